//! `starfabric bench isolation`: tenant isolation at the PP node (paper 000 §7.2,
//! Fig. 10) on the netns testbed, with the driver the e2e test uses
//! (`testbed::isolation`), so the numbers here come from tested code.
//!
//! One testbed (prefix `sfi-<pid>-`, 3 VPCs). Phases 0–1: B's paced real TCP
//! connections alone, then while A floods SYNs at 10× its base (hping3); A's state,
//! credit and admitted rate from the PP node's metrics. Phase 2 (a fresh platform with
//! a debt allowance): A and B flood, C idle: Jain's index and utilisation. `--plot`
//! draws credit, state and rate over time as SVG (docs/rate-isolation.md).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use testbed::isolation::{self, IsolationReport, IsolationSpec};
use testbed::{Resources, Testbed, TopologySpec};

#[derive(Args, Clone, Debug)]
pub struct IsolationBenchArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Write credit, state and rate over time (Fig. 10) as an SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// `--setup-capacity` of the PP node (new flows/s).
    #[arg(long, default_value_t = IsolationSpec::new().setup_capacity)]
    pub capacity: f64,
    /// Every tenant's base new flows/s.
    #[arg(long, default_value_t = IsolationSpec::new().base)]
    pub base: f64,
    /// Every tenant's burst new flows/s.
    #[arg(long, default_value_t = IsolationSpec::new().burst)]
    pub burst: f64,
    /// Floods send this many times base SYNs per second.
    #[arg(long, default_value_t = IsolationSpec::new().flood_factor)]
    pub flood_factor: f64,
    /// The victim's new TCP connections per second.
    #[arg(long, default_value_t = IsolationSpec::new().victim_rate)]
    pub victim_rate: f64,
}

pub fn run(a: &IsolationBenchArgs) -> Result<IsolationReport> {
    if !testbed::is_root() {
        bail!(
            "bench isolation runs on the netns testbed, which needs root (network namespaces, veth, nftables): run it as root"
        );
    }
    testbed::install_signal_cleanup()?;
    testbed::check_prerequisites()?;
    testbed::sweep_stale("sfi-");
    let spec = IsolationSpec {
        setup_capacity: a.capacity,
        base: a.base,
        burst: a.burst,
        flood_factor: a.flood_factor,
        victim_rate: a.victim_rate,
        ..IsolationSpec::new()
    };
    let prefix = format!("sfi-{}-", std::process::id());
    // Dropped at the end of this function, also on an error: deletes everything.
    let res = Resources::new(&prefix);
    let tb = Testbed::build(TopologySpec::new(&prefix).tenants(3), res.clone())?;
    let r = isolation::run(&tb, &std::env::current_exe()?, &spec).context("isolation scenario")?;
    drop(tb);
    res.cleanup();
    if let Some(path) = &a.plot {
        std::fs::write(path, isolation::svg(&r)).with_context(|| path.display().to_string())?;
        tracing::info!(path = %path.display(), "plot written");
    }
    Ok(r)
}

fn opt(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.3}"))
}

fn ms(v: Option<u64>) -> String {
    v.map_or("n/a".into(), |v| format!("{:.2}", v as f64 / 1000.0))
}

pub fn print(r: &IsolationReport) {
    let p = &r.params;
    println!(
        "parameters: setup capacity {} new flows/s; A, B, C: base {} burst {} (phase 2: debt {}); floods {}× base = {} SYN/s ({} hping3 each); victim B {} conn/s",
        p.setup_capacity,
        p.base,
        p.burst,
        p.debt,
        p.flood_factor,
        p.flood_factor * p.base,
        p.flood_procs,
        p.victim_rate
    );
    let rows: Vec<(&str, String)> = vec![
        ("victim_failed", r.victim_failed.to_string()),
        (
            "victim connections (baseline / flood)",
            format!(
                "{} / {}",
                r.victim_connections_baseline, r.victim_connections_flood
            ),
        ),
        (
            "victim_failed_baseline",
            r.victim_failed_baseline.to_string(),
        ),
        ("victim_p99 ms baseline", ms(r.victim_p99_us_baseline)),
        ("victim_p99 ms flood", ms(r.victim_p99_us_flood)),
        ("victim_p99_ratio", opt(r.victim_p99_ratio)),
        (
            "victim_p50 ms baseline / flood",
            format!(
                "{} / {}",
                ms(r.victim_p50_us_baseline),
                ms(r.victim_p50_us_flood)
            ),
        ),
        ("victim_p50_ratio", opt(r.victim_p50_ratio)),
        (
            "victim_p99 ms while A bursts / after",
            format!(
                "{} / {}",
                ms(r.victim_p99_us_flood_burst),
                ms(r.victim_p99_us_flood_after)
            ),
        ),
        (
            "victim max setup ms (flood)",
            ms(Some(r.victim_max_setup_us_flood)),
        ),
        ("victim_rate_limited", format!("{}", r.victim_rate_limited)),
        (
            "aggressor_rate_limited",
            format!("{}", r.aggressor_rate_limited),
        ),
        (
            "aggressor_offered_rate",
            format!("{:.0}", r.aggressor_offered_rate),
        ),
        (
            "flood s / in S_burst s",
            format!("{:.1} / {:.1}", r.flood_secs, r.aggressor_burst_secs),
        ),
        ("aggressor_rate_vs_burst", opt(r.aggressor_rate_vs_burst)),
        (
            "aggressor_rate_vs_burst_max",
            opt(r.aggressor_rate_vs_burst_max),
        ),
        (
            "aggressor_rate_after_credit_vs_base",
            opt(r.aggressor_rate_after_credit_vs_base),
        ),
        (
            "aggressor_rate_after_credit_vs_base_max",
            opt(r.aggressor_rate_after_credit_vs_base_max),
        ),
        ("jain", format!("{:.3}", r.jain)),
        ("utilisation", format!("{:.3}", r.utilisation)),
        ("phase 2 admitted/s", format!("{:.0?}", r.fair_admitted)),
        ("phase 2 set up/s", format!("{:.0?}", r.fair_setup_rate)),
    ];
    for (k, v) in rows {
        println!("{k:<42} {v}");
    }
}
