//! Criterion benchmarks of FM's rule cache on the setup path: caching a newly decided
//! flow (forward rule with its reverse rule as companion, as SC's tail returns it) into
//! a cache already holding `FLOWS` flows at its capacity (so each insert also evicts the
//! oldest flow), and answering a PP node's re-request by either direction's key (a
//! restarted node, or a vIP moved to a node that never saw the flow).
//!
//! Before the benches it prints the memory the cache takes per flow (resident set growth
//! while `FLOWS` flows are cached, over `FLOWS`).
//!
//! `answer_new_flows` times what FM does per new flow after caching SC's reply, for a
//! batch of `ANSWER_BATCH` flows: queue the answer, size the `PpDown` for the down
//! queue's byte bound, and encode it as tonic does (`Message::encode`). `decoded` sends
//! the reply as a message, which encodes it a second time (FM before
//! `v1::EncodedReply`); `encoded` sends the cache entry's bytes. Both drop the decoded
//! reply, as FM does.
//!
//! `sc_results` times what a batch of `ANSWER_BATCH` new flows' replies costs from the
//! SC tail's node to FM's cache, both ends: the node encoding its `ScUp` (`sc_encode`)
//! and FM decoding it and caching each rule (`fm_cache`). `decoded` sends the replies
//! as messages (`OpResult.replies`, SC before `encoded_replies`), which FM decodes and
//! the cache encodes again; `encoded` has the node encode each reply once
//! (`proto::encode_rule_replies`) and FM cache the bytes (`RuleCache::insert_encoded`);
//! `encoded_checked` also decodes each body at FM, as a check that PP will read it
//! (what FM would pay to vouch for SC's bytes). `tail_reply` times the tail from the
//! chain's rules on: `messages` builds each reply as a message and encodes it
//! (`proto::encode_rule_replies`), `direct` encodes the rules into the body
//! (`proto::DecidedReply`), as the tail does now.
//!
//! `pp_read` times the PP node's end for a batch of `ANSWER_BATCH` replies: decoding
//! the `PpDown` and reading each reply into the pipeline's `RuleReply`, through a
//! message (`messages`) or straight from the bytes (`direct`, `proto::read_rule_reply`).
//!
//! `cargo bench -p fm --bench cache`

use std::net::Ipv4Addr;

use criterion::{black_box, criterion_group, Criterion};
use fm::{CacheKey, RuleCache};
use pipeline::{Action, FlowKey, Rule};
use proto::v1;

const FLOWS: u32 = 200_000;
/// Replies per `PpDown` in `answer_new_flows` (FM's batches in `bench setup` averaged
/// about 200 at saturation; fewer at lower rates).
const ANSWER_BATCH: u32 = 64;
/// Cache entries: a flow takes two (one per direction's key).
const CAPACITY: usize = 2 * FLOWS as usize;

fn key(i: u32) -> FlowKey {
    let (a, b, p) = ((i >> 16) & 255, (i >> 8) & 255, 1024 + (i & 255) * 200);
    format!("100 udp 198.18.{a}.{b}:{p} > 198.19.0.9:53")
        .parse()
        .expect("flow key")
}

/// What SC's tail returns for an SNAT → LB flow: decap, source and destination
/// rewritten, encap toward the next hop; the reverse rule undoes both.
fn decided(i: u32) -> (CacheKey, v1::RuleReply, [u8; 40]) {
    let (k, fwd, rev) = decided_rules(i);
    let reply = v1::RuleReply {
        id: u64::from(i),
        worker: 0,
        key: Some((&k).into()),
        result: Some(v1::rule_reply::Result::Rule((&fwd).into())),
        also: vec![(&rev).into()],
        // As FM caches an SC group's reply (group by id since `decided_by_group`).
        decided_by: String::new(),
        decided_by_group: 1,
        frame_forwarded: false,
    };
    ((1, 1, *k.as_bytes()), reply, *rev.key.as_bytes())
}

/// [`decided`]'s flow key, rule and companion as the chain composes them.
fn decided_rules(i: u32) -> (FlowKey, Rule, Rule) {
    let k = key(i);
    // Ports as SNAT hands them out: 60,000 per public address, so every flow's reverse
    // key is its own.
    let ext = Ipv4Addr::new(198, 19, 255, 1 + (i / 60_000) as u8);
    let eport = 1024 + (i % 60_000) as u16;
    let backend = Ipv4Addr::new(198, 19, 1, 7 + (i % 2) as u8);
    let mut fwd = Rule::new(
        k,
        vec![
            Action::DecapVxlan,
            Action::SetSrc {
                addr: Some(ext.into()),
                port: Some(eport),
            },
            Action::SetDst {
                addr: Some(backend.into()),
                port: Some(5353),
            },
            Action::EncapVxlan {
                dst: Ipv4Addr::new(198, 18, 0, 9),
                vni: 200,
                inner_dmac: Some([2, 0, 0, 0, 0, 9]),
                inner_smac: None,
            },
            Action::Output(1),
        ],
    );
    fwd.idle_timeout = Some(std::time::Duration::from_secs(120));
    let rkey: FlowKey = format!("200 udp {backend}:5353 > {ext}:{eport}")
        .parse()
        .expect("reverse key");
    let mut rev = Rule::new(
        rkey,
        vec![
            Action::DecapVxlan,
            Action::SetSrc {
                addr: Some(Ipv4Addr::new(198, 19, 0, 9).into()),
                port: Some(53),
            },
            Action::SetDst {
                addr: k.src().into(),
                port: Some(k.sport()),
            },
            Action::EncapVxlan {
                dst: Ipv4Addr::new(198, 18, 0, 3),
                vni: 100,
                inner_dmac: Some([2, 0, 0, 0, 0, 3]),
                inner_smac: None,
            },
            Action::Output(1),
        ],
    );
    rev.idle_timeout = fwd.idle_timeout;
    (k, fwd, rev)
}

/// A cache holding flows 0..FLOWS, and each flow's forward and reverse cache keys.
fn filled() -> (RuleCache, Vec<(CacheKey, CacheKey)>) {
    let mut c = RuleCache::new(CAPACITY, 120_000);
    let mut keys = Vec::with_capacity(FLOWS as usize);
    for i in 0..FLOWS {
        let (ck, r, rk) = decided(i);
        c.insert(ck, &r, 0);
        keys.push((ck, (ck.0, ck.1, rk)));
    }
    (c, keys)
}

fn rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

fn report_memory() {
    // Built first, so the replies' own memory is not counted.
    let replies: Vec<_> = (0..FLOWS).map(decided).collect();
    let before = rss_bytes();
    let mut c = RuleCache::new(CAPACITY, 120_000);
    for (ck, r, _) in &replies {
        c.insert(*ck, r, 0);
    }
    if let (Some(a), Some(b)) = (before, rss_bytes()) {
        println!(
            "rule cache: {} entries for {FLOWS} flows, {:.0} bytes a flow (resident set growth), \
             a reply encodes to {} bytes",
            c.len(),
            b.saturating_sub(a) as f64 / f64::from(FLOWS),
            prost::Message::encoded_len(&replies[0].1),
        );
    }
    black_box(&c);
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("rule_cache");
    let (mut cache, _) = filled();
    let mut next = FLOWS;
    let mut now = 1;
    g.bench_function("insert_new_flow_at_capacity", |b| {
        b.iter_batched(
            || {
                next = next.wrapping_add(1);
                decided(next)
            },
            |(ck, r, _)| {
                now += 1;
                cache.insert(ck, &r, now);
            },
            criterion::BatchSize::SmallInput,
        )
    });
    let (mut cache, keys) = filled();
    let mut i = 0usize;
    g.bench_function("get_forward", |b| {
        b.iter(|| {
            i = (i + 7919) % keys.len();
            black_box(cache.get(&keys[i].0, 1))
        })
    });
    g.bench_function("get_reverse", |b| {
        b.iter(|| {
            i = (i + 7919) % keys.len();
            black_box(cache.get(&keys[i].1, 1))
        })
    });
    g.finish();

    let mut g = c.benchmark_group("answer_new_flows");
    g.throughput(criterion::Throughput::Elements(u64::from(ANSWER_BATCH)));
    for encoded in [false, true] {
        let mut next = FLOWS;
        let mut wire = prost::bytes::BytesMut::with_capacity(1 << 20);
        let name = if encoded { "encoded" } else { "decoded" };
        g.bench_function(name, |b| {
            b.iter_batched(
                || {
                    // SC's replies, and each one's cache entry as `RuleCache::insert`
                    // makes it (a small cache: the insert is the same on both paths and
                    // is `rule_cache`'s bench, not this one's).
                    let mut cache = RuleCache::new(4 * ANSWER_BATCH as usize, 120_000);
                    (0..ANSWER_BATCH)
                        .map(|_| {
                            next = next.wrapping_add(1);
                            let (ck, mut r, _) = decided(next);
                            let (id, worker) = (r.id, r.worker);
                            (r.id, r.worker) = (0, 0);
                            let body = cache.insert(ck, &r, 1).expect("a rule is cached");
                            (r.id, r.worker) = (id, worker);
                            (r, body)
                        })
                        .collect::<Vec<_>>()
                },
                |flows| {
                    let mut batch = v1::RuleReplyBatch::default();
                    for (r, body) in flows {
                        if encoded {
                            let (id, worker) = (r.id, r.worker);
                            drop(r);
                            batch.encoded.push(v1::EncodedReply { id, worker, body });
                        } else {
                            batch.replies.push(r);
                        }
                    }
                    let down = v1::PpDown {
                        msg: Some(v1::pp_down::Msg::Replies(batch)),
                    };
                    let bound = prost::Message::encoded_len(&down);
                    wire.clear();
                    prost::Message::encode(&down, &mut wire).expect("room");
                    black_box((bound, wire.len()))
                },
                criterion::BatchSize::SmallInput,
            )
        });
    }
    g.finish();

    // The tail's results for one batch of new flows, as the node builds them.
    let results = |from: u32| -> Vec<v1::OpResult> {
        vec![v1::OpResult {
            seq: 1,
            replies: (from..from + ANSWER_BATCH)
                .map(|i| {
                    let (_, mut r, _) = decided(i);
                    r.decided_by_group = 0;
                    r
                })
                .collect(),
            ..Default::default()
        }]
    };
    let up = |results: Vec<v1::OpResult>| v1::ScUp {
        msg: Some(v1::sc_up::Msg::Results(v1::GroupResults {
            group: 1,
            epoch: 1,
            results,
        })),
    };
    let mut g = c.benchmark_group("sc_results");
    g.throughput(criterion::Throughput::Elements(u64::from(ANSWER_BATCH)));
    for encoded in [false, true] {
        let name = if encoded {
            "sc_encode/encoded"
        } else {
            "sc_encode/decoded"
        };
        let mut wire = prost::bytes::BytesMut::with_capacity(1 << 20);
        let mut next = 0u32;
        g.bench_function(name, |b| {
            b.iter_batched(
                || {
                    next = next.wrapping_add(ANSWER_BATCH);
                    results(next)
                },
                |mut rs| {
                    if encoded {
                        proto::encode_rule_replies(&mut rs, 1);
                    }
                    wire.clear();
                    prost::Message::encode(&up(rs), &mut wire).expect("room");
                    black_box(wire.len())
                },
                criterion::BatchSize::SmallInput,
            )
        });
    }
    // From the chain's rules to the tail's `ScUp`: building each reply as a message
    // and encoding it (`messages`, the tail before `proto::DecidedReply`), or encoding
    // the rules straight into the body (`direct`), in 64 KiB chunks as the tail does.
    for direct in [false, true] {
        let name = if direct {
            "tail_reply/direct"
        } else {
            "tail_reply/messages"
        };
        let mut wire = prost::bytes::BytesMut::with_capacity(1 << 20);
        let mut chunk = prost::bytes::BytesMut::new();
        let mut next = 0u32;
        g.bench_function(name, |b| {
            b.iter_batched(
                || {
                    next = next.wrapping_add(ANSWER_BATCH);
                    (next..next + ANSWER_BATCH)
                        .map(|i| {
                            let (k, fwd, rev) = decided_rules(i);
                            (u64::from(i), v1::FlowKey::from(&k), fwd, rev)
                        })
                        .collect::<Vec<_>>()
                },
                |flows| {
                    let mut r = v1::OpResult {
                        seq: 1,
                        ..Default::default()
                    };
                    if direct {
                        r.encoded_replies.reserve(flows.len());
                        for (id, key, fwd, rev) in &flows {
                            let body = proto::DecidedReply {
                                key: Some(key),
                                rule: fwd,
                                also: Some(rev),
                                group: 1,
                            };
                            let n = body.encoded_len();
                            if chunk.capacity() < n {
                                chunk = prost::bytes::BytesMut::with_capacity(n.max(64 * 1024));
                            }
                            body.encode(&mut chunk);
                            r.encoded_replies.push(v1::EncodedRuleReply {
                                id: *id,
                                body: chunk.split().freeze(),
                            });
                        }
                    } else {
                        r.replies.reserve(flows.len());
                        for (id, key, fwd, rev) in &flows {
                            r.replies.push(v1::RuleReply {
                                id: *id,
                                key: Some(key.clone()),
                                result: Some(v1::rule_reply::Result::Rule(proto::rule_keyed(
                                    fwd,
                                    Some(key),
                                ))),
                                also: vec![v1::Rule::from(rev)],
                                worker: 1,
                                ..Default::default()
                            });
                        }
                    }
                    let mut rs = vec![r];
                    if !direct {
                        proto::encode_rule_replies(&mut rs, 1);
                    }
                    wire.clear();
                    prost::Message::encode(&up(rs), &mut wire).expect("room");
                    black_box(wire.len());
                    flows
                },
                criterion::BatchSize::SmallInput,
            )
        });
    }
    for (name, encoded, checked) in [
        ("fm_cache/decoded", false, false),
        ("fm_cache/encoded", true, false),
        ("fm_cache/encoded_checked", true, true),
    ] {
        let mut next = 0u32;
        g.bench_function(name, |b| {
            b.iter_batched(
                || {
                    next = next.wrapping_add(ANSWER_BATCH);
                    let mut rs = results(next);
                    if encoded {
                        proto::encode_rule_replies(&mut rs, 1);
                    }
                    let keys: Vec<CacheKey> =
                        (next..next + ANSWER_BATCH).map(|i| decided(i).0).collect();
                    let wire = prost::bytes::Bytes::from(prost::Message::encode_to_vec(&up(rs)));
                    (
                        RuleCache::new(4 * ANSWER_BATCH as usize, 120_000),
                        keys,
                        wire,
                    )
                },
                |(mut cache, keys, wire)| {
                    // As tonic decodes a message: from the frame's `Bytes`.
                    let m: v1::ScUp = prost::Message::decode(wire).expect("decodes");
                    let Some(v1::sc_up::Msg::Results(g)) = m.msg else {
                        unreachable!()
                    };
                    for r in g.results {
                        for (mut reply, ck) in r.replies.into_iter().zip(&keys) {
                            reply.decided_by_group = g.group;
                            (reply.id, reply.worker) = (0, 0);
                            black_box(cache.insert(*ck, &reply, 1));
                        }
                        for (e, ck) in r.encoded_replies.iter().zip(&keys) {
                            if checked {
                                let r: v1::RuleReply =
                                    prost::Message::decode(e.body.clone()).expect("decodes");
                                black_box(r);
                            }
                            black_box(cache.insert_encoded(*ck, &e.body, 1));
                        }
                    }
                    cache
                },
                criterion::BatchSize::SmallInput,
            )
        });
    }
    g.finish();

    // The PP node's end: a `PpDown` of a batch's replies off the wire, each read into
    // the pipeline's reply as PP's FM session hands it to its worker. `messages`
    // decodes each into a `v1::RuleReply` and converts that (PP before
    // `proto::read_rule_reply`); `direct` reads the bytes into the pipeline's reply.
    let mut g = c.benchmark_group("pp_read");
    g.throughput(criterion::Throughput::Elements(u64::from(ANSWER_BATCH)));
    for direct in [false, true] {
        let name = if direct { "direct" } else { "messages" };
        let mut next = 0u32;
        g.bench_function(name, |b| {
            b.iter_batched(
                || {
                    next = next.wrapping_add(ANSWER_BATCH);
                    let replies = (next..next + ANSWER_BATCH)
                        .map(|i| {
                            let mut r = decided(i).1;
                            (r.id, r.worker) = (u64::from(i), 1);
                            r
                        })
                        .collect();
                    let down = v1::PpDown {
                        msg: Some(v1::pp_down::Msg::Replies(v1::RuleReplyBatch::new(replies))),
                    };
                    prost::bytes::Bytes::from(prost::Message::encode_to_vec(&down))
                },
                |wire| {
                    // As tonic decodes a message: from the frame's `Bytes`.
                    let m: v1::PpDown = prost::Message::decode(wire).expect("decodes");
                    let Some(v1::pp_down::Msg::Replies(batch)) = m.msg else {
                        unreachable!()
                    };
                    let mut out = Vec::with_capacity(batch.len());
                    for b in &batch.wire {
                        let reply = if direct {
                            proto::read_rule_reply(b).expect("reads").reply
                        } else {
                            let m: v1::RuleReply = prost::Message::decode(&b[..]).expect("decodes");
                            pipeline::RuleReply::try_from(m).expect("converts")
                        };
                        out.push(reply);
                    }
                    out
                },
                criterion::BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench);

fn main() {
    report_memory();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
