//! A per-host connection limiter: at most `limit` concurrent flows per source host (VNI
//! and address, as the flow entered the chain); a flow over the limit is dropped as
//! `connlimit-exceeded`. A slot comes back when PP reports FIN/RST or its rules' expiry,
//! or when nothing was heard of the flow for `idle_timeout_s`.
//!
//! Written on the public `nf` API alone, as a tenant would write it; `docs/nf-api.md`
//! ("Writing a new NF") builds it step by step. Its state is one platform table
//! ([`StateTables`]), so it writes no snapshot, split, merge or expiry code.
//!
//! It asks for its chain to be partitioned by source host (`partition_by`), so that FM
//! sends all of a host's flows to one partition and the limit holds globally. In a chain
//! partitioned by flow hash (an NF beside it keeps state of its own) the limit holds per
//! partition: after a scale-out a host's flows may be spread over two, each admitting up
//! to `limit`. Split and merge move flows with their slots, so no slot is lost or counted
//! twice.
use std::time::Duration;

use nf::TableSpec;
use nf::{
    Decision, FirstPacket, FlowEvent, NetworkFunction, NfEnv, NfError, PartitionBy, StateTables,
};
use pipeline::FlowKey;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnLimitConfig {
    /// Concurrent flows per host, at least 1.
    pub limit: u32,
    /// A flow nothing was heard of for this long gives its slot back; default 300.
    pub idle_timeout_s: Option<u64>,
}

/// A row per admitted flow, grouped by host; the row's timer is the idle deadline.
const FLOWS: &str = "flows";

/// A host: VNI and source address, so overlapping VPC address spaces stay apart.
fn host(k: &FlowKey) -> (u32, std::net::IpAddr) {
    (k.vni(), k.src())
}

pub struct ConnLimit {
    limit: usize,
    idle: Duration,
    state: StateTables,
}

impl ConnLimit {
    pub fn new(cfg: &ConnLimitConfig) -> Result<Self, NfError> {
        let idle = cfg.idle_timeout_s.unwrap_or(300);
        // At most 30 days: keeps ms deadlines far from overflow, catches ms-for-s mistakes.
        if cfg.limit == 0 || !(1..=2_592_000).contains(&idle) {
            let m = "connlimit: limit must be 1 or more, idle_timeout_s 1 to 2592000".to_string();
            return Err(NfError::Config(m));
        }
        let state = StateTables::create(&[TableSpec::per_flow(FLOWS)])?;
        let (limit, idle) = (cfg.limit as usize, Duration::from_secs(idle));
        Ok(ConnLimit { limit, idle, state })
    }

    /// Flows holding a slot of the source host of `k`.
    pub fn in_use(&self, k: &FlowKey) -> usize {
        self.state.count_group(FLOWS, &host(k)).unwrap_or(0)
    }
}

impl NetworkFunction for ConnLimit {
    fn kind(&self) -> &str {
        "connlimit"
    }

    fn tables(&self) -> Vec<TableSpec> {
        vec![TableSpec::per_flow(FLOWS)]
    }

    nf::platform_state!(self.state);

    /// The limit is per host: partitioned by source, a host's flows share one partition.
    fn partition_by(&self) -> PartitionBy {
        PartitionBy::SourceAddress
    }

    /// Keyed by `pkt.flow`, the key events carry, so it may follow a rewriting NF.
    fn first_packet(&mut self, pkt: &FirstPacket, env: &mut NfEnv) -> Result<Decision, NfError> {
        let deadline = env.now_ms.saturating_add(self.idle.as_millis() as u64);
        let mut pass = Decision::pass();
        pass.idle_timeout = Some(self.idle);
        // Asked again, in either direction (PP lost a rule): the flow keeps its slot.
        for k in [pkt.flow, pkt.flow.reversed()] {
            if self.state.set_timer(FLOWS, &k, deadline)? {
                return Ok(pass);
            }
        }
        if self.in_use(&pkt.flow) >= self.limit {
            let mut drop = Decision::drop("connlimit-exceeded");
            // PP holds the drop rule briefly: a retry is judged again soon after a slot frees.
            drop.idle_timeout = Some(Duration::from_secs(5));
            return Ok(drop);
        }
        self.state
            .put_flow_in(FLOWS, &pkt.flow, &host(&pkt.flow), &())?;
        self.state.set_timer(FLOWS, &pkt.flow, deadline)?;
        Ok(pass)
    }

    fn on_event(&mut self, ev: &FlowEvent, env: &mut NfEnv) {
        let deadline = env.now_ms.saturating_add(self.idle.as_millis() as u64);
        let (k, s) = (ev.key(), &mut self.state);
        match ev {
            FlowEvent::TcpClosing { .. } | FlowEvent::Expired { .. } => _ = s.delete_flow(FLOWS, k),
            FlowEvent::Active { .. } => _ = s.set_timer(FLOWS, k, deadline),
            _ => {}
        }
    }
}
