//! The orchestrator as a service, in one test binary: its REST API over real HTTP against
//! both store backends, the control loop, placement over real SC agents, and the
//! PrivateLink API. As four targets each compiled and linked the same axum, tonic and
//! etcd-client instantiations again (159 CPU-s in the `ci` profile).
//!
//! Run one module: `cargo test -p orchestrator --test service api::`.

#[path = "../common/mod.rs"]
mod common;

mod api;
mod control;
mod placement;
mod privatelink_api;
