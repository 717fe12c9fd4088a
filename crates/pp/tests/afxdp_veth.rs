//! `AfXdpIo` on a real veth pair between two network namespaces this test creates
//! (`sfax-<pid>-<n>-pp`, `-peer`; 198.18.250.0/24), deleted on drop, also when a test
//! fails. The PP side runs the XDP program (native mode) with the socket in `xsks` and a
//! `Worker<AfXdpIo>`; the peer side writes VXLAN frames onto its veth with a packet
//! socket and reads what comes back: the pipeline's output, outer Ethernet header
//! included (with AF_XDP the kernel no longer writes it).
//!
//! Needs root; without it each test prints SKIP (under CI, `CI` set, that is a failure).
//! Each thread enters its namespace with setns(2), which affects that thread only.

use std::net::{Ipv4Addr, UdpSocket};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use packet::build::{EncapV4, VXLAN_V4_OVERHEAD};
use packet::csum;
use packet::{parse_frame, L4};
use pipeline::{
    Desc, MonotonicClock, NodeAddr, PacketIo, PipelineConfig, Rule, RuleReply, Verdict, VpcBinding,
    Worker, FRAME_SIZE, HEADROOM,
};
use pp::{AfXdpConfig, AfXdpIo, XskMode};
use testkit::netns::{enter, ip, ns_exec, root_or_skip, Netns};
use testkit::rig::channel_pipeline;

mod common;
use common::{check_checksums, expected_reply, request};

const PP_IP: [u8; 4] = [198, 18, 250, 1];
const PEER_IP: [u8; 4] = [198, 18, 250, 2];
const PP_MAC: [u8; 6] = [0x02, 0x5f, 0xfa, 0, 0, 0x01];
const PEER_MAC: [u8; 6] = [0x02, 0x5f, 0xfa, 0, 0, 0x02];

/// Two namespaces joined by a veth pair (`xa` on the PP side, `xb` on the peer side);
/// deleted on drop (by testkit's guard), which destroys the veth too.
struct Lab {
    _ns: Netns,
    pp: String,
    peer: String,
}

fn netns() -> Option<Lab> {
    if !root_or_skip("AF_XDP on veth (namespaces, XDP, AF_XDP)") {
        return None;
    }
    let mut guard = Netns::unique("sfax");
    let (pp, peer) = guard.add_pair("pp", "xa", "peer", "xb");
    for (n, dev, mac, addr) in [
        (&pp, "xa", "02:5f:fa:00:00:01", "198.18.250.1/24"),
        (&peer, "xb", "02:5f:fa:00:00:02", "198.18.250.2/24"),
    ] {
        // No IPv6: its router solicitations would be extra frames on the link.
        ns_exec(
            n,
            &[
                "sysctl",
                "-qw",
                &format!("net.ipv6.conf.{dev}.disable_ipv6=1"),
            ],
        );
        ip(&["-n", n, "link", "set", dev, "address", mac]);
        ip(&["-n", n, "addr", "add", addr, "dev", dev]);
        ip(&["-n", n, "link", "set", dev, "up"]);
    }
    Some(Lab {
        _ns: guard,
        pp,
        peer,
    })
}

fn node() -> NodeAddr {
    NodeAddr {
        ip: Ipv4Addr::from(PP_IP),
        mac: PP_MAC,
        gw_mac: PEER_MAC,
    }
}

/// What the peer puts on the wire: the request in VXLAN to the PP node.
fn vxlan_to_pp(vni: u32, inner: &[u8]) -> Vec<u8> {
    let t = EncapV4::new(PEER_MAC, PP_MAC, PEER_IP, PP_IP, vni);
    let mut f = vec![0u8; VXLAN_V4_OVERHEAD + inner.len()];
    t.write(&mut f, inner.len(), 50000);
    f[VXLAN_V4_OVERHEAD..].copy_from_slice(inner);
    f
}

fn reflect_rule(sport: u16) -> Rule {
    common::reflect_rule(sport, "198.18.250.2", "count; ")
}

/// A pipeline for VNI 100 with `port`'s reflect rule installed for good, and its FM
/// channels (rule requests out, replies in).
fn reflect_pipeline(
    port: u16,
) -> (
    pipeline::Pipeline,
    crossbeam_channel::Receiver<pipeline::RuleRequest>,
    crossbeam_channel::Sender<RuleReply>,
) {
    let mut pcfg = PipelineConfig::new(node());
    pcfg.flow_capacity = 1024;
    let (mut p, req_rx, rep_tx) = channel_pipeline(pcfg, 16);
    p.bind_vpc(
        100,
        VpcBinding {
            tenant: 1,
            chain: 1,
        },
    );
    let mut r = reflect_rule(port);
    r.idle_timeout = Some(Duration::MAX);
    p.install_rule(&r, 0).unwrap();
    (p, req_rx, rep_tx)
}

/// A raw packet socket on `dev` in the calling thread's namespace.
struct RawSock {
    fd: libc::c_int,
    ifindex: libc::c_int,
}

impl RawSock {
    fn open(dev: &str) -> RawSock {
        let proto = (libc::ETH_P_ALL as u16).to_be() as libc::c_int;
        // SAFETY: plain socket(2).
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto) };
        assert!(
            fd >= 0,
            "packet socket: {}",
            std::io::Error::last_os_error()
        );
        let name = std::ffi::CString::new(dev).unwrap();
        // SAFETY: a NUL-terminated name.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) } as libc::c_int;
        assert!(ifindex > 0, "no {dev}");
        // SAFETY: zeroed sockaddr_ll is valid; filled below.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto as u16;
        sll.sll_ifindex = ifindex;
        // SAFETY: `sll` lives for the call; its size is passed.
        let r = unsafe {
            libc::bind(
                fd,
                &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        assert_eq!(r, 0, "bind: {}", std::io::Error::last_os_error());
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        // SAFETY: `tv` lives for the call; its size is passed.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const libc::timeval as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as u32,
            )
        };
        RawSock { fd, ifindex }
    }

    fn send(&self, frame: &[u8]) {
        // SAFETY: `frame` is valid for its length; the socket is bound to the device.
        let r = unsafe { libc::send(self.fd, frame.as_ptr().cast(), frame.len(), 0) };
        assert_eq!(
            r,
            frame.len() as isize,
            "{}",
            std::io::Error::last_os_error()
        );
    }

    /// The next frame received on the device (not our own outgoing ones), or `None` after
    /// the receive timeout.
    fn recv(&self) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; 4096];
        // SAFETY: zeroed sockaddr_ll is valid; recvfrom fills it.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut sl = std::mem::size_of::<libc::sockaddr_ll>() as u32;
        // SAFETY: `buf` and `sll` are valid for the lengths passed and live for the call.
        let r = unsafe {
            libc::recvfrom(
                self.fd,
                buf.as_mut_ptr().cast(),
                buf.len(),
                0,
                &mut sll as *mut libc::sockaddr_ll as *mut libc::sockaddr,
                &mut sl,
            )
        };
        if r < 0 {
            return None;
        }
        if sll.sll_pkttype == libc::PACKET_OUTGOING || sll.sll_ifindex != self.ifindex {
            return Some(Vec::new());
        }
        buf.truncate(r as usize);
        Some(buf)
    }
}

impl Drop for RawSock {
    fn drop(&mut self) {
        // SAFETY: our fd, closed once.
        unsafe { libc::close(self.fd) };
    }
}

/// Check a frame the PP node sent: outer Ethernet node → gateway, IPv4 node → peer,
/// VXLAN VNI 100; returns the inner frame.
fn check_output(f: &[u8]) -> Vec<u8> {
    assert_eq!(&f[0..6], &PEER_MAC, "outer destination MAC = the gateway's");
    assert_eq!(&f[6..12], &PP_MAC, "outer source MAC = the node's");
    assert_eq!(
        csum::checksum(0, &f[14..34]),
        0,
        "outer IPv4 header checksum"
    );
    let p = parse_frame(f).unwrap();
    let ip = p.ip().unwrap();
    assert_eq!(&f[ip.src_range()], &PP_IP);
    assert_eq!(&f[ip.dst_range()], &PEER_IP);
    assert_eq!(p.vxlan.expect("VXLAN").vni, 100);
    p.vxlan_inner(f).unwrap().to_vec()
}

struct PpResult {
    stats: pp::AfXdpStats,
    census: pp::FrameCensus,
    frames: usize,
    mode: XskMode,
    hits: u64,
    misses: u64,
    rule_requests: u64,
    static_packets: u64,
    kernel: pp::AfXdpKernelStats,
}

#[test]
fn vxlan_through_the_pipeline_on_af_xdp_with_static_and_fm_rules() {
    let Some(ns) = netns() else { return };
    const STATIC_PORT: u16 = 40000;
    const MISS_PORT: u16 = 40001;
    let stop = Arc::new(AtomicBool::new(false));
    let (ready_tx, ready_rx) = crossbeam_channel::bounded::<Result<(), String>>(1);
    let pp_ns = ns.pp.clone();
    let stop2 = stop.clone();
    let pp = std::thread::spawn(move || -> PpResult {
        enter(&pp_ns);
        let (p, req_rx, rep_tx) = reflect_pipeline(STATIC_PORT);
        let mut program = xdp::XdpProgram::load().expect("load the XDP program");
        program.set_node(&node()).unwrap();
        let mut cfg = AfXdpConfig::new("xa");
        cfg.poll_timeout = Duration::from_millis(5);
        cfg.frames = 256;
        // The TX ring's accounting is what this test checks (completions below).
        cfg.tx = pp::AfXdpTx::Ring;
        let io = AfXdpIo::bind(cfg).expect("AF_XDP bind");
        let mode = io.mode();
        program.register_xsk(0, &io).unwrap();
        let attachment = program.attach("xa").expect("attach");
        assert_eq!(
            attachment.mode,
            xdp::AttachMode::Native,
            "veth has native XDP"
        );
        let mut w = Worker::new(p, io, 64, Box::new(MonotonicClock::new()));
        ready_tx.send(Ok(())).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !stop2.load(Ordering::Relaxed) && Instant::now() < deadline {
            w.run_once().unwrap();
            // The test is FM: answer every rule request with the reflect rule.
            while let Ok(req) = req_rx.try_recv() {
                assert_eq!(req.key, reflect_rule(MISS_PORT).key);
                rep_tx.send(RuleReply::ok(reflect_rule(MISS_PORT))).unwrap();
            }
        }
        // Drain the TX ring so the census below sees every frame home.
        for _ in 0..100 {
            if w.io.frame_census().tx == 0 {
                break;
            }
            let mut d = Vec::new();
            w.io.rx(&mut d, 0).unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
        w.io.verify_frames().expect("frame accounting");
        program.detach(attachment).unwrap();
        let (_, static_packets, _) = w
            .pipeline
            .lookup_rule(&reflect_rule(STATIC_PORT).key)
            .unwrap();
        let s = w.pipeline.stats();
        PpResult {
            stats: w.io.stats(),
            census: w.io.frame_census(),
            frames: 256,
            mode,
            hits: s.hits,
            misses: s.misses,
            rule_requests: s.rule_requests,
            static_packets,
            kernel: w.io.kernel_stats().unwrap(),
        }
    });
    ready_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("PP thread ready")
        .unwrap();

    let peer_ns = ns.peer.clone();
    let peer = std::thread::spawn(move || {
        enter(&peer_ns);
        let sock = RawSock::open("xb");
        // Sizes from minimal to the largest whose VXLAN frame fits the veth's 1500 MTU.
        let payloads: Vec<Vec<u8>> = (0..24usize)
            .map(|i| vec![i as u8; 1 + (i * 61) % 1422])
            .chain([vec![0xab; 1422]])
            .collect();
        let mut sent = Vec::new();
        for (i, pl) in payloads.iter().enumerate() {
            let port = if i % 3 == 2 { MISS_PORT } else { STATIC_PORT };
            sock.send(&vxlan_to_pp(100, &request(port, pl)));
            sent.push((port, pl.clone()));
        }
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        while got.len() < sent.len() && Instant::now() < deadline {
            match sock.recv() {
                Some(f) if f.len() > 42 && f[12..14] == [0x08, 0x00] && f[6..12] == PP_MAC => {
                    got.push(f)
                }
                _ => {}
            }
        }
        // Non-VXLAN traffic still reaches the PP side's kernel: a datagram from this
        // namespace's kernel needs ARP for 198.18.250.1 answered through XDP_PASS.
        let u = UdpSocket::bind("198.18.250.2:0").unwrap();
        u.send_to(b"arp", "198.18.250.1:9").unwrap();
        (sent, got)
    });
    let (sent, got) = peer.join().unwrap();
    // Let the ARP exchange finish before the program goes.
    let neigh_deadline = Instant::now() + Duration::from_secs(3);
    let resolved = loop {
        let out = Command::new("ip")
            .args(["-n", &ns.peer, "neigh", "show", "198.18.250.1", "dev", "xb"])
            .output()
            .unwrap();
        let s = String::from_utf8_lossy(&out.stdout).to_string();
        if s.contains("02:5f:fa:00:00:01") || Instant::now() > neigh_deadline {
            break s;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    stop.store(true, Ordering::Relaxed);
    let r = pp.join().unwrap();

    assert_eq!(r.mode, XskMode::Copy, "veth has no AF_XDP zero-copy");
    assert_eq!(got.len(), sent.len(), "one output frame per input frame");
    // The static flow's replies keep their order, and so do the held-then-released ones.
    let mut by_port: std::collections::HashMap<u16, Vec<Vec<u8>>> = Default::default();
    for f in &got {
        let inner = check_output(f);
        check_checksums(&inner);
        let p = parse_frame(&inner).unwrap();
        let L4::Udp { dport, .. } = p.ip().unwrap().l4 else {
            panic!("inner not UDP")
        };
        by_port.entry(dport).or_default().push(inner);
    }
    for port in [STATIC_PORT, MISS_PORT] {
        let want: Vec<Vec<u8>> = sent
            .iter()
            .filter(|(p, _)| *p == port)
            .map(|(p, pl)| expected_reply(*p, pl))
            .collect();
        assert_eq!(
            by_port.remove(&port).unwrap_or_default(),
            want,
            "port {port}"
        );
    }
    let n_static = sent.iter().filter(|(p, _)| *p == STATIC_PORT).count() as u64;
    assert_eq!(r.static_packets, n_static);
    assert_eq!(r.rule_requests, 1, "one rule request for the missing flow");
    assert!(r.misses >= 1);
    assert!(r.hits >= n_static);
    assert!(
        resolved.contains("02:5f:fa:00:00:01"),
        "ARP for the PP node went to its kernel (XDP_PASS): {resolved:?}"
    );
    // Every frame accounted for: sent through the ring (copy mode) and back home.
    assert_eq!(r.stats.rx_packets, sent.len() as u64);
    assert_eq!(r.stats.tx_packets, sent.len() as u64);
    assert_eq!(
        (
            r.stats.tx_ring_full,
            r.stats.tx_no_frame,
            r.stats.tx_oversize
        ),
        (0, 0, 0)
    );
    assert_eq!(r.stats.tx_completed, r.stats.tx_packets);
    assert_eq!(r.census.total(), r.frames);
    assert_eq!((r.census.user, r.census.tx), (0, 0));
    assert_eq!(r.kernel.rx_dropped, 0);
    drop(ns);
}

#[test]
fn tx_from_counts_frames_it_cannot_send_and_conserves_frames() {
    let Some(ns) = netns() else { return };
    let pp_ns = ns.pp.clone();
    std::thread::spawn(move || {
        enter(&pp_ns);
        let mut cfg = AfXdpConfig::new("xa");
        cfg.frames = 64;
        cfg.poll_timeout = Duration::from_millis(1);
        let mut io = AfXdpIo::bind(cfg).unwrap();
        let c = io.frame_census();
        assert_eq!((c.free, c.fill, c.user, c.tx), (32, 32, 0, 0));
        // 40 frames to send (more than the 32 free ones), one too large for a frame, and
        // one that is not Tx: 32 sent, 8 without a frame, 1 oversize, 1 ignored.
        let mut region = vec![0u8; 42 * FRAME_SIZE];
        let mut descs = Vec::new();
        for i in 0..42usize {
            let len = if i == 40 { 1900 } else { 60 };
            let mut d = Desc::new(i * FRAME_SIZE, HEADROOM, len, FRAME_SIZE, 0);
            let f = &mut region[i * FRAME_SIZE + HEADROOM..][..60];
            // A frame the peer will drop: to a MAC nobody has, EtherType 0x88b5 (local
            // experimental).
            f[..6].copy_from_slice(&[0x02, 0xee, 0, 0, 0, 0]);
            f[6..12].copy_from_slice(&PP_MAC);
            f[12..14].copy_from_slice(&[0x88, 0xb5]);
            d.verdict = if i == 41 {
                Verdict::Held
            } else {
                Verdict::Tx(0)
            };
            descs.push(d);
        }
        let sent = io.tx_from(&region, &descs).unwrap();
        let s = io.stats();
        assert_eq!(sent, 32);
        io.verify_frames().expect("frame accounting");
        assert_eq!((s.tx_packets, s.tx_no_frame, s.tx_oversize), (32, 8, 1));
        assert_eq!(s.tx_packets + s.tx_no_frame + s.tx_oversize, 41);
        assert_eq!(io.frame_census().total(), 64);
        // Kicks on rx bring every sent frame back through the completion ring.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut d = Vec::new();
        while io.frame_census().tx > 0 {
            assert!(
                Instant::now() < deadline,
                "completions: {:?}",
                io.frame_census()
            );
            io.rx(&mut d, 64).unwrap();
        }
        assert_eq!(io.stats().tx_completed, 32);
        let c = io.frame_census();
        assert_eq!(c.total(), 64);
        assert_eq!((c.free + c.fill, c.user, c.tx), (64, 0, 0));
        assert_eq!(c.fill, 32, "fill ring topped up again");
        assert_eq!(io.verify_frames(), Ok(c));
    })
    .join()
    .unwrap();
    drop(ns);
}

/// What AF_XDP setup reads of the interface (its MAC and receive queues) comes from the
/// thread's own namespace after an in-process setns, where `/sys/class/net` still shows
/// the host's: sysfs has no `xa` here, and a name both had would be the host's device.
#[test]
fn the_interface_is_read_in_the_threads_own_namespace() {
    let Some(lab) = netns() else { return };
    let pp = lab.pp.clone();
    // A second receive queue on a veth of its own, so the count is not the default 1.
    ip(&[
        "-n",
        &pp,
        "link",
        "add",
        "xq",
        "numrxqueues",
        "3",
        "numtxqueues",
        "3",
        "type",
        "veth",
        "peer",
        "name",
        "xq-p",
    ]);
    ip(&[
        "-n",
        &pp,
        "link",
        "set",
        "xq",
        "address",
        "02:5f:fa:00:00:33",
    ]);
    let sysfs_sees_it = std::path::Path::new("/sys/class/net/xq").exists();
    let (mac, queues, xa_queues, missing) = testkit::netns::in_ns(&pp, || {
        (
            pp::netif::mac_of("xq").map_err(|e| e.to_string()),
            pp::netif::rx_queues("xq").map_err(|e| e.to_string()),
            pp::netif::rx_queues("xa").map_err(|e| e.to_string()),
            pp::netif::mac_of("sf-none").map_err(|e| e.to_string()),
        )
    });
    // Busy polling's NAPI deferral writes sysfs: it refuses a view that is not the
    // thread's (here sysfs has no `xq` at all) rather than write another's device.
    let deferral = testkit::netns::in_ns(&pp, || {
        pp::NapiDeferral::apply("xq", 2, 200_000)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    let e = deferral.expect_err("sysfs is the host's here");
    assert!(e.contains("another network namespace"), "{e}");
    assert!(
        !sysfs_sees_it,
        "the host's sysfs does not show the lab's veth"
    );
    assert_eq!(mac, Ok([0x02, 0x5f, 0xfa, 0, 0, 0x33]));
    assert_eq!(queues, Ok(3));
    assert_eq!(xa_queues, Ok(1));
    let e = missing.expect_err("no such interface");
    assert!(e.contains("sf-none"), "{e}");
}

/// Copy mode with `AfXdpTx::Gso`: frames of one flow that arrive in one batch leave as
/// one UDP GSO message through the packet socket, after a frame of the same flow that
/// was too short to start the run and left through the TX ring. With the PP side's veth unable to
/// take UDP GSO whole (`tx-udp-segmentation off`, as on the testbed, where the router
/// side runs XDP), the kernel cuts it at the device: the peer sees every datagram, in
/// order, each with its own lengths, a valid IP header and a UDP checksum that is none
/// (a frame sent as PP wrote it), complete, or the pseudo-header sum of its own length
/// (unfinished
/// `CHECKSUM_PARTIAL`, which the receiving kernel trusts on a veth), and its UDP stack
/// takes every one.
#[test]
fn a_batch_of_one_flow_leaves_as_one_gso_send_and_arrives_as_its_datagrams() {
    let Some(ns) = netns() else { return };
    const PORT: u16 = 40002;
    const N: usize = 40;
    const GSO_RUN_MIN: usize = 4;
    ns_exec(
        &ns.pp,
        &["ethtool", "-K", "xa", "tx-udp-segmentation", "off"],
    );
    let (ready_tx, ready_rx) = crossbeam_channel::bounded::<()>(1);
    let (sent_tx, sent_rx) = crossbeam_channel::bounded::<()>(1);
    let stop = Arc::new(AtomicBool::new(false));
    let pp_ns = ns.pp.clone();
    let stop2 = stop.clone();
    let pp = std::thread::spawn(move || {
        enter(&pp_ns);
        let (p, _req_rx, _rep_tx) = reflect_pipeline(PORT);
        let mut program = xdp::XdpProgram::load().expect("load the XDP program");
        program.set_node(&node()).unwrap();
        let mut cfg = AfXdpConfig::new("xa");
        cfg.poll_timeout = Duration::from_millis(5);
        cfg.frames = 256;
        cfg.tx = pp::AfXdpTx::Gso;
        let io = AfXdpIo::bind(cfg).expect("AF_XDP bind");
        assert_eq!(io.tx_path(), "gso");
        program.register_xsk(0, &io).unwrap();
        let attachment = program.attach("xa").expect("attach");
        let mut w = Worker::new(p, io, 64, Box::new(MonotonicClock::new()));
        ready_tx.send(()).unwrap();
        // Let the whole burst queue on the RX ring, so one batch holds it.
        sent_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let deadline = Instant::now() + Duration::from_secs(10);
        while !stop2.load(Ordering::Relaxed) && Instant::now() < deadline {
            w.run_once().unwrap();
        }
        w.io.verify_frames().expect("frame accounting");
        program.detach(attachment).unwrap();
        (w.io.stats(), w.io.frame_census())
    });
    ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let peer_ns = ns.peer.clone();
    let peer = std::thread::spawn(move || {
        enter(&peer_ns);
        let sock = RawSock::open("xb");
        let udp = UdpSocket::bind("198.18.250.2:4789").unwrap();
        udp.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        // A short first frame (alone: the next is larger, so it goes through the TX
        // ring), N - 2 frames of 1,000 bytes of payload and a shorter last one, each its
        // own bytes, so order and content show: the ring's frame of the flow must leave
        // before the flow's run.
        let payloads: Vec<Vec<u8>> = (0..N)
            .map(|i| {
                let len = match i {
                    0 => 50,
                    i if i == N - 1 => 300,
                    _ => 1000,
                };
                vec![i as u8; len]
            })
            .collect();
        for pl in &payloads {
            sock.send(&vxlan_to_pp(100, &request(PORT, pl)));
        }
        sent_tx.send(()).unwrap();
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(5);
        while got.len() < N && Instant::now() < deadline {
            match sock.recv() {
                Some(f) if f.len() > 42 && f[12..14] == [0x08, 0x00] && f[6..12] == PP_MAC => {
                    got.push(f)
                }
                _ => {}
            }
        }
        let mut datagrams = 0;
        let mut buf = vec![0u8; 2048];
        while datagrams < N {
            match udp.recv_from(&mut buf) {
                Ok(_) => datagrams += 1,
                Err(_) => break,
            }
        }
        (payloads, got, datagrams)
    });
    let (payloads, got, datagrams) = peer.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    let (stats, census) = pp.join().unwrap();

    assert_eq!(got.len(), N, "one datagram on the wire per frame");
    let (mut none, mut complete, mut partial) = (0, 0, 0);
    for (f, pl) in got.iter().zip(&payloads) {
        let inner = check_output(f);
        assert_eq!(inner, expected_reply(PORT, pl), "in order, content intact");
        assert_eq!(csum::get16(f, 16) as usize, f.len() - 14, "IP total length");
        let udp_len = csum::get16(f, 38);
        assert_eq!(udp_len as usize, f.len() - 34, "UDP length");
        let src: [u8; 4] = f[26..30].try_into().unwrap();
        let dst: [u8; 4] = f[30..34].try_into().unwrap();
        let pseudo = csum::pseudo_v4(&src, &dst, 17, udp_len);
        if csum::get16(f, 40) == 0 {
            // No checksum (what PP's encap writes): only a frame sent as it was.
            none += 1;
        } else if csum::fold(pseudo + csum::sum(&f[34..])) == 0xffff {
            complete += 1;
        } else {
            assert_eq!(
                csum::get16(f, 40),
                csum::fold(pseudo),
                "an unfinished UDP checksum is this datagram's pseudo-header sum"
            );
            partial += 1;
        }
    }
    assert_eq!(none + complete + partial, N);
    assert!(
        complete + partial >= GSO_RUN_MIN,
        "the run's datagrams carry a checksum"
    );
    assert_eq!(datagrams, N, "the peer's UDP stack took every datagram");
    assert!(
        stats.tx_gso_sends >= 1 && stats.tx_gso_segments >= 2,
        "{stats:?}"
    );
    assert_eq!(stats.tx_packets, N as u64, "{stats:?}");
    assert!(
        stats.tx_gso_segments < N as u64,
        "the first frame went through the ring: {stats:?}"
    );
    assert_eq!(
        (
            stats.tx_send_dropped,
            stats.tx_gso_fallbacks,
            stats.tx_ring_full
        ),
        (0, 0, 0)
    );
    assert_eq!((census.user, census.tx), (0, 0), "{census:?}");
    drop(ns);
}

/// The packet-socket transmit's qdisc: a `noqueue` veth gets a `pfifo` root for as long
/// as the guard lives and `noqueue` back after; an interface that already has a qdisc
/// of its own is left alone.
#[test]
fn a_noqueue_interface_gets_a_pfifo_root_for_as_long_as_the_guard_lives() {
    let Some(ns) = netns() else { return };
    let (before, attached, during, again, after) = testkit::netns::in_ns(&ns.pp, || {
        let ifindex = pp::netif::ifindex("xa").unwrap();
        let root = || pp::qdisc::root_qdisc(ifindex).unwrap().map(|q| q.kind);
        let before = root();
        let guard = pp::qdisc::FifoQdisc::attach_if_noqueue("xa", 1000).unwrap();
        let attached = guard.is_some();
        let during = root();
        // A second caller finds a qdisc there and leaves it.
        let again = pp::qdisc::FifoQdisc::attach_if_noqueue("xa", 1000)
            .unwrap()
            .is_some();
        drop(guard);
        let after = root();
        (before, attached, during, again, after)
    });
    // A qdisc someone else put there is neither replaced nor removed.
    ns_exec(
        &ns.pp,
        &["tc", "qdisc", "add", "dev", "xa", "root", "bfifo"],
    );
    let (own, kept) = testkit::netns::in_ns(&ns.pp, || {
        let ifindex = pp::netif::ifindex("xa").unwrap();
        let own = pp::qdisc::FifoQdisc::attach_if_noqueue("xa", 1000)
            .unwrap()
            .is_some();
        (own, pp::qdisc::root_qdisc(ifindex).unwrap().map(|q| q.kind))
    });
    assert_eq!(before.as_deref(), Some("noqueue"));
    assert!(attached);
    assert_eq!(during.as_deref(), Some("pfifo"));
    assert!(!again);
    assert_eq!(after.as_deref(), Some("noqueue"));
    assert!(!own);
    assert_eq!(kept.as_deref(), Some("bfifo"));
    drop(ns);
}
