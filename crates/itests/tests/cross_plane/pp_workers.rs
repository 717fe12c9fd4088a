//! A PP node with two pipeline workers (docs/pp-pipeline.md, "Workers") against a real
//! FM and SC group: FM's reply goes to the worker that asked, the other direction of a
//! flow one worker set up is answered to the other worker from FM's rule cache
//! (without SC: what a reply that RSS put on the other queue does), and a revocation
//! reaches both workers.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{flow, snat_chain, wait, Cluster};
use pipeline::{PacketMeta, RuleReply, RuleRequest, RuleSource};
use pp::FmClient;

fn channel(
    link: &pp::WorkerLink,
) -> (
    &crossbeam_channel::Sender<RuleRequest>,
    &crossbeam_channel::Receiver<RuleReply>,
) {
    let RuleSource::Channel { requests, replies } = &link.source else {
        unreachable!("an FM link is a channel")
    };
    (requests, replies)
}

/// The next reply on `rx` that is not a revocation, within 10 s.
fn answer(rx: &crossbeam_channel::Receiver<RuleReply>) -> RuleReply {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let r = rx.recv_timeout(left).expect("an answer within 10 s");
        if !r.revoke {
            return r;
        }
    }
}

#[test]
fn each_worker_gets_its_own_answers_and_the_reverse_direction_comes_from_fms_cache() {
    let cluster = Cluster::start(
        vec![snat_chain(&["198.19.0.1"])],
        3,
        Arc::new(sc::BuiltinNfs),
    );
    cluster.wait_groups(1, 3);
    let mut cfg = cluster.pp_config("pp-workers");
    cfg.workers = 2;
    let (mut client, links) = FmClient::start(cfg).unwrap();
    assert_eq!(links.len(), 2);
    wait(Duration::from_secs(5), "PP session", || {
        client.connected().then_some(())
    });
    let (req0, rep0) = channel(&links[0]);
    let (req1, rep1) = channel(&links[1]);

    // Worker 1 sets a flow up: its answer comes to worker 1, none to worker 0.
    let mut first = flow(7);
    first.worker = 1;
    req1.send(first.clone()).unwrap();
    let fwd = answer(rep1);
    let rule = fwd.result.clone().expect("SNAT rule");
    assert_eq!(rule.key, first.key);
    assert!(fwd.mapped_source().is_some(), "{fwd:?}");
    let reverse = fwd
        .also
        .first()
        .expect("the reply direction's rule")
        .clone();
    assert!(
        rep0.recv_timeout(Duration::from_millis(300)).is_err(),
        "worker 0 asked nothing"
    );
    let before = cluster.stats();

    // The reply direction lands on worker 0, which never saw the flow: it asks as
    // an unbound tenant by key, and FM answers from its cache.
    let mut back = RuleRequest::new(
        reverse.key,
        proto::UNBOUND_TENANT,
        0,
        PacketMeta::new(60, 0),
    );
    back.worker = 0;
    req0.send(back).unwrap();
    let got = answer(rep0);
    assert_eq!(got.result.as_ref().ok(), Some(&reverse), "{got:?}");
    assert!(
        rep1.recv_timeout(Duration::from_millis(300)).is_err(),
        "worker 1 did not ask"
    );
    let after = cluster.stats();
    assert!(after.cache.hits > before.cache.hits, "{after:?}");
    assert_eq!(
        after.submitted, before.submitted,
        "SC was not asked: {after:?}"
    );

    // The chain goes: FM withdraws the flow's rules from both workers (it does not
    // know which holds them).
    cluster
        .rt
        .block_on(cluster.fm.set_desired(vec![], vec![], vec![]))
        .unwrap();
    for (i, rx) in [rep0, rep1].into_iter().enumerate() {
        wait(
            Duration::from_secs(5),
            "a revocation at each worker",
            || {
                rx.recv_timeout(Duration::from_millis(50))
                    .ok()
                    .filter(|r| r.revoke && r.key == first.key)
                    .map(|_| ())
            },
        );
        println!("worker {i}: revoked");
    }
    client.stop();
}
