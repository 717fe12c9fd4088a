//! Training the Q-networks in the twin (§IV-B, §IV-D, Table II), one per core count.
//!
//! A round plays `games_per_round` generated training instances (train stream only)
//! as the sequential game, all at once, ε-greedy. When a game ends the twin gives
//! every player its payoff π_j (achieved / requested rate of its SFC), and each move
//! becomes one experience (inputs, core, π_j). Then `updates_per_round` Adam steps on
//! a prioritized minibatch: loss = mean_i w_i · (Q(s_i, a_i) − π_i)², priorities
//! |Q − π|^α, importance weights w_i = (N·P(i))^−β / max w, β annealed to 1.
//!
//! Each player moves once and its payoff is known only when the game ends, so from
//! its point of view every move is terminal: the Q-learning target is π_j itself, and
//! double Q-learning's target network has nothing to bootstrap (we keep the dueling
//! head and prioritized replay). The other players' later moves are part of the
//! environment, played by the current policy: the network learns best responses to
//! it (§IV-B).
//!
//! Deviations for a 2-core CPU budget (docs/cores.md): minibatches of 256 instead of
//! 2048, a replay of 100k instead of 500k, a fixed learning rate instead of
//! population-based training, ε annealed over the run's first half instead of 500k
//! steps. Every `validate_every` rounds the greedy policy plays a fixed set of
//! validation instances (train stream, never trained on) and the best weights are
//! kept: model selection in place of ASHA.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use learnkit::QWeights;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::model::{ModelHeader, NetInfo, Sfc2cpuModel, MODEL_FORMAT, MODEL_VERSION};
use super::net::{net_err, QNet};
use super::{play_games, Batch, Game, FEATURES, VNF_FEATURES};
use crate::assign::{Assigner, RoundRobin};
use crate::generate::{generate, GenSpec, Seed};
use crate::problem::Problem;
use crate::twin::{evaluate_unchecked, TwinParams};
use crate::CoresError;

/// Validation instances come from this far into the train stream; training counts
/// up from `first_seed` and never gets there.
const VALID_BASE: u64 = 1 << 62;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Core counts to train a network for.
    pub cores: Vec<usize>,
    /// Rounds per core count.
    pub rounds: usize,
    /// Wall-time cap per core count, seconds (the run stops at whichever of rounds
    /// and seconds comes first; ε follows the further along of the two).
    pub seconds: Option<f64>,
    pub games_per_round: usize,
    pub updates_per_round: usize,
    pub batch: usize,
    pub replay: usize,
    /// Experiences before the first step.
    pub warmup: usize,
    pub lr: f64,
    pub eps_start: f64,
    pub eps_end: f64,
    /// Fraction of the run over which ε anneals.
    pub eps_decay: f64,
    pub per_alpha: f64,
    pub per_beta_start: f64,
    pub validate_every: usize,
    pub validation_instances: usize,
    /// Weight init, exploration and sampling.
    pub seed: u64,
    /// Training instance i of a core count is `Seed::train(first_seed + i)`.
    pub first_seed: u64,
    pub max_vnfs: usize,
    /// The greedy moves' tie tolerance (see [`super::TIE_TOLERANCE`]); absent in
    /// files trained before it existed, which used plain argmax.
    #[serde(default)]
    pub tie_tolerance: f32,
    pub gen: GenSpec,
    pub twin: TwinParams,
}

impl TrainConfig {
    /// The configuration of the shipped model (with `--seconds` per core count).
    pub fn standard() -> Self {
        TrainConfig {
            cores: vec![2, 4, 8, 12, 16],
            rounds: 4000,
            seconds: Some(200.0),
            games_per_round: 32,
            updates_per_round: 8,
            batch: 256,
            replay: 100_000,
            warmup: 2048,
            lr: 1e-3,
            eps_start: 1.0,
            eps_end: 0.02,
            eps_decay: 0.5,
            per_alpha: 0.6,
            per_beta_start: 0.4,
            validate_every: 10,
            validation_instances: 64,
            seed: 1,
            first_seed: 0,
            max_vnfs: 16,
            tie_tolerance: super::TIE_TOLERANCE,
            gen: GenSpec::default(),
            twin: TwinParams::default(),
        }
    }

    /// Seconds, for the smoke test.
    pub fn tiny() -> Self {
        TrainConfig {
            cores: vec![4],
            rounds: 120,
            seconds: None,
            games_per_round: 32,
            updates_per_round: 4,
            batch: 128,
            replay: 20_000,
            warmup: 512,
            validate_every: 20,
            validation_instances: 32,
            ..TrainConfig::standard()
        }
    }

    pub fn validate(&self) -> Result<(), CoresError> {
        let bad = |f: &str, r: String| Err(CoresError::invalid(f, r));
        if self.cores.is_empty() || self.cores.iter().any(|&c| c == 0 || c > 1024) {
            return bad("cores", format!("need 1..=1024 each, got {:?}", self.cores));
        }
        if self.rounds == 0 || self.games_per_round == 0 {
            return bad("rounds", "rounds and games_per_round must be ≥ 1".into());
        }
        if let Some(s) = self.seconds {
            if !(s.is_finite() && s > 0.0) {
                return bad("seconds", format!("must be > 0, got {s}"));
            }
        }
        if self.batch == 0 || self.replay < self.batch || self.replay > 10_000_000 {
            return bad(
                "batch",
                format!(
                    "need 1 ≤ batch ≤ replay ≤ 1e7, got {} / {}",
                    self.batch, self.replay
                ),
            );
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("lr", format!("must be > 0, got {}", self.lr));
        }
        for (f, v) in [
            ("eps_start", self.eps_start),
            ("eps_end", self.eps_end),
            ("eps_decay", self.eps_decay),
            ("per_alpha", self.per_alpha),
            ("per_beta_start", self.per_beta_start),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return bad(f, format!("must be in [0, 1], got {v}"));
            }
        }
        if self.max_vnfs < self.gen.total_vnfs.1 {
            return bad(
                "max_vnfs",
                format!(
                    "{} is below the generator's {}",
                    self.max_vnfs, self.gen.total_vnfs.1
                ),
            );
        }
        self.gen.validate()?;
        self.twin.validate()
    }
}

/// What one round measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundReport {
    pub cores: usize,
    pub round: usize,
    pub epsilon: f64,
    /// Σ delivered / Σ offered over the round's (exploring) games.
    pub throughput_ratio: f64,
    pub loss: f64,
    pub grad_steps: u64,
    /// Greedy policy on the validation instances, when validated this round.
    pub valid_ratio: Option<f64>,
}

/// Summary stored in the model header, per core count.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TrainMetrics {
    pub rounds: usize,
    pub games: u64,
    pub grad_steps: u64,
    pub wall_secs: f64,
    pub loss_first: f64,
    pub loss_last: f64,
    /// Σ delivered / Σ offered of the kept weights on the validation instances, and
    /// of RR on the same instances.
    pub valid_ratio: f64,
    pub valid_ratio_rr: f64,
    pub best_round: usize,
}

/// Proportional prioritized replay over a sum tree.
struct Replay {
    cap: usize,
    summary_w: usize,
    n: usize,
    summary: Vec<f32>,
    all: Vec<f32>,
    mask: Vec<f32>,
    current: Vec<f32>,
    action: Vec<u32>,
    reward: Vec<f32>,
    tree: Vec<f64>,
    leaves: usize,
    max_prio: f64,
    len: usize,
    head: usize,
}

impl Replay {
    fn new(cap: usize, cores: usize, n: usize) -> Self {
        let leaves = cap.next_power_of_two();
        Replay {
            cap,
            summary_w: 2 * cores,
            n,
            summary: vec![0.0; cap * 2 * cores],
            all: vec![0.0; cap * n * VNF_FEATURES],
            mask: vec![0.0; cap * n],
            current: vec![0.0; cap * VNF_FEATURES],
            action: vec![0; cap],
            reward: vec![0.0; cap],
            tree: vec![0.0; 2 * leaves],
            leaves,
            max_prio: 1.0,
            len: 0,
            head: 0,
        }
    }

    fn set_prio(&mut self, i: usize, p: f64) {
        let mut k = self.leaves + i;
        let d = p - self.tree[k];
        while k >= 1 {
            self.tree[k] += d;
            k /= 2;
        }
    }

    fn total(&self) -> f64 {
        self.tree[1]
    }

    /// The leaf where the prefix sum passes `u`.
    fn find(&self, mut u: f64) -> usize {
        let mut k = 1;
        while k < self.leaves {
            let l = 2 * k;
            if u <= self.tree[l] || self.tree[l + 1] <= 0.0 {
                k = l;
            } else {
                u -= self.tree[l];
                k = l + 1;
            }
        }
        (k - self.leaves).min(self.len.saturating_sub(1))
    }

    fn push(&mut self, b: &Batch, row: usize, action: usize, reward: f32) {
        let i = self.head;
        let (sw, n) = (self.summary_w, self.n);
        self.summary[i * sw..(i + 1) * sw].copy_from_slice(&b.summary[row * sw..(row + 1) * sw]);
        let a = n * VNF_FEATURES;
        self.all[i * a..(i + 1) * a].copy_from_slice(&b.all[row * a..(row + 1) * a]);
        self.mask[i * n..(i + 1) * n].copy_from_slice(&b.mask[row * n..(row + 1) * n]);
        self.current[i * VNF_FEATURES..(i + 1) * VNF_FEATURES]
            .copy_from_slice(&b.current[row * VNF_FEATURES..(row + 1) * VNF_FEATURES]);
        self.action[i] = action as u32;
        self.reward[i] = reward;
        let p = self.max_prio;
        self.set_prio(i, p);
        self.head = (self.head + 1) % self.cap;
        self.len = (self.len + 1).min(self.cap);
    }
}

/// One pending experience: the game, the player, its inputs and move.
struct Move {
    game: usize,
    vnf: usize,
    batch: Batch,
    action: usize,
}

struct Trainer<'c> {
    cfg: &'c TrainConfig,
    cores: usize,
    net: QNet,
    opt: AdamW,
    replay: Replay,
    rng: ChaCha8Rng,
    grad_steps: u64,
}

impl Trainer<'_> {
    fn step(&mut self, beta: f64) -> candle_core::Result<f64> {
        let b = self.cfg.batch;
        let (sw, n) = (self.replay.summary_w, self.replay.n);
        let mut batch = Batch::default();
        let mut idx = Vec::with_capacity(b);
        let mut act = Vec::with_capacity(b);
        let mut rew = Vec::with_capacity(b);
        let mut w = Vec::with_capacity(b);
        let total = self.replay.total();
        let len = self.replay.len as f64;
        let seg = total / b as f64;
        for s in 0..b {
            // Stratified: one draw per equal slice of the priority mass.
            let u = seg * (s as f64 + self.rng.gen::<f64>());
            let i = self.replay.find(u);
            let p = self.replay.tree[self.replay.leaves + i] / total;
            w.push((len * p).powf(-beta));
            idx.push(i);
            let r = &self.replay;
            batch
                .summary
                .extend_from_slice(&r.summary[i * sw..(i + 1) * sw]);
            let a = n * VNF_FEATURES;
            batch.all.extend_from_slice(&r.all[i * a..(i + 1) * a]);
            batch.mask.extend_from_slice(&r.mask[i * n..(i + 1) * n]);
            batch
                .current
                .extend_from_slice(&r.current[i * VNF_FEATURES..(i + 1) * VNF_FEATURES]);
            act.push(r.action[i]);
            rew.push(r.reward[i]);
            batch.rows += 1;
        }
        let wmax = w.iter().copied().fold(f64::MIN_POSITIVE, f64::max);
        let w: Vec<f32> = w.iter().map(|x| (x / wmax) as f32).collect();
        let dev = Device::Cpu;
        let [s, a, m, c] = batch.tensors(self.cores, n)?;
        let q = self.net.forward(&s, &a, &m, &c)?;
        let act = Tensor::from_vec(act, (b, 1), &dev)?;
        let qa = q.gather(&act, 1)?.squeeze(1)?;
        let y = Tensor::from_vec(rew, b, &dev)?;
        let wt = Tensor::from_vec(w, b, &dev)?;
        let td = (qa - y)?;
        let loss = (td.sqr()? * wt)?.mean_all()?;
        self.opt.backward_step(&loss)?;
        let td: Vec<f32> = td.to_vec1()?;
        for (&i, d) in idx.iter().zip(td) {
            let p = (f64::from(d.abs()) + 1e-3).powf(self.cfg.per_alpha);
            self.replay.max_prio = self.replay.max_prio.max(p);
            self.replay.set_prio(i, p);
        }
        self.grad_steps += 1;
        loss.to_dtype(DType::F64)?.to_scalar::<f64>()
    }
}

/// Σ delivered / Σ offered of the greedy policy (or RR) over `problems`.
fn ratio_of(
    net: Option<&QNet>,
    tie: f32,
    problems: &[Problem],
    twin: &TwinParams,
) -> Result<f64, CoresError> {
    let assignments = match net {
        Some(net) => {
            let mut games: Vec<Game<'_>> = problems.iter().map(Game::new).collect();
            play_games(net, tie, &mut games, None, &mut |_, _, _, _, _| {})?;
            games.iter().map(Game::assignment).collect::<Vec<_>>()
        }
        None => problems
            .iter()
            .map(|p| RoundRobin.assign(p))
            .collect::<Result<Vec<_>, _>>()?,
    };
    let (mut got, mut asked) = (0.0, 0.0);
    for (p, a) in problems.iter().zip(&assignments) {
        got += evaluate_unchecked(p, a, twin).throughput_mpps;
        asked += p.offered_mpps();
    }
    Ok(if asked > 0.0 { got / asked } else { 1.0 })
}

fn train_one(
    cfg: &TrainConfig,
    cores: usize,
    progress: &mut dyn FnMut(&RoundReport),
) -> Result<(QNet, TrainMetrics), CoresError> {
    let t0 = Instant::now();
    let mut net = QNet::new(cores, cfg.max_vnfs)?;
    net.reseed(cfg.seed ^ (cores as u64).wrapping_mul(0x9e37_79b9))?;
    let params = ParamsAdamW {
        lr: cfg.lr,
        weight_decay: 0.0,
        ..ParamsAdamW::default()
    };
    let opt = AdamW::new(net.vars.all_vars(), params).map_err(|e| net_err("optimiser", e))?;
    let valid: Vec<Problem> = (0..cfg.validation_instances as u64)
        .map(|i| generate(&cfg.gen, cores, Seed::train(VALID_BASE + i)).map(|g| g.problem))
        .collect::<Result<_, _>>()?;
    let valid_rr = ratio_of(None, 0.0, &valid, &cfg.twin)?;
    let mut t = Trainer {
        cfg,
        cores,
        net,
        opt,
        replay: Replay::new(cfg.replay, cores, cfg.max_vnfs),
        rng: ChaCha8Rng::seed_from_u64(cfg.seed ^ 0x5eed ^ cores as u64),
        grad_steps: 0,
    };
    let mut explore_rng = ChaCha8Rng::seed_from_u64(cfg.seed ^ 0xe4b1 ^ cores as u64);
    let mut best = (f64::MIN, 0usize, HashMap::new());
    let mut losses = Vec::new();
    let mut next_seed = cfg.first_seed;
    let mut games_played = 0u64;
    let mut round = 0;
    while round < cfg.rounds {
        let progress_frac = {
            let by_rounds = round as f64 / cfg.rounds as f64;
            let by_time = cfg.seconds.map_or(0.0, |s| t0.elapsed().as_secs_f64() / s);
            by_rounds.max(by_time)
        };
        if progress_frac >= 1.0 {
            break;
        }
        let eps = cfg.eps_start
            + (cfg.eps_end - cfg.eps_start) * (progress_frac / cfg.eps_decay.max(1e-9)).min(1.0);
        let beta = cfg.per_beta_start + (1.0 - cfg.per_beta_start) * progress_frac;
        let problems: Vec<Problem> = (0..cfg.games_per_round)
            .map(|_| {
                let s = Seed::train(next_seed);
                next_seed += 1;
                generate(&cfg.gen, cores, s).map(|g| g.problem)
            })
            .collect::<Result<_, _>>()?;
        let mut games: Vec<Game<'_>> = problems.iter().map(Game::new).collect();
        let mut moves: Vec<Move> = Vec::new();
        play_games(
            &t.net,
            cfg.tie_tolerance,
            &mut games,
            Some((eps, &mut explore_rng)),
            &mut |g, j, b, row, a| {
                let mut one = Batch::default();
                let sw = 2 * cores;
                let n = cfg.max_vnfs;
                one.summary
                    .extend_from_slice(&b.summary[row * sw..(row + 1) * sw]);
                one.all.extend_from_slice(
                    &b.all[row * n * VNF_FEATURES..(row + 1) * n * VNF_FEATURES],
                );
                one.mask.extend_from_slice(&b.mask[row * n..(row + 1) * n]);
                one.current
                    .extend_from_slice(&b.current[row * VNF_FEATURES..(row + 1) * VNF_FEATURES]);
                one.rows = 1;
                moves.push(Move {
                    game: g,
                    vnf: j,
                    batch: one,
                    action: a,
                });
            },
        )?;
        games_played += games.len() as u64;
        let (mut got, mut asked) = (0.0, 0.0);
        let payoffs: Vec<Vec<f64>> = games
            .iter()
            .map(|g| {
                let pred = evaluate_unchecked(g.p, &g.assignment(), &cfg.twin);
                got += pred.throughput_mpps;
                asked += g.p.offered_mpps();
                pred.payoff
            })
            .collect();
        for mv in &moves {
            let r = payoffs[mv.game][mv.vnf] as f32;
            t.replay.push(&mv.batch, 0, mv.action, r);
        }
        let mut round_loss = Vec::new();
        if t.replay.len >= cfg.warmup.max(cfg.batch) {
            for _ in 0..cfg.updates_per_round {
                let l = t.step(beta).map_err(|e| net_err("training step", e))?;
                round_loss.push(l);
            }
        }
        let loss = if round_loss.is_empty() {
            0.0
        } else {
            round_loss.iter().sum::<f64>() / round_loss.len() as f64
        };
        if !round_loss.is_empty() {
            losses.push(loss);
        }
        let mut valid_ratio = None;
        if (round + 1) % cfg.validate_every.max(1) == 0 && t.grad_steps > 0 {
            let v = ratio_of(Some(&t.net), cfg.tie_tolerance, &valid, &cfg.twin)?;
            valid_ratio = Some(v);
            if v > best.0 {
                best = (v, round, t.net.tensors());
            }
        }
        let rep = RoundReport {
            cores,
            round,
            epsilon: eps,
            throughput_ratio: if asked > 0.0 { got / asked } else { 1.0 },
            loss,
            grad_steps: t.grad_steps,
            valid_ratio,
        };
        tracing::debug!(cores, round, eps, loss, "sfc2cpu training round");
        progress(&rep);
        round += 1;
    }
    // The last weights compete with the best validated ones.
    let last = ratio_of(Some(&t.net), cfg.tie_tolerance, &valid, &cfg.twin)?;
    if last >= best.0 {
        best = (last, round.saturating_sub(1), t.net.tensors());
    }
    let mut net = t.net;
    net.load_tensors(&best.2)?;
    let (loss_first, loss_last) = learnkit::fifth_means(&losses);
    let metrics = TrainMetrics {
        rounds: round,
        games: games_played,
        grad_steps: t.grad_steps,
        wall_secs: t0.elapsed().as_secs_f64(),
        loss_first,
        loss_last,
        valid_ratio: best.0,
        valid_ratio_rr: valid_rr,
        best_round: best.1,
    };
    tracing::info!(cores, ?metrics, "sfc2cpu network trained");
    Ok((net, metrics))
}

/// Trains one network per core count of `cfg`; `progress` sees every round.
pub fn train(
    cfg: &TrainConfig,
    progress: &mut dyn FnMut(&RoundReport),
) -> Result<Sfc2cpuModel, CoresError> {
    cfg.validate()?;
    let mut nets = BTreeMap::new();
    let mut metrics = BTreeMap::new();
    for &c in &cfg.cores {
        let (net, m) = train_one(cfg, c, progress)?;
        nets.insert(c, net);
        metrics.insert(c, m);
    }
    let header = ModelHeader {
        format: MODEL_FORMAT.to_string(),
        version: MODEL_VERSION,
        features: FEATURES.iter().map(|s| s.to_string()).collect(),
        net: NetInfo::this_build(),
        cores: nets.keys().copied().collect(),
        max_vnfs: cfg.max_vnfs,
        train: Some(cfg.clone()),
        metrics,
    };
    Ok(Sfc2cpuModel { header, nets })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_tree_samples_by_priority() {
        let mut r = Replay::new(4, 1, 1);
        let b = Batch {
            rows: 1,
            summary: vec![0.0; 2],
            all: vec![0.0; VNF_FEATURES],
            mask: vec![1.0],
            current: vec![0.0; VNF_FEATURES],
        };
        for _ in 0..4 {
            r.push(&b, 0, 0, 0.0);
        }
        r.set_prio(0, 1.0);
        r.set_prio(1, 0.0);
        r.set_prio(2, 3.0);
        r.set_prio(3, 0.0);
        assert_eq!(r.total(), 4.0);
        assert_eq!(r.find(0.5), 0);
        assert_eq!(r.find(1.5), 2);
        assert_eq!(r.find(3.9), 2);
    }

    #[test]
    fn bad_configs_are_refused() {
        let mut c = TrainConfig::tiny();
        c.cores.clear();
        assert!(train(&c, &mut |_| {}).is_err());
        let mut c = TrainConfig::tiny();
        c.batch = 0;
        assert!(c.validate().is_err());
        let mut c = TrainConfig::tiny();
        c.max_vnfs = 8;
        assert!(c.validate().is_err());
    }
}
