//! The node side of the control session: `starfabric pp|fm|sc --orchestrator ADDR`.
//!
//! The agent runs on a thread of its own (PP's worker is a plain thread, FM and SC have
//! runtimes of their own; none should share its scheduling with this). It says hello,
//! sends the node's report every `report_ms` the orchestrator asked for, and hands each
//! directive to the node through a `watch` channel, which the node polls between its
//! own work. It reconnects with backoff for as long as it runs; a node keeps serving
//! with its last directive while the orchestrator is away.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::v1::{self, node_down, node_up};
use thiserror::Error;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

#[derive(Debug, Error)]
pub enum AgentError {
    #[error("cannot start the control agent: {0}")]
    Start(String),
}

/// What the node reports, produced on demand (cheaply: from a published snapshot).
pub type ReportFn = Arc<dyn Fn() -> v1::NodeReport + Send + Sync>;

pub struct AgentConfig {
    /// The orchestrator's control address, `host:port`.
    pub orchestrator: String,
    pub hello: v1::NodeHello,
    /// mTLS to the orchestrator; `None` is plaintext (`--insecure`).
    pub tls: Option<Arc<crate::tls::NodeTls>>,
}

/// A running agent.
pub struct Agent {
    directives: watch::Receiver<Option<v1::Directive>>,
    applied: Arc<AtomicU64>,
    connected: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Agent {
    pub fn start(cfg: AgentConfig, report: ReportFn) -> Result<Agent, AgentError> {
        let (tx, rx) = watch::channel(None);
        let applied = Arc::new(AtomicU64::new(0));
        let connected = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| AgentError::Start(e.to_string()))?;
        let (a, c, s) = (applied.clone(), connected.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("control-agent".into())
            .spawn(move || rt.block_on(run(cfg, report, tx, a, c, s)))
            .map_err(|e| AgentError::Start(e.to_string()))?;
        Ok(Agent {
            directives: rx,
            applied,
            connected,
            stop,
            thread: Some(thread),
        })
    }

    /// Directives as they arrive (`None` until the first).
    pub fn directives(&self) -> watch::Receiver<Option<v1::Directive>> {
        self.directives.clone()
    }

    /// Tell the orchestrator which directive version the node now runs.
    pub fn set_applied(&self, version: u64) {
        self.applied.store(version, Ordering::Relaxed);
    }

    pub fn connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn run(
    cfg: AgentConfig,
    report: ReportFn,
    directives: watch::Sender<Option<v1::Directive>>,
    applied: Arc<AtomicU64>,
    connected: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
) {
    let mut backoff = Duration::from_millis(100);
    let mut seq = 0u64;
    while !stop.load(Ordering::Relaxed) {
        match session(
            &cfg,
            &report,
            &directives,
            &applied,
            &connected,
            &stop,
            &mut seq,
        )
        .await
        {
            Ok(()) => backoff = Duration::from_millis(100),
            Err(e) => {
                if connected.swap(false, Ordering::Relaxed) {
                    warn!(orchestrator = %cfg.orchestrator, error = %e, "control session lost; reconnecting");
                } else {
                    debug!(orchestrator = %cfg.orchestrator, error = %e, "control session failed");
                }
            }
        }
        connected.store(false, Ordering::Relaxed);
        // Sleep in short steps so that stop() is prompt.
        let until = tokio::time::Instant::now() + backoff;
        while tokio::time::Instant::now() < until && !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

async fn session(
    cfg: &AgentConfig,
    report: &ReportFn,
    directives: &watch::Sender<Option<v1::Directive>>,
    applied: &AtomicU64,
    connected: &AtomicBool,
    stop: &AtomicBool,
    seq: &mut u64,
) -> Result<(), String> {
    let endpoint = crate::endpoint(&cfg.orchestrator)
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(2));
    let channel = crate::tls::connect(endpoint, cfg.tls.as_ref(), crate::tls::Role::Orchestrator)
        .await
        .map_err(|e| e.to_string())?;
    let mut client = v1::control_client::ControlClient::new(channel)
        .max_decoding_message_size(crate::MAX_MESSAGE)
        .max_encoding_message_size(crate::MAX_MESSAGE);
    let (tx, rx) = mpsc::unbounded_channel();
    tx.send(v1::NodeUp {
        msg: Some(node_up::Msg::Hello(cfg.hello.clone())),
    })
    .map_err(|e| e.to_string())?;
    let mut inbound = client
        .node_session(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .map_err(|e| e.message().to_string())?
        .into_inner();
    let welcome = match inbound.message().await.map_err(|e| e.to_string())? {
        Some(v1::NodeDown {
            msg: Some(node_down::Msg::Welcome(w)),
        }) => w,
        _ => return Err("the orchestrator did not welcome the node".into()),
    };
    connected.store(true, Ordering::Relaxed);
    info!(orchestrator = %welcome.orchestrator_id, report_ms = welcome.report_ms, "control session up");
    let period = Duration::from_millis(u64::from(welcome.report_ms.clamp(10, 60_000)));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut stop_check = tokio::time::interval(Duration::from_millis(50));
    loop {
        tokio::select! {
            _ = tick.tick() => {
                *seq += 1;
                let mut r = report();
                r.seq = *seq;
                r.applied_version = applied.load(Ordering::Relaxed);
                tx.send(v1::NodeUp { msg: Some(node_up::Msg::Report(r)) })
                    .map_err(|e| e.to_string())?;
            }
            m = inbound.message() => match m.map_err(|e| e.to_string())? {
                Some(v1::NodeDown { msg: Some(node_down::Msg::Directive(d)) }) => {
                    debug!(version = d.version, chains = d.chains.len(), vpcs = d.vpcs.len(),
                           fms = d.fm_addrs.len(), "directive received");
                    // Revocations apply here, for every kind of node, before the node's
                    // own loop looks at the directive: within one push of the revoke.
                    if let Some(t) = &cfg.tls {
                        for id in d.revoked.iter().filter(|id| !t.is_revoked(id)) {
                            t.revoke(id);
                        }
                    }
                    directives.send_replace(Some(d));
                }
                Some(_) => debug!("ignoring an unexpected control message"),
                None => return Err("the orchestrator closed the session".into()),
            },
            _ = stop_check.tick() => {
                if stop.load(Ordering::Relaxed) {
                    return Ok(());
                }
            }
        }
    }
}

/// A node's link to the orchestrator: the hello it sends, a report slot the node's own
/// loop refreshes, and directive polling (what `pp`, `fm` and `sc` nodes share).
pub struct NodeAgent {
    agent: Agent,
    report: Arc<Mutex<v1::NodeReport>>,
    directives: tokio::sync::watch::Receiver<Option<v1::Directive>>,
    metrics_url: String,
}

impl NodeAgent {
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        orchestrator: &str,
        id: &str,
        role: v1::Role,
        addr: &str,
        cluster: &str,
        metrics_url: Option<String>,
        capacity: Option<v1::NodeCapacity>,
        tls: Option<Arc<crate::tls::NodeTls>>,
    ) -> Result<NodeAgent, AgentError> {
        let report = Arc::new(Mutex::new(v1::NodeReport::default()));
        let r = report.clone();
        let agent = Agent::start(
            AgentConfig {
                orchestrator: orchestrator.to_string(),
                hello: v1::NodeHello {
                    node: Some(v1::NodeInfo {
                        id: id.to_string(),
                        role: role as i32,
                        addr: addr.to_string(),
                        load: None,
                        proto_version: crate::PROTO_VERSION,
                        incarnation: 0,
                        ..Default::default()
                    }),
                    cluster: cluster.to_string(),
                    metrics_url: metrics_url.unwrap_or_default(),
                    version: env!("CARGO_PKG_VERSION").to_string(),
                    capacity,
                },
                tls,
            },
            Arc::new(move || r.lock().unwrap_or_else(|e| e.into_inner()).clone()),
        )?;
        let directives = agent.directives();
        Ok(NodeAgent {
            agent,
            report,
            directives,
            metrics_url: String::new(),
        })
    }

    /// Publish what the next report says.
    pub fn set_report(&self, mut r: v1::NodeReport) {
        if r.metrics_url.is_empty() {
            r.metrics_url = self.metrics_url.clone();
        }
        *self.report.lock().unwrap_or_else(|e| e.into_inner()) = r;
    }

    /// The node's Prometheus endpoint, once it serves one.
    pub fn set_metrics(&mut self, addr: Option<std::net::SocketAddr>) {
        if let Some(a) = addr {
            self.metrics_url = format!("http://{a}/metrics");
        }
    }

    /// A directive that arrived since the last call.
    pub fn new_directive(&mut self) -> Option<v1::Directive> {
        if self.directives.has_changed().unwrap_or(false) {
            self.directives.borrow_and_update().clone()
        } else {
            None
        }
    }

    /// Wait for a directive that names at least one FM (PP and SC need one to start).
    pub fn wait_for_fm(&mut self, stop: &std::sync::atomic::AtomicBool) -> Option<v1::Directive> {
        let mut said = Instant::now() - Duration::from_secs(60);
        loop {
            if stop.load(std::sync::atomic::Ordering::Relaxed) {
                return None;
            }
            let d = self.directives.borrow_and_update().clone();
            if let Some(d) = d.filter(|d| !d.fm_addrs.is_empty()) {
                return Some(d);
            }
            if said.elapsed() > Duration::from_secs(5) {
                println!(
                    "waiting for the orchestrator to name a fabric master (connected: {})",
                    self.agent.connected()
                );
                said = Instant::now();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn set_applied(&self, version: u64) {
        self.agent.set_applied(version);
    }
}

/// A node's control thread: it applies directives, refreshes the report and prints
/// status lines until halted.
pub struct ControlLoop {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ControlLoop {
    /// Run `f` on a thread named `name`; `f` should return once `stop` is set.
    pub fn spawn(
        name: &str,
        stop: Arc<AtomicBool>,
        f: impl FnOnce(Arc<AtomicBool>) + Send + 'static,
    ) -> std::io::Result<ControlLoop> {
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || f(s))?;
        Ok(ControlLoop {
            stop,
            thread: Some(thread),
        })
    }

    /// Stop the thread and wait for it; false if it was halted already.
    pub fn halt(&mut self) -> bool {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take() {
            Some(t) => {
                let _ = t.join();
                true
            }
            None => false,
        }
    }
}
