//! Node providers (DESIGN.md "Orchestrator": "a node provider starts and stops nodes").
//!
//! [`LocalPpProvider`] is the local provider for the PP tier: it runs PP nodes as child
//! processes from a pool of node *slots* (a JSON file, [`PpPool`]), each a complete
//! command line that starts `starfabric pp --vip-group` with the slot's `--id` (on a
//! host, or `ip netns exec NS …` on a testbed). It is the [`PpNodeProvider`] the
//! autoscaler calls:
//! - **Add:** the first slot that neither this provider runs nor FM lists as a live node
//!   is started. It is ready once FM's Multi-IP table (`VipMap`) gives it a vIP: FM
//!   balances the vIPs onto a joining node, so from then on the underlay's ECMP sends it
//!   traffic. A node that exits or is not given a vIP within `ready_timeout` is stopped
//!   and the add fails with the tail of its log.
//! - **Remove:** the provider only ever stops a node it started, the newest first. It
//!   drains the node first (`PpDrain`: FM moves every vIP to the other nodes, gainers
//!   announcing before the loser lets go), waits `drain_linger` for frames already on
//!   their way, then sends SIGTERM to the node's own PID, and SIGKILL if it has not
//!   exited within `stop_timeout`.
//!
//! A Kubernetes provider would scale the PP DaemonSet's node pool instead; the trait is
//! the same.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use proto::v1::{self, fabric_master_client::FabricMasterClient};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::process::{Child, Command};
use tokio::sync::Mutex;
use tonic::transport::Channel;
use tracing::{info, warn};

use crate::autoscale::PpNodeProvider;

#[derive(Debug, Error)]
pub enum ProviderError {
    #[error("PP node pool {path}: {msg}")]
    Pool { path: String, msg: String },
    #[error("FM address {0}: {1}")]
    Fm(String, String),
}

/// One PP node the provider may start: its node id and the command that starts it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PpSlot {
    /// The node id the command registers with (`--id`), as FM lists it.
    pub id: String,
    /// The program and its arguments, run as given (no shell).
    pub argv: Vec<String>,
}

/// The pool file: `{"log_dir": "/var/log/starfabric", "nodes": [{"id": "pp-1", "argv":
/// ["starfabric", "pp", "--vip-group", "--id", "pp-1", ...]}]}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PpPool {
    /// Where each started node's stdout and stderr go (`<id>.log`, appended); default
    /// the system's temporary directory.
    #[serde(default)]
    pub log_dir: Option<PathBuf>,
    pub nodes: Vec<PpSlot>,
}

impl PpPool {
    pub fn load(path: &Path) -> Result<PpPool, ProviderError> {
        let err = |msg: String| ProviderError::Pool {
            path: path.display().to_string(),
            msg,
        };
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        let pool: PpPool = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        pool.validate().map_err(err)?;
        Ok(pool)
    }

    /// Every slot has a program, a unique id, and passes that id as `--id` (else FM would
    /// know the node by another name, and the provider could not tell when it is ready).
    pub fn validate(&self) -> Result<(), String> {
        if self.nodes.is_empty() {
            return Err("no nodes".into());
        }
        let mut seen = HashSet::new();
        for s in &self.nodes {
            if s.id.is_empty() {
                return Err("a node has an empty id".into());
            }
            if !seen.insert(s.id.as_str()) {
                return Err(format!("node id {} appears twice", s.id));
            }
            if s.argv.first().is_none_or(|p| p.is_empty()) {
                return Err(format!("node {}: argv names no program", s.id));
            }
            let passes_id = s.argv.windows(2).any(|w| w[0] == "--id" && w[1] == s.id)
                || s.argv.iter().any(|a| *a == format!("--id={}", s.id));
            if !passes_id {
                return Err(format!(
                    "node {}: argv must pass `--id {}` (FM knows the node by it)",
                    s.id, s.id
                ));
            }
        }
        Ok(())
    }
}

/// A node this provider started and has not stopped.
struct Started {
    slot: usize,
    child: Child,
    pid: u32,
    log: PathBuf,
}

/// PP nodes as local child processes (see the module doc).
pub struct LocalPpProvider {
    fm: FabricMasterClient<Channel>,
    pool: PpPool,
    /// In start order; the newest is stopped first.
    running: Mutex<Vec<Started>>,
    /// Longest from spawn to holding a vIP.
    pub ready_timeout: Duration,
    /// After the drain, before SIGTERM: frames the switch still sends by its old MAC
    /// table (the node keeps taking a given-up vMAC this long itself).
    pub drain_linger: Duration,
    /// Longest SIGTERM may take before SIGKILL.
    pub stop_timeout: Duration,
}

impl LocalPpProvider {
    pub fn new(
        fm: &str,
        tls: Option<&std::sync::Arc<proto::tls::NodeTls>>,
        pool: PpPool,
    ) -> Result<Self, ProviderError> {
        pool.validate().map_err(|msg| ProviderError::Pool {
            path: "(given)".into(),
            msg,
        })?;
        Ok(LocalPpProvider {
            fm: crate::fm_link::lazy(fm, tls).map_err(|e| ProviderError::Fm(fm.to_string(), e))?,
            pool,
            running: Mutex::new(Vec::new()),
            ready_timeout: Duration::from_secs(20),
            drain_linger: Duration::from_millis(300),
            stop_timeout: Duration::from_secs(5),
        })
    }

    /// The ids and PIDs of the nodes this provider runs, oldest first.
    pub async fn running(&self) -> Vec<(String, u32)> {
        let mut r = self.running.lock().await;
        reap(&mut r, &self.pool);
        r.iter()
            .map(|s| (self.pool.nodes[s.slot].id.clone(), s.pid))
            .collect()
    }

    async fn vip_map(&self) -> Result<v1::VipMapReply, String> {
        let mut c = self.fm.clone();
        match tokio::time::timeout(Duration::from_secs(5), c.vip_map(v1::VipMapRequest {})).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(format!("FM VipMap: {}", s.message())),
            Err(_) => Err("FM VipMap: no answer within 5 s".into()),
        }
    }

    fn log_path(&self, id: &str) -> PathBuf {
        self.pool
            .log_dir
            .clone()
            .unwrap_or_else(std::env::temp_dir)
            .join(format!("{id}.log"))
    }

    /// Drain, then stop every node this provider started (newest first): for an
    /// autoscaler that is told to take its nodes with it when it stops.
    pub async fn stop_all(&self) -> Vec<Result<String, String>> {
        let mut out = Vec::new();
        while !self.running().await.is_empty() {
            out.push(self.remove_pp_node().await);
        }
        out
    }
}

/// Forget nodes whose process has exited (a crash is FM's business: their vIPs moved).
fn reap(running: &mut Vec<Started>, pool: &PpPool) {
    running.retain_mut(|s| match s.child.try_wait() {
        Ok(None) => true,
        Ok(Some(status)) => {
            warn!(node = %pool.nodes[s.slot].id, pid = s.pid, %status, "PP node exited");
            false
        }
        Err(e) => {
            warn!(node = %pool.nodes[s.slot].id, pid = s.pid, error = %e, "PP node: wait failed");
            true
        }
    });
}

fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}

fn owned(map: &v1::VipMapReply, id: &str) -> Vec<u32> {
    map.vips
        .iter()
        .filter(|v| v.node == id)
        .filter_map(|v| v.vip.as_ref().map(|x| x.index))
        .collect()
}

/// SIGTERM, then SIGKILL after `grace`; answers how it ended.
async fn stop_child(s: &mut Started, grace: Duration) -> String {
    // SAFETY: `s.child` has not been waited for (it is reaped only through this handle),
    // so `s.pid` is still this child's PID and cannot name another process.
    let rc = unsafe { libc::kill(s.pid as libc::pid_t, libc::SIGTERM) };
    if rc != 0 {
        warn!(pid = s.pid, error = %std::io::Error::last_os_error(), "SIGTERM failed");
    }
    match tokio::time::timeout(grace, s.child.wait()).await {
        Ok(Ok(status)) => format!("exited ({status})"),
        Ok(Err(e)) => format!("wait failed: {e}"),
        Err(_) => {
            let _ = s.child.start_kill();
            match s.child.wait().await {
                Ok(status) => format!("killed after {grace:?} ({status})"),
                Err(e) => format!("killed; wait failed: {e}"),
            }
        }
    }
}

#[tonic::async_trait]
impl PpNodeProvider for LocalPpProvider {
    async fn add_pp_node(&self) -> Result<String, String> {
        let mut running = self.running.lock().await;
        reap(&mut running, &self.pool);
        let live: HashSet<String> = self.vip_map().await?.nodes.into_iter().collect();
        let busy: HashSet<usize> = running.iter().map(|s| s.slot).collect();
        let slot = (0..self.pool.nodes.len())
            .find(|i| !busy.contains(i) && !live.contains(&self.pool.nodes[*i].id))
            .ok_or_else(|| {
                format!(
                    "every PP node slot is running ({} slots)",
                    self.pool.nodes.len()
                )
            })?;
        let s = &self.pool.nodes[slot];
        let log = self.log_path(&s.id);
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(|e| format!("log {}: {e}", log.display()))?;
        let f2 = f.try_clone().map_err(|e| format!("log: {e}"))?;
        let t0 = Instant::now();
        let child = Command::new(&s.argv[0])
            .args(&s.argv[1..])
            .stdin(Stdio::null())
            .stdout(f)
            .stderr(f2)
            // Left running if the autoscaler exits: the node serves traffic.
            .kill_on_drop(false)
            .spawn()
            .map_err(|e| format!("starting {} ({}): {e}", s.id, s.argv[0]))?;
        let pid = child.id().unwrap_or(0);
        info!(node = %s.id, pid, "PP node started");
        let mut started = Started {
            slot,
            child,
            pid,
            log: log.clone(),
        };
        loop {
            if let Ok(Some(status)) = started.child.try_wait() {
                return Err(format!(
                    "{} (pid {pid}) exited ({status}) before FM gave it a vIP: {}",
                    s.id,
                    tail(&log)
                ));
            }
            if let Ok(m) = self.vip_map().await {
                let vips = owned(&m, &s.id);
                if !vips.is_empty() {
                    let ms = t0.elapsed().as_millis();
                    running.push(started);
                    return Ok(format!(
                        "started {} (pid {pid}); FM gave it vIPs {vips:?} {ms} ms after start",
                        s.id
                    ));
                }
            }
            if t0.elapsed() > self.ready_timeout {
                let how = stop_child(&mut started, self.stop_timeout).await;
                return Err(format!(
                    "{} (pid {pid}) held no vIP {:?} after start; stopped it, {how}: {}",
                    s.id,
                    self.ready_timeout,
                    tail(&log)
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn remove_pp_node(&self) -> Result<String, String> {
        let mut running = self.running.lock().await;
        reap(&mut running, &self.pool);
        let mut s = running.pop().ok_or_else(|| {
            "no PP node started by this provider is running (it stops only its own)".to_string()
        })?;
        let id = self.pool.nodes[s.slot].id.clone();
        let t0 = Instant::now();
        let mut c = self.fm.clone();
        let drained = tokio::time::timeout(
            Duration::from_secs(5),
            c.pp_drain(v1::PpDrainRequest { node: id.clone() }),
        )
        .await;
        let moved = match drained {
            Ok(Ok(r)) => {
                let m = r.into_inner();
                let left = owned(&m, &id);
                if !left.is_empty() {
                    running.push(s);
                    return Err(format!("FM left vIPs {left:?} on {id} after the drain"));
                }
                m.vips.len()
            }
            Ok(Err(st)) => {
                running.push(s);
                return Err(format!("FM refused to drain {id}: {}", st.message()));
            }
            Err(_) => {
                running.push(s);
                return Err(format!("FM did not answer the drain of {id} within 5 s"));
            }
        };
        let drained_ms = t0.elapsed().as_millis();
        tokio::time::sleep(self.drain_linger).await;
        let how = stop_child(&mut s, self.stop_timeout).await;
        info!(node = %id, pid = s.pid, %how, log = %s.log.display(), "PP node stopped");
        Ok(format!(
            "drained {id} in {drained_ms} ms (the {moved} vIPs now on the other nodes), then \
             stopped it (pid {}): {how}",
            s.pid
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(json: &str) -> Result<PpPool, String> {
        let p: PpPool = serde_json::from_str(json).map_err(|e| e.to_string())?;
        p.validate()?;
        Ok(p)
    }

    #[test]
    fn a_pool_names_each_node_and_its_command() {
        let p = pool(
            r#"{"log_dir": "/tmp/x", "nodes": [
                {"id": "pp-1", "argv": ["starfabric", "pp", "--vip-group", "--id", "pp-1"]},
                {"id": "pp-2", "argv": ["ip", "netns", "exec", "n2", "starfabric", "pp", "--id=pp-2"]}
            ]}"#,
        )
        .unwrap();
        assert_eq!(p.nodes.len(), 2);
        assert_eq!(p.log_dir.as_deref(), Some(Path::new("/tmp/x")));
        assert_eq!(p.nodes[1].argv[0], "ip");
    }

    #[test]
    fn bad_pools_are_refused_with_the_reason() {
        for (json, why) in [
            (r#"{"nodes": []}"#, "no nodes"),
            (
                r#"{"nodes": [{"id": "", "argv": ["x", "--id", ""]}]}"#,
                "empty id",
            ),
            (r#"{"nodes": [{"id": "a", "argv": []}]}"#, "no program"),
            (
                r#"{"nodes": [{"id": "a", "argv": ["pp", "--id", "b"]}]}"#,
                "--id a",
            ),
            (
                r#"{"nodes": [{"id": "a", "argv": ["pp", "--id", "a"]}, {"id": "a", "argv": ["pp", "--id", "a"]}]}"#,
                "twice",
            ),
            (
                r#"{"nodes": [{"id": "a", "argv": ["pp", "--id", "a"]}], "extra": 1}"#,
                "unknown field",
            ),
            (r#"{"nodes": "pp-1"}"#, "invalid type"),
        ] {
            let e = pool(json).expect_err(json);
            assert!(e.contains(why), "{json}: {e}");
        }
    }

    #[test]
    fn a_missing_pool_file_is_an_error_naming_the_file() {
        let e = PpPool::load(Path::new("/nonexistent/pool.json")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/pool.json"), "{e}");
    }
}
