//! `starfabric fm`: run a fabric master.
//!
//! PP and SC nodes connect to it; it forms SC groups for the configured tenant chains
//! as SC nodes register, and dispatches rule requests to them.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;

use crate::pp_cmd::{install_signal_handlers, STOP};

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
    /// Serve Prometheus metrics (`/metrics`, `/healthz`) on this address; port 0 picks one.
    #[arg(long)]
    metrics: Option<SocketAddr>,
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
    let cfg = file.to_config(&a.id)?;
    let nchains = cfg.chains.len();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let fm = rt.block_on(fm::start(cfg, a.listen))?;
    install_signal_handlers()?;
    // Tests and scripts wait for this line.
    println!("fm: listening on {}, {nchains} chains", fm.addr());
    std::io::stdout().flush()?;
    let metrics = a
        .metrics
        .map(|addr| crate::metrics::fm_start(&rt, addr, &fm))
        .transpose()?;
    let metrics_addr: Option<SocketAddr> = metrics.as_ref().map(|m| m.addr());
    let metrics_field = metrics_addr.map(tracing::field::display);
    tracing::info!(addr = %fm.addr(), chains = nchains, metrics = metrics_field, "FM running");
    let start = Instant::now();
    let mut next = a.stats_interval.map(|i| start + Duration::from_secs_f64(i));
    while !STOP.load(Ordering::Relaxed) {
        if a.duration
            .is_some_and(|d| start.elapsed() >= Duration::from_secs_f64(d))
        {
            break;
        }
        if let (Some(t), Some(i)) = (next, a.stats_interval) {
            if Instant::now() >= t {
                print_status(&rt, &fm, start);
                next = Some(t + Duration::from_secs_f64(i));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    print_status(&rt, &fm, start);
    fm.stop();
    println!("fm: stopped");
    Ok(())
}

fn print_status(rt: &tokio::runtime::Runtime, fm: &fm::FmHandle, start: Instant) {
    let (Some(s), Some(m), Some(map)) = rt.block_on(async {
        (
            fm.stats().await,
            fm.members().await,
            fm.partition_map().await,
        )
    }) else {
        return;
    };
    let alive = |role: proto::v1::Role| {
        m.members
            .iter()
            .filter(|x| x.alive && x.node.as_ref().is_some_and(|n| n.role == role as i32))
            .count()
    };
    println!(
        "fm: t={:.1}s pp={} sc={} groups={} requests={} cache_hits={} submitted={} \
         sc_replies={} timeouts={} reconfigurations={} bad_messages={}",
        start.elapsed().as_secs_f64(),
        alive(proto::v1::Role::Pp),
        alive(proto::v1::Role::Sc),
        map.groups.len(),
        s.pp_requests,
        s.cache.hits,
        s.submitted,
        s.sc_replies,
        s.timeouts,
        s.reconfigurations,
        fm.wire_counters().bad_messages.load(Ordering::Relaxed)
    );
    let _ = std::io::stdout().flush();
}
