//! `starfabric bench placement`: the placement bench (`placement::bench`) over generated
//! or given workloads (docs/placement.md).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use placement::ddqn::DdqnModel;

#[derive(Args, Debug, Clone)]
pub struct PlacementBenchArgs {
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// A workload file (docs/placement.md) to run instead of the generated held-out
    /// workloads.
    #[arg(long)]
    pub workload: Option<PathBuf>,
    /// Held-out generated workloads.
    #[arg(long, default_value_t = 3)]
    pub instances: usize,
    /// Their pool size.
    #[arg(long, default_value_t = 60)]
    pub nodes: usize,
    /// Small instances for the MILP comparison.
    #[arg(long, default_value_t = 5)]
    pub small_instances: usize,
    /// MILP time limit per small instance, seconds.
    #[arg(long, default_value_t = 10.0)]
    pub milp_secs: f64,
    /// GCM instances for RGCM against its MILP.
    #[arg(long, default_value_t = 10)]
    pub gcm_instances: usize,
    /// The DDQN model (default: the one shipped with this build).
    #[arg(long)]
    pub model: Option<PathBuf>,
}

pub fn load_model(path: Option<&PathBuf>) -> Result<DdqnModel> {
    match path {
        Some(p) => DdqnModel::load(p).with_context(|| format!("loading {}", p.display())),
        None => DdqnModel::shipped().context("the shipped DDQN model"),
    }
}

pub fn bench(a: &PlacementBenchArgs) -> Result<()> {
    let workload = a
        .workload
        .as_ref()
        .map(|p| -> Result<placement::workload::Workload> {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            placement::workload::Workload::from_json(&text)
                .with_context(|| format!("workload {}", p.display()))
        })
        .transpose()?;
    let model = load_model(a.model.as_ref())?;
    let opts = placement::bench::BenchOptions {
        instances: a.instances,
        nodes: a.nodes,
        workload,
        small_instances: a.small_instances,
        milp_time_limit: Duration::from_secs_f64(a.milp_secs.max(0.1)),
        gcm_instances: a.gcm_instances,
        ..Default::default()
    };
    let t0 = Instant::now();
    let quiet = a.json;
    let r = placement::bench::run(&opts, &model, &mut |line| {
        if !quiet {
            println!("  {line}");
        }
    })?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    println!(
        "\nonline mean cost (node-time + migrations), {} workloads:",
        r.online_instances
    );
    for (k, v) in &r.cost {
        println!(
            "  {k:<14} {v:10.1}   migrations {:.1}",
            r.migrations.get(k).copied().unwrap_or(0.0)
        );
    }
    println!("small instances, mean Eq. 1 cost:");
    for (k, v) in &r.cost_small {
        println!("  {k:<14} {v:10.2}");
    }
    println!(
        "ddqn/ff {:.3}  ddqn/bf {:.3}  ddqn/milp {:.3}  forecast gain {:.3}",
        r.ddqn_vs_ff, r.ddqn_vs_bf, r.ddqn_vs_milp, r.forecast_gain
    );
    println!(
        "rgcm/milp {:.3}  theorem bounds {}  violations {}  decision p99 at {} nodes {:.2} ms (bf {:.2} ms)",
        r.rgcm_vs_milp,
        if r.rgcm_bound_ok { "held" } else { "FAILED on some instance" },
        r.violations,
        r.decision_nodes,
        r.decision_ms_p99,
        r.decision_ms_p99_bf
    );
    println!("({:.1} s)", t0.elapsed().as_secs_f64());
    Ok(())
}
