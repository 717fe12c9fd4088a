//! The seeds of the `control` fuzz target (fuzz/fuzz_targets/control.rs, issue 23) and
//! the harness it drives (`fm::fuzzing`): a well-formed session sequence reaches the
//! master and gets answers down the sessions; malformed registrations and messages are
//! refused or undecodable, never a panic. The seed files in fuzz/corpus/control/ must be
//! what this test builds: `SF_WRITE_FUZZ_SEEDS=1` rewrites them after a protocol change.

use crate::common;

use fm::fuzzing::{run, Op, Summary};
use prost::Message;
use proto::v1;

fn node(id: &str, role: v1::Role) -> v1::NodeInfo {
    v1::NodeInfo {
        id: id.into(),
        role: role as i32,
        addr: format!("127.0.0.1:{}", 7000 + id.len()),
        proto_version: proto::PROTO_VERSION,
        ..Default::default()
    }
}

fn pp_register(info: v1::NodeInfo) -> Vec<u8> {
    v1::PpUp {
        msg: Some(v1::pp_up::Msg::Register(info)),
    }
    .encode_to_vec()
}

fn sc_register(info: v1::NodeInfo) -> Vec<u8> {
    v1::ScUp {
        msg: Some(v1::sc_up::Msg::Register(info)),
    }
    .encode_to_vec()
}

fn encode(ops: &[Op]) -> Vec<u8> {
    ops.iter().flat_map(Op::encode).collect()
}

/// A PP node and three SC nodes join, the orchestrator directs FM to serve an SNAT
/// chain, PP asks for 8 flows' rules and reports events, time passes, every query runs.
fn cluster_seed() -> Vec<Op> {
    let chain = common::snat_chain(&["198.18.100.1"]).to_proto().unwrap();
    let directive = v1::Directive {
        version: 1,
        chains: vec![chain],
        ..Default::default()
    }
    .encode_to_vec();
    let requests = v1::PpUp {
        msg: Some(v1::pp_up::Msg::Requests(v1::RuleRequestBatch {
            requests: (0..8)
                .map(|i| proto::request_to_proto(&common::flow(i), u64::from(i) + 1))
                .collect(),
        })),
    }
    .encode_to_vec();
    let events = v1::PpUp {
        msg: Some(v1::pp_up::Msg::Events(v1::FlowEventBatch {
            events: vec![proto::event_to_proto(
                1,
                1,
                &nf::FlowEvent::Expired {
                    key: common::flow(0).key,
                },
            )],
        })),
    }
    .encode_to_vec();
    let mut ops = vec![
        Op::OpenPp(pp_register(node("pp-1", v1::Role::Pp))),
        Op::OpenSc(sc_register(node("sc-1", v1::Role::Sc))),
        Op::OpenSc(sc_register(node("sc-2", v1::Role::Sc))),
        Op::OpenSc(sc_register(node("sc-3", v1::Role::Sc))),
        Op::Directive(directive),
        Op::Advance(100),
        Op::Pp(0, requests),
        Op::Advance(50),
        Op::Pp(0, events),
        Op::ScaleOut(
            v1::ScaleOutRequest {
                tenant: 1,
                chain: 1,
                group: None,
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        Op::Advance(2000),
        Op::Close(1),
        Op::Advance(2000),
    ];
    for k in 0..8 {
        ops.push(Op::Query(k, Vec::new()));
    }
    ops
}

/// What FM refuses: a PP registration on the SC session, another protocol version, an
/// empty id, a message before any session, and bytes that are no message at all.
fn refusals_seed() -> Vec<Op> {
    let mut old = node("pp-9", v1::Role::Pp);
    old.proto_version = proto::PROTO_VERSION + 1;
    vec![
        Op::OpenSc(sc_register(node("pp-1", v1::Role::Pp))),
        Op::OpenPp(pp_register(old)),
        Op::OpenPp(pp_register(node("", v1::Role::Pp))),
        Op::Pp(0, Vec::new()),
        Op::Directive(vec![0xff, 0xff, 0xff]),
    ]
}

#[test]
fn a_well_formed_session_sequence_reaches_the_master_and_is_answered() {
    let ops = cluster_seed();
    let s = run(&encode(&ops));
    assert_eq!(
        s,
        Summary {
            applied: ops.len() as u64,
            refused: 0,
            undecodable: 0,
            delivered: s.delivered,
        }
    );
    // Group configurations down the SC sessions, submits, replies down the PP session.
    assert!(s.delivered >= 4, "{s:?}");
}

#[test]
fn malformed_registrations_and_messages_are_refused() {
    let s = run(&encode(&refusals_seed()));
    assert_eq!(
        s,
        Summary {
            applied: 0,
            refused: 4,
            undecodable: 1,
            delivered: 0,
        }
    );
}

#[test]
fn ops_round_trip_and_truncated_input_ends_cleanly() {
    let ops = cluster_seed();
    let bytes = encode(&ops);
    let mut rest = &bytes[..];
    let mut back = Vec::new();
    while let Some((op, tail)) = Op::read(rest) {
        back.push(op);
        rest = tail;
    }
    assert_eq!(back, ops);
    // Every prefix of a valid stream is a valid input too.
    for cut in [1, 2, 3, 5, bytes.len() / 2, bytes.len() - 1] {
        run(&bytes[..cut]);
    }
}

#[test]
fn the_committed_seeds_are_current() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/control");
    let write = std::env::var_os("SF_WRITE_FUZZ_SEEDS").is_some_and(|v| v == "1");
    for (name, ops) in [("cluster", cluster_seed()), ("refusals", refusals_seed())] {
        let bytes = encode(&ops);
        let path = dir.join(name);
        if write {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &bytes).unwrap();
        }
        let on_disk = std::fs::read(&path).unwrap_or_else(|e| {
            panic!("{}: {e} (SF_WRITE_FUZZ_SEEDS=1 writes it)", path.display())
        });
        assert!(
            on_disk == bytes,
            "{} is stale: rerun with SF_WRITE_FUZZ_SEEDS=1",
            path.display()
        );
    }
}
