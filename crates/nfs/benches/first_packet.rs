//! Criterion benchmarks of the built-in NFs' first-packet path, the per-flow work every
//! SC replica does: a new flow (conntrack miss, ACL or Maglev or a port allocation, a row
//! put with its timer)
//! and a re-request of a known one, against tables already holding `FLOWS` flows (so
//! lookups pay the cache misses of a loaded table, not of an empty one); and building
//! each NF, as every new replica does.
//!
//! `cargo bench -p nfs --bench first_packet`

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion};
use nf::{FirstPacket, NetworkFunction, NfEnv};
use pipeline::{FlowKey, PacketMeta};

const FLOWS: u32 = 100_000;

fn key(i: u32) -> FlowKey {
    let (a, b, p) = ((i >> 16) & 255, (i >> 8) & 255, 1024 + (i & 255) * 200);
    format!("100 udp 198.18.{a}.{b}:{p} > 198.19.0.9:53")
        .parse()
        .expect("flow key")
}

fn nf(kind: &str) -> Box<dyn NetworkFunction> {
    nfs::build(&nf_config(kind)).expect("nf")
}

fn nf_config(kind: &str) -> nfs::NfConfig {
    let cfg = match kind {
        // Two addresses: 129k ports for the 101k mappings (endpoint-independent, one per
        // source endpoint) the bench makes.
        "snat" => serde_json::json!({"kind": "snat", "pools": [{"addresses":
            ["198.19.255.1", "198.19.255.2"], "sources": ["198.18.0.0/16"]}]}),
        "fw" => serde_json::json!({"kind": "fw", "tenants": [{"tenant": 1,
            "default_action": "allow", "rules": [{"action": "deny", "proto": "tcp", "dport": 23}]}]}),
        _ => serde_json::json!({"kind": "lb", "services": [{"vip": "198.19.0.9", "port": 53,
            "protocol": "udp", "backends": [{"addr": "198.19.1.7", "port": 5353},
            {"addr": "198.19.1.8", "port": 5353}]}]}),
    };
    serde_json::from_value(cfg).expect("config")
}

fn first(nf: &mut dyn NetworkFunction, k: FlowKey, now_ms: u64) {
    let p = FirstPacket::new(k, 1, PacketMeta::new(60, 0));
    let mut env = NfEnv::new(now_ms, now_ms);
    black_box(nf.first_packet(&p, &mut env).expect("decided"));
}

fn loaded(kind: &str, keys: &[FlowKey]) -> Box<dyn NetworkFunction> {
    let mut n = nf(kind);
    for (i, k) in keys.iter().take(FLOWS as usize).enumerate() {
        first(n.as_mut(), *k, i as u64);
    }
    n
}

fn bench(c: &mut Criterion) {
    // Keys made once: parsing a key costs more than the NF's work on it.
    let keys: Vec<FlowKey> = (0..FLOWS + 1024).map(key).collect();
    for kind in ["fw", "lb", "snat"] {
        let mut g = c.benchmark_group(kind);
        // A batch of 1024 new flows into a loaded table, per iteration.
        g.bench_function("new_flows_x1024", |b| {
            b.iter_batched_ref(
                || loaded(kind, &keys),
                |n| {
                    for k in &keys[FLOWS as usize..] {
                        first(n.as_mut(), *k, 1_000_000);
                    }
                },
                BatchSize::LargeInput,
            )
        });
        let mut n = loaded(kind, &keys);
        let mut i = 0usize;
        g.bench_function("known_flow", |b| {
            b.iter(|| {
                i = (i + 7919) % FLOWS as usize;
                first(n.as_mut(), keys[i], 2_000_000);
            })
        });
        // Building the NF, as a replica's start does, the instances kept until the
        // sample ends (a new replica's tables are in fresh memory). The LB's Maglev
        // table is populated by its first build and shared by the others while one
        // lives (`nfs::lb::maglev`).
        let cfg = nf_config(kind);
        g.bench_function("build", |b| {
            b.iter_with_large_drop(|| nfs::build(&cfg).expect("nf"))
        });
        if kind == "lb" {
            // A seed no build used before: the table is populated, not shared.
            let mut seed = 1u64 << 40;
            g.bench_function("build_first", |b| {
                b.iter_batched(
                    || {
                        seed += 1;
                        let mut v = serde_json::to_value(&cfg).expect("config");
                        v["seed"] = seed.into();
                        serde_json::from_value::<nfs::NfConfig>(v).expect("config")
                    },
                    |c| nfs::build(&c).expect("nf"),
                    BatchSize::SmallInput,
                )
            });
        }
        g.finish();
    }
    chain_bench(c, &keys);
}

/// The built-in FW → SNAT → LB as one chain with the setup bench's VXLAN egress both
/// ways: what a replica runs per new flow, the two composed rules included (each a
/// six-action list: decap, two rewrites, encap, count, output).
fn chain(keys: &[FlowKey]) -> nf::Chain {
    let nfs = ["fw", "snat", "lb"].map(nf).into_iter().collect();
    let egress = |vni| nf::Egress {
        decap: true,
        encap: Some((std::net::Ipv4Addr::new(198, 18, 0, 50), vni)),
        inner_dmac: None,
        output: 1,
    };
    let mut c =
        nf::Chain::new(nfs, nf::ChainSpec::seq(3), egress(200), egress(100)).expect("chain");
    for (i, k) in keys.iter().take(FLOWS as usize).enumerate() {
        decide(&mut c, *k, i as u64);
    }
    c
}

fn decide(c: &mut nf::Chain, k: FlowKey, now_ms: u64) -> nf::ComposedRules {
    let p = FirstPacket::new(k, 1, PacketMeta::new(60, 0));
    c.decide(&p, &mut NfEnv::new(now_ms, now_ms))
        .expect("decided")
}

fn chain_bench(c: &mut Criterion, keys: &[FlowKey]) {
    let mut g = c.benchmark_group("chain");
    // 1024 new flows into a loaded chain, each decision kept until the batch ends (a
    // replica keeps its decisions until the tail's ack).
    g.bench_function("new_flows_x1024", |b| {
        b.iter_batched_ref(
            || (chain(keys), Vec::with_capacity(1024)),
            |(c, kept)| {
                for k in &keys[FLOWS as usize..] {
                    kept.push(decide(c, *k, 1_000_000));
                }
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
