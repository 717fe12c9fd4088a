//! The monitor sees traffic, across the planes in one process: packets of a flow go
//! through a PP pipeline whose rule a built-in FW → MON → SNAT chain composed at SC; PP
//! reports the counted rules' counters to FM, FM routes them to the flow's SC group, the
//! group applies them to the monitor through its op log, and FM's `Traffic` query reads
//! them back. Every packet counts, not one per flow, in both directions.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{wait, Cluster};
use packet::build::{udp_v4, vxlan_wrap};
use pipeline::{
    CounterReportConfig, FlowKey, ManualClock, MemRing, Pipeline, PipelineConfig, VecSource,
    VpcBinding, Worker,
};
use pp::FmClient;
use proto::ChainDef;
use testkit::rig::node;

const VNI: u32 = 100;
const EGRESS_VNI: u32 = 200;
const CLIENT: [u8; 4] = [198, 18, 10, 2];
const SERVER: [u8; 4] = [198, 19, 0, 9];
/// The chain's SNAT pool address.
const SNAT_ADDR: [u8; 4] = [198, 19, 255, 1];

fn chain() -> ChainDef {
    serde_json::from_value(serde_json::json!({
        "tenant": 1, "chain": 1,
        "nfs": [
            {"kind": "fw", "tenants": [{"tenant": 1, "default_action": "allow", "rules": []}]},
            {"kind": "monitor"},
            {"kind": "snat", "pools": [{"addresses": ["198.19.255.1"],
                                        "ports": {"lo": 20000, "hi": 29999}}]}
        ],
        "forward": {"decap": true, "encap": {"dst": "198.18.0.9", "vni": EGRESS_VNI}, "output": 1},
        "reverse": {"decap": true, "encap": {"dst": "198.18.0.50", "vni": VNI}, "output": 1}
    }))
    .unwrap()
}

/// A UDP packet of the client 198.18.10.2:40000 to 198.19.0.9:53, `payload` bytes long.
fn request(payload: usize) -> Vec<u8> {
    let inner = udp_v4(CLIENT, 40000, SERVER, 53, &vec![7u8; payload]);
    vxlan_wrap([198, 18, 0, 50], [198, 18, 0, 1], 51000, VNI, &inner)
}

/// The server's reply to the translated address, on the egress VNI.
fn reply(to_port: u16, payload: usize) -> Vec<u8> {
    let inner = udp_v4(SERVER, 53, SNAT_ADDR, to_port, &vec![9u8; payload]);
    vxlan_wrap([198, 18, 0, 9], [198, 18, 0, 1], 52000, EGRESS_VNI, &inner)
}

#[test]
fn every_packet_of_a_flow_reaches_the_monitor_in_both_directions() {
    let cluster = Cluster::start(vec![chain()], 3, Arc::new(sc::BuiltinNfs));
    cluster.wait_groups(1, 3);
    let (client, mut links) = FmClient::start(cluster.pp_config("pp-1")).unwrap();
    let link = links.remove(0);
    let mut cfg = PipelineConfig::new(node());
    cfg.counter_reports = Some(CounterReportConfig {
        interval_ms: 1000,
        queue: 1024,
        scan_per_service: 1024,
    });
    let mut p = Pipeline::new(cfg, link.source).unwrap();
    // Only the client's VNI is bound here: replies arrive on the egress VNI, and FM
    // tells their reports' tenant from its rule cache.
    p.bind_vpc(
        VNI,
        VpcBinding {
            tenant: 1,
            chain: 1,
        },
    );
    let clock = ManualClock::default();
    let mut w = Worker::new(
        p,
        MemRing::new(VecSource::default(), 64),
        64,
        Box::new(clock.clone()),
    );
    wait(Duration::from_secs(5), "PP session", || {
        client.connected().then_some(())
    });
    let reports = client.report_sender();
    let mut buf = Vec::new();
    let mut flush = |w: &mut Worker<MemRing<VecSource>>| {
        w.pipeline.take_counter_reports(&mut buf);
        assert!(
            reports.send(std::mem::take(&mut buf)),
            "the report queue has room"
        );
    };

    // The first packet misses and is held; the chain decides; the rules come back.
    let mut sent = (0u64, 0u64);
    let f = request(10);
    sent = (sent.0 + 1, sent.1 + f.len() as u64);
    w.io.source.push(f, 0);
    wait(Duration::from_secs(10), "the rule", || {
        let _ = link.doorbell.wait_ring(Duration::from_millis(10));
        w.run_once().unwrap();
        (w.pipeline.stats().pending_released >= 1).then_some(())
    });
    let fwd: FlowKey = format!("{VNI} udp 198.18.10.2:40000 > 198.19.0.9:53")
        .parse()
        .unwrap();
    let rev = w
        .pipeline
        .table()
        .iter()
        .map(|(e, _)| e.key)
        .find(|k| k.vni() == EGRESS_VNI)
        .expect("the reverse rule came along");
    assert!(w.pipeline.lookup_rule(&fwd).is_some());

    // Later packets hit the composed rule at PP; SC never sees them.
    const N: usize = 60;
    const M: usize = 25;
    let mut back = (0u64, 0u64);
    for i in 0..N {
        let f = request(10 + i * 7);
        sent = (sent.0 + 1, sent.1 + f.len() as u64);
        w.io.source.push(f, 0);
        if i % 8 == 7 {
            w.run_once().unwrap();
            // Some reports go out mid-way (the periodic pass), some at the end.
            clock.advance(300);
            w.run_once().unwrap();
            flush(&mut w);
        }
    }
    for i in 0..M {
        let f = reply(rev.dport(), 20 + i * 3);
        back = (back.0 + 1, back.1 + f.len() as u64);
        w.io.source.push(f, 0);
    }
    while !w.io.source.frames.is_empty() {
        w.run_once().unwrap();
    }
    assert_eq!(
        w.pipeline.stats().misses,
        1,
        "one flow, one miss: the replies hit the reverse rule"
    );
    assert!(w.pipeline.report_all_counters());
    flush(&mut w);
    assert!(w.pipeline.stats().counter_reports >= 2);

    let want_total = (sent.0 + back.0, sent.1 + back.1);
    let report = wait(Duration::from_secs(10), "the monitor's counts", || {
        let r = cluster
            .rt
            .block_on(cluster.fm.observer().traffic(1))
            .unwrap();
        let t = r.report.as_ref()?.tenants.first()?.count?;
        ((t.packets, t.bytes) == want_total).then_some(r)
    });
    assert_eq!((report.groups, report.groups_read), (1, 1));
    let rep = proto::traffic_from(report.report.as_ref().unwrap()).unwrap();
    assert_eq!(rep.tenants.len(), 1, "only tenant 1");
    assert_eq!(rep.tenants[0].1.flows, 1);
    let host = |a: &str| {
        let ip: std::net::IpAddr = a.parse().unwrap();
        rep.hosts
            .iter()
            .find(|(_, h, _)| *h == ip)
            .map(|(_, _, c)| (c.packets, c.bytes))
    };
    assert_eq!(
        host("198.18.10.2"),
        Some(sent),
        "the client's packets and bytes"
    );
    assert_eq!(
        host("198.19.0.9"),
        Some(back),
        "the server's, counted on the reply rule"
    );
    assert!(sent.0 as usize == N + 1);

    // Every replica applied the same deltas through the group's log.
    let views: Vec<_> = cluster
        .scs
        .iter()
        .map(|s| {
            let g = cluster.group_traffic(s.addr());
            g.into_iter().map(|g| g.traffic).collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(views.len(), 3);
    for v in &views[1..] {
        assert_eq!(v, &views[0], "replicas agree");
    }
    let fm = cluster.stats();
    assert!(fm.counter_events_routed >= 2);
    assert_eq!(
        fm.counter_events_unknown_flow + fm.counter_events_no_group,
        0
    );
}
