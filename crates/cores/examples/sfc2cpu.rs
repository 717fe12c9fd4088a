//! Train and evaluate the sfc2cpu learned assigner in the twin.
//!
//! ```text
//! cargo run --release -p cores --example sfc2cpu -- train [--seconds 200] [--rounds N]
//!     [--cores 2,4,8,12,16] [--seed 1] [--out crates/cores/models/sfc2cpu-v1.safetensors]
//! cargo run --release -p cores --example sfc2cpu -- eval [MODEL] [--instances 100]
//! ```
//! `train`'s `--seconds` caps each core count's training; `eval` is the twin half
//! of `starfabric bench cores` (RR, LLF, FFD and the model on held-out instances).

use std::time::Instant;

use cores::bench::{run, BenchOptions};
use cores::learned::{train, Sfc2cpuModel, TrainConfig};

fn arg<T: std::str::FromStr>(args: &[String], name: &str) -> Option<T> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
}

fn list(args: &[String], name: &str) -> Option<Vec<usize>> {
    let s: String = arg(args, name)?;
    s.split(',').map(|x| x.trim().parse().ok()).collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("train") => {
            let mut cfg = TrainConfig::standard();
            if let Some(s) = arg(&args, "--seconds") {
                cfg.seconds = Some(s);
            }
            cfg.rounds = arg(&args, "--rounds").unwrap_or(cfg.rounds);
            cfg.seed = arg(&args, "--seed").unwrap_or(cfg.seed);
            cfg.lr = arg(&args, "--lr").unwrap_or(cfg.lr);
            cfg.updates_per_round = arg(&args, "--updates").unwrap_or(cfg.updates_per_round);
            cfg.batch = arg(&args, "--batch").unwrap_or(cfg.batch);
            if let Some(c) = list(&args, "--cores") {
                cfg.cores = c;
            }
            let out: String = arg(&args, "--out")
                .unwrap_or_else(|| "crates/cores/models/sfc2cpu-v1.safetensors".into());
            let t0 = Instant::now();
            let model = train(&cfg, &mut |r| {
                if r.valid_ratio.is_some() || r.round % 50 == 0 {
                    eprintln!(
                        "cores {:2} round {:5} eps {:.3} thr {:.4} loss {:.5} steps {:6} valid {}",
                        r.cores,
                        r.round,
                        r.epsilon,
                        r.throughput_ratio,
                        r.loss,
                        r.grad_steps,
                        r.valid_ratio.map_or("-".into(), |v| format!("{v:.4}"))
                    );
                }
            })?;
            model.save(&out)?;
            let size = std::fs::metadata(&out)?.len();
            println!(
                "trained in {:.1} s, {} params, {size} bytes -> {out}",
                t0.elapsed().as_secs_f64(),
                model.param_count()
            );
            for (c, m) in &model.header.metrics {
                println!(
                    "  {c:2} cores: {} rounds, {} games, {} steps, {:.0} s, valid {:.4} (rr {:.4}), best round {}, loss {:.5} -> {:.5}",
                    m.rounds, m.games, m.grad_steps, m.wall_secs, m.valid_ratio, m.valid_ratio_rr, m.best_round, m.loss_first, m.loss_last
                );
            }
        }
        Some("eval") => {
            let path = args
                .get(1)
                .filter(|a| !a.starts_with("--"))
                .cloned()
                .unwrap_or_else(|| "crates/cores/models/sfc2cpu-v1.safetensors".into());
            let model = Sfc2cpuModel::load(&path)?;
            let instances: usize = arg(&args, "--instances").unwrap_or(100);
            let core_counts = list(&args, "--cores").unwrap_or(vec![4, 8, 12, 16]);
            // `--validation`: train-stream instances no training run plays
            // (Seed::train(2^61 + i)), for choosing inference settings without
            // looking at the held-out ones.
            let workload = if args.iter().any(|a| a == "--validation") {
                let mut problems = Vec::new();
                for &c in &core_counts {
                    for i in 0..instances as u64 {
                        problems.push(
                            cores::generate::generate(
                                &cores::generate::GenSpec::default(),
                                c,
                                cores::generate::Seed::train((1 << 61) + i),
                            )?
                            .problem,
                        );
                    }
                }
                Some(cores::Workload {
                    version: cores::problem::WORKLOAD_VERSION,
                    name: "validation (train stream)".into(),
                    problems,
                })
            } else {
                None
            };
            let opts = BenchOptions {
                instances,
                cores: core_counts,
                workload,
                ..BenchOptions::default()
            };
            let mut a = model.assigner();
            if let Some(t) = arg(&args, "--tie") {
                a = a.with_tie_tolerance(t);
            }
            let r = run(&opts, Some(&a), &mut |l| println!("{l}"))?;
            for s in &r.settings {
                println!(
                    "{:2} cores: best heuristic {} ; s2c/rr {:?} ; s2c/best {:?}",
                    s.cores, s.best_heuristic, s.s2c_vs_rr, s.s2c_vs_best_heuristic
                );
            }
            println!("goal met: {:?}", r.goal_met);
        }
        Some("gen") => {
            // The generator's own (hidden) placement, for reference: Eq. 1 holds on it.
            let n: u64 = arg(&args, "--instances").unwrap_or(100);
            for c in list(&args, "--cores").unwrap_or(vec![4, 8, 12, 16]) {
                let (mut thr, mut lat, mut bott) = (Vec::new(), Vec::new(), 0);
                for i in 0..n {
                    let g = cores::generate::generate(
                        &cores::generate::GenSpec::default(),
                        c,
                        cores::generate::Seed::test(i),
                    )?;
                    let r = cores::evaluate(&g.problem, &g.gen, &cores::TwinParams::default())?;
                    if r.throughput_mpps < g.problem.offered_mpps() * (1.0 - 1e-9) {
                        bott += 1;
                    }
                    thr.push(r.throughput_mpps);
                    lat.push(r.latency_s * 1e3);
                }
                thr.sort_by(f64::total_cmp);
                lat.sort_by(f64::total_cmp);
                println!(
                    "{c:2} cores gen: median {:.3} Mpps {:.3} ms, {bott}/{n} instances short of offered",
                    thr[thr.len() / 2],
                    lat[lat.len() / 2]
                );
            }
        }
        _ => {
            eprintln!("usage: sfc2cpu train [--seconds S] [--cores 4,8] [--out FILE] | eval [MODEL] [--instances N]");
            std::process::exit(2);
        }
    }
    Ok(())
}
