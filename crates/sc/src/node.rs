//! The SC node: replicas of SC groups, their chain links, and the session to FM.
//!
//! Tasks, all on the caller's tokio runtime:
//! - the `ServiceComputation` gRPC server: `Replicate` streams from predecessors,
//!   `GroupStatus` for operators and tests;
//! - one task per hosted replica, owning its [`ReplicaCore`] (no locks on the hot path);
//!   it drains every input that is queued before it flushes, so a burst of requests
//!   leaves as one batch to the successor, one ack upstream and one message to FM;
//! - one link task per replica with a successor: a `Replicate` client stream, which
//!   reconnects until the configuration changes;
//! - the FM session: registration (with the groups it hosts, so an FM that does not
//!   know them can adopt them), heartbeats, group configs and submits down, tail
//!   results up. It reconnects forever, to the next of its FM addresses when one is
//!   unreachable (FM failover, [`proto::FmAddrs`]); results produced while it is down
//!   wait in a queue (FM ignores answers it no longer wants).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use proto::v1::service_computation_server::{ServiceComputation, ServiceComputationServer};
use proto::v1::{self, fabric_master_client::FabricMasterClient};
use proto::v1::{replicate_down, replicate_up, sc_down, sc_up};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn};

use crate::factory::ChainFactory;
use crate::replica::{LinkChange, Outbox, ReplicaCore, ReplicaStats};
use crate::ScError;

/// Configuration of an SC node.
#[derive(Debug, Clone)]
pub struct ScConfig {
    pub node_id: String,
    /// Where the replication server listens (port 0: any).
    pub listen: SocketAddr,
    /// The address other SC nodes use to reach it; default: the bound address.
    pub advertise: Option<String>,
    /// The fabric master, `host:port`, or several, comma-separated: the node fails over
    /// to the next when the one it is on is unreachable.
    pub fm: String,
    /// How often a group's head runs the NFs' timers (as an op, on every replica).
    pub timer_period: Duration,
    /// Wait between reconnection attempts (to FM and to successors).
    pub reconnect: Duration,
}

impl ScConfig {
    pub fn new(node_id: &str, listen: SocketAddr, fm: &str) -> Self {
        ScConfig {
            node_id: node_id.to_string(),
            listen,
            advertise: None,
            fm: fm.to_string(),
            timer_period: Duration::from_secs(1),
            reconnect: Duration::from_millis(20),
        }
    }
}

/// Node-wide counters.
#[derive(Debug, Default)]
pub struct ScCounters {
    /// Undecodable or out-of-protocol messages from peers.
    pub bad_messages: AtomicU64,
    /// Submits for groups this node does not host.
    pub unknown_group: AtomicU64,
    pub fm_sessions: AtomicU64,
    pub successor_links: AtomicU64,
}

enum ReplicaIn {
    Configure(v1::GroupConfig),
    Leave(u64),
    Submit(v1::GroupSubmit),
    /// A scaling step for the group (head only).
    Scale(v1::scale_op::Step),
    PredHello {
        conn: u64,
        hello: v1::ReplicaHello,
        up: mpsc::UnboundedSender<Result<v1::ReplicateUp, Status>>,
    },
    PredMsg {
        conn: u64,
        msg: replicate_down::Msg,
    },
    PredGone {
        conn: u64,
    },
    SuccUp {
        conn: u64,
        ack: v1::ReplicaHelloAck,
        down: mpsc::UnboundedSender<v1::ReplicateDown>,
    },
    SuccAck {
        conn: u64,
        seq: u64,
    },
    SuccGone {
        conn: u64,
    },
    Status {
        snapshots: bool,
        reply: oneshot::Sender<(v1::GroupState, ReplicaStats)>,
    },
    Metrics {
        reply: oneshot::Sender<GroupMetrics>,
    },
    /// What the node reports of this replica when it registers with an FM (None: not
    /// a member any more).
    Hosted {
        reply: oneshot::Sender<Option<v1::HostedGroup>>,
    },
}

/// What a metrics endpoint reads of one hosted replica.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupMetrics {
    /// Status without the state snapshot.
    pub state: v1::GroupState,
    pub stats: ReplicaStats,
    /// The tenant and chain of the group's partition (0 before it is configured).
    pub tenant: u32,
    pub chain: u32,
}

/// Abort handles of every task a node spawned, so that stopping it leaves nothing
/// running (tests kill replicas this way).
#[derive(Default)]
struct TaskSet(Mutex<Vec<AbortHandle>>);

impl TaskSet {
    fn spawn<F>(&self, f: F) -> AbortHandle
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let h = tokio::spawn(f).abort_handle();
        let mut v = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if v.len() > 64 {
            v.retain(|t| !t.is_finished());
        }
        v.push(h.clone());
        h
    }

    fn abort_all(&self) {
        for t in self.0.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            t.abort();
        }
    }
}

struct Shared {
    cfg: ScConfig,
    advertise: String,
    factory: Arc<dyn ChainFactory>,
    groups: Mutex<HashMap<u64, mpsc::UnboundedSender<ReplicaIn>>>,
    to_fm: mpsc::UnboundedSender<v1::ScUp>,
    to_fm_rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<v1::ScUp>>,
    next_conn: AtomicU64,
    tasks: TaskSet,
    stopped: AtomicBool,
    counters: ScCounters,
    requests_applied: AtomicU64,
    /// Random per process start (see `NodeInfo.incarnation`).
    incarnation: u64,
    /// The FM this node has a session with now (empty while it has none).
    current_fm: Mutex<String>,
}

impl Shared {
    fn conn_id(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    fn group(&self, id: u64) -> Option<mpsc::UnboundedSender<ReplicaIn>> {
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
    }

    /// Sends every hosted replica the request `ask` makes around a reply channel, and
    /// collects the replies (a replica that is gone or does not answer is skipped).
    async fn ask_replicas<T>(&self, ask: impl Fn(oneshot::Sender<T>) -> ReplicaIn) -> Vec<T> {
        let senders: Vec<_> = self
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        let mut out = Vec::with_capacity(senders.len());
        for tx in senders {
            let (rtx, rrx) = oneshot::channel();
            if tx.send(ask(rtx)).is_ok() {
                if let Ok(r) = rrx.await {
                    out.push(r);
                }
            }
        }
        out
    }

    fn bad(&self) {
        self.counters.bad_messages.fetch_add(1, Ordering::Relaxed);
    }
}

/// A running SC node.
pub struct ScHandle {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

/// Start an SC node on the current tokio runtime: bind, serve, connect to FM.
pub async fn start(cfg: ScConfig, factory: Arc<dyn ChainFactory>) -> Result<ScHandle, ScError> {
    let fms = proto::FmAddrs::parse(&cfg.fm).map_err(|e| ScError::Config(e.to_string()))?;
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| ScError::Io(format!("bind {}: {e}", cfg.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| ScError::Io(e.to_string()))?;
    let advertise = cfg.advertise.clone().unwrap_or_else(|| addr.to_string());
    let (to_fm, to_fm_rx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared {
        cfg,
        advertise,
        factory,
        groups: Mutex::new(HashMap::new()),
        to_fm,
        to_fm_rx: tokio::sync::Mutex::new(to_fm_rx),
        next_conn: AtomicU64::new(1),
        tasks: TaskSet::default(),
        stopped: AtomicBool::new(false),
        counters: ScCounters::default(),
        requests_applied: AtomicU64::new(0),
        incarnation: rand::random(),
        current_fm: Mutex::new(String::new()),
    });
    let svc = ServiceComputationServer::new(ScService {
        shared: shared.clone(),
    })
    .max_decoding_message_size(proto::MAX_MESSAGE)
    .max_encoding_message_size(proto::MAX_MESSAGE);
    let incoming = proto::incoming(listener).map_err(|e| ScError::Io(e.to_string()))?;
    shared.tasks.spawn(async move {
        if let Err(e) = proto::server()
            .add_service(svc)
            .serve_with_incoming(incoming)
            .await
        {
            warn!(error = %e, "SC server stopped");
        }
    });
    let s = shared.clone();
    shared.tasks.spawn(fm_session_loop(s, fms));
    info!(node = %shared.cfg.node_id, %addr, fm = %shared.cfg.fm, "SC node started");
    Ok(ScHandle { addr, shared })
}

impl ScHandle {
    /// The replication server's bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn node_id(&self) -> &str {
        &self.shared.cfg.node_id
    }

    pub fn counters(&self) -> &ScCounters {
        &self.shared.counters
    }

    /// The FM address this node has its session with (None while it has none).
    pub fn current_fm(&self) -> Option<String> {
        let f = self
            .shared
            .current_fm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        (!f.is_empty()).then_some(f)
    }

    /// Stop everything this node runs: its server, FM session, replicas and links.
    /// Connections close as their tasks are dropped, so peers see the node die.
    pub fn stop(&self) {
        self.shared.stopped.store(true, Ordering::Relaxed);
        self.shared
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.shared.tasks.abort_all();
    }

    /// Status of every hosted replica (with state snapshots if asked).
    pub async fn status(&self, snapshots: bool) -> Vec<(v1::GroupState, ReplicaStats)> {
        status(&self.shared, snapshots).await
    }

    /// A read-only view of this node that can be cloned into other tasks (a metrics
    /// endpoint); unlike the handle, dropping it stops nothing.
    pub fn observer(&self) -> ScObserver {
        ScObserver {
            shared: self.shared.clone(),
        }
    }
}

/// Queries of a running SC node, for observers: see [`ScHandle::observer`].
#[derive(Clone)]
pub struct ScObserver {
    shared: Arc<Shared>,
}

impl ScObserver {
    pub fn node_id(&self) -> &str {
        &self.shared.cfg.node_id
    }

    pub fn counters(&self) -> &ScCounters {
        &self.shared.counters
    }

    /// Requests this node accepted as the head of its groups (each request is then
    /// applied by every replica; counted here once).
    pub fn head_requests(&self) -> u64 {
        self.shared.requests_applied.load(Ordering::Relaxed)
    }

    /// Metrics of every hosted replica, ascending by group.
    pub async fn group_metrics(&self) -> Vec<GroupMetrics> {
        let mut out = self
            .shared
            .ask_replicas(|reply| ReplicaIn::Metrics { reply })
            .await;
        out.sort_by_key(|m| m.state.group);
        out
    }
}

impl Drop for ScHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn status(shared: &Shared, snapshots: bool) -> Vec<(v1::GroupState, ReplicaStats)> {
    let mut out = shared
        .ask_replicas(|reply| ReplicaIn::Status { snapshots, reply })
        .await;
    out.sort_by_key(|(s, _)| s.group);
    out
}

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

async fn connect(addr: &str) -> Result<Channel, ScError> {
    proto::endpoint(addr)
        .map_err(|e| ScError::Io(format!("{addr}: {e}")))?
        .connect()
        .await
        .map_err(|e| ScError::Io(format!("{addr}: {e}")))
}

// ------------------------------------------------------------------ FM session

async fn fm_session_loop(shared: Arc<Shared>, mut fms: proto::FmAddrs) {
    let mut failures = 0u32;
    loop {
        let fm = fms.current().to_string();
        let mut opened = false;
        let r = fm_session(&shared, &fm, &mut opened).await;
        shared
            .current_fm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        if opened {
            failures = 0;
        }
        if let Err(e) = &r {
            failures += 1;
            if failures <= 3 || failures % 50 == 0 {
                warn!(%fm, error = %e, "FM session failed; reconnecting");
            }
        }
        if shared.stopped.load(Ordering::Relaxed) {
            return;
        }
        let next = if opened {
            fms.session_broke()
        } else {
            fms.connect_failed()
        };
        if fms.current() != fm {
            info!(node = %shared.cfg.node_id, from = %fm, to = %fms.current(),
                  "FM unreachable; failing over to the next FM");
        }
        if next == proto::Next::AfterBackoff {
            tokio::time::sleep(shared.cfg.reconnect * 5).await;
        }
    }
}

/// What every replica this node hosts reports to a new FM session.
async fn hosted_groups(shared: &Shared) -> Vec<v1::HostedGroup> {
    shared
        .ask_replicas(|reply| ReplicaIn::Hosted { reply })
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// One session with FM `fm`. `opened` is set once FM acknowledged the registration:
/// a failure after that is a broken session, before it a failed connect.
async fn fm_session(shared: &Arc<Shared>, fm: &str, opened: &mut bool) -> Result<(), ScError> {
    let ch = connect(fm).await?;
    let mut client = FabricMasterClient::new(ch)
        .max_decoding_message_size(proto::MAX_MESSAGE)
        .max_encoding_message_size(proto::MAX_MESSAGE);
    // Two lanes: registration, hosted groups and heartbeats overtake queued results, so
    // a backlog of results never makes this node miss its heartbeats at FM.
    let (otx, orx) = proto::lanes::lanes::<v1::ScUp>();
    let _ = otx.control.send(v1::ScUp {
        msg: Some(sc_up::Msg::Register(v1::NodeInfo {
            id: shared.cfg.node_id.clone(),
            role: v1::Role::Sc as i32,
            addr: shared.advertise.clone(),
            load: None,
            proto_version: proto::PROTO_VERSION,
            incarnation: shared.incarnation,
            ..Default::default()
        })),
    });
    // Right behind the registration, so FM has it before it decides anything about the
    // node: an FM that does not know these groups (restarted, or a standby this node
    // failed over to) adopts them instead of forming new ones over the same state.
    let hosted = hosted_groups(shared).await;
    let nhosted = hosted.len();
    let _ = otx.control.send(v1::ScUp {
        msg: Some(sc_up::Msg::Hosted(v1::HostedGroups { groups: hosted })),
    });
    let resp = client
        .sc_session(orx)
        .await
        .map_err(|e| ScError::Io(format!("sc_session: {e}")))?;
    let mut inbound = resp.into_inner();
    let first = inbound
        .message()
        .await
        .map_err(|e| ScError::Io(e.to_string()))?;
    let Some(v1::ScDown {
        msg: Some(sc_down::Msg::Registered(ack)),
    }) = first
    else {
        return Err(ScError::Protocol(
            "FM did not acknowledge registration".into(),
        ));
    };
    if ack.proto_version != proto::PROTO_VERSION {
        return Err(ScError::Protocol(format!(
            "FM speaks protocol {}, this node {}",
            ack.proto_version,
            proto::PROTO_VERSION
        )));
    }
    shared.counters.fm_sessions.fetch_add(1, Ordering::Relaxed);
    *opened = true;
    *shared.current_fm.lock().unwrap_or_else(|e| e.into_inner()) = fm.to_string();
    info!(node = %shared.cfg.node_id, %fm, fm_id = %ack.fm_id, heartbeat_ms = ack.heartbeat_ms,
          groups = nhosted, "registered with FM");

    // Tail results (from every replica) → this session.
    let fwd_tx = otx.data.clone();
    let s2 = shared.clone();
    let forward = shared.tasks.spawn(async move {
        let mut rx = s2.to_fm_rx.lock().await;
        while let Some(m) = rx.recv().await {
            if fwd_tx.send(m).is_err() {
                break;
            }
        }
    });
    let hb_tx = otx.control.clone();
    let s3 = shared.clone();
    let period = Duration::from_millis(u64::from(ack.heartbeat_ms.max(1)));
    let pulse = proto::liveness::Pulse::new();
    pulse.beat();
    // Stopped when this session ends (dropped on return).
    let _liveness = proto::liveness::for_session(fm, &ack, period, &pulse);
    let heartbeat = shared.tasks.spawn(async move {
        let mut tick = tokio::time::interval(period);
        let mut seq = 0u64;
        let mut last = 0u64;
        loop {
            tick.tick().await;
            pulse.beat();
            seq += 1;
            let applied = s3.requests_applied.load(Ordering::Relaxed);
            let groups = s3.groups.lock().unwrap_or_else(|e| e.into_inner()).len() as u32;
            let hb = v1::Heartbeat {
                seq,
                load: Some(v1::Load {
                    requests_per_s: (applied - last) as f64 / period.as_secs_f64(),
                    flows: 0,
                    groups,
                    ..Default::default()
                }),
            };
            last = applied;
            if hb_tx
                .send(v1::ScUp {
                    msg: Some(sc_up::Msg::Heartbeat(hb)),
                })
                .is_err()
            {
                break;
            }
        }
    });

    let result = loop {
        let m = match inbound.message().await {
            Ok(Some(m)) => m,
            Ok(None) => break Ok(()),
            Err(e) => break Err(ScError::Io(format!("FM session: {e}"))),
        };
        match m.msg {
            Some(sc_down::Msg::Configure(cfg)) => on_configure(shared, cfg),
            Some(sc_down::Msg::Submit(sub)) => match shared.group(sub.group) {
                Some(tx) => {
                    let _ = tx.send(ReplicaIn::Submit(sub));
                }
                None => {
                    shared
                        .counters
                        .unknown_group
                        .fetch_add(1, Ordering::Relaxed);
                }
            },
            Some(sc_down::Msg::Leave(l)) => {
                if let Some(tx) = shared.group(l.group) {
                    let _ = tx.send(ReplicaIn::Leave(l.epoch));
                }
            }
            // Scaling steps (docs/scaling.md) go to the group's replica, whose head stamps
            // them into the log.
            Some(sc_down::Msg::St(st)) => {
                scale_step(shared, st.from_group, v1::scale_op::Step::Split(st))
            }
            Some(sc_down::Msg::Install(i)) => {
                scale_step(shared, i.group, v1::scale_op::Step::Install(i))
            }
            Some(sc_down::Msg::End(e)) => scale_step(shared, e.group, v1::scale_op::Step::End(e)),
            Some(sc_down::Msg::Registered(_)) => {}
            None => shared.bad(),
        }
    };
    forward.abort();
    heartbeat.abort();
    result
}

fn scale_step(shared: &Shared, group: u64, step: v1::scale_op::Step) {
    match shared.group(group) {
        Some(tx) => {
            let _ = tx.send(ReplicaIn::Scale(step));
        }
        None => {
            shared
                .counters
                .unknown_group
                .fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn on_configure(shared: &Arc<Shared>, cfg: v1::GroupConfig) {
    let Some(g) = &cfg.group else {
        shared.bad();
        return;
    };
    let gid = g.id;
    let mut groups = shared.groups.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(tx) = groups.get(&gid) {
        if tx.send(ReplicaIn::Configure(cfg.clone())).is_ok() {
            return;
        }
    }
    if !g.replicas.iter().any(|r| r.node_id == shared.cfg.node_id) {
        return;
    }
    let mut core = ReplicaCore::new(&shared.cfg.node_id, cfg.clone(), shared.factory.as_ref());
    // Scale ops carry or produce a partition's bulk state: let the chain's replicas
    // apply them side by side (docs/scaling.md).
    core.forward_first(true);
    let (tx, rx) = mpsc::unbounded_channel();
    let _ = tx.send(ReplicaIn::Configure(cfg));
    groups.insert(gid, tx.clone());
    drop(groups);
    let s = shared.clone();
    shared.tasks.spawn(replica_task(s, core, tx, rx));
}

// ------------------------------------------------------------------ replica task

/// Longest a replica works through queued input before it flushes and yields.
const MAX_BURST: Duration = Duration::from_millis(2);

struct Links {
    /// Successor link task and the epoch its hellos carry.
    link: Option<AbortHandle>,
    link_epoch: Arc<AtomicU64>,
    down: Option<(u64, mpsc::UnboundedSender<v1::ReplicateDown>)>,
    up: Option<(u64, mpsc::UnboundedSender<Result<v1::ReplicateUp, Status>>)>,
}

async fn replica_task(
    shared: Arc<Shared>,
    mut core: ReplicaCore,
    me: mpsc::UnboundedSender<ReplicaIn>,
    mut rx: mpsc::UnboundedReceiver<ReplicaIn>,
) {
    let gid = core.group_id();
    let mut links = Links {
        link: None,
        link_epoch: Arc::new(AtomicU64::new(0)),
        down: None,
        up: None,
    };
    let mut timer = tokio::time::interval(shared.cfg.timer_period);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    timer.tick().await;
    'run: loop {
        let mut out = Outbox::default();
        let first = tokio::select! {
            m = rx.recv() => match m {
                Some(m) => m,
                None => break 'run,
            },
            _ = timer.tick() => {
                core.timer(wall_ms(), &mut out);
                flush(&shared, &mut core, &mut links, out);
                continue;
            }
        };
        // Drain what is queued, so it leaves as one batch, but for a bounded time: the
        // node's other tasks (heartbeats above all) share this thread.
        let burst = std::time::Instant::now();
        let mut next = Some(first);
        while let Some(m) = next.take() {
            if !handle(&shared, &mut core, &mut links, &me, m, &mut out) {
                flush(&shared, &mut core, &mut links, out);
                break 'run;
            }
            if burst.elapsed() < MAX_BURST {
                next = rx.try_recv().ok();
            }
        }
        flush(&shared, &mut core, &mut links, out);
        tokio::task::yield_now().await;
    }
    if let Some(l) = links.link.take() {
        l.abort();
    }
    let mut groups = shared.groups.lock().unwrap_or_else(|e| e.into_inner());
    if groups.get(&gid).is_some_and(|tx| tx.same_channel(&me)) {
        groups.remove(&gid);
    }
    info!(group = gid, node = %shared.cfg.node_id, "replica stopped");
}

/// Handle one input. Returns false when the replica must stop.
fn handle(
    shared: &Arc<Shared>,
    core: &mut ReplicaCore,
    links: &mut Links,
    me: &mpsc::UnboundedSender<ReplicaIn>,
    m: ReplicaIn,
    out: &mut Outbox,
) -> bool {
    match m {
        ReplicaIn::Configure(cfg) => {
            let change = core.configure(cfg, out);
            links.link_epoch.store(core.epoch(), Ordering::Relaxed);
            match change {
                LinkChange::Keep => {}
                LinkChange::Drop => {
                    if let Some(l) = links.link.take() {
                        l.abort();
                    }
                    links.down = None;
                }
                LinkChange::Connect { node_id, addr } => {
                    if let Some(l) = links.link.take() {
                        l.abort();
                    }
                    links.down = None;
                    let s = shared.clone();
                    let epoch = links.link_epoch.clone();
                    let tx = me.clone();
                    let gid = core.group_id();
                    links.link = Some(
                        shared
                            .tasks
                            .spawn(successor_link(s, gid, epoch, node_id, addr, tx)),
                    );
                }
            }
            if !core.is_member() {
                info!(group = core.group_id(), "no longer a member");
                return false;
            }
        }
        ReplicaIn::Leave(epoch) => {
            if epoch >= core.epoch() {
                return false;
            }
        }
        ReplicaIn::Submit(sub) => {
            let n = sub.requests.as_ref().map_or(0, |r| r.requests.len());
            if core.submit(sub, wall_ms(), out) {
                shared
                    .requests_applied
                    .fetch_add(n as u64, Ordering::Relaxed);
            }
        }
        ReplicaIn::Scale(step) => {
            if !core.scale(step, wall_ms(), out) {
                debug!(
                    group = core.group_id(),
                    "scaling step at a replica that is not head"
                );
            }
            if let Err(e) = run_pending(shared, core, links, out) {
                warn!(error = %e, "scale op after forwarding");
            }
        }
        ReplicaIn::PredHello { conn, hello, up } => match core.predecessor_hello(conn, &hello) {
            Ok(ack) => {
                let _ = up.send(Ok(v1::ReplicateUp {
                    msg: Some(replicate_up::Msg::Hello(ack)),
                }));
                links.up = Some((conn, up));
            }
            Err(e) => {
                debug!(error = %e, "predecessor refused");
                let _ = up.send(Err(Status::failed_precondition(e)));
            }
        },
        ReplicaIn::PredMsg { conn, msg } => match msg {
            replicate_down::Msg::Ops(b) => {
                let n = b.ops.len();
                let applied = core
                    .on_ops(conn, b.ops, out)
                    .and_then(|()| run_pending(shared, core, links, out));
                if let Err(e) = applied {
                    warn!(error = %e, "dropping predecessor link");
                    if links.up.as_ref().is_some_and(|(c, _)| *c == conn) {
                        if let Some((_, up)) = links.up.take() {
                            let _ = up.send(Err(Status::aborted(e)));
                        }
                    }
                    core.predecessor_gone(conn);
                }
                let _ = n;
            }
            replicate_down::Msg::Snapshot(s) => {
                heavy(|| core.on_snapshot(conn, s, shared.factory.as_ref(), out));
            }
            replicate_down::Msg::Hello(_) => shared.bad(),
        },
        ReplicaIn::PredGone { conn } => {
            core.predecessor_gone(conn);
            if links.up.as_ref().is_some_and(|(c, _)| *c == conn) {
                links.up = None;
            }
        }
        ReplicaIn::SuccUp { conn, ack, down } => {
            links.down = Some((conn, down));
            // May serialize the whole partition for a joiner.
            heavy(|| core.successor_ready(conn, &ack, out));
        }
        ReplicaIn::SuccAck { conn, seq } => core.on_ack(conn, seq, out),
        ReplicaIn::SuccGone { conn } => {
            core.successor_lost(conn);
            if links.down.as_ref().is_some_and(|(c, _)| *c == conn) {
                links.down = None;
            }
        }
        ReplicaIn::Status { snapshots, reply } => {
            let state = heavy(|| core.state(snapshots));
            let _ = reply.send((state, core.stats));
        }
        ReplicaIn::Hosted { reply } => {
            let _ = reply.send(core.is_member().then(|| core.hosted()));
        }
        ReplicaIn::Metrics { reply } => {
            let p = core.partition().unwrap_or_default();
            let _ = reply.send(GroupMetrics {
                state: core.state(false),
                stats: core.stats,
                tenant: p.tenant,
                chain: p.chain,
            });
        }
    }
    true
}

/// A scale op the replica forwarded before applying it (`ReplicaCore::forward_first`):
/// send it (and everything before it) now, then apply it while the successor does too.
fn run_pending(
    shared: &Shared,
    core: &mut ReplicaCore,
    links: &mut Links,
    out: &mut Outbox,
) -> Result<(), String> {
    while core.has_pending() {
        flush(shared, core, links, std::mem::take(out));
        heavy(|| core.run_pending(out))?;
    }
    Ok(())
}

/// Run work that may take long (a partition's snapshot) without starving the node's
/// other tasks: on a multi-threaded runtime they move to another worker meanwhile.
fn heavy<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

fn flush(shared: &Shared, core: &mut ReplicaCore, links: &mut Links, out: Outbox) {
    if out.snapshot.is_some() || !out.down.is_empty() {
        if let Some((conn, down)) = &links.down {
            let mut ok = true;
            if let Some(s) = out.snapshot {
                ok &= down
                    .send(v1::ReplicateDown {
                        msg: Some(replicate_down::Msg::Snapshot(s)),
                    })
                    .is_ok();
            }
            if !out.down.is_empty() {
                ok &= down
                    .send(v1::ReplicateDown {
                        msg: Some(replicate_down::Msg::Ops(v1::OpBatch { ops: out.down })),
                    })
                    .is_ok();
            }
            if !ok {
                // The link died under us; the ops stay unacked and are resent on the
                // next handshake.
                core.successor_lost(*conn);
                links.down = None;
            }
        }
    }
    if let (Some(seq), Some((_, up))) = (out.ack_up, &links.up) {
        let _ = up.send(Ok(v1::ReplicateUp {
            msg: Some(replicate_up::Msg::Ack(v1::Ack { seq })),
        }));
    }
    if !out.results.is_empty() {
        let _ = shared.to_fm.send(v1::ScUp {
            msg: Some(sc_up::Msg::Results(v1::GroupResults {
                group: core.group_id(),
                epoch: core.epoch(),
                results: out.results,
            })),
        });
    }
}

// ------------------------------------------------------------------ successor link

async fn successor_link(
    shared: Arc<Shared>,
    group: u64,
    epoch: Arc<AtomicU64>,
    node_id: String,
    addr: String,
    replica: mpsc::UnboundedSender<ReplicaIn>,
) {
    let mut failures = 0u32;
    loop {
        let conn = shared.conn_id();
        match link_once(&shared, group, &epoch, &addr, conn, &replica).await {
            Ok(()) => failures = 0,
            Err(e) => {
                failures += 1;
                if failures <= 3 || failures % 100 == 0 {
                    debug!(group, succ = %node_id, %addr, error = %e, "successor link failed");
                }
            }
        }
        if replica.is_closed() {
            return;
        }
        tokio::time::sleep(shared.cfg.reconnect).await;
    }
}

async fn link_once(
    shared: &Shared,
    group: u64,
    epoch: &AtomicU64,
    addr: &str,
    conn: u64,
    replica: &mpsc::UnboundedSender<ReplicaIn>,
) -> Result<(), ScError> {
    let ch = connect(addr).await?;
    let mut client = v1::service_computation_client::ServiceComputationClient::new(ch)
        .max_decoding_message_size(proto::MAX_MESSAGE)
        .max_encoding_message_size(proto::MAX_MESSAGE);
    let (dtx, drx) = mpsc::unbounded_channel();
    let _ = dtx.send(v1::ReplicateDown {
        msg: Some(replicate_down::Msg::Hello(v1::ReplicaHello {
            group,
            epoch: epoch.load(Ordering::Relaxed),
            from: shared.cfg.node_id.clone(),
        })),
    });
    let resp = client
        .replicate(UnboundedReceiverStream::new(drx))
        .await
        .map_err(|e| ScError::Io(format!("replicate: {e}")))?;
    let mut inbound = resp.into_inner();
    let ack = match inbound.message().await {
        Ok(Some(v1::ReplicateUp {
            msg: Some(replicate_up::Msg::Hello(a)),
        })) => a,
        Ok(_) => return Err(ScError::Protocol("successor did not answer hello".into())),
        Err(e) => return Err(ScError::Io(format!("hello: {e}"))),
    };
    shared
        .counters
        .successor_links
        .fetch_add(1, Ordering::Relaxed);
    if replica
        .send(ReplicaIn::SuccUp {
            conn,
            ack,
            down: dtx,
        })
        .is_err()
    {
        return Ok(());
    }
    let r = loop {
        match inbound.message().await {
            Ok(Some(v1::ReplicateUp {
                msg: Some(replicate_up::Msg::Ack(a)),
            })) => {
                if replica
                    .send(ReplicaIn::SuccAck { conn, seq: a.seq })
                    .is_err()
                {
                    break Ok(());
                }
            }
            Ok(Some(_)) => shared.bad(),
            Ok(None) => break Err(ScError::Io("successor closed the stream".into())),
            Err(e) => break Err(ScError::Io(format!("successor: {e}"))),
        }
    };
    let _ = replica.send(ReplicaIn::SuccGone { conn });
    r
}

// ------------------------------------------------------------------ gRPC service

struct ScService {
    shared: Arc<Shared>,
}

#[tonic::async_trait]
impl ServiceComputation for ScService {
    type ReplicateStream = UnboundedReceiverStream<Result<v1::ReplicateUp, Status>>;

    async fn replicate(
        &self,
        req: Request<Streaming<v1::ReplicateDown>>,
    ) -> Result<Response<Self::ReplicateStream>, Status> {
        let shared = &self.shared;
        if shared.stopped.load(Ordering::Relaxed) {
            return Err(Status::unavailable("node stopped"));
        }
        let mut inbound = req.into_inner();
        let hello = match inbound.message().await {
            Ok(Some(v1::ReplicateDown {
                msg: Some(replicate_down::Msg::Hello(h)),
            })) => h,
            Ok(_) => {
                shared.bad();
                return Err(Status::invalid_argument("first message must be hello"));
            }
            Err(e) => {
                shared.bad();
                return Err(e);
            }
        };
        let Some(tx) = shared.group(hello.group) else {
            return Err(Status::unavailable(format!(
                "group {} not hosted here (yet)",
                hello.group
            )));
        };
        let conn = shared.conn_id();
        let (utx, urx) = mpsc::unbounded_channel();
        tx.send(ReplicaIn::PredHello {
            conn,
            hello,
            up: utx,
        })
        .map_err(|_| Status::unavailable("replica stopped"))?;
        let s = shared.clone();
        shared.tasks.spawn(async move {
            loop {
                match inbound.message().await {
                    Ok(Some(v1::ReplicateDown { msg: Some(msg) })) => {
                        if tx.send(ReplicaIn::PredMsg { conn, msg }).is_err() {
                            break;
                        }
                    }
                    Ok(Some(_)) => s.bad(),
                    Ok(None) => break,
                    Err(e) => {
                        if e.code() != tonic::Code::Cancelled && e.code() != tonic::Code::Unknown {
                            s.bad();
                        }
                        debug!(error = %e, "predecessor stream ended");
                        break;
                    }
                }
            }
            let _ = tx.send(ReplicaIn::PredGone { conn });
        });
        Ok(Response::new(UnboundedReceiverStream::new(urx)))
    }

    async fn group_status(
        &self,
        req: Request<v1::GroupStatusRequest>,
    ) -> Result<Response<v1::GroupStatusReply>, Status> {
        let groups = status(&self.shared, req.get_ref().snapshots).await;
        Ok(Response::new(v1::GroupStatusReply {
            node_id: self.shared.cfg.node_id.clone(),
            groups: groups.into_iter().map(|(s, _)| s).collect(),
        }))
    }
}

// ------------------------------------------------------------------ a node on its own thread

/// An SC node running on its own tokio runtime and threads, as if it
/// were a process of its own: [`ScProcess::kill`] drops the runtime, which ends every
/// task and closes every socket at once, the way a crashed node looks to its peers.
pub struct ScProcess {
    addr: SocketAddr,
    node_id: String,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ScProcess {
    pub fn spawn(cfg: ScConfig, factory: Arc<dyn ChainFactory>) -> Result<ScProcess, ScError> {
        let node_id = cfg.node_id.clone();
        // Two workers, so a replica busy with a large snapshot never holds up the
        // node's heartbeats.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(format!("sc-{node_id}"))
            .enable_all()
            .build()
            .map_err(|e| ScError::Io(e.to_string()))?;
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("sc-{node_id}"))
            .spawn(move || {
                rt.block_on(async move {
                    match start(cfg, factory).await {
                        Ok(h) => {
                            let _ = addr_tx.send(Ok(h.addr()));
                            let _ = stop_rx.await;
                            drop(h);
                        }
                        Err(e) => {
                            let _ = addr_tx.send(Err(e));
                        }
                    }
                });
                // Dropping the runtime here cancels whatever the node still had running.
                drop(rt);
            })
            .map_err(|e| ScError::Io(e.to_string()))?;
        let addr = addr_rx
            .recv()
            .map_err(|_| ScError::Io("SC node thread died".into()))??;
        Ok(ScProcess {
            addr,
            node_id,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// Stop the node abruptly and wait for its thread.
    pub fn kill(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for ScProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
