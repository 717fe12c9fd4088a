//! The IPsec gateway inside the pipeline: tunnel traffic bypasses the flow table (no
//! rule request), ESP to the node is opened and delivered into the VPC, everything else
//! takes the usual path, and every ESP drop is counted under its own name.

use std::net::Ipv4Addr;

use ipsec::{Dir, Gateway, GatewayConfig, Job, Outcome, SaConfig, TunnelConfig};
use packet::build::{udp_v4, vxlan_wrap};
use pipeline::{DropReason, PipelineConfig};
use testkit::rig::{client_udp, node, Rig, TENANT_VNI};

const PEER: Ipv4Addr = Ipv4Addr::new(198, 18, 20, 2);
const VTEP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 50);

fn sa(spi: u32, k: u8) -> SaConfig {
    SaConfig {
        spi,
        keymat: vec![k; 20],
    }
}

/// The node's tunnel: the VPC 198.18.10.0/24 on VNI 100 to the remote 198.19.0.0/24.
fn ours() -> TunnelConfig {
    TunnelConfig {
        name: "acme/site".into(),
        tenant: 7,
        vni: TENANT_VNI,
        peer: PEER,
        local_prefixes: vec!["198.18.10.0/24".parse().unwrap()],
        remote_prefixes: vec!["198.19.0.0/24".parse().unwrap()],
        vtep: VTEP,
        vm_mac: [2, 0x5f, 0, 0, 0, 9],
        outbound: sa(0x1001, 1),
        inbound: vec![sa(0x2001, 2)],
        esn: false,
        replay_window: 64,
    }
}

/// The remote site's mirror image.
fn theirs() -> Gateway {
    let mut g = Gateway::new(GatewayConfig::new(
        PEER,
        [2, 9, 9, 9, 9, 1],
        [2, 9, 9, 9, 9, 2],
    ));
    let mut t = ours();
    t.peer = node().ip;
    t.local_prefixes = vec!["198.19.0.0/24".parse().unwrap()];
    t.remote_prefixes = vec!["198.18.10.0/24".parse().unwrap()];
    t.outbound = sa(0x2001, 2);
    t.inbound = vec![sa(0x1001, 1)];
    g.apply(&[t], 0).unwrap();
    g
}

fn rig() -> Rig {
    let mut cfg = PipelineConfig::new(node());
    cfg.flow_capacity = 1024;
    let mut r = Rig::tenant(cfg, 16);
    r.worker.io.sink.capture = true;
    let n = node();
    let mut g = Gateway::new(GatewayConfig::new(n.ip, n.mac, n.gw_mac));
    g.apply(&[ours()], 0).unwrap();
    r.worker.pipeline.set_ipsec(Some(g));
    r
}

/// ESP frames the remote site seals: replies from 198.19.0.9:53 to the client.
fn from_remote(g: &mut Gateway, n: usize) -> Vec<Vec<u8>> {
    let inner_ip = udp_v4([198, 19, 0, 9], 53, [198, 18, 10, 2], 1000, b"answer");
    let mut inner = vec![0u8; 14];
    inner[12] = 0x08;
    inner.extend_from_slice(&inner_ip[14..]);
    let f = vxlan_wrap(VTEP.octets(), PEER.octets(), 1, TENANT_VNI, &inner);
    let t = g
        .outbound_tunnel(
            TENANT_VNI,
            Ipv4Addr::new(198, 19, 0, 9),
            Ipv4Addr::new(198, 18, 10, 2),
        )
        .unwrap();
    let mut region = vec![0u8; 2048 * n];
    let mut jobs = Vec::new();
    for i in 0..n {
        region[i * 2048 + 256..i * 2048 + 256 + f.len()].copy_from_slice(&f);
        jobs.push(Job {
            slot: i * 2048,
            cap: 2048,
            start: i * 2048 + 256,
            len: f.len(),
            dir: Dir::Out {
                tunnel: t,
                ip_off: 64,
                ip_end: 64 + inner_ip.len() as u16 - 14,
            },
            outcome: Outcome::Pending,
        });
    }
    g.process(&mut region, &mut jobs, 0);
    jobs.iter()
        .map(|j| match j.outcome {
            Outcome::Tx { start, len, .. } => region[start..start + len].to_vec(),
            o => panic!("{o:?}"),
        })
        .collect()
}

#[test]
fn tunnel_traffic_is_sealed_without_a_rule_and_esp_is_delivered_into_the_vpc() {
    let mut r = rig();
    r.send((0..3).map(|i| client_udp(TENANT_VNI, 1000, 53, &[i])));
    let out = r.out();
    assert_eq!(out.len(), 3);
    assert!(
        r.requests.try_recv().is_err(),
        "no rule request for tunnel traffic"
    );
    let s = r.worker.pipeline.stats();
    assert_eq!((s.misses, s.hits, s.tx_packets), (0, 0, 3));
    let mut remote = theirs();
    for (i, f) in out.iter().enumerate() {
        let e = ipsec::esp::parse(f).unwrap();
        assert_eq!((e.dst, e.spi, e.seq_lo), (PEER, 0x1001, i as u32 + 1));
    }
    // The remote site opens them: the client's datagrams.
    let mut region = vec![0u8; 2048 * 3];
    let mut jobs: Vec<Job> = out
        .iter()
        .enumerate()
        .map(|(i, f)| {
            region[i * 2048 + 256..i * 2048 + 256 + f.len()].copy_from_slice(f);
            Job {
                slot: i * 2048,
                cap: 2048,
                start: i * 2048 + 256,
                len: f.len(),
                dir: Dir::In,
                outcome: Outcome::Pending,
            }
        })
        .collect();
    remote.process(&mut region, &mut jobs, 0);
    assert!(jobs.iter().all(|j| matches!(j.outcome, Outcome::Tx { .. })));

    // Replies: ESP in, VXLAN to the VPC's host out.
    r.send(from_remote(&mut remote, 2));
    let out = r.out();
    assert_eq!(out.len(), 2);
    for f in &out {
        let p = packet::parse_frame(f).unwrap();
        assert_eq!(p.vxlan.unwrap().vni, TENANT_VNI);
        assert_eq!(&f[30..34], &VTEP.octets());
        let inner = p.vxlan_inner(f).unwrap();
        assert_eq!(&inner[26..30], &[198, 19, 0, 9]);
        assert_eq!(&inner[30..34], &[198, 18, 10, 2]);
    }
    // The tenant's counters include the tunnel's packets.
    let (t, c) = r.worker.pipeline.tenants().next().unwrap();
    assert_eq!((t, c.packets), (7, 5));
}

#[test]
fn other_traffic_of_the_vpc_still_asks_for_a_rule() {
    let mut r = rig();
    // To 198.19.0.9 from another source than the local selector: not the tunnel's.
    let inner = udp_v4([198, 18, 11, 2], 1000, [198, 19, 0, 9], 53, b"x");
    r.send([vxlan_wrap(
        VTEP.octets(),
        node().ip.octets(),
        1,
        TENANT_VNI,
        &inner,
    )]);
    assert!(r.out().is_empty());
    assert!(r.requests.try_recv().is_ok());
}

#[test]
fn every_bad_esp_packet_is_dropped_under_its_own_reason() {
    let mut r = rig();
    let mut remote = theirs();
    let good = from_remote(&mut remote, 2);
    let mut wrong_key = good[1].clone();
    let n = wrong_key.len();
    wrong_key[n - 1] ^= 0xff; // the ICV
    let mut unknown = good[0].clone();
    unknown[34..38].copy_from_slice(&0xdead_u32.to_be_bytes());
    let truncated = good[0][..50].to_vec();
    r.send([
        good[0].clone(),
        good[0].clone(), // a replay
        wrong_key,
        unknown,
        truncated,
    ]);
    assert_eq!(r.out().len(), 1);
    let p = &r.worker.pipeline;
    let s = p.stats();
    for (reason, name) in [
        (ipsec::EspDrop::Replay, "esp-replay"),
        (ipsec::EspDrop::Auth, "esp-auth-failed"),
        (ipsec::EspDrop::UnknownSpi, "esp-unknown-spi"),
        (ipsec::EspDrop::Truncated, "esp-truncated"),
    ] {
        assert_eq!(s.dropped(DropReason::Esp(reason)), 1, "{name}");
        assert_eq!(p.drop_name(DropReason::Esp(reason)), name);
    }
    assert_eq!(s.total_drops(), 4);
}

#[test]
fn esp_without_a_gateway_configured_is_an_unknown_spi() {
    let mut cfg = PipelineConfig::new(node());
    cfg.flow_capacity = 1024;
    let mut r = Rig::tenant(cfg, 16);
    let n = node();
    r.worker
        .pipeline
        .set_ipsec(Some(Gateway::new(GatewayConfig::new(
            n.ip, n.mac, n.gw_mac,
        ))));
    let mut remote = theirs();
    r.send(from_remote(&mut remote, 1));
    assert_eq!(
        r.worker
            .pipeline
            .stats()
            .dropped(DropReason::Esp(ipsec::EspDrop::UnknownSpi)),
        1
    );
    assert!(r.requests.try_recv().is_err());
}
