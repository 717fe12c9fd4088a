//! Generates the starfabric.v1 messages and services with Debian's `protoc`
//! (package protobuf-compiler, installed by scripts/setup.sh).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let proto = "proto/starfabric/v1/starfabric.proto";
    println!("cargo:rerun-if-changed={proto}");
    println!("cargo:rerun-if-env-changed=PROTOC");
    let protoc = std::env::var_os("PROTOC")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("protoc"));
    // prost-build would fail with a terse "Could not find `protoc`"; say what to do.
    if Command::new(&protoc).arg("--version").output().is_err() {
        panic!(
            "\n\nprotoc not found (looked for {:?}).\n\
             The proto crate compiles starfabric.proto with Debian's protobuf compiler:\n\
             \x20   apt-get install protobuf-compiler   (or run scripts/setup.sh)\n\
             or point PROTOC at a protoc binary.\n\n",
            protoc
        );
    }
    std::env::set_var("PROTOC", &protoc);
    tonic_build::configure()
        .build_server(true)
        .build_client(true)
        // The setup path's per-flow byte fields decode as `Bytes`: a slice of the
        // message's receive buffer, and a clone is a reference count. As `Vec<u8>`
        // each one was an allocation per decode and per copy, at every hop of a flow's
        // request and reply (PP, FM, three replicas). State transfer keeps `Vec<u8>`:
        // it is not per flow, and its parts are kept long after the message is gone.
        .bytes([
            ".starfabric.v1.FlowKey.raw",
            ".starfabric.v1.Endpoint.addr",
            ".starfabric.v1.Encap",
            ".starfabric.v1.RuleRequest.frame",
            ".starfabric.v1.Action.fabric",
            ".starfabric.v1.FabricFrame.frame",
            ".starfabric.v1.EncodedRuleReply.body",
        ])
        // Rule is written by hand (src/rule_msg.rs): it sizes its action list once.
        .extern_path(".starfabric.v1.Rule", "crate::rule_msg::Rule")
        // So is RuleReplyBatch (src/reply_batch.rs): FM sends its cached encoding.
        .extern_path(
            ".starfabric.v1.RuleReplyBatch",
            "crate::reply_batch::RuleReplyBatch",
        )
        .compile_protos(&[proto], &["proto"])
        .unwrap_or_else(|e| panic!("compiling {proto}: {e}"));
}
