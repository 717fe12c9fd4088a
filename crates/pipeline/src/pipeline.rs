//! The per-worker pipeline: parse → match → action over batches.
//!
//! A batch runs in three passes so that table memory is fetched for many packets at
//! once instead of one cache miss after another (the VPP/DPDK pattern):
//! 1. parse, build the `FlowKey`, hash it, prefetch its two buckets;
//! 2. find the signature match, prefetch the entry and its rule;
//! 3. confirm the key, then run the rule's actions, or take the miss path.
//!
//! The miss path holds the packet in the [`PendingQueue`] and sends a [`RuleRequest`];
//! [`Pipeline::service`] installs the rules that came back and releases the held packets
//! in order, before the next batch.

use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, TrySendError};
// foldhash rather than SipHash: `vpcs` is looked up for every packet.
use hashbrown::HashMap;
use packet::rewrite::{rewrite_endpoint, rewrite_icmp_error, Side};
use packet::{parse_frame_with, Frame, Ip, ParseOptions, L3, L4};

use crate::io::{Desc, PacketIo, Verdict};
use crate::key::{vxlan_source_port, FlowKey, KeyError};
use crate::pending::{PendingConfig, PendingQueue};
use crate::rule::{slot_flag, NodeAddr, Rule, RuleContext, RuleError, RuleSlot};
use crate::stats::{DropReason, Stats, TenantCounters};
use crate::table::{
    age, newer, FlowTable, Inserted, Near, Probe, TableError, CLOSING_SEEN, ESTABLISHED_SEEN,
    REPLY_OF, REPORTS,
};
use crate::trace::{wall_us, Lookup, TraceDecision, TracePacket, TraceRecord, Tracer};

/// Largest batch processed in one pass; bigger inputs are processed in chunks.
pub const MAX_BATCH: usize = 64;

/// What a tenant's VNI means to this PP node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VpcBinding {
    pub tenant: u32,
    /// The NF chain the tenant's traffic goes through.
    pub chain: u32,
}

/// Facts about the first packet of a flow that the NF logic may need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PacketMeta {
    pub len: u16,
    pub tcp_flags: u8,
    pub icmp_error: bool,
    pub ingress_port: u16,
}

impl PacketMeta {
    /// A `len`-byte packet with `tcp_flags` (0 for other protocols), not an ICMP error,
    /// from port 0: how tests and tools write the packet an NF is shown.
    pub fn new(len: u16, tcp_flags: u8) -> Self {
        PacketMeta {
            len,
            tcp_flags,
            icmp_error: false,
            ingress_port: 0,
        }
    }
}

/// A request for the rule of a flow that missed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleRequest {
    pub key: FlowKey,
    pub hash: u64,
    pub tenant: u32,
    pub chain: u32,
    pub meta: PacketMeta,
    pub worker: u16,
    /// The flow's first packet, whole, when [`PipelineConfig::first_frames`] is on and
    /// this request is the flow's first: FM may carry it to the flow's next-hop PP
    /// node over the fabric (docs/fabric.md), and then says so in
    /// [`RuleReply::frame_forwarded`].
    pub frame: Option<Box<[u8]>>,
}

impl RuleRequest {
    /// A request for `key`'s rule from worker 0, with the key's own hash.
    pub fn new(key: FlowKey, tenant: u32, chain: u32, meta: PacketMeta) -> Self {
        RuleRequest {
            key,
            hash: key.hash(),
            tenant,
            chain,
            meta,
            worker: 0,
            frame: None,
        }
    }
}

/// The answer to a [`RuleRequest`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleReply {
    pub key: FlowKey,
    pub result: Result<Rule, String>,
    /// Rules to install alongside, such as the flow's reverse-direction rule, so replies
    /// hit without a request of their own. One is held inline: a new flow's reply
    /// carries its reverse rule, and a list on the heap was an allocation per flow.
    pub also: Companions,
    /// Not an answer: FM withdrew `key`'s rule (its chain went or was rebuilt). The
    /// worker removes it, so the flow's next packet asks again.
    pub revoke: bool,
    /// Who decided, as FM says. Shown by traces only.
    pub decided_by: DecidedBy,
    /// FM carried the request's frame (the flow's first held packet) to the next-hop
    /// node: the worker releases only the packets held after it, so none goes twice.
    pub frame_forwarded: bool,
    /// A frame FM carried here from the flow's ingress node (docs/fabric.md): after
    /// installing this reply's rules, the worker runs it through its pipeline as if it
    /// had come over the fabric. Such a reply answers no request of this node's.
    pub inject: Option<Box<[u8]>>,
}

/// A reply's companion rules ([`RuleReply::also`]).
pub type Companions = smallvec::SmallVec<[Rule; 1]>;

/// Who decided a [`RuleReply`], as FM's reply says.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DecidedBy {
    /// The reply does not say (a static rule, an older FM).
    #[default]
    Unsaid,
    /// An SC group's chain computed it. FM names the group by id, so a flow's answer
    /// carries no string; it reads "SC group G".
    ScGroup(u64),
    /// Anyone else, by name: `FM rule cache`, `FM fabric`, `FM` for FM's own refusals.
    Named(String),
}

impl std::fmt::Display for DecidedBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecidedBy::Unsaid => Ok(()),
            DecidedBy::ScGroup(g) => write!(f, "SC group {g}"),
            DecidedBy::Named(n) => f.write_str(n),
        }
    }
}

impl RuleReply {
    /// The source address and port the answered rule rewrites to (a SNAT mapping);
    /// None for an error or a rule that sets neither or only one of them.
    pub fn mapped_source(&self) -> Option<(std::net::IpAddr, u16)> {
        let rule = self.result.as_ref().ok()?;
        rule.actions.iter().find_map(|a| match a {
            crate::rule::Action::SetSrc {
                addr: Some(a),
                port: Some(p),
            } => Some((*a, *p)),
            _ => None,
        })
    }
}

impl RuleReply {
    pub fn ok(rule: Rule) -> Self {
        RuleReply {
            key: rule.key,
            result: Ok(rule),
            also: Companions::new(),
            revoke: false,
            decided_by: DecidedBy::Unsaid,
            frame_forwarded: false,
            inject: None,
        }
    }

    pub fn err(key: FlowKey, e: impl Into<String>) -> Self {
        RuleReply {
            key,
            result: Err(e.into()),
            also: Companions::new(),
            revoke: false,
            decided_by: DecidedBy::Unsaid,
            frame_forwarded: false,
            inject: None,
        }
    }

    /// FM withdraws `key`'s rule.
    pub fn revoke(key: FlowKey) -> Self {
        RuleReply {
            key,
            result: Err("revoked".into()),
            also: Companions::new(),
            revoke: true,
            decided_by: DecidedBy::Unsaid,
            frame_forwarded: false,
            inject: None,
        }
    }
}

/// Where a worker's misses go.
pub enum RuleSource {
    /// Static rules only: a miss is dropped as `no-rule`.
    None,
    Channel {
        requests: Sender<RuleRequest>,
        replies: Receiver<RuleReply>,
    },
}

/// The per-tenant rate manager's hook (paper 000 §7.2). It is asked at the two points
/// where a tenant uses the node: packets through the `police` action, and new flows
/// (rule requests) at a miss.
pub trait Policer: Send {
    /// Whether policer `class` admits a packet of `bytes` at `now_ms`.
    fn admit(&mut self, class: u16, bytes: u32, now_ms: u32) -> bool;

    /// Whether `tenant`'s packet rate admits a packet of `bytes` at `now_ms`; asked for
    /// every packet of a tenant marked with [`Pipeline::set_tenant_policed`].
    fn admit_packet(&mut self, tenant: u32, bytes: u32, now_ms: u32) -> bool {
        let _ = (tenant, bytes, now_ms);
        true
    }

    /// Whether `tenant` may start a new flow (send a rule request) at `now_us`. A
    /// refused flow's packet is dropped as `rate-limited`; the default admits all.
    fn admit_request(&mut self, tenant: u32, now_us: u64) -> bool {
        let _ = (tenant, now_us);
        true
    }

    /// Hand counts kept per worker to the rate manager (before its tick), so a tenant
    /// that went quiet is not left with uncounted ops.
    fn flush(&mut self) {}
}

/// Wall-clock source in milliseconds (wrapping), read once per batch.
pub trait Clock: Send {
    fn now_ms(&self) -> u32;

    /// The same clock in microseconds, for latency measurement (rule setup takes well
    /// under a millisecond on a local fabric). `now_ms` must equal `(now_us / 1000) as
    /// u32`; the default has millisecond resolution.
    fn now_us(&self) -> u64 {
        u64::from(self.now_ms()) * 1000
    }

    /// Another handle on the same clock, which [`Worker::new`] gives its pipeline for
    /// latency measurement. `None` (the default): the pipeline measures in the
    /// milliseconds its callers pass.
    fn clone_box(&self) -> Option<Box<dyn Clock>> {
        None
    }
}

/// Milliseconds since the clock was made.
pub struct MonotonicClock(std::time::Instant);

impl MonotonicClock {
    pub fn new() -> Self {
        MonotonicClock(std::time::Instant::now())
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_ms(&self) -> u32 {
        self.0.elapsed().as_millis() as u32
    }

    fn now_us(&self) -> u64 {
        self.0.elapsed().as_micros() as u64
    }

    fn clone_box(&self) -> Option<Box<dyn Clock>> {
        Some(Box::new(MonotonicClock(self.0)))
    }
}

/// A clock tests move by hand. It keeps microseconds; `set` and `advance` take
/// milliseconds, `set_us` and `advance_us` microseconds.
#[derive(Clone, Default)]
pub struct ManualClock(std::sync::Arc<std::sync::atomic::AtomicU64>);

impl ManualClock {
    pub fn set(&self, ms: u32) {
        self.set_us(u64::from(ms) * 1000)
    }
    pub fn advance(&self, ms: u32) {
        self.advance_us(u64::from(ms) * 1000)
    }
    pub fn set_us(&self, us: u64) {
        self.0.store(us, std::sync::atomic::Ordering::Relaxed)
    }
    pub fn advance_us(&self, us: u64) {
        self.0.fetch_add(us, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u32 {
        (self.now_us() / 1000) as u32
    }

    fn now_us(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn clone_box(&self) -> Option<Box<dyn Clock>> {
        Some(Box::new(self.clone()))
    }
}

/// VNIs are 24 bits.
const VNI_MASK: u32 = (1 << 24) - 1;
const VNIS: usize = 1 << 24;

/// Per-tenant counting on the hit path, in three plain arrays (no hashing, no locks):
/// - `vni_slot`: a dense VNI → slot table, one `u16` per possible VNI (32 MiB of
///   address space). It is allocated zeroed, which the allocator serves from fresh
///   zero pages, so only the pages holding bound VNIs ever become resident (4 KiB per
///   2048 consecutive VNIs). A lookup is one load from a page that stays in cache.
/// - `counters`: per-slot [`TenantCounters`], one entry per tenant (VNIs of one tenant
///   share a slot); slot 0 collects packets of unbound VNIs and is not a tenant.
/// - `ids`: slot → tenant id, read only when exporting.
struct Tenants {
    /// An array, not a slice: indexed by a masked VNI, it needs no bounds check.
    vni_slot: Box<[u16; VNIS]>,
    counters: Vec<TenantCounters>,
    ids: Vec<u32>,
    /// Per slot: every packet of the tenant meets its packet rate (paper 000 §7.2).
    policed: Vec<bool>,
    /// Slot of the default binding's tenant, for VNIs with no slot of their own.
    default_slot: u16,
}

impl Tenants {
    fn new() -> Self {
        Tenants {
            vni_slot: vec![0u16; VNIS]
                .into_boxed_slice()
                .try_into()
                .expect("VNIS entries"),
            counters: vec![TenantCounters::default()],
            ids: vec![0],
            policed: vec![false],
            default_slot: 0,
        }
    }

    /// The slot of `tenant`, made on first use. Past `u16::MAX` tenants on one worker,
    /// further tenants share slot 0 (unattributed).
    fn slot_of(&mut self, tenant: u32) -> u16 {
        if let Some(i) = self.ids.iter().skip(1).position(|&t| t == tenant) {
            return i as u16 + 1;
        }
        if self.ids.len() > usize::from(u16::MAX) {
            return 0;
        }
        self.ids.push(tenant);
        self.counters.push(TenantCounters::default());
        self.policed.push(false);
        (self.ids.len() - 1) as u16
    }

    #[inline(always)]
    fn add(&mut self, slot: usize, packets: u64, bytes: u64) {
        let c = &mut self.counters[slot];
        c.packets += packets;
        c.bytes += bytes;
    }

    #[inline(always)]
    fn slot(&self, vni: u32) -> usize {
        match self.vni_slot[(vni & VNI_MASK) as usize] {
            0 => usize::from(self.default_slot),
            s => usize::from(s),
        }
    }
}

/// Configuration of one worker's pipeline.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    pub flow_capacity: usize,
    /// Seed of the table hash (per worker, random in production).
    pub seed: u64,
    pub node: NodeAddr,
    /// Idle timeout of rules that name none.
    pub default_idle_timeout: Duration,
    pub pending: PendingConfig,
    pub parse: ParseOptions,
    /// Arena slots the idle sweep examines per serviced batch.
    pub sweep_budget: usize,
    pub worker: u16,
    /// Elephant detection for the fast path; `None` (the default) detects nothing.
    pub elephant: Option<ElephantPolicy>,
    /// A miss on a VNI with no tenant binding asks the rule source anyway, as
    /// `proto::UNBOUND_TENANT` (FM answers from its cache by key). For PP clusters, whose
    /// nodes see replies on the gateways' VNIs for flows they never saw start. Off: such
    /// a miss is an `unknown-vni` drop.
    pub ask_unbound: bool,
    /// What PP tells SC about flows after their first packet ([`FlowNotice`]).
    pub notices: NoticeConfig,
    /// Report counted rules' counters (for the monitor NF); `None` (the default):
    /// counters stay cumulative in the table and nothing is reported.
    pub counter_reports: Option<CounterReportConfig>,
    /// While set (FM serves chains split over the PP fabric and asked for them), a new
    /// flow's first packet travels with its rule request ([`RuleRequest::frame`]).
    /// Shared with the FM client, which learns it at registration; `None`: never.
    pub first_frames: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

/// How a worker reports its counted rules' counters (`Action::Count`) toward SC, where
/// the monitor NF adds them up (docs/metrics.md, "Monitor counters").
///
/// Every `interval_ms` a report pass walks the flow table's arena, at most
/// `scan_per_service` slots per [`Pipeline::service`] call (so no call stalls the data
/// path) and paced over [`REPORT_SPREAD`] of the interval, and queues a
/// [`CounterReport`] for each counted rule that counted something since its last
/// report, zeroing its counters. A rule that leaves the table (idle, evicted, revoked,
/// replaced) has its last counts queued right away. The queue holds at most `queue`
/// reports: a pass that finds it full stops and resumes later with the counters intact;
/// a leaving rule's last counts that find it full are dropped and counted
/// (`counter_reports_dropped`). The hit path pays nothing beyond the counter add it
/// already did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterReportConfig {
    pub interval_ms: u32,
    pub queue: usize,
    pub scan_per_service: usize,
}

/// The share of a counter report interval one pass is spread over (the rest is slack,
/// so a pass slowed by a full queue still ends before the next is due), and the steps
/// it takes. Paced, the reports leave in [`REPORT_STEPS`] batches per pass. Unpaced, a
/// pass over a table of a few thousand flows took a few ms, and its reports reached FM
/// and then every SC hop as one burst per interval, queued ahead of every tenant's rule
/// requests: that burst was most of another tenant's setup p99 under a SYN flood
/// (docs/rate-isolation.md, "The tail was the counter reports"). Steps rather than a
/// slot or two per call: each batch is a message to FM and a wakeup of the FM client.
pub const REPORT_SPREAD: (u64, u64) = (3, 4);
/// See [`REPORT_SPREAD`].
pub const REPORT_STEPS: u64 = 32;

/// How many arena slots the report pass may examine now: up to where a pass begun
/// `elapsed_ms` ago over an arena of `len` slots should be, paced in [`REPORT_STEPS`]
/// steps over [`REPORT_SPREAD`] of `interval_ms`, and at most `cap`.
pub fn report_budget(
    elapsed_ms: u32,
    interval_ms: u32,
    cursor: usize,
    len: usize,
    cap: usize,
) -> usize {
    let spread = (u64::from(interval_ms) * REPORT_SPREAD.0 / REPORT_SPREAD.1).max(1);
    let step = (u64::from(elapsed_ms) * REPORT_STEPS / spread).min(REPORT_STEPS);
    let due = (len as u64 * step).div_ceil(REPORT_STEPS) as usize;
    due.saturating_sub(cursor).min(cap)
}

impl Default for CounterReportConfig {
    fn default() -> Self {
        CounterReportConfig {
            interval_ms: 1000,
            queue: 1 << 16,
            scan_per_service: 4096,
        }
    }
}

/// Flow notices: TCP establishment and close are noticed on the hit path (a flag test
/// per TCP packet; the report itself is cold), activity by a periodic walk of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoticeConfig {
    /// Report `Active` for flows seen since the previous walk, starting a walk every
    /// this many ms; 0 reports no activity. Must stay well below the shortest NF idle
    /// timeout (SNAT and FW time half-open TCP at 240 s and 120 s), since NFs refresh
    /// their deadlines only on these reports.
    pub active_period_ms: u32,
    /// Most arena slots the activity walk examines per serviced batch. The walk is
    /// paced over 3/4 of `active_period_ms` in steps, like the counter report pass
    /// ([`report_budget`]).
    pub active_budget: usize,
    /// Most notices queued between two drains; more are dropped and counted
    /// (`Stats::notices_dropped`): a lost `Active` is made good by the next walk, a
    /// lost `TcpEstablished` leaves the flow on the transitory timeout.
    pub queue: usize,
}

impl Default for NoticeConfig {
    fn default() -> Self {
        NoticeConfig {
            active_period_ms: 10_000,
            active_budget: 1024,
            queue: 4096,
        }
    }
}

/// What PP noticed about a flow SC decided, for the NFs (`nf::FlowEvent`). Reported
/// on the flow's forward key, the one PP asked about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowNotice {
    pub kind: NoticeKind,
    pub key: FlowKey,
    pub tenant: u32,
    pub chain: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoticeKind {
    /// The first forward packet with ACK and without SYN, FIN or RST: the opener's
    /// third handshake packet (it sends one only after the SYN-ACK came back).
    TcpEstablished,
    /// A forward packet with FIN or RST.
    TcpClosing,
    /// Seen since the previous activity walk.
    Active,
}

/// One counted rule's counts since its previous report. `tenant` and `chain` come from
/// the binding of the rule key's VNI; 0 and 0 when the VNI has none (a reply rule on
/// another tenant's gateway VNI: FM knows the flow's tenant from its rule cache).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterReport {
    pub key: FlowKey,
    pub tenant: u32,
    pub chain: u32,
    pub packets: u64,
    pub bytes: u64,
}

/// Most elephants queued for the fast path between two drains; more wait for the
/// next packet after a drain (they stay unmarked).
const MAX_QUEUED_ELEPHANTS: usize = 4096;

/// When a flow is heavy enough to hand to the fast path (Zeta §IV-C): it carries at
/// least `bytes` bytes or `packets` packets within one `window_ms` window. Counted on the
/// flow's counters with one read and one write per packet (§IV-D): a packet that finds
/// the window older than `window_ms` starts a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElephantPolicy {
    pub window_ms: u32,
    pub bytes: u64,
    pub packets: u32,
}

impl Default for ElephantPolicy {
    /// 100 ms windows; 125 kB (10 Mbit/s) or 1,000 packets (10 kpps) in one makes an
    /// elephant. Zeta's gateways use 20 kbit/s; a PP node's userspace path is far
    /// cheaper per packet than a host agent, so only flows that cost it real CPU move.
    fn default() -> Self {
        ElephantPolicy {
            window_ms: 100,
            bytes: 125_000,
            packets: 1_000,
        }
    }
}

impl PipelineConfig {
    pub fn new(node: NodeAddr) -> Self {
        PipelineConfig {
            flow_capacity: 1 << 16,
            seed: 0x005e_ed0f_f10e,
            node,
            default_idle_timeout: Duration::from_secs(300),
            pending: PendingConfig::default(),
            parse: ParseOptions::default(),
            sweep_budget: 16,
            worker: 0,
            elephant: None,
            ask_unbound: false,
            notices: NoticeConfig::default(),
            counter_reports: None,
            first_frames: None,
        }
    }
}

/// Where the matched packet's headers are, relative to the start of its data.
#[derive(Debug, Clone, Copy)]
struct Classified {
    /// The IP packet the key came from (the inner one for VXLAN).
    ip: Ip,
    vni: u32,
    /// Start and end of the inner frame for VXLAN; 0 when not encapsulated.
    inner_off: u16,
    inner_end: u16,
}

#[derive(Clone, Copy)]
struct Stage {
    key: FlowKey,
    hash: u64,
    probe: Probe,
    cand: Option<crate::table::Way>,
    cls: Classified,
}

/// One worker's PP pipeline.
pub struct Pipeline {
    table: FlowTable,
    ctx: RuleContext,
    pending: PendingQueue,
    stats: Stats,
    cfg: PipelineConfig,
    vpcs: HashMap<u32, VpcBinding>,
    default_binding: Option<VpcBinding>,
    source: RuleSource,
    policer: Option<Box<dyn Policer>>,
    stages: Vec<Option<Stage>>,
    released: Vec<Desc>,
    expired_keys: Vec<(FlowKey, u16)>,
    tenants: Tenants,
    /// Tenant slot of the packet being acted on, so `drop` can charge the tenant
    /// without every drop site passing it; 0 (unattributed) outside the act pass.
    cur_tenant: usize,
    /// Microsecond time for rule setup latency, read only on the miss path and when a
    /// reply installs a rule (see [`Pipeline::set_clock`]).
    clock: Option<Box<dyn Clock>>,
    /// Flows that crossed the elephant threshold, for the fast path to take.
    elephants: Vec<FlowKey>,
    /// The armed trace; `None` (off) costs the hot loop one branch per chunk.
    trace: Option<Box<Tracer>>,
    /// Flow notices for SC, bounded by `cfg.notices.queue`.
    notices: Vec<FlowNotice>,
    /// The activity walk: next slot, when the running walk started, when the one
    /// before it started (a flow seen since then is active); `None` between walks.
    active_walk: Option<usize>,
    active_started: u32,
    active_prev: Option<u32>,
    reports: Reports,
    /// The IPsec VPN gateway (docs/ipsec.md); `None`: ESP and tunnel traffic are not
    /// looked for, and the hot loop pays one branch per packet.
    ipsec: Option<Box<ipsec::Gateway>>,
    /// This chunk's frames for the gateway, and their descriptor indices.
    esp_jobs: Vec<ipsec::Job>,
    esp_idx: Vec<u16>,
    /// A frame FM carried here, waiting for its reply's rules and released packets
    /// (see `inject_pending`), and the slot it runs in.
    inject_after: Option<Box<[u8]>>,
    inject_region: Vec<u8>,
}

/// The counter report queue and pass (see [`CounterReportConfig`]).
#[derive(Default)]
struct Reports {
    queue: Vec<CounterReport>,
    /// When the running (or last) pass started, ms.
    pass_start: u32,
    scanning: bool,
    started: bool,
    finals: Vec<(FlowKey, u64, u64)>,
    /// Counted rules that left the table while offloaded, since the fast path's last
    /// drain and the one before: the fast path folds their last driver counts after the
    /// entry is gone, and those are reported from here.
    gone: Vec<FlowKey>,
    gone_prev: Vec<FlowKey>,
}

impl Pipeline {
    pub fn new(cfg: PipelineConfig, source: RuleSource) -> Result<Self, TableError> {
        let mut table = FlowTable::new(cfg.flow_capacity, cfg.seed)?;
        if cfg.elephant.is_some() {
            table.track_windows();
        }
        Ok(Pipeline {
            table,
            ctx: RuleContext::new(cfg.node, cfg.default_idle_timeout),
            pending: PendingQueue::new(cfg.pending),
            stats: Stats::default(),
            vpcs: HashMap::new(),
            default_binding: None,
            source,
            policer: None,
            stages: vec![None; MAX_BATCH],
            released: Vec::with_capacity(cfg.pending.per_flow as usize),
            expired_keys: Vec::new(),
            tenants: Tenants::new(),
            cur_tenant: 0,
            clock: None,
            elephants: Vec::new(),
            trace: None,
            notices: Vec::new(),
            active_walk: None,
            active_started: 0,
            active_prev: None,
            reports: Reports::default(),
            ipsec: None,
            esp_jobs: Vec::with_capacity(MAX_BATCH),
            esp_idx: Vec::with_capacity(MAX_BATCH),
            inject_after: None,
            inject_region: Vec::new(),
            cfg,
        })
        .map(|mut p| {
            p.table.set_counter_reports(p.cfg.counter_reports.is_some());
            p
        })
    }

    /// Arm a trace (`Some`) or disarm it (`None`); see [`crate::trace`].
    pub fn set_tracer(&mut self, t: Option<Tracer>) {
        self.trace = t.map(Box::new);
    }

    /// The armed trace, if any (it disarms itself once its count is used up and no
    /// traced miss awaits FM's answer).
    pub fn tracer(&self) -> Option<&Tracer> {
        self.trace.as_deref()
    }

    /// Turn the IPsec VPN gateway on (`Some`) or off. With it on, ESP frames to the
    /// node and VPC frames toward a tunnel's remote prefixes go to the gateway instead
    /// of the flow table (docs/ipsec.md).
    pub fn set_ipsec(&mut self, g: Option<ipsec::Gateway>) {
        self.ipsec = g.map(Box::new);
    }

    pub fn ipsec(&self) -> Option<&ipsec::Gateway> {
        self.ipsec.as_deref()
    }

    pub fn ipsec_mut(&mut self) -> Option<&mut ipsec::Gateway> {
        self.ipsec.as_deref_mut()
    }

    pub fn set_policer(&mut self, p: Box<dyn Policer>) {
        self.policer = Some(p);
    }

    /// Meter every packet of `tenant` against its packet rate (the policer's
    /// [`Policer::admit_packet`]), not only those whose rule has a `police` action. Its
    /// flows are then never offloaded to the fast path, which has no policer.
    /// See [`Policer::flush`].
    pub fn flush_policer(&mut self) {
        if let Some(p) = self.policer.as_mut() {
            p.flush();
        }
    }

    pub fn set_tenant_policed(&mut self, tenant: u32, on: bool) {
        let slot = usize::from(self.tenants.slot_of(tenant));
        if slot != 0 {
            self.tenants.policed[slot] = on;
        }
    }

    /// Bind a VNI to a tenant and chain; misses on unbound VNIs are dropped.
    pub fn bind_vpc(&mut self, vni: u32, b: VpcBinding) {
        self.vpcs.insert(vni, b);
        // A VNI above 24 bits never matches a packet, so it gets no slot.
        if vni <= VNI_MASK {
            let slot = self.tenants.slot_of(b.tenant);
            self.tenants.vni_slot[vni as usize] = slot;
        }
    }

    /// Replace every VNI binding at once (the orchestrator's directive). Flows of a VNI
    /// that lost its binding keep their installed rules until those idle out; only
    /// their new flows are refused (`unknown-vni`).
    pub fn replace_vpcs(&mut self, bindings: impl IntoIterator<Item = (u32, VpcBinding)>) {
        for (vni, _) in self.vpcs.drain() {
            if vni <= VNI_MASK {
                self.tenants.vni_slot[vni as usize] = 0;
            }
        }
        for (vni, b) in bindings {
            self.bind_vpc(vni, b);
        }
    }

    /// The VNI bindings, in no particular order.
    pub fn vpcs(&self) -> impl Iterator<Item = (u32, VpcBinding)> + '_ {
        self.vpcs.iter().map(|(v, b)| (*v, *b))
    }

    /// Binding used for VNIs with no binding of their own.
    pub fn set_default_binding(&mut self, b: Option<VpcBinding>) {
        self.default_binding = b;
        self.tenants.default_slot = match b {
            Some(b) => self.tenants.slot_of(b.tenant),
            None => 0,
        };
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Per-tenant counters of the tenants bound on this worker (by `bind_vpc` or the
    /// default binding), in binding order. Packets of unbound VNIs are in no tenant's.
    pub fn tenants(&self) -> impl Iterator<Item = (u32, &TenantCounters)> {
        self.tenants
            .ids
            .iter()
            .zip(self.tenants.counters.iter())
            .skip(1)
            .map(|(&t, c)| (t, c))
    }

    /// The clock rule setup latency is measured on; [`Worker::new`] sets it to a handle
    /// on the worker's clock. Without one, latency is measured in the milliseconds
    /// passed to `process`/`service`.
    ///
    /// The pipeline reads it only on the miss path and when installing a reply: the hit
    /// path has no use for microseconds, so it pays nothing for them.
    pub fn set_clock(&mut self, clock: Option<Box<dyn Clock>>) {
        self.clock = clock;
    }

    /// Microseconds for latency measurement: the clock's, or the caller's ms.
    fn latency_now_us(&self, now_ms: u32) -> u64 {
        match &self.clock {
            Some(c) => c.now_us(),
            None => u64::from(now_ms) * 1000,
        }
    }

    pub fn table(&self) -> &FlowTable {
        &self.table
    }

    pub fn rules(&self) -> &RuleContext {
        &self.ctx
    }

    pub fn pending(&self) -> &PendingQueue {
        &self.pending
    }

    pub fn config(&self) -> &PipelineConfig {
        &self.cfg
    }

    /// Name of a drop reason as counters and the golden corpus spell it.
    pub fn drop_name(&self, r: DropReason) -> String {
        match r {
            DropReason::Rule(i) => format!(
                "rule:{}",
                self.ctx
                    .reasons()
                    .get(i as usize)
                    .map(String::as_str)
                    .unwrap_or("?")
            ),
            d => d.name().to_string(),
        }
    }

    /// Install (or atomically replace) a rule.
    pub fn install_rule(&mut self, rule: &Rule, now: u32) -> Result<(), RuleError> {
        let slot = match self.ctx.compile(rule) {
            Ok(s) => s,
            Err(e) => {
                self.stats.rule_compile_errors += 1;
                return Err(e);
            }
        };
        let sport = vxlan_source_port(rule.rewritten_key().hash());
        if slot.wants_offload() {
            self.stats.offload_marked += 1;
        }
        let ctx = &self.ctx;
        let res = self
            .table
            .insert(&rule.key, slot, sport, now, |r: &RuleSlot| {
                ctx.timeout_ms(r.timeout_class)
            });
        match res {
            Inserted::New { victim, .. } => {
                self.stats.rules_installed += 1;
                if let Some((_, old, reason)) = victim {
                    self.ctx.release(&old);
                    match reason {
                        crate::table::EvictReason::Expired => self.stats.expired += 1,
                        _ => self.stats.evicted_table_full += 1,
                    }
                }
            }
            Inserted::Replaced { old, .. } => {
                self.stats.rules_replaced += 1;
                self.ctx.release(&old);
            }
        }
        Ok(())
    }

    /// Remove a flow's rule. Returns its final counters.
    pub fn remove_rule(&mut self, key: &FlowKey) -> Option<(u64, u64)> {
        let i = self.table.lookup(key)?;
        let c = *self.table.counters(i);
        let r = self.table.remove(key)?;
        self.ctx.release(&r);
        Some((c.packets, c.bytes))
    }

    /// The rule installed for `key`, as an action list, with its counters.
    pub fn lookup_rule(&self, key: &FlowKey) -> Option<(crate::Actions, u64, u64)> {
        let i = self.table.lookup(key)?;
        let c = self.table.counters(i);
        Some((self.ctx.decompile(self.table.rule(i)), c.packets, c.bytes))
    }

    /// Parse a frame down to the IP packet to match, and its VNI.
    #[inline]
    fn classify(&self, data: &[u8]) -> Result<Classified, DropReason> {
        let v = match packet::vxlan_fast(data, self.cfg.parse.vxlan_port) {
            Some(v) => v,
            None => {
                let outer: Frame = parse_frame_with(data, &self.cfg.parse)?;
                match (outer.vxlan, outer.l3) {
                    (Some(v), _) => v,
                    (None, L3::Ip(ip)) => {
                        return Ok(Classified {
                            ip,
                            vni: 0,
                            inner_off: 0,
                            inner_end: 0,
                        })
                    }
                    (None, _) => return Err(DropReason::NotIp),
                }
            }
        };
        let inner = &data[v.inner_off as usize..v.inner_end as usize];
        match parse_frame_with(inner, &self.cfg.parse)?.l3 {
            L3::Ip(ip) => Ok(Classified {
                ip: ip.shifted(v.inner_off),
                vni: v.vni,
                inner_off: v.inner_off,
                inner_end: v.inner_end,
            }),
            _ => Err(DropReason::NotIp),
        }
    }

    /// Process one batch of received descriptors in place, setting each verdict.
    pub fn process(&mut self, region: &mut [u8], descs: &mut [Desc], now: u32) {
        for chunk in descs.chunks_mut(MAX_BATCH) {
            self.process_chunk(region, chunk, now, true);
        }
    }

    fn process_chunk(&mut self, region: &mut [u8], descs: &mut [Desc], now: u32, fresh: bool) {
        // Lent out of `self` for the chunk so passes read stages in place, not by copy.
        let mut stages = std::mem::take(&mut self.stages);
        self.stage_chunk(region, descs, now, fresh, &mut stages);
        self.stages = stages;
    }

    #[inline(always)]
    fn stage_chunk(
        &mut self,
        region: &mut [u8],
        descs: &mut [Desc],
        now: u32,
        fresh: bool,
        stages: &mut [Option<Stage>],
    ) {
        // Pass 1: parse, key, hash, prefetch buckets. Its drops belong to no tenant.
        self.cur_tenant = 0;
        // The trace hook: one test per chunk while off.
        let tracing = self.trace.is_some();
        for (i, d) in descs.iter_mut().enumerate() {
            if fresh {
                self.stats.rx_packets += 1;
                self.stats.rx_bytes += d.len as u64;
            }
            stages[i] = None;
            if let Some(g) = self.ipsec.as_deref() {
                if ipsec::esp::is_esp(d.data(region)) {
                    self.esp_job(i, d, ipsec::Dir::In);
                    continue;
                }
                if !g.is_empty() {
                    if let Some(dir) = self.esp_outbound(g, d.data(region)) {
                        self.esp_job(i, d, dir);
                        continue;
                    }
                }
            }
            let cls = match self.classify(d.data(region)) {
                Ok(c) => c,
                Err(r) => {
                    self.drop(d, r);
                    if tracing {
                        self.trace_unkeyed(region, d, r, fresh);
                    }
                    continue;
                }
            };
            let key = match FlowKey::from_ip(d.data(region), &cls.ip, cls.vni) {
                Ok(k) => k,
                Err(KeyError::Fragment) => {
                    self.drop(d, DropReason::Fragment);
                    if tracing {
                        self.trace_unkeyed(region, d, DropReason::Fragment, fresh);
                    }
                    continue;
                }
            };
            let hash = self.table.hash(&key);
            let probe = self.table.probe(hash);
            self.table.prefetch_buckets(&probe);
            stages[i] = Some(Stage {
                key,
                hash,
                probe,
                cand: None,
                cls,
            });
        }
        // Pass 2: signature match in the first bucket, prefetch entry and rule. A key
        // not in its first bucket has its second one prefetched and is matched in pass
        // 2b, so that read overlaps the rest of this pass instead of stalling it.
        let window = self.cfg.elephant.is_some();
        let mut far = [0u8; MAX_BATCH];
        let mut n_far = 0;
        for (i, st) in stages[..descs.len()].iter_mut().enumerate() {
            let Some(st) = st else { continue };
            st.cand = match self.table.candidate_near(&st.probe) {
                Near::Hit(c) => {
                    // Elephant detection counts every hit in its window.
                    self.table.prefetch_entry(c, window);
                    Some(c)
                }
                Near::Far => {
                    self.table.prefetch_far(&st.probe);
                    far[n_far] = i as u8;
                    n_far += 1;
                    None
                }
                Near::Absent => None,
            };
        }
        // Pass 2b: the second buckets.
        for &i in &far[..n_far] {
            if let Some(st) = &mut stages[i as usize] {
                st.cand = self.table.candidate_far(&st.probe);
                if let Some(c) = st.cand {
                    self.table.prefetch_entry(c, window);
                }
            }
        }
        // Pass 3: confirm, act or miss. Per-tenant counts: a run of packets of one VNI
        // (the common case within a batch) adds up in locals; the VNI table is read and
        // the tenant's counters written only when the VNI changes, and after the pass.
        // `cur_tenant` follows the run, for `drop`.
        let mut run_vni = u32::MAX; // no 24-bit VNI
        let (mut run_packets, mut run_bytes) = (0u64, 0u64);
        let fresh_n = u64::from(fresh);
        for (i, d) in descs.iter_mut().enumerate() {
            let Some(st) = &stages[i] else { continue };
            if st.cls.vni != run_vni {
                self.tenants.add(self.cur_tenant, run_packets, run_bytes);
                (run_packets, run_bytes) = (0, 0);
                run_vni = st.cls.vni;
                self.cur_tenant = self.tenants.slot(run_vni);
            }
            run_packets += fresh_n;
            run_bytes += fresh_n * u64::from(d.len);
            let traced = tracing && self.trace_wants(st);
            let snap = if traced {
                Some(self.trace_begin(region, d, st, fresh))
            } else {
                None
            };
            let hit = self.table.confirm(&st.probe, st.cand, &st.key);
            let mut expired = false;
            match hit {
                Some(idx) => {
                    let timeout = self.ctx.timeout_ms(self.table.rule(idx).timeout_class);
                    if age(now, self.table.entry(idx).last_seen) > timeout {
                        let old = self.table.expire(idx);
                        self.ctx.release(&old);
                        self.stats.expired += 1;
                        expired = true;
                        self.miss(region, d, st, now);
                    } else {
                        self.stats.hits += 1;
                        self.table.touch(idx, now);
                        if let L4::Tcp { flags, .. } = st.cls.ip.l4 {
                            self.watch_tcp(idx, flags);
                        }
                        // A policed tenant's flows stay here: the fast path has no policer.
                        if let Some(p) = self.cfg.elephant {
                            if !self.tenants.policed[self.cur_tenant] {
                                self.detect_elephant(&p, idx, d.len, now);
                            }
                        }
                        self.apply(region, d, &st.cls, idx, now);
                    }
                }
                None => self.miss(region, d, st, now),
            }
            if let Some(s) = snap {
                let hit = if expired { None } else { hit };
                self.trace_end(s, region, d, hit, expired, now);
            }
        }
        self.tenants.add(self.cur_tenant, run_packets, run_bytes);
        self.cur_tenant = 0;
        if !self.esp_jobs.is_empty() {
            self.run_esp(region, descs, now, fresh);
        }
        if tracing {
            if let Some(t) = self.trace.as_mut() {
                t.flush_counts();
            }
        }
    }

    /// A VPC frame (VXLAN) whose inner IPv4 packet is for one of `g`'s tunnels: the
    /// job that seals it. Checked before the flow table, so a tunnel's flows need no
    /// rule.
    #[inline]
    fn esp_outbound(&self, g: &ipsec::Gateway, data: &[u8]) -> Option<ipsec::Dir> {
        let v = packet::vxlan_fast(data, self.cfg.parse.vxlan_port)?;
        if !g.has_vni(v.vni) {
            return None;
        }
        let (o, e) = (v.inner_off as usize, v.inner_end as usize);
        // Untagged inner Ethernet carrying IPv4 (what a VPC host's VXLAN device sends).
        let inner = data.get(o..e)?;
        if inner.len() < 14 + 20 || inner[12] != 0x08 || inner[13] != 0x00 || inner[14] >> 4 != 4 {
            return None;
        }
        let ip = &inner[14..];
        let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
        if total < 20 || total > ip.len() {
            return None;
        }
        let src = std::net::Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
        let dst = std::net::Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
        let tunnel = g.outbound_tunnel(v.vni, src, dst)?;
        let ip_off = (o + 14) as u16;
        Some(ipsec::Dir::Out {
            tunnel,
            ip_off,
            ip_end: ip_off + total as u16,
        })
    }

    #[inline]
    fn esp_job(&mut self, i: usize, d: &Desc, dir: ipsec::Dir) {
        self.esp_idx.push(i as u16);
        self.esp_jobs.push(ipsec::Job {
            slot: d.base as usize,
            cap: d.cap as usize,
            start: d.base as usize + d.off as usize,
            len: d.len as usize,
            dir,
            outcome: ipsec::Outcome::Pending,
        });
    }

    /// Hand the chunk's ESP and tunnel frames to the gateway in one call, then set their
    /// verdicts and count them like any other packet.
    #[cold]
    #[inline(never)]
    fn run_esp(&mut self, region: &mut [u8], descs: &mut [Desc], now: u32, fresh: bool) {
        let mut jobs = std::mem::take(&mut self.esp_jobs);
        let mut idx = std::mem::take(&mut self.esp_idx);
        if let Some(g) = self.ipsec.as_deref_mut() {
            g.process(region, &mut jobs, now);
        }
        for (j, &i) in jobs.iter().zip(idx.iter()) {
            let d = &mut descs[usize::from(i)];
            match j.outcome {
                ipsec::Outcome::Tx {
                    start, len, vni, ..
                } => {
                    let slot = self.tenants.slot(vni);
                    if fresh {
                        self.tenants.add(slot, 1, u64::from(d.len));
                    }
                    d.off = (start - d.base as usize) as u16;
                    d.len = len as u16;
                    d.verdict = Verdict::Tx(0);
                    self.stats.tx_packets += 1;
                    self.stats.tx_bytes += len as u64;
                }
                ipsec::Outcome::Drop(r) => self.drop(d, DropReason::Esp(r)),
                ipsec::Outcome::Pending => self.drop(d, DropReason::NoRule),
            }
        }
        jobs.clear();
        idx.clear();
        self.esp_jobs = jobs;
        self.esp_idx = idx;
    }

    /// Whether the trace takes this packet (armed only).
    #[cold]
    #[inline(never)]
    fn trace_wants(&mut self, st: &Stage) -> bool {
        let tenant = (self.cur_tenant != 0).then(|| self.tenants.ids[self.cur_tenant]);
        match self.trace.as_mut() {
            Some(t) => t.wants(tenant, st.cls.vni, Some(&st.key)),
            None => false,
        }
    }

    fn tenant_of_vni(&self, vni: u32) -> Option<u32> {
        match self.tenants.slot(vni) {
            0 => None,
            s => Some(self.tenants.ids[s]),
        }
    }

    /// A traced packet's record as received, before its actions rewrite it, with the
    /// counters its outcome is read from.
    #[cold]
    #[inline(never)]
    fn trace_begin(
        &mut self,
        region: &[u8],
        d: &Desc,
        st: &Stage,
        fresh: bool,
    ) -> (Box<TracePacket>, u64, u64) {
        let snaplen = self.trace.as_ref().map_or(0, |t| t.snaplen);
        let data = d.data(region);
        let inner = (st.cls.inner_off != 0)
            .then(|| &data[st.cls.inner_off as usize..st.cls.inner_end as usize]);
        let seq = self.trace.as_mut().map_or(0, |t| t.next_seq());
        let p = TracePacket {
            tenant: (self.cur_tenant != 0).then(|| self.tenants.ids[self.cur_tenant]),
            vni: st.cls.vni,
            released: !fresh,
            key: Some(st.key),
            tcp_flags: match st.cls.ip.l4 {
                L4::Tcp { flags, .. } => Some(flags),
                _ => None,
            },
            parse: "ok".into(),
            ..TracePacket::received(seq, self.cfg.worker, data, inner, snaplen)
        };
        (Box::new(p), self.stats.rule_requests, self.stats.elephants)
    }

    /// Finish a traced packet's record after its lookup and actions, and emit it.
    #[cold]
    #[inline(never)]
    fn trace_end(
        &mut self,
        (mut p, requests, elephants): (Box<TracePacket>, u64, u64),
        region: &[u8],
        d: &Desc,
        hit: Option<u32>,
        expired: bool,
        now: u32,
    ) {
        let snaplen = self.trace.as_ref().map_or(0, |t| t.snaplen);
        match hit {
            Some(idx) => {
                p.lookup = Lookup::Hit { entry: idx };
                p.actions = Some(crate::format_actions(
                    &self.ctx.decompile(self.table.rule(idx)),
                ));
                p.offloaded = self.stats.elephants > elephants;
            }
            None => {
                let request = self.stats.rule_requests > requests;
                p.lookup = Lookup::Miss { expired, request };
                if d.verdict == Verdict::Held {
                    let t_us = self.latency_now_us(now);
                    let (key, seq) = (p.key, p.seq);
                    if let (Some(t), Some(k)) = (self.trace.as_mut(), key) {
                        t.watch(k, seq, t_us);
                    }
                }
            }
        }
        self.trace_verdict(&mut p, region, d, snaplen);
        if let Some(t) = self.trace.as_mut() {
            t.emit(TraceRecord::Packet(p));
        }
    }

    fn trace_verdict(&self, p: &mut TracePacket, region: &[u8], d: &Desc, snaplen: usize) {
        match d.verdict {
            Verdict::Tx(port) => {
                p.verdict = format!("tx {port}");
                let out = d.data(region);
                p.out = out[..out.len().min(snaplen)].to_vec();
                p.out_len = out.len() as u32;
            }
            Verdict::Drop(r) => {
                p.verdict = "drop".into();
                p.drop_reason = Some(self.drop_name(r));
            }
            Verdict::Held => p.verdict = "held".into(),
            Verdict::Pending => p.verdict = "pending".into(),
        }
    }

    /// A packet dropped before it had a flow key (a parse error, a later fragment):
    /// traced when the filter asks for no flow fields.
    #[cold]
    #[inline(never)]
    fn trace_unkeyed(&mut self, region: &[u8], d: &Desc, r: DropReason, fresh: bool) {
        let data = d.data(region);
        let v = packet::vxlan_fast(data, self.cfg.parse.vxlan_port);
        let vni = v.map_or(0, |v| v.vni);
        let tenant = self.tenant_of_vni(vni);
        let Some(t) = self.trace.as_mut() else { return };
        if !t.wants(tenant, vni, None) {
            return;
        }
        let snaplen = t.snaplen;
        let seq = t.next_seq();
        let inner = v.map(|v| &data[v.inner_off as usize..v.inner_end as usize]);
        let mut p = TracePacket {
            tenant,
            vni,
            released: !fresh,
            parse: self.drop_name(r),
            ..TracePacket::received(seq, self.cfg.worker, data, inner, snaplen)
        };
        self.trace_verdict(&mut p, region, d, snaplen);
        if let Some(t) = self.trace.as_mut() {
            t.emit(TraceRecord::Packet(Box::new(p)));
        }
    }

    /// FM's answer to a traced miss.
    #[cold]
    #[inline(never)]
    fn trace_decision(&mut self, reply: &RuleReply, installed: bool, now: u32) {
        let now_us = self.latency_now_us(now);
        let Some(t) = self.trace.as_mut() else { return };
        let Some((for_seq, t0)) = t.unwatch(&reply.key) else {
            return;
        };
        let d = TraceDecision {
            ts_us: wall_us(),
            worker: self.cfg.worker,
            for_seq,
            key: reply.key,
            result: match &reply.result {
                Ok(r) => Ok(crate::format_actions(&r.actions)),
                Err(e) => Err(e.clone()),
            },
            also: reply
                .also
                .iter()
                .map(|r| format!("{}: {}", r.key, crate::format_actions(&r.actions)))
                .collect(),
            installed,
            decided_by: reply.decided_by.to_string(),
            after_us: now_us.saturating_sub(t0),
        };
        t.emit(TraceRecord::Decision(Box::new(d)));
    }

    /// Zeta's single read/write window count; a flow crossing the policy's threshold
    /// is queued once for the fast path (the offloaded mark stops it queueing again).
    #[inline]
    fn detect_elephant(&mut self, p: &ElephantPolicy, idx: u32, len: u16, now: u32) {
        let Some(w) = self.table.window_mut(idx) else {
            return;
        };
        if age(now, w.start) > p.window_ms {
            w.start = now;
            w.packets = 1;
            w.bytes = u64::from(len);
        } else {
            w.packets = w.packets.saturating_add(1);
            w.bytes += u64::from(len);
        }
        if (w.bytes >= p.bytes || w.packets >= p.packets)
            && !self.table.entry(idx).is_offloaded()
            && self.elephants.len() < MAX_QUEUED_ELEPHANTS
        {
            // Marked before the fast path has it: a flow the fast path refuses stays
            // marked, so it is not offered again on every packet.
            self.table.set_offloaded(idx, true);
            self.stats.elephants += 1;
            self.elephants.push(self.table.entry(idx).key);
        }
    }

    /// The hit path's TCP check: one flag test unless the packet may be news (a first
    /// pure ACK, or a first FIN/RST, on a flow's forward rule; a first FIN/RST on its
    /// linked reply rule, such as a server's RST).
    #[inline(always)]
    fn watch_tcp(&mut self, idx: u32, tcp: u8) {
        use packet::tcp_flags::{ACK, FIN, RST, SYN};
        let f = self.table.flags(idx);
        if f & (REPORTS | REPLY_OF) == 0 {
            return;
        }
        if f & REPLY_OF != 0 {
            if tcp & (FIN | RST) != 0 {
                self.notice_reply_closing(idx);
            }
            return;
        }
        if tcp & (FIN | RST) != 0 {
            if f & CLOSING_SEEN == 0 {
                self.notice_tcp(idx, CLOSING_SEEN, NoticeKind::TcpClosing);
            }
        } else if tcp & (ACK | SYN) == ACK && f & ESTABLISHED_SEEN == 0 {
            self.notice_tcp(idx, ESTABLISHED_SEEN, NoticeKind::TcpEstablished);
        }
    }

    /// A FIN or RST on a reply rule: `TcpClosing` for its flow, reported on the forward
    /// rule's key (the one SC knows), once per flow whichever direction closes first.
    #[cold]
    #[inline(never)]
    fn notice_reply_closing(&mut self, reply: u32) {
        let Some(fwd) = self.table.companion(reply) else {
            return;
        };
        if self.table.flags(fwd) & CLOSING_SEEN == 0 {
            self.notice_tcp(fwd, CLOSING_SEEN, NoticeKind::TcpClosing);
        }
    }

    #[cold]
    #[inline(never)]
    fn notice_tcp(&mut self, idx: u32, flag: u16, kind: NoticeKind) {
        // Marked even if the queue is full: a notice is reported once or counted lost,
        // never retried per packet.
        self.table.set_flags(idx, flag);
        let key = self.table.entry(idx).key;
        self.notice(kind, key);
    }

    fn notice(&mut self, kind: NoticeKind, key: FlowKey) {
        let Some(b) = self.vpcs.get(&key.vni()).copied().or(self.default_binding) else {
            self.stats.notices_unbound += 1;
            return;
        };
        if self.notices.len() >= self.cfg.notices.queue {
            self.stats.notices_dropped += 1;
            return;
        }
        self.stats.notices += 1;
        self.notices.push(FlowNotice {
            kind,
            key,
            tenant: b.tenant,
            chain: b.chain,
        });
    }

    /// One step of the activity walk: start a walk every `active_period_ms`, and
    /// report flows (forward rules) seen since the previous walk started.
    fn walk_active(&mut self, now: u32) {
        let period = self.cfg.notices.active_period_ms;
        if period == 0 {
            return;
        }
        let i = match self.active_walk {
            Some(i) => i,
            None => {
                if self
                    .active_prev
                    .is_some_and(|p| now.wrapping_sub(p) < period)
                {
                    return;
                }
                self.active_started = now;
                0
            }
        };
        // Paced like the counter report pass (`report_budget`): a walk that reported a
        // whole table's active flows at once sent FM and the SC chains one burst every
        // period, ahead of every tenant's rule requests.
        let slots = self.table.slots();
        let budget = report_budget(
            age(now, self.active_started),
            period,
            i,
            slots,
            self.cfg.notices.active_budget.max(1),
        );
        if budget == 0 && i < slots {
            self.active_walk = Some(i);
            return;
        }
        // Seen since the previous walk started (before the first walk, everything
        // installed counts). Compared with that start, not with this walk's: a paced
        // walk reaches a slot long after it started, and a flow hit in between is still
        // active.
        let prev = self.active_prev;
        let end = (i + budget).min(slots);
        for j in i..end {
            let e = self.table.entry(j as u32);
            if !e.is_live() || self.table.flags(j as u32) & REPORTS == 0 {
                continue;
            }
            // Either direction keeps the flow alive: one-way inbound traffic (a download
            // over UDP) hits only the reply rule.
            let last_seen = match self.table.companion(j as u32) {
                Some(r) => newer(e.last_seen, self.table.entry(r).last_seen),
                None => e.last_seen,
            };
            if prev.is_none_or(|p| (last_seen.wrapping_sub(p) as i32) >= 0) {
                let key = e.key;
                self.notice(NoticeKind::Active, key);
            }
        }
        if end >= slots {
            self.active_walk = None;
            self.active_prev = Some(self.active_started);
        } else {
            self.active_walk = Some(end);
        }
    }

    /// Flow notices since the last call, for SC (through FM).
    pub fn take_notices(&mut self) -> Vec<FlowNotice> {
        std::mem::take(&mut self.notices)
    }

    /// Flows that became elephants since the last call, marked offloaded in the table.
    /// The fast path installs each one's rule, or calls [`Pipeline::unmark_offloaded`].
    pub fn take_elephants(&mut self) -> Vec<FlowKey> {
        std::mem::take(&mut self.elephants)
    }

    /// Removals and replacements of offloaded flows' rules since the last call.
    pub fn take_offload_events(&mut self) -> Vec<crate::table::OffloadEvent> {
        self.drain_finals();
        // The fast path follows the events it takes now before it asks again, so keys
        // gone before the previous drain are done with.
        self.reports.gone_prev = std::mem::take(&mut self.reports.gone);
        self.table.take_offload_events()
    }

    /// Counter reports queued since the last call (see [`CounterReportConfig`]).
    pub fn take_counter_reports(&mut self, out: &mut Vec<CounterReport>) {
        out.append(&mut self.reports.queue);
    }

    /// Queue every counted rule's counts now, up to the queue's room (shutdown, or a
    /// test that will not wait for the interval). Returns whether all fit.
    pub fn report_all_counters(&mut self) -> bool {
        let Some(rc) = self.cfg.counter_reports else {
            return true;
        };
        self.drain_finals();
        self.reports.scanning = false;
        let (vpcs, default, queue) = (&self.vpcs, self.default_binding, &mut self.reports.queue);
        let mut queued = 0u64;
        // Restart the hand so that one call covers the whole arena.
        self.table.restart_report_pass();
        let done = self.table.report_counters(usize::MAX, |k, p, b| {
            if queue.len() >= rc.queue {
                return false;
            }
            queue.push(report_of(vpcs, default, k, p, b));
            queued += 1;
            true
        });
        self.stats.counter_reports += queued;
        done
    }

    fn drain_finals(&mut self) {
        if self.cfg.counter_reports.is_none() {
            return;
        }
        let mut finals = std::mem::take(&mut self.reports.finals);
        let mut gone = std::mem::take(&mut self.reports.gone);
        self.table.take_finals(&mut finals, &mut gone);
        self.reports.gone = gone;
        for (k, p, b) in finals.drain(..) {
            self.queue_report(&k, p, b, true);
        }
        self.reports.finals = finals;
    }

    /// Queue a report; a full queue drops it, counted, when it is a final one.
    fn queue_report(&mut self, key: &FlowKey, packets: u64, bytes: u64, last: bool) -> bool {
        let Some(rc) = self.cfg.counter_reports else {
            return false;
        };
        if self.reports.queue.len() >= rc.queue {
            if last {
                self.stats.counter_reports_dropped += 1;
            }
            return false;
        }
        let r = report_of(&self.vpcs, self.default_binding, key, packets, bytes);
        self.reports.queue.push(r);
        self.stats.counter_reports += 1;
        true
    }

    /// Between batches: queue the counts of rules that left, and move the report pass on.
    fn service_reports(&mut self, rc: CounterReportConfig, now: u32) {
        self.drain_finals();
        let r = &mut self.reports;
        if !r.scanning && (!r.started || age(now, r.pass_start) >= rc.interval_ms) {
            r.scanning = true;
            r.started = true;
            r.pass_start = now;
        }
        if !r.scanning {
            return;
        }
        let (cursor, len) = self.table.report_position();
        let budget = report_budget(
            age(now, r.pass_start),
            rc.interval_ms,
            cursor,
            len,
            rc.scan_per_service,
        );
        if budget == 0 && cursor < len {
            return;
        }
        let (vpcs, default, queue) = (&self.vpcs, self.default_binding, &mut r.queue);
        let mut queued = 0u64;
        let mut full = false;
        let done = self.table.report_counters(budget, |k, p, b| {
            if queue.len() >= rc.queue {
                full = true;
                return false;
            }
            queue.push(report_of(vpcs, default, k, p, b));
            queued += 1;
            true
        });
        self.stats.counter_reports += queued;
        if full {
            self.stats.counter_report_queue_full += 1;
        }
        if done {
            self.reports.scanning = false;
        }
    }

    /// The installed rule of `key`, rebuilt from its compiled form.
    pub fn rule_of(&self, key: &FlowKey) -> Option<Rule> {
        let i = self.table.lookup(key)?;
        Some(Rule {
            key: *key,
            actions: self.ctx.decompile(self.table.rule(i)),
            idle_timeout: None,
        })
    }

    /// Give `key` back to the userspace path: it may be detected again later.
    pub fn unmark_offloaded(&mut self, key: &FlowKey) {
        if let Some(i) = self.table.lookup(key) {
            self.table.set_offloaded(i, false);
            if let Some(w) = self.table.window_mut(i) {
                (w.packets, w.bytes) = (0, 0);
            }
        }
    }

    /// Add what the fast path did for `key` since the last fold to the rule's, tenant's
    /// and pipeline's counters, so stats add up wherever the packets went. With `seen`,
    /// also refresh the entry's idle clock: the flow is alive even though userspace
    /// does not see its packets. Returns false when the flow has no entry any more (its
    /// tenant's and the pipeline's counters still get the packets).
    pub fn fold_fastpath(
        &mut self,
        key: &FlowKey,
        packets: u64,
        bytes: u64,
        seen: Option<u32>,
    ) -> bool {
        self.stats.fastpath_packets += packets;
        self.stats.fastpath_bytes += bytes;
        let slot = self.tenants.slot(key.vni());
        self.tenants.add(slot, packets, bytes);
        let Some(i) = self.table.lookup(key) else {
            // A counted rule that left the table while offloaded: the driver's last
            // counts are still the flow's, and go out as a report of their own.
            if self.reports.gone_prev.contains(key) || self.reports.gone.contains(key) {
                self.queue_report(key, packets, bytes, true);
            }
            return false;
        };
        let c = self.table.counters_mut(i);
        c.packets += packets;
        c.bytes += bytes;
        if let Some(now) = seen {
            self.table.touch(i, now);
        }
        true
    }

    #[inline]
    fn drop(&mut self, d: &mut Desc, r: DropReason) {
        self.stats.drop(r);
        self.tenants.counters[self.cur_tenant].drops += 1;
        d.verdict = Verdict::Drop(r);
    }

    fn miss(&mut self, region: &[u8], d: &mut Desc, st: &Stage, now: u32) {
        self.stats.misses += 1;
        let RuleSource::Channel { requests, .. } = &self.source else {
            return self.drop(d, DropReason::NoRule);
        };
        let binding = match self.vpcs.get(&st.cls.vni).copied().or(self.default_binding) {
            Some(b) => b,
            None if self.cfg.ask_unbound => VpcBinding {
                tenant: 0,
                chain: 0,
            },
            None => return self.drop(d, DropReason::UnknownVni),
        };
        let now_us = self.latency_now_us(now);
        let new_flow = !self.pending.is_pending(&st.key, st.hash);
        // A flow already waiting for its rule has been admitted; only a new one spends
        // the tenant's request rate, before it can take pending-queue room.
        if let Some(p) = self.policer.as_mut() {
            if new_flow && !p.admit_request(binding.tenant, now_us) {
                return self.drop(d, DropReason::RateLimited);
            }
        }
        let held = match self
            .pending
            .hold(&st.key, st.hash, d.data(region), d.port, now, now_us)
        {
            Ok(h) => h,
            Err(r) => return self.drop(d, r),
        };
        d.verdict = Verdict::Held;
        if held.needs_request {
            let ip = &st.cls.ip;
            let req = RuleRequest {
                key: st.key,
                hash: st.key.hash(),
                tenant: binding.tenant,
                chain: binding.chain,
                meta: PacketMeta {
                    len: d.len,
                    tcp_flags: match ip.l4 {
                        L4::Tcp { flags, .. } => flags,
                        _ => 0,
                    },
                    icmp_error: ip.icmp_quote().is_some(),
                    ingress_port: d.port,
                },
                worker: self.cfg.worker,
                frame: None,
            };
            // Only the flow's first packet goes with the request: it heads the flow's
            // held packets, so if FM carries it on, the one to leave out on release is
            // the first (a retry after a full channel sends no frame).
            let frame = new_flow
                && self
                    .cfg
                    .first_frames
                    .as_ref()
                    .is_some_and(|f| f.load(std::sync::atomic::Ordering::Relaxed));
            let req = RuleRequest {
                frame: frame.then(|| d.data(region).into()),
                ..req
            };
            match requests.try_send(req) {
                Ok(()) => {
                    self.stats.rule_requests += 1;
                    self.pending.mark_requested(&st.key, st.hash);
                    if frame {
                        self.pending.mark_head_sent(&st.key, st.hash);
                    }
                }
                // The next packet of the flow retries; the pending timeout bounds it.
                Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                    self.stats.request_channel_full += 1
                }
            }
        }
    }

    /// Run rule `idx`'s actions on the packet.
    #[inline]
    fn apply(&mut self, region: &mut [u8], d: &mut Desc, cls: &Classified, idx: u32, now: u32) {
        let rule = *self.table.rule(idx);
        let f = rule.flags;
        if f & slot_flag::SLOT_COUNT != 0 {
            let c = self.table.counters_mut(idx);
            c.packets += 1;
            c.bytes += d.len as u64;
        }
        if f & slot_flag::SLOT_DROP != 0 {
            return self.drop(d, DropReason::Rule(rule.arg));
        }
        if f & slot_flag::SLOT_POLICE != 0 || self.tenants.policed[self.cur_tenant] {
            if let Some(p) = self.policer.as_mut() {
                let admitted = if f & slot_flag::SLOT_POLICE != 0 {
                    p.admit(rule.police, d.len as u32, now)
                } else {
                    p.admit_packet(self.tenants.ids[self.cur_tenant], d.len as u32, now)
                };
                if !admitted {
                    return self.drop(d, DropReason::Police);
                }
            }
        }
        let slot = d.slot_mut(region);
        let off = d.off as usize;
        let data = &mut slot[off..off + d.len as usize];
        if f & (slot_flag::SLOT_SRC_ADDR
            | slot_flag::SLOT_SRC_PORT
            | slot_flag::SLOT_DST_ADDR
            | slot_flag::SLOT_DST_PORT)
            != 0
        {
            let ip = &cls.ip;
            let quote = ip.icmp_quote();
            for (side, af, pf, a, p) in [
                (
                    Side::Src,
                    slot_flag::SLOT_SRC_ADDR,
                    slot_flag::SLOT_SRC_PORT,
                    rule.src_addr,
                    rule.sport,
                ),
                (
                    Side::Dst,
                    slot_flag::SLOT_DST_ADDR,
                    slot_flag::SLOT_DST_PORT,
                    rule.dst_addr,
                    rule.dport,
                ),
            ] {
                if f & (af | pf) == 0 {
                    continue;
                }
                let addr = if f & af != 0 { self.ctx.addr(a) } else { None };
                let port = (f & pf != 0).then_some(p);
                let res = match quote {
                    Some(q) => rewrite_icmp_error(data, ip, q, side, addr, port),
                    None => rewrite_endpoint(data, ip, side, addr, port),
                };
                if res.is_err() {
                    return self.drop(d, DropReason::RewriteFailed);
                }
            }
        }
        let (mut start, mut len) = (off, d.len as usize);
        if f & slot_flag::SLOT_DECAP != 0 && cls.inner_off != 0 {
            start = off + cls.inner_off as usize;
            len = (cls.inner_end - cls.inner_off) as usize;
        }
        if f & slot_flag::SLOT_ENCAP != 0 {
            let Some(nh) = self.ctx.nexthop(rule.nexthop) else {
                return self.drop(d, DropReason::RewriteFailed);
            };
            let o = packet::build::VXLAN_V4_OVERHEAD;
            if start < o {
                return self.drop(d, DropReason::NoHeadroom);
            }
            if let Some(m) = nh.inner_dmac {
                slot[start..start + 6].copy_from_slice(&m);
            }
            if let Some(m) = nh.inner_smac {
                slot[start + 6..start + 12].copy_from_slice(&m);
            }
            let sport = self.table.entry(idx).encap_sport;
            nh.encap.write(&mut slot[start - o..], len, sport);
            start -= o;
            len += o;
        }
        d.off = start as u16;
        d.len = len as u16;
        if f & slot_flag::SLOT_OUTPUT != 0 {
            self.stats.tx_packets += 1;
            self.stats.tx_bytes += len as u64;
            d.verdict = Verdict::Tx(rule.arg);
        } else {
            self.drop(d, DropReason::NoRule);
        }
    }

    /// Between batches: install rules that came back, release their held packets in order
    /// through `io`, expire waiting flows, and sweep idle ones. Returns packets released.
    pub fn service<B: PacketIo + ?Sized>(&mut self, io: &mut B, now: u32) -> usize {
        let mut released = 0;
        while let RuleSource::Channel { replies, .. } = &self.source {
            let Ok(reply) = replies.try_recv() else { break };
            released += self.on_reply(io, reply, now);
        }
        let mut keys = std::mem::take(&mut self.expired_keys);
        keys.clear();
        let dropped = self.pending.expire(now, &mut keys);
        for _ in 0..dropped {
            self.stats.drop(DropReason::PendingTimeout);
        }
        for (k, n) in &keys {
            let t = self.tenants.slot(k.vni());
            self.tenants.counters[t].drops += u64::from(*n);
        }
        self.expired_keys = keys;
        if self.trace.is_some() {
            let now_us = self.latency_now_us(now);
            let max_age = u64::from(self.cfg.pending.timeout_ms) * 1000 + 1_000_000;
            if let Some(t) = self.trace.as_mut() {
                t.expire_watch(now_us, max_age);
                if t.done() {
                    // Disarmed: the reader sees the channel close.
                    self.trace = None;
                }
            }
        }
        let ctx = &mut self.ctx;
        let budget = self.cfg.sweep_budget;
        let mut freed: Vec<RuleSlot> = Vec::new();
        let n = self.table.sweep(
            now,
            budget,
            |r| ctx.timeout_ms(r.timeout_class),
            |_, r| freed.push(*r),
        );
        for r in &freed {
            self.ctx.release(r);
        }
        self.stats.expired += n as u64;
        if let Some(g) = self.ipsec.as_deref_mut() {
            g.expire(now);
        }
        self.walk_active(now);
        if let Some(rc) = self.cfg.counter_reports {
            self.service_reports(rc, now);
        }
        released
    }

    fn on_reply<B: PacketIo + ?Sized>(
        &mut self,
        io: &mut B,
        mut reply: RuleReply,
        now: u32,
    ) -> usize {
        // Run after the reply's rules are installed and the flow's packets that were
        // here before it are released, in that order.
        self.inject_after = reply.inject.take();
        if reply.revoke {
            // An offloaded flow's removal reaches the fast path as an OffloadEvent.
            if self.remove_rule(&reply.key).is_some() {
                self.stats.rules_revoked += 1;
            }
            return 0;
        }
        for r in &reply.also {
            if let Err(e) = self.install_rule(r, now) {
                tracing::warn!(key = %r.key, error = %e, "companion rule does not compile");
            }
        }
        let hash = self.table.hash(&reply.key);
        let installed = match &reply.result {
            Ok(rule) => {
                if rule.key != reply.key {
                    tracing::warn!(key = %reply.key, rule = %rule.key, "reply rule for another key");
                    false
                } else {
                    match self.install_rule(rule, now) {
                        Ok(()) => {
                            // The rule for the key this PP asked about: the flow's events
                            // are reported on it.
                            if let Some(i) = self.table.lookup(&rule.key) {
                                self.table.set_flags(i, REPORTS);
                                // One companion is the flow's reply rule: link it, so
                                // FIN/RST and activity seen there reach SC too.
                                if let [reply_rule] = reply.also.as_slice() {
                                    if let Some(r) = self.table.lookup(&reply_rule.key) {
                                        self.table.link(i, r);
                                    }
                                }
                            }
                            true
                        }
                        Err(e) => {
                            tracing::warn!(key = %reply.key, error = %e, "rule does not compile");
                            false
                        }
                    }
                }
            }
            Err(e) => {
                tracing::debug!(key = %reply.key, error = %e, "rule request failed");
                false
            }
        };
        if self.trace.is_some() {
            self.trace_decision(&reply, installed, now);
        }
        let since_us = self.pending.held_since_us(&reply.key, hash);
        // FM carried the flow's first packet on to the next-hop node with our request:
        // releasing it too would send it twice.
        let skip = usize::from(
            installed && reply.frame_forwarded && self.pending.head_sent(&reply.key, hash),
        );
        let mut descs = std::mem::take(&mut self.released);
        descs.clear();
        let n = self.pending.take(&reply.key, hash, &mut descs);
        if n == 0 {
            self.released = descs;
            return self.inject_pending(io, now);
        }
        let t = self.tenants.slot(reply.key.vni());
        if installed {
            // A flow set up through the miss path: its first packet was held at
            // `since_us`, and its rule is installed now.
            if let Some(t0) = since_us {
                let t = self.latency_now_us(now);
                self.stats.setup_latency.observe_us(t.saturating_sub(t0));
            }
            self.tenants.counters[t].flows_setup += 1;
            self.stats.fabric_first_via_fm += skip as u64;
            // Held packets run through the normal pipeline, in arrival order; their rule
            // is now installed, so each one hits.
            let mut region = std::mem::take(self.pending.region_mut_vec());
            for chunk in descs[skip..].chunks_mut(MAX_BATCH) {
                self.process_chunk(&mut region, chunk, now, false);
            }
            *self.pending.region_mut_vec() = region;
            self.stats.pending_released += (n - skip) as u64;
            if let Err(e) = io.tx_from(self.pending.region_mut(), &descs[skip..]) {
                tracing::warn!(error = %e, "transmit of released packets failed");
            }
        } else {
            self.cur_tenant = t;
            for d in descs.iter_mut() {
                self.drop(d, DropReason::RuleError);
            }
            self.cur_tenant = 0;
        }
        self.pending.free(&descs);
        self.released = descs;
        n + self.inject_pending(io, now)
    }

    /// Run the frame FM carried here (`inject_after`) through the pipeline as if it had
    /// arrived over the fabric: counted as received, matched against the rule FM
    /// installed just before, and sent (or held as a miss, or dropped with its reason)
    /// like any packet. Returns 1 if one was injected.
    fn inject_pending<B: PacketIo + ?Sized>(&mut self, io: &mut B, now: u32) -> usize {
        let Some(frame) = self.inject_after.take() else {
            return 0;
        };
        self.stats.fabric_injected += 1;
        if frame.len() > crate::io::MAX_FRAME {
            // The FM client refuses these before they get here; one that does not fit a
            // slot is a bad header, as a received one would be.
            self.stats.drop(DropReason::BadHeader);
            return 1;
        }
        // A slot of its own, with the headroom an encap pushes into.
        let mut region = std::mem::take(&mut self.inject_region);
        region.resize(crate::io::FRAME_SIZE, 0);
        let off = crate::io::HEADROOM;
        region[off..off + frame.len()].copy_from_slice(&frame);
        let mut d = [Desc::new(0, off, frame.len(), crate::io::FRAME_SIZE, 0)];
        self.process_chunk(&mut region, &mut d, now, true);
        if matches!(d[0].verdict, Verdict::Tx(_)) {
            if let Err(e) = io.tx_from(&region, &d) {
                tracing::warn!(error = %e, "transmit of a fabric frame from FM failed");
            }
        }
        self.inject_region = region;
        1
    }
}

/// A report of `key`'s counts, with the tenant and chain of its VNI's binding.
fn report_of(
    vpcs: &HashMap<u32, VpcBinding>,
    default: Option<VpcBinding>,
    key: &FlowKey,
    packets: u64,
    bytes: u64,
) -> CounterReport {
    let b = vpcs.get(&key.vni()).copied().or(default);
    CounterReport {
        key: *key,
        tenant: b.map_or(0, |b| b.tenant),
        chain: b.map_or(0, |b| b.chain),
        packets,
        bytes,
    }
}

/// A worker: one pipeline driven by one I/O backend.
pub struct Worker<B: PacketIo> {
    pub pipeline: Pipeline,
    pub io: B,
    descs: Vec<Desc>,
    batch: usize,
    clock: Box<dyn Clock>,
}

impl<B: PacketIo> Worker<B> {
    pub fn new(mut pipeline: Pipeline, io: B, batch: usize, clock: Box<dyn Clock>) -> Self {
        pipeline.set_clock(clock.clone_box());
        Worker {
            pipeline,
            io,
            descs: Vec::with_capacity(batch),
            batch,
            clock,
        }
    }

    /// The worker's clock now, in the ms the pipeline's timestamps use.
    pub fn now_ms(&self) -> u32 {
        self.clock.now_ms()
    }

    /// Receive, process and transmit one batch, then service the miss path.
    /// Returns packets received.
    pub fn run_once(&mut self) -> Result<usize, crate::io::IoError> {
        let now = self.clock.now_ms();
        let n = self.io.rx(&mut self.descs, self.batch)?;
        if n > 0 {
            self.pipeline
                .process(self.io.region(), &mut self.descs, now);
            self.io.tx(&self.descs)?;
        }
        self.pipeline.service(&mut self.io, now);
        Ok(n)
    }

    /// Run until `stop` is set.
    pub fn run(&mut self, stop: &std::sync::atomic::AtomicBool) -> Result<(), crate::io::IoError> {
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            if self.run_once()? == 0 {
                std::thread::yield_now();
            }
        }
        Ok(())
    }
}
