//! `starfabric bench setup --workload FILE`: the chain and the new flows the setup bench
//! runs, from a file (docs/benchmarks.md, "Setup workload").
//!
//! Without a workload the bench makes its own flows (UDP, one source port per flow, to
//! one service) and uses the chain `--nfs` names. A workload can replace either or both:
//! `nfs` is any chain of the built-in NFs, configured as the orchestrator's API takes
//! them; `flows` (inline) or `flows_csv` (a file beside it) is a list of 5-tuples,
//! each a new flow, optionally with its arrival time, so that a connection trace
//! nobody here wrote can be replayed through PP → FM → SC → FM → PP.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use serde::Deserialize;

/// The most flows a workload may list (a 16-byte tuple and an 8-byte time each).
pub const MAX_FLOWS: usize = 10_000_000;

/// Flows the bench's warm-up may make before a workload's flows start; the warm-up is
/// generated, and a workload flow equal to one of them is refused (it would find FM's
/// rule cache warm and not measure the setup path).
pub const WARMUP_MAX_FLOWS: u64 = 1 << 16;

/// The file, as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    version: u32,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    nfs: Option<Vec<serde_json::Value>>,
    #[serde(default)]
    flows: Option<Vec<FlowRow>>,
    #[serde(default)]
    flows_csv: Option<PathBuf>,
    #[serde(default)]
    paced: PacedBy,
}

/// One flow of `flows` or one row of `flows_csv`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FlowRow {
    proto: Proto,
    src: Ipv4Addr,
    sport: u16,
    dst: Ipv4Addr,
    dport: u16,
    #[serde(default)]
    pub(crate) at_us: Option<f64>,
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Proto {
    Udp,
    Tcp,
}

/// How the paced measurement offers its flows.
#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum PacedBy {
    /// Open loop at `--rate` flows per second (the bench's default).
    #[default]
    Rate,
    /// At the flows' own `at_us` times, relative to the first flow the measurement
    /// offers.
    Trace,
}

impl PacedBy {
    pub fn as_str(self) -> &'static str {
        match self {
            PacedBy::Rate => "rate",
            PacedBy::Trace => "trace",
        }
    }
}

/// One new flow: the inner 5-tuple of its first packet (IPv4; a TCP flow's first packet
/// is a SYN).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceFlow {
    pub proto: u8,
    pub src: Ipv4Addr,
    pub sport: u16,
    pub dst: Ipv4Addr,
    pub dport: u16,
}

/// A workload's flows in file order, with their arrival times when it paces by trace.
#[derive(Debug, Clone)]
pub struct SetupTrace {
    pub flows: Vec<TraceFlow>,
    /// Arrival time of each flow, in nanoseconds from the file's zero; non-decreasing.
    /// `Some` exactly when the workload paces by trace.
    pub at_ns: Option<Vec<u64>>,
}

impl SetupTrace {
    /// How many flows, from index `from` on, have arrived `elapsed_ns` after flow
    /// `start`'s arrival (paced by trace).
    pub fn due(&self, start: usize, from: usize, elapsed_ns: u64) -> usize {
        match &self.at_ns {
            Some(at) if from < at.len() => {
                let t0 = at[start.min(at.len() - 1)];
                at[from..].partition_point(|&t| t.saturating_sub(t0) <= elapsed_ns)
            }
            Some(_) => 0,
            None => self.flows.len().saturating_sub(from),
        }
    }

    /// When flow `i` is due, in nanoseconds after flow `start`'s arrival.
    pub fn offset_ns(&self, start: usize, i: usize) -> Option<u64> {
        let at = self.at_ns.as_ref()?;
        let t = *at.get(i)?;
        Some(t.saturating_sub(*at.get(start)?))
    }
}

/// A loaded, checked workload.
#[derive(Debug, Clone)]
pub struct SetupWorkload {
    /// `name`, or the file's path.
    pub name: String,
    /// The chain's NFs (`nfs::NfConfig` JSON), checked by building them; `None`: the
    /// chain `--nfs` names.
    pub nfs: Option<Vec<serde_json::Value>>,
    /// What the chain is partitioned by, from its NFs (as the orchestrator fills it).
    pub partition: nf::PartitionBy,
    /// `None`: the bench generates its flows.
    pub trace: Option<SetupTrace>,
    pub paced: PacedBy,
}

impl SetupWorkload {
    pub fn load(path: &Path) -> Result<SetupWorkload> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading workload {}", path.display()))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        Self::parse(&text, dir)
            .with_context(|| format!("workload {}: not a valid setup workload", path.display()))
            .map(|mut w| {
                if w.name.is_empty() {
                    w.name = path.display().to_string();
                }
                w
            })
    }

    /// Parse and check a workload; `dir` resolves a relative `flows_csv`.
    pub fn parse(text: &str, dir: &Path) -> Result<SetupWorkload> {
        let f: File = serde_json::from_str(text)?;
        ensure!(f.version == 1, "version must be 1, got {}", f.version);
        let (nfs, partition) = match f.nfs {
            Some(nfs) => {
                let partition = check_nfs(&nfs)?;
                (Some(nfs), partition)
            }
            None => (None, nf::PartitionBy::Flow),
        };
        let rows = match (f.flows, f.flows_csv) {
            (Some(_), Some(_)) => bail!("give flows or flows_csv, not both"),
            (Some(rows), None) => Some(rows.into_iter().map(Ok).collect::<Vec<_>>()),
            (None, Some(csv)) => Some(read_csv(&dir.join(csv), "flows_csv", MAX_FLOWS)?),
            (None, None) => None,
        };
        let trace = match rows {
            Some(rows) => Some(trace(rows, f.paced)?),
            None => {
                ensure!(
                    f.paced == PacedBy::Rate,
                    "paced \"trace\" needs flows with at_us times"
                );
                None
            }
        };
        Ok(SetupWorkload {
            name: f.name.unwrap_or_default(),
            nfs,
            partition,
            trace,
            paced: f.paced,
        })
    }

    /// The chain's NF kinds, joined as the bench prints a chain: `fw → snat → lb`.
    pub fn chain_label(&self) -> Option<String> {
        self.nfs.as_deref().map(chain_label)
    }
}

/// A workload's `nfs`: each entry an NF configuration as the orchestrator's API takes it
/// (`nfs::NfConfig`), checked by parsing; the chain's partitioning, as the orchestrator
/// computes it from its NFs.
pub(crate) fn check_nfs(nfs: &[serde_json::Value]) -> Result<nf::PartitionBy> {
    ensure!(!nfs.is_empty(), "nfs: a chain needs at least one NF");
    let configs = nfs
        .iter()
        .enumerate()
        .map(|(i, v)| {
            serde_json::from_value::<nfs::NfConfig>(v.clone()).with_context(|| format!("nfs[{i}]"))
        })
        .collect::<Result<Vec<_>>>()?;
    nfs::chain_partition(&configs).context("nfs")
}

/// The chain's NF kinds, joined as the benches print a chain: `fw → snat → lb`.
pub(crate) fn chain_label(nfs: &[serde_json::Value]) -> String {
    let kinds: Vec<&str> = nfs
        .iter()
        .map(|v| v.get("kind").and_then(|k| k.as_str()).unwrap_or("?"))
        .collect();
    kinds.join(" → ")
}

impl FlowRow {
    /// The row's 5-tuple; `i` names it in an error.
    pub(crate) fn tuple(&self, i: usize) -> Result<TraceFlow> {
        ensure!(
            self.sport != 0 && self.dport != 0,
            "flows[{i}]: port 0 is not a flow's port"
        );
        Ok(TraceFlow {
            proto: match self.proto {
                Proto::Udp => packet::proto::UDP,
                Proto::Tcp => packet::proto::TCP,
            },
            src: self.src,
            sport: self.sport,
            dst: self.dst,
            dport: self.dport,
        })
    }
}

/// Rows of a CSV file with the header `proto,src,sport,dst,dport` and, optionally,
/// `at_us`, at most `max` of them; `field` names the file in errors. A row that does
/// not parse is kept as its error, to be named by row.
pub(crate) fn read_csv(
    path: &Path,
    field: &str,
    max: usize,
) -> Result<Vec<Result<FlowRow, String>>> {
    let mut r = csv::ReaderBuilder::new()
        .trim(csv::Trim::All)
        .from_path(path)
        .with_context(|| format!("{field} {}", path.display()))?;
    let mut rows = Vec::new();
    for (i, row) in r.deserialize::<FlowRow>().enumerate() {
        ensure!(i < max, "{field} {}: more than {max} rows", path.display());
        // Row i is line i + 2 (after the header) when no field spans lines.
        rows.push(row.map_err(|e| format!("{field} line {}: {e}", i + 2)));
    }
    Ok(rows)
}

/// The warm-up's flow `i` (`bench::flow_src`): UDP from 198.18.0.0/30 to the bench's
/// service port 53.
fn is_warmup_flow(f: &TraceFlow, service: Ipv4Addr) -> bool {
    let first = u32::from(Ipv4Addr::new(198, 18, 0, 0));
    let src = u32::from(f.src);
    f.proto == packet::proto::UDP
        && f.dst == service
        && f.dport == 53
        && src >= first
        && u64::from(src - first) < (WARMUP_MAX_FLOWS >> 14)
        && (1024..1024 + (1u32 << 14)).contains(&u32::from(f.sport))
}

fn trace(rows: Vec<Result<FlowRow, String>>, paced: PacedBy) -> Result<SetupTrace> {
    ensure!(!rows.is_empty(), "flows: a workload's flow list is empty");
    ensure!(
        rows.len() <= MAX_FLOWS,
        "flows: {} flows, more than {MAX_FLOWS}",
        rows.len()
    );
    let mut flows = Vec::with_capacity(rows.len());
    let mut at_ns = (paced == PacedBy::Trace).then(|| Vec::with_capacity(rows.len()));
    let mut seen: HashMap<TraceFlow, usize> = HashMap::with_capacity(rows.len());
    for (i, row) in rows.into_iter().enumerate() {
        let row = row.map_err(anyhow::Error::msg)?;
        let f = row.tuple(i)?;
        ensure!(
            !is_warmup_flow(&f, crate::bench_setup::SERVICE),
            "flows[{i}]: {f:?} is one of the bench's warm-up flows (UDP from \
             198.18.0.0/30, ports 1024-17407, to {}:53); use other addresses",
            crate::bench_setup::SERVICE
        );
        if let Some(j) = seen.insert(f, i) {
            bail!(
                "flows[{i}] repeats flows[{j}] ({f:?}): every flow of a setup workload \
                 must be new, or its packet would hit the rule set up for the first"
            );
        }
        if let Some(at) = at_ns.as_mut() {
            let Some(us) = row.at_us else {
                bail!("flows[{i}]: paced \"trace\" needs at_us on every flow");
            };
            ensure!(
                us.is_finite() && (0.0..=1e12).contains(&us),
                "flows[{i}]: at_us must be a time in [0, 1e12] µs, got {us}"
            );
            let ns = (us * 1e3).round() as u64;
            if let Some(&prev) = at.last() {
                ensure!(
                    ns >= prev,
                    "flows[{i}]: at_us {us} is before the previous flow's; list flows in \
                     arrival order"
                );
            }
            at.push(ns);
        }
        flows.push(f);
    }
    Ok(SetupTrace { flows, at_ns })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<SetupWorkload> {
        SetupWorkload::parse(text, Path::new("."))
    }

    #[test]
    fn an_inline_trace_loads_in_order_with_its_times() {
        let w = parse(
            r#"{"version": 1, "name": "t", "paced": "trace", "flows": [
                {"proto": "udp", "src": "10.0.0.1", "sport": 4000, "dst": "198.19.0.100", "dport": 53, "at_us": 0},
                {"proto": "tcp", "src": "10.0.0.2", "sport": 4000, "dst": "198.19.0.100", "dport": 80, "at_us": 12.5},
                {"proto": "tcp", "src": "10.0.0.2", "sport": 4001, "dst": "198.19.0.100", "dport": 80, "at_us": 12.5}
            ]}"#,
        )
        .expect("valid");
        let t = w.trace.expect("trace");
        assert_eq!(t.flows.len(), 3);
        assert_eq!(t.flows[1].proto, packet::proto::TCP);
        assert_eq!(t.at_ns.as_deref(), Some(&[0, 12_500, 12_500][..]));
        assert_eq!(w.paced, PacedBy::Trace);
        // Due by time: none before 12.5 µs after the first, then both.
        assert_eq!(t.due(0, 1, 12_499), 0);
        assert_eq!(t.due(0, 1, 12_500), 2);
        // A measurement that starts at flow 1 counts from flow 1's time.
        assert_eq!(t.due(1, 1, 0), 2);
        assert_eq!(t.offset_ns(0, 2), Some(12_500));
        assert_eq!(t.due(0, 3, u64::MAX), 0);
    }

    #[test]
    fn a_csv_trace_loads_from_beside_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join("flows.csv"),
            "proto,src,sport,dst,dport,at_us\nudp,10.0.0.1,1000,10.9.0.1,53,\ntcp, 10.0.0.1 ,1000,10.9.0.1,443,7\n",
        )
        .expect("csv");
        let wl = dir.path().join("w.json");
        std::fs::write(&wl, r#"{"version": 1, "flows_csv": "flows.csv"}"#).expect("json");
        let w = SetupWorkload::load(&wl).expect("valid");
        let t = w.trace.expect("trace");
        assert_eq!(t.flows.len(), 2);
        assert_eq!(t.flows[1].dport, 443);
        assert!(t.at_ns.is_none(), "paced by rate keeps no times");
        assert_eq!(w.name, wl.display().to_string());
        // Without times, every flow from `from` on is due at once.
        assert_eq!(t.due(0, 1, 0), 1);

        // A bad row is named by its line.
        std::fs::write(
            dir.path().join("flows.csv"),
            "proto,src,sport,dst,dport\nudp,10.0.0.1,1000,10.9.0.1,53\nsctp,10.0.0.1,1000,10.9.0.1,53\n",
        )
        .expect("csv");
        let e = format!("{:#}", SetupWorkload::load(&wl).unwrap_err());
        assert!(e.contains("line 3"), "{e}");
    }

    #[test]
    fn bad_workloads_are_refused_with_the_reason() {
        let cases: &[(&str, &str)] = &[
            (r#"{"version": 2}"#, "version must be 1"),
            (r#"{"version": 1, "rate": 5}"#, "unknown field"),
            (r#"{"version": 1, "flows": []}"#, "empty"),
            (
                r#"{"version": 1, "flows": [{"proto": "udp", "src": "10.0.0.1", "sport": 0, "dst": "10.0.0.2", "dport": 53}]}"#,
                "port 0",
            ),
            (
                r#"{"version": 1, "flows": [{"proto": "udp", "src": "2001:db8::1", "sport": 1, "dst": "10.0.0.2", "dport": 53}]}"#,
                "IPv4",
            ),
            (
                r#"{"version": 1, "flows": [
                    {"proto": "udp", "src": "10.0.0.1", "sport": 9, "dst": "10.0.0.2", "dport": 53},
                    {"proto": "udp", "src": "10.0.0.1", "sport": 9, "dst": "10.0.0.2", "dport": 53}]}"#,
                "flows[1] repeats flows[0]",
            ),
            (
                r#"{"version": 1, "paced": "trace", "flows": [
                    {"proto": "udp", "src": "10.0.0.1", "sport": 9, "dst": "10.0.0.2", "dport": 53, "at_us": 5},
                    {"proto": "udp", "src": "10.0.0.1", "sport": 10, "dst": "10.0.0.2", "dport": 53, "at_us": 4}]}"#,
                "before the previous",
            ),
            (
                r#"{"version": 1, "paced": "trace", "flows": [
                    {"proto": "udp", "src": "10.0.0.1", "sport": 9, "dst": "10.0.0.2", "dport": 53}]}"#,
                "at_us on every flow",
            ),
            (r#"{"version": 1, "paced": "trace"}"#, "needs flows"),
            (
                r#"{"version": 1, "flows": [{"proto": "udp", "src": "198.18.0.1", "sport": 1100, "dst": "198.19.0.100", "dport": 53}]}"#,
                "warm-up",
            ),
            (r#"{"version": 1, "nfs": []}"#, "at least one NF"),
            (r#"{"version": 1, "nfs": [{"kind": "nat64"}]}"#, "nfs[0]"),
            (
                r#"{"version": 1, "flows": [], "flows_csv": "x.csv"}"#,
                "not both",
            ),
        ];
        for (text, want) in cases {
            let e = format!("{:#}", parse(text).expect_err(text));
            assert!(e.contains(want), "{text}: {e} (wanted {want:?})");
        }
    }

    #[test]
    fn a_chain_of_builtin_nfs_is_checked_and_partitioned_as_the_orchestrator_does() {
        let w = parse(
            r#"{"version": 1, "nfs": [
                {"kind": "fw", "tenants": [{"tenant": 1, "default_action": "allow", "rules": []}]},
                {"kind": "snat", "pools": [{"addresses": ["198.19.255.1"], "ports": {"lo": 1024, "hi": 65535}}]}
            ]}"#,
        )
        .expect("valid");
        assert_eq!(w.chain_label().as_deref(), Some("fw → snat"));
        let configs: Vec<nfs::NfConfig> = w
            .nfs
            .iter()
            .flatten()
            .map(|v| serde_json::from_value(v.clone()).expect("config"))
            .collect();
        assert_eq!(
            w.partition,
            nfs::chain_partition(&configs).expect("partition")
        );
        assert!(w.trace.is_none());
    }
}
