//! A whole PP node, started in-process: pipeline workers (one by default,
//! [`PpNodeConfig::workers`]) each on an AF_XDP socket of its own (the default wherever
//! it works) or a UDP VXLAN socket ([`IoKind`]), their rule source, the optional XDP
//! fast path, vIP group membership, `/metrics`, and the control session.
//!
//! Worker 0's thread also runs the control loop: directives, rates, trace arming and
//! vIPs are applied there and handed to the other workers over a command channel each;
//! the other workers publish snapshots that the stats line, `/metrics` and the node
//! report sum.
//!
//! Rules come from the fabric master (`fm`): a miss holds the packet and asks FM,
//! which asks the SC group owning the flow. Static rules from a file (`rules`) can be
//! installed too; without an FM they are the only rules and a miss is a `no-rule` drop.
//!
//! [`start`] returns once the node is listening (or failed); the worker runs on a
//! thread of its own until [`PpHandle::stop`]. `starfabric pp` is this plus flags.

mod fastpath;
mod io;
pub mod rt;

use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pipeline::{
    CounterReport, CounterReportConfig, DropReason, MonotonicClock, NodeAddr, Pipeline,
    PipelineConfig, RuleSource, VpcBinding, Worker,
};
use proto::agent::{AgentError, NodeAgent};
use thiserror::Error;

pub use fastpath::{FastPath, OffloadConfig};
pub use io::{add_afxdp, add_udp, mac_str, open, IoKind, IoOptions, IoStats, OpenedIo, PpIo};

use crate::metrics::{PpMetrics, PpSnapshot, PP_PUBLISH_EVERY};
use crate::rates::RateLimits;
use crate::{FmClient, FmClientConfig};

/// Why a PP node did not start, or stopped.
#[derive(Debug, Error)]
pub enum PpNodeError {
    #[error("{0}")]
    Io(String),
    #[error("{0}")]
    Config(String),
    #[error("rules file {path}: {why}")]
    Rules { path: PathBuf, why: String },
    #[error("FM client: {0}")]
    Fm(String),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error("metrics endpoint: {0}")]
    Metrics(String),
    #[error("worker: {0}")]
    Worker(String),
    #[error("the PP worker thread panicked")]
    Panicked,
}

/// What a PP node runs with; [`Default`] is `starfabric pp` with no flags, except
/// `worker_rt` (the CLI's `--worker-rt` defaults to 10, the library to `None`) and
/// `workers_auto` (the CLI's `--workers` defaults to `auto`, the library to one worker).
#[derive(Clone)]
pub struct PpNodeConfig {
    /// Underlay IPv4 address and UDP port to receive VXLAN on.
    pub listen: SocketAddrV4,
    /// Static rules file (`match` / `rule` line pairs, see [`crate::parse_rules`]).
    pub rules: Option<PathBuf>,
    pub io: IoKind,
    /// UMEM frames of the AF_XDP socket (a power of two).
    pub xdp_frames: u32,
    /// Preferred busy polling of the AF_XDP sockets (`--busy-poll`); `None`: NAPI
    /// (interrupt) driven.
    pub busy_poll: Option<crate::BusyPoll>,
    /// How the AF_XDP ports transmit (`--afxdp-tx`).
    pub afxdp_tx: crate::AfXdpTx,
    /// Run each packet worker `SCHED_FIFO` at this priority while the kernel drops
    /// frames for it (`--worker-rt`, see [`rt`]); `None`: the ordinary scheduler always.
    pub worker_rt: Option<i32>,
    /// With `worker_rt`: `SCHED_FIFO` always, not only while overloaded
    /// (`--worker-rt-always`).
    pub worker_rt_always: bool,
    /// The outer source `encap` writes (default: the listen address).
    pub node_ip: Option<Ipv4Addr>,
    /// Outer source MAC with the UDP backend (AF_XDP uses the interface's).
    pub node_mac: Option<[u8; 6]>,
    /// Outer destination MAC; AF_XDP resolves it when not given.
    pub gw_mac: Option<[u8; 6]>,
    /// Flow table capacity of the node, split evenly over the workers.
    pub flows: usize,
    /// Pipeline workers, each on a thread of its own with its own port (AF_XDP socket
    /// on receive queue `i`, or a `SO_REUSEPORT` UDP socket), flow table shard, FM
    /// link and policer. Worker 0's thread also runs the control loop. See
    /// docs/pp-pipeline.md, "Workers".
    pub workers: usize,
    /// Choose the worker count at start instead of `workers`: one per CPU the process
    /// may run on, no more than the interface has receive queues on AF_XDP, and one with
    /// `offload` ([`resolve_workers`]). `starfabric pp`'s default (`--workers auto`).
    pub workers_auto: bool,
    /// A stats line to `lines` every this often.
    pub stats_interval: Option<Duration>,
    /// With an FM: how often counted rules report their counters (the monitor's data).
    pub counter_interval: Duration,
    /// With an FM: how often flows that carried traffic are reported `Active`, so NFs
    /// refresh their idle deadlines ([`MAX_ACTIVE_INTERVAL`] at most; zero: never).
    pub active_interval: Duration,
    /// Send all output to this UDP port instead of each frame's outer destination port.
    pub peer_port: Option<u16>,
    /// Largest receive batch.
    pub batch: usize,
    /// Fabric masters, comma-separated, in failover order.
    pub fm: Option<String>,
    /// This node's id toward FM (default `pp-<listen>`).
    pub id: Option<String>,
    /// Static VNI → tenant chain bindings (they win over the orchestrator's).
    pub vpcs: Vec<(u32, VpcBinding)>,
    /// The binding of VNIs with none.
    pub default_chain: Option<VpcBinding>,
    /// The orchestrator's control address: it binds VNIs and names the FM (unless `fm`).
    pub orchestrator: Option<String>,
    /// The PP cluster (vIP group) this node serves.
    pub cluster: String,
    /// Join the PP cluster's vIP group (needs AF_XDP and an FM).
    pub vip_group: bool,
    /// Serve `/metrics` here.
    pub metrics: Option<SocketAddr>,
    pub offload: OffloadConfig,
    /// The capacity the rate managers share out (paper 000 §7.2).
    pub rate_capacity: crate::rates::RateCapacity,
    /// Fixed per-tenant rates; they win over the orchestrator's.
    pub rates: std::collections::BTreeMap<u32, crate::rates::TenantRateLimits>,
    /// Where status lines go.
    pub lines: telemetry::Lines,
    /// mTLS to FM and the orchestrator; `None` is plaintext (`--insecure`).
    pub tls: Option<std::sync::Arc<proto::tls::NodeTls>>,
}

impl Default for PpNodeConfig {
    fn default() -> Self {
        PpNodeConfig {
            listen: SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, packet::VXLAN_PORT),
            rules: None,
            io: IoKind::Auto,
            xdp_frames: 4096,
            busy_poll: None,
            afxdp_tx: crate::AfXdpTx::Auto,
            // `starfabric pp` defaults to SCHED_FIFO 10; an in-process node shares its
            // process with tests and harnesses, so the library leaves the scheduler alone.
            worker_rt: None,
            worker_rt_always: false,
            node_ip: None,
            node_mac: None,
            gw_mac: None,
            flows: 1 << 16,
            workers: 1,
            workers_auto: false,
            stats_interval: None,
            counter_interval: Duration::from_secs(1),
            active_interval: Duration::from_secs(10),
            peer_port: None,
            batch: 64,
            fm: None,
            id: None,
            vpcs: Vec::new(),
            default_chain: None,
            orchestrator: None,
            cluster: "default".into(),
            vip_group: false,
            metrics: None,
            offload: OffloadConfig::default(),
            rate_capacity: crate::rates::RateCapacity::default(),
            rates: Default::default(),
            lines: telemetry::Lines::default(),
            tls: None,
        }
    }
}

/// A running PP node.
pub struct PpHandle {
    local: SocketAddrV4,
    metrics: Option<SocketAddr>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<(), PpNodeError>>>,
}

impl PpHandle {
    /// The address the node receives VXLAN on (the real port when asked for port 0).
    pub fn local_addr(&self) -> SocketAddrV4 {
        self.local
    }

    /// The `/metrics` endpoint, when it serves one.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics
    }

    /// Whether the worker has ended (stopped, or failed: see [`PpHandle::stop`]).
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Stop the worker and wait for it; its error if it failed.
    pub fn stop(mut self) -> Result<(), PpNodeError> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(PpNodeError::Panicked),
            None => Ok(()),
        }
    }
}

impl Drop for PpHandle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Static rules never idle out.
const STATIC_IDLE: Duration = Duration::MAX;
/// The longest `Active` report period: half the shortest built-in NF idle timeout (the
/// FW's 30 s for ICMP), so a busy flow is reported at least twice before a built-in NF
/// with its default timeouts would forget it.
pub const MAX_ACTIVE_INTERVAL: Duration = Duration::from_secs(15);
/// Idle timeout of FM rules that name none.
const FM_IDLE: Duration = Duration::from_secs(300);

/// Start a PP node and wait until it listens. `stop` ends it (also while it still
/// waits for the orchestrator to name an FM, in which case this returns `Ok(None)`).
pub fn start(
    mut cfg: PpNodeConfig,
    stop: Arc<AtomicBool>,
) -> Result<Option<PpHandle>, PpNodeError> {
    if cfg.workers_auto {
        cfg.workers = resolve_workers(&cfg);
    }
    if cfg.active_interval > MAX_ACTIVE_INTERVAL {
        return Err(PpNodeError::Config(format!(
            "--active-interval {:?} is longer than {:?}: NFs refresh idle deadlines only on \
             these reports, and the FW times ICMP at 30 s",
            cfg.active_interval, MAX_ACTIVE_INTERVAL
        )));
    }
    check_workers(&cfg)?;
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
    let s = stop.clone();
    // Everything is built on the worker thread: the AF_XDP socket and the XDP program
    // handle are not `Send`.
    let thread = std::thread::Builder::new()
        .name("pp-worker".into())
        .spawn(move || run(cfg, s, ready_tx))
        .map_err(|e| PpNodeError::Worker(e.to_string()))?;
    match ready_rx.recv() {
        Ok(Some((local, metrics))) => Ok(Some(PpHandle {
            local,
            metrics,
            stop,
            thread: Some(thread),
        })),
        Ok(None) => {
            let _ = thread.join();
            Ok(None)
        }
        Err(_) => match thread.join() {
            Ok(Err(e)) => Err(e),
            Ok(Ok(())) => Ok(None),
            Err(_) => Err(PpNodeError::Panicked),
        },
    }
}

/// Most workers a node runs: the XDP program's `xsks` map holds this many queues.
pub const MAX_WORKERS: usize = xdp::abi::MAX_XSK_QUEUES as usize;

/// The worker count `--workers auto` gives: a worker per CPU the process may run on
/// (its affinity mask and CPU quota, `available_parallelism`), at most `MAX_WORKERS`
/// and `flows`; on AF_XDP (or `--io auto` where the listen address's interface has a
/// queue count) at most the interface's receive queues, since each worker takes one;
/// one with `--offload`, whose fast path follows one worker's table.
pub fn resolve_workers(cfg: &PpNodeConfig) -> usize {
    if cfg.offload.offload {
        return 1;
    }
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cap = cpus.min(MAX_WORKERS).min(cfg.flows).max(1);
    if cfg.io == IoKind::Udp || cfg.peer_port.is_some() {
        return cap;
    }
    match crate::netif::interface_of(*cfg.listen.ip()).and_then(|i| crate::netif::rx_queues(&i)) {
        Ok(q) => cap.min(q as usize).max(1),
        // No interface to read: AF_XDP will not open on it either, and `--io auto`
        // falls back to the UDP socket, which takes any number.
        Err(_) => cap,
    }
}

/// The worker count's own limits (the interface's queue count is checked when the
/// AF_XDP backend opens).
fn check_workers(cfg: &PpNodeConfig) -> Result<(), PpNodeError> {
    if cfg.workers == 0 || cfg.workers > MAX_WORKERS {
        return Err(PpNodeError::Config(format!(
            "--workers {} is not in 1..={MAX_WORKERS}",
            cfg.workers
        )));
    }
    if cfg.workers > 1 && cfg.offload.offload {
        // The fast path's offloader follows one pipeline's flows; with several it
        // would take back or count only worker 0's.
        return Err(PpNodeError::Config(format!(
            "--offload runs with one worker only (--workers {} asked): the XDP fast path \
             follows a single worker's flow table",
            cfg.workers
        )));
    }
    if cfg.workers > cfg.flows {
        return Err(PpNodeError::Config(format!(
            "--flows {} is fewer than --workers {}: each worker needs a flow table",
            cfg.flows, cfg.workers
        )));
    }
    Ok(())
}

type Ready = std::sync::mpsc::SyncSender<Option<(SocketAddrV4, Option<SocketAddr>)>>;

fn run(a: PpNodeConfig, stop: Arc<AtomicBool>, ready: Ready) -> Result<(), PpNodeError> {
    // Worker 0's thread: data path, left where the scheduler (or the operator) puts it.
    corepack::exclude_current_thread();
    let say = |l: &str| a.lines.say(l);
    let id = a.id.clone().unwrap_or_else(|| format!("pp-{}", a.listen));
    let nworkers = a.workers;
    let opened = io::open(&IoOptions {
        kind: a.io,
        listen: a.listen,
        peer_port: a.peer_port,
        batch: a.batch,
        // Replies are serviced between receive batches. They ring the worker's doorbell,
        // which ends an idle wait at once; the short timeout bounds the rest of the
        // work between batches (and what a ring lost to a race would cost).
        poll_timeout: if a.fm.is_some() || a.orchestrator.is_some() {
            Duration::from_millis(1)
        } else {
            Duration::from_millis(20)
        },
        gw_mac: a.gw_mac,
        frames: a.xdp_frames,
        busy_poll: a.busy_poll,
        afxdp_tx: a.afxdp_tx,
        workers: nworkers,
    })?;
    let mut ios = opened.ios;
    // Kept for as long as the workers run: dropping it detaches the XDP program. Its
    // `program` is where offloaded rules go.
    let mut xdp = opened.xdp;
    // Kept, like `xdp`, for as long as the workers send.
    let _udp_qdisc = opened.udp_qdisc;
    let io_detail = opened.detail;
    let local = match &ios[0] {
        PpIo::Udp(u) => u.local_addr(),
        PpIo::AfXdp(_) => a.listen,
    };
    let node = match &xdp {
        // With AF_XDP the outer Ethernet header `encap` writes is what goes on the wire:
        // the interface's MAC and the resolved (or given) gateway MAC.
        Some(x) => {
            if a.node_mac.is_some_and(|m| m != x.node.mac) {
                tracing::warn!("--node-mac ignored: AF_XDP sends with the interface's MAC");
            }
            NodeAddr {
                ip: a.node_ip.unwrap_or(x.node.ip),
                ..x.node
            }
        }
        None => NodeAddr {
            ip: a.node_ip.unwrap_or(*a.listen.ip()),
            mac: a.node_mac.unwrap_or([2, 0, 0, 0, 0, 1]),
            gw_mac: a.gw_mac.unwrap_or([2, 0, 0, 0, 0, 2]),
        },
    };
    let mut fastpath = match (a.offload.offload, &xdp) {
        (true, Some(_)) => Some(FastPath::new(&a.offload)),
        (true, None) => {
            tracing::warn!("--offload needs the XDP program attached (the AF_XDP backend); the fast path is off");
            None
        }
        (false, _) => None,
    };
    let mut cfg = PipelineConfig::new(node);
    cfg.elephant = fastpath.as_ref().and(a.offload.elephant());
    cfg.flow_capacity = worker_flows(a.flows, nworkers);
    let mut agent = match &a.orchestrator {
        Some(o) => Some(NodeAgent::start(
            o,
            &id,
            proto::v1::Role::Pp,
            &local.to_string(),
            &a.cluster,
            None,
            None,
            a.tls.clone(),
        )?),
        None => None,
    };
    let mut first_directive = None;
    let fm_addr = match (&a.fm, agent.as_mut()) {
        (Some(fm), _) => Some(fm.clone()),
        (None, Some(ag)) => match ag.wait_for_fm(&stop) {
            Some(d) => {
                let fm = d.fm_addrs.join(",");
                first_directive = Some(d);
                Some(fm)
            }
            None => {
                let _ = ready.send(None);
                return Ok(());
            }
        },
        (None, None) => None,
    };
    // The vIP group: the node takes nothing until FM assigns it vIPs.
    let rx_packets = Arc::new(AtomicU64::new(0));
    let owned_vips: crate::OwnedVips = Default::default();
    let (vip_tx, vip_rx) = crossbeam_channel::unbounded::<proto::v1::VipAssign>();
    let mut vip_member =
        match (a.vip_group, xdp.as_mut(), &fm_addr) {
            (false, _, _) => None,
            (true, None, _) => return Err(PpNodeError::Config(
                "--vip-group needs the AF_XDP backend: only the XDP program sees frames to a vMAC"
                    .into(),
            )),
            (true, _, None) => {
                return Err(PpNodeError::Config(
                    "--vip-group needs --fm (FM assigns the vIPs)".into(),
                ))
            }
            (true, Some(x), Some(_)) => {
                x.program
                    .set_vip_macs(&[])
                    .map_err(|e| PpNodeError::Io(format!("XDP program: vIP mode: {e}")))?;
                let mut m = crate::VipMember::new(&x.ifname, owned_vips.clone())
                    .map_err(|e| PpNodeError::Io(format!("vIP group: {e}")))?;
                // A cluster node is a fabric node too (docs/fabric.md): peers reach it
                // at its own MAC on the cluster's switch, whatever vIPs it owns.
                m.set_fabric_mac(&mut x.program, node.mac)
                    .map_err(|e| PpNodeError::Io(format!("fabric: {e}")))?;
                Some(m)
            }
        };
    let mut fm_client = None;
    let mut reports_tx = None;
    let sources: Vec<RuleSource> = match &fm_addr {
        Some(fm) => {
            let mut fcfg = FmClientConfig::new(fm, &id);
            fcfg.rx_packets = rx_packets.clone();
            fcfg.tls = a.tls.clone();
            // One link per worker: FM echoes the asking worker's id, and the client
            // hands each reply to that worker (revocations to all).
            fcfg.workers = nworkers as u16;
            if vip_member.is_some() {
                fcfg.vip_capable = true;
                fcfg.owned_vips = owned_vips.clone();
                fcfg.vip_tx = Some(vip_tx.clone());
                fcfg.fabric_mac = Some(node.mac);
                // Off until FM says at registration that it serves split chains.
                let first = Arc::new(AtomicBool::new(false));
                fcfg.first_frames = Some(first.clone());
                cfg.first_frames = Some(first);
            }
            let (client, links) =
                FmClient::start(fcfg).map_err(|e| PpNodeError::Fm(e.to_string()))?;
            reports_tx = Some(client.report_sender());
            fm_client = Some(client);
            cfg.default_idle_timeout = FM_IDLE;
            cfg.notices.active_period_ms = a.active_interval.as_millis() as u32;
            cfg.counter_reports = Some(CounterReportConfig {
                interval_ms: a
                    .counter_interval
                    .as_millis()
                    .clamp(1, u128::from(u32::MAX / 2)) as u32,
                ..Default::default()
            });
            // Each worker waits on its doorbell beside its socket: FM's replies wake an
            // idle worker at once, not at its next poll timeout (crate::doorbell).
            links
                .into_iter()
                .zip(ios.iter_mut())
                .map(|(l, io)| {
                    io.set_doorbell(l.doorbell);
                    l.source
                })
                .collect()
        }
        None => {
            cfg.default_idle_timeout = STATIC_IDLE;
            (0..nworkers).map(|_| RuleSource::None).collect()
        }
    };
    // A node sees replies on the gateways' VNIs for flows it never saw start: in a PP
    // cluster another node saw them, and a restarted node forgot them. FM answers
    // those from its cache. The same holds between this node's own workers: a flow's
    // reply direction may arrive on another queue than its first packet did.
    cfg.ask_unbound = fm_addr.is_some();
    let mut rates = RateLimits::new(a.rate_capacity, nworkers, a.rates.clone())
        .map_err(|e| PpNodeError::Config(format!("rates: {e}")))?;
    let mut workers = Vec::with_capacity(nworkers);
    let mut nrules = 0;
    // Outbound ESP sequence numbers, one counter per SA for all the workers.
    let seqs = ipsec::SeqSpace::new();
    for (i, (source, io)) in sources.into_iter().zip(ios.drain(..)).enumerate() {
        let mut c = cfg.clone();
        c.worker = i as u16;
        c.seed = rand::random();
        // The fast path follows worker 0's table only (start refuses --offload with
        // more workers).
        if i > 0 {
            c.elephant = None;
        }
        let mut pipeline = Pipeline::new(c, source)
            .map_err(|e| PpNodeError::Config(format!("flow table: {e}")))?;
        // The IPsec VPN gateway (docs/ipsec.md): tunnels come with the directives. With
        // several workers, each seals an SA's packets from the node's one counter
        // (`seqs`); a lone worker keeps its own, with no atomic step per packet.
        let gw = ipsec::GatewayConfig::new(node.ip, node.mac, node.gw_mac);
        pipeline.set_ipsec(Some(if nworkers > 1 {
            ipsec::Gateway::with_seq_space(gw, seqs.clone())
        } else {
            ipsec::Gateway::new(gw)
        }));
        for (vni, b) in &a.vpcs {
            pipeline.bind_vpc(*vni, *b);
        }
        pipeline.set_policer(Box::new(rates.policer()));
        rates.mark_policed(&mut pipeline);
        pipeline.set_default_binding(a.default_chain);
        nrules = match &a.rules {
            Some(path) => install_rules_file(&mut pipeline, path)?,
            None => 0,
        };
        workers.push(Worker::new(
            pipeline,
            io,
            a.batch,
            Box::new(MonotonicClock::new()),
        ));
    }
    if let Some(d) = first_directive.take() {
        let before = rates.policed_tenants();
        for e in rates.apply(&d.rates, &mut workers[0].pipeline) {
            tracing::warn!(error = %e, "rates refused; the tenant keeps its last ones");
        }
        let st = directive_state(&a.vpcs, &d, &before, &rates.policed_tenants());
        for w in &mut workers {
            apply_state(&mut w.pipeline, &st, 0);
        }
        if let Some(ag) = agent.as_ref() {
            ag.set_applied(d.version);
        }
    }
    let mut worker = workers.remove(0);

    let start = Instant::now();
    let mut next_report = start;
    // The report's rates: packets received and rule requests sent since the last one.
    let mut report_rate = telemetry::CounterRates::<2>::default();
    let mut next_stats = a.stats_interval.map(|i| start + i);
    let fm_stats = fm_client.as_ref().map(|c| c.stats_shared());
    let notices = fm_client.as_ref().map(|c| c.notice_sender());
    // The other workers: data path only; this thread keeps the control loop and
    // hands them node-wide changes over their command channels.
    let peers_stop = Arc::new(AtomicBool::new(false));
    let mut peers: Vec<Peer> = Vec::with_capacity(workers.len());
    for (i, w) in workers.into_iter().enumerate() {
        let i = i + 1;
        let (cmd_tx, cmd_rx) = crossbeam_channel::unbounded::<WorkerCmd>();
        let snap = Arc::new(std::sync::Mutex::new(None));
        let ctx = PeerCtx {
            cmds: cmd_rx,
            snap: snap.clone(),
            notices: notices.clone(),
            reports: reports_tx.clone(),
            stop: peers_stop.clone(),
            flush_every: rates.tick_period(),
            rt: a.worker_rt.map(|p| (p, a.worker_rt_always)),
        };
        let thread = match std::thread::Builder::new()
            .name(format!("pp-worker-{i}"))
            .spawn(move || run_peer(w, ctx))
        {
            Ok(t) => t,
            Err(e) => {
                // The workers already started end with this one's failure.
                peers_stop.store(true, Ordering::Relaxed);
                for p in &mut peers {
                    if let Some(t) = p.thread.take() {
                        let _ = t.join();
                    }
                }
                return Err(PpNodeError::Worker(e.to_string()));
            }
        };
        peers.push(Peer {
            cmds: cmd_tx,
            snap,
            thread: Some(thread),
        });
    }
    // Worker 0's real-time governor; here so the final stats line has it too.
    let mut rt0: Option<rt::RtGovernor> = None;
    let r = control_loop(
        &a,
        ControlState {
            worker: &mut worker,
            peers: &mut peers,
            stop: &stop,
            ready,
            local,
            nrules,
            io_detail,
            fm_addr: fm_addr.as_deref(),
            fm_client: fm_client.as_ref(),
            fm_stats,
            notices: notices.as_ref(),
            reports_tx: reports_tx.as_ref(),
            rates: &mut rates,
            agent: agent.as_mut(),
            vip_member: vip_member.as_mut(),
            vip_rx: &vip_rx,
            xdp: xdp.as_mut(),
            fastpath: fastpath.as_mut(),
            rx_packets: &rx_packets,
            start,
            next_report: &mut next_report,
            report_rate: &mut report_rate,
            next_stats: &mut next_stats,
            rt: &mut rt0,
        },
    );
    // Whatever ended the loop ends the other workers too; they report their last
    // counters and publish their final counts as they go.
    peers_stop.store(true, Ordering::Relaxed);
    let mut first_err = r.err();
    for p in &mut peers {
        if let Some(t) = p.thread.take() {
            let e = match t.join() {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(_) => Some(PpNodeError::Panicked),
            };
            if first_err.is_none() {
                first_err = e;
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    if let (Some(fp), Some(x)) = (fastpath.as_mut(), xdp.as_mut()) {
        let now_ms = worker.now_ms();
        fp.flush(&mut x.program, &mut worker.pipeline, now_ms);
        say(&format!("pp: fast path:{}", fp.summary()));
    }
    if let Some(tx) = &reports_tx {
        // The counts since the last pass, so a stopping node loses none it could send.
        worker.pipeline.report_all_counters();
        send_reports(&mut worker.pipeline, tx, &mut Vec::new());
    }
    let rt0 = rt0.as_ref().map(|g| g.stats(Instant::now()));
    say(&summary(&worker, rt0, &peer_snaps(&peers), start.elapsed()));
    drop(xdp);
    if let Some(mut c) = fm_client {
        c.stop();
    }
    say("pp: stopped");
    Ok(())
}

/// Each worker's flow table capacity: `--flows` is the node's, split evenly (rounded
/// up), so the node's memory and flow count stay what `--flows` says.
pub fn worker_flows(flows: usize, workers: usize) -> usize {
    flows.div_ceil(workers.max(1))
}

/// A change of node-wide state for another worker, run on its thread between batches
/// with its pipeline and its clock's now (ms).
type WorkerCmd = Box<dyn FnOnce(&mut Pipeline, u32) + Send>;

/// What a worker other than 0 publishes for the control loop, every
/// [`PP_PUBLISH_EVERY`] and when it stops.
#[derive(Clone)]
struct PeerSnap {
    snap: PpSnapshot,
    io: IoStats,
    ipsec: IpsecLine,
}

/// The IPsec part of the stats line.
#[derive(Clone, Copy, Default)]
struct IpsecLine {
    shown: bool,
    tunnels: usize,
    out: u64,
    inb: u64,
    icmp_too_big: u64,
    batches: u64,
}

impl IpsecLine {
    fn of(p: &Pipeline) -> IpsecLine {
        match p.ipsec().filter(|g| !g.is_empty() || g.stats().batches > 0) {
            Some(g) => {
                let st = g.stats();
                IpsecLine {
                    shown: true,
                    tunnels: g.tunnels().len(),
                    out: st.out_packets,
                    inb: st.in_packets,
                    icmp_too_big: st.icmp_too_big,
                    batches: st.batches,
                }
            }
            None => IpsecLine::default(),
        }
    }

    fn add(&mut self, o: &IpsecLine) {
        self.shown |= o.shown;
        // Every worker holds the same tunnels.
        self.tunnels = self.tunnels.max(o.tunnels);
        self.out += o.out;
        self.inb += o.inb;
        self.icmp_too_big += o.icmp_too_big;
        self.batches += o.batches;
    }
}

fn peer_snap(w: &Worker<PpIo>, rt: Option<rt::RtStats>) -> PeerSnap {
    let mut snap = crate::metrics::worker_snapshot(w);
    snap.rt.extend(rt);
    PeerSnap {
        snap,
        io: w.io.stats(),
        ipsec: IpsecLine::of(&w.pipeline),
    }
}

struct Peer {
    cmds: crossbeam_channel::Sender<WorkerCmd>,
    snap: Arc<std::sync::Mutex<Option<PeerSnap>>>,
    thread: Option<JoinHandle<Result<(), PpNodeError>>>,
}

/// The latest snapshots of the other workers (a worker that has not published yet
/// counts as nothing).
fn peer_snaps(peers: &[Peer]) -> Vec<PeerSnap> {
    peers
        .iter()
        .filter_map(|p| telemetry::lock(&p.snap).clone())
        .collect()
}

/// Hand every other worker the change `f` makes (one command each).
fn broadcast(peers: &[Peer], f: impl Fn() -> WorkerCmd) {
    for p in peers {
        // A worker that is gone has failed; the control loop finds it by its thread.
        let _ = p.cmds.send(f());
    }
}

struct PeerCtx {
    cmds: crossbeam_channel::Receiver<WorkerCmd>,
    snap: Arc<std::sync::Mutex<Option<PeerSnap>>>,
    notices: Option<crate::fm_client::NoticeSender>,
    reports: Option<crate::ReportSender>,
    stop: Arc<AtomicBool>,
    flush_every: Duration,
    /// `SCHED_FIFO` priority of the worker and whether always
    /// ([`PpNodeConfig::worker_rt`]).
    rt: Option<(i32, bool)>,
}

fn governor(priority: i32, always: bool) -> rt::RtGovernor {
    if always {
        rt::RtGovernor::always(priority, Instant::now())
    } else {
        rt::RtGovernor::new(priority, Instant::now())
    }
}

/// A worker other than 0: the data path, its miss path's notices and counter
/// reports, and the node-wide changes the control loop sends it.
fn run_peer(mut w: Worker<PpIo>, c: PeerCtx) -> Result<(), PpNodeError> {
    corepack::exclude_current_thread();
    let mut rt = c.rt.map(|(p, always)| governor(p, always));
    let mut next_pub = Instant::now();
    let mut next_flush = Instant::now();
    let mut report_buf = Vec::new();
    let publish = |w: &Worker<PpIo>, rt: &Option<rt::RtGovernor>| {
        let rt = rt.as_ref().map(|g| g.stats(Instant::now()));
        *telemetry::lock(&c.snap) = Some(peer_snap(w, rt));
    };
    publish(&w, &rt);
    while !c.stop.load(Ordering::Relaxed) {
        while let Ok(cmd) = c.cmds.try_recv() {
            let now_ms = w.now_ms();
            cmd(&mut w.pipeline, now_ms);
        }
        let now = Instant::now();
        if now >= next_flush {
            // The node thread ticks the rate managers; this worker's spending reaches
            // them on its flushes.
            w.pipeline.flush_policer();
            next_flush = now + c.flush_every;
        }
        if now >= next_pub {
            publish(&w, &rt);
            next_pub = now + PP_PUBLISH_EVERY;
        }
        if let Some(g) = rt.as_mut() {
            g.tick(now, || w.io.kernel_drops());
        }
        w.run_once()
            .map_err(|e| PpNodeError::Worker(e.to_string()))?;
        let n = w.pipeline.take_notices();
        if let Some(tx) = &c.notices {
            tx.send(n);
        }
        if let Some(tx) = &c.reports {
            send_reports(&mut w.pipeline, tx, &mut report_buf);
        }
    }
    if let Some(tx) = &c.reports {
        w.pipeline.report_all_counters();
        send_reports(&mut w.pipeline, tx, &mut report_buf);
    }
    publish(&w, &rt);
    Ok(())
}

/// What the control loop works on (worker 0's thread).
struct ControlState<'a> {
    worker: &'a mut Worker<PpIo>,
    peers: &'a mut Vec<Peer>,
    stop: &'a AtomicBool,
    ready: Ready,
    local: SocketAddrV4,
    nrules: usize,
    io_detail: String,
    fm_addr: Option<&'a str>,
    fm_client: Option<&'a FmClient>,
    fm_stats: Option<Arc<crate::FmClientStats>>,
    notices: Option<&'a crate::fm_client::NoticeSender>,
    reports_tx: Option<&'a crate::ReportSender>,
    rates: &'a mut RateLimits,
    agent: Option<&'a mut NodeAgent>,
    vip_member: Option<&'a mut crate::VipMember>,
    vip_rx: &'a crossbeam_channel::Receiver<proto::v1::VipAssign>,
    xdp: Option<&'a mut crate::XdpAttached>,
    fastpath: Option<&'a mut FastPath>,
    rx_packets: &'a AtomicU64,
    start: Instant,
    next_report: &'a mut Instant,
    report_rate: &'a mut telemetry::CounterRates<2>,
    next_stats: &'a mut Option<Instant>,
    rt: &'a mut Option<rt::RtGovernor>,
}

/// Worker 0's loop: its own data path, and everything node-wide (directives, rates,
/// vIPs, fast path, `/metrics`, trace, stats line, node report), broadcast to the
/// other workers as commands and summed from their snapshots.
fn control_loop(a: &PpNodeConfig, s: ControlState<'_>) -> Result<(), PpNodeError> {
    let say = |l: &str| a.lines.say(l);
    let ControlState {
        worker,
        peers,
        stop,
        ready,
        local,
        nrules,
        io_detail,
        fm_addr,
        fm_client,
        fm_stats,
        notices,
        reports_tx,
        rates,
        mut agent,
        mut vip_member,
        vip_rx,
        mut xdp,
        mut fastpath,
        rx_packets,
        start,
        next_report,
        report_rate,
        next_stats,
        rt,
    } = s;
    let nworkers = peers.len() + 1;
    // Tests and scripts wait for this line before sending traffic.
    say(&format!(
        "pp: listening on {local}, {nrules} static rules, {} flows{}, {io_detail}{}{}",
        a.flows,
        match &fm_addr {
            Some(fm) => format!(", rules from FM {fm}"),
            None => String::new(),
        },
        if fastpath.is_some() {
            ", XDP fast path on"
        } else {
            ""
        },
        if nworkers > 1 {
            format!(
                ", {nworkers} workers of {} flows each",
                worker.pipeline.table().capacity()
            )
        } else {
            String::new()
        }
    ));
    // `starfabric trace` arms traces over the metrics endpoint.
    let trace = Arc::new(crate::trace::TraceControl::default());
    let mut metrics = a
        .metrics
        .map(|addr| PpMetrics::start(addr, fm_stats, Some(&trace)))
        .transpose()?;
    let metrics_addr: Option<SocketAddr> = metrics.as_ref().map(|m| m.addr());
    if let Some(ag) = agent.as_mut() {
        ag.set_metrics(metrics_addr);
    }
    let metrics_field = metrics_addr.map(tracing::field::display);
    tracing::info!(%local, rules = nrules, io = worker.io.name(), workers = nworkers, metrics = metrics_field, "PP worker running");
    *rt = a.worker_rt.map(|p| governor(p, a.worker_rt_always));
    let _ = ready.send(Some((local, metrics_addr)));

    let mut report_buf = Vec::new();
    // The other workers' latest snapshots, re-read every PP_PUBLISH_EVERY.
    let mut others: Vec<PeerSnap> = Vec::new();
    let mut next_others = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if let Some(g) = rt.as_mut() {
            g.tick(now, || worker.io.kernel_drops());
        }
        if !peers.is_empty() && now >= next_others {
            next_others = now + PP_PUBLISH_EVERY;
            others = peer_snaps(peers);
            // A worker that ended on its own failed: the node stops with its error.
            if let Some(p) = peers
                .iter_mut()
                .find(|p| p.thread.as_ref().is_some_and(|t| t.is_finished()))
            {
                return match p.thread.take().map(|t| t.join()) {
                    Some(Ok(Err(e))) => Err(e),
                    Some(Err(_)) => Err(PpNodeError::Panicked),
                    _ => Err(PpNodeError::Worker("a worker stopped".into())),
                };
            }
        }
        if let (Some(t), Some(i)) = (*next_stats, a.stats_interval) {
            if now >= t {
                let rt0 = rt.as_ref().map(|g| g.stats(now));
                let mut line = summary(worker, rt0, &others, start.elapsed());
                if let Some(c) = &fm_client {
                    // Which FM the node is on (FM failover); `none` while it has none.
                    let _ = write!(line, " fm={}", c.current_fm().as_deref().unwrap_or("none"));
                }
                if let Some(fp) = &fastpath {
                    line.push_str(&fp.summary());
                }
                if let Some(m) = &vip_member {
                    let _ = write!(
                        line,
                        " vips={} vip_assignments={} vip_announcements={}",
                        m.owned().len(),
                        m.stats.assignments,
                        m.stats.announcements
                    );
                }
                say(&line);
                *next_stats = Some(t + i);
            }
        }
        if rates.due(now) {
            worker.pipeline.flush_policer();
            rates.tick(now);
        }
        if let Some(m) = &mut metrics {
            let snaps: Vec<PpSnapshot> = others.iter().map(|o| o.snap.clone()).collect();
            m.tick(
                worker,
                rt.as_ref().map(|g| g.stats(now)),
                &snaps,
                rates,
                now,
            );
        }
        if let Some(ag) = agent.as_mut() {
            if now >= *next_report {
                *next_report = now + Duration::from_millis(250);
                if let Some(d) = ag.new_directive() {
                    let now_ms = worker.now_ms();
                    let before = rates.policed_tenants();
                    for e in rates.apply(&d.rates, &mut worker.pipeline) {
                        tracing::warn!(error = %e, "rates refused; the tenant keeps its last ones");
                    }
                    let st = Arc::new(directive_state(
                        &a.vpcs,
                        &d,
                        &before,
                        &rates.policed_tenants(),
                    ));
                    apply_state(&mut worker.pipeline, &st, now_ms);
                    broadcast(peers, || {
                        let st = st.clone();
                        Box::new(move |p, now_ms| apply_state(p, &st, now_ms))
                    });
                    ag.set_applied(d.version);
                }
                let mut r = report(worker, &others, fm_client);
                if let Some(l) = r.load.as_mut() {
                    let (rx, req) = others.iter().fold(
                        {
                            let st = worker.pipeline.stats();
                            (st.rx_packets, st.rule_requests)
                        },
                        |(rx, req), o| {
                            (
                                rx + o.snap.stats.rx_packets,
                                req + o.snap.stats.rule_requests,
                            )
                        },
                    );
                    [l.packets_per_s, l.requests_per_s] = report_rate.observe(now, [rx, req]);
                }
                r.rates = rates.status();
                ag.set_report(r);
            }
        }
        if let (Some(m), Some(x)) = (vip_member.as_mut(), xdp.as_mut()) {
            while let Ok(assign) = vip_rx.try_recv() {
                if let Err(e) = m.apply(&mut x.program, &assign) {
                    tracing::error!(error = %e, "vIP assignment not applied");
                }
            }
            m.tick(&mut x.program, now);
        }
        rx_packets.store(
            worker.pipeline.stats().rx_packets
                + others.iter().map(|o| o.snap.stats.rx_packets).sum::<u64>(),
            Ordering::Relaxed,
        );
        trace.poll_with(&mut worker.pipeline, |t| {
            broadcast(peers, || {
                let t = t.map(pipeline::Tracer::fork);
                Box::new(move |p, _| p.set_tracer(t))
            })
        });
        worker
            .run_once()
            .map_err(|e| PpNodeError::Worker(e.to_string()))?;
        // Taken even without FM, so the queue never stays full.
        let n = worker.pipeline.take_notices();
        if let Some(tx) = &notices {
            tx.send(n);
        }
        if let (Some(fp), Some(x)) = (fastpath.as_mut(), xdp.as_mut()) {
            let now_ms = worker.now_ms();
            fp.poll(&mut x.program, &mut worker.pipeline, now_ms);
        }
        if let Some(tx) = &reports_tx {
            send_reports(&mut worker.pipeline, tx, &mut report_buf);
        }
    }
    Ok(())
}

/// Install a static rules file; how many rules it held.
/// Most counter reports in one message to FM.
const REPORT_BATCH: usize = 4096;

/// Hand the worker's queued counter reports to the FM client, in bounded batches.
fn send_reports(p: &mut Pipeline, tx: &crate::ReportSender, buf: &mut Vec<CounterReport>) {
    p.take_counter_reports(buf);
    while !buf.is_empty() {
        let rest = if buf.len() > REPORT_BATCH {
            buf.split_off(REPORT_BATCH)
        } else {
            Vec::new()
        };
        tx.send(std::mem::replace(buf, rest));
    }
}

fn install_rules_file(pipeline: &mut Pipeline, path: &PathBuf) -> Result<usize, PpNodeError> {
    let err = |why: String| PpNodeError::Rules {
        path: path.clone(),
        why,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let rules = crate::parse_rules(&text).map_err(|e| err(e.to_string()))?;
    for r in &rules {
        // Static rules never idle out, whatever the default for FM's rules is.
        let mut rule = r.rule.clone();
        rule.idle_timeout.get_or_insert(STATIC_IDLE);
        pipeline
            .install_rule(&rule, 0)
            .map_err(|e| err(format!("line {}: rule does not compile: {e}", r.line)))?;
    }
    Ok(rules.len())
}

/// The node-wide part of a directive that every worker's pipeline takes.
struct DirectiveState {
    /// The directive's VNI bindings, then the static ones (which win).
    bindings: Vec<(u32, VpcBinding)>,
    /// Tenants whose policing changed: off for those that lost their packet rates,
    /// on for every tenant that has them.
    policed: Vec<(u32, bool)>,
    ipsec: Vec<proto::v1::IpsecTunnel>,
}

/// What directive `d` means for each pipeline, its rates already taken by the node's
/// rate managers (`before`, `after`: the policed tenants around that).
fn directive_state(
    fixed: &[(u32, VpcBinding)],
    d: &proto::v1::Directive,
    before: &std::collections::BTreeSet<u32>,
    after: &std::collections::BTreeSet<u32>,
) -> DirectiveState {
    let bindings: Vec<(u32, VpcBinding)> = d
        .vpcs
        .iter()
        .map(|b| {
            (
                b.vni,
                VpcBinding {
                    tenant: b.tenant,
                    chain: b.chain,
                },
            )
        })
        .chain(fixed.iter().copied())
        .collect();
    tracing::info!(
        version = d.version,
        vpcs = d.vpcs.len(),
        rates = d.rates.len(),
        ipsec = d.ipsec.len(),
        "directive applied"
    );
    DirectiveState {
        bindings,
        policed: before
            .difference(after)
            .map(|t| (*t, false))
            .chain(after.iter().map(|t| (*t, true)))
            .collect(),
        ipsec: d.ipsec.clone(),
    }
}

/// Bind the directive's VNIs, mark its policed tenants and take its IPsec tunnels.
fn apply_state(p: &mut Pipeline, st: &DirectiveState, now_ms: u32) {
    for (t, on) in &st.policed {
        p.set_tenant_policed(*t, *on);
    }
    p.replace_vpcs(st.bindings.iter().copied());
    apply_ipsec(p, &st.ipsec, now_ms);
}

/// Take the directive's IPsec tunnels. A tunnel that does not convert is left out (and
/// logged); a set the gateway refuses leaves the gateway as it was.
fn apply_ipsec(p: &mut Pipeline, tunnels: &[proto::v1::IpsecTunnel], now_ms: u32) {
    let Some(g) = p.ipsec_mut() else { return };
    let mut cfgs = Vec::with_capacity(tunnels.len());
    for t in tunnels {
        match tunnel_config(t) {
            Ok(c) => cfgs.push(c),
            Err(e) => tracing::warn!(tunnel = %t.name, error = %e, "IPsec tunnel refused"),
        }
    }
    match g.apply(&cfgs, now_ms) {
        Ok(()) => tracing::info!(tunnels = cfgs.len(), "IPsec tunnels applied"),
        Err(e) => {
            tracing::warn!(error = %e, "IPsec tunnels refused; the gateway keeps its last ones")
        }
    }
}

/// A directive's tunnel as the gateway takes it.
pub fn tunnel_config(t: &proto::v1::IpsecTunnel) -> Result<ipsec::TunnelConfig, String> {
    let ip = |what: &str, s: &str| -> Result<Ipv4Addr, String> {
        s.parse()
            .map_err(|_| format!("{what} {s:?} is not an IPv4 address"))
    };
    let prefixes = |v: &[String]| -> Result<Vec<ipsec::Prefix>, String> {
        v.iter().map(|p| p.parse()).collect()
    };
    let sa = |s: &proto::v1::IpsecSa| ipsec::SaConfig {
        spi: s.spi,
        keymat: s.keymat.clone(),
    };
    Ok(ipsec::TunnelConfig {
        name: t.name.clone(),
        tenant: t.tenant,
        vni: t.vni,
        peer: ip("peer", &t.peer)?,
        local_prefixes: prefixes(&t.local_prefixes)?,
        remote_prefixes: prefixes(&t.remote_prefixes)?,
        vtep: ip("vtep", &t.vtep)?,
        vm_mac: <[u8; 6]>::try_from(t.vm_mac.as_slice())
            .map_err(|_| format!("vm_mac has {} bytes, not 6", t.vm_mac.len()))?,
        outbound: sa(t.outbound.as_ref().ok_or("no outbound SA")?),
        inbound: t.inbound.iter().map(sa).collect(),
        esn: t.esn,
        replay_window: t.replay_window,
    })
}

/// What a PP node tells the orchestrator: worker 0's pipeline plus the others'
/// snapshots, summed.
fn report(w: &Worker<PpIo>, others: &[PeerSnap], fm: Option<&FmClient>) -> proto::v1::NodeReport {
    let p = &w.pipeline;
    let mut s = p.stats().clone();
    let mut flows = p.table().len() as u64;
    let mut tenants: Vec<(u32, pipeline::TenantCounters)> =
        p.tenants().map(|(t, c)| (t, *c)).collect();
    for o in others {
        s.merge(&o.snap.stats);
        flows += o.snap.flow_entries as u64;
        for (t, c) in &o.snap.tenants {
            match tenants.iter_mut().find(|(u, _)| u == t) {
                Some((_, u)) => u.merge(c),
                None => tenants.push((*t, *c)),
            }
        }
    }
    let ready = fm.is_none_or(|c| c.connected());
    proto::v1::NodeReport {
        load: Some(proto::v1::Load {
            requests_per_s: 0.0,
            flows,
            groups: 0,
            ..Default::default()
        }),
        ready,
        detail: match fm {
            Some(c) if c.connected() => format!(
                "FM session up ({}), {} VNIs bound",
                c.current_fm().unwrap_or_default(),
                p.vpcs().count()
            ),
            Some(_) => "no FM session".to_string(),
            None => "static rules only".to_string(),
        },
        counters: [
            ("rx_packets", s.rx_packets),
            ("tx_packets", s.tx_packets),
            ("hits", s.hits),
            ("misses", s.misses),
            ("drops", s.total_drops()),
            ("rule_requests", s.rule_requests),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect(),
        // Worker 0's gateway: the tunnels are the same on every worker (their counters
        // are worker 0's; the stats line sums them).
        ipsec: p
            .ipsec()
            .map(|g| g.tunnels().into_iter().map(ipsec_status).collect())
            .unwrap_or_default(),
        tenants: tenants
            .into_iter()
            .map(|(t, c)| proto::v1::TenantCounters {
                tenant: t,
                packets: c.packets,
                bytes: c.bytes,
                drops: c.drops,
                flows: c.flows_setup,
            })
            .collect(),
        ..Default::default()
    }
}

fn ipsec_status(t: ipsec::TunnelStatus) -> proto::v1::IpsecTunnelStatus {
    proto::v1::IpsecTunnelStatus {
        name: t.name,
        outbound_spi: t.outbound_spi,
        outbound_seq: t.outbound_seq,
        outbound_packets: t.outbound.packets,
        outbound_bytes: t.outbound.bytes,
        inbound: t
            .inbound
            .into_iter()
            .map(|(spi, c, retiring)| proto::v1::IpsecSaStatus {
                spi,
                packets: c.packets,
                bytes: c.bytes,
                retiring,
            })
            .collect(),
        drops: t.drops,
    }
}

/// `pp: t=5.0s rx=.. tx=.. hits=.. misses=.. drops=N (reason=n ...) io: ...`, summed
/// over worker 0 and the other workers' snapshots; with several workers also
/// `workers=N rx_per_worker=a/b/..`, and with real-time governors
/// `rt: workers_rt=.. rt_entered=.. rt_ms=..` (`rt_disabled` when the kernel refused
/// SCHED_FIFO), before the I/O part.
fn summary(w: &Worker<PpIo>, rt0: Option<rt::RtStats>, others: &[PeerSnap], t: Duration) -> String {
    let p = &w.pipeline;
    let mut s = p.stats().clone();
    let mut io = w.io.stats();
    let mut ipsec = IpsecLine::of(p);
    let mut reasons: Vec<(String, u64)> = DropReason::FIXED
        .iter()
        .map(|&r| (p.drop_name(r), s.dropped(r)))
        .collect();
    reasons.extend(
        (0..p.rules().reasons().len())
            .map(|i| (p.drop_name(DropReason::Rule(i as u8)), s.rule_drops[i])),
    );
    let mut rx_per_worker = vec![s.rx_packets];
    for o in others {
        rx_per_worker.push(o.snap.stats.rx_packets);
        s.merge(&o.snap.stats);
        if let Some(sum) = IoStats::sum(&[io, o.io]) {
            io = sum;
        }
        ipsec.add(&o.ipsec);
        // By name: each worker numbers its rule reasons itself.
        for (name, n) in &o.snap.drops {
            match reasons.iter_mut().find(|(m, _)| m == name) {
                Some((_, m)) => *m += n,
                None => reasons.push((name.clone(), *n)),
            }
        }
    }
    let mut line = format!(
        "pp: t={:.1}s rx={} tx={} hits={} misses={} drops={}",
        t.as_secs_f64(),
        s.rx_packets,
        s.tx_packets,
        s.hits,
        s.misses,
        s.total_drops()
    );
    let nonzero: Vec<String> = reasons
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(r, n)| format!("{r}={n}"))
        .collect();
    if !nonzero.is_empty() {
        let _ = write!(line, " ({})", nonzero.join(" "));
    }
    if s.elephants > 0 || s.fastpath_packets > 0 {
        let _ = write!(
            line,
            " elephants={} fastpath={}",
            s.elephants, s.fastpath_packets
        );
    }
    // The fabric's first packet through FM (docs/fabric.md), once it has happened.
    if s.fabric_injected > 0 || s.fabric_first_via_fm > 0 {
        let _ = write!(
            line,
            " fabric_injected={} fabric_first_via_fm={}",
            s.fabric_injected, s.fabric_first_via_fm
        );
    }
    if ipsec.shown {
        let _ = write!(
            line,
            " ipsec: tunnels={} out={} in={} icmp_too_big={} batches={}",
            ipsec.tunnels, ipsec.out, ipsec.inb, ipsec.icmp_too_big, ipsec.batches
        );
    }
    if !others.is_empty() {
        let per: Vec<String> = rx_per_worker.iter().map(u64::to_string).collect();
        let _ = write!(
            line,
            " workers={} rx_per_worker={}",
            rx_per_worker.len(),
            per.join("/")
        );
    }
    // The real-time governors (docs/afxdp.md, "Overload"): whether and how long the
    // workers ran SCHED_FIFO because the kernel dropped frames for them.
    let govs: Vec<rt::RtStats> = rt0
        .into_iter()
        .chain(others.iter().flat_map(|o| o.snap.rt.iter().copied()))
        .collect();
    if !govs.is_empty() {
        let (now_rt, g) = rt::RtStats::sum(&govs);
        let _ = write!(
            line,
            " rt: workers_rt={now_rt} rt_entered={} rt_ms={}{}",
            g.entered,
            g.rt_time.as_millis(),
            if g.disabled { " rt_disabled" } else { "" }
        );
    }
    line.push_str(&io.summary());
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flow_table_is_split_evenly_rounding_up() {
        assert_eq!(worker_flows(1 << 16, 1), 1 << 16);
        assert_eq!(worker_flows(1 << 16, 2), 1 << 15);
        assert_eq!(worker_flows(10, 3), 4);
        assert_eq!(worker_flows(5, 0), 5);
    }

    /// `--workers auto`: a worker per CPU on the UDP socket, within the flow count; one
    /// with the fast path; on AF_XDP no more than the interface's queues (loopback has
    /// one), and whatever it gives passes the count's own checks.
    #[test]
    fn auto_takes_a_worker_per_cpu_within_the_nodes_limits() {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cfg = |io: IoKind, flows: usize, offload: bool| {
            let mut c = PpNodeConfig {
                io,
                flows,
                listen: SocketAddrV4::new(Ipv4Addr::LOCALHOST, packet::VXLAN_PORT),
                workers_auto: true,
                ..PpNodeConfig::default()
            };
            c.offload.offload = offload;
            c
        };
        let udp = cfg(IoKind::Udp, 1 << 16, false);
        assert_eq!(resolve_workers(&udp), cpus.min(MAX_WORKERS));
        assert_eq!(resolve_workers(&cfg(IoKind::Udp, 1, false)), 1);
        assert_eq!(resolve_workers(&cfg(IoKind::Afxdp, 1 << 16, true)), 1);
        let lo_queues = crate::netif::rx_queues("lo").map_or(cpus, |q| q as usize);
        assert_eq!(
            resolve_workers(&cfg(IoKind::Afxdp, 1 << 16, false)),
            cpus.min(lo_queues).clamp(1, MAX_WORKERS)
        );
        for c in [
            udp,
            cfg(IoKind::Auto, 1 << 16, false),
            cfg(IoKind::Udp, 1, false),
        ] {
            let c = PpNodeConfig {
                workers: resolve_workers(&c),
                ..c
            };
            assert!(check_workers(&c).is_ok(), "{} workers", c.workers);
        }
    }

    #[test]
    fn worker_counts_the_node_cannot_run_are_refused() {
        let cfg = |workers: usize, flows: usize, offload: bool| {
            let mut c = PpNodeConfig {
                workers,
                flows,
                ..PpNodeConfig::default()
            };
            c.offload.offload = offload;
            check_workers(&c)
        };
        assert!(cfg(1, 1 << 16, true).is_ok());
        assert!(cfg(4, 1 << 16, false).is_ok());
        for (w, f, o, needle) in [
            (0, 1 << 16, false, "--workers 0 is not in 1..=64"),
            (65, 1 << 16, false, "--workers 65"),
            (2, 1 << 16, true, "--offload runs with one worker only"),
            (4, 3, false, "--flows 3 is fewer than --workers 4"),
        ] {
            match cfg(w, f, o) {
                Err(PpNodeError::Config(why)) => assert!(why.contains(needle), "{why}"),
                r => panic!("{w} workers, {f} flows, offload {o}: {:?}", r.err()),
            }
        }
    }
}
