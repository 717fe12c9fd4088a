//! `starfabric bench workers --workload FILE`: the chain and the scenario the worker
//! bench runs, from a file (docs/benchmarks.md, "Workers workload").
//!
//! Without a workload the bench runs the chain `--nfs` names, starts 16 groups, and
//! parks and wakes the chain 200 times with the plane tests' flows. A workload can give
//! any chain of the built-in NFs (as the orchestrator's API takes them), the flows the
//! wake rounds ask for, and every count the flags set; a flag given on the command line
//! overrides the file.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use serde::Deserialize;

use crate::setup_workload::{chain_label, check_nfs, FlowRow, TraceFlow};

/// The most wake flows a workload may list: each is asked once before the rounds, to
/// record the state its answer carries.
pub const MAX_WAKE_FLOWS: usize = 100_000;

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
    groups: Option<u32>,
    #[serde(default)]
    rounds: Option<u32>,
    #[serde(default)]
    workers: Option<u64>,
    #[serde(default)]
    single_starts: Option<usize>,
    #[serde(default)]
    worker_slice_us: Option<u64>,
    #[serde(default)]
    fm_threads: Option<u64>,
}

/// The counts a run uses, each from a flag, else the file, else the bench's default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkersCounts {
    /// SC groups of three replicas, started at once: 1–64.
    pub groups: u32,
    /// Park-and-wake rounds: 1–100,000.
    pub rounds: u32,
    /// Worker threads per SC node: 1–256.
    pub workers: u64,
    /// Starts one at a time per node: 0–10,000 (0 skips them).
    pub single_starts: usize,
    /// The slice each worker asks for, in µs: 0 (the kernel's default) to 100,000.
    pub worker_slice_us: u64,
    /// FM's runtime threads: 1–64.
    pub fm_threads: u64,
}

impl Default for WorkersCounts {
    fn default() -> Self {
        WorkersCounts {
            groups: 16,
            rounds: 200,
            workers: 6,
            single_starts: 64,
            worker_slice_us: sc::workers::DEFAULT_WORKER_SLICE.as_micros() as u64,
            fm_threads: 2,
        }
    }
}

impl WorkersCounts {
    /// Every count in range; the error names the field.
    pub fn check(&self) -> Result<()> {
        let within = |name: &str, v: u64, lo: u64, hi: u64| -> Result<()> {
            ensure!(
                (lo..=hi).contains(&v),
                "{name} must be {lo}..={hi}, got {v}"
            );
            Ok(())
        };
        within("groups", self.groups.into(), 1, 64)?;
        within("rounds", self.rounds.into(), 1, 100_000)?;
        within("workers", self.workers, 1, 256)?;
        within("single_starts", self.single_starts as u64, 0, 10_000)?;
        within("worker_slice_us", self.worker_slice_us, 0, 100_000)?;
        within("fm_threads", self.fm_threads, 1, 64)?;
        Ok(())
    }
}

/// The counts a file sets; a `None` leaves the flag's value or the default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CountsSet {
    pub groups: Option<u32>,
    pub rounds: Option<u32>,
    pub workers: Option<u64>,
    pub single_starts: Option<usize>,
    pub worker_slice_us: Option<u64>,
    pub fm_threads: Option<u64>,
}

impl CountsSet {
    /// `self` over `under`: each field that is set wins.
    pub fn over(self, under: CountsSet) -> CountsSet {
        CountsSet {
            groups: self.groups.or(under.groups),
            rounds: self.rounds.or(under.rounds),
            workers: self.workers.or(under.workers),
            single_starts: self.single_starts.or(under.single_starts),
            worker_slice_us: self.worker_slice_us.or(under.worker_slice_us),
            fm_threads: self.fm_threads.or(under.fm_threads),
        }
    }

    /// The counts, with the bench's default for each field not set, checked.
    pub fn resolve(self) -> Result<WorkersCounts> {
        let d = WorkersCounts::default();
        let c = WorkersCounts {
            groups: self.groups.unwrap_or(d.groups),
            rounds: self.rounds.unwrap_or(d.rounds),
            workers: self.workers.unwrap_or(d.workers),
            single_starts: self.single_starts.unwrap_or(d.single_starts),
            worker_slice_us: self.worker_slice_us.unwrap_or(d.worker_slice_us),
            fm_threads: self.fm_threads.unwrap_or(d.fm_threads),
        };
        c.check()?;
        Ok(c)
    }
}

/// A loaded, checked workload.
#[derive(Debug, Clone)]
pub struct WorkersWorkload {
    /// `name`, or the file's path.
    pub name: String,
    /// The chain's NFs (`nfs::NfConfig` JSON), checked; `None`: the chain `--nfs` names.
    pub nfs: Option<Vec<serde_json::Value>>,
    /// What the chain is partitioned by, from its NFs.
    pub partition: nf::PartitionBy,
    /// The flows the wake rounds ask for, round `r` flow `r % len`; `None`: the plane
    /// tests' flows.
    pub flows: Option<Vec<TraceFlow>>,
    pub counts: CountsSet,
}

impl WorkersWorkload {
    pub fn load(path: &Path) -> Result<WorkersWorkload> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading workload {}", path.display()))?;
        Self::parse(&text)
            .with_context(|| format!("workload {}: not a valid workers workload", path.display()))
            .map(|mut w| {
                if w.name.is_empty() {
                    w.name = path.display().to_string();
                }
                w
            })
    }

    pub fn parse(text: &str) -> Result<WorkersWorkload> {
        let f: File = serde_json::from_str(text)?;
        ensure!(f.version == 1, "version must be 1, got {}", f.version);
        let (nfs, partition) = match f.nfs {
            Some(nfs) => {
                let partition = check_nfs(&nfs)?;
                (Some(nfs), partition)
            }
            None => (None, nf::PartitionBy::Flow),
        };
        let flows = f.flows.map(wake_flows).transpose()?;
        let counts = CountsSet {
            groups: f.groups,
            rounds: f.rounds,
            workers: f.workers,
            single_starts: f.single_starts,
            worker_slice_us: f.worker_slice_us,
            fm_threads: f.fm_threads,
        };
        // The file's counts alone must be in range, so a file is never accepted only
        // because a flag happened to override its bad value.
        CountsSet::default().over(counts).resolve()?;
        Ok(WorkersWorkload {
            name: f.name.unwrap_or_default(),
            nfs,
            partition,
            flows,
            counts,
        })
    }

    /// The chain's NF kinds, as the bench prints a chain.
    pub fn chain_label(&self) -> Option<String> {
        self.nfs.as_deref().map(chain_label)
    }
}

fn wake_flows(rows: Vec<FlowRow>) -> Result<Vec<TraceFlow>> {
    ensure!(!rows.is_empty(), "flows: a workload's flow list is empty");
    ensure!(
        rows.len() <= MAX_WAKE_FLOWS,
        "flows: {} flows, more than {MAX_WAKE_FLOWS}",
        rows.len()
    );
    let mut seen: HashMap<TraceFlow, usize> = HashMap::with_capacity(rows.len());
    let mut flows = Vec::with_capacity(rows.len());
    for (i, row) in rows.into_iter().enumerate() {
        ensure!(
            row.at_us.is_none(),
            "flows[{i}]: at_us has no meaning here (a wake round asks when the chain is \
             parked, not at a time)"
        );
        let f = row.tuple(i)?;
        if let Some(j) = seen.insert(f, i) {
            bail!(
                "flows[{i}] repeats flows[{j}] ({f:?}): list each flow once; the rounds \
                 cycle through the list"
            );
        }
        flows.push(f);
    }
    Ok(flows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workload_sets_the_chain_flows_and_counts() {
        let w = WorkersWorkload::parse(
            r#"{"version": 1, "name": "lb wake", "groups": 4, "rounds": 10, "workers": 3,
                "nfs": [
                  {"kind": "fw", "tenants": [{"tenant": 1, "default_action": "allow", "rules": []}]},
                  {"kind": "lb", "services": [{"vip": "198.19.0.9", "port": 80, "protocol": "tcp",
                    "backends": [{"addr": "198.19.1.7", "port": 8080}]}]}],
                "flows": [
                  {"proto": "tcp", "src": "198.18.20.1", "sport": 40000, "dst": "198.19.0.9", "dport": 80},
                  {"proto": "udp", "src": "198.18.20.2", "sport": 40000, "dst": "198.19.0.9", "dport": 53}]}"#,
        )
        .expect("valid");
        assert_eq!(w.name, "lb wake");
        assert_eq!(w.chain_label().as_deref(), Some("fw → lb"));
        let flows = w.flows.as_ref().expect("flows");
        assert_eq!(flows.len(), 2);
        assert_eq!(flows[0].proto, packet::proto::TCP);
        // File values, then a flag over them, then defaults for the rest.
        let flag = CountsSet {
            rounds: Some(7),
            ..CountsSet::default()
        };
        let c = flag.over(w.counts).resolve().expect("in range");
        assert_eq!((c.groups, c.rounds, c.workers), (4, 7, 3));
        assert_eq!(c.single_starts, WorkersCounts::default().single_starts);
    }

    #[test]
    fn the_committed_workloads_load() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/workloads");
        for name in ["workers-fw-snat-lb.json", "workers-fw-snat32-lb.json"] {
            let w = WorkersWorkload::load(&dir.join(name)).expect(name);
            assert_eq!(w.chain_label().as_deref(), Some("fw → snat → lb"), "{name}");
            assert_eq!(w.flows.as_ref().map(Vec::len), Some(6), "{name}");
            assert_eq!(
                w.counts,
                CountsSet::default(),
                "{name}: the bench's own counts"
            );
        }
    }

    #[test]
    fn no_workload_and_no_flags_is_the_benchs_default() {
        let c = CountsSet::default()
            .resolve()
            .expect("defaults are in range");
        assert_eq!(c, WorkersCounts::default());
    }

    #[test]
    fn bad_workers_workloads_are_refused_with_the_reason() {
        let tuple =
            r#""proto": "udp", "src": "198.18.20.1", "sport": 9, "dst": "198.19.0.9", "dport": 53"#;
        let cases: Vec<(String, &str)> = vec![
            (r#"{"version": 2}"#.into(), "version must be 1"),
            (r#"{"version": 1, "rate": 5}"#.into(), "unknown field"),
            (r#"{"version": 1, "groups": 0}"#.into(), "groups must be 1..=64"),
            (r#"{"version": 1, "groups": 65}"#.into(), "groups must be 1..=64"),
            (r#"{"version": 1, "rounds": 0}"#.into(), "rounds must be"),
            (r#"{"version": 1, "workers": 0}"#.into(), "workers must be"),
            (r#"{"version": 1, "fm_threads": 0}"#.into(), "fm_threads must be"),
            (r#"{"version": 1, "worker_slice_us": 200000}"#.into(), "worker_slice_us"),
            (r#"{"version": 1, "single_starts": 20000}"#.into(), "single_starts"),
            (r#"{"version": 1, "groups": -1}"#.into(), "invalid value"),
            (r#"{"version": 1, "nfs": []}"#.into(), "at least one NF"),
            (r#"{"version": 1, "nfs": [{"kind": "nat64"}]}"#.into(), "nfs[0]"),
            (r#"{"version": 1, "flows": []}"#.into(), "empty"),
            (format!(r#"{{"version": 1, "flows": [{{{tuple}}}, {{{tuple}}}]}}"#), "flows[1] repeats flows[0]"),
            (format!(r#"{{"version": 1, "flows": [{{{tuple}, "at_us": 5}}]}}"#), "at_us has no meaning"),
            (
                r#"{"version": 1, "flows": [{"proto": "udp", "src": "10.0.0.1", "sport": 0, "dst": "10.0.0.2", "dport": 53}]}"#.into(),
                "port 0",
            ),
        ];
        for (text, want) in &cases {
            let e = format!("{:#}", WorkersWorkload::parse(text).expect_err(text));
            assert!(e.contains(want), "{text}: {e} (wanted {want:?})");
        }
    }
}
