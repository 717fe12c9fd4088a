//! The lab: benchmarks (`starfabric bench ...`), the demos (`starfabric demo`) and the
//! netns testbed commands (`starfabric testbed ...`). The product (the planes and the
//! operator CLI) does not depend on it; the `starfabric` binary includes it behind its
//! default `lab` feature.
//!
//! These are commands, not a library API: they print their reports and return
//! `anyhow` errors like the binary they are part of (docs/structure.md).

pub mod bench;
pub mod bench_chain;
pub mod bench_cores;
pub mod bench_cores_node;
pub mod bench_e2e;
pub mod bench_isolation;
pub mod bench_placement;
pub mod bench_scaling;
pub mod bench_setup;
pub mod bench_workers;
pub mod demo;
mod demo_testbed;
pub mod hit_workload;
pub mod setup_workload;
pub mod testbed_cmd;
pub mod workers_workload;

/// The median of the finite values (the benches' paired ratios): [`testbed::ladder::median`].
pub(crate) use testbed::ladder::median;

/// Tests that start a packer take this first: one packer runs per process, and it moves
/// every thread of it, the other tests' too.
#[cfg(test)]
pub(crate) static PACKER_TEST: std::sync::Mutex<()> = std::sync::Mutex::new(());
