//! Starting starfabric inside the testbed: an FM and an SC group in the control
//! namespace, a PP node in the PP namespace, configured by an FM configuration file.
//!
//! [`start_starfabric`] is the one place that knows how the platform is started, so
//! that switching to the orchestrator (`starfabric up`) later touches only it.

use std::net::SocketAddrV4;
use std::path::{Path, PathBuf};
use std::time::Duration;

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
    /// Also start a standby FM (same configuration, [`STANDBY_FM_PORT`]) and give the PP
    /// and SC nodes both addresses, so they fail over to it when the first FM dies.
    pub standby_fm: bool,
}

impl PlatformSpec {
    pub fn new(chains: Vec<ChainDef>, vpcs: Vec<(u32, u32, u32)>) -> Self {
        PlatformSpec {
            chains,
            vpcs,
            sc_nodes: 3,
            flows: 1 << 18,
            pp_args: Vec::new(),
            standby_fm: false,
        }
    }

    /// Add arguments for `starfabric pp`.
    pub fn pp_args(mut self, args: &[&str]) -> Self {
        self.pp_args.extend(args.iter().map(|s| s.to_string()));
        self
    }
}

/// A running starfabric.
pub struct Platform {
    pub fm: Proc,
    /// SC node `i` runs with `--id sc-<i>` (the node id FM's partition map names).
    pub scs: Vec<Proc>,
    pub pp: Proc,
    pub fm_config: PathBuf,
    /// FM's gRPC address, inside the control namespace.
    pub fm_addr: String,
    /// The `starfabric` binary everything runs from (to restart FM).
    pub bin: PathBuf,
    /// The standby FM and its address, with [`PlatformSpec::standby_fm`] (after
    /// [`Platform::promote_standby`], the FM that died).
    pub standby: Option<(Proc, String)>,
}

/// Where the standby FM listens, in the control namespace beside the first.
pub const STANDBY_FM_PORT: u16 = 7001;

impl Platform {
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
        self.fm = spawn_fm(tb, &self.bin, &self.fm_addr, &self.fm_config, "restarted")?;
        Ok(())
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

fn last_line(p: &Path, prefix: &str) -> String {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .rev()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_default()
        .to_string()
}

/// A `key=value` field of a status line.
pub fn field(line: &str, key: &str) -> Option<u64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
}

/// Start starfabric in `tb` from the `starfabric` binary `bin`: FM with `spec`'s chains,
/// `spec.sc_nodes` SC nodes, and the PP node with `spec`'s VPC bindings. Returns once FM
/// has formed a group for every chain and the PP node is connected.
pub fn start_starfabric(tb: &Testbed, bin: &Path, spec: &PlatformSpec) -> Result<Platform> {
    let cfg = serde_json::json!({
        "replicas": 3,
        "chains": spec.chains,
    });
    let fm_config = tb.path("fm.json");
    std::fs::write(
        &fm_config,
        serde_json::to_string_pretty(&cfg).unwrap_or_default(),
    )
    .map_err(|e| Error::io(fm_config.display().to_string(), e))?;
    let bin_path = bin.to_path_buf();
    let bin = bin.display().to_string();
    let fm_addr = SocketAddrV4::new(addr::CTL, addr::FM_PORT).to_string();
    let fm = spawn_fm(tb, &bin_path, &fm_addr, &fm_config, "")?;
    let standby = spec
        .standby_fm
        .then(|| spawn_standby_fm(tb, &bin_path, &fm_config))
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
        let p = tb.spawn(
            Node::Ctl,
            &format!("starfabric {id}"),
            &[
                &bin, "sc", "--fm", &fm_list, "--listen", &listen, "--id", &id,
            ],
        )?;
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
        "--id",
        "pp-0",
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
    argv.extend(spec.pp_args.iter().cloned());
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let pp = tb.spawn(Node::Pp, "starfabric pp", &argv)?;
    tb.wait_log(&pp, "pp: listening", limit)?;
    let platform = Platform {
        fm,
        scs,
        pp,
        fm_config,
        fm_addr: fm_addr.clone(),
        bin: bin_path,
        standby,
    };
    let want = spec.chains.len() as u64;
    let nsc = spec.sc_nodes as u64;
    cmd::wait_for("FM: SC groups and the PP session", limit, || {
        let s = platform.fm_status();
        Ok((field(&s, "groups") == Some(want)
            && field(&s, "sc") == Some(nsc)
            && field(&s, "pp") == Some(1))
        .then_some(()))
    })?;
    info!(chains = want, "starfabric up");
    Ok(platform)
}

/// Start FM in the control namespace and wait until it listens. `tag` tells a
/// restarted FM's log from the first one's (the first is kept for the post-mortem).
fn spawn_fm(tb: &Testbed, bin: &Path, fm_addr: &str, config: &Path, tag: &str) -> Result<Proc> {
    let bin = bin.display().to_string();
    let conf = config.display().to_string();
    let what = if tag.is_empty() {
        "starfabric fm".to_string()
    } else {
        format!("starfabric fm {tag}")
    };
    let fm = tb.spawn(
        Node::Ctl,
        &what,
        &[
            &bin,
            "fm",
            "--listen",
            fm_addr,
            "--config",
            &conf,
            "--stats-interval",
            "0.2",
        ],
    )?;
    tb.wait_log(&fm, "fm: listening", Duration::from_secs(20))?;
    Ok(fm)
}

/// Start the standby FM: the same configuration as the first, on [`STANDBY_FM_PORT`] of
/// the control namespace, with a status line every 50 ms (a failover is timed by it).
/// It has no members until the nodes fail over to it.
fn spawn_standby_fm(tb: &Testbed, bin: &Path, config: &Path) -> Result<(Proc, String)> {
    let addr = SocketAddrV4::new(addr::CTL, STANDBY_FM_PORT).to_string();
    let bin = bin.display().to_string();
    let conf = config.display().to_string();
    let fm = tb.spawn(
        Node::Ctl,
        "starfabric fm standby",
        &[
            &bin,
            "fm",
            "--listen",
            &addr,
            "--config",
            &conf,
            "--id",
            "fm-standby",
            "--stats-interval",
            "0.05",
        ],
    )?;
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
    }
}
