//! A whole FM node, started in-process: the fabric master's gRPC service on a runtime
//! of its own, `/metrics`, the control session with the orchestrator (whose
//! directives replace the configured chains), and a status line. `starfabric fm` is
//! this plus flags.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use proto::agent::{ControlLoop, NodeAgent};
use proto::v1;
use telemetry::MetricsServer;

use crate::{FmConfig, FmError, FmHandle};

/// What an FM node runs with.
#[derive(Clone)]
pub struct FmNodeConfig {
    pub fm: FmConfig,
    /// Address to serve gRPC on.
    pub listen: SocketAddr,
    /// Register with this orchestrator and serve the chains it directs.
    pub orchestrator: Option<String>,
    /// Address PP and SC nodes reach this FM at (default: the bound address).
    pub advertise: Option<String>,
    /// Serve `/metrics` here.
    pub metrics: Option<SocketAddr>,
    /// A status line every this often.
    pub stats_interval: Option<Duration>,
    pub lines: telemetry::Lines,
    /// The runtime's worker threads (at least one).
    pub threads: usize,
}

/// A running FM node.
pub struct FmNode {
    rt: Option<tokio::runtime::Runtime>,
    fm: Arc<FmHandle>,
    control: ControlLoop,
    metrics: Option<MetricsServer>,
    lines: telemetry::Lines,
    started: Instant,
}

/// Start an FM node: serving once this returns.
pub fn start(cfg: FmNodeConfig) -> Result<FmNode, FmError> {
    let say = |l: &str| cfg.lines.say(l);
    let nchains = cfg.fm.chains.len();
    let id = cfg.fm.fm_id.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.threads.max(1))
        .enable_all()
        .build()
        .map_err(|e| FmError::Io(e.to_string()))?;
    let tls = cfg.fm.tls.clone();
    let fm = Arc::new(rt.block_on(crate::start(cfg.fm, cfg.listen))?);
    let advertise = cfg
        .advertise
        .clone()
        .unwrap_or_else(|| fm.addr().to_string());
    let mut agent = match &cfg.orchestrator {
        Some(o) => Some(
            NodeAgent::start(o, &id, v1::Role::Fm, &advertise, "", None, None, tls)
                .map_err(|e| FmError::Io(e.to_string()))?,
        ),
        None => None,
    };
    // Tests and scripts wait for this line.
    say(&format!("fm: listening on {}, {nchains} chains", fm.addr()));
    let metrics = cfg
        .metrics
        .map(|addr| crate::metrics::start(rt.handle(), addr, &fm))
        .transpose()
        .map_err(|e| FmError::Io(format!("FM metrics endpoint: {e}")))?;
    let metrics_addr: Option<SocketAddr> = metrics.as_ref().map(|m| m.addr());
    if let Some(ag) = agent.as_mut() {
        ag.set_metrics(metrics_addr);
    }
    let metrics_field = metrics_addr.map(tracing::field::display);
    tracing::info!(addr = %fm.addr(), chains = nchains, metrics = metrics_field, "FM running");
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let (h, f, lines) = (rt.handle().clone(), fm.clone(), cfg.lines.clone());
    let interval = cfg.stats_interval;
    let control = ControlLoop::spawn("fm-control", stop, move |s| {
        control_loop(h, f, s, agent, nchains, interval, lines, started)
    })
    .map_err(|e| FmError::Io(e.to_string()))?;
    Ok(FmNode {
        rt: Some(rt),
        fm,
        control,
        metrics,
        lines: cfg.lines,
        started,
    })
}

impl FmNode {
    pub fn addr(&self) -> SocketAddr {
        self.fm.addr()
    }

    pub fn handle(&self) -> &FmHandle {
        &self.fm
    }

    /// The runtime FM serves on, for callers that ask the [`FmHandle`] things.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        self.rt.as_ref().expect("runtime lives until drop").handle()
    }

    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(|m| m.addr())
    }

    /// Stop serving: a last status line, then `fm: stopped`.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if !self.control.halt() {
            return;
        }
        let say = |l: &str| self.lines.say(l);
        if let Some(line) = status_line(self.runtime(), &self.fm, self.started) {
            say(&line);
        }
        self.metrics.take();
        self.fm.stop();
        say("fm: stopped");
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
    }
}

impl Drop for FmNode {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[allow(clippy::too_many_arguments)]
fn control_loop(
    rt: tokio::runtime::Handle,
    fm: Arc<FmHandle>,
    stop: Arc<AtomicBool>,
    mut agent: Option<NodeAgent>,
    nchains: usize,
    interval: Option<Duration>,
    lines: telemetry::Lines,
    started: Instant,
) {
    let mut next = interval.map(|i| started + i);
    let mut next_report = started;
    let mut desired_chains = nchains;
    while !stop.load(Ordering::Relaxed) {
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
        if let (Some(t), Some(i)) = (next, interval) {
            if Instant::now() >= t {
                if let Some(line) = status_line(&rt, &fm, started) {
                    lines.say(&line);
                }
                next = Some(t + i);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What FM tells the orchestrator: its partition map and membership, whether every
/// desired chain has its SC groups, and its counters.
fn report(rt: &tokio::runtime::Handle, fm: &FmHandle, chains: usize) -> Option<v1::NodeReport> {
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
        ("bad_sc_replies", s.bad_sc_replies),
        ("timeouts", s.timeouts),
        ("reconfigurations", s.reconfigurations),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    Some(v1::NodeReport {
        load: Some(v1::Load {
            requests_per_s: 0.0,
            flows: s.cache.inserts.saturating_sub(
                s.cache.evicted_full + s.cache.expired + s.cache.invalidated + s.cache.unreadable,
            ),
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

fn status_line(rt: &tokio::runtime::Handle, fm: &FmHandle, start: Instant) -> Option<String> {
    let (Some(s), Some(m), Some(map), metrics) = rt.block_on(async {
        (
            fm.stats().await,
            fm.members().await,
            fm.partition_map().await,
            fm.metrics().await,
        )
    }) else {
        return None;
    };
    let alive = |role: proto::v1::Role| {
        m.members
            .iter()
            .filter(|x| x.alive && x.node.as_ref().is_some_and(|n| n.role == role as i32))
            .count()
    };
    // The fabric (docs/fabric.md): its counters, and its routes per serving PP node
    // (`fabric@pp-1=12`), only when there are any.
    let mut fabric = String::new();
    if s.fabric != Default::default() {
        let f = s.fabric;
        fabric = format!(
            " fabric_routes={} fabric_forwarded={} fabric_local={} fabric_withdrawn={} fabric_no_node={} \
             fabric_first_packets_forwarded={} fabric_first_dropped={}",
            f.routes,
            f.forwarded,
            f.local,
            f.withdrawn,
            f.no_node,
            f.first_forwarded,
            f.first_dropped.total()
        );
        // Each reason only once it has happened.
        for (r, n) in f.first_dropped.by_reason() {
            if n > 0 {
                fabric.push_str(&format!(" fabric_first_dropped:{r}={n}"));
            }
        }
        for (node, n) in metrics.map(|m| m.fabric_routes).unwrap_or_default() {
            fabric.push_str(&format!(" fabric@{node}={n}"));
        }
    }
    Some(
        format!(
            "fm: t={:.1}s pp={} sc={} groups={} requests={} cache_hits={} submitted={} \
         sc_replies={} timeouts={} reconfigurations={} bad_messages={} nodes_dead={} \
         scale_outs={} scale_ins={} scale_aborts={} scale_redirects={} scale_last_us={} \
         vip_moves={} cache_misses={} adopted={} scale_pulls={} scale_migrating={}",
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
            s.scale_pulls,
            s.scale_migrating,
        ) + &fabric,
    )
}
