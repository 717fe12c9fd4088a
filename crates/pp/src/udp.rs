//! [`UdpVxlanIo`]: a [`PacketIo`] backend over an ordinary UDP socket on the VXLAN port,
//! batched with `recvmmsg`/`sendmmsg`.
//!
//! The pipeline works on whole Ethernet frames, but a UDP socket sees only the VXLAN
//! datagram. So RX writes each datagram into a frame slot behind a synthesized outer
//! Ethernet/IPv4/UDP header (source = the datagram's sender, destination = the socket),
//! and TX parses the outer headers of each output frame to find where to send its UDP
//! payload.
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
use std::time::Duration;

use packet::csum::{checksum, put16};
use packet::{ethertype, parse_frame, proto, IpVersion, L3, L4, VXLAN_PORT};
use pipeline::{Desc, IoError, PacketIo, Verdict, FRAME_SIZE, HEADROOM, MAX_FRAME};
use thiserror::Error;

/// Outer Ethernet (14) + IPv4 (20) + UDP (8) header synthesized in front of a datagram.
pub const SYNTH_HDR_LEN: usize = 14 + 20 + 8;
/// Largest datagram a slot holds behind the headroom and the synthesized header.
pub const MAX_DATAGRAM: usize = MAX_FRAME - SYNTH_HDR_LEN;
/// Most datagrams moved by one `recvmmsg`/`sendmmsg` call, and the most frame slots.
pub const MAX_IO_BATCH: usize = 64;

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
    /// Frame slots, i.e. the largest RX batch (at most [`MAX_IO_BATCH`]).
    pub slots: usize,
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
    #[error("frame slots {0} not in 1..={MAX_IO_BATCH}")]
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

/// A PP port over a UDP socket; see the module docs for what it can and cannot do.
pub struct UdpVxlanIo {
    sock: UdpSocket,
    local: SocketAddrV4,
    cfg: UdpVxlanConfig,
    /// `slots` frame slots of [`FRAME_SIZE`] bytes, laid out like `MemRing`'s.
    region: Vec<u8>,
    stats: UdpVxlanStats,
}

impl UdpVxlanIo {
    pub fn bind(cfg: UdpVxlanConfig) -> Result<Self, UdpVxlanError> {
        if cfg.slots == 0 || cfg.slots > MAX_IO_BATCH {
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
        tracing::info!(%local, peer_port = ?cfg.peer_port, "UDP VXLAN port bound");
        Ok(UdpVxlanIo {
            sock,
            local,
            region: vec![0u8; cfg.slots * FRAME_SIZE],
            cfg,
            stats: UdpVxlanStats::default(),
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

    /// Sends `descs`, whose frames are in `region` (this socket's own slots when `None`).
    #[inline]
    fn send(&mut self, region: Option<&[u8]>, descs: &[Desc]) -> usize {
        let region = region.unwrap_or(&self.region);
        send_frames(
            self.sock.as_raw_fd(),
            self.local,
            self.cfg.peer_port,
            &mut self.stats,
            region,
            descs,
        )
    }

    /// One non-blocking `recvmmsg` of up to `want` datagrams into the slots; returns the
    /// count received.
    fn recv_batch(&mut self, want: usize, descs: &mut Vec<Desc>) -> Result<usize, IoError> {
        let mut names = [SOCKADDR_ZERO; MAX_IO_BATCH];
        let mut iov = [IOVEC_ZERO; MAX_IO_BATCH];
        let mut msgs = [MMSG_ZERO; MAX_IO_BATCH];
        let data_off = HEADROOM + SYNTH_HDR_LEN;
        let base_ptr = self.region.as_mut_ptr();
        for i in 0..want {
            iov[i].iov_base = base_ptr.wrapping_add(i * FRAME_SIZE + data_off).cast();
            iov[i].iov_len = MAX_DATAGRAM;
            let h = &mut msgs[i].msg_hdr;
            h.msg_name = (&mut names[i] as *mut libc::sockaddr_in).cast();
            h.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            h.msg_iov = &mut iov[i];
            h.msg_iovlen = 1;
        }
        // SAFETY: `msgs[..want]` point at `names`, `iov` (both live for the call) and,
        // through `iov`, at disjoint `MAX_DATAGRAM`-byte ranges inside `self.region`
        // (slot i spans [i*FRAME_SIZE, (i+1)*FRAME_SIZE) and data_off + MAX_DATAGRAM ==
        // FRAME_SIZE), which nothing else borrows during the call.
        let r = unsafe {
            libc::recvmmsg(
                self.sock.as_raw_fd(),
                msgs.as_mut_ptr(),
                want as libc::c_uint,
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
            let base = i * FRAME_SIZE;
            let hdr = base + HEADROOM;
            write_outer_header(
                &mut self.region[hdr..hdr + SYNTH_HDR_LEN],
                src,
                self.local,
                len,
            );
            descs.push(Desc::new(
                base,
                HEADROOM,
                SYNTH_HDR_LEN + len,
                FRAME_SIZE,
                0,
            ));
            self.stats.rx_packets += 1;
            self.stats.rx_bytes += len as u64;
        }
        Ok(n)
    }

    /// Wait up to the poll timeout for the socket to become readable.
    fn wait_readable(&self) -> Result<bool, IoError> {
        let mut pfd = libc::pollfd {
            fd: self.sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = self.cfg.poll_timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
        // SAFETY: one valid pollfd that lives for the call.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r < 0 {
            let e = errno();
            // A signal (Ctrl-C) wakes us: report no packets so the loop checks its flag.
            return if e.raw_os_error() == Some(libc::EINTR) {
                Ok(false)
            } else {
                Err(IoError::Os(e))
            };
        }
        Ok(r > 0)
    }
}

/// Send every `Tx` descriptor's UDP payload, [`MAX_IO_BATCH`] per `sendmmsg`.
fn send_frames(
    fd: RawFd,
    local: SocketAddrV4,
    peer_port: Option<u16>,
    stats: &mut UdpVxlanStats,
    region: &[u8],
    descs: &[Desc],
) -> usize {
    let mut sent_total = 0;
    let mut tx = descs
        .iter()
        .filter(|d| matches!(d.verdict, Verdict::Tx(_)))
        .peekable();
    while tx.peek().is_some() {
        let mut names = [SOCKADDR_ZERO; MAX_IO_BATCH];
        let mut iov = [IOVEC_ZERO; MAX_IO_BATCH];
        let mut msgs = [MMSG_ZERO; MAX_IO_BATCH];
        let mut lens = [0usize; MAX_IO_BATCH];
        let mut count = 0;
        for d in tx.by_ref() {
            let frame = d.data(region);
            let Some(t) = tx_target(frame, peer_port).filter(|t| t.dst != local) else {
                stats.tx_unsendable += 1;
                tracing::trace!(len = frame.len(), "output frame is not IPv4 VXLAN; dropped");
                continue;
            };
            let payload = &frame[t.payload];
            names[count] = to_sockaddr(t.dst);
            // sendmmsg only reads through iov_base; the *mut is what the C struct wants.
            iov[count].iov_base = payload.as_ptr() as *mut libc::c_void;
            iov[count].iov_len = payload.len();
            lens[count] = payload.len();
            count += 1;
            if count == MAX_IO_BATCH {
                break;
            }
        }
        for i in 0..count {
            let h = &mut msgs[i].msg_hdr;
            h.msg_name = (&mut names[i] as *mut libc::sockaddr_in).cast();
            h.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
            h.msg_iov = &mut iov[i];
            h.msg_iovlen = 1;
        }
        let mut done = 0;
        while done < count {
            // SAFETY: `msgs[done..count]` point at `names` and `iov` (live for the call),
            // and through `iov` at payload ranges of `region`, which is borrowed shared
            // for the whole function; sendmmsg only reads them.
            let r = unsafe {
                libc::sendmmsg(
                    fd,
                    msgs.as_mut_ptr().add(done),
                    (count - done) as libc::c_uint,
                    libc::MSG_DONTWAIT,
                )
            };
            if r > 0 {
                let r = r as usize;
                stats.tx_packets += r as u64;
                stats.tx_bytes += lens[done..done + r].iter().sum::<usize>() as u64;
                sent_total += r;
                done += r;
                continue;
            }
            let e = errno();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                // The socket buffer or the device queue is full: the rest of this batch
                // would meet the same, so drop it as a full NIC ring would.
                Some(libc::EAGAIN) | Some(libc::ENOBUFS) => {
                    stats.tx_dropped += (count - done) as u64;
                    tracing::debug!(dropped = count - done, error = %e, "send queue full");
                    done = count;
                }
                // This message's fault (no route, too long, ...): skip it, send the rest.
                _ => {
                    stats.tx_errors += 1;
                    tracing::debug!(error = %e, dst = ?from_sockaddr(&names[done]), "send failed");
                    done += 1;
                }
            }
        }
    }
    sent_total
}

impl PacketIo for UdpVxlanIo {
    fn rx(&mut self, descs: &mut Vec<Desc>, max: usize) -> Result<usize, IoError> {
        descs.clear();
        let want = max.min(self.cfg.slots);
        if want == 0 {
            return Ok(0);
        }
        if self.recv_batch(want, descs)? == 0 && self.wait_readable()? {
            self.recv_batch(want, descs)?;
        }
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
