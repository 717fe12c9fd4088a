//! `starfabric sc`: run an SC node. It registers with the fabric master, which makes it
//! a replica of SC groups and pushes their chain order.

use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;

use proto::v1;

use crate::node_agent::NodeAgent;
use crate::pp_cmd::{install_signal_handlers, STOP};

#[derive(Args, Debug)]
pub struct ScArgs {
    /// The fabric master, `host:port`, or several comma-separated (`a:7000,b:7001`): the
    /// node starts on the first and fails over to the next when its FM is unreachable
    /// (default: the ones the orchestrator names).
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
    /// What the node offers the orchestrator's placement (docs/placement.md):
    /// `bw=GBIT,cpu=CORES,mem=GIB,price=P`, any subset. Unset parts take the
    /// orchestrator's defaults.
    #[arg(long, value_parser = parse_capacity)]
    capacity: Option<v1::NodeCapacity>,
}

/// `bw=10,cpu=2,mem=4,price=1` (any subset, any order) as a node capacity.
pub fn parse_capacity(s: &str) -> Result<v1::NodeCapacity, String> {
    let mut c = v1::NodeCapacity::default();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?} is not KEY=VALUE"))?;
        let x: f64 = v
            .parse()
            .map_err(|_| format!("{k}: {v:?} is not a number"))?;
        if !x.is_finite() || x < 0.0 {
            return Err(format!("{k} must be a finite number >= 0, got {v}"));
        }
        match k {
            "bw" => c.bw_gbps = x,
            "cpu" => c.cpu = x,
            "mem" => c.mem_gib = x,
            "price" => c.price = x,
            _ => return Err(format!("unknown capacity key {k:?} (bw, cpu, mem, price)")),
        }
    }
    Ok(c)
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
            a.capacity,
        )?),
        _ => None,
    };
    let fm = match (&a.fm, agent.as_mut()) {
        (Some(fm), _) => fm.clone(),
        (None, Some(ag)) => match ag.wait_for_fm(&STOP) {
            Some(d) => {
                ag.set_applied(d.version);
                d.fm_addrs.join(",")
            }
            None => return Ok(()),
        },
        (None, None) => anyhow::bail!("--fm or --orchestrator is required"),
    };
    proto::FmAddrs::parse(&fm).with_context(|| format!("--fm {fm}"))?;
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
        agent = Some(NodeAgent::start(
            o,
            &a.id,
            v1::Role::Sc,
            &addr,
            "",
            None,
            a.capacity,
        )?);
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
    let mut on_fm: Option<String> = None;
    while !STOP.load(Ordering::Relaxed) {
        // Tests and operators see from this line which FM the node is on (FM failover).
        let now_fm = node.current_fm();
        if now_fm != on_fm {
            if let Some(f) = &now_fm {
                println!("sc: node {} on FM {f}", a.id);
                std::io::stdout().flush()?;
            }
            on_fm = now_fm;
        }
        if let Some(ag) = agent.as_mut() {
            if let Some(d) = ag.new_directive() {
                // The FM addresses an SC node fails over between are fixed at start.
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
