//! SC (service computation): NF logic and NF state, partitioned (paper 000 §4.1).
//!
//! An SC node hosts replicas of partitions. A partition is (tenant, chain, key-hash
//! range); its state is a [`nf::Chain`] instance, owned by an *SC group* of replicas
//! (three by default) that keep it identical by chain replication, the paper's
//! packet-pass-through (§3.2): see [`replica`] for the protocol and its repair rules,
//! and [`node`] for the tasks and streams around it.
//!
//! Who detects failures: FM. Every SC node keeps one session stream to FM and sends a
//! heartbeat on it every `heartbeat_ms` (50 ms by default). FM declares a node dead when
//! the stream breaks or after `sc_miss_limit` (10) silent periods, removes it from its
//! groups, and pushes each group's new replica order (a new epoch) to the survivors,
//! appending a spare node at the tail when one is registered. SC nodes never decide
//! membership themselves; they follow FM's configuration, so there is exactly one
//! authority for chain order.

pub mod assign;
pub mod factory;
pub mod metrics;
pub mod node;
pub mod process;
pub mod replica;
pub mod spares;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod workers;

pub use assign::{assigner_by_name, Fallback, FallbackStep, Sfc2cpu, ASSIGNER_NAMES};
pub use factory::{BuiltinNfs, ChainFactory};
pub use node::{
    start, Assigner, GroupMetrics, ScConfig, ScCounters, ScHandle, ScObserver, ScProcess,
    WorkerStats,
};
pub use replica::{Applied, LinkChange, Outbox, Outcome, ReplicaCore, ReplicaStats};
pub use workers::{CoreAssigner, RoundRobin, WorkerLoad};

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ScError {
    #[error("chain: {0}")]
    Chain(String),
    #[error("i/o: {0}")]
    Io(String),
    #[error("protocol: {0}")]
    Protocol(String),
    #[error("configuration: {0}")]
    Config(String),
}
