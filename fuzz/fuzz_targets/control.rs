//! The control protocol from untrusted bytes (issue 23): a stream of ops
//! (`fm::fuzzing::Op`: session registrations and the messages PP and SC nodes send FM,
//! orchestrator directives, scale and vIP requests, queries, time) drives FM's master
//! through the service's own validation and dispatch; and every decoded message also
//! goes through the proto → pipeline / NF conversions the planes run on it: rule
//! requests, replies, actions and flow events into pipeline and NF types, and chain
//! configurations into built NF chains (what SC does with FM's group configuration),
//! whose state restore is then fed the op's raw bytes as a snapshot. A malformed input
//! must end in an error or a refusal, never a panic.
#![no_main]

use fm::fuzzing::{ControlHarness, Op};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use proto::v1;

/// What SC does with a chain configuration FM sends it: parse each NF's JSON, build the
/// NFs and the chain; then restore state from `snapshot` (untrusted bytes here).
fn build_chain(c: &v1::ChainConfig, snapshot: &[u8]) {
    let Ok(parts) = proto::ChainParts::try_from(c) else {
        return;
    };
    let Ok(nfs) = parts
        .nfs
        .iter()
        .map(|cfg| {
            let cfg: nfs::NfConfig = serde_json::from_str(cfg).map_err(|e| e.to_string())?;
            nfs::build(&cfg).map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, String>>()
    else {
        return;
    };
    if let Ok(mut chain) = nf::Chain::new(nfs, parts.spec.clone(), parts.forward, parts.reverse) {
        let _ = chain.restore(snapshot);
        let _ = chain.snapshot();
    }
}

/// The conversions PP, FM and SC apply to what they receive.
fn convert(op: &Op) {
    match op {
        Op::Pp(_, b) => match v1::PpUp::decode(&b[..]).ok().and_then(|m| m.msg) {
            Some(v1::pp_up::Msg::Requests(batch)) => {
                for r in &batch.requests {
                    let _ = pipeline::RuleRequest::try_from(r);
                }
            }
            Some(v1::pp_up::Msg::Events(batch)) => {
                for e in &batch.events {
                    let _ = proto::event_from(e);
                }
            }
            _ => {}
        },
        Op::Sc(_, b) => {
            if let Some(v1::sc_up::Msg::Results(r)) =
                v1::ScUp::decode(&b[..]).ok().and_then(|m| m.msg)
            {
                for res in &r.results {
                    for reply in &res.replies {
                        let _ = pipeline::RuleReply::try_from(reply);
                    }
                }
            }
        }
        Op::Directive(b) => {
            if let Ok(d) = v1::Directive::decode(&b[..]) {
                for c in &d.chains {
                    build_chain(c, b);
                }
            }
        }
        _ => {}
    }
}

fuzz_target!(|data: &[u8]| {
    let mut h = ControlHarness::new(Vec::new());
    let mut rest = data;
    while let Some((op, tail)) = Op::read(rest) {
        convert(&op);
        let _ = h.step(&op);
        rest = tail;
    }
});
