//! Counter reports (the monitor's data): counted rules' counters leave the worker as
//! deltas, periodically and when a rule leaves the table, bounded by the report queue.

use pipeline::{
    parse_actions, report_budget, CounterReport, CounterReportConfig, FlowKey, PipelineConfig,
    Rule, RuleReply,
};
use testkit::rig::{client_udp, node, Rig, TENANT_VNI};

fn tenant_udp(sport: u16, payload: usize) -> Vec<u8> {
    client_udp(TENANT_VNI, sport, 53, &vec![0u8; payload])
}

fn key(sport: u16) -> FlowKey {
    format!("100 udp 198.18.10.2:{sport} > 198.19.0.9:53")
        .parse()
        .unwrap()
}

fn rule(sport: u16, count: bool) -> Rule {
    let actions = if count {
        "decap; set-src 198.19.255.1:40000; encap 198.18.0.9 vni 200; count; out 1"
    } else {
        "decap; set-src 198.19.255.1:40000; encap 198.18.0.9 vni 200; out 1"
    };
    Rule::new(key(sport), parse_actions(actions).unwrap())
}

fn rig(reports: CounterReportConfig) -> Rig {
    let mut cfg = PipelineConfig::new(node());
    cfg.flow_capacity = 1024;
    cfg.counter_reports = Some(reports);
    Rig::tenant(cfg, 64)
}

fn take(r: &mut Rig) -> Vec<CounterReport> {
    let mut v = Vec::new();
    r.worker.pipeline.take_counter_reports(&mut v);
    v
}

/// Sum of the reports' (packets, bytes) for `k`.
fn sum(v: &[CounterReport], k: &FlowKey) -> (u64, u64) {
    v.iter()
        .filter(|r| r.key == *k)
        .fold((0, 0), |(p, b), r| (p + r.packets, b + r.bytes))
}

/// Install `sport`'s rule through the miss path: its first packet is held, FM answers.
fn set_up(r: &mut Rig, sport: u16, count: bool, len: usize) {
    r.send([tenant_udp(sport, len)]);
    r.requests.try_recv().expect("a request");
    r.replies.send(RuleReply::ok(rule(sport, count))).unwrap();
    r.worker.run_once().unwrap();
}

#[test]
fn every_packet_of_a_counted_rule_is_reported_once_as_deltas() {
    let cfg = CounterReportConfig {
        interval_ms: 1000,
        queue: 1024,
        scan_per_service: 4,
    };
    let mut r = rig(cfg);
    let frame_len = tenant_udp(1000, 100).len() as u64;
    set_up(&mut r, 1000, true, 100);
    set_up(&mut r, 1001, false, 100);
    let mut all = take(&mut r);
    let mut sent = 1u64;
    for round in 0..5u32 {
        r.send((0..7).map(|_| tenant_udp(1000, 100)));
        r.send((0..3).map(|_| tenant_udp(1001, 100)));
        sent += 7;
        r.clock.advance(400 + round * 100);
        for _ in 0..4 {
            r.worker.run_once().unwrap();
        }
        all.extend(take(&mut r));
    }
    // Whatever is left goes out on demand.
    assert!(r.worker.pipeline.report_all_counters());
    all.extend(take(&mut r));
    assert_eq!(sum(&all, &key(1000)), (sent, sent * frame_len));
    assert!(
        all.iter().filter(|x| x.key == key(1000)).count() > 1,
        "reported periodically, not once at the end"
    );
    assert_eq!(
        sum(&all, &key(1001)),
        (0, 0),
        "rules without count report nothing"
    );
    assert!(all.iter().all(|x| (x.tenant, x.chain) == (7, 3)));
    assert!(all.iter().all(|x| x.packets > 0));
    // Nothing counted twice: with nothing new, nothing more is reported.
    r.clock.advance(5000);
    for _ in 0..4 {
        r.worker.run_once().unwrap();
    }
    assert!(r.worker.pipeline.report_all_counters());
    assert!(take(&mut r).is_empty());
}

/// A pass is paced over the interval: its reports leave in many small batches, not in
/// one burst at the start of each interval (docs/rate-isolation.md).
#[test]
fn a_pass_spreads_its_reports_over_the_interval() {
    let mut r = rig(CounterReportConfig {
        interval_ms: 1000,
        queue: 1024,
        scan_per_service: 4096,
    });
    for s in 0..64 {
        set_up(&mut r, 3000 + s, true, 10);
    }
    take(&mut r);
    // Traffic on every flow, then two intervals in 10 ms steps (the first pass began
    // and ended on the empty table).
    for s in 0..64 {
        r.send([tenant_udp(3000 + s, 10)]);
    }
    r.worker.run_once().unwrap();
    let mut batches = Vec::new();
    for step in 0..200u32 {
        r.clock.advance(10);
        r.worker.run_once().unwrap();
        let got = take(&mut r);
        if !got.is_empty() {
            batches.push((step, got.len()));
        }
    }
    let total: usize = batches.iter().map(|b| b.1).sum();
    assert!(
        total >= 64,
        "every flow reported within two intervals: {batches:?}"
    );
    let biggest = batches.iter().map(|b| b.1).max().unwrap_or(0);
    assert!(
        batches.len() >= 16 && biggest <= 16,
        "reports leave in small batches spread over the interval: {batches:?}"
    );
}

#[test]
fn the_report_budget_follows_the_clock_in_steps() {
    // Nothing at the pass's start, all of it by 3/4 of the interval, never past `cap`.
    assert_eq!(report_budget(0, 1000, 0, 3200, usize::MAX), 0);
    assert_eq!(report_budget(375, 1000, 0, 3200, usize::MAX), 1600);
    assert_eq!(report_budget(375, 1000, 1500, 3200, usize::MAX), 100);
    assert_eq!(report_budget(750, 1000, 0, 3200, usize::MAX), 3200);
    assert_eq!(report_budget(5000, 1000, 0, 3200, 4096), 3200);
    assert_eq!(report_budget(750, 1000, 0, 3200, 64), 64);
    // Steps: a pass over 3200 slots moves in 100-slot steps.
    assert_eq!(report_budget(20, 1000, 0, 3200, usize::MAX), 0);
    assert_eq!(report_budget(24, 1000, 0, 3200, usize::MAX), 100);
    // A tiny interval is all due at once, and an empty arena has nothing to scan.
    assert_eq!(report_budget(1, 1, 0, 10, usize::MAX), 10);
    assert_eq!(report_budget(500, 1000, 0, 0, usize::MAX), 0);
}

#[test]
fn a_rule_that_leaves_the_table_reports_its_last_counts() {
    let mut r = rig(CounterReportConfig {
        interval_ms: 1_000_000,
        queue: 1024,
        scan_per_service: 1024,
    });
    set_up(&mut r, 1000, true, 10);
    set_up(&mut r, 1002, true, 10);
    let mut all = take(&mut r);
    r.send((0..4).map(|_| tenant_udp(1000, 10)));
    r.send((0..2).map(|_| tenant_udp(1002, 10)));
    // Removed (a revoke) and replaced (an update from FM): neither loses counts.
    assert!(r.worker.pipeline.remove_rule(&key(1000)).is_some());
    r.replies.send(RuleReply::ok(rule(1002, true))).unwrap();
    r.worker.run_once().unwrap();
    all.extend(take(&mut r));
    assert_eq!(sum(&all, &key(1000)).0, 5);
    assert_eq!(sum(&all, &key(1002)).0, 3);
    // Idle expiry: the sweep reaps it and its counts go out.
    r.send((0..6).map(|_| tenant_udp(1002, 10)));
    r.clock.advance(400_000);
    for _ in 0..200 {
        r.worker.run_once().unwrap();
    }
    assert!(
        r.worker.pipeline.lookup_rule(&key(1002)).is_none(),
        "expired"
    );
    all.extend(take(&mut r));
    assert_eq!(sum(&all, &key(1002)).0, 9);
}

#[test]
fn a_full_queue_pauses_the_pass_without_loss_and_counts_lost_finals() {
    let mut r = rig(CounterReportConfig {
        interval_ms: 10,
        queue: 2,
        scan_per_service: 1024,
    });
    for s in 0..5 {
        set_up(&mut r, 2000 + s, true, 10);
    }
    // Five flows with counts, room for two: the pass pauses, and resumes once drained.
    let mut all = Vec::new();
    for _ in 0..10 {
        r.clock.advance(20);
        r.worker.run_once().unwrap();
        all.extend(take(&mut r));
    }
    for s in 0..5 {
        assert_eq!(sum(&all, &key(2000 + s)).0, 1, "flow {s}");
    }
    assert!(r.worker.pipeline.stats().counter_report_queue_full > 0);
    assert_eq!(r.worker.pipeline.stats().counter_reports_dropped, 0);
    // Rules leaving while the queue is full (nobody drains it): counted drops.
    for s in 0..5 {
        r.send([tenant_udp(2000 + s, 10)]);
    }
    for s in 0..5 {
        r.worker.pipeline.remove_rule(&key(2000 + s));
    }
    r.worker.run_once().unwrap();
    let dropped = r.worker.pipeline.stats().counter_reports_dropped;
    assert_eq!(
        take(&mut r).len(),
        2,
        "the queue never holds more than its bound"
    );
    assert_eq!(dropped, 3);
}

#[test]
fn without_reports_counters_stay_cumulative() {
    let mut cfg = PipelineConfig::new(node());
    cfg.flow_capacity = 64;
    let mut r = Rig::tenant(cfg, 64);
    set_up(&mut r, 1000, true, 10);
    r.send((0..3).map(|_| tenant_udp(1000, 10)));
    r.clock.advance(5000);
    r.worker.run_once().unwrap();
    assert!(take(&mut r).is_empty());
    assert_eq!(r.worker.pipeline.lookup_rule(&key(1000)).unwrap().1, 4);
}
