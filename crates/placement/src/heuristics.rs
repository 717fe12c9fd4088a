//! The bin-packing baselines CyberStar started from (paper 000 §7.1): First Fit, Best
//! Fit, and First Fit Decreasing for the offline case. Each honours Eq. 2–6, overlap
//! included: they choose an order of nodes and take the first combination in that
//! order that [`ClusterState::first_feasible`] accepts.

use crate::problem::{
    ClusterState, Instance, NodeIdx, PlaceError, Placement, Placer, Request, Resource,
};

/// Partial sets a heuristic's search may visit before it gives up on a request.
pub const DEFAULT_BUDGET: usize = 50_000;

/// First Fit: nodes in index order (the order the operator listed them).
#[derive(Debug, Clone)]
pub struct FirstFit {
    pub budget: usize,
}

impl Default for FirstFit {
    fn default() -> Self {
        FirstFit {
            budget: DEFAULT_BUDGET,
        }
    }
}

impl Placer for FirstFit {
    fn name(&self) -> &str {
        "ff"
    }

    fn place(&mut self, state: &ClusterState, req: &Request) -> Result<Vec<NodeIdx>, PlaceError> {
        let order: Vec<NodeIdx> = (0..state.nodes().len()).collect();
        state
            .first_feasible(req, &order, self.budget)
            .ok_or_else(|| no_set(state, req))
    }
}

/// Best Fit: nodes in use first, each ordered by the room it would have left after
/// taking the request's share (tightest first); then unused nodes, cheapest per unit
/// of capacity first.
#[derive(Debug, Clone)]
pub struct BestFit {
    pub budget: usize,
}

impl Default for BestFit {
    fn default() -> Self {
        BestFit {
            budget: DEFAULT_BUDGET,
        }
    }
}

impl Placer for BestFit {
    fn name(&self) -> &str {
        "bf"
    }

    fn place(&mut self, state: &ClusterState, req: &Request) -> Result<Vec<NodeIdx>, PlaceError> {
        let order = best_fit_order(state, req);
        state
            .first_feasible(req, &order, self.budget)
            .ok_or_else(|| no_set(state, req))
    }
}

/// The node order Best Fit searches in, for `req` at G = G_min.
pub fn best_fit_order(state: &ClusterState, req: &Request) -> Vec<NodeIdx> {
    let share = req.demand.scale(1.0 / state.limits().g_min as f64);
    let mut keyed: Vec<(bool, f64, NodeIdx)> = (0..state.nodes().len())
        .filter(|&e| state.is_up(e))
        .map(|e| {
            let cap = state.nodes()[e].capacity;
            let left = state.free(e).saturating_sub(share);
            if state.in_use(e) {
                // Normalised room left in the tightest dimension.
                let room = Resource::ALL
                    .iter()
                    .map(|&r| {
                        let c = cap.get(r);
                        if c > 0.0 {
                            left.get(r) / c
                        } else {
                            0.0
                        }
                    })
                    .fold(f64::MAX, f64::min);
                (false, room, e)
            } else {
                (true, price_per_capacity(state, e), e)
            }
        })
        .collect();
    keyed.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2)));
    keyed.into_iter().map(|(_, _, e)| e).collect()
}

/// Price over mean normalised capacity: what a unit of room costs on node `e`.
fn price_per_capacity(state: &ClusterState, e: NodeIdx) -> f64 {
    let nodes = state.nodes();
    let n = &nodes[e];
    let mut norm = 0.0;
    for r in Resource::ALL {
        let max = nodes.iter().map(|x| x.capacity.get(r)).fold(0.0, f64::max);
        if max > 0.0 {
            norm += n.capacity.get(r) / max;
        }
    }
    if norm > 0.0 {
        n.price / norm
    } else {
        f64::MAX
    }
}

fn no_set(state: &ClusterState, req: &Request) -> PlaceError {
    PlaceError::infeasible(
        &req.tenant,
        format!(
            "no {}..{} of the {} nodes up can take its share within U = {} and O = {}",
            state.limits().g_min,
            state.limits().g_max,
            (0..state.nodes().len()).filter(|&e| state.is_up(e)).count(),
            state.limits().threshold,
            state.limits().overlap
        ),
    )
}

/// Places every request of `inst` in the given order with `placer`; the offline use of
/// an online algorithm.
pub fn place_all(
    inst: &Instance,
    placer: &mut dyn Placer,
    order: &[usize],
) -> Result<Placement, PlaceError> {
    inst.validate()?;
    let mut state = ClusterState::new(inst.nodes.clone(), inst.limits)?;
    let mut sets = vec![Vec::new(); inst.requests.len()];
    for &i in order {
        let req = &inst.requests[i];
        let set = placer.place(&state, req)?;
        state.commit(req, &set)?;
        sets[i] = set;
    }
    Ok(Placement { sets })
}

/// Offline First Fit in request order.
pub fn first_fit(inst: &Instance) -> Result<Placement, PlaceError> {
    let order: Vec<usize> = (0..inst.requests.len()).collect();
    place_all(inst, &mut FirstFit::default(), &order)
}

/// Offline Best Fit in request order.
pub fn best_fit(inst: &Instance) -> Result<Placement, PlaceError> {
    let order: Vec<usize> = (0..inst.requests.len()).collect();
    place_all(inst, &mut BestFit::default(), &order)
}

/// First Fit Decreasing: the largest requests first (by their biggest demand relative
/// to the mean node capacity in that dimension), then First Fit.
pub fn first_fit_decreasing(inst: &Instance) -> Result<Placement, PlaceError> {
    let n = inst.nodes.len().max(1) as f64;
    let mean: Vec<f64> = Resource::ALL
        .iter()
        .map(|&r| inst.nodes.iter().map(|x| x.capacity.get(r)).sum::<f64>() / n)
        .collect();
    let size = |i: usize| {
        Resource::ALL
            .iter()
            .zip(&mean)
            .map(|(&r, &m)| {
                if m > 0.0 {
                    inst.requests[i].demand.get(r) / m
                } else {
                    0.0
                }
            })
            .fold(0.0, f64::max)
    };
    let mut order: Vec<usize> = (0..inst.requests.len()).collect();
    order.sort_by(|&a, &b| size(b).total_cmp(&size(a)).then(a.cmp(&b)));
    place_all(inst, &mut FirstFit::default(), &order)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{check, cost, Limits, Node, Resources};

    fn inst() -> Instance {
        let mut nodes = Vec::new();
        for i in 0..6 {
            let big = i % 2 == 1;
            nodes.push(Node {
                id: format!("n{i}"),
                capacity: if big {
                    Resources::new(40.0, 32.0, 128.0)
                } else {
                    Resources::new(10.0, 8.0, 16.0)
                },
                price: if big { 3.6 } else { 1.0 },
            });
        }
        let requests = [1.0, 6.0, 2.0, 9.0, 0.5, 3.0]
            .iter()
            .enumerate()
            .map(|(i, &d)| Request {
                tenant: format!("t{i}"),
                demand: Resources::new(d, d * 0.5, d),
            })
            .collect();
        Instance {
            nodes,
            requests,
            limits: Limits {
                threshold: 0.8,
                g_min: 2,
                g_max: 3,
                overlap: 1,
            },
        }
    }

    #[test]
    fn every_baseline_is_feasible() {
        let inst = inst();
        for (name, p) in [
            ("ff", first_fit(&inst)),
            ("bf", best_fit(&inst)),
            ("ffd", first_fit_decreasing(&inst)),
        ] {
            let p = p.unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(check(&inst, &p), vec![], "{name}");
            assert!(cost(&inst, &p) > 0.0);
        }
    }

    #[test]
    fn best_fit_prefers_used_nodes() {
        let inst = inst();
        let mut state = ClusterState::new(inst.nodes.clone(), inst.limits).unwrap();
        let r0 = &inst.requests[0];
        let s0 = BestFit::default().place(&state, r0).unwrap();
        state.commit(r0, &s0).unwrap();
        let r1 = &inst.requests[4];
        let s1 = BestFit::default().place(&state, r1).unwrap();
        assert!(s1.iter().any(|e| s0.contains(e)), "{s0:?} then {s1:?}");
    }

    #[test]
    fn infeasible_requests_say_why() {
        let mut inst = inst();
        inst.requests[0].demand = Resources::new(1000.0, 1.0, 1.0);
        let e = first_fit(&inst).unwrap_err();
        assert!(e.to_string().contains("t0"), "{e}");
    }
}
