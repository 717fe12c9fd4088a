//! The NF programming model: what an NF is, what state it declares, and how a chain of
//! NFs becomes one composed rule per flow direction.
//!
//! This follows Serpens (paper 004, §III-B, §IV-A, Fig. 8/9) and S6 (paper 001):
//! - An NF implements [`NetworkFunction`]. It declares its state tables with a scope
//!   (per-flow | shared) and an access (read | write); a shared-write table names its
//!   consistency: *partitioned* (Serpens "release": split and merge, e.g. a port pool) or
//!   *replicated* (Serpens "eventual": merge by sum, e.g. counters).
//! - It runs only on SC, and only for a flow's first packet: it returns a [`Decision`]
//!   (verdict, rewrites for both directions, idle timeout). PP then applies the composed
//!   rule to every later packet without asking.
//! - Serpens' `update` and `trigger`: an NF asks (`NfEnv::trigger`, or its
//!   `NetworkFunction::trigger` condition) and the platform runs
//!   `NetworkFunction::update` after the op, in the group's order ([`Chain::run_triggers`]).
//! - State an NF keeps in platform-owned tables ([`StateTables`], S6 objects behind
//!   Serpens' `create_table`/`get`/`put`/`delete`) is snapshot, split, merged and
//!   expired by the platform from the tables' declarations; the NF writes none of it.
//! - Split, merge and timer hooks are what scaling and expiry call; state moves as
//!   opaque snapshots, so SC can ship it between groups (paper 000 §4.1, Fig. 3).
//! - A chain ([`ChainSpec`]) is a sequence of NFs with branches on a verdict label
//!   (Serpens `distribute`) that join again afterwards. [`Chain::decide`] runs the NFs in
//!   order on one flow and composes their rewrites into one action list per direction, so
//!   PP does one lookup and runs the chain to completion (Serpens §III-C).
//!
//! Determinism: an SC group replicates by passing each request through every replica
//! (chain replication), and each replica runs the NFs itself. NF code must therefore be a
//! function of (its state, the request): time comes from [`NfEnv::now_ms`] (stamped by the
//! group's head) and randomness from [`NfEnv::rng`] (seeded per request), never from
//! the host. See `docs/nf-api.md` for a worked example.

mod chain;
mod env;
pub mod flowmap;
mod index_alloc;
pub mod pool;
pub mod slabmap;
mod state;
mod types;

pub use chain::{
    Chain, ChainDecoder, ChainError, ChainSpec, ComposedRules, Egress, NfPath, PreparedChainPart,
};
pub use env::{DetRng, NfEnv, Trigger};
pub use slabmap::SlabMap;
pub use state::{MirrorWrite, RefsFn, StateError, StateTables, WHOLE_SHARE};
pub use types::{
    Access, Consistency, Decision, Endpoint, FirstPacket, FlowEvent, MergeDecoder, NetworkFunction,
    NfError, PartitionBy, PreparedPart, Rewrite, Scope, SplitHalf, SplitRule, TableSpec,
    TrafficCount, TrafficReport, Verdict,
};
