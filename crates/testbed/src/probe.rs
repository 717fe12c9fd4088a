//! Failover measured the way Zeta measures it (paper 003 §VIII-C.2): a probe every
//! 0.5 ms, and the recovery time is the number of probes lost in a row times 0.5 ms.
//!
//! A probe here is a UDP datagram from the VPC client through starfabric's chain (SNAT)
//! to an echo server on the internet host, and its echo back: both directions cross the
//! PP cluster. Each probe *flow* (one source port) is hashed by the underlay onto one vIP
//! per direction, so the prober runs several flows at once, each with its own probe
//! every 0.5 ms: whichever PP node fails, some flows cross it, and their longest run of
//! lost probes is the outage they saw. Flows that lost nothing crossed only survivors.
//!
//! Sender, receivers and the echo server are threads of this process that enter the
//! namespaces (no binaries of ours in the path), so only the platform is measured.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracing::warn;

use crate::elastic::enter_netns;
use crate::topo::{addr, Node, Testbed};
use crate::{Error, Result};

/// The echo server's port on the internet host.
pub const ECHO_PORT: u16 = 7;
/// Probe payload: flow index, sequence number (both big endian), then padding.
const PROBE_LEN: usize = 32;

/// What to send.
#[derive(Debug, Clone)]
pub struct ProbeSpec {
    pub client: usize,
    pub flows: usize,
    pub interval: Duration,
    /// The prober stops by itself after this long, whatever happens to its caller.
    pub limit: Duration,
}

impl ProbeSpec {
    /// 8 flows from VPC 0, each with a probe every 0.5 ms.
    pub fn new() -> Self {
        ProbeSpec {
            client: 0,
            flows: 8,
            interval: Duration::from_micros(500),
            limit: Duration::from_secs(120),
        }
    }
}

impl Default for ProbeSpec {
    fn default() -> Self {
        Self::new()
    }
}

/// One probe flow's result.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FlowProbes {
    pub local_port: u16,
    pub sent: u64,
    pub received: u64,
    /// The longest run of consecutive lost probes (not counting the last 200 ms, whose
    /// echoes may still have been on their way).
    pub longest_loss_run: u64,
    /// ms since the prober started at which that run began.
    pub loss_run_start_ms: f64,
    /// Every run of lost probes: (ms since the prober started, probes lost). A flow's
    /// first probes wait for its rule, so the longest run may be at the start and not
    /// at the event a window looks at.
    pub loss_runs: Vec<(f64, u64)>,
}

/// All flows.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ProbeReport {
    pub interval_us: u64,
    pub flows: Vec<FlowProbes>,
    pub sent: u64,
    pub received: u64,
    /// Flows that lost at least one probe.
    pub flows_with_loss: usize,
    /// Longest run of lost probes of any flow × the interval: the outage of the worst
    /// affected flow, Zeta's "recovery delay".
    pub recovery_ms: f64,
    /// Where the scenario's clock (its event times) starts on the prober's.
    pub scenario_t0_ms: f64,
}

impl ProbeReport {
    /// The longest loss run of any flow that started within [from_ms, to_ms).
    pub fn recovery_ms_between(&self, from_ms: f64, to_ms: f64) -> f64 {
        let us = self.interval_us as f64 / 1000.0;
        self.flows
            .iter()
            .flat_map(|f| f.loss_runs.iter())
            .filter(|(t, _)| *t >= from_ms && *t < to_ms)
            .map(|(_, n)| *n as f64 * us)
            .fold(0.0, f64::max)
    }

    /// Flows that lost a probe in a run starting within [from_ms, to_ms).
    pub fn flows_with_loss_between(&self, from_ms: f64, to_ms: f64) -> usize {
        self.flows
            .iter()
            .filter(|f| f.loss_runs.iter().any(|(t, _)| *t >= from_ms && *t < to_ms))
            .count()
    }
}

/// A UDP echo server on the internet host ([`ECHO_PORT`]).
pub struct EchoServer {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<u64>>,
}

impl EchoServer {
    pub fn start(tb: &Testbed) -> Result<EchoServer> {
        let ns = Path::new("/run/netns").join(tb.ns(Node::Inet));
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let handle = std::thread::spawn(move || -> u64 {
            let sock = match enter_netns(&ns)
                .and_then(|_| {
                    UdpSocket::bind(SocketAddrV4::new(addr::INET, ECHO_PORT))
                        .map_err(|e| Error::io("bind the echo server", e))
                })
                .and_then(|s| {
                    s.set_read_timeout(Some(Duration::from_millis(50)))
                        .map_err(|e| Error::io("echo server", e))?;
                    Ok(s)
                }) {
                Ok(s) => {
                    let _ = ready_tx.send(Ok(()));
                    s
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return 0;
                }
            };
            let mut buf = [0u8; 2048];
            let mut n = 0u64;
            while !st.load(Ordering::Relaxed) {
                if let Ok((len, from)) = sock.recv_from(&mut buf) {
                    let _ = sock.send_to(&buf[..len], from);
                    n += 1;
                }
            }
            n
        });
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .map_err(|_| Error::Setup("the echo server did not start".into()))??;
        Ok(EchoServer {
            stop,
            handle: Some(handle),
        })
    }

    /// Stop it; returns how many datagrams it echoed.
    pub fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.take().and_then(|h| h.join().ok()).unwrap_or(0)
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

struct Flow {
    sock: UdpSocket,
    port: u16,
    /// Send time (µs since t0) of each sequence number, and whether it came back.
    sent_us: Vec<u64>,
    got: Vec<bool>,
}

/// A running prober.
pub struct Prober {
    stop: Arc<AtomicBool>,
    t0: Instant,
    interval: Duration,
    handle: Option<JoinHandle<Result<Vec<FlowProbes>>>>,
}

impl Prober {
    /// Start probing the internet host's echo server from `spec.client`.
    pub fn start(tb: &Testbed, spec: &ProbeSpec) -> Result<Prober> {
        if spec.flows == 0 || spec.interval.is_zero() {
            return Err(Error::Setup("probing needs flows and an interval".into()));
        }
        let ns = Path::new("/run/netns").join(tb.ns(Node::Client(spec.client)));
        let stop = Arc::new(AtomicBool::new(false));
        let t0 = Instant::now();
        let st = stop.clone();
        let interval = spec.interval;
        let spec = spec.clone();
        let handle = std::thread::spawn(move || run(&ns, &spec, &st, t0));
        Ok(Prober {
            stop,
            t0,
            interval,
            handle: Some(handle),
        })
    }

    pub fn t0(&self) -> Instant {
        self.t0
    }

    /// Stop (after the last echoes had 200 ms to come back) and report.
    pub fn stop(mut self) -> Result<ProbeReport> {
        self.stop.store(true, Ordering::Relaxed);
        let flows = self
            .handle
            .take()
            .ok_or_else(|| Error::Setup("prober already stopped".into()))?
            .join()
            .map_err(|_| Error::Setup("prober thread panicked".into()))??;
        let us = self.interval.as_micros() as u64;
        let recovery_ms = flows
            .iter()
            .map(|f| f.longest_loss_run as f64 * us as f64 / 1000.0)
            .fold(0.0, f64::max);
        Ok(ProbeReport {
            interval_us: us,
            sent: flows.iter().map(|f| f.sent).sum(),
            received: flows.iter().map(|f| f.received).sum(),
            flows_with_loss: flows.iter().filter(|f| f.received < f.sent).count(),
            recovery_ms,
            flows,
            scenario_t0_ms: 0.0,
        })
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn run(ns: &Path, spec: &ProbeSpec, stop: &AtomicBool, t0: Instant) -> Result<Vec<FlowProbes>> {
    enter_netns(ns)?;
    let target = SocketAddrV4::new(addr::INET, ECHO_PORT);
    let mut flows = Vec::with_capacity(spec.flows);
    for _ in 0..spec.flows {
        let sock = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
            .map_err(|e| Error::io("probe socket", e))?;
        sock.connect(target)
            .map_err(|e| Error::io("probe socket", e))?;
        sock.set_nonblocking(true)
            .map_err(|e| Error::io("probe socket", e))?;
        let port = sock
            .local_addr()
            .map_err(|e| Error::io("probe socket", e))?
            .port();
        flows.push(Flow {
            sock,
            port,
            sent_us: Vec::new(),
            got: Vec::new(),
        });
    }
    let mut buf = [0u8; 2048];
    let mut next = Instant::now();
    let mut stopping: Option<Instant> = None;
    loop {
        let now = Instant::now();
        if stopping.is_none() && (stop.load(Ordering::Relaxed) || now - t0 > spec.limit) {
            stopping = Some(now);
        }
        if stopping.is_some_and(|s| now - s > Duration::from_millis(200)) {
            break;
        }
        if stopping.is_none() && now >= next {
            // Behind schedule (the thread was not run for a while) the missed probes
            // are not sent late in a burst: the outage would look shorter than it was.
            while next + spec.interval <= now {
                next += spec.interval;
            }
            next += spec.interval;
            let t_us = now.duration_since(t0).as_micros() as u64;
            for (i, f) in flows.iter_mut().enumerate() {
                let seq = f.sent_us.len() as u32;
                let mut p = [0u8; PROBE_LEN];
                p[..4].copy_from_slice(&(i as u32).to_be_bytes());
                p[4..8].copy_from_slice(&seq.to_be_bytes());
                match f.sock.send(&p) {
                    Ok(_) => {
                        f.sent_us.push(t_us);
                        f.got.push(false);
                    }
                    // A full socket buffer or an ICMP error on the connected socket:
                    // nothing was sent, nothing is counted.
                    Err(e) => warn!(port = f.port, error = %e, "probe not sent"),
                }
            }
        }
        for f in flows.iter_mut() {
            while let Ok(n) = f.sock.recv(&mut buf) {
                if n >= 8 {
                    let seq = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
                    if let Some(g) = f.got.get_mut(seq) {
                        *g = true;
                    }
                }
            }
        }
        let wait = next.saturating_duration_since(Instant::now());
        std::thread::sleep(wait.min(Duration::from_micros(200)));
    }
    Ok(flows.into_iter().map(summarize).collect())
}

fn summarize(f: Flow) -> FlowProbes {
    let (mut best, mut best_start, mut run, mut run_start) = (0u64, 0u64, 0u64, 0u64);
    let mut runs = Vec::new();
    for (i, &g) in f.got.iter().enumerate() {
        if g {
            if run > 0 {
                runs.push((run_start as f64 / 1000.0, run));
            }
            run = 0;
        } else {
            if run == 0 {
                run_start = f.sent_us[i];
            }
            run += 1;
            if run > best {
                best = run;
                best_start = run_start;
            }
        }
    }
    if run > 0 {
        runs.push((run_start as f64 / 1000.0, run));
    }
    FlowProbes {
        loss_runs: runs,
        local_port: f.port,
        sent: f.got.len() as u64,
        received: f.got.iter().filter(|g| **g).count() as u64,
        longest_loss_run: best,
        loss_run_start_ms: best_start as f64 / 1000.0,
    }
}

/// Datagrams received, with their sources, in arrival order.
pub type Datagrams = Vec<(SocketAddrV4, Vec<u8>)>;

/// A UDP receiver on the internet host that keeps every datagram it gets, with its
/// source: what arrived, and how often (docs/fabric.md's single-datagram flows).
pub struct UdpSink {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Datagrams>>,
}

impl UdpSink {
    /// Listen on the internet host's address, `port`.
    pub fn start(tb: &Testbed, port: u16) -> Result<UdpSink> {
        let ns = Path::new("/run/netns").join(tb.ns(Node::Inet));
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let handle = std::thread::spawn(move || {
            let sock = match enter_netns(&ns)
                .and_then(|_| {
                    UdpSocket::bind(SocketAddrV4::new(addr::INET, port))
                        .map_err(|e| Error::io("bind the UDP sink", e))
                })
                .and_then(|s| {
                    s.set_read_timeout(Some(Duration::from_millis(50)))
                        .map_err(|e| Error::io("UDP sink", e))?;
                    Ok(s)
                }) {
                Ok(s) => {
                    let _ = ready_tx.send(Ok(()));
                    s
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return Vec::new();
                }
            };
            let mut got = Vec::new();
            let mut buf = [0u8; 2048];
            while !st.load(Ordering::Relaxed) {
                if let Ok((len, std::net::SocketAddr::V4(from))) = sock.recv_from(&mut buf) {
                    got.push((from, buf[..len].to_vec()));
                }
            }
            got
        });
        ready_rx
            .recv_timeout(Duration::from_secs(5))
            .map_err(|_| Error::Setup("the UDP sink did not start".into()))??;
        Ok(UdpSink {
            stop,
            handle: Some(handle),
        })
    }

    /// Stop it; every datagram it received, in arrival order.
    pub fn stop(mut self) -> Datagrams {
        self.stop.store(true, Ordering::Relaxed);
        self.handle
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default()
    }
}

impl Drop for UdpSink {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Send each of `payloads` from VPC client `client` to the internet host's `port` as a
/// flow of its own: one datagram from a fresh socket (a new source port), `gap` apart.
/// Returns the source ports used.
pub fn single_datagram_flows(
    tb: &Testbed,
    client: usize,
    port: u16,
    payloads: Vec<Vec<u8>>,
    gap: Duration,
) -> Result<Vec<u16>> {
    let ns = Path::new("/run/netns").join(tb.ns(Node::Client(client)));
    std::thread::spawn(move || -> Result<Vec<u16>> {
        enter_netns(&ns)?;
        let target = SocketAddrV4::new(addr::INET, port);
        let mut ports = Vec::with_capacity(payloads.len());
        // Kept open until all are sent, so no source port is used twice.
        let mut socks = Vec::with_capacity(payloads.len());
        for p in &payloads {
            let sock = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
                .map_err(|e| Error::io("flow socket", e))?;
            sock.send_to(p, target)
                .map_err(|e| Error::io("send a datagram", e))?;
            ports.push(
                sock.local_addr()
                    .map_err(|e| Error::io("flow socket", e))?
                    .port(),
            );
            socks.push(sock);
            std::thread::sleep(gap);
        }
        Ok(ports)
    })
    .join()
    .map_err(|_| Error::Setup("the sender thread panicked".into()))?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(got: &[bool]) -> Flow {
        Flow {
            sock: UdpSocket::bind("127.0.0.1:0").unwrap(),
            port: 1,
            sent_us: (0..got.len() as u64).map(|i| i * 500).collect(),
            got: got.to_vec(),
        }
    }

    #[test]
    fn the_longest_run_of_losses_is_the_outage() {
        let f = summarize(flow(&[
            true, false, true, false, false, false, true, false, false, true,
        ]));
        assert_eq!(f.sent, 10);
        assert_eq!(f.received, 4);
        assert_eq!(f.longest_loss_run, 3);
        assert_eq!(f.loss_run_start_ms, 1.5);
        assert_eq!(f.loss_runs, vec![(0.5, 1), (1.5, 3), (3.5, 2)]);
        let f = summarize(flow(&[true, true]));
        assert_eq!(f.longest_loss_run, 0);
    }

    #[test]
    fn recovery_is_the_worst_flows_run_in_the_window() {
        let r = ProbeReport {
            interval_us: 500,
            flows: vec![
                FlowProbes {
                    longest_loss_run: 20,
                    loss_run_start_ms: 1000.0,
                    loss_runs: vec![(1000.0, 20)],
                    ..Default::default()
                },
                FlowProbes {
                    longest_loss_run: 50,
                    loss_run_start_ms: 10.0,
                    // A start-up loss longer than its loss at the event.
                    loss_runs: vec![(10.0, 50), (1010.0, 4)],
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        assert_eq!(r.recovery_ms_between(900.0, 1100.0), 10.0);
        assert_eq!(r.flows_with_loss_between(900.0, 1100.0), 2);
        assert_eq!(r.recovery_ms_between(0.0, 100.0), 25.0);
        assert_eq!(r.recovery_ms_between(2000.0, 3000.0), 0.0);
    }
}
