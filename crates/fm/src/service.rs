//! FM's gRPC face: session streams for PP and SC nodes, status queries, and the task
//! that owns the [`Master`].

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::liveness::LivenessRegistry;
use proto::tls::Role;
use proto::v1::fabric_master_server::{FabricMaster, FabricMasterServer};
use proto::v1::{self, pp_down, pp_up, sc_down, sc_up};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn};

use crate::events::EventLog;
use crate::master::{
    DesiredChange, FmConfig, FmMetrics, FmStats, Master, Opened, Out, ScaleOutcome, ScaleRequest,
};
use crate::FmError;

#[cfg(feature = "fuzzing")]
pub mod fuzzing;

type PpTx = DownTx<v1::PpDown>;
type ScTx = DownTx<v1::ScDown>;
type ScaleDone = oneshot::Sender<Result<ScaleOutcome, String>>;

/// The master task's input: what the session readers and the RPCs send it. Queries
/// carry the channel their answer goes back on.
enum MasterIn {
    PpOpen {
        open: Opened,
        tx: PpTx,
    },
    PpRequests {
        session: u64,
        requests: Vec<v1::RuleRequest>,
    },
    PpEvents {
        events: Vec<v1::FlowEvent>,
    },
    ScOpen {
        open: Opened,
        tx: ScTx,
    },
    ScResults {
        session: u64,
        results: v1::GroupResults,
    },
    ScFin {
        fin: v1::ScaleFin,
    },
    /// The groups an SC node hosts, sent right after its registration.
    ScHosted {
        session: u64,
        node: String,
        groups: Vec<v1::HostedGroup>,
    },
    Heartbeat {
        session: u64,
        node: String,
        load: Option<v1::Load>,
    },
    Closed {
        session: u64,
        node: String,
    },
    Members(oneshot::Sender<v1::MembershipView>),
    Map(oneshot::Sender<v1::PartitionMap>),
    Stats(oneshot::Sender<FmStats>),
    Metrics(oneshot::Sender<FmMetrics>),
    /// The orchestrator's desired configuration: tenant chains and their partitions.
    SetDesired {
        chains: Vec<v1::ChainConfig>,
        partitions: Vec<v1::Partition>,
        shards: Vec<v1::TenantShards>,
        done: oneshot::Sender<DesiredChange>,
    },
    Flows(v1::FlowsRequest, oneshot::Sender<v1::FlowsReply>),
    /// Drop every cached rule (pinned ones stay); answers how many were dropped.
    ClearCache(oneshot::Sender<usize>),
    Scale(ScaleRequest, ScaleDone),
    Events(v1::EventsRequest, oneshot::Sender<v1::EventsReply>),
    RecordEvent(v1::RecordEventRequest, oneshot::Sender<Result<u64, String>>),
    Load(oneshot::Sender<v1::LoadReply>),
    VipMap(oneshot::Sender<v1::VipMapReply>),
    PpDrain(String, oneshot::Sender<Result<v1::VipMapReply, Status>>),
    VipMove(
        v1::VipMoveRequest,
        oneshot::Sender<Result<v1::VipMapReply, Status>>,
    ),
}

impl MasterIn {
    /// Whether this goes on the master's control lane, which it always serves before
    /// the data lane: heartbeats and read-only queries. Session opens and closes stay
    /// on the data lane, in order with the session's requests and results.
    fn is_control(&self) -> bool {
        matches!(
            self,
            MasterIn::Heartbeat { .. }
                | MasterIn::Members(_)
                | MasterIn::Map(_)
                | MasterIn::Stats(_)
                | MasterIn::Metrics(_)
                | MasterIn::Load(_)
                | MasterIn::Events(..)
                | MasterIn::VipMap(_)
                | MasterIn::Flows(..)
        )
    }
}

/// Counters kept outside the master task (by the stream readers).
#[derive(Debug, Default)]
pub struct FmWireCounters {
    /// Messages that did not decode, or broke the session protocol.
    pub bad_messages: AtomicU64,
    pub sessions: AtomicU64,
    /// Rule requests a PP session's reader answered with
    /// [`proto::ERR_SETUP_OVERLOAD`] because the master's queue was over
    /// `FmConfig::max_queued` (counted into `FmStats::setup_overload` too).
    pub setup_overload: AtomicU64,
    /// Messages dropped because their session's down queue was full.
    pub down_full: Arc<DownFullCounters>,
}

/// Messages not sent down a session because its queue already held
/// `FmConfig::max_down_queue` messages or `FmConfig::max_down_bytes` bytes (the node
/// reads slower than FM writes). Only what the node asks for again is dropped this way;
/// control messages always go.
#[derive(Debug, Default)]
pub struct DownFullCounters {
    /// Rule reply batches to a PP node: its pending flows time out and ask again.
    pub replies: AtomicU64,
    /// First packets for a fabric next hop: lost, as a full link would lose them.
    pub frames: AtomicU64,
    /// Request-only submits to an SC group head: FM retries them when unanswered.
    pub submits: AtomicU64,
}

/// A session's down stream as FM writes it: an unbounded channel, so the master task
/// never waits on a node, and the count and encoded size of the messages in it, which
/// `Links::deliver` bounds by dropping what the node asks for again (see
/// [`DownFullCounters`]). Why not a bounded channel: a full one would make the master
/// block or lose control messages (a group's configuration, a vIP move) along with the
/// droppable ones.
pub(crate) struct DownTx<D> {
    tx: DownSender<D>,
    queued: Arc<DownQueued>,
}

/// What waits in one down stream.
#[derive(Debug, Default)]
struct DownQueued {
    messages: AtomicUsize,
    bytes: AtomicUsize,
}

impl DownQueued {
    fn add(&self, bytes: usize) {
        self.messages.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    fn sub(&self, bytes: usize) {
        self.messages.fetch_sub(1, Ordering::Relaxed);
        self.bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    /// Whether the stream holds as much as `bound` allows.
    fn full(&self, bound: DownBound) -> bool {
        self.messages.load(Ordering::Relaxed) >= bound.messages
            || self.bytes.load(Ordering::Relaxed) >= bound.bytes
    }

    /// Queue `msg` on `tx`, counted in; false (and counted out) if the stream is gone.
    /// The master's [`DownTx`] and a PP reader's shed replies both send through here.
    fn send<D: prost::Message>(&self, tx: &DownSender<D>, msg: D) -> bool {
        let bytes = msg.encoded_len();
        self.add(bytes);
        if tx.send((Ok(msg), bytes)).is_err() {
            self.sub(bytes);
            return false;
        }
        true
    }
}

/// A down channel's sending end: each message with its encoded size.
type DownSender<D> = mpsc::UnboundedSender<(Result<D, Status>, usize)>;

/// How much one session's down stream may hold before droppable messages are dropped
/// (`FmConfig::max_down_queue`, `FmConfig::max_down_bytes`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct DownBound {
    pub messages: usize,
    pub bytes: usize,
}

impl DownBound {
    pub(crate) fn of(cfg: &FmConfig) -> Self {
        DownBound {
            messages: cfg.max_down_queue.max(1),
            bytes: cfg.max_down_bytes.max(1),
        }
    }
}

impl<D: prost::Message> DownTx<D> {
    /// Queue `msg`; false if the stream is gone.
    fn send(&self, msg: D) -> bool {
        self.queued.send(&self.tx, msg)
    }
}

impl<D> DownTx<D> {
    fn queued(&self) -> usize {
        self.queued.messages.load(Ordering::Relaxed)
    }

    fn queued_bytes(&self) -> usize {
        self.queued.bytes.load(Ordering::Relaxed)
    }

    fn full(&self, bound: DownBound) -> bool {
        self.queued.full(bound)
    }
}

/// The node's side of a `DownTx`: what tonic writes to the node, counted out as it is
/// taken.
pub struct DownStream<D> {
    rx: mpsc::UnboundedReceiver<(Result<D, Status>, usize)>,
    queued: Arc<DownQueued>,
}

impl<D> DownStream<D> {
    /// A message if one is queued (the fuzz harness drains with it).
    #[cfg_attr(not(feature = "fuzzing"), allow(dead_code))]
    pub(crate) fn try_recv(&mut self) -> Option<Result<D, Status>> {
        let (m, bytes) = self.rx.try_recv().ok()?;
        self.queued.sub(bytes);
        Some(m)
    }
}

impl<D> tokio_stream::Stream for DownStream<D> {
    type Item = Result<D, Status>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        match self.rx.poll_recv(cx) {
            std::task::Poll::Ready(Some((m, bytes))) => {
                self.queued.sub(bytes);
                std::task::Poll::Ready(Some(m))
            }
            std::task::Poll::Ready(None) => std::task::Poll::Ready(None),
            std::task::Poll::Pending => std::task::Poll::Pending,
        }
    }
}

/// A session's down channel: the master's end and the stream's.
pub(crate) fn down_channel<D>() -> (DownTx<D>, DownStream<D>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let queued = Arc::new(DownQueued::default());
    (
        DownTx {
            tx,
            queued: queued.clone(),
        },
        DownStream { rx, queued },
    )
}

struct Shared {
    /// The master's data lane: session opens, requests, results, closes, and changes.
    tx: mpsc::UnboundedSender<MasterIn>,
    /// The master's control lane (see [`MasterIn::is_control`]), served first: a full
    /// data lane never delays a heartbeat's load report or a status query.
    ctl: mpsc::UnboundedSender<MasterIn>,
    /// Rule requests on the data lane not yet taken by the master.
    queued: Arc<AtomicUsize>,
    /// Bound on `queued` (`FmConfig::max_queued`).
    max_queued: usize,
    /// `FmConfig::max_down_queue`, `FmConfig::max_down_bytes`.
    max_down: DownBound,
    /// Epoch of FM's millisecond clock.
    start: Instant,
    next_session: AtomicU64,
    wire: FmWireCounters,
    stopped: AtomicBool,
    tasks: Mutex<Vec<AbortHandle>>,
    /// The liveness lane's sessions by token, and its thread's stop flag.
    liveness: Arc<LivenessRegistry>,
    liveness_stop: Arc<AtomicBool>,
    tls: Option<Arc<proto::tls::NodeTls>>,
}

impl Shared {
    fn spawn<F>(&self, f: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let h = tokio::spawn(f).abort_handle();
        let mut v = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        if v.len() > 64 {
            v.retain(|t| !t.is_finished());
        }
        v.push(h);
    }

    fn bad(&self) {
        self.wire.bad_messages.fetch_add(1, Ordering::Relaxed);
    }

    /// Count `requests` into the master's queue, or, if that would take it over its
    /// bound, refuse them all: Err holds their `setup-overload` replies.
    fn admit(
        &self,
        requests: Vec<v1::RuleRequest>,
    ) -> Result<Vec<v1::RuleRequest>, Vec<v1::RuleReply>> {
        let n = requests.len();
        let before = self.queued.fetch_add(n, Ordering::Relaxed);
        if before + n <= self.max_queued || before == 0 {
            return Ok(requests);
        }
        self.queued.fetch_sub(n, Ordering::Relaxed);
        self.wire
            .setup_overload
            .fetch_add(n as u64, Ordering::Relaxed);
        Err(requests
            .iter()
            .map(|r| v1::RuleReply {
                decided_by: "FM".into(),
                ..proto::error_reply(r, proto::ERR_SETUP_OVERLOAD)
            })
            .collect())
    }

    /// Hand the master `msg` on its lane; Err if the master is gone.
    fn send(&self, msg: MasterIn) -> Result<(), ()> {
        let lane = if msg.is_control() {
            &self.ctl
        } else {
            &self.tx
        };
        lane.send(msg).map_err(|_| ())
    }

    fn mark_seen(&self, seen: &AtomicU64) {
        seen.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Send the master task a message carrying a reply channel and await the reply;
    /// None if the master is gone.
    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> MasterIn) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        self.send(make(tx)).ok()?;
        rx.await.ok()
    }
}

/// A running fabric master.
pub struct FmHandle {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

/// Start a fabric master on the current tokio runtime, listening on `listen`.
pub async fn start(cfg: FmConfig, listen: SocketAddr) -> Result<FmHandle, FmError> {
    let chains = cfg
        .chains
        .iter()
        .map(|c| {
            c.to_proto()
                .map_err(|e| FmError::Config(format!("tenant {} chain {}: {e}", c.tenant, c.chain)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| FmError::Io(format!("bind {listen}: {e}")))?;
    let addr = listener
        .local_addr()
        .map_err(|e| FmError::Io(e.to_string()))?;
    let (tx, rx) = mpsc::unbounded_channel();
    let (ctl, ctl_rx) = mpsc::unbounded_channel();
    let start = Instant::now();
    let queued = Arc::new(AtomicUsize::new(0));
    let shared = Arc::new(Shared {
        tx,
        ctl,
        queued: queued.clone(),
        max_queued: cfg.max_queued.max(1),
        max_down: DownBound::of(&cfg),
        start,
        next_session: AtomicU64::new(1),
        wire: FmWireCounters::default(),
        stopped: AtomicBool::new(false),
        tasks: Mutex::new(Vec::new()),
        liveness: Arc::new(LivenessRegistry::new(start)),
        liveness_stop: Arc::new(AtomicBool::new(false)),
        tls: cfg.tls.clone(),
    });
    let liveness_port =
        crate::liveness::start_or_warn(addr, shared.liveness.clone(), shared.liveness_stop.clone());
    let heartbeat = cfg.tick_period();
    let max_down = DownBound::of(&cfg);
    // Opened before anything listens, so a bad path fails the start, not a later event.
    let events = match &cfg.events_file {
        Some(p) => Some(EventLog::with_file(cfg.events_capacity, p)?),
        None => None,
    };
    let mut master = Master::new(cfg, chains);
    if let Some(events) = events {
        master.events = events;
    }
    master.liveness_port = liveness_port;
    let lanes = MasterLanes {
        ctl: ctl_rx,
        data: rx,
        queued,
    };
    let links = Links::new(max_down, shared.wire.down_full.clone());
    shared.spawn(run_master(master, lanes, links, heartbeat, start));
    let svc = FabricMasterServer::new(FmService {
        shared: shared.clone(),
    })
    .max_decoding_message_size(proto::MAX_MESSAGE)
    .max_encoding_message_size(proto::MAX_MESSAGE);
    // PP and SC nodes hold sessions; the orchestrator asks for state and scales.
    let incoming = proto::tls::incoming(
        listener,
        shared.tls.clone(),
        &[Role::Pp, Role::Sc, Role::Orchestrator, Role::Operator],
    )
    .map_err(|e| FmError::Io(e.to_string()))?;
    shared.spawn(async move {
        if let Err(e) = proto::server()
            .add_service(svc)
            .serve_with_incoming(incoming)
            .await
        {
            warn!(error = %e, "FM server stopped");
        }
    });
    info!(%addr, "fabric master listening");
    Ok(FmHandle { addr, shared })
}

/// Longest the master works through queued input before it flushes and yields.
const MAX_BURST: std::time::Duration = std::time::Duration::from_millis(2);

/// Within a burst, the master flushes each time it has taken this many requests and
/// results (PP's largest batch). Flushing only at the burst's end kept a window of
/// new flows together as one clump that the stages worked on in turn, PP, FM, the
/// chain, each idle while another had it; flushing every 256 lets SC start on the
/// first part while FM takes the rest (docs/setup-path.md, "Clumps").
const FLUSH_AFTER: usize = 256;

/// What the master task holds for the master, which does no I/O: the sessions' down
/// channels and the callers waiting for scales.
struct Links {
    pp: HashMap<u64, PpTx>,
    sc: HashMap<u64, ScTx>,
    scales: HashMap<u64, ScaleDone>,
    /// `FmConfig::max_down_queue`, `FmConfig::max_down_bytes`.
    max_down: DownBound,
    down_full: Arc<DownFullCounters>,
}

impl Links {
    fn new(max_down: DownBound, down_full: Arc<DownFullCounters>) -> Self {
        Links {
            pp: HashMap::new(),
            sc: HashMap::new(),
            scales: HashMap::new(),
            max_down,
            down_full,
        }
    }
}

/// Which counter a message dropped on a full down queue goes to; `None`: never dropped.
fn pp_droppable<'a>(msg: &v1::PpDown, c: &'a DownFullCounters) -> Option<&'a AtomicU64> {
    match msg.msg {
        Some(pp_down::Msg::Replies(_)) => Some(&c.replies),
        Some(pp_down::Msg::Fabric(_)) => Some(&c.frames),
        _ => None,
    }
}

/// [`pp_droppable`] for SC: a submit of requests only (events and mirrored writes are
/// not retried, so a submit carrying them always goes).
fn sc_droppable<'a>(msg: &v1::ScDown, c: &'a DownFullCounters) -> Option<&'a AtomicU64> {
    match &msg.msg {
        Some(sc_down::Msg::Submit(s))
            if s.events.as_ref().is_none_or(|e| e.events.is_empty()) && s.mirror.is_empty() =>
        {
            Some(&c.submits)
        }
        _ => None,
    }
}

impl Links {
    /// Send what the master queued. A session that has gone drops its messages, and a
    /// send on a stream whose node went away fails quietly: the master hears of it
    /// from the session's reader.
    fn deliver(&mut self, out: Vec<Out>) {
        for o in out {
            match o {
                Out::Pp { session, msg } => {
                    if let Some(tx) = self.pp.get(&session) {
                        match pp_droppable(&msg, &self.down_full) {
                            Some(c) if tx.full(self.max_down) => {
                                c.fetch_add(1, Ordering::Relaxed);
                                debug!(
                                    session,
                                    queued = tx.queued(),
                                    bytes = tx.queued_bytes(),
                                    "PP down queue full; dropped"
                                );
                            }
                            _ => {
                                tx.send(msg);
                            }
                        }
                    }
                }
                Out::Sc { session, msg } => {
                    if let Some(tx) = self.sc.get(&session) {
                        match sc_droppable(&msg, &self.down_full) {
                            Some(c) if tx.full(self.max_down) => {
                                c.fetch_add(1, Ordering::Relaxed);
                                debug!(
                                    session,
                                    queued = tx.queued(),
                                    bytes = tx.queued_bytes(),
                                    "SC down queue full; dropped"
                                );
                            }
                            _ => {
                                tx.send(*msg);
                            }
                        }
                    }
                }
                Out::Close { session } => {
                    self.pp.remove(&session);
                    self.sc.remove(&session);
                }
                Out::Scaled(outcome) => {
                    if let Some(done) = self.scales.remove(&outcome.scale_id) {
                        let _ = done.send(Ok(outcome));
                    }
                }
            }
        }
    }
}

/// Hand `msg` to the master (`now_us` on FM's clock) and answer it if it is a query.
fn dispatch(m: &mut Master, links: &mut Links, msg: MasterIn, now_us: u64) {
    let now_ms = now_us / 1000;
    match msg {
        MasterIn::PpOpen { open, tx } => {
            links.pp.insert(open.session, tx);
            m.on_pp_open(open, now_us);
        }
        MasterIn::PpRequests { session, requests } => m.on_pp_requests(session, requests, now_us),
        MasterIn::PpEvents { events } => m.on_pp_events(events, now_us),
        MasterIn::ScOpen { open, tx } => {
            links.sc.insert(open.session, tx);
            m.on_sc_open(open, now_us);
        }
        MasterIn::ScResults { session, results } => m.on_sc_results(session, results, now_us),
        MasterIn::ScFin { fin } => m.on_sc_fin(fin, now_us),
        MasterIn::ScHosted {
            session,
            node,
            groups,
        } => m.on_sc_hosted(session, &node, groups, now_us),
        MasterIn::Heartbeat {
            session,
            node,
            load,
        } => m.on_heartbeat(session, &node, load),
        MasterIn::Closed { session, node } => m.on_closed(session, &node, now_us),
        MasterIn::Scale(req, done) => match m.scale(req, now_us) {
            Ok(id) => {
                links.scales.insert(id, done);
            }
            Err(e) => {
                let _ = done.send(Err(e));
            }
        },
        MasterIn::SetDesired {
            chains,
            partitions,
            shards,
            done,
        } => {
            let _ = done.send(m.set_desired(chains, partitions, shards, now_us));
        }
        MasterIn::Members(tx) => {
            let _ = tx.send(m.members_view(now_ms));
        }
        MasterIn::Map(tx) => {
            let _ = tx.send(m.partition_map());
        }
        MasterIn::Stats(tx) => {
            let _ = tx.send(m.stats());
        }
        MasterIn::Metrics(tx) => {
            let _ = tx.send(m.metrics());
        }
        MasterIn::Flows(req, tx) => {
            let _ = tx.send(m.flows(&req, now_ms));
        }
        MasterIn::ClearCache(tx) => {
            let _ = tx.send(m.clear_cache());
        }
        MasterIn::Events(req, tx) => {
            let _ = tx.send(m.events_reply(&req));
        }
        MasterIn::RecordEvent(req, tx) => {
            let _ = tx.send(m.record_external(req));
        }
        MasterIn::Load(tx) => {
            let _ = tx.send(m.load_reply(now_ms));
        }
        MasterIn::VipMap(tx) => {
            let _ = tx.send(m.vip_map());
        }
        MasterIn::PpDrain(node, tx) => {
            let _ = tx.send(m.pp_drain(&node).map_err(Status::failed_precondition));
        }
        MasterIn::VipMove(req, tx) => {
            let _ = tx.send(m.vip_move(&req).map_err(Status::failed_precondition));
        }
    }
    // Sent as the master decided, not held for the burst: only submits and PP replies
    // wait for `flush`.
    links.deliver(m.take_out());
}

/// What the master task reads: its two lanes, and the count of requests queued on
/// the data lane (which it takes down as it takes them).
struct MasterLanes {
    ctl: mpsc::UnboundedReceiver<MasterIn>,
    data: mpsc::UnboundedReceiver<MasterIn>,
    queued: Arc<AtomicUsize>,
}

impl MasterLanes {
    /// The next queued message, control lane first, without waiting.
    fn try_next(&mut self) -> Option<MasterIn> {
        let m = self.ctl.try_recv().or_else(|_| self.data.try_recv()).ok()?;
        self.taken(&m);
        Some(m)
    }

    fn taken(&self, m: &MasterIn) {
        if let MasterIn::PpRequests { requests, .. } = m {
            self.queued.fetch_sub(requests.len(), Ordering::Relaxed);
        }
    }
}

impl MasterIn {
    /// Requests and results it carries.
    fn work(&self) -> usize {
        match self {
            MasterIn::PpRequests { requests, .. } => requests.len(),
            MasterIn::ScResults { results, .. } => {
                results.results.iter().map(|r| r.replies.len()).sum()
            }
            _ => 0,
        }
    }
}

async fn run_master(
    mut m: Master,
    mut lanes: MasterLanes,
    mut links: Links,
    period: std::time::Duration,
    start: Instant,
) {
    let now_us = || start.elapsed().as_micros() as u64;
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // Biased: the periodic work (failure detection) first, then the control lane
        // (heartbeats, queries), then data. A deep queue of requests and results can
        // delay neither a node's liveness nor its judgement.
        let msg = tokio::select! {
            biased;
            due = tick.tick() => {
                let lag = due.elapsed().as_millis() as u64;
                m.tick_late(now_us(), lag);
                m.flush(now_us());
                links.deliver(m.take_out());
                continue;
            }
            msg = lanes.ctl.recv() => msg,
            msg = lanes.data.recv() => msg,
        };
        let Some(msg) = msg else { break };
        lanes.taken(&msg);
        let mut unflushed = msg.work();
        dispatch(&mut m, &mut links, msg, now_us());
        // Everything already queued joins this burst: that is what batches submits to
        // SC and replies to PP without a timer. Bounded in time, so the session readers
        // sharing the runtime keep up.
        let burst = std::time::Instant::now();
        while burst.elapsed() < MAX_BURST {
            match lanes.try_next() {
                Some(msg) => {
                    unflushed += msg.work();
                    dispatch(&mut m, &mut links, msg, now_us());
                    if unflushed >= FLUSH_AFTER {
                        m.flush(now_us());
                        links.deliver(m.take_out());
                        unflushed = 0;
                    }
                }
                None => break,
            }
        }
        m.flush(now_us());
        links.deliver(m.take_out());
        tokio::task::yield_now().await;
    }
}

impl FmHandle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn wire_counters(&self) -> &FmWireCounters {
        &self.shared.wire
    }

    pub fn liveness_counters(&self) -> &crate::liveness::LivenessCounters {
        &self.shared.liveness.counters
    }

    pub async fn members(&self) -> Option<v1::MembershipView> {
        self.observer().members().await
    }

    pub async fn partition_map(&self) -> Option<v1::PartitionMap> {
        self.observer().partition_map().await
    }

    pub async fn stats(&self) -> Option<FmStats> {
        self.observer().stats().await
    }

    /// Per-tenant request counts and the request latency histogram.
    pub async fn metrics(&self) -> Option<FmMetrics> {
        self.observer().metrics().await
    }

    /// Serve exactly these chains with these partitions from now on (the orchestrator's
    /// desired state; see `Master::set_desired`).
    pub async fn set_desired(
        &self,
        chains: Vec<v1::ChainConfig>,
        partitions: Vec<v1::Partition>,
        shards: Vec<v1::TenantShards>,
    ) -> Option<DesiredChange> {
        self.observer()
            .ask(|done| MasterIn::SetDesired {
                chains,
                partitions,
                shards,
                done,
            })
            .await
    }

    /// Rules in the cache.
    pub async fn flows(&self, req: v1::FlowsRequest) -> Option<v1::FlowsReply> {
        self.observer().ask(|tx| MasterIn::Flows(req, tx)).await
    }

    /// Drop every rule in FM's cache (rules pinned by a scale under way stay), so the
    /// next request for each flow goes to SC. For operators and tests; returns how many
    /// rules were dropped.
    pub async fn clear_cache(&self) -> Option<usize> {
        self.observer().ask(MasterIn::ClearCache).await
    }

    /// Scale out or in (paper 000 Fig. 3, docs/scaling.md). Returns when the scale
    /// finished (fin) or was aborted (`ScaleOutcome::aborted`); an error if FM refused
    /// to start it.
    pub async fn scale(&self, req: ScaleRequest) -> Result<ScaleOutcome, FmError> {
        scale(&self.shared, req).await
    }

    /// FM's event log from `since_seq` on.
    pub async fn events(&self, since_seq: u64, limit: u32) -> Option<v1::EventsReply> {
        self.observer()
            .events(v1::EventsRequest { since_seq, limit })
            .await
    }

    /// Per-group request counters and live nodes' heartbeat load.
    pub async fn load(&self) -> Option<v1::LoadReply> {
        self.observer().load().await
    }

    /// A read-only view of this FM that can be cloned into other tasks (a metrics
    /// endpoint); unlike the handle, dropping it stops nothing.
    pub fn observer(&self) -> FmObserver {
        FmObserver {
            shared: self.shared.clone(),
        }
    }

    pub fn stop(&self) {
        self.shared.stopped.store(true, Ordering::Relaxed);
        self.shared.liveness_stop.store(true, Ordering::Relaxed);
        for t in self
            .shared
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            t.abort();
        }
    }
}

/// Queries of a running FM, for observers: see [`FmHandle::observer`].
#[derive(Clone)]
pub struct FmObserver {
    shared: Arc<Shared>,
}

impl FmObserver {
    pub fn wire_counters(&self) -> &FmWireCounters {
        &self.shared.wire
    }

    /// FM's TLS state (its refusal counters); `None` under --insecure.
    pub fn tls(&self) -> Option<&Arc<proto::tls::NodeTls>> {
        self.shared.tls.as_ref()
    }

    pub fn liveness_counters(&self) -> &crate::liveness::LivenessCounters {
        &self.shared.liveness.counters
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> MasterIn) -> Option<T> {
        self.shared.ask(make).await
    }

    pub async fn members(&self) -> Option<v1::MembershipView> {
        self.ask(MasterIn::Members).await
    }

    pub async fn partition_map(&self) -> Option<v1::PartitionMap> {
        self.ask(MasterIn::Map).await
    }

    pub async fn stats(&self) -> Option<FmStats> {
        let mut s = self.ask(MasterIn::Stats).await?;
        s.setup_overload += self.shared.wire.setup_overload.load(Ordering::Relaxed);
        Some(s)
    }

    pub async fn metrics(&self) -> Option<FmMetrics> {
        self.ask(MasterIn::Metrics).await
    }

    /// Events from `req.since_seq` on (see [`crate::EventLog`]).
    pub async fn events(&self, req: v1::EventsRequest) -> Option<v1::EventsReply> {
        self.ask(|tx| MasterIn::Events(req, tx)).await
    }

    /// Per-group request counters and live nodes' heartbeat load.
    pub async fn load(&self) -> Option<v1::LoadReply> {
        self.ask(MasterIn::Load).await
    }

    /// A tenant's monitor counters: what the traffic-counting NFs of each of its SC
    /// groups counted, read from one replica per group (the tail first: it has applied
    /// every committed op) and summed over the groups, which are disjoint partitions.
    pub async fn traffic(&self, tenant: u32) -> Option<v1::TrafficReply> {
        let map = self.partition_map().await?;
        Some(traffic(&map, tenant, self.shared.tls.as_ref()).await)
    }
}

/// One SC node's answer for `groups`, within [`TRAFFIC_TIMEOUT`].
async fn group_traffic(
    addr: &str,
    groups: Vec<u64>,
    tls: Option<&Arc<proto::tls::NodeTls>>,
) -> Result<Vec<v1::GroupState>, String> {
    let call = async {
        let ch = proto::connect(addr, tls, Role::Sc)
            .await
            .map_err(|e| e.to_string())?;
        let mut c = v1::service_computation_client::ServiceComputationClient::new(ch)
            .max_decoding_message_size(proto::MAX_MESSAGE);
        c.group_status(v1::GroupStatusRequest {
            snapshots: false,
            traffic: true,
            groups,
        })
        .await
        .map(|r| r.into_inner().groups)
        .map_err(|e| e.message().to_string())
    };
    tokio::time::timeout(TRAFFIC_TIMEOUT, call)
        .await
        .map_err(|_| format!("SC node {addr} did not answer"))?
}

/// How long one SC node may take to answer a traffic query.
const TRAFFIC_TIMEOUT: Duration = Duration::from_secs(3);

async fn traffic(
    map: &v1::PartitionMap,
    tenant: u32,
    tls: Option<&Arc<proto::tls::NodeTls>>,
) -> v1::TrafficReply {
    let mut reply = v1::TrafficReply::default();
    let mut sum = nf::TrafficReport::default();
    let groups: Vec<u64> = map
        .partitions
        .iter()
        .filter(|p| p.tenant == tenant)
        .map(|p| p.group)
        .collect();
    reply.groups = groups.len() as u32;
    for gid in groups {
        let Some(g) = map.groups.iter().find(|g| g.id == gid) else {
            continue;
        };
        let mut read = false;
        for r in g.replicas.iter().rev() {
            match group_traffic(&r.addr, vec![gid], tls).await {
                Ok(states) => {
                    let Some(s) = states.into_iter().find(|s| s.group == gid && s.initialized)
                    else {
                        continue;
                    };
                    if let Some(t) = s.traffic.as_ref() {
                        match proto::traffic_from(t) {
                            Ok(t) => sum.add(&t),
                            Err(e) => reply.errors.push(format!("group {gid}: {e}")),
                        }
                    }
                    read = true;
                    break;
                }
                Err(e) => reply
                    .errors
                    .push(format!("group {gid} at {}: {e}", r.node_id)),
            }
        }
        reply.groups_read += u32::from(read);
    }
    // Only the tenant's own counters: a chain counts under the tenant of its partition,
    // but a misrouted report must not show another tenant's hosts.
    sum.tenants.retain(|(t, _)| *t == tenant);
    sum.hosts.retain(|(t, _, _)| *t == tenant);
    reply.report = Some(proto::traffic_to_proto(&sum));
    reply
}

async fn scale(shared: &Shared, req: ScaleRequest) -> Result<ScaleOutcome, FmError> {
    shared
        .ask(|tx| MasterIn::Scale(req, tx))
        .await
        .ok_or(FmError::Stopped)?
        .map_err(FmError::Scale)
}

/// Run a scale and answer its RPC: the outcome, or the reason FM refused or failed.
async fn scale_reply(
    shared: &Shared,
    req: ScaleRequest,
) -> Result<Response<v1::ScaleReply>, Status> {
    scale(shared, req)
        .await
        .map(|o| Response::new(o.to_proto()))
        .map_err(scale_error)
}

fn scale_error(e: FmError) -> Status {
    match e {
        FmError::Scale(e) => Status::failed_precondition(e),
        e => Status::unavailable(e.to_string()),
    }
}

impl Drop for FmHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

struct FmService {
    shared: Arc<Shared>,
}

/// What every RPC answers once the master task is gone.
fn stopped() -> Status {
    Status::unavailable("stopped")
}

/// The refusal of a page of events or flows above the bound.
fn limit_error(limit: u32) -> Option<Status> {
    (limit > 10_000).then(|| Status::invalid_argument(format!("limit {limit} is above 10000")))
}

impl FmService {
    /// FM's operator services (maps, scaling, vIP moves, events, load, flows, traffic)
    /// answer orchestrator and operator certificates only: a PP or SC node's
    /// certificate opens its own session and nothing else.
    #[allow(clippy::result_large_err)]
    fn operator<T>(&self, req: &Request<T>) -> Result<(), Status> {
        proto::tls::authorize(req, self.shared.tls.as_deref(), &Role::OPERATORS).map(drop)
    }

    /// [`Shared::ask`] for an RPC: the reply, or Unavailable if the master is gone.
    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> MasterIn) -> Result<T, Status> {
        self.shared.ask(make).await.ok_or_else(stopped)
    }
}

/// Read the registration every session starts with.
async fn registration<T>(
    shared: &Shared,
    inbound: &mut Streaming<T>,
    role: v1::Role,
    get: impl Fn(T) -> Option<v1::NodeInfo>,
) -> Result<v1::NodeInfo, Status>
where
    T: prost::Message + Default,
{
    let first = inbound.message().await.inspect_err(|_| shared.bad())?;
    check_registration(first.and_then(get), role).inspect_err(|_| shared.bad())
}

/// A session's first message must register a node of the session's role, speaking
/// FM's protocol version, with an id.
// The Err is the tonic Status the RPC answers with.
#[allow(clippy::result_large_err)]
fn check_registration(info: Option<v1::NodeInfo>, role: v1::Role) -> Result<v1::NodeInfo, Status> {
    let Some(info) = info else {
        return Err(Status::invalid_argument("a session starts with register"));
    };
    if info.role != role as i32 {
        return Err(Status::invalid_argument(format!(
            "{} node on the {} session",
            proto::role_name(info.role),
            proto::role_name(role as i32)
        )));
    }
    if info.proto_version != proto::PROTO_VERSION {
        return Err(Status::failed_precondition(format!(
            "protocol version {} (FM speaks {})",
            info.proto_version,
            proto::PROTO_VERSION
        )));
    }
    if info.id.is_empty() {
        return Err(Status::invalid_argument("empty node id"));
    }
    Ok(info)
}

fn stream_error(shared: &Shared, e: &Status) {
    // A message that fails to decode surfaces as Internal; a peer going away as
    // Cancelled/Unknown/Unavailable.
    if e.code() == tonic::Code::Internal || e.code() == tonic::Code::InvalidArgument {
        shared.bad();
        warn!(error = %e, "bad message on a session");
    } else {
        debug!(error = %e, "session stream ended");
    }
}

/// Serve a PP or SC session: read its registration (`register` takes it from the first
/// message), hand the master the session and its down channel (`open`), then forward
/// what the node sends (`up` turns a message into the master's input; None breaks the
/// protocol) until the stream ends, and tell the master it closed. Rule requests above
/// the master's queue bound are answered here with `setup-overload` (`shed` makes the
/// down message of those replies), so the session never waits on the master.
async fn session<U, D>(
    shared: &Arc<Shared>,
    req: Request<Streaming<U>>,
    role: v1::Role,
    register: impl Fn(U) -> Option<v1::NodeInfo>,
    open: impl FnOnce(Opened, DownTx<D>) -> MasterIn,
    up: impl Fn(U, u64, &str) -> Option<MasterIn> + Send + 'static,
    shed: fn(Vec<v1::RuleReply>) -> D,
) -> Result<Response<DownStream<D>>, Status>
where
    U: prost::Message + Default + 'static,
    D: prost::Message + Send + 'static,
{
    if shared.stopped.load(Ordering::Relaxed) {
        return Err(stopped());
    }
    let want = match role {
        v1::Role::Pp => Role::Pp,
        _ => Role::Sc,
    };
    let peer = proto::tls::authorize(&req, shared.tls.as_deref(), &[want])?;
    let mut inbound = req.into_inner();
    let info = registration(shared, &mut inbound, role, register).await?;
    // A certificate is one node's: it cannot register under another node's id.
    if shared.tls.is_some() && info.id != peer.id {
        shared.bad();
        return Err(Status::permission_denied(format!(
            "certificate of {} cannot register node {:?}",
            peer, info.id
        )));
    }
    let session = shared.next_session.fetch_add(1, Ordering::Relaxed);
    shared.wire.sessions.fetch_add(1, Ordering::Relaxed);
    let (tx, rx) = down_channel();
    // Weak: the master's drop of the session's sender is what ends the down stream
    // (and tells the node its session is gone); the reader must not keep it open.
    let down = tx.tx.downgrade();
    let down_queued = tx.queued.clone();
    let max_down = shared.max_down;
    let node = info.id.clone();
    let seen = Arc::new(AtomicU64::new(0));
    shared.mark_seen(&seen);
    let liveness_token = shared.liveness.add(seen.clone());
    shared
        .send(open(
            Opened {
                session,
                info,
                seen: seen.clone(),
                liveness_token,
            },
            tx,
        ))
        .map_err(|_| stopped())?;
    let s = shared.clone();
    shared.spawn(async move {
        loop {
            let m = match inbound.message().await {
                Ok(Some(m)) => {
                    s.mark_seen(&seen);
                    m
                }
                Ok(None) => break,
                Err(e) => {
                    stream_error(&s, &e);
                    break;
                }
            };
            let Some(msg) = up(m, session, &node) else {
                s.bad();
                continue;
            };
            let msg = match msg {
                MasterIn::PpRequests { session, requests } => match s.admit(requests) {
                    Ok(requests) => MasterIn::PpRequests { session, requests },
                    Err(replies) => {
                        if down_queued.full(max_down) {
                            s.wire.down_full.replies.fetch_add(1, Ordering::Relaxed);
                        } else if let Some(down) = down.upgrade() {
                            down_queued.send(&down, shed(replies));
                        }
                        continue;
                    }
                },
                m => m,
            };
            if s.send(msg).is_err() {
                break;
            }
        }
        s.liveness.remove(liveness_token);
        let _ = s.send(MasterIn::Closed { session, node });
    });
    Ok(Response::new(rx))
}

/// What a PP session's message after its registration asks of the master (`None`: a
/// second registration, or an empty message, which the session ignores).
fn pp_in(m: v1::PpUp, session: u64, node: &str) -> Option<MasterIn> {
    Some(match m.msg? {
        pp_up::Msg::Requests(b) => MasterIn::PpRequests {
            session,
            requests: b.requests,
        },
        pp_up::Msg::Events(b) => MasterIn::PpEvents { events: b.events },
        pp_up::Msg::Heartbeat(h) => MasterIn::Heartbeat {
            session,
            node: node.to_string(),
            load: h.load,
        },
        pp_up::Msg::Register(_) => return None,
    })
}

/// [`pp_in`] for an SC session.
fn sc_in(m: v1::ScUp, session: u64, node: &str) -> Option<MasterIn> {
    Some(match m.msg? {
        sc_up::Msg::Results(results) => MasterIn::ScResults { session, results },
        sc_up::Msg::Heartbeat(h) => MasterIn::Heartbeat {
            session,
            node: node.to_string(),
            load: h.load,
        },
        sc_up::Msg::Fin(fin) => MasterIn::ScFin { fin },
        sc_up::Msg::Hosted(h) => MasterIn::ScHosted {
            session,
            node: node.to_string(),
            groups: h.groups,
        },
        sc_up::Msg::Register(_) => return None,
    })
}

#[tonic::async_trait]
impl FabricMaster for FmService {
    type PpSessionStream = DownStream<v1::PpDown>;
    type ScSessionStream = DownStream<v1::ScDown>;

    async fn pp_session(
        &self,
        req: Request<Streaming<v1::PpUp>>,
    ) -> Result<Response<Self::PpSessionStream>, Status> {
        session(
            &self.shared,
            req,
            v1::Role::Pp,
            |m| match m.msg {
                Some(pp_up::Msg::Register(i)) => Some(i),
                _ => None,
            },
            |open, tx| MasterIn::PpOpen { open, tx },
            pp_in,
            |replies| v1::PpDown {
                msg: Some(pp_down::Msg::Replies(v1::RuleReplyBatch::new(replies))),
            },
        )
        .await
    }

    async fn sc_session(
        &self,
        req: Request<Streaming<v1::ScUp>>,
    ) -> Result<Response<Self::ScSessionStream>, Status> {
        session(
            &self.shared,
            req,
            v1::Role::Sc,
            |m| match m.msg {
                Some(sc_up::Msg::Register(i)) => Some(i),
                _ => None,
            },
            |open, tx| MasterIn::ScOpen { open, tx },
            sc_in,
            // SC sessions carry no rule requests: nothing is ever shed on them.
            |_| v1::ScDown { msg: None },
        )
        .await
    }

    async fn members(
        &self,
        req: Request<v1::MembersRequest>,
    ) -> Result<Response<v1::MembershipView>, Status> {
        self.operator(&req)?;
        self.ask(MasterIn::Members).await.map(Response::new)
    }

    async fn get_partition_map(
        &self,
        req: Request<v1::PartitionMapRequest>,
    ) -> Result<Response<v1::PartitionMap>, Status> {
        self.operator(&req)?;
        self.ask(MasterIn::Map).await.map(Response::new)
    }

    async fn scale_out(
        &self,
        req: Request<v1::ScaleOutRequest>,
    ) -> Result<Response<v1::ScaleReply>, Status> {
        self.operator(&req)?;
        let r = req.into_inner();
        let migration = if r.migration.is_empty() {
            None
        } else {
            Some(
                r.migration
                    .parse::<crate::Migration>()
                    .map_err(Status::invalid_argument)?,
            )
        };
        let req = ScaleRequest::Out {
            tenant: r.tenant,
            chain: r.chain,
            group: r.group,
            migration,
        };
        scale_reply(&self.shared, req).await
    }

    async fn vip_map(
        &self,
        req: Request<v1::VipMapRequest>,
    ) -> Result<Response<v1::VipMapReply>, Status> {
        self.operator(&req)?;
        self.ask(MasterIn::VipMap).await.map(Response::new)
    }

    async fn pp_drain(
        &self,
        req: Request<v1::PpDrainRequest>,
    ) -> Result<Response<v1::VipMapReply>, Status> {
        self.operator(&req)?;
        let node = req.into_inner().node;
        if node.is_empty() {
            return Err(Status::invalid_argument("node is required"));
        }
        self.ask(|tx| MasterIn::PpDrain(node, tx))
            .await?
            .map(Response::new)
    }

    async fn vip_move(
        &self,
        req: Request<v1::VipMoveRequest>,
    ) -> Result<Response<v1::VipMapReply>, Status> {
        self.operator(&req)?;
        let r = req.into_inner();
        if r.to.is_empty() {
            return Err(Status::invalid_argument("to is required"));
        }
        self.ask(|tx| MasterIn::VipMove(r, tx))
            .await?
            .map(Response::new)
    }

    async fn scale_in(
        &self,
        req: Request<v1::ScaleInRequest>,
    ) -> Result<Response<v1::ScaleReply>, Status> {
        self.operator(&req)?;
        let r = req.into_inner();
        let req = ScaleRequest::In {
            tenant: r.tenant,
            chain: r.chain,
            group: r.group,
        };
        scale_reply(&self.shared, req).await
    }

    async fn events(
        &self,
        req: Request<v1::EventsRequest>,
    ) -> Result<Response<v1::EventsReply>, Status> {
        self.operator(&req)?;
        let req = req.into_inner();
        if let Some(e) = limit_error(req.limit) {
            return Err(e);
        }
        self.ask(|tx| MasterIn::Events(req, tx))
            .await
            .map(Response::new)
    }

    async fn record_event(
        &self,
        req: Request<v1::RecordEventRequest>,
    ) -> Result<Response<v1::RecordEventReply>, Status> {
        self.operator(&req)?;
        let req = req.into_inner();
        // The ring is bounded but the file is not: keep one client from filling a disk.
        if req.message.len() + req.detail_json.len() > 64 * 1024 {
            return Err(Status::invalid_argument("event above 64 KiB"));
        }
        let seq = self
            .ask(|tx| MasterIn::RecordEvent(req, tx))
            .await?
            .map_err(Status::invalid_argument)?;
        Ok(Response::new(v1::RecordEventReply { seq }))
    }

    async fn load(&self, req: Request<v1::LoadRequest>) -> Result<Response<v1::LoadReply>, Status> {
        self.operator(&req)?;
        self.ask(MasterIn::Load).await.map(Response::new)
    }

    async fn traffic(
        &self,
        req: Request<v1::TrafficRequest>,
    ) -> Result<Response<v1::TrafficReply>, Status> {
        self.operator(&req)?;
        let tenant = req.into_inner().tenant;
        let map = self.ask(MasterIn::Map).await?;
        Ok(Response::new(
            traffic(&map, tenant, self.shared.tls.as_ref()).await,
        ))
    }

    async fn flows(
        &self,
        req: Request<v1::FlowsRequest>,
    ) -> Result<Response<v1::FlowsReply>, Status> {
        self.operator(&req)?;
        let req = req.into_inner();
        if let Some(e) = limit_error(req.limit) {
            return Err(e);
        }
        self.ask(|tx| MasterIn::Flows(req, tx))
            .await
            .map(Response::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pp(msg: pp_down::Msg) -> Out {
        Out::Pp {
            session: 1,
            msg: v1::PpDown { msg: Some(msg) },
        }
    }

    fn submit(events: bool) -> Out {
        let events = events.then(|| v1::FlowEventBatch {
            events: vec![v1::FlowEvent::default()],
        });
        Out::Sc {
            session: 2,
            msg: Box::new(v1::ScDown {
                msg: Some(sc_down::Msg::Submit(v1::GroupSubmit {
                    events,
                    ..Default::default()
                })),
            }),
        }
    }

    /// A node that does not read: FM keeps at most `max_down_queue` messages for it,
    /// drops (and counts) only what the node asks for again, and always sends control.
    #[test]
    fn a_full_down_queue_drops_only_what_is_asked_again_and_counts_it() {
        let c = Arc::new(DownFullCounters::default());
        let bound = DownBound {
            messages: 2,
            bytes: usize::MAX,
        };
        let mut links = Links::new(bound, c.clone());
        let (tx, mut pp_rx) = down_channel::<v1::PpDown>();
        links.pp.insert(1, tx);
        let (tx, mut sc_rx) = down_channel::<v1::ScDown>();
        links.sc.insert(2, tx);
        let replies = || pp(pp_down::Msg::Replies(v1::RuleReplyBatch::default()));
        links.deliver(vec![
            replies(),
            pp(pp_down::Msg::Fabric(v1::FabricFrame::default())),
            replies(),
            pp(pp_down::Msg::Fabric(v1::FabricFrame::default())),
            pp(pp_down::Msg::Revoked(v1::RuleRevoke::default())),
        ]);
        assert_eq!(c.replies.load(Ordering::Relaxed), 1);
        assert_eq!(c.frames.load(Ordering::Relaxed), 1);
        let mut got = Vec::new();
        while let Some(m) = pp_rx.try_recv() {
            got.push(m.unwrap().msg.unwrap());
        }
        assert_eq!(got.len(), 3, "two under the bound, then the revoke over it");
        assert!(matches!(got[0], pp_down::Msg::Replies(_)));
        assert!(matches!(got[1], pp_down::Msg::Fabric(_)));
        assert!(matches!(got[2], pp_down::Msg::Revoked(_)));
        // Read out: room again.
        links.deliver(vec![replies()]);
        assert!(pp_rx.try_recv().is_some());
        assert_eq!(c.replies.load(Ordering::Relaxed), 1);

        // SC: a request-only submit is retried by FM, one with events is not.
        links.deliver(vec![
            submit(false),
            submit(false),
            submit(false),
            submit(true),
        ]);
        assert_eq!(c.submits.load(Ordering::Relaxed), 1);
        let mut n = 0;
        while sc_rx.try_recv().is_some() {
            n += 1;
        }
        assert_eq!(n, 3);
    }

    /// The byte bound holds on its own: first packets of 1 KB fill a 2.5 KB bound after
    /// three, far under the message bound, and the bytes taken out make room again.
    #[test]
    fn a_down_queue_full_of_bytes_drops_before_its_message_bound() {
        use prost::Message;
        let c = Arc::new(DownFullCounters::default());
        let bound = DownBound {
            messages: 1000,
            bytes: 2500,
        };
        let mut links = Links::new(bound, c.clone());
        let (tx, mut pp_rx) = down_channel::<v1::PpDown>();
        links.pp.insert(1, tx);
        let frame = || {
            pp(pp_down::Msg::Fabric(v1::FabricFrame {
                frame: vec![0xab; 1000].into(),
                ..Default::default()
            }))
        };
        let Out::Pp { msg, .. } = frame() else {
            unreachable!()
        };
        let size = msg.encoded_len();
        assert!((1000..1100).contains(&size), "{size}");
        let revoke = pp(pp_down::Msg::Revoked(v1::RuleRevoke::default()));
        links.deliver(vec![frame(), frame(), frame(), frame(), frame(), revoke]);
        assert_eq!(c.frames.load(Ordering::Relaxed), 2, "the 4th and 5th");
        assert_eq!(links.pp[&1].queued(), 4, "three frames and the revoke");
        assert_eq!(links.pp[&1].queued_bytes(), 3 * size + 2);
        // One read out (1 KB): room for one more, and the count follows.
        assert!(pp_rx.try_recv().is_some());
        assert_eq!(links.pp[&1].queued_bytes(), 2 * size + 2);
        links.deliver(vec![frame(), frame()]);
        assert_eq!(c.frames.load(Ordering::Relaxed), 3);
        let mut left = 0;
        while pp_rx.try_recv().is_some() {
            left += 1;
        }
        assert_eq!(left, 4);
        assert_eq!((links.pp[&1].queued(), links.pp[&1].queued_bytes()), (0, 0));
    }
}
