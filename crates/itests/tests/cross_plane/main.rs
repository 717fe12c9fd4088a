//! The cross-plane integration tests (PP, FM and SC together), one module per scenario, in
//! one test binary: as separate targets each of them compiled and linked the same tokio,
//! tonic and plane-library instantiations again, about 45 s of CPU each in the `ci` profile
//! (15 targets: 655 CPU-s; this binary: 115). `fm_scaling` stays its own target: its tests
//! hold the machine alone (`SERIAL`), and other modules' tests would run beside them here.
//!
//! Run one module: `cargo test -p itests --test cross_plane fm_e2e::`.

#[path = "../common/mod.rs"]
mod common;

mod control_fuzz_seeds;
mod fm_e2e;
mod fm_events;
mod fm_failover;
mod fm_overload;
mod fm_replica_failure;
mod metrics_exposition;
mod monitor_counters;
mod pp_workers;
mod sc_workers;
mod snat_hairpin_partitions;
mod tcp_events;
mod tls_revocation;
mod ui_browser;
