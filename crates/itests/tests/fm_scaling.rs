//! SC scale-out then scale-in (paper 000 Fig. 3, docs/scaling.md) under load: a steady
//! stream of new flows plus long-lived flows that PP keeps asking for again, through a
//! real FM and six SC nodes over gRPC. Checked: no request fails, no external port is
//! handed out twice (in the replies, and in the NF state of every group), every
//! long-lived flow keeps its rule across both events, and every group's state lies in
//! the partition FM's map gives it; flows decided during a move keep their rule when
//! SC is asked again afterwards (FM's cache emptied), which exercises the delta hand-over.
//! The p99 request latency before and during each event is printed (and bounded with
//! SF_SCALING_P99=1).

mod common;

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{flow, mapping, nf_part, wait, Cluster};
use fm::{ScaleOutcome, ScaleRequest};
use nf::NetworkFunction;
use pipeline::{FlowKey, RuleSource};
use pp::FmClient;
use proto::{v1, ChainDef};

const VNI: u32 = 100;
const ADDRS: [&str; 2] = ["198.19.255.1", "198.19.255.2"];
const PORTS: (u16, u16) = (1024, 65535);
const LONG_LIVED: u32 = 2_000;
const DST: &str = "198.19.0.9";
/// New flows per second the load offers (bounded so the partition's state, and the test's
/// duration, stay bounded on a small machine).
const NEW_PER_S: f64 = 3_000.0;

/// The two tests each run seven nodes on a 2-core machine: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn snat_json() -> serde_json::Value {
    serde_json::json!({"kind": "snat", "pools": [
        {"addresses": ADDRS, "ports": {"lo": PORTS.0, "hi": PORTS.1}}]})
}

fn chain(with_fw: bool) -> ChainDef {
    let mut nfs = Vec::new();
    if with_fw {
        nfs.push(serde_json::json!({"kind": "fw", "tenants": [{"tenant": 1,
            "default_action": "allow", "rules": [
            {"name": "no-telnet", "action": "deny", "proto": "tcp", "dport": 23}]}]}));
    }
    nfs.push(snat_json());
    common::chain(nfs.into())
}

/// Flow `i`'s key ([`common::flow`]).
fn key_of(i: u32) -> FlowKey {
    flow(i).key
}

fn key_from(client: Ipv4Addr, sport: u16) -> FlowKey {
    FlowKey::new(
        VNI,
        packet::proto::UDP,
        IpAddr::V4(client),
        sport,
        DST.parse().unwrap(),
        53,
    )
}

/// What the load saw.
#[derive(Default)]
struct Load {
    /// New flows answered: key → mapping.
    new: HashMap<FlowKey, (IpAddr, u16)>,
    /// New flows sent during a scale: (flow index, phase).
    new_during: Vec<(u32, u8)>,
    /// The long-lived flows' rules as first answered.
    long: HashMap<FlowKey, String>,
    /// Error replies (a PP node would ask again; so does the load).
    errors: u64,
    /// Long-lived flows answered with another rule than their first.
    changed: u64,
    long_answers: u64,
    /// Request latency (µs) by the phase it was sent in: every request, and new flows
    /// only (those that reach SC; long-lived ones are FM cache hits).
    latency: [Vec<u64>; 5],
    latency_new: [Vec<u64>; 5],
}

const BEFORE: u8 = 0;
const DURING_OUT: u8 = 1;
const BETWEEN: u8 = 2;
const DURING_IN: u8 = 3;
const AFTER: u8 = 4;
/// Establishing the long-lived flows: not measured.
const SETUP: u8 = u8::MAX;

/// Run the load until `stop`: first the long-lived flows (then `ready` is set), then new
/// flows with `window` outstanding, and the long-lived flows asked for again round-robin.
fn drive(
    source: RuleSource,
    window: usize,
    phase: Arc<AtomicU8>,
    ready: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
) -> Load {
    let RuleSource::Channel { requests, replies } = source else {
        unreachable!()
    };
    let mut load = Load::default();
    // key → (flow index, sent at, phase, long-lived?)
    let mut pending: HashMap<FlowKey, (u32, Instant, u8, bool)> = HashMap::new();
    let long_range = 0..LONG_LIVED;
    let mut next_new = LONG_LIVED;
    let mut next_long = 0u32;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut started: Option<Instant> = None;
    let send = |pending: &mut HashMap<_, _>, i: u32, long: bool, ph: u8| {
        let r = flow(i);
        let key = r.key;
        requests.send(r).unwrap();
        pending.insert(key, (i, Instant::now(), ph, long));
    };
    // Establish the long-lived flows.
    for i in long_range.clone() {
        send(&mut pending, i, true, SETUP);
    }
    loop {
        assert!(Instant::now() < deadline, "load ran past its bound");
        let established = load.long.len() as u32 == LONG_LIVED;
        if established && !ready.load(Ordering::Relaxed) {
            ready.store(true, Ordering::Relaxed);
        }
        let stopping = stop.load(Ordering::Relaxed);
        if stopping && pending.is_empty() {
            break;
        }
        if established && !stopping {
            let ph = phase.load(Ordering::Relaxed);
            let t = *started.get_or_insert_with(Instant::now);
            let allowed = (t.elapsed().as_secs_f64() * NEW_PER_S) as u32 + LONG_LIVED;
            let outstanding_new = pending.values().filter(|p| !p.3).count();
            for _ in outstanding_new..window {
                if next_new >= allowed {
                    break;
                }
                send(&mut pending, next_new, false, ph);
                next_new += 1;
            }
            // Long-lived flows come back (a PP node re-learning them), 32 at a time.
            let outstanding_long = pending.values().filter(|p| p.3).count();
            for _ in outstanding_long..32 {
                let i = next_long % LONG_LIVED;
                next_long += 1;
                if !pending.contains_key(&key_of(i)) {
                    send(&mut pending, i, true, ph);
                }
            }
        }
        let Ok(reply) = replies.recv_timeout(Duration::from_millis(100)) else {
            continue;
        };
        let Some(&(i, sent, ph, long)) = pending.get(&reply.key) else {
            continue;
        };
        match mapping(&reply) {
            Some(m) => {
                pending.remove(&reply.key);
                let us = sent.elapsed().as_micros() as u64;
                if ph != SETUP {
                    load.latency[ph as usize].push(us);
                    if !long {
                        load.latency_new[ph as usize].push(us);
                    }
                }
                let rule = format!("{:?}", reply.result);
                if long {
                    load.long_answers += 1;
                    match load.long.get(&reply.key) {
                        None => {
                            load.long.insert(reply.key, rule);
                        }
                        Some(r) if *r != rule => load.changed += 1,
                        Some(_) => {}
                    }
                } else {
                    load.new.insert(reply.key, m);
                    if ph == DURING_OUT || ph == DURING_IN {
                        load.new_during.push((i, ph));
                    }
                }
            }
            None => {
                eprintln!("error reply for flow {i}: {:?}", reply.result);
                load.errors += 1;
                pending.remove(&reply.key);
                send(&mut pending, i, long, ph);
            }
        }
    }
    load
}

/// A PP session to `cluster`'s FM with [`drive`] running over it on a thread (`window`
/// new flows outstanding), once its long-lived flows are set up and `settle` has passed:
/// the session, the load's phase and stop flags, and the thread.
fn start_load(
    cluster: &Cluster,
    window: usize,
    settle: Duration,
) -> (
    FmClient,
    Arc<AtomicU8>,
    Arc<AtomicBool>,
    std::thread::JoinHandle<Load>,
) {
    let mut pp_cfg = cluster.pp_config("pp-load");
    pp_cfg.forget_after = Duration::from_secs(30);
    let (client, mut links) = FmClient::start(pp_cfg).unwrap();
    let link = links.remove(0);
    wait(Duration::from_secs(5), "PP session", || {
        client.connected().then_some(())
    });
    let phase = Arc::new(AtomicU8::new(BEFORE));
    let ready = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let driver = {
        let (phase, ready, stop) = (phase.clone(), ready.clone(), stop.clone());
        let source = link.source;
        std::thread::spawn(move || drive(source, window, phase, ready, stop))
    };
    wait(Duration::from_secs(30), "long-lived flows", || {
        ready.load(Ordering::Relaxed).then_some(())
    });
    std::thread::sleep(settle);
    (client, phase, stop, driver)
}

fn p99(v: &[u64]) -> (usize, u64) {
    let mut v = v.to_vec();
    v.sort_unstable();
    let i = (v.len() * 99 / 100).min(v.len().saturating_sub(1));
    (v.len(), v.get(i).copied().unwrap_or(0))
}

/// The SNAT state of every group (read from one replica each): group → (range,
/// mappings, free ports per pool address).
struct GroupNat {
    range: (u64, u64),
    mappings: Vec<nfs::snat::MappingInfo>,
    free: Vec<(IpAddr, u16)>,
}

fn nat_states(
    cluster: &Cluster,
    scs: &[sc::ScProcess],
    snat_index: usize,
) -> HashMap<u64, GroupNat> {
    let map = cluster.map();
    let cfg: nfs::NfConfig = serde_json::from_value(snat_json()).unwrap();
    let nfs::NfConfig::Snat(snat_cfg) = cfg else {
        unreachable!()
    };
    let mut out = HashMap::new();
    for p in &map.partitions {
        let g = map.groups.iter().find(|g| g.id == p.group).unwrap();
        // The replica that applied the most (all agree once in step).
        let state = wait(Duration::from_secs(20), "group state", || {
            let mut best: Option<v1::GroupState> = None;
            for r in &g.replicas {
                let sc = scs.iter().find(|s| s.node_id() == r.node_id)?;
                let st = cluster
                    .group_status(sc.addr(), true)
                    .into_iter()
                    .find(|s| s.group == g.id)?;
                if best.as_ref().is_none_or(|b| st.applied > b.applied) {
                    best = Some(st);
                }
            }
            best.filter(|b| b.initialized)
        });
        let mut nat = nfs::snat::Snat::new(snat_cfg.clone()).unwrap();
        nat.restore(&nf_part(&state.snapshot, snat_index)).unwrap();
        let mut free = Vec::new();
        for a in ADDRS {
            let a: IpAddr = a.parse().unwrap();
            free.extend(
                nat.free_ports(a, packet::proto::UDP)
                    .into_iter()
                    .map(|p| (a, p)),
            );
        }
        out.insert(
            p.group,
            GroupNat {
                range: (p.hash_lo, p.hash_hi),
                mappings: nat.mappings(),
                free,
            },
        );
    }
    out
}

/// Across every group: no external endpoint mapped for two internal endpoints, no port
/// free in one group and used or free in another, and each mapping's flow in the range
/// of the group holding it. Returns the number of mappings.
fn check_nat(states: &HashMap<u64, GroupNat>) -> usize {
    let mut owner: HashMap<(IpAddr, u16), nfs::snat::MappingKey> = HashMap::new();
    let mut total = 0;
    for (gid, g) in states {
        for m in &g.mappings {
            total += 1;
            let ext = (m.external.addr, m.external.port);
            if let Some(k) = owner.insert(ext, m.key) {
                assert_eq!(k, m.key, "{ext:?} mapped for two internal endpoints");
            }
            let IpAddr::V4(client) = m.key.addr else {
                unreachable!()
            };
            let h = key_from(client, m.key.port).hash();
            assert!(
                g.range.0 <= h && h <= g.range.1,
                "group {gid} holds a flow of hash {h} outside its range {:?}",
                g.range
            );
        }
    }
    let mut free_seen: HashSet<(IpAddr, u16)> = HashSet::new();
    for g in states.values() {
        for f in &g.free {
            assert!(free_seen.insert(*f), "port {f:?} is free in two groups");
            assert!(!owner.contains_key(f), "port {f:?} is free and mapped");
        }
    }
    total
}

fn run(with_fw: bool, migration: Option<fm::Migration>) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let t0 = Instant::now();
    let cfg = fm::FmConfig {
        chains: vec![chain(with_fw)],
        ..fm::FmConfig::default()
    };
    let cluster = Cluster::start_with(cfg, 6, Arc::new(sc::testing::TestNfs));
    let map0 = cluster.wait_groups(1, 3);
    let g1 = map0.groups[0].id;
    let (client, phase, stop, driver) = start_load(&cluster, 256, Duration::from_millis(1500));

    let scale = |req| -> ScaleOutcome { cluster.rt.block_on(cluster.fm.scale(req)).unwrap() };
    // A scale-out needs three SC nodes outside the chain's groups: asking with none
    // free is refused clearly (here: an unknown chain is, too).
    let bad = cluster.rt.block_on(cluster.fm.scale(ScaleRequest::Out {
        tenant: 9,
        chain: 9,
        group: None,
        migration: None,
    }));
    assert!(matches!(bad, Err(fm::FmError::Scale(_))), "{bad:?}");

    phase.store(DURING_OUT, Ordering::Relaxed);
    let out = scale(ScaleRequest::Out {
        tenant: 1,
        chain: 1,
        group: None,
        migration,
    });
    phase.store(BETWEEN, Ordering::Relaxed);
    assert_eq!(out.aborted, None, "scale-out aborted");
    assert_eq!(out.from_group, g1);
    let map1 = cluster.map();
    assert_eq!(map1.partitions.len(), 2, "the map reflects the split");
    let g2 = out.to_group;
    assert!(map1
        .partitions
        .iter()
        .any(|p| p.group == g2 && (p.hash_lo, p.hash_hi) == (out.moved_lo, out.moved_hi)));
    // The new group's replicas are none of the old group's.
    let members = |m: &v1::PartitionMap, g: u64| -> HashSet<String> {
        m.groups
            .iter()
            .find(|x| x.id == g)
            .map(|x| x.replicas.iter().map(|r| r.node_id.clone()).collect())
            .unwrap_or_default()
    };
    assert!(members(&map1, g1).is_disjoint(&members(&map1, g2)));
    // A second scale-out has no spare nodes left.
    let none = cluster.rt.block_on(cluster.fm.scale(ScaleRequest::Out {
        tenant: 1,
        chain: 1,
        group: None,
        migration: None,
    }));
    match none {
        Err(fm::FmError::Scale(e)) => assert!(e.contains("needs 3 live SC nodes"), "{e}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    std::thread::sleep(Duration::from_millis(1500));
    // Both halves hold their own part: nothing shared wrongly, nothing out of range.
    let snat_index = usize::from(with_fw);
    let split_states = nat_states(&cluster, &cluster.scs, snat_index);
    assert_eq!(split_states.len(), 2);
    let moved_flows = split_states[&g2].mappings.len();
    check_nat(&split_states);
    assert!(moved_flows > 0, "the new group got part of the state");

    phase.store(DURING_IN, Ordering::Relaxed);
    let inn = scale(ScaleRequest::In {
        tenant: 1,
        chain: 1,
        group: Some(g2),
    });
    phase.store(AFTER, Ordering::Relaxed);
    assert_eq!(inn.aborted, None, "scale-in aborted");
    assert_eq!((inn.from_group, inn.to_group), (g2, g1));
    let map2 = cluster.map();
    assert_eq!(map2.partitions.len(), 1);
    assert_eq!(
        (map2.partitions[0].hash_lo, map2.partitions[0].hash_hi),
        (0, u64::MAX)
    );
    assert!(
        map2.groups.iter().all(|g| g.id != g2),
        "the retired group is gone"
    );
    std::thread::sleep(Duration::from_millis(1000));
    stop.store(true, Ordering::Relaxed);
    let load = driver.join().unwrap();

    // Zero failed requests; every new flow has its own external port.
    assert_eq!(load.errors, 0, "requests failed");
    assert_eq!(load.changed, 0, "a long-lived flow's rule changed");
    assert!(load.long_answers > u64::from(LONG_LIVED));
    let mut ext: HashSet<(IpAddr, u16)> = HashSet::new();
    for m in load.new.values() {
        assert!(ext.insert(*m), "external {m:?} handed out twice");
    }
    // And the merged state holds every flow once, in the one group left.
    let merged = nat_states(&cluster, &cluster.scs, snat_index);
    let total = check_nat(&merged);
    assert_eq!(
        total,
        load.new.len() + LONG_LIVED as usize,
        "flows lost or extra"
    );

    // Flows decided during a move keep their rule when asked again after it, with FM's
    // cache emptied so SC answers: those the old owner decided after st reached the
    // new owner in the delta (and, after scale-in, back in the merged group).
    let dropped = cluster.rt.block_on(cluster.fm.clear_cache()).unwrap();
    assert!(dropped > 0);
    let during_out_moved = load
        .new_during
        .iter()
        .filter(|(i, ph)| {
            let h = key_of(*i).hash();
            *ph == DURING_OUT && out.moved_lo <= h && h <= out.moved_hi
        })
        .count();
    let during_in = load
        .new_during
        .iter()
        .filter(|(_, ph)| *ph == DURING_IN)
        .count();
    assert!(
        during_out_moved > 20 && during_in > 20,
        "too few flows decided during the moves to check ({during_out_moved}, {during_in})"
    );
    let again = reask(
        &cluster,
        &load.new_during.iter().map(|p| p.0).collect::<Vec<_>>(),
    );
    for (i, _) in &load.new_during {
        let k = key_of(*i);
        assert_eq!(
            again.get(&k),
            load.new.get(&k),
            "flow {i} decided during a move got another rule afterwards"
        );
    }

    let stats = cluster.stats();
    assert_eq!(
        (stats.scale_outs, stats.scale_ins, stats.scale_aborts),
        (1, 1, 0)
    );
    // Gradual: the flows moved by pulls (the sweep's at least), none in bulk.
    assert_eq!(
        stats.scale_pulls > 0,
        migration == Some(fm::Migration::Gradual),
        "pulls {}",
        stats.scale_pulls
    );
    let line = |v: &[Vec<u64>; 5]| {
        format!(
            "before {:?}, during scale-out {:?}, between {:?}, during scale-in {:?}, after {:?}",
            p99(&v[0]),
            p99(&v[1]),
            p99(&v[2]),
            p99(&v[3]),
            p99(&v[4])
        )
    };
    eprintln!(
        "scaling ({}, {migration:?}): p99 request latency (requests, µs): all: {}; new flows only: {}; \
         scale-out st→fin {:.1} ms ({moved_flows} of {} flows moved), \
         scale-in st→fin {:.1} ms; {} new flows, {} long-lived answers; redirects {}; \
         pulls {}, refused as migrating {}; {:.1}s",
        if with_fw { "FW→SNAT" } else { "SNAT" },
        line(&load.latency),
        line(&load.latency_new),
        out.st_to_fin.as_secs_f64() * 1e3,
        split_states
            .values()
            .map(|g| g.mappings.len())
            .sum::<usize>(),
        inn.st_to_fin.as_secs_f64() * 1e3,
        load.new.len(),
        load.long_answers,
        stats.scale_redirects,
        stats.scale_pulls,
        stats.scale_migrating,
        t0.elapsed().as_secs_f64()
    );
    // The goal: new-flow setup during each move within a small factor of before (it was
    // 100-240 ms when new flows of the moved range queued behind the install). Not met
    // robustly yet: the split op at the old owner (scale-out, 13-36 ms) and above all
    // the merge op at the neighbour (scale-in, 40-60 ms) still block their group's
    // stream for one apply (see docs/scaling.md), so this is checked only with
    // SF_SCALING_P99=1.
    let (_, before) = p99(&load.latency_new[BEFORE as usize]);
    let bound = (5 * before).max(20_000);
    let phases: &[u8] = if std::env::var_os("SF_SCALING_P99").is_some() {
        &[DURING_OUT, DURING_IN]
    } else {
        &[]
    };
    for &ph in phases {
        let (n, during) = p99(&load.latency_new[ph as usize]);
        assert!(n > 0, "no new flow was sent during phase {ph}");
        assert!(
            during <= bound,
            "p99 new-flow setup during phase {ph} is {during} µs; before {before} µs"
        );
    }
    drop(client);
}

/// Ask FM for flows `flows` through a PP session of its own, one at a time in a batch;
/// returns each flow's mapping (errors are missing).
fn reask(cluster: &Cluster, flows: &[u32]) -> HashMap<FlowKey, (IpAddr, u16)> {
    let (client, mut links) = FmClient::start(cluster.pp_config("pp-check")).unwrap();
    let link = links.remove(0);
    wait(Duration::from_secs(5), "PP check session", || {
        client.connected().then_some(())
    });
    let RuleSource::Channel { requests, replies } = link.source else {
        unreachable!()
    };
    for &i in flows {
        requests.send(flow(i)).unwrap();
    }
    let mut out = HashMap::new();
    let mut answered = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while answered < flows.len() && Instant::now() < deadline {
        if let Ok(r) = replies.recv_timeout(Duration::from_millis(100)) {
            answered += 1;
            if let Some(m) = mapping(&r) {
                out.insert(r.key, m);
            }
        }
    }
    assert_eq!(answered, flows.len(), "re-asked flows left unanswered");
    drop(client);
    out
}

#[test]
fn snat_scale_out_then_in_under_load() {
    run(false, Some(fm::Migration::Bulk));
}

#[test]
fn fw_snat_scale_out_then_in_under_load() {
    run(true, Some(fm::Migration::Bulk));
}

/// The same with S6's gradual migration: flows move on first access (the load re-asks
/// long-lived flows) and by the sweep; the checks on both halves' state and on every
/// flow's rule after the moves are the same.
#[test]
fn fw_snat_gradual_scale_out_then_in_under_load() {
    run(true, Some(fm::Migration::Gradual));
}

/// The new group dies during a scale-out: the scale either finishes first (then the
/// group stalls like any group that lost every replica, the existing behaviour) or is
/// aborted and the old group takes its part back. Which one depends on timing; either
/// way no port is handed out twice, long-lived flows keep their rules, and the state is
/// where the map says.
#[test]
fn new_group_dies_during_scale_out() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let cfg = fm::FmConfig {
        chains: vec![chain(false)],
        ..fm::FmConfig::default()
    };
    let mut cluster = Cluster::start_with(cfg, 6, Arc::new(sc::testing::TestNfs));
    let map0 = cluster.wait_groups(1, 3);
    let old: HashSet<String> = map0.groups[0]
        .replicas
        .iter()
        .map(|r| r.node_id.clone())
        .collect();
    let (client, _phase, stop, driver) = start_load(&cluster, 64, Duration::from_millis(500));
    // The scale-out goes through FM's gRPC API, on a thread of its own, so this thread
    // can kill the new group's nodes while it is under way.
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let h = cluster.rt.handle().clone();
        let addr = cluster.fm_addr();
        let operator = cluster.operator_tls();
        std::thread::spawn(move || {
            let r = h.block_on(async move {
                let mut c = common::fm_operator(operator.as_ref(), &addr).await;
                c.scale_out(v1::ScaleOutRequest {
                    tenant: 1,
                    chain: 1,
                    group: None,
                    ..Default::default()
                })
                .await
            });
            let _ = tx.send(r);
        });
    }
    // Kill the three spare nodes once FM has made them the new group (the map then has a
    // second group): killed earlier, on a slow machine before the RPC even reached FM,
    // they would only make FM refuse the scale for want of spares.
    let t0 = Instant::now();
    while cluster.map().groups.len() < 2 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut killed = 0;
    for p in cluster.scs.iter_mut() {
        if !old.contains(p.node_id()) {
            p.kill();
            killed += 1;
        }
    }
    assert_eq!(killed, 3);
    let reply = rx
        .recv_timeout(Duration::from_secs(40))
        .expect("scale answered")
        .expect("the scale-out RPC")
        .into_inner();
    let stats = cluster.stats();
    eprintln!(
        "new group killed during scale-out: aborted={:?}, aborts {}, outs {}",
        reply.aborted, stats.scale_aborts, stats.scale_outs
    );
    if reply.aborted.is_empty() {
        // Finished before the kill: nothing more this test can check about aborts.
        stop.store(true, Ordering::Relaxed);
        let _ = driver.join();
        return;
    }
    assert_eq!(stats.scale_aborts, 1);
    // The old group serves everything again.
    let map = wait(Duration::from_secs(10), "abort complete", || {
        let m = cluster.map();
        (m.groups.len() == 1 && m.partitions.len() == 1).then_some(m)
    });
    assert_eq!(
        (map.partitions[0].hash_lo, map.partitions[0].hash_hi),
        (0, u64::MAX)
    );
    std::thread::sleep(Duration::from_millis(1000));
    stop.store(true, Ordering::Relaxed);
    let load = driver.join().unwrap();
    assert_eq!(load.errors, 0, "requests failed");
    assert_eq!(load.changed, 0, "a long-lived flow's rule changed");
    let mut ext: HashSet<(IpAddr, u16)> = HashSet::new();
    for m in load.new.values() {
        assert!(ext.insert(*m), "external {m:?} handed out twice");
    }
    let live: Vec<sc::ScProcess> = std::mem::take(&mut cluster.scs)
        .into_iter()
        .filter(|p| old.contains(p.node_id()))
        .collect();
    let states = nat_states(&cluster, &live, 0);
    assert_eq!(check_nat(&states), load.new.len() + LONG_LIVED as usize);
    drop(client);
}
