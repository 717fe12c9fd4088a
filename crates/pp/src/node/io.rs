//! The PP node's I/O backend: AF_XDP where it works, the UDP socket otherwise.
//!
//! `--io auto` (the default) tries AF_XDP on the interface that owns `--listen`'s
//! address and falls back to the UDP socket, logging why at warn; `--io afxdp` fails
//! instead of falling back; `--io udp` never tries. See `docs/afxdp.md`.

use std::fmt::Write as _;
use std::net::SocketAddrV4;
use std::time::Duration;

use pipeline::{Desc, IoError, PacketIo};

use super::PpNodeError;
use crate::{
    open_afxdp_workers, AfXdpIo, AfXdpKernelStats, AfXdpNodeConfig, AfXdpNodeError, AfXdpStats,
    UdpVxlanConfig, UdpVxlanIo, UdpVxlanStats, XdpAttached,
};

/// Which backend the node runs on (`--io`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoKind {
    /// AF_XDP where it works, else the UDP socket.
    #[default]
    Auto,
    /// AF_XDP or fail.
    Afxdp,
    /// The UDP socket.
    Udp,
}

/// What the PP node's worker runs on.
// One per process, called per batch: kept inline rather than boxed (no indirection on
// the hot path), so the size difference does not matter.
#[allow(clippy::large_enum_variant)]
pub enum PpIo {
    AfXdp(AfXdpIo),
    Udp(UdpVxlanIo),
}

/// The backend's counters.
#[derive(Debug, Clone, Copy)]
pub enum IoStats {
    /// The backend's counters, and the kernel's of the socket (`None` if unreadable).
    AfXdp(AfXdpStats, Option<AfXdpKernelStats>),
    Udp(UdpVxlanStats),
}

impl PpIo {
    pub fn stats(&self) -> IoStats {
        match self {
            PpIo::AfXdp(io) => IoStats::AfXdp(io.stats(), io.kernel_stats().ok()),
            PpIo::Udp(io) => IoStats::Udp(io.stats()),
        }
    }

    /// Frames the kernel dropped for this port because the worker fell behind (AF_XDP:
    /// no fill-ring frame or RX ring full; UDP: receive buffer full); `None` if
    /// unreadable. What [`super::rt::RtGovernor`] watches.
    pub fn kernel_drops(&self) -> Option<u64> {
        match self {
            PpIo::AfXdp(io) => io
                .kernel_stats()
                .ok()
                .map(|k| k.rx_dropped + k.rx_ring_full),
            PpIo::Udp(io) => io.kernel_drops().ok(),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            PpIo::AfXdp(_) => "afxdp",
            PpIo::Udp(_) => "udp",
        }
    }
}

/// Add `$b`'s fields to `$a`'s, field by field.
macro_rules! add_fields {
    ($a:expr, $b:expr, $($f:ident),+) => {{ $( $a.$f += $b.$f; )+ }};
}

impl IoStats {
    /// The sum of several workers' counters (all on the same backend); `None` for none.
    pub fn sum(all: &[IoStats]) -> Option<IoStats> {
        let mut it = all.iter().copied();
        let mut acc = it.next()?;
        for s in it {
            acc.add(&s);
        }
        Some(acc)
    }

    fn add(&mut self, o: &IoStats) {
        match (self, o) {
            (IoStats::Udp(a), IoStats::Udp(b)) => add_udp(a, b),
            (IoStats::AfXdp(a, ak), IoStats::AfXdp(b, bk)) => {
                add_afxdp(a, b);
                match (ak.as_mut(), bk) {
                    (Some(a), Some(b)) => add_fields!(
                        a,
                        b,
                        rx_dropped,
                        rx_ring_full,
                        rx_fill_ring_empty,
                        rx_invalid_descs,
                        tx_invalid_descs
                    ),
                    // One socket's counters unreadable: the sum would be short.
                    _ => *ak = None,
                }
            }
            // Every worker of a node runs on the same backend.
            _ => {}
        }
    }

    /// Packets the backend received.
    pub fn rx_packets(&self) -> u64 {
        match self {
            IoStats::Udp(s) => s.rx_packets,
            IoStats::AfXdp(s, _) => s.rx_packets,
        }
    }

    /// The ` io: ...` part of the PP node's stats line. Both backends print `rx=`,
    /// `batches=`, `tx=`, `tx_dropped=` and `tx_errors=`, so scripts read either.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        match self {
            IoStats::Udp(io) => {
                let _ = write!(
                    s,
                    " io: rx={} batches={} oversize={} gro_buffers={} gro_segments={} tx={} tx_dropped={} tx_errors={} tx_unsendable={} tx_syscalls={} gso_sends={} gso_segments={} gso_fallbacks={}",
                    io.rx_packets,
                    io.rx_batches,
                    io.rx_oversize,
                    io.gro_buffers,
                    io.gro_segments,
                    io.tx_packets,
                    io.tx_dropped,
                    io.tx_errors,
                    io.tx_unsendable,
                    io.tx_syscalls,
                    io.gso_sends,
                    io.gso_segments,
                    io.gso_fallbacks
                );
                // Sends the kernel took and its device then dropped: not in `tx_dropped`,
                // which only sees what a send call refused (crate::udp's doc).
                if let Some(n) = crate::udp::netns_udp_sndbuf_errors() {
                    let _ = write!(s, " netns_udp_sndbuf_errors={n}");
                }
            }
            IoStats::AfXdp(io, kernel) => {
                let _ = write!(
                    s,
                    " io: afxdp rx={} batches={} tx={} tx_dropped={} tx_errors={} ring_full={} no_frame={} oversize={} moved={} completed={} kicks={} gso_sends={} gso_segments={} gso_fallbacks={} send_dropped={} tx_syscalls={}",
                    io.rx_packets,
                    io.rx_batches,
                    io.tx_packets,
                    io.tx_ring_full + io.tx_no_frame + io.tx_send_dropped,
                    io.tx_oversize + io.tx_kick_errors,
                    io.tx_ring_full,
                    io.tx_no_frame,
                    io.tx_oversize,
                    io.tx_moved,
                    io.tx_completed,
                    io.tx_kicks,
                    io.tx_gso_sends,
                    io.tx_gso_segments,
                    io.tx_gso_fallbacks,
                    io.tx_send_dropped,
                    io.tx_syscalls
                );
                if let Some(k) = kernel {
                    // Frames the kernel dropped before the socket: no frame on the fill
                    // ring, or the RX ring full (the worker fell behind).
                    let _ = write!(
                        s,
                        " xsk_rx_dropped={} xsk_fill_empty={} xsk_rx_ring_full={} busy_polls={} napi_id={}",
                        k.rx_dropped, k.rx_fill_ring_empty, k.rx_ring_full, io.busy_polls, k.napi_id
                    );
                }
            }
        }
        s
    }
}

/// Add `b`'s AF_XDP counters to `a`'s.
pub fn add_afxdp(a: &mut AfXdpStats, b: &AfXdpStats) {
    add_fields!(
        a,
        b,
        rx_packets,
        rx_bytes,
        rx_batches,
        tx_packets,
        tx_bytes,
        tx_ring_full,
        tx_no_frame,
        tx_oversize,
        tx_moved,
        tx_completed,
        tx_kicks,
        tx_kick_errors,
        busy_polls,
        tx_gso_sends,
        tx_gso_segments,
        tx_gso_fallbacks,
        tx_syscalls,
        tx_send_dropped
    );
}

/// Add `b`'s UDP socket counters to `a`'s.
pub fn add_udp(a: &mut UdpVxlanStats, b: &UdpVxlanStats) {
    add_fields!(
        a,
        b,
        rx_packets,
        rx_bytes,
        rx_batches,
        rx_oversize,
        gro_buffers,
        gro_segments,
        tx_packets,
        tx_bytes,
        tx_dropped,
        tx_errors,
        tx_unsendable,
        gso_sends,
        gso_segments,
        gso_fallbacks,
        tx_syscalls
    );
}

impl PpIo {
    /// Wait on `bell` too when idle (the FM client rings it for this worker's replies).
    pub fn set_doorbell(&mut self, bell: std::sync::Arc<crate::Doorbell>) {
        match self {
            PpIo::AfXdp(io) => io.set_doorbell(bell),
            PpIo::Udp(io) => io.set_doorbell(bell),
        }
    }
}

impl PacketIo for PpIo {
    #[inline]
    fn rx(&mut self, descs: &mut Vec<Desc>, max: usize) -> Result<usize, IoError> {
        match self {
            PpIo::AfXdp(io) => io.rx(descs, max),
            PpIo::Udp(io) => io.rx(descs, max),
        }
    }

    #[inline]
    fn region(&mut self) -> &mut [u8] {
        match self {
            PpIo::AfXdp(io) => io.region(),
            PpIo::Udp(io) => io.region(),
        }
    }

    #[inline]
    fn tx(&mut self, descs: &[Desc]) -> Result<usize, IoError> {
        match self {
            PpIo::AfXdp(io) => io.tx(descs),
            PpIo::Udp(io) => io.tx(descs),
        }
    }

    #[inline]
    fn tx_from(&mut self, region: &[u8], descs: &[Desc]) -> Result<usize, IoError> {
        match self {
            PpIo::AfXdp(io) => io.tx_from(region, descs),
            PpIo::Udp(io) => io.tx_from(region, descs),
        }
    }
}

/// Packets the `pfifo` on the UDP backend's interface holds (as `xdp_node`'s).
const UDP_TX_QDISC_LIMIT: u32 = 1000;

/// How to open the backend.
pub struct IoOptions {
    pub kind: IoKind,
    pub listen: SocketAddrV4,
    pub peer_port: Option<u16>,
    pub batch: usize,
    pub poll_timeout: Duration,
    pub gw_mac: Option<[u8; 6]>,
    pub frames: u32,
    /// Preferred busy polling of the AF_XDP sockets.
    pub busy_poll: Option<crate::BusyPoll>,
    /// How the AF_XDP ports transmit.
    pub afxdp_tx: crate::AfXdpTx,
    /// One port per worker: AF_XDP sockets on queues `0..workers`, or UDP sockets
    /// sharing the address with `SO_REUSEPORT`.
    pub workers: usize,
}

/// The opened backend, one port per worker; `xdp` must live as long as the workers
/// (dropping it detaches the program). `detail` says what was chosen, for the
/// "listening" line.
pub struct OpenedIo {
    pub ios: Vec<PpIo>,
    pub xdp: Option<XdpAttached>,
    /// UDP socket backend: the `pfifo` put on the listen address's `noqueue`
    /// interface (removed on drop); must live as long as the workers.
    pub udp_qdisc: Option<crate::qdisc::FifoQdisc>,
    pub detail: String,
}

pub fn open(o: &IoOptions) -> Result<OpenedIo, PpNodeError> {
    if o.kind != IoKind::Udp {
        let why_not = if o.peer_port.is_some() {
            // AF_XDP sends whole frames to their outer destination port; --peer-port is
            // the socket backend's way of sharing one host.
            Some("--peer-port is a UDP-socket option".to_string())
        } else {
            let mut c = AfXdpNodeConfig::new(*o.listen.ip());
            c.gw_mac = o.gw_mac;
            c.io.batch = o.batch.min(crate::AFXDP_MAX_BATCH);
            c.io.poll_timeout = o.poll_timeout;
            c.io.frames = o.frames;
            c.io.busy_poll = o.busy_poll;
            c.io.tx = o.afxdp_tx;
            c.workers = o.workers as u32;
            if o.listen.port() != packet::VXLAN_PORT {
                Some(format!(
                    "port {} is not VXLAN's {}: the XDP program only redirects UDP {}",
                    o.listen.port(),
                    packet::VXLAN_PORT,
                    packet::VXLAN_PORT
                ))
            } else {
                match open_afxdp_workers(c) {
                    Ok((ios, xdp)) => {
                        let detail = format!(
                            "io afxdp ({} XDP on {}, {} mode, tx {}{}, {}, node mac {}, gateway mac {}{})",
                            xdp.mode,
                            xdp.ifname,
                            ios[0].mode(),
                            ios[0].tx_path(),
                            if xdp.tx_qdisc.is_some() {
                                " (pfifo qdisc)"
                            } else {
                                ""
                            },
                            match (o.busy_poll, xdp.napi_deferral.is_some()) {
                                (Some(b), true) =>
                                    format!("busy poll {} us budget {}", b.usecs, b.budget),
                                (Some(b), false) => format!(
                                    "busy poll {} us budget {} without NAPI deferral",
                                    b.usecs, b.budget
                                ),
                                (None, _) => "NAPI driven".to_string(),
                            },
                            mac_str(&xdp.node.mac),
                            mac_str(&xdp.node.gw_mac),
                            if ios.len() > 1 {
                                format!(", {} queues", ios.len())
                            } else {
                                String::new()
                            },
                        );
                        return Ok(OpenedIo {
                            ios: ios.into_iter().map(PpIo::AfXdp).collect(),
                            xdp: Some(xdp),
                            udp_qdisc: None,
                            detail,
                        });
                    }
                    // Asking for more workers than the interface has queues is a
                    // mistake to fix, not a reason to run on another backend.
                    Err(e @ AfXdpNodeError::TooFewQueues { .. }) => {
                        return Err(PpNodeError::Config(e.to_string()))
                    }
                    Err(e) => Some(e.to_string()),
                }
            }
        };
        let why_not = why_not.unwrap_or_default();
        if o.kind == IoKind::Afxdp {
            return Err(PpNodeError::Io(format!("AF_XDP backend: {why_not}")));
        }
        tracing::warn!(reason = %why_not, "AF_XDP not available; falling back to the UDP socket");
    }
    let mut io_cfg = UdpVxlanConfig::new(o.listen);
    io_cfg.peer_port = o.peer_port;
    io_cfg.slots = o.batch;
    io_cfg.poll_timeout = o.poll_timeout;
    // Several workers share the port; the kernel spreads flows over their sockets by
    // 4-tuple hash (the outer UDP source port carries the inner flow's hash).
    io_cfg.reuse_port = o.workers > 1;
    let mut ios = Vec::with_capacity(o.workers);
    for _ in 0..o.workers.max(1) {
        let io = UdpVxlanIo::bind(io_cfg.clone())
            .map_err(|e| PpNodeError::Io(format!("VXLAN socket: {e}")))?;
        // Asked for port 0: the others join the port the first one got.
        io_cfg.bind = io.local_addr();
        ios.push(PpIo::Udp(io));
    }
    // Its UDP_SEGMENT sends burst up to 64 datagrams into the device at once: as for
    // AF_XDP's GSO transmit, a veth without a qdisc drops what its peer's ring cannot
    // take (crate::qdisc). Only where the listen address names the interface.
    let ip = *o.listen.ip();
    let udp_qdisc = if ip.is_unspecified() || ip.is_loopback() {
        None
    } else {
        crate::netif::interface_of(ip)
            .map_err(|e| e.to_string())
            .and_then(|ifname| {
                crate::qdisc::FifoQdisc::attach_if_noqueue(&ifname, UDP_TX_QDISC_LIMIT)
                    .map_err(|e| format!("{ifname}: {e}"))
            })
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "no pfifo qdisc for the GSO sends; bursts may drop");
                None
            })
    };
    let workers = if o.workers > 1 {
        format!(" ({} SO_REUSEPORT sockets)", o.workers)
    } else {
        String::new()
    };
    let qdisc = if udp_qdisc.is_some() {
        " (pfifo qdisc)"
    } else {
        ""
    };
    Ok(OpenedIo {
        ios,
        xdp: None,
        udp_qdisc,
        detail: format!("io udp{workers}{qdisc}"),
    })
}

pub fn mac_str(m: &[u8; 6]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_counters_sum_over_workers_and_an_unreadable_kernel_count_is_not_half_summed() {
        let x = |rx: u64, k: Option<u64>| {
            IoStats::AfXdp(
                AfXdpStats {
                    rx_packets: rx,
                    tx_kicks: 1,
                    ..Default::default()
                },
                k.map(|d| AfXdpKernelStats {
                    rx_dropped: d,
                    ..Default::default()
                }),
            )
        };
        match IoStats::sum(&[x(3, Some(1)), x(4, Some(2))]) {
            Some(IoStats::AfXdp(s, Some(k))) => {
                assert_eq!((s.rx_packets, s.tx_kicks, k.rx_dropped), (7, 2, 3))
            }
            other => panic!("{other:?}"),
        }
        match IoStats::sum(&[x(3, Some(1)), x(4, None)]) {
            Some(IoStats::AfXdp(s, None)) => assert_eq!(s.rx_packets, 7),
            other => panic!("{other:?}"),
        }
        let u = |rx: u64| {
            IoStats::Udp(UdpVxlanStats {
                rx_packets: rx,
                ..Default::default()
            })
        };
        assert_eq!(IoStats::sum(&[u(1), u(2)]).map(|s| s.rx_packets()), Some(3));
        assert!(IoStats::sum(&[]).is_none());
    }
}
