//! PP's NF-independent packet pipeline: parse → match → action.
//!
//! A PP worker owns a [`FlowTable`] of exact-match rules keyed by [`FlowKey`] (VNI +
//! 5-tuple). A hit runs the rule's composed action list (rewrite, decap/encap VXLAN,
//! count, police, drop, output) with incremental checksums; a miss holds the packet in a
//! bounded [`PendingQueue`] and sends a [`RuleRequest`] toward the fabric master. PP holds
//! rules only, never NF state (paper 000 §3.2, §4.2).
//!
//! Workers process batches of descriptors from a [`PacketIo`] backend; the in-memory
//! [`MemRing`] serves tests and benchmarks, and the PP node adds socket, AF_XDP and XDP
//! backends behind the same trait.

mod arena;
pub mod golden;
mod io;
mod key;
mod pending;
mod pipeline;
mod rule;
mod stats;
mod table;
pub mod trace;

pub use io::{
    Desc, FrameSource, IoError, MemRing, MemSink, PacketIo, VecSource, Verdict, FRAME_SIZE,
    HEADROOM, MAX_FRAME,
};
pub use key::{flow_hash, flow_hash_with, vxlan_source_port, FlowKey, KeyError};
pub use pending::{Held, PendingConfig, PendingQueue};
pub use pipeline::{
    report_budget, Clock, Companions, CounterReport, CounterReportConfig, DecidedBy,
    ElephantPolicy, FlowNotice, ManualClock, MonotonicClock, NoticeConfig, NoticeKind, PacketMeta,
    Pipeline, PipelineConfig, Policer, RuleReply, RuleRequest, RuleSource, VpcBinding, Worker,
    MAX_BATCH, REPORT_SPREAD, REPORT_STEPS,
};
pub use rule::{
    format_actions, parse_actions, parse_endpoint, Action, Actions, Nexthop, NodeAddr, Rule,
    RuleContext, RuleCounters, RuleError, RuleSlot,
};
pub use stats::{DropReason, LatencyHistogram, Stats, TenantCounters, LATENCY_BOUNDS_US};
pub use table::{
    age, ElephantWindow, EvictReason, FlowEntry, FlowTable, Inserted, OffloadEvent, TableError,
    TableStats, MAX_CAPACITY,
};
pub use trace::{
    Expr, FilterError, Lookup, TraceCounters, TraceDecision, TraceFilter, TracePacket, TraceRecord,
    Tracer, DEFAULT_SNAPLEN,
};
