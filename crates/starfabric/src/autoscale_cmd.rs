//! `starfabric autoscale --fm HOST:PORT --sc-capacity-rps N [--high 0.8 --low 0.3
//! --interval 1 --sustain 3 --cooldown 10] [--tenant T --chain C ...]`: scale SC groups
//! (and PP nodes, with `--pp-capacity` and a node pool, `--pp-pool FILE`) between water
//! marks until SIGINT/SIGTERM.
//!
//! The policy and the driver are `orchestrator::autoscale`; this runs them against FM's
//! gRPC API, prints one line per decision, and leaves the record in FM's event log
//! (`starfabric events`). docs/autoscaler.md describes the rules.

use std::io::Write as _;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use orchestrator::autoscale::{
    Aggregate, AutoscaleConfig, Autoscaler, Decision, FmActuator, FmEvents, FmLoad, PolicyConfig,
    PpConfig, PpMetric, PpNodeProvider, ScConfig, StepRecord, WaterMarks,
};
use orchestrator::provider::{LocalPpProvider, PpPool};

use crate::pp_cmd::{install_signal_handlers, STOP};

#[derive(Args, Debug, Clone, PartialEq)]
pub struct AutoscaleArgs {
    /// FM's gRPC address (`host:port`).
    #[arg(long, env = "STARFABRIC_FM", default_value = "127.0.0.1:7000")]
    pub fm: String,
    /// Requests/s one SC group serves at utilisation 1.0. Without it SC is not scaled.
    #[arg(long)]
    pub sc_capacity_rps: Option<f64>,
    /// High water mark (utilisation): scale out above it.
    #[arg(long, default_value_t = 0.8)]
    pub high: f64,
    /// Low water mark (utilisation): scale in below it.
    #[arg(long, default_value_t = 0.3)]
    pub low: f64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 1.0)]
    pub interval: f64,
    /// Consecutive samples beyond a mark before acting.
    #[arg(long, default_value_t = 3)]
    pub sustain: u32,
    /// Seconds after an action (or a refusal) before the next one.
    #[arg(long, default_value_t = 10.0)]
    pub cooldown: f64,
    /// SC groups per chain: at least, at most.
    #[arg(long, default_value_t = 1)]
    pub min_groups: usize,
    #[arg(long, default_value_t = 8)]
    pub max_groups: usize,
    /// Watch these tenants' chains (pairs with --chain, in order); none: every chain FM
    /// serves.
    #[arg(long)]
    pub tenant: Vec<u32>,
    #[arg(long)]
    pub chain: Vec<u32>,
    /// The PP load metric's value one PP node carries at utilisation 1.0. Without it PP
    /// is not scaled.
    #[arg(long)]
    pub pp_capacity: Option<f64>,
    /// The PP load metric, from each node's heartbeat: `packets_per_s` (packets it
    /// received) or `requests_per_s` (rule requests it sent FM).
    #[arg(long, default_value = "packets_per_s", value_parser = ["packets_per_s", "requests_per_s"])]
    pub pp_metric: String,
    /// The PP node pool (JSON: `{"log_dir": DIR, "nodes": [{"id": "pp-1", "argv": [...]}]}`)
    /// the local node provider starts nodes from and stops them back into. Without it a
    /// PP decision is recorded as failed (no provider).
    #[arg(long)]
    pub pp_pool: Option<std::path::PathBuf>,
    /// When the autoscaler stops, drain and stop the PP nodes it started (default: leave
    /// them serving).
    #[arg(long)]
    pub pp_stop_on_exit: bool,
    /// Also run Zeta's Multi IPs Scheduler (§VI-B) each sample: a PP node above the high
    /// mark sheds vIPs to lighter nodes of its cluster (no host rule changes), and a
    /// cluster that cannot shed its overload that way grows by a node from --pp-pool.
    /// Needs --pp-capacity. Every move is in `starfabric events` (`multiip_*`).
    #[arg(long)]
    pub multi_ip: bool,
    /// PP nodes: at least, at most.
    #[arg(long, default_value_t = 1)]
    pub pp_min_nodes: usize,
    #[arg(long, default_value_t = 16)]
    pub pp_max_nodes: usize,
    /// Stop after this many seconds (default: until SIGINT/SIGTERM).
    #[arg(long)]
    pub duration: Option<f64>,
}

impl AutoscaleArgs {
    pub fn to_config(&self) -> Result<AutoscaleConfig> {
        if self.tenant.len() != self.chain.len() {
            bail!(
                "--tenant and --chain pair up: {} tenants, {} chains",
                self.tenant.len(),
                self.chain.len()
            );
        }
        if !(self.interval > 0.0 && self.interval.is_finite()) {
            bail!("--interval must be positive");
        }
        if !(self.cooldown >= 0.0 && self.cooldown.is_finite()) {
            bail!("--cooldown must be 0 or more");
        }
        let policy = |min, max, out_on| PolicyConfig {
            marks: WaterMarks {
                high: self.high,
                low: self.low,
            },
            sustain: self.sustain,
            cooldown: Duration::from_secs_f64(self.cooldown),
            min,
            max,
            out_on,
        };
        let cfg = AutoscaleConfig {
            interval: Duration::from_secs_f64(self.interval),
            sc: self.sc_capacity_rps.map(|capacity_rps| ScConfig {
                policy: policy(self.min_groups, self.max_groups, Aggregate::Max),
                capacity_rps,
                chains: self
                    .tenant
                    .iter()
                    .copied()
                    .zip(self.chain.iter().copied())
                    .collect(),
            }),
            pp: self.pp_capacity.map(|capacity| PpConfig {
                policy: policy(self.pp_min_nodes, self.pp_max_nodes, Aggregate::Mean),
                capacity,
                metric: if self.pp_metric == "requests_per_s" {
                    PpMetric::RequestsPerS
                } else {
                    PpMetric::PacketsPerS
                },
                multi_ip: self.multi_ip,
            }),
        };
        if self.multi_ip && self.pp_capacity.is_none() {
            anyhow::bail!("--multi-ip needs --pp-capacity (the load at which a PP node is full)");
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

pub fn run(a: AutoscaleArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    install_signal_handlers()?;
    let start = Instant::now();
    let duration = a.duration.map(Duration::from_secs_f64);
    let stop = async move {
        while !STOP.load(Ordering::Relaxed) && duration.is_none_or(|d| start.elapsed() < d) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    rt.block_on(serve(a, stop))?;
    println!("autoscale: stopped");
    Ok(())
}

/// Parse `starfabric autoscale`'s flags from one string (`starfabric orchestrator
/// --autoscale "FLAGS"`), split at whitespace.
pub fn parse_flags(flags: &str) -> Result<AutoscaleArgs> {
    #[derive(clap::Parser)]
    #[command(name = "--autoscale", no_binary_name = true)]
    struct Flags {
        #[command(flatten)]
        a: AutoscaleArgs,
    }
    let check = || -> Result<AutoscaleArgs> {
        let f = <Flags as clap::Parser>::try_parse_from(flags.split_whitespace())?;
        let cfg = f.a.to_config()?;
        if let Some(pool) = &f.a.pp_pool {
            PpPool::load(pool)?;
            if cfg.pp.is_none() {
                bail!("--pp-pool needs --pp-capacity (PP is not scaled without it)");
            }
        }
        Ok(f.a)
    };
    check().with_context(|| format!("--autoscale {flags:?}"))
}

/// Run the autoscaler until `stop` resolves: on its own runtime (`starfabric
/// autoscale`) or as a task of the orchestrator's.
pub async fn serve(a: AutoscaleArgs, stop: impl std::future::Future<Output = ()>) -> Result<()> {
    let cfg = a.to_config()?;
    let pool = a.pp_pool.as_deref().map(PpPool::load).transpose()?;
    if pool.is_some() && cfg.pp.is_none() {
        bail!("--pp-pool needs --pp-capacity (PP is not scaled without it)");
    }
    let provider = match pool {
        Some(p) => Some(Arc::new(LocalPpProvider::new(&a.fm, p)?)),
        None => None,
    };
    let scaler = Autoscaler::new(
        cfg.clone(),
        FmLoad::new(&a.fm).await?,
        FmActuator::new(
            &a.fm,
            provider.clone().map(|p| p as Arc<dyn PpNodeProvider>),
        )
        .await?,
        FmEvents::new(&a.fm).await?,
    )?;
    // Tests and scripts wait for this line.
    println!(
        "autoscale: watching FM at {}: sc {}, pp {}, marks {}/{}, every {} s, sustain {}, \
         cooldown {} s",
        a.fm,
        cfg.sc.as_ref().map_or("off".into(), |s| format!(
            "{} req/s per group, {}..={} groups",
            s.capacity_rps, s.policy.min, s.policy.max
        )),
        cfg.pp.as_ref().map_or("off".into(), |p| format!(
            "{} {} per node, {}..={} nodes{}",
            p.capacity,
            p.metric.name(),
            p.policy.min,
            p.policy.max,
            if provider.is_some() {
                ", local node provider"
            } else {
                ", no node provider"
            }
        )),
        a.low,
        a.high,
        a.interval,
        a.sustain,
        a.cooldown
    );
    std::io::stdout().flush()?;
    scaler.run(stop, print_record).await;
    if let Some(p) = &provider {
        if a.pp_stop_on_exit {
            for r in p.stop_all().await {
                match r {
                    Ok(s) => println!("autoscale: on exit: {s}"),
                    Err(e) => println!("autoscale: on exit: failed: {e}"),
                }
            }
        } else {
            for (id, pid) in p.running().await {
                println!("autoscale: leaving PP node {id} (pid {pid}) running");
            }
        }
    }
    Ok(())
}

fn print_record(r: &StepRecord) {
    let line = match (&r.decision, &r.result) {
        (Decision::Act(a, why), Some(Ok(s))) => {
            format!("{} {}: {} -> {s}", r.target, a.as_str(), why.text)
        }
        (Decision::Act(a, why), Some(Err(e))) => {
            format!("{} {}: {} -> failed: {e}", r.target, a.as_str(), why.text)
        }
        (Decision::Refused(a, why), _) => {
            format!("{} {} refused: {}", r.target, a.as_str(), why.text)
        }
        _ => return,
    };
    println!("autoscale: {line}");
    let _ = std::io::stdout().flush();
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: AutoscaleArgs,
    }

    fn parse(args: &[&str]) -> Result<AutoscaleConfig> {
        let t = T::try_parse_from(std::iter::once("x").chain(args.iter().copied()))?;
        t.a.to_config()
    }

    #[test]
    fn flags_make_the_policy() {
        let c = parse(&[
            "--fm",
            "198.18.0.1:7000",
            "--sc-capacity-rps",
            "40",
            "--high",
            "0.9",
            "--low",
            "0.2",
            "--interval",
            "0.5",
            "--sustain",
            "2",
            "--cooldown",
            "4",
            "--max-groups",
            "2",
            "--tenant",
            "1",
            "--chain",
            "1",
            "--tenant",
            "2",
            "--chain",
            "3",
        ])
        .unwrap();
        assert_eq!(c.interval, Duration::from_millis(500));
        assert!(c.pp.is_none(), "PP is off without --pp-capacity");
        let sc = c.sc.unwrap();
        assert_eq!(sc.capacity_rps, 40.0);
        assert_eq!(sc.chains, vec![(1, 1), (2, 3)]);
        assert_eq!(
            (sc.policy.marks.high, sc.policy.marks.low, sc.policy.sustain),
            (0.9, 0.2, 2)
        );
        assert_eq!(sc.policy.cooldown, Duration::from_secs(4));
        assert_eq!((sc.policy.min, sc.policy.max), (1, 2));
        assert_eq!(sc.policy.out_on, Aggregate::Max);
        let c = parse(&["--pp-capacity", "5000", "--pp-max-nodes", "4"]).unwrap();
        assert!(c.sc.is_none());
        let pp = c.pp.unwrap();
        assert_eq!(
            (pp.capacity, pp.policy.max, pp.policy.out_on),
            (5000.0, 4, Aggregate::Mean)
        );
        assert_eq!(pp.metric.name(), "packets_per_s");
        let c = parse(&["--pp-capacity", "50", "--pp-metric", "requests_per_s"]).unwrap();
        assert_eq!(c.pp.unwrap().metric.name(), "requests_per_s");
    }

    #[test]
    fn the_orchestrator_takes_the_same_flags_in_one_string() {
        let a = parse_flags("--fm 198.18.0.1:7000 --sc-capacity-rps 40 --max-groups 2").unwrap();
        assert_eq!(a.fm, "198.18.0.1:7000");
        assert_eq!(a.sc_capacity_rps, Some(40.0));
        assert_eq!(a.max_groups, 2);
        for bad in ["", "--sc-capacity-rps", "--sc-capacity-rps 10 --bogus 1"] {
            assert!(parse_flags(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn bad_flags_are_refused() {
        for bad in [
            &[][..],
            &["--sc-capacity-rps", "10", "--tenant", "1"],
            &["--sc-capacity-rps", "10", "--high", "0.2", "--low", "0.3"],
            &["--sc-capacity-rps", "0"],
            &["--sc-capacity-rps", "10", "--interval", "0"],
            &["--sc-capacity-rps", "10", "--sustain", "0"],
            &[
                "--sc-capacity-rps",
                "10",
                "--min-groups",
                "3",
                "--max-groups",
                "2",
            ],
            &["--sc-capacity-rps", "10", "--cooldown", "-1"],
            &["--sc-capacity-rps", "ten"],
            &["--pp-capacity", "10", "--pp-metric", "bytes"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
