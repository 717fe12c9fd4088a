//! The NF state of one partition: mappings, pairings and flows, and how two parts merge.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ::nf::{NfError, Rewrite};
use pipeline::FlowKey;
// hashbrown's default hasher (foldhash) rather than SipHash: splits and merges of a
// partition hash every flow key and endpoint several times (docs/scaling.md).
use hashbrown::HashMap;
use serde::{Deserialize, Serialize};
use tracing::warn;

use super::config::Plan;
use super::ports::{PortPool, PROBES};
use super::snapshot::snap_err;

/// A translated endpoint: what the outside sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ExternalEndpoint {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: u8,
}

/// What a mapping is for: an internal endpoint, and under endpoint-dependent mapping the
/// remote endpoint too. The VNI keeps overlapping tenant VPCs apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MappingKey {
    pub vni: u32,
    pub proto: u8,
    pub addr: IpAddr,
    pub port: u16,
    pub remote: Option<(IpAddr, u16)>,
}

/// A mapping as [`Snat::mappings`] shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MappingInfo {
    pub key: MappingKey,
    pub external: ExternalEndpoint,
    /// Flows of this partition translating through it (hairpin flows count on both the
    /// mapping they leave by and the one they reach).
    pub flows: u32,
    /// This partition holds every copy of the mapping, so it frees the port when the last
    /// flow goes. A mapping shared with another partition by a split holds its port until
    /// the copies are merged.
    pub sole_owner: bool,
}

/// Every copy of a mapping together weighs this much; a split divides the weight. Only a
/// copy holding all of it may free the port, so a port never returns to a free set while
/// some other partition still translates through it.
pub(super) const FULL_WEIGHT: u64 = 1 << 62;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Mapping {
    pub(super) key: MappingKey,
    pub(super) flows: u32,
    pub(super) weight: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum FlowState {
    Udp,
    Icmp,
    /// Established (or picked up mid-stream): RFC 5382's established idle timeout.
    TcpOpen,
    TcpClosing,
    /// Opened by a SYN, the handshake not yet seen complete: the transitory timeout
    /// until PP reports `TcpEstablished` (RFC 5382 REQ-5, RFC 7857 §2.1).
    TcpSynSent,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct FlowEntry {
    /// The mapping the flow's source is translated to.
    pub(super) own: ExternalEndpoint,
    /// Hairpin flows: the mapping of the internal host they reach.
    pub(super) peer: Option<ExternalEndpoint>,
    pub(super) forward: Rewrite,
    pub(super) reverse: Rewrite,
    pub(super) state: FlowState,
    pub(super) deadline_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pairing {
    pub(super) external: IpAddr,
    /// Mappings of the internal address in this partition; the pairing goes with the last.
    pub(super) mappings: u32,
}

/// Counters of one partition; a merge sums them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SnatStats {
    pub flows_created: u64,
    /// Flows removed by the timer.
    pub flows_expired: u64,
    /// Flows removed because PP reported their rules gone.
    pub flows_ended: u64,
    /// Requests for flows already decided (PP and FM lost the rule): answered from state.
    pub replayed: u64,
    pub mappings_created: u64,
    /// New flows that joined an existing mapping (endpoint-independent mapping at work).
    pub mappings_reused: u64,
    pub mappings_released: u64,
    pub ports_preserved: u64,
    /// Mappings placed on another address because the paired one was out of ports.
    pub pairing_fallbacks: u64,
    pub hairpinned: u64,
    /// Flows passed untranslated: source served by no pool, or a pool address itself.
    pub untranslated: u64,
    /// Drops.
    pub exhausted: u64,
    pub refused_inbound: u64,
    pub icmp_error_unknown: u64,
    pub invalid: u64,
    pub unsupported_protocol: u64,
    /// Random probes made by the allocator, successful or not.
    pub random_probes: u64,
    /// Allocations by the number of failed random probes before success; the last slot
    /// counts allocations that needed the scan.
    pub probe_histogram: [u64; PROBES + 1],
    /// Flows two merged partitions both had; the incoming copy was dropped.
    pub merge_conflicts: u64,
}

impl SnatStats {
    pub(super) fn add(&mut self, o: &SnatStats) {
        let pairs = [
            (&mut self.flows_created, o.flows_created),
            (&mut self.flows_expired, o.flows_expired),
            (&mut self.flows_ended, o.flows_ended),
            (&mut self.replayed, o.replayed),
            (&mut self.mappings_created, o.mappings_created),
            (&mut self.mappings_reused, o.mappings_reused),
            (&mut self.mappings_released, o.mappings_released),
            (&mut self.ports_preserved, o.ports_preserved),
            (&mut self.pairing_fallbacks, o.pairing_fallbacks),
            (&mut self.hairpinned, o.hairpinned),
            (&mut self.untranslated, o.untranslated),
            (&mut self.exhausted, o.exhausted),
            (&mut self.refused_inbound, o.refused_inbound),
            (&mut self.icmp_error_unknown, o.icmp_error_unknown),
            (&mut self.invalid, o.invalid),
            (&mut self.unsupported_protocol, o.unsupported_protocol),
            (&mut self.random_probes, o.random_probes),
            (&mut self.merge_conflicts, o.merge_conflicts),
        ];
        for (a, b) in pairs {
            *a = a.saturating_add(b);
        }
        for (a, b) in self.probe_histogram.iter_mut().zip(o.probe_histogram) {
            *a = a.saturating_add(b);
        }
    }
}

/// Replies are looked up without their VNI: a chain that re-encapsulates changes it, and
/// the translated key is unique without it (it holds the flow's own external port).
pub(super) fn reply_key(translated: &FlowKey) -> FlowKey {
    let mut r = translated.reversed();
    r.set_vni(0);
    r
}

pub(super) fn timer_entry(deadline: u64, k: &FlowKey) -> (u64, [u8; 40]) {
    (deadline, *k.as_bytes())
}

/// All NF state of one partition.
#[derive(Debug, Clone)]
pub(super) struct State {
    pub(super) ports: PortPool,
    pub(super) mappings: HashMap<ExternalEndpoint, Mapping>,
    pub(super) by_internal: HashMap<MappingKey, ExternalEndpoint>,
    pub(super) pairings: HashMap<(u32, IpAddr), Pairing>,
    pub(super) flows: HashMap<FlowKey, FlowEntry>,
    pub(super) by_reply: HashMap<FlowKey, FlowKey>,
    pub(super) timers: BTreeSet<(u64, [u8; 40])>,
    pub(super) stats: SnatStats,
}

impl State {
    pub(super) fn new(ports: PortPool) -> Self {
        State {
            ports,
            mappings: HashMap::new(),
            by_internal: HashMap::new(),
            pairings: HashMap::new(),
            flows: HashMap::new(),
            by_reply: HashMap::new(),
            timers: BTreeSet::new(),
            stats: SnatStats::default(),
        }
    }

    /// The flow a key (either direction) belongs to.
    pub(super) fn resolve(&self, key: &FlowKey) -> Option<FlowKey> {
        if self.flows.contains_key(key) {
            return Some(*key);
        }
        let mut k = *key;
        k.set_vni(0);
        self.by_reply.get(&k).copied()
    }

    pub(super) fn insert_flow(&mut self, key: FlowKey, f: FlowEntry) {
        let translated = f.forward.apply(&key);
        self.by_reply.insert(reply_key(&translated), key);
        self.timers.insert(timer_entry(f.deadline_ms, &key));
        if let Some(m) = self.mappings.get_mut(&f.own) {
            m.flows = m.flows.saturating_add(1);
        }
        if let Some(p) = f.peer {
            if let Some(m) = self.mappings.get_mut(&p) {
                m.flows = m.flows.saturating_add(1);
            }
        }
        self.flows.insert(key, f);
    }

    /// Remove a flow and its references; frees ports whose last flow it was.
    pub(super) fn remove_flow(&mut self, key: &FlowKey) -> Option<FlowEntry> {
        let f = self.flows.remove(key)?;
        self.timers.remove(&timer_entry(f.deadline_ms, key));
        let rk = reply_key(&f.forward.apply(key));
        if self.by_reply.get(&rk) == Some(key) {
            self.by_reply.remove(&rk);
        }
        self.release(&f.own);
        if let Some(p) = f.peer {
            self.release(&p);
        }
        Some(f)
    }

    pub(super) fn set_deadline(&mut self, key: &FlowKey, deadline: u64) {
        if let Some(f) = self.flows.get_mut(key) {
            self.timers.remove(&timer_entry(f.deadline_ms, key));
            f.deadline_ms = deadline;
            self.timers.insert(timer_entry(deadline, key));
        }
    }

    pub(super) fn release(&mut self, ext: &ExternalEndpoint) {
        let Some(m) = self.mappings.get_mut(ext) else {
            return;
        };
        m.flows = m.flows.saturating_sub(1);
        if m.flows == 0 && m.weight >= FULL_WEIGHT {
            self.free_mapping(ext);
        }
    }

    /// Drop a mapping and return its port to the pool.
    pub(super) fn free_mapping(&mut self, ext: &ExternalEndpoint) {
        let Some(m) = self.mappings.remove(ext) else {
            return;
        };
        if self.by_internal.get(&m.key) == Some(ext) {
            self.by_internal.remove(&m.key);
        }
        let pk = (m.key.vni, m.key.addr);
        if let Some(p) = self.pairings.get_mut(&pk) {
            p.mappings = p.mappings.saturating_sub(1);
            if p.mappings == 0 {
                self.pairings.remove(&pk);
            }
        }
        if !self.ports.put(ext) {
            // A port outside the pool or already free means state was corrupted upstream;
            // keep going rather than take the NAT down, but say so.
            warn!(?ext, "snat: freed a port that was not in use");
        }
        self.stats.mappings_released += 1;
    }

    /// Rebuild pairing counts from the mappings (after bulk changes).
    pub(super) fn recount_pairings(&mut self) {
        for p in self.pairings.values_mut() {
            p.mappings = 0;
        }
        for m in self.mappings.values() {
            if let Some(p) = self.pairings.get_mut(&(m.key.vni, m.key.addr)) {
                p.mappings += 1;
            }
        }
        self.pairings.retain(|_, p| p.mappings > 0);
    }

    /// Rebuild the internal-endpoint index, preferring the lowest external endpoint when
    /// a merge brought two mappings of one internal endpoint together.
    pub(super) fn reindex_internal(&mut self) {
        let mut exts: Vec<&ExternalEndpoint> = self.mappings.keys().collect();
        exts.sort();
        self.by_internal.clear();
        for e in exts {
            if let Some(m) = self.mappings.get(e) {
                self.by_internal.entry(m.key).or_insert(*e);
            }
        }
    }
}

/// A part decoded for a merge: its state, with its flows taken out in key order (every
/// replica inserts them in the same order).
pub(super) struct SnatPart {
    pub(super) state: State,
    pub(super) flows: Vec<(FlowKey, FlowEntry)>,
}

impl SnatPart {
    pub(super) fn decode(plan: &Plan, bytes: &[u8]) -> Result<SnatPart, NfError> {
        let mut state = State::decode(plan, bytes)?;
        let mut flows: Vec<(FlowKey, FlowEntry)> = state.flows.drain().collect();
        flows.sort_by_key(|(k, _)| *k.as_bytes());
        state.by_reply.clear();
        state.timers.clear();
        Ok(SnatPart { state, flows })
    }
}

impl State {
    /// Whether `other` can be merged into this state (see `Snat::merge`).
    pub(super) fn check_merge(&self, other: &SnatPart) -> Result<(), NfError> {
        let st = self;
        // Word by word and mapping by mapping, not port by port: the free sets hold
        // tens of thousands of ports, and this runs on the request stream.
        for (&(addr, proto), set) in &other.state.ports.sets {
            let Some(mine) = st.ports.sets.get(&(addr, proto)) else {
                continue;
            };
            if (mine.lo, mine.hi) != (set.lo, set.hi) {
                return Err(snap_err(format!("port range of {addr} differs")));
            }
            for (i, (a, b)) in mine.bits.iter().zip(&set.bits).enumerate() {
                let both = a & b;
                if both != 0 {
                    let port = set.port_at(i * 64 + both.trailing_zeros() as usize);
                    return Err(snap_err(format!(
                        "port {port} of {addr} is free on both sides"
                    )));
                }
            }
        }
        for e in st.mappings.keys() {
            if other.state.ports.is_free(e) {
                return Err(snap_err(format!(
                    "port {} of {} is free there and mapped here",
                    e.port, e.addr
                )));
            }
        }
        for (e, m) in &other.state.mappings {
            if st.ports.is_free(e) {
                return Err(snap_err(format!("{e:?} is mapped there and free here")));
            }
            if let Some(mine) = st.mappings.get(e) {
                if mine.key != m.key {
                    return Err(snap_err(format!(
                        "{e:?} is mapped for two internal endpoints"
                    )));
                }
                if mine.weight.saturating_add(m.weight) > FULL_WEIGHT {
                    return Err(snap_err(format!("{e:?} merged more than once")));
                }
            }
        }
        Ok(())
    }

    /// Merge a part `check_merge` accepted.
    pub(super) fn apply_merge(&mut self, other: SnatPart) {
        let st = self;
        for (k, set) in other.state.ports.sets {
            if let Some(mine) = st.ports.sets.get_mut(&k) {
                for (a, b) in mine.bits.iter_mut().zip(&set.bits) {
                    *a |= b;
                }
                mine.free += set.free;
            }
        }
        let touched: Vec<ExternalEndpoint> = other.state.mappings.keys().copied().collect();
        for (e, m) in other.state.mappings {
            match st.mappings.get_mut(&e) {
                Some(mine) => {
                    mine.weight += m.weight;
                    mine.flows = mine.flows.saturating_add(m.flows);
                }
                None => {
                    st.mappings.insert(e, m);
                }
            }
        }
        for (k, f) in other.flows {
            if st.flows.contains_key(&k) {
                warn!(key = %k, "snat merge: flow decided on both sides, keeping ours");
                st.stats.merge_conflicts += 1;
                for e in std::iter::once(f.own).chain(f.peer) {
                    if let Some(m) = st.mappings.get_mut(&e) {
                        m.flows = m.flows.saturating_sub(1);
                    }
                }
                continue;
            }
            st.by_reply
                .entry(reply_key(&f.forward.apply(&k)))
                .or_insert(k);
            st.timers.insert(timer_entry(f.deadline_ms, &k));
            st.flows.insert(k, f);
        }
        for (pk, p) in other.state.pairings {
            st.pairings.entry(pk).or_insert(Pairing {
                external: p.external,
                mappings: 0,
            });
        }
        st.stats.add(&other.state.stats);
        st.recount_pairings();
        st.reindex_internal();
        // Copies reunited into a whole with no flows left: their port is free again.
        for e in touched {
            if st
                .mappings
                .get(&e)
                .is_some_and(|m| m.flows == 0 && m.weight >= FULL_WEIGHT)
            {
                st.free_mapping(&e);
            }
        }
    }
}
