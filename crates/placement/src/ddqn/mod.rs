//! The DDQN placement agent of paper 000 (CyberStar) App. A.2: a Q-network ranks the
//! nodes, the Filtering Algorithm (Alg. 2, [`filter`]) turns the ranking into a
//! feasible set, and training follows Alg. 1 with the paper's modified target, where
//! A_{t+1} comes from the Filtering Algorithm instead of the online network's argmax.
//!
//! # How the network differs from the paper's flat MLP
//!
//! The paper's Q-network is an MLP over the flat state S = ⟨B, C, M, b, c, m⟩ ∈
//! R^{3|E|+3} with |E| outputs, one Q(S, e) per node. Its input and output sizes fix
//! the pool size, and the orchestrator runs pools of 4 to 1,000 nodes that grow and
//! shrink. Here one MLP is shared by all nodes: Q(S, e) = mlp(φ(S, e)), where φ(S, e)
//! ([`features`]) is
//! - node e's slice of the same state: B_e, C_e, M_e (as fractions of U·capacity and
//!   absolute), and the request's b, c, m;
//! - what the flat MLP learns implicitly from which input slot a number sits in —
//!   node e's capacity, price k_e, price per capacity, whether it is in use (y_e), and
//!   how many tenants it holds (what Eq. 6 counts);
//! - derived fit quantities (share of e's room one G_min share takes, whether a share
//!   fits at G_min/G_max, water level now and after), which the flat MLP would have
//!   to learn as products of its inputs;
//! - pooled summaries of the whole state (fraction of nodes in use, mean utilisation
//!   of used nodes, room on used nodes in units of this request, pool size), standing
//!   in for the cross-node view a flat MLP has.
//!
//! So the function class is "the same per-node scorer for every node, conditioned on
//! a summary of the rest" rather than "any function of the whole state"; in exchange
//! it is independent of |E|, trains on pools of mixed sizes, and scores 1,000 nodes in
//! one batched forward pass.
//!
//! # Decisions
//!
//! [`Ddqn`] implements [`Placer`]: features for every node, one forward pass, then
//! [`filter::filter`]. When Alg. 2 finds nothing in the top k it doubles k, then
//! searches the whole Q-order depth first, so it answers wherever a feasible set is
//! found by that search (what Best Fit's search would also find, in another order).
//!
//! # Training
//!
//! [`train::train`] (Alg. 1) runs the agent inside [`crate::sim::run`] over generated
//! training workloads; see its docs. [`model::DdqnModel`] is the versioned file.

pub mod features;
pub mod filter;
pub mod model;
pub mod net;
pub mod train;

use rand::seq::SliceRandom;
use rand::Rng;

pub use filter::{FilterParams, RewardKind, Via};
pub use model::{DdqnModel, ModelHeader, MODEL_FORMAT, MODEL_VERSION};
pub use train::{train, EpisodeReport, TrainConfig, TrainMetrics};

use crate::problem::{ClusterState, NodeIdx, PlaceError, Placer, Request};
use features::{node_features, PoolRef, N_FEATURES};
use net::QNet;
use train::Learner;

/// Counters of how decisions were made.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DecisionStats {
    pub decisions: u64,
    /// Answered by Alg. 2 with k widened past its configured value.
    pub widened: u64,
    /// Answered by the DFS over the full Q-order.
    pub dfs: u64,
    /// No feasible set found.
    pub failed: u64,
    /// Random actions taken while training (ε-greedy).
    pub explored: u64,
}

/// The DDQN placer: Q-network + Filtering Algorithm.
pub struct Ddqn {
    net: QNet,
    pub filter: FilterParams,
    pub reward: RewardKind,
    pub stats: DecisionStats,
    feats: Vec<f32>,
    learner: Option<Box<Learner>>,
}

impl Ddqn {
    /// A placer from a loaded model, using the model's filter parameters and reward.
    pub fn new(model: DdqnModel) -> Self {
        let h = model.header;
        Ddqn::from_net(model.net, h.filter, h.reward)
    }

    pub(crate) fn from_net(net: QNet, filter: FilterParams, reward: RewardKind) -> Self {
        Ddqn {
            net,
            filter,
            reward,
            stats: DecisionStats::default(),
            feats: Vec::new(),
            learner: None,
        }
    }

    /// Q-values of every node of `state` for `req`.
    pub fn q_values(
        &mut self,
        state: &ClusterState,
        req: &Request,
    ) -> Result<Vec<f32>, PlaceError> {
        let pool = PoolRef::new(state);
        self.q_with(state, &pool, req)
    }

    fn q_with(
        &mut self,
        state: &ClusterState,
        pool: &PoolRef,
        req: &Request,
    ) -> Result<Vec<f32>, PlaceError> {
        let all: Vec<NodeIdx> = (0..state.nodes().len()).collect();
        node_features(state, pool, req, &all, &mut self.feats);
        self.net.score_fast(&self.feats)
    }

    fn rows_of(&self, set: &[NodeIdx]) -> Vec<f32> {
        let mut v = Vec::with_capacity(set.len() * N_FEATURES);
        for &e in set {
            v.extend_from_slice(&self.feats[e * N_FEATURES..(e + 1) * N_FEATURES]);
        }
        v
    }
}

impl Placer for Ddqn {
    fn name(&self) -> &str {
        "ddqn"
    }

    fn place(&mut self, state: &ClusterState, req: &Request) -> Result<Vec<NodeIdx>, PlaceError> {
        req.demand.validate("demand")?;
        self.stats.decisions += 1;
        let pool = PoolRef::new(state);
        let q = self.q_with(state, &pool, req)?;
        let greedy = filter::filter(state, &pool, req, &q, &self.filter, self.reward);
        match greedy.as_ref().map(|c| c.via) {
            Some(Via::Dfs) => self.stats.dfs += 1,
            Some(Via::TopK(k)) if k > self.filter.k => self.stats.widened += 1,
            _ => {}
        }
        let Some(mut learner) = self.learner.take() else {
            return match greedy {
                Some(c) => Ok(c.set),
                None => {
                    self.stats.failed += 1;
                    Err(PlaceError::infeasible(
                        &req.tenant,
                        "the Filtering Algorithm and the DFS over the Q-order found no set",
                    ))
                }
            };
        };
        // Training (Alg. 1, lines 6–16). The previous action's experiences complete
        // with this state as S_{t+1} and the Filtering Algorithm's answer as A_{t+1}.
        let next_rows = greedy.as_ref().map(|c| self.rows_of(&c.set));
        learner.complete(next_rows);
        let action = if learner.rng.gen::<f64>() < learner.epsilon {
            // RandomAction(): a random order searched until a set meets Eq. 2–6.
            let mut order: Vec<NodeIdx> = (0..state.nodes().len()).collect();
            order.shuffle(&mut learner.rng);
            let set = state.first_feasible(req, &order, self.filter.budget);
            if set.is_some() {
                self.stats.explored += 1;
            }
            set.or_else(|| greedy.as_ref().map(|c| c.set.clone()))
        } else {
            greedy.as_ref().map(|c| c.set.clone())
        };
        let res = match action {
            Some(set) => {
                let r = filter::reward(self.reward, state, &pool, req, &set);
                learner.begin(self.rows_of(&set), r);
                Ok(set)
            }
            None => {
                self.stats.failed += 1;
                Err(PlaceError::infeasible(&req.tenant, "no feasible set"))
            }
        };
        let step = learner.learn(&self.net);
        self.net.invalidate();
        self.learner = Some(learner);
        step?;
        res
    }
}
