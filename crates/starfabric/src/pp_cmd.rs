//! `starfabric pp`: run a PP node: one pipeline worker on an AF_XDP socket (the default
//! wherever it works) or a UDP VXLAN socket (`--io`, see `pp_io`).
//!
//! Rules come from the fabric master (`--fm ADDR`): a miss holds the packet and asks FM,
//! which asks the SC group owning the flow. Static rules from a file (`--rules`) can be
//! installed too; without `--fm` they are the only rules and a miss is a `no-rule` drop.

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use pipeline::{
    DropReason, MonotonicClock, NodeAddr, Pipeline, PipelineConfig, RuleSource, VpcBinding, Worker,
};
use pp::{FmClient, FmClientConfig};

use crate::node_agent::NodeAgent;
use crate::pp_io::{IoKind, IoOptions, PpIo};

#[derive(Args, Debug)]
pub struct PpArgs {
    /// Underlay IPv4 address and UDP port to receive VXLAN on.
    #[arg(long, default_value = "0.0.0.0:4789")]
    listen: SocketAddrV4,
    /// Static rules: `match <vni> <proto> <src> > <dst>` / `rule <actions>` line pairs.
    #[arg(long)]
    rules: Option<PathBuf>,
    /// I/O backend: `auto` (AF_XDP on the interface that owns --listen's address, else
    /// the UDP socket), `afxdp` (AF_XDP or fail), `udp` (the UDP socket).
    #[arg(long, value_enum, default_value_t = IoKind::Auto)]
    io: IoKind,
    /// UMEM frames of the AF_XDP socket (a power of two).
    #[arg(long, default_value_t = 4096)]
    xdp_frames: u32,
    /// This node's underlay address, the outer source `encap` writes (default: the
    /// --listen address). The UDP backend's kernel sends from the socket's address
    /// regardless.
    #[arg(long)]
    node_ip: Option<Ipv4Addr>,
    /// This node's underlay MAC, the outer source MAC `encap` writes (UDP backend;
    /// AF_XDP uses the interface's own MAC). Default 02:00:00:00:00:01.
    #[arg(long, value_parser = parse_mac)]
    node_mac: Option<[u8; 6]>,
    /// The underlay next hop's MAC, the outer destination MAC `encap` writes. AF_XDP
    /// resolves it from the kernel's route and neighbour tables when not given; the UDP
    /// backend (whose kernel writes the real one) defaults to 02:00:00:00:00:02.
    #[arg(long, value_parser = parse_mac)]
    gw_mac: Option<[u8; 6]>,
    /// Flow table capacity.
    #[arg(long, default_value_t = 1 << 16)]
    flows: usize,
    /// Stop after this many seconds (default: run until SIGINT/SIGTERM).
    #[arg(long, value_parser = parse_secs)]
    duration: Option<Duration>,
    /// Print a one-line stats summary to stdout every this many seconds.
    #[arg(long, value_parser = parse_secs)]
    stats_interval: Option<Duration>,
    /// Send all output to this UDP port instead of each frame's outer destination port
    /// (4789); for several VXLAN endpoints on one host.
    #[arg(long)]
    peer_port: Option<u16>,
    /// Largest receive batch (1..=64 for the UDP socket, 1..=256 for AF_XDP).
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Ask this fabric master (`host:port`) for the rules of flows that miss. Several,
    /// comma-separated (`a:7000,b:7001`): the node starts on the first and fails over
    /// to the next when its FM is unreachable; the stats line names the one it is on
    /// (`fm=ADDR`).
    #[arg(long)]
    fm: Option<String>,
    /// This node's id toward FM (default: `pp-<listen address>`).
    #[arg(long)]
    id: Option<String>,
    /// Bind a VNI to a tenant chain: `VNI=TENANT:CHAIN` (repeatable). Misses on other
    /// VNIs use `--default-chain`, or are dropped as `unknown-vni`.
    #[arg(long = "vpc", value_parser = parse_vpc)]
    vpcs: Vec<(u32, VpcBinding)>,
    /// `TENANT:CHAIN` for VNIs without a `--vpc` binding.
    #[arg(long, value_parser = parse_binding)]
    default_chain: Option<VpcBinding>,
    /// Register with this orchestrator (control address, `host:port`): it binds the
    /// VNIs of the tenants on this node's PP cluster and names the FM (unless --fm).
    #[arg(long)]
    orchestrator: Option<String>,
    /// The PP cluster (vIP group) this node serves.
    #[arg(long, default_value = "default")]
    cluster: String,
    /// Join the PP cluster's vIP group (Multi-IP, docs/pp-cluster.md): take VXLAN only
    /// in frames to the vMACs FM assigns this node, and announce them. Needs the AF_XDP
    /// backend (the XDP program filters by destination MAC) and `--fm`.
    #[arg(long)]
    vip_group: bool,
    /// Serve Prometheus metrics (`/metrics`, `/healthz`) on this address; port 0 picks one.
    #[arg(long)]
    metrics: Option<SocketAddr>,
    #[command(flatten)]
    offload: crate::fastpath::OffloadArgs,
}

fn parse_binding(s: &str) -> Result<VpcBinding, String> {
    let (t, c) = s.split_once(':').ok_or("expected TENANT:CHAIN")?;
    Ok(VpcBinding {
        tenant: t.parse().map_err(|_| format!("bad tenant {t:?}"))?,
        chain: c.parse().map_err(|_| format!("bad chain {c:?}"))?,
    })
}

fn parse_vpc(s: &str) -> Result<(u32, VpcBinding), String> {
    let (v, b) = s.split_once('=').ok_or("expected VNI=TENANT:CHAIN")?;
    let vni: u32 = v.parse().map_err(|_| format!("bad VNI {v:?}"))?;
    if vni >> 24 != 0 {
        return Err(format!("VNI {vni} does not fit in 24 bits"));
    }
    Ok((vni, parse_binding(b)?))
}

fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let mut m = [0u8; 6];
    let mut parts = s.split(':');
    for b in m.iter_mut() {
        let p = parts.next().ok_or("a MAC has six parts")?;
        *b = u8::from_str_radix(p, 16).map_err(|_| format!("bad MAC byte {p:?}"))?;
    }
    if parts.next().is_some() {
        return Err("a MAC has six parts".into());
    }
    Ok(m)
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("not a number of seconds: {s:?}"))?;
    Duration::try_from_secs_f64(v).map_err(|e| e.to_string())
}

pub(crate) static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    // Only an atomic store: anything else is not async-signal-safe.
    STOP.store(true, Ordering::Relaxed);
}

pub(crate) fn install_signal_handlers() -> Result<()> {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        let handler = on_signal as extern "C" fn(libc::c_int);
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe; glibc's
        // signal() installs it with SA_RESTART semantics, and a poll(2) it interrupts
        // returns EINTR, which the backend treats as "no packets".
        let prev = unsafe { libc::signal(sig, handler as libc::sighandler_t) };
        if prev == libc::SIG_ERR {
            bail!(
                "cannot install a handler for signal {sig}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(())
}

/// Static rules never idle out.
const STATIC_IDLE: Duration = Duration::MAX;
/// Idle timeout of FM rules that name none.
const FM_IDLE: Duration = Duration::from_secs(300);

pub fn run(a: PpArgs) -> Result<()> {
    let id = a.id.clone().unwrap_or_else(|| format!("pp-{}", a.listen));
    install_signal_handlers()?;
    let opened = crate::pp_io::open(&IoOptions {
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
    // `program` is where offloaded rules will go.
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
        (true, Some(_)) => Some(crate::fastpath::FastPath::new(&a.offload)),
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
        )?),
        None => None,
    };
    let mut first_directive = None;
    let fm_addr = match (&a.fm, agent.as_mut()) {
        (Some(fm), _) => Some(fm.clone()),
        (None, Some(ag)) => match ag.wait_for_fm(&STOP) {
            Some(d) => {
                let fm = d.fm_addrs.join(",");
                first_directive = Some(d);
                Some(fm)
            }
            None => return Ok(()),
        },
        (None, None) => None,
    };
    // The vIP group: the node takes nothing until FM assigns it vIPs.
    let rx_packets = Arc::new(AtomicU64::new(0));
    let owned_vips: pp::OwnedVips = Default::default();
    let (vip_tx, vip_rx) = crossbeam_channel::unbounded::<proto::v1::VipAssign>();
    let mut vip_member = match (a.vip_group, xdp.as_mut(), &fm_addr) {
        (false, _, _) => None,
        (true, None, _) => anyhow::bail!(
            "--vip-group needs the AF_XDP backend: only the XDP program sees frames to a vMAC"
        ),
        (true, _, None) => bail!("--vip-group needs --fm (FM assigns the vIPs)"),
        (true, Some(x), Some(_)) => {
            x.program
                .set_vip_macs(&[])
                .context("XDP program: vIP mode")?;
            Some(pp::VipMember::new(&x.ifname, owned_vips.clone()).context("vIP group")?)
        }
    };
    let mut fm_client = None;
    let source = match &fm_addr {
        Some(fm) => {
            let mut fcfg = FmClientConfig::new(fm, &id);
            fcfg.rx_packets = rx_packets.clone();
            if vip_member.is_some() {
                fcfg.vip_capable = true;
                fcfg.owned_vips = owned_vips.clone();
                fcfg.vip_tx = Some(vip_tx.clone());
            }
            let (client, mut links) = FmClient::start(fcfg).context("FM client")?;
            fm_client = Some(client);
            cfg.default_idle_timeout = FM_IDLE;
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
    let mut pipeline = Pipeline::new(cfg, source).context("flow table")?;
    for (vni, b) in &a.vpcs {
        pipeline.bind_vpc(*vni, *b);
    }
    if let (Some(d), Some(ag)) = (first_directive.take(), agent.as_ref()) {
        apply_directive(&mut pipeline, &a.vpcs, &d);
        ag.set_applied(d.version);
    }
    pipeline.set_default_binding(a.default_chain);

    let mut nrules = 0;
    if let Some(path) = &a.rules {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let rules = pp::parse_rules(&text).with_context(|| format!("{}", path.display()))?;
        for r in &rules {
            // Static rules never idle out, whatever the default for FM's rules is.
            let mut rule = r.rule.clone();
            rule.idle_timeout.get_or_insert(STATIC_IDLE);
            pipeline.install_rule(&rule, 0).with_context(|| {
                format!("{}: line {}: rule does not compile", path.display(), r.line)
            })?;
        }
        nrules = rules.len();
    }

    let mut worker = Worker::new(pipeline, io, a.batch, Box::new(MonotonicClock::new()));

    let start = Instant::now();
    let mut next_report = start;
    let deadline = a.duration.map(|d| start + d);
    let mut next_stats = a.stats_interval.map(|i| start + i);
    // Tests and scripts wait for this line before sending traffic.
    println!(
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
    );
    std::io::stdout().flush()?;
    let fm_stats = fm_client.as_ref().map(|c| c.stats_shared());
    let mut metrics = a
        .metrics
        .map(|addr| crate::metrics::PpMetrics::start(addr, fm_stats))
        .transpose()?;
    let metrics_addr: Option<SocketAddr> = metrics.as_ref().map(|m| m.addr());
    if let Some(ag) = agent.as_mut() {
        ag.set_metrics(metrics_addr);
    }
    let metrics_field = metrics_addr.map(tracing::field::display);
    tracing::info!(%local, rules = nrules, io = worker.io.name(), metrics = metrics_field, "PP worker running");

    while !STOP.load(Ordering::Relaxed) {
        let now = Instant::now();
        if deadline.is_some_and(|d| now >= d) {
            break;
        }
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
                println!("{line}");
                std::io::stdout().flush()?;
                next_stats = Some(t + i);
            }
        }
        if let Some(m) = &mut metrics {
            m.tick(&worker, now);
        }
        if let Some(ag) = agent.as_mut() {
            if now >= next_report {
                next_report = now + Duration::from_millis(250);
                if let Some(d) = ag.new_directive() {
                    apply_directive(&mut worker.pipeline, &a.vpcs, &d);
                    ag.set_applied(d.version);
                }
                ag.set_report(report(&worker, fm_client.as_ref()));
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
        worker.run_once().context("worker")?;
        if let (Some(fp), Some(x)) = (fastpath.as_mut(), xdp.as_mut()) {
            let now_ms = worker.now_ms();
            fp.poll(&mut x.program, &mut worker.pipeline, now_ms);
        }
    }
    if let (Some(fp), Some(x)) = (fastpath.as_mut(), xdp.as_mut()) {
        let now_ms = worker.now_ms();
        fp.flush(&mut x.program, &mut worker.pipeline, now_ms);
        println!("pp: fast path:{}", fp.summary());
    }
    println!("{}", summary(&worker, start.elapsed()));
    drop(xdp);
    if let Some(mut c) = fm_client {
        c.stop();
    }
    println!("pp: stopped");
    Ok(())
}

/// Bind the directive's VNIs (plus the static `--vpc` ones, which win).
fn apply_directive(p: &mut Pipeline, fixed: &[(u32, VpcBinding)], d: &proto::v1::Directive) {
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
        "directive applied"
    );
    p.replace_vpcs(bindings);
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
    line.push_str(&io.summary());
    line
}
