//! FM (fabric master): the only peer of PP and SC nodes (paper 000 §3.2, §5.1).
//!
//! - PP nodes open a `PpSession` stream and send batches of rule requests. FM answers
//!   from its [`RuleCache`] when it can, and otherwise dispatches each request by the
//!   [`PartitionMap`] — (tenant, chain, hash(key) range) → SC group — to the group's
//!   head, one batch per group; the group's tail sends the result back, and FM returns
//!   the forward rule (with the reverse rule as a companion) to the PP node that asked.
//! - SC nodes open an `ScSession` stream: registration, heartbeats and tail results
//!   up; group configurations and submits down.
//! - [`Membership`] keeps both kinds of node and detects failures (heartbeats every
//!   50 ms, dead after 3 silent periods or at once when the stream breaks); FM then
//!   repairs the SC groups (see `master`).
//!
//! - [`EventLog`] records what FM did and why (scales, deaths, repairs, and the
//!   autoscaler's decisions it is sent), for `starfabric events`.
//!
//! Configuration (tenant chains, group size, cache) comes from [`FmFile`] JSON for now;
//! the orchestrator will push it.

pub mod cache;
pub mod events;
pub mod fabric;
pub mod liveness;
mod master;
pub mod membership;
pub mod metrics;
pub mod node;
pub mod partition;
mod service;
pub mod vip;

use std::time::Duration;

pub use cache::{CacheKey, CacheStats, RuleCache};
pub use events::{Event, EventKind, EventLog};
pub use master::{
    DesiredChange, FmConfig, FmMetrics, FmStats, Migration, ScaleOutcome, ScaleRequest,
};
pub use membership::Membership;
pub use partition::PartitionMap;
#[cfg(feature = "fuzzing")]
pub use service::fuzzing;
pub use service::{start, DownFullCounters, DownStream, FmHandle, FmObserver, FmWireCounters};

use proto::ChainDef;
use serde::{Deserialize, Serialize};
use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FmError {
    #[error("configuration: {0}")]
    Config(String),
    #[error("i/o: {0}")]
    Io(String),
    /// A scale-out or scale-in FM refused to start (see the message).
    #[error("scale: {0}")]
    Scale(String),
    #[error("fabric master stopped")]
    Stopped,
}

/// The FM configuration file (JSON).
///
/// ```json
/// { "replicas": 3, "heartbeat_ms": 50, "miss_limit": 3, "sc_miss_limit": 10,
///   "cache_capacity": 1000000, "cache_default_ttl_ms": 300000,
///   "chains": [ { "tenant": 1, "chain": 1,
///                 "nfs": [ {"kind": "fw", ...}, {"kind": "snat", ...} ],
///                 "forward": {"decap": true, "encap": {"dst": "198.18.0.9", "vni": 200}},
///                 "reverse": {"decap": true, "encap": {"dst": "198.18.0.50", "vni": 100}} } ] }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FmFile {
    #[serde(default = "d_replicas")]
    pub replicas: usize,
    #[serde(default = "d_heartbeat")]
    pub heartbeat_ms: u64,
    #[serde(default = "d_miss")]
    pub miss_limit: u32,
    #[serde(default = "d_sc_miss")]
    pub sc_miss_limit: u32,
    #[serde(default = "d_cache")]
    pub cache_capacity: usize,
    #[serde(default = "d_ttl")]
    pub cache_default_ttl_ms: u64,
    #[serde(default = "d_retry")]
    pub retry_after_ms: u64,
    #[serde(default)]
    pub chains: Vec<ChainDef>,
    /// Heartbeat period of PP nodes (ms); they are dead after `miss_limit` of them.
    #[serde(default = "d_pp_heartbeat")]
    pub pp_heartbeat_ms: u64,
    /// The PP cluster's vIP group: `[{"ip": "198.18.1.100", "mac": "02:5f:76:00:00:00"}]`.
    #[serde(default)]
    pub vips: Vec<VipFile>,
    /// Chains split over the PP fabric (docs/fabric.md): `[{"tenant": 1, "chain": 1,
    /// "nodes": ["pp-1", "pp-2"]}]`, the PP nodes that serve each chain's egress stage.
    #[serde(default)]
    pub fabric: Vec<fabric::FabricStage>,
}

/// One vIP-vMAC pair of [`FmFile::vips`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VipFile {
    pub ip: std::net::Ipv4Addr,
    pub mac: String,
}

fn d_pp_heartbeat() -> u64 {
    10
}

fn d_replicas() -> usize {
    3
}
fn d_heartbeat() -> u64 {
    50
}
fn d_miss() -> u32 {
    3
}
fn d_sc_miss() -> u32 {
    10
}
fn d_cache() -> usize {
    1 << 20
}
fn d_ttl() -> u64 {
    300_000
}
fn d_retry() -> u64 {
    250
}

impl FmFile {
    pub fn parse(text: &str) -> Result<Self, FmError> {
        serde_json::from_str(text).map_err(|e| FmError::Config(e.to_string()))
    }

    pub fn to_config(&self, fm_id: &str) -> Result<FmConfig, FmError> {
        if self.replicas == 0 {
            return Err(FmError::Config("replicas must be at least 1".into()));
        }
        if self.heartbeat_ms == 0
            || self.pp_heartbeat_ms == 0
            || self.miss_limit == 0
            || self.sc_miss_limit == 0
        {
            return Err(FmError::Config(
                "heartbeat_ms, pp_heartbeat_ms, miss_limit and sc_miss_limit must be positive"
                    .into(),
            ));
        }
        let mut vips = Vec::new();
        for v in &self.vips {
            let mac = vip::parse_mac(&v.mac)
                .ok_or_else(|| FmError::Config(format!("vIP {}: bad MAC {:?}", v.ip, v.mac)))?;
            if mac[0] & 1 != 0 {
                return Err(FmError::Config(format!(
                    "vIP {}: {} is a multicast MAC",
                    v.ip, v.mac
                )));
            }
            if vips
                .iter()
                .any(|d: &vip::VipDef| d.ip == v.ip || d.mac == mac)
            {
                return Err(FmError::Config(format!(
                    "vIP {} or its MAC listed twice",
                    v.ip
                )));
            }
            vips.push(vip::VipDef { ip: v.ip, mac });
        }
        for (i, f) in self.fabric.iter().enumerate() {
            if f.nodes.is_empty() {
                return Err(FmError::Config(format!(
                    "fabric stage of tenant {} chain {}: no PP node",
                    f.tenant, f.chain
                )));
            }
            if self.fabric[..i]
                .iter()
                .any(|g| (g.tenant, g.chain) == (f.tenant, f.chain))
            {
                return Err(FmError::Config(format!(
                    "fabric stage of tenant {} chain {} listed twice",
                    f.tenant, f.chain
                )));
            }
        }
        Ok(FmConfig {
            fm_id: fm_id.to_string(),
            heartbeat: Duration::from_millis(self.heartbeat_ms),
            miss_limit: self.miss_limit,
            sc_miss_limit: self.sc_miss_limit,
            replicas: self.replicas,
            cache_capacity: self.cache_capacity,
            cache_default_ttl: Duration::from_millis(self.cache_default_ttl_ms),
            retry_after: Duration::from_millis(self.retry_after_ms),
            chains: self.chains.clone(),
            vips,
            pp_heartbeat: Duration::from_millis(self.pp_heartbeat_ms),
            fabric: self.fabric.clone(),
            ..FmConfig::default()
        })
    }
}
