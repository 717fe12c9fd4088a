//! `starfabric orchestrator`: the REST API and the nodes' control service.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::pp_cmd::{install_signal_handlers, STOP};

#[derive(Args, Debug)]
pub struct OrchestratorArgs {
    /// Address of the REST API.
    #[arg(long, default_value = "127.0.0.1:7080")]
    pub api: SocketAddr,
    /// Address of the nodes' control service (gRPC).
    #[arg(long, default_value = "127.0.0.1:7081")]
    pub control: SocketAddr,
    /// Desired-state store: `embedded:PATH` (a redb file) or
    /// `etcd:http://HOST:PORT[,http://HOST:PORT...]`.
    #[arg(long, default_value = "embedded:/var/lib/starfabric/orchestrator.redb")]
    pub store: String,
    /// Key prefix in etcd (several clusters can share one etcd).
    #[arg(long, default_value = "/starfabric/")]
    pub etcd_prefix: String,
    /// File holding the admin token; created with a random token if missing.
    #[arg(long, default_value = "/var/lib/starfabric/admin-token")]
    pub admin_token_file: PathBuf,
    /// This orchestrator's id.
    #[arg(long, default_value = "orchestrator-1")]
    pub id: String,
    /// How often nodes report, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub report_ms: u64,
    /// Run the autoscaler inside the orchestrator, with `starfabric autoscale`'s flags in
    /// one string, e.g. `--autoscale "--fm 10.0.0.5:7000 --sc-capacity-rps 500 --pp-capacity
    /// 200000 --pp-pool /etc/starfabric/pp-pool.json"`.
    #[arg(long, value_name = "FLAGS", allow_hyphen_values = true)]
    pub autoscale: Option<String>,
    /// Stop after this many seconds (default: until SIGINT/SIGTERM).
    #[arg(long)]
    pub duration: Option<f64>,
    #[command(flatten)]
    pub placement: PlacementArgs,
}

/// Where tenants' shards go (docs/placement.md).
#[derive(Args, Debug, Clone)]
pub struct PlacementArgs {
    /// Placement algorithm: `ddqn` (the learned agent, Best Fit behind it), `bf`, `ff`.
    #[arg(long = "placement", default_value = "ddqn")]
    pub algorithm: orchestrator::placement::Algorithm,
    /// DDQN model file (default: the model shipped with this build).
    #[arg(long = "placement-model")]
    pub model: Option<PathBuf>,
    /// U: the fraction of an SC node's capacity reservations may fill.
    #[arg(long = "placement-threshold", default_value_t = 0.8)]
    pub threshold: f64,
    /// G_min: fewest SC nodes per tenant (at least the group size, 3).
    #[arg(long = "shard-min", default_value_t = 3, allow_hyphen_values = true)]
    pub g_min: i64,
    /// G_max: most SC nodes per tenant.
    #[arg(long = "shard-max", default_value_t = 3, allow_hyphen_values = true)]
    pub g_max: i64,
    /// O: most SC nodes two tenants may share.
    #[arg(
        long = "shard-overlap",
        default_value_t = 2,
        allow_hyphen_values = true
    )]
    pub overlap: i64,
}

impl PlacementArgs {
    pub fn config(&self) -> Result<orchestrator::placement::PlacementConfig> {
        let limits =
            placement::Limits::checked(self.threshold, self.g_min, self.g_max, self.overlap)
                .map_err(|e| anyhow::anyhow!("placement limits: {e}"))?;
        if let Some(m) = &self.model {
            if !m.is_file() {
                bail!("--placement-model {}: no such file", m.display());
            }
        }
        Ok(orchestrator::placement::PlacementConfig {
            algorithm: self.algorithm,
            model: self.model.clone(),
            limits,
            ..Default::default()
        })
    }
}

pub async fn open_store(spec: &str, etcd_prefix: &str) -> Result<Arc<dyn store::Store>> {
    if let Some(path) = spec.strip_prefix("embedded:") {
        if path.is_empty() {
            bail!("--store embedded: needs a file path, e.g. embedded:/var/lib/starfabric/o.redb");
        }
        let s = store::EmbeddedStore::open(path).with_context(|| format!("opening {path}"))?;
        Ok(Arc::new(s))
    } else if let Some(eps) = spec.strip_prefix("etcd:") {
        let endpoints: Vec<String> = eps
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        if endpoints.is_empty() {
            bail!("--store etcd: needs at least one endpoint, e.g. etcd:http://127.0.0.1:2379");
        }
        let s = store::EtcdStore::connect(&endpoints, etcd_prefix)
            .await
            .with_context(|| format!("connecting to etcd at {}", endpoints.join(",")))?;
        Ok(Arc::new(s))
    } else {
        bail!("--store must be embedded:PATH or etcd:URL[,URL...], got {spec:?}")
    }
}

pub fn run(a: OrchestratorArgs) -> Result<()> {
    let autoscale = a
        .autoscale
        .as_deref()
        .map(crate::autoscale_cmd::parse_flags)
        .transpose()?;
    let token = orchestrator::auth::load_or_create_admin_token(&a.admin_token_file)
        .with_context(|| format!("admin token file {}", a.admin_token_file.display()))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut cfg = orchestrator::OrchestratorConfig::new(&token);
    cfg.id = a.id.clone();
    cfg.report_interval = Duration::from_millis(a.report_ms.max(10));
    cfg.placement = a.placement.config()?;
    let mut handle = rt.block_on(async {
        let store = open_store(&a.store, &a.etcd_prefix).await?;
        orchestrator::start(cfg, store, a.api, a.control)
            .await
            .map_err(anyhow::Error::from)
    })?;
    install_signal_handlers()?;
    // `starfabric up` and scripts wait for this line.
    println!(
        "orchestrator: api http://{} control {} store {}",
        handle.api_addr,
        handle.control_addr,
        handle.shared.desired.store().backend()
    );
    std::io::stdout().flush()?;
    let scaler_stop = Arc::new(AtomicBool::new(false));
    let mut scaler = autoscale.map(|args| {
        let flag = scaler_stop.clone();
        rt.spawn(crate::autoscale_cmd::serve(args, async move {
            while !flag.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }))
    });
    let start = std::time::Instant::now();
    while !STOP.load(Ordering::Relaxed) {
        if a.duration
            .is_some_and(|d| start.elapsed() >= Duration::from_secs_f64(d))
        {
            break;
        }
        // An autoscaler that ended on its own (its flags were checked before the start,
        // so this is rare) is reported, and the orchestrator keeps serving the API.
        if scaler.as_ref().is_some_and(|t| t.is_finished()) {
            if let Some(task) = scaler.take() {
                match rt.block_on(task) {
                    Ok(Ok(())) => println!("autoscale: ended"),
                    Ok(Err(e)) => println!("autoscale: failed: {e:#}"),
                    Err(e) => println!("autoscale: task failed: {e}"),
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Some(task) = scaler {
        scaler_stop.store(true, Ordering::Relaxed);
        // The autoscaler may be draining PP nodes it started (`--pp-stop-on-exit`).
        match rt.block_on(async { tokio::time::timeout(Duration::from_secs(60), task).await }) {
            Ok(Ok(Ok(()))) => println!("autoscale: stopped"),
            Ok(Ok(Err(e))) => println!("autoscale: failed: {e:#}"),
            Ok(Err(e)) => println!("autoscale: task failed: {e}"),
            Err(_) => println!("autoscale: did not stop within 60 s"),
        }
    }
    handle.stop();
    println!("orchestrator: stopped");
    Ok(())
}
