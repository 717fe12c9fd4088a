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
        .compile_protos(&[proto], &["proto"])
        .unwrap_or_else(|e| panic!("compiling {proto}: {e}"));
}
