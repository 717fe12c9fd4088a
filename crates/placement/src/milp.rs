//! The exact optimum of paper 000 App. A.1 (Eq. 1–6) as a mixed-integer linear
//! program, for small instances: it is the yardstick the heuristics and the DDQN agent
//! are measured against, not something the orchestrator runs online.
//!
//! Eq. 2–4 divide a tenant's demand by its group size G^i, itself a variable, and
//! Eq. 6 multiplies two placement variables; both are linearised exactly (see
//! `docs/placement.md`, "The MILP"):
//!
//! - `w[i][k]` (binary) picks G^i = `gs[k]`; `u[e][i][k]` (continuous in [0, 1]) is
//!   x_e^i ∧ w_i^k through Σ_k u = x_e^i, Σ_e u = g_k·w_i^k and u ≤ w_i^k. With x and
//!   w integral, u is forced to the product, and the load on e is the linear
//!   Σ_i Σ_k (b^i/g_k)·`u[e][i][k]` ≤ U·B_e·y_e.
//! - `s[e][p]` ≥ x_e^i + x_e^j − 1 (continuous, ≥ 0) is x_e^i·x_e^j for the pair p =
//!   (i, j) wherever it matters, and Σ_e `s[e][p]` ≤ O is Eq. 6.
//!
//! The search is microlp's branch and bound behind good_lp, with a wall-clock limit,
//! seeded with the cheapest of First Fit, Best Fit and FFD. The bound it reports is
//! the smallest LP bound of the nodes still open, so the gap is a true one. HiGHS can
//! replace microlp behind the `highs` feature.

use std::time::{Duration, Instant};

use good_lp::{
    variable, Expression, ProblemVariables, ResolutionError, Solution, SolutionStatus, SolverModel,
    Variable, WithInitialSolution, WithMipGap, WithTimeLimit,
};
use serde::Serialize;
use tracing::{debug, info, warn};

use crate::heuristics::{best_fit, first_fit, first_fit_decreasing};
use crate::problem::{check, cost, Instance, NodeIdx, PlaceError, Placement, Resource};

/// Largest instance [`solve`] accepts: beyond this the branch and bound rarely closes
/// its gap in minutes, and the model (pairs × nodes overlap rows) grows quadratically.
pub const MAX_NODES: usize = 12;
/// See [`MAX_NODES`].
pub const MAX_REQUESTS: usize = 20;

/// Which MILP solver runs the branch and bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// microlp: pure Rust, always built.
    #[default]
    MicroLp,
    /// HiGHS (feature `highs`).
    #[cfg(feature = "highs")]
    Highs,
}

/// How long and how exactly to solve.
#[derive(Debug, Clone, PartialEq)]
pub struct MilpOptions {
    /// Wall-clock budget of the solver call (the heuristic seed and the model build
    /// come on top; both take milliseconds).
    pub time_limit: Duration,
    /// Stop once (incumbent − bound) / incumbent ≤ this; 0 asks for a proof.
    pub mip_gap: f64,
    pub backend: Backend,
    /// Seed the search with the cheapest heuristic placement.
    pub warm_start: bool,
}

impl Default for MilpOptions {
    fn default() -> Self {
        MilpOptions {
            time_limit: Duration::from_secs(10),
            mip_gap: 0.0,
            backend: Backend::default(),
            warm_start: true,
        }
    }
}

/// How the search ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MilpStatus {
    /// Proven optimal: the bound met the incumbent.
    Optimal,
    /// Stopped with the gap within [`MilpOptions::mip_gap`].
    GapLimit,
    /// The time limit ran out first; `gap` says how far from proven the answer is.
    TimeLimit,
    /// The solver gave no usable placement in time (or one [`check`] refused), so this
    /// is the best heuristic's; the bound is still a valid one.
    Heuristic,
}

/// The answer of [`solve`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MilpResult {
    /// Passes [`check`].
    pub placement: Placement,
    /// Eq. 1 of `placement`.
    pub cost: f64,
    /// No placement costs less than this.
    pub lower_bound: f64,
    /// (cost − lower_bound) / cost, 0 when cost is 0.
    pub gap: f64,
    pub status: MilpStatus,
    /// Cost of the cheapest heuristic placement, if any heuristic found one.
    pub heuristic_cost: Option<f64>,
    pub elapsed: Duration,
}

/// Solves `inst` to optimality, or as far as `opts.time_limit` allows.
///
/// Refuses instances over [`MAX_NODES`] nodes or [`MAX_REQUESTS`] requests
/// ([`PlaceError::Invalid`] naming `nodes` or `requests`), malformed ones (as
/// [`Instance::validate`]), and answers [`PlaceError::Infeasible`] when no placement
/// satisfies Eq. 2–6.
pub fn solve(inst: &Instance, opts: &MilpOptions) -> Result<MilpResult, PlaceError> {
    let t0 = Instant::now();
    validate(inst, opts)?;
    precheck_tenants(inst)?;
    if inst.requests.is_empty() {
        return Ok(MilpResult {
            placement: Placement::default(),
            cost: 0.0,
            lower_bound: 0.0,
            gap: 0.0,
            status: MilpStatus::Optimal,
            heuristic_cost: Some(0.0),
            elapsed: t0.elapsed(),
        });
    }

    let seed = best_heuristic(inst);
    let heuristic_cost = seed.as_ref().map(|p| cost(inst, p));
    let classes = node_classes(inst);
    let seed = seed.map(|p| canonical(inst, &classes, &p));

    let model = Model::new(inst, &classes, false);
    info!(
        nodes = inst.nodes.len(),
        requests = inst.requests.len(),
        variables = model.n_vars,
        heuristic_cost,
        "milp: solving"
    );
    let hint = match (&seed, opts.warm_start) {
        (Some(p), true) => model.layout.hint(p),
        _ => Vec::new(),
    };
    let out = match opts.backend {
        Backend::MicroLp => run_microlp(model, hint, opts),
        #[cfg(feature = "highs")]
        Backend::Highs => run_highs(inst, &classes, model, hint, opts),
    };
    let solved = match out {
        Ok(s) => s,
        Err(ResolutionError::Infeasible) => {
            return Err(PlaceError::Infeasible {
                tenant: None,
                reason: format!(
                    "no placement of the {} requests on the {} nodes satisfies Eq. 2-6 \
                     ({}); proved by the MILP",
                    inst.requests.len(),
                    inst.nodes.len(),
                    inst.limits,
                ),
            })
        }
        Err(e) => {
            // Most often the time limit struck before the root relaxation was solved:
            // nothing was proved, so fall back on the heuristic and a solver-free bound.
            warn!(error = %e, "milp: the solver returned no placement");
            Solved {
                placement: None,
                bound: None,
                status: SolutionStatus::TimeLimit,
                solver_error: Some(e.to_string()),
            }
        }
    };

    let mut status = match solved.status {
        SolutionStatus::Optimal => MilpStatus::Optimal,
        SolutionStatus::GapLimit => MilpStatus::GapLimit,
        SolutionStatus::TimeLimit => MilpStatus::TimeLimit,
    };
    let mut placement = solved.placement.filter(|p| {
        let v = check(inst, p);
        if !v.is_empty() {
            warn!(violations = ?v, "milp: the solver's placement fails the checker");
        }
        v.is_empty()
    });
    if let (Some(p), Some(s)) = (&placement, &seed) {
        // The solver may have dropped the hint and stopped on something worse.
        if cost(inst, s) < cost(inst, p) {
            placement = Some(s.clone());
            status = MilpStatus::Heuristic;
        }
    }
    let placement = match placement {
        Some(p) => p,
        None => match seed {
            Some(s) => {
                status = MilpStatus::Heuristic;
                s
            }
            None => {
                return Err(PlaceError::Model(format!(
                    "the MILP found no placement within {:?} and no heuristic found one \
                     either; feasibility is unknown ({})",
                    opts.time_limit,
                    solved.solver_error.unwrap_or_default()
                )))
            }
        },
    };
    let c = cost(inst, &placement);
    let bound = match (status, solved.bound) {
        (MilpStatus::Optimal, _) => c,
        (_, Some(b)) => b.max(simple_bound(inst)),
        (_, None) => simple_bound(inst),
    };
    // A bound above the cost can only be solver tolerance; never report a negative gap.
    let lower_bound = bound.min(c);
    let gap = if c > 0.0 { (c - lower_bound) / c } else { 0.0 };
    let res = MilpResult {
        placement,
        cost: c,
        lower_bound,
        gap,
        status,
        heuristic_cost,
        elapsed: t0.elapsed(),
    };
    info!(
        cost = res.cost,
        lower_bound = res.lower_bound,
        gap = res.gap,
        status = ?res.status,
        elapsed_ms = res.elapsed.as_millis() as u64,
        "milp: done"
    );
    Ok(res)
}

fn validate(inst: &Instance, opts: &MilpOptions) -> Result<(), PlaceError> {
    if inst.nodes.len() > MAX_NODES {
        return Err(PlaceError::invalid(
            "nodes",
            format!(
                "the MILP takes at most {MAX_NODES} nodes, got {}",
                inst.nodes.len()
            ),
        ));
    }
    if inst.requests.len() > MAX_REQUESTS {
        return Err(PlaceError::invalid(
            "requests",
            format!(
                "the MILP takes at most {MAX_REQUESTS} requests, got {}",
                inst.requests.len()
            ),
        ));
    }
    if !opts.mip_gap.is_finite() || opts.mip_gap < 0.0 {
        return Err(PlaceError::invalid(
            "mip_gap",
            format!("must be a finite number ≥ 0, got {}", opts.mip_gap),
        ));
    }
    if opts.time_limit.is_zero() {
        return Err(PlaceError::invalid("time_limit", "must be > 0"));
    }
    inst.validate()
}

/// The group sizes G^i may take: more nodes than exist is no option.
fn group_sizes(inst: &Instance) -> Vec<usize> {
    let hi = inst.limits.g_max.min(inst.nodes.len());
    (inst.limits.g_min..=hi).collect()
}

/// Names a tenant no group size fits even on an empty cluster, which the solver
/// could only report as "infeasible" without saying who.
fn precheck_tenants(inst: &Instance) -> Result<(), PlaceError> {
    let u = inst.limits.threshold;
    let gs = group_sizes(inst);
    for r in &inst.requests {
        let fits = gs.iter().any(|&g| {
            let share = r.demand.scale(1.0 / g as f64);
            let room = inst
                .nodes
                .iter()
                .filter(|n| share.fits_in(&n.capacity.scale(u)))
                .count();
            room >= g
        });
        if !fits {
            return Err(PlaceError::infeasible(
                &r.tenant,
                format!(
                    "for no G in [{}, {}] do G of the {} nodes each have U·capacity for \
                     demand/G (demand bw {}, cpu {}, mem {})",
                    inst.limits.g_min,
                    inst.limits.g_max,
                    inst.nodes.len(),
                    r.demand.bw,
                    r.demand.cpu,
                    r.demand.mem
                ),
            ));
        }
    }
    Ok(())
}

/// The cheapest placement First Fit, Best Fit and FFD find, if any finds one.
fn best_heuristic(inst: &Instance) -> Option<Placement> {
    let mut best: Option<(f64, Placement)> = None;
    for (name, p) in [
        ("ffd", first_fit_decreasing(inst)),
        ("bf", best_fit(inst)),
        ("ff", first_fit(inst)),
    ] {
        match p {
            Ok(p) if check(inst, &p).is_empty() => {
                let c = cost(inst, &p);
                debug!(heuristic = name, cost = c, "milp: seed candidate");
                if best.as_ref().is_none_or(|(b, _)| c < *b) {
                    best = Some((c, p));
                }
            }
            Ok(_) => warn!(
                heuristic = name,
                "milp: heuristic placement fails the checker"
            ),
            Err(e) => debug!(heuristic = name, error = %e, "milp: heuristic found nothing"),
        }
    }
    best.map(|(_, p)| p)
}

/// Groups of interchangeable nodes: same capacity and price, in index order. Any
/// placement stays feasible and costs the same when nodes of one group are permuted,
/// which is what makes the symmetry-breaking rows valid.
fn node_classes(inst: &Instance) -> Vec<Vec<NodeIdx>> {
    let key = |e: NodeIdx| {
        let n = &inst.nodes[e];
        [
            n.capacity.bw.to_bits(),
            n.capacity.cpu.to_bits(),
            n.capacity.mem.to_bits(),
            n.price.to_bits(),
        ]
    };
    let mut classes: Vec<Vec<NodeIdx>> = Vec::new();
    for e in 0..inst.nodes.len() {
        match classes.iter_mut().find(|c| key(c[0]) == key(e)) {
            Some(c) => c.push(e),
            None => classes.push(vec![e]),
        }
    }
    classes
}

/// `p` with the nodes of each class permuted so that the used ones come first, as the
/// symmetry-breaking rows (y_e ≥ y_e' within a class) require of a warm start.
fn canonical(inst: &Instance, classes: &[Vec<NodeIdx>], p: &Placement) -> Placement {
    let mut used = vec![false; inst.nodes.len()];
    for set in &p.sets {
        for &e in set {
            if e < used.len() {
                used[e] = true;
            }
        }
    }
    let mut map: Vec<NodeIdx> = (0..inst.nodes.len()).collect();
    for c in classes {
        let (a, b): (Vec<NodeIdx>, Vec<NodeIdx>) = c.iter().partition(|&&e| used[e]);
        for (&to, from) in c.iter().zip(a.into_iter().chain(b)) {
            map[from] = to;
        }
    }
    Placement {
        sets: p
            .sets
            .iter()
            .map(|s| {
                let mut s: Vec<NodeIdx> = s.iter().map(|&e| map[e]).collect();
                s.sort_unstable();
                s
            })
            .collect(),
    }
}

/// The variables and rows of Eq. 1–6, solver-independent.
struct Model {
    vars: ProblemVariables,
    objective: Expression,
    constraints: Vec<good_lp::Constraint>,
    layout: Layout,
    n_vars: usize,
}

/// Where the integer variables are, to write a hint and read an answer.
struct Layout {
    /// x[e][i]
    x: Vec<Vec<Variable>>,
    y: Vec<Variable>,
    /// w[i][k]: G^i = gs[k]
    w: Vec<Vec<Variable>>,
    gs: Vec<usize>,
}

impl Model {
    /// `relax` builds the LP relaxation (every binary in [0, 1]).
    fn new(inst: &Instance, classes: &[Vec<NodeIdx>], relax: bool) -> Model {
        let n = inst.nodes.len();
        let m = inst.requests.len();
        let gs = group_sizes(inst);
        let lim = &inst.limits;
        let bin = || {
            if relax {
                variable().min(0.0).max(1.0)
            } else {
                variable().binary()
            }
        };
        let mut vars = ProblemVariables::new();
        let y: Vec<Variable> = (0..n).map(|_| vars.add(bin())).collect();
        let x: Vec<Vec<Variable>> = (0..n)
            .map(|_| (0..m).map(|_| vars.add(bin())).collect())
            .collect();
        let w: Vec<Vec<Variable>> = (0..m)
            .map(|_| gs.iter().map(|_| vars.add(bin())).collect())
            .collect();
        let u: Vec<Vec<Vec<Variable>>> = (0..n)
            .map(|_| {
                (0..m)
                    .map(|_| {
                        gs.iter()
                            .map(|_| vars.add(variable().min(0.0).max(1.0)))
                            .collect()
                    })
                    .collect()
            })
            .collect();
        let mut c = Vec::new();

        let mut objective = Expression::with_capacity(n);
        for (e, node) in inst.nodes.iter().enumerate() {
            objective.add_mul(node.price, y[e]);
        }

        for i in 0..m {
            // Eq. 5: exactly one G^i in [G_min, G_max].
            let mut one = Expression::with_capacity(gs.len());
            for &wk in &w[i] {
                one.add_mul(1.0, wk);
            }
            c.push(one.eq(1.0));
            for (k, &g) in gs.iter().enumerate() {
                // Σ_e x_e^i = G^i, disaggregated by G.
                let mut cnt = Expression::with_capacity(n + 1);
                for ue in &u {
                    cnt.add_mul(1.0, ue[i][k]);
                }
                cnt.add_mul(-(g as f64), w[i][k]);
                c.push(cnt.eq(0.0));
            }
            for e in 0..n {
                let mut link = Expression::with_capacity(gs.len() + 1);
                for k in 0..gs.len() {
                    link.add_mul(1.0, u[e][i][k]);
                    // Implied for integral points, but it tightens the relaxation.
                    let mut le = Expression::with_capacity(2);
                    le.add_mul(1.0, u[e][i][k]);
                    le.add_mul(-1.0, w[i][k]);
                    c.push(le.leq(0.0));
                }
                link.add_mul(-1.0, x[e][i]);
                c.push(link.eq(0.0));
                // A node carrying a tenant is bought; Eq. 2–4 say it too, weakly.
                let mut buy = Expression::with_capacity(2);
                buy.add_mul(1.0, x[e][i]);
                buy.add_mul(-1.0, y[e]);
                c.push(buy.leq(0.0));
            }
        }

        // Eq. 2–4 with G^i linearised through u.
        for (e, node) in inst.nodes.iter().enumerate() {
            for r in Resource::ALL {
                let mut load = Expression::with_capacity(m * gs.len() + 1);
                for (i, req) in inst.requests.iter().enumerate() {
                    let d = req.demand.get(r);
                    if d == 0.0 {
                        continue;
                    }
                    for (k, &g) in gs.iter().enumerate() {
                        load.add_mul(d / g as f64, u[e][i][k]);
                    }
                }
                load.add_mul(-lim.threshold * node.capacity.get(r), y[e]);
                c.push(load.leq(0.0));
            }
        }

        // Eq. 6, only where two groups could share more than O nodes.
        let g_hi = gs.last().copied().unwrap_or(0);
        if lim.overlap < g_hi {
            for i in 0..m {
                for j in i + 1..m {
                    let mut shared = Expression::with_capacity(n);
                    for xe in &x {
                        let s = vars.add(variable().min(0.0).max(1.0));
                        let mut both = Expression::with_capacity(3);
                        both.add_mul(1.0, xe[i]);
                        both.add_mul(1.0, xe[j]);
                        both.add_mul(-1.0, s);
                        c.push(both.leq(1.0));
                        shared.add_mul(1.0, s);
                    }
                    c.push(shared.leq(lim.overlap as f64));
                }
            }
        }

        // Symmetry: within a class of identical nodes, buy the lower indices first.
        for cl in classes {
            for pair in cl.windows(2) {
                let mut ord = Expression::with_capacity(2);
                ord.add_mul(1.0, y[pair[1]]);
                ord.add_mul(-1.0, y[pair[0]]);
                c.push(ord.leq(0.0));
            }
        }

        let n_vars = vars.len();
        Model {
            vars,
            objective,
            constraints: c,
            layout: Layout { x, y, w, gs },
            n_vars,
        }
    }
}

impl Layout {
    /// Values of the integer variables for placement `p` (the solver completes the
    /// continuous ones).
    fn hint(&self, p: &Placement) -> Vec<(Variable, f64)> {
        let mut h = Vec::new();
        let mut used = vec![false; self.y.len()];
        for (i, set) in p.sets.iter().enumerate() {
            for (e, xe) in self.x.iter().enumerate() {
                let on = set.contains(&e);
                used[e] |= on;
                h.push((xe[i], if on { 1.0 } else { 0.0 }));
            }
            for (k, &g) in self.gs.iter().enumerate() {
                h.push((self.w[i][k], if set.len() == g { 1.0 } else { 0.0 }));
            }
        }
        for (e, &yv) in self.y.iter().enumerate() {
            h.push((yv, if used[e] { 1.0 } else { 0.0 }));
        }
        h
    }

    fn decode(&self, sol: &impl Solution) -> Placement {
        let m = self.w.len();
        let sets = (0..m)
            .map(|i| {
                (0..self.x.len())
                    .filter(|&e| sol.value(self.x[e][i]) > 0.5)
                    .collect()
            })
            .collect();
        Placement { sets }
    }
}

/// What a backend returned.
struct Solved {
    placement: Option<Placement>,
    /// A proven lower bound on the optimum, when the backend gives one.
    bound: Option<f64>,
    status: SolutionStatus,
    solver_error: Option<String>,
}

fn run_microlp(
    model: Model,
    hint: Vec<(Variable, f64)>,
    opts: &MilpOptions,
) -> Result<Solved, ResolutionError> {
    let Model {
        vars,
        objective,
        constraints,
        layout,
        ..
    } = model;
    let mut problem = vars
        .minimise(objective)
        .using(good_lp::microlp)
        .with_time_limit(opts.time_limit.as_secs_f64())
        .with_mip_gap(opts.mip_gap as f32)
        .map_err(|e| ResolutionError::Str(e.to_string()))?;
    if !hint.is_empty() {
        problem = problem.with_initial_solution(hint);
    }
    let sol = problem.with_all(constraints).solve()?;
    let status = sol.status();
    let placement = layout.decode(&sol);
    let stats = sol.into_inner().stats();
    debug!(
        nodes = stats.nodes_solved,
        lp_iterations = stats.lp_iterations,
        best_bound = stats.best_bound,
        "microlp: stats"
    );
    Ok(Solved {
        placement: Some(placement),
        bound: stats.best_bound,
        status,
        solver_error: None,
    })
}

#[cfg(feature = "highs")]
fn run_highs(
    inst: &Instance,
    classes: &[Vec<NodeIdx>],
    model: Model,
    hint: Vec<(Variable, f64)>,
    opts: &MilpOptions,
) -> Result<Solved, ResolutionError> {
    let Model {
        vars,
        objective,
        constraints,
        layout,
        ..
    } = model;
    let mut problem = vars
        .minimise(objective.clone())
        .using(good_lp::highs)
        .set_time_limit(opts.time_limit.as_secs_f64())
        .set_mip_rel_gap(opts.mip_gap as f32)
        .map_err(|e| ResolutionError::Str(e.to_string()))?;
    if !hint.is_empty() {
        problem = problem.with_initial_solution(hint);
    }
    let sol = problem.with_all(constraints).solve()?;
    let status = sol.status();
    // good_lp does not hand HiGHS's dual bound through: only a proof counts here,
    // otherwise [`solve`] falls back on the LP relaxation.
    let placement = layout.decode(&sol);
    let bound = match status {
        SolutionStatus::Optimal => Some(objective.eval_with(&sol)),
        // good_lp does not hand HiGHS's dual bound through, so a stop before the
        // proof is bounded by the LP relaxation, solved apart.
        _ => highs_relaxation_bound(inst, classes, opts.time_limit),
    };
    Ok(Solved {
        placement: Some(placement),
        bound,
        status,
        solver_error: None,
    })
}

#[cfg(feature = "highs")]
fn highs_relaxation_bound(
    inst: &Instance,
    classes: &[Vec<NodeIdx>],
    limit: Duration,
) -> Option<f64> {
    let Model {
        vars,
        objective,
        constraints,
        ..
    } = Model::new(inst, classes, true);
    let sol = vars
        .minimise(objective.clone())
        .using(good_lp::highs)
        .set_time_limit(limit.as_secs_f64())
        .with_all(constraints)
        .solve();
    match sol {
        Ok(s) if matches!(s.status(), SolutionStatus::Optimal) => Some(objective.eval_with(&s)),
        Ok(_) => None,
        Err(e) => {
            warn!(error = %e, "milp: HiGHS LP relaxation failed");
            None
        }
    }
}

/// The least `cost` of the placements `feasible` accepts, by trying every combination of
/// node sets the limits allow: exponential, the reference the solvers are checked
/// against on tiny instances. `None` when none is feasible.
pub fn exhaustive_min(
    inst: &Instance,
    feasible: impl Fn(&Placement) -> bool,
    cost: impl Fn(&Placement) -> f64,
) -> Option<f64> {
    let n = inst.nodes.len();
    let l = &inst.limits;
    let sets: Vec<Vec<NodeIdx>> = (1u32..(1 << n))
        .map(|mask| (0..n).filter(|&e| mask & (1 << e) != 0).collect::<Vec<_>>())
        .filter(|s| (l.g_min..=l.g_max).contains(&s.len()))
        .collect();
    if sets.is_empty() {
        return None;
    }
    let m = inst.requests.len();
    let mut idx = vec![0usize; m];
    let mut best: Option<f64> = None;
    loop {
        let p = Placement {
            sets: idx.iter().map(|&k| sets[k].clone()).collect(),
        };
        if feasible(&p) {
            let c = cost(&p);
            best = Some(best.map_or(c, |b: f64| b.min(c)));
        }
        // The next combination: `idx` counts like an odometer in base `sets.len()`.
        let mut d = 0;
        loop {
            if d == m {
                return best;
            }
            idx[d] += 1;
            if idx[d] < sets.len() {
                break;
            }
            idx[d] = 0;
            d += 1;
        }
    }
}

/// A lower bound that needs no solver, for when the search stopped before its root
/// relaxation was solved: the larger of
/// - the G_min cheapest prices (every tenant needs G_min distinct nodes), and
/// - per resource, the cheapest fractional cover of the total demand by U·capacity
///   (the LP relaxation of that single aggregated row, solved greedily).
pub fn simple_bound(inst: &Instance) -> f64 {
    if inst.requests.is_empty() {
        return 0.0;
    }
    let mut prices: Vec<f64> = inst.nodes.iter().map(|n| n.price).collect();
    prices.sort_by(f64::total_cmp);
    let mut best: f64 = prices.iter().take(inst.limits.g_min).sum();
    for r in Resource::ALL {
        let mut need: f64 = inst.requests.iter().map(|q| q.demand.get(r)).sum();
        let mut by_value: Vec<(f64, f64)> = inst
            .nodes
            .iter()
            .map(|n| (n.price, inst.limits.threshold * n.capacity.get(r)))
            .filter(|&(_, cap)| cap > 0.0)
            .collect();
        by_value.sort_by(|a, b| (a.0 / a.1).total_cmp(&(b.0 / b.1)));
        let mut paid = 0.0;
        for (price, cap) in by_value {
            if need <= 0.0 {
                break;
            }
            let take = (need / cap).min(1.0);
            paid += take * price;
            need -= take * cap;
        }
        best = best.max(paid);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Limits, Node, Request, Resources};
    use crate::workload::{generate, snapshot_instance, GenSpec};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn opts() -> MilpOptions {
        MilpOptions {
            time_limit: Duration::from_secs(60),
            ..MilpOptions::default()
        }
    }

    /// A random tiny instance with mixed sizes and prices, so that the cheapest
    /// answer is not simply "the first nodes".
    fn tiny(seed: u64, nodes: usize, tenants: usize) -> Instance {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let nodes = (0..nodes)
            .map(|e| {
                let c = rng.gen_range(4.0..16.0);
                Node {
                    id: format!("n{e}"),
                    capacity: Resources::new(c, rng.gen_range(4.0..16.0), 2.0 * c),
                    price: (c / 4.0 * rng.gen_range(0.7..1.3) * 100.0).round() / 100.0,
                }
            })
            .collect();
        let requests = (0..tenants)
            .map(|i| Request {
                tenant: format!("t{i}"),
                demand: Resources::new(
                    rng.gen_range(0.5..9.0),
                    rng.gen_range(0.5..6.0),
                    rng.gen_range(0.5..10.0),
                ),
            })
            .collect();
        let g_min = rng.gen_range(1..=2);
        Instance {
            nodes,
            requests,
            limits: Limits {
                threshold: rng.gen_range(0.6..=1.0),
                g_min,
                g_max: rng.gen_range(g_min..=3),
                overlap: rng.gen_range(0..=2),
            },
        }
    }

    /// Every combination of node sets, the slow way.
    fn brute_force(inst: &Instance) -> Option<f64> {
        exhaustive_min(inst, |p| check(inst, p).is_empty(), |p| cost(inst, p))
    }

    #[test]
    fn equals_brute_force_on_tiny_instances() {
        let mut compared = 0;
        let mut beat_heuristics = 0;
        for seed in 0..12 {
            let inst = tiny(seed, 4, 3);
            let exact = brute_force(&inst);
            match (solve(&inst, &opts()), exact) {
                (Ok(r), Some(best)) => {
                    assert_eq!(check(&inst, &r.placement), vec![], "seed {seed}");
                    assert_eq!(r.status, MilpStatus::Optimal, "seed {seed}");
                    assert!(
                        (r.cost - best).abs() < 1e-9,
                        "seed {seed}: milp {} vs brute force {best}",
                        r.cost
                    );
                    assert!(r.gap.abs() < 1e-9 && (r.lower_bound - best).abs() < 1e-6);
                    if r.heuristic_cost.is_none_or(|h| h > best + 1e-9) {
                        beat_heuristics += 1;
                    }
                    compared += 1;
                }
                (Err(PlaceError::Infeasible { .. }), None) => {}
                (got, want) => panic!("seed {seed}: milp {got:?}, brute force {want:?}"),
            }
        }
        assert!(compared >= 6, "only {compared} feasible tiny instances");
        // Not a requirement of the MILP, but if the heuristics were always optimal
        // here this test would not show that the MILP finds anything on its own.
        assert!(
            beat_heuristics > 0,
            "the heuristics were optimal every time"
        );
    }

    #[test]
    fn never_worse_than_a_heuristic_on_generated_snapshots() {
        let mut spec = GenSpec::standard(8);
        spec.limits.g_max = 3;
        let mut solved = 0;
        for seed in 0..4 {
            let w = generate(&spec, seed).unwrap();
            let inst = snapshot_instance(&w, 10, 8, 8).unwrap();
            let r = solve(&inst, &opts()).unwrap();
            assert_eq!(check(&inst, &r.placement), vec![]);
            assert!((r.cost - cost(&inst, &r.placement)).abs() < 1e-12);
            assert!(r.lower_bound <= r.cost + 1e-9);
            for (name, p) in [
                ("ff", first_fit(&inst)),
                ("bf", best_fit(&inst)),
                ("ffd", first_fit_decreasing(&inst)),
            ] {
                if let Ok(p) = p {
                    assert!(
                        r.cost <= cost(&inst, &p) + 1e-9,
                        "seed {seed}: milp {} > {name} {}",
                        r.cost,
                        cost(&inst, &p)
                    );
                    // The bound holds for every feasible placement.
                    assert!(r.lower_bound <= cost(&inst, &p) + 1e-9);
                }
            }
            if r.status == MilpStatus::Optimal {
                solved += 1;
            }
        }
        assert!(solved > 0, "no snapshot solved to optimality in 60 s");
    }

    #[cfg(feature = "highs")]
    #[test]
    fn highs_agrees_with_brute_force() {
        let highs = MilpOptions {
            backend: Backend::Highs,
            ..opts()
        };
        let mut compared = 0;
        for seed in 0..8 {
            let inst = tiny(seed, 4, 3);
            match (solve(&inst, &highs), brute_force(&inst)) {
                (Ok(r), Some(best)) => {
                    assert_eq!(check(&inst, &r.placement), vec![], "seed {seed}");
                    assert_eq!(r.status, MilpStatus::Optimal, "seed {seed}");
                    assert!(
                        (r.cost - best).abs() < 1e-9,
                        "seed {seed}: {} vs {best}",
                        r.cost
                    );
                    compared += 1;
                }
                (Err(PlaceError::Infeasible { .. }), None) => {}
                (got, want) => panic!("seed {seed}: highs {got:?}, brute force {want:?}"),
            }
        }
        assert!(compared >= 4);
    }

    #[test]
    fn canonical_form_keeps_feasibility_and_cost() {
        for seed in 0..20 {
            let mut inst = tiny(seed, 6, 4);
            // Two classes of identical nodes.
            for e in 0..6 {
                inst.nodes[e].capacity = inst.nodes[e % 2].capacity;
                inst.nodes[e].price = inst.nodes[e % 2].price;
            }
            let Ok(p) = first_fit(&inst) else { continue };
            let classes = node_classes(&inst);
            assert_eq!(classes.len(), 2);
            let q = canonical(&inst, &classes, &p);
            assert_eq!(check(&inst, &q), vec![]);
            assert_eq!(cost(&inst, &q), cost(&inst, &p));
            for c in &classes {
                let used: Vec<bool> = c
                    .iter()
                    .map(|e| q.sets.iter().any(|s| s.contains(e)))
                    .collect();
                assert!(used.windows(2).all(|w| w[0] >= w[1]), "{used:?}");
            }
        }
    }

    #[test]
    fn refuses_large_and_malformed_instances() {
        let mut inst = tiny(1, 13, 2);
        let e = solve(&inst, &opts()).unwrap_err();
        assert!(
            matches!(&e, PlaceError::Invalid { field, .. } if field == "nodes"),
            "{e}"
        );
        inst = tiny(1, 4, 21);
        let e = solve(&inst, &opts()).unwrap_err();
        assert!(
            matches!(&e, PlaceError::Invalid { field, .. } if field == "requests"),
            "{e}"
        );
        inst = tiny(1, 4, 3);
        inst.requests[1].demand.mem = -1.0;
        let e = solve(&inst, &opts()).unwrap_err();
        assert!(e.to_string().contains("requests[1].demand.mem"), "{e}");
        let e = solve(
            &tiny(1, 4, 3),
            &MilpOptions {
                mip_gap: f64::NAN,
                ..opts()
            },
        )
        .unwrap_err();
        assert!(
            matches!(&e, PlaceError::Invalid { field, .. } if field == "mip_gap"),
            "{e}"
        );
    }

    #[test]
    fn infeasible_instances_say_why() {
        let node = |i: usize| Node {
            id: format!("n{i}"),
            capacity: Resources::new(10.0, 10.0, 10.0),
            price: 1.0,
        };
        let req = |t: &str, d: f64| Request {
            tenant: t.into(),
            demand: Resources::new(d, d, d),
        };
        let limits = Limits::checked(0.8, 2, 2, 0).unwrap();
        // One tenant too big for any two nodes: named.
        let inst = Instance {
            nodes: (0..3).map(node).collect(),
            requests: vec![req("a", 1.0), req("huge", 17.0)],
            limits,
        };
        let e = solve(&inst, &opts()).unwrap_err();
        assert!(
            matches!(&e, PlaceError::Infeasible { tenant: Some(t), .. } if t == "huge"),
            "{e}"
        );
        // Each fits alone, but two disjoint pairs need four nodes: only the MILP
        // can tell, and no tenant is to blame.
        let inst = Instance {
            nodes: (0..3).map(node).collect(),
            requests: vec![req("a", 1.0), req("b", 1.0)],
            limits,
        };
        let e = solve(&inst, &opts()).unwrap_err();
        assert!(
            matches!(&e, PlaceError::Infeasible { tenant: None, reason } if reason.contains("Eq. 2-6")),
            "{e}"
        );
    }

    #[test]
    fn a_short_time_limit_still_answers_with_a_true_gap() {
        let mut spec = GenSpec::standard(12);
        spec.limits.g_max = 3;
        spec.initial_tenants = 24;
        let w = generate(&spec, 5).unwrap();
        let inst = snapshot_instance(&w, 0, 12, 20).unwrap();
        assert_eq!(inst.requests.len(), 20);
        let r = solve(
            &inst,
            &MilpOptions {
                time_limit: Duration::from_millis(200),
                ..MilpOptions::default()
            },
        )
        .unwrap();
        assert_eq!(check(&inst, &r.placement), vec![]);
        assert!(r.lower_bound <= r.cost + 1e-9);
        assert!((0.0..=1.0).contains(&r.gap));
        assert!((r.gap - (r.cost - r.lower_bound) / r.cost).abs() < 1e-12);
        if r.status == MilpStatus::Optimal {
            assert_eq!(r.lower_bound, r.cost);
        }
        // Whatever the solver managed, the bound is at least the solver-free one.
        assert!(r.lower_bound >= simple_bound(&inst) - 1e-9);
        assert!(simple_bound(&inst) > 0.0);
        for p in [
            first_fit(&inst),
            best_fit(&inst),
            first_fit_decreasing(&inst),
        ]
        .into_iter()
        .flatten()
        {
            assert!(r.lower_bound <= cost(&inst, &p) + 1e-9);
            assert!(r.cost <= cost(&inst, &p) + 1e-9);
        }
    }
}
