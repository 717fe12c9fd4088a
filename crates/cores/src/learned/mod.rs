//! The learned assigner of paper 002 §IV (sfc2cpu).
//!
//! Assignment is a sequential game (§IV-A): the µVNFs are players that pick a core
//! one after another, seeing everything played so far; each gets the payoff
//! π_j = achieved / requested rate of its SFC. A Q-network (§IV-C, [`net`]) predicts,
//! for the player to move, its payoff for every core; the player takes the best one.
//! One network per core count (the output layer is |M| wide), the same architecture
//! for all: multi-head attention (3 heads, dimension 4, dense 16) from the current
//! µVNF over all µVNFs, concatenated with the action summary, then two dense layers
//! of 48 and a dueling head. Training ([`train()`]) is §IV-D's: Q-learning with a
//! dueling network, prioritized experience replay and ε-greedy exploration, in the
//! twin (§IV-E).
//!
//! Inputs (`Game::features`):
//! - action summary, per core: its relative load Σ_{j on m} l(j) / c(m) and the
//!   number of players on it (divided by the most µVNFs a model takes);
//! - per µVNF: cost, arrival rate, load l(j)/c(m), and whether it has chosen.
//!   Cost and rate are divided by the instance's largest (the paper normalises the
//!   cost to [0, 1]; dividing the rate too keeps instances scaled to another machine
//!   in range); the load is in cores, as in the paper.
//!
//! Players move in decreasing order of load (our choice; the paper does not say):
//! the big decisions come first, as in FFD.
//!
//! [`Sfc2cpuModel`] is the versioned model file; [`load_or_fallback`] is what the
//! node calls: the model's assigner, or RR and the reason when the file is missing,
//! corrupt or of another version.

pub mod model;
pub mod net;
pub mod train;

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use rand::Rng;
use thiserror::Error;

pub use model::{ModelHeader, NetInfo, Sfc2cpuModel, MODEL_FORMAT, MODEL_VERSION};
pub use net::QNet;
pub use train::{train, RoundReport, TrainConfig, TrainMetrics};

use crate::assign::{Assigner, RoundRobin};
use crate::problem::{Assignment, Problem};
use crate::CoresError;

/// Why a model file could not be used.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ModelError {
    #[error("{path}: cannot read the model file: {reason}")]
    Missing { path: String, reason: String },
    #[error("{source_name}: corrupt model file: {reason}")]
    Corrupt { source_name: String, reason: String },
    #[error("{source_name}: format {found:?}, expected {MODEL_FORMAT:?}")]
    Format { source_name: String, found: String },
    #[error("{source_name}: model version {found}, this build reads version {expected}; retrain or use a matching build")]
    Version {
        source_name: String,
        found: u32,
        expected: u32,
    },
    #[error("network: {0}")]
    Net(String),
}

/// Predicted payoffs closer than this are a tie, broken toward the least loaded
/// core (chosen on validation instances, docs/cores.md; the networks' RMS error on
/// payoffs is about 0.02).
pub const TIE_TOLERANCE: f32 = 0.02;

/// Per-µVNF input width: cost, rate, load, chosen.
pub const VNF_FEATURES: usize = 4;

/// Names of the inputs, stored in the model header: a model trained on another
/// layout is refused.
pub const FEATURES: [&str; 6] = [
    "core:relative_load",
    "core:players/max_vnfs",
    "vnf:cost/max_cost",
    "vnf:rate/max_rate",
    "vnf:load/clock",
    "vnf:chosen",
];

/// One game in progress: the state every player sees.
pub(crate) struct Game<'a> {
    pub p: &'a Problem,
    pub order: Vec<usize>,
    pub core_load: Vec<f64>,
    pub core_players: Vec<usize>,
    pub chosen: Vec<Option<usize>>,
    /// Per-µVNF static features (cost, rate, load).
    pub stat: Vec<[f32; 3]>,
    pub loads: Vec<f64>,
}

impl<'a> Game<'a> {
    pub fn new(p: &'a Problem) -> Self {
        let loads = p.loads();
        let rates = p.vnf_rates_pps();
        let max_cost = p
            .vnfs
            .iter()
            .map(|v| v.cost_cycles)
            .fold(0.0f64, f64::max)
            .max(f64::MIN_POSITIVE);
        let max_rate = rates
            .iter()
            .copied()
            .fold(0.0f64, f64::max)
            .max(f64::MIN_POSITIVE);
        let stat = (0..p.vnfs.len())
            .map(|j| {
                [
                    (p.vnfs[j].cost_cycles / max_cost) as f32,
                    (rates[j] / max_rate) as f32,
                    (loads[j] / p.clock_hz) as f32,
                ]
            })
            .collect();
        let mut order: Vec<usize> = (0..loads.len()).collect();
        order.sort_by(|&a, &b| loads[b].total_cmp(&loads[a]).then(a.cmp(&b)));
        Game {
            p,
            order,
            core_load: vec![0.0; p.cores],
            core_players: vec![0; p.cores],
            chosen: vec![None; p.vnfs.len()],
            stat,
            loads,
        }
    }

    /// Writes the inputs for player `j` into the batch buffers.
    pub fn features(&self, j: usize, max_vnfs: usize, f: &mut Batch) {
        for m in 0..self.p.cores {
            f.summary.push((self.core_load[m] / self.p.clock_hz) as f32);
            f.summary
                .push(self.core_players[m] as f32 / max_vnfs as f32);
        }
        for i in 0..max_vnfs {
            if let Some(s) = self.stat.get(i) {
                f.all.extend_from_slice(s);
                f.all.push(if self.chosen[i].is_some() { 1.0 } else { 0.0 });
                f.mask.push(1.0);
            } else {
                f.all.extend_from_slice(&[0.0; VNF_FEATURES]);
                f.mask.push(0.0);
            }
        }
        f.current.extend_from_slice(&self.stat[j]);
        f.current.push(0.0);
        f.rows += 1;
    }

    pub fn play(&mut self, j: usize, m: usize) {
        self.core_load[m] += self.loads[j];
        self.core_players[m] += 1;
        self.chosen[j] = Some(m);
    }

    pub fn assignment(&self) -> Assignment {
        Assignment {
            cores: self.chosen.iter().map(|c| c.unwrap_or(0)).collect(),
        }
    }
}

/// Row-major network inputs for a batch of decisions.
#[derive(Debug, Default, Clone)]
pub struct Batch {
    pub rows: usize,
    /// rows × 2|M|
    pub summary: Vec<f32>,
    /// rows × max_vnfs × 4
    pub all: Vec<f32>,
    /// rows × max_vnfs (1: a µVNF, 0: padding)
    pub mask: Vec<f32>,
    /// rows × 4
    pub current: Vec<f32>,
}

impl Batch {
    pub fn clear(&mut self) {
        self.rows = 0;
        self.summary.clear();
        self.all.clear();
        self.mask.clear();
        self.current.clear();
    }

    pub(crate) fn tensors(
        &self,
        cores: usize,
        max_vnfs: usize,
    ) -> candle_core::Result<[Tensor; 4]> {
        let d = Device::Cpu;
        let b = self.rows;
        Ok([
            Tensor::from_slice(&self.summary, (b, 2 * cores), &d)?,
            Tensor::from_slice(&self.all, (b, max_vnfs, VNF_FEATURES), &d)?,
            Tensor::from_slice(&self.mask, (b, max_vnfs), &d)?,
            Tensor::from_slice(&self.current, (b, VNF_FEATURES), &d)?,
        ])
    }
}

/// Plays `games` to the end, all at once (one batched forward pass per move):
/// greedy, or ε-greedy with `explore`. `on_move` sees each decision's inputs (row
/// `i` of the batch) and action, for the replay buffer.
pub(crate) fn play_games(
    net: &QNet,
    tie: f32,
    games: &mut [Game<'_>],
    mut explore: Option<(f64, &mut dyn rand::RngCore)>,
    on_move: &mut dyn FnMut(usize, usize, &Batch, usize, usize),
) -> Result<(), CoresError> {
    let steps = games.iter().map(|g| g.order.len()).max().unwrap_or(0);
    let mut batch = Batch::default();
    let mut who = Vec::new();
    for t in 0..steps {
        batch.clear();
        who.clear();
        for (g, game) in games.iter().enumerate() {
            if let Some(&j) = game.order.get(t) {
                game.features(j, net.max_vnfs, &mut batch);
                who.push((g, j));
            }
        }
        if who.is_empty() {
            break;
        }
        let q = net.q_values(&batch)?;
        let m = net.cores;
        for (row, &(g, j)) in who.iter().enumerate() {
            let qs = &q[row * m..(row + 1) * m];
            let best = qs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            // Ties: cores whose predicted payoff is within `tie` of the best are
            // equal to the player (the paper's argmax leaves ties open); it takes the
            // least loaded of them, as §II-C's guidelines would.
            let load = &games[g].core_load;
            let greedy = (0..m)
                .filter(|&c| qs[c] >= best - tie)
                .min_by(|&a, &b| load[a].total_cmp(&load[b]).then(a.cmp(&b)))
                .unwrap_or(0);
            let action = match explore.as_mut() {
                Some((eps, rng)) => {
                    if rng.gen::<f64>() < *eps {
                        rng.gen_range(0..m)
                    } else {
                        greedy
                    }
                }
                None => greedy,
            };
            on_move(g, j, &batch, row, action);
            games[g].play(j, action);
        }
    }
    Ok(())
}

/// The learned assigner: one Q-network per core count.
pub struct LearnedAssigner {
    nets: BTreeMap<usize, QNet>,
    max_vnfs: usize,
    tie: f32,
}

impl LearnedAssigner {
    pub fn new(nets: BTreeMap<usize, QNet>, max_vnfs: usize) -> Self {
        LearnedAssigner {
            nets,
            max_vnfs,
            tie: TIE_TOLERANCE,
        }
    }

    /// Another tie tolerance (0: plain argmax, ties to the lowest core).
    pub fn with_tie_tolerance(mut self, tie: f32) -> Self {
        self.tie = if tie.is_finite() { tie.max(0.0) } else { 0.0 };
        self
    }

    pub fn core_counts(&self) -> Vec<usize> {
        self.nets.keys().copied().collect()
    }

    pub fn max_vnfs(&self) -> usize {
        self.max_vnfs
    }
}

impl Assigner for LearnedAssigner {
    fn name(&self) -> &'static str {
        "s2c"
    }

    fn assign(&self, p: &Problem) -> Result<Assignment, CoresError> {
        p.validate()?;
        if p.vnfs.len() > self.max_vnfs {
            return Err(CoresError::TooManyVnfs {
                vnfs: p.vnfs.len(),
                max: self.max_vnfs,
            });
        }
        let net = self
            .nets
            .get(&p.cores)
            .ok_or_else(|| CoresError::NoNetForCores {
                cores: p.cores,
                available: self.core_counts(),
            })?;
        let mut games = [Game::new(p)];
        play_games(net, self.tie, &mut games, None, &mut |_, _, _, _, _| {})?;
        Ok(games[0].assignment())
    }
}

/// What the node runs: the model at `path`, or RR and why not. Never fails.
pub fn load_or_fallback(path: &Path) -> (Box<dyn Assigner>, Option<String>) {
    match Sfc2cpuModel::load(path) {
        Ok(m) => (Box::new(m.assigner()), None),
        Err(e) => {
            let why = format!("learned assigner unavailable, using RR: {e}");
            tracing::warn!(path = %path.display(), error = %e, "sfc2cpu model not loaded; falling back to round robin");
            (Box::new(RoundRobin), Some(why))
        }
    }
}
