//! Compiles the XDP program (`bpf/pp_xdp.c`) with clang into `OUT_DIR/pp_xdp.o`, which
//! the library embeds. clang comes from `scripts/setup.sh` (override with `CLANG`).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let src = "bpf/pp_xdp.c";
    println!("cargo:rerun-if-changed={src}");
    println!("cargo:rerun-if-env-changed=CLANG");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("pp_xdp.o");
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
        .args(["-c", src, "-o"])
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("running {clang} (install it with scripts/setup.sh): {e}"));
    assert!(status.success(), "{clang} failed to compile {src}");
}
