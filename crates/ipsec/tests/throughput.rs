//! The gateway's own cost on one core, in memory (no I/O): bursts of 64 VPC frames of
//! 1400-byte IPv4 packets sealed, then the ESP frames opened, through
//! `Gateway::process` exactly as the PP pipeline calls it. Not a pass/fail test:
//!
//!     cargo test -p ipsec --profile ci --test throughput -- --ignored --nocapture

#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn seal_and_open_throughput_on_one_core() {
    for (bits, keymat) in [(128, 20), (256, 36)] {
        let (seal, open) = ipsec::bench::seal_open_gbps(keymat, 2.0);
        println!(
            "AES-{bits}-GCM, 1400-byte packets, bursts of 64: seal {seal:.2} Gbit/s, open {open:.2} Gbit/s on one core"
        );
        assert!(seal > 0.0 && open > 0.0);
    }
}
