//! The pipeline's observability counters: rule setup latency (on a [`ManualClock`], so
//! every observation is exact) and per-tenant packets, bytes, drops and flow setups.

use pipeline::{
    parse_actions, DropReason, FlowKey, LatencyHistogram, ManualClock, MemRing, PendingConfig,
    Pipeline, PipelineConfig, Rule, RuleReply, RuleSource, TenantCounters, VecSource, VpcBinding,
    LATENCY_BOUNDS_US,
};
use testkit::rig::{client_udp, node, Rig};

/// A tenant UDP packet on `vni` from 198.18.10.2:`sport` to 198.19.0.9:53 with
/// `payload` bytes of payload.
fn frame(vni: u32, sport: u16, payload: usize) -> Vec<u8> {
    client_udp(vni, sport, 53, &vec![0xab; payload])
}

fn key(vni: u32, sport: u16) -> FlowKey {
    format!("{vni} udp 198.18.10.2:{sport} > 198.19.0.9:53")
        .parse()
        .unwrap()
}

fn rule(vni: u32, sport: u16) -> Rule {
    Rule::new(
        key(vni, sport),
        parse_actions("decap; encap 198.18.0.9 vni 200; out 1").unwrap(),
    )
}

fn rig(bindings: &[(u32, u32)], default: Option<u32>) -> Rig {
    let mut cfg = PipelineConfig::new(node());
    cfg.flow_capacity = 1024;
    cfg.pending = PendingConfig {
        per_flow: 16,
        global: 256,
        timeout_ms: 100,
    };
    let clock = ManualClock::default();
    clock.set(1_000);
    Rig::new(cfg, 64, clock, |p| {
        for &(vni, tenant) in bindings {
            p.bind_vpc(vni, VpcBinding { tenant, chain: 1 });
        }
        p.set_default_binding(default.map(|tenant| VpcBinding { tenant, chain: 1 }));
    })
}

/// What these tests do with a rig besides sending frames.
trait MetricsRig {
    fn answer(&mut self, fail: &[FlowKey]);
    fn tenant(&self, t: u32) -> TenantCounters;
    fn latency(&self) -> LatencyHistogram;
}

impl MetricsRig for Rig {
    /// Answer every outstanding request with its rule (or an error for `fail` keys),
    /// then run one round so the replies are installed.
    fn answer(&mut self, fail: &[FlowKey]) {
        while let Ok(req) = self.requests.try_recv() {
            let reply = if fail.contains(&req.key) {
                RuleReply::err(req.key, "denied")
            } else {
                RuleReply::ok(rule(req.key.vni(), req.key.sport()))
            };
            self.replies.send(reply).unwrap();
        }
        self.worker.run_once().unwrap();
    }

    fn tenant(&self, t: u32) -> TenantCounters {
        self.worker
            .pipeline
            .tenants()
            .find(|(id, _)| *id == t)
            .map(|(_, c)| *c)
            .unwrap_or_else(|| panic!("tenant {t} has no counters"))
    }

    fn latency(&self) -> LatencyHistogram {
        self.worker.pipeline.stats().setup_latency
    }
}

/// The bucket whose upper bound is `bound_us`.
fn bucket_of(bound_us: u64) -> usize {
    LATENCY_BOUNDS_US
        .iter()
        .position(|&b| b == bound_us)
        .unwrap()
}

#[test]
fn rule_setup_latency_is_hold_to_install_on_the_pipeline_clock() {
    let mut r = rig(&[(100, 7)], None);
    r.send([frame(100, 1000, 10), frame(100, 1000, 10)]);
    assert_eq!(r.latency().count, 0, "nothing installed yet");
    r.clock.advance(3);
    r.answer(&[]);
    let h = r.latency();
    assert_eq!(h.count, 1, "one flow set up, one observation: {h:?}");
    assert_eq!(h.sum_us, 3_000);
    // 3 ms lies in (2.5 ms, 5 ms].
    assert_eq!(h.counts[bucket_of(5_000)], 1, "{h:?}");
    assert_eq!(r.worker.pipeline.stats().pending_released, 2);

    // Sub-millisecond resolution through the Worker's µs reading.
    r.send([frame(100, 1001, 10)]);
    r.clock.advance_us(700);
    r.answer(&[]);
    let h = r.latency();
    assert_eq!(h.count, 2);
    assert_eq!(h.sum_us, 3_700);
    assert_eq!(
        h.counts[bucket_of(1_000)],
        1,
        "700 µs lies in (500 µs, 1 ms]"
    );

    // Hits afterwards observe nothing; a failed setup observes nothing.
    r.send([frame(100, 1000, 10), frame(100, 1001, 10)]);
    r.send([frame(100, 1002, 10)]);
    r.clock.advance(20);
    r.answer(&[key(100, 1002)]);
    assert_eq!(r.latency().count, 2);
    assert_eq!(r.tenant(7).flows_setup, 2);
}

#[test]
fn per_tenant_packets_and_bytes_are_what_each_tenant_sent() {
    // Tenant 7 owns VNIs 100 and 101, tenant 9 owns VNI 200; VNI 300 is unbound.
    let mut r = rig(&[(100, 7), (101, 7), (200, 9)], None);
    let mut sent = [(0u64, 0u64); 2];
    let mut frames = Vec::new();
    for i in 0..5u16 {
        let f = frame(100 + u32::from(i % 2), 2000 + i, 10 + usize::from(i));
        sent[0].0 += 1;
        sent[0].1 += f.len() as u64;
        frames.push(f);
    }
    for i in 0..3u16 {
        let f = frame(200, 3000, 100 + usize::from(i));
        sent[1].0 += 1;
        sent[1].1 += f.len() as u64;
        frames.push(f);
    }
    frames.push(frame(300, 4000, 10));
    r.send(frames);
    r.answer(&[]);
    // Released packets ran the pipeline again: they must not count twice.
    let (t7, t9) = (r.tenant(7), r.tenant(9));
    assert_eq!((t7.packets, t7.bytes), sent[0]);
    assert_eq!((t9.packets, t9.bytes), sent[1]);
    assert_eq!(t7.flows_setup, 5);
    assert_eq!(t9.flows_setup, 1);
    assert_eq!((t7.drops, t9.drops), (0, 0));
    assert_eq!(
        r.worker.pipeline.tenants().count(),
        2,
        "VNI 300 is no tenant"
    );
    let s = r.worker.pipeline.stats();
    assert_eq!(s.dropped(DropReason::UnknownVni), 1);
    assert_eq!(s.rx_packets, sent[0].0 + sent[1].0 + 1);

    // Hits count too.
    r.send([frame(200, 3000, 7), frame(200, 3000, 7)]);
    assert_eq!(r.tenant(9).packets, sent[1].0 + 2);
    assert_eq!(r.tenant(7).packets, sent[0].0);
}

#[test]
fn per_tenant_drops_cover_rule_errors_and_pending_timeouts() {
    let mut r = rig(&[(100, 7), (200, 9)], None);
    // Tenant 7: a flow whose rule request fails (3 held packets dropped).
    r.send((0..3).map(|_| frame(100, 10, 10)));
    r.answer(&[key(100, 10)]);
    // Tenant 9: a flow whose rule never comes (2 packets time out).
    r.send((0..2).map(|_| frame(200, 20, 10)));
    r.clock.advance(150);
    r.worker.run_once().unwrap();
    let s = r.worker.pipeline.stats();
    assert_eq!(s.dropped(DropReason::RuleError), 3);
    assert_eq!(s.dropped(DropReason::PendingTimeout), 2);
    assert_eq!(r.tenant(7).drops, 3);
    assert_eq!(r.tenant(9).drops, 2);
    assert_eq!(r.tenant(7).flows_setup + r.tenant(9).flows_setup, 0);
    assert_eq!(r.latency().count, 0, "no flow was set up");
}

#[test]
fn default_binding_counts_unbound_vnis_under_its_tenant() {
    let mut r = rig(&[(100, 7)], Some(5));
    let f = frame(555, 1, 10);
    let len = f.len() as u64;
    r.send([f.clone(), f]);
    r.answer(&[]);
    let t5 = r.tenant(5);
    assert_eq!((t5.packets, t5.bytes, t5.flows_setup), (2, 2 * len, 1));
    assert_eq!(r.tenant(7).packets, 0);
}

/// Zeta's window count: a flow is an elephant only if it carries the threshold within
/// one window; a slow flow whose total passes it never is. Each is queued once.
#[test]
fn elephants_are_flows_heavy_within_one_window_and_are_queued_once() {
    let mut cfg = PipelineConfig::new(node());
    cfg.flow_capacity = 64;
    cfg.elephant = Some(pipeline::ElephantPolicy {
        window_ms: 100,
        bytes: 10_000,
        packets: 50,
    });
    let mut p = Pipeline::new(cfg, RuleSource::None).unwrap();
    let (slow, fast, big) = (rule(100, 1), rule(100, 2), rule(100, 3));
    for r in [&slow, &fast, &big] {
        p.install_rule(r, 0).unwrap();
    }
    let run = |p: &mut Pipeline, f: &[u8], n: usize, now: u32| {
        let mut src = VecSource::default();
        for _ in 0..n {
            src.push(f.to_vec(), 0);
        }
        let mut io = MemRing::new(src, 64);
        let mut descs = Vec::new();
        io.rx(&mut descs, 64).unwrap();
        p.process(io.region(), &mut descs, now);
        io.tx(&descs).unwrap();
    };
    use pipeline::PacketIo;
    // Slow: 40 packets every 101 ms, 400 in all: never 50 in one window.
    for w in 0..10 {
        run(&mut p, &frame(100, 1, 10), 40, 1 + w * 101);
    }
    assert!(p.take_elephants().is_empty());
    // Fast: 50 packets in one window.
    run(&mut p, &frame(100, 2, 10), 50, 2000);
    // Big: 8 packets of 1,300 bytes = more than 10,000 bytes in one window.
    run(&mut p, &frame(100, 3, 1300), 8, 2000);
    let mut got = p.take_elephants();
    got.sort_by_key(|k| *k.as_bytes());
    let mut want = vec![fast.key, big.key];
    want.sort_by_key(|k| *k.as_bytes());
    assert_eq!(got, want);
    assert_eq!(p.stats().elephants, 2);
    // Marked: more heavy windows do not queue them again...
    run(&mut p, &frame(100, 2, 10), 60, 2050);
    assert!(p.take_elephants().is_empty());
    // ...until the fast path gives the flow back.
    p.unmark_offloaded(&fast.key);
    run(&mut p, &frame(100, 2, 10), 60, 2060);
    assert_eq!(p.take_elephants(), vec![fast.key]);
    // Without a policy nothing is ever queued.
    let mut plain = Pipeline::new(PipelineConfig::new(node()), RuleSource::None).unwrap();
    plain.install_rule(&fast, 0).unwrap();
    run(&mut plain, &frame(100, 2, 10), 60, 1);
    assert!(plain.take_elephants().is_empty());
}
