//! The Serpens chain row of `bench pipeline` (paper 004 §V, Fig. 15): FW → MON → NAT at
//! a million flows.
//!
//! The rules are the chain's own: the built-in firewall (allow), monitor and SNAT (nfs
//! crate) run in an `nf::Chain`, as an SC replica runs them, once per flow; what PP
//! executes per packet is the composed rule that comes out (decap; set-src pool:port;
//! encap; count; out), installed in one worker's flow table. Packets of all the flows,
//! chosen at random, then go through that worker in batches, with counter reports on
//! (the monitor's data, drained as the PP node drains them), and the bench measures
//! packets per second and the time of each batch.
//!
//! Serpens runs the NFs on every packet; starfabric runs them on a flow's first packet
//! only (SC) and the composed rule on the rest (PP), which is what is timed here. The
//! first-packet cost is the setup path's (`bench setup`).

use std::net::Ipv4Addr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use nf::{Chain, ChainSpec, Egress, FirstPacket, NfEnv};
use pipeline::{
    Action, CounterReportConfig, FlowKey, MemRing, MonotonicClock, NodeAddr, PacketMeta, Pipeline,
    PipelineConfig, RuleSource, VpcBinding, Worker,
};
use serde::{Deserialize, Serialize};

/// `--workload FILE` of the chain row (JSON; docs/benchmarks.md, "Pipeline workload").
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ChainWorkload {
    /// Flows of the table (each one decided by the chain).
    #[serde(default = "default_flows")]
    pub flows: usize,
    /// SNAT pool addresses (198.19.100.0 onward), 64,512 ports each; enough for `flows`.
    #[serde(default)]
    pub pool_addresses: Option<u32>,
    /// Seconds of traffic.
    #[serde(default = "default_seconds")]
    pub seconds: f64,
    /// Packets per batch.
    #[serde(default = "default_batch")]
    pub batch: usize,
}

fn default_flows() -> usize {
    1_000_000
}
fn default_seconds() -> f64 {
    2.0
}
fn default_batch() -> usize {
    pipeline::MAX_BATCH
}

impl Default for ChainWorkload {
    fn default() -> Self {
        ChainWorkload {
            flows: default_flows(),
            pool_addresses: None,
            seconds: default_seconds(),
            batch: default_batch(),
        }
    }
}

const PORTS_PER_ADDR: u32 = 65535 - 1024 + 1;

impl ChainWorkload {
    pub fn load(path: &Path) -> Result<ChainWorkload> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading workload {}", path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text).with_context(|| {
            format!(
                "workload {}: not a chain workload (not JSON)",
                path.display()
            )
        })?;
        Self::from_value(v).with_context(|| format!("workload {}", path.display()))
    }

    /// The chain row's fields of a pipeline workload, checked.
    pub fn from_value(v: serde_json::Value) -> Result<ChainWorkload> {
        let w: ChainWorkload = serde_json::from_value(v).context("not a chain workload")?;
        w.check()?;
        Ok(w)
    }

    pub fn check(&self) -> Result<()> {
        ensure!(
            (1..=10_000_000).contains(&self.flows),
            "flows must be 1..=10000000, got {}",
            self.flows
        );
        ensure!(
            self.seconds.is_finite() && self.seconds > 0.0 && self.seconds <= 600.0,
            "seconds must be in (0, 600], got {}",
            self.seconds
        );
        ensure!(
            (1..=1024).contains(&self.batch),
            "batch must be 1..=1024, got {}",
            self.batch
        );
        if let Some(n) = self.pool_addresses {
            ensure!(
                (1..=255).contains(&n),
                "pool_addresses must be 1..=255, got {n}"
            );
            ensure!(
                u64::from(n) * u64::from(PORTS_PER_ADDR) >= self.flows as u64,
                "{n} pool addresses hold {} flows, fewer than {}",
                u64::from(n) * u64::from(PORTS_PER_ADDR),
                self.flows
            );
        } else {
            ensure!(
                self.addresses() <= 255,
                "{} flows need more than 255 pool addresses",
                self.flows
            );
        }
        Ok(())
    }

    fn addresses(&self) -> u32 {
        self.pool_addresses
            .unwrap_or_else(|| (self.flows as u32).div_ceil(PORTS_PER_ADDR) + 1)
    }
}

/// The chain row's results.
#[derive(Debug, Clone, Serialize)]
pub struct ChainResult {
    pub mpps: f64,
    /// 99th percentile of a batch's time, in µs.
    pub batch_p99_us: f64,
    /// Mean time per packet (batch time over its packets), in µs.
    pub per_packet_us: f64,
    /// 99th percentile of batch time over batch size, in µs per packet.
    pub per_packet_p99_us: f64,
    pub flows: usize,
    pub batch: usize,
    /// Seconds the chain took to decide every flow (the SC side, one core).
    pub setup_seconds: f64,
    /// The composed rule of flow 0, as PP runs it.
    pub rule: String,
}

const VNI: u32 = 100;
const TENANT: u32 = 1;

fn chain(w: &ChainWorkload) -> Result<Chain> {
    let n = w.addresses();
    let pool: Vec<String> = (0..n)
        .map(|i| Ipv4Addr::new(198, 19, 100 + (i / 256) as u8, (i % 256) as u8).to_string())
        .collect();
    let cfgs = [
        serde_json::json!({"kind": "fw", "tenants": [{"tenant": TENANT, "default_action": "allow", "rules": []}]}),
        serde_json::json!({"kind": "monitor"}),
        serde_json::json!({"kind": "snat", "pools": [{"addresses": pool, "ports": {"lo": 1024, "hi": 65535}}]}),
    ];
    let mut nfs = Vec::new();
    for c in cfgs {
        let c: nfs::NfConfig = serde_json::from_value(c).context("chain NF configuration")?;
        nfs.push(nfs::build(&c).context("building the chain's NFs")?);
    }
    let forward = Egress {
        decap: true,
        encap: Some((Ipv4Addr::new(198, 18, 0, 9), 200)),
        inner_dmac: None,
        output: 1,
    };
    let reverse = Egress {
        decap: true,
        encap: Some((Ipv4Addr::new(198, 18, 0, 50), VNI)),
        inner_dmac: None,
        output: 1,
    };
    Ok(Chain::new(
        nfs,
        ChainSpec::Seq(vec![ChainSpec::Nf(0), ChainSpec::Nf(1), ChainSpec::Nf(2)]),
        forward,
        reverse,
    )?)
}

fn node() -> NodeAddr {
    NodeAddr {
        ip: Ipv4Addr::new(198, 18, 0, 1),
        mac: [2, 0, 0, 0, 0, 1],
        gw_mac: [2, 0, 0, 0, 0, 2],
    }
}

/// Decide every flow with the chain and install its forward rule; then time packets.
pub fn chain_point(w: &ChainWorkload) -> Result<ChainResult> {
    w.check()?;
    let mut ch = chain(w)?;
    let mut cfg = PipelineConfig::new(node());
    cfg.flow_capacity = w.flows;
    cfg.counter_reports = Some(CounterReportConfig::default());
    let mut p = Pipeline::new(cfg, RuleSource::None)?;
    p.bind_vpc(
        VNI,
        VpcBinding {
            tenant: TENANT,
            chain: 1,
        },
    );
    let frame_len = crate::bench::template(crate::bench::DST).len();
    let t0 = Instant::now();
    let mut rule0 = String::new();
    for i in 0..w.flows as u64 {
        let (src, sport) = crate::bench::flow_src(i);
        let key = FlowKey::new(VNI, 17, src.into(), sport, crate::bench::DST.into(), 53);
        let pkt = FirstPacket::new(
            key,
            TENANT,
            PacketMeta {
                len: frame_len as u16,
                tcp_flags: 0,
                icmp_error: false,
                ingress_port: 0,
            },
        );
        let mut env = NfEnv::new(0, i);
        let r = ch
            .decide(&pkt, &mut env)
            .with_context(|| format!("the chain on flow {i}"))?;
        if i == 0 {
            let a = &r.forward.actions;
            let snat = a
                .iter()
                .any(|x| matches!(x, Action::SetSrc { addr: Some(_), .. }));
            if !snat
                || !a.contains(&Action::Count)
                || a.iter().any(|x| matches!(x, Action::Drop { .. }))
            {
                bail!(
                    "the chain's rule is not allow + count + SNAT: {}",
                    pipeline::format_actions(a)
                );
            }
            rule0 = pipeline::format_actions(a);
        }
        p.install_rule(&r.forward, 0)
            .with_context(|| format!("installing flow {i}'s rule"))?;
    }
    let setup_seconds = t0.elapsed().as_secs_f64();
    ensure!(
        p.table().len() == w.flows,
        "table holds {} of {} flows",
        p.table().len(),
        w.flows
    );
    drop(ch);
    let io = MemRing::new(crate::bench::Traffic::random(w.flows as u64), w.batch);
    let mut wk = Worker::new(p, io, w.batch, Box::new(MonotonicClock::new()));
    let mut reports = Vec::new();
    let mut step = |wk: &mut Worker<MemRing<crate::bench::Traffic>>| {
        let n = wk.run_once().unwrap_or(0);
        // The node's loop hands reports to the FM client; here they are dropped.
        wk.pipeline.take_counter_reports(&mut reports);
        reports.clear();
        n
    };
    for _ in 0..256 {
        step(&mut wk);
    }
    let mut times: Vec<u32> = Vec::with_capacity(1 << 20);
    let dur = Duration::from_secs_f64(w.seconds);
    let start = Instant::now();
    let mut pkts = 0u64;
    loop {
        let t = Instant::now();
        let n = step(&mut wk);
        let ns = t.elapsed().as_nanos().min(u128::from(u32::MAX)) as u32;
        pkts += n as u64;
        if n > 0 && times.len() < times.capacity() {
            times.push(ns);
        }
        if pkts % 4096 < n as u64 && start.elapsed() >= dur {
            break;
        }
    }
    let el = start.elapsed().as_secs_f64();
    let s = wk.pipeline.stats();
    ensure!(
        s.misses == 0 && s.total_drops() == 0,
        "the chain's flows saw {} misses and {} drops",
        s.misses,
        s.total_drops()
    );
    ensure!(s.counter_reports > 0, "no counter report was queued");
    ensure!(!times.is_empty(), "no batch was timed");
    times.sort_unstable();
    let p99 = times[(times.len() * 99 / 100).min(times.len() - 1)] as f64 / 1000.0;
    Ok(ChainResult {
        mpps: pkts as f64 / el / 1e6,
        batch_p99_us: p99,
        per_packet_us: el * 1e6 / pkts as f64,
        per_packet_p99_us: p99 / w.batch as f64,
        flows: w.flows,
        batch: w.batch,
        setup_seconds,
        rule: rule0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_chain_runs_with_the_chains_own_rule() {
        let r = chain_point(&ChainWorkload {
            flows: 2000,
            pool_addresses: None,
            seconds: 0.05,
            batch: 32,
        })
        .expect("runs");
        assert!(r.mpps > 0.0);
        assert!(r.rule.contains("set-src 198.19.100."), "{}", r.rule);
        assert!(r.rule.contains("count"), "{}", r.rule);
        assert!(r.batch_p99_us > 0.0);
    }

    #[test]
    fn bad_workloads_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        for (text, want) in [
            (r#"{"flows": 0}"#, "flows must be"),
            (r#"{"flows": 10, "batch": 0}"#, "batch must be"),
            (r#"{"flows": 10, "seconds": -1}"#, "seconds must be"),
            (r#"{"flows": 200000, "pool_addresses": 1}"#, "hold"),
            (r#"{"flow": 10}"#, "not a chain workload"),
            ("not json", "not a chain workload"),
        ] {
            let p = dir.path().join("w.json");
            std::fs::write(&p, text).unwrap();
            let e = format!("{:#}", ChainWorkload::load(&p).unwrap_err());
            assert!(e.contains(want), "{text}: {e}");
        }
        let e = ChainWorkload::load(&dir.path().join("missing.json")).unwrap_err();
        assert!(format!("{e:#}").contains("reading workload"));
    }
}
