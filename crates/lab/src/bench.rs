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
    /// The chain row (FW → MON → NAT, Serpens Fig. 15) from this workload file
    /// (docs/benchmarks.md, "Chain workload"); default 1M flows, 2 s.
    #[arg(long)]
    pub workload: Option<std::path::PathBuf>,
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
    /// hit rate at the largest flow count over the rate at the smallest.
    pub large_over_small: f64,
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
    let key = FlowKey::new(VNI, 17, src.into(), sport, DST.into(), 53);
    // Paired pooling as SNAT would: 60000 ports per public address.
    let pool = Ipv4Addr::new(
        198,
        19,
        100 + (i / 60000 / 256) as u8,
        (i / 60000 % 256) as u8,
    );
    let mut actions = vec![
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
    ];
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
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            // Multiply-shift range reduction: a 64-bit `%` costs more than a table hit.
            ((self.rng as u128 * self.flows as u128) >> 64) as u64
        };
        let n = self.template.len();
        out[..n].copy_from_slice(&self.template);
        stamp_flow(out, i);
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

fn hit_point(flows: usize, a: &PipelineBenchArgs) -> Result<(f64, Option<f64>)> {
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
    for i in 0..flows as u64 {
        p.install_rule(&snat_rule(i, a.count), 0)
            .context("installing bench rules")?;
    }
    let rss1 = rss_bytes();
    anyhow::ensure!(
        p.table().len() == flows,
        "table holds {} of {flows}",
        p.table().len()
    );
    let io = MemRing::new(Traffic::random(flows as u64), a.batch);
    let mut w = Worker::new(p, io, a.batch, Box::new(MonotonicClock::new()));
    let mpps = timed(a.seconds, || w.run_once().unwrap_or(0));
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
    let per_flow = match (rss0, rss1) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / flows as f64),
        _ => None,
    };
    Ok((mpps, per_flow))
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
    let want = |part: &str| a.only.as_deref().is_none_or(|o| o == part);
    let baseline_mpps = if want("baseline") {
        baseline_point(&a)
    } else {
        0.0
    };
    let parse_mpps = if want("parse") { parse_point(&a) } else { 0.0 };
    let mut hit_mpps = BTreeMap::new();
    let mut rates = vec![(0, 0.0)];
    let mut rss_per_flow = None;
    for &n in a.flows.iter().filter(|_| want("hit")) {
        rates.retain(|r| r.0 != 0);
        let (mpps, rss) = hit_point(n, &a)?;
        hit_mpps.insert(n.to_string(), mpps);
        rates.push((n, mpps));
        rss_per_flow = rss;
    }
    let miss_mpps = if want("miss") { miss_point(&a)? } else { 0.0 };
    let chain = if want("chain") {
        let mut w = match &a.workload {
            Some(p) => crate::bench_chain::ChainWorkload::load(p)?,
            None => crate::bench_chain::ChainWorkload::default(),
        };
        if a.quick && a.workload.is_none() {
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
        hit_rule_counts: a.count,
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
        batch: a.batch,
        seconds_per_point: a.seconds,
        inner_frame_bytes: 60,
        chain_mpps: chain.as_ref().map_or(0.0, |c| c.mpps),
        chain_p99_us: chain.as_ref().map_or(0.0, |c| c.batch_p99_us),
        chain,
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
    for (n, m) in &r.hit_mpps {
        println!(
            "  {:<36} {:>10.2} Mpps  ({:.0}% of baseline)",
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
