//! `starfabric bench pipeline`: single-core rates of the PP pipeline on the in-memory
//! ring, next to a copy-only baseline measured in the same run.
//!
//! Traffic is tenant VXLAN carrying 60-byte inner frames (64 on the wire with FCS). Each
//! packet picks a flow at random among the installed ones, so the table is exercised at
//! its full size rather than from cache.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use packet::build::{udp_v4, vxlan_wrap};
use pipeline::{
    Action, FlowKey, FrameSource, MemRing, MonotonicClock, NodeAddr, PacketIo, Pipeline,
    PipelineConfig, Rule, RuleReply, RuleSource, VpcBinding, Worker, MAX_BATCH,
};
use serde::Serialize;

#[derive(Subcommand)]
pub enum BenchCmd {
    /// Hit/miss/parse rates of the pipeline on one core.
    Pipeline(PipelineBenchArgs),
    /// New flows/s and first-packet latency through PP → FM → SC → FM → PP.
    Setup(crate::bench_setup::SetupBenchArgs),
    /// The SC node's worker pool: replica start and scale-to-zero wake-up latency, with
    /// the state checked after every wake (docs/workers.md).
    Workers(crate::bench_workers::WorkersBenchArgs),
    /// starfabric next to the kernel on the netns testbed: TCP Gbit/s, 64-byte UDP
    /// packets/s, new TCP connections/s (needs root and the testbed's tools).
    E2e(crate::bench_e2e::E2eBenchArgs),
    /// SC scale-out, scale-in and replica failover under live traffic on the netns
    /// testbed: failed/reset connections, p99 setup, per-node TX timeline (needs root).
    Scaling(crate::bench_scaling::ScalingBenchArgs),
    /// Tenant isolation at the PP node on the netns testbed (docs/rate-isolation.md): a
    /// SYN flood against another tenant's paced connections, burst/base holding, Jain's
    /// index and utilisation under two floods (needs root and hping3).
    Isolation(crate::bench_isolation::IsolationBenchArgs),
    /// Placement (docs/placement.md): FF, BF, FFD, DDQN (with and without the demand
    /// forecast) and the MILP optimum on held-out workloads; RGCM against its MILP.
    Placement(crate::bench_placement::PlacementBenchArgs),
    /// Core assignment (docs/cores.md): RR, LLF, FFD and the learned sfc2cpu assigner
    /// in the CFS digital twin on held-out instances at 4, 8, 12 and 16 cores.
    Cores(crate::bench_cores::CoresBenchArgs),
    /// The packet sender of `bench e2e`'s per-core rate (run by it inside a testbed
    /// namespace): copies of a frame out of a device from the kernel's XDP live-frames
    /// test run, on this thread's CPU.
    #[command(hide = true)]
    XdpGen(XdpGenArgs),
}

#[derive(Args, Clone)]
pub struct XdpGenArgs {
    /// Device to send out of (in this process's network namespace).
    #[arg(long)]
    pub dev: String,
    /// The template frame, hex (as `testbed::measure::udp64_frame` builds it).
    #[arg(long)]
    pub frame: String,
    /// Flows to spread the frames over.
    #[arg(long, default_value_t = 16)]
    pub flows: u32,
    /// Seconds to send for.
    #[arg(long)]
    pub secs: f64,
    /// Frames per second, paced frame by frame (0: as fast as the CPU goes).
    #[arg(long, default_value_t = 0)]
    pub rate: u64,
}

/// Send until the deadline; print the frames handed to the device.
fn xdp_gen(a: &XdpGenArgs) -> Result<()> {
    // The calling thread's namespace's index (sysfs would show the mounting one's).
    let name = std::ffi::CString::new(a.dev.as_str()).context("--dev has a NUL")?;
    // SAFETY: a NUL-terminated name that outlives the call.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    anyhow::ensure!(
        ifindex != 0,
        "no interface {}: {}",
        a.dev,
        std::io::Error::last_os_error()
    );
    let frame = (0..a.frame.len() / 2)
        .map(|i| u8::from_str_radix(a.frame.get(2 * i..2 * i + 2).unwrap_or("zz"), 16))
        .collect::<Result<Vec<u8>, _>>()
        .context("--frame is not hex")?;
    anyhow::ensure!(
        a.secs.is_finite() && a.secs > 0.0 && a.secs <= 600.0,
        "--secs must be in (0, 600]"
    );
    let gen = xdp::LiveGenerator::load(a.flows, &frame, Some(a.rate))?;
    let sent = gen.run_for(ifindex, Duration::from_secs_f64(a.secs))?;
    println!("xdp-gen: sent={sent}");
    Ok(())
}

#[derive(Args, Clone)]
pub struct PipelineBenchArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Flow counts for the hit path.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1000,100000,1000000,10000000"
    )]
    pub flows: Vec<usize>,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 1.0)]
    pub seconds: f64,
    /// Packets per batch.
    #[arg(long, default_value_t = MAX_BATCH)]
    pub batch: usize,
    /// Small and short: 1k and 100k flows, 0.2 s each (a smoke run).
    #[arg(long)]
    pub quick: bool,
    /// Measure only one part (for profiling): baseline, parse, hit or miss.
    #[arg(long)]
    pub only: Option<String>,
    /// Add a `count` action to the hit-path rule (per-rule packet/byte counters: one more
    /// random cache line per packet).
    #[arg(long)]
    pub count: bool,
    /// A pipeline workload file (docs/benchmarks.md, "Pipeline workload"): the chain
    /// row's settings (FW → MON → NAT, Serpens Fig. 15; default 1M flows, 2 s) and, in
    /// its `hit` section, the hit points' flows: table sizes with a popularity law, or a
    /// packet trace.
    #[arg(long)]
    pub workload: Option<std::path::PathBuf>,
    /// Also run the hit points on N pipelines at once, one thread pinned to each of N
    /// CPUs, as a PP node with `--workers N` runs them (`node_hit` in the JSON). 1: only
    /// the one-core points.
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
}

pub fn run(c: BenchCmd) -> Result<()> {
    use crate::{
        bench_cores, bench_e2e, bench_isolation, bench_scaling, bench_setup, bench_workers,
    };
    match c {
        BenchCmd::Pipeline(a) => report(&pipeline_bench(&a)?, a.json, print_table),
        BenchCmd::Setup(a) => report(&bench_setup::run(a.clone())?, a.json, bench_setup::print),
        BenchCmd::Workers(a) => report(
            &bench_workers::run(a.clone())?,
            a.json,
            bench_workers::print,
        ),
        BenchCmd::XdpGen(a) => xdp_gen(&a),
        BenchCmd::Placement(a) => crate::bench_placement::bench(&a),
        BenchCmd::Cores(a) => report(&bench_cores::run(&a)?, a.json, bench_cores::print),
        BenchCmd::E2e(a) => report(&bench_e2e::run(a.clone())?, a.json, bench_e2e::print),
        BenchCmd::Isolation(a) => {
            report(&bench_isolation::run(&a)?, a.json, bench_isolation::print)
        }
        BenchCmd::Scaling(a) => report(&bench_scaling::run(&a)?, a.json, bench_scaling::print),
    }
}

/// A bench's result on stdout: the JSON document with `--json`, else its table.
fn report<R: Serialize>(r: &R, json: bool, print: fn(&R)) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(r)?);
    } else {
        print(r);
    }
    Ok(())
}

/// Results; field names are the documented JSON interface.
#[derive(Serialize, Debug)]
pub struct PipelineBench {
    /// Hit path (lookup + SNAT rewrite + VXLAN re-encap), Mpps per core, by flow count.
    pub hit_mpps: BTreeMap<String, f64>,
    /// Whether the hit-path rule also counted packets and bytes.
    pub hit_rule_counts: bool,
    /// New flows per second through miss → request → rule → release, in Mpps.
    pub miss_mpps: f64,
    /// Parsing outer and inner headers only.
    pub parse_mpps: f64,
    /// Receive (copy into the ring) and transmit with no pipeline work.
    pub baseline_mpps: f64,
    /// Table bytes per flow at capacity: entry (key and rule) + counters + companion
    /// index + bucket share.
    pub bytes_per_flow: f64,
    pub key_bytes: usize,
    pub entry_bytes: usize,
    /// Part of the entry.
    pub rule_bytes: usize,
    /// Per-rule packet/byte counters, kept beside the entry.
    pub counter_bytes: usize,
    /// The index linking a flow's forward and reply entries, kept beside the entry.
    pub companion_bytes: usize,
    /// Resident memory added per flow by the largest table, measured.
    pub rss_bytes_per_flow: Option<f64>,
    /// hit rate at the largest flow count over the rate at the smallest, each point
    /// measured on its own, seconds apart.
    pub large_over_small: f64,
    /// The same ratio with both tables run in alternating 50 ms slices
    /// ([`PairedHit::ratio`]); absent with a workload's `hit` section or one flow count.
    pub large_over_small_paired: Option<f64>,
    pub paired: Option<PairedHit>,
    pub batch: usize,
    pub seconds_per_point: f64,
    pub inner_frame_bytes: usize,
    /// FW → MON → NAT (Serpens Fig. 15) through PP: the rule the built-in NFs composed,
    /// at `chain.flows` flows, Mpps on one core.
    pub chain_mpps: f64,
    /// 99th percentile of a batch's processing time, µs: every packet of a batch is done
    /// when the batch is, so this bounds a packet's p99 latency through the pipeline.
    pub chain_p99_us: f64,
    /// The chain row's details (flows, batch, per-packet times, setup time, the rule).
    pub chain: Option<crate::bench_chain::ChainResult>,
    /// The hit points' workload, when a workload file had a `hit` section.
    pub hit_workload: Option<crate::hit_workload::HitWorkloadInfo>,
    /// The hit points on `--workers N` pipelines at once (absent with one worker, or
    /// with a workload's `hit` section).
    pub node_hit: Option<NodeHit>,
}

/// The hit path of a PP node that runs one pipeline per CPU (`starfabric pp --workers
/// N`): N threads, each pinned to its own CPU, each with its own table and traffic, all
/// measured over the same seconds. Flow `i` belongs to worker `i % N`, as the node's
/// steering hash spreads flows; a worker's table holds its share of the flows and its
/// traffic draws among them.
#[derive(Serialize, Debug, Clone)]
pub struct NodeHit {
    pub workers: usize,
    /// The CPU each worker was pinned to, in worker order.
    pub cpus: Vec<usize>,
    /// The node's rate, the sum over its workers, Mpps, by the node's flow count.
    pub mpps: BTreeMap<String, f64>,
    pub per_worker_mpps: BTreeMap<String, Vec<f64>>,
    /// `mpps` over the one-core `hit_mpps` at the same flow count, measured in the same
    /// run (seconds apart, so the VM's drift is in it: `PairedHit` says how much).
    pub over_one_core: BTreeMap<String, f64>,
}

const VNI: u32 = 100;
pub(crate) const DST: Ipv4Addr = Ipv4Addr::new(198, 19, 200, 9);
/// Offsets of the fields the generator varies: inner source address and port.
const INNER_SRC: usize = 50 + 14 + 12;
const INNER_SPORT: usize = 50 + 14 + 20;

/// Source endpoint of bench flow `i`.
pub(crate) fn flow_src(i: u64) -> (Ipv4Addr, u16) {
    // 198.18.0.0/15 has 2^17 addresses; 16384 ports each.
    let a = u32::from(Ipv4Addr::new(198, 18, 0, 0)) + (i >> 14) as u32;
    (Ipv4Addr::from(a), 1024 + (i & 0x3fff) as u16)
}

/// A tenant VXLAN frame (VNI 100) carrying a 60-byte inner UDP frame to `dst`:53
/// (14 + 20 + 8 + 18 bytes, so the payload ends the frame); [`stamp_flow`] makes it
/// flow `i`'s.
pub(crate) fn template(dst: Ipv4Addr) -> Vec<u8> {
    let inner = udp_v4([198, 18, 0, 0], 1024, dst.octets(), 53, &[0u8; 18]);
    vxlan_wrap([198, 18, 0, 50], [198, 18, 0, 1], 50000, VNI, &inner)
}

fn snat_rule(i: u64, count: bool) -> Rule {
    let (src, sport) = flow_src(i);
    snat_rule_keyed(
        FlowKey::new(VNI, 17, src.into(), sport, DST.into(), 53),
        i,
        count,
    )
}

/// Flow `i`'s SNAT rule under `key`.
fn snat_rule_keyed(key: FlowKey, i: u64, count: bool) -> Rule {
    // Paired pooling as SNAT would: 60000 ports per public address.
    let pool = Ipv4Addr::new(
        198,
        19,
        100 + (i / 60000 / 256) as u8,
        (i / 60000 % 256) as u8,
    );
    let mut actions = pipeline::Actions::new();
    actions.extend([
        Action::DecapVxlan,
        Action::SetSrc {
            addr: Some(IpAddr::V4(pool)),
            port: Some(1024 + (i % 60000) as u16),
        },
        Action::EncapVxlan {
            dst: Ipv4Addr::new(198, 18, 0, 9),
            vni: 200,
            inner_dmac: None,
            inner_smac: None,
        },
    ]);
    if count {
        actions.push(Action::Count);
    }
    actions.push(Action::Output(1));
    Rule::new(key, actions)
}

/// Frames over `flows` flows, chosen by xorshift (or sequentially new, for the miss path).
pub(crate) struct Traffic {
    template: Vec<u8>,
    flows: u64,
    rng: u64,
    sequential: bool,
    next: u64,
}

impl Traffic {
    pub(crate) fn random(flows: u64) -> Self {
        Traffic {
            template: template(DST),
            flows,
            rng: 0x2545_f491_4f6c_dd1d,
            sequential: false,
            next: 0,
        }
    }

    fn new_flows() -> Self {
        Traffic {
            sequential: true,
            ..Traffic::random(1)
        }
    }
}

impl FrameSource for Traffic {
    #[inline]
    fn next_frame(&mut self, out: &mut [u8]) -> Option<(usize, u16)> {
        let i = if self.sequential {
            self.next += 1;
            self.next
        } else {
            self.draw()
        };
        let n = self.template.len();
        out[..n].copy_from_slice(&self.template);
        stamp_flow(out, i);
        Some((n, 0))
    }
}

impl Traffic {
    /// The next random flow, `0..flows`.
    #[inline]
    fn draw(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        // Multiply-shift range reduction: a 64-bit `%` costs more than a table hit.
        ((self.rng as u128 * self.flows as u128) >> 64) as u64
    }
}

/// One worker's share of a node's flows ([`NodeHit`]): draw `j` of [`Traffic`] is flow
/// `j * stride + offset`. A type of its own so that the one-core points' traffic does
/// no more work per packet than it did.
struct ShardTraffic {
    inner: Traffic,
    stride: u64,
    offset: u64,
}

impl ShardTraffic {
    /// Worker `w`'s share of `total` flows on a node of `n` workers: the flows `i` with
    /// `i % n == w`.
    fn new(total: u64, n: u64, w: u64) -> Self {
        ShardTraffic {
            inner: Traffic::random(total.saturating_sub(w).div_ceil(n)),
            stride: n,
            offset: w,
        }
    }

    fn flows(&self) -> u64 {
        self.inner.flows
    }
}

impl FrameSource for ShardTraffic {
    #[inline]
    fn next_frame(&mut self, out: &mut [u8]) -> Option<(usize, u16)> {
        let i = self.inner.draw() * self.stride + self.offset;
        let t = &self.inner.template;
        out[..t.len()].copy_from_slice(t);
        stamp_flow(out, i);
        Some((t.len(), 0))
    }
}

/// Generated flows in the order a popularity law drew them (`hit_workload::draw`),
/// replayed in a loop.
struct DrawnTraffic {
    template: Vec<u8>,
    seq: Vec<u32>,
    pos: usize,
}

impl FrameSource for DrawnTraffic {
    #[inline]
    fn next_frame(&mut self, out: &mut [u8]) -> Option<(usize, u16)> {
        let i = self.seq[self.pos];
        self.pos += 1;
        if self.pos == self.seq.len() {
            self.pos = 0;
        }
        let n = self.template.len();
        out[..n].copy_from_slice(&self.template);
        stamp_flow(out, u64::from(i));
        Some((n, 0))
    }
}

/// A packet trace's packets, in its order, replayed in a loop. Like the generated
/// traffic, a frame gets its flow's addresses and ports and keeps the template's
/// checksums: the hit path rewrites them incrementally and never checks them.
struct TraceTraffic {
    udp: Vec<u8>,
    tcp: Vec<u8>,
    trace: crate::hit_workload::PacketTrace,
    pos: usize,
}

impl TraceTraffic {
    fn new(trace: crate::hit_workload::PacketTrace) -> Self {
        use packet::build::tcp_v4;
        let wrap =
            |inner: Vec<u8>| vxlan_wrap([198, 18, 0, 50], [198, 18, 0, 1], 50000, VNI, &inner);
        TraceTraffic {
            // Both 60-byte inner frames; a TCP packet of an established flow (ACK).
            udp: wrap(udp_v4([0; 4], 1, [0; 4], 1, &[0u8; 18])),
            tcp: wrap(tcp_v4(
                [0; 4],
                1,
                [0; 4],
                1,
                packet::tcp_flags::ACK,
                1,
                &[0u8; 6],
            )),
            trace,
            pos: 0,
        }
    }
}

impl FrameSource for TraceTraffic {
    #[inline]
    fn next_frame(&mut self, out: &mut [u8]) -> Option<(usize, u16)> {
        let f = &self.trace.flows[self.trace.packets[self.pos] as usize];
        self.pos += 1;
        if self.pos == self.trace.packets.len() {
            self.pos = 0;
        }
        let tpl = if f.proto == packet::proto::TCP {
            &self.tcp
        } else {
            &self.udp
        };
        let n = tpl.len();
        out[..n].copy_from_slice(tpl);
        const IP: usize = packet::build::VXLAN_V4_OVERHEAD + 14;
        out[IP + 12..IP + 16].copy_from_slice(&f.src.octets());
        out[IP + 16..IP + 20].copy_from_slice(&f.dst.octets());
        out[IP + 20..IP + 22].copy_from_slice(&f.sport.to_be_bytes());
        out[IP + 22..IP + 24].copy_from_slice(&f.dport.to_be_bytes());
        Some((n, 0))
    }
}

/// Write flow `i`'s inner source address and port into a [`template`] frame.
#[inline]
pub(crate) fn stamp_flow(frame: &mut [u8], i: u64) {
    let (src, sport) = flow_src(i);
    frame[INNER_SRC..INNER_SRC + 4].copy_from_slice(&src.octets());
    frame[INNER_SPORT..INNER_SPORT + 2].copy_from_slice(&sport.to_be_bytes());
}

fn node() -> NodeAddr {
    NodeAddr {
        ip: Ipv4Addr::new(198, 18, 0, 1),
        mac: [2, 0, 0, 0, 0, 1],
        gw_mac: [2, 0, 0, 0, 0, 2],
    }
}

/// Run `step` (which returns packets handled) for `secs`; returns Mpps.
fn timed(secs: f64, mut step: impl FnMut() -> usize) -> f64 {
    // Warm up caches and branch predictors.
    for _ in 0..64 {
        step();
    }
    let dur = Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut pkts = 0u64;
    loop {
        for _ in 0..64 {
            pkts += step() as u64;
        }
        let el = start.elapsed();
        if el >= dur {
            return pkts as f64 / el.as_secs_f64() / 1e6;
        }
    }
}

fn rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// A hit point: a table of `flows` flows holding `rules`, then `traffic` through it for
/// `a.seconds`. Mpps, and resident bytes per flow.
fn hit_point_with<S: FrameSource>(
    flows: usize,
    rules: impl Iterator<Item = Rule>,
    traffic: S,
    a: &PipelineBenchArgs,
) -> Result<(f64, Option<f64>)> {
    let (mpps, rss, _) = hit_point_kept(flows, rules, traffic, a)?;
    Ok((mpps, rss))
}

/// [`hit_point_with`], and the worker with its table, for the interleaved ratio.
fn hit_point_kept<S: FrameSource>(
    flows: usize,
    rules: impl Iterator<Item = Rule>,
    traffic: S,
    a: &PipelineBenchArgs,
) -> Result<(f64, Option<f64>, Worker<MemRing<S>>)> {
    let (mut w, per_flow) = hit_worker(flows, rules, traffic, a)?;
    let mpps = timed(a.seconds, || w.run_once().unwrap_or(0));
    all_hits(&w)?;
    Ok((mpps, per_flow, w))
}

/// A worker over a table of `flows` flows holding `rules`, ready to run `traffic`, and
/// the resident bytes per flow its table added.
fn hit_worker<S: FrameSource>(
    flows: usize,
    rules: impl Iterator<Item = Rule>,
    traffic: S,
    a: &PipelineBenchArgs,
) -> Result<(Worker<MemRing<S>>, Option<f64>)> {
    let mut cfg = PipelineConfig::new(node());
    cfg.flow_capacity = flows;
    let rss0 = rss_bytes();
    let mut p = Pipeline::new(cfg, RuleSource::None)?;
    // Hits are counted per tenant: bind the VNI so they land in a tenant's slot.
    p.bind_vpc(
        VNI,
        VpcBinding {
            tenant: 1,
            chain: 1,
        },
    );
    for r in rules {
        p.install_rule(&r, 0).context("installing bench rules")?;
    }
    let rss1 = rss_bytes();
    anyhow::ensure!(
        p.table().len() == flows,
        "table holds {} of {flows}",
        p.table().len()
    );
    let io = MemRing::new(traffic, a.batch);
    let w = Worker::new(p, io, a.batch, Box::new(MonotonicClock::new()));
    let per_flow = match (rss0, rss1) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / flows as f64),
        _ => None,
    };
    Ok((w, per_flow))
}

/// The calling thread's id (`/proc/thread-self` links to `PID/task/TID`).
fn own_tid() -> Result<i32> {
    let link = std::fs::read_link("/proc/thread-self").context("reading /proc/thread-self")?;
    link.file_name()
        .and_then(|t| t.to_str()?.parse().ok())
        .with_context(|| format!("no thread id in {}", link.display()))
}

/// The hit path at `flows` flows on `cpus.len()` workers at once ([`NodeHit`]): each
/// worker's Mpps.
fn node_hit_point(flows: usize, cpus: &[usize], a: &PipelineBenchArgs) -> Result<Vec<f64>> {
    let n = cpus.len();
    // Every worker builds its table before any measures, so that the rates are of the
    // same seconds; one that fails still reaches the barrier, or the others would wait.
    let ready = std::sync::Barrier::new(n);
    std::thread::scope(|s| {
        let runs: Vec<_> = (cpus.iter().enumerate())
            .map(|(w, &cpu)| {
                let ready = &ready;
                s.spawn(move || -> Result<f64> {
                    let built = (|| {
                        corepack::pin_thread(own_tid()?, &[cpu])
                            .with_context(|| format!("pinning worker {w} to CPU {cpu}"))?;
                        let traffic = ShardTraffic::new(flows as u64, n as u64, w as u64);
                        let share = traffic.flows() as usize;
                        let rules = (w as u64..flows as u64)
                            .step_by(n)
                            .map(|i| snat_rule(i, a.count));
                        hit_worker(share, rules, traffic, a)
                    })();
                    ready.wait();
                    let (mut wk, _) = built?;
                    let mpps = timed(a.seconds, || wk.run_once().unwrap_or(0));
                    all_hits(&wk)?;
                    Ok(mpps)
                })
            })
            .collect();
        runs.into_iter()
            .map(|r| {
                r.join()
                    .map_err(|_| anyhow::anyhow!("a node worker panicked"))?
            })
            .collect()
    })
}

/// Fails the run unless every packet so far hit and was transmitted.
fn all_hits<S: FrameSource>(w: &Worker<MemRing<S>>) -> Result<()> {
    let s = w.pipeline.stats();
    anyhow::ensure!(
        s.misses == 0 && s.total_drops() == 0,
        "hit path saw {} misses and {} drops",
        s.misses,
        s.total_drops()
    );
    anyhow::ensure!(
        w.io.sink.packets == s.tx_packets,
        "every hit was transmitted"
    );
    Ok(())
}

/// The largest table's hit rate over the smallest's, both tables held at once and run in
/// alternating slices. This VM's speed drifts by tens of percent from one minute to the
/// next (the 1k-flow point read 8.4 to 14.6 Mpps in six runs within a quarter hour), so a
/// ratio of two points taken seconds apart measures the drift as much as the table;
/// slices 50 ms apart see the same machine.
#[derive(Serialize, Debug, Clone)]
pub struct PairedHit {
    pub small_flows: usize,
    pub large_flows: usize,
    /// Rounds of four slices: small, large, large, small.
    pub rounds: usize,
    pub slice_seconds: f64,
    /// Median over the rounds of (large's two slices) / (small's two slices).
    pub ratio: f64,
    pub ratio_min: f64,
    pub ratio_max: f64,
    /// Each table's rate over all its slices.
    pub small_mpps: f64,
    pub large_mpps: f64,
}

/// Slice length of [`PairedHit`]: long enough that a slice's warm-up (64 batches, which
/// refill the small table's lines the large one evicted) is under 2% of it at 1k flows.
const PAIRED_SLICE_SECONDS: f64 = 0.05;

fn paired_hit<S1: FrameSource, S2: FrameSource>(
    small: &mut Worker<MemRing<S1>>,
    large: &mut Worker<MemRing<S2>>,
    seconds: f64,
) -> Result<PairedHit> {
    let slice = PAIRED_SLICE_SECONDS;
    // Each table runs `seconds` in all, as a sequential point does; three rounds at least.
    let rounds = ((seconds / (2.0 * slice)).ceil() as usize).max(3);
    let mut ratios = Vec::with_capacity(rounds);
    let (mut s_sum, mut l_sum) = (0.0, 0.0);
    for _ in 0..rounds {
        let s1 = timed(slice, || small.run_once().unwrap_or(0));
        let l1 = timed(slice, || large.run_once().unwrap_or(0));
        let l2 = timed(slice, || large.run_once().unwrap_or(0));
        let s2 = timed(slice, || small.run_once().unwrap_or(0));
        anyhow::ensure!(
            s1 + s2 > 0.0,
            "the small table forwarded nothing in a round"
        );
        ratios.push((l1 + l2) / (s1 + s2));
        s_sum += s1 + s2;
        l_sum += l1 + l2;
    }
    all_hits(small)?;
    all_hits(large)?;
    ratios.sort_by(f64::total_cmp);
    let n = ratios.len();
    let ratio = crate::median(ratios.clone()).context("no round had a finite ratio")?;
    Ok(PairedHit {
        small_flows: small.pipeline.table().len(),
        large_flows: large.pipeline.table().len(),
        rounds,
        slice_seconds: slice,
        ratio,
        ratio_min: ratios[0],
        ratio_max: ratios[n - 1],
        small_mpps: s_sum / (2 * rounds) as f64,
        large_mpps: l_sum / (2 * rounds) as f64,
    })
}

/// The hit points a workload's `hit` section asks for: (table size, Mpps, resident
/// bytes per flow), and what to report about the workload.
type HitPoints = (
    Vec<(usize, f64, Option<f64>)>,
    crate::hit_workload::HitWorkloadInfo,
);

fn workload_hit_points(
    w: &crate::hit_workload::HitWorkload,
    a: &PipelineBenchArgs,
) -> Result<HitPoints> {
    use crate::hit_workload::{draw, drawn_len, top1pct_share, HitFlows, Popularity};
    let mut points = Vec::new();
    let mut shares = BTreeMap::new();
    let (popularity, trace_packets) = match &w.flows {
        HitFlows::Generated { sizes, popularity } => {
            let sizes = if sizes.is_empty() { &a.flows } else { sizes };
            for &n in sizes {
                let rules = (0..n as u64).map(|i| snat_rule(i, a.count));
                let (mpps, rss) = match popularity {
                    // The default traffic, as without a workload.
                    Popularity::Uniform => hit_point_with(n, rules, Traffic::random(n as u64), a)?,
                    p => {
                        let seq = draw(*p, n, drawn_len(n), 0x5eed ^ n as u64);
                        shares.insert(n.to_string(), top1pct_share(&seq, n));
                        let t = DrawnTraffic {
                            template: template(DST),
                            seq,
                            pos: 0,
                        };
                        hit_point_with(n, rules, t, a)?
                    }
                };
                points.push((n, mpps, rss));
            }
            (popularity.to_string(), None)
        }
        HitFlows::Trace(t) => {
            let n = t.flows.len();
            shares.insert(n.to_string(), top1pct_share(&t.packets, n));
            let rules = t.flows.iter().enumerate().map(|(i, f)| {
                let key = FlowKey::new(VNI, f.proto, f.src.into(), f.sport, f.dst.into(), f.dport);
                snat_rule_keyed(key, i as u64, a.count)
            });
            let packets = t.packets.len();
            let (mpps, rss) = hit_point_with(n, rules, TraceTraffic::new(t.clone()), a)?;
            points.push((n, mpps, rss));
            ("trace".to_string(), Some(packets))
        }
    };
    Ok((
        points,
        crate::hit_workload::HitWorkloadInfo {
            name: w.name.clone(),
            popularity,
            trace_packets,
            top1pct_share: shares,
        },
    ))
}

/// A pipeline workload file: the chain row's fields at the top level (the format it
/// has always had) and an optional `hit` section.
fn load_workload(
    path: &std::path::Path,
) -> Result<(
    crate::bench_chain::ChainWorkload,
    Option<crate::hit_workload::HitWorkload>,
)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading workload {}", path.display()))?;
    let mut v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("workload {}: not JSON", path.display()))?;
    let obj = v
        .as_object_mut()
        .with_context(|| format!("workload {}: not a JSON object", path.display()))?;
    let hit = obj.remove("hit");
    let chain = crate::bench_chain::ChainWorkload::from_value(v)
        .with_context(|| format!("workload {}", path.display()))?;
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    let hit = hit
        .map(|h| crate::hit_workload::HitWorkload::parse(h, path.display().to_string(), dir))
        .transpose()
        .with_context(|| format!("workload {}", path.display()))?;
    Ok((chain, hit))
}

fn miss_point(a: &PipelineBenchArgs) -> Result<f64> {
    let (req_tx, req_rx) = crossbeam_channel::bounded(4096);
    let (rep_tx, rep_rx) = crossbeam_channel::bounded(4096);
    let mut cfg = PipelineConfig::new(node());
    cfg.flow_capacity = 1 << 20;
    let mut p = Pipeline::new(
        cfg,
        RuleSource::Channel {
            requests: req_tx,
            replies: rep_rx,
        },
    )?;
    p.bind_vpc(
        VNI,
        VpcBinding {
            tenant: 1,
            chain: 1,
        },
    );
    let io = MemRing::new(Traffic::new_flows(), a.batch);
    let mut w = Worker::new(p, io, a.batch, Box::new(MonotonicClock::new()));
    // The rule server runs inline so the figure is the pipeline's own per-core cost of a
    // new flow: hold, request, compile, install, release.
    let mpps = timed(a.seconds, || {
        let n = w.run_once().unwrap_or(0);
        while let Ok(req) = req_rx.try_recv() {
            let (src, sport) = (req.key.src(), req.key.sport());
            let i = match src {
                IpAddr::V4(s) => {
                    ((u32::from(s) - u32::from(Ipv4Addr::new(198, 18, 0, 0))) as u64) << 14
                        | (sport - 1024) as u64
                }
                IpAddr::V6(_) => 0,
            };
            let _ = rep_tx.try_send(RuleReply::ok(snat_rule(i, a.count)));
        }
        n
    });
    let s = w.pipeline.stats();
    anyhow::ensure!(
        s.rule_requests > 0 && s.pending_released > 0,
        "miss path idle"
    );
    Ok(mpps)
}

fn parse_point(a: &PipelineBenchArgs) -> f64 {
    let mut io = MemRing::new(Traffic::random(1 << 20), a.batch);
    let mut descs = Vec::with_capacity(a.batch);
    let mut sink = 0usize;
    let r = timed(a.seconds, || {
        let n = io.rx(&mut descs, a.batch).unwrap_or(0);
        let region = io.region();
        for d in &descs {
            let data = d.data(region);
            if let Ok(f) = packet::parse_frame(data) {
                if let Some(inner) = f.vxlan_inner(data) {
                    if let Ok(fi) = packet::parse_frame(inner) {
                        sink += fi.l3_off as usize;
                    }
                }
            }
        }
        n
    });
    std::hint::black_box(sink);
    r
}

fn baseline_point(a: &PipelineBenchArgs) -> f64 {
    let mut io = MemRing::new(Traffic::random(1 << 20), a.batch);
    let mut descs = Vec::with_capacity(a.batch);
    timed(a.seconds, || {
        let n = io.rx(&mut descs, a.batch).unwrap_or(0);
        for d in descs.iter_mut() {
            d.verdict = pipeline::Verdict::Tx(1);
        }
        let _ = io.tx(&descs);
        n
    })
}

pub fn pipeline_bench(a: &PipelineBenchArgs) -> Result<PipelineBench> {
    let mut a = a.clone();
    if a.quick {
        a.flows = vec![1000, 100_000];
        a.seconds = 0.2;
    }
    anyhow::ensure!(!a.flows.is_empty(), "no flow counts given");
    anyhow::ensure!(a.batch >= 1 && a.batch <= 1024, "batch must be 1..=1024");
    let allowed = corepack::allowed_cpus();
    anyhow::ensure!(
        a.workers >= 1 && a.workers <= allowed.len(),
        "--workers must be 1..={} (the CPUs this process may use: {allowed:?})",
        allowed.len()
    );
    let want = |part: &str| a.only.as_deref().is_none_or(|o| o == part);
    let baseline_mpps = if want("baseline") {
        baseline_point(&a)
    } else {
        0.0
    };
    let parse_mpps = if want("parse") { parse_point(&a) } else { 0.0 };
    let (chain_w, hit_w) = match &a.workload {
        Some(p) => {
            let (c, h) = load_workload(p)?;
            (Some(c), h)
        }
        None => (None, None),
    };
    let mut hit_mpps = BTreeMap::new();
    let mut rates = vec![(0, 0.0)];
    let mut rss_per_flow = None;
    let mut hit_workload = None;
    let mut paired = None;
    let mut record = |n: usize, mpps: f64, rss: Option<f64>| {
        rates.retain(|r| r.0 != 0);
        hit_mpps.insert(n.to_string(), mpps);
        rates.push((n, mpps));
        rss_per_flow = rss;
    };
    match (&hit_w, want("hit")) {
        (_, false) => {}
        (None, true) => {
            // The smallest and the largest table are kept for the interleaved ratio; the
            // ones between are freed before the next is made, as before.
            let mut sizes = a.flows.clone();
            sizes.sort_unstable();
            sizes.dedup();
            let mut small = None;
            let mut large = None;
            for (k, &n) in sizes.iter().enumerate() {
                let rules = (0..n as u64).map(|i| snat_rule(i, a.count));
                let (mpps, rss, w) = hit_point_kept(n, rules, Traffic::random(n as u64), &a)?;
                record(n, mpps, rss);
                if k == 0 {
                    small = Some(w);
                } else if k + 1 == sizes.len() {
                    large = Some(w);
                }
            }
            if let (Some(s), Some(l)) = (small.as_mut(), large.as_mut()) {
                paired = Some(paired_hit(s, l, a.seconds)?);
            }
        }
        (Some(w), true) => {
            // The section's settings apply to the hit points only, where it gives them.
            let mut ha = a.clone();
            ha.seconds = w.seconds.unwrap_or(a.seconds);
            ha.batch = w.batch.unwrap_or(a.batch);
            ha.count = w.count.unwrap_or(a.count);
            let (points, info) = workload_hit_points(w, &ha)?;
            for (n, mpps, rss) in points {
                record(n, mpps, rss);
            }
            hit_workload = Some(info);
        }
    }
    // After the one-core points, whose kept tables are freed by now.
    let node_hit = if a.workers > 1 && hit_w.is_none() && want("hit") {
        let cpus = allowed[..a.workers].to_vec();
        let mut node = NodeHit {
            workers: a.workers,
            cpus: cpus.clone(),
            mpps: BTreeMap::new(),
            per_worker_mpps: BTreeMap::new(),
            over_one_core: BTreeMap::new(),
        };
        for (key, one) in &hit_mpps {
            let flows: usize = key.parse().context("a hit point's flow count")?;
            let each = node_hit_point(flows, &cpus, &a)?;
            let sum: f64 = each.iter().sum();
            node.mpps.insert(key.clone(), sum);
            node.per_worker_mpps.insert(key.clone(), each);
            node.over_one_core.insert(key.clone(), sum / one);
        }
        Some(node)
    } else {
        None
    };
    let miss_mpps = if want("miss") { miss_point(&a)? } else { 0.0 };
    let chain = if want("chain") {
        let mut w = chain_w.clone().unwrap_or_default();
        if a.quick && chain_w.is_none() {
            w.flows = 100_000;
            w.seconds = 0.2;
        }
        Some(crate::bench_chain::chain_point(&w)?)
    } else {
        None
    };
    let big = pipeline::FlowTable::new(1_000_000, 0)?;
    let bytes_per_flow = big.bytes_at_capacity() as f64 / 1_000_000.0;
    rates.sort_by_key(|r| r.0);
    let large_over_small = rates.last().unwrap().1 / rates[0].1;
    Ok(PipelineBench {
        hit_mpps,
        hit_rule_counts: hit_w.as_ref().and_then(|w| w.count).unwrap_or(a.count),
        miss_mpps,
        parse_mpps,
        baseline_mpps,
        bytes_per_flow,
        key_bytes: FlowKey::LEN,
        entry_bytes: std::mem::size_of::<pipeline::FlowEntry>(),
        rule_bytes: std::mem::size_of::<pipeline::RuleSlot>(),
        counter_bytes: std::mem::size_of::<pipeline::RuleCounters>(),
        companion_bytes: std::mem::size_of::<u32>(),
        rss_bytes_per_flow: rss_per_flow,
        large_over_small,
        large_over_small_paired: paired.as_ref().map(|p| p.ratio),
        paired,
        batch: a.batch,
        seconds_per_point: a.seconds,
        inner_frame_bytes: 60,
        chain_mpps: chain.as_ref().map_or(0.0, |c| c.mpps),
        chain_p99_us: chain.as_ref().map_or(0.0, |c| c.batch_p99_us),
        chain,
        hit_workload,
        node_hit,
    })
}

pub fn print_table(r: &PipelineBench) {
    println!(
        "starfabric pipeline benchmark (one core, {}-packet batches, 64-byte inner frames)",
        r.batch
    );
    println!(
        "  {:<36} {:>10.2} Mpps",
        "copy-only baseline (rx+tx)", r.baseline_mpps
    );
    println!(
        "  {:<36} {:>10.2} Mpps",
        "parse only (outer + inner)", r.parse_mpps
    );
    if let Some(w) = &r.hit_workload {
        println!(
            "  hit points from workload {} ({}{})",
            w.name,
            w.popularity,
            w.trace_packets
                .map_or(String::new(), |p| format!(", {p} packets"))
        );
    }
    for (n, m) in &r.hit_mpps {
        let share = r
            .hit_workload
            .as_ref()
            .and_then(|w| w.top1pct_share.get(n))
            .map_or(String::new(), |s| {
                format!("; busiest 1% of flows: {:.0}% of packets", 100.0 * s)
            });
        println!(
            "  {:<36} {:>10.2} Mpps  ({:.0}% of baseline{share})",
            format!("hit: SNAT + re-encap, {n} flows"),
            m,
            100.0 * m / r.baseline_mpps
        );
    }
    println!(
        "  {:<36} {:>10.3} Mpps  (new flows/s, in M)",
        "miss: hold+request+install+release", r.miss_mpps
    );
    println!(
        "  bytes per flow: {:.1} (entry {} = key {} + meta {} + rule {}; counters {}; companion {}; bucket share {:.1}){}",
        r.bytes_per_flow,
        r.entry_bytes,
        r.key_bytes,
        r.entry_bytes - r.key_bytes - r.rule_bytes,
        r.rule_bytes,
        r.counter_bytes,
        r.companion_bytes,
        r.bytes_per_flow - (r.entry_bytes + r.counter_bytes + r.companion_bytes) as f64,
        r.rss_bytes_per_flow
            .map(|b| format!("; measured RSS {b:.1}"))
            .unwrap_or_default()
    );
    println!(
        "  largest/smallest flow count rate ratio: {:.2}",
        r.large_over_small
    );
    if let Some(p) = &r.paired {
        println!(
            "  the same, interleaved ({} rounds of {:.0} ms slices, {} and {} flows): {:.2} (rounds {:.2}–{:.2}; {:.2} and {:.2} Mpps)",
            p.rounds,
            p.slice_seconds * 1e3,
            p.small_flows,
            p.large_flows,
            p.ratio,
            p.ratio_min,
            p.ratio_max,
            p.small_mpps,
            p.large_mpps
        );
    }
    if let Some(h) = &r.node_hit {
        for (n, m) in &h.mpps {
            let each: Vec<String> = h.per_worker_mpps[n]
                .iter()
                .map(|x| format!("{x:.2}"))
                .collect();
            println!(
                "  {:<36} {:>10.2} Mpps  (×{:.2} one core; CPUs {:?}: {} Mpps)",
                format!("hit on {} workers, {n} flows", h.workers),
                m,
                h.over_one_core[n],
                h.cpus,
                each.join(" + ")
            );
        }
    }
    if let Some(c) = &r.chain {
        println!(
            "  {:<36} {:>10.2} Mpps  (batch p99 {:.1} µs; {:.3} µs/packet, p99 {:.3}; {} flows decided in {:.1} s)",
            "chain: FW → MON → NAT (Serpens)",
            c.mpps,
            c.batch_p99_us,
            c.per_packet_us,
            c.per_packet_p99_us,
            c.flows,
            c.setup_seconds
        );
        println!("    rule: {}", c.rule);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(workload: &std::path::Path) -> PipelineBenchArgs {
        PipelineBenchArgs {
            json: true,
            flows: vec![1000],
            seconds: 0.05,
            batch: MAX_BATCH,
            quick: false,
            only: Some("hit".into()),
            count: false,
            workload: Some(workload.to_path_buf()),
            workers: 1,
        }
    }

    #[test]
    fn a_packet_trace_runs_through_the_hit_path_every_packet_a_hit() {
        let dir = tempfile::tempdir().unwrap();
        // Three flows, UDP and TCP; the trace's own order, flow 0 busiest.
        let mut csv = String::from("proto,src,sport,dst,dport\n");
        for i in 0..300 {
            let row = match i % 6 {
                0..=3 => "udp,198.18.7.1,4000,198.19.0.1,53",
                4 => "tcp,198.18.7.2,5000,198.19.0.2,443",
                _ => "udp,198.18.7.3,6000,198.19.0.1,123",
            };
            csv.push_str(row);
            csv.push('\n');
        }
        std::fs::write(dir.path().join("t.csv"), csv).unwrap();
        let file = dir.path().join("w.json");
        std::fs::write(
            &file,
            r#"{"flows": 1000, "hit": {"name": "three", "packets_csv": "t.csv", "count": true}}"#,
        )
        .unwrap();
        // `hit_point_with` fails the run on any miss or drop, so a frame stamped with
        // another 5-tuple than its rule's would fail here.
        let r = pipeline_bench(&args(&file)).unwrap();
        assert_eq!(r.hit_mpps.keys().collect::<Vec<_>>(), vec!["3"]);
        assert!(r.hit_mpps["3"] > 0.0);
        assert!(r.hit_rule_counts);
        let info = r.hit_workload.unwrap();
        assert_eq!(info.name, "three");
        assert_eq!(info.popularity, "trace");
        assert_eq!(info.trace_packets, Some(300));
        // The busiest 1% of 3 flows is one flow: 4 packets of every 6.
        assert!((info.top1pct_share["3"] - 4.0 / 6.0).abs() < 1e-9);
    }

    #[test]
    fn the_interleaved_ratio_runs_both_kept_tables_every_packet_a_hit() {
        // Given out of order: the smallest and the largest are paired, whatever the order.
        let r = pipeline_bench(&PipelineBenchArgs {
            json: true,
            flows: vec![50_000, 1000, 5000],
            seconds: 0.3,
            batch: MAX_BATCH,
            quick: false,
            only: Some("hit".into()),
            count: false,
            workload: None,
            workers: 1,
        })
        .unwrap();
        assert_eq!(r.hit_mpps.len(), 3);
        let p = r.paired.clone().unwrap();
        assert_eq!((p.small_flows, p.large_flows), (1000, 50_000));
        // 0.3 s per table in rounds of two 50 ms slices each.
        assert_eq!(p.rounds, 3);
        assert!(p.ratio_min <= p.ratio && p.ratio <= p.ratio_max, "{p:?}");
        assert!(p.small_mpps > 0.0 && p.large_mpps > 0.0, "{p:?}");
        assert_eq!(r.large_over_small_paired, Some(p.ratio));
        // One flow count has nothing to pair.
        let mut one = args(std::path::Path::new("unused"));
        one.workload = None;
        let r = pipeline_bench(&one).unwrap();
        assert!(r.paired.is_none() && r.large_over_small_paired.is_none());
    }

    /// `--workers N`: every hit point again on N pinned workers at once, each over its
    /// share of the flows, every packet a hit (checked per worker), the node's rate the
    /// sum of the workers'. More workers than CPUs is refused.
    #[test]
    fn the_node_points_run_every_worker_over_its_share_every_packet_a_hit() {
        let cpus = corepack::allowed_cpus();
        let mut a = args(std::path::Path::new("unused"));
        a.workload = None;
        a.flows = vec![1001, 20_000];
        a.workers = cpus.len() + 1;
        let e = pipeline_bench(&a).unwrap_err().to_string();
        assert!(e.contains("--workers must be"), "{e}");
        if cpus.len() < 2 {
            return;
        }
        a.workers = 2;
        let r = pipeline_bench(&a).unwrap();
        let h = r.node_hit.clone().unwrap();
        assert_eq!((h.workers, h.cpus.clone()), (2, cpus[..2].to_vec()));
        assert_eq!(
            h.mpps.keys().collect::<Vec<_>>(),
            r.hit_mpps.keys().collect::<Vec<_>>()
        );
        for (n, each) in &h.per_worker_mpps {
            assert_eq!(each.len(), 2);
            assert!(each.iter().all(|&m| m > 0.0), "{n}: {each:?}");
            assert!((each.iter().sum::<f64>() - h.mpps[n]).abs() < 1e-9);
            assert!((h.over_one_core[n] - h.mpps[n] / r.hit_mpps[n]).abs() < 1e-9);
        }
        // One worker: no node points.
        a.workers = 1;
        assert!(pipeline_bench(&a).unwrap().node_hit.is_none());
    }

    /// A worker's share: flows `i` with `i % n == w`, and nothing else.
    #[test]
    fn a_shards_traffic_draws_only_its_own_flows() {
        for (total, n, w, share) in [
            (1001u64, 2u64, 0u64, 501u64),
            (1001, 2, 1, 500),
            (10, 3, 2, 3),
        ] {
            let mut t = ShardTraffic::new(total, n, w);
            assert_eq!(t.flows(), share);
            let mut frame = vec![0u8; 256];
            let mut seen = std::collections::BTreeSet::new();
            for _ in 0..20_000 {
                let (len, _) = t.next_frame(&mut frame).unwrap();
                let src = &frame[INNER_SRC..INNER_SRC + 4];
                let sport = u16::from_be_bytes([frame[INNER_SPORT], frame[INNER_SPORT + 1]]);
                let i = (0..total)
                    .find(|&i| {
                        let (a, p) = flow_src(i);
                        a.octets() == src && p == sport
                    })
                    .expect("a flow of the node");
                assert_eq!(i % n, w);
                assert!(len > INNER_SPORT);
                seen.insert(i);
            }
            assert_eq!(seen.len() as u64, share, "every flow of the share is drawn");
        }
    }

    #[test]
    fn generated_flows_follow_the_sections_popularity() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("w.json");
        std::fs::write(
            &file,
            r#"{"hit": {"flows": [2000], "popularity": {"zipf": 1.0}}}"#,
        )
        .unwrap();
        let r = pipeline_bench(&args(&file)).unwrap();
        assert!(r.hit_mpps["2000"] > 0.0);
        let info = r.hit_workload.unwrap();
        assert_eq!(info.popularity, "zipf(1)");
        assert!(info.top1pct_share["2000"] > 0.2, "{info:?}");
        // A workload's points are not paired.
        assert!(r.paired.is_none());
        // Without the section the points are `--flows`' and uniform, as before.
        std::fs::write(&file, r#"{"flows": 1000}"#).unwrap();
        let r = pipeline_bench(&args(&file)).unwrap();
        assert_eq!(r.hit_mpps.keys().collect::<Vec<_>>(), vec!["1000"]);
        assert!(r.hit_workload.is_none());
    }

    #[test]
    fn a_bad_pipeline_workload_is_an_error_that_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("w.json");
        for (text, want) in [
            (r#"{"flowz": 1}"#, "not a chain workload"),
            (r#"{"hit": 3}"#, "hit"),
            (r#"{"hit": {"popularity": {"zipf": 0}}}"#, "zipf exponent"),
            (r#"[1]"#, "not a JSON object"),
        ] {
            std::fs::write(&file, text).unwrap();
            let e = format!("{:#}", pipeline_bench(&args(&file)).unwrap_err());
            assert!(e.contains(want) && e.contains("w.json"), "{text}: {e}");
        }
    }
}
