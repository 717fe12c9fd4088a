//! `starfabric sc`: run an SC node. It registers with the fabric master, which makes it
//! a replica of SC groups and pushes their chain order.

use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use clap::Args;

use crate::pp_cmd::{install_signal_handlers, STOP};

#[derive(Args, Debug)]
pub struct ScArgs {
    /// The fabric master, `host:port`.
    #[arg(long)]
    fm: String,
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
    let mut cfg = sc::ScConfig::new(&a.id, a.listen, &a.fm);
    cfg.advertise = a.advertise.clone();
    cfg.timer_period = Duration::from_millis(a.timer_ms.max(1));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let node = rt.block_on(sc::start(cfg, factory))?;
    install_signal_handlers()?;
    // Tests and scripts wait for this line.
    println!(
        "sc: node {} listening on {}, FM {}",
        a.id,
        node.addr(),
        a.fm
    );
    std::io::stdout().flush()?;
    let metrics = a
        .metrics
        .map(|addr| crate::metrics::sc_start(&rt, addr, &node))
        .transpose()?;
    let metrics_addr: Option<SocketAddr> = metrics.as_ref().map(|m| m.addr());
    let metrics_field = metrics_addr.map(tracing::field::display);
    tracing::info!(node = %a.id, addr = %node.addr(), metrics = metrics_field, "SC running");
    let start = Instant::now();
    while !STOP.load(Ordering::Relaxed) {
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
