//! SNAT state across scaling (split/merge, paper 000 Fig. 3), snapshots, and replica
//! determinism (chain replication runs every request on every replica).

mod snat_util;

use std::collections::{BTreeSet, HashMap};

use nf::{Decision, FlowEvent, NetworkFunction, NfEnv, SplitHalf};
use nfs::snat::{Snat, SnatConfig, SnatPool};
use packet::proto;
use proptest::prelude::*;
use snat_util::*;

const LO: u16 = 20_000;
const HI: u16 = 20_999;

fn cfg() -> SnatConfig {
    SnatConfig::new(vec![
        SnatPool::new(vec![ip(POOL_A), ip(POOL_B)], LO, HI).sources(&[INSIDE])
    ])
}

fn flow(host: u32, sport: u16, remote: u32, tcp: bool) -> String {
    format!(
        "100 {} 198.18.{}.{}:{} > 198.19.0.{}:{}",
        if tcp { "tcp" } else { "udp" },
        host / 200,
        host % 200 + 1,
        sport,
        remote % 250 + 1,
        if tcp { 443 } else { 53 }
    )
}

/// 40 hosts × 3 ports × 4 remotes, UDP and TCP, plus two hairpin flows.
fn populated() -> (Snat, Vec<(String, Decision)>) {
    let mut n = Snat::new(cfg()).expect("config");
    let mut out = Vec::new();
    let mut seed = 0;
    for host in 0..40 {
        for sport in [5000, 5001, 5002] {
            for remote in 0..4 {
                for tcp in [false, true] {
                    let f = flow(host, sport, remote, tcp);
                    seed += 1;
                    let d = decide_at(&mut n, &pkt(&f), 1000, seed);
                    ext(&d);
                    out.push((f, d));
                }
            }
        }
    }
    for (from, to) in [(1u32, 2u32), (3, 4)] {
        let (_, d) = &out[(to as usize) * 24];
        let (a, p) = ext(d);
        let f = format!("100 udp 198.18.0.{}:6000 > {a}:{p}", from + 1);
        let d = decide_at(&mut n, &pkt(&f), 1000, 999 + u64::from(from));
        assert!(d.forward.dst.addr.is_some(), "hairpinned");
        out.push((f, d));
    }
    (n, out)
}

fn mapping_set(parts: &[&Snat]) -> BTreeSet<(nfs::snat::MappingKey, nfs::snat::ExternalEndpoint)> {
    parts
        .iter()
        .flat_map(|p| p.mappings().into_iter().map(|m| (m.key, m.external)))
        .collect()
}

fn check_all(parts: &[&Snat]) {
    for a in [POOL_A, POOL_B] {
        for pr in [proto::UDP, proto::TCP, proto::ICMP] {
            check_ports(parts, ip(a), pr, LO, HI);
        }
    }
}

const HALF: SplitHalf = SplitHalf {
    moved_lo: 0,
    moved_hi: u64::MAX / 2,
};

#[test]
fn split_moves_flows_with_their_mappings_and_halves_free_ports() {
    let (mut a, flows) = populated();
    let before = mapping_set(&[&a]);
    let free_before = a.free_port_count(ip(POOL_A), proto::UDP);
    let part = a.split(&HALF).expect("split");
    let mut b = Snat::new(cfg()).expect("config");
    b.restore(&part).expect("new owner restores the part");
    assert_eq!(a.flow_count() + b.flow_count(), flows.len());
    assert!(b.flow_count() > 0 && a.flow_count() > 0);
    assert_eq!(
        b.stats().flows_created,
        0,
        "counters of the part start at zero"
    );
    // Every mapping survives, on the side(s) whose flows use it; no port is duplicated.
    assert_eq!(mapping_set(&[&a, &b]), before);
    check_all(&[&a, &b]);
    let fa = a.free_port_count(ip(POOL_A), proto::UDP);
    let fb = b.free_port_count(ip(POOL_A), proto::UDP);
    assert_eq!(fa + fb, free_before);
    assert!(fa.abs_diff(fb) <= 1, "free ports halved: {fa} / {fb}");
    // Each flow is where FM will send it, with its decision unchanged.
    for (f, d) in &flows {
        let owner = if HALF.moves(&key(f)) { &mut b } else { &mut a };
        let replays = owner.stats().replayed;
        assert_eq!(&decide_at(owner, &pkt_flags(f, 0x10), 2000, 1), d, "{f}");
        assert_eq!(
            owner.stats().replayed,
            replays + 1,
            "{f} answered from state"
        );
    }
    // A host whose mapping both sides hold keeps it on both (EIM within each partition).
    let shared: Vec<_> = a.mappings().into_iter().filter(|m| !m.sole_owner).collect();
    assert!(
        !shared.is_empty(),
        "the workload shares mappings across the split"
    );
    let m = shared[0];
    let f = format!("100 udp {}:{} > 198.19.0.200:9", m.key.addr, m.key.port);
    if m.key.proto == proto::UDP {
        for side in [&mut a, &mut b] {
            let got = ext(&decide_at(side, &pkt(&f), 3000, 5));
            assert_eq!(got, (m.external.addr, m.external.port));
        }
    }
}

#[test]
fn partitions_allocate_independently_then_merge_back_whole() {
    let (mut a, _) = populated();
    let part = a.split(&HALF).expect("split");
    let mut b = Snat::new(cfg()).expect("config");
    b.restore(&part).expect("restore");
    // New hosts on both sides at once: disjoint free sets mean no collisions.
    for h in 100..160 {
        for (side, seed) in [(&mut a, 1u64), (&mut b, 2u64)] {
            let f = flow(h + seed as u32 * 100, 7000, 9, false);
            ext(&decide_at(side, &pkt(&f), 5000, u64::from(h) * 10 + seed));
        }
    }
    check_all(&[&a, &b]);
    let all = mapping_set(&[&a, &b]);
    a.merge(&b.snapshot().expect("snapshot")).expect("merge");
    assert_eq!(mapping_set(&[&a]), all);
    assert!(a.mappings().iter().all(|m| m.sole_owner), "copies reunited");
    check_all(&[&a]);
    // Everything expires: the whole pool is free again, nothing leaked.
    timer(&mut a, u64::MAX / 2);
    assert_eq!(a.flow_count(), 0);
    assert!(a.mappings().is_empty());
    for addr in [POOL_A, POOL_B] {
        assert_eq!(
            a.free_port_count(ip(addr), proto::UDP),
            usize::from(HI - LO) + 1
        );
        assert_eq!(
            a.free_port_count(ip(addr), proto::TCP),
            usize::from(HI - LO) + 1
        );
    }
}

#[test]
fn a_shared_mapping_keeps_its_port_until_the_copies_merge() {
    let mut a = nat(3000, 3001);
    // One mapping, two flows; pick a split that separates them.
    let f1 = "100 udp 198.18.0.2:5000 > 198.19.0.10:53";
    let mut f2 = String::new();
    for r in 11..250 {
        let f = format!("100 udp 198.18.0.2:5000 > 198.19.0.{r}:53");
        if HALF.moves(&key(&f)) != HALF.moves(&key(f1)) {
            f2 = f;
            break;
        }
    }
    let e = ext(&decide_at(&mut a, &pkt(f1), 0, 1));
    assert_eq!(ext(&decide_at(&mut a, &pkt(&f2), 0, 2)), e);
    let mut b = nat(3000, 3001);
    b.restore(&a.split(&HALF).expect("split")).expect("restore");
    assert_eq!(a.flow_count(), 1);
    assert_eq!(b.flow_count(), 1);
    // Both sides' flows end; neither side may free the port alone.
    timer(&mut a, 10 * 60_000);
    timer(&mut b, 10 * 60_000);
    for side in [&a, &b] {
        assert_eq!(side.flow_count(), 0);
        assert_eq!(side.mappings().len(), 1, "kept as a reservation");
        assert!(!side.free_ports(ip(POOL_A), proto::UDP).contains(&e.1));
    }
    check_ports(&[&a, &b], ip(POOL_A), proto::UDP, 3000, 3001);
    a.merge(&b.snapshot().expect("snapshot")).expect("merge");
    assert!(a.mappings().is_empty());
    assert_eq!(a.free_port_count(ip(POOL_A), proto::UDP), 2);
}

#[test]
fn merge_refuses_overlapping_state_and_changes_nothing() {
    let (mut a, _) = populated();
    let before = a.snapshot().expect("snapshot");
    let err = a
        .merge(&before)
        .expect_err("a state merged with itself owns every port twice");
    assert!(err.to_string().contains("both sides"), "{err}");
    assert_eq!(a.snapshot().expect("snapshot"), before);
    assert!(a.merge(b"not json").is_err());
    assert_eq!(a.snapshot().expect("snapshot"), before);
}

#[test]
fn merge_with_a_flow_decided_on_both_sides_keeps_ours() {
    // During a scale-in, FM may send a retried request to the surviving group before the
    // state arrives; the flow then exists twice.
    let f = "100 udp 198.18.0.2:5000 > 198.19.0.10:53";
    let mut a = nat(3000, 3009);
    let mut b = nat(3000, 3009);
    b.restore(
        &a.split(&SplitHalf {
            moved_lo: 0,
            moved_hi: 0,
        })
        .expect("split"),
    )
    .expect("restore");
    let da = decide_at(&mut a, &pkt(f), 0, 1);
    let db = decide_at(&mut b, &pkt(f), 0, 2);
    a.merge(&b.snapshot().expect("snapshot")).expect("merge");
    assert_eq!(a.flow_count(), 1);
    assert_eq!(decide_at(&mut a, &pkt(f), 1, 3), da);
    assert_eq!(a.stats().merge_conflicts, 1);
    if ext(&da) != ext(&db) {
        assert_eq!(a.mappings().len(), 1, "the loser's mapping is freed");
    }
    check_ports(&[&a], ip(POOL_A), proto::UDP, 3000, 3009);
}

#[test]
fn snapshot_restore_round_trips_and_continues_identically() {
    let (mut a, _) = populated();
    event(
        &mut a,
        FlowEvent::TcpClosing {
            key: key(&flow(0, 5000, 0, true)),
        },
        1500,
    );
    let snap = a.snapshot().expect("snapshot");
    let mut b = Snat::new(cfg()).expect("config");
    b.restore(&snap).expect("restore");
    assert_eq!(b.snapshot().expect("snapshot"), snap, "byte-identical");
    assert_eq!(a.stats(), b.stats());
    for i in 0..50u64 {
        let f = flow(300 + i as u32, 9000, i as u32, i % 2 == 0);
        assert_eq!(
            decide_at(&mut a, &pkt(&f), 4000 + i, i),
            decide_at(&mut b, &pkt(&f), 4000 + i, i)
        );
    }
    assert_eq!(timer(&mut a, 250_000), timer(&mut b, 250_000));
    assert_eq!(a.snapshot().expect("a"), b.snapshot().expect("b"));
}

#[test]
fn restore_rejects_inconsistent_snapshots() {
    let (a, _) = populated();
    let good: serde_json::Value =
        serde_json::from_slice(&a.snapshot_json().expect("snapshot")).expect("json");
    let mut n = Snat::new(cfg()).expect("config");
    let before = n.snapshot().expect("snapshot");
    let mut cases = Vec::new();
    let mut v = good.clone();
    v["version"] = 99.into();
    cases.push(("version", v));
    let mut v = good.clone();
    v["port_pool"][0]["free"] = serde_json::json!([[1, 5]]);
    cases.push(("outside", v));
    let mut v = good.clone();
    let m = v["mappings"][0]["external"].clone();
    v["port_pool"][0] = serde_json::json!({"addr": m["addr"], "proto": m["proto"],
        "free": [[m["port"], m["port"]]]});
    cases.push(("both free and mapped", v));
    let mut v = good.clone();
    v["mappings"] = serde_json::json!([]);
    cases.push(("missing mapping", v));
    let mut v = good.clone();
    v["port_pool"][0]["addr"] = "203.0.113.1".into();
    cases.push(("not in the pool", v));
    for (needle, v) in cases {
        let e = n
            .restore(&serde_json::to_vec(&v).expect("bytes"))
            .expect_err(needle)
            .to_string();
        assert!(e.contains(needle), "{e} should mention {needle}");
        assert_eq!(
            n.snapshot().expect("snapshot"),
            before,
            "unchanged after {needle}"
        );
    }
}

#[test]
fn replicas_fed_the_same_requests_decide_identically() {
    // Chain replication: each replica runs each request itself with the head's now_ms
    // and seed. Their answers (and states) must not diverge, even near exhaustion.
    let mk = || {
        nat_with(vec![SnatPool::new(
            vec![ip(POOL_A), ip(POOL_B)],
            4000,
            4099,
        )
        .sources(&[INSIDE])])
    };
    let (mut r1, mut r2) = (mk(), mk());
    let mut rng = nf::DetRng::new(42);
    let mut decisions = Vec::new();
    for seq in 0..600u64 {
        let now = seq * 1500;
        let f = flow(
            rng.below(60) as u32,
            1024 + rng.below(8) as u16,
            rng.below(30) as u32,
            rng.below(2) == 0,
        );
        let p = pkt(&f);
        let d1 = decide_at(&mut r1, &p, now, seq);
        let d2 = decide_at(&mut r2, &p, now, seq);
        assert_eq!(d1, d2, "request {seq}: {f}");
        decisions.push(d1);
        if seq % 50 == 0 {
            assert_eq!(timer(&mut r1, now), timer(&mut r2, now));
        }
    }
    assert_eq!(r1.snapshot().expect("1"), r2.snapshot().expect("2"));
    assert!(r1.stats().exhausted > 0 || r1.stats().mappings_created > 150);
    // Different seeds do pick different ports (the randomness is real, just replayable).
    let mut r3 = mk();
    let mut r4 = mk();
    let mut differ = 0;
    for h in 0..20u32 {
        let p = pkt(&flow(h, 1, 1, false));
        if decide_at(&mut r3, &p, 0, u64::from(h)) != decide_at(&mut r4, &p, 0, u64::from(h) + 1000)
        {
            differ += 1;
        }
    }
    assert!(differ > 10);
}

#[derive(Debug, Clone)]
enum Op {
    Flow {
        host: u8,
        sport: u8,
        remote: u8,
        tcp: bool,
    },
    Hairpin {
        host: u8,
        target: u8,
    },
    Advance(u32),
    Close(u8),
    Split(u64),
    Merge,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..24, 0u8..4, 0u8..6, any::<bool>())
            .prop_map(|(host, sport, remote, tcp)| Op::Flow { host, sport, remote, tcp }),
        1 => (0u8..24, any::<u8>()).prop_map(|(host, target)| Op::Hairpin { host, target }),
        1 => (0u32..400_000).prop_map(Op::Advance),
        1 => any::<u8>().prop_map(Op::Close),
        1 => any::<u64>().prop_map(Op::Split),
        1 => Just(Op::Merge),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Any interleaving of flows, hairpins, closes, time, splits and merges keeps every
    /// port accounted for exactly once, and once everything expires and merges, the
    /// whole pool is free.
    #[test]
    fn ports_are_conserved_across_any_scaling(ops in proptest::collection::vec(op(), 1..120)) {
        let small = || nat_with(vec![SnatPool::new(vec![ip(POOL_A), ip(POOL_B)], 5000, 5039).sources(&[INSIDE])]);
        let mut parts: Vec<Snat> = vec![small()];
        let mut half: Option<SplitHalf> = None;
        let mut now = 0u64;
        let mut seq = 0u64;
        let mut seen: Vec<String> = Vec::new();
        let mut by_ext: HashMap<(std::net::IpAddr, u16), String> = HashMap::new();
        for op in ops {
            seq += 1;
            match op {
                Op::Flow { host, sport, remote, tcp } => {
                    let f = flow(u32::from(host), 6000 + u16::from(sport), u32::from(remote), tcp);
                    let i = usize::from(half.is_some_and(|h| h.moves(&key(&f))));
                    let d = decide_at(&mut parts[i], &pkt(&f), now, seq);
                    if d.verdict == nf::Verdict::pass() && !tcp {
                        by_ext.insert(ext(&d), f.clone());
                    }
                    seen.push(f);
                }
                Op::Hairpin { host, target } => {
                    if let Some((e, _)) = by_ext.iter().nth(usize::from(target) % by_ext.len().max(1)) {
                        let f = format!("100 udp 198.18.0.{}:7777 > {}:{}", host + 1, e.0, e.1);
                        let i = usize::from(half.is_some_and(|h| h.moves(&key(&f))));
                        decide_at(&mut parts[i], &pkt(&f), now, seq);
                    }
                }
                Op::Advance(ms) => {
                    now += u64::from(ms);
                    for p in parts.iter_mut() {
                        timer(p, now);
                    }
                }
                Op::Close(i) => {
                    if let Some(f) = seen.get(usize::from(i) % seen.len().max(1)) {
                        for p in parts.iter_mut() {
                            event(p, FlowEvent::TcpClosing { key: key(f) }, now);
                        }
                    }
                }
                Op::Split(at) => {
                    if half.is_none() {
                        let h = SplitHalf { moved_lo: at, moved_hi: u64::MAX };
                        let part = parts[0].split(&h).expect("split");
                        let mut b = small();
                        b.restore(&part).expect("restore");
                        parts.push(b);
                        half = Some(h);
                    }
                }
                Op::Merge => {
                    if half.take().is_some() {
                        let b = parts.pop().expect("second part");
                        parts[0].merge(&b.snapshot().expect("snapshot")).expect("merge");
                    }
                }
            }
            let refs: Vec<&Snat> = parts.iter().collect();
            for a in [POOL_A, POOL_B] {
                for pr in [proto::UDP, proto::TCP] {
                    check_ports(&refs, ip(a), pr, 5000, 5039);
                }
            }
        }
        if half.is_some() {
            let b = parts.pop().expect("second part");
            parts[0].merge(&b.snapshot().expect("snapshot")).expect("merge");
        }
        let a = &mut parts[0];
        a.on_timer(&mut NfEnv::new(u64::MAX, 0));
        prop_assert_eq!(a.flow_count(), 0);
        prop_assert!(a.mappings().is_empty(), "leaked: {:?}", a.mappings());
        for addr in [POOL_A, POOL_B] {
            prop_assert_eq!(a.free_port_count(ip(addr), proto::UDP), 40);
            prop_assert_eq!(a.free_port_count(ip(addr), proto::TCP), 40);
        }
    }
}
