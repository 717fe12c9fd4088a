//! A per-host connection limiter: at most `limit` concurrent flows per source host (VNI
//! and address, as the flow entered the chain); a flow over the limit is dropped as
//! `connlimit-exceeded`. A slot comes back when PP reports FIN/RST or its rules' expiry,
//! or when nothing was heard of the flow for `idle_timeout_s`.
//!
//! Written on the public `nf` API alone, as a tenant would write it; `docs/nf-api.md`
//! ("Writing a new NF") builds it step by step.
//!
//! The limit holds per partition: FM dispatches by flow hash, so after a scale-out one
//! host's flows may be spread over two partitions, each admitting up to `limit`. Split and
//! merge move flows with their slots, so no slot is lost or counted twice.
use std::collections::BTreeMap;
use std::time::Duration;

use nf::{Decision, FirstPacket, FlowEvent, NetworkFunction, NfEnv, NfError, SplitHalf, TableSpec};
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

/// The one table, per-flow: (VNI, source host, flow key as text) → deadline (ms). Sorted
/// by host first, so a host's flows are one range; a BTreeMap, so every replica iterates
/// alike and serialises identical bytes.
type Flows = BTreeMap<Entry, u64>;
type Entry = (u32, std::net::IpAddr, String);

fn entry(k: &FlowKey) -> Entry {
    (k.vni(), k.src(), k.to_string())
}

fn snap_err(e: postcard::Error) -> NfError {
    NfError::Snapshot(format!("connlimit: {e}"))
}

pub struct ConnLimit {
    limit: usize,
    idle: Duration,
    flows: Flows,
}

impl ConnLimit {
    pub fn new(cfg: &ConnLimitConfig) -> Result<Self, NfError> {
        let idle = cfg.idle_timeout_s.unwrap_or(300);
        // At most 30 days: keeps ms deadlines far from overflow, catches ms-for-s mistakes.
        if cfg.limit == 0 || !(1..=2_592_000).contains(&idle) {
            let m = "connlimit: limit must be 1 or more, idle_timeout_s 1 to 2592000".to_string();
            return Err(NfError::Config(m));
        }
        let (limit, idle, flows) = (cfg.limit as usize, Duration::from_secs(idle), Flows::new());
        Ok(ConnLimit { limit, idle, flows })
    }

    /// Flows holding a slot of the source host of `k`.
    pub fn in_use(&self, k: &FlowKey) -> usize {
        let host = (k.vni(), k.src());
        let from_host = self.flows.range((host.0, host.1, String::new())..);
        from_host.take_while(|(e, _)| (e.0, e.1) == host).count()
    }
}

impl NetworkFunction for ConnLimit {
    fn kind(&self) -> &str {
        "connlimit"
    }

    fn tables(&self) -> Vec<TableSpec> {
        vec![TableSpec::per_flow("flows")]
    }

    /// Keyed by `pkt.flow`, the key events carry, so it may follow a rewriting NF.
    fn first_packet(&mut self, pkt: &FirstPacket, env: &mut NfEnv) -> Result<Decision, NfError> {
        let deadline = env.now_ms.saturating_add(self.idle.as_millis() as u64);
        let mut pass = Decision::pass();
        pass.idle_timeout = Some(self.idle);
        // Asked again, in either direction (PP lost a rule): the flow keeps its slot.
        let again = [pkt.flow, pkt.flow.reversed()].map(|k| entry(&k));
        if let Some(e) = again.into_iter().find(|e| self.flows.contains_key(e)) {
            self.flows.insert(e, deadline);
            return Ok(pass);
        }
        if self.in_use(&pkt.flow) >= self.limit {
            let mut drop = Decision::drop("connlimit-exceeded");
            // PP holds the drop rule briefly: a retry is judged again soon after a slot frees.
            drop.idle_timeout = Some(Duration::from_secs(5));
            return Ok(drop);
        }
        self.flows.insert(entry(&pkt.flow), deadline);
        Ok(pass)
    }

    fn on_event(&mut self, ev: &FlowEvent, env: &mut NfEnv) {
        let deadline = env.now_ms.saturating_add(self.idle.as_millis() as u64);
        let e = entry(ev.key());
        match ev {
            FlowEvent::TcpClosing { .. } | FlowEvent::Expired { .. } => _ = self.flows.remove(&e),
            FlowEvent::Active { .. } => _ = self.flows.get_mut(&e).map(|d| *d = deadline),
            _ => {}
        }
    }

    fn on_timer(&mut self, env: &mut NfEnv) -> Vec<FlowKey> {
        let due = self.flows.iter().filter(|(_, d)| **d <= env.now_ms);
        let gone = due.filter_map(|((_, _, f), _)| f.parse().ok()).collect();
        self.flows.retain(|_, d| *d > env.now_ms);
        gone
    }

    fn snapshot(&self) -> Result<Vec<u8>, NfError> {
        postcard::to_allocvec(&self.flows).map_err(snap_err)
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), NfError> {
        self.flows = postcard::from_bytes(snapshot).map_err(snap_err)?;
        Ok(())
    }

    /// Moved flows take their slots along.
    fn split(&mut self, half: &SplitHalf) -> Result<Vec<u8>, NfError> {
        let moves =
            |((_, _, f), _): &(Entry, u64)| f.parse::<FlowKey>().is_ok_and(|k| half.moves(&k));
        let (part, keep): (Flows, Flows) =
            std::mem::take(&mut self.flows).into_iter().partition(moves);
        self.flows = keep;
        postcard::to_allocvec(&part).map_err(snap_err)
    }

    /// Parts hold disjoint flows, so the union is the merge. A host may then hold more
    /// than `limit` flows; it gets no new one until it is under again.
    fn merge(&mut self, part: &[u8]) -> Result<(), NfError> {
        let part: Flows = postcard::from_bytes(part).map_err(snap_err)?;
        self.flows.extend(part);
        Ok(())
    }
}
