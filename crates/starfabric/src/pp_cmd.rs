//! `starfabric pp`: run a PP node (`pp::node`) until SIGINT/SIGTERM or `--duration`.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use pipeline::VpcBinding;
use pp::node::{IoKind, OffloadConfig, PpNodeConfig};

/// `--io`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum IoArg {
    /// AF_XDP where it works, else the UDP socket.
    Auto,
    /// AF_XDP or fail.
    Afxdp,
    /// The UDP socket.
    Udp,
}

/// `--afxdp-tx`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum AfxdpTxArg {
    /// The packet socket in copy mode, the TX ring in zero-copy mode.
    Auto,
    /// The AF_XDP TX ring.
    Ring,
    /// The packet socket with UDP GSO, or fail.
    Gso,
}

#[derive(Args, Debug, Clone)]
struct OffloadArgs {
    /// Run elephant flows' rules in the XDP program on the node's interface (the XDP
    /// fast path). Needs the program attached, which the AF_XDP backend does.
    #[arg(long)]
    offload: bool,
    /// Elephant detection window (ms).
    #[arg(long, default_value_t = 100)]
    offload_window_ms: u32,
    /// Bytes within one window that make a flow an elephant.
    #[arg(long, default_value_t = 125_000)]
    offload_bytes: u64,
    /// Packets within one window that make a flow an elephant.
    #[arg(long, default_value_t = 1_000)]
    offload_packets: u32,
    /// An offloaded flow idle this long (ms) in the driver goes back to userspace.
    #[arg(long, default_value_t = 2_000)]
    offload_idle_ms: u64,
}

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
    #[arg(long, value_enum, default_value_t = IoArg::Auto)]
    io: IoArg,
    /// UMEM frames of the AF_XDP socket (a power of two).
    #[arg(long, default_value_t = 4096)]
    xdp_frames: u32,
    /// Preferred busy polling of the AF_XDP sockets: µs one busy poll spins (0: off,
    /// the socket is NAPI driven). With it on, the worker runs the device's receive
    /// poll itself, so overload is refused in the device ring instead of starving the
    /// worker. Linux 6.13+ gives an AF_XDP socket a NAPI to busy-poll only in zero-copy
    /// mode, so it does nothing on a veth (copy mode); off by default
    /// (docs/afxdp.md, "Overload").
    #[arg(long, default_value_t = 0)]
    busy_poll: u32,
    /// Frames per busy poll (`SO_BUSY_POLL_BUDGET`).
    #[arg(long, default_value_t = 64)]
    busy_poll_budget: u16,
    /// How AF_XDP ports transmit: `auto` (a packet socket sending UDP GSO runs in copy
    /// mode, the TX ring in zero-copy mode), `ring` (the TX ring: one skb per frame in
    /// copy mode), `gso` (the packet socket, or fail). docs/afxdp.md, "Transmit".
    #[arg(long, value_enum, default_value_t = AfxdpTxArg::Auto)]
    afxdp_tx: AfxdpTxArg,
    /// Run each packet worker SCHED_FIFO at this priority (1-99; 0: never) while the
    /// kernel drops frames for it. The kernel's receive work for the worker's queue then
    /// runs only while the worker waits for frames, so overload cannot starve the worker
    /// (receive livelock; docs/afxdp.md, "Overload").
    #[arg(long, default_value_t = 10)]
    worker_rt: i32,
    /// With --worker-rt: SCHED_FIFO always, not only while the kernel drops frames.
    /// Keeps more of the peak under overload, at a cost to everything else on the
    /// worker's CPU (docs/afxdp.md, "Overload").
    #[arg(long)]
    worker_rt_always: bool,
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
    /// Flow table capacity of the node, split evenly over the workers.
    #[arg(long, default_value_t = 1 << 16)]
    flows: usize,
    /// Pipeline workers, one thread each (docs/pp-pipeline.md, "Workers"): a number, or
    /// `auto` for one per CPU the process may run on (at most the interface's receive
    /// queues on AF_XDP; one with --offload). With AF_XDP the interface needs exactly
    /// this many receive queues (worker i takes queue i); with the UDP socket they share
    /// the port with SO_REUSEPORT. More than one is refused with --offload.
    #[arg(long, default_value = "auto", value_parser = parse_workers)]
    workers: Workers,
    /// Stop after this many seconds (default: run until SIGINT/SIGTERM).
    #[arg(long, value_parser = parse_secs)]
    duration: Option<Duration>,
    /// Print a one-line stats summary to stdout every this many seconds.
    #[arg(long, value_parser = parse_secs)]
    stats_interval: Option<Duration>,
    /// With an FM: report counted rules' packet and byte counters (the monitor NF's
    /// counts) every this many seconds; rules that leave the table report at once.
    #[arg(long, value_parser = parse_secs, default_value = "1")]
    counter_interval: Duration,
    /// With an FM: report flows that carried traffic as active every this many seconds
    /// (at most 15; 0: never), so NFs refresh their idle deadlines (docs/nf-api.md,
    /// "Timeouts").
    #[arg(long, value_parser = parse_secs, default_value = "10")]
    active_interval: Duration,
    /// Send all output to this UDP port instead of each frame's outer destination port
    /// (4789); for several VXLAN endpoints on one host.
    #[arg(long)]
    peer_port: Option<u16>,
    /// Largest receive batch (1..=256 for the UDP socket, 1..=256 for AF_XDP).
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
    offload: OffloadArgs,
    /// A tenant's fixed rates (paper 000 §7.2), repeatable; they win over the
    /// orchestrator's: `TENANT:requests=MIN/BASE/BURST[/DEBT],packets=MIN/BASE/BURST[/DEBT]`
    /// (per second: new flows, packets).
    #[arg(long = "tenant-rate", value_parser = pp::rates::parse_rate_flag)]
    tenant_rates: Vec<(u32, pp::rates::TenantRateLimits)>,
    /// New flows per second this node's setup path sustains: the capacity the
    /// request-rate managers share out among tenants.
    #[arg(long, default_value_t = pp::rates::RateCapacity::default().requests)]
    setup_capacity: f64,
    /// Packets per second this node forwards: the capacity the packet-rate managers
    /// share out.
    #[arg(long, default_value_t = pp::rates::RateCapacity::default().packets)]
    packet_capacity: f64,
    #[command(flatten)]
    tls: crate::tls_args::TlsArgs,
    #[command(flatten)]
    pack: crate::pack_args::PackArgs,
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

/// `--workers`: a count, or `auto` (a worker per CPU the node may use).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workers {
    Auto,
    Count(usize),
}

fn parse_workers(s: &str) -> Result<Workers, String> {
    if s == "auto" {
        return Ok(Workers::Auto);
    }
    s.parse()
        .map(Workers::Count)
        .map_err(|_| format!("{s:?} is neither a number of workers nor `auto`"))
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

pub fn run(a: PpArgs) -> Result<()> {
    // A node with static rules alone has no plane links to secure.
    let tls = if a.fm.is_some() || a.orchestrator.is_some() {
        let id = a.id.clone().unwrap_or_else(|| format!("pp-{}", a.listen));
        a.tls.load(proto::tls::Role::Pp, &id)?
    } else {
        None
    };
    let stop = crate::signals::install()?;
    let _packer = a.pack.start()?;
    let o = &a.offload;
    let cfg = PpNodeConfig {
        listen: a.listen,
        rules: a.rules,
        io: match a.io {
            IoArg::Auto => IoKind::Auto,
            IoArg::Afxdp => IoKind::Afxdp,
            IoArg::Udp => IoKind::Udp,
        },
        xdp_frames: a.xdp_frames,
        busy_poll: (a.busy_poll > 0).then_some(pp::BusyPoll {
            usecs: a.busy_poll,
            budget: a.busy_poll_budget,
        }),
        afxdp_tx: match a.afxdp_tx {
            AfxdpTxArg::Auto => pp::AfXdpTx::Auto,
            AfxdpTxArg::Ring => pp::AfXdpTx::Ring,
            AfxdpTxArg::Gso => pp::AfXdpTx::Gso,
        },
        worker_rt: (a.worker_rt > 0).then_some(a.worker_rt),
        worker_rt_always: a.worker_rt_always,
        node_ip: a.node_ip,
        node_mac: a.node_mac,
        gw_mac: a.gw_mac,
        flows: a.flows,
        workers: match a.workers {
            Workers::Auto => 1,
            Workers::Count(n) => n,
        },
        workers_auto: a.workers == Workers::Auto,
        stats_interval: a.stats_interval,
        counter_interval: a.counter_interval,
        active_interval: a.active_interval,
        peer_port: a.peer_port,
        batch: a.batch,
        fm: a.fm,
        id: a.id,
        vpcs: a.vpcs,
        default_chain: a.default_chain,
        orchestrator: a.orchestrator,
        cluster: a.cluster,
        vip_group: a.vip_group,
        metrics: a.metrics,
        offload: OffloadConfig {
            offload: o.offload,
            offload_window_ms: o.offload_window_ms,
            offload_bytes: o.offload_bytes,
            offload_packets: o.offload_packets,
            offload_idle_ms: o.offload_idle_ms,
        },
        rate_capacity: pp::rates::RateCapacity {
            requests: a.setup_capacity,
            packets: a.packet_capacity,
        },
        rates: a.tenant_rates.into_iter().collect(),
        lines: telemetry::Lines::stdout(),
        tls,
    };
    let Some(node) = pp::node::start(cfg, stop)? else {
        return Ok(());
    };
    crate::signals::wait(a.duration, None, || node.is_finished(), || {});
    Ok(node.stop()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_is_a_count_or_auto() {
        assert_eq!(parse_workers("auto"), Ok(Workers::Auto));
        assert_eq!(parse_workers("3"), Ok(Workers::Count(3)));
        // 0 parses; the node refuses it with its own message.
        assert_eq!(parse_workers("0"), Ok(Workers::Count(0)));
        for bad in ["", "-1", "two", "Auto"] {
            let e = parse_workers(bad).unwrap_err();
            assert!(e.contains("neither a number of workers nor `auto`"), "{e}");
        }
    }
}
