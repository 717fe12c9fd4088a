//! `starfabric sc`: run an SC node (`sc::process`). It registers with the fabric
//! master, which makes it a replica of SC groups and pushes their chain order.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use clap::Args;

use proto::v1;

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
    /// Pre-started worker threads replicas run on (default: two per core).
    #[arg(long)]
    workers: Option<usize>,
    /// The CPUs workers are pinned to, in round-robin order, as `taskset -c` writes
    /// them: `0-3,6`. Default: every CPU the process may run on. Nodes sharing a host
    /// should take disjoint lists or one list rotated (`1,0` beside `0,1`), else every
    /// node's first replica lands on the same CPU (docs/workers.md).
    #[arg(long)]
    worker_cpus: Option<String>,
    /// The scheduler slice each worker thread asks Linux's fair scheduler for, in µs
    /// (EEVDF, Linux 6.12+): shorter than the node's other threads' slices, so a
    /// woken worker preempts them and a new or woken replica decides at once
    /// (docs/workers.md). Its CPU share is unchanged. 0: the kernel's default.
    #[arg(long, default_value_t = sc::workers::DEFAULT_WORKER_SLICE.as_micros() as u64)]
    worker_slice_us: u64,
    /// Park a replica idle this long (scale to zero; docs/workers.md). Default: never.
    #[arg(long)]
    idle_ms: Option<u64>,
    /// Backpressure (NFVnice; docs/workers.md): a replica with this many inputs queued
    /// has new requests refused as `setup-overload` before they reach its worker,
    /// counted as `shed_requests_total{reason="queue"}`. Default: unbounded.
    #[arg(long)]
    queue_limit: Option<usize>,
    /// Backpressure from the chain: a head this many ops ahead of its successors
    /// refuses new requests the same way (`reason="chain_lag"`). Default: unbounded.
    #[arg(long)]
    lag_limit: Option<usize>,
    /// Which core each worker is pinned to (docs/cores.md): `rr`, `llf`, `ffd` or
    /// `s2c` (the learned sfc2cpu assigner, watched: back to RR on a > 5% regression).
    #[arg(long, default_value = "rr", value_parser = clap::builder::PossibleValuesParser::new(sc::ASSIGNER_NAMES))]
    assigner: String,
    /// The `s2c` assigner's model file (default: the one shipped in this build). A
    /// missing, corrupt or other-version file makes the node use RR and say so.
    #[arg(long)]
    assigner_model: Option<std::path::PathBuf>,
    /// Re-run the assigner on the measured loads this often (default: at start only).
    #[arg(long)]
    assign_period_ms: Option<u64>,
    /// NF chains kept built ahead per hosted chain, so a replica's start takes one
    /// instead of building its NFs (Serpens' pre-loaded NFs; docs/workers.md, "Spare
    /// chains"). They are built on an idle CPU only. 0: every start builds its chain.
    #[arg(long, default_value_t = 1)]
    spare_chains: usize,
    #[command(flatten)]
    tls: crate::tls_args::TlsArgs,
    #[command(flatten)]
    pack: crate::pack_args::PackArgs,
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
        #[cfg(feature = "lab")]
        "test" => Arc::new(sc::testing::TestNfs),
        other => anyhow::bail!("unknown --nfs {other:?} (builtin or test)"),
    };
    let tls = a.tls.load(proto::tls::Role::Sc, &a.id)?;
    let stop = crate::signals::install()?;
    let _packer = a.pack.start()?;
    let cfg = sc::process::ScProcessConfig {
        id: a.id,
        fm: a.fm,
        orchestrator: a.orchestrator,
        listen: a.listen,
        advertise: a.advertise,
        factory,
        timer_period: Duration::from_millis(a.timer_ms),
        metrics: a.metrics,
        capacity: a.capacity,
        lines: telemetry::Lines::stdout(),
        workers: a.workers,
        worker_cpus: a
            .worker_cpus
            .as_deref()
            .map(sc::workers::parse_cpu_list)
            .transpose()
            .map_err(|e| anyhow::anyhow!("--worker-cpus: {e}"))?,
        worker_slice: (a.worker_slice_us > 0).then(|| Duration::from_micros(a.worker_slice_us)),
        idle: a.idle_ms.map(Duration::from_millis),
        queue_limit: a.queue_limit,
        lag_limit: a.lag_limit,
        assigner: Some(a.assigner),
        assigner_model: a.assigner_model,
        assign_period: a.assign_period_ms.map(Duration::from_millis),
        tls,
        spare_chains: a.spare_chains,
    };
    let Some(node) = sc::process::start(cfg, stop)? else {
        return Ok(());
    };
    crate::signals::wait_secs(a.duration);
    node.stop();
    Ok(())
}
