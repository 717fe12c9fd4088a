//! The decision layer of starfabric's orchestrator: where tenants' NF shards go.
//!
//! Paper 000 (CyberStar) App. A.1 states placement as a cost-minimising problem over
//! ECS nodes under capacity thresholds (Eq. 2–4) and shuffle-sharding limits (Eq. 5–6).
//! [`problem`] holds that problem, its checker and the online [`ClusterState`];
//! [`workload`] the workloads and their generator; [`sim`] the emulator every
//! algorithm runs in; [`milp`] the exact optimum of small instances. Paper 003 (Zeta)
//! adds [`rgcm`], the VPC → PP-cluster mapping of §VI-A, and [`multiip`], the Multi
//! IPs Scheduler's policy of §VI-B. Nothing here does I/O or spawns tasks: the
//! orchestrator calls in with a snapshot and acts on the answer.

pub mod bench;
pub mod ddqn;
pub mod forecast;
pub mod heuristics;
pub mod milp;
pub mod multiip;
pub mod problem;
pub mod rgcm;
pub mod sim;
pub mod workload;

pub use problem::{
    check, cost, ClusterState, Instance, Limits, Node, NodeIdx, PlaceError, Placed, Placement,
    Placer, Request, Resource, Resources, Violation,
};
