//! `starfabric bench cores`: core assignment (paper 002, sfc2cpu; docs/cores.md).
//! In the CFS digital twin: RR, LLF, FFD and the learned assigner on held-out
//! generated instances at each core count (or a `--workload` file's problems), median
//! throughput and latency, and `s2c_vs_rr` / `s2c_vs_best_heuristic`.
//!
//! On this node (`bench_cores_node`): generated instances scaled to this machine run
//! as µVNFs on the SC worker pool under each assigner; `node` has the medians, the
//! learned assigner's ratio to RR and the twin's Spearman ρ, `node_runs` every run.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use cores::bench::{BenchOptions, BenchReport};
use cores::{Sfc2cpuModel, Workload};
use serde::Serialize;

use crate::bench_cores_node::{NodeDetail, NodeOptions};

/// The report: the twin half (`cores::bench`'s fields) and the node's runs.
#[derive(Debug, Serialize)]
pub struct CoresBench {
    #[serde(flatten)]
    pub report: BenchReport,
    pub node_runs: Option<NodeDetail>,
}

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
    /// Instances run on this node's SC worker pool (0: the twin half only). With
    /// `--workload`, its first problems, scaled to this machine.
    #[arg(long, default_value_t = 20)]
    pub node_instances: usize,
    /// Requests per second over all SFCs of a node instance.
    #[arg(long, default_value_t = 5000.0)]
    pub node_rps: f64,
    /// Measured time per assigner and node instance (after 300 ms warm-up).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..=60_000))]
    pub node_measure_ms: u64,
}

pub fn run(a: &CoresBenchArgs) -> Result<CoresBench> {
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
    anyhow::ensure!(
        a.node_rps.is_finite() && a.node_rps > 0.0 && a.node_rps <= 1e6,
        "--node-rps must be in (0, 1e6], got {}",
        a.node_rps
    );
    let node_problems = workload.as_ref().map(|w| w.problems.clone());
    let opts = BenchOptions {
        instances: a.instances,
        cores: a.cores.clone(),
        workload,
        ..BenchOptions::default()
    };
    let quiet = a.json;
    let mut r = cores::bench::run(&opts, Some(&learned), &mut |line| {
        if !quiet {
            eprintln!("  {line}");
        }
    })?;
    let mut node_runs = None;
    if a.node_instances > 0 {
        let o = NodeOptions {
            instances: a.node_instances,
            system_rps: a.node_rps,
            measure: std::time::Duration::from_millis(a.node_measure_ms),
            problems: node_problems,
            twin: opts.twin,
            ..NodeOptions::default()
        };
        let (section, detail) = crate::bench_cores_node::run(&o, Some(&learned), &mut |line| {
            if !quiet {
                eprintln!("  {line}");
            }
        })?;
        r.node = Some(section);
        node_runs = Some(detail);
    }
    Ok(CoresBench {
        report: r,
        node_runs,
    })
}

pub fn print(b: &CoresBench) {
    let r = &b.report;
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
            println!("  twin vs node Spearman ρ (RR, LLF, FFD over all instances) {x:.3}");
        }
        if let Some(d) = &b.node_runs {
            let rhos: Vec<f64> = d.instances.iter().filter_map(|i| i.rho).collect();
            if !rhos.is_empty() {
                println!(
                    "  within-instance ρ: mean {:.3} over {} instances ({} tied)",
                    rhos.iter().sum::<f64>() / rhos.len() as f64,
                    rhos.len(),
                    d.instances.len() - rhos.len()
                );
            }
            let fb = d
                .instances
                .iter()
                .filter(|i| i.fallback == Some(true))
                .count();
            println!("  watchdog fallbacks to RR: {fb} of {}", d.instances.len());
        }
    }
}
