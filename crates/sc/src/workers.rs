//! The SC node's worker pool (Serpens §III-A's process pool, sfc2cpu's µVNF workers):
//! pre-started threads that partition replicas run on, each pinned to a core chosen by
//! the node's [`CoreAssigner`], with a nice level from NFVnice's rate-cost share.
//!
//! A worker is an OS thread driving a current-thread tokio runtime. A plain loop would
//! do for the NF calls, but a replica also waits on its inbox, its timer and its idle
//! deadline at once; the runtime gives it that `select!` without a second thread, and
//! its task queue is the worker's own queue. A replica is placed on a worker by
//! spawning its task onto that runtime: the thread is already running and parked, so a
//! start costs one cross-thread wake-up (Serpens' "memory map" start, Table IV), not a
//! thread or process creation. Links and the FM session stay on the node's runtime.
//!
//! docs/workers.md has the model, the knobs and the metrics.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::ScError;

/// What the node measured of one worker since the previous sample: the input of a
/// [`CoreAssigner`] (sfc2cpu's per-µVNF arrival rate and cost) and of the rate-cost share.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerLoad {
    pub worker: usize,
    /// The replica it runs (the first, if several share it; 0 when idle).
    pub group: u64,
    pub tenant: u32,
    pub chain: u32,
    /// Rule requests its replicas applied per second.
    pub arrival_per_s: f64,
    /// Busy time per applied request (ns); 0 without requests.
    pub cost_ns_per_req: f64,
    /// Inputs queued for its replicas now.
    pub queue_len: usize,
}

/// Chooses a core for every worker. The `cores` crate's algorithms (RR, LLF, FFD, the
/// learned assigner) plug in here.
pub trait CoreAssigner: Send + Sync {
    fn name(&self) -> &str;
    /// One core (`0..cores`) per entry of `workers`, in the same order.
    fn assign(&self, cores: usize, workers: &[WorkerLoad]) -> Vec<usize>;
    /// Whether the node must watch the throughput after applying this assigner's answer
    /// and go back to RR on a regression (paper 002 §III-A: the learned assigner).
    fn watched(&self) -> bool {
        false
    }
}

/// Worker `i` on core `i mod cores`: the default, and sfc2cpu's fallback.
#[derive(Debug, Default, Clone, Copy)]
pub struct RoundRobin;

impl CoreAssigner for RoundRobin {
    fn name(&self) -> &str {
        "rr"
    }

    fn assign(&self, cores: usize, workers: &[WorkerLoad]) -> Vec<usize> {
        let cores = cores.max(1);
        workers.iter().map(|w| w.worker % cores).collect()
    }
}

/// The scheduler slice a node's workers ask for (`starfabric sc --worker-slice-us`).
/// `bench workers`, 16 groups configured at once on 2 cores (docs/workers.md): start
/// p50 470–1,821 µs with the kernel's default slice (1.4 ms here), 37–176 µs with
/// 100–300 µs slices, worse again from 500 µs up.
pub const DEFAULT_WORKER_SLICE: Duration = Duration::from_micros(200);

/// Upper bounds (µs, inclusive) of [`StartHistogram`]'s buckets: fine below 100 µs, where
/// the goals are (Serpens: 34 µs start), coarse up to 1 s.
pub const START_BOUNDS_US: [u64; 22] = [
    5, 10, 15, 20, 25, 30, 35, 40, 50, 60, 80, 100, 150, 200, 300, 500, 1_000, 2_000, 5_000,
    10_000, 100_000, 1_000_000,
];

/// Samples kept for exact quantiles (benches read them).
const RECENT: usize = 8192;

/// Start or wake latencies: fixed buckets for `/metrics`, and the most recent samples
/// for exact quantiles. One lock per observation: starts are rare next to requests.
#[derive(Debug, Default)]
pub struct StartHistogram {
    inner: Mutex<HistInner>,
}

#[derive(Debug, Clone, Default)]
pub struct HistInner {
    /// `counts[i]`: observations in bucket `i`; the last is `+Inf`.
    pub counts: Vec<u64>,
    pub sum_ns: u64,
    pub count: u64,
    /// The most recent observations, ns.
    pub recent: VecDeque<u64>,
}

impl StartHistogram {
    pub fn observe(&self, d: Duration) {
        let ns = d.as_nanos().min(u128::from(u64::MAX)) as u64;
        let us = ns / 1000;
        let b = START_BOUNDS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(START_BOUNDS_US.len());
        let mut h = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if h.counts.is_empty() {
            h.counts = vec![0; START_BOUNDS_US.len() + 1];
        }
        h.counts[b] += 1;
        h.sum_ns = h.sum_ns.saturating_add(ns);
        h.count += 1;
        if h.recent.len() == RECENT {
            h.recent.pop_front();
        }
        h.recent.push_back(ns);
    }

    pub fn snapshot(&self) -> HistInner {
        let mut h = self.inner.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if h.counts.is_empty() {
            h.counts = vec![0; START_BOUNDS_US.len() + 1];
        }
        h
    }
}

impl HistInner {
    /// Buckets as (upper bound in seconds, count in that bucket alone), ending with
    /// `+Inf`.
    pub fn buckets_seconds(&self) -> Vec<(f64, u64)> {
        START_BOUNDS_US
            .iter()
            .map(|&b| b as f64 / 1e6)
            .chain(std::iter::once(f64::INFINITY))
            .zip(self.counts.iter().copied())
            .collect()
    }

    /// Quantile `q` of the recent samples, in µs (None without samples).
    pub fn quantile_us(&self, q: f64) -> Option<f64> {
        let mut v: Vec<u64> = self.recent.iter().copied().collect();
        if v.is_empty() {
            return None;
        }
        v.sort_unstable();
        let i = ((v.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
        Some(v[i] as f64 / 1e3)
    }
}

/// A replica placed on a worker, as the worker's load report sees it.
#[derive(Debug, Clone)]
pub struct Placed {
    pub group: u64,
    pub tenant: u32,
    pub chain: u32,
    /// Inputs queued for it (shared with the node's dispatch).
    pub queued: Arc<AtomicUsize>,
}

/// One pre-started worker thread.
pub struct Worker {
    pub id: usize,
    rt: tokio::runtime::Handle,
    /// Its kernel thread id, for affinity and nice (0 until the thread has started).
    tid: AtomicI32,
    placed: Mutex<Vec<Placed>>,
    /// Rule requests applied by replicas on it, and the time they kept it busy.
    requests: AtomicU64,
    busy_ns: AtomicU64,
    /// Its core in the assigner's terms: an index into the pool's CPU list.
    core: AtomicUsize,
    nice: AtomicI32,
    /// The slice its thread asked the kernel's fair scheduler for, in ns (0: the
    /// kernel's default, or the request was refused).
    slice_ns: AtomicU64,
}

impl Worker {
    /// Run `f` on this worker.
    pub fn spawn<F>(&self, f: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        drop(self.rt.spawn(f));
    }

    /// A burst of work done here: `requests` applied in `busy`.
    pub fn record(&self, requests: u64, busy: Duration) {
        self.requests.fetch_add(requests, Ordering::Relaxed);
        self.busy_ns
            .fetch_add(busy.as_nanos() as u64, Ordering::Relaxed);
    }

    pub fn replicas(&self) -> usize {
        self.placed.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn core(&self) -> usize {
        self.core.load(Ordering::Relaxed)
    }

    pub fn nice(&self) -> i32 {
        self.nice.load(Ordering::Relaxed)
    }

    /// The scheduler slice its thread runs with (None: the kernel's default).
    pub fn slice(&self) -> Option<Duration> {
        match self.slice_ns.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }

    fn queue_len(&self) -> usize {
        self.placed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|p| p.queued.load(Ordering::Relaxed))
            .sum()
    }
}

/// Counters of the pool.
#[derive(Debug, Default)]
pub struct PoolCounters {
    /// Affinity, nice or scheduler-slice calls the kernel refused.
    pub os_errors: AtomicU64,
    pub reassignments: AtomicU64,
}

struct Sample {
    at: Instant,
    requests: Vec<u64>,
    busy_ns: Vec<u64>,
}

/// The pre-started workers.
pub struct WorkerPool {
    workers: Vec<Arc<Worker>>,
    stop: tokio::sync::watch::Sender<bool>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// The CPUs workers are pinned to: the assigners' core `i` is `cpus[i]`.
    cpus: Vec<usize>,
    cores: usize,
    pub counters: PoolCounters,
    last: Mutex<Option<Sample>>,
    loads: Mutex<Vec<WorkerLoad>>,
}

impl WorkerPool {
    /// Start `n` workers (at least one) on `cpus` (None: every CPU this process may
    /// run on), placed round robin over that list, in its order, until the first
    /// assignment. A CPU outside the process's affinity mask is a configuration error.
    /// The threads keep the kernel's default scheduler slice ([`WorkerPool::start_with_slice`]).
    pub fn start(node: &str, n: usize, cpus: Option<&[usize]>) -> Result<WorkerPool, ScError> {
        WorkerPool::start_with_slice(node, n, cpus, None)
    }

    /// [`WorkerPool::start`], with each worker thread asking the kernel's fair
    /// scheduler (EEVDF, Linux 6.12 or later) for a slice of `slice`
    /// ([`DEFAULT_WORKER_SLICE`] on a node). A thread that asks for a shorter slice than
    /// the one running gets an earlier deadline, so when a replica's input wakes its
    /// worker, the worker preempts the node's own threads (links, handshakes, gRPC)
    /// instead of waiting out their slices, as it would on the dedicated core Serpens
    /// gives each NF. Its share of the CPU is unchanged: that is its weight, which the
    /// nice levels set. Kernels before 6.12 have no custom slice for fair tasks, so
    /// there the worker keeps the default; a refusal is counted in `os_errors`, and the
    /// worker runs on.
    pub fn start_with_slice(
        node: &str,
        n: usize,
        cpus: Option<&[usize]>,
        slice: Option<Duration>,
    ) -> Result<WorkerPool, ScError> {
        let allowed = allowed_cpus();
        let cpus = match cpus {
            None => allowed,
            Some(list) => {
                check_cpus(list, &allowed)
                    .map_err(|e| ScError::Config(format!("worker CPUs: {e}")))?;
                list.to_vec()
            }
        };
        let cores = cpus.len();
        let (stop, _) = tokio::sync::watch::channel(false);
        let mut workers = Vec::new();
        let mut threads = Vec::new();
        let mut sliced_workers = Vec::new();
        for id in 0..n.max(1) {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .map_err(|e| ScError::Io(format!("worker runtime: {e}")))?;
            let w = Arc::new(Worker {
                id,
                rt: rt.handle().clone(),
                tid: AtomicI32::new(0),
                placed: Mutex::new(Vec::new()),
                requests: AtomicU64::new(0),
                busy_ns: AtomicU64::new(0),
                core: AtomicUsize::new(id % cores),
                nice: AtomicI32::new(0),
                slice_ns: AtomicU64::new(0),
            });
            let (ready_tx, ready_rx) = std::sync::mpsc::channel();
            let (w2, mut stop2) = (w.clone(), stop.subscribe());
            let t = std::thread::Builder::new()
                .name(format!("sc-w{id}-{node}"))
                .spawn(move || {
                    w2.tid.store(gettid(), Ordering::Relaxed);
                    // Pinned by the core assigner, not by an operator: packed with the
                    // node's other threads at low load (docs/corepack.md).
                    corepack::allow_repin_current_thread();
                    let sliced = slice.map(set_slice);
                    warm_up(&rt);
                    let _ = ready_tx.send(sliced);
                    rt.block_on(async move {
                        // A closed channel (the pool dropped) stops it too.
                        let _ = stop2.wait_for(|s| *s).await;
                    });
                    // Dropping the runtime here drops the replicas still on it.
                    drop(rt);
                })
                .map_err(|e| ScError::Io(format!("worker thread: {e}")))?;
            let sliced = ready_rx.recv().ok().flatten();
            threads.push(t);
            workers.push(w);
            sliced_workers.push(sliced);
        }
        let pool = WorkerPool {
            workers,
            stop,
            threads: Mutex::new(threads),
            cpus,
            cores,
            counters: PoolCounters::default(),
            last: Mutex::new(None),
            loads: Mutex::new(Vec::new()),
        };
        for (w, sliced) in pool.workers.iter().zip(sliced_workers) {
            match sliced {
                Some(Ok(ns)) => w.slice_ns.store(ns, Ordering::Relaxed),
                Some(Err(e)) => {
                    pool.counters.os_errors.fetch_add(1, Ordering::Relaxed);
                    warn!(worker = w.id, error = %e, "sched_setattr: the worker keeps the kernel's default slice");
                }
                None => {}
            }
            pool.pin(w, w.core());
        }
        Ok(pool)
    }

    pub fn len(&self) -> usize {
        self.workers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    pub fn cores(&self) -> usize {
        self.cores
    }

    /// The CPU behind the assigners' core `core`.
    pub fn cpu(&self, core: usize) -> usize {
        self.cpus.get(core).copied().unwrap_or(core)
    }

    pub fn workers(&self) -> &[Arc<Worker>] {
        &self.workers
    }

    /// Workers running at least one replica.
    pub fn busy(&self) -> usize {
        self.workers.iter().filter(|w| w.replicas() > 0).count()
    }

    /// Take a worker for `p`: an idle one if there is one, else the one with the
    /// fewest replicas (they then share its queue, as µVNFs share a core).
    pub fn take(&self, p: Placed) -> Arc<Worker> {
        let w = self
            .workers
            .iter()
            .min_by_key(|w| (w.replicas(), w.id))
            .cloned()
            .expect("WorkerPool::start starts at least one worker");
        w.placed.lock().unwrap_or_else(|e| e.into_inner()).push(p);
        w
    }

    /// Give a replica's place on `w` back.
    pub fn release(&self, w: &Worker, group: u64) {
        let mut v = w.placed.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = v.iter().position(|p| p.group == group) {
            v.swap_remove(i);
        }
    }

    /// Measure every worker since the previous call: the assigner's input.
    pub fn sample(&self) -> Vec<WorkerLoad> {
        let now = Instant::now();
        let requests: Vec<u64> = self
            .workers
            .iter()
            .map(|w| w.requests.load(Ordering::Relaxed))
            .collect();
        let busy_ns: Vec<u64> = self
            .workers
            .iter()
            .map(|w| w.busy_ns.load(Ordering::Relaxed))
            .collect();
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let loads: Vec<WorkerLoad> = self
            .workers
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let first = w
                    .placed
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .first()
                    .cloned();
                let (dr, db, dt) = match last.as_ref() {
                    Some(s) => (
                        requests[i].saturating_sub(s.requests[i]),
                        busy_ns[i].saturating_sub(s.busy_ns[i]),
                        now.duration_since(s.at).as_secs_f64(),
                    ),
                    None => (0, 0, 0.0),
                };
                WorkerLoad {
                    worker: w.id,
                    group: first.as_ref().map_or(0, |p| p.group),
                    tenant: first.as_ref().map_or(0, |p| p.tenant),
                    chain: first.as_ref().map_or(0, |p| p.chain),
                    arrival_per_s: if dt > 0.0 { dr as f64 / dt } else { 0.0 },
                    cost_ns_per_req: if dr > 0 { db as f64 / dr as f64 } else { 0.0 },
                    queue_len: w.queue_len(),
                }
            })
            .collect();
        *last = Some(Sample {
            at: now,
            requests,
            busy_ns,
        });
        *self.loads.lock().unwrap_or_else(|e| e.into_inner()) = loads.clone();
        loads
    }

    /// The loads of the latest [`WorkerPool::sample`].
    pub fn last_loads(&self) -> Vec<WorkerLoad> {
        self.loads.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Ask `assigner` for a core per worker and pin them there. An answer of the wrong
    /// length or naming a core that does not exist is refused (the workers stay where
    /// they are): a plug-in's bug must not take the node down.
    pub fn reassign(
        &self,
        assigner: &dyn CoreAssigner,
        loads: &[WorkerLoad],
    ) -> Result<Vec<usize>, ScError> {
        let cores = assigner.assign(self.cores, loads);
        if cores.len() != self.workers.len() || cores.iter().any(|&c| c >= self.cores) {
            return Err(ScError::Config(format!(
                "assigner {} answered {:?} for {} workers on {} cores",
                assigner.name(),
                cores,
                self.workers.len(),
                self.cores
            )));
        }
        for (w, &c) in self.workers.iter().zip(&cores) {
            self.pin(w, c);
        }
        self.counters.reassignments.fetch_add(1, Ordering::Relaxed);
        Ok(cores)
    }

    fn pin(&self, w: &Worker, core: usize) {
        w.core.store(core, Ordering::Relaxed);
        let cpu = self.cpu(core);
        if let Err(e) = pin_worker(w.tid.load(Ordering::Relaxed), cpu) {
            self.counters.os_errors.fetch_add(1, Ordering::Relaxed);
            debug!(worker = w.id, core, cpu, error = %e, "sched_setaffinity");
        }
    }

    /// NFVnice's rate-cost proportional share (paper 002 §III-B): on a contended core,
    /// each worker's CFS weight follows arrival rate × cost per request, against the
    /// heaviest worker on the same core ([`rate_cost_levels`] says when a core is
    /// contended). CFS weights fall by ~1.25× per nice step, so a worker with a tenth
    /// of the heaviest one's demand gets nice `log1.25(10)` ≈ 10, the weakest level
    /// used. Workers without measured demand stay at 0: nice levels compete with every
    /// thread on the machine, not only with the other workers, so a new or just-woken
    /// replica must not start starved (its demand shows in the next sample). Returns
    /// the nice level per worker.
    pub fn apply_rate_cost_share(&self, loads: &[WorkerLoad]) -> Vec<i32> {
        let demand: Vec<f64> = loads
            .iter()
            .map(|l| l.arrival_per_s * l.cost_ns_per_req)
            .collect();
        let placed: Vec<RateCostInput> = (self.workers.iter().zip(&demand))
            .enumerate()
            .map(|(i, (w, &d))| RateCostInput {
                core: w.core.load(Ordering::Relaxed),
                hosts_replicas: w.replicas() > 0,
                demand_ns_per_s: d,
                queue_len: loads.get(i).map_or(0, |l| l.queue_len),
            })
            .collect();
        let levels = rate_cost_levels(&placed);
        for (w, &n) in self.workers.iter().zip(&levels) {
            if w.nice.swap(n, Ordering::Relaxed) != n || n != 0 {
                if let Err(e) = set_nice(w.tid.load(Ordering::Relaxed), n) {
                    self.counters.os_errors.fetch_add(1, Ordering::Relaxed);
                    debug!(worker = w.id, nice = n, error = %e, "setpriority");
                }
            }
        }
        levels
    }

    /// Stop every worker (their replicas are dropped with their runtimes) and wait for
    /// the threads, unless called on one of them.
    pub fn shutdown(&self) {
        self.stop.send_replace(true);
        let me = std::thread::current().id();
        let threads: Vec<_> = self
            .threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        for t in threads {
            if t.thread().id() == me {
                continue;
            }
            if t.join().is_err() {
                warn!("an SC worker thread panicked");
            }
        }
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Pay now what a replica's first decision on a fresh worker would otherwise pay for
/// (measured in `bench workers`: a new replica's first decision took 100-350 µs where a
/// woken one's takes 20 µs): the thread's malloc arena (glibc makes one on a thread's
/// first allocation), its stack pages, and the runtime's timer and task machinery.
fn warm_up(rt: &tokio::runtime::Runtime) {
    let heap = vec![1u8; 256 * 1024];
    std::hint::black_box(&heap);
    drop(heap);
    let mut stack = [0u8; 64 * 1024];
    std::hint::black_box(&mut stack);
    rt.block_on(async {
        let t = tokio::spawn(async {
            let mut iv = tokio::time::interval(Duration::from_micros(10));
            iv.tick().await;
            iv.tick().await;
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
            let _ = tx.send(1);
            rx.recv().await
        });
        let _ = t.await;
    });
}

/// A core whose workers' measured demand adds up to this share of it is contended.
/// The demand is what the workers were served (requests applied × busy time per
/// request), so it cannot exceed the CPU they got; 0.9 leaves room for the node's own
/// threads on a core the workers otherwise fill.
pub const RATE_COST_CONTENDED: f64 = 0.9;

/// Inputs queued at a worker from which its core counts as contended whatever the
/// demand: the worker is behind, which is what happens when other processes take the
/// core and the demand measured stays low.
pub const RATE_COST_BACKLOG: usize = 64;

/// One worker as [`rate_cost_levels`] sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateCostInput {
    pub core: usize,
    pub hosts_replicas: bool,
    /// Arrival rate × cost per request: ns of CPU per second.
    pub demand_ns_per_s: f64,
    pub queue_len: usize,
}

/// The nice level of each worker under NFVnice's rate-cost share. Weights arbitrate
/// between workers that all want more of a core than they get; on a core that is not
/// contended (its workers' demand under [`RATE_COST_CONTENDED`] and none of them
/// [`RATE_COST_BACKLOG`] behind) every worker already gets what it asks for, and a
/// lower weight would only make a light worker wait longer at each wake-up behind the
/// other threads on the machine (the kernel's EEVDF scheduler gives a low-weight
/// thread a later deadline). That is what a light tenant's replicas paid when the
/// levels followed the heaviest worker on the node whatever the load: nice 4 to 10 for
/// a tenant at 50 flows/s beside one at 2,000/s, on cores the workers kept under 0.9
/// busy (docs/rate-isolation.md). On a contended core each worker's level follows its
/// demand against the heaviest worker's on that core, as NFVnice sets shares per core.
pub fn rate_cost_levels(workers: &[RateCostInput]) -> Vec<i32> {
    let cores = workers.iter().map(|w| w.core + 1).max().unwrap_or(0);
    let mut load = vec![0.0f64; cores];
    let mut top = vec![0.0f64; cores];
    let mut behind = vec![false; cores];
    for w in workers.iter().filter(|w| w.hosts_replicas) {
        let d = w.demand_ns_per_s.max(0.0);
        load[w.core] += d / 1e9;
        top[w.core] = top[w.core].max(d);
        behind[w.core] |= w.queue_len >= RATE_COST_BACKLOG;
    }
    workers
        .iter()
        .map(|w| {
            let contended = load[w.core] >= RATE_COST_CONTENDED || behind[w.core];
            if !contended {
                return 0;
            }
            rate_cost_nice(w.hosts_replicas, w.demand_ns_per_s, top[w.core])
        })
        .collect()
}

/// Nice level for a worker's demand against the heaviest worker's on its core (see
/// [`rate_cost_levels`]).
pub fn rate_cost_nice(hosts_replicas: bool, demand: f64, top: f64) -> i32 {
    const STEP: f64 = 1.25;
    const WEAKEST: f64 = 10.0;
    if !(hosts_replicas && demand > 0.0 && top > 0.0) {
        return 0;
    }
    ((top / demand).ln() / STEP.ln())
        .round()
        .clamp(0.0, WEAKEST) as i32
}

// The process's CPUs and the `taskset -c` list format, shared with the control-thread
// packer (`--pack-cpus` parses the same lists).
pub use corepack::{allowed_cpus, parse_cpu_list};

/// `cpus` turned left by `by`: the list a node takes when several share a host (node
/// `i` takes `rotated(cpus, i)`), so that their first workers, where a node's first
/// replicas go, land on different CPUs instead of all on the first.
pub fn rotated(cpus: &[usize], by: usize) -> Vec<usize> {
    let mut v = cpus.to_vec();
    if !v.is_empty() {
        let k = by % v.len();
        v.rotate_left(k);
    }
    v
}

/// Whether `list` names CPUs only from `allowed` (and at least one); the error says
/// which CPU is not.
pub fn check_cpus(list: &[usize], allowed: &[usize]) -> Result<(), String> {
    if list.is_empty() {
        return Err("the list is empty".into());
    }
    if let Some(c) = list.iter().find(|c| !allowed.contains(c)) {
        return Err(format!(
            "CPU {c} is not one this process may run on (allowed: {allowed:?})"
        ));
    }
    Ok(())
}

/// Cores this process may run on.
pub fn online_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The default pool size: two workers per core (≥ 6 workers on this 2-core machine
/// takes `--workers`).
pub fn default_workers() -> usize {
    2 * online_cores()
}

fn gettid() -> i32 {
    // SAFETY: gettid has no preconditions and cannot fail.
    unsafe { libc::gettid() }
}

/// Through corepack, so that a pin and a pass of a packer running in this process are
/// serialised: the pin's CPU stays the worker's own when the packer spreads again.
fn pin_worker(tid: i32, cpu: usize) -> Result<(), String> {
    if tid == 0 {
        return Err("thread not started".into());
    }
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(format!("CPU {cpu} beyond the cpu set"));
    }
    corepack::pin_thread(tid, &[cpu]).map_err(|e| e.to_string())
}

/// Ask for a fair-scheduler slice of `slice` for the calling thread, keeping its nice
/// level. Returns the slice asked for, in ns. The kernel clamps it to 0.1–100 ms.
fn set_slice(slice: Duration) -> Result<u64, String> {
    let ns = slice.as_nanos().clamp(100_000, 100_000_000) as u64;
    // SAFETY: sched_attr is plain data, fully initialised here; sched_setattr reads
    // `size` bytes of it and changes only the calling thread (pid 0). getpriority
    // only reads the calling thread's nice level.
    let r = unsafe {
        let mut a: libc::sched_attr = std::mem::zeroed();
        a.size = std::mem::size_of::<libc::sched_attr>() as u32;
        a.sched_policy = libc::SCHED_OTHER as u32;
        a.sched_nice = libc::getpriority(libc::PRIO_PROCESS, 0);
        a.sched_runtime = ns;
        libc::syscall(libc::SYS_sched_setattr, 0, &a as *const libc::sched_attr, 0)
    };
    if r == 0 {
        Ok(ns)
    } else {
        Err(std::io::Error::last_os_error().to_string())
    }
}

fn set_nice(tid: i32, nice: i32) -> Result<(), String> {
    if tid == 0 {
        return Err("thread not started".into());
    }
    // SAFETY: setpriority only reads its scalar arguments; on Linux PRIO_PROCESS with a
    // thread id sets that thread's nice value alone.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's view of a thread's fair-scheduler slice in ns, where it shows it
    /// (`/proc/.../sched` needs CONFIG_SCHED_DEBUG).
    fn kernel_slice_ns(tid: i32) -> Option<u64> {
        let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/sched")).ok()?;
        s.lines()
            .find(|l| l.starts_with("se.slice"))?
            .split(':')
            .nth(1)?
            .trim()
            .parse()
            .ok()
    }

    /// Custom slices for fair tasks came in Linux 6.12; older kernels take the request
    /// and keep their default.
    fn kernel_applies_custom_slices() -> bool {
        let r = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut v = r
            .trim()
            .split(['.', '-'])
            .map(|p| p.parse::<u32>().unwrap_or(0));
        let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
        (major, minor) >= (6, 12)
    }

    #[test]
    fn workers_run_with_the_slice_the_node_asks_for() {
        let pool =
            WorkerPool::start_with_slice("t", 2, None, Some(Duration::from_micros(200))).unwrap();
        let refused = pool.counters.os_errors.load(Ordering::Relaxed);
        for w in pool.workers() {
            if refused == 0 {
                assert_eq!(w.slice(), Some(Duration::from_micros(200)));
                if kernel_applies_custom_slices() {
                    if let Some(ns) = kernel_slice_ns(w.tid.load(Ordering::Relaxed)) {
                        assert_eq!(ns, 200_000, "worker {}", w.id);
                    }
                }
            } else {
                // A kernel or sandbox that refuses sched_setattr: counted, and the
                // worker runs on with the default.
                assert_eq!(refused, 2);
                assert_eq!(w.slice(), None);
            }
        }
        // Below the kernel's floor, the request is raised to it rather than refused.
        let short =
            WorkerPool::start_with_slice("t", 1, None, Some(Duration::from_micros(10))).unwrap();
        if short.counters.os_errors.load(Ordering::Relaxed) == 0 {
            assert_eq!(short.workers()[0].slice(), Some(Duration::from_micros(100)));
        }
        // A pool that asks for nothing keeps the kernel's default.
        let plain = WorkerPool::start("t", 1, None).unwrap();
        let w = &plain.workers()[0];
        assert_eq!(w.slice(), None);
        if kernel_applies_custom_slices() && refused == 0 {
            if let Some(ns) = kernel_slice_ns(w.tid.load(Ordering::Relaxed)) {
                assert_ne!(ns, 200_000);
            }
        }
    }

    #[test]
    fn round_robin_cycles_over_cores() {
        let loads: Vec<WorkerLoad> = (0..6)
            .map(|worker| WorkerLoad {
                worker,
                ..Default::default()
            })
            .collect();
        assert_eq!(RoundRobin.assign(2, &loads), vec![0, 1, 0, 1, 0, 1]);
        assert_eq!(RoundRobin.assign(0, &loads), vec![0; 6]);
    }

    #[test]
    fn cpu_lists_parse_as_taskset_writes_them() {
        assert_eq!(parse_cpu_list("0-3,6"), Ok(vec![0, 1, 2, 3, 6]));
        assert_eq!(parse_cpu_list("1, 0"), Ok(vec![1, 0]));
        assert_eq!(parse_cpu_list("5"), Ok(vec![5]));
        for bad in ["", "a", "3-1", "0,0", "0-2,1", "1-", "99999"] {
            assert!(parse_cpu_list(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn rotated_lists_start_each_node_on_another_cpu() {
        let cpus = [0, 1, 2];
        assert_eq!(rotated(&cpus, 0), vec![0, 1, 2]);
        assert_eq!(rotated(&cpus, 1), vec![1, 2, 0]);
        assert_eq!(rotated(&cpus, 4), vec![1, 2, 0]);
        assert!(rotated(&[], 3).is_empty());
    }

    #[test]
    fn a_pool_pins_to_its_cpu_list_and_refuses_foreign_cpus() {
        let allowed = allowed_cpus();
        assert!(!allowed.is_empty());
        let list = rotated(&allowed, 1);
        let pool = WorkerPool::start("t", 2, Some(&list)).unwrap();
        assert_eq!(pool.cores(), list.len());
        // Worker 0 is on core 0, which is the list's first CPU.
        assert_eq!(pool.cpu(pool.workers()[0].core()), list[0]);
        assert_eq!(pool.counters.os_errors.load(Ordering::Relaxed), 0);
        // The pinned thread's own view agrees.
        let tid = pool.workers()[0].tid.load(Ordering::Relaxed);
        let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
        let line = status
            .lines()
            .find(|l| l.starts_with("Cpus_allowed_list:"))
            .unwrap();
        assert_eq!(
            line.split_whitespace().nth(1),
            Some(list[0].to_string().as_str())
        );
        drop(pool);
        let foreign = libc::CPU_SETSIZE as usize - 1;
        let err = WorkerPool::start("t", 1, Some(&[foreign]))
            .err()
            .expect("a CPU outside the mask is refused");
        assert!(
            err.to_string().contains("not one this process may run on"),
            "{err}"
        );
        assert!(WorkerPool::start("t", 1, Some(&[])).is_err());
    }

    #[test]
    fn rate_cost_nice_follows_demand_ratio() {
        assert_eq!(rate_cost_nice(true, 100.0, 100.0), 0);
        // A tenth of the demand: log1.25(10) = 10.3.
        assert_eq!(rate_cost_nice(true, 10.0, 100.0), 10);
        assert_eq!(rate_cost_nice(true, 1e-9, 100.0), 10);
        assert_eq!(rate_cost_nice(true, 0.0, 100.0), 0);
        assert_eq!(rate_cost_nice(false, 0.0, 100.0), 0);
        assert_eq!(rate_cost_nice(true, 0.0, 0.0), 0);
    }

    #[test]
    fn rate_cost_levels_weigh_only_contended_cores() {
        let w = |core, demand_ms: f64, queue_len| RateCostInput {
            core,
            hosts_replicas: true,
            demand_ns_per_s: demand_ms * 1e6,
            queue_len,
        };
        // A heavy and a light tenant's workers on two cores a tenth busy: nobody is
        // weighed down (the light one used to get nice 10 against the heavy one).
        let idle = [w(0, 80.0, 0), w(1, 2.0, 0), w(0, 2.0, 0), w(1, 80.0, 3)];
        assert_eq!(rate_cost_levels(&idle), vec![0, 0, 0, 0]);
        // Core 0 full (0.95 of it), core 1 not: only core 0's light worker yields
        // (log1.25(18) = 13, held to the weakest level, 10).
        let busy = [w(0, 900.0, 0), w(0, 50.0, 0), w(1, 300.0, 0), w(1, 30.0, 0)];
        assert_eq!(rate_cost_levels(&busy), vec![0, 10, 0, 0]);
        // Weighed against the heaviest worker on its own core, not the node's.
        let two = [
            w(0, 800.0, 0),
            w(0, 160.0, 0),
            w(1, 900.0, 0),
            w(1, 60.0, 0),
        ];
        assert_eq!(rate_cost_levels(&two), vec![0, 7, 0, 10]);
        // A worker far behind makes its core contended whatever the demand measured
        // (other processes took the core): weights apply there.
        let behind = [w(0, 200.0, RATE_COST_BACKLOG), w(0, 20.0, 0), w(1, 20.0, 0)];
        assert_eq!(rate_cost_levels(&behind), vec![0, 10, 0]);
        let below = [w(0, 200.0, RATE_COST_BACKLOG - 1), w(0, 20.0, 0)];
        assert_eq!(rate_cost_levels(&below), vec![0, 0]);
        // A worker with no replica neither counts toward its core nor is weighed.
        let mut spare = w(0, 0.0, 0);
        spare.hosts_replicas = false;
        assert_eq!(rate_cost_levels(&[w(0, 950.0, 0), spare]), vec![0, 0]);
        assert_eq!(rate_cost_levels(&[]), Vec::<i32>::new());
    }

    /// Every worker on core 0, whatever the machine.
    struct AllOnZero;

    impl CoreAssigner for AllOnZero {
        fn name(&self) -> &str {
            "zero"
        }
        fn assign(&self, _cores: usize, workers: &[WorkerLoad]) -> Vec<usize> {
            vec![0; workers.len()]
        }
    }

    #[test]
    fn the_pool_weighs_its_workers_only_when_their_core_is_contended() {
        let pool = WorkerPool::start("t", 3, None).unwrap();
        for g in 1..=2 {
            pool.take(Placed {
                group: g,
                tenant: g as u32,
                chain: 1,
                queued: Arc::new(AtomicUsize::new(0)),
            });
        }
        // Workers 0 and 1 at `heavy` and `light` requests/s of 40 µs; worker 2 idle.
        let loads = |heavy: f64, light: f64| -> Vec<WorkerLoad> {
            [(heavy, 40e3), (light, 40e3), (0.0, 0.0)]
                .into_iter()
                .enumerate()
                .map(|(worker, (arrival_per_s, cost_ns_per_req))| WorkerLoad {
                    worker,
                    arrival_per_s,
                    cost_ns_per_req,
                    ..Default::default()
                })
                .collect()
        };
        let levels =
            |pool: &WorkerPool| -> Vec<i32> { pool.workers().iter().map(|w| w.nice()).collect() };
        pool.reassign(&AllOnZero, &pool.sample()).unwrap();
        // 2,000 and 50 requests/s: a tenth of the core between them.
        let light = loads(2000.0, 50.0);
        assert_eq!(pool.apply_rate_cost_share(&light), vec![0, 0, 0]);
        assert_eq!(levels(&pool), vec![0, 0, 0]);
        // 22,500 and 1,500 requests/s: 0.96 of the core, so the light one yields
        // (log1.25(15) = 12, held to 10); the worker without a replica does not.
        assert_eq!(
            pool.apply_rate_cost_share(&loads(22500.0, 1500.0)),
            vec![0, 10, 0]
        );
        assert_eq!(levels(&pool), vec![0, 10, 0]);
        // The load falls again: the light worker's level goes back to 0.
        assert_eq!(pool.apply_rate_cost_share(&light), vec![0, 0, 0]);
        assert_eq!(pool.workers()[1].nice(), 0);
    }

    #[test]
    fn take_prefers_idle_workers_then_the_least_shared() {
        let pool = WorkerPool::start("t", 3, None).unwrap();
        let placed = |group| Placed {
            group,
            tenant: 1,
            chain: 1,
            queued: Arc::new(AtomicUsize::new(0)),
        };
        let ids: Vec<usize> = (1..=4).map(|g| pool.take(placed(g)).id).collect();
        assert_eq!(&ids[..3], &[0, 1, 2]);
        assert_eq!(pool.busy(), 3);
        assert_eq!(pool.workers()[ids[3]].replicas(), 2);
        pool.release(&pool.workers()[1].clone(), 2);
        assert_eq!(pool.busy(), 2 + usize::from(ids[3] == 1));
        assert_eq!(pool.take(placed(5)).id, 1);
    }

    #[test]
    fn sample_measures_rate_and_cost() {
        let pool = WorkerPool::start("t", 2, None).unwrap();
        assert!(pool.sample().iter().all(|l| l.arrival_per_s == 0.0));
        pool.workers()[1].record(100, Duration::from_micros(500));
        std::thread::sleep(Duration::from_millis(20));
        let l = pool.sample();
        assert_eq!(l[0].arrival_per_s, 0.0);
        assert!(l[1].arrival_per_s > 0.0);
        assert_eq!(l[1].cost_ns_per_req, 5000.0);
    }

    #[test]
    fn a_bad_assignment_is_refused() {
        struct Bad;
        impl CoreAssigner for Bad {
            fn name(&self) -> &str {
                "bad"
            }
            fn assign(&self, cores: usize, _: &[WorkerLoad]) -> Vec<usize> {
                vec![cores]
            }
        }
        let pool = WorkerPool::start("t", 2, None).unwrap();
        let loads = pool.sample();
        assert!(pool.reassign(&Bad, &loads).is_err());
        let got = pool.reassign(&RoundRobin, &loads).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(pool.workers()[1].core(), 1 % pool.cores());
    }

    #[test]
    fn histogram_quantiles_come_from_samples() {
        let h = StartHistogram::default();
        for us in [10u64, 20, 30, 40, 1000] {
            h.observe(Duration::from_micros(us));
        }
        let s = h.snapshot();
        assert_eq!(s.count, 5);
        assert_eq!(s.quantile_us(0.5), Some(30.0));
        assert_eq!(s.quantile_us(1.0), Some(1000.0));
        assert_eq!(s.counts.iter().sum::<u64>(), 5);
    }
}
