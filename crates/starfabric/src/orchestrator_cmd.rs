//! `starfabric orchestrator`: the REST API and the nodes' control service.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;

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
    pub placement: orchestrator::placement::PlacementFlags,
    /// Plaintext plane links (lab use only): no CA, no node certificates.
    #[arg(long, env = "STARFABRIC_INSECURE")]
    pub insecure: bool,
    /// Lifetime of the node certificates the CA issues, in seconds (renewed at 2/3).
    #[arg(long, default_value_t = 86400)]
    pub cert_ttl_s: u64,
    /// A reusable join token for nodes of ROLE, read from FILE (e.g. a mounted
    /// Kubernetes Secret): `sc=/etc/starfabric/join/sc`. Repeatable. Unlike `node token
    /// create`'s one-time tokens it admits any number of nodes (docs/security.md).
    #[arg(long, value_name = "ROLE=FILE")]
    pub bootstrap_token: Vec<String>,
}

/// `ROLE=FILE` → the role and the token the file holds.
fn bootstrap_token(spec: &str) -> Result<(proto::tls::Role, String)> {
    let (role, file) = spec
        .split_once('=')
        .with_context(|| format!("--bootstrap-token {spec:?}: expected ROLE=FILE"))?;
    let role: proto::tls::Role = role
        .parse()
        .with_context(|| format!("--bootstrap-token {spec:?}"))?;
    let token = std::fs::read_to_string(file)
        .with_context(|| format!("--bootstrap-token {spec:?}: reading {file}"))?;
    Ok((role, token.trim().to_string()))
}

pub fn run(a: OrchestratorArgs) -> Result<()> {
    let autoscale = a
        .autoscale
        .as_deref()
        .map(orchestrator::autoscaler::parse_flags)
        .transpose()?;
    let token = orchestrator::auth::load_or_create_admin_token(&a.admin_token_file)
        .with_context(|| format!("admin token file {}", a.admin_token_file.display()))?;
    crate::signals::install()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut cfg = orchestrator::OrchestratorConfig::new(&token);
    cfg.id = a.id.clone();
    cfg.report_interval = Duration::from_millis(a.report_ms.max(10));
    cfg.placement = a.placement.config().map_err(anyhow::Error::msg)?;
    cfg.bootstrap_tokens = a
        .bootstrap_token
        .iter()
        .map(|s| bootstrap_token(s))
        .collect::<Result<_>>()?;
    cfg.security = if a.insecure {
        tracing::warn!("--insecure: plane links are plaintext and unauthenticated");
        orchestrator::control::Security::Insecure
    } else {
        if a.cert_ttl_s < 60 {
            anyhow::bail!("--cert-ttl-s must be at least 60");
        }
        orchestrator::control::Security::Tls {
            cert_ttl: Duration::from_secs(a.cert_ttl_s),
        }
    };
    let mut handle = rt.block_on(async {
        let store = store::open(&a.store, &a.etcd_prefix).await?;
        orchestrator::start(cfg, store, a.api, a.control)
            .await
            .map_err(anyhow::Error::from)
    })?;
    // `starfabric up` and scripts wait for this line.
    println!(
        "orchestrator: api http://{} control {} store {}",
        handle.api_addr,
        handle.control_addr,
        handle.shared.desired.store().backend()
    );
    std::io::stdout().flush()?;
    let scaler_stop = Arc::new(AtomicBool::new(false));
    // The autoscaler dials FM as the orchestrator, with its (rotating) certificate.
    let own_tls = handle.shared.cfg.tls.clone();
    let mut scaler = autoscale.map(|mut args| {
        let flag = scaler_stop.clone();
        let lines = telemetry::Lines::stdout();
        args.tls.insecure = own_tls.is_none();
        rt.spawn(orchestrator::autoscaler::serve(
            args,
            own_tls.clone(),
            async move {
                while !flag.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            move |l| lines.say(l),
        ))
    });
    let start = std::time::Instant::now();
    while !crate::signals::stopped() {
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
