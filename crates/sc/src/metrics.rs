//! The SC node's `/metrics`: its replicas live in tasks, so each scrape first asks them
//! (the exporter's scrape hook) and renders what came back. Names: `starfabric_sc_*`.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use telemetry::{collector, lock, tenant_label, Exporter, MetricsServer, Scrape};

/// What a scrape asks the SC node's replicas for.
#[derive(Debug, Clone, Default)]
pub struct ScSnapshot {
    pub groups: Vec<crate::GroupMetrics>,
    pub head_requests: u64,
    pub bad_messages: u64,
    pub unknown_group: u64,
    pub fm_sessions: u64,
    pub successor_links: u64,
    pub workers: crate::WorkerStats,
}

impl ScSnapshot {
    pub async fn fetch(o: &crate::ScObserver) -> Self {
        let c = o.counters();
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        ScSnapshot {
            groups: o.group_metrics().await,
            head_requests: o.head_requests(),
            bad_messages: load(&c.bad_messages),
            unknown_group: load(&c.unknown_group),
            fm_sessions: load(&c.fm_sessions),
            successor_links: load(&c.successor_links),
            workers: o.worker_stats(),
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
    let group = |m: &crate::GroupMetrics| [("group", m.state.group.to_string())];
    let group_pos = |m: &crate::GroupMetrics| {
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
    sc.counter_family(
        "group_mirror_sent",
        "Writes to mirrored NF tables made here, for the chain's other partitions, by group.",
        g.iter().map(|m| (group_pos(m), m.stats.mirror_sent)),
    )?;
    sc.counter_family(
        "group_mirror_imported",
        "Other partitions' mirrored writes applied here, by group.",
        g.iter().map(|m| (group_pos(m), m.stats.mirror_imported)),
    )?;
    sc.counter_family(
        "group_mirror_skipped",
        "Other partitions' mirrored writes skipped (no such NF or mirrored table, table full), by group.",
        g.iter().map(|m| (group_pos(m), m.stats.mirror_skipped)),
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
    workers_encode(sc, s)?;
    sc.counter(
        "successor_links",
        "Successor links opened.",
        s.successor_links,
    )
}

/// Serve SC metrics on its runtime; each scrape asks the replicas first.
pub fn start(
    rt: &tokio::runtime::Handle,
    addr: SocketAddr,
    node: &crate::ScHandle,
) -> Result<MetricsServer, telemetry::TelemetryError> {
    let obs = node.observer();
    telemetry::serve_fetched(rt, addr, sc_exporter, move || {
        let obs = obs.clone();
        async move { Some(ScSnapshot::fetch(&obs).await) }
    })
}

/// The worker pool and the state manager (docs/workers.md).
fn workers_encode(sc: &mut Scrape<'_>, s: &ScSnapshot) -> std::fmt::Result {
    let w = &s.workers;
    sc.gauge("workers", "Pre-started worker threads.", w.workers as u64)?;
    sc.gauge(
        "workers_busy",
        "Workers running at least one replica.",
        w.busy as u64,
    )?;
    sc.gauge(
        "replicas_parked",
        "Replicas parked in the state manager (scaled to zero).",
        w.parked as u64,
    )?;
    // Per chain: running (not parked) replicas, the chain's busy workers on this node.
    let mut chains: Vec<((u32, u32), u64)> = Vec::new();
    for m in &s.groups {
        let k = (m.tenant, m.chain);
        let up = u64::from(!m.parked);
        match chains.iter_mut().find(|(c, _)| *c == k) {
            Some((_, n)) => *n += up,
            None => chains.push((k, up)),
        }
    }
    chains.sort_unstable();
    sc.gauge_family(
        "chain_replicas_running",
        "Replicas of a tenant's chain on a worker (0: the chain is at zero here).",
        chains
            .into_iter()
            .map(|((t, c), n)| ([("tenant", t.to_string()), ("chain", c.to_string())], n)),
    )?;
    sc.gauge_family(
        "replica_parked",
        "1 while the group's replica is parked.",
        s.groups
            .iter()
            .map(|m| ([("group", m.state.group.to_string())], u64::from(m.parked))),
    )?;
    sc.counter(
        "replica_starts",
        "Replicas placed on a worker first.",
        w.starts,
    )?;
    sc.counter(
        "replica_parks",
        "Idle replicas that gave their worker back.",
        w.parks,
    )?;
    sc.counter(
        "replica_wakes",
        "Parked replicas woken on a worker.",
        w.wakes,
    )?;
    sc.counter(
        "parked_inputs",
        "Inputs (acks, timer ops, queries) applied to parked replicas in place.",
        w.parked_inputs,
    )?;
    sc.counter_family(
        "replica_start_chains",
        "Replica starts by where their NF chain came from: a spare built ahead, or built at the start.",
        [
            ([("from", "spare".to_string())], w.spare_hits),
            ([("from", "build".to_string())], w.spare_misses),
        ],
    )?;
    sc.counter(
        "spare_chains_built",
        "NF chains built ahead in the background for the next start.",
        w.spares_built,
    )?;
    sc.counter_family(
        "shed_requests",
        "Rule requests refused early by backpressure, by reason.",
        [
            ([("reason", "queue".to_string())], w.shed_queue),
            ([("reason", "chain_lag".to_string())], w.shed_chain_lag),
        ],
    )?;
    sc.gauge_family(
        "worker_core",
        "The CPU each worker is pinned to (from the node's CPU list).",
        w.placement
            .iter()
            .enumerate()
            .map(|(i, p)| ([("worker", i.to_string())], p.0 as u64)),
    )?;
    sc.gauge_family(
        "worker_nice",
        "Each worker's nice level (rate-cost share).",
        w.placement
            .iter()
            .enumerate()
            .map(|(i, p)| ([("worker", i.to_string())], i64::from(p.1))),
    )?;
    sc.gauge_family(
        "worker_slice_seconds",
        "Each worker's scheduler slice (0: the kernel's default).",
        w.slices.iter().enumerate().map(|(i, d)| {
            (
                [("worker", i.to_string())],
                d.map_or(0.0, |d| d.as_secs_f64()),
            )
        }),
    )?;
    sc.counter(
        "assigner_fallbacks",
        "Learned core assignments that regressed over 5% and were replaced by round robin.",
        w.assigner_fallbacks,
    )?;
    sc.counter(
        "worker_os_errors",
        "Affinity, nice or scheduler-slice calls the kernel refused.",
        w.os_errors,
    )?;
    worker_latency(
        sc,
        "replica_start",
        "From the input that needs a worker to a new replica's first decision on it.",
        &w.start,
    )?;
    worker_latency(
        sc,
        "replica_wake",
        "From the input that wakes a parked replica to its first decision on a worker.",
        &w.wake,
    )
}

/// A worker pool latency histogram as a `_seconds` histogram (SC's counterpart of
/// [`telemetry::latency`], whose histograms are the pipeline's).
fn worker_latency(
    sc: &mut Scrape<'_>,
    name: &str,
    help: &str,
    h: &crate::workers::HistInner,
) -> std::fmt::Result {
    sc.histogram_seconds(
        name,
        help,
        h.sum_ns as f64 / 1e9,
        h.count,
        &h.buckets_seconds(),
    )
}
