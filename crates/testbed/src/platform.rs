//! Starting starfabric inside the testbed: an FM and an SC group in the control
//! namespace, a PP node in the PP namespace, configured by an FM configuration file.
//!
//! [`start_starfabric`] is the one place that knows how the platform is started, so
//! that switching to the orchestrator (`starfabric up`) later touches only it.

use std::collections::BTreeMap;
use std::net::SocketAddrV4;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use proto::tls::{Bundle, Ca, Identity, Role};
use proto::ChainDef;
use tracing::info;

use crate::cmd;
use crate::topo::{addr, Node, Proc, Testbed};
use crate::{Error, Result};

/// What to run.
#[derive(Debug, Clone)]
pub struct PlatformSpec {
    pub chains: Vec<ChainDef>,
    /// VNI → (tenant, chain) bindings of the PP node.
    pub vpcs: Vec<(u32, u32, u32)>,
    /// SC nodes (FM forms groups of 3 replicas).
    pub sc_nodes: usize,
    /// PP `--flows`.
    pub flows: usize,
    /// More arguments for `starfabric pp`, e.g. `--io udp` (the default is `--io auto`,
    /// which takes AF_XDP on the PP node's veth).
    pub pp_args: Vec<String>,
    /// Cluster mode: more arguments for PP node `i` only, after `pp_args` (e.g.
    /// `--offload` on one node: a plain and an accelerated node in one cluster, for live
    /// migration between them). Every start of that node gets them.
    pub pp_node_args: Vec<(usize, Vec<String>)>,
    /// PP cluster mode (the topology has `pp_nodes` > 0): how many PP nodes to start;
    /// the other namespaces are spares for scale-out.
    pub pp_active: usize,
    /// Also start a standby FM (same configuration, [`STANDBY_FM_PORT`]) and give the PP
    /// and SC nodes both addresses, so they fail over to it when the first FM dies.
    pub standby_fm: bool,
    /// More arguments for every `starfabric sc`, e.g. `--idle-ms 300`.
    pub sc_args: Vec<String>,
    /// Give SC node `i` a metrics endpoint on [`SC_METRICS_PORT`] + `i` of the control
    /// namespace ([`Platform::sc_metrics`]).
    pub sc_metrics: bool,
    /// Plaintext plane links (`--insecure`). Off by default: every node gets a
    /// certificate of the run's own CA, as under `starfabric up`.
    pub insecure: bool,
    /// Cluster mode: chains split over the PP fabric, (tenant, chain, the PP node ids
    /// serving its egress stage), FM's `fabric` configuration (docs/fabric.md).
    pub fabric: Vec<(u32, u32, Vec<String>)>,
    /// FM's `cache_capacity` (rules it keeps), or FM's default. A small cache makes a
    /// flow whose PP rule is gone ask SC again instead of FM answering from its cache.
    pub fm_cache_capacity: Option<usize>,
}

/// SC node `i`'s metrics port with [`PlatformSpec::sc_metrics`]: this + `i`.
pub const SC_METRICS_PORT: u16 = 9300;

impl PlatformSpec {
    pub fn new(chains: Vec<ChainDef>, vpcs: Vec<(u32, u32, u32)>) -> Self {
        PlatformSpec {
            chains,
            vpcs,
            sc_nodes: 3,
            flows: 1 << 18,
            pp_args: Vec::new(),
            pp_node_args: Vec::new(),
            pp_active: 1,
            standby_fm: false,
            sc_args: Vec::new(),
            sc_metrics: false,
            insecure: false,
            fabric: Vec::new(),
            fm_cache_capacity: None,
        }
    }

    /// Add arguments for `starfabric pp`.
    pub fn pp_args(mut self, args: &[&str]) -> Self {
        self.pp_args.extend(args.iter().map(|s| s.to_string()));
        self
    }

    /// Add arguments for PP node `i` only (cluster mode).
    pub fn pp_node_args(mut self, i: usize, args: &[&str]) -> Self {
        self.pp_node_args
            .push((i, args.iter().map(|s| s.to_string()).collect()));
        self
    }
}

/// The run's certificates: a CA made for this testbed and a `--tls-dir` per node under
/// the testbed's directory. `starfabric up` has each node join through the
/// orchestrator's API with a token; the directly started platform runs no
/// orchestrator, so the testbed plays the CA, as an operator's provisioning would.
pub struct Certs {
    ca: Ca,
    root: PathBuf,
}

/// How long the testbed's certificates live: longer than any run.
const CERT_TTL: Duration = Duration::from_secs(24 * 3600);

impl Certs {
    fn new(tb: &Testbed) -> Result<Self> {
        let ca = Ca::generate().map_err(|e| Error::Setup(format!("testbed CA: {e}")))?;
        Ok(Certs {
            ca,
            root: tb.path("tls"),
        })
    }

    /// Node `id`'s certificate directory, issued on first use (a restarted node keeps
    /// its certificate, as a real one keeps its `--tls-dir`).
    pub fn dir(&self, role: Role, id: &str) -> Result<PathBuf> {
        let dir = self.root.join(id);
        if !dir.join("node.pem").exists() {
            let me = Identity::new(role, id).map_err(|e| Error::Setup(e.to_string()))?;
            Bundle::issue(&self.ca, &me, CERT_TTL)
                .and_then(|b| b.write_dir(&dir))
                .map_err(|e| Error::Setup(format!("certificate of {me}: {e}")))?;
        }
        Ok(dir)
    }
}

/// This process's CPUs (its affinity mask, which the nodes it spawns inherit) turned
/// left by `by`, as a `--worker-cpus` list: node `i` of several on this host takes turn
/// `i` (sc's `workers::rotated`; the testbed does not link the SC crate for it).
/// None if the kernel will not say.
fn rotated_cpu_list(by: usize) -> Option<String> {
    // SAFETY: cpu_set_t is a plain bit array that sched_getaffinity fills; zeroed is the
    // empty set, and CPU_ISSET only reads inside it (indices below CPU_SETSIZE).
    let mut cpus: Vec<usize> = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    };
    if cpus.is_empty() {
        return None;
    }
    let k = by % cpus.len();
    cpus.rotate_left(k);
    Some(
        cpus.iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(","),
    )
}

/// The plane-security arguments of node `id`: its `--tls-dir`, or `--insecure`.
fn security(certs: Option<&Certs>, role: Role, id: &str) -> Result<Vec<String>> {
    Ok(match certs {
        Some(c) => vec!["--tls-dir".into(), c.dir(role, id)?.display().to_string()],
        None => vec!["--insecure".into()],
    })
}

/// A running starfabric.
pub struct Platform {
    pub fm: Proc,
    /// SC node `i` runs with `--id sc-<i>` (the node id FM's partition map names).
    pub scs: Vec<Proc>,
    /// The PP node (cluster mode: PP node 0).
    pub pp: Proc,
    /// Cluster mode: PP node `i`'s process, if started (`pps[0]` is `pp`).
    pub pps: Vec<Option<Proc>>,
    /// `starfabric pp` arguments common to every PP node (cluster mode).
    pp_argv: Vec<String>,
    /// More arguments of PP node `i` ([`PlatformSpec::pp_node_args`]).
    pp_node_argv: BTreeMap<usize, Vec<String>>,
    pub fm_config: PathBuf,
    /// FM's gRPC address, inside the control namespace.
    pub fm_addr: String,
    /// The `starfabric` binary everything runs from (to restart FM).
    pub bin: PathBuf,
    /// The standby FM and its address, with [`PlatformSpec::standby_fm`] (after
    /// [`Platform::promote_standby`], the FM that died).
    pub standby: Option<(Proc, String)>,
    /// The nodes' certificates (`None`: [`PlatformSpec::insecure`]).
    pub certs: Option<Arc<Certs>>,
}

/// Where the standby FM listens, in the control namespace beside the first.
pub const STANDBY_FM_PORT: u16 = 7001;

impl Platform {
    /// SC node `i`'s metrics address (`host:port` in the control namespace), with
    /// [`PlatformSpec::sc_metrics`].
    pub fn sc_metrics(&self, i: usize) -> String {
        SocketAddrV4::new(addr::CTL, SC_METRICS_PORT + i as u16).to_string()
    }

    /// The PP node's last stats line (`pp: t=.. rx=.. tx=.. hits=.. misses=.. drops=..`).
    pub fn pp_stats(&self) -> String {
        std::fs::read_to_string(&self.pp.log)
            .unwrap_or_default()
            .lines()
            .rev()
            .find(|l| l.starts_with("pp: t="))
            .unwrap_or_default()
            .to_string()
    }

    /// The PP node's stats line once `ok` holds for it (it prints one a second), or the
    /// last one after 5 s (for the caller's assertion to show).
    pub fn pp_stats_when(&self, ok: impl Fn(&str) -> bool) -> String {
        let end = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let s = self.pp_stats();
            if ok(&s) || std::time::Instant::now() > end {
                return s;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The PP node's `pp: listening on ...` line, which names its I/O backend
    /// (`io afxdp (...)` or `io udp`).
    pub fn pp_listening(&self) -> String {
        last_line(&self.pp.log, "pp: listening on ")
    }

    /// The PP node's I/O backend: `afxdp` or `udp` (from its listening line).
    pub fn pp_io(&self) -> Option<&'static str> {
        let l = self.pp_listening();
        if l.contains(", io afxdp") {
            Some("afxdp")
        } else if l.contains(", io udp") {
            Some("udp")
        } else {
            None
        }
    }

    /// The FM's last status line.
    pub fn fm_status(&self) -> String {
        last_line(&self.fm.log, "fm: t=")
    }

    /// Every status line FM has printed so far, oldest first (a history of its
    /// counters at its `--stats-interval`).
    pub fn fm_status_lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.fm.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("fm: t="))
            .map(str::to_string)
            .collect()
    }

    /// The process of SC node `id` (`sc-<i>`).
    pub fn sc(&self, id: &str) -> Option<&Proc> {
        let i: usize = id.strip_prefix("sc-")?.parse().ok()?;
        self.scs.get(i)
    }

    /// Crash SC node `id` (SIGKILL to its own recorded PID).
    pub fn kill_sc(&self, tb: &Testbed, id: &str) -> Result<()> {
        let p = self
            .sc(id)
            .ok_or_else(|| Error::Setup(format!("no SC node {id}")))?;
        info!(id, pid = p.pid, "killing SC node");
        tb.kill(p)
    }

    /// Crash FM (SIGKILL). The PP and SC nodes keep reconnecting until it is back.
    pub fn kill_fm(&self, tb: &Testbed) -> Result<()> {
        info!(pid = self.fm.pid, "killing FM");
        tb.kill(&self.fm)
    }

    /// Start FM again (after [`Platform::kill_fm`]) from the same configuration, on the
    /// same address; returns once it listens. A new FM starts with no state: it forms
    /// the groups again as the SC nodes reconnect.
    pub fn restart_fm(&mut self, tb: &Testbed) -> Result<()> {
        if tb.running(&self.fm) {
            return Err(Error::Setup("FM is still running".into()));
        }
        self.fm = spawn_fm(
            tb,
            &self.bin,
            &self.fm_addr,
            &self.fm_config,
            "restarted",
            self.certs.as_deref(),
        )?;
        Ok(())
    }

    /// Cluster mode: start PP node `i` (`--id pp-<i>`) in its namespace; returns once it
    /// listens (FM then gives it a share of the vIPs).
    pub fn start_pp(&mut self, tb: &Testbed, i: usize) -> Result<&Proc> {
        if i >= self.pps.len() {
            return Err(Error::Setup(format!(
                "no PP node namespace {i} (the topology has {})",
                self.pps.len()
            )));
        }
        if self.pps[i].as_ref().is_some_and(|p| tb.running(p)) {
            return Err(Error::Setup(format!("PP node {i} is running")));
        }
        let p = spawn_pp(
            tb,
            i,
            &self.node_argv(i),
            if self.pps[i].is_some() { "again" } else { "" },
            self.certs.as_deref(),
        )?;
        if i == 0 {
            self.pp = p.clone();
        }
        self.pps[i] = Some(p);
        Ok(self.pps[i].as_ref().expect("just set"))
    }

    /// Cluster mode: the command that starts PP node `i` (`--id pp-<i>`) in its own
    /// namespace from any other, for a node provider's pool (the autoscaler starts the
    /// node, not this platform).
    pub fn pp_slot_argv(&self, tb: &Testbed, i: usize) -> Result<Vec<String>> {
        if i >= self.pps.len() {
            return Err(Error::Setup(format!(
                "no PP node namespace {i} (the topology has {})",
                self.pps.len()
            )));
        }
        let ip = cmd::which("ip").unwrap_or_else(|| PathBuf::from("ip"));
        let mut argv = vec![
            ip.display().to_string(),
            "netns".into(),
            "exec".into(),
            tb.ns(Node::pp(i)),
        ];
        argv.extend(self.node_argv(i));
        let id = format!("pp-{i}");
        argv.extend(security(self.certs.as_deref(), Role::Pp, &id)?);
        argv.extend(["--id".into(), id]);
        Ok(argv)
    }

    /// PP node `i`'s `starfabric pp` command line: the common one, then its own
    /// arguments.
    fn node_argv(&self, i: usize) -> Vec<String> {
        let mut argv = self.pp_argv.clone();
        argv.extend(self.pp_node_argv.get(&i).into_iter().flatten().cloned());
        argv
    }

    /// Cluster mode: replace PP node `i`'s own arguments for its next start (e.g. a
    /// spare restarted accelerated, with `--offload`).
    pub fn set_pp_node_args(&mut self, i: usize, args: &[&str]) {
        self.pp_node_argv
            .insert(i, args.iter().map(|s| s.to_string()).collect());
    }

    /// Cluster mode: PP node `i`'s last stats line.
    pub fn pp_node_stats(&self, i: usize) -> String {
        self.pp_node(i)
            .map(|p| last_line(&p.log, "pp: t="))
            .unwrap_or_default()
    }

    /// Cluster mode: PP node `i`'s process.
    pub fn pp_node(&self, i: usize) -> Option<&Proc> {
        self.pps.get(i).and_then(|p| p.as_ref())
    }

    /// Crash PP node `i` (SIGKILL to its recorded PID).
    pub fn kill_pp(&self, tb: &Testbed, i: usize) -> Result<()> {
        let p = self
            .pp_node(i)
            .ok_or_else(|| Error::Setup(format!("PP node {i} was not started")))?;
        info!(i, pid = p.pid, "killing PP node");
        tb.kill(p)
    }

    /// Stop PP node `i` (SIGTERM, then SIGKILL if it lingers).
    pub fn stop_pp(&self, tb: &Testbed, i: usize) {
        if let Some(p) = self.pp_node(i) {
            tb.stop(p);
        }
    }

    /// How the operator tools (`starfabric scale`, `events`, `autoscale`) reach FM: the
    /// run's operator certificate (`--tls-dir`), or `--insecure`.
    pub fn operator_args(&self) -> Vec<String> {
        // Issued with the platform, so this cannot fail here.
        security(self.certs.as_deref(), Role::Operator, "operator").unwrap_or_default()
    }

    /// `starfabric autoscale --fm FM FLAGS…` with the operator's credentials, in the
    /// control namespace, once it says it is watching.
    pub fn autoscaler(&self, tb: &Testbed, what: &str, flags: &[&str]) -> Result<Proc> {
        let bin = self.bin.display().to_string();
        let op = self.operator_args();
        let mut argv = vec![bin.as_str(), "autoscale", "--fm", &self.fm_addr];
        argv.extend(flags);
        argv.extend(op.iter().map(String::as_str));
        let scaler = tb.spawn(Node::Ctl, what, &argv)?;
        tb.wait_log(&scaler, "autoscale: watching", Duration::from_secs(10))?;
        Ok(scaler)
    }

    /// FM's event log (`starfabric events -o json`, in the control namespace), one
    /// object per line.
    pub fn events(&self, tb: &Testbed) -> Result<Vec<serde_json::Value>> {
        let bin = self.bin.display().to_string();
        let op = self.operator_args();
        let mut argv = vec![bin.as_str(), "events", "--fm", &self.fm_addr];
        argv.extend(op.iter().map(String::as_str));
        argv.extend(["-o", "json"]);
        let out = tb.exec(Node::Ctl, &argv, Duration::from_secs(10))?;
        (out.lines())
            .map(|l| {
                serde_json::from_str(l).map_err(|e| Error::Parse {
                    what: "starfabric events".into(),
                    msg: format!("{e}: {l}"),
                })
            })
            .collect()
    }

    /// FM's vIP table (`starfabric scale vips -o json`, run in the control namespace).
    pub fn vip_map(&self, tb: &Testbed) -> Result<VipMap> {
        let bin = self.bin.display().to_string();
        let op = self.operator_args();
        let mut argv = vec![bin.as_str(), "scale", "vips", "--fm", &self.fm_addr];
        argv.extend(op.iter().map(String::as_str));
        argv.extend(["-o", "json"]);
        let out = tb.exec(Node::Ctl, &argv, Duration::from_secs(10))?;
        serde_json::from_str(&out).map_err(|e| Error::Parse {
            what: "starfabric scale vips".into(),
            msg: format!("{e}: {out}"),
        })
    }

    /// PP scale-in's first step: FM moves every vIP of `pp-<i>` to the other nodes.
    pub fn drain_pp(&self, tb: &Testbed, i: usize) -> Result<VipMap> {
        self.scale_vips(tb, "pp-drain", &["--node", &format!("pp-{i}")])
    }

    /// Live migration's operator step: FM moves every vIP of `pp-<from>` to `pp-<to>`
    /// (`starfabric scale vip-move --from pp-<from> --to pp-<to>`, one FM session for
    /// all of them). Returns FM's table after the last move.
    pub fn move_vips(&self, tb: &Testbed, from: usize, to: usize) -> Result<VipMap> {
        let (from, to) = (format!("pp-{from}"), format!("pp-{to}"));
        self.scale_vips(
            tb,
            "vip-move",
            &["--from", &from, "--to", &to, "--reason", "live migration"],
        )
    }

    /// `starfabric scale CMD --fm FM ARGS` as the operator, in the control namespace;
    /// FM's vIP table from its JSON answer.
    fn scale_vips(&self, tb: &Testbed, cmd: &str, args: &[&str]) -> Result<VipMap> {
        let bin = self.bin.display().to_string();
        let op = self.operator_args();
        let mut argv = vec![bin.as_str(), "scale", cmd, "--fm", &self.fm_addr];
        argv.extend_from_slice(args);
        argv.extend(op.iter().map(String::as_str));
        argv.extend(["-o", "json"]);
        let out = tb.exec(Node::Ctl, &argv, Duration::from_secs(10))?;
        serde_json::from_str(&out).map_err(|e| Error::Parse {
            what: format!("starfabric scale {cmd}"),
            msg: format!("{e}: {out}"),
        })
    }

    /// PP nodes whose process runs (cluster mode: any of them; otherwise the one).
    pub fn pp_running(&self, tb: &Testbed) -> u64 {
        if self.pps.is_empty() {
            u64::from(tb.running(&self.pp))
        } else {
            self.pps.iter().flatten().filter(|p| tb.running(p)).count() as u64
        }
    }

    /// The standby FM's last status line (empty without one).
    pub fn standby_status(&self) -> String {
        self.standby
            .as_ref()
            .map(|(p, _)| last_line(&p.log, "fm: t="))
            .unwrap_or_default()
    }

    /// The FM address SC node `id` last said it is on (`sc: node ID on FM ADDR`).
    pub fn sc_fm(&self, id: &str) -> Option<String> {
        let p = self.sc(id)?;
        let l = last_line(&p.log, &format!("sc: node {id} on FM "));
        l.rsplit(' ')
            .next()
            .filter(|a| !a.is_empty())
            .map(String::from)
    }

    /// The FM address the PP node's last stats line names (`fm=ADDR`).
    pub fn pp_fm(&self) -> Option<String> {
        self.pp_stats()
            .split_whitespace()
            .find_map(|w| w.strip_prefix("fm="))
            .filter(|a| *a != "none")
            .map(String::from)
    }

    /// After the first FM died and the nodes failed over: make the standby the FM this
    /// platform's helpers talk to (status, counters, `scale` CLI); the dead one is kept
    /// as `standby` for the post-mortem.
    pub fn promote_standby(&mut self) -> Result<()> {
        let (p, addr) = self
            .standby
            .take()
            .ok_or_else(|| Error::Setup("no standby FM".into()))?;
        let old = std::mem::replace(&mut self.fm, p);
        let old_addr = std::mem::replace(&mut self.fm_addr, addr);
        self.standby = Some((old, old_addr));
        Ok(())
    }

    /// Stop the PP node, the SC nodes and FM (in that order), leaving the topology.
    pub fn stop(self, tb: &Testbed) {
        for p in self.pps.iter().skip(1).flatten() {
            tb.stop(p);
        }
        tb.stop(&self.pp);
        for s in &self.scs {
            tb.stop(s);
        }
        tb.stop(&self.fm);
        if let Some((p, _)) = &self.standby {
            tb.stop(p);
        }
    }
}

/// FM's vIP table, as `starfabric scale vips -o json` prints it.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct VipMap {
    pub epoch: u64,
    pub moves: u64,
    pub nodes: Vec<String>,
    pub draining: Vec<String>,
    pub vips: Vec<VipEntry>,
}

#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct VipEntry {
    pub index: u32,
    pub ip: String,
    pub mac: String,
    pub node: Option<String>,
}

impl VipMap {
    /// vIP indices owned by `node`.
    pub fn owned_by(&self, node: &str) -> Vec<u32> {
        self.vips
            .iter()
            .filter(|v| v.node.as_deref() == Some(node))
            .map(|v| v.index)
            .collect()
    }

    /// Every vIP has an owner.
    pub fn all_owned(&self) -> bool {
        !self.vips.is_empty() && self.vips.iter().all(|v| v.node.is_some())
    }
}

fn last_line(p: &Path, prefix: &str) -> String {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .rev()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_default()
        .to_string()
}

/// A `key=value` field of a status line, also inside the PP line's parenthesised drop
/// reasons (`drops=4 (no-rule=1 rate-limited=3)`).
pub fn field(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace()
        .map(|w| w.trim_start_matches('(').trim_end_matches(')'))
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}

/// Start starfabric in `tb` from the `starfabric` binary `bin`: FM with `spec`'s chains,
/// `spec.sc_nodes` SC nodes, and the PP node with `spec`'s VPC bindings. Returns once FM
/// has formed a group for every chain and the PP node is connected.
pub fn start_starfabric(tb: &Testbed, bin: &Path, spec: &PlatformSpec) -> Result<Platform> {
    let cluster = tb.spec.pp_nodes;
    let mut cfg = serde_json::json!({
        "replicas": 3,
        "chains": spec.chains,
    });
    if cluster > 0 {
        cfg["vips"] = (0..tb.spec.vips)
            .map(|k| serde_json::json!({"ip": addr::vip(k), "mac": crate::topo::mac::vip(k)}))
            .collect();
        if spec.pp_active == 0 || spec.pp_active > cluster {
            return Err(Error::Setup(format!(
                "pp_active must be in 1..={cluster} (the PP node namespaces)"
            )));
        }
    }
    if let Some(n) = spec.fm_cache_capacity {
        cfg["cache_capacity"] = n.into();
    }
    if !spec.fabric.is_empty() {
        if cluster == 0 {
            return Err(Error::Setup(
                "a fabric needs the PP cluster topology (its nodes reach each other on the switch)"
                    .into(),
            ));
        }
        cfg["fabric"] = spec
            .fabric
            .iter()
            .map(|(t, c, nodes)| serde_json::json!({"tenant": t, "chain": c, "nodes": nodes}))
            .collect();
    }
    let fm_config = tb.path("fm.json");
    std::fs::write(
        &fm_config,
        serde_json::to_string_pretty(&cfg).unwrap_or_default(),
    )
    .map_err(|e| Error::io(fm_config.display().to_string(), e))?;
    let certs = if spec.insecure {
        None
    } else {
        let c = Certs::new(tb)?;
        c.dir(Role::Operator, "operator")?;
        Some(Arc::new(c))
    };
    let bin_path = bin.to_path_buf();
    let bin = bin.display().to_string();
    let fm_addr = SocketAddrV4::new(addr::CTL, addr::FM_PORT).to_string();
    let fm = spawn_fm(tb, &bin_path, &fm_addr, &fm_config, "", certs.as_deref())?;
    let standby = spec
        .standby_fm
        .then(|| spawn_standby_fm(tb, &bin_path, &fm_config, certs.as_deref()))
        .transpose()?;
    // What the nodes are given: both FMs with a standby, the first first.
    let fm_list = match &standby {
        Some((_, a)) => format!("{fm_addr},{a}"),
        None => fm_addr.clone(),
    };
    let limit = Duration::from_secs(20);
    let listen = SocketAddrV4::new(addr::CTL, 0).to_string();
    let mut scs = Vec::new();
    for i in 0..spec.sc_nodes {
        let id = format!("sc-{i}");
        let metrics = SocketAddrV4::new(addr::CTL, SC_METRICS_PORT + i as u16).to_string();
        let sec = security(certs.as_deref(), Role::Sc, &id)?;
        let mut argv: Vec<&str> = vec![
            &bin, "sc", "--fm", &fm_list, "--listen", &listen, "--id", &id,
        ];
        argv.extend(sec.iter().map(String::as_str));
        if spec.sc_metrics {
            argv.extend(["--metrics", &metrics]);
        }
        // The SC nodes share this host: each takes the CPU list turned by its index,
        // so their first replicas do not all land on one CPU.
        let cpus = rotated_cpu_list(i);
        if !spec.sc_args.iter().any(|a| a.starts_with("--worker-cpus")) {
            if let Some(c) = &cpus {
                argv.extend(["--worker-cpus", c]);
            }
        }
        argv.extend(spec.sc_args.iter().map(String::as_str));
        let p = tb.spawn(Node::Ctl, &format!("starfabric {id}"), &argv)?;
        scs.push(p);
    }
    for p in &scs {
        tb.wait_log(p, "sc: node", limit)?;
    }
    let pp_listen = SocketAddrV4::new(addr::PP, 4789).to_string();
    let flows = spec.flows.to_string();
    let mut argv: Vec<String> = [
        bin.as_str(),
        "pp",
        "--listen",
        &pp_listen,
        "--fm",
        &fm_list,
        "--flows",
        &flows,
        "--stats-interval",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for (v, t, c) in &spec.vpcs {
        argv.push("--vpc".into());
        argv.push(format!("{v}={t}:{c}"));
    }
    if cluster > 0 {
        argv.push("--vip-group".into());
    }
    argv.extend(spec.pp_args.iter().cloned());
    // `starfabric pp` takes a worker per CPU by default; the testbed's figures (the
    // per-core rates above all) and its tests are for one worker unless they ask for
    // more.
    let names_workers = |a: &[String]| {
        a.iter()
            .any(|x| x == "--workers" || x.starts_with("--workers="))
    };
    if !names_workers(&spec.pp_args) && !spec.pp_node_args.iter().any(|(_, a)| names_workers(a)) {
        argv.extend(["--workers".to_string(), "1".to_string()]);
    }
    let mut pp_node_argv: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for (i, a) in &spec.pp_node_args {
        pp_node_argv
            .entry(*i)
            .or_default()
            .extend(a.iter().cloned());
    }
    let mut argv0 = argv.clone();
    argv0.extend(pp_node_argv.get(&0).into_iter().flatten().cloned());
    let pp = spawn_pp(tb, 0, &argv0, "", certs.as_deref())?;
    let mut pps = vec![None; cluster];
    if cluster > 0 {
        pps[0] = Some(pp.clone());
    }
    let mut platform = Platform {
        fm,
        scs,
        pp,
        pps,
        pp_argv: argv,
        pp_node_argv,
        fm_config,
        fm_addr: fm_addr.clone(),
        bin: bin_path,
        standby,
        certs,
    };
    for i in 1..spec.pp_active.min(cluster) {
        platform.start_pp(tb, i)?;
    }
    let want = spec.chains.len() as u64;
    let nsc = spec.sc_nodes as u64;
    let npp = spec.pp_active.max(1) as u64;
    cmd::wait_for("FM: SC groups and the PP sessions", limit, || {
        let s = platform.fm_status();
        Ok((field(&s, "groups") == Some(want)
            && field(&s, "sc") == Some(nsc)
            && field(&s, "pp") == Some(npp))
        .then_some(()))
    })?;
    if cluster > 0 {
        cmd::wait_for("FM: every vIP owned by a PP node", limit, || {
            let m = platform.vip_map(tb)?;
            Ok((m.all_owned() && m.nodes.len() as u64 == npp).then_some(()))
        })?;
    }
    info!(chains = want, "starfabric up");
    Ok(platform)
}

/// Start PP node `i` with the common `argv` plus its id and certificate; wait until
/// it listens.
fn spawn_pp(
    tb: &Testbed,
    i: usize,
    argv: &[String],
    tag: &str,
    certs: Option<&Certs>,
) -> Result<Proc> {
    let id = format!("pp-{i}");
    let sec = security(certs, Role::Pp, &id)?;
    let mut argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    argv.extend(sec.iter().map(String::as_str));
    argv.extend(["--id", &id]);
    let what = match (i, tag.is_empty()) {
        (0, true) => "starfabric pp".to_string(),
        (_, true) => format!("starfabric pp-{i}"),
        (_, false) => format!("starfabric pp-{i} {tag}"),
    };
    let p = tb.spawn(Node::pp(i), &what, &argv)?;
    tb.wait_log(&p, "pp: listening", Duration::from_secs(20))?;
    Ok(p)
}

/// Start FM in the control namespace and wait until it listens. `tag` tells a
/// restarted FM's log from the first one's (the first is kept for the post-mortem).
fn spawn_fm(
    tb: &Testbed,
    bin: &Path,
    fm_addr: &str,
    config: &Path,
    tag: &str,
    certs: Option<&Certs>,
) -> Result<Proc> {
    let sec = security(certs, Role::Fm, "fm-1")?;
    let bin = bin.display().to_string();
    let conf = config.display().to_string();
    let what = if tag.is_empty() {
        "starfabric fm".to_string()
    } else {
        format!("starfabric fm {tag}")
    };
    let mut argv = vec![
        bin.as_str(),
        "fm",
        "--listen",
        fm_addr,
        "--config",
        &conf,
        "--stats-interval",
        "0.2",
    ];
    argv.extend(sec.iter().map(String::as_str));
    let fm = tb.spawn(Node::Ctl, &what, &argv)?;
    tb.wait_log(&fm, "fm: listening", Duration::from_secs(20))?;
    Ok(fm)
}

/// Start the standby FM: the same configuration as the first, on [`STANDBY_FM_PORT`] of
/// the control namespace, with a status line every 50 ms (a failover is timed by it).
/// It has no members until the nodes fail over to it.
fn spawn_standby_fm(
    tb: &Testbed,
    bin: &Path,
    config: &Path,
    certs: Option<&Certs>,
) -> Result<(Proc, String)> {
    let sec = security(certs, Role::Fm, "fm-standby")?;
    let addr = SocketAddrV4::new(addr::CTL, STANDBY_FM_PORT).to_string();
    let bin = bin.display().to_string();
    let conf = config.display().to_string();
    let mut argv = vec![
        bin.as_str(),
        "fm",
        "--listen",
        &addr,
        "--config",
        &conf,
        "--id",
        "fm-standby",
        "--stats-interval",
        "0.05",
    ];
    argv.extend(sec.iter().map(String::as_str));
    let fm = tb.spawn(Node::Ctl, "starfabric fm standby", &argv)?;
    tb.wait_log(&fm, "fm: listening", Duration::from_secs(20))?;
    Ok((fm, addr))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_fields() {
        let l = "fm: t=1.0s pp=1 sc=3 groups=2 requests=10 cache_hits=0";
        assert_eq!(field(l, "pp"), Some(1));
        assert_eq!(field(l, "groups"), Some(2));
        assert_eq!(field(l, "sc"), Some(3));
        assert_eq!(field(l, "nope"), None);
        let pp = "pp: t=2.0s rx=9 tx=5 hits=4 misses=1 drops=4 (no-rule=1 rate-limited=3) io: x";
        assert_eq!(field(pp, "drops"), Some(4));
        assert_eq!(field(pp, "no-rule"), Some(1));
        assert_eq!(field(pp, "rate-limited"), Some(3));
    }
}
