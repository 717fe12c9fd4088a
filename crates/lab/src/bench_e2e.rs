//! `starfabric bench e2e`: starfabric next to the Linux kernel on the netns testbed,
//! with the same traffic from the same client: TCP Gbit/s (iperf3), 64-byte UDP
//! packets/s (trafgen, counted at the receiver), new TCP connections/s (wrk with
//! `Connection: close` against nginx).
//!
//! Runs, in one topology, one after the other: the kernel routing only, the kernel with
//! nftables SNAT, the kernel as an nftables DNAT load balancer; then starfabric with a
//! SNAT chain on the UDP-socket backend (`starfabric`), the same on the AF_XDP backend
//! (`afxdp`; in copy mode it transmits through a packet socket in UDP GSO runs), the
//! same with the AF_XDP TX ring instead (`afxdp_ring`), and starfabric with an LB chain
//! (UDP socket). The ratios are over kernel
//! nftables SNAT. Every measurement is bounded in time; a failed one is reported as
//! missing (null) with its error, and the run goes on.
//!
//! Each starfabric SNAT variant is one call of `starfabric_snat` with the PP node's
//! arguments (`--io udp`, `--io afxdp`); a later variant (the XDP fast path) is one more
//! call with its own flags and one more field.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use testbed::baseline::{self, KernelMode};
use testbed::measure::{self, Numbers};
use testbed::platform::{self, Platform, PlatformSpec};
use testbed::topo::{addr, vni, Node};
use testbed::{services, Testbed, TopologySpec};

use crate::testbed_cmd::{tenant_chain, ChainKind};

#[derive(Args, Clone, Debug, Default)]
pub struct E2eBenchArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// The run's settings as JSON (docs/benchmarks.md, "E2e workload"); the flags below
    /// override the file.
    #[arg(long)]
    pub workload: Option<PathBuf>,
    /// Seconds per measurement, 1–600 [default: 4].
    #[arg(long)]
    pub secs: Option<u32>,
    /// UDP flows (source ports) of the packets/s run, 1–65535 [default: 16].
    #[arg(long)]
    pub udp_flows: Option<u16>,
    /// Concurrent wrk connections, 1–10000 [default: 32].
    #[arg(long)]
    pub conns: Option<u32>,
    /// nginx backends behind the load balancers, 1–64 [default: 3].
    #[arg(long)]
    pub backends: Option<usize>,
    /// Give the kernel baselines RPS on the PP namespace's underlay link, so their
    /// receive path spreads over every CPU (a veth has no RSS).
    #[arg(long)]
    pub kernel_rps: bool,
    /// Run only these variants (by their JSON names: kernel_forward, kernel,
    /// kernel_dnat_lb, starfabric, afxdp, afxdp_ring, xdp_fastpath, starfabric_lb,
    /// ipsec); the
    /// others are left empty. Default: all.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Take only these measurements (tcp, udp64, core, cps); the others are left
    /// empty. `core` is the per-core ladder that gives `udp64_core_pps` and
    /// `overload_keep`. Default: all.
    #[arg(long, value_delimiter = ',')]
    pub measure: Vec<String>,
    /// More arguments for the PP node of every starfabric variant, appended to the
    /// variant's own (e.g. `--pp-arg=--busy-poll=0`, to compare with a setting off).
    #[arg(long = "pp-arg", allow_hyphen_values = true)]
    pub pp_args: Vec<String>,
    /// After the variants, TCP again in this many pairs per SNAT variant that ran: the
    /// kernel's nftables SNAT and the variant back to back, in turns (the kernel first
    /// in even pairs), so each ratio is over a kernel run seconds away, not minutes.
    /// `tcp_ratio_paired` is the median of each variant's pairs. 0 (the default): none,
    /// 0–20 [default: 0].
    #[arg(long)]
    pub tcp_pairs: Option<u32>,
}

/// The variants, by their JSON names (`--only`).
pub const VARIANTS: [&str; 9] = [
    "kernel_forward",
    "kernel",
    "kernel_dnat_lb",
    "starfabric",
    "afxdp",
    "afxdp_ring",
    "xdp_fastpath",
    "starfabric_lb",
    "ipsec",
];

/// The measurements (`--measure`).
pub const MEASURES: [&str; 4] = ["tcp", "udp64", "core", "cps"];

const DEFAULT_SECS: u32 = 4;
const DEFAULT_UDP_FLOWS: u16 = 16;
const DEFAULT_CONNS: u32 = 32;
const DEFAULT_BACKENDS: usize = 3;

/// `--workload FILE`: the settings the flags take, from a file, so a run can be
/// written down and repeated; every field but `version` is optional.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct E2eWorkload {
    version: u32,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    secs: Option<u32>,
    #[serde(default)]
    udp_flows: Option<u16>,
    #[serde(default)]
    conns: Option<u32>,
    #[serde(default)]
    backends: Option<usize>,
    #[serde(default)]
    kernel_rps: Option<bool>,
    #[serde(default)]
    only: Option<Vec<String>>,
    #[serde(default)]
    measure: Option<Vec<String>>,
    #[serde(default)]
    pp_args: Option<Vec<String>>,
    #[serde(default)]
    tcp_pairs: Option<u32>,
}

impl E2eBenchArgs {
    /// The settings the run uses: each flag given, else the workload file's value, else
    /// the default; checked. Returns the workload's name (its path when it has none).
    pub fn with_workload(mut self) -> Result<(E2eBenchArgs, Option<String>)> {
        let mut name = None;
        if let Some(path) = &self.workload {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading workload {}", path.display()))?;
            let w: E2eWorkload = serde_json::from_str(&text)
                .with_context(|| format!("workload {}: not an e2e workload", path.display()))?;
            anyhow::ensure!(
                w.version == 1,
                "workload {}: version must be 1, got {}",
                path.display(),
                w.version
            );
            name = Some(w.name.unwrap_or_else(|| path.display().to_string()));
            self.secs = self.secs.or(w.secs);
            self.udp_flows = self.udp_flows.or(w.udp_flows);
            self.conns = self.conns.or(w.conns);
            self.backends = self.backends.or(w.backends);
            self.tcp_pairs = self.tcp_pairs.or(w.tcp_pairs);
            self.kernel_rps |= w.kernel_rps.unwrap_or(false);
            for (flag, file) in [
                (&mut self.only, w.only),
                (&mut self.measure, w.measure),
                (&mut self.pp_args, w.pp_args),
            ] {
                if flag.is_empty() {
                    *flag = file.unwrap_or_default();
                }
            }
        }
        self.check().map_err(|e| match &self.workload {
            Some(p) => anyhow!("workload {}: {e}", p.display()),
            None => e,
        })?;
        Ok((self, name))
    }

    /// Every setting in range and every name known; the error names the field.
    fn check(&self) -> Result<()> {
        let within = |name: &str, v: u64, lo: u64, hi: u64| -> Result<()> {
            anyhow::ensure!(
                (lo..=hi).contains(&v),
                "{name} must be {lo}..={hi}, got {v}"
            );
            Ok(())
        };
        within("secs", self.secs().into(), 1, 600)?;
        within("udp_flows", self.udp_flows().into(), 1, 65_535)?;
        within("conns", self.conns().into(), 1, 10_000)?;
        within("backends", self.backends() as u64, 1, 64)?;
        within("tcp_pairs", self.tcp_pairs().into(), 0, 20)?;
        for (field, names, known) in [
            ("only", &self.only, &VARIANTS[..]),
            ("measure", &self.measure, &MEASURES[..]),
        ] {
            if let Some(bad) = names.iter().find(|n| !known.contains(&n.as_str())) {
                anyhow::bail!("{field}: unknown {bad:?} (one of {})", known.join(", "));
            }
        }
        Ok(())
    }

    fn secs(&self) -> u32 {
        self.secs.unwrap_or(DEFAULT_SECS)
    }

    fn tcp_pairs(&self) -> u32 {
        self.tcp_pairs.unwrap_or(0)
    }

    fn udp_flows(&self) -> u16 {
        self.udp_flows.unwrap_or(DEFAULT_UDP_FLOWS)
    }

    fn conns(&self) -> u32 {
        self.conns.unwrap_or(DEFAULT_CONNS)
    }

    fn backends(&self) -> usize {
        self.backends.unwrap_or(DEFAULT_BACKENDS)
    }

    fn runs(&self, variant: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|v| v == variant)
    }

    fn measures(&self, m: &str) -> bool {
        self.measure.is_empty() || self.measure.iter().any(|v| v == m)
    }
}

/// Results; field names are the documented JSON interface.
#[derive(Serialize, Debug, Default)]
pub struct E2eBench {
    /// starfabric with a SNAT chain, PP node on the UDP-socket backend (`--io udp`).
    pub starfabric: Numbers,
    /// starfabric with a SNAT chain, PP node on the AF_XDP backend (`--io afxdp`).
    pub afxdp: Numbers,
    /// afxdp / kernel.
    pub ratio_afxdp: Numbers,
    /// The same on AF_XDP transmitting through the socket's TX ring
    /// (`--afxdp-tx ring`: one skb per frame in copy mode), the backend's transmit
    /// before the packet socket; beside `afxdp` so both are measured in one run.
    pub afxdp_ring: Numbers,
    /// afxdp_ring / kernel.
    pub ratio_afxdp_ring: Numbers,
    /// starfabric with a SNAT chain on AF_XDP with the XDP fast path on (`--offload`):
    /// elephant flows' rules run in the driver.
    pub xdp_fastpath: Numbers,
    /// xdp_fastpath / kernel.
    pub ratio_xdp_fastpath: Numbers,
    /// xdp_fastpath / afxdp: the fast path over our own userspace path (paper 000 §6
    /// reports 6.6x for NAT on a DPU).
    pub fastpath_over_userspace: Numbers,
    /// The kernel with nftables SNAT: the baseline of `ratio`.
    pub kernel: Numbers,
    /// starfabric / kernel.
    pub ratio: Numbers,
    /// The kernel routing only (no NAT).
    pub kernel_forward: Numbers,
    /// The kernel as an nftables DNAT load balancer (cps against the VIP).
    pub kernel_dnat_lb: Numbers,
    /// starfabric with an LB chain (cps against the VIP).
    pub starfabric_lb: Numbers,
    /// starfabric_lb / kernel_dnat_lb.
    pub ratio_lb: Numbers,
    /// TCP Gbit/s (iperf3, VPC 0's host to the remote site's host) through starfabric's
    /// IPsec gateway: ESP tunnel mode, AES-GCM-128, to the remote site (docs/ipsec.md).
    pub ipsec_gbps: Option<f64>,
    /// The same through the kernel's xfrm as the gateway in the PP namespace, same
    /// topology and remote site, same run.
    pub ipsec_kernel_gbps: Option<f64>,
    /// ipsec_gbps / ipsec_kernel_gbps.
    pub ipsec_ratio: Option<f64>,
    /// The gateway's own seal rate on one core, in memory (AES-128-GCM, 1400-byte
    /// packets, bursts of 64 through the same call the pipeline makes): what the
    /// data path could carry with the I/O and the remote site out of the way.
    pub ipsec_core_gbps: Option<f64>,
    /// Issue 18's summary: each SNAT backend's TCP Gbit/s over the kernel nftables
    /// SNAT's (the `tcp_gbps` of `ratio`, `ratio_afxdp`, `ratio_afxdp_ring` and
    /// `ratio_xdp_fastpath`, gathered by backend).
    pub tcp_ratio: ByBackend,
    /// 64-byte UDP packets/s end to end over the kernel's (`udp64_pps` of the ratios).
    pub udp64_ratio: ByBackend,
    /// 64-byte UDP packets/s with the NF alone on one CPU over the kernel's
    /// (`udp64_core_pps` of the ratios): the per-core figure the goals are judged on.
    pub udp64_core_ratio: ByBackend,
    /// New TCP connections/s over the kernel's (`cps` of the ratios).
    pub cps_ratio: ByBackend,
    /// What each backend, and the kernel, forwards at 2 x its peak offered load over its
    /// peak, per core (`overload_keep` of each variant; issue 18's goal: >= 0.9).
    pub overload_keep: ByBackend,
    /// `tcp_ratio` again from `--tcp-pairs` pairs: each variant's TCP Gbit/s over the
    /// kernel nftables SNAT's measured right beside it, the median of the variant's
    /// pairs. This VM's speed drifts from one minute to the next, and the variants'
    /// own TCP runs come minutes after the kernel's; `tcp_ratio` stays as it was.
    pub tcp_ratio_paired: ByBackend,
    /// Every pair: (variant, kernel Gbit/s, variant Gbit/s).
    pub tcp_pairs: Vec<TcpPair>,
    pub setup: Setup,
    /// Measurements that failed, with why.
    pub errors: Vec<String>,
}

/// One pair of `--tcp-pairs`: the kernel nftables SNAT and a starfabric SNAT variant,
/// one iperf3 run each, back to back.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct TcpPair {
    /// The variant's JSON name (`starfabric`, `afxdp`, `afxdp_ring`, `xdp_fastpath`).
    pub variant: String,
    pub kernel_gbps: f64,
    pub gbps: f64,
    /// Whether the kernel ran first in this pair.
    pub kernel_first: bool,
}

/// The median of `variant`'s pairs' ratios, if it has any.
fn paired_ratio(pairs: &[TcpPair], variant: &str) -> Option<f64> {
    crate::median(
        pairs
            .iter()
            .filter(|p| p.variant == variant && p.kernel_gbps > 0.0)
            .map(|p| p.gbps / p.kernel_gbps)
            .collect(),
    )
}

/// One figure per SNAT variant: the PP node on the UDP-socket backend, on AF_XDP (packet
/// socket transmit, and TX ring transmit), with the XDP fast path; and the kernel's
/// nftables SNAT where the figure is not a ratio over it.
#[derive(Serialize, Debug, Default, PartialEq)]
pub struct ByBackend {
    pub udp_socket: Option<f64>,
    pub afxdp: Option<f64>,
    pub afxdp_ring: Option<f64>,
    pub xdp_fastpath: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel: Option<f64>,
}

impl E2eBench {
    /// Fill the ratios and the by-backend summary from the measured variants.
    fn derive(&mut self) {
        self.ratio = self.starfabric.ratio(&self.kernel);
        self.ratio_afxdp = self.afxdp.ratio(&self.kernel);
        self.ratio_afxdp_ring = self.afxdp_ring.ratio(&self.kernel);
        self.ratio_xdp_fastpath = self.xdp_fastpath.ratio(&self.kernel);
        self.fastpath_over_userspace = self.xdp_fastpath.ratio(&self.afxdp);
        self.ratio_lb = self.starfabric_lb.ratio(&self.kernel_dnat_lb);
        let ratios = |f: fn(&Numbers) -> Option<f64>| ByBackend {
            udp_socket: f(&self.ratio),
            afxdp: f(&self.ratio_afxdp),
            afxdp_ring: f(&self.ratio_afxdp_ring),
            xdp_fastpath: f(&self.ratio_xdp_fastpath),
            kernel: None,
        };
        self.tcp_ratio = ratios(|n| n.tcp_gbps);
        self.udp64_ratio = ratios(|n| n.udp64_pps);
        self.udp64_core_ratio = ratios(|n| n.udp64_core_pps);
        self.cps_ratio = ratios(|n| n.cps);
        self.tcp_ratio_paired = ByBackend {
            udp_socket: paired_ratio(&self.tcp_pairs, "starfabric"),
            afxdp: paired_ratio(&self.tcp_pairs, "afxdp"),
            afxdp_ring: paired_ratio(&self.tcp_pairs, "afxdp_ring"),
            xdp_fastpath: paired_ratio(&self.tcp_pairs, "xdp_fastpath"),
            kernel: None,
        };
        self.overload_keep = ByBackend {
            udp_socket: self.starfabric.overload_keep,
            afxdp: self.afxdp.overload_keep,
            afxdp_ring: self.afxdp_ring.overload_keep,
            xdp_fastpath: self.xdp_fastpath.overload_keep,
            kernel: self.kernel.overload_keep,
        };
    }
}

#[derive(Serialize, Debug, Default)]
pub struct Setup {
    pub secs: u32,
    pub udp_flows: u16,
    pub wrk_connections: u32,
    pub backends: usize,
    pub cpus: usize,
    /// The PP node's last stats line of each starfabric run.
    pub pp_stats: Vec<String>,
    /// The PP node's listening line of each starfabric run (names its I/O backend).
    pub pp_io: Vec<String>,
    /// Whether the kernel baselines had RPS on the PP namespace's underlay link.
    pub kernel_rps: bool,
    /// The workload's name (`--workload`), or null without one.
    pub workload: Option<String>,
    /// Per 64-byte UDP run: what trafgen offered next to what arrived.
    pub udp64: Vec<String>,
    /// Who terminated the IPsec tunnel at the remote site (kernel xfrm, or the
    /// userspace ESP endpoint where the kernel has no ESP), and the PP node's stats line.
    pub ipsec: Vec<String>,
}

/// Start the platform under test. The one place that knows how starfabric is started
/// (today: FM, SC and PP processes from an FM configuration file; later the
/// orchestrator's `starfabric up`).
fn start_platform(
    tb: &Testbed,
    bin: &Path,
    chain: ChainKind,
    backends: usize,
    pp_args: &[&str],
) -> Result<Platform> {
    let c = tenant_chain(chain, 0, backends)?;
    let spec = PlatformSpec::new(vec![c], vec![(vni::tenant(0), 1, 1)]).pp_args(pp_args);
    Ok(platform::start_starfabric(tb, bin, &spec)?)
}

/// Start starfabric with a SNAT chain and the PP node's `pp_args`, measure TCP, UDP and
/// cps to the internet host, stop it. The PP node's listening and stats lines go to
/// `setup`.
fn starfabric_snat(
    r: &mut Runner<'_>,
    setup: &mut Setup,
    bin: &Path,
    label: &str,
    pp_args: &[&str],
) -> Result<Numbers> {
    let p = start_platform(r.tb, bin, ChainKind::Snat, r.a.backends(), pp_args)?;
    setup.pp_io.push(format!("{label}: {}", p.pp_listening()));
    let n = r.internet(label, &[p.pp.pid]);
    setup.pp_stats.push(p.pp_stats());
    p.stop(r.tb);
    Ok(n)
}

/// One `--tcp-pairs` pair: iperf3 through the kernel's nftables SNAT and through the
/// variant, back to back, the kernel first when `kernel_first`. None when either run
/// failed (its error is in the report's `errors`).
fn tcp_pair(
    r: &mut Runner<'_>,
    bin: &Path,
    variant: &str,
    label: &str,
    pp_args: &[&str],
    kernel_first: bool,
) -> Result<Option<TcpPair>> {
    let secs = r.a.secs();
    let kernel = |r: &mut Runner<'_>| -> Result<Option<f64>> {
        r.progress("kernel (paired): iperf3");
        let k = baseline::start_kernel(r.tb, KernelMode::Snat)?;
        let g = measure::tcp_gbps(r.tb, Node::Client(0), addr::INET, secs);
        k.stop(r.tb);
        if !r.a.json {
            eprintln!("done");
        }
        Ok(r.note("kernel paired tcp", g))
    };
    let ours = |r: &mut Runner<'_>| -> Result<Option<f64>> {
        r.progress(&format!("{label} (paired): iperf3"));
        let p = start_platform(r.tb, bin, ChainKind::Snat, r.a.backends(), pp_args)?;
        let g = measure::tcp_gbps(r.tb, Node::Client(0), addr::INET, secs);
        p.stop(r.tb);
        if !r.a.json {
            eprintln!("done");
        }
        Ok(r.note(&format!("{label} paired tcp"), g))
    };
    let (k, g) = if kernel_first {
        let k = kernel(r)?;
        (k, ours(r)?)
    } else {
        let g = ours(r)?;
        (kernel(r)?, g)
    };
    Ok(match (k, g) {
        (Some(kernel_gbps), Some(gbps)) => Some(TcpPair {
            variant: variant.to_string(),
            kernel_gbps,
            gbps,
            kernel_first,
        }),
        _ => None,
    })
}

/// The `setup.udp64` line of a per-core ladder: the peak, the 2× step, the unpaced
/// step, and every step as `phase asked: offered→forwarded` (k packets/s).
fn core_line(label: &str, u: &measure::Udp64Core) -> String {
    let k = |v: f64| format!("{:.0}k", v / 1e3);
    let steps: Vec<String> = u
        .ladder
        .iter()
        .map(|s| {
            let phase = match s.phase {
                testbed::ladder::Phase::Bracket => "x2",
                testbed::ladder::Phase::Bisect => "bisect",
                testbed::ladder::Phase::Overload => "2xpeak",
                testbed::ladder::Phase::PairPeak => "pair peak",
                testbed::ladder::Phase::PairOverload => "pair 2xpeak",
                testbed::ladder::Phase::Unpaced => "unpaced",
            };
            let asked = if s.asked == 0 {
                "max".to_string()
            } else {
                k(s.asked as f64)
            };
            // How much of the step the NF ran real-time (PP's `--worker-rt`).
            let rt = match s.rt_share {
                Some(r) if r > 0.0 => format!(" rt {:.0}%", r * 100.0),
                _ => String::new(),
            };
            format!("{phase} {asked}: {}→{}{rt}", k(s.offered), k(s.forwarded))
        })
        .collect();
    let opt = |v: Option<f64>| v.map_or("-".to_string(), k);
    format!(
        "{label}, NF on CPU {} (sender on CPU {}): peak {} pps forwarded ({} offered, peak load {}); at 2x the peak load {} offered, {} forwarded, overload_keep {}, overload_keep_paired {}; unpaced {}; steps: {}",
        u.nf_cpu,
        u.gen_cpu,
        k(u.pps),
        k(u.offered_pps),
        u.peak_load_pps.map_or("-".to_string(), |p| k(p as f64)),
        opt(u.overload2x_offered_pps),
        opt(u.overload2x_pps),
        u.overload_keep.map_or("-".to_string(), |v| format!("{v:.2}")),
        u.overload_keep_paired
            .map_or("-".to_string(), |v| format!("{v:.2}")),
        opt(u.overload_pps),
        steps.join(", ")
    )
}

struct Runner<'a> {
    tb: &'a Testbed,
    a: &'a E2eBenchArgs,
    bin: &'a Path,
    errors: Vec<String>,
    offered: Vec<String>,
}

impl Runner<'_> {
    fn note<T>(&mut self, what: &str, r: testbed::Result<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                let msg = format!("{what}: {e}");
                eprintln!("bench e2e: {msg}");
                self.errors.push(msg);
                None
            }
        }
    }

    fn progress(&self, what: &str) {
        if !self.a.json {
            eprint!("bench e2e: {what} ... ");
            let _ = std::io::stderr().flush();
        }
    }

    /// TCP, UDP (end to end, and the NF on one core) and cps through to the internet
    /// host. `nf_pids`: the NF's processes, pinned with it for the per-core rate.
    fn internet(&mut self, label: &str, nf_pids: &[i32]) -> Numbers {
        let (tb, a) = (self.tb, self.a);
        let mut tcp_gbps = None;
        if a.measures("tcp") {
            self.progress(&format!("{label}: iperf3"));
            let tcp = measure::tcp_gbps(tb, Node::Client(0), addr::INET, a.secs());
            tcp_gbps = self.note(&format!("{label} tcp"), tcp);
        }
        let mut udp64_pps = None;
        if a.measures("udp64") {
            self.progress(&format!("{label}: trafgen"));
            let udp = measure::udp64_pps(
                tb,
                0,
                a.udp_flows(),
                std::time::Duration::from_secs(1),
                f64::from(a.secs()),
            );
            udp64_pps = self.note(&format!("{label} udp64"), udp).map(|u| {
                self.offered.push(format!(
                    "{label}: {:.0} pps offered, {:.0} arrived, {:.0} dropped at the PP namespace's UDP socket buffers",
                    u.offered_pps, u.pps, u.pp_socket_drops_pps
                ));
                u.pps
            });
        }
        let (mut udp64_core_pps, mut overload_keep, mut overload_keep_paired) = (None, None, None);
        if a.measures("core") {
            self.progress(&format!("{label}: xdp-gen ladder"));
            let core = measure::udp64_core_pps(
                tb,
                self.bin,
                0,
                a.udp_flows(),
                nf_pids,
                std::time::Duration::from_secs(1),
                1.0,
            );
            if let Some(u) = self.note(&format!("{label} udp64 core"), core) {
                self.offered.push(core_line(label, &u));
                udp64_core_pps = Some(u.pps);
                overload_keep = u.overload_keep;
                overload_keep_paired = u.overload_keep_paired;
            }
        }
        let mut cps = None;
        if a.measures("cps") {
            self.progress(&format!("{label}: wrk"));
            let url = format!("http://{}/", addr::INET);
            let c = measure::cps(tb, Node::Client(0), &url, a.secs(), a.conns());
            cps = self.note(&format!("{label} cps"), c);
        }
        if !a.json {
            eprintln!("done");
        }
        Numbers {
            tcp_gbps,
            udp64_pps,
            udp64_core_pps,
            cps,
            overload_keep,
            overload_keep_paired,
        }
    }

    /// cps against the VIP.
    fn lb(&mut self, label: &str) -> Numbers {
        self.progress(&format!("{label}: wrk"));
        let url = format!("http://{}/", addr::VIP);
        let c = measure::cps(
            self.tb,
            Node::Client(0),
            &url,
            self.a.secs(),
            self.a.conns(),
        );
        let cps = self.note(&format!("{label} cps"), c);
        if !self.a.json {
            eprintln!("done");
        }
        Numbers {
            cps,
            ..Numbers::default()
        }
    }
}

pub fn run(a: E2eBenchArgs) -> Result<E2eBench> {
    let (a, workload) = a.with_workload()?;
    let (prefix, res) = crate::testbed_cmd::testbed_run("sfb-")?;
    let tb = Testbed::build(
        TopologySpec::new(&prefix)
            .tenants(1)
            .backends(a.backends().max(1)),
        res.clone(),
    )?;
    services::start_inet(&tb, false)?;
    services::start_backends(&tb)?;
    let bin: PathBuf = std::env::current_exe()?;
    let mut r = Runner {
        tb: &tb,
        a: &a,
        bin: &bin,
        errors: Vec::new(),
        offered: Vec::new(),
    };
    let mut out = E2eBench::default();

    for mode in [KernelMode::Forward, KernelMode::Snat, KernelMode::DnatLb] {
        let variant = match mode {
            KernelMode::Forward => "kernel_forward",
            KernelMode::Snat => "kernel",
            KernelMode::DnatLb => "kernel_dnat_lb",
        };
        if !a.runs(variant) {
            continue;
        }
        let k = baseline::start_kernel(&tb, mode)?;
        if a.kernel_rps {
            baseline::enable_rps(&tb, Node::Pp, "up0")?;
        }
        let n = match mode {
            KernelMode::DnatLb => r.lb(mode.name()),
            _ => r.internet(mode.name(), &[]),
        };
        k.stop(&tb);
        match mode {
            KernelMode::Forward => out.kernel_forward = n,
            KernelMode::Snat => out.kernel = n,
            KernelMode::DnatLb => out.kernel_dnat_lb = n,
        }
    }

    if a.kernel_rps {
        // starfabric runs without it, as it always does.
        baseline::disable_rps(&tb, Node::Pp, "up0")?;
    }
    let snat_variants: [(&str, &str, &[&str]); 4] = [
        (
            "starfabric",
            "starfabric SNAT (UDP socket)",
            &["--io", "udp"],
        ),
        ("afxdp", "starfabric SNAT (AF_XDP)", &["--io", "afxdp"]),
        (
            "afxdp_ring",
            "starfabric SNAT (AF_XDP, TX ring)",
            &["--io", "afxdp", "--afxdp-tx", "ring"],
        ),
        (
            "xdp_fastpath",
            "starfabric SNAT (XDP fast path)",
            &["--io", "afxdp", "--offload", "--offload-packets", "200"],
        ),
    ];
    for (variant, label, pp_args) in snat_variants {
        if !a.runs(variant) {
            continue;
        }
        let mut pp_args: Vec<&str> = pp_args.to_vec();
        pp_args.extend(a.pp_args.iter().map(String::as_str));
        let n = starfabric_snat(&mut r, &mut out.setup, &bin, label, &pp_args)?;
        match variant {
            "starfabric" => out.starfabric = n,
            "afxdp" => out.afxdp = n,
            "afxdp_ring" => out.afxdp_ring = n,
            _ => out.xdp_fastpath = n,
        }
    }
    if a.tcp_pairs() > 0 && a.measures("tcp") {
        for (variant, label, pp_args) in snat_variants {
            if !a.runs(variant) {
                continue;
            }
            let mut pp_args: Vec<&str> = pp_args.to_vec();
            pp_args.extend(a.pp_args.iter().map(String::as_str));
            for i in 0..a.tcp_pairs() {
                if let Some(p) = tcp_pair(&mut r, &bin, variant, label, &pp_args, i % 2 == 0)? {
                    out.tcp_pairs.push(p);
                }
            }
        }
    }
    if a.runs("starfabric_lb") {
        let p = start_platform(&tb, &bin, ChainKind::Lb, a.backends(), &["--io", "udp"])?;
        out.setup
            .pp_io
            .push(format!("starfabric LB: {}", p.pp_listening()));
        out.starfabric_lb = r.lb("starfabric LB");
        out.setup.pp_stats.push(p.pp_stats());
        p.stop(&tb);
    }

    if a.runs("ipsec") {
        ipsec(&mut r, &mut out)?;
    }

    out.derive();
    out.errors = r.errors;
    out.setup.udp64 = r.offered;
    out.setup.secs = a.secs();
    out.setup.udp_flows = a.udp_flows();
    out.setup.wrk_connections = a.conns();
    out.setup.backends = a.backends();
    out.setup.cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    out.setup.kernel_rps = a.kernel_rps;
    out.setup.workload = workload;
    drop(tb);
    res.cleanup();
    Ok(out)
}

/// The IPsec rows: a remote site behind the router; iperf3 from VPC 0's host to the
/// host behind it, first with the PP namespace's kernel as the IPsec gateway (xfrm),
/// then with starfabric (`starfabric up`, the tunnel set through the API). Each run has
/// SAs of its own, so neither meets the other's replay window.
fn ipsec(r: &mut Runner<'_>, out: &mut E2eBench) -> Result<()> {
    use testbed::ipsec::{self as tip, CtlApi, KernelGateway, PeerKind, RemoteSite, Sa};
    let tb = r.tb;
    let key = |b: u8| -> String { [b; 20].iter().map(|x| format!("{x:02x}")).collect() };
    r.progress("IPsec gateway on one core, in memory");
    let (seal, open) = ipsec::bench::seal_open_gbps(20, 1.0);
    out.ipsec_core_gbps = Some(seal);
    out.setup.ipsec.push(format!(
        "gateway on one core, in memory: seal {seal:.2} Gbit/s, open {open:.2} Gbit/s (AES-128-GCM, 1400-byte packets)"
    ));
    if !r.a.json {
        eprintln!("done");
    }
    let mut site = RemoteSite::build(tb, None)?;
    out.setup.ipsec.push(site.summary());
    services::start_iperf3(tb, Node::RemoteHost, tip::addr::HOST)?;
    if site.kind == PeerKind::Xfrm {
        r.progress("kernel xfrm IPsec: iperf3");
        let (a, b) = (Sa::new(0x3001, &key(0x31)), Sa::new(0x4001, &key(0x41)));
        site.install(tb, &b, std::slice::from_ref(&a))?;
        let k = KernelGateway::start(tb, &a, &b)?;
        let g = measure::tcp_gbps(tb, Node::Client(0), tip::addr::HOST, r.a.secs());
        out.ipsec_kernel_gbps = r.note("ipsec kernel xfrm tcp", g);
        k.stop(tb)?;
        if !r.a.json {
            eprintln!("done");
        }
    } else {
        r.errors.push(format!(
            "ipsec kernel xfrm baseline: not measurable here: {}",
            site.why_userspace.clone().unwrap_or_default()
        ));
    }
    r.progress("starfabric IPsec: starfabric up");
    let config = tb.path("ipsec-cli.json");
    let up = tb.spawn_up(r.bin, &config, &tb.path("ipsec-up"), &[])?;
    tb.wait_log(&up, "up: ready", std::time::Duration::from_secs(90))?;
    let api = CtlApi::from_config(&config)?;
    let path = "/v1/tenants/bench/ipsec/branch";
    let (ours, theirs) = (Sa::new(0x1001, &key(0x11)), Sa::new(0x2001, &key(0x22)));
    site.install(tb, &theirs, std::slice::from_ref(&ours))?;
    api.put(tb, "/v1/tenants/bench", serde_json::json!({}))?;
    api.put(
        tb,
        "/v1/tenants/bench/vpcs/main",
        serde_json::json!({"vni": vni::tenant(0)}),
    )?;
    api.put(tb, path, tip::tunnel_body(&ours, &[&theirs]))?;
    api.wait_applied(tb, path, ours.spi, std::time::Duration::from_secs(30))?;
    r.progress("starfabric IPsec: iperf3");
    let g = measure::tcp_gbps(tb, Node::Client(0), tip::addr::HOST, r.a.secs());
    out.ipsec_gbps = r.note("ipsec starfabric tcp", g);
    if let Ok((_, v)) = api.call(tb, "GET", path, None) {
        out.setup
            .ipsec
            .push(format!("starfabric tunnel: {}", v["status"]));
    }
    out.setup
        .ipsec
        .push(format!("remote site: {}", site.describe(tb)));
    tb.stop(&up);
    if !r.a.json {
        eprintln!("done");
    }
    out.ipsec_ratio = match (out.ipsec_gbps, out.ipsec_kernel_gbps) {
        (Some(s), Some(k)) if k > 0.0 => Some(s / k),
        _ => None,
    };
    Ok(())
}

fn cell(v: Option<f64>, unit: f64, prec: usize) -> String {
    v.map_or_else(|| "-".to_string(), |v| format!("{:.*}", prec, v / unit))
}

pub fn print(r: &E2eBench) {
    println!(
        "starfabric bench e2e: {} s per run, {} UDP flows, {} wrk connections, {} backends, {} CPUs{}",
        r.setup.secs,
        r.setup.udp_flows,
        r.setup.wrk_connections,
        r.setup.backends,
        r.setup.cpus,
        if r.setup.kernel_rps { ", kernel with RPS" } else { "" }
    );
    println!(
        "{:<24} {:>10} {:>14} {:>16} {:>12} {:>14} {:>8}",
        "", "TCP Gbit/s", "UDP64 kpps", "UDP64/core kpps", "conn/s", "overload_keep", "paired"
    );
    // Numbers in their units (UDP in kpps), or ratios of them to two decimals.
    let row = |name: &str, n: &Numbers, ratio: bool| {
        let (pps_scale, pps_decimals, cps_decimals) = if ratio { (1.0, 2, 2) } else { (1e3, 1, 0) };
        println!(
            "{:<24} {:>10} {:>14} {:>16} {:>12} {:>14} {:>8}",
            name,
            cell(n.tcp_gbps, 1.0, 2),
            cell(n.udp64_pps, pps_scale, pps_decimals),
            cell(n.udp64_core_pps, pps_scale, pps_decimals),
            cell(n.cps, 1.0, cps_decimals),
            cell(n.overload_keep, 1.0, 2),
            cell(n.overload_keep_paired, 1.0, 2)
        );
    };
    for (name, n, ratio) in [
        ("starfabric SNAT (UDP)", &r.starfabric, false),
        ("starfabric SNAT (AF_XDP)", &r.afxdp, false),
        ("sf SNAT (AF_XDP ring)", &r.afxdp_ring, false),
        ("starfabric SNAT (XDP fp)", &r.xdp_fastpath, false),
        ("kernel nft SNAT", &r.kernel, false),
        ("kernel forward", &r.kernel_forward, false),
        ("starfabric LB", &r.starfabric_lb, false),
        ("kernel nft DNAT LB", &r.kernel_dnat_lb, false),
        ("ratio SNAT (sf/kernel)", &r.ratio, true),
        ("ratio AF_XDP (/kernel)", &r.ratio_afxdp, true),
        ("ratio AF_XDP ring", &r.ratio_afxdp_ring, true),
        ("ratio XDP fp (/kernel)", &r.ratio_xdp_fastpath, true),
        ("XDP fp / AF_XDP", &r.fastpath_over_userspace, true),
        ("ratio LB (sf/kernel)", &r.ratio_lb, true),
    ] {
        row(name, n, ratio);
    }
    for (name, v) in [
        ("TCP paired: UDP socket", r.tcp_ratio_paired.udp_socket),
        ("TCP paired: AF_XDP", r.tcp_ratio_paired.afxdp),
        ("TCP paired: AF_XDP ring", r.tcp_ratio_paired.afxdp_ring),
        ("TCP paired: XDP fp", r.tcp_ratio_paired.xdp_fastpath),
    ] {
        if v.is_some() {
            println!(
                "{:<24} {:>10}  (median over kernel runs beside it)",
                name,
                cell(v, 1.0, 2)
            );
        }
    }
    for p in &r.tcp_pairs {
        println!(
            "tcp pair {}: kernel {:.2} Gbit/s, {:.2} Gbit/s ({})",
            p.variant,
            p.kernel_gbps,
            p.gbps,
            if p.kernel_first {
                "kernel first"
            } else {
                "kernel second"
            }
        );
    }
    println!(
        "{:<24} {:>10}",
        "starfabric IPsec",
        cell(r.ipsec_gbps, 1.0, 2)
    );
    println!(
        "{:<24} {:>10}",
        "kernel xfrm IPsec",
        cell(r.ipsec_kernel_gbps, 1.0, 2)
    );
    println!(
        "{:<24} {:>10}",
        "ratio IPsec (sf/kernel)",
        cell(r.ipsec_ratio, 1.0, 2)
    );
    for s in &r.setup.ipsec {
        println!("ipsec {s}");
    }
    for s in &r.setup.udp64 {
        println!("udp64 {s}");
    }
    for s in &r.setup.pp_io {
        println!("{s}");
    }
    for s in &r.setup.pp_stats {
        println!("{s}");
    }
    for e in &r.errors {
        println!("error: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(text: &str, flags: E2eBenchArgs) -> Result<(E2eBenchArgs, Option<String>)> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("e2e.json");
        std::fs::write(&path, text)?;
        E2eBenchArgs {
            workload: Some(path),
            ..flags
        }
        .with_workload()
    }

    #[test]
    fn a_workload_sets_the_run_and_flags_override_it() {
        let (a, name) = with(
            r#"{"version": 1, "name": "tcp only", "secs": 10, "conns": 64, "backends": 5,
                "kernel_rps": true, "only": ["kernel", "xdp_fastpath"], "measure": ["tcp"],
                "pp_args": ["--busy-poll=0"]}"#,
            E2eBenchArgs {
                secs: Some(2),
                measure: vec!["cps".into()],
                ..E2eBenchArgs::default()
            },
        )
        .expect("valid");
        assert_eq!(name.as_deref(), Some("tcp only"));
        assert_eq!((a.secs(), a.conns(), a.backends()), (2, 64, 5));
        assert_eq!(a.udp_flows(), DEFAULT_UDP_FLOWS);
        assert!(a.kernel_rps);
        assert!(a.runs("kernel") && a.runs("xdp_fastpath") && !a.runs("afxdp"));
        assert!(
            a.measures("cps") && !a.measures("tcp"),
            "the flag's list wins"
        );
        assert_eq!(a.pp_args, ["--busy-poll=0"]);
    }

    #[test]
    fn without_a_workload_the_flags_and_defaults_stand() {
        let (a, name) = E2eBenchArgs::default().with_workload().expect("defaults");
        assert_eq!(name, None);
        assert_eq!(
            (a.secs(), a.udp_flows(), a.conns(), a.backends()),
            (
                DEFAULT_SECS,
                DEFAULT_UDP_FLOWS,
                DEFAULT_CONNS,
                DEFAULT_BACKENDS
            )
        );
        assert!(VARIANTS.iter().all(|v| a.runs(v)) && MEASURES.iter().all(|m| a.measures(m)));
        assert_eq!(a.tcp_pairs(), 0, "no pairs unless asked");
        let bad = E2eBenchArgs {
            only: vec!["nft".into()],
            ..E2eBenchArgs::default()
        };
        let e = format!("{:#}", bad.with_workload().unwrap_err());
        assert!(e.contains("only: unknown \"nft\""), "{e}");
    }

    #[test]
    fn bad_e2e_workloads_are_refused_with_the_reason() {
        for (text, want) in [
            (r#"{"version": 2}"#, "version must be 1"),
            (r#"{"version": 1, "rate": 5}"#, "not an e2e workload"),
            (r#"{"version": 1, "secs": 0}"#, "secs must be 1..=600"),
            (r#"{"version": 1, "secs": 601}"#, "secs must be 1..=600"),
            (r#"{"version": 1, "udp_flows": 0}"#, "udp_flows must be"),
            (
                r#"{"version": 1, "udp_flows": 70000}"#,
                "not an e2e workload",
            ),
            (r#"{"version": 1, "conns": 0}"#, "conns must be"),
            (r#"{"version": 1, "backends": 65}"#, "backends must be"),
            (
                r#"{"version": 1, "tcp_pairs": 21}"#,
                "tcp_pairs must be 0..=20",
            ),
            (
                r#"{"version": 1, "measure": ["latency"]}"#,
                "measure: unknown",
            ),
        ] {
            let e = format!("{:#}", with(text, E2eBenchArgs::default()).expect_err(text));
            assert!(e.contains(want), "{text}: {e} (wanted {want:?})");
        }
    }

    fn numbers(tcp: f64, udp: f64, core: f64, cps: Option<f64>, keep: f64) -> Numbers {
        Numbers {
            tcp_gbps: Some(tcp),
            udp64_pps: Some(udp),
            udp64_core_pps: Some(core),
            cps,
            overload_keep: Some(keep),
            overload_keep_paired: None,
        }
    }

    #[test]
    fn paired_tcp_ratios_are_each_variants_median_over_the_kernel_beside_it() {
        let pair = |v: &str, k: f64, g: f64| TcpPair {
            variant: v.into(),
            kernel_gbps: k,
            gbps: g,
            kernel_first: true,
        };
        let mut b = E2eBench {
            tcp_pairs: vec![
                pair("afxdp", 2.0, 1.8),
                pair("afxdp", 1.0, 1.1),
                pair("afxdp", 2.0, 2.4),
                pair("starfabric", 2.0, 2.0),
                pair("starfabric", 2.0, 3.0),
                // A kernel run that read nothing is not divided by.
                pair("xdp_fastpath", 0.0, 2.0),
            ],
            ..E2eBench::default()
        };
        b.derive();
        let p = &b.tcp_ratio_paired;
        assert!((p.afxdp.unwrap() - 1.1).abs() < 1e-12, "{p:?}");
        assert!((p.udp_socket.unwrap() - 1.25).abs() < 1e-12, "{p:?}");
        assert_eq!((p.afxdp_ring, p.xdp_fastpath, p.kernel), (None, None, None));
        // The sequential summary is left as it was: no variant ran on its own here.
        assert_eq!(b.tcp_ratio.afxdp, None);
    }

    #[test]
    fn the_summary_gathers_each_backends_ratio_over_the_kernel() {
        let mut b = E2eBench {
            kernel: numbers(2.0, 100.0, 200.0, Some(50.0), 0.8),
            starfabric: numbers(2.5, 150.0, 220.0, Some(40.0), 1.0),
            afxdp: numbers(3.0, 200.0, 400.0, None, 0.95),
            xdp_fastpath: numbers(4.0, 180.0, 3000.0, Some(75.0), 0.5),
            ..Default::default()
        };
        b.derive();
        assert_eq!(b.tcp_ratio.udp_socket, Some(1.25));
        assert_eq!(b.tcp_ratio.afxdp, Some(1.5));
        assert_eq!(b.tcp_ratio.xdp_fastpath, Some(2.0));
        // Not measured: no figure, not a zero.
        assert_eq!(b.tcp_ratio.afxdp_ring, None);
        assert_eq!(b.udp64_ratio.afxdp, Some(2.0));
        assert_eq!(b.udp64_core_ratio.xdp_fastpath, Some(15.0));
        assert_eq!(b.cps_ratio.udp_socket, Some(0.8));
        assert_eq!(b.cps_ratio.afxdp, None);
        assert_eq!(b.cps_ratio.xdp_fastpath, Some(1.5));
        // Not a ratio: each backend's own, and the kernel's beside them.
        assert_eq!(b.overload_keep.afxdp, Some(0.95));
        assert_eq!(b.overload_keep.kernel, Some(0.8));
        assert_eq!(b.fastpath_over_userspace.udp64_core_pps, Some(7.5));

        let v = serde_json::to_value(&b).unwrap();
        assert_eq!(v["udp64_ratio"]["udp_socket"], 1.5);
        assert_eq!(v["overload_keep"]["kernel"], 0.8);
        assert!(v["tcp_ratio"].get("kernel").is_none());
    }
}
