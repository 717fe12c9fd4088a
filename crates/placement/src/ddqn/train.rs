//! Alg. 1 of paper 000: offline training of the Q-network.
//!
//! Each episode replays one generated training workload (`train_seed` only) through
//! [`crate::sim::run`] with the agent in training mode. Inside `place`, the agent
//! - builds S_t (every node's features) and runs the Filtering Algorithm on Q(S_t; θ);
//! - completes the previous decision's experiences with S_{t+1} = this state and
//!   A_{t+1} = the Filtering Algorithm's answer on it (the paper's modification of
//!   the DDQN target), and stores one experience per ECS of A_{t-1} (line 14);
//! - acts ε-greedily: a random feasible set with probability ε, else Alg. 2;
//! - samples a minibatch and takes an Adam step on
//!   L(θ) = E[(R_t + γ·Z_t − Q(S_t, a_t; θ))²], Z_t = mean over e ∈ A_{t+1} of
//!   Q(S_{t+1}, e; θ') (Eq. 7; A_{t+1} is a set, so its value is its members' mean);
//! - copies θ to θ' every C gradient steps.
//!
//! A_{t+1} is computed when S_{t+1} is seen, with θ at that time, and stored as its
//! members' feature rows: recomputing it at sampling time would need the whole
//! cluster state per experience.

use std::time::Instant;

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use learnkit::QWeights;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::features::{FEATURES, N_FEATURES};
use super::filter::{FilterParams, RewardKind};
use super::model::{DdqnModel, ModelHeader, MODEL_FORMAT, MODEL_VERSION};
use super::net::{model_err, QNet};
use super::Ddqn;
use crate::forecast::HoltWinters;
use crate::problem::{check_unit_interval, PlaceError};
use crate::sim::{run, CurrentDemand, Reserve, SimOptions};
use crate::workload::{generate, train_seed, GenSpec};

/// Hyperparameters of Alg. 1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// N: episodes (one training workload each).
    pub episodes: usize,
    /// Pool sizes of the episodes' workloads (`GenSpec::standard(n)`), cycled.
    pub pool_sizes: Vec<usize>,
    /// Episode i uses `train_seed(first_seed + i)`.
    pub first_seed: u64,
    /// Seed of weight init, exploration and minibatch sampling.
    pub seed: u64,
    pub hidden: Vec<usize>,
    pub reward: RewardKind,
    pub filter: FilterParams,
    /// γ.
    pub gamma: f64,
    pub lr: f64,
    pub batch: usize,
    /// Replay buffer capacity, in experiences (one per ECS of an action).
    pub replay: usize,
    /// Experiences stored before the first gradient step.
    pub warmup: usize,
    /// C: gradient steps between copies of θ into θ'.
    pub target_every: usize,
    /// ε decays linearly from `eps_start` to `eps_end` over the first
    /// `eps_decay` fraction of episodes.
    pub eps_start: f64,
    pub eps_end: f64,
    pub eps_decay: f64,
    /// Gradient steps per decision (Alg. 1 takes one).
    pub updates_per_decision: usize,
    /// Fraction of episodes that reserve with the Holt–Winters forecaster (the agent
    /// then sees forecast reservations as b, c, m, as it will in service).
    pub forecast_share: f64,
}

impl TrainConfig {
    /// The configuration of the shipped model.
    pub fn standard() -> Self {
        TrainConfig {
            episodes: 120,
            pool_sizes: vec![30, 60, 100],
            first_seed: 0,
            seed: 1,
            hidden: vec![64, 64],
            reward: RewardKind::Packing,
            filter: FilterParams::default(),
            gamma: 0.9,
            lr: 1e-3,
            batch: 64,
            replay: 50_000,
            warmup: 1_000,
            target_every: 500,
            eps_start: 1.0,
            eps_end: 0.02,
            eps_decay: 0.6,
            updates_per_decision: 1,
            forecast_share: 0.5,
        }
    }

    /// A small configuration for tests: seconds, not minutes.
    pub fn tiny() -> Self {
        TrainConfig {
            episodes: 8,
            pool_sizes: vec![20],
            warmup: 200,
            target_every: 100,
            replay: 10_000,
            hidden: vec![32, 32],
            ..TrainConfig::standard()
        }
    }

    pub fn validate(&self) -> Result<(), PlaceError> {
        let bad = |f: &str, r: String| Err(PlaceError::invalid(f, r));
        if self.episodes == 0 {
            return bad("episodes", "must be ≥ 1".into());
        }
        if self.pool_sizes.is_empty() || self.pool_sizes.iter().any(|&n| n < 4) {
            return bad(
                "pool_sizes",
                format!("need ≥ 1 size, each ≥ 4, got {:?}", self.pool_sizes),
            );
        }
        if !(0.0..=1.0).contains(&self.gamma) {
            return bad("gamma", format!("must be in [0, 1], got {}", self.gamma));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("lr", format!("must be > 0, got {}", self.lr));
        }
        if self.batch == 0 || self.replay < self.batch {
            return bad(
                "batch",
                format!(
                    "need 1 ≤ batch ≤ replay, got {} / {}",
                    self.batch, self.replay
                ),
            );
        }
        if self.target_every == 0 {
            return bad("target_every", "must be ≥ 1".into());
        }
        check_unit_interval(&[
            ("eps_start", self.eps_start),
            ("eps_end", self.eps_end),
            ("eps_decay", self.eps_decay),
            ("forecast_share", self.forecast_share),
        ])?;
        if self.filter.k < 1 || self.filter.max_k < self.filter.k {
            return bad(
                "filter.k",
                format!("need 1 ≤ k ≤ max_k, got {:?}", self.filter),
            );
        }
        Ok(())
    }

    fn epsilon(&self, episode: usize) -> f64 {
        let span = (self.eps_decay * self.episodes as f64).max(1.0);
        let f = (episode as f64 / span).min(1.0);
        self.eps_start + (self.eps_end - self.eps_start) * f
    }
}

/// What one training episode measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpisodeReport {
    pub episode: usize,
    pub nodes: usize,
    pub seed: u64,
    pub reserve: String,
    pub epsilon: f64,
    /// The emulator's cost of the episode (exploration included).
    pub cost: f64,
    pub rejected: usize,
    pub violations: usize,
    /// Mean loss of the episode's gradient steps (0 before warm-up).
    pub loss: f64,
    pub grad_steps: u64,
}

/// Summary stored in the model header.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TrainMetrics {
    pub episodes: usize,
    pub grad_steps: u64,
    pub wall_secs: f64,
    /// Mean loss over the first and the last fifth of the episodes with updates.
    pub loss_first: f64,
    pub loss_last: f64,
    pub train_seeds: Vec<u64>,
}

/// One stored experience: (S_t, a_t) as a_t's feature row, R_t, and (S_{t+1},
/// A_{t+1}) as the rows of the Filtering Algorithm's answer on S_{t+1}.
struct Replay {
    cap: usize,
    g_max: usize,
    x: Vec<f32>,
    next: Vec<f32>,
    mask: Vec<f32>,
    r: Vec<f32>,
    len: usize,
    head: usize,
}

impl Replay {
    fn new(cap: usize, g_max: usize) -> Self {
        Replay {
            cap,
            g_max,
            x: vec![0.0; cap * N_FEATURES],
            next: vec![0.0; cap * g_max * N_FEATURES],
            mask: vec![0.0; cap * g_max],
            r: vec![0.0; cap],
            len: 0,
            head: 0,
        }
    }

    /// `next` empty: terminal (no S_{t+1}, or no feasible A_{t+1}).
    fn push(&mut self, row: &[f32], r: f32, next: &[f32]) {
        let i = self.head;
        self.x[i * N_FEATURES..(i + 1) * N_FEATURES].copy_from_slice(row);
        let base = i * self.g_max;
        let nn = (next.len() / N_FEATURES).min(self.g_max);
        for j in 0..self.g_max {
            let dst = &mut self.next[(base + j) * N_FEATURES..(base + j + 1) * N_FEATURES];
            if j < nn {
                dst.copy_from_slice(&next[j * N_FEATURES..(j + 1) * N_FEATURES]);
                self.mask[base + j] = 1.0;
            } else {
                dst.fill(0.0);
                self.mask[base + j] = 0.0;
            }
        }
        self.r[i] = r;
        self.head = (self.head + 1) % self.cap;
        self.len = (self.len + 1).min(self.cap);
    }
}

/// The training half of a [`Ddqn`]: target network, optimiser, replay, ε.
pub(crate) struct Learner {
    target: QNet,
    opt: AdamW,
    replay: Replay,
    pub(crate) rng: ChaCha8Rng,
    pub(crate) epsilon: f64,
    gamma: f64,
    batch: usize,
    warmup: usize,
    target_every: u64,
    updates: usize,
    grad_steps: u64,
    /// The last action's rows and reward, waiting for S_{t+1}.
    pending: Option<(Vec<f32>, f32)>,
    losses: Vec<f64>,
}

impl Learner {
    /// Stores the pending experiences with `next` = A_{t+1}'s rows (None: terminal).
    pub(crate) fn complete(&mut self, next: Option<Vec<f32>>) {
        if let Some((rows, r)) = self.pending.take() {
            let next = next.unwrap_or_default();
            for row in rows.chunks_exact(N_FEATURES) {
                self.replay.push(row, r, &next);
            }
        }
    }

    pub(crate) fn begin(&mut self, rows: Vec<f32>, r: f64) {
        self.pending = Some((rows, r as f32));
    }

    /// Lines 15–17 of Alg. 1, `updates` times.
    pub(crate) fn learn(&mut self, net: &QNet) -> Result<(), PlaceError> {
        if self.replay.len < self.warmup.max(self.batch) {
            return Ok(());
        }
        for _ in 0..self.updates {
            let loss = self.step(net).map_err(|e| model_err("training step", e))?;
            self.losses.push(loss);
            self.grad_steps += 1;
            if self.grad_steps % self.target_every == 0 {
                self.target.load_tensors(&net.tensors())?;
            }
        }
        Ok(())
    }

    fn step(&mut self, net: &QNet) -> candle_core::Result<f64> {
        let b = self.batch;
        let g = self.replay.g_max;
        let mut x = Vec::with_capacity(b * N_FEATURES);
        let mut nx = Vec::with_capacity(b * g * N_FEATURES);
        let mut mask = Vec::with_capacity(b * g);
        let mut r = Vec::with_capacity(b);
        for _ in 0..b {
            let i = self.rng.gen_range(0..self.replay.len);
            x.extend_from_slice(&self.replay.x[i * N_FEATURES..(i + 1) * N_FEATURES]);
            nx.extend_from_slice(&self.replay.next[i * g * N_FEATURES..(i + 1) * g * N_FEATURES]);
            mask.extend_from_slice(&self.replay.mask[i * g..(i + 1) * g]);
            r.push(self.replay.r[i]);
        }
        let dev = Device::Cpu;
        let x = Tensor::from_vec(x, (b, N_FEATURES), &dev)?;
        let nx = Tensor::from_vec(nx, (b * g, N_FEATURES), &dev)?;
        let mask = Tensor::from_vec(mask, (b, g), &dev)?;
        let r = Tensor::from_vec(r, b, &dev)?;
        // Z_t = mean of Q(S_{t+1}, e; θ') over e ∈ A_{t+1}; 0 when terminal.
        let qn = self.target.forward(&nx)?.reshape((b, g))?;
        let cnt = mask.sum(D::Minus1)?;
        let z = (qn.mul(&mask)?.sum(D::Minus1)? / cnt.clamp(1.0, f64::MAX)?)?;
        let y = (r + (z * self.gamma)?)?.detach();
        let q = net.forward(&x)?;
        let loss = (q - y)?.sqr()?.mean_all()?;
        self.opt.backward_step(&loss)?;
        loss.to_dtype(DType::F64)?.to_scalar::<f64>()
    }
}

/// Trains a Q-network per Alg. 1; `progress` sees every episode.
pub fn train(
    cfg: &TrainConfig,
    progress: &mut dyn FnMut(&EpisodeReport),
) -> Result<DdqnModel, PlaceError> {
    cfg.validate()?;
    let t0 = Instant::now();
    let mut net = QNet::new(&cfg.hidden)?;
    net.reseed(cfg.seed)?;
    let target = net.duplicate()?;
    let params = ParamsAdamW {
        lr: cfg.lr,
        weight_decay: 0.0,
        ..ParamsAdamW::default()
    };
    let opt = AdamW::new(net.vars.all_vars(), params).map_err(|e| model_err("optimiser", e))?;
    // G_max is a property of the workload; the generator's standard spec fixes it,
    // and the replay stores A_{t+1} padded to it.
    let g_max = cfg
        .pool_sizes
        .iter()
        .map(|&n| GenSpec::standard(n).limits.g_max)
        .max()
        .unwrap_or(4);
    let learner = Learner {
        target,
        opt,
        replay: Replay::new(cfg.replay, g_max),
        rng: ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x5eed),
        epsilon: cfg.eps_start,
        gamma: cfg.gamma,
        batch: cfg.batch,
        warmup: cfg.warmup,
        target_every: cfg.target_every as u64,
        updates: cfg.updates_per_decision.max(1),
        grad_steps: 0,
        pending: None,
        losses: Vec::new(),
    };
    let mut agent = Ddqn::from_net(net, cfg.filter, cfg.reward);
    agent.learner = Some(Box::new(learner));
    let mut seeds = Vec::new();
    let mut ep_losses = Vec::new();
    let mut pick = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0xf0ca);
    for ep in 0..cfg.episodes {
        let n = cfg.pool_sizes[ep % cfg.pool_sizes.len()];
        let seed = train_seed(cfg.first_seed + ep as u64);
        seeds.push(seed);
        let w = generate(&GenSpec::standard(n), seed)?;
        let eps = cfg.epsilon(ep);
        if let Some(l) = agent.learner.as_mut() {
            l.epsilon = eps;
            l.losses.clear();
        }
        let mut hw;
        let mut cur = CurrentDemand;
        let reserve: &mut dyn Reserve = if pick.gen::<f64>() < cfg.forecast_share {
            hw = HoltWinters::for_period(w.period)?;
            &mut hw
        } else {
            &mut cur
        };
        let rep = run(&w, &mut agent, reserve, &SimOptions::default())?;
        let (loss, steps) = match agent.learner.as_mut() {
            Some(l) => {
                // The episode ends: the last action's experiences are terminal.
                l.complete(None);
                let m = if l.losses.is_empty() {
                    0.0
                } else {
                    l.losses.iter().sum::<f64>() / l.losses.len() as f64
                };
                (m, l.grad_steps)
            }
            None => (0.0, 0),
        };
        if steps > 0 {
            ep_losses.push(loss);
        }
        let er = EpisodeReport {
            episode: ep,
            nodes: n,
            seed,
            reserve: rep.reserve.clone(),
            epsilon: eps,
            cost: rep.cost,
            rejected: rep.rejected,
            violations: rep.violations,
            loss,
            grad_steps: steps,
        };
        tracing::info!(
            episode = ep,
            nodes = n,
            cost = rep.cost,
            loss,
            epsilon = eps,
            "ddqn training episode"
        );
        progress(&er);
    }
    let (loss_first, loss_last) = learnkit::fifth_means(&ep_losses);
    let metrics = TrainMetrics {
        episodes: cfg.episodes,
        grad_steps: agent.learner.as_ref().map(|l| l.grad_steps).unwrap_or(0),
        wall_secs: t0.elapsed().as_secs_f64(),
        loss_first,
        loss_last,
        train_seeds: seeds,
    };
    let header = ModelHeader {
        format: MODEL_FORMAT.to_string(),
        version: MODEL_VERSION,
        features: FEATURES.iter().map(|s| s.to_string()).collect(),
        hidden: cfg.hidden.clone(),
        reward: cfg.reward,
        filter: cfg.filter,
        train: Some(cfg.clone()),
        metrics,
    };
    Ok(DdqnModel {
        header,
        net: agent.net,
    })
}
