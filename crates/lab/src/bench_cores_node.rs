//! The node half of `starfabric bench cores` (issue 17; paper 002 §V on a real node):
//! generated sfc2cpu instances scaled to this machine run as µVNFs on the SC node's
//! worker pool, once per assigner, and what they deliver is measured.
//!
//! - Every µVNF is one pre-started worker of [`sc::workers::WorkerPool`] (its own OS
//!   thread and queue), pinned by `sched_setaffinity` to the core the assigner chose,
//!   with the node's NFVnice nice level from rate × cost (`apply_rate_cost_share`).
//! - A request costs a µVNF its `cost_cycles` ns of dummy loop, as the paper's µVNFs
//!   spin a configured number of loops: the loop count is calibrated once, so a
//!   preempted µVNF still owes its work (a wall-clock spin would not).
//! - The head of each SFC makes its own open-loop arrivals at the SFC's rate (no load
//!   generator thread to compete for the cores), each stamped with its due time; the
//!   tail counts deliveries and their latency from that time. Queues between µVNFs
//!   hold `queue` requests; with backpressure (NFVnice, the twin's default) a head
//!   drops a new arrival early while a queue downstream in its chain is over
//!   ¾ full; a full queue drops late (the work upstream is lost).
//! - Per instance: RR, LLF, FFD and the learned assigner (identical assignments, up to
//!   renaming the cores, run once). The twin predicts each; Spearman's ρ between the
//!   twin's and the measured throughput of RR, LLF and FFD validates the twin.
//! - §III-A's fallback on real numbers: the learned run is cut into samples and fed to
//!   [`cores::Watchdog`] with RR's measured throughput; a regression over 5 % counts as
//!   a fallback (the node would go back to RR).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use cores::bench::NodeSection;
use cores::generate::{generate, GenSpec, Seed};
use cores::machine::{scale_to_machine, spearman, MachineTarget};
use cores::problem::{Assignment, Problem};
use cores::twin::{evaluate, TwinParams};
use cores::watchdog::{Watchdog, WatchdogConfig, WatchdogVerdict};
use cores::Assigner;
use sc::workers::{CoreAssigner, Placed, WorkerLoad, WorkerPool};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

/// How the node half runs.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// Instances (each with ≥ `min_vnfs` µVNFs).
    pub instances: usize,
    pub min_vnfs: usize,
    /// Requests per second over all SFCs of an instance.
    pub system_rps: f64,
    pub warmup: Duration,
    pub measure: Duration,
    /// A µVNF's input queue, requests.
    pub queue: usize,
    /// Problems to scale and run instead of generated ones.
    pub problems: Option<Vec<Problem>>,
    pub twin: TwinParams,
}

impl Default for NodeOptions {
    fn default() -> Self {
        NodeOptions {
            instances: 20,
            min_vnfs: 6,
            system_rps: 5_000.0,
            warmup: Duration::from_millis(300),
            measure: Duration::from_millis(1000),
            queue: 64,
            problems: None,
            twin: TwinParams::default(),
        }
    }
}

/// One assigner on one instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRun {
    pub cores: Vec<usize>,
    pub throughput_rps: f64,
    pub latency_ms: f64,
    pub twin_throughput_rps: f64,
    pub twin_latency_ms: f64,
    /// Arrivals dropped early (backpressure, or the head's queue full) and late (a
    /// full queue after upstream work).
    pub dropped_early: u64,
    pub dropped_late: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeInstance {
    pub vnfs: usize,
    pub sfcs: usize,
    pub offered_rps: f64,
    /// Σ load / (cores · clock): the offered load per core.
    pub load_per_core: f64,
    pub runs: BTreeMap<String, NodeRun>,
    /// Spearman's ρ of RR, LLF, FFD within this instance (None when the twin or the
    /// measurement ties them all).
    pub rho: Option<f64>,
    /// The watchdog reverted the learned assignment to RR.
    pub fallback: Option<bool>,
}

/// Everything the node half measured (`report.node_runs` in JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeDetail {
    pub spin_loops_per_us: f64,
    pub system_rps: f64,
    pub measure_ms: u64,
    pub instances: Vec<NodeInstance>,
}

/// Dummy work: `loops` rounds of a multiply-add the compiler cannot drop.
fn spin(loops: u64) {
    let mut x = 0x9e37_79b9_7f4a_7c15_u64;
    for i in 0..loops {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(i);
    }
    std::hint::black_box(x);
}

/// Loops per microsecond on this machine: the fastest of several timings, so that a
/// preemption during calibration does not make every µVNF cheaper.
pub fn calibrate() -> f64 {
    let n = 2_000_000u64;
    spin(n / 10);
    (0..7)
        .map(|_| {
            let t = Instant::now();
            spin(n);
            n as f64 / (t.elapsed().as_secs_f64() * 1e6)
        })
        .fold(0.0, f64::max)
}

/// Pins worker j to `cores[j]`.
struct Fixed(Vec<usize>);

impl CoreAssigner for Fixed {
    fn name(&self) -> &str {
        "fixed"
    }
    fn assign(&self, _cores: usize, _workers: &[WorkerLoad]) -> Vec<usize> {
        self.0.clone()
    }
}

/// Per SFC, what its tail saw inside the measurement window.
#[derive(Default)]
struct SfcStats {
    delivered: AtomicU64,
    latency_ns: AtomicU64,
}

struct Counters {
    early: AtomicU64,
    late: AtomicU64,
}

/// Where a µVNF sends what it processed.
struct Next {
    tx: Option<mpsc::Sender<Instant>>,
    sfc: Arc<SfcStats>,
    window: (Instant, Instant),
    counters: Arc<Counters>,
}

impl Next {
    fn pass(&self, due: Instant) {
        match &self.tx {
            Some(tx) => {
                if tx.try_send(due).is_err() {
                    self.counters.late.fetch_add(1, Ordering::Relaxed);
                }
            }
            None => {
                let now = Instant::now();
                if now >= self.window.0 && now < self.window.1 {
                    self.sfc.delivered.fetch_add(1, Ordering::Relaxed);
                    self.sfc
                        .latency_ns
                        .fetch_add(now.duration_since(due).as_nanos() as u64, Ordering::Relaxed);
                }
            }
        }
    }
}

/// Head of an SFC: its arrivals, dropped early under backpressure.
#[allow(clippy::too_many_arguments)]
async fn head(
    loops: u64,
    rate: f64,
    start: Instant,
    queue: usize,
    downstream: Vec<mpsc::Sender<Instant>>,
    backpressure: bool,
    next: Next,
    stop: Arc<AtomicBool>,
) {
    if rate <= 0.0 {
        return;
    }
    let high = queue * 3 / 4;
    let mut made: u64 = 0;
    let mut backlog = std::collections::VecDeque::with_capacity(queue);
    let counters = next.counters.clone();
    while !stop.load(Ordering::Relaxed) {
        let due = (start.elapsed().as_secs_f64() * rate) as u64;
        while made < due {
            let at = start + Duration::from_secs_f64(made as f64 / rate);
            made += 1;
            if backlog.len() >= queue {
                counters.early.fetch_add(1, Ordering::Relaxed);
            } else {
                backlog.push_back(at);
            }
        }
        match backlog.pop_front() {
            Some(at) => {
                let congested =
                    backpressure && downstream.iter().any(|d| queue - d.capacity() > high);
                if congested {
                    counters.early.fetch_add(1, Ordering::Relaxed);
                } else {
                    spin(loops);
                    next.pass(at);
                }
            }
            None => {
                let at = start + Duration::from_secs_f64(made as f64 / rate);
                tokio::time::sleep_until(at.into()).await;
            }
        }
    }
}

async fn middle(loops: u64, mut rx: mpsc::Receiver<Instant>, next: Next) {
    while let Some(at) = rx.recv().await {
        spin(loops);
        next.pass(at);
    }
}

/// Runs `p` (costs in ns) under `a` for warmup + measure; the learned run also gives
/// throughput samples for the watchdog.
fn run_once(
    p: &Problem,
    a: &Assignment,
    o: &NodeOptions,
    loops_per_us: f64,
    samples: usize,
) -> Result<(NodeRun, Vec<f64>)> {
    let n = p.vnfs.len();
    let pool = WorkerPool::start("bench", n, None).context("worker pool")?;
    if pool.cores() < p.cores {
        bail!(
            "the instance has {} cores; this machine has {}",
            p.cores,
            pool.cores()
        );
    }
    // Register µVNF j on worker j (an empty pool hands out workers in id order), so the
    // rate-cost share sees it as busy.
    for j in 0..n {
        let w = pool.take(Placed {
            group: j as u64,
            tenant: 0,
            chain: 0,
            queued: Default::default(),
        });
        if w.id != j {
            bail!("worker pool handed out worker {} for µVNF {j}", w.id);
        }
    }
    let rates = p.vnf_rates_pps();
    let loads: Vec<WorkerLoad> = (0..n)
        .map(|j| WorkerLoad {
            worker: j,
            group: j as u64,
            arrival_per_s: rates[j],
            cost_ns_per_req: p.vnfs[j].cost_cycles * 1e9 / p.clock_hz,
            ..Default::default()
        })
        .collect();
    pool.reassign(&Fixed(a.cores.clone()), &loads)
        .map_err(|e| anyhow::anyhow!("pinning: {e}"))?;
    if matches!(o.twin.scheduler, cores::twin::Scheduler::RateCost) {
        pool.apply_rate_cost_share(&loads);
    }
    let start = Instant::now() + Duration::from_millis(20);
    let window = (start + o.warmup, start + o.warmup + o.measure);
    let stop = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(Counters {
        early: AtomicU64::new(0),
        late: AtomicU64::new(0),
    });
    let sfc_stats: Vec<Arc<SfcStats>> = p.sfcs.iter().map(|_| Arc::default()).collect();
    let workers = pool.workers();
    for (k, s) in p.sfcs.iter().enumerate() {
        let mut txs = Vec::new();
        let mut rxs = Vec::new();
        for _ in 1..s.vnfs.len() {
            let (tx, rx) = mpsc::channel::<Instant>(o.queue.max(1));
            txs.push(tx);
            rxs.push(rx);
        }
        let loops_of = |j: usize| {
            let ns = p.vnfs[j].cost_cycles * 1e9 / p.clock_hz;
            (ns / 1e3 * loops_per_us).round().max(1.0) as u64
        };
        let next_of = |i: usize| Next {
            tx: txs.get(i).cloned(),
            sfc: sfc_stats[k].clone(),
            window,
            counters: counters.clone(),
        };
        let mut rxs = rxs.into_iter();
        for (i, &j) in s.vnfs.iter().enumerate() {
            let next = next_of(i);
            if i == 0 {
                workers[j].spawn(head(
                    loops_of(j),
                    s.rate_mpps * 1e6,
                    start,
                    o.queue.max(1),
                    txs.clone(),
                    o.twin.backpressure,
                    next,
                    stop.clone(),
                ));
            } else {
                let rx = rxs.next().context("queue per hop")?;
                workers[j].spawn(middle(loops_of(j), rx, next));
            }
        }
    }
    // Throughput samples over the window for the watchdog (delivered per slice).
    let mut series = Vec::new();
    std::thread::sleep(window.0.saturating_duration_since(Instant::now()));
    let slice = o.measure / samples.max(1) as u32;
    let total = |v: &[Arc<SfcStats>]| -> u64 {
        v.iter().map(|s| s.delivered.load(Ordering::Relaxed)).sum()
    };
    let mut last = total(&sfc_stats);
    for _ in 0..samples.max(1) {
        std::thread::sleep(slice);
        let now = total(&sfc_stats);
        series.push((now - last) as f64 / slice.as_secs_f64());
        last = now;
    }
    std::thread::sleep(
        window.1.saturating_duration_since(Instant::now()) + Duration::from_millis(5),
    );
    stop.store(true, Ordering::Relaxed);
    pool.shutdown();
    let delivered: u64 = total(&sfc_stats);
    let lat_ns: u64 = sfc_stats
        .iter()
        .map(|s| s.latency_ns.load(Ordering::Relaxed))
        .sum();
    let twin = evaluate(p, a, &o.twin)?;
    Ok((
        NodeRun {
            cores: a.cores.clone(),
            throughput_rps: delivered as f64 / o.measure.as_secs_f64(),
            latency_ms: if delivered > 0 {
                lat_ns as f64 / delivered as f64 / 1e6
            } else {
                f64::NAN
            },
            twin_throughput_rps: twin.throughput_mpps * 1e6,
            twin_latency_ms: twin.latency_s * 1e3,
            dropped_early: counters.early.load(Ordering::Relaxed),
            dropped_late: counters.late.load(Ordering::Relaxed),
        },
        series,
    ))
}

/// Cores renamed in order of first use: assignments equal up to that are one run.
fn canonical(a: &Assignment) -> Vec<usize> {
    let mut map = BTreeMap::new();
    a.cores
        .iter()
        .map(|&c| {
            let k = map.len();
            *map.entry(c).or_insert(k)
        })
        .collect()
}

/// The instances the node runs: generated at this machine's core count (≥ `min_vnfs`
/// µVNFs, the test stream) or the given problems, scaled to `system_rps` with costs
/// in ns.
pub fn instances(o: &NodeOptions, cores: usize) -> Result<Vec<Problem>> {
    let target = MachineTarget {
        cores,
        system_rps: o.system_rps,
    };
    if let Some(ps) = &o.problems {
        return ps
            .iter()
            .take(o.instances.max(1))
            .map(|p| scale_to_machine(p, target).map_err(Into::into))
            .collect();
    }
    let spec = GenSpec::default();
    let mut out = Vec::new();
    // Seeds far from the twin half's (Seed::test(0..instances)), so the node half is
    // no rerun of those instances.
    let mut i = 1u64 << 40;
    while out.len() < o.instances {
        if i > (1u64 << 40) + 100_000 {
            bail!(
                "found only {} generated instances with ≥ {} µVNFs",
                out.len(),
                o.min_vnfs
            );
        }
        let g = generate(&spec, cores, Seed::test(i))?;
        i += 1;
        if g.problem.vnfs.len() >= o.min_vnfs {
            out.push(scale_to_machine(&g.problem, target)?);
        }
    }
    Ok(out)
}

/// The node half: `learned` is the shipped (or given) model's assigner.
pub fn run(
    o: &NodeOptions,
    learned: Option<&dyn Assigner>,
    progress: &mut dyn FnMut(&str),
) -> Result<(NodeSection, NodeDetail)> {
    let cores = sc::workers::online_cores();
    let loops_per_us = calibrate();
    progress(&format!(
        "node: {cores} cores, dummy loop {loops_per_us:.1} loops/µs"
    ));
    let problems = instances(o, cores)?;
    let mut algs: Vec<Box<dyn Assigner>> = cores::assign::baselines();
    let watch = WatchdogConfig::default();
    let mut detail = NodeDetail {
        spin_loops_per_us: loops_per_us,
        system_rps: o.system_rps,
        measure_ms: o.measure.as_millis() as u64,
        instances: Vec::new(),
    };
    for (i, p) in problems.iter().enumerate() {
        let mut runs: BTreeMap<String, NodeRun> = BTreeMap::new();
        let mut done: BTreeMap<Vec<usize>, (NodeRun, Vec<f64>)> = BTreeMap::new();
        let mut fallback = None;
        let names: Vec<&str> = algs.iter().map(|a| a.name()).collect();
        let mut assignments: Vec<(String, Assignment)> = Vec::new();
        for (k, a) in algs.iter_mut().enumerate() {
            assignments.push((names[k].to_string(), a.assign(p)?));
        }
        if let Some(l) = learned {
            match l.assign(p) {
                Ok(a) => assignments.push(("s2c".to_string(), a)),
                Err(e) => progress(&format!("instance {i}: s2c refused: {e}")),
            }
        }
        for (name, a) in &assignments {
            let key = canonical(a);
            let (run, series) = match done.get(&key) {
                Some(r) => r.clone(),
                None => {
                    let r = run_once(p, a, o, loops_per_us, watch.window)?;
                    done.insert(key, r.clone());
                    r
                }
            };
            let mut run = run;
            run.cores = a.cores.clone();
            if name == "s2c" {
                let rr = runs.get("rr").map_or(f64::NAN, |r| r.throughput_rps);
                if let Ok(mut w) = Watchdog::new(rr, watch) {
                    let mut reverted = false;
                    for s in &series {
                        if let WatchdogVerdict::RevertToRr { reason } = w.observe(*s) {
                            progress(&format!("instance {i}: fallback to RR: {reason}"));
                            reverted = true;
                        }
                    }
                    fallback = Some(reverted);
                }
            }
            runs.insert(name.clone(), run);
        }
        let pick = |f: fn(&NodeRun) -> f64| -> Vec<f64> {
            ["rr", "llf", "ffd"]
                .iter()
                .filter_map(|n| runs.get(*n).map(f))
                .collect()
        };
        let rho = spearman(
            &pick(|r| r.twin_throughput_rps),
            &pick(|r| r.throughput_rps),
        );
        let offered = p.offered_mpps() * 1e6;
        let load = p.loads().iter().sum::<f64>() / (p.cores as f64 * p.clock_hz);
        progress(&format!(
            "instance {i}: {} µVNFs, {} SFCs, load/core {load:.2}: {}",
            p.vnfs.len(),
            p.sfcs.len(),
            runs.iter()
                .map(|(k, r)| format!(
                    "{k} {:.0} rps (twin {:.0})",
                    r.throughput_rps, r.twin_throughput_rps
                ))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        detail.instances.push(NodeInstance {
            vnfs: p.vnfs.len(),
            sfcs: p.sfcs.len(),
            offered_rps: offered,
            load_per_core: load,
            runs,
            rho: rho.is_finite().then_some(rho),
            fallback,
        });
    }
    Ok((summarize(&detail, cores), detail))
}

/// Medians over instances; `s2c_vs_rr` is the median of per-instance ratios; ρ pools
/// every (instance, RR/LLF/FFD) pair.
pub fn summarize(d: &NodeDetail, cores: usize) -> NodeSection {
    let mut throughput = BTreeMap::new();
    let mut latency = BTreeMap::new();
    for name in ["rr", "llf", "ffd", "s2c"] {
        let t: Vec<f64> = d
            .instances
            .iter()
            .filter_map(|i| i.runs.get(name).map(|r| r.throughput_rps))
            .collect();
        let l: Vec<f64> = d
            .instances
            .iter()
            .filter_map(|i| i.runs.get(name).map(|r| r.latency_ms))
            .collect();
        if let Some(m) = crate::median(t) {
            throughput.insert(name.to_string(), m);
        }
        if let Some(m) = crate::median(l) {
            latency.insert(name.to_string(), m);
        }
    }
    let ratios: Vec<f64> = d
        .instances
        .iter()
        .filter_map(|i| {
            let (s, r) = (i.runs.get("s2c")?, i.runs.get("rr")?);
            (r.throughput_rps > 0.0).then(|| s.throughput_rps / r.throughput_rps)
        })
        .collect();
    let mut twin = Vec::new();
    let mut measured = Vec::new();
    for i in &d.instances {
        for n in ["rr", "llf", "ffd"] {
            if let Some(r) = i.runs.get(n) {
                twin.push(r.twin_throughput_rps);
                measured.push(r.throughput_rps);
            }
        }
    }
    let rho = spearman(&twin, &measured);
    NodeSection {
        workers: d.instances.iter().map(|i| i.vnfs).min().unwrap_or(0),
        cores,
        throughput_rps: throughput,
        latency_ms: latency,
        s2c_vs_rr: crate::median(ratios),
        twin_spearman_rho: rho.is_finite().then_some(rho),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_ignores_core_names() {
        let a = Assignment {
            cores: vec![1, 1, 0, 1],
        };
        let b = Assignment {
            cores: vec![0, 0, 1, 0],
        };
        assert_eq!(canonical(&a), canonical(&b));
        assert_ne!(
            canonical(&a),
            canonical(&Assignment {
                cores: vec![0, 1, 1, 0]
            })
        );
    }

    #[test]
    fn generated_instances_fit_the_machine() {
        let o = NodeOptions {
            instances: 5,
            ..NodeOptions::default()
        };
        let ps = instances(&o, 2).unwrap();
        assert_eq!(ps.len(), 5);
        for p in &ps {
            assert!(p.vnfs.len() >= 6);
            assert_eq!(p.cores, 2);
            assert!((p.offered_mpps() * 1e6 - 5000.0).abs() < 1e-6);
        }
    }

    /// A small real run: two µVNF chains on the pool deliver what the twin says an
    /// underloaded node delivers (everything), and an overloaded one drops.
    #[test]
    fn underloaded_instance_delivers_its_rate() {
        let p = Problem {
            cores: 1,
            clock_hz: 1e9,
            vnfs: vec![
                cores::problem::Vnf {
                    cost_cycles: 20_000.0,
                },
                cores::problem::Vnf {
                    cost_cycles: 20_000.0,
                },
            ],
            sfcs: vec![cores::problem::Sfc {
                rate_mpps: 0.002,
                vnfs: vec![0, 1],
            }],
        };
        let o = NodeOptions {
            warmup: Duration::from_millis(100),
            measure: Duration::from_millis(500),
            ..NodeOptions::default()
        };
        let a = Assignment { cores: vec![0, 0] };
        let (r, series) = run_once(&p, &a, &o, calibrate(), 5).unwrap();
        assert_eq!(series.len(), 5);
        // 2000 rps offered at 8 % of one core: all of it, give or take the window's
        // edges and a noisy machine.
        assert!(
            r.throughput_rps > 1000.0 && r.throughput_rps < 2300.0,
            "{r:?}"
        );
        assert!((r.twin_throughput_rps - 2000.0).abs() < 1.0, "{r:?}");
        assert_eq!(r.dropped_late, 0, "{r:?}");
    }
}
