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
}

impl PlatformSpec {
    pub fn new(chains: Vec<ChainDef>, vpcs: Vec<(u32, u32, u32)>) -> Self {
        PlatformSpec {
            chains,
            vpcs,
            sc_nodes: 3,
            flows: 1 << 18,
            pp_args: Vec::new(),
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
}

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

    /// Stop the PP node, the SC nodes and FM (in that order), leaving the topology.
    pub fn stop(self, tb: &Testbed) {
        tb.stop(&self.pp);
        for s in &self.scs {
            tb.stop(s);
        }
        tb.stop(&self.fm);
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
    let limit = Duration::from_secs(20);
    let listen = SocketAddrV4::new(addr::CTL, 0).to_string();
    let mut scs = Vec::new();
    for i in 0..spec.sc_nodes {
        let id = format!("sc-{i}");
        let p = tb.spawn(
            Node::Ctl,
            &format!("starfabric {id}"),
            &[
                &bin, "sc", "--fm", &fm_addr, "--listen", &listen, "--id", &id,
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
        &fm_addr,
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
