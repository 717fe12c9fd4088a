//! `starfabric bench workers`: the SC node's worker pool and scale to zero
//! (docs/workers.md), measured inside the nodes.
//!
//! In this process, over real gRPC on 127.0.0.1: an FM, three SC nodes (each on its own
//! runtime thread, with `--workers` pre-started workers) and a PP session's FM client.
//! - *start*: FM configures `--groups` SC groups of three replicas at once; every
//!   replica's time from its configure arriving to its first decision on a worker is the
//!   nodes' start histogram (`start_us_p50`, `start_us_p99`).
//! - *wake*: `--rounds` times, every replica is parked (the chain at zero: no busy
//!   worker on any node), then one flow's first packet is asked again. Each replica it
//!   wakes records the time from the input that woke it to its first decision on a worker
//!   (`wake_ms_p99`); the client also times the whole request (`wake_request_ms_p99`).
//!   The answer must carry the SNAT mapping the flow got before the first park:
//!   `state_intact` counts the rounds where it did.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use pipeline::{RuleReply, RuleSource};
use pp::{FmClient, FmClientConfig};
use serde::Serialize;
// The plane tests' flows (tenant 1's chain 1 on VNI 100): the bench asks for the same.
use testkit::flows::{flow, CHAIN, TENANT, VNI};

use crate::setup_workload::TraceFlow;
use crate::workers_workload::{CountsSet, WorkersWorkload};

#[derive(Args, Clone, Debug)]
pub struct WorkersBenchArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// The chain, the wake flows and the counts as JSON (docs/benchmarks.md, "Workers
    /// workload"); the flags below override the file's counts.
    #[arg(long)]
    pub workload: Option<PathBuf>,
    /// Worker threads per SC node [default: 6].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub workers: Option<u64>,
    /// The scheduler slice each worker thread asks for, in µs (`starfabric sc
    /// --worker-slice-us`; docs/workers.md). 0: the kernel's default, the baseline
    /// [default: 200].
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=100_000))]
    pub worker_slice_us: Option<u64>,
    /// SC groups (each three replicas, one per node) started at once [default: 16].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub groups: Option<u32>,
    /// Park-and-wake rounds [default: 200].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub rounds: Option<u32>,
    /// NFs: `test` (the SC crate's FW → SNAT → LB) or `builtin` (nfs' FW → SNAT). A
    /// workload's `nfs` replaces it.
    #[arg(long, default_value = "test")]
    pub nfs: String,
    /// Starts one at a time on each node, with nothing else queued (0: skip)
    /// [default: 64].
    #[arg(long)]
    pub single_starts: Option<usize>,
    /// Run every plane link in plaintext (lab use; docs/security.md). Default: mTLS, as
    /// production runs (a CA made in-process, a certificate per node).
    #[arg(long)]
    pub insecure: bool,
    /// FM's runtime threads. Two, as `starfabric fm` runs: the start and wake figures
    /// of earlier runs were taken so, and one moved none of them beyond their spread
    /// (docs/setup-path.md, "FM on one runtime thread") [default: 2].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub fm_threads: Option<u64>,
    /// Spare NF chains each SC node keeps built per hosted chain (`starfabric sc
    /// --spare-chains`; docs/workers.md, "Spare chains"). 0: every start builds its
    /// chain, as before they existed.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(0..=64))]
    pub spare_chains: u64,
    /// Pack the planes' control threads, SC's NF workers with them, onto the fewest CPUs
    /// that keep up (`starfabric sc --pack-cpus`; `off`, `auto` or a CPU list;
    /// docs/corepack.md). `auto` starts spread and packs after a second with room, so
    /// the concurrent starts at the run's start are taken spread; a list applies from
    /// the first pass, before any start.
    #[arg(long, env = "STARFABRIC_PACK_CPUS", default_value = "off", value_parser = parse_pack)]
    pub pack_cpus: corepack::PackSpec,
}

fn parse_pack(s: &str) -> Result<corepack::PackSpec, String> {
    s.parse()
}

/// What the control-thread packer did during the run (`--pack-cpus`).
#[derive(Serialize, Debug, Default)]
pub struct WorkersPack {
    /// `off`, `auto` or the CPU list.
    pub spec: String,
    /// CPUs the control threads could use when the concurrent starts were asked for, and
    /// at the end of the run.
    pub active_at_starts: usize,
    pub active_at_end: usize,
    pub cpus: usize,
    pub grows: u64,
    pub shrinks: u64,
}

impl WorkersBenchArgs {
    /// The counts the flags set.
    fn counts(&self) -> CountsSet {
        CountsSet {
            groups: self.groups,
            rounds: self.rounds,
            workers: self.workers,
            single_starts: self.single_starts,
            worker_slice_us: self.worker_slice_us,
            fm_threads: self.fm_threads,
        }
    }
}

/// Results; field names are the documented JSON interface.
#[derive(Serialize, Debug)]
pub struct WorkersBench {
    /// Configure arriving → the new replica's first decision on a worker.
    pub start_us_p50: f64,
    pub start_us_p99: f64,
    pub starts: u64,
    /// Its parts: building the replica's NF chain, and placing it on a worker → first
    /// decision (the pool's own start cost; Serpens pre-loads NFs, so its 34 µs is this).
    pub build_us_p50: f64,
    pub start_worker_us_p50: f64,
    pub start_worker_us_p99: f64,
    /// Configure → first decision for starts made one at a time (`--single-starts` per
    /// node, each after the one before it left): a start with no other start queued on
    /// the cores, which is what Serpens Table IV's 34 µs is. The `start_us_*` fields
    /// above, measured while FM configures every group at once, stay as they were.
    pub single_start_us_p50: f64,
    pub single_start_us_p99: f64,
    pub single_starts: u64,
    /// Parked replica → first decision on a worker, inside the node.
    pub wake_ms_p99: f64,
    pub wake_us_p50: f64,
    pub wakes: u64,
    /// The whole request that woke the chain: PP → FM → head → middle → tail → FM → PP.
    pub wake_request_ms_p50: f64,
    pub wake_request_ms_p99: f64,
    /// Rounds whose answer had the flow's mapping from before the first park.
    pub state_intact: u32,
    pub rounds: u32,
    /// What `state_intact` compares with the flow's first answer: `snat-mapping` (its
    /// external address and port) when the first answer mapped the source, else
    /// `actions` (the whole forward rule's action list); `snat-mapping+actions` when the
    /// flows differ.
    pub state_check: &'static str,
    /// Distinct flows the rounds cycled through.
    pub wake_flows: u64,
    /// Times the parks were asked again because a worker was still busy 10 ms after
    /// them (a replica woken by a late input), over all rounds.
    pub reparks: u64,
    pub workers_per_node: u64,
    /// The slice the workers asked for (0: the kernel's default).
    pub worker_slice_us: u64,
    pub groups: u32,
    pub chain: String,
    /// FM's runtime threads in this run (`--fm-threads`).
    pub fm_threads: u64,
    /// The workload's name (`--workload`), or null without one.
    pub workload: Option<String>,
    /// `--spare-chains`, and how many starts took a spare chain instead of building
    /// one: of the concurrent starts and of the single starts.
    pub spare_chains: u64,
    pub starts_from_spare: u64,
    pub single_starts_from_spare: u64,
    /// Every start over the run that built its chain because its spare was still being
    /// built, or because the builder had the spares' lock at that instant.
    pub spare_misses_building: u64,
    pub spare_misses_contended: u64,
    /// The control-thread packer (`--pack-cpus`).
    pub pack: WorkersPack,
}

fn chain(nfs: &str) -> Result<proto::ChainDef> {
    let nfs = match nfs {
        "test" => serde_json::json!([
            {"kind": "test-fw", "deny_dports": [23]},
            {"kind": "test-snat", "addrs": ["198.19.255.1"], "ports": [1024, 65535]},
            {"kind": "test-lb", "vip": "198.19.0.100", "port": 80,
             "backend": "198.19.1.7", "backend_port": 8080}
        ]),
        "builtin" => serde_json::json!([
            {"kind": "fw", "default_action": "allow"},
            {"kind": "snat", "pools": [{"addresses": ["198.19.255.1"],
                                        "ports": {"lo": 1024, "hi": 65535}}]}
        ]),
        other => bail!("unknown --nfs {other:?} (test or builtin)"),
    };
    Ok(serde_json::from_value(serde_json::json!({
        "tenant": TENANT, "chain": CHAIN, "nfs": nfs,
        "forward": {"decap": true, "encap": {"dst": "198.18.0.9", "vni": 200}, "output": 1},
        "reverse": {"decap": true, "encap": {"dst": "198.18.0.50", "vni": VNI}, "output": 1}
    }))?)
}

/// What a wake round's answer must keep from the flow's first answer.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kept {
    /// The SNAT mapping: external address and port.
    Mapping(IpAddr, u16),
    /// The forward rule's actions, for a chain that maps no source.
    Actions(pipeline::Actions),
}

impl Kept {
    fn of(r: &RuleReply) -> Result<Kept> {
        if let Some((a, p)) = r.mapped_source() {
            return Ok(Kept::Mapping(a, p));
        }
        match &r.result {
            Ok(rule) => Ok(Kept::Actions(rule.actions.clone())),
            Err(e) => bail!(
                "the chain refused flow {} ({e}): a wake round needs a flow the chain admits",
                r.key
            ),
        }
    }

    fn label(&self) -> &'static str {
        match self {
            Kept::Mapping(..) => "snat-mapping",
            Kept::Actions(_) => "actions",
        }
    }
}

/// A wake flow's first packet as a PP worker asks for its rule (tenant 1's chain 1 on
/// VNI 100); a TCP flow's is a SYN.
fn request(f: &TraceFlow) -> pipeline::RuleRequest {
    let flags = if f.proto == packet::proto::TCP {
        packet::tcp_flags::SYN
    } else {
        0
    };
    let key = pipeline::FlowKey::new(
        VNI,
        f.proto,
        IpAddr::V4(f.src),
        f.sport,
        IpAddr::V4(f.dst),
        f.dport,
    );
    pipeline::RuleRequest::new(key, TENANT, CHAIN, pipeline::PacketMeta::new(60, flags))
}

fn wait_for<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> Result<T> {
    let t = Instant::now();
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if t.elapsed() > limit {
            bail!("{what}: not within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

pub fn run(a: WorkersBenchArgs) -> Result<WorkersBench> {
    let workload = a
        .workload
        .as_deref()
        .map(WorkersWorkload::load)
        .transpose()?;
    let counts = a
        .counts()
        .over(workload.as_ref().map(|w| w.counts).unwrap_or_default())
        .resolve()?;
    let (chain, factory, chain_label) =
        match workload.as_ref().and_then(|w| Some((w, w.nfs.as_ref()?))) {
            Some((w, nfs)) => (
                crate::bench_setup::chain_of(serde_json::Value::Array(nfs.clone()), w.partition)?,
                Arc::new(sc::BuiltinNfs) as Arc<dyn sc::ChainFactory>,
                w.chain_label().unwrap_or_default(),
            ),
            None => (
                chain(&a.nfs)?,
                crate::bench_setup::chain_factory(&a.nfs),
                match a.nfs.as_str() {
                    "test" => "test-fw → test-snat → test-lb".into(),
                    _ => "fw → snat".into(),
                },
            ),
        };
    let proto_chain = chain.to_proto()?;
    // The CPU list is read before the packer can narrow this thread's mask.
    let cpus = sc::workers::allowed_cpus();
    let packer = a.pack_cpus.start().context("--pack-cpus")?;
    let pack_stats = || packer.as_ref().map(|p| p.stats()).unwrap_or_default();
    let rt = crate::bench_setup::fm_runtime(counts.fm_threads)?;
    let pki = crate::bench_setup::BenchPki::new(a.insecure)?;
    let fm_cfg = fm::FmConfig {
        chains: vec![chain],
        // Every ask reaches SC: the answer shows SC's state, not FM's cache.
        cache_capacity: 1,
        tls: pki.node(proto::tls::Role::Fm, "fm-1")?,
        ..fm::FmConfig::default()
    };
    let local = "127.0.0.1:0".parse()?;
    let fm = rt.block_on(fm::start(fm_cfg, local))?;
    let fm_addr = fm.addr().to_string();
    let scs = (0..3)
        .map(|i| {
            let id = format!("sc-{i}");
            let mut c = sc::ScConfig::new(&id, local, &fm_addr);
            c.workers = counts.workers as usize;
            c.worker_slice =
                (counts.worker_slice_us > 0).then(|| Duration::from_micros(counts.worker_slice_us));
            c.worker_cpus = Some(sc::workers::rotated(&cpus, i));
            // Parking is on demand here (`park`), so every round parks at a known time.
            c.idle = None;
            c.spare_chains = a.spare_chains as usize;
            c.tls = pki.node(proto::tls::Role::Sc, &id)?;
            Ok(sc::ScProcess::spawn(c, factory.clone())?)
        })
        .collect::<Result<Vec<_>>>()?;
    // N equal key-hash ranges, configured at once once the nodes are there.
    wait_for(Duration::from_secs(10), "SC nodes registered", || {
        let m = rt.block_on(fm.partition_map())?;
        (m.groups.len() == 1 && m.groups.iter().all(|g| g.replicas.len() == 3)).then_some(())
    })?;
    let groups = counts.groups;
    let active_at_starts = pack_stats().active;
    if groups > 1 {
        let partitions = crate::bench_setup::equal_partitions(TENANT, CHAIN, groups);
        rt.block_on(fm.set_desired(vec![proto_chain.clone()], partitions, Vec::new()))
            .context("FM")?;
    }
    wait_for(Duration::from_secs(10), "SC groups formed", || {
        let m = rt.block_on(fm.partition_map())?;
        let hosted: usize = scs
            .iter()
            .map(|s| rt.block_on(s.observer().group_metrics()).len())
            .sum();
        (m.groups.len() == groups as usize
            && m.groups.iter().all(|g| g.replicas.len() == 3)
            && hosted >= 3 * groups as usize)
            .then_some(())
    })?;

    let mut ccfg = FmClientConfig::new(&fm_addr, "pp-bench");
    ccfg.tls = pki.node(proto::tls::Role::Pp, "pp-bench")?;
    let (client, mut links) = FmClient::start(ccfg)?;
    wait_for(Duration::from_secs(5), "PP session", || {
        client.connected().then_some(())
    })?;
    let RuleSource::Channel { requests, replies } = links.remove(0).source else {
        bail!("FM client gave no channel");
    };
    // The wake flows: the workload's, or the plane tests' first 64.
    let wake: Vec<pipeline::RuleRequest> = match workload.as_ref().and_then(|w| w.flows.as_ref()) {
        Some(flows) => flows.iter().map(request).collect(),
        None => (0..64).map(flow).collect(),
    };
    let ask = |i: usize| -> Result<(RuleReply, Duration)> {
        let t = Instant::now();
        requests
            .send(wake[i].clone())
            .context("PP request channel")?;
        let r = replies
            .recv_timeout(Duration::from_secs(10))
            .context("no answer within 10 s")?;
        Ok((r, t.elapsed()))
    };
    // One flow per round, spread over the groups; what their first answers carried.
    let flows: Vec<usize> = (0..counts.rounds as usize)
        .map(|r| r % wake.len())
        .collect();
    let mut first = std::collections::HashMap::new();
    for &f in &flows {
        if let std::collections::hash_map::Entry::Vacant(e) = first.entry(f) {
            let (r, _) = ask(f)?;
            e.insert(Kept::of(&r)?);
        }
    }
    // One label when every flow is compared the same way (a chain's SNAT may map only
    // some sources).
    let labels: std::collections::BTreeSet<&str> = first.values().map(Kept::label).collect();
    let state_check = match labels.len() {
        1 => labels.into_iter().next().unwrap_or_default(),
        _ => "snat-mapping+actions",
    };

    let mut request_ms = Vec::new();
    let mut intact = 0;
    let mut reparks = 0u64;
    for &f in &flows {
        // Park every replica, and wait until no worker on any node is busy. An input
        // that comes after a replica's park wakes it (a late ask or ack), and it then
        // stays on its worker: about one run in twenty with the built-in chain waited
        // out the whole limit so. Parks are asked again every 10 ms until no worker is
        // busy; a parked replica takes a park in place, so this wakes nothing.
        let park_all = || {
            for s in &scs {
                let o = s.observer();
                for g in rt.block_on(o.group_metrics()) {
                    o.park(g.state.group);
                }
            }
        };
        park_all();
        let mut checks = 0u32;
        wait_for(Duration::from_secs(5), "every replica parked", || {
            let idle = scs.iter().all(|s| s.observer().worker_stats().busy == 0);
            checks += 1;
            if !idle && checks % 10 == 0 {
                park_all();
                reparks += 1;
            }
            idle.then_some(())
        })?;
        let (r, d) = ask(f)?;
        request_ms.push(d.as_secs_f64() * 1e3);
        if Kept::of(&r).ok().as_ref() == first.get(&f) {
            intact += 1;
        }
    }
    let stats: Vec<sc::WorkerStats> = scs.iter().map(|s| s.observer().worker_stats()).collect();
    let probe_partition = proto::v1::Partition {
        tenant: TENANT,
        chain: CHAIN,
        hash_lo: 0,
        hash_hi: u64::MAX,
        group: 0,
    };
    let mut single = Vec::new();
    for s in &scs {
        let d = s
            .observer()
            .probe_starts(
                &proto_chain,
                probe_partition,
                counts.single_starts,
                Duration::from_secs(5),
            )
            .with_context(|| format!("single starts on {}", s.node_id()))?;
        single.extend(d.iter().map(|d| d.as_secs_f64() * 1e6));
    }
    let after: Vec<sc::WorkerStats> = scs.iter().map(|s| s.observer().worker_stats()).collect();
    let spare_hits: u64 = after.iter().map(|s| s.spare_hits).sum();
    let starts_from_spare: u64 = stats.iter().map(|s| s.spare_hits).sum();
    let spare_misses_building = after.iter().map(|s| s.spare_misses_building).sum();
    let spare_misses_contended = after.iter().map(|s| s.spare_misses_contended).sum();
    let samples = |f: fn(&sc::WorkerStats) -> &sc::workers::HistInner| -> Vec<f64> {
        stats
            .iter()
            .flat_map(|s| f(s).recent.iter().map(|&ns| ns as f64 / 1e3))
            .collect()
    };
    let mut starts = samples(|s| &s.start);
    let mut build = samples(|s| &s.build);
    let mut place = samples(|s| &s.place);
    let mut wakes = samples(|s| &s.wake);
    drop(client);
    fm.stop();
    drop(scs);
    let pack_end = pack_stats();
    Ok(WorkersBench {
        starts: starts.len() as u64,
        start_us_p50: pct(&mut starts, 0.50),
        start_us_p99: pct(&mut starts, 0.99),
        build_us_p50: pct(&mut build, 0.50),
        start_worker_us_p50: pct(&mut place, 0.50),
        start_worker_us_p99: pct(&mut place, 0.99),
        single_starts: single.len() as u64,
        single_start_us_p50: pct(&mut single, 0.50),
        single_start_us_p99: pct(&mut single, 0.99),
        wakes: wakes.len() as u64,
        wake_us_p50: pct(&mut wakes, 0.50),
        wake_ms_p99: pct(&mut wakes, 0.99) / 1e3,
        wake_request_ms_p50: pct(&mut request_ms, 0.50),
        wake_request_ms_p99: pct(&mut request_ms, 0.99),
        state_intact: intact,
        rounds: flows.len() as u32,
        state_check,
        wake_flows: first.len() as u64,
        reparks,
        workers_per_node: counts.workers,
        worker_slice_us: counts.worker_slice_us,
        groups,
        chain: chain_label,
        fm_threads: counts.fm_threads,
        workload: workload.map(|w| w.name),
        spare_chains: a.spare_chains,
        starts_from_spare,
        single_starts_from_spare: spare_hits - starts_from_spare,
        spare_misses_building,
        spare_misses_contended,
        pack: WorkersPack {
            spec: a.pack_cpus.to_string(),
            active_at_starts,
            active_at_end: pack_end.active,
            cpus: pack_end.cpus,
            grows: pack_end.grows,
            shrinks: pack_end.shrinks,
        },
    })
}

pub fn print(r: &WorkersBench) {
    println!(
        "starfabric bench workers: {} workers per SC node, {} group(s) of 3 replicas, chain {}",
        r.workers_per_node, r.groups, r.chain
    );
    println!(
        "  start (configure → first decision on a worker): p50 {:.1} µs, p99 {:.1} µs ({} starts)",
        r.start_us_p50, r.start_us_p99, r.starts
    );
    println!(
        "    of which: building the NF chain p50 {:.1} µs; placing on a worker → first decision p50 {:.1} µs, p99 {:.1} µs",
        r.build_us_p50, r.start_worker_us_p50, r.start_worker_us_p99
    );
    println!(
        "  single start (one at a time, nothing else queued): p50 {:.1} µs, p99 {:.1} µs ({} starts)",
        r.single_start_us_p50, r.single_start_us_p99, r.single_starts
    );
    println!(
        "  NF chain from a spare built ahead ({} per chain): {} of {} starts, {} of {} single starts",
        r.spare_chains, r.starts_from_spare, r.starts, r.single_starts_from_spare, r.single_starts
    );
    if r.pack.spec != "off" {
        println!(
            "  control threads packed ({}): on {} of {} CPUs at the concurrent starts, {} at the end ({} shrinks, {} grows)",
            r.pack.spec,
            r.pack.active_at_starts,
            r.pack.cpus,
            r.pack.active_at_end,
            r.pack.shrinks,
            r.pack.grows
        );
    }
    println!(
        "  wake (input → first decision of a parked replica): p50 {:.1} µs, p99 {:.3} ms ({} wakes)",
        r.wake_us_p50, r.wake_ms_p99, r.wakes
    );
    println!(
        "  request that woke the chain, PP → FM → SC ×3 → FM → PP: p50 {:.3} ms, p99 {:.3} ms",
        r.wake_request_ms_p50, r.wake_request_ms_p99
    );
    println!(
        "  state intact after wake: {}/{} rounds ({} flows; compared: {})",
        r.state_intact, r.rounds, r.wake_flows, r.state_check
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With the nodes' control threads and NF workers packed onto one CPU, a short run
    /// starts every replica, wakes every parked one with its state, and says where the
    /// packer had the threads.
    #[test]
    fn a_run_packed_onto_one_cpu_starts_and_wakes_with_the_state_intact() {
        let _one = crate::PACKER_TEST.lock().unwrap_or_else(|e| e.into_inner());
        let first = corepack::allowed_cpus()[0];
        let r = run(WorkersBenchArgs {
            json: true,
            workload: None,
            workers: Some(2),
            worker_slice_us: None,
            groups: Some(2),
            rounds: Some(10),
            nfs: "test".into(),
            single_starts: Some(4),
            insecure: true,
            fm_threads: Some(1),
            spare_chains: 1,
            pack_cpus: corepack::PackSpec::List(vec![first]),
        })
        .expect("bench workers");
        assert_eq!(r.pack.spec, first.to_string());
        assert_eq!((r.pack.cpus, r.pack.active_at_starts), (1, 1));
        // The first group's three as the nodes register, then the two groups' six.
        assert_eq!(r.starts, 9);
        assert_eq!(r.single_starts, 12, "four a node");
        assert_eq!(r.state_intact, r.rounds);
        assert!(r.start_us_p50 > 0.0 && r.wake_us_p50 > 0.0);
        assert!(
            corepack::process_stats().is_none(),
            "the packer stopped with the run"
        );
    }
}
