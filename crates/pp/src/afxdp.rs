//! [`AfXdpIo`]: a [`PacketIo`] backend over an AF_XDP socket (xsk-rs), the PP node's
//! default I/O wherever it works.
//!
//! The UMEM *is* the backend region of the pipeline's descriptor model: `frames` slots of
//! [`FRAME_SIZE`] bytes, slot `i` at `i * FRAME_SIZE`. The kernel writes a received frame
//! at `XDP_PACKET_HEADROOM` (256) into its slot, so every RX descriptor has 256 bytes of
//! headroom in front of the data (more than the pipeline's [`HEADROOM`]) for encap.
//!
//! Frames move between four owners, and [`AfXdpIo`] keeps the count of each exact (a
//! debug assertion after every call, [`AfXdpIo::frame_census`] for tests):
//! - **free**: userspace's free list (for `tx_from` copies, and to refill the fill ring);
//! - **fill**: on the fill ring or the RX ring, i.e. the kernel's, until `rx` takes them;
//! - **user**: handed to the pipeline by the last `rx`, until `tx`;
//! - **tx**: on the TX ring, the kernel's, until the completion ring returns them.
//!
//! `tx` puts `Tx`-verdict frames on the TX ring as they are (no copy) and the batch's
//! other frames back on the free list, then tops the fill ring up. An AF_XDP TX
//! descriptor's address is the frame's data start as RX delivered it (xsk-rs hands out
//! descriptors only from the RX and completion rings), so a frame whose data start the
//! pipeline moved (encap of bare traffic, decap without re-encap) is first moved back
//! within its slot; decap + re-encap, the usual VXLAN-to-VXLAN rule, keeps the start.
//!
//! Copy mode (veth and most drivers without AF_XDP zero-copy) transmits in `sendto`, at
//! most 32 descriptors per call, so the TX ring is kicked whenever frames are
//! outstanding, not only when the need-wakeup flag asks for it, and again on every `rx`.
//! Ring full and no free frame are counted drops, never a panic or a leaked frame.
//!
//! In copy mode that is one skb per frame, with no segmentation offload, so by default
//! ([`AfXdpTx::Auto`]) a copy-mode port sends runs of one outer flow (a TCP flow's
//! segments, after its rule) through a packet socket instead, one UDP GSO skb per run
//! ([`crate::gso_tx`]); scattered frames still use the ring. See `docs/afxdp.md`,
//! "Transmit".
//!
//! The socket only receives what an XDP program on the interface redirects to it: the
//! PP node attaches `xdp::XdpProgram` and registers this socket's fd in its `xsks` map
//! ([`AfXdpIo::as_raw_fd`]). Binding uses `XSK_LIBXDP_FLAGS_INHIBIT_PROG_LOAD`, so
//! libxdp never loads a program of its own.

use std::collections::VecDeque;
use std::io::Write as _;
use std::num::NonZeroU32;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use pipeline::{Desc, IoError, PacketIo, Verdict, FRAME_SIZE, HEADROOM};
use thiserror::Error;
use xsk_rs::config::{
    BindFlags, FrameSize, Interface, LibxdpFlags, QueueSize, SocketConfig, UmemConfig,
};
use xsk_rs::{CompQueue, FillQueue, FrameDesc, RxQueue, TxQueue, Umem};

use crate::doorbell::{self, Doorbell};
use crate::gso_tx::{self, PacketGsoTx};

/// Largest RX batch, and the most descriptors moved per ring operation.
pub const AFXDP_MAX_BATCH: usize = 256;

/// The kernel's headroom in front of received data (`XDP_PACKET_HEADROOM`).
pub const XDP_HEADROOM: usize = 256;

/// The shortest run of one outer flow that goes through the packet socket as one GSO
/// message ([`AfXdpTx::Gso`]); shorter ones go through the TX ring. Two 64-byte frames
/// in one packet-socket message cost more than two on the ring (measured: the per-core
/// 64 B rate fell 23% with runs of two on the socket; docs/afxdp.md, "Transmit").
const GSO_MIN_RUN: usize = 4;

/// How many descriptors copy-mode `sendto` transmits per call (the kernel's
/// `TX_BATCH_SIZE`); how many kicks a TX batch needs.
const COPY_MODE_TX_PER_KICK: usize = 32;

/// Preferred busy polling of the socket's NAPI context (`SO_PREFER_BUSY_POLL`): the
/// PP worker, not the kernel's NAPI thread or softirq, decides when received frames
/// are processed, and takes at most `budget` per syscall. Under overload the excess
/// then stays in the device's receive ring and is refused there, where it costs the
/// PP's CPU nothing, instead of being run through XDP and dropped at an empty fill
/// ring after the kernel paid for it (receive livelock). Needs a socket with a NAPI id
/// ([`AfXdpKernelStats::napi_id`]), which Linux 6.13+ gives zero-copy sockets only; on
/// a veth it does nothing. See `docs/afxdp.md`, "Overload".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BusyPoll {
    /// `SO_BUSY_POLL`: how long (µs) one busy-polling syscall spins for frames.
    pub usecs: u32,
    /// `SO_BUSY_POLL_BUDGET`: frames per NAPI poll of a busy-polling syscall.
    pub budget: u16,
}

impl Default for BusyPoll {
    fn default() -> Self {
        BusyPoll {
            usecs: 20,
            budget: 64,
        }
    }
}

/// Configuration of an [`AfXdpIo`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AfXdpConfig {
    /// Interface to bind.
    pub ifname: String,
    /// Receive queue to bind (the XDP program redirects by `rx_queue_index`).
    pub queue_id: u32,
    /// UMEM frames (a power of two ≥ 64). Half are kept on the fill ring.
    pub frames: u32,
    /// Largest RX batch (1..=[`AFXDP_MAX_BATCH`]).
    pub batch: usize,
    /// How long `rx` waits for a frame when none is queued.
    pub poll_timeout: Duration,
    /// Try zero-copy first (falls back to copy mode when the driver refuses).
    pub zero_copy: bool,
    /// Preferred busy polling; `None` leaves the socket interrupt (NAPI) driven.
    pub busy_poll: Option<BusyPoll>,
    /// How frames are transmitted.
    pub tx: AfXdpTx,
}

/// How an [`AfXdpIo`] transmits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AfXdpTx {
    /// [`AfXdpTx::Gso`] in copy mode (where the packet socket opens), the TX ring in
    /// zero-copy mode (no skb per frame there to save).
    #[default]
    Auto,
    /// The socket's TX ring only: one skb per frame in copy mode.
    Ring,
    /// A packet socket for runs of `GSO_MIN_RUN` or more frames of one outer flow,
    /// one UDP GSO message each ([`crate::gso_tx`]), the TX ring for every other frame;
    /// an error if the packet socket cannot open.
    Gso,
}

impl AfXdpConfig {
    pub fn new(ifname: &str) -> Self {
        AfXdpConfig {
            ifname: ifname.to_string(),
            queue_id: 0,
            frames: 4096,
            batch: 64,
            poll_timeout: Duration::from_millis(20),
            zero_copy: true,
            busy_poll: None,
            tx: AfXdpTx::Auto,
        }
    }
}

/// Counters of an [`AfXdpIo`]. Every `Tx` descriptor handed to the backend ends in exactly
/// one of `tx_packets`, `tx_ring_full`, `tx_no_frame`, `tx_oversize`, `tx_send_dropped`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AfXdpStats {
    /// Frames delivered to the pipeline.
    pub rx_packets: u64,
    /// Their bytes (whole Ethernet frames).
    pub rx_bytes: u64,
    /// `rx` calls that returned at least one frame.
    pub rx_batches: u64,
    /// Put on the TX ring.
    pub tx_packets: u64,
    /// Their bytes.
    pub tx_bytes: u64,
    /// Dropped: the TX ring had no room.
    pub tx_ring_full: u64,
    /// Dropped (`tx_from`): no free UMEM frame to copy into.
    pub tx_no_frame: u64,
    /// Dropped: larger than a frame slot holds from the TX offset on.
    pub tx_oversize: u64,
    /// Frames whose data start the pipeline moved, moved back in their slot before TX.
    pub tx_moved: u64,
    /// Frames the completion ring returned (sent by the kernel).
    pub tx_completed: u64,
    /// `sendto` kicks of the TX ring.
    pub tx_kicks: u64,
    /// Kicks that failed with an unexpected error (the frames stay on the ring).
    pub tx_kick_errors: u64,
    /// Busy-polling `recvfrom` calls (`rx` found the RX ring empty and asked the
    /// kernel to run the NAPI poll in this thread).
    pub busy_polls: u64,
    /// Packet-socket transmit ([`AfXdpTx::Gso`]): messages of more than one frame (one
    /// GSO skb each), the frames in them, GSO messages refused and re-sent frame by
    /// frame, `sendmmsg`/`sendmsg` calls, and frames the kernel refused (dropped).
    pub tx_gso_sends: u64,
    pub tx_gso_segments: u64,
    pub tx_gso_fallbacks: u64,
    pub tx_syscalls: u64,
    pub tx_send_dropped: u64,
}

/// The kernel's counters of the socket (`XDP_STATISTICS`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AfXdpKernelStats {
    /// Received frames dropped (no frame on the fill ring, or RX ring full).
    pub rx_dropped: u64,
    pub rx_ring_full: u64,
    pub rx_fill_ring_empty: u64,
    pub rx_invalid_descs: u64,
    pub tx_invalid_descs: u64,
    /// The NAPI context the kernel recorded for the socket (`SO_INCOMING_NAPI_ID`): since
    /// Linux 6.13 set at bind, for zero-copy sockets only, from the queue's NAPI (before,
    /// from the first frame received). 0 means none: busy polling has nothing to drive,
    /// as on a veth (copy mode).
    pub napi_id: u32,
}

/// How the socket is bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XskMode {
    ZeroCopy,
    Copy,
}

impl std::fmt::Display for XskMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            XskMode::ZeroCopy => "zero-copy",
            XskMode::Copy => "copy",
        })
    }
}

/// Why an [`AfXdpIo`] could not be set up.
#[derive(Debug, Error)]
pub enum AfXdpError {
    #[error("bad configuration: {0}")]
    Config(String),
    #[error("cannot create the UMEM: {0}")]
    Umem(String),
    #[error("cannot bind an AF_XDP socket to {ifname} queue {queue}: {reason}")]
    Bind {
        ifname: String,
        queue: u32,
        reason: String,
    },
}

/// Who holds a frame (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    Free,
    Fill,
    User,
    Tx,
}

/// How many frames each owner holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FrameCensus {
    pub free: usize,
    pub fill: usize,
    pub user: usize,
    pub tx: usize,
}

impl FrameCensus {
    pub fn total(&self) -> usize {
        self.free + self.fill + self.user + self.tx
    }
}

/// A PP port over an AF_XDP socket; see the module docs.
pub struct AfXdpIo {
    cfg: AfXdpConfig,
    mode: XskMode,
    // Field order is drop order: the rings go before the UMEM handle (each ring holds
    // its own handle on the socket and the UMEM anyway).
    tx_q: TxQueue,
    rx_q: RxQueue,
    fill_q: FillQueue,
    comp_q: CompQueue,
    umem: Umem,
    /// Start and length of the UMEM mapping (the region).
    base: *mut u8,
    len: usize,
    /// Frames on the free list.
    free: VecDeque<FrameDesc>,
    /// The descriptor of each frame the pipeline holds, by slot.
    user: Vec<Option<FrameDesc>>,
    owner: Vec<Owner>,
    census: FrameCensus,
    /// Keep this many frames on the fill ring.
    fill_target: usize,
    /// Scratch descriptor arrays (no allocation per batch).
    scratch: Vec<FrameDesc>,
    tx_batch: Vec<FrameDesc>,
    stats: AfXdpStats,
    /// Busy polling is on (the socket options took).
    busy_poll: bool,
    /// The packet socket that transmits instead of the TX ring ([`AfXdpTx`]).
    gso: Option<PacketGsoTx>,
    /// Scratch of `tx_runs`: the `(start, len)` of each `Tx` frame of the batch and its
    /// index in the batch, their runs, and the current phase's runs and ring frames
    /// (indices into `gso_frames`).
    gso_frames: Vec<(usize, usize)>,
    gso_desc: Vec<usize>,
    gso_runs: Vec<gso_tx::Run>,
    phase_runs: Vec<gso_tx::Run>,
    phase_ring: Vec<usize>,
    /// Entries of the TX ring.
    tx_ring_size: u32,
    /// Rung when FM's replies for this worker arrive: an idle wait ends for them too.
    doorbell: Option<Arc<Doorbell>>,
}

// SAFETY: `base` points into the UMEM mapping that `umem` keeps alive; nothing else
// refers to it from another thread, and xsk-rs's queues are `Send`. Moving the backend
// to another thread moves the only user of the pointer with it.
unsafe impl Send for AfXdpIo {}

fn queue_size(n: u32) -> Result<QueueSize, AfXdpError> {
    QueueSize::new(n).map_err(|e| AfXdpError::Config(format!("ring size {n}: {e}")))
}

type Rings = (TxQueue, RxQueue, FillQueue, CompQueue);

/// Entries of the RX and TX rings for a UMEM of `frames`.
fn ring_size(frames: u32) -> u32 {
    (frames / 2).max(64)
}

fn make_umem(frames: u32) -> Result<(Umem, Vec<FrameDesc>), AfXdpError> {
    let cfg = UmemConfig::builder()
        .frame_size(
            FrameSize::new(FRAME_SIZE as u32).map_err(|e| AfXdpError::Config(e.to_string()))?,
        )
        .fill_queue_size(queue_size(frames)?)
        .comp_queue_size(queue_size(frames)?)
        // The kernel's XDP_PACKET_HEADROOM alone is our headroom: data at 256.
        .frame_headroom(0)
        .build()
        .map_err(|e| AfXdpError::Config(e.to_string()))?;
    let n = NonZeroU32::new(frames).ok_or_else(|| AfXdpError::Config("0 frames".into()))?;
    Umem::new(cfg, n, false).map_err(|e| AfXdpError::Umem(e.to_string()))
}

fn bind(cfg: &AfXdpConfig, umem: &Umem, flags: BindFlags) -> Result<Rings, AfXdpError> {
    let bind_err = |reason: String| AfXdpError::Bind {
        ifname: cfg.ifname.clone(),
        queue: cfg.queue_id,
        reason,
    };
    let ring = ring_size(cfg.frames);
    let scfg = SocketConfig::builder()
        .rx_queue_size(queue_size(ring)?)
        .tx_queue_size(queue_size(ring)?)
        // The PP node attaches its own XDP program and fills `xsks` itself.
        .libxdp_flags(LibxdpFlags::XSK_LIBXDP_FLAGS_INHIBIT_PROG_LOAD)
        .bind_flags(flags | BindFlags::XDP_USE_NEED_WAKEUP)
        .build();
    let ifname: Interface = cfg
        .ifname
        .parse()
        .map_err(|_| AfXdpError::Config(format!("interface name {:?}", cfg.ifname)))?;
    // SAFETY: the UMEM is new and used by this one socket only, so the (interface,
    // queue) pair is not already bound from it and INHIBIT_PROG_LOAD is not required
    // for soundness (we set it anyway: the program is ours).
    let (tx_q, rx_q, fq_cq) = unsafe { xsk_rs::Socket::new(scfg, umem, &ifname, cfg.queue_id) }
        .map_err(|e| {
            let src = std::error::Error::source(&e)
                .map(|s| format!(": {s}"))
                .unwrap_or_default();
            bind_err(format!("{e}{src}"))
        })?;
    let (fill_q, comp_q) =
        fq_cq.ok_or_else(|| bind_err("no fill/completion ring for a new UMEM".into()))?;
    Ok((tx_q, rx_q, fill_q, comp_q))
}

impl AfXdpIo {
    /// Create the UMEM and bind a socket to `cfg.ifname` queue `cfg.queue_id`, zero-copy
    /// if asked and the driver supports it, else in copy mode. Needs CAP_NET_RAW and
    /// CAP_NET_ADMIN (root).
    pub fn bind(cfg: AfXdpConfig) -> Result<Self, AfXdpError> {
        if cfg.batch == 0 || cfg.batch > AFXDP_MAX_BATCH {
            return Err(AfXdpError::Config(format!(
                "batch {} not in 1..={AFXDP_MAX_BATCH}",
                cfg.batch
            )));
        }
        if cfg.frames < 64 || !cfg.frames.is_power_of_two() {
            return Err(AfXdpError::Config(format!(
                "frames {} is not a power of two ≥ 64",
                cfg.frames
            )));
        }
        let mut attempt = None;
        if cfg.zero_copy {
            let (umem, descs) = make_umem(cfg.frames)?;
            match bind(&cfg, &umem, BindFlags::XDP_ZEROCOPY) {
                Ok(rings) => attempt = Some((umem, descs, rings, XskMode::ZeroCopy)),
                // veth and many drivers: EOPNOTSUPP. A fresh UMEM for the copy-mode bind,
                // so nothing of the failed one (its saved rings) is reused.
                Err(e) => tracing::debug!(error = %e, "zero-copy bind refused; copy mode"),
            }
        }
        let (umem, descs, (tx_q, rx_q, fill_q, comp_q), mode) = match attempt {
            Some(a) => a,
            None => {
                let (umem, descs) = make_umem(cfg.frames)?;
                let rings = bind(&cfg, &umem, BindFlags::XDP_COPY)?;
                (umem, descs, rings, XskMode::Copy)
            }
        };
        let frames = cfg.frames as usize;
        debug_assert_eq!(descs.len(), frames);
        let len = frames * FRAME_SIZE;
        // Derive the mapping's start from frame 0's data pointer: xsk-rs lays the UMEM out
        // as one anonymous mapping of `frames * FRAME_SIZE` bytes, frame i at
        // i * FRAME_SIZE, its data segment at `desc.addr()` from the mapping's start.
        // SAFETY: descs[0] is a descriptor of this UMEM, handed out by Umem::new and not
        // submitted to any ring, so reading its (empty) data segment races with nothing.
        let d0 = unsafe { umem.data(&descs[0]) }.contents().as_ptr();
        let base = d0.wrapping_sub(descs[0].addr()) as *mut u8;
        // Check the layout assumption on the last frame before relying on it.
        let last = &descs[frames - 1];
        // SAFETY: as above, for the last frame.
        let dl = unsafe { umem.data(last) }.contents().as_ptr();
        if !std::ptr::eq(dl, base.wrapping_add(last.addr()))
            || descs[0].addr() != XDP_HEADROOM
            || last.addr() != (frames - 1) * FRAME_SIZE + XDP_HEADROOM
        {
            return Err(AfXdpError::Umem(
                "UMEM layout is not frames of FRAME_SIZE with data at 256".into(),
            ));
        }
        let fill_target = frames / 2;
        let mut io = AfXdpIo {
            mode,
            tx_q,
            rx_q,
            fill_q,
            comp_q,
            umem,
            base,
            len,
            free: descs.into_iter().collect(),
            user: vec![None; frames],
            owner: vec![Owner::Free; frames],
            census: FrameCensus {
                free: frames,
                ..Default::default()
            },
            fill_target,
            scratch: vec![FrameDesc::default(); AFXDP_MAX_BATCH.max(COPY_MODE_TX_PER_KICK)],
            tx_batch: Vec::with_capacity(AFXDP_MAX_BATCH),
            stats: AfXdpStats::default(),
            busy_poll: false,
            gso: None,
            gso_frames: Vec::with_capacity(AFXDP_MAX_BATCH),
            gso_desc: Vec::with_capacity(AFXDP_MAX_BATCH),
            gso_runs: Vec::with_capacity(AFXDP_MAX_BATCH),
            phase_runs: Vec::with_capacity(AFXDP_MAX_BATCH),
            phase_ring: Vec::with_capacity(AFXDP_MAX_BATCH),
            tx_ring_size: ring_size(cfg.frames),
            doorbell: None,
            cfg,
        };
        let want_gso = match io.cfg.tx {
            AfXdpTx::Ring => false,
            AfXdpTx::Gso => true,
            AfXdpTx::Auto => mode == XskMode::Copy,
        };
        if want_gso {
            let opened = crate::netif::ifindex(&io.cfg.ifname).and_then(PacketGsoTx::open);
            match (opened, io.cfg.tx) {
                (Ok(g), _) => io.gso = Some(g),
                (Err(e), AfXdpTx::Gso) => {
                    return Err(AfXdpError::Bind {
                        ifname: io.cfg.ifname.clone(),
                        queue: io.cfg.queue_id,
                        reason: format!("packet socket for GSO transmit: {e}"),
                    })
                }
                (Err(e), _) => {
                    tracing::warn!(error = %e, "no packet socket for GSO transmit; the TX ring sends")
                }
            }
        }
        if let Some(bp) = io.cfg.busy_poll {
            set_busy_poll(io.as_raw_fd(), bp).map_err(|e| AfXdpError::Bind {
                ifname: io.cfg.ifname.clone(),
                queue: io.cfg.queue_id,
                reason: format!("busy-poll socket options: {e}"),
            })?;
            io.busy_poll = true;
        }
        io.top_up_fill();
        tracing::info!(
            ifname = %io.cfg.ifname,
            queue = io.cfg.queue_id,
            %mode,
            frames,
            busy_poll = ?io.cfg.busy_poll,
            tx = io.tx_path(),
            "AF_XDP socket bound"
        );
        Ok(io)
    }

    pub fn mode(&self) -> XskMode {
        self.mode
    }

    /// How this port transmits: `gso` (packet socket) or `ring`.
    pub fn tx_path(&self) -> &'static str {
        if self.gso.is_some() {
            "gso"
        } else {
            "ring"
        }
    }

    pub fn config(&self) -> &AfXdpConfig {
        &self.cfg
    }

    pub fn stats(&self) -> AfXdpStats {
        self.stats
    }

    /// The kernel's counters of the socket (one `getsockopt`).
    pub fn kernel_stats(&self) -> std::io::Result<AfXdpKernelStats> {
        let s = self.rx_q.fd().xdp_statistics()?;
        let mut napi_id: libc::c_uint = 0;
        let mut len = std::mem::size_of::<libc::c_uint>() as libc::socklen_t;
        // SAFETY: a valid socket fd, and an out-buffer of the option's size that lives
        // for the call.
        let r = unsafe {
            libc::getsockopt(
                self.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_INCOMING_NAPI_ID,
                (&mut napi_id as *mut libc::c_uint).cast(),
                &mut len,
            )
        };
        if r != 0 {
            napi_id = 0;
        }
        Ok(AfXdpKernelStats {
            napi_id,
            rx_dropped: s.rx_dropped(),
            rx_ring_full: s.rx_ring_full(),
            rx_fill_ring_empty: s.rx_fill_ring_empty_descs(),
            rx_invalid_descs: s.rx_invalid_descs(),
            tx_invalid_descs: s.tx_invalid_descs(),
        })
    }

    /// How many frames each owner holds; the total is always the UMEM's frame count.
    pub fn frame_census(&self) -> FrameCensus {
        self.census
    }

    /// Check the frame accounting from scratch (O(frames), for tests and debugging): every
    /// frame has exactly one owner, the census counts them, the free list holds exactly
    /// the free frames (each once) and the pipeline's slots exactly the user frames.
    pub fn verify_frames(&self) -> Result<FrameCensus, String> {
        let mut c = FrameCensus::default();
        for (slot, o) in self.owner.iter().enumerate() {
            match o {
                Owner::Free => c.free += 1,
                Owner::Fill => c.fill += 1,
                Owner::User => c.user += 1,
                Owner::Tx => c.tx += 1,
            }
            if (*o == Owner::User) != self.user[slot].is_some() {
                return Err(format!(
                    "slot {slot}: owner {o:?}, descriptor held: {}",
                    self.user[slot].is_some()
                ));
            }
        }
        if c != self.census {
            return Err(format!("owners {c:?}, census {:?}", self.census));
        }
        let mut seen = vec![false; self.owner.len()];
        for d in &self.free {
            let slot = self.slot_of(d.addr());
            if self.owner[slot] != Owner::Free || std::mem::replace(&mut seen[slot], true) {
                return Err(format!(
                    "free list: slot {slot} ({:?}, or twice)",
                    self.owner[slot]
                ));
            }
        }
        if self.free.len() != c.free || c.total() != self.cfg.frames as usize {
            return Err(format!("free list {} for census {c:?}", self.free.len()));
        }
        Ok(c)
    }

    #[inline]
    fn slot_of(&self, addr: usize) -> usize {
        addr / FRAME_SIZE
    }

    #[inline]
    fn give(&mut self, slot: usize, from: Owner, to: Owner) {
        debug_assert_eq!(self.owner[slot], from, "frame {slot} owner");
        self.owner[slot] = to;
        for (o, d) in [(from, usize::MAX), (to, 1)] {
            let c = match o {
                Owner::Free => &mut self.census.free,
                Owner::Fill => &mut self.census.fill,
                Owner::User => &mut self.census.user,
                Owner::Tx => &mut self.census.tx,
            };
            *c = c.wrapping_add(d);
        }
    }

    fn check_census(&self) {
        debug_assert_eq!(
            self.census.total(),
            self.cfg.frames as usize,
            "frames conserved: {:?}",
            self.census
        );
        debug_assert_eq!(self.census.free, self.free.len());
    }

    /// Move free frames to the fill ring until it holds `fill_target`.
    fn top_up_fill(&mut self) {
        let want = self.fill_target.saturating_sub(self.census.fill);
        let n = want.min(self.free.len()).min(self.scratch.len());
        if n == 0 {
            return;
        }
        for i in 0..n {
            self.scratch[i] = self.free.pop_front().expect("counted above");
        }
        // SAFETY: these frames were on the free list: neither the kernel (fill, RX, TX,
        // completion rings) nor the pipeline holds them.
        let done = unsafe { self.fill_q.produce(&self.scratch[..n]) };
        // `produce` is all or nothing; a full fill ring (cannot happen: it holds all
        // frames) leaves them free.
        for i in 0..n {
            let d = self.scratch[i];
            let slot = self.slot_of(d.addr());
            if i < done {
                self.census.free -= 1;
                self.census.fill += 1;
                debug_assert_eq!(self.owner[slot], Owner::Free);
                self.owner[slot] = Owner::Fill;
            } else {
                self.free.push_back(d);
            }
        }
    }

    /// Take what the completion ring returned onto the free list.
    fn reap_completions(&mut self) -> usize {
        let mut total = 0;
        loop {
            let cap = self.scratch.len();
            // SAFETY: the completion ring returns frames we put on the TX ring; they are
            // ours again once consumed.
            let n = unsafe { self.comp_q.consume(&mut self.scratch[..cap]) };
            for i in 0..n {
                let d = self.scratch[i];
                let slot = self.slot_of(d.addr());
                if slot >= self.owner.len() || self.owner[slot] != Owner::Tx {
                    // Not a frame we sent: a kernel bug, not something to count per packet.
                    tracing::error!(addr = d.addr(), "completion of a frame not on the TX ring");
                    continue;
                }
                self.give(slot, Owner::Tx, Owner::Free);
                self.free.push_back(d);
            }
            total += n;
            if n < cap {
                break;
            }
        }
        self.stats.tx_completed += total as u64;
        total
    }

    /// Kick the TX ring while frames are outstanding and kicks make progress. Copy mode
    /// sends at most 32 per `sendto`; zero-copy drivers send from their NAPI loop and
    /// only need a kick when the need-wakeup flag says so.
    fn kick_tx(&mut self) {
        self.reap_completions();
        let mut budget = self.census.tx / COPY_MODE_TX_PER_KICK + 2;
        while self.census.tx > 0 && budget > 0 {
            budget -= 1;
            if self.mode == XskMode::ZeroCopy && !self.tx_q.needs_wakeup() {
                break;
            }
            self.stats.tx_kicks += 1;
            if let Err(e) = self.tx_q.wakeup() {
                self.stats.tx_kick_errors += 1;
                tracing::debug!(error = %e, "AF_XDP TX kick failed");
                break;
            }
            if self.reap_completions() == 0 {
                // The device pushed back (or completes asynchronously): try again on the
                // next call instead of spinning.
                break;
            }
        }
        self.top_up_fill();
    }

    /// Put `tx_batch` on the TX ring; whatever does not fit is counted and freed.
    fn submit_tx(&mut self) {
        if self.tx_batch.is_empty() {
            return;
        }
        // SAFETY: every frame in `tx_batch` is ours (taken from the pipeline's batch or
        // the free list), written completely, and not on any other ring.
        let done = unsafe { self.tx_q.produce(&self.tx_batch) };
        // `produce` is all-or-nothing when the ring lacks room; retry after reaping
        // completions, then fall back to as many as fit.
        let done = if done == 0 {
            self.reap_completions();
            let room = self.tx_q.nb_free(self.tx_batch.len() as u32) as usize;
            let k = room.min(self.tx_batch.len());
            // SAFETY: as above.
            if k > 0 {
                unsafe { self.tx_q.produce(&self.tx_batch[..k]) }
            } else {
                0
            }
        } else {
            done
        };
        let batch = std::mem::take(&mut self.tx_batch);
        for (i, d) in batch.iter().enumerate() {
            let slot = self.slot_of(d.addr());
            let from = self.owner[slot];
            if i < done {
                self.stats.tx_packets += 1;
                self.stats.tx_bytes += d.lengths().data() as u64;
                self.give(slot, from, Owner::Tx);
            } else {
                self.stats.tx_ring_full += 1;
                self.give(slot, from, Owner::Free);
                self.free.push_back(*d);
            }
        }
        self.tx_batch = batch;
        self.tx_batch.clear();
        self.kick_tx();
    }

    fn wait_readable(&self, timeout: Duration) -> Result<bool, IoError> {
        // A ring (FM's replies) or a signal ends the wait with no packets, and the
        // worker's loop services the replies or looks at its stop flag.
        doorbell::wait(Some(self.as_raw_fd()), self.doorbell.as_deref(), timeout)
            .map(|(readable, _)| readable)
            .map_err(IoError::Os)
    }

    /// Wait on `bell` too whenever the socket has nothing: the FM client rings it when
    /// replies for this worker arrive.
    pub fn set_doorbell(&mut self, bell: Arc<Doorbell>) {
        self.doorbell = Some(bell);
    }

    /// One busy-polling `recvfrom` (`xsk_recvmsg` runs `sk_busy_loop`, the NAPI poll of
    /// the socket's queue, when `SO_BUSY_POLL` is set). A socket without a NAPI context
    /// yet returns at once.
    fn busy_poll_once(&mut self) {
        self.stats.busy_polls += 1;
        // SAFETY: a valid socket fd; no buffer (length 0): AF_XDP delivers through the
        // RX ring, the call only drives the poll.
        let r = unsafe {
            libc::recvfrom(
                self.as_raw_fd(),
                std::ptr::null_mut(),
                0,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if !matches!(
                e.raw_os_error(),
                Some(libc::EAGAIN) | Some(libc::EINTR) | Some(libc::EBUSY)
            ) {
                tracing::trace!(error = %e, "AF_XDP busy-poll recvfrom");
            }
        }
    }

    fn recv_batch(&mut self, descs: &mut Vec<Desc>, want: usize) -> usize {
        // SAFETY: the RX ring hands back frames of this UMEM that the kernel has
        // finished writing; they are ours until we give them back.
        let n = unsafe { self.rx_q.consume(&mut self.scratch[..want]) };
        for i in 0..n {
            let fd = self.scratch[i];
            let addr = fd.addr();
            let slot = self.slot_of(addr);
            let base = slot * FRAME_SIZE;
            let len = fd.lengths().data();
            if slot >= self.owner.len() || addr + len > base + FRAME_SIZE {
                tracing::error!(addr, len, "RX descriptor outside the UMEM");
                continue;
            }
            self.give(slot, Owner::Fill, Owner::User);
            self.user[slot] = Some(fd);
            descs.push(Desc::new(base, addr - base, len, FRAME_SIZE, 0));
            self.stats.rx_packets += 1;
            self.stats.rx_bytes += len as u64;
        }
        self.stats.rx_batches += (n > 0) as u64;
        n
    }
}

/// Set preferred busy polling on an AF_XDP socket: `SO_PREFER_BUSY_POLL`,
/// `SO_BUSY_POLL` and `SO_BUSY_POLL_BUDGET` (the budget above the
/// `net.core.busy_budget`-free default needs CAP_NET_ADMIN, which binding needs anyway).
fn set_busy_poll(fd: RawFd, bp: BusyPoll) -> std::io::Result<()> {
    let set = |opt, v| crate::udp::set_int_opt(fd, libc::SOL_SOCKET, opt, v);
    set(libc::SO_PREFER_BUSY_POLL, 1)?;
    set(libc::SO_BUSY_POLL, bp.usecs as libc::c_int)?;
    set(libc::SO_BUSY_POLL_BUDGET, libc::c_int::from(bp.budget))
}

/// The device side of preferred busy polling: `napi_defer_hard_irqs` and
/// `gro_flush_timeout` of an interface (`/sys/class/net/DEV/`), so that after a busy
/// poll the kernel defers to a timer instead of re-arming its interrupt (on a veth:
/// the peer's `napi_schedule`) and the busy-polling thread stays the one that runs
/// the NAPI poll. Restores the old values on drop.
#[derive(Debug)]
pub struct NapiDeferral {
    ifname: String,
    old: Vec<(&'static str, String)>,
}

impl NapiDeferral {
    /// Set `defer_hard_irqs` and `gro_flush_timeout_ns` on `ifname`.
    pub fn apply(
        ifname: &str,
        defer_hard_irqs: u32,
        gro_flush_timeout_ns: u64,
    ) -> std::io::Result<NapiDeferral> {
        crate::netif::sysfs_is_ours(ifname)?;
        let mut d = NapiDeferral {
            ifname: ifname.to_string(),
            old: Vec::new(),
        };
        for (name, v) in [
            ("napi_defer_hard_irqs", defer_hard_irqs.to_string()),
            ("gro_flush_timeout", gro_flush_timeout_ns.to_string()),
        ] {
            let path = format!("/sys/class/net/{ifname}/{name}");
            let old = std::fs::read_to_string(&path)?.trim().to_string();
            std::fs::write(&path, &v)?;
            d.old.push((name, old));
        }
        tracing::info!(
            ifname,
            defer_hard_irqs,
            gro_flush_timeout_ns,
            "NAPI deferral set for busy polling"
        );
        Ok(d)
    }
}

impl Drop for NapiDeferral {
    fn drop(&mut self) {
        for (name, v) in self.old.drain(..).rev() {
            let path = format!("/sys/class/net/{}/{name}", self.ifname);
            if let Err(e) = std::fs::write(&path, &v) {
                tracing::warn!(path, error = %e, "restoring the NAPI deferral");
            }
        }
    }
}

impl AsRawFd for AfXdpIo {
    /// The socket's fd, for the XDP program's `xsks` map.
    fn as_raw_fd(&self) -> RawFd {
        self.rx_q.fd().as_raw_fd()
    }
}

impl PacketIo for AfXdpIo {
    fn rx(&mut self, descs: &mut Vec<Desc>, max: usize) -> Result<usize, IoError> {
        descs.clear();
        debug_assert_eq!(self.census.user, 0, "tx() recycles every frame of an rx");
        // Completions and kicks first: frames sent in earlier batches come back to the
        // free list and the fill ring, and copy mode needs sendto to make progress.
        if self.census.tx > 0 {
            self.kick_tx();
        }
        let want = max.min(self.cfg.batch);
        if want == 0 {
            return Ok(0);
        }
        // Refill before draining: the frames freed by the last batch go back to the
        // kernel before it next runs, so it does not meet an empty fill ring while
        // this thread has free frames.
        self.top_up_fill();
        if self.recv_batch(descs, want) == 0 && self.busy_poll {
            // Run the device's NAPI poll here, in this thread, for up to `budget`
            // frames (and `usecs`), then take what it put on the RX ring.
            self.busy_poll_once();
            self.recv_batch(descs, want);
        }
        if descs.is_empty() {
            // Frames still on the TX ring need kicks, not a long sleep.
            let timeout = if self.census.tx > 0 {
                Duration::ZERO
            } else {
                self.cfg.poll_timeout
            };
            if self.wait_readable(timeout)? {
                self.recv_batch(descs, want);
            }
        }
        self.check_census();
        Ok(descs.len())
    }

    fn region(&mut self) -> &mut [u8] {
        // SAFETY: `base..base+len` is the UMEM mapping, kept alive by `self.umem`. The
        // kernel writes only frames on the fill ring and reads only frames on the TX
        // ring; the pipeline touches only the frames of the descriptors `rx` gave it,
        // which are neither. The borrow of `self` keeps this slice from outliving the
        // mapping or overlapping another one made here.
        unsafe { std::slice::from_raw_parts_mut(self.base, self.len) }
    }

    fn tx(&mut self, descs: &[Desc]) -> Result<usize, IoError> {
        let before = self.stats.tx_packets;
        self.tx_batch.clear();
        if self.gso.is_some() {
            self.tx_runs(descs);
        } else {
            for d in descs {
                self.ring_frame(d);
            }
            self.submit_tx();
        }
        self.top_up_fill();
        self.check_census();
        Ok((self.stats.tx_packets - before) as usize)
    }

    fn tx_from(&mut self, region: &[u8], descs: &[Desc]) -> Result<usize, IoError> {
        let before = self.stats.tx_packets;
        self.tx_batch.clear();
        for d in descs {
            if !matches!(d.verdict, Verdict::Tx(_)) {
                continue;
            }
            let data = d.data(region);
            if data.len() > FRAME_SIZE - XDP_HEADROOM {
                self.stats.tx_oversize += 1;
                continue;
            }
            if self.free.is_empty() {
                self.reap_completions();
            }
            let Some(mut fd) = self.free.pop_front() else {
                self.stats.tx_no_frame += 1;
                continue;
            };
            let slot = self.slot_of(fd.addr());
            self.census.free -= 1;
            self.census.user += 1;
            debug_assert_eq!(self.owner[slot], Owner::Free);
            self.owner[slot] = Owner::User;
            // SAFETY: a free frame: no ring and no descriptor of the pipeline holds it.
            let mut dm = unsafe { self.umem.data_mut(&mut fd) };
            let mut cur = dm.cursor();
            cur.set_pos(0);
            if cur.write_all(data).is_err() {
                self.stats.tx_oversize += 1;
                self.give(slot, Owner::User, Owner::Free);
                self.free.push_back(fd);
                continue;
            }
            self.tx_batch.push(fd);
            if self.tx_batch.len() == AFXDP_MAX_BATCH {
                self.submit_tx();
            }
        }
        self.submit_tx();
        self.top_up_fill();
        self.check_census();
        Ok((self.stats.tx_packets - before) as usize)
    }
}

impl AfXdpIo {
    /// The UMEM mapping, read only.
    fn umem_bytes(&self) -> &[u8] {
        // SAFETY: `base..base+len` is the UMEM mapping, kept alive by `self.umem`; the
        // borrow of `self` keeps any `&mut` view of it (`region`) from coexisting.
        unsafe { std::slice::from_raw_parts(self.base, self.len) }
    }

    /// Take descriptor `d` of the last `rx` from the pipeline: a `Tx` frame goes on
    /// `tx_batch` (moved back to its descriptor's fixed TX address if the pipeline moved
    /// its start), any other frame back to the free list.
    fn ring_frame(&mut self, d: &Desc) {
        let slot = d.base as usize / FRAME_SIZE;
        let Some(mut fd) = self.user.get_mut(slot).and_then(Option::take) else {
            // Not a frame of the last rx (or seen twice): nothing of ours to recycle.
            debug_assert!(false, "descriptor of slot {slot} not from the last rx");
            return;
        };
        let Verdict::Tx(_) = d.verdict else {
            self.give(slot, Owner::User, Owner::Free);
            self.free.push_back(fd);
            return;
        };
        let base = slot * FRAME_SIZE;
        let start = base + d.off as usize;
        let len = d.len as usize;
        let tx_at = fd.addr();
        if tx_at - base + len > FRAME_SIZE {
            self.stats.tx_oversize += 1;
            self.give(slot, Owner::User, Owner::Free);
            self.free.push_back(fd);
            return;
        }
        if start != tx_at {
            // The descriptor's TX address is fixed (see the module docs): move the data.
            self.region().copy_within(start..start + len, tx_at);
            self.stats.tx_moved += 1;
        }
        // SAFETY: the frame is the pipeline's until now (owner User), no ring holds it.
        unsafe { self.umem.data_mut(&mut fd) }.cursor().set_pos(len);
        self.tx_batch.push(fd);
    }

    /// `tx` with the packet socket ([`AfXdpTx::Gso`]): the batch's `Tx` frames are cut
    /// into runs of one outer flow ([`gso_tx::plan_runs`]); a run of [`GSO_MIN_RUN`] or
    /// more goes through the packet socket as one GSO message, every other frame
    /// through the TX ring (one skb per frame either way, and the ring's is the
    /// cheaper). Within a phase the socket sends first and the ring after, which keeps
    /// each outer flow in batch order unless a ring frame of a flow comes before a run of
    /// the same flow: that run then starts a new phase, after the ring has sent.
    fn tx_runs(&mut self, descs: &[Desc]) {
        self.gso_frames.clear();
        self.gso_desc.clear();
        for (i, d) in descs.iter().enumerate() {
            let slot = d.base as usize / FRAME_SIZE;
            let in_slot = (d.off as usize).saturating_add(d.len as usize) <= FRAME_SIZE;
            if matches!(d.verdict, Verdict::Tx(_)) && in_slot && slot < self.owner.len() {
                self.gso_frames
                    .push((slot * FRAME_SIZE + d.off as usize, d.len as usize));
                self.gso_desc.push(i);
            }
        }
        let mut runs = std::mem::take(&mut self.gso_runs);
        gso_tx::plan_runs(self.umem_bytes(), &self.gso_frames, &mut runs);
        self.phase_runs.clear();
        self.phase_ring.clear();
        for r in &runs {
            if r.count < GSO_MIN_RUN {
                self.phase_ring.extend(r.first..r.first + r.count);
                continue;
            }
            let region = self.umem_bytes();
            let (s0, l0) = self.gso_frames[r.first];
            let first = &region[s0..s0 + l0];
            let ring_has_flow = self.phase_ring.iter().any(|&k| {
                let (s, l) = self.gso_frames[k];
                gso_tx::same_flow(&region[s..s + l], first)
            });
            if ring_has_flow {
                self.flush_phase(descs);
            }
            self.phase_runs.push(*r);
        }
        self.flush_phase(descs);
        self.gso_runs = runs;
        // What is left with the pipeline (sent through the socket, not Tx, oversize)
        // goes back to the free list; the socket has copied what it sent.
        for d in descs {
            let slot = d.base as usize / FRAME_SIZE;
            if let Some(fd) = self.user.get_mut(slot).and_then(Option::take) {
                let in_slot = (d.off as usize).saturating_add(d.len as usize) <= FRAME_SIZE;
                if matches!(d.verdict, Verdict::Tx(_)) && !in_slot {
                    self.stats.tx_oversize += 1;
                }
                self.give(slot, Owner::User, Owner::Free);
                self.free.push_back(fd);
            }
        }
    }

    /// Send one phase of [`Self::tx_runs`]: its runs through the socket, then its ring
    /// frames.
    fn flush_phase(&mut self, descs: &[Desc]) {
        if !self.phase_runs.is_empty() {
            // Frames already on the TX ring (an earlier phase or batch) leave first:
            // copy mode transmits in the kick, so a ring the kernel has consumed is a
            // ring that has sent.
            let mut tries = 4;
            while self.census.tx > 0 && self.tx_q.nb_free_exact() < self.tx_ring_size && tries > 0 {
                tries -= 1;
                self.stats.tx_kicks += 1;
                if self.tx_q.wakeup().is_err() {
                    self.stats.tx_kick_errors += 1;
                    break;
                }
            }
            if let Some(gso) = self.gso.as_mut() {
                // SAFETY: as in `region`: the UMEM mapping, alive with `self.umem`; only
                // the frames of this batch (owner User, on no ring) are read and
                // written, and no other slice of the mapping is alive during the call.
                let region = unsafe { std::slice::from_raw_parts_mut(self.base, self.len) };
                let before = gso.stats();
                let sent = gso.send(region, &self.gso_frames, &self.phase_runs);
                let after = gso.stats();
                self.stats.tx_packets += sent as u64;
                self.stats.tx_bytes += after.bytes - before.bytes;
                self.stats.tx_gso_sends += after.gso_sends - before.gso_sends;
                self.stats.tx_gso_segments += after.gso_segments - before.gso_segments;
                self.stats.tx_gso_fallbacks += after.gso_fallbacks - before.gso_fallbacks;
                self.stats.tx_syscalls += after.syscalls - before.syscalls;
                self.stats.tx_send_dropped += after.dropped - before.dropped;
            }
            self.phase_runs.clear();
        }
        if !self.phase_ring.is_empty() {
            let ring = std::mem::take(&mut self.phase_ring);
            for &k in &ring {
                self.ring_frame(&descs[self.gso_desc[k]]);
            }
            self.phase_ring = ring;
            self.phase_ring.clear();
            self.submit_tx();
        }
    }
}

impl Drop for AfXdpIo {
    fn drop(&mut self) {
        tracing::debug!(stats = ?self.stats, census = ?self.census, "AF_XDP socket closed");
    }
}

/// How much headroom an RX descriptor leaves for encap (more than the pipeline asks for).
pub const RX_HEADROOM: usize = XDP_HEADROOM;
const _: () = assert!(RX_HEADROOM >= HEADROOM);
