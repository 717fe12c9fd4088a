//! The SC node: replicas of SC groups, their chain links, and the session to FM.
//!
//! Tasks on the caller's tokio runtime (the node's I/O):
//! - the `ServiceComputation` gRPC server: `Replicate` streams from predecessors,
//!   `GroupStatus` for operators and tests;
//! - one link task per replica with a successor: a `Replicate` client stream, which
//!   reconnects until the configuration changes (links live here, not on the replica's
//!   worker, so they survive the replica parking);
//! - the state manager's timer (NF timers of parked heads) and the worker monitor
//!   (loads, rate-cost nice levels, periodic core assignment);
//! - the FM session: registration (with the groups it hosts, so an FM that does not
//!   know them can adopt them), heartbeats, group configs and submits down, tail
//!   results up. It reconnects forever, to the next of its FM addresses when one is
//!   unreachable (FM failover, [`proto::FmAddrs`]); results produced while it is down
//!   wait in a queue (FM ignores answers it no longer wants).
//!
//! Each hosted replica runs as one task on a worker of the node's pre-started pool
//! ([`crate::workers`]), owning its [`ReplicaCore`] (no locks on the hot path); it drains
//! every input that is queued before it flushes, so a burst of requests leaves as one
//! batch to the successor, one ack upstream and one message to FM. Idle for
//! `ScConfig::idle`, it parks (Serpens' scale to zero, §III-B): its core, link state and
//! inbox move into its `ReplicaSlot` in the node's state manager and its worker goes
//! back to the pool. Inputs that only maintain state (acks, timer ops from the head,
//! status queries) are applied there in place; any other input wakes it on a worker.
//! docs/workers.md has the whole model.

use proto::tls::Role;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use proto::v1::service_computation_server::{ServiceComputation, ServiceComputationServer};
use proto::v1::{self, fabric_master_client::FabricMasterClient};
use proto::v1::{replicate_down, replicate_up, sc_down, sc_up};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn};

use crate::assign::{Fallback, FallbackStep};
use crate::factory::ChainFactory;
use crate::replica::{LinkChange, Outbox, ReplicaCore, ReplicaStats};
use crate::spares::SpareChains;
use crate::workers::{
    default_workers, CoreAssigner, HistInner, Placed, RoundRobin, StartHistogram, Worker,
    WorkerLoad, WorkerPool,
};
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
    /// Pre-started workers replicas run on (default: two per core).
    pub workers: usize,
    /// The CPUs the workers are pinned to, in round-robin order (`--worker-cpus`);
    /// None: every CPU the process may run on, ascending. Nodes that share a host take
    /// disjoint lists, or one list rotated ([`crate::workers::rotated`]): with the
    /// same list, every node's first worker, and so every node's first replica, is on
    /// the same CPU.
    pub worker_cpus: Option<Vec<usize>>,
    /// The fair-scheduler slice worker threads ask for (None: the kernel's default);
    /// [`crate::workers::DEFAULT_WORKER_SLICE`] unless set.
    pub worker_slice: Option<Duration>,
    /// A replica without input for this long parks (scale to zero); None: never.
    pub idle: Option<Duration>,
    /// Backpressure at dispatch: a submit for a replica with this many inputs queued
    /// is refused at once ([`proto::ERR_SETUP_OVERLOAD`]); None (the default): unbounded.
    pub queue_limit: Option<usize>,
    /// Backpressure from the chain: a head with this many ops unacknowledged by its
    /// successors refuses new requests the same way; None: unbounded.
    pub lag_limit: Option<usize>,
    /// Between load samples of the workers (rate-cost nice levels, assignment input).
    pub monitor_period: Duration,
    /// Apply NFVnice's rate-cost share as per-worker nice levels.
    pub rate_cost_share: bool,
    /// Chooses a core per worker.
    pub assigner: Assigner,
    /// Re-run the assigner this often (None: at start and on [`ScHandle::reassign`]).
    pub assign_period: Option<Duration>,
    /// How a learned assigner is watched: RR's baseline and the learned assignment's
    /// mean over `window` monitor samples; a drop over `tolerance` reverts to RR.
    pub assign_watch: cores::watchdog::WatchdogConfig,
    /// mTLS for the replication server and the node's links (FM, successors); `None`
    /// is plaintext (`--insecure`, lab use only).
    pub tls: Option<Arc<proto::tls::NodeTls>>,
    /// Spare NF chains kept built per chain configuration the node has started, so a
    /// start takes one instead of building it ([`crate::spares`]); 0: every start
    /// builds its chain.
    pub spare_chains: usize,
    /// Threads of the node's own tokio runtime when [`ScProcess::spawn`] (or `starfabric
    /// sc`) builds it: the gRPC server, the successor links and the FM session. The
    /// replicas run on the worker pool, not here, and heartbeats have their own thread
    /// (`proto::liveness`). 2 by default. With 1, three nodes sharing two cores switched
    /// threads a fifth less often in the setup bench, but used no less CPU
    /// (docs/setup-path.md, "What a flow costs at a few thousand a second").
    pub io_threads: usize,
}

/// The node's [`CoreAssigner`] (a newtype so that the configuration stays `Debug`).
#[derive(Clone)]
pub struct Assigner(pub Arc<dyn CoreAssigner>);

impl std::fmt::Debug for Assigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Assigner({})", self.0.name())
    }
}

impl Default for Assigner {
    fn default() -> Self {
        Assigner(Arc::new(RoundRobin))
    }
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
            workers: default_workers(),
            worker_cpus: None,
            worker_slice: Some(crate::workers::DEFAULT_WORKER_SLICE),
            idle: None,
            queue_limit: None,
            lag_limit: None,
            monitor_period: Duration::from_millis(500),
            rate_cost_share: true,
            assigner: Assigner::default(),
            assign_period: None,
            assign_watch: cores::watchdog::WatchdogConfig::default(),
            tls: None,
            spare_chains: 1,
            io_threads: 2,
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
    /// Replicas placed on a worker for the first time.
    pub starts: AtomicU64,
    /// Replicas that went idle and gave their worker back.
    pub parks: AtomicU64,
    /// Parked replicas an input put back on a worker.
    pub wakes: AtomicU64,
    /// Inputs the state manager applied to a parked replica without waking it.
    pub parked_inputs: AtomicU64,
    /// Rule requests refused early because the replica's queue was over
    /// `queue_limit` (reason `queue`) or its chain lagged over `lag_limit` (`chain_lag`).
    pub shed_queue: AtomicU64,
    pub shed_chain_lag: AtomicU64,
    /// Learned core assignments that regressed and were replaced by RR (paper 002
    /// §III-A).
    pub assigner_fallbacks: AtomicU64,
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
        /// Also what the chain's traffic-counting NFs counted.
        traffic: bool,
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
    /// Park now if it can (as if idle): [`ScHandle::park`].
    Park,
}

impl ReplicaIn {
    /// Inputs that only maintain a parked replica's state: the state manager applies
    /// them in place instead of waking it. Timer ops from a parked head are the reason:
    /// NF timers keep expiring state at every replica while the chain is at zero.
    fn maintenance(&self) -> bool {
        match self {
            ReplicaIn::SuccAck { .. }
            | ReplicaIn::SuccGone { .. }
            | ReplicaIn::PredGone { .. }
            | ReplicaIn::Status { .. }
            | ReplicaIn::Metrics { .. }
            | ReplicaIn::Hosted { .. }
            | ReplicaIn::Park => true,
            ReplicaIn::PredMsg {
                msg: replicate_down::Msg::Ops(b),
                ..
            } => b
                .ops
                .iter()
                .all(|o| matches!(o.body, Some(v1::op::Body::Timer(_)))),
            _ => false,
        }
    }
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
    /// Parked in the state manager (no worker).
    pub parked: bool,
    /// The worker it runs on (None while parked).
    pub worker: Option<usize>,
}

/// Abort handles of every task a node spawned, so that stopping it leaves nothing
/// running (tests kill replicas this way).
/// They run on the node's runtime even when spawned from a replica on a worker: links
/// must outlive the replica's stay on any one worker.
struct TaskSet {
    rt: tokio::runtime::Handle,
    tasks: Mutex<Vec<AbortHandle>>,
}

impl TaskSet {
    fn spawn<F>(&self, f: F) -> AbortHandle
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let h = self.rt.spawn(f).abort_handle();
        let mut v = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        if v.len() > 64 {
            v.retain(|t| !t.is_finished());
        }
        v.push(h.clone());
        h
    }

    fn abort_all(&self) {
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            t.abort();
        }
    }
}

struct Shared {
    cfg: ScConfig,
    advertise: String,
    factory: Arc<dyn ChainFactory>,
    groups: Mutex<HashMap<u64, Arc<ReplicaSlot>>>,
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
    pool: WorkerPool,
    /// From the input that needed a worker to the replica's first decision on it: for
    /// a new replica (`start`) and for a parked one (`wake`).
    start_hist: StartHistogram,
    wake_hist: StartHistogram,
    /// Parts of a start: building the replica's NF chain (`ReplicaCore::new`, which
    /// Serpens does ahead, pre-loading NFs), and from placing it on a worker to its
    /// first decision there (the pool's own cost, Serpens Table IV's).
    build_hist: StartHistogram,
    place_hist: StartHistogram,
    /// The watch over a learned assigner (used when `cfg.assigner` is watched).
    fallback: Mutex<Fallback>,
    /// NF chains built ahead for the next start of each hosted chain (Serpens' NF
    /// Manager).
    spares: SpareChains,
    /// The FM of the current session takes rule replies encoded
    /// (`RegisterAck.encoded_replies`); until a session says so, and with an older FM,
    /// results go to FM decoded.
    fm_takes_encoded: AtomicBool,
}

impl Shared {
    fn conn_id(&self) -> u64 {
        self.next_conn.fetch_add(1, Ordering::Relaxed)
    }

    fn group(&self, id: u64) -> Option<Arc<ReplicaSlot>> {
        self.groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
    }

    /// Sends every hosted replica the request `ask` makes around a reply channel, and
    /// collects the replies (a replica that is gone or does not answer is skipped).
    async fn ask_replicas<T>(
        self: &Arc<Self>,
        ask: impl Fn(oneshot::Sender<T>) -> ReplicaIn,
    ) -> Vec<T> {
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
            if tx.send(self, ask(rtx)) {
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
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| ScError::Io(format!("bind {}: {e}", cfg.listen)))?;
    start_on(cfg, factory, listener).await
}

/// [`start`] on a listener bound already (`cfg.listen` is then unused): a node that must
/// name its address before it can start (to the orchestrator, which names the FM)
/// binds first.
pub async fn start_on(
    cfg: ScConfig,
    factory: Arc<dyn ChainFactory>,
    listener: tokio::net::TcpListener,
) -> Result<ScHandle, ScError> {
    let fms = proto::FmAddrs::parse(&cfg.fm).map_err(|e| ScError::Config(e.to_string()))?;
    let addr = listener
        .local_addr()
        .map_err(|e| ScError::Io(e.to_string()))?;
    let advertise = cfg.advertise.clone().unwrap_or_else(|| addr.to_string());
    let (to_fm, to_fm_rx) = mpsc::unbounded_channel();
    let pool = WorkerPool::start_with_slice(
        &cfg.node_id,
        cfg.workers,
        cfg.worker_cpus.as_deref(),
        cfg.worker_slice,
    )?;
    let cfg_watch = cfg.assign_watch;
    let spares = SpareChains::new(&cfg.node_id, cfg.spare_chains, factory.clone());
    let shared = Arc::new(Shared {
        cfg,
        advertise,
        factory,
        groups: Mutex::new(HashMap::new()),
        to_fm,
        to_fm_rx: tokio::sync::Mutex::new(to_fm_rx),
        next_conn: AtomicU64::new(1),
        tasks: TaskSet {
            rt: tokio::runtime::Handle::current(),
            tasks: Mutex::new(Vec::new()),
        },
        stopped: AtomicBool::new(false),
        counters: ScCounters::default(),
        requests_applied: AtomicU64::new(0),
        incarnation: rand::random(),
        current_fm: Mutex::new(String::new()),
        pool,
        start_hist: StartHistogram::default(),
        wake_hist: StartHistogram::default(),
        build_hist: StartHistogram::default(),
        place_hist: StartHistogram::default(),
        fallback: Mutex::new(Fallback::new(cfg_watch)),
        spares,
        fm_takes_encoded: AtomicBool::new(false),
    });
    let svc = ServiceComputationServer::new(ScService {
        shared: shared.clone(),
    })
    .max_decoding_message_size(proto::MAX_MESSAGE)
    .max_encoding_message_size(proto::MAX_MESSAGE);
    // Predecessors in replica chains, and FM's state queries.
    let incoming = proto::tls::incoming(listener, shared.cfg.tls.clone(), &[Role::Sc, Role::Fm])
        .map_err(|e| ScError::Io(e.to_string()))?;
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
    shared.tasks.spawn(parked_timers(shared.clone()));
    shared.tasks.spawn(monitor(shared.clone()));
    info!(node = %shared.cfg.node_id, %addr, fm = %shared.cfg.fm, workers = shared.pool.len(),
          idle_ms = shared.cfg.idle.map(|d| d.as_millis() as u64),
          assigner = shared.cfg.assigner.0.name(), "SC node started");
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
        self.shared.pool.shutdown();
        self.shared.spares.shutdown();
    }

    /// Measure the workers, ask the node's assigner for a core per worker, and pin
    /// them: the cores, one per worker. A watched (learned) assigner starts over: RR
    /// now, for a new baseline, then the learned assignment (see [`Fallback`]).
    pub fn reassign(&self) -> Result<Vec<usize>, ScError> {
        let loads = self.shared.pool.sample();
        let a = self.shared.cfg.assigner.0.clone();
        if a.watched() {
            lock(&self.shared.fallback).restart();
            return self.shared.pool.reassign(&RoundRobin, &loads);
        }
        self.shared.pool.reassign(a.as_ref(), &loads)
    }

    /// Park `group`'s replica now, as if it had been idle (scale to zero on demand).
    /// False if the node does not host it.
    pub fn park(&self, group: u64) -> bool {
        self.observer().park(group)
    }

    /// Status of every hosted replica (with state snapshots if asked).
    pub async fn status(&self, snapshots: bool) -> Vec<(v1::GroupState, ReplicaStats)> {
        status(&self.shared, snapshots, false).await
    }

    /// Status of every hosted replica with its chain's traffic counters (the monitor's),
    /// as `GroupStatus` with `traffic` answers.
    pub async fn traffic(&self) -> Vec<v1::GroupState> {
        status(&self.shared, false, true)
            .await
            .into_iter()
            .map(|(s, _)| s)
            .collect()
    }

    /// A view of this node that can be cloned into other tasks (a metrics
    /// endpoint); unlike the handle, dropping it stops nothing.
    pub fn observer(&self) -> ScObserver {
        ScObserver {
            shared: self.shared.clone(),
        }
    }

    /// See [`ScObserver::worker_stats`].
    pub fn worker_stats(&self) -> WorkerStats {
        self.observer().worker_stats()
    }
}

/// Queries of a running SC node (and parking on demand), for observers: see [`ScHandle::observer`].
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

    /// Park `group`'s replica now, as if it had been idle. False if it is not hosted.
    pub fn park(&self, group: u64) -> bool {
        self.shared
            .group(group)
            .is_some_and(|g| g.send(&self.shared, ReplicaIn::Park))
    }

    /// Start `n` replicas one after another, each only once the one before it has
    /// decided and left, through the path FM's configure takes (`on_configure`: build
    /// the chain, take a worker, first decision on it). Returns the node's own start
    /// samples for them (configure → first decision).
    ///
    /// Why: FM configures a cluster's groups all at once, so the start samples of
    /// `bench workers` also hold each start's wait behind the ones queued before it on
    /// the same cores. This measures one start with nothing queued, which is what
    /// Serpens Table IV's 34 µs is. Each probe replica is a one-member group with an id
    /// from the top of the id space (FM counts up from 1), and leaves right after its
    /// first decision.
    #[cfg(feature = "testing")]
    pub fn probe_starts(
        &self,
        chain: &v1::ChainConfig,
        partition: v1::Partition,
        n: usize,
        limit: Duration,
    ) -> Result<Vec<Duration>, ScError> {
        let sh = &self.shared;
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let gid = u64::MAX - i as u64;
            let cfg = v1::GroupConfig {
                group: Some(v1::ScGroup {
                    id: gid,
                    epoch: 1,
                    replicas: vec![v1::Replica {
                        node_id: sh.cfg.node_id.clone(),
                        addr: self.shared.cfg.listen.to_string(),
                    }],
                }),
                partition: Some(v1::Partition {
                    group: gid,
                    ..partition
                }),
                chain: Some(chain.clone()),
                ..Default::default()
            };
            let before = sh.start_hist.snapshot().count;
            on_configure(sh, cfg);
            let t = Instant::now();
            // Sleep, not spin: a spinning prober would take a core from the worker it
            // measures.
            let sample = loop {
                let h = sh.start_hist.snapshot();
                if h.count > before {
                    break h.recent.back().copied();
                }
                if t.elapsed() > limit {
                    return Err(ScError::Io(format!(
                        "probe start {i}: no decision within {limit:?}"
                    )));
                }
                std::thread::sleep(Duration::from_micros(200));
            };
            out.extend(sample.map(Duration::from_nanos));
            if let Some(slot) = sh.group(gid) {
                slot.send(sh, ReplicaIn::Leave(1));
            }
            while sh.group(gid).is_some() {
                if t.elapsed() > limit {
                    return Err(ScError::Io(format!(
                        "probe start {i}: replica did not leave"
                    )));
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        Ok(out)
    }

    /// The worker pool and the state manager.
    pub fn worker_stats(&self) -> WorkerStats {
        let sh = &self.shared;
        let parked = sh
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter(|g| g.is_parked())
            .count();
        let c = &sh.counters;
        WorkerStats {
            workers: sh.pool.len(),
            busy: sh.pool.busy(),
            cores: sh.pool.cores(),
            parked,
            start: sh.start_hist.snapshot(),
            wake: sh.wake_hist.snapshot(),
            build: sh.build_hist.snapshot(),
            place: sh.place_hist.snapshot(),
            starts: c.starts.load(Ordering::Relaxed),
            parks: c.parks.load(Ordering::Relaxed),
            wakes: c.wakes.load(Ordering::Relaxed),
            parked_inputs: c.parked_inputs.load(Ordering::Relaxed),
            spare_hits: sh.spares.counters.hits.load(Ordering::Relaxed),
            spare_misses: sh.spares.counters.misses.load(Ordering::Relaxed),
            spare_misses_building: sh.spares.counters.misses_building.load(Ordering::Relaxed),
            spare_misses_contended: sh.spares.counters.misses_contended.load(Ordering::Relaxed),
            spares_built: sh.spares.counters.built.load(Ordering::Relaxed),
            spares_failed: sh.spares.counters.failed.load(Ordering::Relaxed),
            shed_queue: c.shed_queue.load(Ordering::Relaxed),
            shed_chain_lag: c.shed_chain_lag.load(Ordering::Relaxed),
            loads: sh.pool.last_loads(),
            placement: sh
                .pool
                .workers()
                .iter()
                .map(|w| (sh.pool.cpu(w.core()), w.nice(), w.replicas()))
                .collect(),
            slices: sh.pool.workers().iter().map(|w| w.slice()).collect(),
            os_errors: sh.pool.counters.os_errors.load(Ordering::Relaxed),
            reassignments: sh.pool.counters.reassignments.load(Ordering::Relaxed),
            assigner: active_assigner(sh),
            assigner_fallbacks: c.assigner_fallbacks.load(Ordering::Relaxed),
            assigner_fallback_reason: lock(&sh.fallback).last_reason().map(str::to_string),
        }
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

/// What [`ScObserver::worker_stats`] reports.
#[derive(Debug, Clone, Default)]
pub struct WorkerStats {
    pub workers: usize,
    /// Workers running at least one replica.
    pub busy: usize,
    pub cores: usize,
    /// Replicas parked in the state manager.
    pub parked: usize,
    /// Configure → a new replica's first decision on a worker.
    pub start: HistInner,
    /// Waking input → a parked replica's first decision on a worker.
    pub wake: HistInner,
    /// The parts of `start`: building its NF chain; placing it → first decision.
    pub build: HistInner,
    pub place: HistInner,
    pub starts: u64,
    pub parks: u64,
    pub wakes: u64,
    pub parked_inputs: u64,
    /// Starts whose NF chain was a spare built ahead, and starts that built it
    /// ([`crate::spares`]); spares built in the background, and builds that failed.
    pub spare_hits: u64,
    pub spare_misses: u64,
    /// Of the misses: the spare was still being built; the builder had the shelf.
    pub spare_misses_building: u64,
    pub spare_misses_contended: u64,
    pub spares_built: u64,
    pub spares_failed: u64,
    pub shed_queue: u64,
    pub shed_chain_lag: u64,
    /// The latest load sample.
    pub loads: Vec<WorkerLoad>,
    /// Per worker: (the CPU it is pinned to, nice, replicas).
    pub placement: Vec<(usize, i32, usize)>,
    /// Each worker's scheduler slice (None: the kernel's default).
    pub slices: Vec<Option<Duration>>,
    pub os_errors: u64,
    pub reassignments: u64,
    /// The assignment in force: the assigner's name, or `rr (baseline for s2c)` /
    /// `rr (fallback from s2c)` while a learned one is measured or was reverted.
    pub assigner: String,
    pub assigner_fallbacks: u64,
    /// Why the latest fallback happened.
    pub assigner_fallback_reason: Option<String>,
}

fn active_assigner(sh: &Shared) -> String {
    let a = &sh.cfg.assigner.0;
    if !a.watched() {
        return a.name().to_string();
    }
    let f = lock(&sh.fallback);
    if f.watched_active() {
        a.name().to_string()
    } else if f.fallbacks() > 0 && f.last_reason().is_some() {
        format!("rr (fallback from {})", a.name())
    } else {
        format!("rr (baseline for {})", a.name())
    }
}

impl Drop for ScHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn status(
    shared: &Arc<Shared>,
    snapshots: bool,
    traffic: bool,
) -> Vec<(v1::GroupState, ReplicaStats)> {
    let mut out = shared
        .ask_replicas(|reply| ReplicaIn::Status {
            snapshots,
            traffic,
            reply,
        })
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

async fn connect(shared: &Shared, addr: &str, server: Role) -> Result<Channel, ScError> {
    proto::connect(addr, shared.cfg.tls.as_ref(), server)
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
async fn hosted_groups(shared: &Arc<Shared>) -> Vec<v1::HostedGroup> {
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
    let ch = connect(shared, fm, Role::Fm).await?;
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
    let encoded = ack.encoded_replies;
    shared.fm_takes_encoded.store(encoded, Ordering::Relaxed);
    let forward = shared.tasks.spawn(async move {
        let mut rx = s2.to_fm_rx.lock().await;
        while let Some(mut m) = rx.recv().await {
            // Encoded for an FM before this one (a failover to an older FM): decoded
            // back, so this one reads them.
            if let (false, Some(sc_up::Msg::Results(r))) = (encoded, &mut m.msg) {
                let bad = proto::decode_rule_replies(&mut r.results);
                if bad > 0 {
                    warn!(
                        bad,
                        "encoded replies that do not decode; dropped (FM retries them)"
                    );
                }
            }
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
                Some(slot) => dispatch_submit(shared, &slot, sub),
                None => {
                    shared
                        .counters
                        .unknown_group
                        .fetch_add(1, Ordering::Relaxed);
                }
            },
            Some(sc_down::Msg::Leave(l)) => {
                if let Some(slot) = shared.group(l.group) {
                    slot.send(shared, ReplicaIn::Leave(l.epoch));
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
            Some(sc_down::Msg::Pull(p)) => scale_step(shared, p.group, v1::scale_op::Step::Pull(p)),
            Some(sc_down::Msg::Registered(_)) => {}
            Some(sc_down::Msg::Deploy(chain)) => shared.spares.deploy(&chain),
            None => shared.bad(),
        }
    };
    forward.abort();
    heartbeat.abort();
    result
}

/// The node's dispatch is upstream of every replica's worker: a submit for a replica
/// whose queue is over `queue_limit` is refused here, before it costs the worker
/// anything (NFVnice's backpressure, docs/workers.md). Flow events still pass: they
/// keep state right, and are few.
fn dispatch_submit(shared: &Arc<Shared>, slot: &Arc<ReplicaSlot>, mut sub: v1::GroupSubmit) {
    let over = shared
        .cfg
        .queue_limit
        .is_some_and(|l| slot.queued.load(Ordering::Relaxed) >= l);
    if over {
        if let Some(reqs) = sub.requests.take() {
            let n = reqs.requests.len() as u64;
            shared.counters.shed_queue.fetch_add(n, Ordering::Relaxed);
            let _ = shared
                .to_fm
                .send(overload_results(sub.group, sub.epoch, &reqs));
        }
        if sub.events.as_ref().is_none_or(|e| e.events.is_empty()) {
            return;
        }
    }
    slot.send(shared, ReplicaIn::Submit(sub));
}

/// Answers refusing every request of `reqs` with [`proto::ERR_SETUP_OVERLOAD`]: FM
/// passes them to the PP node, which refuses the flow and asks again on its next packet.
fn overload_results(group: u64, epoch: u64, reqs: &v1::RuleRequestBatch) -> v1::ScUp {
    v1::ScUp {
        msg: Some(sc_up::Msg::Results(v1::GroupResults {
            group,
            epoch,
            results: vec![v1::OpResult {
                seq: 0,
                replies: reqs
                    .requests
                    .iter()
                    .map(|r| proto::error_reply(r, proto::ERR_SETUP_OVERLOAD))
                    .collect(),
                ..Default::default()
            }],
        })),
    }
}

fn scale_step(shared: &Arc<Shared>, group: u64, step: v1::scale_op::Step) {
    match shared.group(group) {
        Some(slot) => {
            slot.send(shared, ReplicaIn::Scale(step));
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
    let at = Instant::now();
    let gid = g.id;
    let existing = shared.group(gid);
    if let Some(slot) = existing {
        if slot.send(shared, ReplicaIn::Configure(cfg.clone())) {
            return;
        }
    }
    if !g.replicas.iter().any(|r| r.node_id == shared.cfg.node_id) {
        return;
    }
    // The next spare is asked for when `_refill` drops: after the start is placed.
    let (spare, _refill) = match &cfg.chain {
        Some(c) => shared.spares.take(c),
        None => (None, shared.spares.no_refill()),
    };
    let mut core = match spare {
        Some(chain) => ReplicaCore::with_chain(&shared.cfg.node_id, cfg.clone(), Ok(chain)),
        None => ReplicaCore::new(&shared.cfg.node_id, cfg.clone(), shared.factory.as_ref()),
    };
    shared.build_hist.observe(at.elapsed());
    // Scale ops carry or produce a partition's bulk state: let the chain's replicas
    // apply them side by side (docs/scaling.md).
    core.forward_first(true);
    let (tx, rx) = mpsc::unbounded_channel();
    let p = cfg.partition.unwrap_or_default();
    let slot = Arc::new(ReplicaSlot {
        gid,
        tenant: p.tenant,
        chain: p.chain,
        tx,
        queued: Arc::new(AtomicUsize::new(0)),
        state: Mutex::new(SlotState::Running),
    });
    let links = Links {
        link: None,
        link_epoch: Arc::new(AtomicU64::new(0)),
        down: None,
        up: None,
        worker: None,
        park_now: false,
        ack: HeldAck::default(),
    };
    let mut groups = shared.groups.lock().unwrap_or_else(|e| e.into_inner());
    if groups.get(&gid).is_some_and(|g| !g.is_stopped()) {
        // Configured twice at once (FM resent it): the first one won.
        return;
    }
    groups.insert(gid, slot.clone());
    drop(groups);
    shared.counters.starts.fetch_add(1, Ordering::Relaxed);
    let st = lock(&slot.state);
    let _ = slot.tx.send(ReplicaIn::Configure(cfg));
    slot.queued.fetch_add(1, Ordering::Relaxed);
    place(shared, &slot, core, links, rx, Vec::new(), at, false);
    drop(st);
}

// ------------------------------------------------------------------ replica task

/// Longest a replica works through queued input before it flushes and yields.
const MAX_BURST: Duration = Duration::from_millis(2);

/// Within a burst, a replica flushes (ops to its successor, results to FM, acks) each
/// time it has applied this many requests, so the next replica starts on them while
/// this one takes the rest of its queue (FM does the same; docs/setup-path.md).
const FLUSH_AFTER: u64 = 256;

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where a replica is.
enum SlotState {
    /// On a worker (or being placed on one).
    Running,
    /// In the state manager, without a worker.
    Parked(Box<Parked>),
    /// Gone: inputs are refused.
    Stopped,
}

/// What the state manager keeps of a parked replica: everything its task owned.
struct Parked {
    core: ReplicaCore,
    links: Links,
    rx: mpsc::UnboundedReceiver<ReplicaIn>,
}

/// A hosted replica as the node's dispatch sees it: its inbox, and where it is. Every
/// input goes through [`ReplicaSlot::send`], which wakes a parked replica; parking and
/// sending take the same lock, so an input can never be left behind in the inbox of a
/// replica that parked without seeing it.
pub(crate) struct ReplicaSlot {
    gid: u64,
    tenant: u32,
    chain: u32,
    tx: mpsc::UnboundedSender<ReplicaIn>,
    /// Inputs sent and not yet taken from the inbox (the backpressure signal).
    queued: Arc<AtomicUsize>,
    state: Mutex<SlotState>,
}

impl ReplicaSlot {
    fn is_parked(&self) -> bool {
        matches!(*lock(&self.state), SlotState::Parked(_))
    }

    fn is_stopped(&self) -> bool {
        matches!(*lock(&self.state), SlotState::Stopped)
    }

    fn placed(&self) -> Placed {
        Placed {
            group: self.gid,
            tenant: self.tenant,
            chain: self.chain,
            queued: self.queued.clone(),
        }
    }

    /// Queue `m` for the replica. A parked replica gets it applied in place by the
    /// state manager if it is maintenance, or is woken on a worker. False if the
    /// replica is gone.
    fn send(self: &Arc<Self>, shared: &Arc<Shared>, m: ReplicaIn) -> bool {
        let at = Instant::now();
        let mut st = lock(&self.state);
        if matches!(*st, SlotState::Stopped) || self.tx.send(m).is_err() {
            return false;
        }
        self.queued.fetch_add(1, Ordering::Relaxed);
        if !matches!(*st, SlotState::Parked(_)) {
            return true;
        }
        let SlotState::Parked(mut p) = std::mem::replace(&mut *st, SlotState::Running) else {
            return true;
        };
        // In order: maintenance up to the first input that needs the worker; that one
        // and everything after it wait for the worker.
        let mut backlog = Vec::new();
        while let Ok(m) = p.rx.try_recv() {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            if backlog.is_empty() && m.maintenance() {
                let mut out = Outbox::default();
                shared
                    .counters
                    .parked_inputs
                    .fetch_add(1, Ordering::Relaxed);
                handle(shared, &mut p.core, &mut p.links, self, m, &mut out);
                flush(shared, &mut p.core, &mut p.links, out);
            } else {
                backlog.push(m);
            }
        }
        if backlog.is_empty() {
            *st = SlotState::Parked(p);
            return true;
        }
        shared.counters.wakes.fetch_add(1, Ordering::Relaxed);
        let Parked { core, links, rx } = *p;
        place(shared, self, core, links, rx, backlog, at, true);
        true
    }
}

/// Put a replica on a worker from the pool. `at`: when the input that needs it came;
/// its first decision there is measured from then. Called with the slot's lock held.
#[allow(clippy::too_many_arguments)]
fn place(
    shared: &Arc<Shared>,
    slot: &Arc<ReplicaSlot>,
    core: ReplicaCore,
    mut links: Links,
    rx: mpsc::UnboundedReceiver<ReplicaIn>,
    backlog: Vec<ReplicaIn>,
    at: Instant,
    wake: bool,
) {
    let w = shared.pool.take(slot.placed());
    links.worker = Some(w.id);
    links.park_now = false;
    let run = Run {
        shared: shared.clone(),
        slot: slot.clone(),
        worker: w.clone(),
        first: Some((at, wake)),
        placed_at: Instant::now(),
    };
    w.spawn(replica_task(run, core, links, rx, backlog));
}

struct Links {
    /// Successor link task and the epoch its hellos carry.
    link: Option<AbortHandle>,
    link_epoch: Arc<AtomicU64>,
    down: Option<(u64, mpsc::UnboundedSender<v1::ReplicateDown>)>,
    up: Option<(u64, mpsc::UnboundedSender<Result<v1::ReplicateUp, Status>>)>,
    /// The worker the replica runs on (None while parked).
    worker: Option<usize>,
    /// Asked to park at the end of this burst.
    park_now: bool,
    /// The ack owed upstream, held back a little (see [`ACK_HOLD`]).
    ack: HeldAck,
}

/// How long a replica may hold its ack to the predecessor back, so that the acks of
/// several bursts leave as one. At a few thousand new flows a second every op is a
/// burst of its own, and each ack wakes two runtimes and two workers on its way to the
/// head (tail → middle → head): about 40% of the thread wake-ups a flow costs there.
/// Nothing waits on an ack to answer a flow (the tail's result to FM is what commits
/// it); acks only trim the predecessors' resend buffers, which hold up to this much
/// more for it (and `ScConfig::lag_limit`, if set, counts those ops too).
const ACK_HOLD: Duration = Duration::from_millis(5);

/// An ack covering this many more ops than the last one sent leaves at once.
const ACK_HOLD_OPS: u64 = 1024;

/// The ack a replica owes its predecessor and has not sent yet.
#[derive(Default)]
struct HeldAck {
    /// (predecessor connection, highest seq to acknowledge), since when.
    pending: Option<(u64, u64, Instant)>,
    /// The last seq sent upstream.
    sent: u64,
}

impl Links {
    /// Owe the predecessor an ack of `seq`; sent now if `now` (or when it is due).
    fn ack(&mut self, seq: u64, now: bool) {
        let Some((conn, _)) = &self.up else {
            return;
        };
        let conn = *conn;
        let (seq, since) = match self.ack.pending {
            Some((c, held, since)) if c == conn => (held.max(seq), since),
            _ => (seq, Instant::now()),
        };
        self.ack.pending = Some((conn, seq, since));
        // Due by time too: a replica busy burst after burst may not get to its timer.
        if now || seq.saturating_sub(self.ack.sent) >= ACK_HOLD_OPS || since.elapsed() >= ACK_HOLD {
            self.send_ack();
        }
    }

    /// When the held ack is due, if there is one.
    fn ack_due(&self) -> Option<tokio::time::Instant> {
        self.ack
            .pending
            .map(|(_, _, since)| tokio::time::Instant::from_std(since + ACK_HOLD))
    }

    /// Send the held ack, if any, to the predecessor it is for (a predecessor that has
    /// gone since is not told: its successor's handshake says where it stands).
    fn send_ack(&mut self) {
        let Some((conn, seq, _)) = self.ack.pending.take() else {
            return;
        };
        if let Some((c, up)) = &self.up {
            if *c == conn {
                let _ = up.send(Ok(v1::ReplicateUp {
                    msg: Some(replicate_up::Msg::Ack(v1::Ack { seq })),
                }));
                self.ack.sent = seq;
            }
        }
    }
}

/// A replica's stay on one worker.
struct Run {
    shared: Arc<Shared>,
    slot: Arc<ReplicaSlot>,
    worker: Arc<Worker>,
    /// When the input that needed the worker came, and whether it woke the replica.
    first: Option<(Instant, bool)>,
    placed_at: Instant,
}

impl Run {
    fn first_decision(&mut self) {
        if let Some((at, wake)) = self.first.take() {
            if wake {
                self.shared.wake_hist.observe(at.elapsed());
            } else {
                self.shared.start_hist.observe(at.elapsed());
                self.shared.place_hist.observe(self.placed_at.elapsed());
            }
        }
    }

    fn received(&self) {
        self.slot.queued.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A replica on a worker, until it stops or parks. `backlog`: inputs taken from its
/// inbox while it was parked, handled first.
async fn replica_task(
    mut run: Run,
    mut core: ReplicaCore,
    mut links: Links,
    mut rx: mpsc::UnboundedReceiver<ReplicaIn>,
    backlog: Vec<ReplicaIn>,
) {
    let shared = run.shared.clone();
    let slot = run.slot.clone();
    let gid = core.group_id();
    // The first tick one period from now: an interval's immediate first tick would
    // still wait for the time driver's next millisecond, and delay the first decision.
    let period = shared.cfg.timer_period;
    let mut timer = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut out = Outbox::default();
    let mut stop = false;
    let t0 = Instant::now();
    let before = core.stats.requests_applied;
    for m in backlog {
        if !handle(&shared, &mut core, &mut links, &slot, m, &mut out) {
            stop = true;
            break;
        }
        run.first_decision();
    }
    flush(&shared, &mut core, &mut links, std::mem::take(&mut out));
    run.worker
        .record(core.stats.requests_applied - before, t0.elapsed());
    let mut last_active = tokio::time::Instant::now();
    'run: loop {
        if stop {
            break;
        }
        let idle_at = shared.cfg.idle.map(|d| last_active + d);
        let first = tokio::select! {
            m = rx.recv() => match m {
                Some(m) => m,
                None => break 'run,
            },
            _ = timer.tick() => {
                core.timer(wall_ms(), &mut out);
                flush_holding_ack(&shared, &mut core, &mut links, std::mem::take(&mut out));
                continue;
            }
            _ = sleep_until(links.ack_due()) => {
                links.send_ack();
                continue;
            }
            _ = sleep_until(idle_at) => {
                match park(&run, core, links, rx) {
                    Ok(()) => return,
                    Err(p) => {
                        let Parked { core: c, links: l, rx: r } = *p;
                        (core, links, rx) = (c, l, r);
                        last_active = tokio::time::Instant::now();
                        continue;
                    }
                }
            }
        };
        run.received();
        // Drain what is queued, so it leaves as one batch, but for a bounded time: the
        // worker's other replicas share this thread.
        let burst = Instant::now();
        let before = core.stats.requests_applied;
        let mut flushed_at = before;
        let mut next = Some(first);
        while let Some(m) = next.take() {
            if !m.maintenance() {
                last_active = tokio::time::Instant::now();
            }
            if !handle(&shared, &mut core, &mut links, &slot, m, &mut out) {
                flush(&shared, &mut core, &mut links, std::mem::take(&mut out));
                break 'run;
            }
            run.first_decision();
            if core.stats.requests_applied - flushed_at >= FLUSH_AFTER {
                flush_holding_ack(&shared, &mut core, &mut links, std::mem::take(&mut out));
                flushed_at = core.stats.requests_applied;
            }
            if burst.elapsed() < MAX_BURST {
                next = rx.try_recv().ok();
                if next.is_some() {
                    run.received();
                }
            }
        }
        flush_holding_ack(&shared, &mut core, &mut links, std::mem::take(&mut out));
        run.worker
            .record(core.stats.requests_applied - before, burst.elapsed());
        if links.park_now {
            match park(&run, core, links, rx) {
                Ok(()) => return,
                Err(p) => {
                    // Input came in meanwhile: park after it (`park_now` stays set).
                    let Parked {
                        core: c,
                        links: l,
                        rx: r,
                    } = *p;
                    (core, links, rx) = (c, l, r);
                }
            }
        }
        tokio::task::yield_now().await;
    }
    links.send_ack();
    if let Some(l) = links.link.take() {
        l.abort();
    }
    *lock(&slot.state) = SlotState::Stopped;
    let mut groups = lock(&shared.groups);
    if groups.get(&gid).is_some_and(|g| Arc::ptr_eq(g, &slot)) {
        groups.remove(&gid);
    }
    drop(groups);
    shared.pool.release(&run.worker, gid);
    info!(group = gid, node = %shared.cfg.node_id, "replica stopped");
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Park the replica in its slot and give the worker back; refused (the state comes
/// back) while input is queued or a forwarded scale op waits.
fn park(
    run: &Run,
    core: ReplicaCore,
    mut links: Links,
    rx: mpsc::UnboundedReceiver<ReplicaIn>,
) -> Result<(), Box<Parked>> {
    // A parked replica has no timer to send it later.
    links.send_ack();
    let mut st = lock(&run.slot.state);
    if run.slot.queued.load(Ordering::Relaxed) > 0 || core.has_pending() {
        return Err(Box::new(Parked { core, links, rx }));
    }
    links.worker = None;
    links.park_now = false;
    *st = SlotState::Parked(Box::new(Parked { core, links, rx }));
    drop(st);
    run.shared.pool.release(&run.worker, run.slot.gid);
    run.shared.counters.parks.fetch_add(1, Ordering::Relaxed);
    debug!(
        group = run.slot.gid,
        worker = run.worker.id,
        "replica parked"
    );
    Ok(())
}

/// The state manager's timer: a parked head still runs its NFs' timers every
/// `timer_period` (as an op down its chain, which parked replicas apply in place), so
/// state expires at the same times as when it runs.
async fn parked_timers(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(shared.cfg.timer_period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let slots: Vec<_> = lock(&shared.groups).values().cloned().collect();
        for slot in slots {
            let mut st = lock(&slot.state);
            if let SlotState::Parked(p) = &mut *st {
                if p.core.is_head() {
                    let mut out = Outbox::default();
                    p.core.timer(wall_ms(), &mut out);
                    flush(&shared, &mut p.core, &mut p.links, out);
                }
            }
        }
    }
}

/// Sample the workers' loads; apply the rate-cost share and, if periodic, the
/// assignment.
async fn monitor(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(shared.cfg.monitor_period.max(Duration::from_millis(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_assign = Instant::now();
    let assigner = shared.cfg.assigner.0.clone();
    // A watched (learned) assigner is applied only once RR's throughput is known.
    let watched = assigner.watched();
    let first: &dyn CoreAssigner = if watched {
        &RoundRobin
    } else {
        assigner.as_ref()
    };
    if let Err(e) = shared.pool.reassign(first, &shared.pool.sample()) {
        warn!(error = %e, "initial core assignment refused; workers stay round robin");
    }
    loop {
        tick.tick().await;
        let loads = shared.pool.sample();
        if shared.cfg.rate_cost_share {
            shared.pool.apply_rate_cost_share(&loads);
        }
        if watched {
            let throughput: f64 = loads.iter().map(|l| l.arrival_per_s).sum();
            let step = lock(&shared.fallback).observe(throughput);
            match step {
                FallbackStep::Stay => {}
                FallbackStep::ApplyWatched { rr_throughput } => {
                    last_assign = Instant::now();
                    match shared.pool.reassign(assigner.as_ref(), &loads) {
                        Ok(cores) => info!(
                            event = "assigner_applied",
                            assigner = assigner.name(),
                            rr_throughput,
                            ?cores,
                            "learned core assignment applied; watching throughput against RR's"
                        ),
                        Err(e) => warn!(error = %e, "core assignment refused"),
                    }
                }
                FallbackStep::RevertToRr { reason } => {
                    shared
                        .counters
                        .assigner_fallbacks
                        .fetch_add(1, Ordering::Relaxed);
                    warn!(event = "assigner_fallback", assigner = assigner.name(), %reason,
                          "learned core assignment regressed; back to round robin");
                    if let Err(e) = shared.pool.reassign(&RoundRobin, &loads) {
                        warn!(error = %e, "round robin assignment refused");
                    }
                }
            }
            if !lock(&shared.fallback).watched_active() {
                continue;
            }
        }
        if let Some(p) = shared.cfg.assign_period {
            if last_assign.elapsed() >= p {
                last_assign = Instant::now();
                if let Err(e) = shared.pool.reassign(assigner.as_ref(), &loads) {
                    warn!(error = %e, "core assignment refused");
                }
            }
        }
    }
}

/// Handle one input. Returns false when the replica must stop.
fn handle(
    shared: &Arc<Shared>,
    core: &mut ReplicaCore,
    links: &mut Links,
    me: &Arc<ReplicaSlot>,
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
        ReplicaIn::Submit(mut sub) => {
            // The chain's backpressure: a head whose successors lag this far behind
            // refuses new requests instead of queueing more ops for them.
            let lagging = core.is_head()
                && shared
                    .cfg
                    .lag_limit
                    .is_some_and(|l| core.unacked_len() >= l);
            if lagging {
                if let Some(reqs) = sub.requests.take() {
                    shared
                        .counters
                        .shed_chain_lag
                        .fetch_add(reqs.requests.len() as u64, Ordering::Relaxed);
                    if let Some(sc_up::Msg::Results(r)) =
                        overload_results(sub.group, sub.epoch, &reqs).msg
                    {
                        out.results.extend(r.results);
                    }
                }
            }
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
        ReplicaIn::Status {
            snapshots,
            traffic,
            reply,
        } => {
            let mut state = heavy(|| core.state(snapshots));
            if traffic {
                state.traffic = core.traffic();
            }
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
                parked: links.worker.is_none(),
                worker: links.worker,
            });
        }
        ReplicaIn::Park => links.park_now = links.worker.is_some(),
    }
    true
}

/// A scale op the replica forwarded before applying it (`ReplicaCore::forward_first`):
/// send it (and everything before it) now, then apply it while the successor does too.
fn run_pending(
    shared: &Arc<Shared>,
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

fn flush(shared: &Arc<Shared>, core: &mut ReplicaCore, links: &mut Links, out: Outbox) {
    flush_with(shared, core, links, out, true);
}

/// [`flush`], but the ack upstream may be held back ([`ACK_HOLD`]): only the replica
/// task's own flushes do this, since its loop sends the ack when it falls due.
fn flush_holding_ack(shared: &Arc<Shared>, core: &mut ReplicaCore, links: &mut Links, out: Outbox) {
    flush_with(shared, core, links, out, false);
}

fn flush_with(
    shared: &Arc<Shared>,
    core: &mut ReplicaCore,
    links: &mut Links,
    out: Outbox,
    ack_now: bool,
) {
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
    match out.ack_up {
        Some(seq) => links.ack(seq, ack_now),
        None if ack_now => links.send_ack(),
        None => {}
    }
    // The tail encodes its next results' rule replies as it makes them, for an FM
    // that takes them so (`ReplicaCore::encode_replies`).
    let encoded = shared.fm_takes_encoded.load(Ordering::Relaxed);
    core.encode_replies(encoded);
    if !out.results.is_empty() {
        // Encoded on the replica's worker, once per reply: FM passes the bytes on to PP
        // as they are (proto's `encoded_rules` says what this saves). Most came encoded
        // from the core; this catches the rest (made before the FM said it takes them,
        // or restored from a snapshot).
        let mut results = out.results;
        if encoded {
            proto::encode_rule_replies(&mut results, core.group_id());
        }
        let _ = shared.to_fm.send(v1::ScUp {
            msg: Some(sc_up::Msg::Results(v1::GroupResults {
                group: core.group_id(),
                epoch: core.epoch(),
                results,
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
    replica: Arc<ReplicaSlot>,
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
        if replica.is_stopped() {
            return;
        }
        tokio::time::sleep(shared.cfg.reconnect).await;
    }
}

async fn link_once(
    shared: &Arc<Shared>,
    group: u64,
    epoch: &AtomicU64,
    addr: &str,
    conn: u64,
    replica: &Arc<ReplicaSlot>,
) -> Result<(), ScError> {
    let ch = connect(shared, addr, Role::Sc).await?;
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
    if !replica.send(
        shared,
        ReplicaIn::SuccUp {
            conn,
            ack,
            down: dtx,
        },
    ) {
        return Ok(());
    }
    let r = loop {
        match inbound.message().await {
            Ok(Some(v1::ReplicateUp {
                msg: Some(replicate_up::Msg::Ack(a)),
            })) => {
                if !replica.send(shared, ReplicaIn::SuccAck { conn, seq: a.seq }) {
                    break Ok(());
                }
            }
            Ok(Some(_)) => shared.bad(),
            Ok(None) => break Err(ScError::Io("successor closed the stream".into())),
            Err(e) => break Err(ScError::Io(format!("successor: {e}"))),
        }
    };
    replica.send(shared, ReplicaIn::SuccGone { conn });
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
        proto::tls::authorize(&req, shared.cfg.tls.as_deref(), &[Role::Sc])?;
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
        if !tx.send(
            shared,
            ReplicaIn::PredHello {
                conn,
                hello,
                up: utx,
            },
        ) {
            return Err(Status::unavailable("replica stopped"));
        }
        let s = shared.clone();
        shared.tasks.spawn(async move {
            loop {
                match inbound.message().await {
                    Ok(Some(v1::ReplicateDown { msg: Some(msg) })) => {
                        if !tx.send(&s, ReplicaIn::PredMsg { conn, msg }) {
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
            tx.send(&s, ReplicaIn::PredGone { conn });
        });
        Ok(Response::new(UnboundedReceiverStream::new(urx)))
    }

    async fn group_status(
        &self,
        req: Request<v1::GroupStatusRequest>,
    ) -> Result<Response<v1::GroupStatusReply>, Status> {
        let r = req.into_inner();
        let groups = status(&self.shared, r.snapshots, r.traffic).await;
        Ok(Response::new(v1::GroupStatusReply {
            node_id: self.shared.cfg.node_id.clone(),
            groups: groups
                .into_iter()
                .map(|(s, _)| s)
                .filter(|s| r.groups.is_empty() || r.groups.contains(&s.group))
                .collect(),
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
    observer: ScObserver,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ScProcess {
    pub fn spawn(cfg: ScConfig, factory: Arc<dyn ChainFactory>) -> Result<ScProcess, ScError> {
        let node_id = cfg.node_id.clone();
        // Multi-threaded even with one thread: `heavy` moves a long snapshot off the
        // runtime with `block_in_place`, which a current-thread runtime cannot do.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.io_threads.max(1))
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
                            let _ = addr_tx.send(Ok((h.addr(), h.observer())));
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
        let (addr, observer) = addr_rx
            .recv()
            .map_err(|_| ScError::Io("SC node thread died".into()))??;
        Ok(ScProcess {
            addr,
            node_id,
            observer,
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

    /// Queries of the node (they answer nothing useful once it is killed).
    pub fn observer(&self) -> &ScObserver {
        &self.observer
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

#[cfg(test)]
mod tests {
    use super::*;

    fn links_with_up(
        conn: u64,
    ) -> (
        Links,
        mpsc::UnboundedReceiver<Result<v1::ReplicateUp, Status>>,
    ) {
        let (tx, rx) = mpsc::unbounded_channel();
        let links = Links {
            link: None,
            link_epoch: Arc::new(AtomicU64::new(0)),
            down: None,
            up: Some((conn, tx)),
            worker: None,
            park_now: false,
            ack: HeldAck::default(),
        };
        (links, rx)
    }

    fn acked(rx: &mut mpsc::UnboundedReceiver<Result<v1::ReplicateUp, Status>>) -> Vec<u64> {
        let mut seqs = Vec::new();
        while let Ok(Ok(m)) = rx.try_recv() {
            if let Some(replicate_up::Msg::Ack(a)) = m.msg {
                seqs.push(a.seq);
            }
        }
        seqs
    }

    #[test]
    fn a_held_ack_leaves_once_for_several_bursts_and_at_once_when_asked() {
        let (mut l, mut rx) = links_with_up(7);
        l.ack(3, false);
        l.ack(9, false);
        assert!(acked(&mut rx).is_empty(), "held, not sent");
        assert!(l.ack_due().is_some());
        l.send_ack();
        assert_eq!(acked(&mut rx), vec![9], "one ack, the highest seq");
        assert!(l.ack_due().is_none());
        l.ack(10, true);
        assert_eq!(acked(&mut rx), vec![10]);
    }

    #[test]
    fn a_held_ack_leaves_when_it_covers_enough_ops_or_is_old_enough() {
        let (mut l, mut rx) = links_with_up(7);
        l.ack(ACK_HOLD_OPS, false);
        assert_eq!(
            acked(&mut rx),
            vec![ACK_HOLD_OPS],
            "1,024 ops past the last sent"
        );
        l.ack(ACK_HOLD_OPS + 1, false);
        assert!(acked(&mut rx).is_empty());
        std::thread::sleep(ACK_HOLD + Duration::from_millis(1));
        l.ack(ACK_HOLD_OPS + 2, false);
        assert_eq!(acked(&mut rx), vec![ACK_HOLD_OPS + 2], "due by time");
    }

    #[test]
    fn a_held_ack_is_not_sent_to_a_new_predecessor() {
        let (mut l, mut rx) = links_with_up(7);
        l.ack(5, false);
        let (tx2, mut rx2) = mpsc::unbounded_channel();
        l.up = Some((8, tx2));
        l.send_ack();
        assert!(acked(&mut rx).is_empty(), "the old link is gone");
        assert!(
            acked(&mut rx2).is_empty(),
            "the new predecessor was not told"
        );
        l.ack(6, false);
        l.send_ack();
        assert_eq!(acked(&mut rx2), vec![6]);
    }
}
