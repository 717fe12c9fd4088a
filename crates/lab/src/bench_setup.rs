//! `starfabric bench setup`: new flows per second and first-packet latency through the
//! whole control path on loopback: PP miss → FM → SC head → middle → tail → FM → PP
//! install and release.
//!
//! Everything runs in this process but talks real gRPC over 127.0.0.1: an FM (its own
//! tokio runtime), three SC nodes (each on its own runtime thread, as separate processes
//! would be), and a PP pipeline worker with the FM client. The worker's packet source
//! makes one packet per new flow and stamps the flow's number into its payload; the
//! packet's release after the rule is installed stops the flow's clock.
//!
//! Two measurements, each `--seconds` long:
//! - *saturated*: as many new flows in flight as `--window` allows, to find the most
//!   flows per second the path sustains (`flows_per_s`);
//! - *paced*: new flows offered open-loop at `--rate` per second, for the latency at
//!   that load (`p50_us`, `p99_us`).

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use pipeline::{
    Desc, IoError, MonotonicClock, NodeAddr, PacketIo, Pipeline, PipelineConfig, Verdict,
    VpcBinding, Worker, FRAME_SIZE, HEADROOM,
};
use pp::{FmClient, FmClientConfig};
use proto::ChainDef;
use serde::Serialize;

use crate::setup_workload::{PacedBy, SetupTrace, SetupWorkload, WARMUP_MAX_FLOWS};

#[derive(Args, Clone, Debug)]
pub struct SetupBenchArgs {
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
    /// Offered new flows per second for the latency measurement.
    #[arg(long, default_value_t = 50_000.0)]
    pub rate: f64,
    /// New flows in flight at most in the saturated measurement.
    #[arg(long, default_value_t = 2048)]
    pub window: usize,
    /// How long the PP FM client waits to fill a batch, in microseconds.
    #[arg(long, default_value_t = 100)]
    pub linger_us: u64,
    /// FM's runtime threads. One by default: this process is a 2-core node hosting
    /// every plane, and a second FM thread there costs more in wake-ups and stealing
    /// than it adds (docs/setup-path.md, "FM on one runtime thread"). 2 is what
    /// `starfabric fm` runs by default.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub fm_threads: u64,
    /// Each SC node's runtime threads (`ScConfig::io_threads`; `starfabric sc` runs 2).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub sc_threads: u64,
    /// NFs of the chain: `test` (the SC crate's deterministic FW → SNAT → LB) or
    /// `builtin` (nfs' firewall, SNAT and load balancer).
    #[arg(long, default_value = "test")]
    pub nfs: String,
    /// SC groups serving the chain: its key-hash space split into this many equal
    /// partitions, one group of 3 replicas each, all on the same 3 SC nodes (every node
    /// hosts one replica of every group).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub groups: u32,
    /// Run every plane link in plaintext (lab use; docs/security.md). Default: mTLS, as
    /// production runs (a CA made in-process, a certificate per node).
    #[arg(long)]
    pub insecure: bool,
    /// mTLS, the default: accepted so older scripts that ask for it keep working.
    #[arg(long, hide = true, conflicts_with = "insecure")]
    pub tls: bool,
    /// Write every set-up flow of the saturated and paced measurements to FILE, one line
    /// each: `phase done_us latency_us` (phase `saturated` or `paced`; `done_us`, when
    /// the flow's packet was released, counts from the measurement's start). Shows where
    /// in a run the slow flows are: a pause stalls a block of consecutive flows, where
    /// load alone spreads them out.
    #[arg(long, value_name = "FILE")]
    pub latency_log: Option<std::path::PathBuf>,
    /// The chain and the new flows from a workload file (JSON; docs/benchmarks.md,
    /// "Setup workload"): `nfs` replaces `--nfs`'s chain, `flows` or `flows_csv` the
    /// generated flows, and `paced: "trace"` offers the paced measurement's flows at
    /// their own times instead of at `--rate`.
    #[arg(long, value_name = "FILE")]
    pub workload: Option<std::path::PathBuf>,
    /// Pack the planes' control threads onto the fewest CPUs that keep up, as a node
    /// does with `--pack-cpus` (`off`, the nodes' default too; `auto`; or a CPU list;
    /// docs/corepack.md). The bench's PP worker is data path and is never moved, as on
    /// a PP node.
    #[arg(long, env = "STARFABRIC_PACK_CPUS", default_value = "off", value_parser = parse_pack)]
    pub pack_cpus: corepack::PackSpec,
}

fn parse_pack(s: &str) -> Result<corepack::PackSpec, String> {
    s.parse()
}

/// What the control-thread packer did during the run (`--pack-cpus`).
#[derive(Serialize, Debug, Default)]
pub struct PackReport {
    /// `auto`, `off` or the CPU list.
    pub spec: String,
    /// CPUs the control threads could use at the end of the saturated and the paced
    /// measurement.
    pub active_saturated: usize,
    pub active_paced: usize,
    pub cpus: usize,
    pub grows: u64,
    pub shrinks: u64,
    pub failed_probes: u64,
}

/// Results; field names are the documented JSON interface.
#[derive(Serialize, Debug)]
pub struct SetupBench {
    /// New flows per second, saturated (window of `window` flows in flight).
    pub flows_per_s: f64,
    /// First-packet latency at `rate` offered flows per second, microseconds.
    pub p50_us: f64,
    pub p99_us: f64,
    /// Offered and achieved rate of the latency measurement.
    pub rate: f64,
    pub paced_flows_per_s: f64,
    pub p999_us: f64,
    pub max_us: f64,
    /// Latency in the saturated measurement.
    pub saturated_p50_us: f64,
    pub saturated_p99_us: f64,
    pub window: usize,
    pub chain: String,
    /// Flows that did not complete (dropped or timed out), both measurements.
    pub failed: u64,
    /// Mean requests per PP → FM batch and per FM → SC submit.
    pub pp_batch: f64,
    pub fm_batch: f64,
    pub seconds: f64,
    /// SC groups (partitions) serving the chain.
    pub groups: u32,
    /// Nodes FM declared dead (missed heartbeats or a broken session) from the SC
    /// groups forming to the end of the run: the PP node and the 3 SC nodes are all
    /// live throughout, so anything but 0 is a false suspicion.
    pub session_drops: u64,
    /// Rule requests FM refused as `setup-overload` during the measurements (counted
    /// in `failed` too when their flow did not complete).
    pub setup_overload: u64,
    /// CPU time the whole process (PP worker and FM client, FM, the three SC nodes)
    /// spent per flow set up in the saturated measurement, microseconds: the setup
    /// path's cost, which unlike `flows_per_s` does not move with what else the
    /// machine runs.
    pub cpu_us_per_flow: f64,
    /// Page faults the whole process took per flow set up in the saturated
    /// measurement: the fresh memory the flows' state is faulted into. Part of
    /// `cpu_us_per_flow`, and the part a virtual machine prices very differently from
    /// bare metal (docs/setup-path.md, "First touch of memory on this VM").
    pub faults_per_flow: f64,
    /// The same CPU per flow in the paced measurement, where at low rates each flow
    /// is a batch of its own and costs far more (docs/setup-path.md, "What a flow
    /// costs at a few thousand a second").
    pub paced_cpu_us_per_flow: f64,
    /// The control-thread packer (`--pack-cpus`).
    pub pack: PackReport,
    /// Flows set up in the saturated measurement.
    pub saturated_flows: u64,
    /// Allocations per flow set up in the saturated measurement, over the whole
    /// process, and the bytes they asked for; `null` unless the binary was built with
    /// `--features alloc-count` (docs/setup-path.md).
    pub allocs_per_flow: Option<f64>,
    pub alloc_bytes_per_flow: Option<f64>,
    /// The same, by thread name (threads of one name added up), largest first; only
    /// threads with at least 0.01 per flow.
    pub allocs_per_flow_by_thread: Option<Vec<(String, f64)>>,
    /// FM's runtime threads in this run (`--fm-threads`).
    pub fm_threads: u64,
    /// Each SC node's runtime threads in this run (`--sc-threads`).
    pub sc_threads: u64,
    /// Flows the chain's policy dropped (a drop rule came back), both measurements: they
    /// were decided, so they are not in `failed`, and they have no release to time.
    pub denied: u64,
    /// How the paced measurement offered its flows: `rate` (`--rate`) or `trace` (the
    /// workload's `at_us` times; `rate` is then the rate they came at).
    pub paced_by: &'static str,
    /// `--workload`: its name (`null` without one), then its flows, the flows the
    /// measurements took from it, and whether a measurement ran out of them before its
    /// time was up (these three also `null` when it lists no flows).
    pub workload: Option<String>,
    pub workload_flows: Option<u64>,
    pub workload_flows_used: Option<u64>,
    pub workload_exhausted: Option<bool>,
}

/// One thread's allocations so far, as an `alloc-count` build counts them.
#[derive(Debug, Clone)]
pub struct ThreadAllocs {
    /// The counter's slot: a thread's for its life.
    pub slot: usize,
    pub name: String,
    pub allocs: u64,
    pub bytes: u64,
}

/// Set by a binary built with `--features alloc-count`: each thread's allocation
/// counts so far.
pub static ALLOC_SNAPSHOT: std::sync::OnceLock<fn() -> Vec<ThreadAllocs>> =
    std::sync::OnceLock::new();

/// Allocations between two snapshots, per flow: (total, bytes, by thread name).
fn allocs_per_flow(
    before: &[ThreadAllocs],
    after: &[ThreadAllocs],
    flows: u64,
) -> (f64, f64, Vec<(String, f64)>) {
    let flows = flows.max(1) as f64;
    let mut by_name: std::collections::BTreeMap<String, u64> = Default::default();
    let (mut total, mut bytes) = (0u64, 0u64);
    for a in after {
        let b = before.iter().find(|b| b.slot == a.slot);
        let n = a.allocs - b.map_or(0, |b| b.allocs);
        total += n;
        bytes += a.bytes - b.map_or(0, |b| b.bytes);
        *by_name.entry(a.name.clone()).or_default() += n;
    }
    let mut named: Vec<(String, f64)> = by_name
        .into_iter()
        .map(|(k, n)| (k, n as f64 / flows))
        .filter(|(_, v)| *v >= 0.01)
        .collect();
    named.sort_by(|a, b| b.1.total_cmp(&a.1));
    (total as f64 / flows, bytes as f64 / flows, named)
}

/// CPU time (user + system) of this process so far, in seconds.
/// The whole process's CPU seconds (user + system) and page faults so far.
fn process_usage() -> (f64, u64) {
    // SAFETY: getrusage writes into the zeroed struct we pass and reads nothing else.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is always valid.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) } != 0 {
        return (f64::NAN, 0);
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    let faults = (u.ru_minflt as u64).saturating_add(u.ru_majflt as u64);
    (tv(u.ru_utime) + tv(u.ru_stime), faults)
}

const VNI: u32 = 100;
/// The service the generated flows ask for (UDP port 53); the built-in chains balance it.
pub(crate) const SERVICE: Ipv4Addr = Ipv4Addr::new(198, 19, 0, 100);
const SNAT_ADDRS: usize = 32;

fn chain(nfs: &str) -> Result<ChainDef> {
    chain_of(builtin_nfs(nfs)?, nf::PartitionBy::Flow)
}

/// The NFs `--nfs` names, as a chain's `nfs` JSON.
fn builtin_nfs(nfs: &str) -> Result<serde_json::Value> {
    let addrs: Vec<String> = (0..SNAT_ADDRS)
        .map(|i| format!("198.19.255.{}", i + 1))
        .collect();
    let nfs = match nfs {
        "test" => serde_json::json!([
            {"kind": "test-fw", "deny_dports": [23]},
            {"kind": "test-snat", "addrs": addrs, "ports": [1024, 65535]},
            {"kind": "test-lb", "vip": SERVICE.to_string(), "port": 53,
             "backend": "198.19.1.7", "backend_port": 5353}
        ]),
        "builtin" => serde_json::json!([
            {"kind": "fw", "tenants": [{"tenant": 1, "default_action": "allow", "rules": [
                {"action": "deny", "proto": "tcp", "dport": 23}]}]},
            {"kind": "snat", "pools": [{"addresses": addrs, "ports": {"lo": 1024, "hi": 65535}}]},
            {"kind": "lb", "services": [{"vip": SERVICE.to_string(), "port": 53, "protocol": "udp",
                "backends": [{"addr": "198.19.1.7", "port": 5353}]}]}
        ]),
        other => bail!("unknown --nfs {other:?} (test or builtin)"),
    };
    Ok(nfs)
}

/// Tenant 1's chain 1 of `nfs`, with the bench's VXLAN egress both ways.
pub(crate) fn chain_of(nfs: serde_json::Value, partition: nf::PartitionBy) -> Result<ChainDef> {
    let mut def: ChainDef = serde_json::from_value(serde_json::json!({
        "tenant": 1, "chain": 1, "nfs": nfs,
        "forward": {"decap": true, "encap": {"dst": "198.18.0.9", "vni": 200}, "output": 1},
        "reverse": {"decap": true, "encap": {"dst": "198.18.0.50", "vni": 100}, "output": 1}
    }))?;
    def.partition = partition;
    Ok(def)
}

enum Pace {
    Window(usize),
    Rate(f64),
    /// At the workload's own arrival times (`SetupTrace::at_ns`).
    Trace,
}

/// A workload's flows as a measurement takes them: flow number `base + k` is the
/// trace's flow `start + k`.
struct TraceSource {
    trace: Arc<SetupTrace>,
    start: usize,
    /// Frames of one UDP and one TCP SYN flow (VXLAN, VNI 100); `write` makes them
    /// another flow's.
    udp: Vec<u8>,
    tcp: Vec<u8>,
}

/// Inner frame offsets in the bench's VXLAN frames.
const INNER_IP: usize = packet::build::VXLAN_V4_OVERHEAD + 14;
const INNER_L4: usize = INNER_IP + 20;

impl TraceSource {
    fn new(trace: Arc<SetupTrace>, start: usize) -> Self {
        use packet::build::{tcp_v4, udp_v4, vxlan_wrap};
        let wrap =
            |inner: Vec<u8>| vxlan_wrap([198, 18, 0, 50], [198, 18, 0, 1], 50000, VNI, &inner);
        TraceSource {
            trace,
            start,
            udp: wrap(udp_v4([0; 4], 1, [0; 4], 1, &[0u8; 18])),
            tcp: wrap(tcp_v4(
                [0; 4],
                1,
                [0; 4],
                1,
                packet::tcp_flags::SYN,
                1,
                &[0u8; 8],
            )),
        }
    }

    /// Write trace flow `i`'s first packet, ending in the flow number `id`, into `out`;
    /// the frame's length.
    fn write(&self, i: usize, id: u64, out: &mut [u8]) -> usize {
        use packet::csum::{checksum, pseudo_v4};
        let f = &self.trace.flows[i];
        let (tpl, csum_at) = if f.proto == packet::proto::TCP {
            (&self.tcp, INNER_L4 + 16)
        } else {
            (&self.udp, INNER_L4 + 6)
        };
        let len = tpl.len();
        let out = &mut out[..len];
        out.copy_from_slice(tpl);
        out[INNER_IP + 12..INNER_IP + 16].copy_from_slice(&f.src.octets());
        out[INNER_IP + 16..INNER_IP + 20].copy_from_slice(&f.dst.octets());
        out[INNER_IP + 10..INNER_IP + 12].fill(0);
        let ip = checksum(0, &out[INNER_IP..INNER_L4]);
        out[INNER_IP + 10..INNER_IP + 12].copy_from_slice(&ip.to_be_bytes());
        out[INNER_L4..INNER_L4 + 2].copy_from_slice(&f.sport.to_be_bytes());
        out[INNER_L4 + 2..INNER_L4 + 4].copy_from_slice(&f.dport.to_be_bytes());
        out[len - 8..].copy_from_slice(&id.to_le_bytes());
        out[csum_at..csum_at + 2].fill(0);
        let l4_len = (len - INNER_L4) as u16;
        let mut c = checksum(
            pseudo_v4(&f.src.octets(), &f.dst.octets(), f.proto, l4_len),
            &out[INNER_L4..],
        );
        if c == 0 && f.proto == packet::proto::UDP {
            // Zero means "no checksum" in UDP over IPv4 (RFC 768).
            c = 0xffff;
        }
        out[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
        len
    }
}

/// Makes one packet per new flow and times each flow from its packet's arrival to its
/// release.
struct FlowGen {
    region: Vec<u8>,
    slots: usize,
    template: Vec<u8>,
    base: u64,
    next: u64,
    stop_generating: bool,
    pace: Pace,
    start: Instant,
    /// Arrival time (ns since `start`) by flow, relative to `base`.
    t_in: Vec<u64>,
    /// Each set-up flow's latency, in the order the flows completed.
    lat_ns: Vec<u64>,
    /// When the latest flow completed (ns since `start`).
    last_done_ns: u64,
    /// When each set-up flow completed, in `lat_ns`' order (kept for `--latency-log`).
    done_at: Option<Vec<u64>>,
    /// Flows known to have failed or been denied (set by the driver from pipeline drop
    /// counters).
    failed: u64,
    /// The workload's flows, if it lists them; else flows are generated.
    trace: Option<TraceSource>,
    /// Generate no more than this many flows.
    limit: u64,
    /// Generation stopped early: the workload's flows or `limit` ran out.
    exhausted: bool,
    /// When generation stopped (ns since `start`).
    stopped_ns: Option<u64>,
}

impl FlowGen {
    fn new(base: u64, pace: Pace, slots: usize) -> Self {
        FlowGen {
            region: vec![0u8; slots * FRAME_SIZE],
            slots,
            template: crate::bench::template(SERVICE),
            base,
            next: base,
            stop_generating: false,
            pace,
            start: Instant::now(),
            t_in: Vec::new(),
            lat_ns: Vec::new(),
            last_done_ns: 0,
            done_at: None,
            failed: 0,
            trace: None,
            limit: u64::MAX,
            exhausted: false,
            stopped_ns: None,
        }
    }

    fn generated(&self) -> u64 {
        self.next - self.base
    }

    fn in_flight(&self) -> u64 {
        self.generated() - self.lat_ns.len() as u64 - self.failed
    }

    /// Stop making flows (the measurement's time is up, or its flows ran out).
    fn stop(&mut self, now_ns: u64) {
        if !self.stop_generating {
            self.stop_generating = true;
            self.stopped_ns = Some(now_ns);
        }
    }

    /// The workload's flows this measurement has not offered yet.
    fn trace_left(&self) -> u64 {
        match &self.trace {
            Some(t) => (t.trace.flows.len() - t.start) as u64 - self.generated(),
            None => u64::MAX,
        }
    }

    /// Flows that may be generated now.
    fn due(&self, now_ns: u64) -> u64 {
        if self.stop_generating {
            return 0;
        }
        let due = match self.pace {
            Pace::Window(w) => (w as u64).saturating_sub(self.in_flight()),
            Pace::Rate(r) => {
                let should = (now_ns as f64 * r / 1e9) as u64;
                should.saturating_sub(self.generated())
            }
            Pace::Trace => match &self.trace {
                Some(t) => {
                    let from = t.start + self.generated() as usize;
                    t.trace.due(t.start, from, now_ns) as u64
                }
                None => 0,
            },
        };
        due.min(self.trace_left())
            .min(self.limit.saturating_sub(self.generated()))
    }

    /// How long an idle worker may sleep: until the next paced flow is due, but at
    /// least `GRAIN`, so that paced flows arrive in small bursts as they would from a
    /// NIC ring rather than one wakeup per flow.
    fn until_due(&self) -> Duration {
        const GRAIN: u64 = 50_000;
        let now = self.start.elapsed().as_nanos() as u64;
        let at = match self.pace {
            Pace::Window(_) => return Duration::from_millis(1),
            Pace::Rate(r) => ((self.generated() + 1) as f64 / r * 1e9) as u64,
            Pace::Trace => match &self.trace {
                Some(t) => t
                    .trace
                    .offset_ns(t.start, t.start + self.generated() as usize)
                    .unwrap_or(now),
                None => now,
            },
        };
        Duration::from_nanos(at.saturating_sub(now).clamp(GRAIN, 1_000_000))
    }

    fn record(&mut self, region: &[u8], descs: &[Desc]) -> usize {
        let now = self.start.elapsed().as_nanos() as u64;
        let mut n = 0;
        for d in descs {
            if let Verdict::Tx(_) = d.verdict {
                let data = d.data(region);
                let Some(id) = data.last_chunk::<8>().map(|b| u64::from_le_bytes(*b)) else {
                    continue;
                };
                if let Some(t) = id
                    .checked_sub(self.base)
                    .and_then(|i| self.t_in.get(i as usize))
                {
                    self.lat_ns.push(now.saturating_sub(*t));
                    self.last_done_ns = now;
                    if let Some(d) = self.done_at.as_mut() {
                        d.push(now);
                    }
                    n += 1;
                }
            }
        }
        n
    }
}

impl PacketIo for FlowGen {
    fn rx(&mut self, descs: &mut Vec<Desc>, max: usize) -> Result<usize, IoError> {
        descs.clear();
        let now = self.start.elapsed().as_nanos() as u64;
        if !self.stop_generating && (self.trace_left() == 0 || self.generated() >= self.limit) {
            self.exhausted = true;
            self.stop(now);
        }
        let n = self.due(now).min(max.min(self.slots) as u64) as usize;
        for i in 0..n {
            let flow = self.next;
            self.next += 1;
            let base = i * FRAME_SIZE;
            let out = &mut self.region[base + HEADROOM..base + FRAME_SIZE];
            let len = match &self.trace {
                Some(t) => t.write(t.start + (flow - self.base) as usize, flow, out),
                None => {
                    let len = self.template.len();
                    let out = &mut out[..len];
                    out.copy_from_slice(&self.template);
                    crate::bench::stamp_flow(out, flow);
                    out[len - 8..].copy_from_slice(&flow.to_le_bytes());
                    len
                }
            };
            self.t_in.push(now);
            descs.push(Desc::new(base, HEADROOM, len, FRAME_SIZE, 0));
        }
        Ok(n)
    }

    fn region(&mut self) -> &mut [u8] {
        &mut self.region
    }

    fn tx(&mut self, descs: &[Desc]) -> Result<usize, IoError> {
        // Packets are held on a miss; a direct transmit means a hit, which a new flow
        // never is.
        let region = std::mem::take(&mut self.region);
        let n = self.record(&region, descs);
        self.region = region;
        Ok(n)
    }

    fn tx_from(&mut self, region: &[u8], descs: &[Desc]) -> Result<usize, IoError> {
        Ok(self.record(region, descs))
    }
}

struct Phase {
    flows_per_s: f64,
    lat_us: Vec<f64>,
    failed: u64,
    /// Flows a drop rule decided (the chain's policy).
    denied: u64,
    /// Flows offered, and per second while they were being offered.
    generated: u64,
    offered_per_s: f64,
    /// The phase ran out of flows before its time was up.
    exhausted: bool,
    /// Process CPU seconds the phase took.
    cpu_s: f64,
    /// Page faults the process took during the phase.
    faults: u64,
}

fn pct(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i.min(v.len() - 1)]
}

/// The `--latency-log` file, with the name of the measurement being written.
type LatencyLog<'a> = (&'static str, &'a mut std::io::BufWriter<std::fs::File>);

/// Run one measurement on a fresh pipeline (fresh flow table) sharing the FM session:
/// flows numbered from `base`, at most `limit` of them, taken from `trace` when given.
fn phase(
    link: &mut Option<pp::WorkerLink>,
    base: u64,
    (pace, limit, trace): (Pace, u64, Option<TraceSource>),
    seconds: f64,
    log: Option<LatencyLog<'_>>,
) -> Result<(Phase, u64, pp::WorkerLink)> {
    let l = link.take().context("worker link")?;
    let mut cfg = PipelineConfig::new(NodeAddr {
        ip: Ipv4Addr::new(198, 18, 0, 1),
        mac: [2, 0, 0, 0, 0, 1],
        gw_mac: [2, 0, 0, 0, 0, 2],
    });
    cfg.flow_capacity = 1 << 20;
    cfg.pending.global = 16384;
    cfg.pending.timeout_ms = 2000;
    let mut p = Pipeline::new(cfg, l.source)?;
    p.bind_vpc(
        VNI,
        VpcBinding {
            tenant: 1,
            chain: 1,
        },
    );
    let mut gen = FlowGen::new(base, pace, pipeline::MAX_BATCH);
    gen.limit = limit;
    gen.trace = trace;
    if log.is_some() {
        gen.done_at = Some(Vec::new());
    }
    let mut w = Worker::new(p, gen, pipeline::MAX_BATCH, Box::new(MonotonicClock::new()));
    let doorbell = l.doorbell;
    let (cpu0, faults0) = process_usage();
    w.io.start = Instant::now();
    let run_for = Duration::from_secs_f64(seconds);
    let drain_limit = run_for + Duration::from_secs(5);
    loop {
        let el = w.io.start.elapsed();
        if el >= run_for {
            w.io.stop(el.as_nanos() as u64);
        }
        let s = w.pipeline.stats();
        w.io.failed = s.total_drops();
        if w.io.stop_generating && w.io.in_flight() == 0 || el >= drain_limit {
            break;
        }
        let before = w.io.lat_ns.len();
        let n = w.run_once()?;
        if n == 0 && w.io.lat_ns.len() == before {
            // Idle: sleep until a reply rings or the next paced flow is due.
            let _ = doorbell.wait_ring(w.io.until_due());
        }
    }
    let (cpu1, faults1) = process_usage();
    let (cpu_s, faults) = (cpu1 - cpu0, faults1.saturating_sub(faults0));
    let s = w.pipeline.stats();
    let done = w.io.lat_ns.len() as u64;
    let denied: u64 = s.rule_drops.iter().sum();
    let failed = w.io.generated().saturating_sub(done + denied);
    if s.total_drops() > denied {
        tracing::warn!(
            drops = s.total_drops() - denied,
            "flows dropped in the setup bench"
        );
    }
    let generated = w.io.generated();
    let exhausted = w.io.exhausted;
    let gen_s = w.io.stopped_ns.map_or(seconds, |n| n as f64 / 1e9);
    let elapsed = w.io.start.elapsed().as_secs_f64().min(seconds + 5.0);
    let last = w.io.last_done_ns as f64 / 1e9;
    let span = if last > 0.0 { last } else { elapsed };
    if let (Some(log), Some(done)) = (log, &w.io.done_at) {
        use std::io::Write;
        for (t, l) in done.iter().zip(&w.io.lat_ns) {
            writeln!(
                log.1,
                "{} {:.1} {:.1}",
                log.0,
                *t as f64 / 1e3,
                *l as f64 / 1e3
            )
            .context("writing the latency log")?;
        }
    }
    let mut lat_us: Vec<f64> = w.io.lat_ns.iter().map(|n| *n as f64 / 1e3).collect();
    lat_us.sort_by(f64::total_cmp);
    let next = w.io.next;
    // Give the rule source back for the next phase.
    let Worker { pipeline, .. } = w;
    drop(pipeline);
    Ok((
        Phase {
            flows_per_s: done as f64 / span,
            lat_us,
            failed,
            denied,
            generated,
            offered_per_s: generated as f64 / gen_s.max(1e-9),
            exhausted,
            cpu_s,
            faults,
        },
        next,
        pp::WorkerLink {
            source: pipeline::RuleSource::None,
            doorbell,
        },
    ))
}

/// The SC nodes' NFs for `--nfs test|builtin` (the benches share it).
/// `groups` equal key-hash ranges of the chain, each its own group.
pub(crate) fn equal_partitions(tenant: u32, chain: u32, groups: u32) -> Vec<proto::v1::Partition> {
    let step = u64::MAX / u64::from(groups);
    (0..u64::from(groups))
        .map(|i| proto::v1::Partition {
            tenant,
            chain,
            hash_lo: i * step,
            hash_hi: if i + 1 == u64::from(groups) {
                u64::MAX
            } else {
                (i + 1) * step - 1
            },
            group: 0,
        })
        .collect()
}

/// The runtime a bench's in-process FM runs on (`--fm-threads`).
pub(crate) fn fm_runtime(threads: u64) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1) as usize)
        .enable_all()
        .build()
}

/// The in-process benches' PKI: one CA per run and a certificate per node of its role,
/// as the orchestrator would issue them; none under `--insecure`.
pub(crate) struct BenchPki(Option<proto::tls::Ca>);

impl BenchPki {
    pub(crate) fn new(insecure: bool) -> Result<Self> {
        Ok(BenchPki(match insecure {
            true => None,
            false => Some(proto::tls::Ca::generate()?),
        }))
    }

    /// Node `id`'s TLS state as `role` (`None` under `--insecure`).
    pub(crate) fn node(
        &self,
        role: proto::tls::Role,
        id: &str,
    ) -> Result<Option<Arc<proto::tls::NodeTls>>> {
        let Some(ca) = &self.0 else { return Ok(None) };
        let ident = proto::tls::Identity::new(role, id)?;
        let b = proto::tls::Bundle::issue(ca, &ident, Duration::from_secs(3600))?;
        Ok(Some(proto::tls::NodeTls::new(&b)?))
    }
}

pub(crate) fn chain_factory(nfs: &str) -> Arc<dyn sc::ChainFactory> {
    match nfs {
        "test" => Arc::new(sc::testing::TestNfs),
        _ => Arc::new(sc::BuiltinNfs),
    }
}

pub fn run(a: SetupBenchArgs) -> Result<SetupBench> {
    // Started first, so every plane thread is one it manages. This thread runs the PP
    // worker (data path).
    corepack::exclude_current_thread();
    let packer = a.pack_cpus.start().context("--pack-cpus")?;
    let pack_stats = || packer.as_ref().map(|p| p.stats()).unwrap_or_default();
    let workload = a.workload.as_deref().map(SetupWorkload::load).transpose()?;
    let (chain, factory, chain_label) =
        match workload.as_ref().and_then(|w| Some((w, w.nfs.as_ref()?))) {
            Some((w, nfs)) => (
                chain_of(serde_json::Value::Array(nfs.clone()), w.partition)?,
                Arc::new(sc::BuiltinNfs) as Arc<dyn sc::ChainFactory>,
                w.chain_label().unwrap_or_default(),
            ),
            None => (
                chain(&a.nfs)?,
                chain_factory(&a.nfs),
                match a.nfs.as_str() {
                    "test" => "test-fw → test-snat → test-lb".into(),
                    _ => "fw → snat → lb".into(),
                },
            ),
        };
    let paced_by = workload.as_ref().map_or(PacedBy::Rate, |w| w.paced);
    let trace = workload
        .as_ref()
        .and_then(|w| w.trace.clone())
        .map(Arc::new);
    let proto_chain = chain.to_proto()?;
    let rt = fm_runtime(a.fm_threads)?;
    let pki = BenchPki::new(a.insecure)?;
    let tls = |role, id: &str| pki.node(role, id);
    let fm_cfg = fm::FmConfig {
        chains: vec![chain],
        tls: tls(proto::tls::Role::Fm, "fm-1")?,
        ..fm::FmConfig::default()
    };
    let local = "127.0.0.1:0".parse()?;
    let fm = rt.block_on(fm::start(fm_cfg, local))?;
    let fm_addr = fm.addr().to_string();
    let groups = a.groups.max(1);
    if groups > 1 {
        let partitions = equal_partitions(proto_chain.tenant, proto_chain.chain, groups);
        rt.block_on(fm.set_desired(vec![proto_chain], partitions, Vec::new()))
            .context("FM")?;
    }
    let d0 = rt.block_on(fm.stats()).context("FM")?.nodes_dead;
    let cpus = sc::workers::allowed_cpus();
    let scs = (0..3)
        .map(|i| {
            let id = format!("sc-{i}");
            let mut c = sc::ScConfig::new(&id, local, &fm_addr);
            // Three nodes on one host: each takes the CPU list turned by its index, as
            // nodes sharing a host should (`ScConfig::worker_cpus`).
            c.worker_cpus = Some(sc::workers::rotated(&cpus, i));
            c.tls = tls(proto::tls::Role::Sc, &id)?;
            c.io_threads = a.sc_threads as usize;
            Ok(sc::ScProcess::spawn(c, factory.clone())?)
        })
        .collect::<Result<Vec<_>>>()?;
    let t = Instant::now();
    loop {
        let m = rt.block_on(fm.partition_map()).context("FM")?;
        if m.groups.len() == groups as usize && m.groups.iter().all(|g| g.replicas.len() == 3) {
            break;
        }
        if t.elapsed() > Duration::from_secs(10) {
            bail!("the SC groups did not form");
        }
        std::thread::sleep(Duration::from_millis(10));
    }

    // One FM client (one PP node), re-used by a fresh pipeline per measurement: each
    // phase's flows are new, and so is its flow table.
    let mut ccfg = FmClientConfig::new(&fm_addr, "pp-bench");
    ccfg.linger = Duration::from_micros(a.linger_us);
    ccfg.tls = tls(proto::tls::Role::Pp, "pp-bench")?;
    let (client, links) = FmClient::start(ccfg)?;
    let t = Instant::now();
    while !client.connected() {
        if t.elapsed() > Duration::from_secs(5) {
            bail!("PP could not reach FM");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut links = links;
    let link = links.remove(0);
    let pipeline::RuleSource::Channel { requests, replies } = link.source else {
        bail!("FM client gave no channel");
    };
    let mk = |d: &std::sync::Arc<pp::Doorbell>| pp::WorkerLink {
        source: pipeline::RuleSource::Channel {
            requests: requests.clone(),
            replies: replies.clone(),
        },
        doorbell: d.clone(),
    };
    let doorbell = link.doorbell;

    // Warm up connections, allocators and caches, with generated flows (a workload's
    // flows are all measured; `SetupWorkload` refuses any that equals one of these).
    let (_, next, _) = phase(
        &mut Some(mk(&doorbell)),
        0,
        (Pace::Window(512), WARMUP_MAX_FLOWS, None),
        0.3,
        None,
    )?;
    let source = |start: usize| trace.clone().map(|t| TraceSource::new(t, start));
    let mut log = match &a.latency_log {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => None,
    };
    let s0 = rt.block_on(fm.stats()).context("FM")?;
    // Requests and batches the PP client has sent so far.
    let sent = || {
        let s = client.stats();
        (
            s.requests_sent.load(std::sync::atomic::Ordering::Relaxed),
            s.batches_sent.load(std::sync::atomic::Ordering::Relaxed),
        )
    };
    let c0 = sent();
    let snap = ALLOC_SNAPSHOT.get();
    let a0 = snap.map(|f| f());
    let (sat, next, _) = phase(
        &mut Some(mk(&doorbell)),
        next,
        (Pace::Window(a.window), u64::MAX, source(0)),
        a.seconds,
        log.as_mut().map(|l| ("saturated", l)),
    )?;
    let pack_sat = pack_stats();
    let allocs = snap
        .zip(a0)
        .map(|(f, a0)| allocs_per_flow(&a0, &f(), sat.lat_us.len() as u64));
    let paced_pace = match paced_by {
        PacedBy::Rate => Pace::Rate(a.rate),
        PacedBy::Trace => Pace::Trace,
    };
    let (paced, _, _) = phase(
        &mut Some(mk(&doorbell)),
        next,
        (paced_pace, u64::MAX, source(sat.generated as usize)),
        a.seconds,
        log.as_mut().map(|l| ("paced", l)),
    )?;
    let pack_paced = pack_stats();
    if let Some(mut l) = log {
        use std::io::Write;
        l.flush().context("writing the latency log")?;
    }
    let s1 = rt.block_on(fm.stats()).context("FM")?;
    let c1 = sent();
    // Let FM judge the last heartbeat periods of the run before the count is taken.
    std::thread::sleep(Duration::from_millis(100));
    let dead = rt.block_on(fm.stats()).context("FM")?.nodes_dead;
    drop(client);
    fm.stop();
    drop(scs);
    Ok(SetupBench {
        flows_per_s: sat.flows_per_s,
        p50_us: pct(&paced.lat_us, 0.50),
        p99_us: pct(&paced.lat_us, 0.99),
        rate: match paced_by {
            PacedBy::Rate => a.rate,
            PacedBy::Trace => paced.offered_per_s,
        },
        paced_flows_per_s: paced.flows_per_s,
        p999_us: pct(&paced.lat_us, 0.999),
        max_us: paced.lat_us.last().copied().unwrap_or(f64::NAN),
        saturated_p50_us: pct(&sat.lat_us, 0.50),
        saturated_p99_us: pct(&sat.lat_us, 0.99),
        window: a.window,
        chain: chain_label,
        failed: sat.failed + paced.failed,
        pp_batch: (c1.0 - c0.0) as f64 / ((c1.1 - c0.1).max(1)) as f64,
        fm_batch: (s1.submitted - s0.submitted) as f64 / ((s1.submits - s0.submits).max(1)) as f64,
        seconds: a.seconds,
        groups,
        session_drops: dead - d0,
        setup_overload: s1.setup_overload - s0.setup_overload,
        cpu_us_per_flow: sat.cpu_s * 1e6 / (sat.lat_us.len().max(1)) as f64,
        faults_per_flow: sat.faults as f64 / (sat.lat_us.len().max(1)) as f64,
        paced_cpu_us_per_flow: paced.cpu_s * 1e6 / (paced.lat_us.len().max(1)) as f64,
        pack: PackReport {
            spec: a.pack_cpus.to_string(),
            active_saturated: pack_sat.active,
            active_paced: pack_paced.active,
            cpus: pack_paced.cpus,
            grows: pack_paced.grows,
            shrinks: pack_paced.shrinks,
            failed_probes: pack_paced.failed_probes,
        },
        saturated_flows: sat.lat_us.len() as u64,
        allocs_per_flow: allocs.as_ref().map(|a| a.0),
        alloc_bytes_per_flow: allocs.as_ref().map(|a| a.1),
        allocs_per_flow_by_thread: allocs.map(|a| a.2),
        fm_threads: a.fm_threads,
        sc_threads: a.sc_threads,
        denied: sat.denied + paced.denied,
        paced_by: paced_by.as_str(),
        workload: workload.as_ref().map(|w| w.name.clone()),
        workload_flows: trace.as_ref().map(|t| t.flows.len() as u64),
        workload_flows_used: trace.as_ref().map(|_| sat.generated + paced.generated),
        workload_exhausted: trace.as_ref().map(|_| sat.exhausted || paced.exhausted),
    })
}

pub fn print(r: &SetupBench) {
    println!("starfabric bench setup: PP → FM → SC head → middle → tail → FM → PP, loopback gRPC");
    println!(
        "  chain: {} ({} SC group(s) on 3 SC nodes)",
        r.chain, r.groups
    );
    if let Some(name) = &r.workload {
        match (r.workload_flows, r.workload_flows_used) {
            (Some(n), Some(used)) => println!(
                "  workload: {name}: {used} of its {n} flows offered{}",
                if r.workload_exhausted == Some(true) {
                    " (ran out before a measurement's time was up)"
                } else {
                    ""
                }
            ),
            _ => println!("  workload: {name} (the chain; flows generated)"),
        }
    }
    println!(
        "  saturated ({} in flight): {:.0} new flows/s   (p50 {:.0} µs, p99 {:.0} µs)",
        r.window, r.flows_per_s, r.saturated_p50_us, r.saturated_p99_us
    );
    println!(
        "  paced at {:.0}/s ({}): {:.0} new flows/s   first-packet latency p50 {:.0} µs, p99 {:.0} µs, \
         p99.9 {:.0} µs, max {:.0} µs",
        r.rate, r.paced_by, r.paced_flows_per_s, r.p50_us, r.p99_us, r.p999_us, r.max_us
    );
    println!(
        "  batching: {:.1} requests per PP → FM message, {:.1} per FM → SC submit; failed flows: {}; \
         denied by the chain: {}",
        r.pp_batch, r.fm_batch, r.failed, r.denied
    );
    println!(
        "  session drops: {}   setup-overload refusals: {}",
        r.session_drops, r.setup_overload
    );
    println!(
        "  cost: {:.1} µs of process CPU and {:.2} page faults per flow set up (saturated, {} flows); \
         {:.1} µs per flow paced",
        r.cpu_us_per_flow, r.faults_per_flow, r.saturated_flows, r.paced_cpu_us_per_flow
    );
    println!(
        "  control threads packed ({}): on {} of {} CPUs at the end of the saturated run, {} at the end \
         of the paced one; {} grows, {} shrinks ({} undone)",
        r.pack.spec,
        r.pack.active_saturated,
        r.pack.cpus,
        r.pack.active_paced,
        r.pack.grows,
        r.pack.shrinks,
        r.pack.failed_probes
    );
    if let (Some(n), Some(b), Some(t)) = (
        r.allocs_per_flow,
        r.alloc_bytes_per_flow,
        &r.allocs_per_flow_by_thread,
    ) {
        println!("  allocations: {n:.1} per flow set up ({b:.0} bytes)");
        for (name, v) in t {
            println!("    {name}: {v:.2}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_per_flow_add_up_by_thread_name_between_snapshots() {
        let t = |slot, name: &str, allocs, bytes| ThreadAllocs {
            slot,
            name: name.into(),
            allocs,
            bytes,
        };
        let before = [t(0, "main", 100, 1000), t(1, "sc-w0-sc-0", 10, 100)];
        // Slot 2 is a thread started during the measurement; slot 0's thread kept
        // its slot, whatever its name reads now.
        let after = [
            t(0, "main", 300, 3000),
            t(1, "sc-w0-sc-0", 1010, 10100),
            t(2, "sc-w0-sc-0", 500, 400),
            t(3, "idle", 0, 0),
        ];
        let (n, b, by) = allocs_per_flow(&before, &after, 100);
        assert_eq!(n, (200 + 1000 + 500) as f64 / 100.0);
        assert_eq!(b, (2000 + 10000 + 400) as f64 / 100.0);
        assert_eq!(
            by,
            vec![("sc-w0-sc-0".to_string(), 15.0), ("main".to_string(), 2.0)]
        );
    }

    /// 0.3 s measurements, 64 flows in flight, the test chain, plaintext links.
    fn short_run(rate: f64) -> SetupBenchArgs {
        SetupBenchArgs {
            json: true,
            seconds: 0.3,
            rate,
            window: 64,
            linger_us: 100,
            fm_threads: 1,
            sc_threads: 2,
            nfs: "test".into(),
            groups: 1,
            insecure: true,
            tls: false,
            latency_log: None,
            workload: None,
            pack_cpus: corepack::PackSpec::Off,
        }
    }

    /// With the control threads packed onto one CPU (a list of one), every plane thread
    /// runs there and the flows still all come back; the report says what the packer
    /// did.
    #[test]
    fn a_run_with_its_control_threads_on_one_cpu_sets_up_every_flow() {
        let _one = crate::PACKER_TEST.lock().unwrap_or_else(|e| e.into_inner());
        let first = corepack::allowed_cpus()[0];
        let r = run(SetupBenchArgs {
            pack_cpus: corepack::PackSpec::List(vec![first]),
            ..short_run(2000.0)
        })
        .expect("bench setup");
        assert_eq!(r.pack.spec, first.to_string());
        assert_eq!((r.pack.cpus, r.pack.active_paced), (1, 1));
        assert_eq!(r.failed, 0);
        assert!(r.saturated_flows > 0 && r.paced_cpu_us_per_flow > 0.0);
        assert!(
            corepack::process_stats().is_none(),
            "the packer stopped with the run"
        );
    }

    /// A short run through the real path (FM, three SC nodes, PP over loopback gRPC):
    /// the log holds one line per flow set up, in both measurements, and its saturated
    /// lines are the flows the cost figure divides by.
    #[test]
    fn the_latency_log_has_a_line_per_flow_set_up() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("lat.txt");
        let r = run(SetupBenchArgs {
            latency_log: Some(path.clone()),
            ..short_run(2000.0)
        })
        .expect("bench setup");
        let log = std::fs::read_to_string(&path).expect("log");
        let (mut sat, mut paced) = (0u64, 0u64);
        for line in log.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            assert_eq!(f.len(), 3, "{line}");
            let done: f64 = f[1].parse().expect("done_us");
            let lat: f64 = f[2].parse().expect("latency_us");
            assert!(lat > 0.0 && done >= lat, "{line}");
            match f[0] {
                "saturated" => sat += 1,
                "paced" => paced += 1,
                other => panic!("phase {other}"),
            }
        }
        assert_eq!(sat, r.saturated_flows);
        assert!(sat > 0 && paced > 0, "{sat} saturated, {paced} paced lines");
    }

    /// A workload's chain and flows go through the real path: every flow it lists that
    /// the chain's firewall denies (TCP to port 23) comes back as a drop rule, and no
    /// other flow does, so the flows offered are the file's, in its order; the paced
    /// measurement offers them at the file's times.
    #[test]
    fn a_workload_trace_runs_through_its_own_chain_at_its_own_times() {
        const FLOWS: usize = 60_000;
        let dir = tempfile::tempdir().expect("tempdir");
        let mut csv = String::from("proto,src,sport,dst,dport,at_us\n");
        let deniable = |i: usize| i % 10 == 3;
        for i in 0..FLOWS {
            let src = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 1, 0, 0)) + (i / 1000) as u32);
            let sport = 2000 + (i % 1000);
            let (proto, dport) = if deniable(i) {
                ("tcp", 23)
            } else {
                ("udp", 53)
            };
            // 100 µs apart: 10,000 flows/s when paced by the trace.
            csv += &format!("{proto},{src},{sport},{SERVICE},{dport},{}\n", i * 100);
        }
        std::fs::write(dir.path().join("flows.csv"), csv).expect("csv");
        let nfs = builtin_nfs("builtin").expect("nfs");
        let wl = dir.path().join("w.json");
        std::fs::write(
            &wl,
            serde_json::json!({"version": 1, "name": "trace test", "nfs": nfs,
                "flows_csv": "flows.csv", "paced": "trace"})
            .to_string(),
        )
        .expect("workload");
        let r = run(SetupBenchArgs {
            workload: Some(wl),
            ..short_run(50_000.0)
        })
        .expect("bench setup");
        assert_eq!(r.chain, "fw → snat → lb");
        assert_eq!(r.workload.as_deref(), Some("trace test"));
        assert_eq!(r.workload_flows, Some(FLOWS as u64));
        assert_eq!(r.workload_exhausted, Some(false));
        let used = r.workload_flows_used.expect("used") as usize;
        assert!(used > 0 && used < FLOWS, "{used} flows used");
        assert_eq!(r.failed, 0);
        assert_eq!(
            r.denied,
            (0..used).filter(|&i| deniable(i)).count() as u64,
            "the flows denied are the file's TCP/23 flows among the {used} offered"
        );
        assert_eq!(r.paced_by, "trace");
        assert!(
            (7_000.0..13_000.0).contains(&r.rate),
            "the trace offers 10,000 flows/s; offered {}",
            r.rate
        );
        assert!(r.p50_us.is_finite(), "the paced measurement set up flows");
    }
}
