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
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use pipeline::{RuleReply, RuleSource};
use pp::{FmClient, FmClientConfig};
use serde::Serialize;
// The plane tests' flows (tenant 1's chain 1 on VNI 100): the bench asks for the same.
use testkit::flows::{flow, CHAIN, TENANT, VNI};

#[derive(Args, Clone, Debug)]
pub struct WorkersBenchArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Worker threads per SC node.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub workers: u64,
    /// The scheduler slice each worker thread asks for, in µs (`starfabric sc
    /// --worker-slice-us`; docs/workers.md). 0: the kernel's default, the baseline.
    #[arg(long, default_value_t = sc::workers::DEFAULT_WORKER_SLICE.as_micros() as u64)]
    pub worker_slice_us: u64,
    /// SC groups (each three replicas, one per node) started at once.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub groups: u32,
    /// Park-and-wake rounds.
    #[arg(long, default_value_t = 200)]
    pub rounds: u32,
    /// NFs: `test` (the SC crate's FW → SNAT → LB) or `builtin` (nfs' FW → SNAT).
    #[arg(long, default_value = "test")]
    pub nfs: String,
    /// Starts one at a time on each node, with nothing else queued (0: skip).
    #[arg(long, default_value_t = 64)]
    pub single_starts: usize,
    /// Run every plane link in plaintext (lab use; docs/security.md). Default: mTLS, as
    /// production runs (a CA made in-process, a certificate per node).
    #[arg(long)]
    pub insecure: bool,
    /// FM's runtime threads. Two, as `starfabric fm` runs: the start and wake figures
    /// of earlier runs were taken so, and one moved none of them beyond their spread
    /// (docs/setup-path.md, "FM on one runtime thread").
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub fm_threads: u64,
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
    pub workers_per_node: u64,
    /// The slice the workers asked for (0: the kernel's default).
    pub worker_slice_us: u64,
    pub groups: u32,
    pub chain: String,
    /// FM's runtime threads in this run (`--fm-threads`).
    pub fm_threads: u64,
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

fn mapping(r: &RuleReply) -> Option<(IpAddr, u16)> {
    r.mapped_source()
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
    let chain = chain(&a.nfs)?;
    let proto_chain = chain.to_proto()?;
    let factory = crate::bench_setup::chain_factory(&a.nfs);
    let rt = crate::bench_setup::fm_runtime(a.fm_threads)?;
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
    let cpus = sc::workers::allowed_cpus();
    let scs = (0..3)
        .map(|i| {
            let id = format!("sc-{i}");
            let mut c = sc::ScConfig::new(&id, local, &fm_addr);
            c.workers = a.workers as usize;
            c.worker_slice =
                (a.worker_slice_us > 0).then(|| Duration::from_micros(a.worker_slice_us));
            c.worker_cpus = Some(sc::workers::rotated(&cpus, i));
            // Parking is on demand here (`park`), so every round parks at a known time.
            c.idle = None;
            c.tls = pki.node(proto::tls::Role::Sc, &id)?;
            Ok(sc::ScProcess::spawn(c, factory.clone())?)
        })
        .collect::<Result<Vec<_>>>()?;
    // N equal key-hash ranges, configured at once once the nodes are there.
    wait_for(Duration::from_secs(10), "SC nodes registered", || {
        let m = rt.block_on(fm.partition_map())?;
        (m.groups.len() == 1 && m.groups.iter().all(|g| g.replicas.len() == 3)).then_some(())
    })?;
    let groups = a.groups.max(1);
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
    let ask = |i: u32| -> Result<(RuleReply, Duration)> {
        let t = Instant::now();
        requests.send(flow(i)).context("PP request channel")?;
        let r = replies
            .recv_timeout(Duration::from_secs(10))
            .context("no answer within 10 s")?;
        Ok((r, t.elapsed()))
    };
    // One flow per round, spread over the groups; their first mappings.
    let flows: Vec<u32> = (0..a.rounds.max(1)).map(|r| r % 64).collect();
    let mut first = std::collections::HashMap::new();
    for &f in &flows {
        if let std::collections::hash_map::Entry::Vacant(e) = first.entry(f) {
            let (r, _) = ask(f)?;
            e.insert(mapping(&r).context("no SNAT mapping in the first answer")?);
        }
    }

    let mut request_ms = Vec::new();
    let mut intact = 0;
    for &f in &flows {
        // Park every replica, and wait until no worker on any node is busy.
        for s in &scs {
            let o = s.observer();
            for g in rt.block_on(o.group_metrics()) {
                o.park(g.state.group);
            }
        }
        wait_for(Duration::from_secs(5), "every replica parked", || {
            scs.iter()
                .all(|s| s.observer().worker_stats().busy == 0)
                .then_some(())
        })?;
        let (r, d) = ask(f)?;
        request_ms.push(d.as_secs_f64() * 1e3);
        if mapping(&r) == first.get(&f).copied() {
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
                a.single_starts,
                Duration::from_secs(5),
            )
            .with_context(|| format!("single starts on {}", s.node_id()))?;
        single.extend(d.iter().map(|d| d.as_secs_f64() * 1e6));
    }
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
        workers_per_node: a.workers,
        worker_slice_us: a.worker_slice_us,
        groups,
        chain: match a.nfs.as_str() {
            "test" => "test-fw → test-snat → test-lb".into(),
            _ => "fw → snat".into(),
        },
        fm_threads: a.fm_threads,
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
        "  wake (input → first decision of a parked replica): p50 {:.1} µs, p99 {:.3} ms ({} wakes)",
        r.wake_us_p50, r.wake_ms_p99, r.wakes
    );
    println!(
        "  request that woke the chain, PP → FM → SC ×3 → FM → PP: p50 {:.3} ms, p99 {:.3} ms",
        r.wake_request_ms_p50, r.wake_request_ms_p99
    );
    println!(
        "  state intact after wake: {}/{} rounds",
        r.state_intact, r.rounds
    );
}
