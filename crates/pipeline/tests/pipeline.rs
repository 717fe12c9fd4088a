//! Behaviour of the pipeline around its tables: miss path, pending limits, timeouts,
//! eviction, policing, replacement, and robustness against arbitrary bytes.

use std::net::IpAddr;
use std::time::Duration;

use packet::build::{ip_frame, udp_v4, vxlan_wrap, L4Spec};
use packet::rewrite::Addr;
use pipeline::{
    parse_actions, DropReason, FlowKey, MemRing, PacketIo, PendingConfig, Pipeline, PipelineConfig,
    Policer, Rule, RuleReply, RuleSource, VecSource, Verdict,
};
use proptest::prelude::*;
use testkit::rig::{client_udp, node, Rig, TENANT_VNI};

/// A tenant UDP packet from 198.18.10.2:`sport` to 198.19.0.9:53 on VNI 100, with a
/// sequence number in the payload.
fn tenant_udp(sport: u16, seq: u32) -> Vec<u8> {
    client_udp(TENANT_VNI, sport, 53, &seq.to_be_bytes())
}

fn tenant_key(sport: u16) -> FlowKey {
    format!("100 udp 198.18.10.2:{sport} > 198.19.0.9:53")
        .parse()
        .unwrap()
}

fn snat_rule(sport: u16) -> Rule {
    Rule::new(
        tenant_key(sport),
        parse_actions("decap; set-src 198.19.255.1:40000; encap 198.18.0.9 vni 200; count; out 1")
            .unwrap(),
    )
}

fn rig(pending: PendingConfig, channel_cap: usize) -> Rig {
    let mut cfg = PipelineConfig::new(node());
    cfg.pending = pending;
    cfg.flow_capacity = 1024;
    let mut r = Rig::tenant(cfg, channel_cap);
    r.worker.io.sink.capture = true;
    r
}

/// Sequence number carried in an output frame (re-encapped: outer 50 + eth 14 + ip 20 + udp 8).
fn seq_of(frame: &[u8]) -> u32 {
    u32::from_be_bytes(frame[92..96].try_into().unwrap())
}

/// FM's `reply` reaches the worker, which takes it on its next run.
fn answer(r: &mut Rig, reply: RuleReply) {
    r.replies.send(reply).unwrap();
    r.send([]);
    r.worker.run_once().unwrap();
}

/// The sequence numbers of the frames sent since the last look, in order.
fn sent_seqs(r: &mut Rig) -> Vec<u32> {
    r.out().iter().map(|f| seq_of(f)).collect()
}

#[test]
fn miss_holds_requests_once_then_releases_in_order_and_hits() {
    let mut r = rig(PendingConfig::default(), 16);
    r.send((0..5).map(|i| tenant_udp(1000, i)));
    assert!(r.out().is_empty(), "nothing leaves before the rule");
    let req = r.requests.try_recv().expect("one request");
    assert!(r.requests.try_recv().is_err(), "only one request per flow");
    assert_eq!(req.key, tenant_key(1000));
    assert_eq!((req.tenant, req.chain), (7, 3));
    assert_eq!(req.meta.len, tenant_udp(1000, 0).len() as u16);
    let s = r.worker.pipeline.stats();
    assert_eq!((s.misses, s.rule_requests, s.hits), (5, 1, 0));
    assert_eq!(r.worker.pipeline.pending().held(), 5);

    answer(&mut r, RuleReply::ok(snat_rule(1000)));
    let out = r.out();
    assert_eq!(out.len(), 5);
    assert_eq!(
        out.iter().map(|f| seq_of(f)).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4]
    );
    // Rewritten: inner source is the pool address and port.
    assert_eq!(&out[0][50 + 14 + 12..50 + 14 + 16], &[198, 19, 255, 1]);
    assert_eq!(r.worker.pipeline.pending().held(), 0);

    r.send((5..8).map(|i| tenant_udp(1000, i)));
    let out = r.out();
    assert_eq!(out.iter().map(|f| seq_of(f)).collect::<Vec<_>>(), [5, 6, 7]);
    let s = r.worker.pipeline.stats();
    assert_eq!(s.pending_released, 5);
    assert_eq!(s.hits, 5 + 3, "released packets hit too");
    assert_eq!(s.rx_packets, 8, "released packets are not received twice");
    let (_, pkts, _) = r.worker.pipeline.lookup_rule(&tenant_key(1000)).unwrap();
    assert_eq!(pkts, 8);
}

#[test]
fn pending_overflow_is_counted_per_flow_and_globally() {
    let mut r = rig(
        PendingConfig {
            per_flow: 3,
            global: 5,
            timeout_ms: 1000,
        },
        64,
    );
    r.send((0..4).map(|i| tenant_udp(1, i)));
    assert_eq!(
        r.worker
            .pipeline
            .stats()
            .dropped(DropReason::PendingFlowFull),
        1
    );
    r.send([tenant_udp(2, 0), tenant_udp(2, 1), tenant_udp(3, 0)]);
    let s = r.worker.pipeline.stats();
    assert_eq!(s.dropped(DropReason::PendingGlobalFull), 1);
    assert_eq!(r.worker.pipeline.pending().held(), 5);
    assert_eq!(s.rx_packets, 7);
    assert_eq!(
        s.total_drops() + r.worker.pipeline.pending().held() as u64,
        7,
        "every packet is held or counted"
    );
}

/// Issue 18's bad input: a flood of malformed frames and of new flows far beyond the
/// pending queue, interleaved with an established flow's packets in the same batches.
/// Every flood frame is a counted drop with its reason, the worker never stalls (each
/// batch returns and the next one runs), and the established flow loses nothing and
/// stays in order. Counts, not time: no timed assertion.
#[test]
fn floods_of_malformed_frames_and_new_flows_are_counted_and_established_flows_keep_going() {
    let pending = PendingConfig {
        per_flow: 2,
        global: 16,
        timeout_ms: 60_000,
    };
    let mut r = rig(pending, 8);
    // The established flow: its rule installed through the miss path, as FM would.
    r.send([tenant_udp(1000, 0)]);
    let _ = r
        .requests
        .try_recv()
        .expect("the established flow asked once");
    answer(&mut r, RuleReply::ok(snat_rule(1000)));
    assert_eq!(r.out().len(), 1);

    let valid = tenant_udp(1000, 0);
    let mut seq = 1u32;
    let (mut malformed, mut new_flow_pkts) = (0u64, 0u64);
    for round in 0..50u32 {
        let mut batch = Vec::new();
        for i in 0..40u32 {
            let n = round * 40 + i;
            match i % 4 {
                // Truncated inside the outer headers, inside the inner ones, and junk.
                0 => batch.push(valid[..20 + (n as usize % 20)].to_vec()),
                1 => batch.push(valid[..64 + (n as usize % 20)].to_vec()),
                2 => batch.push(vec![0xff; 60 + (n as usize % 40)]),
                // A new flow (a new source port) with no rule: far more than the
                // pending queue and the request channel hold.
                _ => {
                    batch.push(tenant_udp(2000 + (n % 60_000) as u16, n));
                    new_flow_pkts += 1;
                    continue;
                }
            }
            malformed += 1;
            // The established flow's packet between the flood's.
            batch.push(tenant_udp(1000, seq));
            seq += 1;
        }
        r.send(batch);
    }
    let out = r.out();
    let seqs: Vec<u32> = out.iter().map(|f| seq_of(f)).collect();
    assert_eq!(
        seqs,
        (1..seq).collect::<Vec<_>>(),
        "the established flow: every packet, in order"
    );
    let s = r.worker.pipeline.stats();
    let by_reason = |d| s.dropped(d);
    let parse_drops = by_reason(DropReason::Truncated)
        + by_reason(DropReason::BadHeader)
        + by_reason(DropReason::NotIp);
    assert_eq!(
        parse_drops, malformed,
        "every malformed frame is a parse drop with its reason: {s:?}"
    );
    let held = r.worker.pipeline.pending().held() as u64;
    assert!(
        held <= 16,
        "the pending queue stays within its bound: {held}"
    );
    let pending_drops = by_reason(DropReason::PendingGlobalFull)
        + by_reason(DropReason::PendingFlowFull)
        + by_reason(DropReason::RateLimited);
    assert!(
        pending_drops > 0,
        "the new-flow flood overflowed the queue: {s:?}"
    );
    assert_eq!(
        s.total_drops() + held,
        malformed + new_flow_pkts,
        "every flood frame is held or a counted drop: {s:?}"
    );
    assert_eq!(
        s.rx_packets,
        1 + malformed + new_flow_pkts + u64::from(seq - 1)
    );
}

#[test]
fn pending_timeout_drops_and_counts_then_a_new_packet_asks_again() {
    let mut r = rig(
        PendingConfig {
            per_flow: 8,
            global: 64,
            timeout_ms: 100,
        },
        64,
    );
    r.send([tenant_udp(9, 0), tenant_udp(9, 1)]);
    assert!(r.requests.try_recv().is_ok());
    r.clock.advance(101);
    r.worker.run_once().unwrap();
    let s = r.worker.pipeline.stats();
    assert_eq!(s.dropped(DropReason::PendingTimeout), 2);
    assert_eq!(r.worker.pipeline.pending().held(), 0);
    r.send([tenant_udp(9, 2)]);
    assert!(r.requests.try_recv().is_ok(), "re-requested after timeout");
}

#[test]
fn full_request_channel_is_counted_and_retried_by_the_next_packet() {
    let mut r = rig(PendingConfig::default(), 1);
    r.send([tenant_udp(1, 0), tenant_udp(2, 0)]);
    assert_eq!(r.worker.pipeline.stats().request_channel_full, 1);
    assert_eq!(r.requests.try_recv().unwrap().key, tenant_key(1));
    r.send([tenant_udp(2, 1)]);
    assert_eq!(r.requests.try_recv().unwrap().key, tenant_key(2));
    assert_eq!(r.worker.pipeline.stats().rule_requests, 2);
}

#[test]
fn error_reply_drops_held_packets_with_a_reason() {
    let mut r = rig(PendingConfig::default(), 4);
    r.send([tenant_udp(5, 0), tenant_udp(5, 1)]);
    let req = r.requests.try_recv().unwrap();
    r.replies
        .send(RuleReply::err(req.key, "sc unavailable"))
        .unwrap();
    r.worker.run_once().unwrap();
    assert_eq!(r.worker.pipeline.stats().dropped(DropReason::RuleError), 2);
    assert!(r.out().is_empty());
}

#[test]
fn unknown_vni_is_dropped_without_a_request() {
    let mut r = rig(PendingConfig::default(), 4);
    let inner = udp_v4([198, 18, 10, 2], 1, [198, 19, 0, 9], 2, b"x");
    r.send([vxlan_wrap(
        [198, 18, 0, 50],
        [198, 18, 0, 1],
        1,
        999,
        &inner,
    )]);
    assert_eq!(r.worker.pipeline.stats().dropped(DropReason::UnknownVni), 1);
    assert!(r.requests.try_recv().is_err());
}

#[test]
fn idle_rule_expires_and_next_packet_misses() {
    let mut r = rig(PendingConfig::default(), 16);
    let rule = snat_rule(77).with_idle_timeout(Duration::from_millis(1000));
    r.worker.pipeline.install_rule(&rule, 0).unwrap();
    r.send([tenant_udp(77, 0)]);
    assert_eq!(r.out().len(), 1);
    r.clock.set(900);
    r.send([tenant_udp(77, 1)]);
    assert_eq!(r.out().len(), 1, "touched at 900, so alive until 1900");
    r.clock.set(1950);
    r.send([tenant_udp(77, 2)]);
    assert!(r.out().is_empty());
    let s = r.worker.pipeline.stats();
    assert_eq!((s.expired, s.misses), (1, 1));
    assert_eq!(
        r.worker.pipeline.rules().interned(),
        (0, 0),
        "refs released"
    );
}

#[test]
fn sweep_reaps_idle_flows_without_traffic() {
    let mut r = rig(PendingConfig::default(), 16);
    for p in 0..100 {
        let rule = snat_rule(p).with_idle_timeout(Duration::from_millis(10));
        r.worker.pipeline.install_rule(&rule, 0).unwrap();
    }
    assert_eq!(r.worker.pipeline.table().len(), 100);
    r.clock.set(50);
    let budget = r.worker.pipeline.config().sweep_budget;
    for _ in 0..100usize.div_ceil(budget) {
        r.worker.run_once().unwrap();
    }
    assert_eq!(r.worker.pipeline.table().len(), 0);
    assert_eq!(r.worker.pipeline.stats().expired, 100);
}

#[test]
fn full_table_evicts_with_a_counted_reason() {
    let mut cfg = PipelineConfig::new(node());
    cfg.flow_capacity = 32;
    let mut p = Pipeline::new(cfg, RuleSource::None).unwrap();
    for i in 0..100u16 {
        p.install_rule(&snat_rule(i), i as u32).unwrap();
    }
    assert_eq!(p.table().len(), 32);
    assert_eq!(p.stats().evicted_table_full, 68);
    assert!(
        p.lookup_rule(&tenant_key(99)).is_some(),
        "newest flow present"
    );
}

#[test]
fn replacing_a_rule_takes_effect_at_once() {
    let mut r = rig(PendingConfig::default(), 16);
    r.worker.pipeline.install_rule(&snat_rule(10), 0).unwrap();
    r.send([tenant_udp(10, 0)]);
    let replacement = Rule::new(
        tenant_key(10),
        parse_actions("decap; set-src 198.19.255.2:40001; encap 198.18.0.9 vni 200; out 1")
            .unwrap(),
    );
    r.worker.pipeline.install_rule(&replacement, 0).unwrap();
    r.send([tenant_udp(10, 1)]);
    let out = r.out();
    assert_eq!(&out[0][64 + 12..64 + 16], &[198, 19, 255, 1]);
    assert_eq!(&out[1][64 + 12..64 + 16], &[198, 19, 255, 2]);
    assert_eq!(r.worker.pipeline.stats().rules_replaced, 1);
    assert_eq!(
        r.worker.pipeline.rules().interned(),
        (1, 1),
        "old refs released"
    );
}

/// The policer hook a [`Spend`] answers from its budget.
#[derive(Clone, Copy, PartialEq)]
enum Hook {
    /// `admit`, for police class 4.
    Police,
    /// `admit_request`, for tenant 7.
    Request,
    /// `admit_packet`, for tenant 7.
    Packet,
}

/// A policer that admits `left` times through `hook`, then refuses. The other hooks
/// admit as the trait's defaults do, except `admit` outside [`Hook::Police`]: no rule
/// of those tests has a police action.
struct Spend {
    hook: Hook,
    left: u32,
}

impl Spend {
    fn spend(&mut self, hook: Hook) -> bool {
        if hook != self.hook {
            return true;
        }
        let admit = self.left > 0;
        self.left = self.left.saturating_sub(1);
        admit
    }
}

impl Policer for Spend {
    fn admit(&mut self, class: u16, _bytes: u32, _now: u32) -> bool {
        match self.hook {
            Hook::Police => assert_eq!(class, 4),
            Hook::Request => {}
            Hook::Packet => panic!("no rule here has a police action"),
        }
        self.spend(Hook::Police)
    }
    fn admit_request(&mut self, tenant: u32, _now_us: u64) -> bool {
        if self.hook == Hook::Request {
            assert_eq!(tenant, 7);
        }
        self.spend(Hook::Request)
    }
    fn admit_packet(&mut self, tenant: u32, _bytes: u32, _now: u32) -> bool {
        if self.hook == Hook::Packet {
            assert_eq!(tenant, 7);
        }
        self.spend(Hook::Packet)
    }
}

/// [`rig`] with `channel_cap`, policed by a [`Spend`] of `left` through `hook`.
fn policed_rig(channel_cap: usize, hook: Hook, left: u32) -> Rig {
    let mut r = rig(PendingConfig::default(), channel_cap);
    r.worker
        .pipeline
        .set_policer(Box::new(Spend { hook, left }));
    r
}

#[test]
fn police_hook_drops_what_the_policer_refuses() {
    let mut r = policed_rig(16, Hook::Police, 3);
    let rule = Rule::new(
        tenant_key(20),
        parse_actions("decap; police 4; out 1").unwrap(),
    );
    r.worker.pipeline.install_rule(&rule, 0).unwrap();
    r.send((0..5).map(|i| tenant_udp(20, i)));
    assert_eq!(r.out().len(), 3);
    assert_eq!(r.worker.pipeline.stats().dropped(DropReason::Police), 2);
}

#[test]
fn new_flows_over_the_request_rate_are_dropped_as_rate_limited() {
    // Two new flows of tenant 7 are admitted, then none.
    let mut r = policed_rig(64, Hook::Request, 2);
    // Flow 1000's second packet finds it pending: it spends no second admission.
    r.send([tenant_udp(1000, 0), tenant_udp(1000, 1)]);
    r.send((1001..1004).map(|sport| tenant_udp(sport, 0)));
    let mut asked = Vec::new();
    while let Ok(req) = r.requests.try_recv() {
        asked.push(req.key);
    }
    assert_eq!(asked, [tenant_key(1000), tenant_key(1001)]);
    let s = r.worker.pipeline.stats();
    assert_eq!(s.dropped(DropReason::RateLimited), 2);
    assert_eq!(s.rule_requests, 2);
    assert_eq!(
        r.worker.pipeline.pending().held(),
        3,
        "refused flows hold nothing"
    );
    assert_eq!(
        r.worker.pipeline.drop_name(DropReason::RateLimited),
        "rate-limited"
    );
}

#[test]
fn a_policed_tenant_meets_its_packet_rate_without_a_police_action() {
    // Three packets of tenant 7 through `admit_packet`.
    let mut r = policed_rig(16, Hook::Packet, 3);
    r.worker.pipeline.install_rule(&snat_rule(30), 0).unwrap();
    r.send((0..2).map(|i| tenant_udp(30, i)));
    assert_eq!(
        r.out().len(),
        2,
        "not policed yet: the policer is not asked"
    );
    r.worker.pipeline.set_tenant_policed(7, true);
    r.send((2..7).map(|i| tenant_udp(30, i)));
    assert_eq!(r.out().len(), 3);
    let s = r.worker.pipeline.stats();
    assert_eq!(s.dropped(DropReason::Police), 2);
    assert_eq!(
        r.worker.pipeline.drop_name(DropReason::Police),
        "rate-limited-packets"
    );
    r.worker.pipeline.set_tenant_policed(7, false);
    r.send((7..10).map(|i| tenant_udp(30, i)));
    assert_eq!(r.out().len(), 3);
}

/// A full table holds some flows in their second bucket. The batched lookup matches
/// those in a pass of its own (after prefetching that bucket); every one must still hit.
#[test]
fn flows_in_their_second_bucket_hit_in_a_batch() {
    let n = 4096u16;
    let mut cfg = PipelineConfig::new(node());
    cfg.flow_capacity = usize::from(n);
    let mut p = Pipeline::new(cfg, RuleSource::None).unwrap();
    for i in 0..n {
        p.install_rule(&snat_rule(1024 + i), 0).unwrap();
    }
    assert_eq!(p.table().len(), usize::from(n));
    let far = p.table().second_bucket_residents();
    assert!(far > 0, "a full table has flows in their second bucket");
    let mut src = VecSource::default();
    for i in 0..n {
        src.push(tenant_udp(1024 + i, u32::from(i)), 0);
    }
    let mut io = MemRing::new(src, 64);
    let mut descs = Vec::new();
    let mut sent = 0;
    while io.rx(&mut descs, 64).unwrap() > 0 {
        p.process(io.region(), &mut descs, 0);
        for d in &descs {
            assert_eq!(d.verdict, Verdict::Tx(1), "every flow is in the table");
        }
        sent += descs.len();
    }
    assert_eq!(sent, usize::from(n));
    let s = p.stats();
    assert_eq!(
        (s.hits, s.misses),
        (u64::from(n), 0),
        "{far} in second buckets"
    );
}

#[test]
fn ten_million_flow_capacity_is_accepted() {
    // Allocation is lazy for the arenas; the bucket array is 128 MiB.
    let mut cfg = PipelineConfig::new(node());
    cfg.flow_capacity = 10_000_000;
    let p = Pipeline::new(cfg, RuleSource::None).unwrap();
    assert_eq!(p.table().capacity(), 10_000_000);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Arbitrary bytes, and arbitrary mutations of a valid tenant frame, never panic and
    /// always end in a verdict that is counted.
    #[test]
    fn any_input_gets_a_counted_verdict(
        raw in proptest::collection::vec(any::<u8>(), 0..200),
        flips in proptest::collection::vec((0usize..120, any::<u8>()), 0..6),
        cut in 0usize..140,
    ) {
        let mut p = Pipeline::new(PipelineConfig::new(node()), RuleSource::None).unwrap();
        p.install_rule(&snat_rule(1000), 0).unwrap();
        let mut valid = tenant_udp(1000, 1);
        for (at, b) in flips {
            if at < valid.len() { valid[at] ^= b; }
        }
        valid.truncate(cut.max(1));
        let mut src = VecSource::default();
        src.push(raw, 0);
        src.push(valid, 0);
        let mut io = MemRing::new(src, 4);
        let mut descs = Vec::new();
        io.rx(&mut descs, 4).unwrap();
        p.process(io.region(), &mut descs, 0);
        for d in &descs {
            prop_assert!(matches!(d.verdict, Verdict::Tx(_) | Verdict::Drop(_)));
        }
        let s = p.stats();
        prop_assert_eq!(s.tx_packets + s.total_drops(), 2);
    }
}

#[test]
fn key_extraction_of_v6_and_echo() {
    let f = ip_frame(
        Addr::V6("2001:2::1".parse::<std::net::Ipv6Addr>().unwrap().octets()),
        Addr::V6("2001:2::2".parse::<std::net::Ipv6Addr>().unwrap().octets()),
        L4Spec::Echo {
            request: true,
            id: 42,
            seq: 1,
        },
        b"ping",
    );
    let fr = packet::parse_frame(&f).unwrap();
    let k = FlowKey::from_ip(&f, fr.ip().unwrap(), 0).unwrap();
    assert_eq!(k.to_string(), "0 icmp6 [2001:2::1]:42 > [2001:2::2]:0");
    assert_eq!(k.src(), "2001:2::1".parse::<IpAddr>().unwrap());
}

/// docs/fabric.md, "The first packet through FM", at the ingress node: with FM asking
/// for first packets, a new flow's first packet goes with its request; when FM says it
/// carried it on, only the packets held after it are released, so none leaves twice.
#[test]
fn the_first_packet_fm_carried_on_is_not_released_again() {
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let mut cfg = PipelineConfig::new(node());
    cfg.first_frames = Some(flag.clone());
    let mut r = Rig::tenant(cfg, 16);
    r.worker.io.sink.capture = true;
    r.send((0..3).map(|i| tenant_udp(1000, i)));
    let req = r.requests.try_recv().expect("one request");
    assert_eq!(req.frame.as_deref(), Some(tenant_udp(1000, 0).as_slice()));
    let mut reply = RuleReply::ok(snat_rule(1000));
    reply.frame_forwarded = true;
    answer(&mut r, reply);
    assert_eq!(
        sent_seqs(&mut r),
        [1, 2],
        "the first packet went through FM, the others from here"
    );
    let s = r.worker.pipeline.stats();
    assert_eq!((s.fabric_first_via_fm, s.pending_released), (1, 2));
    assert_eq!(r.worker.pipeline.pending().held(), 0);

    // FM did not carry it (the answer does not say so): every held packet goes.
    r.send((0..2).map(|i| tenant_udp(1001, i)));
    assert!(r.requests.try_recv().unwrap().frame.is_some());
    answer(&mut r, RuleReply::ok(snat_rule(1001)));
    assert_eq!(sent_seqs(&mut r), [0, 1]);

    // Without FM's ask, no frame travels, and an answer claiming one left out nothing.
    flag.store(false, std::sync::atomic::Ordering::Relaxed);
    r.send((0..2).map(|i| tenant_udp(1002, i)));
    assert!(r.requests.try_recv().unwrap().frame.is_none());
    let mut reply = RuleReply::ok(snat_rule(1002));
    reply.frame_forwarded = true;
    answer(&mut r, reply);
    assert_eq!(sent_seqs(&mut r), [0, 1]);
    assert_eq!(r.worker.pipeline.stats().fabric_first_via_fm, 1);
}

/// At the next-hop node: the packet FM carried comes with the node's rule for the flow;
/// the rule is installed first, then the packet runs as if it came over the fabric.
#[test]
fn a_packet_fm_carried_here_runs_after_its_rule_is_installed() {
    let mut r = rig(PendingConfig::default(), 16);
    let mut install = RuleReply::ok(snat_rule(2000));
    install.inject = Some(tenant_udp(2000, 0).into());
    answer(&mut r, install);
    let out = r.out();
    assert_eq!(out.iter().map(|f| seq_of(f)).collect::<Vec<_>>(), [0]);
    // Translated by the rule that came with it.
    assert_eq!(&out[0][50 + 14 + 12..50 + 14 + 16], &[198, 19, 255, 1]);
    let s = r.worker.pipeline.stats();
    assert_eq!(
        (s.fabric_injected, s.rx_packets, s.hits, s.misses),
        (1, 1, 1, 0)
    );
    assert!(
        r.requests.try_recv().is_err(),
        "no request: the rule was there"
    );
    // The flow's next packets, over the fabric, hit the same rule.
    r.send([tenant_udp(2000, 1)]);
    assert_eq!(sent_seqs(&mut r), [1]);

    // Packets of the flow that came over the fabric before FM's message were held as a
    // miss: they go first, then the carried one.
    r.send([tenant_udp(2001, 1)]);
    assert!(r.out().is_empty());
    assert_eq!(r.requests.try_recv().unwrap().key, tenant_key(2001));
    let mut install = RuleReply::ok(snat_rule(2001));
    install.inject = Some(tenant_udp(2001, 0).into());
    answer(&mut r, install);
    assert_eq!(sent_seqs(&mut r), [1, 0]);

    // Carried without a usable rule: it is a miss like any packet, held while the node
    // asks for the rule itself.
    let mut install = RuleReply::err(tenant_key(2002), "no rule for you");
    install.inject = Some(tenant_udp(2002, 0).into());
    answer(&mut r, install);
    assert!(r.out().is_empty());
    assert_eq!(r.requests.try_recv().unwrap().key, tenant_key(2002));
    answer(&mut r, RuleReply::ok(snat_rule(2002)));
    assert_eq!(sent_seqs(&mut r), [0]);

    // A frame past a slot is dropped, counted, never a panic.
    let mut install = RuleReply::ok(snat_rule(2003));
    install.inject = Some(vec![0u8; pipeline::MAX_FRAME + 1].into());
    answer(&mut r, install);
    assert!(r.out().is_empty());
    assert_eq!(r.worker.pipeline.stats().dropped(DropReason::BadHeader), 1);
}
