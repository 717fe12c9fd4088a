//! The per-host connection limiter of `docs/nf-api.md` ("Writing a new NF"): limits per
//! host, slots released by events and expiry, and state that survives snapshot, restore,
//! split and merge.

use std::collections::BTreeMap;

use nf::{Chain, ChainSpec, Egress, FirstPacket, FlowEvent, NetworkFunction, NfEnv, NfError};
use nf::{SplitHalf, Verdict};
use nfs::connlimit::{ConnLimit, ConnLimitConfig};
use packet::tcp_flags::SYN;
use pipeline::{FlowKey, PacketMeta};
use proptest::prelude::*;

fn key(s: &str) -> FlowKey {
    s.parse().expect("flow key")
}

fn pkt(s: &str) -> FirstPacket {
    FirstPacket::new(key(s), 1, PacketMeta::new(60, SYN))
}

fn limiter(limit: u32) -> ConnLimit {
    ConnLimit::new(&ConnLimitConfig {
        limit,
        idle_timeout_s: Some(60),
    })
    .expect("config")
}

/// Flow `i` of host `h` in VPC `vni`.
fn flow(vni: u32, h: u8, i: u16) -> String {
    format!("{vni} tcp 10.0.0.{h}:{} > 192.0.2.1:443", 10_000 + i)
}

fn decide(nf: &mut ConnLimit, f: &str, now_ms: u64) -> Verdict {
    nf.first_packet(&pkt(f), &mut NfEnv::new(now_ms, 7))
        .expect("decided")
        .verdict
}

fn refused() -> Verdict {
    Verdict::drop("connlimit-exceeded")
}

#[test]
fn the_limit_holds_per_host_and_other_hosts_are_unaffected() {
    let mut nf = limiter(3);
    for i in 0..3 {
        assert_eq!(decide(&mut nf, &flow(5, 1, i), 0), Verdict::pass());
    }
    assert_eq!(nf.in_use(&key(&flow(5, 1, 0))), 3);
    assert_eq!(decide(&mut nf, &flow(5, 1, 3), 0), refused());
    assert_eq!(decide(&mut nf, &flow(5, 1, 4), 0), refused());
    // Another host, and the same address in another VPC, have their own slots.
    for i in 0..3 {
        assert_eq!(decide(&mut nf, &flow(5, 2, i), 0), Verdict::pass());
        assert_eq!(decide(&mut nf, &flow(6, 1, i), 0), Verdict::pass());
    }
    assert_eq!(nf.in_use(&key(&flow(5, 1, 0))), 3, "refusals take no slot");
    assert_eq!(nf.in_use(&key(&flow(5, 2, 0))), 3);
    assert_eq!(nf.in_use(&key(&flow(6, 1, 0))), 3);
}

#[test]
fn a_flow_asked_about_again_keeps_its_slot_in_either_direction() {
    let mut nf = limiter(1);
    let f = flow(5, 1, 0);
    assert_eq!(decide(&mut nf, &f, 0), Verdict::pass());
    assert_eq!(decide(&mut nf, &f, 1_000), Verdict::pass());
    let reply = key(&f).reversed().to_string();
    assert_eq!(decide(&mut nf, &reply, 2_000), Verdict::pass());
    assert_eq!(nf.in_use(&key(&f)), 1);
    assert_eq!(nf.in_use(&key(&reply)), 0, "the server got no slot");
    assert_eq!(decide(&mut nf, &flow(5, 1, 1), 0), refused());
}

#[test]
fn close_and_expiry_events_release_a_slot() {
    for ev in [
        |k| FlowEvent::TcpClosing { key: k },
        |k| FlowEvent::Expired { key: k },
    ] {
        let mut nf = limiter(2);
        decide(&mut nf, &flow(5, 1, 0), 0);
        decide(&mut nf, &flow(5, 1, 1), 0);
        assert_eq!(decide(&mut nf, &flow(5, 1, 2), 0), refused());
        let e: FlowEvent = ev(key(&flow(5, 1, 0)));
        nf.on_event(&e, &mut NfEnv::new(10, 0));
        assert_eq!(nf.in_use(&key(&flow(5, 1, 0))), 1, "{e:?}");
        assert_eq!(decide(&mut nf, &flow(5, 1, 2), 20), Verdict::pass());
        assert_eq!(decide(&mut nf, &flow(5, 1, 3), 20), refused());
    }
}

#[test]
fn the_timer_forgets_idle_flows_and_activity_keeps_them() {
    let mut nf = limiter(2);
    decide(&mut nf, &flow(5, 1, 0), 0);
    decide(&mut nf, &flow(5, 1, 1), 1_000);
    // Activity at 50 s moves flow 0's deadline from 60 s to 110 s.
    let active = FlowEvent::Active {
        key: key(&flow(5, 1, 0)),
    };
    nf.on_event(&active, &mut NfEnv::new(50_000, 0));
    assert!(nf.on_timer(&mut NfEnv::new(59_999, 0)).is_empty());
    assert_eq!(
        nf.on_timer(&mut NfEnv::new(61_000, 0)),
        vec![key(&flow(5, 1, 1))]
    );
    assert_eq!(nf.in_use(&key(&flow(5, 1, 0))), 1);
    assert_eq!(decide(&mut nf, &flow(5, 1, 2), 61_000), Verdict::pass());
    assert_eq!(
        nf.on_timer(&mut NfEnv::new(110_000, 0)),
        vec![key(&flow(5, 1, 0))]
    );
}

#[test]
fn decisions_carry_the_idle_timeout_and_a_short_drop_hold() {
    let mut nf = limiter(1);
    let env = &mut NfEnv::new(0, 0);
    let d = nf.first_packet(&pkt(&flow(5, 1, 0)), env).expect("ok");
    assert_eq!(d.idle_timeout, Some(std::time::Duration::from_secs(60)));
    assert!(d.forward.is_empty() && d.reverse.is_empty());
    let d = nf.first_packet(&pkt(&flow(5, 1, 1)), env).expect("ok");
    assert_eq!(d.verdict, refused());
    assert!(d.idle_timeout.is_some_and(|t| t.as_secs() < 60));
}

#[test]
fn snapshot_restore_keeps_every_slot_and_replicas_agree() {
    let mut a = limiter(2);
    let mut b = limiter(2);
    for f in [flow(5, 1, 0), flow(5, 1, 1), flow(5, 2, 0), flow(6, 3, 9)] {
        assert_eq!(decide(&mut a, &f, 100), decide(&mut b, &f, 100));
    }
    let snap = a.snapshot().expect("snapshot");
    assert_eq!(
        snap,
        b.snapshot().expect("snapshot"),
        "replicas byte-identical"
    );
    let mut c = limiter(2);
    c.restore(&snap).expect("restore");
    assert_eq!(c.snapshot().expect("snapshot"), snap);
    assert_eq!(decide(&mut c, &flow(5, 1, 2), 200), refused());
    assert_eq!(decide(&mut c, &flow(5, 2, 1), 200), Verdict::pass());
    assert_eq!(
        c.on_timer(&mut NfEnv::new(60_100, 0)).len(),
        4,
        "deadlines survived"
    );
}

#[test]
fn a_corrupt_snapshot_is_refused_and_changes_nothing() {
    let mut nf = limiter(1);
    decide(&mut nf, &flow(5, 1, 0), 0);
    let before = nf.snapshot().expect("snapshot");
    for bad in [&b"\xff\xff\xff\xff\xff"[..], &before[..before.len() - 1]] {
        assert!(matches!(nf.restore(bad), Err(NfError::Snapshot(_))));
        assert!(matches!(nf.merge(bad), Err(NfError::Snapshot(_))));
    }
    assert_eq!(nf.snapshot().expect("snapshot"), before);
}

#[test]
fn bad_configuration_is_a_typed_error() {
    for (limit, idle) in [(0, None), (1, Some(0)), (1, Some(31 * 24 * 3600))] {
        let cfg = ConnLimitConfig {
            limit,
            idle_timeout_s: idle,
        };
        assert!(
            matches!(ConnLimit::new(&cfg), Err(NfError::Config(_))),
            "{cfg:?}"
        );
    }
    for bad in [
        r#"{"kind": "connlimit"}"#,
        r#"{"kind": "connlimit", "limit": -1}"#,
        r#"{"kind": "connlimit", "limit": 2, "burst": 1}"#,
        r#"{"kind": "connlimit", "limit": "2"}"#,
    ] {
        assert!(serde_json::from_str::<nfs::NfConfig>(bad).is_err(), "{bad}");
    }
    let zero: nfs::NfConfig =
        serde_json::from_str(r#"{"kind": "connlimit", "limit": 0}"#).expect("parses");
    assert!(matches!(nfs::build(&zero), Err(NfError::Config(_))));
}

#[test]
fn builds_from_json_and_runs_in_a_chain() {
    let cfg: nfs::NfConfig =
        serde_json::from_str(r#"{"kind": "connlimit", "limit": 1, "idle_timeout_s": 30}"#)
            .expect("config");
    let nf = nfs::build(&cfg).expect("built");
    assert_eq!(nf.kind(), "connlimit");
    let mut chain =
        Chain::new(vec![nf], ChainSpec::seq(1), Egress::LOCAL, Egress::LOCAL).expect("chain");
    let env = &mut NfEnv::new(0, 1);
    let first = chain.decide(&pkt(&flow(5, 1, 0)), env).expect("decided");
    assert_eq!(first.path_names(), ["connlimit"]);
    assert!(
        first.reverse.is_some(),
        "an admitted flow gets a reply rule"
    );
    let second = chain.decide(&pkt(&flow(5, 1, 1)), env).expect("decided");
    assert!(
        second.reverse.is_none(),
        "a refused flow gets a drop rule only"
    );
    assert!(
        pipeline::format_actions(&second.forward.actions).contains("connlimit-exceeded"),
        "{:?}",
        second.forward.actions
    );
}

/// Host of each flow, by the limiter's own count.
fn usage(nf: &ConnLimit, flows: &[String]) -> BTreeMap<String, usize> {
    flows
        .iter()
        .map(|f| {
            let k = key(f);
            (format!("{} {}", k.vni(), k.src()), nf.in_use(&k))
        })
        .collect()
}

proptest! {
    /// A split moves every flow with its slot (the two parts' counts add up to the
    /// whole, per host), the new owner restores its part and keeps those flows without
    /// taking new slots, and merging the part back gives the original state.
    #[test]
    fn split_and_merge_keep_the_counts(
        picks in prop::collection::vec((0u8..4, 0u16..40, 0u64..3), 1..60),
        lo in any::<u64>(),
        width in any::<u64>(),
    ) {
        let mut a = limiter(5);
        let mut admitted = Vec::new();
        for (h, port, t) in picks {
            let f = flow(7, h, port);
            if decide(&mut a, &f, t * 1_000) == Verdict::pass() {
                admitted.push(f);
            }
        }
        admitted.sort();
        admitted.dedup();
        let whole = a.snapshot().expect("snapshot");
        let before = usage(&a, &admitted);
        let half = SplitHalf { moved_lo: lo, moved_hi: lo.saturating_add(width) };
        let part = a.split(&half).expect("split");
        let mut b = limiter(5);
        b.restore(&part).expect("restore");
        for f in &admitted {
            let (kept, moved) = (a.in_use(&key(f)), b.in_use(&key(f)));
            prop_assert_eq!(kept + moved, before[&format!("7 {}", key(f).src())]);
        }
        for f in &admitted {
            // The owner FM now sends the flow to answers it as a known flow.
            let owner = if half.moves(&key(f)) { &mut b } else { &mut a };
            let n = owner.in_use(&key(f));
            prop_assert_eq!(decide(owner, f, 5_000), Verdict::pass());
            prop_assert_eq!(owner.in_use(&key(f)), n);
        }
        // Re-asking refreshed deadlines; merge a part taken before that to compare.
        let mut a2 = limiter(5);
        a2.restore(&whole).expect("restore");
        let p2 = a2.split(&half).expect("split");
        a2.merge(&p2).expect("merge");
        prop_assert_eq!(a2.snapshot().expect("snapshot"), whole);
        prop_assert_eq!(usage(&a2, &admitted), before);
    }
}

/// Every `rust` block of the walkthrough in `docs/nf-api.md` is a verbatim excerpt of the
/// NF or of its registration, so the document cannot drift from the code.
#[test]
fn the_walkthrough_quotes_the_source() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let read = |p: &str| std::fs::read_to_string(root.join(p)).expect(p);
    let doc = read("../../docs/nf-api.md");
    let sources = [read("src/connlimit.rs"), read("src/lib.rs")];
    let start = doc
        .find("## Writing a new NF: a per-host connection limiter")
        .expect("walkthrough section");
    let section = &doc[start..];
    let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
    let mut blocks = 0;
    for block in section.split("```rust\n").skip(1) {
        let code = block.split("```").next().unwrap_or_default();
        assert!(
            sources.iter().any(|s| s.contains(code)),
            "not in the source:\n{code}"
        );
        blocks += 1;
    }
    assert!(blocks >= 8, "only {blocks} code blocks in the walkthrough");
}
