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

/// The median of the finite values, or None if there are none (the mean of the two
/// middle values for an even count).
pub(crate) fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    })
}

/// Tests that start a packer take this first: one packer runs per process, and it moves
/// every thread of it, the other tests' too.
#[cfg(test)]
pub(crate) static PACKER_TEST: std::sync::Mutex<()> = std::sync::Mutex::new(());
