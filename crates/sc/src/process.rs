//! A whole SC node, started in-process: the replication server and FM session on a
//! runtime of its own, `/metrics`, and the control session with the orchestrator
//! (which may name the FM). `starfabric sc` is this plus flags.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::agent::{ControlLoop, NodeAgent};
use proto::v1;
use telemetry::MetricsServer;
use thiserror::Error;

use crate::{ChainFactory, ScHandle};

#[derive(Debug, Error)]
pub enum ScProcessError {
    #[error("{0}")]
    Config(String),
    #[error("{0}")]
    Io(String),
}

/// What an SC node runs with.
#[derive(Clone)]
pub struct ScProcessConfig {
    pub id: String,
    /// The fabric masters, comma-separated, in failover order (`None`: the ones the
    /// orchestrator names).
    pub fm: Option<String>,
    pub orchestrator: Option<String>,
    /// The replication server's address (port 0: any).
    pub listen: SocketAddr,
    /// Address other SC nodes reach it at (default: the bound address).
    pub advertise: Option<String>,
    pub factory: Arc<dyn ChainFactory>,
    /// Between NF timer runs in the groups it heads.
    pub timer_period: Duration,
    pub metrics: Option<SocketAddr>,
    /// What the node offers the orchestrator's placement.
    pub capacity: Option<v1::NodeCapacity>,
    pub lines: telemetry::Lines,
    /// Pre-started workers (None: two per core).
    pub workers: Option<usize>,
    /// The CPUs workers are pinned to, in round-robin order (None: every CPU the
    /// process may run on).
    pub worker_cpus: Option<Vec<usize>>,
    /// The scheduler slice worker threads ask for (None: the kernel's default;
    /// [`crate::ScConfig::worker_slice`]).
    pub worker_slice: Option<Duration>,
    /// Idle time after which a replica parks (None: never).
    pub idle: Option<Duration>,
    /// NFVnice's backpressure at dispatch: a replica with this many inputs queued has
    /// new requests refused as `setup-overload` (None: unbounded; [`crate::ScConfig::queue_limit`]).
    pub queue_limit: Option<usize>,
    /// The chain's backpressure: a head this many ops ahead of its successors refuses
    /// new requests the same way (None: unbounded; [`crate::ScConfig::lag_limit`]).
    pub lag_limit: Option<usize>,
    /// Core assigner (one of [`crate::ASSIGNER_NAMES`]; None: RR).
    pub assigner: Option<String>,
    /// The learned assigner's model file (None: the one shipped in this build).
    pub assigner_model: Option<std::path::PathBuf>,
    /// Re-run the assigner this often (None: at start and on request).
    pub assign_period: Option<Duration>,
    /// mTLS on every link of the node; `None` is plaintext (`--insecure`).
    pub tls: Option<Arc<proto::tls::NodeTls>>,
    /// Spare NF chains kept built per hosted chain ([`crate::ScConfig::spare_chains`]).
    pub spare_chains: usize,
}

/// A running SC node.
pub struct ScProcess {
    rt: Option<tokio::runtime::Runtime>,
    node: Arc<ScHandle>,
    control: ControlLoop,
    metrics: Option<MetricsServer>,
    lines: telemetry::Lines,
}

/// Start an SC node. Without an FM it first waits for the orchestrator to name one;
/// `stop` ends that wait, and then this returns `Ok(None)`.
pub fn start(
    a: ScProcessConfig,
    stop: Arc<AtomicBool>,
) -> Result<Option<ScProcess>, ScProcessError> {
    let say = |l: &str| a.lines.say(l);
    let agent_err = |e: proto::agent::AgentError| ScProcessError::Io(e.to_string());
    // The replication server's socket is bound first, so the orchestrator learns the
    // bound address (not `--listen`'s port 0) even when it must name the FM before the
    // node can start.
    let listener = std::net::TcpListener::bind(a.listen)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .map_err(|e| ScProcessError::Io(format!("bind {}: {e}", a.listen)))?;
    let bound = listener
        .local_addr()
        .map_err(|e| ScProcessError::Io(e.to_string()))?;
    let hello_addr = a.advertise.clone().unwrap_or_else(|| bound.to_string());
    // Started before the node when the orchestrator must name the FM, else after it.
    let start_agent = |o: &str| {
        NodeAgent::start(
            o,
            &a.id,
            v1::Role::Sc,
            &hello_addr,
            "",
            None,
            a.capacity,
            a.tls.clone(),
        )
        .map_err(agent_err)
    };
    let mut agent = match (&a.orchestrator, &a.fm) {
        (Some(o), None) => Some(start_agent(o)?),
        _ => None,
    };
    let fm = match (&a.fm, agent.as_mut()) {
        (Some(fm), _) => fm.clone(),
        (None, Some(ag)) => match ag.wait_for_fm(&stop) {
            Some(d) => {
                ag.set_applied(d.version);
                d.fm_addrs.join(",")
            }
            None => return Ok(None),
        },
        (None, None) => {
            return Err(ScProcessError::Config(
                "--fm or --orchestrator is required".into(),
            ))
        }
    };
    proto::FmAddrs::parse(&fm).map_err(|e| ScProcessError::Config(format!("--fm {fm}: {e}")))?;
    let mut cfg = crate::ScConfig::new(&a.id, a.listen, &fm);
    cfg.advertise = a.advertise.clone();
    cfg.timer_period = a.timer_period.max(Duration::from_millis(1));
    if let Some(n) = a.workers {
        if n == 0 {
            return Err(ScProcessError::Config(
                "--workers must be at least 1".into(),
            ));
        }
        cfg.workers = n;
    }
    if let Some(cpus) = &a.worker_cpus {
        crate::workers::check_cpus(cpus, &crate::workers::allowed_cpus())
            .map_err(|e| ScProcessError::Config(format!("--worker-cpus: {e}")))?;
        cfg.worker_cpus = Some(cpus.clone());
    }
    cfg.worker_slice = a.worker_slice;
    cfg.idle = a.idle;
    cfg.spare_chains = a.spare_chains;
    for (flag, limit) in [
        ("--queue-limit", a.queue_limit),
        ("--lag-limit", a.lag_limit),
    ] {
        if limit == Some(0) {
            return Err(ScProcessError::Config(format!(
                "{flag} must be at least 1 (0 would refuse every request)"
            )));
        }
    }
    cfg.queue_limit = a.queue_limit;
    cfg.lag_limit = a.lag_limit;
    if let Some(name) = &a.assigner {
        let (assigner, why) = crate::assigner_by_name(name, a.assigner_model.as_deref())
            .map_err(|e| ScProcessError::Config(format!("--assigner: {e}")))?;
        if let Some(why) = why {
            // The node runs on with RR; operators read this line and the status.
            say(&format!("sc: {why}"));
        }
        cfg.assigner = crate::Assigner(assigner);
    }
    cfg.assign_period = a.assign_period;
    cfg.tls = a.tls.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.io_threads.max(1))
        .enable_all()
        .build()
        .map_err(|e| ScProcessError::Io(e.to_string()))?;
    let node = rt
        .block_on(async {
            let listener = tokio::net::TcpListener::from_std(listener)
                .map_err(|e| crate::ScError::Io(e.to_string()))?;
            crate::node::start_on(cfg, a.factory.clone(), listener).await
        })
        .map_err(|e| ScProcessError::Io(e.to_string()))?;
    if let (Some(o), None) = (&a.orchestrator, &agent) {
        agent = Some(start_agent(o)?);
    }
    // Tests and scripts wait for this line.
    say(&format!(
        "sc: node {} listening on {}, FM {fm}",
        a.id,
        node.addr()
    ));
    let metrics = a
        .metrics
        .map(|addr| crate::metrics::start(rt.handle(), addr, &node))
        .transpose()
        .map_err(|e| ScProcessError::Io(format!("SC metrics endpoint: {e}")))?;
    let metrics_addr: Option<SocketAddr> = metrics.as_ref().map(|m| m.addr());
    if let Some(ag) = agent.as_mut() {
        ag.set_metrics(metrics_addr);
    }
    let metrics_field = metrics_addr.map(tracing::field::display);
    tracing::info!(node = %a.id, addr = %node.addr(), metrics = metrics_field, "SC running");
    let node = Arc::new(node);
    let (h, n, lines, id) = (
        rt.handle().clone(),
        node.clone(),
        a.lines.clone(),
        a.id.clone(),
    );
    let control = ControlLoop::spawn("sc-control", stop, move |s| {
        control_loop(h, n, s, agent, lines, id)
    })
    .map_err(|e| ScProcessError::Io(e.to_string()))?;
    Ok(Some(ScProcess {
        rt: Some(rt),
        node,
        control,
        metrics,
        lines: a.lines,
    }))
}

impl ScProcess {
    pub fn addr(&self) -> SocketAddr {
        self.node.addr()
    }

    pub fn handle(&self) -> &ScHandle {
        &self.node
    }

    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(|m| m.addr())
    }

    /// Stop: a line per group it served, then `sc: stopped`.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if !self.control.halt() {
            return;
        }
        let Some(rt) = self.rt.take() else {
            return;
        };
        let say = |l: &str| self.lines.say(l);
        for (g, s) in &rt.block_on(self.node.status(false)) {
            say(&format!(
                "sc: group {} epoch {} position {}/{} applied {} requests {}",
                g.group, g.epoch, g.position, g.length, g.applied, s.requests_applied
            ));
        }
        self.metrics.take();
        self.node.stop();
        say("sc: stopped");
        rt.shutdown_timeout(Duration::from_secs(1));
    }
}

impl Drop for ScProcess {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn control_loop(
    rt: tokio::runtime::Handle,
    node: Arc<ScHandle>,
    stop: Arc<AtomicBool>,
    mut agent: Option<NodeAgent>,
    lines: telemetry::Lines,
    id: String,
) {
    let mut next_report = Instant::now();
    let mut rate = telemetry::CounterRates::<1>::default();
    let mut on_fm: Option<String> = None;
    while !stop.load(Ordering::Relaxed) {
        // Tests and operators see from this line which FM the node is on (FM failover).
        let now_fm = node.current_fm();
        if now_fm != on_fm {
            if let Some(f) = &now_fm {
                lines.say(&format!("sc: node {id} on FM {f}"));
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
                ag.set_report(report(&rt, &node, &mut rate));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What an SC node tells the orchestrator: the groups it serves and what it applied.
/// A request is applied by every replica of its group; it counts once, at the tail
/// (where it is committed), so the orchestrator can add up the nodes' counts per tenant.
fn report(
    rt: &tokio::runtime::Handle,
    node: &ScHandle,
    rate: &mut telemetry::CounterRates<1>,
) -> v1::NodeReport {
    let groups = rt.block_on(node.observer().group_metrics());
    let applied: u64 = groups.iter().map(|g| g.stats.requests_applied).sum();
    let mut at_tail: std::collections::BTreeMap<u32, u64> = Default::default();
    for g in groups
        .iter()
        .filter(|g| g.tenant != 0 && g.state.length > 0 && g.state.position + 1 == g.state.length)
    {
        *at_tail.entry(g.tenant).or_default() += g.stats.requests_applied;
    }
    let [requests_per_s] = rate.observe(Instant::now(), [at_tail.values().sum()]);
    let sessions = node.counters().fm_sessions.load(Ordering::Relaxed);
    v1::NodeReport {
        load: Some(v1::Load {
            requests_per_s,
            flows: 0,
            groups: groups.len() as u32,
            ..Default::default()
        }),
        ready: sessions > 0,
        detail: format!("{} groups, {sessions} FM sessions opened", groups.len()),
        tenants: at_tail
            .into_iter()
            .map(|(tenant, n)| v1::TenantCounters {
                tenant,
                flows: n,
                ..Default::default()
            })
            .collect(),
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
