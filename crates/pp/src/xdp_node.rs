//! Setting a PP node up on AF_XDP: find the interface that owns the node's underlay
//! address, learn its MAC and its gateway's MAC, load the XDP program with that identity,
//! bind an [`AfXdpIo`] to the interface's queue, register it in the program's `xsks`
//! map, and attach the program.
//!
//! The order matters: until the program is attached everything still goes to the kernel,
//! and from the moment it is, VXLAN to the node has a socket to go to.

use std::net::Ipv4Addr;
use std::time::Duration;

use pipeline::NodeAddr;
use thiserror::Error;
use xdp::{AttachMode, Attachment, XdpError, XdpProgram};

use crate::afxdp::{AfXdpConfig, AfXdpError, AfXdpIo, NapiDeferral};
use crate::netif::{self, NetifError};
use crate::qdisc::FifoQdisc;

/// Packets (GSO skbs count one each) the `pfifo` put on a `noqueue` interface holds: the
/// length Linux gives an Ethernet device's transmit queue.
const TX_QDISC_LIMIT: u32 = 1000;

/// What [`open_afxdp`] needs.
#[derive(Debug, Clone)]
pub struct AfXdpNodeConfig {
    /// The node's underlay address: the interface that owns it is the one used.
    pub ip: Ipv4Addr,
    /// The next hop's MAC; resolved from the kernel's route and neighbour tables if
    /// `None`.
    pub gw_mac: Option<[u8; 6]>,
    /// How long to wait for the gateway's neighbour entry.
    pub resolve_wait: Duration,
    /// UMEM frames, batch and poll timeout of each socket (`ifname` and `queue_id` are
    /// filled in).
    pub io: AfXdpConfig,
    /// Sockets to bind, one per receive queue `0..workers` (one per PP worker). The
    /// interface must have exactly this many receive queues: a queue without a socket
    /// would pass its VXLAN to the kernel, which has no listener for it.
    pub workers: u32,
}

impl AfXdpNodeConfig {
    pub fn new(ip: Ipv4Addr) -> Self {
        AfXdpNodeConfig {
            ip,
            gw_mac: None,
            resolve_wait: Duration::from_secs(1),
            io: AfXdpConfig::new(""),
            workers: 1,
        }
    }
}

/// Why AF_XDP cannot run here (the PP node then falls back to its UDP socket).
#[derive(Debug, Error)]
pub enum AfXdpNodeError {
    #[error("{0}")]
    NotApplicable(String),
    #[error(transparent)]
    Netif(#[from] NetifError),
    #[error(
        "{ifname} has {queues} receive queues; the AF_XDP backend binds one socket per \
         queue, one per worker ({workers} workers): run --workers {queues}, or set the \
         interface's queue count (ethtool -L {ifname} combined {workers})"
    )]
    Queues {
        ifname: String,
        queues: u32,
        workers: u32,
    },
    /// More workers than queues: a configuration error, never a fallback.
    #[error(
        "--workers {workers} is more than the {queues} receive queues of {ifname}: each \
         AF_XDP worker needs a queue of its own"
    )]
    TooFewQueues {
        ifname: String,
        queues: u32,
        workers: u32,
    },
    #[error("XDP program: {0}")]
    Xdp(#[from] XdpError),
    #[error(transparent)]
    Socket(#[from] AfXdpError),
}

/// The XDP side of an AF_XDP PP node: keep it alive as long as the socket is used
/// (dropping it detaches the program). `program` is where offloaded rules go.
#[derive(Debug)]
pub struct XdpAttached {
    pub program: XdpProgram,
    pub attachment: Option<Attachment>,
    pub ifname: String,
    pub mode: AttachMode,
    /// The identity `encap` must write: node IP and MAC, gateway MAC.
    pub node: NodeAddr,
    /// The gateway whose MAC was resolved (`None` when given).
    pub gateway: Option<Ipv4Addr>,
    /// The interface's NAPI deferral while the sockets busy-poll (restored on drop);
    /// `None` without busy polling, or if the interface refused it.
    pub napi_deferral: Option<NapiDeferral>,
    /// The `pfifo` root qdisc put on a `noqueue` interface for the packet-socket
    /// transmit (removed on drop); `None` when no port sends through the packet socket
    /// or the interface has a qdisc of its own.
    pub tx_qdisc: Option<FifoQdisc>,
}

impl XdpAttached {
    /// Detach the program now (also done on drop).
    pub fn detach(&mut self) {
        if let Some(a) = self.attachment.take() {
            if let Err(e) = self.program.detach(a) {
                tracing::warn!(error = %e, "detaching the XDP program");
            }
        }
    }
}

impl Drop for XdpAttached {
    fn drop(&mut self) {
        self.detach();
    }
}

/// Set a PP node up on AF_XDP with one socket (see the module docs).
pub fn open_afxdp(cfg: AfXdpNodeConfig) -> Result<(AfXdpIo, XdpAttached), AfXdpNodeError> {
    let cfg = AfXdpNodeConfig { workers: 1, ..cfg };
    let (mut ios, x) = open_afxdp_workers(cfg)?;
    Ok((ios.remove(0), x))
}

/// Set a PP node up on AF_XDP with `cfg.workers` sockets, socket `i` bound to receive
/// queue `i` and registered at index `i` of `xsks` (the program redirects by
/// `rx_queue_index`).
pub fn open_afxdp_workers(
    cfg: AfXdpNodeConfig,
) -> Result<(Vec<AfXdpIo>, XdpAttached), AfXdpNodeError> {
    if cfg.workers == 0 {
        return Err(AfXdpNodeError::NotApplicable("0 workers".into()));
    }
    if cfg.ip.is_unspecified() || cfg.ip.is_loopback() {
        return Err(AfXdpNodeError::NotApplicable(format!(
            "listen address {} is not one interface's address",
            cfg.ip
        )));
    }
    let ifname = netif::interface_of(cfg.ip)?;
    let queues = netif::rx_queues(&ifname)?;
    let workers = cfg.workers;
    if queues < workers {
        return Err(AfXdpNodeError::TooFewQueues {
            ifname,
            queues,
            workers,
        });
    }
    if queues != workers {
        return Err(AfXdpNodeError::Queues {
            ifname,
            queues,
            workers,
        });
    }
    if workers > xdp::abi::MAX_XSK_QUEUES {
        return Err(AfXdpNodeError::NotApplicable(format!(
            "{workers} workers: the XDP program's xsks map holds {}",
            xdp::abi::MAX_XSK_QUEUES
        )));
    }
    let mac = netif::mac_of(&ifname)?;
    let (gateway, gw_mac) = match cfg.gw_mac {
        Some(m) => (None, m),
        None => {
            let (gw, m) = netif::gateway_mac(&ifname, cfg.resolve_wait)?;
            (Some(gw), m)
        }
    };
    let node = NodeAddr {
        ip: cfg.ip,
        mac,
        gw_mac,
    };
    // Preferred busy polling needs the device to defer its interrupt to a timer after a
    // busy poll, or the kernel's own NAPI run takes the frames back (docs/afxdp.md).
    let napi_deferral = match cfg.io.busy_poll {
        Some(_) => match NapiDeferral::apply(&ifname, NAPI_DEFER_HARD_IRQS, GRO_FLUSH_TIMEOUT_NS) {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::warn!(%ifname, error = %e, "cannot set the NAPI deferral for busy polling");
                None
            }
        },
        None => None,
    };
    let mut program = XdpProgram::load()?;
    program.set_node(&node)?;
    let mut ios = Vec::with_capacity(workers as usize);
    for q in 0..workers {
        let mut io_cfg = cfg.io.clone();
        io_cfg.ifname = ifname.clone();
        io_cfg.queue_id = q;
        let io = AfXdpIo::bind(io_cfg)?;
        program.register_xsk(q, &io)?;
        ios.push(io);
    }
    // GSO sends burst up to 64 datagrams into the device at once; without a qdisc, a
    // veth drops what its peer's ring cannot take (crate::qdisc).
    let tx_qdisc = if ios.iter().any(|io| io.tx_path() == "gso") {
        match FifoQdisc::attach_if_noqueue(&ifname, TX_QDISC_LIMIT) {
            Ok(q) => q,
            Err(e) => {
                tracing::warn!(%ifname, error = %e, "no pfifo qdisc for the GSO transmit; bursts may drop");
                None
            }
        }
    } else {
        None
    };
    let attachment = program.attach(&ifname)?;
    let mode = attachment.mode;
    Ok((
        ios,
        XdpAttached {
            program,
            attachment: Some(attachment),
            ifname,
            mode,
            node,
            gateway,
            napi_deferral,
            tx_qdisc,
        },
    ))
}

/// `napi_defer_hard_irqs` while busy polling: how many empty NAPI polls in a row keep
/// the interrupt deferred (the kernel's documented example value).
pub const NAPI_DEFER_HARD_IRQS: u32 = 2;
/// `gro_flush_timeout` while busy polling, ns: if the PP worker stops busy polling for
/// this long (idle, or descheduled), the kernel's NAPI takes over again.
pub const GRO_FLUSH_TIMEOUT_NS: u64 = 200_000;
