//! The `hit` section of `starfabric bench pipeline --workload FILE`: which flows the hit
//! path's table holds and which of them each packet belongs to (docs/benchmarks.md,
//! "Pipeline workload").
//!
//! Without it the hit points install `--flows` flows and pick each packet's flow
//! uniformly at random, the worst case for the table's caches. Real traffic is skewed:
//! a few flows carry most packets. The section lets a run say so, either with a
//! popularity law over generated flows (`{"zipf": s}`) or with a packet trace (one
//! 5-tuple per packet, in order) that nobody here wrote; the trace's distinct 5-tuples
//! become the table.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};

use crate::setup_workload::{read_csv, FlowRow, TraceFlow};

/// The most packets a trace may list (4 bytes each once read, plus its distinct flows).
pub const MAX_PACKETS: usize = 50_000_000;
/// The most flows a table may hold here (as `--flows`).
pub const MAX_FLOWS: usize = 10_000_000;
/// Flow indices drawn ahead for a popularity law; the packets replay them in a loop.
/// 4 Mi indices (16 MiB) read in order cost the hit path a streaming read, not a miss.
const DRAWN: usize = 1 << 22;

/// How packets choose among generated flows.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Popularity {
    /// Every flow equally likely (the bench's default).
    #[default]
    Uniform,
    /// Zipf with exponent s: the flow of rank k gets a share ∝ 1 / k^s.
    Zipf(f64),
}

/// The section as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    flows: Option<Vec<usize>>,
    #[serde(default)]
    popularity: Popularity,
    #[serde(default)]
    packets: Option<Vec<FlowRow>>,
    #[serde(default)]
    packets_csv: Option<PathBuf>,
    #[serde(default)]
    seconds: Option<f64>,
    #[serde(default)]
    batch: Option<usize>,
    #[serde(default)]
    count: Option<bool>,
}

/// A packet trace: its distinct flows, and each packet's flow by index into them.
#[derive(Debug, Clone)]
pub struct PacketTrace {
    pub flows: Vec<TraceFlow>,
    pub packets: Vec<u32>,
}

/// Where the hit points' flows and packets come from.
#[derive(Debug, Clone)]
pub enum HitFlows {
    /// Generated flows (the bench's own 5-tuples), one point per table size.
    Generated {
        sizes: Vec<usize>,
        popularity: Popularity,
    },
    /// One point: the trace's flows, its packets replayed in order.
    Trace(PacketTrace),
}

/// A loaded, checked `hit` section.
#[derive(Debug, Clone)]
pub struct HitWorkload {
    /// `name`, or the file's path.
    pub name: String,
    pub flows: HitFlows,
    pub seconds: Option<f64>,
    pub batch: Option<usize>,
    pub count: Option<bool>,
}

/// What the results say about the workload that ran.
#[derive(Debug, Clone, Serialize)]
pub struct HitWorkloadInfo {
    pub name: String,
    /// `uniform`, `zipf(s)` or `trace`.
    pub popularity: String,
    /// Packets the trace lists (a trace only).
    pub trace_packets: Option<usize>,
    /// Share of packets that belong to the busiest 1% of the flows, by table size:
    /// 0.01 for uniform traffic.
    pub top1pct_share: std::collections::BTreeMap<String, f64>,
}

impl HitWorkload {
    /// Parse and check the section; `dir` resolves a relative `packets_csv`.
    pub fn parse(v: serde_json::Value, name: String, dir: &Path) -> Result<HitWorkload> {
        let f: File = serde_json::from_value(v).context("hit")?;
        if let Some(s) = f.seconds {
            ensure!(
                s.is_finite() && s > 0.0 && s <= 600.0,
                "hit.seconds must be in (0, 600], got {s}"
            );
        }
        if let Some(b) = f.batch {
            ensure!(
                (1..=1024).contains(&b),
                "hit.batch must be 1..=1024, got {b}"
            );
        }
        if let Popularity::Zipf(s) = f.popularity {
            ensure!(
                s.is_finite() && s > 0.0 && s <= 10.0,
                "hit.popularity: the zipf exponent must be in (0, 10], got {s}"
            );
        }
        let rows = match (f.packets, f.packets_csv) {
            (Some(_), Some(_)) => bail!("hit: give packets or packets_csv, not both"),
            (Some(rows), None) => Some(rows.into_iter().map(Ok).collect()),
            (None, Some(csv)) => Some(read_csv(&dir.join(csv), "hit.packets_csv", MAX_PACKETS)?),
            (None, None) => None,
        };
        let flows = match rows {
            Some(rows) => {
                ensure!(
                    f.flows.is_none(),
                    "hit: a packet trace sets the table's flows; leave out hit.flows"
                );
                ensure!(
                    f.popularity == Popularity::Uniform,
                    "hit: a packet trace has its own popularity; leave out hit.popularity"
                );
                HitFlows::Trace(trace(rows)?)
            }
            None => {
                let sizes = f.flows.unwrap_or_default();
                for (i, &n) in sizes.iter().enumerate() {
                    ensure!(
                        (1..=MAX_FLOWS).contains(&n),
                        "hit.flows[{i}] must be 1..={MAX_FLOWS}, got {n}"
                    );
                }
                HitFlows::Generated {
                    sizes,
                    popularity: f.popularity,
                }
            }
        };
        Ok(HitWorkload {
            name: f.name.unwrap_or(name),
            flows,
            seconds: f.seconds,
            batch: f.batch,
            count: f.count,
        })
    }
}

fn trace(rows: Vec<Result<FlowRow, String>>) -> Result<PacketTrace> {
    ensure!(!rows.is_empty(), "hit.packets: the trace is empty");
    ensure!(
        rows.len() <= MAX_PACKETS,
        "hit.packets: {} packets, more than {MAX_PACKETS}",
        rows.len()
    );
    let mut index: HashMap<TraceFlow, u32> = HashMap::new();
    let mut flows = Vec::new();
    let mut packets = Vec::with_capacity(rows.len());
    for (i, row) in rows.into_iter().enumerate() {
        let f = row
            .map_err(anyhow::Error::msg)?
            .tuple(i)
            .map_err(|e| anyhow::anyhow!("hit.packets[{i}]: {e:#}"))?;
        let next = flows.len();
        let k = *index.entry(f).or_insert_with(|| {
            flows.push(f);
            next as u32
        });
        ensure!(
            flows.len() <= MAX_FLOWS,
            "hit.packets: more than {MAX_FLOWS} distinct flows"
        );
        packets.push(k);
    }
    Ok(PacketTrace { flows, packets })
}

/// `n` flow indices in `0..flows` drawn from `p` (seeded, so every run replays the same
/// packets). The rank drawn is spread over the table by a bijection, so that the busy
/// flows are not the first ones installed, which would sit side by side in memory.
pub fn draw(p: Popularity, flows: usize, n: usize, seed: u64) -> Vec<u32> {
    use rand09::{Rng, SeedableRng};
    let mut rng = rand09::rngs::StdRng::seed_from_u64(seed);
    // A prime above every table size: rank × P mod flows maps the ranks 1..=flows one to
    // one onto 0..flows, and rank 1, the busiest, is not flow 0.
    const P: u64 = 2_654_435_761;
    let n_flows = flows as u64;
    match p {
        Popularity::Uniform => (0..n)
            .map(|_| rng.random_range(0..n_flows) as u32)
            .collect(),
        Popularity::Zipf(s) => {
            // Checked in `parse`; a bad exponent here is a caller's bug, so fall back to
            // the smallest law rather than panic.
            let z = rand_distr::Zipf::new(n_flows as f64, s)
                .or_else(|_| rand_distr::Zipf::new(n_flows as f64, 1.0))
                .expect("Zipf(n ≥ 1, 1.0) is valid");
            (0..n)
                .map(|_| {
                    let rank = (rng.sample(z) as u64).clamp(1, n_flows);
                    (rank.wrapping_mul(P) % n_flows) as u32
                })
                .collect()
        }
    }
}

/// How many packet indices `draw` makes for a table of `flows`.
pub fn drawn_len(flows: usize) -> usize {
    DRAWN.max(flows.min(MAX_FLOWS))
}

/// Share of `packets` that belong to the busiest 1% of `flows` flows (at least one).
pub fn top1pct_share(packets: &[u32], flows: usize) -> f64 {
    if packets.is_empty() || flows == 0 {
        return 0.0;
    }
    let mut counts = vec![0u32; flows];
    for &p in packets {
        counts[p as usize] += 1;
    }
    let top = flows.div_ceil(100);
    counts.select_nth_unstable_by(top - 1, |a, b| b.cmp(a));
    let busy: u64 = counts[..top].iter().map(|&c| u64::from(c)).sum();
    busy as f64 / packets.len() as f64
}

impl std::fmt::Display for Popularity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Popularity::Uniform => write!(f, "uniform"),
            Popularity::Zipf(s) => write!(f, "zipf({s})"),
        }
    }
}

#[cfg(test)]
use std::net::Ipv4Addr;

/// A trace row as the file writes it.
#[cfg(test)]
fn row(proto: &str, src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> serde_json::Value {
    serde_json::json!({"proto": proto, "src": src.to_string(), "sport": sport,
        "dst": dst.to_string(), "dport": dport})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: serde_json::Value) -> Result<HitWorkload> {
        HitWorkload::parse(v, "test".into(), Path::new("."))
    }

    #[test]
    fn generated_sizes_and_a_zipf_law_parse() {
        let w = parse(serde_json::json!({"flows": [1000, 1000000], "popularity": {"zipf": 0.99}}))
            .unwrap();
        match w.flows {
            HitFlows::Generated { sizes, popularity } => {
                assert_eq!(sizes, vec![1000, 1_000_000]);
                assert_eq!(popularity, Popularity::Zipf(0.99));
            }
            HitFlows::Trace(_) => panic!("no trace was given"),
        }
        let w = parse(serde_json::json!({"popularity": "uniform"})).unwrap();
        assert!(matches!(
            w.flows,
            HitFlows::Generated {
                popularity: Popularity::Uniform,
                ..
            }
        ));
    }

    #[test]
    fn bad_sections_are_refused_with_the_field_named() {
        let cases = [
            (serde_json::json!({"flows": [0]}), "hit.flows[0]"),
            (serde_json::json!({"flows": [20000000]}), "hit.flows[0]"),
            (
                serde_json::json!({"popularity": {"zipf": -1.0}}),
                "zipf exponent",
            ),
            (
                serde_json::json!({"popularity": {"zipf": 0.0}}),
                "zipf exponent",
            ),
            (serde_json::json!({"seconds": 0.0}), "hit.seconds"),
            (serde_json::json!({"batch": 4096}), "hit.batch"),
            (serde_json::json!({"packets": []}), "trace is empty"),
            (serde_json::json!({"flowz": [1]}), "unknown field"),
            (
                serde_json::json!({"packets": [row("udp", Ipv4Addr::new(198,18,0,1), 1, Ipv4Addr::new(198,19,0,1), 53)], "flows": [10]}),
                "leave out hit.flows",
            ),
            (
                serde_json::json!({"packets": [row("udp", Ipv4Addr::new(198,18,0,1), 0, Ipv4Addr::new(198,19,0,1), 53)]}),
                "hit.packets[0]",
            ),
            (
                serde_json::json!({"packets": [], "packets_csv": "x.csv"}),
                "not both",
            ),
        ];
        for (v, want) in cases {
            let e = format!("{:#}", parse(v.clone()).unwrap_err());
            assert!(e.contains(want), "{v}: {e}");
        }
    }

    #[test]
    fn a_trace_keeps_packet_order_and_indexes_distinct_flows() {
        let a = row(
            "udp",
            Ipv4Addr::new(198, 18, 0, 1),
            1000,
            Ipv4Addr::new(198, 19, 0, 1),
            53,
        );
        let b = row(
            "tcp",
            Ipv4Addr::new(198, 18, 0, 2),
            2000,
            Ipv4Addr::new(198, 19, 0, 1),
            80,
        );
        let w = parse(serde_json::json!({"packets": [a, b, a, a, b]})).unwrap();
        let HitFlows::Trace(t) = w.flows else {
            panic!("a trace was given")
        };
        assert_eq!(t.flows.len(), 2);
        assert_eq!(t.packets, vec![0, 1, 0, 0, 1]);
        assert_eq!(t.flows[1].proto, packet::proto::TCP);
        assert_eq!(t.flows[1].dport, 80);
    }

    #[test]
    fn a_trace_reads_from_csv_beside_the_workload() {
        let dir = std::env::temp_dir().join(format!("sf-hit-csv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("p.csv"),
            "proto,src,sport,dst,dport\nudp,198.18.0.1,1000,198.19.0.1,53\nudp,198.18.0.1,1000,198.19.0.1,53\ntcp,198.18.0.3,9,198.19.0.1,443\n",
        )
        .unwrap();
        let w = HitWorkload::parse(
            serde_json::json!({"packets_csv": "p.csv"}),
            "t".into(),
            &dir,
        )
        .unwrap();
        let HitFlows::Trace(t) = w.flows else {
            panic!("a trace was given")
        };
        assert_eq!((t.flows.len(), t.packets.len()), (2, 3));
        std::fs::write(
            dir.join("bad.csv"),
            "proto,src,sport,dst,dport\nudp,nope,1,198.19.0.1,53\n",
        )
        .unwrap();
        let e = HitWorkload::parse(
            serde_json::json!({"packets_csv": "bad.csv"}),
            "t".into(),
            &dir,
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("hit.packets_csv line 2"), "{e:#}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn zipf_concentrates_packets_where_uniform_spreads_them() {
        let n = 100_000;
        let u = draw(Popularity::Uniform, n, 1 << 18, 7);
        let z = draw(Popularity::Zipf(0.99), n, 1 << 18, 7);
        assert!(u.iter().chain(&z).all(|&i| (i as usize) < n));
        let (su, sz) = (top1pct_share(&u, n), top1pct_share(&z, n));
        // Uniform: about 1% of the packets plus the top's sampling luck; Zipf(0.99)
        // over 100k flows: about 60%.
        assert!(su < 0.03, "uniform top 1% share {su}");
        assert!(sz > 0.4, "zipf top 1% share {sz}");
        // The busiest flow is not flow 0: ranks are spread over the table.
        let mut c = vec![0u32; n];
        for &i in &z {
            c[i as usize] += 1;
        }
        let busiest = (0..n).max_by_key(|&i| c[i]).unwrap();
        assert_ne!(busiest, 0);
        assert_eq!(draw(Popularity::Zipf(0.99), n, 1000, 7), z[..1000]);
    }
}
