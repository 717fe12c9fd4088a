//! The autoscaler as a process of its own (`starfabric autoscale`) or a task of the
//! orchestrator's (`starfabric orchestrator --autoscale "FLAGS"`): its flags, and
//! [`serve`], which runs the policy and drivers of [`crate::autoscale`] against FM's
//! gRPC API until told to stop, saying one line per decision. docs/autoscaler.md
//! describes the rules.

use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use crate::autoscale::{
    Aggregate, AutoscaleConfig, Autoscaler, Decision, FmActuator, FmEvents, FmLoad, PolicyConfig,
    PpConfig, PpMetric, PpNodeProvider, ScConfig, StepRecord, WaterMarks,
};
use crate::provider::{LocalPpProvider, PpPool};

/// Bad flags, or a driver that could not start.
#[derive(Debug, Error)]
#[error("{0}")]
pub struct AutoscalerError(pub String);

#[derive(clap::Args, Debug, Clone, PartialEq)]
pub struct AutoscaleFlags {
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
    /// SC groups per chain: at least, at most. `--min-groups 0`: an idle chain at one
    /// group goes to zero running instances (its state parked on the SC nodes, which
    /// need `--idle-ms`; the next request wakes it). docs/autoscaler.md.
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
    /// How to reach FM: an operator certificate, or --insecure. Ignored under
    /// `starfabric orchestrator --autoscale`, which presents the orchestrator's own.
    #[command(flatten)]
    pub tls: crate::fm_link::FmTlsArgs,
}

impl AutoscaleFlags {
    pub fn to_config(&self) -> Result<AutoscaleConfig, AutoscalerError> {
        if self.tenant.len() != self.chain.len() {
            return Err(AutoscalerError(format!(
                "--tenant and --chain pair up: {} tenants, {} chains",
                self.tenant.len(),
                self.chain.len()
            )));
        }
        if !(self.interval > 0.0 && self.interval.is_finite()) {
            return Err(AutoscalerError("--interval must be positive".into()));
        }
        if !(self.cooldown >= 0.0 && self.cooldown.is_finite()) {
            return Err(AutoscalerError("--cooldown must be 0 or more".into()));
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
            return Err(AutoscalerError(
                "--multi-ip needs --pp-capacity (the load at which a PP node is full)".into(),
            ));
        }
        cfg.validate().map_err(|e| AutoscalerError(e.to_string()))?;
        Ok(cfg)
    }
}

/// Parse `starfabric autoscale`'s flags from one string (`starfabric orchestrator
/// --autoscale "FLAGS"`), split at whitespace.
pub fn parse_flags(flags: &str) -> Result<AutoscaleFlags, AutoscalerError> {
    #[derive(clap::Parser)]
    #[command(name = "--autoscale", no_binary_name = true)]
    struct Flags {
        #[command(flatten)]
        a: AutoscaleFlags,
    }
    let check = || -> Result<AutoscaleFlags, AutoscalerError> {
        let f = <Flags as clap::Parser>::try_parse_from(flags.split_whitespace())
            .map_err(|e| AutoscalerError(e.to_string()))?;
        let cfg = f.a.to_config()?;
        if let Some(pool) = &f.a.pp_pool {
            PpPool::load(pool).map_err(|e| AutoscalerError(e.to_string()))?;
            if cfg.pp.is_none() {
                return Err(AutoscalerError(
                    "--pp-pool needs --pp-capacity (PP is not scaled without it)".into(),
                ));
            }
        }
        Ok(f.a)
    };
    check().map_err(|e| AutoscalerError(format!("--autoscale {flags:?}: {e}")))
}

/// Run the autoscaler until `stop` resolves: on its own runtime (`starfabric
/// autoscale`) or as a task of the orchestrator's.
///
/// `tls` is the certificate FM is dialled with: the orchestrator's own under
/// `--autoscale`, else `None` and the flags' (`--tls-dir` or `--insecure`) are loaded.
pub async fn serve(
    a: AutoscaleFlags,
    tls: Option<Arc<proto::tls::NodeTls>>,
    stop: impl std::future::Future<Output = ()>,
    say: impl Fn(&str),
) -> Result<(), AutoscalerError> {
    let e = |e: &dyn std::fmt::Display| AutoscalerError(e.to_string());
    let cfg = a.to_config()?;
    let tls = match tls {
        Some(t) => Some(t),
        None => a.tls.load().map_err(AutoscalerError)?,
    };
    let tls = tls.as_ref();
    let pool = a
        .pp_pool
        .as_deref()
        .map(PpPool::load)
        .transpose()
        .map_err(|x| e(&x))?;
    if pool.is_some() && cfg.pp.is_none() {
        return Err(AutoscalerError(
            "--pp-pool needs --pp-capacity (PP is not scaled without it)".into(),
        ));
    }
    let provider = match pool {
        Some(p) => Some(Arc::new(
            LocalPpProvider::new(&a.fm, tls, p).map_err(|x| e(&x))?,
        )),
        None => None,
    };
    let scaler = Autoscaler::new(
        cfg.clone(),
        FmLoad::new(&a.fm, tls).await.map_err(|x| e(&x))?,
        FmActuator::new(
            &a.fm,
            tls,
            provider.clone().map(|p| p as Arc<dyn PpNodeProvider>),
        )
        .await
        .map_err(|x| e(&x))?,
        FmEvents::new(&a.fm, tls).await.map_err(|x| e(&x))?,
    )
    .map_err(|x| e(&x))?;
    // Tests and scripts wait for this line.
    say(&format!(
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
    ));
    scaler
        .run(stop, |r| record_line(r).iter().for_each(|l| say(l)))
        .await;
    if let Some(p) = &provider {
        if a.pp_stop_on_exit {
            for r in p.stop_all().await {
                match r {
                    Ok(s) => say(&format!("autoscale: on exit: {s}")),
                    Err(e) => say(&format!("autoscale: on exit: failed: {e}")),
                }
            }
        } else {
            for (id, pid) in p.running().await {
                say(&format!(
                    "autoscale: leaving PP node {id} (pid {pid}) running"
                ));
            }
        }
    }
    Ok(())
}

/// The line a decision prints, if it prints one.
fn record_line(r: &StepRecord) -> Option<String> {
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
        _ => return None,
    };
    Some(format!("autoscale: {line}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: AutoscaleFlags,
    }

    fn parse(args: &[&str]) -> Result<AutoscaleConfig, AutoscalerError> {
        let t = T::try_parse_from(std::iter::once("x").chain(args.iter().copied()))
            .map_err(|e| AutoscalerError(e.to_string()))?;
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
        // SC chains may go to zero running instances; PP keeps a node.
        let c = parse(&["--sc-capacity-rps", "10", "--min-groups", "0"]).unwrap();
        assert_eq!(c.sc.unwrap().policy.min, 0);
        assert!(parse(&["--pp-capacity", "10", "--pp-min-nodes", "0"]).is_err());
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
            &[
                "--sc-capacity-rps",
                "10",
                "--min-groups",
                "0",
                "--max-groups",
                "0",
            ],
            &["--sc-capacity-rps", "ten"],
            &["--pp-capacity", "10", "--pp-metric", "bytes"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
