//! `UdpVxlanIo` on real sockets over 127.0.0.1 (ephemeral ports): VXLAN datagrams from a
//! std `UdpSocket` go through a `Worker<UdpVxlanIo>` and come back decapped, rewritten
//! and re-encapsulated to a listening socket.
//!
//! `encap` writes outer UDP destination 4789, so the backend's `peer_port` override sends
//! to the listener's ephemeral port instead: binding 4789 here would collide with
//! anything else on the machine using VXLAN (a kernel VXLAN device, a parallel test).

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};

use packet::build::{vxlan_wrap, VXLAN_V4_OVERHEAD};
use pipeline::{
    parse_actions, DropReason, FlowKey, MonotonicClock, NodeAddr, Pipeline, PipelineConfig, Rule,
    RuleReply, RuleRequest, RuleSource, VpcBinding, Worker,
};
use pp::{UdpVxlanConfig, UdpVxlanIo, MAX_DATAGRAM};

mod common;
use common::{check_checksums, expected_reply, request};

const PORT: u16 = 40000;

fn node() -> NodeAddr {
    NodeAddr {
        ip: Ipv4Addr::LOCALHOST,
        mac: [2, 0, 0, 0, 0, 1],
        gw_mac: [2, 0, 0, 0, 0, 2],
    }
}

/// What the VXLAN datagram (from the VXLAN header on) of an inner frame looks like.
fn datagram(vni: u32, inner: &[u8]) -> Vec<u8> {
    vxlan_wrap([127, 0, 0, 1], [127, 0, 0, 1], 1, vni, inner)[VXLAN_V4_OVERHEAD - 8..].to_vec()
}

fn reflect_rule(sport: u16, extra: &str) -> Rule {
    common::reflect_rule(sport, "127.0.0.1", extra)
}

struct Rig {
    worker: Worker<UdpVxlanIo>,
    /// Sends VXLAN datagrams to the worker.
    client: UdpSocket,
    /// Where the worker's output goes (its `peer_port`).
    listener: UdpSocket,
    pp_addr: SocketAddrV4,
}

fn rig(source: RuleSource) -> Rig {
    let listener = UdpSocket::bind("127.0.0.1:0").unwrap();
    listener
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut cfg = UdpVxlanConfig::new(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0));
    cfg.peer_port = Some(listener.local_addr().unwrap().port());
    cfg.poll_timeout = Duration::from_millis(5);
    let io = UdpVxlanIo::bind(cfg).unwrap();
    let pp_addr = io.local_addr();
    assert_ne!(pp_addr.port(), 0);
    let mut pcfg = PipelineConfig::new(node());
    pcfg.flow_capacity = 1024;
    let mut p = Pipeline::new(pcfg, source).unwrap();
    p.bind_vpc(
        100,
        VpcBinding {
            tenant: 1,
            chain: 1,
        },
    );
    let worker = Worker::new(p, io, 64, Box::new(MonotonicClock::new()));
    let client = UdpSocket::bind("127.0.0.1:0").unwrap();
    Rig {
        worker,
        client,
        listener,
        pp_addr,
    }
}

impl Rig {
    /// Run the worker until it has received `n` more datagrams (bounded in time).
    fn pump(&mut self, n: u64) {
        let target = self.worker.io.stats().rx_packets + self.worker.io.stats().rx_oversize + n;
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.worker.io.stats().rx_packets + self.worker.io.stats().rx_oversize < target {
            assert!(
                Instant::now() < deadline,
                "worker did not receive {n} datagrams in 5 s"
            );
            self.worker.run_once().unwrap();
        }
    }

    fn send(&self, dg: &[u8]) {
        self.client.send_to(dg, self.pp_addr).unwrap();
    }

    fn recv(&self) -> Option<Vec<u8>> {
        let mut buf = [0u8; 4096];
        match self.listener.recv_from(&mut buf) {
            Ok((n, from)) => {
                assert_eq!(
                    from,
                    std::net::SocketAddr::V4(self.pp_addr),
                    "sent from the PP socket"
                );
                Some(buf[..n].to_vec())
            }
            Err(_) => None,
        }
    }
}

/// Check a received VXLAN datagram and return its inner frame.
fn check_vxlan(dg: &[u8], vni: u32) -> &[u8] {
    assert!(dg.len() > 8);
    assert_eq!(dg[0], 0x08, "VXLAN I flag");
    assert_eq!(u32::from_be_bytes([0, dg[4], dg[5], dg[6]]), vni);
    &dg[8..]
}

#[test]
fn static_rule_reflects_over_loopback() {
    let mut r = rig(RuleSource::None);
    r.worker
        .pipeline
        .install_rule(&reflect_rule(PORT, "count; "), 0)
        .unwrap();

    let payloads: Vec<Vec<u8>> = (0..10u8).map(|i| vec![i; 1 + i as usize * 37]).collect();
    for p in &payloads {
        r.send(&datagram(100, &request(PORT, p)));
    }
    r.pump(payloads.len() as u64);
    for p in &payloads {
        let dg = r.recv().expect("reply datagram");
        let inner = check_vxlan(&dg, 100);
        check_checksums(inner);
        assert_eq!(inner, &expected_reply(PORT, p)[..]);
    }
    assert!(r.recv().is_none(), "one reply per request");

    let s = r.worker.pipeline.stats();
    assert_eq!((s.rx_packets, s.hits, s.tx_packets), (10, 10, 10));
    let io = r.worker.io.stats();
    assert_eq!((io.rx_packets, io.tx_packets), (10, 10));
    assert!(io.rx_batches >= 1 && io.rx_batches <= 10);
    assert_eq!((io.tx_dropped, io.tx_errors, io.tx_unsendable), (0, 0, 0));
    let key = reflect_rule(PORT, "").key;
    let (_, packets, _) = r.worker.pipeline.lookup_rule(&key).unwrap();
    assert_eq!(packets, 10);
}

#[test]
fn misses_decap_only_and_oversize_are_counted_not_sent() {
    let mut r = rig(RuleSource::None);
    // Decap and output, no encap: the frame is a bare inner frame, which a UDP socket
    // cannot send.
    let key: FlowKey = "100 udp 198.19.10.2:40001 > 198.19.10.9:7".parse().unwrap();
    r.worker
        .pipeline
        .install_rule(&Rule::new(key, parse_actions("decap; out 0").unwrap()), 0)
        .unwrap();

    r.send(&datagram(100, &request(40001, b"decap only")));
    r.send(&datagram(100, &request(40002, b"no rule")));
    r.send(b"not vxlan at all");
    r.send(&vec![0x08; MAX_DATAGRAM + 1]);
    r.send(&datagram(100, &vec![0u8; MAX_DATAGRAM - 8]));
    r.pump(5);
    assert!(r.recv().is_none());

    let io = r.worker.io.stats();
    assert_eq!(io.rx_oversize, 1);
    assert_eq!(io.rx_packets, 4);
    assert_eq!(io.tx_unsendable, 1);
    assert_eq!(io.tx_packets, 0);
    let s = r.worker.pipeline.stats();
    assert_eq!(s.dropped(DropReason::NoRule), 1);
    // "not vxlan at all" and the all-zero inner frame.
    assert_eq!(s.total_drops(), 3);
}

#[test]
fn released_pending_packets_go_out_through_tx_from() {
    let (req_tx, req_rx) = crossbeam_channel::bounded::<RuleRequest>(16);
    let (rep_tx, rep_rx) = crossbeam_channel::unbounded::<RuleReply>();
    let mut r = rig(RuleSource::Channel {
        requests: req_tx,
        replies: rep_rx,
    });
    for i in 0..3u8 {
        r.send(&datagram(100, &request(PORT, &[i; 20])));
    }
    r.pump(3);
    assert!(r.recv().is_none(), "held while the rule is outstanding");
    let req = req_rx.try_recv().expect("one rule request");
    assert!(req_rx.try_recv().is_err());
    let rule = reflect_rule(PORT, "");
    assert_eq!(req.key, rule.key);
    rep_tx.send(RuleReply::ok(rule)).unwrap();
    // The next run_once services the reply and releases the held packets via tx_from.
    r.worker.run_once().unwrap();
    for i in 0..3u8 {
        let dg = r.recv().expect("released packet");
        let inner = check_vxlan(&dg, 100);
        check_checksums(inner);
        assert_eq!(
            inner,
            &expected_reply(PORT, &[i; 20])[..],
            "in arrival order"
        );
    }
    assert_eq!(r.worker.pipeline.stats().pending_released, 3);
    assert_eq!(r.worker.io.stats().tx_packets, 3);
}
