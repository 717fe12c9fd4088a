//! A flow's life across the two paths: userspace until it is an elephant, the XDP fast
//! path while it is busy, userspace again once it has been idle, with its counters adding
//! up across every move; and rule updates and removals following it into the map.
//!
//! The XDP side runs through `BPF_PROG_TEST_RUN` (no interface needed), the userspace
//! side through the real pipeline; the frames are the golden corpus's.

use std::time::Duration;

use pipeline::golden::{self, Outcome};
use pipeline::{
    Action, ElephantPolicy, MemRing, NodeAddr, PacketIo, Pipeline, PipelineConfig, Rule,
    RuleSource, VecSource, Verdict, VpcBinding,
};
use xdp::{monotonic_now, OffloadPolicy, Offloader, XdpProgram, XdpVerdict};

const CASE: &str = "v4-udp-snat-reencap";
const TENANT: u32 = 7;

struct Fixture {
    node: NodeAddr,
    rule: Rule,
    input: Vec<u8>,
    output: Vec<u8>,
    prog: XdpProgram,
    p: Pipeline,
}

fn fixture(elephant_packets: u32) -> Fixture {
    let (node, cases) = golden::load().expect("corpus");
    let c = cases.iter().find(|c| c.name == CASE).expect("corpus case");
    let rule = c.parsed_rule().unwrap().expect("case has a rule");
    let Some(Outcome::Out(_, output)) = c.expect.clone() else {
        panic!("{CASE} transmits");
    };
    let mut prog = XdpProgram::load().expect("load the XDP program (needs root / CAP_BPF)");
    prog.set_node(&node).expect("set node");
    let mut cfg = PipelineConfig::new(node);
    cfg.flow_capacity = 64;
    cfg.elephant = Some(ElephantPolicy {
        window_ms: 10_000,
        bytes: u64::MAX,
        packets: elephant_packets,
    });
    let mut p = Pipeline::new(cfg, RuleSource::None).unwrap();
    p.bind_vpc(
        rule.key.vni(),
        VpcBinding {
            tenant: TENANT,
            chain: 1,
        },
    );
    p.install_rule(&rule, 0).unwrap();
    Fixture {
        node,
        rule,
        input: c.input.clone(),
        output,
        prog,
        p,
    }
}

/// One frame through the userspace pipeline at `now` ms: the frame it sends.
fn userspace(p: &mut Pipeline, frame: &[u8], now: u32) -> Vec<u8> {
    let mut src = VecSource::default();
    src.push(frame.to_vec(), 0);
    let mut io = MemRing::new(src, 4);
    io.sink.capture = true;
    let mut descs = Vec::new();
    io.rx(&mut descs, 4).unwrap();
    p.process(io.region(), &mut descs, now);
    io.tx(&descs).unwrap();
    assert!(
        matches!(descs[0].verdict, Verdict::Tx(_)),
        "{:?}",
        descs[0].verdict
    );
    io.sink.captured.remove(0).1
}

fn counters(p: &Pipeline, r: &Rule) -> (u64, u64) {
    let (_, packets, bytes) = p.lookup_rule(&r.key).expect("rule installed");
    (packets, bytes)
}

fn tenant_packets(p: &Pipeline) -> u64 {
    p.tenants()
        .find(|(t, _)| *t == TENANT)
        .map_or(0, |(_, c)| c.packets)
}

#[test]
fn a_long_flow_moves_to_xdp_and_back_with_counters_adding_up() {
    let mut f = fixture(10);
    let len = f.input.len() as u64;
    let policy = OffloadPolicy {
        idle: Duration::from_secs(1),
        sweep_interval: Duration::from_millis(1),
        ..OffloadPolicy::default()
    };
    let mut off = Offloader::new(policy);
    let mut now = 1u32;

    // Below the threshold: userspace only, nothing in the map.
    for _ in 0..9 {
        assert_eq!(userspace(&mut f.p, &f.input, now), f.output);
        now += 1;
    }
    off.poll(&mut f.prog, &mut f.p, now, monotonic_now())
        .unwrap();
    assert_eq!(off.stats().offloaded, 0);
    assert_eq!(f.prog.rule_counters(&f.rule.key).unwrap(), None);
    let (v, out) = f.prog.test_run(&f.input).unwrap();
    assert_eq!(
        (v, &out),
        (XdpVerdict::Pass, &f.input),
        "a miss goes up untouched"
    );

    // The tenth packet in the window makes it an elephant; the next poll offloads it.
    assert_eq!(userspace(&mut f.p, &f.input, now), f.output);
    assert_eq!(f.p.stats().elephants, 1);
    off.poll(&mut f.prog, &mut f.p, now, monotonic_now())
        .unwrap();
    assert_eq!(off.stats().offloaded, 1);
    assert!(off.is_offloaded(&f.rule.key));
    assert_eq!(counters(&f.p, &f.rule), (10, 10 * len));

    // In the driver: the same output frame as userspace gave, counted in the map.
    for _ in 0..30 {
        let (v, out) = f.prog.test_run(&f.input).unwrap();
        assert_eq!(v, XdpVerdict::Tx);
        assert_eq!(out, f.output, "the fast path's frame is userspace's");
    }
    let c = f.prog.rule_counters(&f.rule.key).unwrap().unwrap();
    assert_eq!((c.packets, c.bytes), (30, 30 * len));
    // Userspace saw none of those.
    assert_eq!(f.p.stats().rx_packets, 10);

    // A sweep folds the driver's counts into the rule's, the tenant's and the node's.
    now += 100;
    off.sweep(&mut f.prog, &mut f.p, now, monotonic_now())
        .unwrap();
    assert_eq!(counters(&f.p, &f.rule), (40, 40 * len));
    assert_eq!(f.p.stats().fastpath_packets, 30);
    assert_eq!(f.p.stats().fastpath_bytes, 30 * len);
    assert_eq!(tenant_packets(&f.p), 40);
    // Folding twice adds nothing.
    off.sweep(&mut f.prog, &mut f.p, now, monotonic_now())
        .unwrap();
    assert_eq!(counters(&f.p, &f.rule), (40, 40 * len));
    // The flow's userspace entry was kept alive by the fold (its idle clock is `now`).
    assert_eq!(
        f.p.table()
            .entry(f.p.table().lookup(&f.rule.key).unwrap())
            .last_seen,
        now
    );

    // Two more in the driver, then the flow goes idle past the policy: the rule comes
    // back out of the map with its last counts folded.
    for _ in 0..2 {
        assert_eq!(f.prog.test_run(&f.input).unwrap().0, XdpVerdict::Tx);
    }
    let later = monotonic_now() + Duration::from_secs(2);
    off.poll(&mut f.prog, &mut f.p, now, later).unwrap();
    assert_eq!(off.stats().expired, 1);
    assert!(!off.is_offloaded(&f.rule.key));
    assert_eq!(f.prog.rule_counters(&f.rule.key).unwrap(), None);
    assert_eq!(counters(&f.p, &f.rule), (42, 42 * len));
    let (v, out) = f.prog.test_run(&f.input).unwrap();
    assert_eq!(
        (v, &out),
        (XdpVerdict::Pass, &f.input),
        "back on the miss path"
    );

    // Back in userspace, with the same rule and counters continuing from 42.
    for _ in 0..5 {
        now += 1;
        assert_eq!(userspace(&mut f.p, &f.input, now), f.output);
    }
    assert_eq!(counters(&f.p, &f.rule), (47, 47 * len));
    assert_eq!(tenant_packets(&f.p), 47);
    let s = f.p.stats();
    assert_eq!(
        s.rx_packets + s.fastpath_packets,
        47,
        "every packet counted once"
    );

    // Busy again: it crosses the threshold anew and moves back into the driver.
    for _ in 0..10 {
        now += 1;
        userspace(&mut f.p, &f.input, now);
    }
    off.poll(&mut f.prog, &mut f.p, now, monotonic_now())
        .unwrap();
    assert_eq!(off.stats().offloaded, 2);
    assert_eq!(f.prog.test_run(&f.input).unwrap().0, XdpVerdict::Tx);
    off.flush(&mut f.prog, &mut f.p, now).unwrap();
    assert_eq!(counters(&f.p, &f.rule), (58, 58 * len));
    assert_eq!(off.stats().active, 0);
}

#[test]
fn rule_updates_and_removals_reach_the_map() {
    let mut f = fixture(1);
    let len = f.input.len() as u64;
    let mut off = Offloader::new(OffloadPolicy::default());
    userspace(&mut f.p, &f.input, 1);
    off.poll(&mut f.prog, &mut f.p, 1, monotonic_now()).unwrap();
    assert!(off.is_offloaded(&f.rule.key));
    for _ in 0..3 {
        assert_eq!(
            f.prog.test_run(&f.input).unwrap(),
            (XdpVerdict::Tx, f.output.clone())
        );
    }

    // FM replaces the flow's rule (a new SNAT address): the map follows.
    let mut updated = f.rule.clone();
    for a in &mut updated.actions {
        if let Action::SetSrc { addr, .. } = a {
            *addr = Some("198.19.0.77".parse().unwrap());
        }
    }
    f.p.install_rule(&updated, 2).unwrap();
    off.poll(&mut f.prog, &mut f.p, 2, monotonic_now()).unwrap();
    assert_eq!(off.stats().replaced, 1);
    assert!(
        off.is_offloaded(&f.rule.key),
        "the new rule is offloadable too"
    );
    // What the driver now sends is what userspace sends with the new rule.
    let mut fresh = Pipeline::new(PipelineConfig::new(f.node), RuleSource::None).unwrap();
    fresh.install_rule(&updated, 0).unwrap();
    let want = userspace(&mut fresh, &f.input, 1);
    assert_ne!(want, f.output);
    let (v, out) = f.prog.test_run(&f.input).unwrap();
    assert_eq!((v, out), (XdpVerdict::Tx, want));
    // The three packets the old rule carried in the driver were folded, not lost.
    assert_eq!(f.p.stats().fastpath_packets, 3);
    assert_eq!(tenant_packets(&f.p), 4);

    // FM removes the rule: it leaves the map, its last packet is folded.
    assert!(f.p.remove_rule(&f.rule.key).is_some());
    off.poll(&mut f.prog, &mut f.p, 3, monotonic_now()).unwrap();
    assert_eq!(off.stats().removed, 1);
    assert_eq!(f.prog.rule_counters(&f.rule.key).unwrap(), None);
    assert_eq!(f.prog.test_run(&f.input).unwrap().0, XdpVerdict::Pass);
    assert_eq!(f.p.stats().fastpath_packets, 4);
    assert_eq!(f.p.stats().fastpath_bytes, 4 * len);
    assert_eq!(tenant_packets(&f.p), 5);
}

#[test]
fn rules_the_driver_cannot_run_stay_in_userspace() {
    let mut f = fixture(1);
    let mut policed = f.rule.clone();
    policed.actions.insert(1, Action::Police { class: 1 });
    f.p.install_rule(&policed, 1).unwrap();
    userspace(&mut f.p, &f.input, 2);
    let mut off = Offloader::new(OffloadPolicy::default());
    off.poll(&mut f.prog, &mut f.p, 2, monotonic_now()).unwrap();
    assert_eq!(off.stats().not_offloadable, 1);
    assert_eq!(off.stats().offloaded, 0);
    assert_eq!(f.prog.rule_counters(&f.rule.key).unwrap(), None);
    // Offered once: more packets do not queue it again.
    for now in 3..20 {
        userspace(&mut f.p, &f.input, now);
    }
    assert_eq!(f.p.stats().elephants, 1);
}
