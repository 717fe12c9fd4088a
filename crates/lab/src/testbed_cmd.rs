//! `starfabric testbed up|down|status`: the netns testbed (crates/testbed) by hand.
//!
//! `up` builds the topology under the fixed prefix `sftb-`, starts the servers and the
//! platform, records everything in a state file, and returns, leaving it running; `down`
//! deletes what the state file lists (and any namespace left with the prefix). If `up`
//! fails or is interrupted half-way, it deletes what it made before exiting.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use testbed::baseline::{self, KernelMode};
use testbed::chains::{self, Toward};
use testbed::cleanup::{self, Record};
use testbed::platform::{self, PlatformSpec};
use testbed::topo::{addr, vni, Node};
use testbed::{services, Resources, Testbed, TopologySpec};

/// The namespace prefix of `testbed up`.
pub const PREFIX: &str = "sftb-";
const STATE_DIR: &str = "/run/starfabric-testbed";

fn state_file() -> PathBuf {
    Path::new(STATE_DIR).join("state.json")
}

#[derive(Subcommand)]
pub enum TestbedCmd {
    /// Build the topology, start the servers and the platform, and leave them running.
    Up(UpArgs),
    /// Delete everything `up` created.
    Down,
    /// Show what `up` created and whether it is running.
    Status,
    /// Crash one platform process of the running testbed (SIGKILL to the PID `up`
    /// recorded, checked against its start time): `fm`, `pp` or `sc-<i>`.
    Kill {
        /// `fm`, `pp` or `sc-<i>`.
        what: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum PlatformKind {
    /// starfabric: FM, three SC nodes and a PP node.
    Starfabric,
    /// The kernel in the PP namespace, routing only.
    KernelForward,
    /// The kernel in the PP namespace with nftables SNAT.
    KernelSnat,
    /// The kernel in the PP namespace with an nftables DNAT load balancer.
    KernelLb,
    /// Nothing in the PP namespace.
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ChainKind {
    /// SNAT to the tenant's pool address, toward the internet.
    Snat,
    /// FW (TCP 80 and 5201, UDP allowed; the rest denied) then SNAT.
    FwSnat,
    /// The load balancer: VIP 198.19.2.100:80 over the nginx backends.
    Lb,
}

#[derive(Args, Debug)]
pub struct UpArgs {
    /// VPCs (tenants), each with a client host; all use 198.19.1.0/24.
    #[arg(long, default_value_t = 2)]
    tenants: usize,
    /// nginx backends behind the service gateway.
    #[arg(long, default_value_t = 3)]
    backends: usize,
    /// What runs in the PP namespace.
    #[arg(long, value_enum, default_value_t = PlatformKind::Starfabric)]
    platform: PlatformKind,
    /// The chain every tenant gets (starfabric).
    #[arg(long, value_enum, default_value_t = ChainKind::Snat)]
    chain: ChainKind,
    /// Also start the STUN server on the internet host.
    #[arg(long)]
    stun: bool,
    /// SC nodes in the control namespace (FM forms groups of 3; the rest are spares
    /// for scale-out, `starfabric scale sc-out`, and for replacing a dead replica).
    #[arg(long, default_value_t = 3)]
    sc_nodes: usize,
    /// Also start a standby FM (198.18.4.2:7001) and give the PP and SC nodes both FM
    /// addresses: `testbed kill fm` then makes them fail over to it.
    #[arg(long)]
    standby_fm: bool,
    /// More arguments for the PP node (starfabric), after the platform's own, e.g.
    /// `--pp-arg=--io=udp` for the UDP-socket backend instead of AF_XDP.
    #[arg(long = "pp-arg", allow_hyphen_values = true)]
    pp_args: Vec<String>,
}

pub fn run(c: TestbedCmd) -> Result<()> {
    match c {
        TestbedCmd::Up(a) => up(a),
        TestbedCmd::Down => down(),
        TestbedCmd::Status => status(),
        TestbedCmd::Kill { what } => kill(&what),
    }
}

/// The chain of tenant `j` (tenant id j+1, chain 1).
pub fn tenant_chain(kind: ChainKind, j: usize, backends: usize) -> Result<proto::ChainDef> {
    use nfs::fw::{AclAction, AclProto};
    let t = j as u32 + 1;
    Ok(match kind {
        ChainKind::Snat => chains::chain(t, 1, j, Toward::Internet, &[chains::snat(j)])?,
        ChainKind::Lb => chains::chain(t, 1, j, Toward::Services, &[chains::lb(backends)])?,
        ChainKind::FwSnat => chains::chain(
            t,
            1,
            j,
            Toward::Internet,
            &[
                chains::fw(
                    t,
                    vec![
                        chains::acl(AclAction::Allow, AclProto::Tcp, services::HTTP_PORT),
                        chains::acl(AclAction::Allow, AclProto::Tcp, services::IPERF_PORT),
                        nfs::fw::AclRule {
                            proto: AclProto::Udp,
                            ..nfs::fw::AclRule::new(AclAction::Allow)
                        },
                    ],
                    AclAction::Deny,
                ),
                chains::snat(j),
            ],
        )?,
    })
}

/// Ready this process for a bench on a testbed of its own: cleanup on signals, the
/// tools checked, and what killed runs under `root` left swept. The run's name prefix
/// and its resources, which delete everything when dropped (also on an error).
pub(crate) fn testbed_run(root: &str) -> Result<(String, std::sync::Arc<Resources>)> {
    testbed::install_signal_cleanup()?;
    testbed::check_prerequisites()?;
    testbed::sweep_stale(root);
    let prefix = format!("{root}{}-", std::process::id());
    let res = Resources::new(&prefix);
    Ok((prefix, res))
}

fn up(a: UpArgs) -> Result<()> {
    testbed::install_signal_cleanup()?;
    testbed::check_prerequisites()?;
    if state_file().exists() {
        bail!(
            "a testbed is up ({}): `starfabric testbed down` first",
            state_file().display()
        );
    }
    if a.platform == PlatformKind::KernelLb && a.backends == 0 {
        bail!("--platform kernel-lb needs --backends > 0");
    }
    if a.platform != PlatformKind::Starfabric && !a.pp_args.is_empty() {
        bail!("--pp-arg is for the starfabric PP node (--platform starfabric)");
    }
    std::fs::create_dir_all(STATE_DIR).with_context(|| STATE_DIR.to_string())?;
    let res = Resources::with_state_file(PREFIX, state_file());
    let mut spec = TopologySpec::new(PREFIX)
        .tenants(a.tenants)
        .backends(a.backends);
    spec.dir = Some(Path::new(STATE_DIR).join("run"));
    // On any error below, `res` is dropped and deletes what was made.
    let tb = Testbed::build(spec, res.clone())?;
    services::start_inet(&tb, a.stun)?;
    services::start_backends(&tb)?;
    match a.platform {
        PlatformKind::Starfabric => {
            let chains = (0..a.tenants)
                .map(|j| tenant_chain(a.chain, j, a.backends))
                .collect::<Result<Vec<_>>>()?;
            let vpcs = (0..a.tenants)
                .map(|j| (vni::tenant(j), j as u32 + 1, 1))
                .collect();
            let bin = std::env::current_exe()?;
            let mut spec = PlatformSpec::new(chains, vpcs);
            spec.sc_nodes = a.sc_nodes;
            spec.standby_fm = a.standby_fm;
            spec.pp_args.extend(a.pp_args.iter().cloned());
            let p = platform::start_starfabric(&tb, &bin, &spec)?;
            if let Some((s, addr)) = &p.standby {
                println!("starfabric: standby FM on {addr}, log {}", s.log.display());
            }
            println!(
                "starfabric: FM {} ({} SC nodes), PP log {}",
                p.fm.log.display(),
                a.sc_nodes,
                p.pp.log.display()
            );
            println!(
                "scale: ip netns exec {} {} scale sc-out --fm {} {} --tenant 1 --chain 1",
                tb.ns(Node::Ctl),
                bin.display(),
                p.fm_addr,
                p.operator_args().join(" ")
            );
        }
        PlatformKind::KernelForward => drop(baseline::start_kernel(&tb, KernelMode::Forward)?),
        PlatformKind::KernelSnat => drop(baseline::start_kernel(&tb, KernelMode::Snat)?),
        PlatformKind::KernelLb => drop(baseline::start_kernel(&tb, KernelMode::DnatLb)?),
        PlatformKind::None => {}
    }
    // Everything is up: leave it running, recorded in the state file.
    res.keep();
    println!(
        "testbed up: {} namespaces, state in {}",
        tb.nodes().len(),
        state_file().display()
    );
    for n in tb.nodes() {
        println!("  {}", tb.ns(n));
    }
    println!(
        "try:\n  ip netns exec {} curl -s http://{}/\n  ip netns exec {} iperf3 -c {} -t 3\n  \
         ip netns exec {} curl -s http://{}/   (with --chain lb)\n  starfabric testbed down",
        tb.ns(Node::Client(0)),
        addr::INET,
        tb.ns(Node::Client(0)),
        addr::INET,
        tb.ns(Node::Client(0)),
        addr::VIP,
    );
    Ok(())
}

fn read_state() -> Result<Option<Record>> {
    match std::fs::read_to_string(state_file()) {
        Ok(t) => Ok(Some(serde_json::from_str(&t).context("state file")?)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).context(state_file().display().to_string()),
    }
}

fn down() -> Result<()> {
    if !testbed::is_root() {
        bail!(testbed::Error::NotRoot);
    }
    let mut rec = read_state()?.unwrap_or_default();
    // Namespaces with the fixed prefix that the state file does not list (a state file
    // lost with /run): ours by name.
    for ns in cleanup::namespaces_with_prefix(PREFIX) {
        if !rec.namespaces.contains(&ns) {
            rec.namespaces.push(ns);
        }
    }
    let (n, p) = (rec.namespaces.len(), rec.processes.len());
    cleanup::cleanup_record(&rec);
    let _ = std::fs::remove_file(state_file());
    let left = cleanup::namespaces_with_prefix(PREFIX);
    if !left.is_empty() {
        bail!("namespaces still there: {left:?}");
    }
    println!("testbed down: {n} namespaces and up to {p} processes removed");
    Ok(())
}

/// The `what` a process of `up` was recorded under, for `kill`'s names.
fn recorded_name(what: &str) -> Result<String> {
    Ok(match what {
        "fm" => "starfabric fm".into(),
        "fm-standby" => "starfabric fm standby".into(),
        "pp" => "starfabric pp".into(),
        w if w
            .strip_prefix("sc-")
            .is_some_and(|i| i.parse::<usize>().is_ok()) =>
        {
            format!("starfabric {w}")
        }
        w => bail!("cannot kill {w:?}: name fm, fm-standby, pp or sc-<i>"),
    })
}

fn kill(what: &str) -> Result<()> {
    if !testbed::is_root() {
        bail!(testbed::Error::NotRoot);
    }
    let name = recorded_name(what)?;
    let Some(mut rec) = read_state()? else {
        bail!(
            "no testbed is up ({} does not exist)",
            state_file().display()
        );
    };
    let p = rec
        .processes
        .iter()
        .find(|p| p.what == name)
        .cloned()
        .with_context(|| format!("the testbed has no process {name:?}"))?;
    // The recorded start time tells our process from another that got its PID since.
    if cleanup::start_time(p.pid) != Some(p.start_time) {
        bail!("{name} (pid {}) is not running", p.pid);
    }
    // SAFETY: kill(2) on a PID this testbed recorded, checked above to be the same
    // process (its start time); SIGKILL, because the point is a crash.
    if unsafe { libc::kill(p.pid, libc::SIGKILL) } != 0 {
        bail!("kill {}: {}", p.pid, std::io::Error::last_os_error());
    }
    rec.processes.retain(|x| x.pid != p.pid);
    let tmp = state_file().with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(&rec)?)?;
    std::fs::rename(&tmp, state_file())?;
    tracing::info!(pid = p.pid, %name, "killed");
    println!("killed {name} (pid {})", p.pid);
    Ok(())
}

fn status() -> Result<()> {
    let Some(rec) = read_state()? else {
        println!(
            "no testbed is up ({} does not exist)",
            state_file().display()
        );
        let stray = cleanup::namespaces_with_prefix(PREFIX);
        if !stray.is_empty() {
            println!("but namespaces with prefix {PREFIX} exist: {stray:?} (`testbed down` deletes them)");
        }
        return Ok(());
    };
    println!("testbed up (state {}):", state_file().display());
    for ns in &rec.namespaces {
        let ok = Path::new("/run/netns").join(ns).exists();
        println!(
            "  netns {ns:<16} {}",
            if ok { "present" } else { "MISSING" }
        );
    }
    for p in &rec.processes {
        let ok = cleanup::start_time(p.pid) == Some(p.start_time);
        println!(
            "  pid {:<8} {:<24} {}",
            p.pid,
            p.what,
            if ok { "running" } else { "gone" }
        );
    }
    let pp_log = Path::new(STATE_DIR).join("run").join("starfabric-pp.log");
    if let Ok(t) = std::fs::read_to_string(&pp_log) {
        if let Some(l) = t.lines().rev().find(|l| l.starts_with("pp: t=")) {
            println!("  {l}");
        }
    }
    Ok(())
}
