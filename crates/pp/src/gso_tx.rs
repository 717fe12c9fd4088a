//! [`PacketGsoTx`]: the transmit side of a copy-mode AF_XDP port through an AF_PACKET
//! socket with virtio-net headers, so that a run of VXLAN datagrams to one VTEP leaves
//! as one UDP GSO skb instead of one skb per frame.
//!
//! Why not the TX ring: copy-mode AF_XDP (a veth, or a driver without zero-copy) builds
//! one skb per TX descriptor in `__xsk_generic_xmit` and sends each through the device
//! on its own; AF_XDP frames have no segmentation offload. A TCP flow's segments reach
//! PP back to back and, after its rule, leave back to back with the same outer headers
//! (the outer source port carries the inner flow's hash) and of the same size. A packet
//! socket with `PACKET_VNET_HDR` takes such a run as one message whose `virtio_net_hdr`
//! says `GSO_UDP_L4`: one skb through the qdisc and the driver's transmit, cut into
//! datagrams only where a device cannot take it whole (`validate_xmit_skb`), as the
//! UDP socket backend's `UDP_SEGMENT` sends are, but with the header PP wrote byte for
//! byte (MACs, addresses, the per-flow source port), and without a route lookup.
//!
//! Why not a library: no maintained crate wraps packet sockets with virtio-net headers;
//! the socket calls are few and the run planning is the product.
//!
//! A run is a sequence of frames that are Ethernet, IPv4 (no options, not a fragment)
//! and UDP, with the same Ethernet header, TOS, DF, TTL, addresses and ports, each
//! carrying `seg` bytes of UDP payload but the last, which carries at most `seg`: what
//! the kernel's UDP segmentation gives back (`__udp_gso_segment` with `gso_size = seg`,
//! IP ids counting up from the first frame's). At most [`MAX_GSO_SEGS`] frames and an
//! IP length of 65,535. The first frame's header becomes the run's: IP total length,
//! IP checksum (a router checks it if the device forwards the skb whole), UDP length,
//! and a UDP checksum the device finishes (`VIRTIO_NET_HDR_F_NEEDS_CSUM`; the kernel
//! refuses UDP GSO without it). A VXLAN frame sent with a zero UDP checksum therefore
//! leaves with a computed one, which RFC 7348 allows. A run of one frame is sent as it
//! is, with an empty virtio-net header.
//!
//! The socket is bound to the interface with protocol 0, so it receives nothing.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use packet::csum;

/// Ethernet + IPv4 without options + UDP.
const HDRS: usize = 14 + 20 + 8;
/// The IPv4 header's offset.
const IP: usize = 14;
/// The UDP header's offset.
const UDP: usize = IP + 20;

/// Most frames in one GSO message (the kernel's `UDP_MAX_SEGMENTS` is 64 before 6.17 and
/// 128 since; the smaller holds everywhere).
pub const MAX_GSO_SEGS: usize = 64;

/// Most messages per `sendmmsg`.
const MAX_MSGS: usize = 64;

/// `struct virtio_net_hdr` (10 bytes, host byte order on a little-endian host, which
/// is what packet sockets use).
const VNET_HDR_LEN: usize = 10;
const VIRTIO_NET_HDR_F_NEEDS_CSUM: u8 = 1;
const VIRTIO_NET_HDR_GSO_UDP_L4: u8 = 5;
/// `PACKET_VNET_HDR` (linux/if_packet.h), not in the libc crate for every target.
const PACKET_VNET_HDR: libc::c_int = 15;

/// One planned message: `count` frames from index `first` of the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub first: usize,
    pub count: usize,
    /// UDP payload bytes of every frame but the last (the GSO segment size).
    pub seg: usize,
    /// UDP payload bytes of the whole run.
    pub payload: usize,
    /// Bytes of the run's frames as they were handed in (what leaves the device).
    pub bytes: usize,
}

/// Counters of a [`PacketGsoTx`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GsoTxStats {
    /// Frames the socket took (one per datagram that leaves), and their bytes.
    pub frames: u64,
    pub bytes: u64,
    /// Messages of more than one frame (one GSO skb each).
    pub gso_sends: u64,
    /// Frames sent inside them.
    pub gso_segments: u64,
    /// GSO messages the kernel refused, re-sent one frame per message.
    pub gso_fallbacks: u64,
    /// `sendmmsg` calls.
    pub syscalls: u64,
    /// Frames dropped: the kernel refused their message (device queue full, no buffer
    /// space, or refused even alone).
    pub dropped: u64,
}

/// UDP payload length of a frame that can be part of a run, `None` for any other frame.
fn gso_payload(f: &[u8]) -> Option<usize> {
    if f.len() <= HDRS || f[12..14] != [0x08, 0x00] || f[IP] != 0x45 || f[IP + 9] != 17 {
        return None;
    }
    // Neither MF nor a fragment offset.
    if csum::get16(f, IP + 6) & 0x3fff != 0 {
        return None;
    }
    let ip_len = csum::get16(f, IP + 2) as usize;
    let udp_len = csum::get16(f, UDP + 4) as usize;
    (ip_len == f.len() - IP && udp_len == ip_len - 20).then(|| f.len() - HDRS)
}

/// Whether `b` has the header of `a` (everything the segmenter copies from the first
/// frame into every datagram, but the lengths, the IP id and the checksums).
fn same_header(a: &[u8], b: &[u8]) -> bool {
    a.len() >= HDRS
        && b.len() >= HDRS
        && a[..IP] == b[..IP]
        && a[IP + 1] == b[IP + 1]
        && a[IP + 6..IP + 10] == b[IP + 6..IP + 10]
        && a[IP + 12..UDP + 4] == b[IP + 12..UDP + 4]
}

/// Whether frames `a` and `b` belong to one outer flow in the sense of [`plan_runs`]
/// (both can be in a run, with the same header): what must leave in order.
pub fn same_flow(a: &[u8], b: &[u8]) -> bool {
    gso_payload(a).is_some() && gso_payload(b).is_some() && same_header(a, b)
}

/// Cut a batch of frames (`(start, len)` in `region`, in sending order) into runs.
/// Frames keep their order; every frame is in exactly one run.
pub fn plan_runs(region: &[u8], frames: &[(usize, usize)], runs: &mut Vec<Run>) {
    runs.clear();
    let frame = |i: usize| &region[frames[i].0..frames[i].0 + frames[i].1];
    let mut i = 0;
    while i < frames.len() {
        let first = frame(i);
        let Some(seg) = gso_payload(first).filter(|&s| s > 0) else {
            runs.push(Run {
                first: i,
                count: 1,
                seg: 0,
                payload: 0,
                bytes: first.len(),
            });
            i += 1;
            continue;
        };
        let mut run = Run {
            first: i,
            count: 1,
            seg,
            payload: seg,
            bytes: first.len(),
        };
        let mut last = seg;
        while last == seg && run.count < MAX_GSO_SEGS && i + run.count < frames.len() {
            let next = frame(i + run.count);
            let Some(p) = gso_payload(next) else { break };
            if p == 0 || p > seg || 28 + run.payload + p > 65_535 || !same_header(first, next) {
                break;
            }
            run.count += 1;
            run.payload += p;
            run.bytes += next.len();
            last = p;
        }
        i += run.count;
        runs.push(run);
    }
}

/// Rewrite the first frame of a run of more than one into the run's header: lengths of
/// the whole, the IP checksum over them, and the UDP checksum's pseudo-header part
/// (folded, not complemented) for the device to finish.
fn write_run_header(f: &mut [u8], payload: usize) {
    let udp_len = (8 + payload) as u16;
    let ip_len = udp_len + 20;
    csum::put16(f, IP + 2, ip_len);
    csum::put16(f, IP + 10, 0);
    let c = csum::checksum(0, &f[IP..UDP]);
    csum::put16(f, IP + 10, c);
    csum::put16(f, UDP + 4, udp_len);
    let src: [u8; 4] = f[IP + 12..IP + 16].try_into().expect("4 bytes");
    let dst: [u8; 4] = f[IP + 16..IP + 20].try_into().expect("4 bytes");
    let pseudo = csum::fold(csum::pseudo_v4(&src, &dst, 17, udp_len));
    csum::put16(f, UDP + 6, pseudo);
}

fn vnet_hdr(seg: usize) -> [u8; VNET_HDR_LEN] {
    let mut h = [0u8; VNET_HDR_LEN];
    if seg > 0 {
        h[0] = VIRTIO_NET_HDR_F_NEEDS_CSUM;
        h[1] = VIRTIO_NET_HDR_GSO_UDP_L4;
        h[2..4].copy_from_slice(&(HDRS as u16).to_le_bytes()); // hdr_len
        h[4..6].copy_from_slice(&(seg as u16).to_le_bytes()); // gso_size
        h[6..8].copy_from_slice(&(UDP as u16).to_le_bytes()); // csum_start
        h[8..10].copy_from_slice(&6u16.to_le_bytes()); // csum_offset
    }
    h
}

/// The packet socket of one AF_XDP port; see the module docs.
pub struct PacketGsoTx {
    fd: OwnedFd,
    addr: libc::sockaddr_ll,
    stats: GsoTxStats,
    hdrs: Vec<[u8; VNET_HDR_LEN]>,
    iovs: Vec<libc::iovec>,
    /// Where each message's iovecs start in `iovs`.
    iov_at: Vec<usize>,
    msgs: Vec<libc::mmsghdr>,
}

// SAFETY: the raw pointers in the scratch `iovs`/`msgs` are rebuilt for every send and
// never dereferenced outside it; the socket is an fd.
unsafe impl Send for PacketGsoTx {}

impl PacketGsoTx {
    /// Open a packet socket with virtio-net headers on interface `ifindex`, in the
    /// caller's network namespace. Needs CAP_NET_RAW.
    pub fn open(ifindex: u32) -> std::io::Result<Self> {
        // SAFETY: plain socket(2); the fd is owned below.
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a new fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let set = |level, opt, v| crate::udp::set_int_opt(fd.as_raw_fd(), level, opt, v);
        set(libc::SOL_PACKET, PACKET_VNET_HDR, 1)?;
        // A full batch of 64 KiB messages is in flight at once; the default send buffer
        // (212,992 bytes) would refuse most of it. FORCE needs CAP_NET_ADMIN; without it,
        // the capped SO_SNDBUF.
        let want = 8 << 20;
        if set(libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, want).is_err() {
            set(libc::SOL_SOCKET, libc::SO_SNDBUF, want)?;
        }
        // SAFETY: sockaddr_ll is plain data; all-zero is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = ifindex as i32;
        // Protocol 0: bound for sending only; no frame is ever queued to this socket.
        // SAFETY: a valid fd and a sockaddr_ll that lives for the call.
        let r = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Each message names the protocol (the skb's, for the GSO checks) and the device.
        addr.sll_protocol = (libc::ETH_P_IP as u16).to_be();
        Ok(PacketGsoTx {
            fd,
            addr,
            stats: GsoTxStats::default(),
            hdrs: Vec::with_capacity(MAX_MSGS),
            iovs: Vec::with_capacity(MAX_MSGS * 4),
            iov_at: Vec::with_capacity(MAX_MSGS),
            msgs: Vec::with_capacity(MAX_MSGS),
        })
    }

    pub fn stats(&self) -> GsoTxStats {
        self.stats
    }

    /// Send `runs` of `frames` (`(start, len)` in `region`; the runs from
    /// [`plan_runs`] over them, or some of them) and return how many frames the kernel
    /// took; the rest are counted in `dropped`. The first frame of each run of more than
    /// one is rewritten in place (`write_run_header`); every frame is free again on
    /// return (the kernel copies what it sends).
    pub fn send(&mut self, region: &mut [u8], frames: &[(usize, usize)], runs: &[Run]) -> usize {
        let before = self.stats.frames;
        for chunk in runs.chunks(MAX_MSGS) {
            for r in chunk.iter().filter(|r| r.count > 1) {
                let (s, l) = frames[r.first];
                write_run_header(&mut region[s..s + l], r.payload);
            }
            self.send_chunk(region, frames, chunk);
        }
        (self.stats.frames - before) as usize
    }

    /// One `sendmmsg` per pass over `chunk`'s runs; a message the kernel refuses is
    /// dropped (no room) or, for a GSO message it will not take (`EINVAL`, `EIO`,
    /// `EOPNOTSUPP`), re-sent one frame per message.
    fn send_chunk(&mut self, region: &[u8], frames: &[(usize, usize)], chunk: &[Run]) {
        self.hdrs.clear();
        self.iovs.clear();
        self.msgs.clear();
        for r in chunk {
            self.hdrs
                .push(vnet_hdr(if r.count > 1 { r.seg } else { 0 }));
        }
        // iovecs: per run, its virtio-net header, the first frame whole, then the UDP
        // payload of every other frame (their headers are the segmenter's to write).
        let mut iov_at = std::mem::take(&mut self.iov_at);
        iov_at.clear();
        for (k, r) in chunk.iter().enumerate() {
            iov_at.push(self.iovs.len());
            self.iovs.push(libc::iovec {
                iov_base: self.hdrs[k].as_ptr() as *mut libc::c_void,
                iov_len: VNET_HDR_LEN,
            });
            for j in 0..r.count {
                let (s, l) = frames[r.first + j];
                let skip = if j == 0 { 0 } else { HDRS };
                self.iovs.push(libc::iovec {
                    iov_base: region[s + skip..].as_ptr() as *mut libc::c_void,
                    iov_len: l - skip,
                });
            }
        }
        for (k, r) in chunk.iter().enumerate() {
            // SAFETY: msghdr is plain data; all-zero is a valid value.
            let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
            h.msg_name = (&self.addr as *const libc::sockaddr_ll) as *mut libc::c_void;
            h.msg_namelen = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
            // SAFETY: the run's iovecs are in bounds of `iovs`, which is not resized
            // until the sends below are done.
            h.msg_iov = unsafe { self.iovs.as_mut_ptr().add(iov_at[k]) };
            h.msg_iovlen = 1 + r.count;
            self.msgs.push(libc::mmsghdr {
                msg_hdr: h,
                msg_len: 0,
            });
        }
        self.iov_at = iov_at;
        let mut at = 0;
        while at < chunk.len() {
            self.stats.syscalls += 1;
            // SAFETY: every msghdr points at `addr`, at iovecs of `iovs` and through them
            // at `hdrs` and `region`, all alive and unmoved for the call.
            let n = unsafe {
                libc::sendmmsg(
                    self.fd.as_raw_fd(),
                    self.msgs.as_mut_ptr().add(at),
                    (chunk.len() - at) as libc::c_uint,
                    libc::MSG_DONTWAIT,
                )
            };
            if n > 0 {
                for r in &chunk[at..at + n as usize] {
                    self.took(r);
                }
                at += n as usize;
                continue;
            }
            let e = std::io::Error::last_os_error();
            let r = chunk[at];
            let refused_gso = r.count > 1
                && matches!(
                    e.raw_os_error(),
                    Some(libc::EINVAL) | Some(libc::EIO) | Some(libc::EOPNOTSUPP)
                );
            if refused_gso {
                self.stats.gso_fallbacks += 1;
                tracing::debug!(error = %e, frames = r.count, "GSO message refused; one frame per message");
                self.send_singles(region, frames, r);
            } else {
                tracing::trace!(error = %e, frames = r.count, "packet socket send refused");
                self.stats.dropped += r.count as u64;
            }
            at += 1;
        }
    }

    fn took(&mut self, r: &Run) {
        self.stats.frames += r.count as u64;
        self.stats.bytes += r.bytes as u64;
        if r.count > 1 {
            self.stats.gso_sends += 1;
            self.stats.gso_segments += r.count as u64;
        }
    }

    /// Send a refused run's frames one per `sendmsg`. The first frame's header was
    /// rewritten for the run, so its lengths and checksums are made its own again.
    fn send_singles(&mut self, region: &[u8], frames: &[(usize, usize)], r: Run) {
        let hdr = vnet_hdr(0);
        for j in 0..r.count {
            let (s, l) = frames[r.first + j];
            let mut first = [0u8; HDRS];
            let iov2: &[u8] = if j == 0 {
                first.copy_from_slice(&region[s..s + HDRS]);
                let ip_len = (l - IP) as u16;
                csum::put16(&mut first, IP + 2, ip_len);
                csum::put16(&mut first, IP + 10, 0);
                let c = csum::checksum(0, &first[IP..UDP]);
                csum::put16(&mut first, IP + 10, c);
                csum::put16(&mut first, UDP + 4, ip_len - 20);
                let src: [u8; 4] = first[IP + 12..IP + 16].try_into().expect("4 bytes");
                let dst: [u8; 4] = first[IP + 16..IP + 20].try_into().expect("4 bytes");
                let u = csum::checksum(
                    csum::pseudo_v4(&src, &dst, 17, ip_len - 20),
                    &[&first[UDP..UDP + 6], &region[s + HDRS..s + l]].concat(),
                );
                csum::put16(&mut first, UDP + 6, if u == 0 { 0xffff } else { u });
                &first
            } else {
                &region[s..s + HDRS]
            };
            let iov = [
                libc::iovec {
                    iov_base: hdr.as_ptr() as *mut libc::c_void,
                    iov_len: VNET_HDR_LEN,
                },
                libc::iovec {
                    iov_base: iov2.as_ptr() as *mut libc::c_void,
                    iov_len: HDRS,
                },
                libc::iovec {
                    iov_base: region[s + HDRS..].as_ptr() as *mut libc::c_void,
                    iov_len: l - HDRS,
                },
            ];
            // SAFETY: msghdr is plain data; all-zero is a valid value.
            let mut h: libc::msghdr = unsafe { std::mem::zeroed() };
            h.msg_name = (&self.addr as *const libc::sockaddr_ll) as *mut libc::c_void;
            h.msg_namelen = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
            h.msg_iov = iov.as_ptr() as *mut libc::iovec;
            h.msg_iovlen = iov.len();
            self.stats.syscalls += 1;
            // SAFETY: `h` points at `addr` and `iov`, which point at live buffers.
            let n = unsafe { libc::sendmsg(self.fd.as_raw_fd(), &h, libc::MSG_DONTWAIT) };
            if n < 0 {
                self.stats.dropped += 1;
            } else {
                self.stats.frames += 1;
                self.stats.bytes += l as u64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An Ethernet/IPv4/UDP frame with `payload` bytes of UDP payload.
    fn frame(src_port: u16, payload: usize, fill: u8) -> Vec<u8> {
        let mut f = vec![0u8; HDRS + payload];
        f[..6].copy_from_slice(&[2, 0, 0, 0, 0, 2]);
        f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
        f[12..14].copy_from_slice(&[8, 0]);
        f[IP] = 0x45;
        csum::put16(&mut f, IP + 2, (20 + 8 + payload) as u16);
        csum::put16(&mut f, IP + 6, 0x4000);
        f[IP + 8] = 64;
        f[IP + 9] = 17;
        f[IP + 12..IP + 16].copy_from_slice(&[198, 18, 0, 1]);
        f[IP + 16..IP + 20].copy_from_slice(&[198, 18, 0, 2]);
        let c = csum::checksum(0, &f[IP..UDP]);
        csum::put16(&mut f, IP + 10, c);
        csum::put16(&mut f, UDP, src_port);
        csum::put16(&mut f, UDP + 2, 4789);
        csum::put16(&mut f, UDP + 4, (8 + payload) as u16);
        f[HDRS..].fill(fill);
        f
    }

    fn batch(fs: &[Vec<u8>]) -> (Vec<u8>, Vec<(usize, usize)>) {
        let mut region = Vec::new();
        let mut at = Vec::new();
        for f in fs {
            at.push((region.len(), f.len()));
            region.extend_from_slice(f);
        }
        (region, at)
    }

    fn counts(fs: &[Vec<u8>]) -> Vec<usize> {
        let (region, at) = batch(fs);
        let mut runs = Vec::new();
        plan_runs(&region, &at, &mut runs);
        let mut next = 0;
        for r in &runs {
            assert_eq!(r.first, next, "runs cover the batch in order: {runs:?}");
            next += r.count;
        }
        assert_eq!(next, fs.len());
        runs.iter().map(|r| r.count).collect()
    }

    #[test]
    fn runs_split_at_a_new_header_a_larger_frame_or_after_a_short_one() {
        let a = |p| frame(1000, p, 1);
        let b = |p| frame(2000, p, 2);
        assert_eq!(counts(&[a(100), a(100), a(100)]), [3]);
        // A shorter frame ends a run; the next starts another.
        assert_eq!(counts(&[a(100), a(50), a(100)]), [2, 1]);
        // A larger frame cannot follow the segment size.
        assert_eq!(counts(&[a(50), a(100), a(100)]), [1, 2]);
        // Another outer source port is another run.
        assert_eq!(counts(&[a(100), b(100), b(100), a(100)]), [1, 2, 1]);
        // Not UDP over IPv4 without options: alone.
        let mut arp = a(100);
        arp[12..14].copy_from_slice(&[8, 6]);
        let mut frag = a(100);
        csum::put16(&mut frag, IP + 6, 0x2000);
        assert_eq!(counts(&[arp, a(100), frag, a(100)]), [1, 1, 1, 1]);
        // Lengths that disagree with the frame (padding) keep a frame alone.
        let mut padded = a(100);
        padded.extend_from_slice(&[0; 4]);
        assert_eq!(counts(&[a(100), padded, a(100)]), [1, 1, 1]);
    }

    #[test]
    fn runs_respect_the_segment_and_length_limits() {
        let many: Vec<_> = (0..MAX_GSO_SEGS + 5).map(|_| frame(7, 100, 0)).collect();
        assert_eq!(counts(&many), [MAX_GSO_SEGS, 5]);
        // 1,450-byte payloads: 45 fit under an IP length of 65,535 (28 + 45 × 1,450 =
        // 65,278), the 46th does not.
        let big: Vec<_> = (0..50).map(|_| frame(7, 1450, 0)).collect();
        assert_eq!(counts(&big), [45, 5]);
    }

    #[test]
    fn a_run_header_is_what_the_segmenter_expects() {
        let fs: Vec<_> = (0..3).map(|i| frame(7, 100, i)).collect();
        let (mut region, at) = batch(&fs);
        let mut runs = Vec::new();
        plan_runs(&region, &at, &mut runs);
        assert_eq!(runs.len(), 1);
        write_run_header(&mut region[..at[0].1], runs[0].payload);
        let f = &region[..HDRS];
        assert_eq!(csum::get16(f, IP + 2), 20 + 8 + 300);
        assert_eq!(csum::get16(f, UDP + 4), 8 + 300);
        // The IP header checks.
        assert_eq!(csum::fold(csum::sum(&f[IP..UDP])), 0xffff);
        // The UDP field holds the pseudo-header sum: finishing it over the whole
        // datagram (header with that field, then the payloads) gives a checksum that
        // verifies.
        let mut dgram = f[UDP..].to_vec();
        for (s, l) in &at {
            dgram.extend_from_slice(&region[s + HDRS..s + l]);
        }
        let partial = csum::get16(&dgram, 6) as u64;
        csum::put16(&mut dgram, 6, 0);
        let full = csum::checksum(partial, &dgram);
        csum::put16(&mut dgram, 6, full);
        let src: [u8; 4] = f[IP + 12..IP + 16].try_into().unwrap();
        let dst: [u8; 4] = f[IP + 16..IP + 20].try_into().unwrap();
        let check = csum::fold(csum::pseudo_v4(&src, &dst, 17, 308) + csum::sum(&dgram));
        assert_eq!(check, 0xffff);
    }

    /// Any batch, however malformed its frames: the runs partition it in order, and
    /// every run is what the segmenter can give back (one header, the segment size but
    /// a shorter last, the limits). No panic.
    #[test]
    fn runs_of_arbitrary_frames_are_always_sound() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
        for _ in 0..3000 {
            let n = rng.gen_range(0..80);
            let fs: Vec<Vec<u8>> = (0..n)
                .map(|_| {
                    let mut f = match rng.gen_range(0..4) {
                        0 => (0..rng.gen_range(0..80)).map(|_| rng.gen()).collect(),
                        1 => frame(rng.gen_range(1..3), rng.gen_range(0..1500), 0),
                        _ => frame(7, [0, 1, 100, 1450][rng.gen_range(0..4)], 1),
                    };
                    // Now and then a byte of the header changed at random.
                    if rng.gen_bool(0.1) && !f.is_empty() {
                        let i = rng.gen_range(0..f.len().min(HDRS));
                        f[i] = rng.gen();
                    }
                    f
                })
                .collect();
            let (region, at) = batch(&fs);
            let mut runs = Vec::new();
            plan_runs(&region, &at, &mut runs);
            let mut next = 0;
            for r in &runs {
                assert_eq!(r.first, next);
                assert!(r.count >= 1 && r.count <= MAX_GSO_SEGS);
                next += r.count;
                let f = |j: usize| &fs[r.first + j];
                assert_eq!(r.bytes, (0..r.count).map(|j| f(j).len()).sum::<usize>());
                if r.count == 1 {
                    continue;
                }
                assert!(28 + r.payload <= 65_535);
                for j in 0..r.count {
                    let p = gso_payload(f(j)).expect("a run's frames are UDP over IPv4");
                    assert!(same_flow(f(0), f(j)));
                    if j + 1 < r.count {
                        assert_eq!(p, r.seg);
                    } else {
                        assert!(p >= 1 && p <= r.seg);
                    }
                }
            }
            assert_eq!(next, fs.len());
        }
    }

    #[test]
    fn vnet_header_says_udp_gso_only_for_runs() {
        assert_eq!(vnet_hdr(0), [0; VNET_HDR_LEN]);
        let h = vnet_hdr(1450);
        assert_eq!((h[0], h[1]), (1, 5));
        assert_eq!(u16::from_le_bytes([h[2], h[3]]), 42);
        assert_eq!(u16::from_le_bytes([h[4], h[5]]), 1450);
        assert_eq!(u16::from_le_bytes([h[6], h[7]]), 34);
        assert_eq!(u16::from_le_bytes([h[8], h[9]]), 6);
    }
}
