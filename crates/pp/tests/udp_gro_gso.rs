//! UDP GRO on receive and UDP GSO on send of `UdpVxlanIo`, on real sockets over
//! 127.0.0.1 (ephemeral ports).
//!
//! Loopback keeps a GSO send as one buffer all the way to a socket that accepts
//! coalesced buffers (`UDP_GRO`), which is exactly what a NIC's GRO hands such a socket;
//! a socket without `UDP_GRO` gets the buffer cut back into datagrams by the kernel. So:
//! - a hand-made `UDP_SEGMENT` send into the backend arrives as one coalesced buffer,
//!   and every segment must come out of `rx` as its own frame, in order;
//! - the backend's own GSO sends must arrive at a plain socket as separate datagrams.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::Duration;

use packet::build::{udp_v4, vxlan_wrap, VXLAN_V4_OVERHEAD};
use pipeline::{Desc, PacketIo, Verdict, FRAME_SIZE, HEADROOM};
use pp::{UdpVxlanConfig, UdpVxlanIo, SYNTH_HDR_LEN};

fn backend(slots: usize, peer_port: Option<u16>) -> UdpVxlanIo {
    let mut cfg = UdpVxlanConfig::new(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0));
    cfg.slots = slots;
    cfg.peer_port = peer_port;
    cfg.poll_timeout = Duration::from_millis(200);
    UdpVxlanIo::bind(cfg).unwrap()
}

/// Segment `i` of a burst: `len` bytes, all derived from `i`, so a segment out of place
/// or cut at the wrong offset shows.
fn segment(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i * 31 + j) as u8).collect()
}

/// Send `segs` (all of `segs[0]`'s size but maybe the last) from `sock` to `dst` as ONE
/// `sendmsg` with a `UDP_SEGMENT` control message.
fn gso_send(sock: &UdpSocket, dst: SocketAddrV4, segs: &[Vec<u8>]) {
    let payload: Vec<u8> = segs.concat();
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: dst.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*dst.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr() as *mut libc::c_void,
        iov_len: payload.len(),
    };
    let mut ctrl = [0u64; 4];
    // SAFETY: a zeroed msghdr is valid; every pointer set below points at a local that
    // outlives the sendmsg call, and the CMSG_* writes stay inside `ctrl` (32 bytes,
    // 8-aligned, room for a cmsghdr and a u16).
    let r = unsafe {
        let mut h: libc::msghdr = std::mem::zeroed();
        h.msg_name = &sa as *const libc::sockaddr_in as *mut libc::c_void;
        h.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        h.msg_iov = &mut iov;
        h.msg_iovlen = 1;
        h.msg_control = ctrl.as_mut_ptr().cast();
        h.msg_controllen = libc::CMSG_SPACE(2) as _;
        let c = libc::CMSG_FIRSTHDR(&h);
        (*c).cmsg_level = libc::SOL_UDP;
        (*c).cmsg_type = libc::UDP_SEGMENT;
        (*c).cmsg_len = libc::CMSG_LEN(2) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut u16, segs[0].len() as u16);
        libc::sendmsg(sock.as_raw_fd(), &h, 0)
    };
    assert_eq!(
        r,
        payload.len() as isize,
        "GSO sendmsg: {}",
        std::io::Error::last_os_error()
    );
}

/// `rx` until `n` frames came or a receive found nothing; the datagram of each frame.
fn receive(io: &mut UdpVxlanIo, n: usize, batch: usize) -> (Vec<Vec<u8>>, Vec<usize>) {
    let mut descs = Vec::new();
    let mut got = Vec::new();
    let mut batches = Vec::new();
    while got.len() < n {
        let k = io.rx(&mut descs, batch).unwrap();
        if k == 0 {
            break;
        }
        batches.push(k);
        let region = io.region();
        for d in &descs {
            got.push(d.data(region)[SYNTH_HDR_LEN..].to_vec());
        }
    }
    (got, batches)
}

#[test]
fn a_coalesced_gro_buffer_comes_out_as_one_frame_per_segment() {
    let mut io = backend(64, None);
    let sender = UdpSocket::bind("127.0.0.1:0").unwrap();
    // 1,400-byte segments (a VXLAN datagram of a 1,500-byte underlay is 1,472) and a
    // short tail, as a TCP flow's burst ends.
    let mut segs: Vec<Vec<u8>> = (0..20).map(|i| segment(i, 1400)).collect();
    segs.push(segment(20, 333));
    gso_send(&sender, io.local_addr(), &segs);

    let (got, _) = receive(&mut io, segs.len(), 64);
    assert_eq!(got.len(), segs.len(), "one frame per segment");
    for (i, (g, s)) in got.iter().zip(&segs).enumerate() {
        assert_eq!(g, s, "segment {i}");
    }
    let st = io.stats();
    assert_eq!(
        st.gro_buffers, 1,
        "the burst arrived as one coalesced buffer"
    );
    assert_eq!(st.gro_segments, segs.len() as u64);
    assert_eq!(st.rx_packets, segs.len() as u64);
    assert_eq!(st.rx_batches, 1, "one recvmmsg for the whole burst");
    // Every frame carries the synthesized outer header of its own length and the
    // sender's address.
    let mut descs = Vec::new();
    gso_send(&sender, io.local_addr(), &segs[..3]);
    assert_eq!(io.rx(&mut descs, 64).unwrap(), 3);
    let sport = sender.local_addr().unwrap().port();
    let region = io.region();
    let be16 = |f: &[u8], at: usize| u16::from_be_bytes([f[at], f[at + 1]]) as usize;
    for (d, s) in descs.iter().zip(&segs) {
        let f = d.data(region);
        assert_eq!(f.len(), SYNTH_HDR_LEN + s.len());
        assert_eq!(be16(f, 14 + 2), 20 + 8 + s.len(), "IPv4 total length");
        assert_eq!(be16(f, 34), sport as usize, "UDP source port");
        assert_eq!(be16(f, 34 + 4), 8 + s.len(), "UDP length");
    }
}

#[test]
fn segments_beyond_the_slots_wait_for_the_next_rx_without_a_syscall() {
    let mut io = backend(4, None);
    let sender = UdpSocket::bind("127.0.0.1:0").unwrap();
    let segs: Vec<Vec<u8>> = (0..11).map(|i| segment(i, 1000)).collect();
    gso_send(&sender, io.local_addr(), &segs);
    let (got, batches) = receive(&mut io, segs.len(), 64);
    assert_eq!(batches, vec![4, 4, 3]);
    assert_eq!(got, segs);
    assert_eq!(io.stats().rx_batches, 1);
}

/// Frames to `dst` (outer destination 127.0.0.1; the port comes from `peer_port`), each
/// a VXLAN datagram of an inner UDP packet with payload `segment(i, len)`, written into
/// `region` slots; returns Tx descriptors and each frame's VXLAN datagram.
fn frames(region: &mut [u8], lens: &[usize]) -> (Vec<Desc>, Vec<Vec<u8>>) {
    let mut descs = Vec::new();
    let mut datagrams = Vec::new();
    for (i, &len) in lens.iter().enumerate() {
        let inner = udp_v4(
            [198, 19, 10, 2],
            40000,
            [198, 19, 10, 9],
            7,
            &segment(i, len),
        );
        let f = vxlan_wrap([127, 0, 0, 1], [127, 0, 0, 1], 50000, 100, &inner);
        let base = i * FRAME_SIZE;
        region[base + HEADROOM..base + HEADROOM + f.len()].copy_from_slice(&f);
        let mut d = Desc::new(base, HEADROOM, f.len(), FRAME_SIZE, 0);
        d.verdict = Verdict::Tx(1);
        descs.push(d);
        datagrams.push(f[VXLAN_V4_OVERHEAD - 8..].to_vec());
    }
    (descs, datagrams)
}

fn recv_all(sock: &UdpSocket, n: usize) -> Vec<Vec<u8>> {
    sock.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut buf = vec![0u8; 65536];
    (0..n)
        .map(|_| {
            let k = sock.recv(&mut buf).expect("datagram");
            buf[..k].to_vec()
        })
        .collect()
}

#[test]
fn gso_sends_arrive_as_separate_datagrams_at_a_plain_socket() {
    let listener = UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut io = backend(64, Some(listener.local_addr().unwrap().port()));
    // 30 full-size frames and a short last one: one GSO run.
    let mut lens = vec![1350; 30];
    lens.push(200);
    let mut region = vec![0u8; lens.len() * FRAME_SIZE];
    let (descs, want) = frames(&mut region, &lens);
    assert_eq!(io.tx_from(&region, &descs).unwrap(), lens.len());
    let got = recv_all(&listener, lens.len());
    assert_eq!(got, want, "each datagram separately, in order");
    let st = io.stats();
    assert_eq!(st.gso_sends, 1);
    assert_eq!(st.gso_segments, lens.len() as u64);
    assert_eq!(st.tx_packets, lens.len() as u64);
    assert_eq!(st.tx_syscalls, 1);
    assert_eq!(st.gso_fallbacks + st.tx_dropped + st.tx_errors, 0);
}

#[test]
fn sizes_and_run_limits_split_gso_runs_and_keep_the_order() {
    let listener = UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut io = backend(64, Some(listener.local_addr().unwrap().port()));
    // A run of 3, a larger frame that cannot join it (starts a new run of 2 with the
    // 900 after it: a shorter datagram may only end a run), a single 100, then 70 of
    // 800 bytes: more than one GSO message may hold, so two runs.
    let mut lens = vec![500, 500, 500, 1000, 900, 100];
    lens.extend(std::iter::repeat_n(800, 70));
    let mut region = vec![0u8; lens.len() * FRAME_SIZE];
    let (descs, want) = frames(&mut region, &lens);
    assert_eq!(io.tx_from(&region, &descs).unwrap(), lens.len());
    let got = recv_all(&listener, lens.len());
    assert_eq!(got, want);
    let st = io.stats();
    // Runs: [500x3], [1000, 900], [100], [800x64], [800x6].
    assert_eq!(st.gso_sends, 4);
    assert_eq!(st.gso_segments, 3 + 2 + 64 + 6);
    assert_eq!(st.tx_packets, lens.len() as u64);
}

#[test]
fn without_gso_every_datagram_is_its_own_message() {
    let listener = UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut cfg = UdpVxlanConfig::new(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0));
    cfg.peer_port = Some(listener.local_addr().unwrap().port());
    cfg.gso = false;
    let mut io = UdpVxlanIo::bind(cfg).unwrap();
    let lens = vec![700; 10];
    let mut region = vec![0u8; lens.len() * FRAME_SIZE];
    let (descs, want) = frames(&mut region, &lens);
    assert_eq!(io.tx_from(&region, &descs).unwrap(), lens.len());
    assert_eq!(recv_all(&listener, lens.len()), want);
    let st = io.stats();
    assert_eq!((st.gso_sends, st.tx_syscalls), (0, 1));
}
