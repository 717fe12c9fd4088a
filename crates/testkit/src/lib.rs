//! The shared harness of the workspace's tests: what every integration test that
//! creates network namespaces, starts processes or polls for a condition would otherwise
//! write again.
//!
//! - [`netns`]: run `ip`, create namespaces and veth pairs under a caller-given name
//!   prefix, enter a namespace; [`netns::Netns`] deletes the namespaces it created on
//!   drop, also when the test panics. Test addresses are in 198.18.0.0/15.
//! - [`child`]: [`child::ChildGuard`] stops a started process by its own PID (SIGTERM,
//!   a bounded wait, then SIGKILL); [`child::lines`] reads its stdout lines on a thread,
//!   [`child::line_matching`] waits for one; [`child::run_bounded`] runs a command
//!   within a time limit.
//! - [`docs`]: [`docs::first_json_block`] takes the example a doc page shows, for a
//!   test that runs it.
//! - [`wait`]: [`wait::wait_until`] polls a closure until it returns `Some`, panicking
//!   with what it waited for on timeout.
//! - `rig` (feature `rig`): a `pipeline::Pipeline` on in-memory I/O with its rule
//!   channel and a manual clock, as the pipeline's own tests drive it.
//! - `flows` (feature `flows`): the client flows plane tests and benches ask rules
//!   for, and a SNAT's rule for one.
//! - `pki` (feature `pki`): a test CA issuing each in-process node a certificate of
//!   its role, so harnesses run their planes on mTLS.
//!
//! Everything here panics with a clear message rather than returning errors: a failed
//! setup step is a failed test.

pub mod child;
pub mod docs;
#[cfg(feature = "flows")]
pub mod flows;
pub mod netns;
#[cfg(feature = "pki")]
pub mod pki;
#[cfg(feature = "rig")]
pub mod rig;
pub mod wait;

pub use child::ChildGuard;
pub use netns::{ip, Netns};
pub use wait::{wait_until, wait_until_every};
