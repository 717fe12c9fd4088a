//! Core assignment on an SC node: which CPU core runs each NF worker (paper 002,
//! sfc2cpu). A worker is a µVNF in the paper's words: one NF with a cost per request,
//! chained into SFCs that each have an arrival rate.
//!
//! - [`problem`]: the problem (µVNFs, SFCs, cores, assignments) and its JSON form;
//! - [`generate`]: §III-C's seeded generator with Table I's ranges, train and test
//!   streams disjoint by construction;
//! - [`twin`]: §IV-E's CFS digital twin (rate-cost shares, backpressure);
//! - [`assign`]: the [`Assigner`] trait, RR, LLF and FFD;
//! - [`learned`]: §IV's learned assigner (multi-head attention, double Q-learning
//!   in the twin), its model file and the fallback to RR when it cannot load;
//! - [`watchdog`]: §III-A's fallback after a learned assignment regresses;
//! - [`mod@bench`]: the twin half of `starfabric bench cores`;
//! - [`machine`]: Spearman's ρ and scaling instances to this machine, for validating
//!   the twin against the node.
//!
//! Nothing here does I/O except reading and writing model files on request; the SC
//! node calls in with its workers and applies the answer.

pub mod assign;
pub mod bench;
pub mod generate;
pub mod learned;
pub mod machine;
pub mod problem;
pub mod twin;
pub mod watchdog;

pub use assign::{Assigner, FirstFitDecreasing, LeastLoadedFirst, RandomAssigner, RoundRobin};
pub use learned::{load_or_fallback, LearnedAssigner, ModelError, Sfc2cpuModel};
pub use problem::{Assignment, Problem, Sfc, Vnf, Workload};
pub use twin::{evaluate, Prediction, Scheduler, TwinParams};
pub use watchdog::{Watchdog, WatchdogVerdict};

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Error)]
pub enum CoresError {
    #[error("invalid {field}: {reason}")]
    Invalid { field: String, reason: String },
    #[error("the problem has {vnfs} µVNFs; the model was trained for at most {max}")]
    TooManyVnfs { vnfs: usize, max: usize },
    #[error("the model has no network for {cores} cores (it has {available:?})")]
    NoNetForCores { cores: usize, available: Vec<usize> },
    #[error("model: {0}")]
    Model(#[from] ModelError),
}

impl CoresError {
    pub fn invalid(field: &str, reason: String) -> Self {
        CoresError::Invalid {
            field: field.to_string(),
            reason,
        }
    }
}
