//! A PP cluster under live traffic (docs/pp-cluster.md): several PP nodes behind the
//! router's ECMP route over the cluster's vIPs (Zeta's Multi-IP, paper 003 §IV-E; the
//! ENI-bonding group of paper 000 §4.2). PP scale-out and scale-in move vIPs; a PP
//! node's failure moves its vIPs to the survivors, measured with a probe every 0.5 ms.
//! A live migration moves every vIP from a plain PP node to an accelerated one and back.
//!
//! `#[ignore]`d like the other elasticity tests: `make test-elastic` runs them one at a
//! time.

use std::time::Duration;

use testbed::elastic::{self, Event, IperfSpec, LoadSpec, ScenarioReport, ScenarioSpec};
use testbed::platform::Platform;
use testbed::probe::ProbeSpec;

mod common;
use common::Lab;

/// One VPC with SNAT toward the internet host, `active` PP nodes running.
fn platform(lab: &Lab, active: usize) -> Platform {
    lab.start_snat_inet(|spec| spec.pp_active = active)
}

fn print(r: &ScenarioReport) {
    println!(
        "{}; iperf3 {:.1} Mbit/s, longest stall {:.1} s, error {:?}",
        common::scenario_counts(r),
        r.iperf.mean_mbps,
        r.iperf.max_stall_s,
        r.iperf.error,
    );
    for e in &r.events {
        println!("  {}; {:?}", common::event_counts(e), e.pp);
    }
    if let Some(p) = &r.probe {
        println!(
            "  probes (scenario t0 at {:.1} ms): {} flows, sent {}, received {}, flows with loss {}, worst outage {:.1} ms",
            p.scenario_t0_ms,
            p.flows.len(),
            p.sent,
            p.received,
            p.flows_with_loss,
            p.recovery_ms
        );
        for f in &p.flows {
            println!("    {f:?}");
        }
    }
}

#[test]
#[ignore = "netns elasticity test: `make test-elastic` runs it (one at a time)"]
fn pp_scale_out_takes_traffic_within_a_second_and_scale_in_drains_first() {
    let Some(lab) = Lab::cluster(1, 0, 3) else {
        return;
    };
    let mut p = platform(&lab, 2);
    let tb = lab.tb();
    let m = p.vip_map(tb).expect("vIP map");
    assert_eq!(m.owned_by("pp-0").len() + m.owned_by("pp-1").len(), 8);
    assert_eq!(m.owned_by("pp-0").len(), 4, "{m:?}");
    let spec = ScenarioSpec {
        name: "pp_scale_out_in".into(),
        load: LoadSpec::new(),
        iperf: IperfSpec::new(14),
        before: Duration::from_secs(2),
        after: Duration::from_secs(2),
        events: vec![
            Event::PpScaleOut { node: 2 },
            Event::Pause(Duration::from_secs(2)),
            Event::PpScaleIn { node: 0 },
        ],
    };
    let r = elastic::run_scenario(tb, &mut p, &spec).expect("scenario");
    print(&r);
    common::assert_survived(&r, 300);
    let out = r.events[0].pp.as_ref().expect("scale-out report");
    assert!(
        out.vips_after.len() >= 2,
        "the new node took a share of the 8 vIPs: {out:?}"
    );
    let secs = out
        .seconds_to_traffic
        .expect("traffic reached the new node");
    // The goal (docs/pp-cluster.md, bench/goals.json): traffic within a second.
    assert!(secs < 1.0, "{secs} s from command to traffic");
    let inn = r.events[2].pp.as_ref().expect("scale-in report");
    assert!(!inn.vips_before.is_empty());
    assert!(inn.vips_after.is_empty(), "drained: {inn:?}");
    // Every node that ran carried traffic at some point of the timeline.
    for n in ["pp-0", "pp-1", "pp-2"] {
        assert!(
            r.timeline
                .iter()
                .any(|t| t.tx_bytes_per_s.get(n).is_some_and(|v| *v > 10_000.0)),
            "{n} never sent anything"
        );
    }
    // After the drain pp-0 is stopped and the others serve everything.
    let m = p.vip_map(tb).expect("vIP map");
    assert!(m.all_owned());
    assert!(m.owned_by("pp-0").is_empty());
}

fn failover(silent: bool) {
    let Some(lab) = Lab::cluster(1, 0, 2) else {
        return;
    };
    let mut p = platform(&lab, 2);
    let tb = lab.tb();
    let spec = ScenarioSpec {
        name: if silent {
            "pp_failover_silent"
        } else {
            "pp_failover"
        }
        .into(),
        load: LoadSpec::new(),
        iperf: IperfSpec::new(9),
        before: Duration::from_secs(3),
        after: Duration::from_secs(3),
        events: vec![Event::KillPp { node: 1, silent }],
    };
    let r =
        elastic::run_scenario_probed(tb, &mut p, &spec, Some(&ProbeSpec::new())).expect("scenario");
    print(&r);
    for i in 0..2 {
        println!("  pp-{i}: {}", p.pp_node_stats(i));
    }
    println!("  FM: {}", p.fm_status());
    common::assert_survived(&r, 300);
    let e = r.events[0].pp.as_ref().expect("failover report");
    assert_eq!(e.vips_before.len(), 4, "{e:?}");
    assert!(e.vips_after.is_empty());
    let probe = r.probe.as_ref().expect("probes");
    assert!(probe.sent > 1000 && probe.received > 0);
    let flows = e.flows_with_loss.expect("probe flows counted");
    assert!(
        flows > 0,
        "no probe flow crossed the failed node: {probe:?}"
    );
    let recovery = e.recovery_ms.expect("recovery measured");
    println!("recovery {recovery:.1} ms over {flows} probe flows");
    // The goal is 50 ms (bench/goals.json). A silent node is found only after FM's
    // PP limit (3 heartbeats of 10 ms) before its vIPs can move, so it gets that on top.
    let bound = if silent { 50.0 + 30.0 } else { 50.0 };
    assert!(recovery < bound, "recovery {recovery} ms, goal {bound} ms");
}

#[test]
#[ignore = "netns elasticity test: `make test-elastic` runs it (one at a time)"]
fn a_killed_pp_nodes_vips_move_to_the_survivor_and_iperf3_survives() {
    failover(false);
}

#[test]
#[ignore = "netns elasticity test: `make test-elastic` runs it (one at a time)"]
fn a_pp_node_that_falls_silent_is_found_by_heartbeats_and_its_vips_move() {
    failover(true);
}

/// The autoscaler scales the PP tier through the local node provider: one PP node runs,
/// the pool file names a spare (`pp-1` in its own namespace). iperf3's packets push the
/// node's heartbeat `packets_per_s` over the high mark, so the provider starts `pp-1`
/// and FM gives it vIPs; when iperf3 ends, the light connection loop that ran
/// throughout is under the low mark, so the provider drains `pp-1` and stops it. No
/// connection fails or is reset across either, and FM's event log has both decisions.
#[test]
#[ignore = "netns elasticity test: `make test-elastic` runs it (one at a time)"]
fn autoscaler_adds_a_pp_node_under_load_and_drains_it_when_idle() {
    use std::time::Instant;
    use testbed::elastic::{ConnLoop, Iperf, Outcome};
    use testbed::platform::field;

    let Some(lab) = Lab::cluster(1, 0, 2) else {
        return;
    };
    let p = platform(&lab, 1);
    let tb = lab.tb();
    assert_eq!(p.vip_map(tb).expect("vIP map").nodes, vec!["pp-0"]);
    let pool = tb.path("pp-pool.json");
    let pool_json = serde_json::json!({
        "log_dir": tb.dir,
        "nodes": [{"id": "pp-1", "argv": p.pp_slot_argv(tb, 1).expect("slot")}],
    });
    std::fs::write(&pool, pool_json.to_string()).expect("write the pool");
    let pool_s = pool.display().to_string();
    // 2 iperf3 streams at 50 Mbit/s are some 10k packets/s through PP; the connection
    // loop alone, at 20 connections/s, is a few hundred.
    let scaler = p
        .autoscaler(
            tb,
            "starfabric autoscale pp",
            &[
                "--pp-capacity",
                "5000",
                "--pp-metric",
                "packets_per_s",
                "--high",
                "0.8",
                "--low",
                "0.2",
                "--interval",
                "0.5",
                "--sustain",
                "3",
                "--cooldown",
                "3",
                "--pp-max-nodes",
                "2",
                "--pp-pool",
                pool_s.as_str(),
                "--pp-stop-on-exit",
            ],
        )
        .expect("the autoscaler runs");
    let mut light = testbed::elastic::LoadSpec::new();
    light.rate = 20.0;
    light.workers = 5;
    let conns = ConnLoop::start(tb, &light).expect("connection loop");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        p.vip_map(tb).expect("vIP map").nodes,
        vec!["pp-0"],
        "no scale-out under light load"
    );

    let load = Instant::now();
    // The underlay spreads flows over the vIPs by an L4 hash of each direction, so
    // which node carries an iperf3 stream is luck. Eight streams (the same 100 Mbit/s
    // as two) make "no stream direction lands on pp-1's half" a 1 in 65536 event; with
    // two it was 1 in 16, and pp-1 then saw only the connection loop (rx 971 in CI).
    let mut spec = IperfSpec::new(12);
    spec.streams = 8;
    spec.bitrate = "12500K".into();
    let iperf = Iperf::start(tb, &spec).expect("iperf3");
    let wait_nodes = |want: usize, limit: Duration| -> Duration {
        let t = Instant::now();
        loop {
            let m = p.vip_map(tb).expect("vIP map");
            if m.nodes.len() == want && m.all_owned() {
                return t.elapsed();
            }
            assert!(
                t.elapsed() < limit,
                "{} PP nodes after {limit:?}, want {want}: {m:?}\n{}",
                m.nodes.len(),
                std::fs::read_to_string(&scaler.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    wait_nodes(2, Duration::from_secs(20));
    let out_after = load.elapsed();
    let m = p.vip_map(tb).expect("vIP map");
    let taken = m.owned_by("pp-1");
    assert!(!taken.is_empty(), "{m:?}");
    let rep = iperf.wait(tb).expect("iperf3 report");
    let pp1_log = tb.path("pp-1.log");
    let pp1_stats = std::fs::read_to_string(&pp1_log)
        .unwrap_or_default()
        .lines()
        .rev()
        .find(|l| l.starts_with("pp: t="))
        .unwrap_or_default()
        .to_string();
    let idle = Instant::now();
    wait_nodes(1, Duration::from_secs(30));
    let in_after = idle.elapsed();
    std::thread::sleep(Duration::from_secs(1));
    let samples = conns.stop().expect("connections");
    let log = std::fs::read_to_string(&scaler.log).unwrap_or_default();
    tb.stop(&scaler);
    println!(
        "autoscale pp: pp-1 serving vIPs {taken:?} {:.1} s after iperf3 started; back to \
         pp-0 alone {:.1} s after it ended; {} connections; iperf3 {:.1} Mbit/s, stall \
         {:.1} s, error {:?}\n  pp-1: {pp1_stats}\n{log}",
        out_after.as_secs_f64(),
        in_after.as_secs_f64(),
        samples.len(),
        rep.mean_mbps,
        rep.max_stall_s,
        rep.error
    );
    let failed: Vec<_> = samples
        .iter()
        .filter(|s| s.outcome != Outcome::Ok)
        .collect();
    assert!(samples.len() >= 200, "the loop ran: {}", samples.len());
    assert!(failed.is_empty(), "{failed:#?}");
    assert!(elastic::duplicate_mappings(&samples).is_empty());
    assert!(rep.error.is_none(), "iperf3: {:?}", rep.error);
    assert!(
        field(&pp1_stats, "rx").is_some_and(|rx| rx > 1000),
        "pp-1 carried traffic: {pp1_stats}"
    );
    assert!(
        log.contains("pp scale_out:") && log.contains("-> started pp-1 (pid "),
        "{log}"
    );
    assert!(
        log.contains("pp scale_in:") && log.contains("-> drained pp-1 in "),
        "{log}"
    );
    assert!(!log.contains("failed"), "{log}");
    let ev = p.events(tb).expect("starfabric events");
    let decisions: Vec<&str> = (ev.iter())
        .filter(|e| e["kind"] == "autoscale_decision" && e["detail"]["target"]["tier"] == "pp")
        .map(|e| e["detail"]["action"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(decisions, vec!["scale_out", "scale_in"], "{ev:?}");
    p.stop(tb);
}

/// Live migration (CyberStar §6.2, docs/pp-cluster.md "Live migration"): PP node 0 is
/// plain (AF_XDP, every packet in userspace), PP node 1 accelerated (`--offload`: its
/// elephant flows' rules run in the driver). The tenant's traffic, all 8 vIPs, starts
/// on the plain node. FM moves every vIP to the accelerated node and back through the
/// operator's `starfabric scale vip-move`, while iperf3 and the connection loop run: no
/// connection fails or is reset (the loop's outcomes and the kernels' TCP counters at
/// both ends), iperf3 runs through, the accelerated node takes the moved iperf3 flows
/// into its driver, and the vIPs end where they started.
#[test]
#[ignore = "netns elasticity test: `make test-elastic` runs it (one at a time)"]
fn live_migration_between_a_plain_and_an_accelerated_pp_node_loses_no_connection() {
    use testbed::platform::field;

    let Some(lab) = Lab::cluster(1, 0, 2) else {
        return;
    };
    let mut p = lab.start_snat_inet(|spec| {
        spec.pp_active = 2;
        spec.pp_node_args.push((
            1,
            vec!["--offload".into(), "--offload-packets".into(), "50".into()],
        ));
    });
    let tb = lab.tb();
    // Before any traffic: the accelerated node gives its share to the plain one, so the
    // whole tenant starts there.
    let m = p.move_vips(tb, 1, 0).expect("vip-move to the plain node");
    assert_eq!(m.owned_by("pp-0").len(), 8, "{m:?}");
    let spec = ScenarioSpec {
        name: "live_migration".into(),
        load: LoadSpec::new(),
        iperf: IperfSpec::new(12),
        before: Duration::from_secs(2),
        after: Duration::from_secs(2),
        events: vec![
            Event::MigrateVips { from: 0, to: 1 },
            Event::Pause(Duration::from_secs(2)),
            Event::MigrateVips { from: 1, to: 0 },
        ],
    };
    let r = elastic::run_scenario(tb, &mut p, &spec).expect("scenario");
    print(&r);
    let (plain, accel) = (p.pp_node_stats(0), p.pp_node_stats(1));
    println!(
        "  tcp resets: {:?}\n  pp-0: {plain}\n  pp-1: {accel}",
        r.tcp_resets
    );
    common::assert_survived(&r, 300);
    let tcp = r.tcp_resets.expect("the kernels' TCP counters were read");
    assert_eq!(tcp.estab_resets, 0, "{tcp:?}");
    assert_eq!(tcp.out_rsts, 0, "{tcp:?}");
    let (to_accel, to_plain) = (
        r.events[0].pp.as_ref().expect("migration report"),
        r.events[2].pp.as_ref().expect("migration report"),
    );
    for (e, from, to) in [(to_accel, "pp-0", "pp-1"), (to_plain, "pp-1", "pp-0")] {
        assert_eq!(e.node, from);
        assert_eq!(e.to_node.as_deref(), Some(to));
        assert_eq!(e.vips_before.len(), 8, "{e:?}");
        assert!(e.vips_after.is_empty(), "{e:?}");
        assert_eq!(e.to_vips_after.len(), 8, "{e:?}");
        assert_eq!(e.vip_moves, 8, "{e:?}");
        // The target carried nothing before, so its first frame is the moved traffic.
        assert!(e.first_frame_ms.is_some(), "{to} took no frame: {e:?}");
        assert!(e.migration_ms.is_some(), "{e:?}");
        let t = e.throughput.as_ref().expect("throughput around the move");
        assert!(t.before_mbps.is_some() && t.after_mbps.is_some(), "{t:?}");
    }
    // The accelerated node ran the moved iperf3 flows in its driver; it had none before
    // the move (it owned no vIP), so these are the moved flows. The plain node has no
    // fast path at all.
    assert!(
        field(&accel, "offloaded").is_some_and(|n| n > 0),
        "pp-1 offloaded nothing: {accel}"
    );
    assert!(
        field(&accel, "fastpath").is_some_and(|n| n > 0),
        "pp-1's driver forwarded nothing: {accel}"
    );
    assert!(field(&plain, "offloaded").is_none(), "{plain}");
    let m = p.vip_map(tb).expect("vIP map");
    assert_eq!(m.owned_by("pp-0").len(), 8, "{m:?}");
    assert!(m.owned_by("pp-1").is_empty(), "{m:?}");
    p.stop(tb);
}
