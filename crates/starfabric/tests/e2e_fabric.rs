//! The fabric between PP nodes (paper 000 §5.2, docs/fabric.md): a FW + SNAT chain
//! whose SNAT stage only some PP nodes serve. Flows enter on a node that does not serve
//! it, pass the firewall there, and go on over the fabric to a node that does, which
//! translates and sends them to the internet. FM keeps the routes; they follow PP
//! scale-out and a PP node's failure.
//!
//! The first test runs in the workspace run. The second times nothing either, but it
//! runs iperf3 and a connection loop through a PP kill like the other elasticity tests,
//! so `make test-elastic` runs it on its own.

use std::time::Duration;

use nfs::fw::{AclAction, AclProto};
use testbed::chains::{self, Toward};
use testbed::elastic::{self, Event, IperfSpec, LoadSpec, ScenarioSpec};
use testbed::platform::{field, Platform, PlatformSpec};
use testbed::topo::{addr, vni, Node};
use testbed::{probe, services, Testbed};

mod common;
use common::Lab;

/// The UDP port the single-datagram flows go to (allowed by the FW).
const UDP_PORT: u16 = 9999;

/// FW (TCP 80 and iperf3's 5201 allowed, UDP to [`UDP_PORT`] allowed, TCP 8080 denied,
/// the rest denied) then SNAT, for VPC 0; its SNAT stage on `stage` (PP node ids).
fn split_chain_platform(lab: &Lab, active: usize, stage: &[&str]) -> Platform {
    let tb = lab.tb();
    services::start_inet(tb, false).expect("internet host servers");
    let fw = chains::fw(
        1,
        vec![
            chains::acl(AclAction::Allow, AclProto::Tcp, 80),
            chains::acl(AclAction::Allow, AclProto::Tcp, 5201),
            chains::acl(AclAction::Allow, AclProto::Udp, UDP_PORT),
            chains::acl(AclAction::Deny, AclProto::Tcp, 8080),
        ],
        AclAction::Deny,
    );
    let chain =
        chains::chain(1, 1, 0, Toward::Internet, &[fw, chains::snat(0)]).expect("FW+SNAT chain");
    let mut spec = PlatformSpec::new(vec![chain], vec![(vni::tenant(0), 1, 1)]);
    spec.pp_active = active;
    spec.fabric = vec![(1, 1, stage.iter().map(|s| s.to_string()).collect())];
    lab.start_spec(&spec)
}

fn curl(tb: &Testbed, url: &str) -> testbed::cmd::Output {
    tb.exec_full(
        Node::Client(0),
        &["curl", "-sS", "--max-time", "5", url],
        Duration::from_secs(10),
    )
    .expect("run curl")
}

/// Wait (bounded) until PP node `i`'s stats line satisfies `ok`; the last line either
/// way.
fn pp_line(p: &Platform, i: usize, ok: impl Fn(&str) -> bool) -> String {
    let _ = testbed::cmd::wait_for("a PP stats line", Duration::from_secs(5), || {
        let l = p.pp_node_stats(i);
        Ok(ok(&l).then_some(()))
    });
    p.pp_node_stats(i)
}

fn fm_line(p: &Platform, ok: impl Fn(&str) -> bool) -> String {
    let _ = testbed::cmd::wait_for("an FM status line", Duration::from_secs(5), || {
        Ok(ok(&p.fm_status()).then_some(()))
    });
    p.fm_status()
}

#[test]
fn a_fw_snat_chain_split_over_two_pp_nodes_works_end_to_end_over_the_fabric() {
    let Some(lab) = Lab::cluster(1, 0, 2) else {
        return;
    };
    let p = split_chain_platform(&lab, 2, &["pp-1"]);
    let tb = lab.tb();
    // Every vIP on pp-0: the client's flows enter there only, and pp-1, which serves the
    // SNAT stage, sees them only over the fabric.
    let m = p.move_vips(tb, 1, 0).expect("vIPs to pp-0");
    assert_eq!(m.owned_by("pp-0").len(), 8, "{m:?}");
    assert!(m.owned_by("pp-1").is_empty());

    // Allowed: FW on pp-0, SNAT on pp-1, and the reply back the same way.
    for i in 0..5 {
        let out = curl(tb, &format!("http://{}/?i={i}", addr::INET));
        assert!(out.ok(), "curl {i}: {}: {}", out.status, out.stderr);
        // nginx answers with the address it saw: the tenant's SNAT pool address.
        assert!(
            out.stdout.contains(&addr::pool(0).to_string()),
            "not translated: {:?}",
            out.stdout
        );
    }
    // Denied by the firewall at the ingress node: it never crosses the fabric.
    let denied = curl(tb, &format!("http://{}:8080/", addr::INET));
    assert!(!denied.ok(), "TCP 8080 passed the firewall");

    let fm = fm_line(&p, |l| field(l, "fabric_local").is_some_and(|n| n >= 5));
    println!("FM: {fm}");
    let pp0 = pp_line(&p, 0, |l| field(l, "rule:acl-deny").is_some_and(|n| n >= 1));
    let pp1 = pp_line(&p, 1, |l| field(l, "tx").is_some_and(|n| n >= 20));
    println!("pp-0: {pp0}\npp-1: {pp1}");
    // FM made one route per allowed flow (under both directions' keys), all to pp-1;
    // the denied flow got none. It answered pp-0 with forwarding entries and pp-1 with
    // the whole rules (lower bounds: a node asks again for a flow whose answer is late).
    assert_eq!(field(&fm, "fabric_routes"), Some(5), "{fm}");
    assert!(
        field(&fm, "fabric@pp-1").is_some_and(|n| n >= 10),
        "five flows' routes (two keys each) to pp-1: {fm}"
    );
    assert!(field(&fm, "fabric@pp-0").is_none(), "{fm}");
    assert!(
        field(&fm, "fabric_forwarded").is_some_and(|n| n >= 5),
        "{fm}"
    );
    assert!(field(&fm, "fabric_local").is_some_and(|n| n >= 5), "{fm}");
    assert_eq!(field(&fm, "fabric_no_node"), Some(0), "{fm}");
    // The firewall's verdict was applied on pp-0; pp-1 owns no vIP and still received
    // and sent the flows: they came over the fabric.
    assert!(
        field(&pp0, "rule:acl-deny").is_some_and(|n| n >= 1),
        "{pp0}"
    );
    assert!(field(&pp1, "rule:acl-deny").is_none(), "{pp1}");
    assert!(field(&pp1, "rx").is_some_and(|n| n >= 20), "{pp1}");
    assert!(field(&pp1, "tx").is_some_and(|n| n >= 20), "{pp1}");

    first_packets_of_new_flows_go_through_fm(&p, tb);
}

/// The first packet through FM (paper 000 §5.2, docs/fabric.md). Each flow here is one
/// UDP datagram: pp-0 (FW) misses on it and sends it with its rule request, FM routes
/// the flow to pp-1 and hands the datagram to pp-1 with pp-1's rule, and pp-1 (SNAT)
/// sends it to the internet host. pp-0 must not send it as well.
fn first_packets_of_new_flows_go_through_fm(p: &Platform, tb: &Testbed) {
    const FLOWS: u64 = 20;
    let forwarded = |l: &str| field(l, "fabric_first_packets_forwarded").unwrap_or(0);
    // Counters from before, once the lines cover everything the curls did (PP prints
    // every second).
    std::thread::sleep(Duration::from_millis(2100));
    let (fm0, pp0_0, pp1_0) = (p.fm_status(), p.pp_node_stats(0), p.pp_node_stats(1));
    // The curls' first packets (their SYNs) went this way too.
    assert!(forwarded(&fm0) >= 5, "{fm0}");
    let via_fm = |l: &str| field(l, "fabric_first_via_fm").unwrap_or(0);
    let injected = |l: &str| field(l, "fabric_injected").unwrap_or(0);

    let sink = probe::UdpSink::start(tb, UDP_PORT).expect("UDP sink on the internet host");
    let payloads: Vec<Vec<u8>> = (0..FLOWS)
        .map(|i| format!("first-packet-{i}").into_bytes())
        .collect();
    let ports =
        probe::single_datagram_flows(tb, 0, UDP_PORT, payloads.clone(), Duration::from_millis(20))
            .expect("send the datagrams");
    let mut distinct = ports.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(
        distinct.len() as u64,
        FLOWS,
        "one source port per flow: {ports:?}"
    );
    let fm = fm_line(p, |l| forwarded(l) >= forwarded(&fm0) + FLOWS);
    let pp0 = pp_line(p, 0, |l| via_fm(l) >= via_fm(&pp0_0) + FLOWS);
    let pp1 = pp_line(p, 1, |l| injected(l) >= injected(&pp1_0) + FLOWS);
    // Time for a duplicate, if one were sent, to arrive and be counted.
    std::thread::sleep(Duration::from_millis(1100));
    let got = sink.stop();
    let (fm, pp0, pp1) = (
        fm_line(p, |l| forwarded(l) >= forwarded(&fm)),
        pp_line(p, 0, |l| via_fm(l) >= via_fm(&pp0)),
        pp_line(p, 1, |l| injected(l) >= injected(&pp1)),
    );
    println!("first packets: FM: {fm}\npp-0: {pp0}\npp-1: {pp1}");

    // Every flow's one datagram arrived exactly once, translated by pp-1's SNAT.
    for (i, want) in payloads.iter().enumerate() {
        let n = got.iter().filter(|(_, d)| d == want).count();
        assert_eq!(n, 1, "flow {i} arrived {n} times; got {got:?}");
    }
    assert_eq!(got.len() as u64, FLOWS, "{got:?}");
    for (from, _) in &got {
        assert_eq!(*from.ip(), addr::pool(0), "not translated: {got:?}");
    }
    // FM carried each flow's first packet, once; pp-0 left each one to FM and pp-1 ran
    // each one.
    assert_eq!(forwarded(&fm) - forwarded(&fm0), FLOWS, "{fm0}\n{fm}");
    assert_eq!(field(&fm, "fabric_first_dropped"), Some(0), "{fm}");
    assert_eq!(via_fm(&pp0) - via_fm(&pp0_0), FLOWS, "{pp0_0}\n{pp0}");
    assert_eq!(injected(&pp1) - injected(&pp1_0), FLOWS, "{pp1_0}\n{pp1}");
    // pp-1 asked for none of these rules: the rule came with the packet.
    assert_eq!(injected(&pp0), 0, "{pp0}");
}

#[test]
#[ignore = "netns elasticity test: `make test-elastic` runs it (one at a time)"]
fn fabric_routes_follow_pp_scale_out_and_a_killed_pp_node_loses_no_connection() {
    let Some(lab) = Lab::cluster(1, 0, 3) else {
        return;
    };
    // The SNAT stage on pp-1 and pp-2; pp-2 starts as a scale-out during the run.
    let mut p = split_chain_platform(&lab, 2, &["pp-1", "pp-2"]);
    let tb = lab.tb();
    p.move_vips(tb, 1, 0).expect("vIPs to pp-0");
    // iperf3 starts before pp-2 runs, so its flows' routes are all to pp-1, the node
    // the test kills.
    let spec = ScenarioSpec {
        name: "fabric_scale_out_and_pp_kill".into(),
        load: LoadSpec::new(),
        iperf: IperfSpec::new(12),
        before: Duration::from_secs(2),
        after: Duration::from_secs(3),
        events: vec![
            Event::PpScaleOut { node: 2 },
            Event::Pause(Duration::from_secs(3)),
            Event::KillPp {
                node: 1,
                silent: false,
            },
        ],
    };
    let r = elastic::run_scenario(tb, &mut p, &spec).expect("scenario");
    println!(
        "{}; iperf3 {:.1} Mbit/s, longest stall {:.1} s, error {:?}",
        common::scenario_counts(&r),
        r.iperf.mean_mbps,
        r.iperf.max_stall_s,
        r.iperf.error,
    );
    for e in &r.events {
        println!("  {}; {:?}", common::event_counts(e), e.pp);
    }
    for i in [0, 2] {
        println!("  pp-{i}: {}", p.pp_node_stats(i));
    }
    let lines = p.fm_status_lines();
    let fm = lines.last().cloned().unwrap_or_default();
    println!("  FM: {fm}");

    // 0 established connections lost.
    common::assert_survived(&r, 300);
    if let Some(t) = &r.tcp_resets {
        assert_eq!(t.estab_resets, 0, "{t:?}");
    }

    // Scale-out: while pp-1 still lived, new flows were routed to pp-2 as well.
    let both = lines.iter().find(|l| {
        field(l, "fabric@pp-1").is_some_and(|n| n > 0)
            && field(l, "fabric@pp-2").is_some_and(|n| n > 0)
    });
    assert!(
        both.is_some(),
        "no FM status line had routes to both pp-1 and pp-2; last: {fm}"
    );
    // Failure: FM withdrew pp-1's routes, and none points there since.
    assert!(
        field(&fm, "fabric_withdrawn").is_some_and(|n| n > 0),
        "{fm}"
    );
    assert!(field(&fm, "fabric@pp-1").is_none(), "{fm}");
    assert!(field(&fm, "fabric@pp-2").is_some_and(|n| n > 0), "{fm}");
    assert_eq!(field(&fm, "fabric_no_node"), Some(0), "{fm}");
    let pp2 = p.pp_node_stats(2);
    assert!(field(&pp2, "tx").is_some_and(|n| n > 1000), "{pp2}");
}
