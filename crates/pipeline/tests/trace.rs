//! The trace hook in a running pipeline: a miss, FM's decision, the held packets
//! released as hits, later hits, a drop with its reason, and the count running out.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use pipeline::{
    parse_actions, FlowKey, Lookup, PipelineConfig, Rule, RuleReply, TraceCounters, TraceFilter,
    TraceRecord, Tracer,
};
use testkit::rig::{client_udp, node, Rig, TENANT_VNI};

fn tenant_udp(sport: u16, dport: u16) -> Vec<u8> {
    client_udp(TENANT_VNI, sport, dport, &[0u8; 8])
}

fn key(sport: u16, dport: u16) -> FlowKey {
    format!("100 udp 198.18.10.2:{sport} > 198.19.0.9:{dport}")
        .parse()
        .unwrap()
}

fn rig() -> Rig {
    let mut cfg = PipelineConfig::new(node());
    cfg.flow_capacity = 1024;
    let mut r = Rig::tenant(cfg, 16);
    r.worker.io.sink.capture = true;
    r
}

#[test]
fn a_trace_shows_the_miss_the_decision_and_the_hits() {
    let mut r = rig();
    let (tx, rx) = crossbeam_channel::bounded(64);
    let c = Arc::new(TraceCounters::default());
    let f = TraceFilter::new(Some(7), None, "udp and dst port 53").unwrap();
    r.worker
        .pipeline
        .set_tracer(Some(Tracer::new(f, 6, 128, tx, c.clone())));
    // Another port: tested, not traced.
    r.send([tenant_udp(1000, 54)]);
    // Two packets of a new flow: a miss that asks, a miss that waits.
    r.send([tenant_udp(1000, 53), tenant_udp(1000, 53)]);
    r.replies
        .send(RuleReply {
            decided_by: pipeline::DecidedBy::ScGroup(4),
            ..RuleReply::ok(Rule::new(
                key(1000, 53),
                parse_actions(
                    "decap; set-src 198.19.255.1:40000; encap 198.18.0.9 vni 200; count; out 1",
                )
                .unwrap(),
            ))
        })
        .unwrap();
    r.worker.run_once().unwrap();
    // Two more hits; then a rule that drops.
    r.send([tenant_udp(1000, 53)]);
    r.worker
        .pipeline
        .install_rule(
            &Rule::new(key(1001, 53), parse_actions("drop blocked").unwrap()),
            0,
        )
        .unwrap();
    r.send([
        tenant_udp(1001, 53),
        tenant_udp(1000, 53),
        tenant_udp(1000, 53),
    ]);
    let recs: Vec<TraceRecord> = rx.try_iter().collect();
    let mut lines = Vec::new();
    for rec in &recs {
        match rec {
            TraceRecord::Packet(p) => {
                assert_eq!((p.tenant, p.vni), (Some(7), 100));
                assert_eq!(p.outer_len as usize, tenant_udp(1000, 53).len());
                assert_eq!(p.inner_len as usize, p.outer_len as usize - 50);
                assert_eq!(&p.outer[..], &tenant_udp(p.key.unwrap().sport(), 53)[..]);
                lines.push(format!(
                    "{} {:?} {} {:?} released={} out={}",
                    p.seq, p.lookup, p.verdict, p.drop_reason, p.released, p.out_len
                ));
            }
            TraceRecord::Decision(d) => {
                assert_eq!(d.key, key(1000, 53));
                assert!(d.installed);
                assert_eq!(d.decided_by, "SC group 4");
                lines.push(format!("decision for {}: {:?}", d.for_seq, d.result));
            }
        }
    }
    let tx_len = 50 + 14 + 20 + 8 + 8;
    let want = [
        "1 Miss { expired: false, request: true } held None released=false out=0".to_string(),
        "2 Miss { expired: false, request: false } held None released=false out=0".to_string(),
        "decision for 1: Ok(\"decap; set-src 198.19.255.1:40000; encap 198.18.0.9 vni 200; count; out 1\")".to_string(),
        format!("3 Hit {{ entry: {0} }} tx 1 None released=true out={tx_len}", entry(&recs, 3)),
        format!("4 Hit {{ entry: {0} }} tx 1 None released=true out={tx_len}", entry(&recs, 4)),
        format!("5 Hit {{ entry: {0} }} tx 1 None released=false out={tx_len}", entry(&recs, 5)),
        format!("6 Hit {{ entry: {0} }} drop Some(\"rule:blocked\") released=false out=0", entry(&recs, 6)),
    ];
    assert_eq!(lines, want);
    // Six packets taken: the count is used up, the tracer disarmed itself, and the
    // packets after it were tested but not traced.
    assert!(r.worker.pipeline.tracer().is_none());
    assert_eq!(c.emitted.load(Ordering::Relaxed), 7);
    assert_eq!(c.lost.load(Ordering::Relaxed), 0);
    assert_eq!(c.tested.load(Ordering::Relaxed), 7);
    assert!(rx.try_recv().is_err());
}

fn entry(recs: &[TraceRecord], seq: u64) -> u32 {
    recs.iter()
        .find_map(|r| match r {
            TraceRecord::Packet(p) if p.seq == seq => match p.lookup {
                Lookup::Hit { entry } => Some(entry),
                _ => None,
            },
            _ => None,
        })
        .expect("a hit")
}
