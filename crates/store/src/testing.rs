//! A real etcd server for tests (feature `testing`).
//!
//! [`EtcdServer::start`] runs `/usr/bin/etcd` (Debian's `etcd-server`, installed
//! by `scripts/setup.sh`) as a child process on free loopback ports with its own
//! temporary data dir, waits until it reports healthy, and kills it (by its PID)
//! when dropped, also when the test panics. A system etcd on 2379, if one runs,
//! is never touched.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the etcd binary is looked for; `STARFABRIC_ETCD` overrides it.
pub const ETCD_BIN: &str = "/usr/bin/etcd";
/// How long `start` waits for etcd to become healthy.
pub const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A running etcd child process. Dropping it kills the process.
#[derive(Debug)]
pub struct EtcdServer {
    /// Client URL, e.g. `http://127.0.0.1:41234`.
    pub endpoint: String,
    child: Option<Child>,
    pid: u32,
    log: PathBuf,
    // Dropped after `drop` has killed and reaped etcd.
    dir: tempfile::TempDir,
}

impl EtcdServer {
    /// Starts etcd and waits until it is healthy; panics with the reason (and
    /// the tail of etcd's log) if it cannot, e.g. when etcd is not installed.
    #[track_caller]
    pub fn start() -> EtcdServer {
        match Self::try_start() {
            Ok(server) => server,
            Err(e) => panic!("{e}"),
        }
    }

    /// Like [`EtcdServer::start`], returning the failure instead.
    pub fn try_start() -> Result<EtcdServer, String> {
        let bin = std::env::var_os("STARFABRIC_ETCD")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(ETCD_BIN));
        if !bin.is_file() {
            return Err(format!(
                "etcd binary not found at {}: run `bash scripts/setup.sh` (it installs \
                 Debian's etcd-server package; CI runs it) or set STARFABRIC_ETCD",
                bin.display()
            ));
        }
        // Ports are picked by binding :0 and released before etcd binds them, so
        // another process can win the race; then etcd exits and we try again.
        let mut last_err = String::new();
        for attempt in 1..=3 {
            match Self::spawn(&bin) {
                Ok(server) => return Ok(server),
                Err(e) => {
                    tracing::warn!(attempt, error = %e, "etcd did not start");
                    last_err = e;
                }
            }
        }
        Err(last_err)
    }

    fn spawn(bin: &Path) -> Result<EtcdServer, String> {
        let dir = tempfile::Builder::new()
            .prefix("starfabric-etcd-")
            .tempdir()
            .map_err(|e| format!("creating etcd temp dir: {e}"))?;
        let (client_port, peer_port) = free_port_pair()?;
        let client = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let log = dir.path().join("etcd.log");
        let log_file =
            std::fs::File::create(&log).map_err(|e| format!("creating {}: {e}", log.display()))?;
        let log_err = log_file
            .try_clone()
            .map_err(|e| format!("cloning log handle: {e}"))?;
        let mut cmd = Command::new(bin);
        // ETCD_* variables of the machine (e.g. a system etcd's config) would
        // override our flags.
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("ETCD_") {
                cmd.env_remove(k);
            }
        }
        cmd.arg("--name")
            .arg("default")
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .arg("--listen-client-urls")
            .arg(&client)
            .arg("--advertise-client-urls")
            .arg(&client)
            .arg("--listen-peer-urls")
            .arg(&peer)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer)
            .arg("--initial-cluster")
            .arg(format!("default={peer}"))
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--initial-cluster-token")
            .arg(format!("starfabric-test-{client_port}"))
            .arg("--logger")
            .arg("zap")
            .stdin(Stdio::null())
            .stdout(log_file)
            .stderr(log_err);
        let child = cmd
            .spawn()
            .map_err(|e| format!("spawning {}: {e}", bin.display()))?;
        let pid = child.id();
        let mut server = EtcdServer {
            endpoint: client,
            child: Some(child),
            pid,
            log,
            dir,
        };
        server.wait_healthy(client_port)?;
        tracing::info!(endpoint = %server.endpoint, pid, "test etcd started");
        Ok(server)
    }

    /// Polls `/health` until etcd has a leader; fails early if etcd exits.
    fn wait_healthy(&mut self, port: u16) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(format!(
                        "etcd (pid {}) exited with {status} before becoming healthy; log tail:\n{}",
                        self.pid,
                        self.log_tail()
                    ));
                }
            }
            if health_ok(port) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                // Drop kills it.
                return Err(format!(
                    "etcd (pid {}) not healthy within {START_TIMEOUT:?}; log tail:\n{}",
                    self.pid,
                    self.log_tail()
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `vec![endpoint]`, the form `EtcdStore::connect` takes.
    pub fn endpoints(&self) -> Vec<String> {
        vec![self.endpoint.clone()]
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The last lines etcd logged, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Kills etcd now (e.g. to test how clients behave when it is gone).
    /// Idempotent; `drop` does it too.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Child::kill signals exactly this PID; wait reaps it so no zombie
            // stays behind.
            if let Err(e) = child.kill() {
                tracing::warn!(pid = self.pid, error = %e, "killing test etcd");
            }
            let _ = child.wait();
        }
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn free_port_pair() -> Result<(u16, u16), String> {
    let bind = || TcpListener::bind("127.0.0.1:0").map_err(|e| format!("binding a free port: {e}"));
    // Both held at once, so the two ports differ.
    let (a, b) = (bind()?, bind()?);
    let port = |l: &TcpListener| {
        l.local_addr()
            .map(|a| a.port())
            .map_err(|e| format!("local addr: {e}"))
    };
    Ok((port(&a)?, port(&b)?))
}

/// etcd answers `/health` with `"health":"true"` once it has a leader and can
/// serve requests; before that it refuses the connection or says false.
fn health_ok(port: u16) -> bool {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut conn) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return false;
    };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = conn.set_write_timeout(Some(Duration::from_secs(2)));
    let req = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if conn.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut resp = String::new();
    let _ = conn.take(64 * 1024).read_to_string(&mut resp);
    resp.starts_with("HTTP/1.1 200") && resp.contains("\"health\":\"true\"")
}
