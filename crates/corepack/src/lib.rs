//! Control threads packed onto the fewest CPUs that keep up with them.
//!
//! A flow's setup crosses a dozen thread hand-offs (PP worker → FM client → FM → three
//! SC replicas, each a node runtime and a worker → FM → PP). When the two threads of a
//! hand-off sit on different CPUs, the wake-up is an inter-processor interrupt, and the
//! idle CPU has to come out of its halt; under a hypervisor both are exits to the host.
//! On the 2-vCPU VM this project is measured on, a ping-pong between two threads costs
//! 23–74 µs a round trip across CPUs and 3–4 µs on one CPU (`perf bench sched pipe`,
//! with and without `taskset -c 0`), and a few thousand setups a second kept 1.3 CPUs busy
//! spread out but 0.8 on one (docs/corepack.md). The kernel's scheduler spreads woken
//! threads onto idle CPUs, which is right for throughput and wrong for such a chain at
//! low load.
//!
//! [`CorePacker`] runs one thread per process. Every `interval` it reads how busy the
//! CPUs the control threads may use are (`/proc/stat`, every process counted), and a
//! [`PackPolicy`] decides how many of the process's CPUs they get: one CPU fewer after a
//! second with room, one more as soon as the active ones are full (two samples), with a
//! doubling backoff for a load that keeps not fitting. The packer then sets the
//! affinity of every thread of the process to the first `k` CPUs, except:
//!
//! - threads that called [`exclude_current_thread`] (the data path: PP's packet
//!   workers, which have cores of their own to use);
//! - threads pinned from outside the process (their mask is not the process's full
//!   one and they did not call [`allow_repin_current_thread`]): an operator's
//!   `taskset` wins.
//!
//! Threads a policy of this process pins (SC's NF workers, which the core assigner
//! places) call [`allow_repin_current_thread`], and the policy pins them with
//! [`pin_thread`]: while packed they run on the active CPUs (on their own CPU if it is
//! one of them), and when the packer grows back to every CPU each thread gets back the
//! mask the policy last gave it. A pin and a packer's pass take one lock, so neither
//! undoes the other. A mask set by anyone else meanwhile becomes the thread's new own
//! mask.
//!
//! All processes pack toward the same CPUs (the lowest of each one's list), so the
//! planes of one host meet on the same CPU at low load, and the system-wide busy time
//! makes them spread again when together they fill it.

mod policy;

pub use policy::{Change, PackPolicy, PolicyConfig};

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tracing::{debug, info};

/// Errors starting a packer.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    #[error("invalid CPU list: {0}")]
    Cpus(String),
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("starting the packer thread: {0}")]
    Spawn(std::io::Error),
    #[error("a packer already runs in this process (two would undo each other's masks)")]
    Running,
}

/// Settings of a [`CorePacker`].
#[derive(Clone, Debug)]
pub struct PackConfig {
    /// Time between samples.
    pub interval: Duration,
    pub policy: PolicyConfig,
    /// The CPUs to pack onto, in order (the first is the one left at low load); None:
    /// every CPU the process may run on, ascending. Threads get their own masks back
    /// only when the active CPUs are all the process's, so a narrower list pins the
    /// control threads within it.
    pub cpus: Option<Vec<usize>>,
}

impl Default for PackConfig {
    fn default() -> Self {
        PackConfig {
            interval: Duration::from_millis(50),
            policy: PolicyConfig::default(),
            cpus: None,
        }
    }
}

/// What the packer and the process's own pinning share. One lock serialises a pin
/// ([`pin_thread`]) with the packer's passes, so neither undoes the other: a pin that
/// landed between a pass's read of a mask and its write would otherwise be overwritten
/// with a mask derived from the thread's previous home, and that old home given back
/// when the packer spread again.
#[derive(Default)]
struct Registry {
    excluded: BTreeSet<i32>,
    repin: BTreeSet<i32>,
    /// Every thread whose mask the packer or [`pin_thread`] set: its own mask and the
    /// one set.
    seen: HashMap<i32, Seen>,
    /// The CPUs a running packer keeps the control threads on while packed; None when
    /// spread or when no packer runs.
    packed_onto: Option<Vec<usize>>,
}

fn registry() -> &'static Mutex<Registry> {
    static R: OnceLock<Mutex<Registry>> = OnceLock::new();
    R.get_or_init(Default::default)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn gettid() -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

/// The calling thread is data path: the packer never moves it. Call it at the start of
/// the thread. The mark goes with the thread: the packer's next pass after the thread
/// ends drops it, so a later thread given the same id by the kernel is packed as any
/// other (Linux hands out ids in order up to `pid_max` before it reuses one, so the id
/// cannot come back within a pass).
pub fn exclude_current_thread() {
    lock(registry()).excluded.insert(gettid());
}

/// The calling thread is pinned by a policy of this process (not by an operator): the
/// packer may move it onto the active CPUs while packed, and gives it its own mask back
/// when it spreads again. The policy pins it with [`pin_thread`].
pub fn allow_repin_current_thread() {
    lock(registry()).repin.insert(gettid());
}

/// Pin thread `tid` of this process to `cpus`, as a policy of this process (SC's core
/// assigner), and make `cpus` its own mask: while a packer has the control threads
/// packed, the thread runs where `cpus` meets the active CPUs (on the active CPUs if they
/// do not meet), and it gets `cpus` when the packer spreads again or stops. Without a
/// packer it is `sched_setaffinity`. The thread may be repinned by the packer from then
/// on, as [`allow_repin_current_thread`] allows.
pub fn pin_thread(tid: i32, cpus: &[usize]) -> Result<(), std::io::Error> {
    if cpus.is_empty() || cpus.iter().any(|&c| c >= libc::CPU_SETSIZE as usize) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("CPU set {cpus:?}: empty, or beyond {}", libc::CPU_SETSIZE),
        ));
    }
    let mut r = lock(registry());
    let applied = match &r.packed_onto {
        Some(active) => narrowed(cpus, active),
        None => cpus.to_vec(),
    };
    set_affinity(tid, &applied)?;
    r.repin.insert(tid);
    r.seen.insert(
        tid,
        Seen {
            home: cpus.to_vec(),
            applied,
        },
    );
    Ok(())
}

/// A thread's own mask where it meets the active CPUs, or the active CPUs if the two do
/// not meet.
fn narrowed(home: &[usize], active: &[usize]) -> Vec<usize> {
    let both: Vec<usize> = home
        .iter()
        .copied()
        .filter(|c| active.contains(c))
        .collect();
    if both.is_empty() {
        active.to_vec()
    } else {
        both
    }
}

fn running() -> &'static Mutex<Option<Arc<Shared>>> {
    static R: OnceLock<Mutex<Option<Arc<Shared>>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// The stats of the packer running in this process, if one is: what every node's
/// `/metrics` shows (telemetry's `Exporter` asks at each scrape).
pub fn process_stats() -> Option<PackStats> {
    lock(running()).as_ref().map(|s| stats_of(s))
}

fn stats_of(s: &Shared) -> PackStats {
    PackStats {
        active: s.active.load(Ordering::Relaxed),
        cpus: s.cpus.load(Ordering::Relaxed),
        grows: s.grows.load(Ordering::Relaxed),
        shrinks: s.shrinks.load(Ordering::Relaxed),
        failed_probes: s.failed_probes.load(Ordering::Relaxed),
        managed_threads: s.managed.load(Ordering::Relaxed),
        affinity_errors: s.affinity_errors.load(Ordering::Relaxed),
    }
}

/// What a packer has done, for metrics and benches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PackStats {
    /// CPUs the control threads may use now.
    pub active: usize,
    /// CPUs there are to pack onto.
    pub cpus: usize,
    pub grows: u64,
    pub shrinks: u64,
    /// Grows that undid a shrink within the probe window.
    pub failed_probes: u64,
    /// Threads whose affinity the last pass set or kept.
    pub managed_threads: usize,
    /// `sched_setaffinity` calls the kernel refused (a thread gone meanwhile, or a CPU
    /// taken offline).
    pub affinity_errors: u64,
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    active: AtomicUsize,
    cpus: AtomicUsize,
    grows: AtomicU64,
    shrinks: AtomicU64,
    failed_probes: AtomicU64,
    managed: AtomicUsize,
    affinity_errors: AtomicU64,
}

/// The running packer of a process (one is enough; two would fight). Stops, and gives
/// every thread its own mask back, when dropped or [`CorePacker::stop`]ped.
pub struct CorePacker {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl CorePacker {
    /// Start the packer thread.
    pub fn start(cfg: PackConfig) -> Result<CorePacker, PackError> {
        let allowed = allowed_cpus();
        let cpus = match cfg.cpus.clone() {
            Some(list) => {
                if list.is_empty() {
                    return Err(PackError::Cpus("empty".into()));
                }
                let mut seen = BTreeSet::new();
                for c in &list {
                    if !allowed.contains(c) {
                        return Err(PackError::Cpus(format!(
                            "CPU {c} is not one this process may run on ({allowed:?})"
                        )));
                    }
                    if !seen.insert(*c) {
                        return Err(PackError::Cpus(format!("CPU {c} is listed twice")));
                    }
                }
                list
            }
            None => allowed.clone(),
        };
        let stat = CpuStat::read()?;
        let mut slot = lock(running());
        if slot.is_some() {
            return Err(PackError::Running);
        }
        let shared = Arc::new(Shared::default());
        shared.active.store(cpus.len(), Ordering::Relaxed);
        shared.cpus.store(cpus.len(), Ordering::Relaxed);
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("corepack".into())
            .spawn(move || run(cfg, cpus, allowed, stat, sh))
            .map_err(PackError::Spawn)?;
        *slot = Some(shared.clone());
        Ok(CorePacker {
            shared,
            thread: Some(thread),
        })
    }

    pub fn stats(&self) -> PackStats {
        stats_of(&self.shared)
    }

    /// Stop the packer; every thread it moved gets its own mask back.
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        {
            let mut r = lock(running());
            if r.as_ref().is_some_and(|s| Arc::ptr_eq(s, &self.shared)) {
                *r = None;
            }
        }
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}

impl Drop for CorePacker {
    fn drop(&mut self) {
        self.halt();
    }
}

/// A thread the packer has seen: its own mask and the one the packer last set.
struct Seen {
    home: Vec<usize>,
    applied: Vec<usize>,
}

fn run(cfg: PackConfig, cpus: Vec<usize>, allowed: Vec<usize>, mut stat: CpuStat, sh: Arc<Shared>) {
    let start = Instant::now();
    let mut policy = PackPolicy::new(cpus.len(), cfg.policy.clone());
    info!(cpus = ?cpus, "corepack: packing control threads onto the CPUs that keep up");
    while !sh.stop.load(Ordering::Relaxed) {
        std::thread::park_timeout(cfg.interval);
        if sh.stop.load(Ordering::Relaxed) {
            break;
        }
        let Ok(now_stat) = CpuStat::read() else {
            continue;
        };
        let k = policy.active();
        let busy = now_stat.busy_since(&stat, &cpus[..k]);
        stat = now_stat;
        match policy.step(start.elapsed(), busy) {
            Some(Change::Grow { to, failed_probe }) => {
                sh.grows.fetch_add(1, Ordering::Relaxed);
                if failed_probe {
                    sh.failed_probes.fetch_add(1, Ordering::Relaxed);
                }
                info!(
                    to,
                    busy, failed_probe, "corepack: control threads spread to more CPUs"
                );
            }
            Some(Change::Shrink { to }) => {
                sh.shrinks.fetch_add(1, Ordering::Relaxed);
                info!(to, busy, "corepack: control threads packed onto fewer CPUs");
            }
            None => {}
        }
        sh.active.store(policy.active(), Ordering::Relaxed);
        let active = &cpus[..policy.active()];
        // Every CPU the process has: each thread's own mask. A list narrower than the
        // process's (`--pack-cpus 0`) keeps the threads on it at any load.
        let spread = allowed.iter().all(|c| active.contains(c));
        apply(&allowed, active, spread, &sh);
    }
    // Give every moved thread its own mask back.
    apply(&allowed, &allowed, true, &sh);
    sh.active.store(cpus.len(), Ordering::Relaxed);
}

/// One pass over the process's threads: each managed thread runs on `active` (within
/// its own mask where the two meet), or on its own mask when `spread`. Holds the
/// registry's lock throughout (see [`Registry`]); a pass is one directory read and two
/// system calls per thread.
fn apply(allowed: &[usize], active: &[usize], spread: bool, sh: &Shared) {
    let mut r = lock(registry());
    // Read under the lock: a thread that registers after this read is not dropped below.
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return;
    };
    let tids: BTreeSet<i32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    // Threads that ended take their marks with them.
    r.seen.retain(|t, _| tids.contains(t));
    r.excluded.retain(|t| tids.contains(t));
    r.repin.retain(|t| tids.contains(t));
    r.packed_onto = (!spread).then(|| active.to_vec());
    let r = &mut *r;
    let mut managed = 0;
    for &tid in &tids {
        if r.excluded.contains(&tid) {
            continue;
        }
        let Some(cur) = get_affinity(tid) else {
            continue;
        };
        let home = match r.seen.get(&tid) {
            Some(s) if s.applied == cur => s.home.clone(),
            // New, or moved by someone else since: that is its own mask now.
            _ => cur.clone(),
        };
        let ours = home == allowed || r.repin.contains(&tid);
        if !ours {
            r.seen.remove(&tid);
            continue;
        }
        managed += 1;
        let want = if spread {
            home.clone()
        } else {
            narrowed(&home, active)
        };
        let applied = if want != cur {
            match set_affinity(tid, &want) {
                Ok(()) => want,
                Err(e) => {
                    sh.affinity_errors.fetch_add(1, Ordering::Relaxed);
                    debug!(tid, error = %e, "corepack: sched_setaffinity");
                    cur
                }
            }
        } else {
            cur
        };
        r.seen.insert(tid, Seen { home, applied });
    }
    sh.managed.store(managed, Ordering::Relaxed);
}

/// Per-CPU busy and total time from `/proc/stat`, in clock ticks.
#[derive(Clone, Debug, Default)]
struct CpuStat {
    /// Indexed by CPU number: (busy, total).
    cpus: Vec<(u64, u64)>,
}

impl CpuStat {
    fn read() -> Result<CpuStat, PackError> {
        let text = std::fs::read_to_string("/proc/stat").map_err(|source| PackError::Io {
            path: "/proc/stat".into(),
            source,
        })?;
        Ok(CpuStat::parse(&text))
    }

    /// Idle and iowait are idle; everything else, steal included (time the hypervisor
    /// took is time the threads could not run), is busy.
    fn parse(text: &str) -> CpuStat {
        let mut cpus = Vec::new();
        for line in text.lines() {
            // "cpuN ..." lines; not the "cpu  ..." total.
            let Some(rest) = line
                .strip_prefix("cpu")
                .filter(|r| r.starts_with(|c: char| c.is_ascii_digit()))
            else {
                continue;
            };
            let mut f = rest.split_ascii_whitespace();
            let Some(Ok(n)) = f.next().map(str::parse::<usize>) else {
                continue;
            };
            let v: Vec<u64> = f.filter_map(|x| x.parse().ok()).collect();
            if v.len() < 5 {
                continue;
            }
            // user nice system idle iowait irq softirq steal (guest time is in user).
            let total: u64 = v.iter().take(8).sum();
            let idle = v[3] + v[4];
            if cpus.len() <= n {
                cpus.resize(n + 1, (0, 0));
            }
            cpus[n] = (total - idle.min(total), total);
        }
        CpuStat { cpus }
    }

    /// Busy CPUs (0..=cpus.len()) summed over `cpus` since `before`.
    fn busy_since(&self, before: &CpuStat, cpus: &[usize]) -> f64 {
        let mut sum = 0.0;
        for &c in cpus {
            let (Some(&(b1, t1)), Some(&(b0, t0))) = (self.cpus.get(c), before.cpus.get(c)) else {
                continue;
            };
            let dt = t1.saturating_sub(t0);
            if dt > 0 {
                sum += b1.saturating_sub(b0) as f64 / dt as f64;
            }
        }
        sum
    }
}

/// The CPUs this process may run on, ascending: the calling thread's affinity mask,
/// which every thread inherits from the process unless something pinned it (call it
/// from a thread nobody pinned, as node start does). Falls back to `0..N` (N the
/// available parallelism) if the kernel will not say.
pub fn allowed_cpus() -> Vec<usize> {
    match get_affinity(0) {
        Some(all) if !all.is_empty() => all,
        _ => (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect(),
    }
}

/// Parse a CPU list as `taskset -c` and VPP's `corelist-workers` write it: `0-3,6,8-9`.
/// The order is kept (it is the round-robin order); a CPU named twice is an error.
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>, String> {
    let mut out: Vec<usize> = Vec::new();
    for part in s.split(',').map(str::trim) {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let num = |x: &str| {
            x.parse::<usize>()
                .map_err(|_| format!("{part:?} is not a CPU number or range (e.g. 0-3,6)"))
        };
        let (lo, hi) = (num(lo)?, num(hi)?);
        if lo > hi {
            return Err(format!("range {part:?} runs backwards"));
        }
        if hi >= libc::CPU_SETSIZE as usize {
            return Err(format!(
                "CPU {hi} is beyond the {} a CPU set holds",
                libc::CPU_SETSIZE
            ));
        }
        for c in lo..=hi {
            if out.contains(&c) {
                return Err(format!("CPU {c} is listed twice"));
            }
            out.push(c);
        }
    }
    Ok(out)
}

fn get_affinity(tid: i32) -> Option<Vec<usize>> {
    // SAFETY: cpu_set_t is a plain bit array; zeroed is the empty set, and
    // sched_getaffinity writes at most the size passed.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        Some(
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect(),
        )
    }
}

fn set_affinity(tid: i32, cpus: &[usize]) -> Result<(), std::io::Error> {
    // SAFETY: as in get_affinity. Every CPU here is below CPU_SETSIZE: it came from a
    // mask the kernel returned, or pin_thread checked it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        if libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat_is_read_per_cpu_with_steal_as_busy() {
        let text = "cpu  10 0 10 100 0 0 0 0 0 0\n\
                    cpu0 5 0 5 50 10 0 0 0 0 0\n\
                    cpu1 5 0 5 50 0 0 0 20 0 0\n\
                    intr 1 2 3\n";
        let s = CpuStat::parse(text);
        assert_eq!(s.cpus, vec![(10, 70), (30, 80)]);
        let later = "cpu0 15 0 5 90 10 0 0 0 0 0\ncpu1 55 0 5 50 0 0 0 20 0 0\n";
        let l = CpuStat::parse(later);
        // CPU 0: 10 busy of 50 ticks; CPU 1: 50 busy of 50.
        assert!((l.busy_since(&s, &[0]) - 10.0 / 50.0).abs() < 1e-9);
        assert!((l.busy_since(&s, &[1]) - 1.0).abs() < 1e-9);
        assert!((l.busy_since(&s, &[0, 1]) - (1.0 + 10.0 / 50.0)).abs() < 1e-9);
        // A CPU the file does not list counts nothing.
        assert_eq!(l.busy_since(&s, &[7]), 0.0);
    }

    #[test]
    fn an_ended_threads_marks_go_at_the_next_pass() {
        let t = std::thread::spawn(|| {
            exclude_current_thread();
            allow_repin_current_thread();
            gettid()
        });
        let tid = t.join().unwrap();
        {
            let r = lock(registry());
            assert!(r.excluded.contains(&tid) && r.repin.contains(&tid));
        }
        // Spread over the process's own CPUs: every thread keeps the mask it has.
        let all = allowed_cpus();
        apply(&all, &all, true, &Shared::default());
        let r = lock(registry());
        assert!(!r.excluded.contains(&tid), "a reused id is not excluded");
        assert!(!r.repin.contains(&tid) && !r.seen.contains_key(&tid));
        assert!(r.packed_onto.is_none());
    }

    #[test]
    fn malformed_proc_stat_lines_are_skipped() {
        let s = CpuStat::parse("cpux 1 2\ncpu0 1 2\ncpu3 1 1 1 1 1 1 1 1\ngarbage\n");
        assert_eq!(s.cpus.len(), 4);
        assert_eq!(s.cpus[3], (6, 8));
        assert_eq!(s.cpus[0], (0, 0));
    }

    #[test]
    fn a_cpu_list_outside_the_process_mask_is_refused() {
        let bad = CorePacker::start(PackConfig {
            cpus: Some(vec![libc::CPU_SETSIZE as usize - 1]),
            ..PackConfig::default()
        });
        assert!(matches!(bad, Err(PackError::Cpus(_))));
        let empty = CorePacker::start(PackConfig {
            cpus: Some(vec![]),
            ..PackConfig::default()
        });
        assert!(matches!(empty, Err(PackError::Cpus(_))));
        let c = allowed_cpus()[0];
        let twice = CorePacker::start(PackConfig {
            cpus: Some(vec![c, c]),
            ..PackConfig::default()
        });
        assert!(matches!(twice, Err(PackError::Cpus(_))));
    }
}

/// What `--pack-cpus` asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PackSpec {
    /// Never move a thread.
    Off,
    /// Pack onto the process's CPUs, lowest first.
    Auto,
    /// At most these CPUs, in this order (the first is the one kept at low load). A
    /// list narrower than the process's CPUs keeps the control threads on it at any
    /// load, like VPP's `main-core`.
    List(Vec<usize>),
}

impl std::str::FromStr for PackSpec {
    type Err = String;

    /// `auto`, `off`, or a list such as `0,1` or `2-3,0`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "auto" => return Ok(PackSpec::Auto),
            "off" => return Ok(PackSpec::Off),
            "" => return Err("expected auto, off or a CPU list such as 0,1".into()),
            _ => {}
        }
        parse_cpu_list(s).map(PackSpec::List)
    }
}

impl std::fmt::Display for PackSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PackSpec::Off => f.write_str("off"),
            PackSpec::Auto => f.write_str("auto"),
            PackSpec::List(l) => {
                let s: Vec<String> = l.iter().map(|c| c.to_string()).collect();
                f.write_str(&s.join(","))
            }
        }
    }
}

impl PackSpec {
    /// Start a packer as asked (None for `off`), with the default policy.
    pub fn start(&self) -> Result<Option<CorePacker>, PackError> {
        let cpus = match self {
            PackSpec::Off => return Ok(None),
            PackSpec::Auto => None,
            PackSpec::List(l) => Some(l.clone()),
        };
        CorePacker::start(PackConfig {
            cpus,
            ..PackConfig::default()
        })
        .map(Some)
    }
}

#[cfg(test)]
mod spec_tests {
    use super::PackSpec;

    #[test]
    fn pack_cpus_parses_auto_off_and_lists() {
        assert_eq!("auto".parse(), Ok(PackSpec::Auto));
        assert_eq!("off".parse(), Ok(PackSpec::Off));
        assert_eq!("1,0".parse(), Ok(PackSpec::List(vec![1, 0])));
        assert_eq!("2-4, 0".parse(), Ok(PackSpec::List(vec![2, 3, 4, 0])));
        assert!("0,0".parse::<PackSpec>().is_err(), "a CPU named twice");
        assert_eq!(PackSpec::List(vec![2, 0]).to_string(), "2,0");
        assert_eq!(PackSpec::Auto.to_string(), "auto");
        for bad in ["", "x", "1,,2", "3-1", "-1", "0-99999999"] {
            assert!(bad.parse::<PackSpec>().is_err(), "{bad:?} parsed");
        }
    }
}
