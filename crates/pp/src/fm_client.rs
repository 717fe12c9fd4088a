//! The PP node's client of the fabric master: bridges pipeline workers' rule request
//! channels to one FM session stream, and FM's replies back to the workers.
//!
//! Two threads, so that no pipeline worker ever blocks on the network:
//! - the *collector* waits for a worker's first request, then gathers more for up to
//!   `linger` (~100 µs) or `batch_max` requests, and hands the batch to the session
//!   thread. It does not linger in a trickle (the last batch small and more than a
//!   linger ago): such a request goes at once, with whatever is already queued.
//! - The *session* thread (a single-threaded tokio runtime), which numbers requests,
//!   sends one `RuleRequestBatch` per batch, and routes each reply to the worker that
//!   asked (by the `worker` field FM echoes), ringing that worker's doorbell.
//!
//! On a broken session it reconnects (every `reconnect`) and resends the requests that
//! have no answer yet; a request older than `forget_after` is dropped from that list,
//! since its worker has timed its packets out by then. Given several FM addresses it
//! fails over: a broken session is retried once on the same FM, a failed connect
//! moves on to the next address ([`proto::FmAddrs`] has the policy and why).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

// foldhash rather than SipHash: `outstanding` is probed for every request and reply.
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use crate::doorbell::Doorbell;
use hashbrown::HashMap;
use pipeline::{CounterReport, FlowNotice, NoticeKind, RuleReply, RuleRequest, RuleSource};
use proto::v1::{self, fabric_master_client::FabricMasterClient, pp_down, pp_up};
use proto::Bytes;
use thiserror::Error;
use tokio::sync::mpsc;
use tracing::{info, warn};

/// The span a heartbeat's `packets_per_s` is measured over.
const RATE_WINDOW: Duration = Duration::from_millis(500);

#[derive(Debug, Error)]
pub enum FmClientError {
    #[error("starting the FM client: {0}")]
    Start(String),
    #[error("FM addresses: {0}")]
    Addrs(#[from] proto::FmAddrsError),
}

/// Configuration of the FM client.
#[derive(Debug, Clone)]
pub struct FmClientConfig {
    /// FM address, `host:port`, or several comma-separated: the client fails over to
    /// the next when the one it is on is unreachable.
    pub fm: String,
    pub node_id: String,
    /// Pipeline workers served (each gets a [`WorkerLink`]).
    pub workers: u16,
    /// Most requests in one batch.
    pub batch_max: usize,
    /// How long the collector waits for more requests after the first of a batch.
    pub linger: Duration,
    /// Capacity of the request channel shared by the workers (a full channel makes the
    /// pipeline count `request_channel_full` and retry on the flow's next packet).
    pub request_capacity: usize,
    pub reconnect: Duration,
    pub forget_after: Duration,
    /// PP cluster membership: the node can own vIPs (it filters by vMAC in XDP). FM's
    /// vIP assignments go to `vip_tx`; `owned_vips` is reported at registration.
    pub vip_capable: bool,
    pub owned_vips: crate::vip::OwnedVips,
    pub vip_tx: Option<Sender<v1::VipAssign>>,
    /// Where the fabric reaches this node (its MAC), told to FM at registration;
    /// `None`: FM routes no chain stage here.
    pub fabric_mac: Option<[u8; 6]>,
    /// Set on registration to whether FM wants new flows' first packets with their rule
    /// requests (`RegisterAck.fabric_frames`, a node with a `fabric_mac` only); the
    /// pipeline reads it ([`pipeline::PipelineConfig::first_frames`]).
    pub first_frames: Option<Arc<AtomicBool>>,
    /// Packets the node has received (its main loop keeps it current): the heartbeat's
    /// load, which FM's vIP scheduler and the autoscaler read.
    pub rx_packets: Arc<AtomicU64>,
    /// Batches of counter reports (the monitor's counts) waiting for the session thread,
    /// at most; a worker that finds the queue full drops its batch, counted.
    pub report_batches: usize,
    /// mTLS to FM; `None` is plaintext (`--insecure`).
    pub tls: Option<Arc<proto::tls::NodeTls>>,
}

impl FmClientConfig {
    pub fn new(fm: &str, node_id: &str) -> Self {
        FmClientConfig {
            fm: fm.to_string(),
            node_id: node_id.to_string(),
            workers: 1,
            batch_max: 256,
            linger: Duration::from_micros(100),
            request_capacity: 1 << 16,
            reconnect: Duration::from_millis(100),
            forget_after: Duration::from_secs(2),
            vip_capable: false,
            owned_vips: Default::default(),
            vip_tx: None,
            fabric_mac: None,
            first_frames: None,
            rx_packets: Arc::new(AtomicU64::new(0)),
            report_batches: 64,
            tls: None,
        }
    }
}

/// What a pipeline worker needs: its rule source, and a doorbell that rings when
/// replies for it arrive (so an idle worker waits on it and its socket together).
pub struct WorkerLink {
    pub source: RuleSource,
    pub doorbell: Arc<Doorbell>,
}

/// A worker's way to send its counter reports to FM (as `FlowEvent.counters`), without
/// ever blocking: the queue toward the session thread is bounded, and a batch that
/// finds it full is dropped and counted (`counter_reports_dropped`).
#[derive(Clone)]
pub struct ReportSender {
    tx: mpsc::Sender<Vec<CounterReport>>,
    stats: Arc<FmClientStats>,
}

impl ReportSender {
    /// Hand a batch over; returns false if it was dropped (queue full, client gone).
    pub fn send(&self, batch: Vec<CounterReport>) -> bool {
        if batch.is_empty() {
            return true;
        }
        let n = batch.len() as u64;
        match self.tx.try_send(batch) {
            Ok(()) => true,
            Err(_) => {
                self.stats
                    .counter_reports_dropped
                    .fetch_add(n, Ordering::Relaxed);
                false
            }
        }
    }
}

/// Counters of the FM client.
#[derive(Debug, Default)]
pub struct FmClientStats {
    pub requests_sent: AtomicU64,
    pub batches_sent: AtomicU64,
    pub replies: AtomicU64,
    /// Replies that did not decode into rules (answered to the worker as errors).
    pub bad_replies: AtomicU64,
    /// Replies for requests not outstanding (answered twice, or after a resend).
    pub stray_replies: AtomicU64,
    /// Requests FM refused because its setup path was over its bound
    /// ([`proto::ERR_SETUP_OVERLOAD`]): the flow's packets are dropped as a rule error
    /// and its next packet asks again.
    pub setup_overload: AtomicU64,
    pub sessions: AtomicU64,
    /// Sessions that failed to open or broke (each followed by a reconnect).
    pub session_errors: AtomicU64,
    pub resent: AtomicU64,
    /// Flow keys FM withdrew (handed to every worker to remove).
    pub revoked: AtomicU64,
    pub connected: AtomicBool,
    /// The FM address of the open session (empty while there is none).
    pub current_fm: Mutex<String>,
    /// Sessions opened on another FM than the one before (FM failovers).
    pub failovers: AtomicU64,
    /// Flow notices sent to FM as `FlowEvent`s; dropped because the notice channel was
    /// full (FM slow or unreachable).
    pub notices_sent: AtomicU64,
    pub notices_dropped: AtomicU64,
    /// Counter reports sent to FM, and dropped because the queue toward the session was
    /// full (FM unreachable or slow for longer than the queue holds).
    pub counter_reports_sent: AtomicU64,
    pub counter_reports_dropped: AtomicU64,
    /// First packets FM carried here from other nodes' flows (docs/fabric.md), handed
    /// to the worker to run; and those dropped, by reason: larger than a frame slot
    /// (or empty), a rule that did not decode, a worker this node does not have.
    pub fabric_frames: AtomicU64,
    pub fabric_frames_oversized: AtomicU64,
    pub fabric_frames_bad: AtomicU64,
    pub fabric_frames_no_worker: AtomicU64,
}

impl FmClientStats {
    /// The FM address of the open session, if one is open.
    pub fn current_fm(&self) -> Option<String> {
        let f = self
            .current_fm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        (!f.is_empty()).then_some(f)
    }
}

/// A running FM client.
pub struct FmClient {
    stats: Arc<FmClientStats>,
    notices: NoticeSender,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    reports: ReportSender,
}

/// Batches of flow notices the session may hold while FM is slow or away; past that
/// they are dropped and counted (`FmClientStats::notices_dropped`).
const NOTICE_BATCHES: usize = 256;

/// A worker's way to send flow notices to FM: never blocks; a full channel is a counted
/// drop.
#[derive(Clone)]
pub struct NoticeSender {
    tx: mpsc::Sender<Vec<FlowNotice>>,
    stats: Arc<FmClientStats>,
}

impl NoticeSender {
    pub fn send(&self, notices: Vec<FlowNotice>) {
        if notices.is_empty() {
            return;
        }
        let n = notices.len() as u64;
        if self.tx.try_send(notices).is_err() {
            self.stats.notices_dropped.fetch_add(n, Ordering::Relaxed);
        }
    }
}

/// A notice as the `FlowEvent` FM routes to the group owning the flow.
fn notice_to_proto(n: &FlowNotice) -> v1::FlowEvent {
    let key = (&n.key).into();
    let kind = match n.kind {
        NoticeKind::TcpEstablished => v1::flow_event::Kind::TcpEstablished(key),
        NoticeKind::TcpClosing => v1::flow_event::Kind::TcpClosing(key),
        NoticeKind::Active => v1::flow_event::Kind::Active(key),
    };
    v1::FlowEvent {
        tenant: n.tenant,
        chain: n.chain,
        kind: Some(kind),
    }
}

struct WorkerOut {
    replies: Sender<RuleReply>,
    bell: Arc<Doorbell>,
}

impl FmClient {
    /// Start the client; returns one [`WorkerLink`] per worker (index = worker id).
    pub fn start(cfg: FmClientConfig) -> Result<(FmClient, Vec<WorkerLink>), FmClientError> {
        let fms = proto::FmAddrs::parse(&cfg.fm)?;
        let workers = cfg.workers.max(1);
        let (req_tx, req_rx) = crossbeam_channel::bounded(cfg.request_capacity.max(1));
        let mut links = Vec::new();
        let mut outs = Vec::new();
        let stats = Arc::new(FmClientStats::default());
        let (rep_report_tx, report_rx) = mpsc::channel(cfg.report_batches.max(1));
        for _ in 0..workers {
            // Unbounded: replies are bounded by the requests a worker has outstanding,
            // and the session thread must never block on a slow worker.
            let (rep_tx, rep_rx) = crossbeam_channel::unbounded();
            let bell = Arc::new(
                Doorbell::new().map_err(|e| FmClientError::Start(format!("doorbell: {e}")))?,
            );
            links.push(WorkerLink {
                source: RuleSource::Channel {
                    requests: req_tx.clone(),
                    replies: rep_rx,
                },
                doorbell: bell.clone(),
            });
            outs.push(WorkerOut {
                replies: rep_tx,
                bell,
            });
        }
        drop(req_tx);
        let reports = ReportSender {
            tx: rep_report_tx,
            stats: stats.clone(),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let (net_tx, net_rx) = mpsc::unbounded_channel::<Vec<RuleRequest>>();
        let (notice_tx, notice_rx) = mpsc::channel::<Vec<FlowNotice>>(NOTICE_BATCHES);
        let notices = NoticeSender {
            tx: notice_tx,
            stats: stats.clone(),
        };

        let c = cfg.clone();
        let st = stop.clone();
        let collector = std::thread::Builder::new()
            .name("pp-fm-collect".into())
            .spawn(move || collect(c, req_rx, net_tx, st))
            .map_err(|e| FmClientError::Start(e.to_string()))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| FmClientError::Start(e.to_string()))?;
        let s = stats.clone();
        let st = stop.clone();
        let session = std::thread::Builder::new()
            .name("pp-fm-session".into())
            .spawn(move || {
                rt.block_on(session_loop(
                    cfg, fms, net_rx, notice_rx, report_rx, outs, s, st,
                ))
            })
            .map_err(|e| FmClientError::Start(e.to_string()))?;
        Ok((
            FmClient {
                stats,
                notices,
                stop,
                threads: vec![collector, session],
                reports,
            },
            links,
        ))
    }

    pub fn stats(&self) -> &FmClientStats {
        &self.stats
    }

    /// Where workers hand their flow notices ([`pipeline::Pipeline::take_notices`]).
    pub fn notice_sender(&self) -> NoticeSender {
        self.notices.clone()
    }

    /// Where workers send their counter reports (clone one per worker).
    pub fn report_sender(&self) -> ReportSender {
        self.reports.clone()
    }

    /// The counters, shared, for a reader on another thread (a metrics endpoint).
    pub fn stats_shared(&self) -> Arc<FmClientStats> {
        self.stats.clone()
    }

    pub fn connected(&self) -> bool {
        self.stats.connected.load(Ordering::Relaxed)
    }

    /// The FM address of the open session, if one is open.
    pub fn current_fm(&self) -> Option<String> {
        self.stats.current_fm()
    }

    /// Stop both threads and wait for them.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for FmClient {
    fn drop(&mut self) {
        self.stop();
    }
}

fn collect(
    cfg: FmClientConfig,
    rx: Receiver<RuleRequest>,
    net: mpsc::UnboundedSender<Vec<RuleRequest>>,
    stop: Arc<AtomicBool>,
) {
    let max = cfg.batch_max.max(1);
    let mut last_batch = Instant::now();
    let mut last_len = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let first = match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => {
                // Every worker is gone; nothing will ever be asked again.
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let mut batch = Vec::with_capacity(max.min(64));
        batch.push(first);
        let now = Instant::now();
        let linger = linger_for(
            cfg.linger,
            now.saturating_duration_since(last_batch),
            last_len,
        );
        let deadline = now + linger;
        while batch.len() < max {
            match rx.try_recv() {
                Ok(r) => batch.push(r),
                Err(_) => {
                    if linger.is_zero() {
                        break;
                    }
                    match rx.recv_deadline(deadline) {
                        Ok(r) => batch.push(r),
                        Err(_) => break,
                    }
                }
            }
        }
        last_batch = Instant::now();
        last_len = batch.len();
        if net.send(batch).is_err() {
            break;
        }
    }
}

/// How long to gather more requests after a batch's first, given the time since the last
/// batch closed and its size. Lingering pays only while requests come in bursts or
/// closer together than the linger. A trickle (the last batch held at most
/// [`TRICKLE`] requests and closed more than a linger ago) gains nothing from the wait,
/// which would only add the linger to this flow's setup (on an idle node, to every new
/// flow). Requests that are already queued still go in the same batch. Under load the
/// last batch was large, so the collector lingers as before: without the size test, the
/// first request of each burst left alone, and the setup bench's batches shrank from
/// a median of 215 requests to 178 (four pairs of runs).
fn linger_for(linger: Duration, since_last_batch: Duration, last_len: usize) -> Duration {
    if last_len <= TRICKLE && since_last_batch > linger {
        Duration::ZERO
    } else {
        linger
    }
}

/// The largest batch that still counts as a trickle for [`linger_for`].
const TRICKLE: usize = 2;

struct Outstanding {
    req: v1::RuleRequest,
    sent: Instant,
}

#[allow(clippy::too_many_arguments)]
async fn session_loop(
    cfg: FmClientConfig,
    mut fms: proto::FmAddrs,
    mut net: mpsc::UnboundedReceiver<Vec<RuleRequest>>,
    mut notices: mpsc::Receiver<Vec<FlowNotice>>,
    mut reports: mpsc::Receiver<Vec<CounterReport>>,
    outs: Vec<WorkerOut>,
    stats: Arc<FmClientStats>,
    stop: Arc<AtomicBool>,
) {
    let mut outstanding: HashMap<u64, Outstanding> = HashMap::new();
    let mut next_id = 1u64;
    let mut failures = 0u32;
    let mut last_fm: Option<String> = None;
    while !stop.load(Ordering::Relaxed) {
        let fm = fms.current().to_string();
        let mut opened = false;
        let r = session(
            &cfg,
            &fm,
            &mut opened,
            &mut net,
            &mut notices,
            &mut reports,
            &outs,
            &stats,
            &stop,
            &mut outstanding,
            &mut next_id,
        )
        .await;
        stats.connected.store(false, Ordering::Relaxed);
        stats
            .current_fm
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        if opened {
            if last_fm.as_ref().is_some_and(|l| *l != fm) {
                stats.failovers.fetch_add(1, Ordering::Relaxed);
            }
            last_fm = Some(fm.clone());
            failures = 0;
        }
        match r {
            Ok(()) => return,
            Err(e) => {
                failures += 1;
                stats.session_errors.fetch_add(1, Ordering::Relaxed);
                if failures <= 3 || failures % 50 == 0 {
                    warn!(%fm, error = %e, "FM session failed; reconnecting");
                }
            }
        }
        let next = if opened {
            fms.session_broke()
        } else {
            fms.connect_failed()
        };
        if fms.current() != fm {
            info!(node = %cfg.node_id, from = %fm, to = %fms.current(),
                  "FM unreachable; failing over to the next FM");
        }
        if next == proto::Next::AfterBackoff {
            tokio::time::sleep(cfg.reconnect).await;
        }
    }
}

/// One session with FM `fm`. Returns Ok when the client is stopping. `opened` is set
/// once FM acknowledged the registration: a failure after that is a broken session,
/// before it a failed connect.
#[allow(clippy::too_many_arguments)]
async fn session(
    cfg: &FmClientConfig,
    fm: &str,
    opened: &mut bool,
    net: &mut mpsc::UnboundedReceiver<Vec<RuleRequest>>,
    notices: &mut mpsc::Receiver<Vec<FlowNotice>>,
    reports: &mut mpsc::Receiver<Vec<CounterReport>>,
    outs: &[WorkerOut],
    stats: &FmClientStats,
    stop: &AtomicBool,
    outstanding: &mut HashMap<u64, Outstanding>,
    next_id: &mut u64,
) -> Result<(), String> {
    let ch = proto::connect(fm, cfg.tls.as_ref(), proto::tls::Role::Fm)
        .await
        .map_err(|e| e.to_string())?;
    let mut client = FabricMasterClient::new(ch)
        .max_decoding_message_size(proto::MAX_MESSAGE)
        .max_encoding_message_size(proto::MAX_MESSAGE);
    // Two lanes: registration and heartbeats overtake queued request batches, so a
    // backlog of requests never makes this node miss its heartbeats at FM.
    let (otx, orx) = proto::lanes::lanes::<v1::PpUp>();
    let _ = otx.control.send(v1::PpUp {
        msg: Some(pp_up::Msg::Register(v1::NodeInfo {
            id: cfg.node_id.clone(),
            role: v1::Role::Pp as i32,
            addr: String::new(),
            load: None,
            proto_version: proto::PROTO_VERSION,
            incarnation: 0,
            vip_capable: cfg.vip_capable,
            owned_vips: cfg.owned_vips.lock().map(|v| v.clone()).unwrap_or_default(),
            fabric_mac: cfg.fabric_mac.map(|m| m.to_vec()).unwrap_or_default(),
            fabric_frames: cfg.fabric_mac.is_some(),
        })),
    });
    let mut inbound = client
        .pp_session(orx)
        .await
        .map_err(|e| e.to_string())?
        .into_inner();
    let ack = match inbound.message().await.map_err(|e| e.to_string())? {
        Some(v1::PpDown {
            msg: Some(pp_down::Msg::Registered(a)),
        }) => a,
        _ => return Err("FM did not acknowledge registration".into()),
    };
    stats.sessions.fetch_add(1, Ordering::Relaxed);
    *opened = true;
    *stats.current_fm.lock().unwrap_or_else(|e| e.into_inner()) = fm.to_string();
    stats.connected.store(true, Ordering::Relaxed);
    info!(%fm, fm_id = %ack.fm_id, node = %cfg.node_id, "PP session open");
    if let Some(f) = &cfg.first_frames {
        f.store(
            ack.fabric_frames && cfg.fabric_mac.is_some(),
            Ordering::Relaxed,
        );
    }

    // Ask again for everything unanswered: the old session may have lost it.
    let now = Instant::now();
    outstanding.retain(|_, o| now.duration_since(o.sent) < cfg.forget_after);
    if !outstanding.is_empty() {
        // Without their first packets: the old FM may have carried one on already and
        // its answer was lost with the session; the worker releases the packet itself
        // when the answer does not say it went.
        let requests: Vec<v1::RuleRequest> = outstanding
            .values_mut()
            .map(|o| {
                o.req.frame = proto::Bytes::new();
                o.req.clone()
            })
            .collect();
        stats
            .resent
            .fetch_add(requests.len() as u64, Ordering::Relaxed);
        let _ = otx.data.send(v1::PpUp {
            msg: Some(pp_up::Msg::Requests(v1::RuleRequestBatch { requests })),
        });
    }

    let hb_period = Duration::from_millis(u64::from(ack.heartbeat_ms.max(1)));
    let pulse = proto::liveness::Pulse::new();
    pulse.beat();
    // Lives as long as this session: dropped (and stopped) when this function returns.
    let _liveness = proto::liveness::for_session(fm, &ack, hb_period, &pulse);
    let mut hb = tokio::time::interval(hb_period);
    let mut hb_seq = 0u64;
    let mut hb_last = (Instant::now(), cfg.rx_packets.load(Ordering::Relaxed));
    let mut packets_per_s = 0.0;
    loop {
        // Biased: the heartbeat that keeps this node alive at FM first, then FM's
        // replies (finishing work in flight), then new batches. A flood of new batches
        // can then delay neither the heartbeat nor the replies.
        tokio::select! {
            biased;
            _ = hb.tick() => {
                if stop.load(Ordering::Relaxed) {
                    return Ok(());
                }
                hb_seq += 1;
                pulse.beat();
                let now = Instant::now();
                // Forgetting is a walk over every outstanding request: done once per
                // rate window, not per 10 ms heartbeat (forget_after is seconds).
                if now.duration_since(hb_last.0) >= RATE_WINDOW {
                    outstanding.retain(|_, o| now.duration_since(o.sent) < cfg.forget_after);
                }
                // The rate is taken over windows of RATE_WINDOW, not per heartbeat: a
                // 10 ms heartbeat's own slice holds a handful of packets, too few for
                // the vIP scheduler's or the autoscaler's water marks.
                let rx = cfg.rx_packets.load(Ordering::Relaxed);
                let elapsed = now.duration_since(hb_last.0);
                if elapsed >= RATE_WINDOW {
                    packets_per_s = rx.saturating_sub(hb_last.1) as f64 / elapsed.as_secs_f64();
                    hb_last = (now, rx);
                }
                let _ = otx.control.send(v1::PpUp {
                    msg: Some(pp_up::Msg::Heartbeat(v1::Heartbeat {
                        seq: hb_seq,
                        load: Some(v1::Load {
                            requests_per_s: 0.0,
                            flows: outstanding.len() as u64,
                            groups: 0,
                            packets_per_s,
                        }),
                    })),
                });
            }
            m = inbound.message() => {
                match m.map_err(|e| e.to_string())? {
                    Some(v1::PpDown { msg: Some(pp_down::Msg::Replies(b)) }) => {
                        // Off the wire every reply is its bytes, read here straight
                        // into the pipeline's reply.
                        deliver(&b.into_wire(), outs, stats, outstanding);
                    }
                    Some(v1::PpDown { msg: Some(pp_down::Msg::Revoked(r)) }) => {
                        revoke(&r.keys, outs, stats);
                    }
                    Some(v1::PpDown { msg: Some(pp_down::Msg::Fabric(f)) }) => {
                        inject(f, outs, stats);
                    }
                    Some(v1::PpDown { msg: Some(pp_down::Msg::Vips(a)) }) => {
                        if let Some(tx) = &cfg.vip_tx {
                            let _ = tx.send(a);
                        }
                    }
                    Some(_) => {}
                    None => return Err("FM closed the session".into()),
                }
            }
            batch = net.recv() => {
                let Some(batch) = batch else { return Ok(()) };
                let now = Instant::now();
                let mut slab = proto::FieldSlab::new(batch.len() * pipeline::FlowKey::LEN);
                let requests: Vec<v1::RuleRequest> = batch
                    .iter()
                    .map(|r| {
                        let id = *next_id;
                        *next_id += 1;
                        let m = proto::request_in(r, id, &mut slab);
                        outstanding.insert(id, Outstanding { req: m.clone(), sent: now });
                        m
                    })
                    .collect();
                stats.requests_sent.fetch_add(requests.len() as u64, Ordering::Relaxed);
                stats.batches_sent.fetch_add(1, Ordering::Relaxed);
                otx.data.send(v1::PpUp {
                    msg: Some(pp_up::Msg::Requests(v1::RuleRequestBatch { requests })),
                })
                .map_err(|_| "session closed".to_string())?;
            }
            // Last: rule requests hold packets, notices only refresh NF state.
            batch = notices.recv() => {
                let Some(batch) = batch else { continue };
                let events: Vec<v1::FlowEvent> = batch.iter().map(notice_to_proto).collect();
                stats.notices_sent.fetch_add(events.len() as u64, Ordering::Relaxed);
                otx.data.send(v1::PpUp {
                    msg: Some(pp_up::Msg::Events(v1::FlowEventBatch { events })),
                })
                .map_err(|_| "session closed".to_string())?;
            }
            // Last: counts can wait; new flows' setup cannot.
            Some(batch) = reports.recv() => {
                let events: Vec<v1::FlowEvent> = batch
                    .iter()
                    .map(|r| proto::counters_event(r.tenant, r.chain, &r.key, r.packets, r.bytes))
                    .collect();
                stats.counter_reports_sent.fetch_add(events.len() as u64, Ordering::Relaxed);
                otx.data.send(v1::PpUp {
                    msg: Some(pp_up::Msg::Events(v1::FlowEventBatch { events })),
                })
                .map_err(|_| "session closed".to_string())?;
            }
        }
    }
}

/// A first packet FM carried here from the flow's ingress node, with this node's rule
/// for the flow: handed to the worker as one reply, so the worker installs the rule
/// before it runs the packet (docs/fabric.md). Bad ones are dropped, counted.
fn inject(f: v1::FabricFrame, outs: &[WorkerOut], stats: &FmClientStats) {
    if f.frame.is_empty() || f.frame.len() > proto::MAX_FABRIC_FRAME {
        stats
            .fabric_frames_oversized
            .fetch_add(1, Ordering::Relaxed);
        return;
    }
    let Some(mut reply) = f.install.as_ref().and_then(|m| RuleReply::try_from(m).ok()) else {
        stats.fabric_frames_bad.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let worker = f.install.as_ref().map_or(0, |m| m.worker as usize);
    let Some(out) = outs.get(worker) else {
        stats
            .fabric_frames_no_worker
            .fetch_add(1, Ordering::Relaxed);
        return;
    };
    reply.inject = Some(f.frame[..].into());
    if out.replies.send(reply).is_err() {
        stats
            .fabric_frames_no_worker
            .fetch_add(1, Ordering::Relaxed);
        return;
    }
    stats.fabric_frames.fetch_add(1, Ordering::Relaxed);
    out.bell.ring();
}

/// Hand FM's revocations to every worker: FM does not know which worker holds a flow,
/// and a worker without it ignores the revocation.
fn revoke(keys: &[v1::FlowKey], outs: &[WorkerOut], stats: &FmClientStats) {
    let keys: Vec<pipeline::FlowKey> = keys
        .iter()
        .filter_map(|k| match pipeline::FlowKey::try_from(k) {
            Ok(k) => Some(k),
            Err(_) => {
                stats.bad_replies.fetch_add(1, Ordering::Relaxed);
                None
            }
        })
        .collect();
    stats
        .revoked
        .fetch_add(keys.len() as u64, Ordering::Relaxed);
    for out in outs {
        for k in &keys {
            if out.replies.send(RuleReply::revoke(*k)).is_err() {
                break;
            }
        }
        out.bell.ring();
    }
}

/// Read each of FM's replies (a `RuleReply`'s bytes) into the pipeline's reply and hand
/// it to the worker that asked. A reply that does not read is counted
/// (`bad_replies`); when its id, worker and key still read, the flow gets an error
/// reply, so its worker releases the packets it holds now rather than at its timeout.
fn deliver(
    replies: &[Bytes],
    outs: &[WorkerOut],
    stats: &FmClientStats,
    outstanding: &mut HashMap<u64, Outstanding>,
) {
    let mut rung = vec![false; outs.len()];
    let mut unreadable = 0u64;
    for bytes in replies {
        stats.replies.fetch_add(1, Ordering::Relaxed);
        let (id, worker, reply) = match proto::read_rule_reply(bytes) {
            Ok(r) => (r.id, r.worker, r.reply),
            Err(e) => {
                unreadable += 1;
                let Some(refusal) = proto::refusal_of(bytes) else {
                    continue;
                };
                let Ok(key) = proto::key_of(refusal.key.as_ref()) else {
                    // Still answered, or it would count as stray below.
                    outstanding.remove(&refusal.id);
                    continue;
                };
                let why = match e {
                    proto::ReadError::Decode(_) => proto::ERR_BAD_SC_REPLY.to_string(),
                    proto::ReadError::Convert(e) => format!("bad reply: {e}"),
                };
                (refusal.id, refusal.worker, RuleReply::err(key, why))
            }
        };
        if outstanding.remove(&id).is_none() {
            stats.stray_replies.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        if matches!(&reply.result, Err(e) if e == proto::ERR_SETUP_OVERLOAD) {
            stats.setup_overload.fetch_add(1, Ordering::Relaxed);
        }
        let Some(out) = outs.get(worker as usize) else {
            unreadable += 1;
            continue;
        };
        if out.replies.send(reply).is_ok() {
            rung[worker as usize] = true;
        }
    }
    if unreadable > 0 {
        stats.bad_replies.fetch_add(unreadable, Ordering::Relaxed);
        warn!(unreadable, "FM sent replies that do not read");
    }
    for (i, r) in rung.into_iter().enumerate() {
        if r {
            outs[i].bell.ring();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker() -> (WorkerOut, Receiver<RuleReply>) {
        let (tx, rx) = crossbeam_channel::unbounded();
        let bell = Arc::new(Doorbell::new().unwrap());
        (WorkerOut { replies: tx, bell }, rx)
    }

    fn install(worker: u32) -> v1::RuleReply {
        let key: pipeline::FlowKey = "100 udp 198.18.10.2:5 > 198.19.0.9:53".parse().unwrap();
        let rule = pipeline::Rule::new(key, pipeline::parse_actions("out 0").unwrap());
        proto::reply_to_proto(&RuleReply::ok(rule), 0, worker as u16)
    }

    #[test]
    fn the_collector_lingers_except_in_a_trickle() {
        let l = Duration::from_micros(100);
        // Busy: the last batch closed 20 µs ago; wait for more.
        assert_eq!(linger_for(l, Duration::from_micros(20), 1), l);
        assert_eq!(linger_for(l, l, 1), l);
        // A trickle: the last batch, of one request, closed 2 ms ago; send at once.
        assert_eq!(linger_for(l, Duration::from_millis(2), 1), Duration::ZERO);
        assert_eq!(
            linger_for(l, Duration::from_millis(2), TRICKLE),
            Duration::ZERO
        );
        // Bursts: the last batch was large, however long ago; wait for more.
        assert_eq!(linger_for(l, Duration::from_millis(2), 200), l);
        // No linger configured: never.
        assert_eq!(
            linger_for(Duration::ZERO, Duration::ZERO, 0),
            Duration::ZERO
        );
    }

    #[test]
    fn replies_read_off_the_wire_reach_their_workers_and_bad_ones_cost_their_flow_only() {
        let (out, rx) = worker();
        let outs = [out];
        let stats = FmClientStats::default();
        let mut outstanding = HashMap::new();
        for id in 1..=7 {
            outstanding.insert(
                id,
                Outstanding {
                    req: v1::RuleRequest::default(),
                    sent: Instant::now(),
                },
            );
        }
        let with = |id: u64, f: &dyn Fn(&mut v1::RuleReply)| {
            let mut m = install(0);
            m.id = id;
            f(&mut m);
            v1::RuleReplyBatch::new(vec![m]).into_wire().remove(0)
        };
        let good = with(1, &|_| {});
        let overload = with(2, &|m| {
            m.result = Some(v1::rule_reply::Result::Error(
                proto::ERR_SETUP_OVERLOAD.into(),
            ))
        });
        // Decodes, but its output port does not fit a pipeline port.
        let unconvertible = with(3, &|m| {
            if let Some(v1::rule_reply::Result::Rule(r)) = &mut m.result {
                r.actions[0].kind = Some(v1::action::Kind::Output(1 << 20));
            }
        });
        // Its top level reads; an action inside is a cut-off varint.
        let mut undecodable = with(4, &|m| m.result = None).to_vec();
        undecodable.extend_from_slice(&[0x1a, 0x04, 0x12, 0x02, 0x08, 0x80]);
        let no_worker = with(5, &|m| m.worker = 9);
        let stray = with(99, &|_| {});
        let no_id = Bytes::from_static(&[0x08, 0x80]);
        deliver(
            &[
                good,
                overload,
                unconvertible,
                undecodable.into(),
                no_worker,
                stray,
                no_id,
            ],
            &outs,
            &stats,
            &mut outstanding,
        );
        let got: Vec<RuleReply> = rx.try_iter().collect();
        assert_eq!(got.len(), 4, "{got:?}");
        assert!(got[0].result.is_ok());
        assert_eq!(
            got[0].key,
            install(0)
                .key
                .as_ref()
                .map(|k| proto::key_of(Some(k)).unwrap())
                .unwrap()
        );
        assert_eq!(got[1].result, Err(proto::ERR_SETUP_OVERLOAD.to_string()));
        assert!(
            matches!(&got[2].result, Err(e) if e.starts_with("bad reply: ")),
            "{:?}",
            got[2].result
        );
        assert_eq!(got[3].result, Err(proto::ERR_BAD_SC_REPLY.to_string()));
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        assert_eq!(
            (
                n(&stats.replies),
                n(&stats.bad_replies),
                n(&stats.stray_replies),
                n(&stats.setup_overload)
            ),
            (7, 4, 1, 1)
        );
        assert_eq!(outstanding.len(), 2, "ids 6 and 7 still wait");
    }

    #[test]
    fn a_carried_packet_reaches_its_worker_with_its_rule_and_bad_ones_are_counted() {
        let (out, rx) = worker();
        let outs = [out];
        let stats = FmClientStats::default();
        let ok = v1::FabricFrame {
            install: Some(install(0)),
            frame: vec![7; 60].into(),
        };
        inject(ok.clone(), &outs, &stats);
        let got = rx.try_recv().expect("handed to the worker");
        assert!(got.result.is_ok());
        assert_eq!(got.inject.as_deref(), Some(&[7u8; 60][..]));
        assert_eq!(stats.fabric_frames.load(Ordering::Relaxed), 1);

        // Too big for a frame slot, or empty.
        for frame in [vec![0; proto::MAX_FABRIC_FRAME + 1], vec![]] {
            inject(
                v1::FabricFrame {
                    frame: frame.into(),
                    ..ok.clone()
                },
                &outs,
                &stats,
            );
        }
        // No rule, or one that does not decode.
        let mut bad = install(0);
        bad.key = Some(v1::FlowKey {
            raw: vec![1; 3].into(),
        });
        for install in [None, Some(bad)] {
            inject(
                v1::FabricFrame {
                    install,
                    ..ok.clone()
                },
                &outs,
                &stats,
            );
        }
        // For a worker this node does not have.
        inject(
            v1::FabricFrame {
                install: Some(install(9)),
                ..ok.clone()
            },
            &outs,
            &stats,
        );
        assert!(rx.try_recv().is_err(), "nothing bad reached the worker");
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        assert_eq!(
            (
                n(&stats.fabric_frames),
                n(&stats.fabric_frames_oversized),
                n(&stats.fabric_frames_bad),
                n(&stats.fabric_frames_no_worker)
            ),
            (1, 2, 2, 1)
        );
    }
}
