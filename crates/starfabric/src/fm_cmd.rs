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

use proto::v1;

use crate::node_agent::NodeAgent;
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
    let nchains = cfg.chains.len();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let fm = rt.block_on(fm::start(cfg, a.listen))?;
    install_signal_handlers()?;
    let advertise = a.advertise.clone().unwrap_or_else(|| fm.addr().to_string());
    let mut agent = match &a.orchestrator {
        Some(o) => Some(NodeAgent::start(
            o,
            &a.id,
            v1::Role::Fm,
            &advertise,
            "",
            None,
            None,
        )?),
        None => None,
    };
    // Tests and scripts wait for this line.
    println!("fm: listening on {}, {nchains} chains", fm.addr());
    std::io::stdout().flush()?;
    let metrics = a
        .metrics
        .map(|addr| crate::metrics::fm_start(&rt, addr, &fm))
        .transpose()?;
    let metrics_addr: Option<SocketAddr> = metrics.as_ref().map(|m| m.addr());
    if let Some(ag) = agent.as_mut() {
        ag.set_metrics(metrics_addr);
    }
    let metrics_field = metrics_addr.map(tracing::field::display);
    tracing::info!(addr = %fm.addr(), chains = nchains, metrics = metrics_field, "FM running");
    let start = Instant::now();
    let mut next = a.stats_interval.map(|i| start + Duration::from_secs_f64(i));
    let mut next_report = start;
    let mut desired_chains = nchains;
    while !STOP.load(Ordering::Relaxed) {
        if let Some(ag) = agent.as_mut() {
            if let Some(d) = ag.new_directive() {
                desired_chains = d.chains.len();
                let change = rt.block_on(fm.set_desired(d.chains, d.partitions, d.shards));
                tracing::info!(version = d.version, ?change, "directive applied");
                ag.set_applied(d.version);
            }
            if Instant::now() >= next_report {
                next_report = Instant::now() + Duration::from_millis(250);
                if let Some(r) = report(&rt, &fm, desired_chains) {
                    ag.set_report(r);
                }
            }
        }
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

/// What FM tells the orchestrator: its partition map and membership, whether every
/// desired chain has its SC groups, and its counters.
fn report(
    rt: &tokio::runtime::Runtime,
    fm: &fm::FmHandle,
    chains: usize,
) -> Option<v1::NodeReport> {
    let (s, m, map, metrics) = rt.block_on(async {
        (
            fm.stats().await,
            fm.members().await,
            fm.partition_map().await,
            fm.metrics().await,
        )
    });
    let (s, m, map, metrics) = (s?, m?, map?, metrics?);
    let served: std::collections::HashSet<(u32, u32)> =
        map.partitions.iter().map(|p| (p.tenant, p.chain)).collect();
    let live_sc = m
        .members
        .iter()
        .filter(|x| {
            x.alive
                && x.node
                    .as_ref()
                    .is_some_and(|n| n.role == v1::Role::Sc as i32)
        })
        .count();
    let ready = served.len() >= chains;
    let counters = [
        ("rule_requests", s.pp_requests),
        ("cache_hits", s.cache.hits),
        ("cache_misses", s.cache.misses),
        ("submitted", s.submitted),
        ("sc_replies", s.sc_replies),
        ("timeouts", s.timeouts),
        ("reconfigurations", s.reconfigurations),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    Some(v1::NodeReport {
        load: Some(v1::Load {
            requests_per_s: 0.0,
            flows: s
                .cache
                .inserts
                .saturating_sub(s.cache.evicted_full + s.cache.expired + s.cache.invalidated),
            groups: map.groups.len() as u32,
            ..Default::default()
        }),
        ready,
        detail: if ready {
            format!("{} chains served, {live_sc} SC nodes", served.len())
        } else {
            format!(
                "{} of {chains} chains have SC groups; {live_sc} SC nodes live",
                served.len()
            )
        },
        partitions: Some(map),
        members: Some(m),
        counters,
        tenants: metrics
            .tenant_requests
            .iter()
            .map(|&(tenant, n)| v1::TenantCounters {
                tenant,
                flows: n,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    })
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
         sc_replies={} timeouts={} reconfigurations={} bad_messages={} nodes_dead={} \
         scale_outs={} scale_ins={} scale_aborts={} scale_redirects={} scale_last_us={} \
         vip_moves={} cache_misses={} adopted={}",
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
        fm.wire_counters().bad_messages.load(Ordering::Relaxed),
        s.nodes_dead,
        s.scale_outs,
        s.scale_ins,
        s.scale_aborts,
        s.scale_redirects,
        s.scale_last_us,
        s.vip_moves,
        s.cache.misses,
        s.groups_adopted,
    );
    let _ = std::io::stdout().flush();
}
