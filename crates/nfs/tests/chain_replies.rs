//! A chain of the built-in NFs asked about the reply direction of a flow it decided:
//! what SC sees when PP and FM lost only a flow's reverse rule (evicted, or a PP node
//! that took over a vIP). The reply must meet the NFs in the order the reverse rule
//! carries it (SNAT before the firewall) and get the flow's own rules back.

use nf::{Chain, ChainSpec, ComposedRules, Egress, FirstPacket, NfEnv};
use pipeline::{Action, FlowKey, PacketMeta, Rule};

const SYN: u8 = 0x02;
const SYN_ACK: u8 = 0x12;
const ACK: u8 = 0x10;

fn chain(kinds: &[&str]) -> Chain {
    let nfs: Vec<_> = (kinds.iter())
        .map(|k| {
            let c = match *k {
                "fw" => serde_json::json!({"kind": "fw", "tenants": [{"tenant": 1,
                    "default_action": "deny",
                    "rules": [{"action": "allow", "proto": "tcp", "dport": 443}]}]}),
                "snat" => serde_json::json!({"kind": "snat", "pools": [{"addresses":
                    ["198.19.255.1"], "sources": ["198.18.0.0/16"]}]}),
                "privatelink" => serde_json::json!({"kind": "privatelink", "endpoints": [
                    {"address": "198.19.0.9", "port": 443, "protocol": "tcp",
                     "service_addr": "198.19.1.7", "service_port": 8443}],
                    "source": {"addresses": ["198.19.9.1"]}}),
                _ => serde_json::json!({"kind": "lb", "services": [{"vip": "198.19.0.9",
                    "port": 443, "protocol": "tcp", "backends": [
                    {"addr": "198.19.1.7", "port": 8443}]}]}),
            };
            nfs::build(&serde_json::from_value(c).expect("config")).expect("nf")
        })
        .collect();
    let n = nfs.len();
    Chain::new(nfs, ChainSpec::seq(n), Egress::LOCAL, Egress::LOCAL).expect("chain")
}

fn ask(c: &mut Chain, key: FlowKey, flags: u8, now: u64) -> ComposedRules {
    let p = FirstPacket::new(key, 1, PacketMeta::new(60, flags));
    c.decide(&p, &mut NfEnv::new(now, now)).expect("decided")
}

fn drops(r: &Rule) -> bool {
    r.actions.iter().any(|a| matches!(a, Action::Drop { .. }))
}

fn same_rule(a: &Rule, b: &Rule) {
    assert_eq!((a.key, &a.actions), (b.key, &b.actions));
}

fn client() -> FlowKey {
    "100 tcp 198.18.0.2:40000 > 198.19.0.9:443"
        .parse()
        .expect("key")
}

#[test]
fn a_reply_whose_reverse_rule_was_lost_gets_the_flows_rules_back() {
    for kinds in [
        &["fw", "snat"][..],
        &["fw", "snat", "lb"],
        &["snat", "fw"],
        &["fw"],
        &["fw", "privatelink"],
    ] {
        let mut c = chain(kinds);
        let first = ask(&mut c, client(), SYN, 0);
        assert!(!drops(&first.forward), "{kinds:?}: {first:?}");
        let rev = first.reverse.clone().expect("reverse rule");
        // The server's SYN-ACK, then a later ACK, arrive where PP has no reverse rule.
        for (flags, now) in [(SYN_ACK, 10), (ACK, 20)] {
            let again = ask(&mut c, rev.key, flags, now);
            assert!(!drops(&again.forward), "{kinds:?}: {again:?}");
            same_rule(&again.forward, &rev);
            same_rule(
                again.reverse.as_ref().expect("its companion"),
                &first.forward,
            );
            let path: Vec<&str> = kinds.iter().rev().copied().collect();
            assert_eq!(again.path_names(), path, "replies meet the NFs last first");
        }
    }
}

#[test]
fn a_reply_of_a_flow_no_nf_knows_is_still_refused() {
    let mut c = chain(&["fw", "snat"]);
    ask(&mut c, client(), SYN, 0);
    // Another pool port: nothing was ever translated there.
    let stray: FlowKey = "100 tcp 198.19.0.9:443 > 198.19.255.1:40001"
        .parse()
        .expect("key");
    let r = ask(&mut c, stray, SYN_ACK, 10);
    assert!(drops(&r.forward), "{r:?}");
    assert_eq!(r.path_names(), ["fw"], "asked forward, as any unknown flow");
}

/// A replica restored from a snapshot (as a chain repair brings one in) holds its rows
/// in other slots of its maps (`nf::SlabMap`: in the snapshot's key order, not in
/// arrival order) and grew their indexes at other times. It still decides alike and
/// snapshots the same bytes: no decision and no snapshot byte depends on where a row
/// sits or when a map grew.
#[test]
fn a_replica_restored_midway_agrees_with_one_that_ran_every_request() {
    let flow = |i: u32| -> FlowKey {
        let src = format!("198.18.{}.{}", 1 + i / 250 % 250, 1 + i % 250);
        format!("100 tcp {src}:{} > 198.19.0.9:443", 1024 + i % 50_000)
            .parse()
            .expect("key")
    };
    let mut a = chain(&["fw", "snat", "lb"]);
    for i in 0..12_000u32 {
        ask(&mut a, flow(i), SYN, u64::from(i));
    }
    let mut b = chain(&["fw", "snat", "lb"]);
    b.restore(&a.snapshot().expect("a")).expect("restored");
    // Past the next growth of every map's index (at 28,672 rows).
    for i in 12_000..30_000u32 {
        let now = u64::from(i);
        let (x, y) = (
            ask(&mut a, flow(i), SYN, now),
            ask(&mut b, flow(i), SYN, now),
        );
        same_rule(&x.forward, &y.forward);
        match (&x.reverse, &y.reverse) {
            (Some(p), Some(q)) => same_rule(p, q),
            (p, q) => assert_eq!(p.is_some(), q.is_some(), "flow {i}"),
        }
        // Replies of earlier flows find their rows wherever they sit.
        if i % 97 == 0 {
            let rev = x.reverse.clone().expect("reverse rule");
            let (p, q) = (
                ask(&mut a, rev.key, SYN_ACK, now),
                ask(&mut b, rev.key, SYN_ACK, now),
            );
            same_rule(&p.forward, &q.forward);
        }
    }
    assert_eq!(a.snapshot().expect("a"), b.snapshot().expect("b"));
}
