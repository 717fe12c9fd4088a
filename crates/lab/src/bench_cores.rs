//! `starfabric bench cores`: core assignment (paper 002, sfc2cpu; docs/cores.md).
//! In the CFS digital twin: RR, LLF, FFD and the learned assigner on held-out
//! generated instances at each core count (or a `--workload` file's problems), median
//! throughput and latency, and `s2c_vs_rr` / `s2c_vs_best_heuristic`.
//!
//! The node part (≥ 6 workers on the SC node) is `report.node`, printed when present;
//! it stays None until the SC worker pool is wired in.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use cores::bench::{BenchOptions, BenchReport};
use cores::{Sfc2cpuModel, Workload};

#[derive(Args, Debug, Clone)]
pub struct CoresBenchArgs {
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// A workload file (docs/cores.md) to run instead of generated instances.
    #[arg(long)]
    pub workload: Option<PathBuf>,
    /// Held-out generated instances per core count.
    #[arg(long, default_value_t = 100)]
    pub instances: usize,
    /// Core counts of the generated instances.
    #[arg(long, value_delimiter = ',', default_value = "4,8,12,16")]
    pub cores: Vec<usize>,
    /// The learned assigner's model (default: the one shipped with this build).
    #[arg(long)]
    pub model: Option<PathBuf>,
}

pub fn run(a: &CoresBenchArgs) -> Result<BenchReport> {
    let workload = a
        .workload
        .as_ref()
        .map(|p| -> Result<Workload> {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            Workload::from_json(&text).with_context(|| format!("workload {}", p.display()))
        })
        .transpose()?;
    anyhow::ensure!(a.instances >= 1, "--instances must be ≥ 1");
    anyhow::ensure!(
        a.cores.iter().all(|&c| (1..=1024).contains(&c)),
        "--cores: each count must be in 1..=1024, got {:?}",
        a.cores
    );
    let model = match &a.model {
        Some(p) => Sfc2cpuModel::load(p).with_context(|| format!("loading {}", p.display()))?,
        None => Sfc2cpuModel::shipped().context("the shipped sfc2cpu model")?,
    };
    let learned = model.assigner();
    let opts = BenchOptions {
        instances: a.instances,
        cores: a.cores.clone(),
        workload,
        ..BenchOptions::default()
    };
    let quiet = a.json;
    let r = cores::bench::run(&opts, Some(&learned), &mut |line| {
        if !quiet {
            eprintln!("  {line}");
        }
    })?;
    Ok(r)
}

pub fn print(r: &BenchReport) {
    println!(
        "core assignment in the twin ({}; T {} ms, γ {}, {:?}, backpressure {}):",
        r.source,
        r.twin.period_s * 1e3,
        r.twin.gamma,
        r.twin.scheduler,
        r.twin.backpressure
    );
    for s in &r.settings {
        println!(
            "{} cores, {} instances (median offered {:.3} Mpps):",
            s.cores, s.instances, s.median_offered_mpps
        );
        for (k, v) in &s.algorithms {
            println!(
                "  {k:<4} median {:.3} Mpps {:.3} ms   p90 {:.3} ms   max core load {:.2}   overloaded {}",
                v.median_throughput_mpps,
                v.median_latency_ms,
                v.p90_latency_ms,
                v.median_max_core_load,
                v.overloaded_instances
            );
        }
        let fmt = |x: &Option<cores::bench::Ratios>| {
            x.as_ref().map_or("n/a".to_string(), |r| {
                format!("throughput ×{:.3}, latency ×{:.3}", r.throughput, r.latency)
            })
        };
        println!("  s2c_vs_rr: {}", fmt(&s.s2c_vs_rr));
        println!(
            "  s2c_vs_best_heuristic ({}): {}",
            s.best_heuristic,
            fmt(&s.s2c_vs_best_heuristic)
        );
        if let Some(e) = &s.s2c_error {
            println!("  s2c did not run: {e}");
        }
    }
    match r.goal_met {
        Some(ok) => println!(
            "goal at 4–12 cores (≥ +36% throughput, ≥ 59% lower latency than RR, ≥ best heuristic): {}",
            if ok { "met" } else { "NOT met" }
        ),
        None => println!("goal at 4–12 cores: not judged (no such setting)"),
    }
    if let Some(n) = &r.node {
        println!("on this node ({} workers on {} cores):", n.workers, n.cores);
        for (k, v) in &n.throughput_rps {
            println!(
                "  {k:<4} {v:.0} req/s {:.3} ms",
                n.latency_ms.get(k).copied().unwrap_or(f64::NAN)
            );
        }
        if let Some(x) = n.s2c_vs_rr {
            println!("  s2c_vs_rr {x:.3}");
        }
        if let Some(x) = n.twin_spearman_rho {
            println!("  twin vs node Spearman ρ {x:.3}");
        }
    }
}
