//! A whole PP node, started in-process: one pipeline worker on an AF_XDP socket (the
//! default wherever it works) or a UDP VXLAN socket ([`IoKind`]), its rule source, the
//! optional XDP fast path, vIP group membership, `/metrics`, and the control session.
//!
//! Rules come from the fabric master (`fm`): a miss holds the packet and asks FM,
//! which asks the SC group owning the flow. Static rules from a file (`rules`) can be
//! installed too; without an FM they are the only rules and a miss is a `no-rule` drop.
//!
//! [`start`] returns once the node is listening (or failed); the worker runs on a
//! thread of its own until [`PpHandle::stop`]. `starfabric pp` is this plus flags.

mod fastpath;
mod io;

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
pub use io::{mac_str, open, IoKind, IoOptions, IoStats, OpenedIo, PpIo};

use crate::metrics::PpMetrics;
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

/// What a PP node runs with; [`Default`] is `starfabric pp` with no flags.
#[derive(Clone)]
pub struct PpNodeConfig {
    /// Underlay IPv4 address and UDP port to receive VXLAN on.
    pub listen: SocketAddrV4,
    /// Static rules file (`match` / `rule` line pairs, see [`crate::parse_rules`]).
    pub rules: Option<PathBuf>,
    pub io: IoKind,
    /// UMEM frames of the AF_XDP socket (a power of two).
    pub xdp_frames: u32,
    /// The outer source `encap` writes (default: the listen address).
    pub node_ip: Option<Ipv4Addr>,
    /// Outer source MAC with the UDP backend (AF_XDP uses the interface's).
    pub node_mac: Option<[u8; 6]>,
    /// Outer destination MAC; AF_XDP resolves it when not given.
    pub gw_mac: Option<[u8; 6]>,
    /// Flow table capacity.
    pub flows: usize,
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
            node_ip: None,
            node_mac: None,
            gw_mac: None,
            flows: 1 << 16,
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
pub fn start(cfg: PpNodeConfig, stop: Arc<AtomicBool>) -> Result<Option<PpHandle>, PpNodeError> {
    if cfg.active_interval > MAX_ACTIVE_INTERVAL {
        return Err(PpNodeError::Config(format!(
            "--active-interval {:?} is longer than {:?}: NFs refresh idle deadlines only on \
             these reports, and the FW times ICMP at 30 s",
            cfg.active_interval, MAX_ACTIVE_INTERVAL
        )));
    }
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

type Ready = std::sync::mpsc::SyncSender<Option<(SocketAddrV4, Option<SocketAddr>)>>;

fn run(a: PpNodeConfig, stop: Arc<AtomicBool>, ready: Ready) -> Result<(), PpNodeError> {
    let say = |l: &str| a.lines.say(l);
    let id = a.id.clone().unwrap_or_else(|| format!("pp-{}", a.listen));
    let opened = io::open(&IoOptions {
        kind: a.io,
        listen: a.listen,
        peer_port: a.peer_port,
        batch: a.batch,
        // Replies are serviced between receive batches: an idle socket must not hold
        // them back for long.
        poll_timeout: if a.fm.is_some() || a.orchestrator.is_some() {
            Duration::from_millis(1)
        } else {
            Duration::from_millis(20)
        },
        gw_mac: a.gw_mac,
        frames: a.xdp_frames,
    })?;
    let io = opened.io;
    // Kept for as long as the worker runs: dropping it detaches the XDP program. Its
    // `program` is where offloaded rules go.
    let mut xdp = opened.xdp;
    let io_detail = opened.detail;
    let local = match &io {
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
    cfg.flow_capacity = a.flows;
    cfg.seed = rand::random();
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
    let source = match &fm_addr {
        Some(fm) => {
            let mut fcfg = FmClientConfig::new(fm, &id);
            fcfg.rx_packets = rx_packets.clone();
            fcfg.tls = a.tls.clone();
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
            let (client, mut links) =
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
            links.remove(0).source
        }
        None => {
            cfg.default_idle_timeout = STATIC_IDLE;
            RuleSource::None
        }
    };
    // A node sees replies on the gateways' VNIs for flows it never saw start: in a PP
    // cluster another node saw them, and a restarted node forgot them. FM answers
    // those from its cache.
    cfg.ask_unbound = fm_addr.is_some();
    let mut pipeline =
        Pipeline::new(cfg, source).map_err(|e| PpNodeError::Config(format!("flow table: {e}")))?;
    // The IPsec VPN gateway (docs/ipsec.md): tunnels come with the directives.
    pipeline.set_ipsec(Some(ipsec::Gateway::new(ipsec::GatewayConfig::new(
        node.ip,
        node.mac,
        node.gw_mac,
    ))));
    for (vni, b) in &a.vpcs {
        pipeline.bind_vpc(*vni, *b);
    }
    let mut rates = RateLimits::new(a.rate_capacity, 1, a.rates.clone())
        .map_err(|e| PpNodeError::Config(format!("rates: {e}")))?;
    pipeline.set_policer(Box::new(rates.policer()));
    rates.mark_policed(&mut pipeline);
    if let (Some(d), Some(ag)) = (first_directive.take(), agent.as_ref()) {
        apply_directive(&mut pipeline, &mut rates, &a.vpcs, &d, 0);
        ag.set_applied(d.version);
    }
    pipeline.set_default_binding(a.default_chain);
    let nrules = match &a.rules {
        Some(path) => install_rules_file(&mut pipeline, path)?,
        None => 0,
    };

    let mut worker = Worker::new(pipeline, io, a.batch, Box::new(MonotonicClock::new()));

    let start = Instant::now();
    let mut next_report = start;
    // The report's rates: packets received and rule requests sent since the last one.
    let mut report_rate = telemetry::CounterRates::<2>::default();
    let mut next_stats = a.stats_interval.map(|i| start + i);
    // Tests and scripts wait for this line before sending traffic.
    say(&format!(
        "pp: listening on {local}, {nrules} static rules, {} flows{}, {io_detail}{}",
        a.flows,
        match &fm_addr {
            Some(fm) => format!(", rules from FM {fm}"),
            None => String::new(),
        },
        if fastpath.is_some() {
            ", XDP fast path on"
        } else {
            ""
        }
    ));
    let fm_stats = fm_client.as_ref().map(|c| c.stats_shared());
    let notices = fm_client.as_ref().map(|c| c.notice_sender());
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
    tracing::info!(%local, rules = nrules, io = worker.io.name(), metrics = metrics_field, "PP worker running");
    let _ = ready.send(Some((local, metrics_addr)));

    let mut report_buf = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if let (Some(t), Some(i)) = (next_stats, a.stats_interval) {
            if now >= t {
                let mut line = summary(&worker, start.elapsed());
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
                next_stats = Some(t + i);
            }
        }
        if rates.due(now) {
            worker.pipeline.flush_policer();
            rates.tick(now);
        }
        if let Some(m) = &mut metrics {
            m.tick(&worker, &rates, now);
        }
        if let Some(ag) = agent.as_mut() {
            if now >= next_report {
                next_report = now + Duration::from_millis(250);
                if let Some(d) = ag.new_directive() {
                    let now_ms = worker.now_ms();
                    apply_directive(&mut worker.pipeline, &mut rates, &a.vpcs, &d, now_ms);
                    ag.set_applied(d.version);
                }
                let mut r = report(&worker, fm_client.as_ref());
                if let Some(l) = r.load.as_mut() {
                    let st = worker.pipeline.stats();
                    [l.packets_per_s, l.requests_per_s] =
                        report_rate.observe(now, [st.rx_packets, st.rule_requests]);
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
        rx_packets.store(worker.pipeline.stats().rx_packets, Ordering::Relaxed);
        trace.poll(&mut worker.pipeline);
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
    if let (Some(fp), Some(x)) = (fastpath.as_mut(), xdp.as_mut()) {
        let now_ms = worker.now_ms();
        fp.flush(&mut x.program, &mut worker.pipeline, now_ms);
        say(&format!("pp: fast path:{}", fp.summary()));
    }
    if let Some(tx) = &reports_tx {
        // The counts since the last pass, so a stopping node loses none it could send.
        worker.pipeline.report_all_counters();
        send_reports(&mut worker.pipeline, tx, &mut report_buf);
    }
    say(&summary(&worker, start.elapsed()));
    drop(xdp);
    if let Some(mut c) = fm_client {
        c.stop();
    }
    say("pp: stopped");
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

/// Bind the directive's VNIs (plus the static ones, which win) and take its rates.
fn apply_directive(
    p: &mut Pipeline,
    rates: &mut RateLimits,
    fixed: &[(u32, VpcBinding)],
    d: &proto::v1::Directive,
    now_ms: u32,
) {
    for e in rates.apply(&d.rates, p) {
        tracing::warn!(error = %e, "rates refused; the tenant keeps its last ones");
    }
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
    p.replace_vpcs(bindings);
    apply_ipsec(p, &d.ipsec, now_ms);
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

/// What a PP node tells the orchestrator.
fn report(w: &Worker<PpIo>, fm: Option<&FmClient>) -> proto::v1::NodeReport {
    let p = &w.pipeline;
    let s = p.stats();
    let ready = fm.is_none_or(|c| c.connected());
    proto::v1::NodeReport {
        load: Some(proto::v1::Load {
            requests_per_s: 0.0,
            flows: p.table().len() as u64,
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
        ipsec: p
            .ipsec()
            .map(|g| g.tunnels().into_iter().map(ipsec_status).collect())
            .unwrap_or_default(),
        tenants: p
            .tenants()
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

/// `pp: t=5.0s rx=.. tx=.. hits=.. misses=.. drops=N (reason=n ...) io: ...`
fn summary(w: &Worker<PpIo>, t: Duration) -> String {
    let p = &w.pipeline;
    let s = p.stats();
    let io = w.io.stats();
    let mut line = format!(
        "pp: t={:.1}s rx={} tx={} hits={} misses={} drops={}",
        t.as_secs_f64(),
        s.rx_packets,
        s.tx_packets,
        s.hits,
        s.misses,
        s.total_drops()
    );
    let mut reasons: Vec<(String, u64)> = DropReason::FIXED
        .iter()
        .map(|&r| (p.drop_name(r), s.dropped(r)))
        .collect();
    reasons.extend(
        (0..p.rules().reasons().len())
            .map(|i| (p.drop_name(DropReason::Rule(i as u8)), s.rule_drops[i])),
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
    if let Some(g) = p.ipsec().filter(|g| !g.is_empty() || g.stats().batches > 0) {
        let st = g.stats();
        let _ = write!(
            line,
            " ipsec: tunnels={} out={} in={} icmp_too_big={} batches={}",
            g.tunnels().len(),
            st.out_packets,
            st.in_packets,
            st.icmp_too_big,
            st.batches
        );
    }
    line.push_str(&io.summary());
    line
}
