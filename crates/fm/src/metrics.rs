//! FM's `/metrics`: the master's state lives in a task that answers queries, so each
//! scrape first asks it (the exporter's scrape hook) and renders what came back.
//! Names: `starfabric_fm_*`.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use telemetry::{collector, latency, lock, tenant_label, Exporter, MetricsServer, Scrape};

/// What a scrape asks the FM master task for.
#[derive(Debug, Clone, Default)]
pub struct FmSnapshot {
    pub stats: crate::FmStats,
    pub metrics: crate::FmMetrics,
    pub live_pp: usize,
    pub live_sc: usize,
    pub groups: usize,
    pub bad_messages: u64,
    pub sessions: u64,
    pub liveness_beacons: u64,
    pub liveness_rejected: u64,
    /// Peers refused by plane security, per [`proto::tls::Refusal`] (empty: --insecure).
    pub tls_refused: Vec<(&'static str, u64)>,
    /// Messages dropped on full session down queues: replies, frames, submits.
    pub down_full: [u64; 3],
}

impl FmSnapshot {
    pub async fn fetch(o: &crate::FmObserver) -> Option<Self> {
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
            liveness_beacons: o.liveness_counters().beacons.load(Ordering::Relaxed),
            liveness_rejected: o.liveness_counters().rejected.load(Ordering::Relaxed),
            tls_refused: o
                .tls()
                .map(|t| {
                    proto::tls::Refusal::ALL
                        .iter()
                        .map(|r| (r.as_str(), t.refusals().get(*r)))
                        .collect()
                })
                .unwrap_or_default(),
            down_full: {
                let c = &o.wire_counters().down_full;
                [&c.replies, &c.frames, &c.submits].map(|n| n.load(Ordering::Relaxed))
            },
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
        "tls_refused",
        "Peers refused by plane security (mTLS handshake or role), by reason.",
        f.tls_refused.iter().map(|(r, n)| ([("reason", *r)], *n)),
    )?;
    sc.counter_family(
        "down_queue_full",
        "Messages FM dropped because the session's down queue held max_down_queue messages or max_down_bytes bytes (the node reads slower than FM writes), by kind: rule reply batches and first packets to PP nodes, request-only submits to SC nodes. Each is asked for again or lost as on a full link.",
        ["replies", "frames", "submits"]
            .into_iter()
            .zip(f.down_full)
            .map(|(k, n)| ([("kind", k)], n)),
    )?;
    sc.counter_family(
        "tenant_requests",
        "Rule requests from PP nodes, by tenant.",
        f.metrics
            .tenant_requests
            .iter()
            .map(|(t, n)| (tenant_label(*t), *n)),
    )?;
    sc.counter(
        "counter_events",
        "PP rule counter reports received (monitor counters).",
        s.counter_events,
    )?;
    sc.counter(
        "counter_events_routed",
        "PP rule counter reports sent on to the SC group owning the flow.",
        s.counter_events_routed,
    )?;
    sc.counter_family(
        "counter_events_dropped",
        "PP rule counter reports dropped, by reason.",
        [
            ("unknown-flow", s.counter_events_unknown_flow),
            ("no-group", s.counter_events_no_group),
            ("queue-full", s.counter_events_queue_full),
        ]
        .map(|(r, n)| ([("reason", r)], n)),
    )?;
    sc.counter(
        "mirror_relayed",
        "Writes to mirrored NF tables relayed from a group to another group of its chain (docs/nf-api.md).",
        s.mirror_relayed,
    )?;
    sc.counter(
        "mirror_dropped",
        "Writes to mirrored NF tables not relayed (queue full, or the group had no head).",
        s.mirror_dropped,
    )?;
    sc.counter(
        "fabric_first_packets_forwarded",
        "First packets of new flows FM carried from the ingress PP node to the next-hop PP node (docs/fabric.md).",
        s.fabric.first_forwarded,
    )?;
    sc.counter_family(
        "fabric_first_packets_dropped",
        "First packets FM could not carry on (the ingress node released them itself), by reason.",
        s.fabric
            .first_dropped
            .by_reason()
            .map(|(r, n)| ([("reason", r)], n)),
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
    sc.counter(
        "cache_unreadable",
        "Cached rules dropped because their bytes (as SC encoded them) did not decode.",
        s.cache.unreadable,
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
    sc.counter(
        "bad_replies",
        "Encoded SC replies that did not read as a reply; their flows were refused (sc-bad-reply).",
        s.bad_sc_replies,
    )?;
    sc.counter("replies", "Replies sent to PP nodes.", s.replies_to_pp)?;
    sc.counter("timeouts", "Requests that ran out of attempts.", s.timeouts)?;
    sc.counter(
        "setup_overload",
        "Rule requests refused as setup-overload (FM's queue or requests in flight to SC over their bound).",
        s.setup_overload,
    )?;
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
    sc.counter(
        "liveness_beacons",
        "Liveness beacons (UDP) that stamped a node's session as heard.",
        f.liveness_beacons,
    )?;
    sc.counter(
        "liveness_rejected",
        "Datagrams on the liveness port that were no beacon or named no open session.",
        f.liveness_rejected,
    )?;
    latency(
        sc,
        "request",
        "From a PP request reaching the master task to its reply leaving it.",
        &f.metrics.request_latency,
    )
}

/// Serve FM metrics on its runtime; each scrape asks the master task first.
pub fn start(
    rt: &tokio::runtime::Handle,
    addr: SocketAddr,
    fm: &crate::FmHandle,
) -> Result<MetricsServer, telemetry::TelemetryError> {
    let obs = fm.observer();
    telemetry::serve_fetched(rt, addr, fm_exporter, move || {
        let obs = obs.clone();
        async move { FmSnapshot::fetch(&obs).await }
    })
}
