//! The NF state of one partition: flows, mappings, the port pool and address pairings,
//! all in platform-owned tables (`nf::StateTables`), and the indexes derived from them.
//!
//! The platform snapshots, splits, merges and replicates the tables from their
//! declarations (`SplitRule`s): the port pool halves its free ports, a mapping goes with
//! the flows that use it (copied, its share halved, when flows on both sides do), the
//! pairings are copied, the counters start a new part at zero. This module keeps only
//! what is derived, rebuilt by [`State::reindex`] whenever the platform moved rows.

use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::net::IpAddr;

use ::nf::{Endpoint, NfError, Rewrite, SlabMap, StateTables, WHOLE_SHARE};
use pipeline::FlowKey;
// hashbrown's default hasher (foldhash) rather than SipHash: splits and merges of a
// partition hash every flow key and endpoint several times (docs/scaling.md).
use hashbrown::{DefaultHashBuilder, HashMap};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use tracing::warn;

use super::config::Plan;
use super::snapshot::snap_err;
use crate::reply_index::ReplyIndex;
use ::nf::pool::PROBES;

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

/// A mapping as [`Snat::mappings`](crate::snat::Snat::mappings) shows it.
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
/// some other partition still translates through it. It is the platform's with-flows
/// share.
pub(super) const FULL_WEIGHT: u64 = WHOLE_SHARE;

/// The tables, by the names the NF declares.
pub(super) const FLOWS: &str = "flows";
pub(super) const MAPPINGS: &str = "mappings";
pub(super) const PORTS: &str = "port-pool";
pub(super) const PAIRINGS: &str = "address-pairing";
pub(super) const STATS: &str = "stats";
/// The other partitions' mappings (external → internal), the shadow of `mappings`
/// that the platform keeps (`StateTables::set_mirror_source`): what a hairpinned flow
/// reaches when the host it targets is translated by another partition (RFC 4787 REQ-9
/// across partitions; docs/nf-api.md).
pub(super) const MIRROR: &str = "mapping-mirror";

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

/// A flow as the NF works with it; its row (`FlowRow`) keeps only what the rewrites are
/// made from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct FlowEntry {
    /// The mapping the flow's source is translated to.
    pub(super) own: ExternalEndpoint,
    /// Hairpin flows: the mapping of the internal host they reach.
    pub(super) peer: Option<ExternalEndpoint>,
    pub(super) forward: Rewrite,
    pub(super) reverse: Rewrite,
    pub(super) state: FlowState,
    /// The row's platform timer, not stored in its value.
    pub(super) deadline_ms: u64,
}

/// A flow's row in the `flows` table: its mapping, a hairpin flow's peer mapping and
/// the internal endpoint behind it, and its TCP state. The rewrites follow from these
/// and the flow's key, so an IPv4 row fits inline in the platform's row (no allocation
/// per flow) and a read decodes a few bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct FlowRow {
    pub(super) own: ExternalEndpoint,
    pub(super) peer: Option<(ExternalEndpoint, IpAddr, u16)>,
    pub(super) state: FlowState,
}

impl FlowRow {
    pub(super) fn of(f: &FlowEntry) -> FlowRow {
        let peer = f.peer.map(|p| {
            let to = f.forward.dst;
            (p, to.addr.unwrap_or(p.addr), to.port.unwrap_or(p.port))
        });
        FlowRow {
            own: f.own,
            peer,
            state: f.state,
        }
    }

    /// The flow entry of `key`, its rewrites made again (`Snat::outbound`,
    /// `Snat::hairpin`).
    pub(super) fn entry(&self, key: &FlowKey, deadline_ms: u64) -> FlowEntry {
        let own = Endpoint::new(self.own.addr, self.own.port);
        let back = Endpoint::new(key.src(), key.sport());
        let (forward, reverse) = match self.peer {
            None => (
                Rewrite::src(self.own.addr, self.own.port),
                Rewrite::dst(key.src(), key.sport()),
            ),
            Some((target, addr, port)) => (
                Rewrite {
                    src: own,
                    dst: Endpoint::new(addr, port),
                },
                Rewrite {
                    src: Endpoint::new(target.addr, target.port),
                    dst: back,
                },
            ),
        };
        FlowEntry {
            own: self.own,
            peer: self.peer.map(|p| p.0),
            forward,
            reverse,
            state: self.state,
            deadline_ms,
        }
    }
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

/// The lanes of the `stats` counter table: the fields in declaration order, then the
/// probe histogram.
const STAT_LANES: usize = 18 + PROBES + 1;

impl SnatStats {
    fn fields(&mut self) -> [&mut u64; 18] {
        [
            &mut self.flows_created,
            &mut self.flows_expired,
            &mut self.flows_ended,
            &mut self.replayed,
            &mut self.mappings_created,
            &mut self.mappings_reused,
            &mut self.mappings_released,
            &mut self.ports_preserved,
            &mut self.pairing_fallbacks,
            &mut self.hairpinned,
            &mut self.untranslated,
            &mut self.exhausted,
            &mut self.refused_inbound,
            &mut self.icmp_error_unknown,
            &mut self.invalid,
            &mut self.unsupported_protocol,
            &mut self.random_probes,
            &mut self.merge_conflicts,
        ]
    }

    pub(super) fn lanes(&self) -> [u64; STAT_LANES] {
        let f = [
            self.flows_created,
            self.flows_expired,
            self.flows_ended,
            self.replayed,
            self.mappings_created,
            self.mappings_reused,
            self.mappings_released,
            self.ports_preserved,
            self.pairing_fallbacks,
            self.hairpinned,
            self.untranslated,
            self.exhausted,
            self.refused_inbound,
            self.icmp_error_unknown,
            self.invalid,
            self.unsupported_protocol,
            self.random_probes,
            self.merge_conflicts,
        ];
        let mut out = [0; STAT_LANES];
        out[..18].copy_from_slice(&f);
        out[18..].copy_from_slice(&self.probe_histogram);
        out
    }

    pub(super) fn from_lanes(l: &[u64]) -> SnatStats {
        let mut s = SnatStats::default();
        for (f, v) in s.fields().into_iter().zip(l) {
            *f = *v;
        }
        for (h, v) in s.probe_histogram.iter_mut().zip(l.iter().skip(18)) {
            *h = *v;
        }
        s
    }
}

/// Replies are looked up without their VNI: a chain that re-encapsulates changes it, and
/// the translated key is unique without it (it holds the flow's own external port).
pub(super) fn reply_key(translated: &FlowKey) -> FlowKey {
    let mut r = translated.reversed();
    r.set_vni(0);
    r
}

/// The mappings a flow row uses, for the platform's split ([`nf::RefsFn`]).
fn flow_refs(v: &[u8]) -> SmallVec<[Vec<u8>; 2]> {
    let Ok(f) = postcard::from_bytes::<FlowRow>(v) else {
        return SmallVec::new();
    };
    std::iter::once(f.own)
        .chain(f.peer.map(|p| p.0))
        .filter_map(|e| postcard::to_allocvec(&e).ok())
        .collect()
}

fn state_err(e: ::nf::StateError) -> NfError {
    NfError::State(format!("snat: {e}"))
}

/// All NF state of one partition: the platform's tables and what is derived from them.
#[derive(Debug, Clone)]
pub(super) struct State {
    pub(super) tables: StateTables,
    /// Derived: the flows of this part using each mapping, by the mapping's slot in
    /// the `mappings` table (`StateTables::slot`). A row keeps its slot for life, and
    /// slots are renumbered only by what calls [`State::reindex`] (restore, split,
    /// merge), so an array serves where a map keyed by the external endpoint cost each
    /// replica 32 bytes and a cold insert per mapping (a bench flow has a mapping of
    /// its own). Whether a mapping exists, and what it is for, is its row's.
    pub(super) flows_by_slot: Vec<u32>,
    /// Derived: internal endpoint → its mapping's slot.
    pub(super) by_internal: InternalIndex,
    /// Derived: each internal address's paired pool address, and its mappings here.
    pub(super) pairings: HashMap<(u32, IpAddr), (IpAddr, u32)>,
    /// Derived: reply key (VNI 0) → forward key, for the flows whose reply key does not
    /// lead back to them through their mapping ([`State::reply_to`]): hairpin flows,
    /// and any other whose derivation does not round-trip. Counted per external
    /// address (`ReplyIndex`).
    pub(super) by_reply: ReplyIndex,
    /// Derived: mappings per (external address, protocol), so that a key whose
    /// destination holds none is answered without probing `mappings`.
    pub(super) mapped: HashMap<(IpAddr, u8), u32>,
    /// Derived: free ports per (pool address, protocol), read for every new mapping's
    /// choice of address.
    pub(super) free: HashMap<(IpAddr, u8), u32>,
    /// What this op counted, not yet added to the `stats` table ([`State::flush`]).
    pub(super) stats: SnatStats,
}

impl State {
    /// The tables an NF with `plan` declares, every port free (`full`) or none.
    pub(super) fn new(plan: &Plan, full: bool) -> Result<Self, NfError> {
        let mut tables = StateTables::create(&plan.tables())?;
        tables
            .set_refs(MAPPINGS, FLOWS, flow_refs)
            .map_err(state_err)?;
        // Other partitions' mappings, for hairpinning across partitions; the platform
        // fills it from theirs, so this part's own are never held twice.
        tables
            .set_mirror_source(MIRROR, MAPPINGS)
            .map_err(state_err)?;
        for (addr, proto, lo, hi) in plan.port_rows() {
            tables
                .pool_define(PORTS, &(addr, proto), lo, hi, full)
                .map_err(state_err)?;
        }
        let mut st = State {
            tables,
            flows_by_slot: Vec::new(),
            by_internal: InternalIndex::default(),
            pairings: HashMap::new(),
            by_reply: ReplyIndex::new(),
            mapped: HashMap::new(),
            free: HashMap::new(),
            stats: SnatStats::default(),
        };
        st.reindex_view();
        Ok(st)
    }

    /// Write what this op counted to the `stats` table (S6's untethered add).
    pub(super) fn flush(&mut self) {
        if self.stats == SnatStats::default() {
            return;
        }
        if let Err(e) = self.tables.add(STATS, &(), &self.stats.lanes()) {
            warn!(%e, "snat: counters not recorded");
        }
        self.stats = SnatStats::default();
    }

    /// Every count: the `stats` table's and what this op counted so far.
    pub(super) fn totals(&self) -> SnatStats {
        let mut l = (self.tables.counter(STATS, &()).ok()).unwrap_or_default();
        l.resize(STAT_LANES, 0);
        for (a, b) in l.iter_mut().zip(self.stats.lanes()) {
            *a = a.saturating_add(b);
        }
        SnatStats::from_lanes(&l)
    }

    /// A flow's entry, by its forward key.
    pub(super) fn flow(&self, key: &FlowKey) -> Option<FlowEntry> {
        let (row, d) = self
            .tables
            .get_flow_timed::<FlowRow>(FLOWS, key)
            .ok()
            .flatten()?;
        Some(row.entry(key, d.unwrap_or(u64::MAX)))
    }

    /// The flow a key (either direction) belongs to, with its entry: one lookup for a
    /// forward key.
    pub(super) fn lookup(&self, key: &FlowKey) -> Option<(FlowKey, FlowEntry)> {
        if let Some(f) = self.flow(key) {
            return Some((*key, f));
        }
        let mut k = *key;
        k.set_vni(0);
        let fk = self.reply_to(&k)?;
        Some((fk, self.flow(&fk)?))
    }

    /// The forward key of the flow whose reply key (VNI 0) is `k`.
    ///
    /// A plain flow's reply goes to its own mapping's external endpoint, from the
    /// endpoint the flow was sent to; the mapping names the internal endpoint and VNI,
    /// so the forward key follows, and the flow's row confirms it. Nothing is indexed
    /// for it: an index of every flow's reply key cost each replica about 100 bytes and
    /// an insert per flow. The flows this does not find (hairpin flows, whose reply
    /// comes from the peer's internal endpoint) are indexed in `by_reply`.
    pub(super) fn reply_to(&self, k: &FlowKey) -> Option<FlowKey> {
        self.derived_reply_to(k)
            .or_else(|| self.by_reply.get(k).copied())
    }

    fn derived_reply_to(&self, k: &FlowKey) -> Option<FlowKey> {
        if !self.mapped.contains_key(&(k.dst(), k.proto())) {
            return None;
        }
        let own = ExternalEndpoint {
            addr: k.dst(),
            port: k.dport(),
            proto: k.proto(),
        };
        let m = self.mapping_key(&own)?;
        let fk = FlowKey::new(m.vni, k.proto(), m.addr, m.port, k.src(), k.sport());
        let (row, _) = (self.tables)
            .get_flow_timed::<FlowRow>(FLOWS, &fk)
            .ok()
            .flatten()?;
        (row.own == own && row.peer.is_none()).then_some(fk)
    }

    /// What the mapping of external endpoint `e` is for, from its row.
    pub(super) fn mapping_key(&self, e: &ExternalEndpoint) -> Option<MappingKey> {
        self.tables.get(MAPPINGS, e).ok().flatten()
    }

    /// Whether `e` is a mapping of this part.
    pub(super) fn has_mapping(&self, e: &ExternalEndpoint) -> bool {
        self.mapping_slot(e).is_some()
    }

    fn mapping_slot(&self, e: &ExternalEndpoint) -> Option<u32> {
        self.tables.slot(MAPPINGS, e).ok().flatten()
    }

    /// The flows of this part using mapping `e`; `None` if there is no such mapping.
    pub(super) fn flows_of(&self, e: &ExternalEndpoint) -> Option<u32> {
        let s = self.mapping_slot(e)?;
        Some(self.flows_by_slot.get(s as usize).copied().unwrap_or(0))
    }

    fn flows_of_mut(&mut self, e: &ExternalEndpoint) -> Option<&mut u32> {
        let s = self.mapping_slot(e)? as usize;
        Some(slot_count(&mut self.flows_by_slot, s))
    }

    /// The mapping made for internal endpoint `mk`, if any.
    pub(super) fn mapping_of(&self, mk: &MappingKey) -> Option<ExternalEndpoint> {
        self.by_internal.get(&self.tables, mk).map(|(_, e)| e)
    }

    /// Every mapping with its slot, in the table's key order.
    pub(super) fn mapping_rows(&self) -> Vec<(u32, ExternalEndpoint, MappingKey)> {
        let rows: Vec<(ExternalEndpoint, MappingKey)> =
            self.tables.rows(MAPPINGS).unwrap_or_default();
        rows.into_iter()
            .filter_map(|(e, mk)| Some((self.mapping_slot(&e)?, e, mk)))
            .collect()
    }

    /// Index `key`'s reply key if deriving it would not find the flow.
    fn index_reply(&mut self, key: FlowKey, f: &FlowEntry) {
        let rk = reply_key(&f.forward.apply(&key));
        if self.derived_reply_to(&rk) != Some(key) {
            self.by_reply.insert(rk, key);
        }
    }

    pub(super) fn flow_count(&self) -> usize {
        self.tables.len(FLOWS).unwrap_or(0)
    }

    pub(super) fn free_count(&self, addr: IpAddr, proto: u8) -> u32 {
        self.free.get(&(addr, proto)).copied().unwrap_or(0)
    }

    pub(super) fn is_free(&self, e: &ExternalEndpoint) -> bool {
        (self.tables.pool(PORTS, &(e.addr, e.proto)).ok().flatten())
            .is_some_and(|p| p.is_free(e.port))
    }

    pub(super) fn sole_owner(&self, e: &ExternalEndpoint) -> bool {
        self.tables.share(MAPPINGS, e).ok().flatten() == Some(WHOLE_SHARE)
    }

    /// The flow a key (either direction) belongs to.
    pub(super) fn resolve(&self, key: &FlowKey) -> Option<FlowKey> {
        if self.tables.timer(FLOWS, key).ok().flatten().is_some() {
            return Some(*key);
        }
        let mut k = *key;
        k.set_vni(0);
        self.reply_to(&k)
    }

    /// A port taken from the pool (`pool_alloc`), for the free-count index.
    pub(super) fn took(&mut self, addr: IpAddr, proto: u8) {
        if let Some(n) = self.free.get_mut(&(addr, proto)) {
            *n = n.saturating_sub(1);
        }
    }

    pub(super) fn insert_flow(&mut self, key: FlowKey, f: FlowEntry) -> Result<(), NfError> {
        (self.tables)
            .put_flow_timed(FLOWS, &key, &FlowRow::of(&f), f.deadline_ms)
            .map_err(state_err)?;
        self.index_reply(key, &f);
        for e in std::iter::once(f.own).chain(f.peer) {
            if let Some(n) = self.flows_of_mut(&e) {
                *n = n.saturating_add(1);
            }
        }
        Ok(())
    }

    /// A flow's row is gone (deleted, or expired by the platform's timer): drop its
    /// reply index and free ports whose last flow it was.
    pub(super) fn forget_flow(&mut self, key: &FlowKey, f: &FlowEntry) {
        let rk = reply_key(&f.forward.apply(key));
        if self.by_reply.get(&rk) == Some(key) {
            self.by_reply.remove(&rk);
        }
        self.release(&f.own);
        if let Some(p) = f.peer {
            self.release(&p);
        }
    }

    /// Remove a flow and its references; frees ports whose last flow it was.
    pub(super) fn remove_flow(&mut self, key: &FlowKey) -> Option<FlowEntry> {
        let f = self.flow(key)?;
        if !self.tables.delete_flow(FLOWS, key).unwrap_or(false) {
            return None;
        }
        self.forget_flow(key, &f);
        Some(f)
    }

    /// Move flow `key` (whose entry is `f`) to `state` and `deadline`.
    pub(super) fn set_flow_state(
        &mut self,
        key: &FlowKey,
        f: &FlowEntry,
        state: FlowState,
        deadline: u64,
    ) {
        if f.state != state {
            let row = FlowRow {
                state,
                ..FlowRow::of(f)
            };
            if let Err(e) = self.tables.put_flow_timed(FLOWS, key, &row, deadline) {
                warn!(%e, "snat: flow state not updated");
            }
        } else {
            self.set_deadline(key, deadline);
        }
    }

    pub(super) fn set_deadline(&mut self, key: &FlowKey, deadline: u64) {
        let _ = self.tables.set_timer(FLOWS, key, deadline);
    }

    pub(super) fn release(&mut self, ext: &ExternalEndpoint) {
        let Some(n) = self.flows_of_mut(ext) else {
            return;
        };
        *n = n.saturating_sub(1);
        if *n == 0 && self.sole_owner(ext) {
            self.free_mapping(ext);
        }
    }

    /// Record a new whole mapping.
    pub(super) fn add_mapping(
        &mut self,
        ext: ExternalEndpoint,
        mk: MappingKey,
        paired: IpAddr,
    ) -> Result<(), NfError> {
        let (slot, new) = (self.tables)
            .put_slot(MAPPINGS, &ext, &mk)
            .map_err(state_err)?;
        let pk = (mk.vni, mk.addr);
        if !self.pairings.contains_key(&pk) {
            self.tables.put(PAIRINGS, &pk, &paired).map_err(state_err)?;
        }
        *slot_count(&mut self.flows_by_slot, slot as usize) = 0;
        if new {
            *self.mapped.entry((ext.addr, ext.proto)).or_insert(0) += 1;
        }
        self.by_internal.insert(&self.tables, mk, slot);
        self.pairings.entry(pk).or_insert((paired, 0)).1 += 1;
        Ok(())
    }

    /// Drop a mapping and return its port to the pool.
    pub(super) fn free_mapping(&mut self, ext: &ExternalEndpoint) {
        let Some(slot) = self.mapping_slot(ext) else {
            return;
        };
        // What the mapping was for, read before the row goes.
        let key = (self
            .tables
            .at::<ExternalEndpoint, MappingKey>(MAPPINGS, slot))
        .ok()
        .flatten()
        .map(|(_, mk)| mk);
        *slot_count(&mut self.flows_by_slot, slot as usize) = 0;
        let end = (ext.addr, ext.proto);
        if let Some(n) = self.mapped.get_mut(&end) {
            *n -= 1;
            if *n == 0 {
                self.mapped.remove(&end);
            }
        }
        let _ = self.tables.delete(MAPPINGS, ext);
        if let Some(key) = key {
            self.by_internal.remove(&key, slot);
            let pk = (key.vni, key.addr);
            if let Some(p) = self.pairings.get_mut(&pk) {
                p.1 = p.1.saturating_sub(1);
                if p.1 == 0 {
                    self.pairings.remove(&pk);
                    let _ = self.tables.delete(PAIRINGS, &pk);
                }
            }
        } else {
            warn!(?ext, "snat: a mapping without its row");
        }
        if self
            .tables
            .pool_put(PORTS, &(ext.addr, ext.proto), ext.port)
            .unwrap_or(false)
        {
            *self.free.entry((ext.addr, ext.proto)).or_insert(0) += 1;
        } else {
            // A port outside the pool or already free means state was corrupted upstream;
            // keep going rather than take the NAT down, but say so.
            warn!(?ext, "snat: freed a port that was not in use");
        }
        self.stats.mappings_released += 1;
    }

    /// The derived indexes of the tables as they are, changing no row (a part decoded
    /// for a merge is looked at, not changed).
    pub(super) fn reindex_view(&mut self) {
        self.flows_by_slot.clear();
        self.mapped.clear();
        self.by_internal.clear();
        self.by_reply.clear();
        self.pairings.clear();
        let maps = self.mapping_rows();
        let top = maps.iter().map(|m| m.0 as usize + 1).max().unwrap_or(0);
        self.flows_by_slot.resize(top, 0);
        // Rows in key order: of two mappings of one internal endpoint (a merge brought
        // them together) the index prefers the first.
        for (s, e, mk) in &maps {
            *self.mapped.entry((e.addr, e.proto)).or_insert(0) += 1;
            self.by_internal.insert(&self.tables, *mk, *s);
        }
        self.free.clear();
        let pools: Vec<((IpAddr, u8), u32)> = (self.tables.pools(PORTS).unwrap_or_default())
            .into_iter()
            .map(|(k, p)| (k, p.free()))
            .collect();
        self.free.extend(pools);
        let rows: Vec<(FlowKey, FlowRow)> = self.tables.flows(FLOWS).unwrap_or_default();
        for (k, r) in &rows {
            let f = r.entry(k, 0);
            let rk = reply_key(&f.forward.apply(k));
            if self.derived_reply_to(&rk) != Some(*k) {
                self.by_reply.get_or_insert(rk, *k);
            }
            for e in std::iter::once(f.own).chain(f.peer) {
                if let Some(n) = self.flows_of_mut(&e) {
                    *n = n.saturating_add(1);
                }
            }
        }
        let pairs: Vec<((u32, IpAddr), IpAddr)> = self.tables.rows(PAIRINGS).unwrap_or_default();
        for (pk, ext) in pairs {
            self.pairings.insert(pk, (ext, 0));
        }
        for (_, _, mk) in &maps {
            if let Some(p) = self.pairings.get_mut(&(mk.vni, mk.addr)) {
                p.1 += 1;
            }
        }
        self.stats = SnatStats::default();
    }

    /// Rebuild everything derived from the tables, after the platform replaced or moved
    /// rows (restore, split, merge): the mapping and reply indexes, the flows per
    /// mapping, the pairings' counts. Pairings no mapping uses any more are dropped, and
    /// so are whole mappings no flow uses (copies a merge reunited): their port is free
    /// again. The same on every replica, as the ops are.
    pub(super) fn reindex(&mut self) {
        self.reindex_view();
        let unused: Vec<(u32, IpAddr)> = (self.pairings.iter())
            .filter(|(_, p)| p.1 == 0)
            .map(|(k, _)| *k)
            .collect();
        for pk in unused {
            self.pairings.remove(&pk);
            let _ = self.tables.delete(PAIRINGS, &pk);
        }
        let mut idle: Vec<ExternalEndpoint> = (self.mapping_rows().into_iter())
            .filter(|(s, e, _)| {
                self.flows_by_slot.get(*s as usize).is_none_or(|n| *n == 0) && self.sole_owner(e)
            })
            .map(|(_, e, _)| e)
            .collect();
        idle.sort();
        for e in idle {
            self.free_mapping(&e);
        }
        self.flush();
    }

    /// What the platform cannot see across tables, checked before a merge: a port
    /// mapped on one side is not free on the other.
    pub(super) fn check_merge(&self, other: &State) -> Result<(), NfError> {
        for (_, e, _) in &self.mapping_rows() {
            if other.is_free(e) {
                return Err(snap_err(format!(
                    "port {} of {} is free there and mapped here",
                    e.port, e.addr
                )));
            }
        }
        for (_, e, theirs) in &other.mapping_rows() {
            if self.is_free(e) {
                return Err(snap_err(format!("{e:?} is mapped there and free here")));
            }
            if let Some(mine) = self.mapping_key(e) {
                if mine != *theirs {
                    return Err(snap_err(format!(
                        "{e:?} is mapped for two internal endpoints"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Flows both this state and `other` hold: a merge keeps this side's.
    pub(super) fn conflicts(&self, other: &State) -> u64 {
        let theirs: Vec<(FlowKey, FlowRow)> = other.tables.flows(FLOWS).unwrap_or_default();
        theirs
            .iter()
            .filter(|(k, _)| self.tables.timer(FLOWS, k).ok().flatten().is_some())
            .count() as u64
    }
}

/// The count in slot `s`, the array grown to hold it.
fn slot_count(v: &mut Vec<u32>, s: usize) -> &mut u32 {
    if v.len() <= s {
        v.resize(s + 1, 0);
    }
    &mut v[s]
}

/// Internal endpoint → the slot of its mapping's row, the row being what a mapping is
/// for ([`MAPPINGS`]: external endpoint → [`MappingKey`]). Keyed by a 64-bit hash of the
/// key, and every hit checked against the row, where a `SlabMap<MappingKey,
/// ExternalEndpoint>` held a copy of both: 24 bytes a slot instead of 72, at each
/// replica, for every mapping. A key whose hash another key already holds (a 64-bit
/// collision: not expected in practice, but a NAT must not translate by one) is kept by
/// its key in `collided`.
#[derive(Debug, Clone, Default)]
pub(super) struct InternalIndex<S = DefaultHashBuilder> {
    hasher: S,
    by_hash: SlabMap<u64, u32>,
    collided: BTreeMap<MappingKey, u32>,
}

impl<S: BuildHasher> InternalIndex<S> {
    fn row(tables: &StateTables, slot: u32) -> Option<(ExternalEndpoint, MappingKey)> {
        tables.at(MAPPINGS, slot).ok().flatten()
    }

    /// `mk`'s mapping: its slot and external endpoint.
    pub(super) fn get(
        &self,
        tables: &StateTables,
        mk: &MappingKey,
    ) -> Option<(u32, ExternalEndpoint)> {
        if let Some(&s) = self.by_hash.get(&self.hasher.hash_one(mk)) {
            if let Some((e, k)) = Self::row(tables, s) {
                if k == *mk {
                    return Some((s, e));
                }
            }
        }
        if self.collided.is_empty() {
            return None;
        }
        let s = *self.collided.get(mk)?;
        Self::row(tables, s).map(|(e, _)| (s, e))
    }

    /// Index `mk`'s mapping at `slot`, unless `mk` already has one (the first stays).
    pub(super) fn insert(&mut self, tables: &StateTables, mk: MappingKey, slot: u32) {
        let h = self.hasher.hash_one(mk);
        match self.by_hash.entry(h) {
            ::nf::slabmap::Entry::Vacant(v) => {
                v.insert(slot);
            }
            ::nf::slabmap::Entry::Occupied(o) => {
                if Self::row(tables, *o.get()).is_none_or(|(_, k)| k != mk) {
                    self.collided.entry(mk).or_insert(slot);
                }
            }
        }
    }

    /// Drop `mk`'s entry if it names `slot` (a mapping being freed).
    pub(super) fn remove(&mut self, mk: &MappingKey, slot: u32) {
        let h = self.hasher.hash_one(mk);
        if self.by_hash.get(&h) == Some(&slot) {
            self.by_hash.remove(&h);
        } else if self.collided.get(mk) == Some(&slot) {
            self.collided.remove(mk);
        }
    }

    pub(super) fn clear(&mut self) {
        self.by_hash.clear();
        self.collided.clear();
    }
}

#[cfg(test)]
mod internal_index_tests {
    use super::*;
    use crate::snat::{Snat, SnatConfig, SnatPool};
    use std::hash::{BuildHasherDefault, Hasher};

    /// Every key hashes alike: each insert after the first is a collision.
    #[derive(Default)]
    struct Same;

    impl Hasher for Same {
        fn finish(&self) -> u64 {
            42
        }
        fn write(&mut self, _: &[u8]) {}
    }

    fn mk(port: u16) -> MappingKey {
        MappingKey {
            vni: 100,
            proto: 17,
            addr: "198.18.0.1".parse().expect("address"),
            port,
            remote: None,
        }
    }

    fn ext(port: u16) -> ExternalEndpoint {
        ExternalEndpoint {
            addr: "198.19.255.1".parse().expect("address"),
            port,
            proto: 17,
        }
    }

    #[test]
    fn colliding_internal_endpoints_each_find_their_own_mapping() {
        let pool = SnatPool::new(vec!["198.19.255.1".parse().expect("address")], 1024, 65535);
        let mut n = Snat::new(SnatConfig::new(vec![pool])).expect("config");
        let t = &mut n.state.tables;
        let mut slots = Vec::new();
        for p in 1..=4u16 {
            let (s, new) = t.put_slot(MAPPINGS, &ext(p), &mk(p)).expect("put");
            assert!(new);
            slots.push(s);
        }
        let t = &n.state.tables;
        let mut idx: InternalIndex<BuildHasherDefault<Same>> = InternalIndex::default();
        for p in 1..=3u16 {
            idx.insert(t, mk(p), slots[p as usize - 1]);
        }
        // A second mapping of an indexed key does not replace the first.
        idx.insert(t, mk(1), slots[1]);
        assert_eq!(idx.collided.len(), 2);
        for p in 1..=3u16 {
            assert_eq!(idx.get(t, &mk(p)), Some((slots[p as usize - 1], ext(p))));
        }
        assert_eq!(idx.get(t, &mk(4)), None, "not indexed");
        // Removal names the slot: a wrong one changes nothing.
        idx.remove(&mk(2), slots[2]);
        assert_eq!(idx.get(t, &mk(2)), Some((slots[1], ext(2))));
        // The key holding the hash goes; the collided ones are still found.
        idx.remove(&mk(1), slots[0]);
        assert_eq!(idx.get(t, &mk(1)), None);
        assert_eq!(idx.get(t, &mk(2)), Some((slots[1], ext(2))));
        assert_eq!(idx.get(t, &mk(3)), Some((slots[2], ext(3))));
        // The next key takes the free hash.
        idx.insert(t, mk(4), slots[3]);
        assert_eq!(idx.collided.len(), 2);
        assert_eq!(idx.get(t, &mk(4)), Some((slots[3], ext(4))));
        idx.remove(&mk(2), slots[1]);
        idx.remove(&mk(3), slots[2]);
        assert!(idx.collided.is_empty());
        assert_eq!(idx.get(t, &mk(4)), Some((slots[3], ext(4))));
    }

    #[test]
    fn flows_per_mapping_follow_the_mapping_rows_slots() {
        let pool = SnatPool::new(vec!["198.19.255.1".parse().expect("address")], 1024, 65535)
            .sources(&["198.18.0.0/16"]);
        let mut n = Snat::new(SnatConfig::new(vec![pool])).expect("config");
        let mut env = ::nf::NfEnv::new(0, 7);
        // Three flows from one internal endpoint share its mapping (endpoint-independent
        // mapping); one more endpoint has a mapping of its own.
        let mut keys = Vec::new();
        for (src, dst) in [(1000, 10), (1000, 11), (1000, 12), (2000, 10)] {
            let k: FlowKey = format!("100 udp 198.18.0.1:{src} > 198.19.0.{dst}:53")
                .parse()
                .expect("flow key");
            let p = ::nf::FirstPacket::new(k, 1, pipeline::PacketMeta::new(60, 0));
            ::nf::NetworkFunction::first_packet(&mut n, &p, &mut env).expect("decided");
            keys.push(k);
        }
        let counts = |n: &Snat| -> Vec<u32> { n.mappings().iter().map(|m| m.flows).collect() };
        let mut c = counts(&n);
        c.sort();
        assert_eq!(c, vec![1, 3]);
        // Rebuilt from the tables: the same counts.
        n.state.reindex_view();
        let mut c2 = counts(&n);
        c2.sort();
        assert_eq!(c2, c);
        // The lone endpoint's flow goes: its mapping and port go with it, and its slot
        // is free for the next mapping, which starts at no flows but its own.
        let before = n.free_port_count("198.19.255.1".parse().expect("address"), 17);
        ::nf::NetworkFunction::on_event(
            &mut n,
            &::nf::FlowEvent::Expired { key: keys[3] },
            &mut ::nf::NfEnv::new(1, 0),
        );
        assert_eq!(counts(&n), vec![3]);
        assert_eq!(
            n.free_port_count("198.19.255.1".parse().expect("address"), 17),
            before + 1
        );
        let k: FlowKey = "100 udp 198.18.0.2:3000 > 198.19.0.10:53"
            .parse()
            .expect("flow key");
        let p = ::nf::FirstPacket::new(k, 1, pipeline::PacketMeta::new(60, 0));
        ::nf::NetworkFunction::first_packet(&mut n, &p, &mut env).expect("decided");
        let mut c3 = counts(&n);
        c3.sort();
        assert_eq!(c3, vec![1, 3]);
        // Every mapping is found from its internal endpoint.
        for m in n.mappings() {
            assert_eq!(n.state.mapping_of(&m.key), Some(m.external));
        }
    }
}
