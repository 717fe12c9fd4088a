//! `starfabric bench placement`: every algorithm of the crate on held-out workloads.
//!
//! Three parts, each with its own instances (docs/placement.md, "Bench"):
//! 1. **Online** (the emulator of [`crate::sim`]): held-out generated workloads
//!    (`test_seed`, never a training seed) or the operator's `--workload FILE`, run
//!    with First Fit, Best Fit and the DDQN agent, each reserving current demand and
//!    reserving with the Holt-Winters forecaster. Cost is the emulator's (node-time
//!    plus migrations).
//! 2. **Small offline instances** (≤ 12 nodes, ≤ 20 tenants, cut from held-out
//!    workloads): Eq. 1 cost of FF, BF, FFD, the DDQN agent placing sequentially, and
//!    the MILP optimum with its gap.
//! 3. **RGCM** (Zeta §VI-A): λ of the rounded mapping against the GCM MILP on small
//!    random instances, and Theorems 4–5 checked on every one.
//!
//! Plus the decision time of the DDQN agent at 1,000 nodes. Nothing is timed in a
//! test; this is the measurement.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use crate::ddqn::DdqnModel;
use crate::forecast::HoltWinters;
use crate::heuristics::{best_fit, first_fit, first_fit_decreasing, place_all, BestFit, FirstFit};
use crate::milp;
use crate::problem::{self, check, PlaceError, Placer};
use crate::rgcm;
use crate::sim::{self, percentile, CurrentDemand, Reserve, SimOptions, SimReport};
use crate::workload::{generate, snapshot_instance, test_seed, GenSpec, Workload};

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Held-out generated workloads (ignored with `workload`).
    pub instances: usize,
    /// Pool size of the generated workloads.
    pub nodes: usize,
    /// An operator's workload instead of the generated ones.
    pub workload: Option<Workload>,
    /// Small offline instances for the MILP comparison, and their size.
    pub small_instances: usize,
    pub small_nodes: usize,
    pub small_tenants: usize,
    pub milp_time_limit: Duration,
    /// Random GCM instances for RGCM against its MILP.
    pub gcm_instances: usize,
    /// Pool size and steps of the decision-time run.
    pub decision_nodes: usize,
    pub decision_steps: usize,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            instances: 3,
            nodes: 60,
            workload: None,
            small_instances: 5,
            small_nodes: 10,
            small_tenants: 14,
            milp_time_limit: Duration::from_secs(10),
            gcm_instances: 10,
            decision_nodes: 1000,
            decision_steps: 4,
        }
    }
}

/// One small instance's costs.
#[derive(Debug, Clone, Serialize)]
pub struct SmallRow {
    pub seed: u64,
    pub nodes: usize,
    pub tenants: usize,
    pub cost: BTreeMap<String, f64>,
    pub milp_bound: f64,
    pub milp_gap: f64,
    pub milp_status: String,
}

/// One GCM instance.
#[derive(Debug, Clone, Serialize)]
pub struct GcmRow {
    pub seed: u64,
    pub lambda_lp: f64,
    pub lambda_rgcm: f64,
    pub lambda_milp: f64,
    pub milp_optimal: bool,
    pub bound_ok: bool,
}

/// Everything the bench prints (`--json`).
#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    /// Online: mean emulator cost per algorithm reserving current demand (`ff`, `bf`,
    /// `ddqn`) and with the forecaster (`ff_forecast`, `bf_forecast`, `ddqn_forecast`).
    pub cost: BTreeMap<String, f64>,
    /// Small offline instances: mean Eq. 1 cost (`ff`, `bf`, `ffd`, `ddqn`, `milp`).
    pub cost_small: BTreeMap<String, f64>,
    /// Ratios of mean online cost.
    pub ddqn_vs_ff: f64,
    pub ddqn_vs_bf: f64,
    /// Mean over small instances of ddqn / milp cost.
    pub ddqn_vs_milp: f64,
    /// 1 − cost(ddqn_forecast) / cost(ddqn).
    pub forecast_gain: f64,
    /// Mean λ(RGCM) / λ(MILP) over the GCM instances.
    pub rgcm_vs_milp: f64,
    /// Theorems 4 and 5 held on every GCM instance.
    pub rgcm_bound_ok: bool,
    /// Constraint violations and refused answers, all algorithms, all parts.
    pub violations: usize,
    /// Arrivals no algorithm could place (a pool too small), per algorithm.
    pub rejected: BTreeMap<String, usize>,
    pub migrations: BTreeMap<String, f64>,
    pub decision_ms_p99: f64,
    pub decision_ms_p99_bf: f64,
    pub decision_nodes: usize,
    pub online_instances: usize,
    pub small: Vec<SmallRow>,
    pub gcm: Vec<GcmRow>,
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// Runs the bench; `progress` hears one line per finished piece.
pub fn run(
    opts: &BenchOptions,
    model: &DdqnModel,
    progress: &mut dyn FnMut(&str),
) -> Result<BenchReport, PlaceError> {
    let sim_opts = SimOptions::default();
    let workloads: Vec<Workload> = match &opts.workload {
        Some(w) => vec![w.clone()],
        None => (0..opts.instances as u64)
            .map(|i| generate(&GenSpec::standard(opts.nodes), test_seed(i)))
            .collect::<Result<_, _>>()?,
    };
    let mut online: BTreeMap<String, Vec<SimReport>> = BTreeMap::new();
    let mut violations = 0usize;
    for (i, w) in workloads.iter().enumerate() {
        for forecast in [false, true] {
            let placers: Vec<(&str, Box<dyn Placer>)> = vec![
                ("ff", Box::new(FirstFit::default())),
                ("bf", Box::new(BestFit::default())),
                ("ddqn", Box::new(model.placer()?)),
            ];
            for (name, mut p) in placers {
                let mut reserve: Box<dyn Reserve> = if forecast {
                    Box::new(HoltWinters::for_period(w.period)?)
                } else {
                    Box::new(CurrentDemand)
                };
                let r = sim::run(w, p.as_mut(), reserve.as_mut(), &sim_opts)?;
                violations += r.violations + r.bad_answers;
                let key = if forecast {
                    format!("{name}_forecast")
                } else {
                    name.to_string()
                };
                progress(&format!(
                    "online {} {key}: cost {:.1} (nodes {:.1} + moves {:.1}), {} migrations, {} rejected",
                    i + 1,
                    r.cost,
                    r.node_cost,
                    r.migration_cost,
                    r.migrations,
                    r.rejected
                ));
                online.entry(key).or_default().push(r);
            }
        }
    }
    let cost: BTreeMap<String, f64> = online
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                mean(&v.iter().map(|r| r.cost).collect::<Vec<_>>()),
            )
        })
        .collect();
    let rejected = online
        .iter()
        .map(|(k, v)| (k.clone(), v.iter().map(|r| r.rejected).sum()))
        .collect();
    let migrations = online
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                mean(&v.iter().map(|r| r.migrations as f64).collect::<Vec<_>>()),
            )
        })
        .collect();

    // Small offline instances, cut from held-out workloads at mid-day.
    let mut small = Vec::new();
    for i in 0..opts.small_instances as u64 {
        let seed = test_seed(10_000 + i);
        let w = generate(&GenSpec::standard(opts.small_nodes.max(4) * 3), seed)?;
        let inst = snapshot_instance(&w, w.steps / 2, opts.small_nodes, opts.small_tenants)?;
        let order: Vec<usize> = (0..inst.requests.len()).collect();
        let mut row = SmallRow {
            seed,
            nodes: inst.nodes.len(),
            tenants: inst.requests.len(),
            cost: BTreeMap::new(),
            milp_bound: 0.0,
            milp_gap: 0.0,
            milp_status: String::new(),
        };
        let answers = [
            ("ff", first_fit(&inst)),
            ("bf", best_fit(&inst)),
            ("ffd", first_fit_decreasing(&inst)),
            ("ddqn", place_all(&inst, &mut model.placer()?, &order)),
        ];
        let mut skip = false;
        for (name, p) in answers {
            match p {
                Ok(p) => {
                    violations += check(&inst, &p).len();
                    row.cost.insert(name.into(), problem::cost(&inst, &p));
                }
                Err(e) => {
                    progress(&format!("small {}: {name} found no placement: {e}", i + 1));
                    skip = true;
                }
            }
        }
        let m = milp::solve(
            &inst,
            &milp::MilpOptions {
                time_limit: opts.milp_time_limit,
                ..Default::default()
            },
        )?;
        violations += check(&inst, &m.placement).len();
        row.cost.insert("milp".into(), m.cost);
        row.milp_bound = m.lower_bound;
        row.milp_gap = m.gap;
        row.milp_status = format!("{:?}", m.status);
        progress(&format!(
            "small {} ({} nodes, {} tenants): {:?}, MILP gap {:.3} ({})",
            i + 1,
            row.nodes,
            row.tenants,
            row.cost,
            row.milp_gap,
            row.milp_status
        ));
        if !skip {
            small.push(row);
        }
    }
    let cost_small: BTreeMap<String, f64> = ["ff", "bf", "ffd", "ddqn", "milp"]
        .iter()
        .map(|k| {
            (
                k.to_string(),
                mean(
                    &small
                        .iter()
                        .filter_map(|r| r.cost.get(*k).copied())
                        .collect::<Vec<_>>(),
                ),
            )
        })
        .collect();
    let ddqn_vs_milp = mean(
        &small
            .iter()
            .filter_map(|r| Some(r.cost.get("ddqn")? / r.cost.get("milp")?.max(1e-9)))
            .collect::<Vec<_>>(),
    );

    // RGCM against the GCM MILP.
    let mut gcm = Vec::new();
    for i in 0..opts.gcm_instances as u64 {
        let seed = test_seed(20_000 + i);
        let (n, d, v, k) = (4, 8, 2, 2);
        let max_demand = 0.6 * n as f64 * 100.0 * 4.0 / (d as f64 * (v as f64 + 1.0));
        let inst = rgcm::random_instance(seed, n, d, v, max_demand, k, true);
        let r = rgcm::rgcm(
            &inst,
            &rgcm::RgcmOptions {
                seed,
                ..Default::default()
            },
        )?;
        let m = rgcm::solve_milp(&inst, &rgcm::MilpOptions::default())?;
        let row = GcmRow {
            seed,
            lambda_lp: r.lambda_lp,
            lambda_rgcm: r.lambda,
            lambda_milp: m.lambda,
            milp_optimal: m.optimal,
            bound_ok: r.bound_ok(),
        };
        progress(&format!(
            "gcm {}: λ̃ {:.3}, RGCM {:.3}, MILP {:.3}{}, bounds {}",
            i + 1,
            row.lambda_lp,
            row.lambda_rgcm,
            row.lambda_milp,
            if row.milp_optimal {
                ""
            } else {
                " (time limit)"
            },
            if row.bound_ok { "hold" } else { "FAIL" }
        ));
        gcm.push(row);
    }
    let rgcm_vs_milp = mean(
        &gcm.iter()
            .map(|g| g.lambda_rgcm / g.lambda_milp.max(1e-12))
            .collect::<Vec<_>>(),
    );
    let rgcm_bound_ok = gcm.iter().all(|g| g.bound_ok);

    // Decision time at 1,000 nodes: the first steps of a held-out day.
    let mut spec = GenSpec::standard(opts.decision_nodes);
    spec.steps = opts.decision_steps.max(1);
    let w = generate(&spec, test_seed(30_000))?;
    let r = sim::run(&w, &mut model.placer()?, &mut CurrentDemand, &sim_opts)?;
    violations += r.violations + r.bad_answers;
    let rb = sim::run(&w, &mut BestFit::default(), &mut CurrentDemand, &sim_opts)?;
    violations += rb.violations + rb.bad_answers;
    let decision_ms_p99 = percentile(&r.decision_ms, 0.99);
    let decision_ms_p99_bf = percentile(&rb.decision_ms, 0.99);
    progress(&format!(
        "decisions at {} nodes: ddqn p99 {:.2} ms, bf p99 {:.2} ms ({} decisions)",
        opts.decision_nodes,
        decision_ms_p99,
        decision_ms_p99_bf,
        r.decision_ms.len()
    ));

    let c = |k: &str| cost.get(k).copied().unwrap_or(f64::NAN);
    Ok(BenchReport {
        ddqn_vs_ff: c("ddqn") / c("ff"),
        ddqn_vs_bf: c("ddqn") / c("bf"),
        ddqn_vs_milp,
        forecast_gain: 1.0 - c("ddqn_forecast") / c("ddqn"),
        rgcm_vs_milp,
        rgcm_bound_ok,
        violations,
        rejected,
        migrations,
        decision_ms_p99,
        decision_ms_p99_bf,
        decision_nodes: opts.decision_nodes,
        online_instances: workloads.len(),
        cost,
        cost_small,
        small,
        gcm,
    })
}
