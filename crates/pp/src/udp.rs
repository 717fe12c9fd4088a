//! [`UdpVxlanIo`]: a [`PacketIo`] backend over an ordinary UDP socket on the VXLAN port,
//! batched with `recvmmsg`/`sendmmsg`, with UDP GRO on receive and UDP GSO on send.
//!
//! The pipeline works on whole Ethernet frames, but a UDP socket sees only the VXLAN
//! datagram. So RX writes each datagram into a frame slot behind a synthesized outer
//! Ethernet/IPv4/UDP header (source = the datagram's sender, destination = the socket),
//! and TX parses the outer headers of each output frame to find where to send its UDP
//! payload.
//!
//! Batching end to end (issue 18): one TCP flow inside VXLAN is one outer 4-tuple (the
//! sender's per-flow source port), so its datagrams are consecutive and of one size.
//! - **GRO on receive** (`UDP_GRO`): the kernel hands one buffer of up to 64 KiB holding
//!   several same-4-tuple datagrams and a `UDP_GRO` control message with the segment
//!   size. RX receives into per-message staging buffers and splits each into one frame
//!   slot per segment; segments that do not fit this batch's slots wait for the next
//!   `rx`, which then makes no syscall. Coalescing happens only where the receiving
//!   device runs GRO (a NIC; a veth only with GRO or XDP on).
//! - **GSO on send** (`UDP_SEGMENT`): consecutive output datagrams to the same
//!   destination and of the same size (the last may be shorter) go as one message with
//!   one iovec per frame; the kernel (or the device) cuts them back into datagrams. One
//!   `sendmmsg` carries up to [`MAX_IO_BATCH`] such messages.
//!
//! Limits of a socket backend, lifted by the AF_XDP backend to come:
//! - The kernel writes the outer IPv4/UDP header on TX, so the outer source address and
//!   the per-flow outer source port that `encap` put in the frame are not honoured: every
//!   datagram leaves from the socket's address and port, and underlay ECMP sees one flow.
//! - IPv4 underlay only (the socket is AF_INET; frames with an IPv6 outer header are
//!   counted as unsendable).
//! - Every output port maps to the one socket.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::ops::Range;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use packet::csum::{checksum, put16};
use packet::{ethertype, parse_frame, proto, IpVersion, L3, L4, VXLAN_PORT};
use pipeline::{Desc, IoError, PacketIo, Verdict, FRAME_SIZE, HEADROOM, MAX_FRAME};
use thiserror::Error;

use crate::doorbell::{self, Doorbell};

/// Outer Ethernet (14) + IPv4 (20) + UDP (8) header synthesized in front of a datagram.
pub const SYNTH_HDR_LEN: usize = 14 + 20 + 8;
/// Largest datagram a slot holds behind the headroom and the synthesized header.
pub const MAX_DATAGRAM: usize = MAX_FRAME - SYNTH_HDR_LEN;
/// Most messages moved by one `recvmmsg`/`sendmmsg` call (with GRO/GSO a message holds
/// several datagrams).
pub const MAX_IO_BATCH: usize = 64;
/// Most frame slots, i.e. the largest RX batch. One GRO buffer alone can hold 44
/// segments of a 1500-byte MTU, so more slots than messages keep batches full.
pub const MAX_SLOTS: usize = 256;
/// Size of one receive staging buffer: the largest buffer GRO hands a socket (an IPv4
/// datagram's 64 KiB limit).
pub const GRO_BUF: usize = 65536;
/// Most datagrams in one GSO send. The kernel's `UDP_MAX_SEGMENTS` is 64 on older
/// kernels (128 on newer ones); 64 works on both.
pub const MAX_GSO_SEGMENTS: usize = 64;
/// Most payload bytes of one GSO send: what fits one IPv4 datagram (65535 - IPv4 20 -
/// UDP 8), which is how the kernel bounds a corked UDP send.
pub const MAX_GSO_BYTES: usize = 65535 - 20 - 8;

/// Outer MACs of synthesized frames. A socket has no link layer, and the pipeline never
/// reads the outer MACs of VXLAN traffic (decap drops them, encap writes its own), so
/// these only have to be recognisable in a capture: locally administered, "s"ocket.
pub const SYNTH_DST_MAC: [u8; 6] = [0x02, 0x73, 0, 0, 0, 0x01];
pub const SYNTH_SRC_MAC: [u8; 6] = [0x02, 0x73, 0, 0, 0, 0x02];

/// Configuration of a [`UdpVxlanIo`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UdpVxlanConfig {
    /// Local address and port to bind. IPv4 only.
    pub bind: SocketAddrV4,
    /// Send every frame to this UDP port instead of the frame's outer destination port.
    /// `encap` always writes 4789; this lets two endpoints share one host on distinct
    /// ports (tests on loopback, several PP nodes on one machine).
    pub peer_port: Option<u16>,
    /// How long `rx` waits for a datagram when none is queued; bounds how long a worker
    /// loop takes to notice it should stop.
    pub poll_timeout: Duration,
    /// Frame slots, i.e. the largest RX batch (at most [`MAX_SLOTS`]).
    pub slots: usize,
    /// Ask the kernel to coalesce received datagrams (`UDP_GRO`). If the kernel refuses,
    /// the socket runs without (logged at warn).
    pub gro: bool,
    /// Send runs of same-destination, same-size datagrams as one `UDP_SEGMENT` message.
    pub gso: bool,
    /// `SO_RCVBUF` to ask for (the kernel caps it at `net.core.rmem_max`).
    pub recv_buffer: Option<usize>,
    /// `SO_SNDBUF` to ask for (capped at `net.core.wmem_max`).
    pub send_buffer: Option<usize>,
    /// Set `SO_REUSEPORT` before binding, so several sockets (one per PP worker) share
    /// the address and the kernel spreads flows over them by their 4-tuple hash.
    pub reuse_port: bool,
}

impl UdpVxlanConfig {
    pub fn new(bind: SocketAddrV4) -> Self {
        UdpVxlanConfig {
            bind,
            peer_port: None,
            poll_timeout: Duration::from_millis(20),
            slots: MAX_IO_BATCH,
            gro: true,
            gso: true,
            recv_buffer: Some(4 << 20),
            send_buffer: Some(4 << 20),
            reuse_port: false,
        }
    }
}

impl Default for UdpVxlanConfig {
    fn default() -> Self {
        Self::new(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, VXLAN_PORT))
    }
}

/// Counters of a [`UdpVxlanIo`]. Every `Tx` descriptor handed to the backend ends in
/// exactly one of `tx_packets`, `tx_dropped`, `tx_errors`, `tx_unsendable`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UdpVxlanStats {
    /// Datagrams delivered to the pipeline.
    pub rx_packets: u64,
    /// Datagram bytes (from the VXLAN header on) delivered to the pipeline.
    pub rx_bytes: u64,
    /// `recvmmsg` calls that returned at least one datagram.
    pub rx_batches: u64,
    /// Buffers the kernel's GRO had coalesced from several datagrams.
    pub gro_buffers: u64,
    /// Datagrams (segments) delivered out of those coalesced buffers.
    pub gro_segments: u64,
    /// Datagrams longer than [`MAX_DATAGRAM`], dropped (a NIC would not fit them either).
    pub rx_oversize: u64,
    /// Datagrams the kernel accepted.
    pub tx_packets: u64,
    /// UDP payload bytes the kernel accepted.
    pub tx_bytes: u64,
    /// Not sent because the kernel pushed back (`EAGAIN`, `ENOBUFS`).
    pub tx_dropped: u64,
    /// Not sent because the send failed otherwise (no route, message too long, ...).
    pub tx_errors: u64,
    /// Frames that are not IPv4/UDP/VXLAN, or are addressed to this socket itself.
    pub tx_unsendable: u64,
    /// GSO messages (several datagrams in one `UDP_SEGMENT` send) the kernel accepted.
    pub gso_sends: u64,
    /// Datagrams sent inside those GSO messages (also counted in `tx_packets`).
    pub gso_segments: u64,
    /// GSO messages the kernel refused for a reason other than a full queue, whose
    /// datagrams were then sent one per message.
    pub gso_fallbacks: u64,
    /// `sendmmsg` calls made.
    pub tx_syscalls: u64,
}

/// Why a [`UdpVxlanIo`] could not be set up.
#[derive(Debug, Error)]
pub enum UdpVxlanError {
    #[error("cannot bind UDP {addr}: {source}")]
    Bind {
        addr: SocketAddrV4,
        source: std::io::Error,
    },
    #[error("cannot configure the socket ({what}): {source}")]
    Socket {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("frame slots {0} not in 1..={MAX_SLOTS}")]
    BadSlots(usize),
}

/// Where a frame's UDP payload goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxTarget {
    pub dst: SocketAddrV4,
    /// The UDP payload (VXLAN header and inner frame) within the frame.
    pub payload: Range<usize>,
}

/// Write the outer Ethernet/IPv4/UDP header of a frame carrying a `payload_len`-byte
/// VXLAN datagram from `src` to `dst` into `out[..SYNTH_HDR_LEN]`.
///
/// The UDP destination port is always 4789, whatever port the socket is bound to: every
/// datagram on the socket is VXLAN by construction, and 4789 is how the pipeline's parser
/// recognises VXLAN. The UDP checksum is 0 (RFC 768: none; the kernel has already
/// verified the real one).
pub fn write_outer_header(
    out: &mut [u8],
    src: SocketAddrV4,
    dst: SocketAddrV4,
    payload_len: usize,
) {
    let out = &mut out[..SYNTH_HDR_LEN];
    out[0..6].copy_from_slice(&SYNTH_DST_MAC);
    out[6..12].copy_from_slice(&SYNTH_SRC_MAC);
    put16(out, 12, ethertype::IPV4);
    let ip = &mut out[14..34];
    ip[0] = 0x45;
    ip[1] = 0;
    put16(ip, 2, (20 + 8 + payload_len) as u16);
    put16(ip, 4, 0);
    put16(ip, 6, 0x4000); // DF
    ip[8] = 64;
    ip[9] = proto::UDP;
    put16(ip, 10, 0);
    ip[12..16].copy_from_slice(&src.ip().octets());
    ip[16..20].copy_from_slice(&dst.ip().octets());
    let c = checksum(0, ip);
    put16(ip, 10, c);
    let udp = &mut out[34..42];
    put16(udp, 0, src.port());
    put16(udp, 2, VXLAN_PORT);
    put16(udp, 4, (8 + payload_len) as u16);
    put16(udp, 6, 0);
}

/// Where to send an output frame: its outer IPv4 destination and UDP destination port
/// (or `peer_port`), and the UDP payload from the VXLAN header on. `None` when the frame
/// is not IPv4/UDP/VXLAN (say a rule that decaps but does not re-encap) or is addressed
/// to nobody.
pub fn tx_target(frame: &[u8], peer_port: Option<u16>) -> Option<TxTarget> {
    let f = parse_frame(frame).ok()?;
    let vx = f.vxlan?;
    let L3::Ip(ip) = f.l3 else { return None };
    if ip.version != IpVersion::V4 {
        return None;
    }
    let L4::Udp { dport, .. } = ip.l4 else {
        return None;
    };
    let r = ip.dst_range();
    let addr = Ipv4Addr::new(
        frame[r.start],
        frame[r.start + 1],
        frame[r.start + 2],
        frame[r.start + 3],
    );
    if addr.is_unspecified() || addr.is_broadcast() {
        return None;
    }
    let payload = vx.off as usize..vx.inner_end as usize;
    frame.get(payload.clone())?;
    Some(TxTarget {
        dst: SocketAddrV4::new(addr, peer_port.unwrap_or(dport)),
        payload,
    })
}

const SOCKADDR_ZERO: libc::sockaddr_in = libc::sockaddr_in {
    sin_family: 0,
    sin_port: 0,
    sin_addr: libc::in_addr { s_addr: 0 },
    sin_zero: [0; 8],
};

const IOVEC_ZERO: libc::iovec = libc::iovec {
    iov_base: std::ptr::null_mut(),
    iov_len: 0,
};

const MMSG_ZERO: libc::mmsghdr = libc::mmsghdr {
    msg_hdr: libc::msghdr {
        msg_name: std::ptr::null_mut(),
        msg_namelen: 0,
        msg_iov: std::ptr::null_mut(),
        msg_iovlen: 0,
        msg_control: std::ptr::null_mut(),
        msg_controllen: 0,
        msg_flags: 0,
    },
    msg_len: 0,
};

fn to_sockaddr(a: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: a.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*a.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

fn from_sockaddr(s: &libc::sockaddr_in) -> Option<SocketAddrV4> {
    (s.sin_family == libc::AF_INET as libc::sa_family_t).then(|| {
        SocketAddrV4::new(
            Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr)),
            u16::from_be(s.sin_port),
        )
    })
}

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

fn set_buffer(
    fd: RawFd,
    opt: libc::c_int,
    bytes: usize,
    what: &'static str,
) -> Result<(), UdpVxlanError> {
    let v = bytes.min(i32::MAX as usize) as libc::c_int;
    // SAFETY: `fd` is an open socket owned by the caller; `v` outlives the call and the
    // length passed is its size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            opt,
            &v as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(UdpVxlanError::Socket {
            what,
            source: errno(),
        });
    }
    Ok(())
}

/// A UDP socket bound to `addr` with `SO_REUSEPORT` set first (std binds at once).
fn bind_reuse_port(addr: SocketAddrV4) -> std::io::Result<UdpSocket> {
    // SAFETY: plain socket(2); the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(errno());
    }
    // SAFETY: `fd` is the socket just created and owned by nothing else; the
    // `UdpSocket` takes it over and closes it on every path from here.
    let sock = unsafe { <UdpSocket as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let one: libc::c_int = 1;
    // SAFETY: `fd` is open (owned by `sock`); `one` outlives the call and the length
    // passed is its size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEPORT,
            &one as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(errno());
    }
    let sa = to_sockaddr(addr);
    // SAFETY: `sa` is a valid sockaddr_in that outlives the call; the length is its size.
    let r = unsafe {
        libc::bind(
            fd,
            &sa as *const libc::sockaddr_in as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(errno());
    }
    Ok(sock)
}

/// Set an `int` socket option.
pub(crate) fn set_int_opt(
    fd: RawFd,
    level: libc::c_int,
    opt: libc::c_int,
    v: libc::c_int,
) -> std::io::Result<()> {
    // SAFETY: `fd` is an open socket owned by the caller; `v` outlives the call and the
    // length passed is its size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            &v as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(errno());
    }
    Ok(())
}

/// Control-message space of one message: room for one `cmsghdr` and an `int` (what
/// `UDP_GRO` delivers and, as a `u16`, what `UDP_SEGMENT` takes), 8-byte aligned as
/// `cmsghdr` needs.
type CmsgSpace = [u64; 4];

/// What one received message held.
#[derive(Debug, Clone, Copy)]
struct RxMsg {
    src: SocketAddrV4,
    len: usize,
    /// Segment size from the `UDP_GRO` control message; 0 when the buffer is one
    /// datagram.
    seg: usize,
}

/// Received messages waiting to be split into frame slots.
struct Staging {
    /// [`MAX_IO_BATCH`] buffers of [`GRO_BUF`] bytes.
    buf: Vec<u8>,
    msgs: Vec<RxMsg>,
    /// Next message to split and the offset of its next segment.
    next: usize,
    off: usize,
}

impl Staging {
    fn is_empty(&self) -> bool {
        self.next >= self.msgs.len()
    }
}

/// A PP port over a UDP socket; see the module docs for what it can and cannot do.
pub struct UdpVxlanIo {
    sock: UdpSocket,
    local: SocketAddrV4,
    cfg: UdpVxlanConfig,
    /// `slots` frame slots of [`FRAME_SIZE`] bytes, laid out like `MemRing`'s.
    region: Vec<u8>,
    staging: Staging,
    /// GSO on this socket (the config's wish, unless the kernel refused it).
    gso: bool,
    stats: UdpVxlanStats,
    /// Rung when FM's replies for this worker arrive: an idle wait ends for them too.
    doorbell: Option<Arc<Doorbell>>,
}

impl UdpVxlanIo {
    pub fn bind(cfg: UdpVxlanConfig) -> Result<Self, UdpVxlanError> {
        if cfg.slots == 0 || cfg.slots > MAX_SLOTS {
            return Err(UdpVxlanError::BadSlots(cfg.slots));
        }
        let sock = if cfg.reuse_port {
            bind_reuse_port(cfg.bind)
        } else {
            UdpSocket::bind(cfg.bind)
        }
        .map_err(|source| UdpVxlanError::Bind {
            addr: cfg.bind,
            source,
        })?;
        // Non-blocking so a burst is drained without ever sleeping in the kernel; `rx`
        // waits in poll(2) with a timeout instead.
        sock.set_nonblocking(true)
            .map_err(|source| UdpVxlanError::Socket {
                what: "O_NONBLOCK",
                source,
            })?;
        let fd = sock.as_raw_fd();
        if let Some(b) = cfg.recv_buffer {
            set_buffer(fd, libc::SO_RCVBUF, b, "SO_RCVBUF")?;
        }
        if let Some(b) = cfg.send_buffer {
            set_buffer(fd, libc::SO_SNDBUF, b, "SO_SNDBUF")?;
        }
        let gro = cfg.gro
            && match set_int_opt(fd, libc::SOL_UDP, libc::UDP_GRO, 1) {
                Ok(()) => true,
                // Kernels before 5.0: the socket still works, one datagram per message.
                Err(e) => {
                    tracing::warn!(error = %e, "UDP_GRO refused; receiving without GRO");
                    false
                }
            };
        let local = match sock.local_addr() {
            Ok(std::net::SocketAddr::V4(a)) => a,
            Ok(std::net::SocketAddr::V6(_)) => unreachable!("bound to an IPv4 address"),
            Err(source) => {
                return Err(UdpVxlanError::Socket {
                    what: "getsockname",
                    source,
                })
            }
        };
        tracing::info!(%local, peer_port = ?cfg.peer_port, gro, gso = cfg.gso, slots = cfg.slots, "UDP VXLAN port bound");
        Ok(UdpVxlanIo {
            sock,
            local,
            region: vec![0u8; cfg.slots * FRAME_SIZE],
            staging: Staging {
                buf: vec![0u8; MAX_IO_BATCH * GRO_BUF],
                msgs: Vec::with_capacity(MAX_IO_BATCH),
                next: 0,
                off: 0,
            },
            gso: cfg.gso,
            cfg,
            stats: UdpVxlanStats::default(),
            doorbell: None,
        })
    }

    /// The bound address (with the kernel's port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddrV4 {
        self.local
    }

    pub fn stats(&self) -> UdpVxlanStats {
        self.stats
    }

    /// Datagrams the kernel dropped for this socket (its receive buffer full):
    /// `SK_MEMINFO_DROPS` of `SO_MEMINFO`, one `getsockopt`.
    pub fn kernel_drops(&self) -> std::io::Result<u64> {
        // SK_MEMINFO_VARS entries; SK_MEMINFO_DROPS is the last (include/uapi/linux/sock_diag.h).
        let mut mem = [0u32; 9];
        let mut len = std::mem::size_of_val(&mem) as libc::socklen_t;
        // SAFETY: a valid socket fd and an out-buffer of `len` bytes that lives for the
        // call.
        let r = unsafe {
            libc::getsockopt(
                self.sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_MEMINFO,
                mem.as_mut_ptr().cast(),
                &mut len,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(u64::from(mem[8]))
    }

    pub fn config(&self) -> &UdpVxlanConfig {
        &self.cfg
    }
}

/// The calling thread's network namespace's `Udp: SndbufErrors` (`/proc/net/snmp`):
/// datagrams a UDP send handed to the kernel that the device then dropped, its queue
/// full. Without `IP_RECVERR` the kernel does not return that `ENOBUFS` to the sender
/// (`udp_send_skb`), so the backend's own `tx_packets` counts them as sent. On the
/// testbed the router side of the PP node's veth runs an XDP program, so its receive
/// ring holds 256 frames, and a TCP flow's GSO bursts overflow it. The counter covers
/// every UDP socket of the namespace, since the namespace was made.
pub fn netns_udp_sndbuf_errors() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/net/snmp").ok()?;
    snmp_field(&text, "Udp:", "SndbufErrors")
}

/// One field of `/proc/net/snmp`'s `proto` section: a line of names, then a line of
/// values, both starting with `proto`.
fn snmp_field(text: &str, proto: &str, field: &str) -> Option<u64> {
    let mut lines = text.lines().filter(|l| l.starts_with(proto));
    let names = lines.next()?;
    let values = lines.next()?;
    let at = names.split_whitespace().position(|n| n == field)?;
    values.split_whitespace().nth(at)?.parse().ok()
}

impl UdpVxlanIo {
    /// Sends `descs`, whose frames are in `region` (this socket's own slots when `None`).
    #[inline]
    fn send(&mut self, region: Option<&[u8]>, descs: &[Desc]) -> usize {
        let region = region.unwrap_or(&self.region);
        let mut tx = Sender {
            fd: self.sock.as_raw_fd(),
            gso: self.gso,
            stats: &mut self.stats,
        };
        let n = tx.send_frames(self.local, self.cfg.peer_port, region, descs);
        self.gso = tx.gso;
        n
    }

    /// One non-blocking `recvmmsg` of up to [`MAX_IO_BATCH`] messages into the staging
    /// buffers; returns the count received. Only called with the staging drained.
    fn recv_staged(&mut self) -> Result<usize, IoError> {
        let mut names = [SOCKADDR_ZERO; MAX_IO_BATCH];
        let mut iov = [IOVEC_ZERO; MAX_IO_BATCH];
        let mut msgs = [MMSG_ZERO; MAX_IO_BATCH];
        let mut ctrl: [CmsgSpace; MAX_IO_BATCH] = [[0; 4]; MAX_IO_BATCH];
        let base_ptr = self.staging.buf.as_mut_ptr();
        for i in 0..MAX_IO_BATCH {
            iov[i].iov_base = base_ptr.wrapping_add(i * GRO_BUF).cast();
            iov[i].iov_len = GRO_BUF;
            let h = &mut msgs[i].msg_hdr;
            h.msg_name = (&mut names[i] as *mut libc::sockaddr_in).cast();
            h.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            h.msg_iov = &mut iov[i];
            h.msg_iovlen = 1;
            h.msg_control = ctrl[i].as_mut_ptr().cast();
            h.msg_controllen = std::mem::size_of::<CmsgSpace>() as _;
        }
        // SAFETY: each `msgs[i]` points at `names[i]`, `iov[i]` and `ctrl[i]` (all live
        // for the call) and, through `iov[i]`, at the disjoint GRO_BUF-byte range i of
        // `self.staging.buf`, which nothing else borrows during the call.
        let r = unsafe {
            libc::recvmmsg(
                self.sock.as_raw_fd(),
                msgs.as_mut_ptr(),
                MAX_IO_BATCH as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if r < 0 {
            let e = errno();
            return match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::EINTR) => Ok(0),
                // An ICMP error queued for an earlier send; it concerns that send, not RX.
                Some(libc::ECONNREFUSED) | Some(libc::EHOSTUNREACH) | Some(libc::ENETUNREACH) => {
                    tracing::debug!(error = %e, "recvmmsg reported an earlier send's error");
                    Ok(0)
                }
                _ => Err(IoError::Os(e)),
            };
        }
        let n = r as usize;
        self.stats.rx_batches += (n > 0) as u64;
        self.staging.msgs.clear();
        self.staging.next = 0;
        self.staging.off = 0;
        for i in 0..n {
            let h = &msgs[i].msg_hdr;
            let len = msgs[i].msg_len as usize;
            if h.msg_flags & libc::MSG_TRUNC != 0 {
                self.stats.rx_oversize += 1;
                continue;
            }
            // An AF_INET socket only reports AF_INET senders; anything else would be a
            // kernel bug, not traffic to count.
            let Some(src) = from_sockaddr(&names[i]) else {
                continue;
            };
            let seg = gro_segment_size(h);
            self.staging.msgs.push(RxMsg {
                src,
                len,
                seg: if seg > 0 && seg < len { seg } else { 0 },
            });
        }
        Ok(n)
    }

    /// Split staged messages into frame slots until `want` frames are in `descs`.
    fn drain(&mut self, want: usize, descs: &mut Vec<Desc>) {
        let st = &mut self.staging;
        while descs.len() < want && st.next < st.msgs.len() {
            let m = st.msgs[st.next];
            let seg = if m.seg == 0 { m.len } else { m.seg };
            let take = seg.min(m.len - st.off);
            if take > MAX_DATAGRAM {
                self.stats.rx_oversize += 1;
            } else {
                let src = st.next * GRO_BUF + st.off;
                let slot = descs.len() * FRAME_SIZE;
                let hdr = slot + HEADROOM;
                let data = hdr + SYNTH_HDR_LEN;
                self.region[data..data + take].copy_from_slice(&st.buf[src..src + take]);
                write_outer_header(
                    &mut self.region[hdr..hdr + SYNTH_HDR_LEN],
                    m.src,
                    self.local,
                    take,
                );
                descs.push(Desc::new(
                    slot,
                    HEADROOM,
                    SYNTH_HDR_LEN + take,
                    FRAME_SIZE,
                    0,
                ));
                self.stats.rx_packets += 1;
                self.stats.rx_bytes += take as u64;
                if m.seg != 0 {
                    self.stats.gro_segments += 1;
                    self.stats.gro_buffers += (st.off == 0) as u64;
                }
            }
            st.off += take;
            // `>=` also moves past an empty datagram (take 0).
            if st.off >= m.len {
                st.next += 1;
                st.off = 0;
            }
        }
    }

    /// Wait up to the poll timeout for the socket to become readable. A ring (FM's
    /// replies) or a signal ends the wait with no packets, and the worker's loop
    /// services the replies or looks at its stop flag.
    fn wait_readable(&self) -> Result<bool, IoError> {
        doorbell::wait(
            Some(self.sock.as_raw_fd()),
            self.doorbell.as_deref(),
            self.cfg.poll_timeout,
        )
        .map(|(readable, _)| readable)
        .map_err(IoError::Os)
    }

    /// Wait on `bell` too whenever the socket has nothing: the FM client rings it when
    /// replies for this worker arrive.
    pub fn set_doorbell(&mut self, bell: Arc<Doorbell>) {
        self.doorbell = Some(bell);
    }
}

/// The segment size of a received message's `UDP_GRO` control message, 0 if none.
fn gro_segment_size(h: &libc::msghdr) -> usize {
    // SAFETY: `h` is a msghdr the kernel just filled; its control pointer and length
    // describe the message's own control buffer, which the CMSG_* macros only walk
    // within, and the data of a `UDP_GRO` message is an int (read unaligned).
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(h);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == libc::UDP_GRO {
                let v = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::c_int);
                return v.max(0) as usize;
            }
            c = libc::CMSG_NXTHDR(h, c);
        }
    }
    0
}

/// One datagram to send: its destination and payload.
#[derive(Clone, Copy)]
struct Out {
    dst: SocketAddrV4,
    ptr: *const u8,
    len: usize,
}

/// The TX half: builds messages (GSO runs or single datagrams) and sends them.
struct Sender<'a> {
    fd: RawFd,
    gso: bool,
    stats: &'a mut UdpVxlanStats,
}

/// Most iovecs (datagrams) in one `sendmmsg`.
const TX_IOVS: usize = MAX_IO_BATCH * 4;

impl Sender<'_> {
    /// Send every `Tx` descriptor's UDP payload; returns the datagrams the kernel took.
    fn send_frames(
        &mut self,
        local: SocketAddrV4,
        peer_port: Option<u16>,
        region: &[u8],
        descs: &[Desc],
    ) -> usize {
        let mut outs: Vec<Out> = Vec::with_capacity(descs.len().min(TX_IOVS));
        let mut sent = 0;
        for d in descs.iter().filter(|d| matches!(d.verdict, Verdict::Tx(_))) {
            let frame = d.data(region);
            let Some(t) = tx_target(frame, peer_port).filter(|t| t.dst != local) else {
                self.stats.tx_unsendable += 1;
                tracing::trace!(len = frame.len(), "output frame is not IPv4 VXLAN; dropped");
                continue;
            };
            let payload = &frame[t.payload];
            outs.push(Out {
                dst: t.dst,
                ptr: payload.as_ptr(),
                len: payload.len(),
            });
            if outs.len() == TX_IOVS {
                sent += self.send_outs(&outs, self.gso);
                outs.clear();
            }
        }
        if !outs.is_empty() {
            sent += self.send_outs(&outs, self.gso);
        }
        sent
    }

    /// Send `outs` (at most [`TX_IOVS`]), grouped into GSO runs when `gso`, in as few
    /// `sendmmsg` calls as the message limit allows.
    fn send_outs(&mut self, outs: &[Out], gso: bool) -> usize {
        debug_assert!(outs.len() <= TX_IOVS);
        let mut iov = [IOVEC_ZERO; TX_IOVS];
        for (v, o) in iov.iter_mut().zip(outs) {
            // sendmmsg only reads through iov_base; the *mut is what the C struct wants.
            v.iov_base = o.ptr as *mut libc::c_void;
            v.iov_len = o.len;
        }
        // Runs of `outs`: (start, count). A run is a GSO message when count > 1.
        let mut runs: Vec<(usize, usize)> = Vec::with_capacity(MAX_IO_BATCH);
        let mut i = 0;
        while i < outs.len() {
            let first = outs[i];
            let mut n = 1;
            let mut bytes = first.len;
            if gso && first.len > 0 {
                // Same destination, same size; the last datagram of a run may be shorter
                // (the kernel cuts the tail into a short last segment).
                while i + n < outs.len() && n < MAX_GSO_SEGMENTS {
                    let o = outs[i + n];
                    if o.dst != first.dst || o.len > first.len || bytes + o.len > MAX_GSO_BYTES {
                        break;
                    }
                    bytes += o.len;
                    n += 1;
                    if o.len < first.len {
                        break;
                    }
                }
            }
            runs.push((i, n));
            i += n;
        }
        let mut sent = 0;
        for chunk in runs.chunks(MAX_IO_BATCH) {
            sent += self.send_runs(outs, &mut iov, chunk);
        }
        sent
    }

    /// One `sendmmsg` per call (more after a partial send) of up to [`MAX_IO_BATCH`]
    /// runs.
    fn send_runs(
        &mut self,
        outs: &[Out],
        iov: &mut [libc::iovec; TX_IOVS],
        runs: &[(usize, usize)],
    ) -> usize {
        let mut names = [SOCKADDR_ZERO; MAX_IO_BATCH];
        let mut msgs = [MMSG_ZERO; MAX_IO_BATCH];
        let mut ctrl: [CmsgSpace; MAX_IO_BATCH] = [[0; 4]; MAX_IO_BATCH];
        for (k, &(start, n)) in runs.iter().enumerate() {
            names[k] = to_sockaddr(outs[start].dst);
            let h = &mut msgs[k].msg_hdr;
            h.msg_name = (&mut names[k] as *mut libc::sockaddr_in).cast();
            h.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            h.msg_iov = iov[start..].as_mut_ptr();
            h.msg_iovlen = n as _;
            if n > 1 {
                h.msg_control = ctrl[k].as_mut_ptr().cast();
                // SAFETY: CMSG_SPACE/CMSG_LEN are arithmetic; CMSG_FIRSTHDR reads only
                // `h`'s control fields, which point at `ctrl[k]` (32 bytes, 8-aligned,
                // room for a cmsghdr and a u16); the writes stay inside it.
                unsafe {
                    h.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<u16>() as u32) as _;
                    let c = libc::CMSG_FIRSTHDR(h);
                    (*c).cmsg_level = libc::SOL_UDP;
                    (*c).cmsg_type = libc::UDP_SEGMENT;
                    (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) as _;
                    std::ptr::write_unaligned(
                        libc::CMSG_DATA(c) as *mut u16,
                        outs[start].len as u16,
                    );
                }
            }
        }
        let count = runs.len();
        let mut sent = 0;
        let mut done = 0;
        while done < count {
            // SAFETY: `msgs[done..count]` point at `names`, `ctrl` and `iov` (live for
            // the call), and through `iov` at payloads in a region the caller borrows
            // shared for the whole send; sendmmsg only reads them.
            let r = unsafe {
                libc::sendmmsg(
                    self.fd,
                    msgs.as_mut_ptr().add(done),
                    (count - done) as libc::c_uint,
                    libc::MSG_DONTWAIT,
                )
            };
            self.stats.tx_syscalls += 1;
            if r > 0 {
                for &(start, n) in &runs[done..done + r as usize] {
                    self.stats.tx_packets += n as u64;
                    self.stats.tx_bytes += outs[start..start + n]
                        .iter()
                        .map(|o| o.len as u64)
                        .sum::<u64>();
                    if n > 1 {
                        self.stats.gso_sends += 1;
                        self.stats.gso_segments += n as u64;
                    }
                    sent += n;
                }
                done += r as usize;
                continue;
            }
            let e = errno();
            let (start, n) = runs[done];
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                // The socket buffer or the device queue is full: the rest of this batch
                // would meet the same, so drop it as a full NIC ring would.
                Some(libc::EAGAIN) | Some(libc::ENOBUFS) => {
                    let left: usize = runs[done..].iter().map(|r| r.1).sum();
                    self.stats.tx_dropped += left as u64;
                    tracing::debug!(dropped = left, error = %e, "send queue full");
                    done = count;
                }
                // A GSO message refused (no checksum offload on the route's device: EIO;
                // a segment over the MTU: EINVAL/EMSGSIZE): send its datagrams one per
                // message, which is what they would have been without GSO.
                _ if n > 1 => {
                    self.stats.gso_fallbacks += 1;
                    tracing::debug!(error = %e, segments = n, "GSO send refused; sending singly");
                    if e.raw_os_error() == Some(libc::EIO) && self.gso {
                        tracing::warn!(error = %e, "UDP GSO unsupported on this route; sending without it");
                        self.gso = false;
                    }
                    sent += self.send_outs(&outs[start..start + n], false);
                    done += 1;
                }
                // This message's fault (no route, too long, ...): skip it, send the rest.
                _ => {
                    self.stats.tx_errors += 1;
                    tracing::debug!(error = %e, dst = ?from_sockaddr(&names[done]), "send failed");
                    done += 1;
                }
            }
        }
        sent
    }
}

impl PacketIo for UdpVxlanIo {
    fn rx(&mut self, descs: &mut Vec<Desc>, max: usize) -> Result<usize, IoError> {
        descs.clear();
        let want = max.min(self.cfg.slots);
        if want == 0 {
            return Ok(0);
        }
        // Segments left from the last call first, without a syscall; then at most one
        // recvmmsg (after a wait when nothing is queued).
        if self.staging.is_empty() && self.recv_staged()? == 0 && self.wait_readable()? {
            self.recv_staged()?;
        }
        self.drain(want, descs);
        Ok(descs.len())
    }

    fn region(&mut self) -> &mut [u8] {
        &mut self.region
    }

    fn tx(&mut self, descs: &[Desc]) -> Result<usize, IoError> {
        // Slots are reused by the next rx as they are: nothing to recycle.
        Ok(self.send(None, descs))
    }

    fn tx_from(&mut self, region: &[u8], descs: &[Desc]) -> Result<usize, IoError> {
        Ok(self.send(Some(region), descs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use packet::build::{ip_frame, udp_v4, vxlan_wrap, L4Spec, VXLAN_V4_OVERHEAD};
    use packet::csum;
    use packet::rewrite::Addr;

    #[test]
    fn the_snmp_udp_section_gives_its_named_field() {
        let text = "Ip: Forwarding DefaultTTL\nIp: 1 64\n\
                    Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors\n\
                    Udp: 10 2 0 30 0 7\n\
                    UdpLite: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors\n\
                    UdpLite: 0 0 0 0 0 0\n";
        assert_eq!(snmp_field(text, "Udp:", "SndbufErrors"), Some(7));
        assert_eq!(snmp_field(text, "Udp:", "OutDatagrams"), Some(30));
        assert_eq!(snmp_field(text, "Udp:", "Nope"), None);
        assert_eq!(
            snmp_field("Udp: SndbufErrors\n", "Udp:", "SndbufErrors"),
            None
        );
        // This machine's own file has the field.
        assert!(netns_udp_sndbuf_errors().is_some());
    }

    fn inner() -> Vec<u8> {
        udp_v4([198, 19, 10, 2], 40000, [198, 19, 10, 9], 7, b"ping")
    }

    /// The VXLAN datagram (header + inner frame) a sender would put on the wire.
    fn datagram(vni: u32) -> Vec<u8> {
        vxlan_wrap([1, 1, 1, 1], [2, 2, 2, 2], 1, vni, &inner())[VXLAN_V4_OVERHEAD - 8..].to_vec()
    }

    #[test]
    fn synthesized_header_parses_as_vxlan_with_valid_checksum() {
        let dg = datagram(100);
        let src = SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 2), 54321);
        let dst = SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 1), 4789);
        let mut f = vec![0u8; SYNTH_HDR_LEN + dg.len()];
        write_outer_header(&mut f, src, dst, dg.len());
        f[SYNTH_HDR_LEN..].copy_from_slice(&dg);
        assert_eq!(csum::checksum(0, &f[14..34]), 0, "IPv4 header checksum");
        let p = parse_frame(&f).unwrap();
        let ip = p.ip().unwrap();
        assert_eq!(&f[ip.src_range()], &[198, 18, 0, 2]);
        assert_eq!(&f[ip.dst_range()], &[198, 18, 0, 1]);
        assert_eq!(ip.end as usize, f.len());
        assert!(
            matches!(ip.l4, L4::Udp { sport: 54321, dport: 4789, len } if len as usize == 8 + dg.len())
        );
        let vx = p.vxlan.unwrap();
        assert_eq!(vx.vni, 100);
        assert_eq!(p.vxlan_inner(&f).unwrap(), &inner()[..]);
    }

    #[test]
    fn synthesized_dport_is_vxlan_whatever_the_socket_port() {
        let dg = datagram(7);
        let mut f = vec![0u8; SYNTH_HDR_LEN + dg.len()];
        let a = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 40001);
        let b = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 40002);
        write_outer_header(&mut f, a, b, dg.len());
        f[SYNTH_HDR_LEN..].copy_from_slice(&dg);
        assert_eq!(parse_frame(&f).unwrap().vxlan.unwrap().vni, 7);
    }

    #[test]
    fn tx_target_of_an_encapsulated_frame() {
        let f = vxlan_wrap([198, 18, 0, 1], [198, 18, 0, 2], 50123, 100, &inner());
        let t = tx_target(&f, None).unwrap();
        assert_eq!(t.dst, SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 2), 4789));
        assert_eq!(t.payload, VXLAN_V4_OVERHEAD - 8..f.len());
        assert_eq!(&f[t.payload.clone()][8..], &inner()[..]);
        let t = tx_target(&f, Some(5555)).unwrap();
        assert_eq!(t.dst.port(), 5555);
    }

    #[test]
    fn tx_target_ignores_ethernet_padding() {
        let mut f = vxlan_wrap([198, 18, 0, 1], [198, 18, 0, 2], 50123, 100, &inner());
        let len = f.len();
        f.extend_from_slice(&[0u8; 6]);
        assert_eq!(tx_target(&f, None).unwrap().payload.end, len);
    }

    #[test]
    fn frames_that_are_not_ipv4_vxlan_are_unsendable() {
        // A decapped inner frame: plain UDP to port 7.
        assert_eq!(tx_target(&inner(), None), None);
        // IPv6 outer UDP to 4789.
        let v6 = ip_frame(
            Addr::V6([0x20, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]),
            Addr::V6([0x20, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]),
            L4Spec::Udp {
                sport: 50000,
                dport: 4789,
            },
            &datagram(1),
        );
        assert!(parse_frame(&v6).unwrap().vxlan.is_some());
        assert_eq!(tx_target(&v6, None), None);
        // Outer destination 0.0.0.0.
        let f = vxlan_wrap([198, 18, 0, 1], [0, 0, 0, 0], 50123, 100, &inner());
        assert_eq!(tx_target(&f, None), None);
        // Garbage and truncation.
        assert_eq!(tx_target(&[0u8; 10], None), None);
        let f = vxlan_wrap([198, 18, 0, 1], [198, 18, 0, 2], 50123, 100, &inner());
        assert_eq!(tx_target(&f[..45], None), None);
    }

    #[test]
    fn sockaddr_round_trip() {
        let a = SocketAddrV4::new(Ipv4Addr::new(198, 18, 0, 1), 4789);
        assert_eq!(from_sockaddr(&to_sockaddr(a)), Some(a));
        assert_eq!(from_sockaddr(&SOCKADDR_ZERO), None);
    }
}
