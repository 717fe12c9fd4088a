//! `starfabric sc`: run an SC node. It registers with the fabric master, which makes it
//! a replica of SC groups and pushes their chain order.

use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;

use proto::v1;

use crate::node_agent::NodeAgent;
use crate::pp_cmd::{install_signal_handlers, STOP};

#[derive(Args, Debug)]
pub struct ScArgs {
    /// The fabric master, `host:port` (default: the first the orchestrator names).
    #[arg(long, required_unless_present = "orchestrator")]
    fm: Option<String>,
    /// Register with this orchestrator (control address, `host:port`).
    #[arg(long)]
    orchestrator: Option<String>,
    /// Address of this node's replication server (port 0: any).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Address other SC nodes reach it at (default: the bound address).
    #[arg(long)]
    advertise: Option<String>,
    /// This node's id (unique among SC nodes).
    #[arg(long)]
    id: String,
    /// NF implementations: `builtin` (the nfs crate) or `test` (also the SC crate's
    /// deterministic test NFs).
    #[arg(long, default_value = "builtin")]
    nfs: String,
    /// Milliseconds between NF timer runs in the groups it heads.
    #[arg(long, default_value_t = 1000)]
    timer_ms: u64,
    /// Stop after this many seconds (default: until SIGINT/SIGTERM).
    #[arg(long)]
    duration: Option<f64>,
    /// Serve Prometheus metrics (`/metrics`, `/healthz`) on this address; port 0 picks one.
    #[arg(long)]
    metrics: Option<SocketAddr>,
}

pub fn run(a: ScArgs) -> Result<()> {
    let factory: Arc<dyn sc::ChainFactory> = match a.nfs.as_str() {
        "builtin" => Arc::new(sc::BuiltinNfs),
        "test" => Arc::new(sc::testing::TestNfs),
        other => anyhow::bail!("unknown --nfs {other:?} (builtin or test)"),
    };
    install_signal_handlers()?;
    // With --fm the node starts first, so the orchestrator learns its bound address;
    // without, the orchestrator must name the FM before the node can start.
    let hello_addr = a.advertise.clone().unwrap_or_else(|| a.listen.to_string());
    let mut agent = match (&a.orchestrator, &a.fm) {
        (Some(o), None) => Some(NodeAgent::start(
            o,
            &a.id,
            v1::Role::Sc,
            &hello_addr,
            "",
            None,
        )?),
        _ => None,
    };
    let fm = match (&a.fm, agent.as_mut()) {
        (Some(fm), _) => fm.clone(),
        (None, Some(ag)) => match ag.wait_for_fm(&STOP) {
            Some(d) => {
                ag.set_applied(d.version);
                d.fm_addrs[0].clone()
            }
            None => return Ok(()),
        },
        (None, None) => anyhow::bail!("--fm or --orchestrator is required"),
    };
    let mut cfg = sc::ScConfig::new(&a.id, a.listen, &fm);
    cfg.advertise = a.advertise.clone();
    cfg.timer_period = Duration::from_millis(a.timer_ms.max(1));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let node = rt.block_on(sc::start(cfg, factory))?;
    if let (Some(o), None) = (&a.orchestrator, &agent) {
        let addr = a
            .advertise
            .clone()
            .unwrap_or_else(|| node.addr().to_string());
        agent = Some(NodeAgent::start(o, &a.id, v1::Role::Sc, &addr, "", None)?);
    }
    // Tests and scripts wait for this line.
    println!("sc: node {} listening on {}, FM {fm}", a.id, node.addr());
    std::io::stdout().flush()?;
    let metrics = a
        .metrics
        .map(|addr| crate::metrics::sc_start(&rt, addr, &node))
        .transpose()?;
    let metrics_addr: Option<SocketAddr> = metrics.as_ref().map(|m| m.addr());
    if let Some(ag) = agent.as_mut() {
        ag.set_metrics(metrics_addr);
    }
    let metrics_field = metrics_addr.map(tracing::field::display);
    tracing::info!(node = %a.id, addr = %node.addr(), metrics = metrics_field, "SC running");
    let start = Instant::now();
    let mut next_report = start;
    while !STOP.load(Ordering::Relaxed) {
        if let Some(ag) = agent.as_mut() {
            if let Some(d) = ag.new_directive() {
                // The FM an SC node serves is fixed at start; FM failover is the
                // elasticity issue's.
                ag.set_applied(d.version);
            }
            if Instant::now() >= next_report {
                next_report = Instant::now() + Duration::from_millis(250);
                ag.set_report(report(&rt, &node));
            }
        }
        if a.duration
            .is_some_and(|d| start.elapsed() >= Duration::from_secs_f64(d))
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let groups = rt.block_on(node.status(false));
    for (g, s) in &groups {
        println!(
            "sc: group {} epoch {} position {}/{} applied {} requests {}",
            g.group, g.epoch, g.position, g.length, g.applied, s.requests_applied
        );
    }
    node.stop();
    println!("sc: stopped");
    Ok(())
}

/// What an SC node tells the orchestrator: the groups it serves and what it applied.
fn report(rt: &tokio::runtime::Runtime, node: &sc::ScHandle) -> v1::NodeReport {
    let groups = rt.block_on(node.status(false));
    let applied: u64 = groups.iter().map(|(_, s)| s.requests_applied).sum();
    let sessions = node.counters().fm_sessions.load(Ordering::Relaxed);
    v1::NodeReport {
        load: Some(v1::Load {
            requests_per_s: 0.0,
            flows: 0,
            groups: groups.len() as u32,
            ..Default::default()
        }),
        ready: sessions > 0,
        detail: format!("{} groups, {sessions} FM sessions opened", groups.len()),
        counters: [
            ("requests_applied".to_string(), applied),
            (
                "bad_messages".to_string(),
                node.counters().bad_messages.load(Ordering::Relaxed),
            ),
        ]
        .into_iter()
        .collect(),
        ..Default::default()
    }
}
