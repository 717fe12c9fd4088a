//! The environment emulator of paper 000 Fig. 14: it replays a [`Workload`] step by
//! step against a [`Placer`], the way the orchestrator runs one online (App. A.2,
//! "Online Running"): new tenants are placed on arrival, a node pushed over U by
//! growing demand has tenants moved off it (scale-up), and a node that falls under
//! the lower threshold is drained when that frees it (scale-down).
//!
//! Cost is the paper's Eq. 1 integrated over time: every step, the price of every node
//! in use; plus `migration_cost` per tenant moved, since the paper's aim is also to
//! "reduce the reallocation". Both parts are reported apart.

use std::collections::HashMap;
use std::time::Instant;

use serde::Serialize;

use crate::problem::{ClusterState, NodeIdx, PlaceError, Placer, Request, Resources};
use crate::workload::Workload;

/// How much a tenant reserves, given what it uses now and what it used before.
/// [`CurrentDemand`] reserves today's demand; a forecaster reserves what it expects
/// over its horizon, so a placement made at night survives the morning.
pub trait Reserve {
    fn name(&self) -> &str;
    /// Called once per step, before any `reserve` of that step, with every present
    /// tenant's actual demand.
    fn observe(&mut self, t: usize, demand: &[(&str, Resources)]);
    /// The reservation for `tenant` at step `t`, whose demand now is `current`.
    /// Must be ≥ `current` in every dimension (the emulator enforces it).
    fn reserve(&mut self, t: usize, tenant: &str, current: Resources) -> Resources;
    /// The tenant left.
    fn forget(&mut self, tenant: &str);
}

/// Reserve exactly the current demand.
#[derive(Debug, Default, Clone)]
pub struct CurrentDemand;

impl Reserve for CurrentDemand {
    fn name(&self) -> &str {
        "current"
    }
    fn observe(&mut self, _t: usize, _demand: &[(&str, Resources)]) {}
    fn reserve(&mut self, _t: usize, _tenant: &str, current: Resources) -> Resources {
        current
    }
    fn forget(&mut self, _tenant: &str) {}
}

/// What one run of the emulator measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SimReport {
    pub algorithm: String,
    pub reserve: String,
    /// `node_cost + migration_cost`.
    pub cost: f64,
    /// Σ over steps of Σ k_e over nodes in use.
    pub node_cost: f64,
    pub migration_cost: f64,
    pub migrations: usize,
    /// Arrivals or moves no feasible set could take (the pool ran out).
    pub rejected: usize,
    /// Constraint violations found by the checker after each step; must be 0.
    pub violations: usize,
    /// Answers the state refused (the placer proposed an infeasible set).
    pub bad_answers: usize,
    pub peak_nodes: usize,
    /// Wall time of each `place` call, in milliseconds.
    #[serde(skip)]
    pub decision_ms: Vec<f64>,
}

impl SimReport {
    pub fn decision_ms_p(&self, q: f64) -> f64 {
        percentile(&self.decision_ms, q)
    }
}

/// The q-quantile (0..=1) of `xs`, 0 for none.
pub fn percentile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
    v[i]
}

/// Options of a run.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Partial sets a placer's fallback search may visit (First Fit's budget).
    pub search_budget: usize,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            search_budget: 20_000,
        }
    }
}

/// Replays `w` against `placer`, reserving with `reserve`.
pub fn run(
    w: &Workload,
    placer: &mut dyn Placer,
    reserve: &mut dyn Reserve,
    _opts: &SimOptions,
) -> Result<SimReport, PlaceError> {
    w.validate()?;
    let mut state = ClusterState::new(w.nodes.clone(), w.limits)?;
    let mut rep = SimReport {
        algorithm: placer.name().to_string(),
        reserve: reserve.name().to_string(),
        ..SimReport::default()
    };
    // Tenants currently admitted (rejected ones are gone for good).
    let mut present: HashMap<&str, usize> = HashMap::new();
    for t in 0..w.steps {
        // 1. Departures.
        present.retain(|name, &mut i| {
            if w.tenants[i].depart <= t {
                state.release(name);
                reserve.forget(name);
                false
            } else {
                true
            }
        });
        // 2. Everyone's demand now, then reservations.
        let arriving: Vec<usize> = (0..w.tenants.len())
            .filter(|&i| w.tenants[i].arrive == t)
            .collect();
        let mut seen: Vec<(&str, Resources)> = Vec::new();
        for (&name, &i) in &present {
            if let Some(d) = w.tenants[i].at(t) {
                seen.push((name, d));
            }
        }
        for &i in &arriving {
            if let Some(d) = w.tenants[i].at(t) {
                seen.push((w.tenants[i].tenant.as_str(), d));
            }
        }
        seen.sort_by(|a, b| a.0.cmp(b.0));
        reserve.observe(t, &seen);
        let mut present_sorted: Vec<(&str, usize)> =
            present.iter().map(|(n, i)| (*n, *i)).collect();
        present_sorted.sort();
        for (name, i) in present_sorted {
            let cur = w.tenants[i].at(t).unwrap_or_default();
            let r = reserve.reserve(t, name, cur).max(cur);
            state.set_demand(name, r)?;
        }
        // 3. Scale-up: move tenants off overloaded nodes, biggest share first.
        loop {
            let over = state.overloaded();
            let Some(&e) = over.first() else { break };
            let mut on: Vec<(String, f64)> = state
                .tenants_on(e)
                .into_iter()
                .filter_map(|n| state.placed(n).map(|p| (n.to_string(), p.share().bw)))
                .collect();
            on.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let Some((name, _)) = on.into_iter().next() else {
                break;
            };
            let placed = state.release(&name).expect("listed on the node");
            let req = Request {
                tenant: name.clone(),
                demand: placed.demand,
            };
            match decide(placer, &state, &req, &mut rep) {
                Some(set) => {
                    state.commit(&req, &set)?;
                    rep.migrations += 1;
                }
                None => {
                    rep.rejected += 1;
                    reserve.forget(&name);
                    present.remove(name.as_str());
                }
            }
        }
        // 4. Arrivals.
        for i in arriving {
            let tr = &w.tenants[i];
            let cur = tr.at(t).unwrap_or_default();
            let req = Request {
                tenant: tr.tenant.clone(),
                demand: reserve.reserve(t, &tr.tenant, cur).max(cur),
            };
            match decide(placer, &state, &req, &mut rep) {
                Some(set) => {
                    state.commit(&req, &set)?;
                    present.insert(tr.tenant.as_str(), i);
                }
                None => {
                    rep.rejected += 1;
                    reserve.forget(&tr.tenant);
                }
            }
        }
        // 5. Scale-down: drain an under-used node if all its tenants fit elsewhere.
        if w.lower_threshold > 0.0 {
            consolidate(w, placer, &mut state, &mut rep)?;
        }
        // 6. Account.
        let in_use = (0..w.nodes.len()).filter(|&e| state.in_use(e)).count();
        rep.peak_nodes = rep.peak_nodes.max(in_use);
        rep.node_cost += state.cost();
        rep.violations += state.violations().len();
    }
    rep.migration_cost = rep.migrations as f64 * w.migration_cost;
    rep.cost = rep.node_cost + rep.migration_cost;
    Ok(rep)
}

/// One placement decision, timed and checked; `None` when no answer is feasible.
fn decide(
    placer: &mut dyn Placer,
    state: &ClusterState,
    req: &Request,
    rep: &mut SimReport,
) -> Option<Vec<NodeIdx>> {
    let t0 = Instant::now();
    let ans = placer.place(state, req);
    rep.decision_ms.push(t0.elapsed().as_secs_f64() * 1e3);
    match ans {
        Ok(set) if state.feasible(req, &set).is_ok() => Some(set),
        Ok(_) => {
            rep.bad_answers += 1;
            None
        }
        Err(_) => None,
    }
}

fn consolidate(
    w: &Workload,
    placer: &mut dyn Placer,
    state: &mut ClusterState,
    rep: &mut SimReport,
) -> Result<(), PlaceError> {
    let mut cands: Vec<(NodeIdx, f64)> = (0..w.nodes.len())
        .filter(|&e| state.in_use(e))
        .map(|e| {
            let u = state.utilisation(e);
            (e, u.iter().copied().fold(0.0, f64::max))
        })
        .filter(|&(_, u)| u < w.lower_threshold)
        .collect();
    cands.sort_by(|a, b| a.1.total_cmp(&b.1));
    for (e, _) in cands {
        if !state.in_use(e) {
            continue;
        }
        // Try on a copy: all of the node's tenants move, or none.
        let mut trial = state.clone();
        trial.set_up(e, false);
        let names: Vec<String> = trial.tenants_on(e).into_iter().map(String::from).collect();
        let mut moved = 0;
        let mut ok = true;
        for name in names {
            let Some(placed) = trial.release(&name) else {
                continue;
            };
            let req = Request {
                tenant: name,
                demand: placed.demand,
            };
            match decide(placer, &trial, &req, rep) {
                Some(set) => {
                    trial.commit(&req, &set)?;
                    moved += 1;
                }
                None => {
                    ok = false;
                    break;
                }
            }
        }
        if ok {
            trial.set_up(e, true);
            *state = trial;
            rep.migrations += moved;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{generate, GenSpec};

    /// Index-order first fit, enough to drive the emulator here.
    struct Naive;
    impl Placer for Naive {
        fn name(&self) -> &str {
            "naive"
        }
        fn place(&mut self, s: &ClusterState, r: &Request) -> Result<Vec<NodeIdx>, PlaceError> {
            let order: Vec<NodeIdx> = (0..s.nodes().len()).collect();
            s.first_feasible(r, &order, 10_000)
                .ok_or_else(|| PlaceError::infeasible(&r.tenant, "no set"))
        }
    }

    #[test]
    fn emulator_runs_clean_and_charges_moves() {
        let w = generate(&GenSpec::standard(40), 3).unwrap();
        let rep = run(&w, &mut Naive, &mut CurrentDemand, &SimOptions::default()).unwrap();
        assert_eq!(rep.violations, 0);
        assert_eq!(rep.bad_answers, 0);
        assert_eq!(rep.rejected, 0, "the pool is large enough");
        assert!(rep.node_cost > 0.0);
        assert!(rep.migrations > 0, "diurnal growth forces scale-ups");
        assert!((rep.cost - rep.node_cost - rep.migration_cost).abs() < 1e-9);
        assert!(!rep.decision_ms.is_empty());
    }
}
