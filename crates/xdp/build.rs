//! Compiles the XDP programs (`bpf/pp_xdp.c`, `bpf/xdp_pass.c`, `bpf/xdp_sink.c`,
//! `bpf/xdp_gen.c`) with clang into
//! `OUT_DIR`, where the library embeds them from. clang comes from `scripts/setup.sh` (override with `CLANG`).
//!
//! First it writes `OUT_DIR/pp_xdp_abi.h` from `src/abi.rs`, the one definition of the
//! rule ABI, which `pp_xdp.c` includes.

use std::path::PathBuf;
use std::process::Command;

// The library uses all of it; the build script only the header writer.
#[allow(dead_code)]
#[path = "src/abi.rs"]
mod abi;

fn out_dir() -> PathBuf {
    PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"))
}

fn main() {
    println!("cargo:rerun-if-env-changed=CLANG");
    println!("cargo:rerun-if-changed=src/abi.rs");
    let header = out_dir().join("pp_xdp_abi.h");
    std::fs::write(&header, abi::c_header())
        .unwrap_or_else(|e| panic!("writing {}: {e}", header.display()));
    compile("bpf/pp_xdp.c", "pp_xdp.o");
    compile("bpf/xdp_pass.c", "xdp_pass.o");
    compile("bpf/xdp_sink.c", "xdp_sink.o");
    compile("bpf/xdp_gen.c", "xdp_gen.o");
}

fn compile(src: &str, obj: &str) {
    println!("cargo:rerun-if-changed={src}");
    let out = out_dir().join(obj);
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".to_string());
    // The multiarch include dir holds <asm/types.h>, which <linux/bpf.h> needs.
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let multiarch = match arch.as_str() {
        "x86_64" => "/usr/include/x86_64-linux-gnu",
        "aarch64" => "/usr/include/aarch64-linux-gnu",
        _ => "/usr/include",
    };
    let status = Command::new(&clang)
        .args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"])
        .arg(format!("-I{multiarch}"))
        .arg(format!("-I{}", out_dir().display()))
        .args(["-c", src, "-o"])
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("running {clang} (install it with scripts/setup.sh): {e}"));
    assert!(status.success(), "{clang} failed to compile {src}");
}
