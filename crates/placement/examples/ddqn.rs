//! Train, evaluate and time the DDQN placement agent.
//!
//! ```text
//! cargo run --release -p placement --example ddqn -- train [--reward paper|packing]
//!     [--episodes N] [--out crates/placement/models/ddqn.safetensors]
//! cargo run --release -p placement --example ddqn -- eval MODEL [--nodes 60] [--seeds 8]
//! cargo run --release -p placement --example ddqn -- latency MODEL [--nodes 1000]
//! ```
//! `eval` runs First Fit, Best Fit and the model on held-out workloads
//! (`test_seed(i)`), each with current-demand and Holt–Winters reservations.

use std::time::Instant;

use placement::ddqn::{train, DdqnModel, RewardKind, TrainConfig};
use placement::forecast::HoltWinters;
use placement::heuristics::{BestFit, FirstFit};
use placement::sim::{percentile, run, CurrentDemand, Reserve, SimOptions, SimReport};
use placement::workload::{generate, test_seed, GenSpec};
use placement::Placer;

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("train") => {
            let mut cfg = TrainConfig::standard();
            cfg.episodes = arg(&args, "--episodes", cfg.episodes);
            cfg.filter.k = arg(&args, "--k", cfg.filter.k);
            cfg.gamma = arg(&args, "--gamma", cfg.gamma);
            cfg.forecast_share = arg(&args, "--forecast-share", cfg.forecast_share);
            cfg.seed = arg(&args, "--seed", cfg.seed);
            if arg(&args, "--reward", String::from("packing")) == "paper" {
                cfg.reward = RewardKind::Paper;
            }
            let out: String = arg(
                &args,
                "--out",
                String::from("crates/placement/models/ddqn.safetensors"),
            );
            let t0 = Instant::now();
            let model = train(&cfg, &mut |r| {
                eprintln!(
                    "ep {:3} n={:3} {:8} eps={:.2} cost={:8.1} rej={} viol={} loss={:.4} steps={}",
                    r.episode,
                    r.nodes,
                    r.reserve,
                    r.epsilon,
                    r.cost,
                    r.rejected,
                    r.violations,
                    r.loss,
                    r.grad_steps
                )
            })?;
            model.save(&out)?;
            let size = std::fs::metadata(&out)?.len();
            println!(
                "trained in {:.1} s, {} params, {} bytes -> {out}; loss first {:.4} last {:.4}",
                t0.elapsed().as_secs_f64(),
                model.param_count(),
                size,
                model.header.metrics.loss_first,
                model.header.metrics.loss_last
            );
        }
        Some("eval") => {
            let path = args.get(1).ok_or("eval MODEL")?;
            let mut model = DdqnModel::load(path)?;
            // Ablations: the same weights under another k or reward.
            model.header.filter.k = arg(&args, "--k", model.header.filter.k);
            model.header.filter.max_k = model.header.filter.max_k.max(2 * model.header.filter.k);
            match arg(&args, "--reward", String::new()).as_str() {
                "paper" => model.header.reward = RewardKind::Paper,
                "packing" => model.header.reward = RewardKind::Packing,
                _ => {}
            }
            let nodes = arg(&args, "--nodes", 60usize);
            let seeds = arg(&args, "--seeds", 8u64);
            eval(&model, nodes, seeds)?;
        }
        Some("latency") => {
            let path = args.get(1).ok_or("latency MODEL")?;
            let model = DdqnModel::load(path)?;
            let nodes = arg(&args, "--nodes", 1000usize);
            let w = generate(&GenSpec::standard(nodes), test_seed(0))?;
            let mut agent = model.placer()?;
            let rep = run(&w, &mut agent, &mut CurrentDemand, &SimOptions::default())?;
            let mut bf = BestFit::default();
            let brep = run(&w, &mut bf, &mut CurrentDemand, &SimOptions::default())?;
            println!(
                "{nodes} nodes, {} decisions: ddqn p50 {:.3} ms p99 {:.3} ms max {:.3} ms (bf p99 {:.3} ms); \
                 stats {:?}; cost ddqn {:.1} bf {:.1}; violations {}",
                rep.decision_ms.len(),
                percentile(&rep.decision_ms, 0.5),
                percentile(&rep.decision_ms, 0.99),
                percentile(&rep.decision_ms, 1.0),
                percentile(&brep.decision_ms, 0.99),
                agent.stats,
                rep.cost,
                brep.cost,
                rep.violations
            );
        }
        Some("profile") => {
            // Where a decision's time goes: scoring (features + forward) vs the whole.
            let path = args.get(1).ok_or("profile MODEL")?;
            let model = DdqnModel::load(path)?;
            let nodes = arg(&args, "--nodes", 1000usize);
            let w = generate(&GenSpec::standard(nodes), test_seed(0))?;
            struct Timed {
                agent: placement::ddqn::Ddqn,
                q_ms: Vec<f64>,
                f_ms: Vec<f64>,
            }
            impl Placer for Timed {
                fn name(&self) -> &str {
                    "timed"
                }
                fn place(
                    &mut self,
                    s: &placement::ClusterState,
                    r: &placement::Request,
                ) -> Result<Vec<usize>, placement::PlaceError> {
                    let t0 = Instant::now();
                    let pool = placement::ddqn::features::PoolRef::new(s);
                    let all: Vec<usize> = (0..s.nodes().len()).collect();
                    let mut f = Vec::new();
                    placement::ddqn::features::node_features(s, &pool, r, &all, &mut f);
                    self.f_ms.push(t0.elapsed().as_secs_f64() * 1e3);
                    let t0 = Instant::now();
                    self.agent.q_values(s, r)?;
                    self.q_ms.push(t0.elapsed().as_secs_f64() * 1e3);
                    self.agent.place(s, r)
                }
            }
            let mut t = Timed {
                agent: model.placer()?,
                q_ms: Vec::new(),
                f_ms: Vec::new(),
            };
            let rep = run(&w, &mut t, &mut CurrentDemand, &SimOptions::default())?;
            println!(
                "features p50 {:.3} p99 {:.3} ms; score p50 {:.3} p99 {:.3} ms; score+place p50 {:.3} p99 {:.3} ms",
                percentile(&t.f_ms, 0.5),
                percentile(&t.f_ms, 0.99),
                percentile(&t.q_ms, 0.5),
                percentile(&t.q_ms, 0.99),
                percentile(&rep.decision_ms, 0.5),
                percentile(&rep.decision_ms, 0.99)
            );
        }
        _ => {
            eprintln!("usage: ddqn train|eval MODEL|latency MODEL [options]");
            std::process::exit(2);
        }
    }
    Ok(())
}

fn eval(model: &DdqnModel, nodes: usize, seeds: u64) -> Result<(), Box<dyn std::error::Error>> {
    let names = ["ff", "bf", "ddqn"];
    // [algorithm][reserve: 0 current, 1 holt-winters] -> costs per seed
    let mut costs = vec![[Vec::new(), Vec::new()]; names.len()];
    let mut bad = 0usize;
    let mut lbs = Vec::new();
    for i in 0..seeds {
        let w = generate(&GenSpec::standard(nodes), test_seed(i))?;
        lbs.push(lower_bound(&w));
        for (a, name) in names.iter().enumerate() {
            for (ri, c) in costs[a].iter_mut().enumerate() {
                let mut placer: Box<dyn Placer> = match *name {
                    "ff" => Box::new(FirstFit::default()),
                    "bf" => Box::new(BestFit::default()),
                    _ => Box::new(model.placer()?),
                };
                let mut hw;
                let mut cur = CurrentDemand;
                let reserve: &mut dyn Reserve = if ri == 1 {
                    hw = HoltWinters::for_period(w.period)?;
                    &mut hw
                } else {
                    &mut cur
                };
                let rep: SimReport = run(&w, placer.as_mut(), reserve, &SimOptions::default())?;
                bad += rep.violations + rep.bad_answers;
                if rep.rejected > 0 {
                    eprintln!("seed {i} {name}/{}: {} rejected", rep.reserve, rep.rejected);
                }
                c.push(rep.cost);
            }
        }
        eprintln!(
            "seed {i}: ff {:.1} bf {:.1} ddqn {:.1} | +hw: ff {:.1} bf {:.1} ddqn {:.1}",
            costs[0][0][i as usize],
            costs[1][0][i as usize],
            costs[2][0][i as usize],
            costs[0][1][i as usize],
            costs[1][1][i as usize],
            costs[2][1][i as usize]
        );
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let m: Vec<[f64; 2]> = costs.iter().map(|c| [mean(&c[0]), mean(&c[1])]).collect();
    println!("held-out: {seeds} workloads of GenSpec::standard({nodes}), test_seed(0..{seeds})");
    for (a, name) in names.iter().enumerate() {
        println!(
            "  {name:5} current {:9.1}   holt-winters {:9.1}   forecast_gain {:+.1}%",
            m[a][0],
            m[a][1],
            100.0 * (m[a][0] - m[a][1]) / m[a][0]
        );
    }
    println!(
        "  lower bound on node cost (current demand, fractional, per dimension) {:.1}; bf is {:+.1}% above it",
        mean(&lbs),
        100.0 * (m[1][0] / mean(&lbs) - 1.0)
    );
    println!(
        "  ddqn vs ff {:+.1}%  vs bf {:+.1}%  (negative = cheaper); violations+bad answers {bad}",
        100.0 * (m[2][0] / m[0][0] - 1.0),
        100.0 * (m[2][0] / m[1][0] - 1.0)
    );
    Ok(())
}

/// A lower bound on Σ_t Σ k_e (current-demand reservations): each step, in each
/// dimension, the demand times the cheapest price per unit of U·capacity in the
/// pool; the largest dimension counts. It ignores G_min, Eq. 6 and integrality, so
/// no placement reaches it.
fn lower_bound(w: &placement::workload::Workload) -> f64 {
    let u = w.limits.threshold;
    let per = |f: fn(&placement::Resources) -> f64| {
        w.nodes
            .iter()
            .filter(|n| f(&n.capacity) > 0.0)
            .map(|n| n.price / (u * f(&n.capacity)))
            .fold(f64::MAX, f64::min)
    };
    let unit = [per(|r| r.bw), per(|r| r.cpu), per(|r| r.mem)];
    (0..w.steps)
        .map(|t| {
            let mut d = [0.0f64; 3];
            for x in w.tenants.iter().filter_map(|x| x.at(t)) {
                d[0] += x.bw;
                d[1] += x.cpu;
                d[2] += x.mem;
            }
            (0..3).map(|i| d[i] * unit[i]).fold(0.0, f64::max)
        })
        .sum()
}
