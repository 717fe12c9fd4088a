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

#[derive(Args, Clone, Debug, Default)]
pub struct IsolationBenchArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Write credit, state and rate over time (Fig. 10) as an SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// The scenario's parameters as JSON (docs/benchmarks.md, "Isolation workload"):
    /// any field of the report's `params`; the flags below override it.
    #[arg(long, value_name = "FILE")]
    pub workload: Option<PathBuf>,
    /// `--setup-capacity` of the PP node (new flows/s) [default: 3000].
    #[arg(long)]
    pub capacity: Option<f64>,
    /// Every tenant's base new flows/s [default: 1000].
    #[arg(long)]
    pub base: Option<f64>,
    /// Every tenant's burst new flows/s [default: 2000].
    #[arg(long)]
    pub burst: Option<f64>,
    /// Floods send this many times base SYNs per second [default: 10].
    #[arg(long)]
    pub flood_factor: Option<f64>,
    /// The victim's new TCP connections per second [default: 50].
    #[arg(long)]
    pub victim_rate: Option<f64>,
}

/// The scenario `a` asks for: the workload file's parameters (defaults for the fields
/// it leaves out), then the flags; checked.
pub fn spec(a: &IsolationBenchArgs) -> Result<IsolationSpec> {
    let mut spec = match &a.workload {
        Some(path) => load_workload(path)?,
        None => IsolationSpec::new(),
    };
    let set = |field: &mut f64, flag: Option<f64>| {
        if let Some(v) = flag {
            *field = v;
        }
    };
    set(&mut spec.setup_capacity, a.capacity);
    set(&mut spec.base, a.base);
    set(&mut spec.burst, a.burst);
    set(&mut spec.flood_factor, a.flood_factor);
    set(&mut spec.victim_rate, a.victim_rate);
    spec.check().map_err(anyhow::Error::msg)?;
    Ok(spec)
}

fn load_workload(path: &std::path::Path) -> Result<IsolationSpec> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading workload {}", path.display()))?;
    let bad = || format!("workload {}: not an isolation workload", path.display());
    let v: serde_json::Value = serde_json::from_str(&text).with_context(bad)?;
    let Some(fields) = v.as_object() else {
        bail!("{}: a JSON object of parameters", bad());
    };
    // The spec fills missing fields with defaults, so an unknown field (a typo) would
    // pass unnoticed: refuse any the spec does not have.
    let known = serde_json::to_value(IsolationSpec::new())?;
    if let Some(k) = fields.keys().find(|k| known.get(k.as_str()).is_none()) {
        bail!("{}: unknown field `{k}`", bad());
    }
    serde_json::from_value(v).with_context(bad)
}

pub fn run(a: &IsolationBenchArgs) -> Result<IsolationReport> {
    // Parameters first: a bad file is an error before anything is built.
    let spec = spec(a)?;
    if !testbed::is_root() {
        bail!(
            "bench isolation runs on the netns testbed, which needs root (network namespaces, veth, nftables): run it as root"
        );
    }
    testbed::install_signal_cleanup()?;
    testbed::check_prerequisites()?;
    testbed::sweep_stale("sfi-");
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
        (
            "victim slowest setups (flood; ms at s)",
            r.victim_slowest_flood
                .iter()
                .map(|x| format!("{:.1}@{:.1}", x.setup_us as f64 / 1e3, x.t_ms as f64 / 1e3))
                .collect::<Vec<_>>()
                .join(" "),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn args(workload: Option<PathBuf>) -> IsolationBenchArgs {
        IsolationBenchArgs {
            workload,
            ..IsolationBenchArgs::default()
        }
    }

    #[test]
    fn a_workload_file_sets_the_scenario_and_flags_override_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("w.json");
        std::fs::write(
            &p,
            r#"{"base": 500, "burst": 1500, "flood_procs": 4, "fair_secs": 10}"#,
        )
        .expect("write");
        let s = spec(&args(Some(p.clone()))).expect("valid");
        assert_eq!(
            (s.base, s.burst, s.flood_procs, s.fair_secs),
            (500.0, 1500.0, 4, 10.0)
        );
        // Fields the file leaves out keep the bench's defaults.
        assert_eq!(s.setup_capacity, IsolationSpec::new().setup_capacity);
        let mut a = args(Some(p));
        a.burst = Some(800.0);
        assert_eq!(spec(&a).expect("valid").burst, 800.0);
        let d = spec(&args(None)).expect("defaults");
        assert_eq!(
            serde_json::to_value(d).expect("json"),
            serde_json::to_value(IsolationSpec::new()).expect("json")
        );
    }

    #[test]
    fn bad_isolation_workloads_are_refused_with_the_reason() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("w.json");
        for (text, want) in [
            (r#"{"bsae": 500}"#, "unknown field `bsae`"),
            (r#"{"base": -1}"#, "base must be in"),
            (
                r#"{"base": 1000, "burst": 500}"#,
                "burst (500) must be at least base",
            ),
            (r#"{"flood_procs": 0}"#, "flood_procs"),
            (r#"{"fair_secs": 1e9}"#, "fair_secs"),
            (r#"{"sample_ms": "fast"}"#, "not an isolation workload"),
            ("[1, 2]", "a JSON object"),
        ] {
            std::fs::write(&p, text).expect("write");
            let e = format!("{:#}", spec(&args(Some(p.clone()))).expect_err(text));
            assert!(e.contains(want), "{text}: {e} (wanted {want:?})");
        }
        // A flag out of range is refused the same way.
        let mut a = args(None);
        a.victim_rate = Some(0.0);
        assert!(format!("{:#}", spec(&a).unwrap_err()).contains("victim_rate"));
    }
}
