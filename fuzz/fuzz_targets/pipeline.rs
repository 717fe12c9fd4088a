//! Arbitrary frames through a whole pipeline with rewrite/decap/encap rules installed for
//! the flows they parse as: every input must end in a counted verdict, never a panic.
#![no_main]
use std::net::Ipv4Addr;

use libfuzzer_sys::fuzz_target;
use pipeline::{
    parse_actions, FlowKey, MemRing, NodeAddr, PacketIo, Pipeline, PipelineConfig, Rule,
    RuleSource, VecSource, Verdict,
};

const RULES: [&str; 4] = [
    "decap; set-src 198.19.255.1:40000; encap 198.18.0.9 vni 200; count; out 1",
    "set-dst 198.19.0.7:8080; set-src :1; out 0",
    "decap; out 2",
    "encap 198.18.0.9 vni 7 dmac 02:00:00:00:00:09 smac 02:00:00:00:00:0a; out 1",
];

fuzz_target!(|data: &[u8]| {
    if data.is_empty() {
        return;
    }
    let node = NodeAddr {
        ip: Ipv4Addr::new(198, 18, 0, 1),
        mac: [2, 0, 0, 0, 0, 1],
        gw_mac: [2, 0, 0, 0, 0, 2],
    };
    let mut cfg = PipelineConfig::new(node);
    cfg.flow_capacity = 8;
    cfg.pending.global = 4;
    let mut p = Pipeline::new(cfg, RuleSource::None).unwrap();
    let frame = &data[1..];
    // Install a rule for whatever key this frame yields, so the action code runs on it.
    if let Ok(f) = packet::parse_frame(frame) {
        let (buf, fr, vni) = match (f.vxlan, f.vxlan_inner(frame)) {
            (Some(v), Some(inner)) => match packet::parse_frame(inner) {
                Ok(fi) => (inner, fi, v.vni),
                Err(_) => (frame, f, 0),
            },
            _ => (frame, f, 0),
        };
        if let Some(ip) = fr.ip() {
            if let Ok(key) = FlowKey::from_ip(buf, ip, vni) {
                let mut actions = parse_actions(RULES[data[0] as usize % RULES.len()]).unwrap();
                if !key.is_v4() {
                    actions.retain(|a| {
                        !matches!(
                            a,
                            pipeline::Action::SetSrc { .. } | pipeline::Action::SetDst { .. }
                        )
                    });
                }
                let _ = p.install_rule(&Rule::new(key, actions), 0);
            }
        }
    }
    let mut src = VecSource::default();
    src.push(frame.to_vec(), 0);
    let mut io = MemRing::new(src, 2);
    let mut descs = Vec::new();
    io.rx(&mut descs, 2).unwrap();
    p.process(io.region(), &mut descs, 1);
    for d in &descs {
        assert!(matches!(d.verdict, Verdict::Tx(_) | Verdict::Drop(_)));
        assert!(d.off as usize + d.len as usize <= d.cap as usize);
    }
    let s = p.stats();
    assert_eq!(s.tx_packets + s.total_drops(), descs.len() as u64);
});
