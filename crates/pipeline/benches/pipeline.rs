//! Criterion benchmarks of the pipeline's parts. `starfabric bench pipeline` measures the
//! whole worker loop; these isolate parse, hash, table lookup and the hit path per batch.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use pipeline::{
    Desc, FlowKey, FlowTable, MemRing, PacketIo, Pipeline, PipelineConfig, Rule, RuleSource,
    TraceCounters, TraceFilter, Tracer, VecSource,
};
use testkit::flows::snat_actions;
use testkit::rig::{client_udp, node};

fn tenant_frame(sport: u16) -> Vec<u8> {
    client_udp(100, sport, 53, &[0u8; 18])
}

/// 64 tenant frames of 64 flows, received: what a hit-path batch starts from.
fn received_batch() -> (MemRing<VecSource>, Vec<Desc>) {
    let mut src = VecSource::default();
    for s in 0..64u16 {
        src.push(tenant_frame(s), 0);
    }
    let mut io = MemRing::new(src, 64);
    let mut d = Vec::with_capacity(64);
    io.rx(&mut d, 64).unwrap();
    (io, d)
}

fn key(sport: u16) -> FlowKey {
    FlowKey::new(
        100,
        17,
        IpAddr::V4(Ipv4Addr::new(198, 18, 10, 2)),
        sport,
        IpAddr::V4(Ipv4Addr::new(198, 19, 0, 9)),
        53,
    )
}

fn bench(c: &mut Criterion) {
    let f = tenant_frame(1000);
    let mut g = c.benchmark_group("packet");
    g.throughput(Throughput::Elements(1));
    g.bench_function("parse_outer_and_inner", |b| {
        b.iter(|| {
            let o = packet::parse_frame(black_box(&f)).unwrap();
            packet::parse_frame(o.vxlan_inner(&f).unwrap()).unwrap()
        })
    });
    g.bench_function("flow_hash", |b| {
        let k = key(1);
        b.iter(|| black_box(&k).hash())
    });
    g.finish();

    let mut g = c.benchmark_group("table");
    g.throughput(Throughput::Elements(1));
    let mut t = FlowTable::new(100_000, 7).unwrap();
    for i in 0..50_000u16 {
        t.insert(&key(i), Default::default(), 0, 0, |_| u32::MAX);
    }
    g.bench_function("lookup_hit_50k", |b| {
        let mut i = 0u16;
        b.iter(|| {
            i = (i + 7919) % 50_000;
            t.lookup(black_box(&key(i)))
        })
    });
    g.finish();

    let mut g = c.benchmark_group("pipeline");
    g.throughput(Throughput::Elements(64));
    let mut p = Pipeline::new(PipelineConfig::new(node()), RuleSource::None).unwrap();
    for s in 0..64u16 {
        p.install_rule(&Rule::new(key(s), snat_actions(40000 + s)), 0)
            .unwrap();
    }
    g.bench_function("hit_batch_64_snat_reencap", |b| {
        b.iter_batched_ref(
            received_batch,
            |(io, d)| p.process(io.region(), d, 1),
            BatchSize::SmallInput,
        )
    });
    // "Tracing costs nothing when off": the batch above runs with the trace hook
    // compiled in and off. Here the same batch with a trace armed whose filter matches
    // none of it (VNI 100's `tcp and port 80`; the traffic is UDP to port 53), so every
    // packet is tested against the filter and none is recorded. docs/trace.md has both.
    let (ttx, _trx) = crossbeam_channel::bounded(16);
    p.set_tracer(Some(Tracer::new(
        TraceFilter::new(None, Some(100), "tcp and port 80").unwrap(),
        u64::MAX,
        256,
        ttx,
        Arc::new(TraceCounters::default()),
    )));
    g.bench_function("hit_batch_64_snat_reencap_trace_armed_nomatch", |b| {
        b.iter_batched_ref(
            received_batch,
            |(io, d)| p.process(io.region(), d, 1),
            BatchSize::SmallInput,
        )
    });
    assert!(p.tracer().is_some(), "still armed");
    p.set_tracer(None);
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
