//! Paper 000 Alg. 2, the Filtering Algorithm, and the reward it maximises.
//!
//! 1. sort nodes by Q, descending;
//! 2. keep the top k;
//! 3. enumerate every combination of size G_min..=G_max;
//! 4. drop those breaking Eq. 2–6 ([`ClusterState::feasible`]);
//! 5. compute each survivor's reward;
//! 6. return the argmax (ties: the highest mean Q).
//!
//! Two additions, both about *when nothing survives*, so the agent rarely fails where
//! Best Fit would succeed: k is doubled (up to [`FilterParams::max_k`]), and past that
//! a depth-first search over the full Q-order ([`ClusterState::first_feasible`])
//! answers. Nodes that cannot take even a G_max share are dropped before step 2:
//! they are in no feasible combination, so this changes no answer, only which nodes
//! the k slots go to.

use serde::{Deserialize, Serialize};

use super::features::PoolRef;
use crate::problem::{ClusterState, NodeIdx, Request, Resources};

/// Which reward the Filtering Algorithm maximises and training regresses on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RewardKind {
    /// App. A.2 as written: an action opening nodes G_new earns −Σ_{e∈G_new} k_e; an
    /// action on used nodes only earns Σ_e (UB_e+UC_e+UM_e)^{-1} (utilisation after
    /// placing). Normalised into [−1, 1]: the first by G_max·max k_e, the second by
    /// G_max·X with each term capped at X = 1/(3·0.05) (a node 5 % full everywhere).
    Paper,
    /// Shaped for Eq. 1 integrated over time: opening a node costs its price per unit
    /// of capacity (1 + ppc_e / max ppc, over 2·G_max), so one large node beats two
    /// small ones; on used nodes only, the mean water level after placing (busiest
    /// dimension over U) — tight packing, as Best Fit, instead of the paper's inverse
    /// water level, which prefers the emptiest used nodes.
    Packing,
}

/// Cap of one paper reward term, 1/(UB+UC+UM): a node 5 % full in every dimension.
const PAPER_TERM_CAP: f64 = 1.0 / (3.0 * 0.05);

/// Parameters of Alg. 2.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FilterParams {
    /// k: candidates taken from the top of the Q-order.
    pub k: usize,
    /// k is doubled while no combination survives, up to this.
    pub max_k: usize,
    /// Partial sets the last-resort DFS may visit.
    pub budget: usize,
}

impl Default for FilterParams {
    fn default() -> Self {
        FilterParams {
            k: 10,
            max_k: 20,
            budget: 50_000,
        }
    }
}

/// How an answer was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// Alg. 2 over the top k (k as finally used).
    TopK(usize),
    /// The DFS over the full Q-order.
    Dfs,
}

/// The Filtering Algorithm's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub set: Vec<NodeIdx>,
    pub reward: f64,
    pub via: Via,
}

/// The reward of placing `req` on `set` in `state` (before placing), in [−1, 1].
pub fn reward(
    kind: RewardKind,
    state: &ClusterState,
    pool: &PoolRef,
    req: &Request,
    set: &[NodeIdx],
) -> f64 {
    let g_max = state.limits().g_max.max(1) as f64;
    if set.is_empty() {
        return -1.0;
    }
    let share = req.demand.scale(1.0 / set.len() as f64);
    let new: Vec<NodeIdx> = set.iter().copied().filter(|&e| !state.in_use(e)).collect();
    match kind {
        RewardKind::Paper => {
            if !new.is_empty() {
                let k: f64 = new.iter().map(|&e| state.nodes()[e].price).sum();
                -(k / (g_max * pool.max_price.max(f64::MIN_POSITIVE))).min(1.0)
            } else {
                let s: f64 = set
                    .iter()
                    .map(|&e| {
                        let after = state.used(e).plus(share);
                        let u: f64 = after.ratio(&state.nodes()[e].capacity).iter().sum();
                        if u > 0.0 {
                            (1.0 / u).min(PAPER_TERM_CAP)
                        } else {
                            PAPER_TERM_CAP
                        }
                    })
                    .sum();
                (s / (g_max * PAPER_TERM_CAP)).min(1.0)
            }
        }
        RewardKind::Packing => {
            if !new.is_empty() {
                let c: f64 = new
                    .iter()
                    .map(|&e| 1.0 + pool.ppc[e] / pool.max_ppc.max(f64::MIN_POSITIVE))
                    .sum();
                -(c / (2.0 * g_max)).min(1.0)
            } else {
                let s: f64 = set.iter().map(|&e| level(state, e, share)).sum();
                (s / set.len() as f64).min(1.0)
            }
        }
    }
}

/// Busiest dimension of node `e` over U after taking `share`.
fn level(state: &ClusterState, e: NodeIdx, share: Resources) -> f64 {
    let after = state.used(e).plus(share);
    after
        .ratio(&state.limit(e))
        .iter()
        .copied()
        .fold(0.0, f64::max)
}

/// Alg. 2 with `q[e]` the score of node `e` (one per node of `state`).
pub fn filter(
    state: &ClusterState,
    pool: &PoolRef,
    req: &Request,
    q: &[f32],
    params: &FilterParams,
    kind: RewardKind,
) -> Option<Choice> {
    let lim = state.limits();
    let n = state.nodes().len().min(q.len());
    let min_share = req.demand.scale(1.0 / lim.g_max as f64);
    // Step 1: nodes in descending Q (index breaks ties, so answers are reproducible).
    let mut order: Vec<NodeIdx> = (0..n).filter(|&e| state.fits(e, &min_share)).collect();
    order.sort_by(|&a, &b| q[b].total_cmp(&q[a]).then(a.cmp(&b)));
    let mut k = params.k.max(lim.g_min);
    loop {
        let top = &order[..k.min(order.len())];
        if let Some((set, reward)) = best_combination(state, pool, req, top, q, kind) {
            return Some(Choice {
                set,
                reward,
                via: Via::TopK(top.len()),
            });
        }
        if top.len() == order.len() || k >= params.max_k {
            break;
        }
        k = (k * 2).min(params.max_k.max(k));
    }
    let set = state.first_feasible(req, &order, params.budget)?;
    Some(Choice {
        reward: reward(kind, state, pool, req, &set),
        set,
        via: Via::Dfs,
    })
}

/// Steps 3–6 over `top`: the feasible combination with the highest reward; among
/// equal rewards the one with the highest mean Q, then the earliest enumerated.
fn best_combination(
    state: &ClusterState,
    pool: &PoolRef,
    req: &Request,
    top: &[NodeIdx],
    q: &[f32],
    kind: RewardKind,
) -> Option<(Vec<NodeIdx>, f64)> {
    let lim = state.limits();
    let mut best: Option<(Vec<NodeIdx>, f64, f64)> = None;
    let mut set = Vec::with_capacity(lim.g_max);
    for g in lim.g_min..=lim.g_max.min(top.len()) {
        let share = req.demand.scale(1.0 / g as f64);
        // Capacity is checked per node before whole sets (Eq. 2–4 are per node).
        let fit: Vec<NodeIdx> = top
            .iter()
            .copied()
            .filter(|&e| state.fits(e, &share))
            .collect();
        if fit.len() < g {
            continue;
        }
        let mut visit = |set: &[NodeIdx]| {
            if state.feasible(req, set).is_err() {
                return;
            }
            let r = reward(kind, state, pool, req, set);
            let mq = set.iter().map(|&e| q[e] as f64).sum::<f64>() / set.len() as f64;
            let better = match &best {
                None => true,
                Some((_, br, bq)) => r > *br + 1e-12 || ((r - *br).abs() <= 1e-12 && mq > *bq),
            };
            if better {
                best = Some((set.to_vec(), r, mq));
            }
        };
        combinations(&fit, g, 0, &mut set, &mut visit);
    }
    best.map(|(s, r, _)| (s, r))
}

fn combinations(
    items: &[NodeIdx],
    g: usize,
    from: usize,
    set: &mut Vec<NodeIdx>,
    visit: &mut dyn FnMut(&[NodeIdx]),
) {
    if set.len() == g {
        visit(set);
        return;
    }
    for i in from..items.len() {
        if items.len() - i < g - set.len() {
            return;
        }
        set.push(items[i]);
        combinations(items, g, i + 1, set, visit);
        set.pop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Limits, Node};

    fn state() -> ClusterState {
        let nodes = (0..6)
            .map(|i| Node {
                id: format!("n{i}"),
                capacity: Resources::new(10.0, 10.0, 10.0),
                price: 1.0 + i as f64,
            })
            .collect();
        ClusterState::new(
            nodes,
            Limits {
                threshold: 0.8,
                g_min: 2,
                g_max: 3,
                overlap: 1,
            },
        )
        .unwrap()
    }

    fn req(t: &str, d: f64) -> Request {
        Request {
            tenant: t.into(),
            demand: Resources::new(d, d, d),
        }
    }

    #[test]
    fn paper_reward_prefers_used_nodes_and_cheap_new_ones() {
        let mut s = state();
        let pool = PoolRef::new(&s);
        s.commit(&req("a", 2.0), &[4, 5]).unwrap();
        let r = req("b", 2.0);
        let used = reward(RewardKind::Paper, &s, &pool, &r, &[4, 5]);
        let cheap_new = reward(RewardKind::Paper, &s, &pool, &r, &[0, 1]);
        let dear_new = reward(RewardKind::Paper, &s, &pool, &r, &[2, 3]);
        assert!(used > 0.0 && used <= 1.0, "{used}");
        assert!(cheap_new < 0.0 && cheap_new > dear_new && dear_new >= -1.0);
    }

    fn params(k: usize, max_k: usize) -> FilterParams {
        FilterParams {
            k,
            max_k,
            budget: 1000,
        }
    }

    #[test]
    fn filter_takes_the_best_feasible_combination_in_top_k() {
        let mut s = state();
        let pool = PoolRef::new(&s);
        s.commit(&req("a", 2.0), &[4, 5]).unwrap();
        // Q favours 4 and 5, but O = 1 forbids putting b on both: the answer has one
        // of them and no more new nodes than needed.
        let q = [0.0, 0.1, 0.2, 0.3, 1.0, 0.9];
        let c = filter(
            &s,
            &pool,
            &req("b", 2.0),
            &q,
            &params(3, 6),
            RewardKind::Paper,
        )
        .unwrap();
        assert!(s.feasible(&req("b", 2.0), &c.set).is_ok());
        assert_eq!(c.set.iter().filter(|&&e| e >= 4).count(), 1, "{c:?}");
        assert_eq!(c.set.len(), 2, "{c:?}");
    }

    #[test]
    fn filter_widens_k_then_falls_back_to_dfs() {
        let mut s = state();
        let pool = PoolRef::new(&s);
        // Fill nodes 0..3 so only 4 and 5 can take anything; Q ranks them last.
        for (i, pair) in [[0, 1], [2, 3]].iter().enumerate() {
            s.commit(&req(&format!("f{i}"), 15.0), pair).unwrap();
        }
        let q = [1.0, 0.9, 0.8, 0.7, 0.0, 0.1];
        let p = params(2, 2);
        // Nodes that cannot take a share are never candidates, so the top 2 are
        // 5 and 4 and Alg. 2 answers directly.
        let c = filter(&s, &pool, &req("b", 2.0), &q, &p, RewardKind::Packing).unwrap();
        assert_eq!(c.via, Via::TopK(2));
        let mut set = c.set.clone();
        set.sort_unstable();
        assert_eq!(set, vec![4, 5]);
        // Nothing fits anywhere: no answer, no panic.
        assert!(filter(&s, &pool, &req("c", 50.0), &q, &p, RewardKind::Packing).is_none());
    }
}
