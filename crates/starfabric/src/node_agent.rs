//! Glue between a node subcommand (`pp`, `fm`, `sc`) and its control session with the
//! orchestrator (`--orchestrator ADDR`): the hello it sends, a report slot the node's
//! own loop refreshes, and directive polling.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use orchestrator::agent::{Agent, AgentConfig};
use proto::v1;

/// A node's link to the orchestrator.
pub struct NodeAgent {
    agent: Agent,
    report: Arc<Mutex<v1::NodeReport>>,
    directives: tokio::sync::watch::Receiver<Option<v1::Directive>>,
    metrics_url: String,
}

impl NodeAgent {
    pub fn start(
        orchestrator: &str,
        id: &str,
        role: v1::Role,
        addr: &str,
        cluster: &str,
        metrics_url: Option<String>,
        capacity: Option<v1::NodeCapacity>,
    ) -> Result<NodeAgent> {
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
                        proto_version: proto::PROTO_VERSION,
                        incarnation: 0,
                        ..Default::default()
                    }),
                    cluster: cluster.to_string(),
                    metrics_url: metrics_url.unwrap_or_default(),
                    version: env!("CARGO_PKG_VERSION").to_string(),
                    capacity,
                },
            },
            Arc::new(move || r.lock().unwrap_or_else(|e| e.into_inner()).clone()),
        )
        .context("control agent")?;
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
