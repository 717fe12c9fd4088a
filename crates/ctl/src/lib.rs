//! The operator verbs of the `starfabric` CLI: clients of the orchestrator's REST API
//! (`orchestrator::client`) and of FM's admin gRPC, with their flags and their output
//! (a table by default, or `-o json|yaml`). The binary parses the command line and
//! calls these; `starfabric up` uses them to wait for and show the platform.
//!
//! These are commands: they print, and return `anyhow` errors like the binary they are
//! part of (docs/structure.md).

pub mod cli;
pub mod events;
pub mod placement;
pub mod scale;
pub mod trace;

pub use cli::{Client, ClientArgs, Output};
