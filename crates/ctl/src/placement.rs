//! `starfabric placement`: the orchestrator's shard sets (`show`), its limits
//! (`limits`), and offline training of the DDQN agent (`train`); docs/placement.md.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use placement::ddqn::{self, TrainConfig};
use serde_json::{json, Value};

use crate::cli::{print_table, Client, Output};

#[derive(Subcommand, Debug)]
pub enum PlacementCmd {
    /// Each tenant's SC nodes and PP clusters, the nodes' reservations, the overlap
    /// matrix and any constraint the placement breaks.
    Show,
    /// Set U, G_min, G_max and O. Tenants whose sets break the new limits are placed
    /// anew; if some tenant cannot be, nothing changes.
    Limits {
        #[arg(long)]
        threshold: f64,
        #[arg(long, allow_hyphen_values = true)]
        g_min: i64,
        #[arg(long, allow_hyphen_values = true)]
        g_max: i64,
        #[arg(long, allow_hyphen_values = true)]
        overlap: i64,
    },
    /// Train the DDQN agent (paper 000 Alg. 1) offline on generated training workloads
    /// and write a versioned model file.
    Train(TrainArgs),
}

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Where to write the model.
    #[arg(long, default_value = "crates/placement/models/ddqn.safetensors")]
    pub out: PathBuf,
    /// Episodes (default: the shipped model's configuration).
    #[arg(long)]
    pub episodes: Option<usize>,
    /// Seed of initialisation, exploration and minibatches.
    #[arg(long)]
    pub seed: Option<u64>,
    /// A tiny configuration (seconds), for smoke tests.
    #[arg(long)]
    pub tiny: bool,
}

fn train(a: &TrainArgs) -> Result<()> {
    let mut cfg = if a.tiny {
        TrainConfig::tiny()
    } else {
        TrainConfig::standard()
    };
    if let Some(e) = a.episodes {
        cfg.episodes = e;
    }
    if let Some(s) = a.seed {
        cfg.seed = s;
    }
    let t0 = Instant::now();
    let model = ddqn::train(&cfg, &mut |e| {
        println!("episode {e:?}");
    })?;
    model
        .save(&a.out)
        .with_context(|| format!("writing {}", a.out.display()))?;
    println!(
        "placement: trained {} episodes in {:.1} s; model written to {} ({} parameters)",
        cfg.episodes,
        t0.elapsed().as_secs_f64(),
        a.out.display(),
        model.param_count()
    );
    Ok(())
}

pub fn run(client: impl FnOnce() -> Result<Client>, cmd: PlacementCmd) -> Result<()> {
    match cmd {
        PlacementCmd::Train(a) => train(&a),
        PlacementCmd::Show => {
            let c = client()?;
            let v = c.call("GET", "/v1/placement", None)?;
            show(&c, &v)
        }
        PlacementCmd::Limits {
            threshold,
            g_min,
            g_max,
            overlap,
        } => {
            let c = client()?;
            let v = c.call(
                "PUT",
                "/v1/placement/limits",
                Some(json!({"threshold": threshold, "g_min": g_min, "g_max": g_max, "overlap": overlap})),
            )?;
            show(&c, &v)
        }
    }
}

fn show(c: &Client, v: &Value) -> Result<()> {
    if c.output != Output::Table {
        return c.print(v, &[], &[]);
    }
    let l = &v["limits"];
    println!(
        "algorithm {}  model {}\nlimits U={} G={}..{} O={}  decisions {} (Best Fit fallbacks {})",
        v["algorithm"].as_str().unwrap_or("?"),
        v["model"].as_str().unwrap_or("?"),
        l["threshold"],
        l["g_min"],
        l["g_max"],
        l["overlap"],
        v["decisions"],
        v["fallbacks"],
    );
    let Some(tenants) = v["tenants"].as_array() else {
        bail!("the orchestrator's answer has no tenants list: {v}");
    };
    println!();
    print_table(
        tenants,
        &[
            ("TENANT", "/tenant"),
            ("SC-NODES", "/sc_nodes"),
            ("PP-CLUSTERS", "/pp_clusters"),
            ("ALGORITHM", "/algorithm"),
            ("MOVES", "/moves"),
            ("ERROR", "/error"),
        ],
    );
    println!();
    let nodes: Vec<Value> = v["nodes"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .map(|mut n| {
            let r = |d: &Value| {
                format!(
                    "{:.1}G/{:.1}c/{:.1}GiB",
                    d["bw_gbps"].as_f64().unwrap_or(0.0),
                    d["cpu"].as_f64().unwrap_or(0.0),
                    d["mem_gib"].as_f64().unwrap_or(0.0)
                )
            };
            n["cap"] = json!(r(&n["capacity"]));
            n["res"] = json!(r(&n["reserved"]));
            n
        })
        .collect();
    print_table(
        &nodes,
        &[
            ("SC-NODE", "/id"),
            ("UP", "/up"),
            ("CAPACITY", "/cap"),
            ("RESERVED", "/res"),
            ("TENANTS", "/tenants"),
        ],
    );
    let names: Vec<&str> = v["overlap"]["tenants"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if !names.is_empty() {
        println!("\nshared SC nodes (Eq. 6: at most O off the diagonal)");
        let w = names.iter().map(|n| n.len()).max().unwrap_or(1).max(3);
        print!("{:w$}", "");
        for n in &names {
            print!("  {n:>w$}");
        }
        println!();
        for (i, n) in names.iter().enumerate() {
            print!("{n:w$}");
            for j in 0..names.len() {
                let n = v["overlap"]["shared"][i][j].as_u64().unwrap_or(0);
                print!("  {n:>w$}");
            }
            println!();
        }
    }
    let violations = v["violations"].as_array().cloned().unwrap_or_default();
    if violations.is_empty() {
        println!("\nno constraint violated");
    } else {
        println!("\nviolations:");
        for x in violations {
            println!("  {}", x.as_str().unwrap_or_default());
        }
    }
    if let Some(e) = v["last_error"].as_str() {
        println!("last error: {e}");
    }
    Ok(())
}
