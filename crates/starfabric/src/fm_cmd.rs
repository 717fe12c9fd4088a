//! `starfabric fm`: run a fabric master (`fm::node`).
//!
//! PP and SC nodes connect to it; it forms SC groups for the configured tenant chains
//! as SC nodes register, and dispatches rule requests to them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct FmArgs {
    /// Address to serve gRPC on.
    #[arg(long, default_value = "127.0.0.1:7000")]
    listen: SocketAddr,
    /// Configuration (JSON): tenant chains, group size, heartbeats, cache; see `fm::FmFile`.
    #[arg(long)]
    config: Option<PathBuf>,
    /// This FM's id.
    #[arg(long, default_value = "fm-1")]
    id: String,
    /// Print a one-line status to stdout every this many seconds.
    #[arg(long)]
    stats_interval: Option<f64>,
    /// Stop after this many seconds (default: until SIGINT/SIGTERM).
    #[arg(long)]
    duration: Option<f64>,
    /// Register with this orchestrator (control address, `host:port`) and serve the
    /// chains it directs instead of the configuration file's.
    #[arg(long)]
    orchestrator: Option<String>,
    /// Address PP and SC nodes reach this FM at (default: the bound address).
    #[arg(long)]
    advertise: Option<String>,
    /// Serve Prometheus metrics (`/metrics`, `/healthz`) on this address; port 0 picks one.
    #[arg(long)]
    metrics: Option<SocketAddr>,
    /// Also append every event of FM's log to this file, one JSON object a line
    /// (`starfabric events` reads the in-memory log either way).
    #[arg(long)]
    events: Option<PathBuf>,
    /// Runtime threads. One suits a small node that hosts other planes too: on two
    /// cores shared with PP and SC, a second FM thread cost more than it gave
    /// (docs/setup-path.md, "FM on one runtime thread").
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=256))]
    threads: u64,
    #[command(flatten)]
    tls: crate::tls_args::TlsArgs,
    #[command(flatten)]
    pack: crate::pack_args::PackArgs,
}

pub fn run(a: FmArgs) -> Result<()> {
    let file = match &a.config {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            fm::FmFile::parse(&text).with_context(|| format!("{}", p.display()))?
        }
        None => fm::FmFile::parse("{}")?,
    };
    let mut cfg = file.to_config(&a.id)?;
    cfg.events_file = a.events.clone();
    cfg.tls = a.tls.load(proto::tls::Role::Fm, &a.id)?;
    crate::signals::install()?;
    let _packer = a.pack.start()?;
    let node = fm::node::start(fm::node::FmNodeConfig {
        fm: cfg,
        listen: a.listen,
        orchestrator: a.orchestrator,
        advertise: a.advertise,
        metrics: a.metrics,
        stats_interval: a.stats_interval.map(Duration::from_secs_f64),
        lines: telemetry::Lines::stdout(),
        threads: a.threads as usize,
    })?;
    crate::signals::wait_secs(a.duration);
    node.stop();
    Ok(())
}
