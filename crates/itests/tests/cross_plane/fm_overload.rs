//! Overload of the setup path (issue 16): a PP node floods FM with rule requests far
//! beyond what FM and its SC group take. FM must shed the excess as `setup-overload`
//! replies, counted at FM and at PP, and must never drop a session: no live node may
//! look dead because requests filled a queue.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use fm::FmConfig;
use pipeline::{RuleReply, RuleSource};

/// Whether FM refused the request as setup overload.
fn is_shed(r: &RuleReply) -> bool {
    r.result
        .as_ref()
        .err()
        .is_some_and(|e| e.contains("setup-overload"))
}

#[test]
fn a_request_flood_sheds_flows_as_setup_overload_and_drops_no_session() {
    let chain = chain(serde_json::json!([{"kind": "test-fw", "deny_dports": [23]}]));
    // Small bounds, so a flood from one PP node is far over both of them.
    let cfg = FmConfig {
        chains: vec![chain],
        max_inflight: 64,
        max_queued: 512,
        ..FmConfig::default()
    };
    let c = Cluster::start_with(cfg, 3, Arc::new(sc::testing::TestNfs));
    c.wait_groups(1, 3);
    let mut ccfg = c.pp_config("pp-flood");
    ccfg.linger = Duration::from_micros(50);
    let (client, link) = pp_session(ccfg);
    let RuleSource::Channel { requests, replies } = link.source else {
        unreachable!()
    };
    let s0 = c.stats();

    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let flood = {
        let (stop, sent) = (stop.clone(), sent.clone());
        std::thread::spawn(move || {
            let mut i = 0u32;
            // As fast as the client takes them, up to 300k: far more than both bounds.
            while !stop.load(Ordering::Relaxed) && i < 300_000 {
                if requests.send(flow(i)).is_err() {
                    break;
                }
                i += 1;
                sent.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let (mut got, mut shed) = (0u64, 0u64);
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(3) {
        if let Ok(r) = replies.recv_timeout(Duration::from_millis(10)) {
            got += 1;
            shed += u64::from(is_shed(&r));
        }
    }
    stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    // Every request is answered: a rule, or a refusal.
    let n = sent.load(Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(20);
    while got < n && Instant::now() < deadline {
        if let Ok(r) = replies.recv_timeout(Duration::from_millis(100)) {
            got += 1;
            shed += u64::from(is_shed(&r));
        }
    }
    assert_eq!(got, n, "requests left unanswered");
    let s1 = c.stats();
    assert!(n > 10_000, "the flood sent only {n} requests");
    assert!(shed > 0, "nothing was shed ({n} requests)");
    assert_eq!(s1.setup_overload - s0.setup_overload, shed, "FM's count");
    assert_eq!(
        client.stats().setup_overload.load(Ordering::Relaxed),
        shed,
        "PP's count"
    );
    // No session dropped: every node alive, none declared dead, the PP session unbroken.
    assert_eq!(s1.nodes_dead, s0.nodes_dead, "FM declared a live node dead");
    assert_eq!(client.stats().session_errors.load(Ordering::Relaxed), 0);
    let members = c.rt.block_on(c.fm.members()).unwrap();
    assert_eq!(members.members.len(), 4);
    assert!(members.members.iter().all(|m| m.alive), "{members:?}");
    eprintln!("flood: {n} requests, {shed} shed as setup-overload");
}
