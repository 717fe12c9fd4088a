//! Elasticity under live traffic: SC scale-out, scale-in and a replica crash while real
//! kernel TCP goes through the PP node.
//!
//! One driver for `crates/starfabric/tests/e2e_elastic.rs` and `starfabric bench
//! scaling`, so the numbers the bench prints come from the code the tests check:
//!
//! - [`ConnLoop`]: new TCP connections from a VPC client to nginx on the internet host
//!   (through SNAT), from threads that entered the client's namespace, so each is a
//!   real kernel TCP handshake through the PP node. Each connection records its setup
//!   time (connect(2): SYN to SYN-ACK, which includes the PP node's miss to FM and SC
//!   for a new flow), its outcome, and the external address nginx saw.
//! - [`Iperf`]: long-lived iperf3 TCP flows with 100 ms intervals, to see whether a
//!   flow stalled or was reset.
//! - [`scale`] and [`partition_map`]: the `starfabric scale` CLI run inside the control
//!   namespace (FM listens there), exactly as an operator would.
//! - [`run_scenario`]: the load, the flows, a 100 ms timeline of bytes sent per node,
//!   and a list of [`Event`]s (scale-out, scale-in, replica crash) in between, giving a
//!   [`ScenarioReport`].

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, SocketAddrV4, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::platform::{field, Platform};
use crate::services::{HTTP_PORT, IPERF_PORT, IPERF_UNPACED_PORT};
use crate::topo::{addr, Node, Proc, Testbed};
use crate::{cmd, Error, Result};

/// Enter `ns_path`'s network namespace on this thread only (setns(2) is per thread):
/// sockets this thread creates afterwards belong to that namespace.
pub(crate) fn enter_netns(ns_path: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    let f = File::open(ns_path).map_err(|e| Error::io(ns_path.display().to_string(), e))?;
    // SAFETY: `f` is an open namespace file; setns changes only the calling thread's
    // network namespace, and the threads that call this are ours and never go back.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(Error::io("setns", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// The new-connection load.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// The VPC client the connections come from.
    pub client: usize,
    pub target: SocketAddrV4,
    /// Connecting threads.
    pub workers: usize,
    /// New connections per second, over all workers.
    pub rate: f64,
    /// How long each connection stays open after its answer, so that connections
    /// overlap and a mapping handed out twice would be seen live on two of them.
    pub hold: Duration,
    /// A connection not established within this is a failure. Linux retransmits a
    /// SYN after 1 s and 3 s, so a lost SYN still connects within it.
    pub connect_timeout: Duration,
    /// The loop stops by itself after this long, whatever happens to its caller.
    pub limit: Duration,
}

impl LoadSpec {
    /// 20 threads, 100 connections/s in all, each held 100 ms, to nginx on the
    /// internet host from VPC 0. (A thread makes at most 1/(setup + hold) connections
    /// a second, so the threads have room to keep the rate while setups slow down.)
    pub fn new() -> Self {
        LoadSpec {
            client: 0,
            target: SocketAddrV4::new(addr::INET, HTTP_PORT),
            workers: 20,
            rate: 100.0,
            hold: Duration::from_millis(100),
            connect_timeout: Duration::from_secs(8),
            limit: Duration::from_secs(120),
        }
    }
}

impl Default for LoadSpec {
    fn default() -> Self {
        Self::new()
    }
}

/// How one connection ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Connected, got nginx's answer.
    Ok,
    /// Reset (RST) after it was established.
    Reset(String),
    /// Never established, or no answer.
    Failed(String),
}

/// One connection of the loop. Times are µs since the loop started.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConnSample {
    pub start_us: u64,
    /// connect(2) time.
    pub setup_us: u64,
    pub end_us: u64,
    pub local_port: u16,
    /// The source address nginx saw: the SNAT mapping.
    pub external: Option<SocketAddrV4>,
    pub outcome: Outcome,
}

/// A running new-connection loop.
pub struct ConnLoop {
    stop: Arc<AtomicBool>,
    t0: Instant,
    workers: Vec<JoinHandle<Result<Vec<ConnSample>>>>,
}

impl ConnLoop {
    /// Start `spec.workers` threads in `spec.client`'s namespace.
    pub fn start(tb: &Testbed, spec: &LoadSpec) -> Result<ConnLoop> {
        if spec.workers == 0 || spec.rate <= 0.0 {
            return Err(Error::Setup("the load needs workers and a rate".into()));
        }
        let ns_path = Path::new("/run/netns").join(tb.ns(Node::Client(spec.client)));
        let stop = Arc::new(AtomicBool::new(false));
        let t0 = Instant::now();
        let workers = (0..spec.workers)
            .map(|k| {
                let (ns_path, stop, spec) = (ns_path.clone(), stop.clone(), spec.clone());
                std::thread::Builder::new()
                    .name(format!("conn-loop-{k}"))
                    .spawn(move || conn_worker(&ns_path, &spec, k, t0, &stop))
                    .map_err(|e| Error::io("spawn a connection thread", e))
            })
            .collect::<Result<Vec<_>>>()?;
        info!(
            workers = spec.workers,
            rate = spec.rate,
            "connection loop started"
        );
        Ok(ConnLoop { stop, t0, workers })
    }

    /// When the loop started (sample times count from it).
    pub fn t0(&self) -> Instant {
        self.t0
    }

    /// µs since the loop started.
    pub fn now_us(&self) -> u64 {
        self.t0.elapsed().as_micros() as u64
    }

    /// Stop and collect every connection, sorted by start.
    pub fn stop(mut self) -> Result<Vec<ConnSample>> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for w in std::mem::take(&mut self.workers) {
            let samples = w
                .join()
                .map_err(|_| Error::Setup("a connection thread panicked".into()))??;
            all.extend(samples);
        }
        all.sort_by_key(|s| s.start_us);
        Ok(all)
    }
}

impl Drop for ConnLoop {
    fn drop(&mut self) {
        // A caller that panics must not leave threads connecting on: they would outlive
        // the namespaces.
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn conn_worker(
    ns_path: &Path,
    spec: &LoadSpec,
    k: usize,
    t0: Instant,
    stop: &AtomicBool,
) -> Result<Vec<ConnSample>> {
    enter_netns(ns_path)?;
    let period = Duration::from_secs_f64(spec.workers as f64 / spec.rate);
    // Staggered, so the workers' connections spread over the period.
    let mut next = Instant::now() + period.mul_f64(k as f64 / spec.workers as f64);
    let mut out = Vec::new();
    while !stop.load(Ordering::Relaxed) && t0.elapsed() < spec.limit && !crate::interrupted() {
        let now = Instant::now();
        if now < next {
            std::thread::sleep((next - now).min(Duration::from_millis(20)));
            continue;
        }
        // Behind schedule (a slow connection): no burst to catch up, which would
        // measure the burst rather than the platform.
        next = (next + period).max(now);
        out.push(one_connection(spec, t0));
    }
    Ok(out)
}

fn us_since(t0: Instant) -> u64 {
    t0.elapsed().as_micros() as u64
}

fn one_connection(spec: &LoadSpec, t0: Instant) -> ConnSample {
    let start = Instant::now();
    let mut s = ConnSample {
        start_us: us_since(t0),
        setup_us: 0,
        end_us: 0,
        local_port: 0,
        external: None,
        outcome: Outcome::Ok,
    };
    let stream = TcpStream::connect_timeout(&SocketAddr::V4(spec.target), spec.connect_timeout);
    s.setup_us = start.elapsed().as_micros() as u64;
    let mut stream = match stream {
        Ok(st) => st,
        Err(e) => {
            s.outcome = Outcome::Failed(format!("connect: {e}"));
            s.end_us = us_since(t0);
            return s;
        }
    };
    s.local_port = stream.local_addr().map(|a| a.port()).unwrap_or(0);
    match exchange(&mut stream) {
        Ok(ext) => {
            s.external = Some(ext);
            std::thread::sleep(spec.hold);
        }
        Err(e) if is_reset(&e) => s.outcome = Outcome::Reset(e.to_string()),
        Err(e) => s.outcome = Outcome::Failed(e.to_string()),
    }
    drop(stream);
    s.end_us = us_since(t0);
    s
}

fn is_reset(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted
    )
}

/// One HTTP request on a keep-alive connection; returns the peer nginx saw
/// (its body is `inet <addr>:<port>`).
fn exchange(stream: &mut TcpStream) -> std::io::Result<SocketAddrV4> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"GET /elastic HTTP/1.1\r\nHost: inet\r\n\r\n")?;
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 512];
    loop {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "closed before the answer",
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(peer) = parse_answer(&buf) {
            return peer;
        }
        if buf.len() > 16 << 10 {
            return Err(std::io::Error::other("answer too long"));
        }
    }
}

/// The peer from a complete answer; None while it is incomplete.
fn parse_answer(buf: &[u8]) -> Option<std::io::Result<SocketAddrV4>> {
    let text = std::str::from_utf8(buf).ok()?;
    let (head, body) = text.split_once("\r\n\r\n")?;
    let line = body.split_once('\n')?.0;
    if !head.starts_with("HTTP/1.1 200") {
        return Some(Err(std::io::Error::other(format!(
            "answer: {}",
            head.lines().next().unwrap_or_default()
        ))));
    }
    Some(
        line.split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("body {line:?}"))),
    )
}

/// The 99th percentile of the setup times of the connections that started in
/// `[from_us, to_us)` and were established (failures have no setup time).
pub fn p99_setup_us(samples: &[ConnSample], from_us: u64, to_us: u64) -> Option<u64> {
    setup_quantile_us(samples, from_us, to_us, 0.99)
}

/// The `q` quantile (0 < q ≤ 1, nearest rank) of the setup times of the connections
/// started in `[from_us, to_us)` that did not fail.
pub fn setup_quantile_us(samples: &[ConnSample], from_us: u64, to_us: u64, q: f64) -> Option<u64> {
    let mut v: Vec<u64> = samples
        .iter()
        .filter(|s| s.start_us >= from_us && s.start_us < to_us)
        .filter(|s| !matches!(s.outcome, Outcome::Failed(_)))
        .map(|s| s.setup_us)
        .collect();
    if v.is_empty() {
        return None;
    }
    v.sort_unstable();
    let i = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1;
    Some(v[i])
}

/// Pairs of connections that were open at the same time, from different client
/// ports, and reached nginx from the same external address and port: one SNAT mapping
/// handed to two flows. (The same external port on connections that did not overlap
/// is fine: a mapping is freed after its flow ends.)
pub fn duplicate_mappings(samples: &[ConnSample]) -> Vec<(SocketAddrV4, u16, u16)> {
    let mut by_ext: HashMap<SocketAddrV4, Vec<&ConnSample>> = HashMap::new();
    for s in samples {
        if let Some(e) = s.external {
            by_ext.entry(e).or_default().push(s);
        }
    }
    let mut dups = Vec::new();
    for (ext, v) in by_ext {
        for (i, a) in v.iter().enumerate() {
            for b in &v[i + 1..] {
                let overlap = a.start_us < b.end_us && b.start_us < a.end_us;
                if overlap && a.local_port != b.local_port {
                    dups.push((ext, a.local_port, b.local_port));
                }
            }
        }
    }
    dups
}

/// Long-lived iperf3 TCP flows.
#[derive(Debug, Clone)]
pub struct IperfSpec {
    pub client: usize,
    /// Parallel TCP streams.
    pub streams: u32,
    pub secs: u32,
    /// Per-stream rate (iperf3 `-b`): paced, so the flows do not take the CPU the
    /// platform needs on a 2-core machine.
    pub bitrate: String,
    /// Unpaced streams (iperf3 `-b 0`) run beside the paced ones, against the second
    /// server (`services::start_iperf3_unpaced`, which the caller starts); 0: none.
    /// They take whatever the path gives, so a dip in forwarding shows in them; the
    /// paced ones stay under the path's capacity and hide it. They report in
    /// [`IperfReport::unpaced`] and give [`ScenarioReport::throughput_dip`].
    pub unpaced_streams: u32,
}

impl IperfSpec {
    pub fn new(secs: u32) -> Self {
        IperfSpec {
            client: 0,
            streams: 2,
            secs,
            bitrate: "50M".into(),
            unpaced_streams: 0,
        }
    }
}

/// A running iperf3 client.
pub struct Iperf {
    proc: Proc,
    json: PathBuf,
    /// The unpaced client, if the spec asks for one.
    unpaced: Option<(Proc, PathBuf)>,
    spec: IperfSpec,
    started: Instant,
}

/// What an iperf3 run showed.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct IperfReport {
    /// iperf3's error (a reset, a refused connection), if any.
    pub error: Option<String>,
    pub streams: usize,
    /// Seconds of intervals reported.
    pub seconds: f64,
    pub mean_mbps: f64,
    /// The longest time any one stream moved no byte (in 100 ms intervals).
    pub max_stall_s: f64,
    pub retransmits: u64,
    /// (interval end s, Mbit/s over all streams), as the sender counted it: bytes its
    /// writes handed to the socket.
    pub timeline: Vec<(f64, f64)>,
    /// The same, as the receiver (the iperf3 server) counted it: bytes delivered. Only
    /// for a run whose server reports JSON ([`crate::services::start_iperf3_unpaced`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub receiver_timeline: Vec<(f64, f64)>,
    /// The unpaced streams' run ([`IperfSpec::unpaced_streams`]), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unpaced: Option<Box<IperfReport>>,
}

impl Iperf {
    /// Start the client in `spec.client`'s namespace against the internet host's
    /// iperf3 server (services::start_inet). Returns once iperf3 was spawned.
    pub fn start(tb: &Testbed, spec: &IperfSpec) -> Result<Iperf> {
        let json = tb.path("iperf3-elastic.json");
        let proc = Self::spawn(tb, spec, IPERF_PORT, spec.streams, &spec.bitrate, &json)?;
        let unpaced = if spec.unpaced_streams > 0 {
            let j = tb.path("iperf3-elastic-unpaced.json");
            let p = Self::spawn(tb, spec, IPERF_UNPACED_PORT, spec.unpaced_streams, "0", &j)?;
            Some((p, j))
        } else {
            None
        };
        Ok(Iperf {
            proc,
            json,
            unpaced,
            spec: spec.clone(),
            started: Instant::now(),
        })
    }

    fn spawn(
        tb: &Testbed,
        spec: &IperfSpec,
        port: u16,
        streams: u32,
        bitrate: &str,
        json: &Path,
    ) -> Result<Proc> {
        // iperf3 appends to its --logfile.
        let _ = std::fs::remove_file(json);
        let (secs, streams) = (spec.secs.to_string(), streams.to_string());
        let json_s = json.display().to_string();
        let server = addr::INET.to_string();
        let receiver = port == IPERF_UNPACED_PORT;
        let port = port.to_string();
        let mut args = vec![
            "iperf3",
            "-c",
            &server,
            "-p",
            &port,
            "-t",
            &secs,
            "-P",
            &streams,
            "-b",
            bitrate,
            "-i",
            "0.1",
            "--connect-timeout",
            "5000",
            "-J",
            "--logfile",
            &json_s,
        ];
        if receiver {
            // The unpaced flows' throughput is what arrives: the server's own 100 ms
            // intervals. The sender counts what its writes handed to the socket, which
            // on the testbed moved in steps of about 1.3 MB (10% of a 100 ms interval
            // at 1 Gbit/s).
            args.push("--get-server-output");
        }
        tb.spawn(Node::Client(spec.client), "iperf3 elastic", &args)
    }

    /// When it was started (its intervals start a connect later).
    pub fn started(&self) -> Instant {
        self.started
    }

    /// When it will have finished.
    pub fn ends_at(&self) -> Instant {
        self.started + Duration::from_secs(self.spec.secs.into())
    }

    /// Wait for the run to end (bounded) and read its report.
    pub fn wait(self, tb: &Testbed) -> Result<IperfReport> {
        let limit = Duration::from_secs(u64::from(self.spec.secs) + 15);
        cmd::wait_for("iperf3 to finish", limit, || {
            Ok(
                (!tb.running(&self.proc)
                    && self.unpaced.as_ref().is_none_or(|u| !tb.running(&u.0)))
                .then_some(()),
            )
        })?;
        let read = |json: &Path| -> Result<IperfReport> {
            let text = std::fs::read_to_string(json)
                .map_err(|e| Error::io(json.display().to_string(), e))?;
            parse_iperf(&text)
        };
        let mut r = read(&self.json)?;
        if let Some((_, j)) = &self.unpaced {
            r.unpaced = Some(Box::new(read(j)?));
        }
        Ok(r)
    }
}

/// Parse iperf3's `-J` output.
pub fn parse_iperf(text: &str) -> Result<IperfReport> {
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| Error::Parse {
        what: "iperf3 JSON".into(),
        msg: e.to_string(),
    })?;
    let mut r = IperfReport {
        error: v["error"].as_str().map(String::from),
        ..Default::default()
    };
    let intervals = v["intervals"].as_array().cloned().unwrap_or_default();
    let mut stall: Vec<f64> = Vec::new();
    for iv in &intervals {
        let sum = &iv["sum"];
        let secs = sum["seconds"].as_f64().unwrap_or(0.0);
        r.seconds += secs;
        r.timeline.push((
            sum["end"].as_f64().unwrap_or(0.0),
            sum["bits_per_second"].as_f64().unwrap_or(0.0) / 1e6,
        ));
        let streams = iv["streams"].as_array().cloned().unwrap_or_default();
        if stall.len() < streams.len() {
            stall.resize(streams.len(), 0.0);
        }
        for (i, s) in streams.iter().enumerate() {
            // iperf3 ends with a short last interval; a stream idle for a sliver of
            // time at the very end is not a stall.
            if s["bytes"].as_u64().unwrap_or(0) == 0 && secs > 0.05 {
                stall[i] += secs;
                r.max_stall_s = r.max_stall_s.max(stall[i]);
            } else {
                stall[i] = 0.0;
            }
        }
    }
    r.streams = stall.len();
    for iv in v["server_output_json"]["intervals"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        let sum = &iv["sum"];
        r.receiver_timeline.push((
            sum["end"].as_f64().unwrap_or(0.0),
            sum["bits_per_second"].as_f64().unwrap_or(0.0) / 1e6,
        ));
    }
    let end = &v["end"]["sum_sent"];
    r.mean_mbps = end["bits_per_second"].as_f64().unwrap_or(0.0) / 1e6;
    r.retransmits = end["retransmits"].as_u64().unwrap_or(0);
    Ok(r)
}

/// `starfabric scale sc-out|sc-in -o json`'s answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScaleResult {
    pub scale_id: u64,
    pub kind: String,
    pub from_group: u64,
    pub to_group: u64,
    pub moved_lo: u64,
    pub moved_hi: u64,
    pub aborted: Option<String>,
    pub st_to_fin_us: u64,
}

/// `starfabric scale map -o json`'s answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PartitionMap {
    pub version: u64,
    pub partitions: Vec<PartitionEntry>,
    pub groups: Vec<GroupEntry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PartitionEntry {
    pub tenant: u32,
    pub chain: u32,
    pub hash_lo: u64,
    pub hash_hi: u64,
    pub group: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GroupEntry {
    pub id: u64,
    pub epoch: u64,
    pub replicas: Vec<ReplicaEntry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReplicaEntry {
    pub node_id: String,
    pub addr: String,
}

impl PartitionMap {
    /// The groups serving `(tenant, chain)`, by key-hash range.
    pub fn groups_of(&self, tenant: u32, chain: u32) -> Vec<u64> {
        let mut p: Vec<&PartitionEntry> = self
            .partitions
            .iter()
            .filter(|p| p.tenant == tenant && p.chain == chain)
            .collect();
        p.sort_by_key(|p| p.hash_lo);
        p.iter().map(|p| p.group).collect()
    }

    /// Group `id`'s replicas, head first.
    pub fn replicas(&self, id: u64) -> Vec<String> {
        self.groups
            .iter()
            .find(|g| g.id == id)
            .map(|g| g.replicas.iter().map(|r| r.node_id.clone()).collect())
            .unwrap_or_default()
    }
}

/// Run `starfabric scale <args> -o json` in the control namespace.
fn scale_cli(tb: &Testbed, p: &Platform, args: &[&str]) -> Result<cmd::Output> {
    let bin = p.bin.display().to_string();
    let op = p.operator_args();
    let mut argv = vec![bin.as_str(), "scale"];
    argv.extend_from_slice(args);
    argv.extend_from_slice(&["--fm", &p.fm_addr, "-o", "json"]);
    argv.extend(op.iter().map(String::as_str));
    tb.exec_full(Node::Ctl, &argv, Duration::from_secs(90))
}

/// FM's partition map.
pub fn partition_map(tb: &Testbed, p: &Platform) -> Result<PartitionMap> {
    let out = scale_cli(tb, p, &["map", "--timeout", "5"])?;
    if !out.ok() {
        return Err(Error::Command {
            cmd: "starfabric scale map".into(),
            msg: out.stderr,
        });
    }
    serde_json::from_str(&out.stdout).map_err(|e| Error::Parse {
        what: "starfabric scale map".into(),
        msg: e.to_string(),
    })
}

/// Scale `(tenant, chain)` out (`out`) or in, through the CLI. An aborted scale is a
/// result (with `aborted` set), not an error; FM refusing to start is an error.
pub fn scale(
    tb: &Testbed,
    p: &Platform,
    out: bool,
    tenant: u32,
    chain: u32,
) -> Result<ScaleResult> {
    scale_with(tb, p, out, tenant, chain, None)
}

/// [`scale`], a scale-out with `migration` ("bulk" or "gradual"; None: FM's default).
pub fn scale_with(
    tb: &Testbed,
    p: &Platform,
    out: bool,
    tenant: u32,
    chain: u32,
    migration: Option<&str>,
) -> Result<ScaleResult> {
    let verb = if out { "sc-out" } else { "sc-in" };
    let (t, c) = (tenant.to_string(), chain.to_string());
    let mut args = vec![verb, "--tenant", &t, "--chain", &c];
    if let Some(m) = migration {
        args.extend(["--migration", m]);
    }
    let o = scale_cli(tb, p, &args)?;
    serde_json::from_str(&o.stdout).map_err(|_| Error::Command {
        cmd: format!("starfabric scale {verb}"),
        msg: format!("{}: {}", o.status, o.stderr.trim()),
    })
}

/// A counter of FM's last status line.
pub fn fm_counter(p: &Platform, key: &str) -> u64 {
    field(&p.fm_status(), key).unwrap_or(0)
}

/// What a scenario does between the load starting and stopping.
#[derive(Debug, Clone)]
pub enum Event {
    ScaleOut {
        tenant: u32,
        chain: u32,
    },
    /// A scale-out whose flows' state moves as `migration` says ("bulk" or "gradual";
    /// docs/scaling.md).
    ScaleOutMigrating {
        tenant: u32,
        chain: u32,
        migration: String,
    },
    ScaleIn {
        tenant: u32,
        chain: u32,
    },
    /// SIGKILL the replica at `position` (0 = head) of the first group serving the
    /// chain, then wait until FM has replaced it.
    KillReplica {
        tenant: u32,
        chain: u32,
        position: usize,
    },
    /// SIGKILL FM, leave it down for `down`, start it again, and wait until it has
    /// formed the groups again and the PP node is back (the PP node keeps forwarding
    /// the flows it has rules for meanwhile).
    RestartFm {
        down: Duration,
    },
    /// SIGKILL the active FM (a platform with a standby FM) and wait until the PP node
    /// and every live SC node are on the standby and it has every group back; the
    /// standby is the platform's FM afterwards ([`Platform::promote_standby`]).
    FailoverFm,
    Pause(Duration),
    /// PP scale-out (cluster mode): start PP node `node` in its spare namespace; FM
    /// gives it a share of the vIPs. Measured until its XDP program passes the first
    /// VXLAN frame to the node (`seconds_to_traffic`).
    PpScaleOut {
        node: usize,
    },
    /// PP scale-in: FM moves every vIP of PP node `node` away (drain), the node's
    /// traffic stops, then the node is stopped.
    PpScaleIn {
        node: usize,
    },
    /// A PP node fails. `silent: false`: SIGKILL (its FM session breaks at once).
    /// `silent: true`: its link goes down first, so only the missing heartbeats tell FM
    /// (a node that hangs or falls off the network); it is killed afterwards.
    KillPp {
        node: usize,
        silent: bool,
    },
    /// Live migration (CyberStar §6.2), e.g. between a plain PP node and an
    /// accelerated one (`--offload`): FM moves every vIP PP node `from` owns to PP node
    /// `to` through the operator's `starfabric scale vip-move`. Measured until `from`
    /// took no frame for 300 ms ([`PpEvent::migration_ms`]).
    MigrateVips {
        from: usize,
        to: usize,
    },
}

/// What a PP cluster event did.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PpEvent {
    pub node: String,
    /// vIPs the node owned before and after.
    pub vips_before: Vec<u32>,
    pub vips_after: Vec<u32>,
    /// FM's vIP moves during the event.
    pub vip_moves: u64,
    /// Scale-out: from the command (starting the node) to the first VXLAN frame its XDP
    /// program took.
    pub seconds_to_traffic: Option<f64>,
    /// Scale-in: from the drain command until the node's traffic stopped.
    pub drained_ms: Option<u64>,
    /// Failure: from the failure to FM's table showing no vIP on the node (FM's view).
    pub vips_moved_ms: Option<u64>,
    /// Failure: the worst probe flow's outage (lost probes × 0.5 ms), Zeta's recovery.
    pub recovery_ms: Option<f64>,
    /// Failure: probe flows that lost probes around the event.
    pub flows_with_loss: Option<usize>,
    /// Live migration: the node that took the vIPs (`node` is the one that gave them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_node: Option<String>,
    /// Live migration: `to_node`'s vIPs after the move.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub to_vips_after: Vec<u32>,
    /// Live migration: from the command to FM's answer with every vIP moved (FM has
    /// told both nodes by then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub map_ms: Option<f64>,
    /// Live migration: from the command to the first VXLAN frame the target's XDP
    /// program took (meaningful when the target carried nothing before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_frame_ms: Option<f64>,
    /// Live migration: the migration time, from the command to the last VXLAN frame
    /// the source's XDP program took (from then on the target carries all the moved
    /// vIPs' traffic), or to `map_ms` or `first_frame_ms` if either is later. Counters
    /// are polled every few ms, so it is exact to one poll.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration_ms: Option<f64>,
    /// Live migration: iperf3 throughput around the move (see [`MigrationThroughput`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throughput: Option<MigrationThroughput>,
}

/// iperf3's throughput (Mbit/s over all its streams: the unpaced ones when the scenario
/// runs some, else the paced ones) around a live migration, from its 100 ms intervals.
/// *Before*: the intervals that end after the flows' slow start and after the previous
/// event, and no later than the command. *During*: the intervals that overlap the
/// command to [`PpEvent::migration_ms`]. *After*: the intervals that start after that
/// and end before the next event (or the end of the run).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MigrationThroughput {
    /// Which iperf3 streams: "unpaced" or "paced".
    pub streams: String,
    pub before_mbps: Option<f64>,
    pub during_mbps: Option<f64>,
    /// The worst 100 ms interval during the move.
    pub during_worst_mbps: Option<f64>,
    pub after_mbps: Option<f64>,
}

/// What happened in one event.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EventReport {
    pub name: String,
    /// ms since the load started.
    pub start_ms: u64,
    pub end_ms: u64,
    pub scale: Option<ScaleResult>,
    pub repair: Option<Repair>,
    #[serde(default)]
    pub failover: Option<Failover>,
    /// Connections that started during the event (or within 1 s after it).
    pub connections: usize,
    pub failed_connections: usize,
    pub p99_setup_us: Option<u64>,
    pub pp: Option<PpEvent>,
}

/// A replica crash and its repair.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Repair {
    pub group: u64,
    pub victim: String,
    pub victim_pid: i32,
    pub before: Vec<String>,
    pub after: Vec<String>,
    /// From the kill to FM's map showing the group whole again without the victim.
    pub repaired_ms: u64,
}

/// An FM failover: the active FM killed, the nodes on the standby.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Failover {
    pub from: String,
    pub to: String,
    pub killed_pid: i32,
    /// Groups the dead FM had (the standby holds as many at the end).
    pub groups: u64,
    /// Live SC nodes, all registered with the standby at the end.
    pub sc_nodes: u64,
    /// From the kill to the standby's status line showing the PP node, every live SC
    /// node and every group (its status comes every 50 ms).
    pub recovery_ms: u64,
    /// Groups the standby adopted from the SC nodes' reports.
    pub adopted: u64,
    /// The FM the PP node's stats line names afterwards.
    pub pp_fm: Option<String>,
    /// SC nodes whose log says they are on the standby.
    pub sc_on_standby: usize,
}

/// The load, the flows and the events.
#[derive(Debug, Clone)]
pub struct ScenarioSpec {
    pub name: String,
    pub load: LoadSpec,
    pub iperf: IperfSpec,
    /// Load before the first event (the "before" window).
    pub before: Duration,
    /// Load after the last event.
    pub after: Duration,
    pub events: Vec<Event>,
}

/// One 100 ms sample of bytes sent per node (bytes/s): `pp` is the PP node's underlay
/// device; `fm` and `sc-<i>` are what each process wrote to its sockets and files
/// (`/proc/<pid>/io` wchar: FM and SC nodes share the control namespace's device).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TimelinePoint {
    pub t_ms: u64,
    pub tx_bytes_per_s: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScenarioReport {
    pub name: String,
    pub connections: usize,
    pub failed_connections: usize,
    pub reset_connections: usize,
    /// Overlapping connections that got the same external address and port.
    pub duplicate_mappings: usize,
    /// Over the whole run.
    pub p99_setup_us: Option<u64>,
    pub p99_setup_before_us: Option<u64>,
    /// Over connections that started during any event (or within 1 s after it).
    pub p99_setup_during_us: Option<u64>,
    /// `p99_setup_during_us / p99_setup_before_us`: new-flow setup p99 during the
    /// events (from an event's command to 1 s after it returned) over p99 before the
    /// first one.
    pub p99_ratio: Option<f64>,
    /// The unpaced iperf3 flows' worst 100 ms throughput during the first event (the
    /// intervals overlapping its start to 1 s after its end) over their mean before it
    /// (after 0.5 s of slow start), as the receiver counted it; see [`throughput_dip`].
    /// None without unpaced flows.
    pub throughput_dip: Option<f64>,
    /// The two sides of `throughput_dip`, Mbit/s.
    pub unpaced_mbps_before: Option<f64>,
    pub unpaced_worst_mbps_during: Option<f64>,
    /// The same from the sender's intervals (the metric before stop 38; kept beside
    /// it: the sender counts bytes written, in steps, not bytes delivered).
    pub throughput_dip_sender: Option<f64>,
    pub unpaced_sender_mbps_before: Option<f64>,
    pub unpaced_sender_worst_mbps_during: Option<f64>,
    /// Where iperf3's interval 0 starts on the load's clock, ms (negative: before the
    /// load), for reading `iperf`'s timelines against `events`.
    pub iperf_offset_ms: f64,
    pub events: Vec<EventReport>,
    pub iperf: IperfReport,
    /// Connections that started more than 1 s after the last event ended: the
    /// platform after the event.
    pub connections_after_events: usize,
    pub failed_after_events: usize,
    pub p99_setup_after_us: Option<u64>,
    /// Did the iperf3 flows run past the end of the last event?
    pub iperf_covered_events: bool,
    /// FM's counters at the end (scale_outs, scale_ins, scale_aborts, nodes_dead, ...).
    pub fm: BTreeMap<String, u64>,
    pub timeline: Vec<TimelinePoint>,
    /// The first few failures, for the post-mortem.
    pub failures: Vec<ConnSample>,
    /// The 0.5 ms probes, when the scenario ran them ([`run_scenario_probed`]).
    pub probe: Option<crate::probe::ProbeReport>,
    /// TCP resets seen by the kernels at both ends (the VPC client's and the internet
    /// host's), before and during the events ([`TcpResets`]).
    #[serde(default)]
    pub tcp_resets: Option<TcpResets>,
}

/// Resets counted by the kernel's TCP MIB (`/proc/net/snmp`) in the namespaces of the
/// VPC client (the connection loop's and iperf3's client side) and of the internet host
/// (nginx's and iperf3's server side), summed: `EstabResets`, connections that went from
/// ESTABLISHED or CLOSE_WAIT straight to CLOSED (an RST received or sent), and
/// `OutRsts`, RST segments sent (also to a segment of a connection the host does not
/// know). Unlike the connection loop's own `Reset` outcomes, these see iperf3's flows
/// and resets a client never reads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcpResets {
    /// From the load's start to the first event's command: the noise floor.
    pub before_estab_resets: u64,
    pub before_out_rsts: u64,
    /// From the first event's command to the end of the run's last window (iperf3
    /// still running, so its own teardown is not in it).
    pub estab_resets: u64,
    pub out_rsts: u64,
}

/// The TCP MIB counters `EstabResets` and `OutRsts` of namespace `ns_path`, read from a
/// thread that entered it.
fn tcp_mib(ns_path: &Path) -> Result<(u64, u64)> {
    let ns_path = ns_path.to_path_buf();
    std::thread::spawn(move || -> Result<(u64, u64)> {
        enter_netns(&ns_path)?;
        let text = std::fs::read_to_string("/proc/thread-self/net/snmp")
            .map_err(|e| Error::io("/proc/thread-self/net/snmp", e))?;
        parse_tcp_resets(&text).ok_or_else(|| Error::Parse {
            what: "/proc/net/snmp".into(),
            msg: "no Tcp: EstabResets/OutRsts".into(),
        })
    })
    .join()
    .map_err(|_| Error::Setup("the TCP MIB reader panicked".into()))?
}

/// `EstabResets` and `OutRsts` from `/proc/net/snmp`'s two `Tcp:` lines (names, then
/// values).
pub fn parse_tcp_resets(snmp: &str) -> Option<(u64, u64)> {
    let mut tcp = snmp.lines().filter(|l| l.starts_with("Tcp:"));
    let names: Vec<&str> = tcp.next()?.split_whitespace().collect();
    let values: Vec<&str> = tcp.next()?.split_whitespace().collect();
    let get = |k: &str| -> Option<u64> {
        let i = names.iter().position(|n| *n == k)?;
        values.get(i)?.parse().ok()
    };
    Some((get("EstabResets")?, get("OutRsts")?))
}

/// Both ends' MIB counters, summed.
fn tcp_mib_both(tb: &Testbed, client: usize) -> Result<(u64, u64)> {
    let ns = |n: Node| Path::new("/run/netns").join(tb.ns(n));
    let (a, b) = tcp_mib(&ns(Node::Client(client)))?;
    let (c, d) = tcp_mib(&ns(Node::Inet))?;
    Ok((a + c, b + d))
}

const FM_COUNTERS: &[&str] = &[
    "scale_outs",
    "scale_ins",
    "scale_aborts",
    "scale_redirects",
    "scale_pulls",
    "scale_migrating",
    "scale_last_us",
    "nodes_dead",
    "reconfigurations",
    "timeouts",
    "requests",
    "adopted",
];

/// Samples bytes sent per node every 100 ms on a thread of its own.
struct TxSampler {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Vec<TimelinePoint>>,
}

fn wchar(pid: i32) -> Option<u64> {
    let t = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    t.lines()
        .find_map(|l| l.strip_prefix("wchar:"))
        .and_then(|v| v.trim().parse().ok())
}

impl TxSampler {
    fn start(tb: &Testbed, p: &Platform, t0: Instant) -> TxSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let mut pids: Vec<(String, i32)> = vec![("fm".into(), p.fm.pid)];
        if let Some((s, _)) = &p.standby {
            pids.push(("fm-standby".into(), s.pid));
        }
        pids.extend(
            p.scs
                .iter()
                .enumerate()
                .map(|(i, s)| (format!("sc-{i}"), s.pid)),
        );
        // Cluster mode: every PP node's bytes sent are the router's received on its
        // port, all read from the router's namespace in one go.
        let cluster: Vec<(String, String)> = (0..tb.spec.pp_nodes)
            .map(|i| (format!("pp-{i}"), tb.pp_port(i)))
            .collect();
        let pp_ns = Path::new("/run/netns").join(tb.ns(if cluster.is_empty() {
            Node::Pp
        } else {
            Node::Router
        }));
        let st = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut out = Vec::new();
            // The PP node's counter is read from inside its namespace by this thread.
            if let Err(e) = enter_netns(&pp_ns) {
                warn!("timeline: {e}");
                return out;
            }
            let read = |pids: &[(String, i32)]| -> BTreeMap<String, u64> {
                let mut m: BTreeMap<String, u64> = pids
                    .iter()
                    .filter_map(|(n, pid)| Some((n.clone(), wchar(*pid)?)))
                    .collect();
                let dev = std::fs::read_to_string("/proc/thread-self/net/dev").unwrap_or_default();
                if cluster.is_empty() {
                    if let Ok(v) = crate::topo::parse_net_dev(&dev, "up0", "tx_bytes") {
                        m.insert("pp".into(), v);
                    }
                }
                for (name, port) in &cluster {
                    if let Ok(v) = crate::topo::parse_net_dev(&dev, port, "rx_bytes") {
                        m.insert(name.clone(), v);
                    }
                }
                m
            };
            let mut last = read(&pids);
            let mut last_t = Instant::now();
            let mut next = last_t + Duration::from_millis(100);
            while !st.load(Ordering::Relaxed) {
                let now = Instant::now();
                if now < next {
                    std::thread::sleep(next - now);
                    continue;
                }
                next += Duration::from_millis(100);
                let cur = read(&pids);
                let dt = last_t.elapsed().as_secs_f64();
                last_t = Instant::now();
                let rates = cur
                    .iter()
                    .filter_map(|(k, v)| {
                        let prev = last.get(k)?;
                        Some((k.clone(), v.saturating_sub(*prev) as f64 / dt))
                    })
                    .collect();
                out.push(TimelinePoint {
                    t_ms: t0.elapsed().as_millis() as u64,
                    tx_bytes_per_s: rates,
                });
                last = cur;
            }
            out
        });
        TxSampler { stop, handle }
    }

    fn stop(self) -> Vec<TimelinePoint> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().unwrap_or_default()
    }
}

/// Kill the replica at `position` of the first group of `(tenant, chain)` and wait
/// (up to 30 s) until FM's map shows that group whole again without it.
fn kill_replica(
    tb: &Testbed,
    p: &Platform,
    tenant: u32,
    chain: u32,
    position: usize,
) -> Result<Repair> {
    let map = partition_map(tb, p)?;
    let group = *map
        .groups_of(tenant, chain)
        .first()
        .ok_or_else(|| Error::Setup(format!("no group serves {tenant}:{chain}")))?;
    let before = map.replicas(group);
    let victim = before
        .get(position)
        .cloned()
        .ok_or_else(|| Error::Setup(format!("group {group} has no replica {position}")))?;
    let victim_pid = p
        .sc(&victim)
        .ok_or_else(|| Error::Setup(format!("{victim} is not an SC node of this run")))?
        .pid;
    let killed = Instant::now();
    p.kill_sc(tb, &victim)?;
    info!(group, %victim, victim_pid, "replica killed; waiting for the repair");
    let after = cmd::wait_for(
        "FM to replace the killed replica",
        Duration::from_secs(30),
        || {
            let m = match partition_map(tb, p) {
                Ok(m) => m,
                // FM is busy repairing; ask again.
                Err(_) => return Ok(None),
            };
            let r = m.replicas(group);
            Ok((r.len() == before.len() && !r.contains(&victim)).then_some(r))
        },
    )?;
    Ok(Repair {
        group,
        victim,
        victim_pid,
        before,
        after,
        repaired_ms: killed.elapsed().as_millis() as u64,
    })
}

fn restart_fm(tb: &Testbed, p: &mut Platform, down: Duration) -> Result<()> {
    p.kill_fm(tb)?;
    cmd::sleep(down)?;
    p.restart_fm(tb)?;
    let sc = p.scs.iter().filter(|s| tb.running(s)).count() as u64;
    let npp = p.pp_running(tb);
    cmd::wait_for(
        "the restarted FM to form its groups and see the PP node",
        Duration::from_secs(30),
        || {
            let s = p.fm_status();
            Ok((field(&s, "groups").unwrap_or(0) >= 1
                && field(&s, "sc") == Some(sc)
                && field(&s, "pp") == Some(npp))
            .then_some(()))
        },
    )
}

/// VXLAN frames PP node `i`'s XDP program has taken (redirected to its AF_XDP socket
/// or transmitted itself), from its veth's ethtool counters. ARP and RARP are passed to
/// the kernel and not counted, so this moves only with tenant traffic.
pub fn pp_xdp_frames(tb: &Testbed, i: usize) -> Result<u64> {
    let stats = crate::measure::ethtool_stats(tb, Node::pp(i), "up0")?;
    Ok(stats
        .iter()
        .filter(|(k, _)| k.ends_with("_xdp_redirect") || k.ends_with("_xdp_tx"))
        .map(|(_, v)| *v)
        .sum())
}

fn pp_scale_out(tb: &Testbed, p: &mut Platform, node: usize) -> Result<PpEvent> {
    let id = format!("pp-{node}");
    let before = p.vip_map(tb)?;
    let base = pp_xdp_frames(tb, node).unwrap_or(0);
    let cmd_at = Instant::now();
    p.start_pp(tb, node)?;
    let first = cmd::wait_for(
        "traffic on the new PP node",
        Duration::from_secs(10),
        || Ok((pp_xdp_frames(tb, node).unwrap_or(0) > base).then(Instant::now)),
    )?;
    let after = p.vip_map(tb)?;
    Ok(PpEvent {
        vips_before: before.owned_by(&id),
        vips_after: after.owned_by(&id),
        vip_moves: after.moves.saturating_sub(before.moves),
        seconds_to_traffic: Some(first.duration_since(cmd_at).as_secs_f64()),
        node: id,
        ..Default::default()
    })
}

fn pp_scale_in(tb: &Testbed, p: &Platform, node: usize) -> Result<PpEvent> {
    let id = format!("pp-{node}");
    let before = p.vip_map(tb)?;
    let at = Instant::now();
    let after = p.drain_pp(tb, node)?;
    // Drained: no frame taken for 300 ms (FM moved the vIPs; flows already on their way
    // to the node were still served by it).
    let mut last = pp_xdp_frames(tb, node)?;
    let mut quiet_since = Instant::now();
    let drained = cmd::wait_for("the PP node to drain", Duration::from_secs(10), || {
        let n = pp_xdp_frames(tb, node)?;
        if n != last {
            last = n;
            quiet_since = Instant::now();
        }
        Ok((quiet_since.elapsed() >= Duration::from_millis(300)).then_some(quiet_since))
    })?;
    p.stop_pp(tb, node);
    Ok(PpEvent {
        vips_before: before.owned_by(&id),
        vips_after: after.owned_by(&id),
        vip_moves: after.moves.saturating_sub(before.moves),
        drained_ms: Some(drained.saturating_duration_since(at).as_millis() as u64),
        node: id,
        ..Default::default()
    })
}

fn kill_pp(tb: &Testbed, p: &Platform, node: usize, silent: bool) -> Result<PpEvent> {
    let id = format!("pp-{node}");
    let before = p.vip_map(tb)?;
    let at = Instant::now();
    if silent {
        tb.exec(
            Node::pp(node),
            &["ip", "link", "set", "up0", "down"],
            cmd::CONFIG_LIMIT,
        )?;
    } else {
        p.kill_pp(tb, node)?;
    }
    let after = cmd::wait_for(
        "FM to move the failed node's vIPs",
        Duration::from_secs(10),
        || {
            let m = match p.vip_map(tb) {
                Ok(m) => m,
                Err(_) => return Ok(None),
            };
            Ok((m.owned_by(&id).is_empty() && m.all_owned()).then_some(m))
        },
    )?;
    let moved_ms = at.elapsed().as_millis() as u64;
    if silent {
        p.kill_pp(tb, node)?;
    }
    Ok(PpEvent {
        vips_before: before.owned_by(&id),
        vips_after: after.owned_by(&id),
        vip_moves: after.moves.saturating_sub(before.moves),
        vips_moved_ms: Some(moved_ms),
        node: id,
        ..Default::default()
    })
}

/// One poll of both nodes' XDP counters: (ms since the command, source's, target's).
type FramePoll = (f64, u64, u64);

/// Live migration: move every vIP of `pp-<from>` to `pp-<to>` and time it. A thread
/// polls both nodes' XDP frame counters from before the command until the source has
/// taken no frame for 300 ms (bounded by 10 s).
fn migrate_vips(tb: &Testbed, p: &Platform, from: usize, to: usize) -> Result<PpEvent> {
    let (id, to_id) = (format!("pp-{from}"), format!("pp-{to}"));
    if from == to {
        return Err(Error::Setup(format!("{id} cannot migrate to itself")));
    }
    for i in [from, to] {
        if p.pp_node(i).is_none_or(|n| !tb.running(n)) {
            return Err(Error::Setup(format!("PP node pp-{i} is not running")));
        }
    }
    let before = p.vip_map(tb)?;
    let ns = |i: usize| tb.ns(Node::pp(i));
    let (src_ns, dst_ns) = (ns(from), ns(to));
    let frames = |ns: &str| -> u64 {
        cmd::in_ns(ns, &["ethtool", "-S", "up0"], cmd::CONFIG_LIMIT)
            .map(|out| {
                crate::measure::parse_ethtool_stats(&out)
                    .iter()
                    .filter(|(k, _)| k.ends_with("_xdp_redirect") || k.ends_with("_xdp_tx"))
                    .map(|(_, v)| *v)
                    .sum()
            })
            .unwrap_or(0)
    };
    let (src0, dst0) = (frames(&src_ns), frames(&dst_ns));
    let done = AtomicBool::new(false);
    let at = Instant::now();
    let since = |t: Instant| t.duration_since(at).as_secs_f64() * 1e3;
    let (moved, polls) = std::thread::scope(|sc| {
        let poller = sc.spawn(|| {
            let mut polls: Vec<FramePoll> = Vec::new();
            let mut last_change = Instant::now();
            let mut last_src = src0;
            loop {
                let (a, b) = (frames(&src_ns), frames(&dst_ns));
                let now = Instant::now();
                if a != last_src {
                    last_src = a;
                    last_change = now;
                }
                polls.push((since(now), a, b));
                let quiet = now.duration_since(last_change) >= Duration::from_millis(300);
                if (done.load(Ordering::Relaxed) && quiet)
                    || now.duration_since(at) > Duration::from_secs(10)
                    || crate::interrupted()
                {
                    return polls;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        let moved = p
            .move_vips(tb, from, to)
            .map(|m| (m, since(Instant::now())));
        done.store(true, Ordering::Relaxed);
        let polls = poller.join().unwrap_or_default();
        (moved, polls)
    });
    let (after, map_ms) = moved?;
    let (first_frame_ms, source_last_ms) = migration_times(src0, dst0, &polls);
    let migration_ms = [Some(map_ms), first_frame_ms, source_last_ms]
        .into_iter()
        .flatten()
        .fold(0.0f64, f64::max);
    info!(
        from = %id, to = %to_id, map_ms, ?first_frame_ms, ?source_last_ms, migration_ms,
        "vIPs migrated"
    );
    Ok(PpEvent {
        vips_before: before.owned_by(&id),
        vips_after: after.owned_by(&id),
        vip_moves: after.moves.saturating_sub(before.moves),
        to_vips_after: after.owned_by(&to_id),
        to_node: Some(to_id),
        map_ms: Some(map_ms),
        first_frame_ms,
        migration_ms: Some(migration_ms),
        node: id,
        ..Default::default()
    })
}

/// From the polls of a migration (ms since the command, source's counter, target's):
/// when the target's counter first moved past `dst0`, and when the source's last moved
/// (None if it never did, from `src0`).
pub fn migration_times(src0: u64, dst0: u64, polls: &[FramePoll]) -> (Option<f64>, Option<f64>) {
    let first = polls.iter().find(|q| q.2 > dst0).map(|q| q.0);
    let mut last = None;
    let mut prev = src0;
    for &(t, a, _) in polls {
        if a != prev {
            last = Some(t);
            prev = a;
        }
    }
    (first, last)
}

/// [`MigrationThroughput`] from iperf3's `timeline` (interval end s, Mbit/s; interval 0
/// starts at `offset_ms` on the scenario's clock), for a move whose command was at
/// `start_ms` and that took `migration_ms`, after an event that ended at `prev_end_ms`
/// and before one that starts at `next_ms` (ms; `f64::INFINITY` for none).
pub fn migration_throughput(
    streams: &str,
    timeline: &[(f64, f64)],
    offset_ms: f64,
    prev_end_ms: f64,
    start_ms: f64,
    migration_ms: f64,
    next_ms: f64,
) -> MigrationThroughput {
    let moved_ms = start_ms + migration_ms;
    let (mut before, mut during, mut after) = (Vec::new(), Vec::new(), Vec::new());
    let mut prev = 0.0;
    for &(end_s, mbps) in timeline {
        let (a, z) = (offset_ms + prev * 1e3, offset_ms + end_s * 1e3);
        prev = end_s;
        // iperf3's short last interval says little about a rate.
        if z - a < 50.0 {
            continue;
        }
        if z - offset_ms > SLOW_START_MS && a >= prev_end_ms - 1.0 && z <= start_ms {
            before.push(mbps);
        }
        if z > start_ms && a < moved_ms.max(start_ms + 1.0) {
            during.push(mbps);
        }
        if a >= moved_ms && z <= next_ms {
            after.push(mbps);
        }
    }
    let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    MigrationThroughput {
        streams: streams.to_string(),
        before_mbps: mean(&before),
        during_mbps: mean(&during),
        during_worst_mbps: during.iter().copied().reduce(f64::min),
        after_mbps: mean(&after),
    }
}

fn failover_fm(tb: &Testbed, p: &mut Platform) -> Result<Failover> {
    let to = p.standby.as_ref().map(|(_, a)| a.clone()).ok_or_else(|| {
        Error::Setup("FM failover needs a standby FM (PlatformSpec::standby_fm)".into())
    })?;
    let groups = partition_map(tb, p)?.groups.len() as u64;
    let live: Vec<String> = p
        .scs
        .iter()
        .enumerate()
        .filter(|(_, s)| tb.running(s))
        .map(|(i, _)| format!("sc-{i}"))
        .collect();
    let sc_nodes = live.len() as u64;
    let npp = p.pp_running(tb);
    let (from, killed_pid) = (p.fm_addr.clone(), p.fm.pid);
    let killed = Instant::now();
    p.kill_fm(tb)?;
    cmd::wait_for(
        "the standby FM to have the PP node, every SC node and every group",
        Duration::from_secs(30),
        || {
            let s = p.standby_status();
            Ok((field(&s, "groups") == Some(groups)
                && field(&s, "sc") == Some(sc_nodes)
                && field(&s, "pp") == Some(npp))
            .then_some(()))
        },
    )?;
    let recovery_ms = killed.elapsed().as_millis() as u64;
    p.promote_standby()?;
    info!(recovery_ms, %from, %to, "FM failover: the standby has every node and group");
    // The nodes' own word for where they are (the PP node prints its stats every 1 s).
    let on_standby = |p: &Platform| {
        live.iter()
            .filter(|id| p.sc_fm(id).as_deref() == Some(to.as_str()))
            .count()
    };
    let _ = cmd::wait_for(
        "the nodes to name the standby FM",
        Duration::from_secs(3),
        || {
            Ok(
                (p.pp_fm().as_deref() == Some(to.as_str()) && on_standby(p) == live.len())
                    .then_some(()),
            )
        },
    );
    Ok(Failover {
        from,
        to: to.clone(),
        killed_pid,
        groups,
        sc_nodes,
        recovery_ms,
        adopted: fm_counter(p, "adopted"),
        pp_fm: p.pp_fm(),
        sc_on_standby: on_standby(p),
    })
}

/// Run `spec` against the running platform `p` (whose chain serves VPC
/// `spec.load.client`, with the internet host's servers up).
pub fn run_scenario(tb: &Testbed, p: &mut Platform, spec: &ScenarioSpec) -> Result<ScenarioReport> {
    run_scenario_probed(tb, p, spec, None)
}

/// [`run_scenario`], with 0.5 ms probes (`probe`) running through it as well; a PP
/// failure's `recovery_ms` comes from them.
pub fn run_scenario_probed(
    tb: &Testbed,
    p: &mut Platform,
    spec: &ScenarioSpec,
    probe: Option<&crate::probe::ProbeSpec>,
) -> Result<ScenarioReport> {
    info!(name = %spec.name, "scenario");
    let echo = probe
        .map(|_| crate::probe::EchoServer::start(tb))
        .transpose()?;
    let prober = probe
        .map(|ps| crate::probe::Prober::start(tb, ps))
        .transpose()?;
    let iperf = Iperf::start(tb, &spec.iperf)?;
    let conns = ConnLoop::start(tb, &spec.load)?;
    let t0 = conns.t0();
    let sampler = TxSampler::start(tb, p, t0);
    let ms = |i: Instant| i.duration_since(t0).as_millis() as u64;
    // Best effort: a namespace whose MIB cannot be read leaves `tcp_resets` out.
    let mib = || tcp_mib_both(tb, spec.load.client).ok();
    let mib0 = mib();
    let (mut mib1, mut mib2) = (None, None);
    // Whatever fails below, the loop and the sampler stop (the loop by its drop).
    let result = (|| -> Result<Vec<(EventReport, Instant)>> {
        cmd::sleep(spec.before)?;
        mib1 = mib();
        let mut evs = Vec::new();
        for e in &spec.events {
            let start = Instant::now();
            let mut r = EventReport {
                name: String::new(),
                start_ms: ms(start),
                end_ms: 0,
                scale: None,
                repair: None,
                failover: None,
                connections: 0,
                failed_connections: 0,
                p99_setup_us: None,
                pp: None,
            };
            match e {
                Event::ScaleOut { tenant, chain } => {
                    r.name = "scale_out".into();
                    r.scale = Some(scale(tb, p, true, *tenant, *chain)?);
                }
                Event::ScaleOutMigrating {
                    tenant,
                    chain,
                    migration,
                } => {
                    r.name = "scale_out".into();
                    r.scale = Some(scale_with(tb, p, true, *tenant, *chain, Some(migration))?);
                }
                Event::ScaleIn { tenant, chain } => {
                    r.name = "scale_in".into();
                    r.scale = Some(scale(tb, p, false, *tenant, *chain)?);
                }
                Event::KillReplica {
                    tenant,
                    chain,
                    position,
                } => {
                    r.name = "replica_kill".into();
                    r.repair = Some(kill_replica(tb, p, *tenant, *chain, *position)?);
                }
                Event::RestartFm { down } => {
                    r.name = "fm_restart".into();
                    restart_fm(tb, p, *down)?;
                }
                Event::FailoverFm => {
                    r.name = "fm_failover".into();
                    r.failover = Some(failover_fm(tb, p)?);
                }
                Event::Pause(d) => {
                    r.name = "pause".into();
                    cmd::sleep(*d)?;
                }
                Event::PpScaleOut { node } => {
                    r.name = "pp_scale_out".into();
                    r.pp = Some(pp_scale_out(tb, p, *node)?);
                }
                Event::PpScaleIn { node } => {
                    r.name = "pp_scale_in".into();
                    r.pp = Some(pp_scale_in(tb, p, *node)?);
                }
                Event::KillPp { node, silent } => {
                    r.name = if *silent {
                        "pp_failover_silent"
                    } else {
                        "pp_failover"
                    }
                    .into();
                    r.pp = Some(kill_pp(tb, p, *node, *silent)?);
                }
                Event::MigrateVips { from, to } => {
                    r.name = "vip_migration".into();
                    r.pp = Some(migrate_vips(tb, p, *from, *to)?);
                }
            }
            let end = Instant::now();
            r.end_ms = ms(end);
            info!(event = %r.name, ms = r.end_ms - r.start_ms, "event done");
            evs.push((r, end));
        }
        cmd::sleep(spec.after)?;
        mib2 = mib();
        Ok(evs)
    })();
    let tcp_resets = match (mib0, mib1, mib2) {
        (Some(a), Some(b), Some(c)) => Some(TcpResets {
            before_estab_resets: b.0.saturating_sub(a.0),
            before_out_rsts: b.1.saturating_sub(a.1),
            estab_resets: c.0.saturating_sub(b.0),
            out_rsts: c.1.saturating_sub(b.1),
        }),
        _ => None,
    };
    let samples = conns.stop()?;
    let timeline = sampler.stop();
    let probe_report = prober.map(|pr| {
        let offset_ms = t0.saturating_duration_since(pr.t0()).as_secs_f64() * 1000.0;
        pr.stop().map(|mut r| {
            r.scenario_t0_ms = offset_ms;
            (r, offset_ms)
        })
    });
    if let Some(e) = echo {
        e.stop();
    }
    let probe_report = probe_report.transpose()?;
    let mut evs = result?;
    if let Some((pr, offset_ms)) = &probe_report {
        for (r, _) in evs.iter_mut() {
            if let Some(pe) = r.pp.as_mut().filter(|_| r.name.starts_with("pp_failover")) {
                // The window: from just before the failure to 1 s after FM moved the
                // vIPs, on the prober's clock.
                let from = r.start_ms as f64 + offset_ms - 5.0;
                let to = r.end_ms as f64 + offset_ms + 1000.0;
                pe.recovery_ms = Some(pr.recovery_ms_between(from, to));
                pe.flows_with_loss = Some(pr.flows_with_loss_between(from, to));
            }
        }
    }
    let ends_at = iperf.ends_at();
    // Negative: iperf3 started just before the load.
    let iperf_offset_ms = if iperf.started() >= t0 {
        iperf.started().duration_since(t0).as_secs_f64() * 1e3
    } else {
        -(t0.duration_since(iperf.started()).as_secs_f64() * 1e3)
    };
    let iperf_report = iperf.wait(tb)?;
    let (streams, tl) = match &iperf_report.unpaced {
        Some(u) => ("unpaced", &u.timeline),
        None => ("paced", &iperf_report.timeline),
    };
    // A live migration's throughput windows reach from the previous real event (not a
    // pause) to the next one.
    let real: Vec<usize> = (0..evs.len())
        .filter(|&i| evs[i].0.name != "pause")
        .collect();
    for (k, &i) in real.iter().enumerate() {
        let prev_end = k
            .checked_sub(1)
            .map_or(0.0, |j| evs[real[j]].0.end_ms as f64);
        let next = real
            .get(k + 1)
            .map_or(f64::INFINITY, |&j| evs[j].0.start_ms as f64);
        let (r, _) = &mut evs[i];
        let start = r.start_ms as f64;
        if let Some(pe) = r.pp.as_mut() {
            if let Some(m) = pe.migration_ms {
                pe.throughput = Some(migration_throughput(
                    streams,
                    tl,
                    iperf_offset_ms,
                    prev_end,
                    start,
                    m,
                    next,
                ));
            }
        }
    }
    let last_end = evs.last().map(|(_, e)| *e).unwrap_or(t0);
    let failed = |s: &&ConnSample| !matches!(s.outcome, Outcome::Ok);
    let first_event_us = evs
        .first()
        .map(|(r, _)| r.start_ms * 1000)
        .unwrap_or(u64::MAX);
    let mut during: Vec<ConnSample> = Vec::new();
    let events: Vec<EventReport> = evs
        .into_iter()
        .map(|(mut r, _)| {
            let (from, to) = (r.start_ms * 1000, r.end_ms * 1000 + 1_000_000);
            let win: Vec<ConnSample> = samples
                .iter()
                .filter(|s| s.start_us >= from && s.start_us < to)
                .cloned()
                .collect();
            r.connections = win.len();
            r.failed_connections = win.iter().filter(failed).count();
            r.p99_setup_us = p99_setup_us(&win, 0, u64::MAX);
            if r.name != "pause" {
                during.extend(win);
            }
            r
        })
        .collect();
    let after_us = if spec.events.is_empty() {
        u64::MAX
    } else {
        last_end.duration_since(t0).as_micros() as u64 + 1_000_000
    };
    let after: Vec<ConnSample> = samples
        .iter()
        .filter(|s| s.start_us >= after_us)
        .cloned()
        .collect();
    let dip_of = |tl: &[(f64, f64)]| match events_first(&events) {
        Some((a, z)) => {
            throughput_dip(tl, iperf_offset_ms, a as f64, (a as f64, z as f64 + 1000.0))
        }
        None => None,
    };
    let unpaced = iperf_report.unpaced.as_deref();
    let dip = unpaced.and_then(|u| dip_of(&u.receiver_timeline));
    let dip_sender = unpaced.and_then(|u| dip_of(&u.timeline));
    let p99_before = p99_setup_us(&samples, 0, first_event_us);
    let p99_during = p99_setup_us(&during, 0, u64::MAX);
    let fm = FM_COUNTERS
        .iter()
        .map(|k| (k.to_string(), fm_counter(p, k)))
        .collect();
    let report = ScenarioReport {
        name: spec.name.clone(),
        connections: samples.len(),
        failed_connections: samples
            .iter()
            .filter(|s| matches!(s.outcome, Outcome::Failed(_)))
            .count(),
        reset_connections: samples
            .iter()
            .filter(|s| matches!(s.outcome, Outcome::Reset(_)))
            .count(),
        duplicate_mappings: duplicate_mappings(&samples).len(),
        p99_setup_us: p99_setup_us(&samples, 0, u64::MAX),
        p99_setup_before_us: p99_before,
        p99_setup_during_us: p99_during,
        p99_ratio: match (p99_during, p99_before) {
            (Some(d), Some(b)) if b > 0 => Some(d as f64 / b as f64),
            _ => None,
        },
        throughput_dip: dip.map(|d| d.2),
        unpaced_mbps_before: dip.map(|d| d.0),
        unpaced_worst_mbps_during: dip.map(|d| d.1),
        throughput_dip_sender: dip_sender.map(|d| d.2),
        unpaced_sender_mbps_before: dip_sender.map(|d| d.0),
        unpaced_sender_worst_mbps_during: dip_sender.map(|d| d.1),
        iperf_offset_ms,
        events,
        connections_after_events: after.len(),
        failed_after_events: after.iter().filter(failed).count(),
        p99_setup_after_us: p99_setup_us(&after, 0, u64::MAX),
        iperf: iperf_report,
        iperf_covered_events: ends_at > last_end,
        fm,
        timeline,
        failures: samples.iter().filter(failed).take(10).cloned().collect(),
        probe: probe_report.map(|(r, _)| r),
        tcp_resets,
    };
    info!(
        name = %report.name,
        connections = report.connections,
        failed = report.failed_connections,
        p99_before = ?report.p99_setup_before_us,
        p99_during = ?report.p99_setup_during_us,
        "scenario done"
    );
    Ok(report)
}

/// The first event's (start, end) ms, if any.
fn events_first(events: &[EventReport]) -> Option<(u64, u64)> {
    events.first().map(|e| (e.start_ms, e.end_ms))
}

/// How long an unpaced flow's first intervals are left out of the "before" mean: TCP
/// slow start, not the platform.
pub const SLOW_START_MS: f64 = 500.0;

/// The unpaced flows' throughput around an event (docs/elastic-tests.md, "Throughput
/// dip"). `timeline` is iperf3's (interval end s, Mbit/s), with interval 0 starting at
/// `offset_ms` on the scenario's clock (the load's start).
/// - *Before*: the mean over the intervals that end after the flow's first
///   [`SLOW_START_MS`] and no later than `before_ms` (the first event's start).
/// - *During*: the worst interval that overlaps `during_ms` (from the event's start,
///   when its command was issued, to 1 s after it returned: the window the new-flow p99
///   "during" uses too).
///
/// Returns (mean before, worst during, worst / mean); None if either side has no
/// interval or nothing moved before.
pub fn throughput_dip(
    timeline: &[(f64, f64)],
    offset_ms: f64,
    before_ms: f64,
    during_ms: (f64, f64),
) -> Option<(f64, f64, f64)> {
    let mut prev_end = 0.0;
    let (mut sum, mut n) = (0.0, 0usize);
    let mut worst: Option<f64> = None;
    for &(end_s, mbps) in timeline {
        let (a, z) = (offset_ms + prev_end * 1000.0, offset_ms + end_s * 1000.0);
        prev_end = end_s;
        // iperf3's short last interval says little about a rate.
        if z - a < 50.0 {
            continue;
        }
        if z - offset_ms > SLOW_START_MS && z <= before_ms {
            sum += mbps;
            n += 1;
        }
        if z > during_ms.0 && a < during_ms.1 {
            worst = Some(worst.map_or(mbps, |w: f64| w.min(mbps)));
        }
    }
    let mean = (n > 0).then(|| sum / n as f64).filter(|m| *m > 0.0)?;
    let worst = worst?;
    Some((mean, worst, worst / mean))
}

/// What [`throughput_dip`] reads with no event at all: the same statistic over every
/// window of `window_ms` that starts, in 100 ms steps, between `from_ms` and `to_ms -
/// window_ms` (the load's clock, as for [`throughput_dip`]). The metric cannot tell an
/// event's dip from one under this floor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DipFloor {
    pub window_ms: f64,
    pub windows: usize,
    /// The windows' `throughput_dip`: median, 10th percentile and lowest.
    pub median: f64,
    pub p10: f64,
    pub min: f64,
    /// Coefficient of variation of the 100 ms intervals between `from_ms` and `to_ms`
    /// (the first [`SLOW_START_MS`] left out).
    pub interval_cv: f64,
}

/// [`DipFloor`] of `timeline` (iperf3's (interval end s, Mbit/s), interval 0 starting
/// at `offset_ms`); None if no window fits.
pub fn dip_floor(
    timeline: &[(f64, f64)],
    offset_ms: f64,
    window_ms: f64,
    from_ms: f64,
    to_ms: f64,
) -> Option<DipFloor> {
    let mut dips = Vec::new();
    let mut t = from_ms;
    while t + window_ms <= to_ms {
        if let Some((_, _, d)) = throughput_dip(timeline, offset_ms, t, (t, t + window_ms)) {
            dips.push(d);
        }
        t += 100.0;
    }
    if dips.is_empty() {
        return None;
    }
    dips.sort_by(f64::total_cmp);
    let at = |q: f64| dips[((dips.len() - 1) as f64 * q).round() as usize];
    let mut prev_end = 0.0;
    let inside: Vec<f64> = timeline
        .iter()
        .filter_map(|&(end_s, mbps)| {
            let (a, z) = (offset_ms + prev_end * 1000.0, offset_ms + end_s * 1000.0);
            prev_end = end_s;
            (z - a >= 50.0 && z - offset_ms > SLOW_START_MS && a >= from_ms && z <= to_ms)
                .then_some(mbps)
        })
        .collect();
    let n = inside.len().max(1) as f64;
    let mean = inside.iter().sum::<f64>() / n;
    let var = inside.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    Some(DipFloor {
        window_ms,
        windows: dips.len(),
        median: at(0.5),
        p10: at(0.1),
        min: dips[0],
        interval_cv: if mean > 0.0 { var.sqrt() / mean } else { 0.0 },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dip_floor_slides_the_dip_window_over_a_run_with_no_event() {
        // 100 ms intervals from the load's start; one slow interval at 3.0-3.1 s.
        let t: Vec<(f64, f64)> = (1..=60)
            .map(|i| (i as f64 / 10.0, if i == 31 { 500.0 } else { 1000.0 }))
            .collect();
        let f = dip_floor(&t, 0.0, 1000.0, 1000.0, 5000.0).unwrap();
        // Windows start at 1.0, 1.1, ..., 4.0 s: 31 of them; those from 2.1 to 3.0 s
        // overlap the slow interval (10 of 31), the rest read 1.0.
        assert_eq!(f.windows, 31);
        assert_eq!(f.median, 1.0);
        assert!((f.min - 500.0 / 1000.0).abs() < 0.01, "{f:?}");
        assert!(f.p10 < 0.6, "{f:?}");
        assert!(f.interval_cv > 0.05 && f.interval_cv < 0.2, "{f:?}");
        // A window that does not fit: none.
        assert!(dip_floor(&t, 0.0, 1000.0, 5500.0, 6000.0).is_none());
        // A steady run has a floor of exactly 1 and no spread.
        let flat: Vec<(f64, f64)> = (1..=60).map(|i| (i as f64 / 10.0, 800.0)).collect();
        let f = dip_floor(&flat, 0.0, 1000.0, 1000.0, 5000.0).unwrap();
        assert_eq!((f.median, f.min, f.interval_cv), (1.0, 1.0, 0.0));
    }

    #[test]
    fn throughput_dip_is_the_worst_interval_during_over_the_mean_before() {
        // 100 ms intervals; the flow started 50 ms after the load.
        let mut t: Vec<(f64, f64)> = (1..=40).map(|i| (i as f64 / 10.0, 100.0)).collect();
        t[4].1 = 10.0; // slow start: left out of the mean
        t[12].1 = 80.0; // before the event: in the mean
        t[25].1 = 45.0; // in the event window: the worst
        t[38].1 = 1.0; // after the window: ignored
        let (before, worst, dip) = throughput_dip(&t, 50.0, 2_000.0, (2_300.0, 3_000.0)).unwrap();
        // Intervals ending in (550, 2000] ms: t[5]..=t[18], 14 of them, one at 80.
        assert!(
            (before - (13.0 * 100.0 + 80.0) / 14.0).abs() < 1e-9,
            "{before}"
        );
        assert_eq!(worst, 45.0);
        assert!((dip - 45.0 / before).abs() < 1e-12);
        // No interval before the event, or none during: no number.
        assert!(throughput_dip(&t, 50.0, 300.0, (2_300.0, 3_000.0)).is_none());
        assert!(throughput_dip(&t, 50.0, 2_000.0, (9_000.0, 9_500.0)).is_none());
        assert!(throughput_dip(&[], 0.0, 2_000.0, (0.0, 1.0)).is_none());
    }

    fn s(start: u64, end: u64, port: u16, ext: u16) -> ConnSample {
        ConnSample {
            start_us: start,
            setup_us: 100,
            end_us: end,
            local_port: port,
            external: Some(SocketAddrV4::new(addr::pool(0), ext)),
            outcome: Outcome::Ok,
        }
    }

    #[test]
    fn tcp_resets_come_from_the_snmp_tcp_lines() {
        let snmp = "Ip: Forwarding DefaultTTL\nIp: 1 64\n\
            Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors\n\
            Tcp: 1 200 120000 -1 10 5 1 7 2 100 90 0 0 3 0\n\
            Udp: InDatagrams\nUdp: 4\n";
        assert_eq!(parse_tcp_resets(snmp), Some((7, 3)));
        assert_eq!(parse_tcp_resets("Tcp: EstabResets\n"), None);
        assert_eq!(parse_tcp_resets("Tcp: A B\nTcp: 1 2\n"), None);
        assert_eq!(parse_tcp_resets(""), None);
    }

    #[test]
    fn migration_times_are_the_targets_first_and_the_sources_last_frame() {
        let polls = [
            (1.0, 100, 5),
            (3.0, 110, 5),
            (5.0, 120, 9),
            (7.0, 125, 30),
            (9.0, 125, 60),
            (11.0, 125, 90),
        ];
        assert_eq!(migration_times(100, 5, &polls), (Some(5.0), Some(7.0)));
        // Neither moved: no time.
        assert_eq!(migration_times(125, 90, &polls[4..]), (None, None));
    }

    #[test]
    fn migration_throughput_windows() {
        // 100 ms intervals from 0 (the scenario's clock, no offset); the move's
        // command at 2000 ms takes 250 ms, the next event is at 4000 ms.
        let t: Vec<(f64, f64)> = (1..=60)
            .map(|i| {
                let end = i as f64 / 10.0;
                let mbps = match i {
                    ..=20 => 100.0,
                    21..=23 => 40.0,
                    _ => 200.0,
                };
                (end, mbps)
            })
            .collect();
        let m = migration_throughput("paced", &t, 0.0, 0.0, 2000.0, 250.0, 4000.0);
        assert_eq!(m.streams, "paced");
        // Before: intervals ending in (500, 2000]: all 100.
        assert_eq!(m.before_mbps, Some(100.0));
        // During: the intervals overlapping (2000, 2250): 2.0-2.1, 2.1-2.2, 2.2-2.3.
        assert_eq!(m.during_mbps, Some(40.0));
        assert_eq!(m.during_worst_mbps, Some(40.0));
        // After: starting at or after 2250 and ending by 4000: 2.3..=4.0, all 200.
        assert_eq!(m.after_mbps, Some(200.0));
        // A previous event ending late leaves no "before".
        let m = migration_throughput("paced", &t, 0.0, 2000.0, 2000.0, 250.0, 4000.0);
        assert_eq!(m.before_mbps, None);
        assert_eq!(m.after_mbps, Some(200.0));
    }

    #[test]
    fn duplicates_need_overlap_and_different_clients() {
        // Same external port, one after the other: a freed mapping reused. Fine.
        assert!(duplicate_mappings(&[s(0, 10, 1, 5000), s(20, 30, 2, 5000)]).is_empty());
        // Overlapping, different external ports: fine.
        assert!(duplicate_mappings(&[s(0, 10, 1, 5000), s(5, 30, 2, 5001)]).is_empty());
        // Overlapping, same external port, different client ports: a duplicate.
        assert_eq!(
            duplicate_mappings(&[s(0, 10, 1, 5000), s(5, 30, 2, 5000)]).len(),
            1
        );
    }

    #[test]
    fn p99_ignores_failures_and_windows() {
        let mut v: Vec<ConnSample> = (0..100)
            .map(|i| ConnSample {
                setup_us: i + 1,
                ..s(i * 10, i * 10 + 5, i as u16, 1)
            })
            .collect();
        v.push(ConnSample {
            setup_us: 1_000_000,
            outcome: Outcome::Failed("x".into()),
            ..s(5, 6, 1, 1)
        });
        assert_eq!(p99_setup_us(&v, 0, u64::MAX), Some(99));
        assert_eq!(p99_setup_us(&v, 0, 100), Some(10));
        assert_eq!(p99_setup_us(&v, 10_000, 20_000), None);
        // The median by nearest rank: the 50th of 1..=100, and of a window's 1..=10 the 5th.
        assert_eq!(setup_quantile_us(&v, 0, u64::MAX, 0.5), Some(50));
        assert_eq!(setup_quantile_us(&v, 0, 100, 0.5), Some(5));
        assert_eq!(setup_quantile_us(&v, 0, u64::MAX, 1.0), Some(100));
    }

    #[test]
    fn http_answer_parsing() {
        let a = b"HTTP/1.1 200 OK\r\nServer: nginx\r\nContent-Length: 24\r\n\r\ninet 198.18.201.1:40000\n";
        let peer = parse_answer(a).unwrap().unwrap();
        assert_eq!(peer, "198.18.201.1:40000".parse().unwrap());
        assert!(parse_answer(b"HTTP/1.1 200 OK\r\nServer: nginx\r\n").is_none());
        assert!(parse_answer(b"HTTP/1.1 502 Bad\r\n\r\nx\n")
            .unwrap()
            .is_err());
    }

    #[test]
    fn iperf_stalls_are_per_stream_runs_of_empty_intervals() {
        let iv = |b0: u64, b1: u64| {
            serde_json::json!({"sum": {"seconds": 0.1, "end": 0.0, "bits_per_second": 8.0 * (b0 + b1) as f64 * 10.0},
                 "streams": [{"bytes": b0}, {"bytes": b1}]})
        };
        let v = serde_json::json!({
            "intervals": [iv(10, 10), iv(0, 10), iv(0, 10), iv(0, 10), iv(10, 0), iv(10, 10)],
            "end": {"sum_sent": {"bits_per_second": 1e6, "retransmits": 3}}
        });
        let r = parse_iperf(&v.to_string()).unwrap();
        assert!(r.error.is_none());
        assert_eq!(r.streams, 2);
        assert!((r.max_stall_s - 0.3).abs() < 1e-9, "{}", r.max_stall_s);
        assert_eq!(r.retransmits, 3);
        let e = parse_iperf(
            r#"{"error": "unable to receive results: Connection reset by peer", "intervals": []}"#,
        )
        .unwrap();
        assert!(e.error.unwrap().contains("reset"));
    }
}
