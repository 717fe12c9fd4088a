//! The `/metrics` endpoint of each node kind, in one place: what each node exports,
//! from which snapshot, and how the endpoint starts.
//!
//! - PP: the worker thread owns the pipeline, so it publishes a [`PpSnapshot`] into a
//!   mutex every [`PP_PUBLISH_EVERY`] ([`PpMetrics::tick`] from its loop); scrapes
//!   render the latest one. No lock is taken per packet, and a scrape never waits for
//!   the worker.
//! - FM and SC: their state lives in tasks that answer queries, so each scrape first
//!   asks them (the exporter's scrape hook) and renders what came back.
//!
//! Each node prints `metrics: listening on http://ADDR/metrics` once its endpoint is up.
//! Names: `starfabric_pp_*`, `starfabric_fm_*`, `starfabric_sc_*`; the Grafana
//! dashboard in `deploy/grafana/` reads them, and a test checks it names no other.

use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use pipeline::{DropReason, LatencyHistogram, Pipeline, Stats, TenantCounters, Worker};
use pp::{AfXdpStats, FmClientStats, UdpVxlanStats};

use crate::pp_io::{IoStats, PpIo};
use telemetry::{collector, Exporter, MetricsServer, Scrape};

/// How often the PP worker publishes its counters for scrapes.
pub const PP_PUBLISH_EVERY: Duration = Duration::from_millis(100);

fn announce(srv: &MetricsServer) -> Result<()> {
    // Tests and `starfabric up` parse this line.
    println!("metrics: listening on {}", srv.url());
    std::io::stdout().flush()?;
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn histogram(s: &mut Scrape<'_>, name: &str, help: &str, h: &LatencyHistogram) -> std::fmt::Result {
    s.histogram_seconds(name, help, h.sum_seconds(), h.count, &h.buckets_seconds())
}

fn tenant_label(t: u32) -> [(&'static str, String); 1] {
    [("tenant", t.to_string())]
}

// ------------------------------------------------------------------------------- PP

/// What the PP worker publishes.
#[derive(Debug, Clone, Default)]
pub struct PpSnapshot {
    pub stats: Stats,
    /// Every drop reason by its `Pipeline::drop_name`: the fixed ones, then the rule
    /// reasons the worker knows.
    pub drops: Vec<(String, u64)>,
    pub tenants: Vec<(u32, TenantCounters)>,
    pub flow_entries: usize,
    pub flow_capacity: usize,
    pub pending_packets: usize,
    pub pending_flows: usize,
    pub io: Option<UdpVxlanStats>,
    /// The AF_XDP backend's counters, when the node runs on it.
    pub afxdp: Option<AfXdpStats>,
}

impl PpSnapshot {
    pub fn of(p: &Pipeline, io: Option<UdpVxlanStats>) -> Self {
        let s = p.stats();
        let mut drops: Vec<(String, u64)> = DropReason::FIXED
            .iter()
            .map(|&r| (p.drop_name(r), s.dropped(r)))
            .collect();
        drops.extend((0..p.rules().reasons().len()).map(|i| {
            let r = DropReason::Rule(i as u8);
            (p.drop_name(r), s.dropped(r))
        }));
        PpSnapshot {
            stats: s.clone(),
            drops,
            tenants: p.tenants().map(|(t, c)| (t, *c)).collect(),
            flow_entries: p.table().len(),
            flow_capacity: p.table().capacity(),
            pending_packets: p.pending().held(),
            pending_flows: p.pending().flows(),
            io,
            afxdp: None,
        }
    }
}

/// The PP exporter over a published snapshot and, with `--fm`, the FM client's counters.
pub fn pp_exporter(snap: Arc<Mutex<PpSnapshot>>, fm: Option<Arc<FmClientStats>>) -> Exporter {
    Exporter::new("starfabric_pp").collector(collector(move |sc| {
        let p = lock(&snap).clone();
        pp_encode(sc, &p, fm.as_deref())
    }))
}

fn pp_encode(sc: &mut Scrape<'_>, p: &PpSnapshot, fm: Option<&FmClientStats>) -> std::fmt::Result {
    let s = &p.stats;
    sc.counter("rx_packets", "Packets received.", s.rx_packets)?;
    sc.counter("rx_bytes", "Bytes received.", s.rx_bytes)?;
    sc.counter("tx_packets", "Packets sent.", s.tx_packets)?;
    sc.counter("tx_bytes", "Bytes sent.", s.tx_bytes)?;
    sc.counter("hits", "Flow table hits.", s.hits)?;
    sc.counter("misses", "Flow table misses.", s.misses)?;
    sc.counter_family(
        "drops",
        "Packets dropped, by reason.",
        p.drops.iter().map(|(r, n)| ([("reason", r.as_str())], *n)),
    )?;
    sc.gauge(
        "flow_table_entries",
        "Rules in the flow table.",
        p.flow_entries as u64,
    )?;
    sc.gauge(
        "flow_table_capacity",
        "Flow table capacity.",
        p.flow_capacity as u64,
    )?;
    sc.counter(
        "flow_table_evictions",
        "Rules evicted to make room.",
        s.evicted_table_full,
    )?;
    sc.counter("flow_table_expired", "Rules expired idle.", s.expired)?;
    sc.gauge(
        "pending_packets",
        "Packets held for a rule.",
        p.pending_packets as u64,
    )?;
    sc.gauge(
        "pending_flows",
        "Flows waiting for a rule.",
        p.pending_flows as u64,
    )?;
    sc.counter(
        "rule_requests",
        "Rule requests sent toward FM.",
        s.rule_requests,
    )?;
    sc.counter(
        "rule_request_channel_full",
        "Rule requests that found the request channel full (retried).",
        s.request_channel_full,
    )?;
    sc.counter("rules_installed", "Rules installed.", s.rules_installed)?;
    sc.counter("rules_replaced", "Rules replaced.", s.rules_replaced)?;
    sc.counter(
        "rule_compile_errors",
        "Rules that did not compile.",
        s.rule_compile_errors,
    )?;
    sc.counter(
        "pending_released",
        "Held packets released after their rule arrived.",
        s.pending_released,
    )?;
    sc.counter(
        "offload_marked",
        "Rules marked for offload.",
        s.offload_marked,
    )?;
    sc.counter(
        "rules_revoked",
        "Installed rules removed because FM withdrew them.",
        s.rules_revoked,
    )?;
    sc.counter(
        "elephants",
        "Flows that crossed the elephant threshold (handed to the XDP fast path).",
        s.elephants,
    )?;
    sc.counter(
        "fastpath_packets",
        "Packets the XDP fast path forwarded for this node's flows (folded back).",
        s.fastpath_packets,
    )?;
    sc.counter(
        "fastpath_bytes",
        "Bytes the XDP fast path forwarded for this node's flows (folded back).",
        s.fastpath_bytes,
    )?;
    histogram(
        sc,
        "rule_setup",
        "From a flow's first packet held to its rule installed.",
        &s.setup_latency,
    )?;
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let (replies, sent, batches, bad, stray, sessions, errors, resent, up) = match fm {
        Some(f) => (
            load(&f.replies),
            load(&f.requests_sent),
            load(&f.batches_sent),
            load(&f.bad_replies),
            load(&f.stray_replies),
            load(&f.sessions),
            load(&f.session_errors),
            load(&f.resent),
            u64::from(f.connected.load(Ordering::Relaxed)),
        ),
        None => Default::default(),
    };
    sc.counter("rule_replies", "Rule replies received from FM.", replies)?;
    sc.counter("fm_requests_sent", "Rule requests sent to FM.", sent)?;
    sc.counter("fm_batches_sent", "Request batches sent to FM.", batches)?;
    sc.counter("fm_bad_replies", "FM replies that did not decode.", bad)?;
    sc.counter(
        "fm_stray_replies",
        "FM replies for no outstanding request.",
        stray,
    )?;
    sc.counter("fm_sessions", "FM sessions opened.", sessions)?;
    sc.counter(
        "fm_session_errors",
        "FM sessions that failed or broke.",
        errors,
    )?;
    sc.counter("fm_resent", "Requests resent on a new FM session.", resent)?;
    sc.gauge("fm_connected", "1 while the FM session is up.", up)?;
    let t = &p.tenants;
    sc.counter_family(
        "tenant_packets",
        "Packets received, by tenant.",
        t.iter().map(|(id, c)| (tenant_label(*id), c.packets)),
    )?;
    sc.counter_family(
        "tenant_bytes",
        "Bytes received, by tenant.",
        t.iter().map(|(id, c)| (tenant_label(*id), c.bytes)),
    )?;
    sc.counter_family(
        "tenant_drops",
        "Packets dropped, by tenant.",
        t.iter().map(|(id, c)| (tenant_label(*id), c.drops)),
    )?;
    sc.counter_family(
        "tenant_flows_setup",
        "Flows set up through the miss path, by tenant.",
        t.iter().map(|(id, c)| (tenant_label(*id), c.flows_setup)),
    )?;
    if let Some(io) = &p.io {
        sc.counter(
            "io_rx_batches",
            "recvmmsg calls that returned datagrams.",
            io.rx_batches,
        )?;
        sc.counter(
            "io_rx_oversize",
            "Datagrams too long, dropped.",
            io.rx_oversize,
        )?;
        sc.counter(
            "io_tx_dropped",
            "Sends the kernel pushed back.",
            io.tx_dropped,
        )?;
        sc.counter("io_tx_errors", "Sends that failed.", io.tx_errors)?;
        sc.counter(
            "io_tx_unsendable",
            "Frames that could not be sent.",
            io.tx_unsendable,
        )?;
    }
    if let Some(x) = &p.afxdp {
        sc.counter(
            "afxdp_rx_batches",
            "AF_XDP receive calls that returned frames.",
            x.rx_batches,
        )?;
        sc.counter(
            "afxdp_tx_ring_full",
            "Frames dropped: the AF_XDP TX ring was full.",
            x.tx_ring_full,
        )?;
        sc.counter(
            "afxdp_tx_no_frame",
            "Released frames dropped: no free UMEM frame.",
            x.tx_no_frame,
        )?;
        sc.counter(
            "afxdp_tx_oversize",
            "Frames dropped: too large for a UMEM frame.",
            x.tx_oversize,
        )?;
        sc.counter(
            "afxdp_tx_completed",
            "Frames the kernel finished sending.",
            x.tx_completed,
        )?;
        sc.counter("afxdp_tx_kicks", "sendto kicks of the TX ring.", x.tx_kicks)?;
    }
    Ok(())
}

/// A PP node's endpoint and the snapshot its worker publishes.
pub struct PpMetrics {
    server: MetricsServer,
    snap: Arc<Mutex<PpSnapshot>>,
    next: Instant,
}

impl PpMetrics {
    /// Serve on `addr` (its own thread: the PP worker has no runtime) and announce it.
    pub fn start(addr: SocketAddr, fm: Option<Arc<FmClientStats>>) -> Result<Self> {
        let snap = Arc::new(Mutex::new(PpSnapshot::default()));
        let server = MetricsServer::spawn_thread(addr, pp_exporter(snap.clone(), fm))?;
        announce(&server)?;
        Ok(PpMetrics {
            server,
            snap,
            next: Instant::now(),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.server.addr()
    }

    /// From the worker loop: publish a snapshot when the last one is old enough.
    pub fn tick(&mut self, w: &Worker<PpIo>, now: Instant) {
        if now < self.next {
            return;
        }
        self.next = now + PP_PUBLISH_EVERY;
        self.publish(w);
    }

    /// Publish now (built outside the lock; the lock only swaps it in).
    pub fn publish(&self, w: &Worker<PpIo>) {
        let s = match w.io.stats() {
            IoStats::Udp(u) => PpSnapshot::of(&w.pipeline, Some(u)),
            IoStats::AfXdp(x, _) => PpSnapshot {
                afxdp: Some(x),
                ..PpSnapshot::of(&w.pipeline, None)
            },
        };
        *lock(&self.snap) = s;
    }
}

// ------------------------------------------------------------------------------- FM

/// What a scrape asks the FM master task for.
#[derive(Debug, Clone, Default)]
pub struct FmSnapshot {
    pub stats: fm::FmStats,
    pub metrics: fm::FmMetrics,
    pub live_pp: usize,
    pub live_sc: usize,
    pub groups: usize,
    pub bad_messages: u64,
    pub sessions: u64,
}

impl FmSnapshot {
    async fn fetch(o: &fm::FmObserver) -> Option<Self> {
        let stats = o.stats().await?;
        let metrics = o.metrics().await?;
        let members = o.members().await?;
        let map = o.partition_map().await?;
        let alive = |role: proto::v1::Role| {
            members
                .members
                .iter()
                .filter(|x| x.alive && x.node.as_ref().is_some_and(|n| n.role == role as i32))
                .count()
        };
        Some(FmSnapshot {
            stats,
            metrics,
            live_pp: alive(proto::v1::Role::Pp),
            live_sc: alive(proto::v1::Role::Sc),
            groups: map.groups.len(),
            bad_messages: o.wire_counters().bad_messages.load(Ordering::Relaxed),
            sessions: o.wire_counters().sessions.load(Ordering::Relaxed),
        })
    }
}

pub fn fm_exporter(snap: Arc<Mutex<FmSnapshot>>) -> Exporter {
    Exporter::new("starfabric_fm").collector(collector(move |sc| {
        let f = lock(&snap).clone();
        fm_encode(sc, &f)
    }))
}

fn fm_encode(sc: &mut Scrape<'_>, f: &FmSnapshot) -> std::fmt::Result {
    let s = &f.stats;
    sc.counter("requests", "Rule requests from PP nodes.", s.pp_requests)?;
    sc.counter_family(
        "tenant_requests",
        "Rule requests from PP nodes, by tenant.",
        f.metrics
            .tenant_requests
            .iter()
            .map(|(t, n)| (tenant_label(*t), *n)),
    )?;
    sc.counter(
        "cache_hits",
        "Requests answered from the rule cache.",
        s.cache.hits,
    )?;
    sc.counter(
        "cache_misses",
        "Requests the rule cache could not answer.",
        s.cache.misses,
    )?;
    sc.counter("cache_inserts", "Rules cached.", s.cache.inserts)?;
    sc.counter(
        "cache_evicted",
        "Rules evicted from a full cache.",
        s.cache.evicted_full,
    )?;
    sc.counter(
        "cache_expired",
        "Cached rules expired idle.",
        s.cache.expired,
    )?;
    sc.counter(
        "cache_invalidated",
        "Cached rules dropped because SC dropped the flow.",
        s.cache.invalidated,
    )?;
    sc.gauge(
        "cache_entries",
        "Rules in the cache.",
        f.metrics.cache_entries as u64,
    )?;
    sc.gauge(
        "inflight",
        "Requests waiting for SC.",
        f.metrics.inflight as u64,
    )?;
    sc.counter(
        "submitted",
        "Requests submitted to SC group heads.",
        s.submitted,
    )?;
    sc.counter("submits", "Submit messages sent to SC.", s.submits)?;
    sc.counter(
        "retries",
        "Requests submitted again (retry or repair).",
        s.resubmitted,
    )?;
    sc.counter("sc_replies", "Answers from SC group tails.", s.sc_replies)?;
    sc.counter(
        "duplicate_replies",
        "SC answers for requests no longer in flight.",
        s.duplicate_replies,
    )?;
    sc.counter("replies", "Replies sent to PP nodes.", s.replies_to_pp)?;
    sc.counter("timeouts", "Requests that ran out of attempts.", s.timeouts)?;
    sc.counter(
        "coalesced",
        "Requests joined to an identical one in flight.",
        s.coalesced,
    )?;
    sc.counter(
        "bad_requests",
        "Requests or events that did not decode.",
        s.bad_requests,
    )?;
    sc.counter(
        "no_group",
        "Requests for a partition with no SC group.",
        s.no_group,
    )?;
    sc.counter(
        "reconfigurations",
        "SC group repairs and refills.",
        s.reconfigurations,
    )?;
    sc.counter("nodes_dead", "Nodes declared dead.", s.nodes_dead)?;
    sc.gauge_family(
        "live_nodes",
        "Live registered nodes, by role.",
        [
            ([("role", "pp")], f.live_pp as u64),
            ([("role", "sc")], f.live_sc as u64),
        ],
    )?;
    sc.gauge(
        "sc_groups",
        "SC groups in the partition map.",
        f.groups as u64,
    )?;
    sc.counter(
        "bad_messages",
        "Session messages that did not decode.",
        f.bad_messages,
    )?;
    sc.counter("sessions", "Node sessions opened.", f.sessions)?;
    histogram(
        sc,
        "request",
        "From a PP request reaching the master task to its reply leaving it.",
        &f.metrics.request_latency,
    )
}

/// Serve FM metrics on its runtime; each scrape asks the master task first.
pub fn fm_start(
    rt: &tokio::runtime::Runtime,
    addr: SocketAddr,
    fm: &fm::FmHandle,
) -> Result<MetricsServer> {
    let snap = Arc::new(Mutex::new(FmSnapshot::default()));
    let obs = fm.observer();
    let s = snap.clone();
    let exporter = fm_exporter(snap).on_scrape(move || {
        let (obs, s) = (obs.clone(), s.clone());
        async move {
            if let Some(f) = FmSnapshot::fetch(&obs).await {
                *lock(&s) = f;
            }
        }
    });
    let _guard = rt.enter();
    let server = MetricsServer::spawn(addr, exporter).context("FM metrics endpoint")?;
    announce(&server)?;
    Ok(server)
}

// ------------------------------------------------------------------------------- SC

/// What a scrape asks the SC node's replicas for.
#[derive(Debug, Clone, Default)]
pub struct ScSnapshot {
    pub groups: Vec<sc::GroupMetrics>,
    pub head_requests: u64,
    pub bad_messages: u64,
    pub unknown_group: u64,
    pub fm_sessions: u64,
    pub successor_links: u64,
}

impl ScSnapshot {
    async fn fetch(o: &sc::ScObserver) -> Self {
        let c = o.counters();
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        ScSnapshot {
            groups: o.group_metrics().await,
            head_requests: o.head_requests(),
            bad_messages: load(&c.bad_messages),
            unknown_group: load(&c.unknown_group),
            fm_sessions: load(&c.fm_sessions),
            successor_links: load(&c.successor_links),
        }
    }
}

fn role(st: &proto::v1::GroupState) -> &'static str {
    match st.position {
        u32::MAX => "none",
        0 => "head",
        p if p + 1 == st.length => "tail",
        _ => "middle",
    }
}

pub fn sc_exporter(snap: Arc<Mutex<ScSnapshot>>) -> Exporter {
    Exporter::new("starfabric_sc").collector(collector(move |sc| {
        let s = lock(&snap).clone();
        sc_encode(sc, &s)
    }))
}

fn sc_encode(sc: &mut Scrape<'_>, s: &ScSnapshot) -> std::fmt::Result {
    let g = &s.groups;
    let group = |m: &sc::GroupMetrics| [("group", m.state.group.to_string())];
    let group_pos = |m: &sc::GroupMetrics| {
        [
            ("group", m.state.group.to_string()),
            (
                "position",
                match m.state.position {
                    u32::MAX => "none".to_string(),
                    p => p.to_string(),
                },
            ),
        ]
    };
    sc.gauge("groups", "Replicas hosted.", g.len() as u64)?;
    sc.counter_family(
        "group_ops_applied",
        "Ops applied by this replica, by group.",
        g.iter().map(|m| (group_pos(m), m.stats.ops_applied)),
    )?;
    sc.counter_family(
        "group_requests_applied",
        "Rule requests applied by this replica, by group.",
        g.iter().map(|m| (group_pos(m), m.stats.requests_applied)),
    )?;
    sc.gauge_family(
        "unacked_ops",
        "Ops applied but not yet acknowledged by the tail, by group.",
        g.iter().map(|m| (group_pos(m), m.state.unacked)),
    )?;
    sc.gauge_family(
        "replica_role",
        "1 for this replica's role in its group's chain.",
        g.iter().map(|m| {
            (
                [
                    ("group", m.state.group.to_string()),
                    ("role", role(&m.state).to_string()),
                ],
                1u64,
            )
        }),
    )?;
    sc.gauge_family(
        "group_epoch",
        "Configuration epoch, by group.",
        g.iter().map(|m| (group(m), m.state.epoch)),
    )?;
    sc.counter_family(
        "group_repairs",
        "Newer configurations received after the first (repairs, refills), by group.",
        g.iter().map(|m| (group(m), m.stats.reconfigurations)),
    )?;
    sc.counter_family(
        "snapshots_sent",
        "State snapshots sent to a new successor, by group.",
        g.iter().map(|m| (group(m), m.stats.snapshots_sent)),
    )?;
    sc.counter_family(
        "snapshots_restored",
        "State snapshots restored from a predecessor, by group.",
        g.iter().map(|m| (group(m), m.stats.snapshots_restored)),
    )?;
    sc.counter_family(
        "resent_ops",
        "Ops resent to a successor after a repair, by group.",
        g.iter().map(|m| (group(m), m.stats.resent_ops)),
    )?;
    sc.counter_family(
        "duplicate_ops",
        "Ops received twice, by group.",
        g.iter().map(|m| (group(m), m.stats.duplicate_ops)),
    )?;
    // Per tenant: every group's partition names its tenant; a tenant with several
    // groups on this node is summed.
    let mut tenants: Vec<(u32, u64)> = Vec::new();
    for m in g {
        match tenants.iter_mut().find(|(t, _)| *t == m.tenant) {
            Some((_, n)) => *n += m.stats.requests_applied,
            None => tenants.push((m.tenant, m.stats.requests_applied)),
        }
    }
    tenants.sort_unstable();
    sc.counter_family(
        "requests_applied",
        "Rule requests applied by this node's replicas, by tenant.",
        tenants.into_iter().map(|(t, n)| (tenant_label(t), n)),
    )?;
    sc.counter(
        "head_requests",
        "Requests accepted as a group head.",
        s.head_requests,
    )?;
    sc.counter(
        "bad_messages",
        "Peer messages that did not decode.",
        s.bad_messages,
    )?;
    sc.counter(
        "unknown_group",
        "Submits for groups not hosted here.",
        s.unknown_group,
    )?;
    sc.counter("fm_sessions", "FM sessions opened.", s.fm_sessions)?;
    sc.counter(
        "successor_links",
        "Successor links opened.",
        s.successor_links,
    )
}

/// Serve SC metrics on its runtime; each scrape asks the replicas first.
pub fn sc_start(
    rt: &tokio::runtime::Runtime,
    addr: SocketAddr,
    node: &sc::ScHandle,
) -> Result<MetricsServer> {
    let snap = Arc::new(Mutex::new(ScSnapshot::default()));
    let obs = node.observer();
    let s = snap.clone();
    let exporter = sc_exporter(snap).on_scrape(move || {
        let (obs, s) = (obs.clone(), s.clone());
        async move {
            let f = ScSnapshot::fetch(&obs).await;
            *lock(&s) = f;
        }
    });
    let _guard = rt.enter();
    let server = MetricsServer::spawn(addr, exporter).context("SC metrics endpoint")?;
    announce(&server)?;
    Ok(server)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipeline::{NodeAddr, PipelineConfig, RuleSource, VpcBinding};
    use telemetry::scrape;

    fn pipeline() -> Pipeline {
        let node = NodeAddr {
            ip: "198.18.0.1".parse().unwrap(),
            mac: [2, 0, 0, 0, 0, 1],
            gw_mac: [2, 0, 0, 0, 0, 2],
        };
        let mut cfg = PipelineConfig::new(node);
        cfg.flow_capacity = 1024;
        let mut p = Pipeline::new(cfg, RuleSource::None).unwrap();
        p.bind_vpc(
            100,
            VpcBinding {
                tenant: 7,
                chain: 1,
            },
        );
        p
    }

    /// Expositions of all three node kinds from populated snapshots.
    fn expositions() -> Vec<Vec<scrape::Sample>> {
        let mut snap = PpSnapshot::of(&pipeline(), Some(UdpVxlanStats::default()));
        snap.stats.setup_latency.observe_us(3_000);
        snap.stats.misses = 4;
        let pp = pp_exporter(Arc::new(Mutex::new(snap)), None);

        let mut f = FmSnapshot {
            live_pp: 1,
            live_sc: 3,
            groups: 1,
            ..FmSnapshot::default()
        };
        f.stats.pp_requests = 5;
        f.metrics.tenant_requests = vec![(7, 5)];
        f.metrics.request_latency.observe_us(800);
        let fm = fm_exporter(Arc::new(Mutex::new(f)));

        let g = sc::GroupMetrics {
            state: proto::v1::GroupState {
                group: 3,
                epoch: 2,
                position: 2,
                length: 3,
                ..Default::default()
            },
            stats: sc::ReplicaStats {
                requests_applied: 9,
                ..Default::default()
            },
            tenant: 7,
            chain: 1,
        };
        let sc = sc_exporter(Arc::new(Mutex::new(ScSnapshot {
            groups: vec![g.clone(), g],
            ..ScSnapshot::default()
        })));
        [pp, fm, sc]
            .iter()
            .map(|e| scrape::parse(&e.encode().unwrap()))
            .collect()
    }

    #[test]
    fn snapshots_render_the_named_series() {
        let all = expositions();
        let (pp, fm, sc) = (&all[0], &all[1], &all[2]);
        let v = |s: &[scrape::Sample], n: &str, l: &[(&str, &str)]| scrape::value(s, n, l);
        assert_eq!(v(pp, "starfabric_pp_misses_total", &[]), Some(4.0));
        for r in DropReason::FIXED {
            assert_eq!(
                v(pp, "starfabric_pp_drops_total", &[("reason", r.name())]),
                Some(0.0),
                "{r:?}"
            );
        }
        assert_eq!(
            v(pp, "starfabric_pp_tenant_packets_total", &[("tenant", "7")]),
            Some(0.0)
        );
        assert_eq!(
            v(pp, "starfabric_pp_flow_table_capacity", &[]),
            Some(1024.0)
        );
        assert_eq!(
            v(
                pp,
                "starfabric_pp_rule_setup_seconds_bucket",
                &[("le", "0.0025")]
            ),
            Some(0.0)
        );
        assert_eq!(
            v(
                pp,
                "starfabric_pp_rule_setup_seconds_bucket",
                &[("le", "0.005")]
            ),
            Some(1.0)
        );
        assert_eq!(v(pp, "starfabric_pp_fm_connected", &[]), Some(0.0));
        assert_eq!(
            v(
                fm,
                "starfabric_fm_tenant_requests_total",
                &[("tenant", "7")]
            ),
            Some(5.0)
        );
        assert_eq!(
            v(fm, "starfabric_fm_live_nodes", &[("role", "sc")]),
            Some(3.0)
        );
        assert_eq!(v(fm, "starfabric_fm_request_seconds_count", &[]), Some(1.0));
        assert_eq!(
            v(
                sc,
                "starfabric_sc_replica_role",
                &[("group", "3"), ("role", "tail")]
            ),
            Some(1.0)
        );
        assert_eq!(
            v(
                sc,
                "starfabric_sc_group_requests_applied_total",
                &[("position", "2")]
            ),
            Some(9.0)
        );
        // Two groups of tenant 7 on this node are summed.
        assert_eq!(
            v(
                sc,
                "starfabric_sc_requests_applied_total",
                &[("tenant", "7")]
            ),
            Some(18.0)
        );
    }

    /// Every metric a dashboard expression names is a series some node exports.
    #[test]
    fn dashboard_queries_only_exported_metrics() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../deploy/grafana/starfabric.json"
        );
        let d: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert!(d["schemaVersion"].as_u64().unwrap() >= 36);
        assert_eq!(d["__inputs"][0]["name"], "DS_PROMETHEUS");
        let have: std::collections::BTreeSet<String> = expositions()
            .into_iter()
            .flatten()
            .map(|s| s.name)
            .collect();
        let mut exprs = 0;
        for p in d["panels"].as_array().unwrap() {
            assert_eq!(p["datasource"]["uid"], "${DS_PROMETHEUS}", "{}", p["title"]);
            let targets = p["targets"].as_array().unwrap();
            assert!(!targets.is_empty(), "{}", p["title"]);
            for t in targets {
                let expr = t["expr"].as_str().unwrap();
                exprs += 1;
                let names: Vec<&str> = expr
                    .match_indices("starfabric_")
                    .map(|(i, _)| {
                        let tail = &expr[i..];
                        let end = tail
                            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                            .unwrap_or(tail.len());
                        &tail[..end]
                    })
                    .collect();
                assert!(!names.is_empty(), "{expr}");
                for n in names {
                    assert!(have.contains(n), "{expr}: {n} is not exported");
                }
            }
        }
        assert!(exprs >= 16);
    }
}
