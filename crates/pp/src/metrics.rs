//! The PP node's `/metrics`: the worker thread owns the pipeline, so it publishes a
//! [`PpSnapshot`] into a mutex every [`PP_PUBLISH_EVERY`] ([`PpMetrics::tick`] from its
//! loop); scrapes render the latest one. No lock is taken per packet, and a scrape
//! never waits for the worker. Names: `starfabric_pp_*` (the Grafana dashboard in
//! `deploy/grafana/` reads them).

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pipeline::{DropReason, Pipeline, Stats, TenantCounters, Worker};
use telemetry::{collector, latency, lock, tenant_label, Exporter, MetricsServer, Scrape};

use crate::node::{IoStats, PpIo, PpNodeError};
use crate::rates::RateLimits;
use crate::{AfXdpStats, FmClientStats, UdpVxlanStats};

/// How often the PP worker publishes its counters for scrapes.
pub const PP_PUBLISH_EVERY: Duration = Duration::from_millis(100);

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
    /// Each rate-managed tenant's credit state (paper 000 §7.2).
    pub rates: Vec<proto::v1::TenantRateStatus>,
    /// Packets each worker received, by worker id; exported only with several workers.
    pub worker_rx: Vec<u64>,
    /// The real-time governor of each worker that has one (`--worker-rt`).
    pub rt: Vec<crate::node::rt::RtStats>,
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
            rates: Vec::new(),
            worker_rx: vec![s.rx_packets],
            rt: Vec::new(),
        }
    }

    /// Add another worker's snapshot: counters sum, drop reasons by name (each
    /// worker numbers its rule reasons itself), tenants by id. `rates` stay this one's
    /// (the node thread's rate managers are node-wide).
    pub fn merge(&mut self, o: &PpSnapshot) {
        self.stats.merge(&o.stats);
        for (name, n) in &o.drops {
            match self.drops.iter_mut().find(|(m, _)| m == name) {
                Some((_, m)) => *m += n,
                None => self.drops.push((name.clone(), *n)),
            }
        }
        for (t, c) in &o.tenants {
            match self.tenants.iter_mut().find(|(u, _)| u == t) {
                Some((_, u)) => u.merge(c),
                None => self.tenants.push((*t, *c)),
            }
        }
        self.flow_entries += o.flow_entries;
        self.flow_capacity += o.flow_capacity;
        self.pending_packets += o.pending_packets;
        self.pending_flows += o.pending_flows;
        if let (Some(a), Some(b)) = (self.io.as_mut(), o.io.as_ref()) {
            crate::node::add_udp(a, b);
        }
        if let (Some(a), Some(b)) = (self.afxdp.as_mut(), o.afxdp.as_ref()) {
            crate::node::add_afxdp(a, b);
        }
        self.worker_rx.extend_from_slice(&o.worker_rx);
        self.rt.extend_from_slice(&o.rt);
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
    if p.worker_rx.len() > 1 {
        sc.counter_family(
            "worker_rx_packets",
            "Packets received, by pipeline worker (--workers).",
            p.worker_rx
                .iter()
                .enumerate()
                .map(|(i, n)| ([("worker", i.to_string())], *n)),
        )?;
    }
    if !p.rt.is_empty() {
        let (now_rt, g) = crate::node::rt::RtStats::sum(&p.rt);
        sc.gauge(
            "worker_rt",
            "Workers running SCHED_FIFO now because the kernel dropped frames for them (--worker-rt).",
            now_rt as u64,
        )?;
        sc.counter(
            "worker_rt_entered",
            "Times a worker became SCHED_FIFO under overload.",
            g.entered,
        )?;
        sc.counter_seconds(
            "worker_rt",
            "Time workers spent SCHED_FIFO, summed over workers.",
            g.rt_time.as_secs_f64(),
        )?;
    }
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
    sc.counter(
        "flow_notices",
        "Flow notices (TCP established/closing, active) queued for SC.",
        s.notices,
    )?;
    sc.counter(
        "flow_notices_dropped",
        "Flow notices dropped because the worker's notice queue was full.",
        s.notices_dropped,
    )?;
    sc.counter(
        "counter_reports",
        "Counted rules' counter deltas queued for FM (the monitor NF's counts).",
        s.counter_reports,
    )?;
    let fm_dropped = fm.map_or(0, |f| f.counter_reports_dropped.load(Ordering::Relaxed));
    sc.counter_family(
        "counter_reports_dropped",
        "Counter reports dropped, by reason: a leaving rule's last counts found the worker's report queue full (queue-full), or a batch found the queue toward FM full (fm-queue-full).",
        [
            ("queue-full", s.counter_reports_dropped),
            ("fm-queue-full", fm_dropped),
        ]
        .map(|(r, n)| ([("reason", r)], n)),
    )?;
    sc.counter(
        "counter_reports_sent",
        "Counter reports sent to FM.",
        fm.map_or(0, |f| f.counter_reports_sent.load(Ordering::Relaxed)),
    )?;
    latency(
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
    sc.counter(
        "fm_setup_overload",
        "Rule requests FM refused as setup-overload (the flow asks again).",
        fm.map_or(0, |f| load(&f.setup_overload)),
    )?;
    sc.counter(
        "fabric_injected",
        "First packets of other nodes' flows FM carried here and this node ran (docs/fabric.md).",
        s.fabric_injected,
    )?;
    sc.counter(
        "fabric_first_via_fm",
        "Flows whose first packet FM carried to the next-hop node, so this node did not send it.",
        s.fabric_first_via_fm,
    )?;
    sc.counter_family(
        "fabric_frames_dropped",
        "First packets from FM dropped before the pipeline, by reason.",
        [
            (
                "oversized",
                fm.map_or(0, |f| load(&f.fabric_frames_oversized)),
            ),
            ("bad-rule", fm.map_or(0, |f| load(&f.fabric_frames_bad))),
            (
                "no-worker",
                fm.map_or(0, |f| load(&f.fabric_frames_no_worker)),
            ),
        ]
        .map(|(r, n)| ([("reason", r)], n)),
    )?;
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
    let rl = |r: &proto::v1::TenantRateStatus| {
        [("tenant", r.tenant.to_string()), ("kind", r.kind.clone())]
    };
    sc.gauge_family(
        "tenant_rate_state",
        "Credit state by tenant and kind (requests, packets): 0 S_min, 1 S_base, 2 S_burst.",
        p.rates.iter().map(|r| {
            let v: i64 = match r.state.as_str() {
                "min" => 0,
                "base" => 1,
                _ => 2,
            };
            (rl(r), v)
        }),
    )?;
    sc.gauge_family(
        "tenant_rate_credit",
        "Credit, in ops, by tenant and kind.",
        p.rates.iter().map(|r| (rl(r), r.credit)),
    )?;
    sc.gauge_family(
        "tenant_rate_allowance",
        "Ops per second the tenant may use until the next tick.",
        p.rates.iter().map(|r| (rl(r), r.allowance)),
    )?;
    sc.gauge_family(
        "tenant_rate_offered",
        "Ops per second the tenant offered over the last tick (refused ones too).",
        p.rates.iter().map(|r| (rl(r), r.offered_rate)),
    )?;
    sc.gauge_family(
        "tenant_rate_admitted",
        "Ops per second admitted for the tenant over the last tick.",
        p.rates.iter().map(|r| (rl(r), r.admitted_rate)),
    )?;
    sc.counter_family(
        "tenant_rate_limited",
        "Ops refused over the tenant's rate (dropped as rate-limited).",
        p.rates.iter().map(|r| (rl(r), r.refused)),
    )?;
    if let Some(io) = &p.io {
        sc.counter(
            "io_rx_batches",
            "recvmmsg calls that returned datagrams.",
            io.rx_batches,
        )?;
        sc.counter(
            "io_gro_buffers",
            "Received buffers the kernel's GRO had coalesced from several datagrams.",
            io.gro_buffers,
        )?;
        sc.counter(
            "io_gro_segments",
            "Datagrams delivered out of GRO-coalesced buffers.",
            io.gro_segments,
        )?;
        sc.counter(
            "io_gso_sends",
            "UDP GSO messages (several datagrams in one send) the kernel accepted.",
            io.gso_sends,
        )?;
        sc.counter(
            "io_gso_segments",
            "Datagrams sent inside UDP GSO messages.",
            io.gso_segments,
        )?;
        sc.counter(
            "io_gso_fallbacks",
            "GSO messages refused by the kernel and sent one datagram per message.",
            io.gso_fallbacks,
        )?;
        sc.counter("io_tx_syscalls", "sendmmsg calls made.", io.tx_syscalls)?;
        if let Some(n) = crate::udp::netns_udp_sndbuf_errors() {
            sc.counter(
                "netns_udp_sndbuf_errors",
                "The network namespace's UDP SndbufErrors: datagrams sends handed to the kernel that the device then dropped, its queue full (not in io_tx_dropped).",
                n,
            )?;
        }
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
        sc.counter(
            "afxdp_tx_gso_sends",
            "Packet-socket messages of more than one frame (one UDP GSO skb each).",
            x.tx_gso_sends,
        )?;
        sc.counter(
            "afxdp_tx_gso_segments",
            "Frames sent inside packet-socket GSO messages.",
            x.tx_gso_segments,
        )?;
        sc.counter(
            "afxdp_tx_gso_fallbacks",
            "GSO messages the kernel refused, re-sent one frame per message.",
            x.tx_gso_fallbacks,
        )?;
        sc.counter(
            "afxdp_tx_send_dropped",
            "Frames dropped: the packet socket's send was refused.",
            x.tx_send_dropped,
        )?;
        sc.counter(
            "afxdp_tx_syscalls",
            "Packet-socket send calls.",
            x.tx_syscalls,
        )?;
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
    /// With `trace`, the endpoint also serves `/trace` (`crate::trace`).
    pub fn start(
        addr: SocketAddr,
        fm: Option<Arc<FmClientStats>>,
        trace: Option<&Arc<crate::trace::TraceControl>>,
    ) -> Result<Self, PpNodeError> {
        let snap = Arc::new(Mutex::new(PpSnapshot::default()));
        let mut exporter = pp_exporter(snap.clone(), fm);
        if let Some(t) = trace {
            exporter = exporter.routes(t.routes());
        }
        let server = MetricsServer::spawn_thread(addr, exporter)
            .map_err(|e| PpNodeError::Metrics(e.to_string()))?;
        server
            .announce()
            .map_err(|e| PpNodeError::Metrics(e.to_string()))?;
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
    /// `others`: the latest snapshots of the node's other workers, summed in.
    pub fn tick(
        &mut self,
        w: &Worker<PpIo>,
        rt: Option<crate::node::rt::RtStats>,
        others: &[PpSnapshot],
        rates: &RateLimits,
        now: Instant,
    ) {
        if now < self.next {
            return;
        }
        self.next = now + PP_PUBLISH_EVERY;
        self.publish(w, rt, others, rates);
    }

    /// Publish now (built outside the lock; the lock only swaps it in).
    pub fn publish(
        &self,
        w: &Worker<PpIo>,
        rt: Option<crate::node::rt::RtStats>,
        others: &[PpSnapshot],
        rates: &RateLimits,
    ) {
        let mut s = worker_snapshot(w);
        s.rt.extend(rt);
        for o in others {
            s.merge(o);
        }
        s.rates = rates.status();
        *lock(&self.snap) = s;
    }
}

/// One worker's pipeline and I/O counters.
pub fn worker_snapshot(w: &Worker<PpIo>) -> PpSnapshot {
    match w.io.stats() {
        IoStats::Udp(u) => PpSnapshot::of(&w.pipeline, Some(u)),
        IoStats::AfXdp(x, _) => PpSnapshot {
            afxdp: Some(x),
            ..PpSnapshot::of(&w.pipeline, None)
        },
    }
}

#[cfg(test)]
mod worker_tests {
    use super::*;

    #[test]
    fn the_real_time_governors_are_exported_summed_and_in_seconds() {
        use crate::node::rt::RtStats;
        let gov = |rt: bool, entered: u64, ms: u64| RtStats {
            rt,
            entered,
            rt_time: Duration::from_millis(ms),
            disabled: false,
        };
        let snap = PpSnapshot {
            rt: vec![gov(true, 3, 1_500), gov(false, 2, 250)],
            ..Default::default()
        };
        let text = pp_exporter(Arc::new(Mutex::new(snap)), None)
            .encode()
            .unwrap();
        let samples = telemetry::scrape::parse(&text);
        let v = |name: &str| telemetry::scrape::value(&samples, name, &[]);
        assert_eq!(v("starfabric_pp_worker_rt"), Some(1.0), "{text}");
        assert_eq!(v("starfabric_pp_worker_rt_entered_total"), Some(5.0));
        assert_eq!(v("starfabric_pp_worker_rt_seconds_total"), Some(1.75));
        // Without a governor (--worker-rt 0) the three are absent.
        let text = pp_exporter(Arc::new(Mutex::new(PpSnapshot::default())), None)
            .encode()
            .unwrap();
        assert!(!text.contains("worker_rt"), "{text}");
    }

    #[test]
    fn snapshots_of_workers_merge_drops_by_name_and_tenants_by_id() {
        let snap = |rx: u64, drops: &[(&str, u64)], tenants: &[(u32, u64)]| {
            let mut s = PpSnapshot {
                drops: drops.iter().map(|(n, c)| (n.to_string(), *c)).collect(),
                tenants: tenants
                    .iter()
                    .map(|(t, p)| {
                        (
                            *t,
                            TenantCounters {
                                packets: *p,
                                ..Default::default()
                            },
                        )
                    })
                    .collect(),
                flow_entries: 2,
                flow_capacity: 8,
                worker_rx: vec![rx],
                ..Default::default()
            };
            s.stats.rx_packets = rx;
            s
        };
        let mut a = snap(5, &[("no-rule", 1), ("acl-deny", 2)], &[(1, 5)]);
        // Worker 1 numbered its rule reasons otherwise: merged by name.
        a.merge(&snap(
            7,
            &[("acl-deny", 3), ("quota", 1)],
            &[(1, 4), (2, 3)],
        ));
        assert_eq!(a.stats.rx_packets, 12);
        assert_eq!(a.worker_rx, vec![5, 7]);
        assert_eq!((a.flow_entries, a.flow_capacity), (4, 16));
        assert_eq!(
            a.drops,
            vec![
                ("no-rule".to_string(), 1),
                ("acl-deny".to_string(), 5),
                ("quota".to_string(), 1)
            ]
        );
        let t: Vec<(u32, u64)> = a.tenants.iter().map(|(t, c)| (*t, c.packets)).collect();
        assert_eq!(t, vec![(1, 9), (2, 3)]);
    }
}
