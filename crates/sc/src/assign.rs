//! The `cores` crate's assigners (paper 002, sfc2cpu: RR, LLF, FFD and the learned
//! one) as the node's [`CoreAssigner`], and §III-A's fallback: after the learned
//! assignment is applied the node watches its throughput and goes back to RR when it
//! falls more than 5 % below what RR gave.
//!
//! The node's unit of assignment is a worker (one OS thread, pinned). A worker runs one
//! partition replica at a time, or a few when the pool is short; the replica runs its
//! whole NF chain in one call, so to the assigner each worker is a µVNF alone in its
//! SFC: arrival rate = the requests its replicas applied per second, cost = its busy
//! time per request. Idle workers are µVNFs with no rate (a nanosecond of cost, since
//! the problem refuses a zero cost), so they land wherever they disturb nothing.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cores::problem::{Problem, Sfc, Vnf};
use cores::watchdog::{Watchdog, WatchdogConfig, WatchdogVerdict};
use cores::Sfc2cpuModel;
use tracing::warn;

use crate::workers::{CoreAssigner, RoundRobin, WorkerLoad};
use crate::ScError;

/// The assigners `starfabric sc --assigner` takes.
pub const ASSIGNER_NAMES: [&str; 4] = ["rr", "llf", "ffd", "s2c"];

/// The workers' loads as a sfc2cpu problem on `cores` cores (costs in ns: `clock_hz` 1e9).
pub fn problem_from_loads(cores: usize, workers: &[WorkerLoad]) -> Problem {
    let vnfs = workers
        .iter()
        .map(|w| Vnf {
            cost_cycles: if w.cost_ns_per_req.is_finite() && w.cost_ns_per_req >= 1.0 {
                w.cost_ns_per_req
            } else {
                1.0
            },
        })
        .collect();
    let sfcs = workers
        .iter()
        .enumerate()
        .map(|(j, w)| Sfc {
            rate_mpps: if w.arrival_per_s.is_finite() && w.arrival_per_s > 0.0 {
                w.arrival_per_s / 1e6
            } else {
                0.0
            },
            vnfs: vec![j],
        })
        .collect();
    Problem {
        cores,
        clock_hz: 1e9,
        vnfs,
        sfcs,
    }
}

/// A `cores` assigner as the node's [`CoreAssigner`]. When it refuses the problem (more
/// workers than the learned model knows, a core count it has no network for) the node
/// gets RR for this round, with a warning and [`Sfc2cpu::refusals`] counted: a model's
/// limits never stop the node.
pub struct Sfc2cpu {
    inner: Box<dyn cores::Assigner + Send + Sync>,
    learned: bool,
    refusals: AtomicU64,
}

impl Sfc2cpu {
    pub fn new(inner: Box<dyn cores::Assigner + Send + Sync>, learned: bool) -> Self {
        Sfc2cpu {
            inner,
            learned,
            refusals: AtomicU64::new(0),
        }
    }

    /// Rounds the inner assigner refused (RR was used instead).
    pub fn refusals(&self) -> u64 {
        self.refusals.load(Ordering::Relaxed)
    }
}

impl CoreAssigner for Sfc2cpu {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn assign(&self, cores: usize, workers: &[WorkerLoad]) -> Vec<usize> {
        let p = problem_from_loads(cores.max(1), workers);
        match self.inner.assign(&p) {
            Ok(a) => a.cores,
            Err(e) => {
                self.refusals.fetch_add(1, Ordering::Relaxed);
                warn!(assigner = self.inner.name(), error = %e, "assigner refused the workers; round robin this time");
                RoundRobin.assign(cores, workers)
            }
        }
    }

    fn watched(&self) -> bool {
        self.learned
    }
}

/// The assigner `name` (one of [`ASSIGNER_NAMES`]). For `s2c` the model comes from
/// `model` or, without one, the model shipped in this build. A model that is missing,
/// corrupt or of another version gives RR and the reason (second value), which the node
/// logs and reports: it never stops the node. An unknown name is an error.
pub fn assigner_by_name(
    name: &str,
    model: Option<&Path>,
) -> Result<(Arc<dyn CoreAssigner>, Option<String>), ScError> {
    let a: Arc<dyn CoreAssigner> = match name {
        "rr" => Arc::new(RoundRobin),
        "llf" => Arc::new(Sfc2cpu::new(Box::new(cores::LeastLoadedFirst), false)),
        "ffd" => Arc::new(Sfc2cpu::new(Box::new(cores::FirstFitDecreasing), false)),
        "s2c" | "learned" => {
            let loaded = match model {
                Some(p) => Sfc2cpuModel::load(p).map_err(|e| format!("{}: {e}", p.display())),
                None => Sfc2cpuModel::shipped().map_err(|e| format!("shipped model: {e}")),
            };
            match loaded {
                Ok(m) => Arc::new(Sfc2cpu::new(Box::new(m.assigner()), true)),
                Err(e) => {
                    let why = format!("learned assigner unavailable, using RR: {e}");
                    warn!(reason = %why, "sfc2cpu model not loaded");
                    return Ok((Arc::new(RoundRobin), Some(why)));
                }
            }
        }
        other => {
            return Err(ScError::Config(format!(
                "unknown assigner {other:?} (one of {})",
                ASSIGNER_NAMES.join(", ")
            )))
        }
    };
    Ok((a, None))
}

/// What the node does after a throughput sample under [`Fallback`].
#[derive(Debug, Clone, PartialEq)]
pub enum FallbackStep {
    /// Nothing to change.
    Stay,
    /// RR's baseline is measured: apply the watched assigner now.
    ApplyWatched { rr_throughput: f64 },
    /// The watched assignment regressed: pin the workers round robin again.
    RevertToRr { reason: String },
}

#[derive(Debug, Clone)]
enum Phase {
    /// Under RR, collecting samples for the baseline.
    Baseline(Vec<f64>),
    Watching(Watchdog),
    /// Reverted: RR until the operator asks again ([`Fallback::restart`]).
    Reverted,
}

/// Paper 002 §III-A's safety net around a learned assigner, driven by the node's
/// monitor: RR runs first for `window` samples (its throughput is the baseline), then
/// the learned assignment is applied and [`cores::Watchdog`] watches the next samples;
/// a mean more than `tolerance` below the baseline reverts to RR, once. Throughput is
/// the requests the node's replicas applied per second.
#[derive(Debug, Clone)]
pub struct Fallback {
    cfg: WatchdogConfig,
    phase: Phase,
    fallbacks: u64,
    last_reason: Option<String>,
}

impl Fallback {
    pub fn new(cfg: WatchdogConfig) -> Self {
        Fallback {
            cfg,
            phase: Phase::Baseline(Vec::new()),
            fallbacks: 0,
            last_reason: None,
        }
    }

    /// Start over from a new RR baseline (the operator asked for a reassignment).
    pub fn restart(&mut self) {
        self.phase = Phase::Baseline(Vec::new());
    }

    /// Times it reverted to RR.
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks
    }

    pub fn last_reason(&self) -> Option<&str> {
        self.last_reason.as_deref()
    }

    /// Whether the watched assignment is the one in force.
    pub fn watched_active(&self) -> bool {
        matches!(self.phase, Phase::Watching(_))
    }

    pub fn observe(&mut self, throughput: f64) -> FallbackStep {
        match &mut self.phase {
            Phase::Baseline(v) => {
                if throughput.is_finite() && throughput >= 0.0 {
                    v.push(throughput);
                }
                if v.len() < self.cfg.window {
                    return FallbackStep::Stay;
                }
                let rr = v.iter().sum::<f64>() / v.len() as f64;
                match Watchdog::new(rr, self.cfg) {
                    Ok(w) => {
                        self.phase = Phase::Watching(w);
                        FallbackStep::ApplyWatched { rr_throughput: rr }
                    }
                    Err(e) => {
                        // Only a bad configuration gets here; stay on RR.
                        self.phase = Phase::Reverted;
                        FallbackStep::RevertToRr {
                            reason: e.to_string(),
                        }
                    }
                }
            }
            Phase::Watching(w) => match w.observe(throughput) {
                WatchdogVerdict::RevertToRr { reason } => {
                    self.phase = Phase::Reverted;
                    self.fallbacks += 1;
                    self.last_reason = Some(reason.clone());
                    FallbackStep::RevertToRr { reason }
                }
                _ => FallbackStep::Stay,
            },
            Phase::Reverted => FallbackStep::Stay,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loads(rates: &[f64], costs: &[f64]) -> Vec<WorkerLoad> {
        rates
            .iter()
            .zip(costs)
            .enumerate()
            .map(|(worker, (&r, &c))| WorkerLoad {
                worker,
                arrival_per_s: r,
                cost_ns_per_req: c,
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn workers_become_single_vnf_sfcs() {
        let p = problem_from_loads(2, &loads(&[1000.0, 0.0, f64::NAN], &[5000.0, 0.0, -1.0]));
        p.validate().unwrap();
        assert_eq!(p.vnfs.len(), 3);
        assert_eq!(p.sfcs.len(), 3);
        assert_eq!(p.sfcs[0].rate_mpps, 0.001);
        assert_eq!(p.vnfs[0].cost_cycles, 5000.0);
        assert_eq!((p.sfcs[1].rate_mpps, p.vnfs[1].cost_cycles), (0.0, 1.0));
        assert_eq!((p.sfcs[2].rate_mpps, p.vnfs[2].cost_cycles), (0.0, 1.0));
    }

    #[test]
    fn heavy_workers_go_to_different_cores() {
        // Two heavy workers (0.6 of a core each) and four light ones on two cores:
        // LLF, FFD and s2c keep the heavy ones apart, RR (worker i on core i mod 2)
        // puts them together.
        let l = loads(
            &[1e4, 1e2, 1e4, 1e2, 1e2, 1e2],
            &[60_000.0, 1000.0, 60_000.0, 1000.0, 1000.0, 1000.0],
        );
        let rr = RoundRobin.assign(2, &l);
        assert_eq!(rr[0], rr[2]);
        for name in ["llf", "ffd", "s2c"] {
            let (a, why) = assigner_by_name(name, None).unwrap();
            assert!(why.is_none(), "{name}: {why:?}");
            let c = a.assign(2, &l);
            assert_eq!(c.len(), 6);
            assert!(c.iter().all(|&m| m < 2));
            assert_ne!(
                c[0], c[2],
                "{name} put both heavy workers on one core: {c:?}"
            );
        }
    }

    #[test]
    fn bad_names_and_models() {
        assert!(assigner_by_name("fastest", None).is_err());
        let dir = std::env::temp_dir().join(format!("sc-assign-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("model.safetensors");
        std::fs::write(&bad, b"not a model").unwrap();
        for p in [bad.clone(), dir.join("missing.safetensors")] {
            let (a, why) = assigner_by_name("s2c", Some(&p)).unwrap();
            assert_eq!(a.name(), "rr");
            assert!(why.unwrap().contains("using RR"));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn too_many_workers_for_the_model_is_rr_and_counted() {
        let m = Sfc2cpuModel::shipped().unwrap();
        let s = Sfc2cpu::new(Box::new(m.assigner()), true);
        let l = loads(&[100.0; 40], &[1000.0; 40]);
        assert_eq!(s.assign(2, &l), RoundRobin.assign(2, &l));
        assert_eq!(s.refusals(), 1);
    }

    #[test]
    fn fallback_applies_after_the_baseline_and_reverts_on_regression() {
        let cfg = WatchdogConfig {
            tolerance: 0.05,
            window: 3,
        };
        let mut f = Fallback::new(cfg);
        assert_eq!(f.observe(100.0), FallbackStep::Stay);
        assert_eq!(f.observe(f64::NAN), FallbackStep::Stay);
        assert_eq!(f.observe(100.0), FallbackStep::Stay);
        assert_eq!(
            f.observe(100.0),
            FallbackStep::ApplyWatched {
                rr_throughput: 100.0
            }
        );
        assert!(f.watched_active());
        // 4 % below: kept.
        for _ in 0..5 {
            assert_eq!(f.observe(96.0), FallbackStep::Stay);
        }
        // Falls to 90: the mean of the window drops under 95.
        let mut step = FallbackStep::Stay;
        for _ in 0..3 {
            step = f.observe(90.0);
            if step != FallbackStep::Stay {
                break;
            }
        }
        assert!(matches!(step, FallbackStep::RevertToRr { .. }), "{step:?}");
        assert_eq!(f.fallbacks(), 1);
        assert!(f.last_reason().unwrap().contains("below RR"));
        assert!(!f.watched_active());
        assert_eq!(f.observe(10.0), FallbackStep::Stay);
        f.restart();
        assert_eq!(f.observe(10.0), FallbackStep::Stay);
    }
}
