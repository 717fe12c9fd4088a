//! Elasticity under live traffic (docs/elastic-tests.md): SC scale-out and scale-in (by
//! hand and by the autoscaler), and an SC replica crash, while real kernel TCP goes
//! through starfabric's PP node in the netns testbed.
//!
//! The load is `testbed::elastic`'s: a loop of new TCP connections from VPC 0 to nginx
//! on the internet host through SNAT (each one asks FM and the SC group serving the key
//! for its rule), plus two long-lived, paced iperf3 TCP streams. The scaling and the
//! crash go through the operator's tools: `starfabric scale sc-out|sc-in|map` inside
//! the control namespace, and a SIGKILL to the SC node's own recorded PID.
//!
//! They are `#[ignore]`d so the workspace's parallel `cargo test` does not run them next
//! to the other e2e tests on a 2-core machine (timing under scaling is what they look
//! at): `make test-elastic` (part of `make test`) runs them one at a time.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use testbed::elastic::{
    self, ConnLoop, Event, IperfSpec, LoadSpec, Outcome, ScenarioReport, ScenarioSpec,
};
use testbed::platform::Platform;

mod common;
use common::Lab;

/// One VPC with SNAT toward the internet host, its servers up, and `sc_nodes` SC nodes
/// (3 form the group; the rest are spares).
fn platform(lab: &Lab, sc_nodes: usize) -> Platform {
    lab.start_snat_inet(|spec| spec.sc_nodes = sc_nodes)
}

fn ms(us: Option<u64>) -> String {
    us.map_or("-".into(), |u| format!("{:.1} ms", u as f64 / 1000.0))
}

/// What every scenario must show, whatever its events: the load ran, no connection
/// failed or was reset, no mapping was handed out twice, and the long-lived flows ran
/// through the events without a reset or a stall longer than 1 s.
fn assert_traffic_survived(r: &ScenarioReport, min_connections: usize) {
    println!(
        "{}; p99 setup before {} during {} overall {}; iperf3 {:.1} Mbit/s, \
         longest stall {:.1} s, {} retransmits",
        common::scenario_counts(r),
        ms(r.p99_setup_before_us),
        ms(r.p99_setup_during_us),
        ms(r.p99_setup_us),
        r.iperf.mean_mbps,
        r.iperf.max_stall_s,
        r.iperf.retransmits,
    );
    for e in &r.events {
        println!(
            "  {}, p99 setup {}",
            common::event_counts(e),
            ms(e.p99_setup_us)
        );
    }
    println!("  FM: {:?}", r.fm);
    assert!(
        r.connections >= min_connections,
        "the load ran: {} connections, want >= {min_connections}",
        r.connections
    );
    assert_eq!(
        r.failed_connections, 0,
        "failed connections: {:#?}",
        r.failures
    );
    assert_eq!(
        r.reset_connections, 0,
        "reset connections: {:#?}",
        r.failures
    );
    assert_eq!(
        r.duplicate_mappings, 0,
        "one SNAT mapping on two live flows"
    );
    assert!(r.iperf.error.is_none(), "iperf3: {:?}", r.iperf.error);
    assert_eq!(r.iperf.streams, 2, "both iperf3 streams reported");
    assert!(
        r.iperf.max_stall_s <= 1.0,
        "an iperf3 stream moved nothing for {:.1} s",
        r.iperf.max_stall_s
    );
    assert!(
        r.iperf.mean_mbps > 1.0,
        "iperf3: {} Mbit/s",
        r.iperf.mean_mbps
    );
    assert!(
        r.iperf_covered_events,
        "the iperf3 flows ended before the last event did: make them longer"
    );
    for e in &r.events {
        if e.name != "pause" {
            assert!(e.connections > 0, "no connection started during {}", e.name);
        }
    }
}

#[test]
#[ignore = "netns elasticity test: `make test-elastic` runs it (one at a time)"]
fn sc_scale_out_then_scale_in_under_new_connections_and_iperf3_flows() {
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    // 3 for the group, 3 spares for the new group of the scale-out.
    let mut p = platform(&lab, 6);
    let before = elastic::partition_map(tb, &p).expect("partition map");
    assert_eq!(before.groups_of(1, 1).len(), 1, "{before:?}");
    let spec = ScenarioSpec {
        name: "sc_scale_out_in".into(),
        load: LoadSpec::new(),
        iperf: IperfSpec::new(25),
        before: Duration::from_secs(3),
        after: Duration::from_secs(3),
        events: vec![
            Event::ScaleOut {
                tenant: 1,
                chain: 1,
            },
            Event::Pause(Duration::from_secs(3)),
            Event::ScaleIn {
                tenant: 1,
                chain: 1,
            },
        ],
    };
    let r = elastic::run_scenario(tb, &mut p, &spec).expect("scenario");
    let out = r.events[0].scale.clone().expect("scale-out result");
    let sin = r.events[2].scale.clone().expect("scale-in result");
    println!("scale-out: {out:?}\nscale-in: {sin:?}");
    assert_traffic_survived(&r, 500);
    assert_eq!(out.kind, "out");
    assert!(
        out.aborted.is_none(),
        "scale-out aborted: {:?}",
        out.aborted
    );
    assert_ne!(out.from_group, out.to_group);
    assert!(out.moved_lo <= out.moved_hi);
    assert!(
        out.moved_lo > 0 || out.moved_hi < u64::MAX,
        "half the range moves, not all of it"
    );
    assert_eq!(sin.kind, "in");
    assert!(sin.aborted.is_none(), "scale-in aborted: {:?}", sin.aborted);
    // Scale-in retires the newest partition: the one the scale-out made.
    assert_eq!(sin.from_group, out.to_group);
    assert_eq!(r.fm["scale_outs"], 1);
    assert_eq!(r.fm["scale_ins"], 1);
    assert_eq!(r.fm["scale_aborts"], 0);
    let after = elastic::partition_map(tb, &p).expect("partition map");
    assert_eq!(after.groups_of(1, 1), vec![out.from_group], "{after:?}");
    // New flows still work after both scales.
    let last = elastic::run_scenario(
        tb,
        &mut p,
        &ScenarioSpec {
            name: "after_scale_in".into(),
            load: LoadSpec::new(),
            iperf: IperfSpec::new(3),
            before: Duration::from_secs(2),
            after: Duration::ZERO,
            events: vec![],
        },
    )
    .expect("scenario");
    assert_traffic_survived(&last, 100);
}

#[test]
#[ignore = "netns elasticity test: `make test-elastic` runs it (one at a time)"]
fn sc_replica_killed_under_traffic_is_replaced_and_no_connection_fails() {
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    // 3 for the group and the spare that replaces the dead replica.
    let mut p = platform(&lab, 4);
    let spec = ScenarioSpec {
        name: "sc_replica_failover".into(),
        load: LoadSpec::new(),
        iperf: IperfSpec::new(15),
        before: Duration::from_secs(3),
        after: Duration::from_secs(3),
        // The middle replica: the chain must be re-linked around it while requests
        // are in flight through it.
        events: vec![Event::KillReplica {
            tenant: 1,
            chain: 1,
            position: 1,
        }],
    };
    let r = elastic::run_scenario(tb, &mut p, &spec).expect("scenario");
    let rep = r.events[0].repair.clone().expect("repair");
    println!("repair: {rep:?}");
    assert_traffic_survived(&r, 400);
    assert_eq!(rep.after.len(), 3, "the group is whole again: {rep:?}");
    assert!(!rep.after.contains(&rep.victim), "{rep:?}");
    // The one node of the four that was not in the group.
    let spare: Vec<String> = (0..4)
        .map(|i| format!("sc-{i}"))
        .filter(|n| !rep.before.contains(n))
        .collect();
    assert_eq!(spare.len(), 1, "{rep:?}");
    assert!(
        rep.after.contains(&spare[0]),
        "the spare replaced the victim: {rep:?}"
    );
    let victim = p.sc(&rep.victim).expect("victim's process");
    assert!(!tb.running(victim), "the victim is dead");
    assert!(
        r.fm["nodes_dead"] >= 1,
        "FM declared the node dead: {:?}",
        r.fm
    );
}

#[test]
#[ignore = "netns elasticity test: `make test-elastic` runs it (one at a time)"]
fn fm_killed_and_restarted_under_traffic_flows_survive_and_new_connections_resume() {
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    let mut p = platform(&lab, 3);
    let spec = ScenarioSpec {
        name: "fm_restart".into(),
        load: LoadSpec::new(),
        iperf: IperfSpec::new(15),
        before: Duration::from_secs(3),
        after: Duration::from_secs(4),
        events: vec![Event::RestartFm {
            down: Duration::from_secs(1),
        }],
    };
    let r = elastic::run_scenario(tb, &mut p, &spec).expect("scenario");
    let e = &r.events[0];
    println!(
        "fm_restart: FM down 1 s, back with its groups after {} ms; {} connections, {} \
         failed ({} started in the outage window), {} reset, {} duplicate mappings; after: \
         {} connections, {} failed, p99 setup {}; iperf3 {:.1} Mbit/s, longest stall {:.1} s",
        e.end_ms - e.start_ms,
        r.connections,
        r.failed_connections,
        e.failed_connections,
        r.reset_connections,
        r.duplicate_mappings,
        r.connections_after_events,
        r.failed_after_events,
        ms(r.p99_setup_after_us),
        r.iperf.mean_mbps,
        r.iperf.max_stall_s,
    );
    // FM holds no packet: established flows keep their rules on the PP node while it
    // is gone, so the long-lived flows do not notice.
    assert!(r.iperf.error.is_none(), "iperf3: {:?}", r.iperf.error);
    assert!(
        r.iperf.max_stall_s <= 1.0,
        "an iperf3 stream moved nothing for {:.1} s while FM restarted",
        r.iperf.max_stall_s
    );
    assert!(r.iperf_covered_events);
    assert_eq!(r.reset_connections, 0, "{:#?}", r.failures);
    // New connections need FM; once it is back (and 1 s more), every one succeeds.
    assert!(
        r.connections_after_events >= 100,
        "{}",
        r.connections_after_events
    );
    assert_eq!(r.failed_after_events, 0, "{:#?}", r.failures);
    assert!(tb.running(&p.fm), "the restarted FM runs");
}

#[test]
#[ignore = "netns elasticity test: `make test-elastic` runs it (one at a time)"]
fn fm_failover_to_a_standby_fm_under_traffic() {
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    let mut p = lab.start_snat_inet(|spec| {
        // 6 SC nodes: the scale-out first gives the FM that dies a map of two
        // partitions, which the standby must rebuild from the SC nodes' reports.
        spec.sc_nodes = 6;
        spec.standby_fm = true;
    });
    let first_fm = p.fm.clone();
    let spec = ScenarioSpec {
        name: "fm_failover".into(),
        load: LoadSpec::new(),
        iperf: IperfSpec::new(14),
        before: Duration::from_secs(3),
        after: Duration::from_secs(4),
        events: vec![
            Event::ScaleOut {
                tenant: 1,
                chain: 1,
            },
            Event::Pause(Duration::from_secs(1)),
            Event::FailoverFm,
        ],
    };
    let r = elastic::run_scenario(tb, &mut p, &spec).expect("scenario");
    let s = r.events[0].scale.as_ref().expect("scale-out result");
    assert!(s.aborted.is_none(), "scale-out aborted: {s:?}");
    let e = &r.events[2];
    let f = e.failover.as_ref().expect("failover result");
    println!(
        "fm_failover: {} -> {}: the standby has the PP node, {} SC nodes and {} groups \
         ({} adopted) {} ms after the kill; PP on {:?}, {} SC nodes on the standby; after: \
         {} connections, {} failed, p99 setup {}",
        f.from,
        f.to,
        f.sc_nodes,
        f.groups,
        f.adopted,
        f.recovery_ms,
        f.pp_fm,
        f.sc_on_standby,
        r.connections_after_events,
        r.failed_after_events,
        ms(r.p99_setup_after_us),
    );
    assert_traffic_survived(&r, 500);
    assert_eq!(f.groups, 2, "the FM that died had two groups");
    assert_eq!(
        f.adopted, f.groups,
        "the standby adopted the groups, not new ones"
    );
    assert_eq!(
        f.pp_fm.as_deref(),
        Some(f.to.as_str()),
        "PP names the standby"
    );
    assert_eq!(
        f.sc_on_standby as u64, f.sc_nodes,
        "every SC node is on the standby"
    );
    assert!(!tb.running(&first_fm), "the first FM is dead");
    // New connections need SC through the standby: every one after the failover works.
    assert!(
        r.connections_after_events >= 100,
        "{}",
        r.connections_after_events
    );
    assert_eq!(r.failed_after_events, 0, "{:#?}", r.failures);
    let map = elastic::partition_map(tb, &p).expect("the standby's map");
    assert_eq!(map.groups_of(1, 1).len(), 2, "{map:?}");
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The number of SC groups serving tenant 1 chain 1, polled until `want` (or panic after
/// `limit`); returns how long it took.
fn wait_groups(lab: &Lab, p: &Platform, want: usize, limit: Duration) -> Duration {
    let t = Instant::now();
    loop {
        let n = elastic::partition_map(lab.tb(), p)
            .map(|m| m.groups_of(1, 1).len())
            .unwrap_or(0);
        if n == want {
            return t.elapsed();
        }
        assert!(
            t.elapsed() < limit,
            "the chain has {n} groups after {limit:?}, want {want}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// FM's event log through `starfabric events -o json`, one object per line.
fn events(lab: &Lab, p: &Platform) -> Vec<Value> {
    p.events(lab.tb()).expect("starfabric events")
}

/// The index of the first event at or after `from` that `f` accepts.
fn find(ev: &[Value], from: usize, what: &str, f: impl Fn(&Value) -> bool) -> usize {
    ev.iter()
        .skip(from)
        .position(f)
        .map(|i| i + from)
        .unwrap_or_else(|| panic!("no {what} after event {from}: {ev:#?}"))
}

/// The autoscaler under real traffic: `starfabric autoscale` watches FM's per-group
/// request rate; 100 new connections/s through SNAT is over the high mark of a group
/// rated at 40 requests/s, so it splits the partition (and, at its maximum of 2 groups,
/// refuses to split again); when the load stops, the low mark takes it back to one
/// group. No connection fails through either scale, and FM's event log tells the whole
/// story: the decisions, then FM's scale steps.
#[test]
#[ignore = "netns elasticity test: `make test-elastic` runs it (one at a time)"]
fn autoscaler_scales_sc_out_under_load_and_back_in_when_idle() {
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    let p = platform(&lab, 6);
    let before = elastic::partition_map(tb, &p).expect("partition map");
    assert_eq!(before.groups_of(1, 1).len(), 1, "{before:?}");
    let scaler = p
        .autoscaler(
            tb,
            "starfabric autoscale",
            &[
                "--sc-capacity-rps",
                "40",
                "--high",
                "0.8",
                "--low",
                "0.3",
                "--interval",
                "0.5",
                "--sustain",
                "3",
                "--cooldown",
                "3",
                "--max-groups",
                "2",
                "--tenant",
                "1",
                "--chain",
                "1",
            ],
        )
        .expect("the autoscaler runs");
    // Idle at one group: the low mark holds, but one group is the minimum.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        elastic::partition_map(tb, &p)
            .unwrap()
            .groups_of(1, 1)
            .len(),
        1
    );

    let load_ms = unix_ms();
    let conns = ConnLoop::start(tb, &LoadSpec::new()).expect("connection loop");
    let out_after = wait_groups(&lab, &p, 2, Duration::from_secs(20));
    // Connections keep coming through the split groups (and the refused second split).
    std::thread::sleep(Duration::from_secs(4));
    let samples = conns.stop().expect("connections");
    let idle_ms = unix_ms();
    let in_after = wait_groups(&lab, &p, 1, Duration::from_secs(20));

    let failed: Vec<_> = samples
        .iter()
        .filter(|s| s.outcome != Outcome::Ok)
        .collect();
    let dups = elastic::duplicate_mappings(&samples);
    println!(
        "autoscale: {} connections, {} failed or reset, {} duplicate mappings; two groups \
         {:.1} s after the load started, one group {:.1} s after it stopped",
        samples.len(),
        failed.len(),
        dups.len(),
        out_after.as_secs_f64(),
        in_after.as_secs_f64()
    );
    assert!(samples.len() >= 400, "the load ran: {}", samples.len());
    assert!(failed.is_empty(), "{failed:#?}");
    assert!(dups.is_empty(), "{dups:?}");

    let ev = events(&lab, &p);
    for e in &ev {
        println!(
            "  {:>4} {} {:<20} {}",
            e["seq"],
            e["time"],
            e["kind"].as_str().unwrap_or(""),
            e["message"].as_str().unwrap_or("")
        );
    }
    for w in ev.windows(2) {
        assert!(w[0]["seq"].as_u64() < w[1]["seq"].as_u64(), "seq grows");
    }
    let kind = |e: &Value, k: &str| e["kind"] == k;
    let sc_action = |e: &Value, a: &str| {
        kind(e, "autoscale_decision")
            && e["detail"]["action"] == a
            && e["detail"]["target"]["tier"] == "sc"
            && e["detail"]["target"]["tenant"] == 1
            && e["detail"]["target"]["chain"] == 1
    };
    find(&ev, 0, "autoscale_started", |e| {
        kind(e, "autoscale_started")
    });
    let d_out = find(&ev, 0, "scale-out decision", |e| sc_action(e, "scale_out"));
    let o_start = find(&ev, d_out, "sc_scale_out_start", |e| {
        kind(e, "sc_scale_out_start")
    });
    let o_done = find(&ev, o_start, "sc_scale_out_done", |e| {
        kind(e, "sc_scale_out_done")
    });
    let d_in = find(&ev, o_done, "scale-in decision", |e| {
        sc_action(e, "scale_in")
    });
    let i_start = find(&ev, d_in, "sc_scale_in_start", |e| {
        kind(e, "sc_scale_in_start")
    });
    let i_done = find(&ev, i_start, "sc_scale_in_done", |e| {
        kind(e, "sc_scale_in_done")
    });
    // Exactly one scale each way: the second split was refused, not made.
    assert_eq!(ev.iter().filter(|e| sc_action(e, "scale_out")).count(), 1);
    assert_eq!(ev.iter().filter(|e| sc_action(e, "scale_in")).count(), 1);
    assert!(
        ev.iter()
            .all(|e| !kind(e, "autoscale_failed") && !kind(e, "scale_aborted")),
        "no failed or aborted scale"
    );
    let refused = ev
        .iter()
        .filter(|e| kind(e, "autoscale_refused"))
        .collect::<Vec<_>>();
    assert!(
        refused
            .iter()
            .all(|e| e["message"].as_str().unwrap_or("").contains("maximum of 2")),
        "{refused:#?}"
    );
    // The decisions say why: over the high mark for 3 samples, under the low one.
    let (o, i) = (&ev[d_out]["detail"], &ev[d_in]["detail"]);
    assert!(o["utilisation"].as_f64().unwrap() > 0.8, "{o}");
    assert_eq!(
        (o["mark"].as_f64(), o["samples"].as_u64()),
        (Some(0.8), Some(3))
    );
    assert_eq!(o["units"], 1);
    assert!(i["utilisation"].as_f64().unwrap() < 0.3, "{i}");
    assert_eq!(i["units"], 2);
    assert_eq!(
        ev[o_done]["detail"]["from_group"],
        before.groups_of(1, 1)[0],
        "the busiest (only) group was split"
    );
    assert_eq!(
        ev[i_done]["detail"]["from_group"], ev[o_done]["detail"]["to_group"],
        "the scale-in retired the group the scale-out made"
    );
    let t = |i: usize| ev[i]["unix_ms"].as_u64().unwrap();
    println!(
        "autoscale reaction: load start -> out decision {} ms, decision -> out done {} ms; \
         load stop -> in decision {} ms, decision -> in done {} ms; {} refusals at max",
        t(d_out).saturating_sub(load_ms),
        t(o_done) - t(d_out),
        t(d_in).saturating_sub(idle_ms),
        t(i_done) - t(d_in),
        refused.len()
    );
    tb.stop(&scaler);
}
