//! Platform-owned NF state: S6's state objects (paper 001, "NF State Abstraction") behind
//! Serpens' table calls (paper 004, Fig. 8: `create_table`, `get`, `put`, `delete`,
//! `timer`).
//!
//! An NF that keeps its state in a [`StateTables`] writes no snapshot, split or merge
//! code: the trait's defaults (`NetworkFunction::snapshot` and the rest) run the ones
//! here, so the platform decides how each table survives a scale, from the table's
//! declaration alone:
//!
//! | Table | Written by | Split (Fig. 3 `st`) | Merge |
//! |---|---|---|---|
//! | per-flow | the flow's owner only | a row moves with its flow (`SplitHalf`) | union; of a flow in both parts, the row with the later timer |
//! | shared, partitioned (S6 single writer) | this part only | a row moves by its key's hash | union; one key in both parts is an error |
//! | shared, replicated (S6 multi writer) | every part, by `add` only | the new part starts from zero | lane-wise sum |
//! | shared, read | [`StateTables::load`] at setup | both keep it | this part's copy stays |
//!
//! S6's two relaxations of the multi-writer object are here as it names them:
//! - **Non-blocking update** (`inc(x) untether`): [`StateTables::add`] records a delta
//!   aside and returns; the platform folds deltas into the table at its timer
//!   ([`StateTables::fold`]) and before every snapshot, so replicas that applied the same
//!   ops serialise the same bytes whenever they folded.
//! - **Bounded-staleness read** (`get() const stale`): [`StateTables::counter_stale`]
//!   answers from the folded copy when it is at most `max_stale_ms` old, and folds first
//!   otherwise. [`StateTables::counter`] is the fresh read.
//!
//! Writing the wrong way is a typed [`StateError`], and the state stays as it was: a
//! table the NF never declared, a `put` to a replicated table (counters are only added
//! to), an `add` to a single-writer table, a flow call on a shared table. Tables can be
//! bounded ([`StateTables::set_capacity`]); a full per-flow or partitioned table refuses
//! a new key, a full counter table counts a new key under its spill key if it has one.
//!
//! Why not a store crate (redb, sled): these tables are in-memory, replicated by the SC
//! group's op log (every replica runs the same ops), and must serialise byte-identically
//! across replicas; ordered maps and postcard give that directly.

use std::collections::BTreeMap;

// hashbrown with its default hasher (foldhash) rather than SipHash, as the NFs' own maps
// were: per-flow rows are probed for every first packet, at every replica.
use crate::flowmap::{self, FlowMap};
use crate::slabmap::SlabMap;
use smallvec::SmallVec;

use pipeline::FlowKey;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use std::num::NonZeroU64;
use std::sync::Arc;

use crate::pool::{Alloc, PoolWire, UnitSet};
use crate::types::{
    Access, Consistency, MergeDecoder, NfError, PartitionBy, PreparedPart, Scope, SplitHalf,
    SplitRule, TableSpec,
};
use crate::DetRng;

/// The share a with-flows row holds when it is the only copy ([`SplitRule::WithFlows`]).
/// A split halves it between the copies; only a copy holding all of it is the last one.
pub const WHOLE_SHARE: u64 = 1 << 62;

/// Which rows of a with-flows table a flow's row refers to: given the flow row's value
/// (postcard), the keys (postcard) of the rows it uses. A plain function, so the tables
/// stay `Clone` and `Debug` and every replica runs the same code.
pub type RefsFn = fn(&[u8]) -> SmallVec<[Vec<u8>; 2]>;

/// What an NF did wrong with its tables, or what a table could not take.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StateError {
    #[error("table {table} was never declared")]
    NoSuchTable { table: String },
    #[error("table {table} is declared twice")]
    Duplicate { table: String },
    #[error("table {table} is {kind}: {op} does not apply")]
    WrongKind {
        table: String,
        kind: &'static str,
        op: &'static str,
    },
    #[error("table {table} is single-writer: multi-writer add is refused")]
    MultiWriterWrite { table: String },
    #[error("table {table} is multi-writer: only add may change it")]
    SingleWriterWrite { table: String },
    #[error("table {table} is read-only: it is loaded at setup")]
    ReadOnly { table: String },
    #[error("table {table} is full ({max_rows} rows)")]
    Full { table: String, max_rows: usize },
    #[error("table {table}: counter has {got} lanes, the table has {want}")]
    Lanes {
        table: String,
        got: usize,
        want: usize,
    },
    #[error("table {table}: {err}")]
    Value { table: String, err: String },
}

impl From<StateError> for NfError {
    fn from(e: StateError) -> Self {
        NfError::State(e.to_string())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum Kind {
    PerFlow,
    Partitioned,
    Replicated,
    Read,
    // Appended, so that parts of older builds keep their kinds' numbers.
    Pool,
    WithFlows,
    Copy,
    Mirror,
}

impl Kind {
    fn of(spec: &TableSpec) -> Kind {
        match spec.split {
            SplitRule::ByKey => {}
            SplitRule::Pool => return Kind::Pool,
            SplitRule::WithFlows => return Kind::WithFlows,
            SplitRule::Copy => return Kind::Copy,
            SplitRule::Mirror => return Kind::Mirror,
        }
        match (spec.scope, spec.access, spec.consistency) {
            (Scope::PerFlow, _, _) => Kind::PerFlow,
            (Scope::Shared, Access::Read, _) => Kind::Read,
            (Scope::Shared, Access::Write, Some(Consistency::Replicated)) => Kind::Replicated,
            (Scope::Shared, Access::Write, _) => Kind::Partitioned,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::PerFlow => "per-flow",
            Kind::Partitioned => "shared single-writer (partitioned)",
            Kind::Replicated => "shared multi-writer (replicated)",
            Kind::Read => "shared read-only",
            Kind::Pool => "a pool of free units (partitioned)",
            Kind::WithFlows => "rows that go with their flows (partitioned)",
            Kind::Copy => "shared single-writer, copied to both parts",
            Kind::Mirror => "a read copy of every partition's rows (mirrored)",
        }
    }

    /// Single-writer shared tables of key → value rows.
    const KEYED: &'static [Kind] = &[Kind::Partitioned, Kind::WithFlows, Kind::Copy, Kind::Mirror];
}

/// A row's value in postcard form. Inline up to 16 bytes, which holds a conntrack
/// entry or a backend: a row then costs no allocation and its read no pointer chase,
/// and a per-flow table stays close to the size of the NFs' own maps it replaced. 24
/// bytes in all: the workspace builds smallvec with `union`, which drops the enum tag
/// that would make it 32.
type Value = SmallVec<[u8; 16]>;

/// An optional time in ms in 8 bytes, where `Option<u64>` takes 16: a per-flow table
/// holds a row per flow at every replica, and its rows' size is what a table doubling
/// moves and faults in (docs/setup-path.md). Kept as the time plus one in a
/// `NonZeroU64`, whose zero is then free for the slab's empty slot: `Option<(key,
/// Row)>` takes no tag of its own, 8 bytes less for every row of every table.
/// `u64::MAX` is none; a time of `u64::MAX - 1` or later (584 million years on) is kept
/// as `u64::MAX - 2`, which never fires either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OptMs(NonZeroU64);

impl OptMs {
    const NONE: OptMs = OptMs(NonZeroU64::MAX);
    /// The latest time kept.
    const LAST: u64 = u64::MAX - 2;

    fn new(t: Option<u64>) -> OptMs {
        match t {
            Some(t) => OptMs(NonZeroU64::MIN.saturating_add(t.min(OptMs::LAST))),
            None => OptMs::NONE,
        }
    }

    fn some(t: u64) -> OptMs {
        OptMs::new(Some(t))
    }

    fn get(self) -> Option<u64> {
        (self != OptMs::NONE).then_some(self.0.get() - 1)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Row {
    value: Value,
    /// Serpens `timer(table, key, timeout)`: the row is removed at this time (per-flow).
    deadline_ms: OptMs,
    /// When the row's live entry in the timer queue fires (at or before `deadline_ms`);
    /// an index detail, not carried in snapshots, rebuilt on restore and merge.
    scheduled: OptMs,
}

impl Row {
    /// A shared table's row: a value, no timer.
    fn keyed(value: Value) -> Row {
        Row {
            value,
            deadline_ms: OptMs::NONE,
            scheduled: OptMs::NONE,
        }
    }
}

/// A row as snapshots and parts carry it.
#[derive(Serialize, Deserialize)]
struct WireRow {
    value: Vec<u8>,
    deadline_ms: Option<u64>,
    group: Option<Vec<u8>>,
    /// A with-flows row's share when it is less than whole.
    share: Option<u64>,
}

/// A row as `SFT1` parts carried it, before with-flows shares.
#[derive(Serialize, Deserialize)]
struct WireRowV1 {
    value: Vec<u8>,
    deadline_ms: Option<u64>,
    group: Option<Vec<u8>>,
}

/// The row; a per-flow row's group is the table's to keep (`Table::flow_groups`).
impl From<WireRow> for Row {
    fn from(w: WireRow) -> Row {
        Row {
            value: Value::from_slice(&w.value),
            deadline_ms: OptMs::new(w.deadline_ms),
            scheduled: OptMs::NONE,
        }
    }
}

/// A row without a group ([`wire_flow_row`] adds a per-flow row's).
impl From<Row> for WireRow {
    fn from(r: Row) -> WireRow {
        wire_flow_row(r, None)
    }
}

fn wire_flow_row(r: Row, group: Option<&[u8]>) -> WireRow {
    WireRow {
        value: r.value.to_vec(),
        deadline_ms: r.deadline_ms.get(),
        group: group.map(<[u8]>::to_vec),
        share: None,
    }
}

#[derive(Debug, Clone, Default)]
struct Table {
    kind: Option<Kind>,
    /// Per-flow tables. A hash map whose growth never stalls ([`SlabMap`]): it is
    /// probed for every first packet at every replica, and holds a row per flow.
    /// Nothing iterates it where order could reach a decision or a snapshot's bytes;
    /// those paths sort.
    flows: FlowMap<Row>,
    /// Partitioned, with-flows, copied and read tables. A hash map, probed for every
    /// mapping an NF makes or frees; whatever leaves it (reads of every row, snapshots,
    /// parts) is sorted by key.
    rows: SlabMap<RowKey, Row>,
    /// With-flows rows holding less than the whole share (absent: whole).
    shares: BTreeMap<Vec<u8>, u64>,
    /// With-flows tables: the per-flow table whose rows refer to these, and how.
    refs: Option<(String, RefsFn)>,
    /// A mirrored table that shadows a source table ([`StateTables::set_mirror_source`]):
    /// the source's name. The source: its mirror's name, where its writes go.
    mirror_of: Option<String>,
    mirrored_by: Option<String>,
    /// Pool tables.
    pools: BTreeMap<Vec<u8>, UnitSet>,
    /// Replicated tables: the folded counters and the untethered deltas not folded yet.
    folded: BTreeMap<Vec<u8>, Vec<u64>>,
    pending: BTreeMap<Vec<u8>, Vec<u64>>,
    /// Distinct keys in `folded` ∪ `pending`.
    counter_keys: usize,
    lanes: usize,
    folded_at_ms: u64,
    max_rows: Option<usize>,
    spill: Option<Vec<u8>>,
    /// Per-flow rows per group, kept with every insert, removal and move.
    groups: BTreeMap<Vec<u8>, usize>,
    /// The group of each per-flow row that is in one ([`StateTables::put_flow_in`]).
    /// Beside the rows, not in them: few tables group their rows, and a field in every
    /// row (16 bytes) was paid by every flow of every table at every replica.
    flow_groups: hashbrown::HashMap<FlowKey, Box<[u8]>>,
    /// The per-flow timer queue, lazy: a row has one live entry, at or before its
    /// deadline. Moving a deadline later (the common case: activity, a handshake done)
    /// only changes the row; the entry, when it fires, re-queues itself at the real
    /// deadline. Moving it earlier queues a new entry and orphans the old one; entries
    /// of removed rows are orphans too, dropped when they fire. So the timer pops due
    /// rows without a scan, and a refresh costs no queue operation.
    timers: TimerQueue,
}

impl Table {
    fn kind(&self) -> Kind {
        self.kind.unwrap_or(Kind::Read)
    }

    /// Where this table's writes go for other partitions, if anywhere: its shadow
    /// mirror, or itself if it is a mirror the NF writes directly.
    fn mirror_name<'a>(&'a self, table: &'a str) -> Option<&'a str> {
        match (&self.mirrored_by, self.kind()) {
            (Some(m), _) => Some(m),
            (None, Kind::Mirror) => Some(table),
            _ => None,
        }
    }

    fn len(&self) -> usize {
        match self.kind() {
            Kind::Replicated => self.counter_keys,
            Kind::PerFlow => self.flows.len(),
            Kind::Pool => self.pools.len(),
            _ => self.rows.len(),
        }
    }

    fn has_room(&self, key: &[u8]) -> bool {
        if self.max_rows.is_none() {
            return true;
        }
        let exists = match self.kind() {
            Kind::Replicated => self.folded.contains_key(key) || self.pending.contains_key(key),
            Kind::PerFlow => flow_of(key).is_some_and(|f| self.flows.contains_key(&f)),
            Kind::Pool => self.pools.contains_key(key),
            _ => self.rows.contains_key(key),
        };
        exists || self.max_rows.is_none_or(|m| self.len() < m)
    }

    /// Put flow `f`'s row in `group` (or in none), counting the move.
    fn regroup(&mut self, f: FlowKey, group: Option<Box<[u8]>>) {
        if group.is_none() && self.flow_groups.is_empty() {
            return;
        }
        let old = match group {
            Some(g) => {
                count_in(&mut self.groups, Some(&g), true);
                self.flow_groups.insert(f, g)
            }
            None => self.flow_groups.remove(&f),
        };
        count_in(&mut self.groups, old.as_deref(), false);
    }

    /// Insert or replace a row; a replaced row's queue entry stays live if it fires no
    /// later than the new deadline.
    fn insert_flow(&mut self, f: FlowKey, mut row: Row, group: Option<Box<[u8]>>) {
        self.regroup(f, group);
        let Table { flows, timers, .. } = self;
        row.scheduled = OptMs::NONE;
        match flows.entry(f) {
            flowmap::Entry::Occupied(mut e) => {
                let old = e.get().scheduled.get();
                if let Some(d) = row.deadline_ms.get() {
                    row.scheduled = OptMs::some(schedule_in(timers, e.slot(), old, d));
                }
                *e.get_mut() = row;
            }
            flowmap::Entry::Vacant(e) => {
                let deadline = row.deadline_ms.get();
                row.scheduled = OptMs::new(deadline);
                let slot = e.insert_slot(row);
                if let Some(d) = deadline {
                    timers.push(d, slot);
                }
            }
        }
    }

    /// Queue every timed row afresh, at its deadline: after the map was built anew (a
    /// split keeps the rows that stay in a new map), its slots are not the ones the
    /// queue names.
    fn requeue(&mut self) {
        self.timers.clear();
        let Table { flows, timers, .. } = self;
        let timed: Vec<(u32, Option<u64>)> = (flows.slots())
            .map(|(s, _, r)| (s, r.deadline_ms.get()))
            .collect();
        for (s, deadline) in timed {
            if let Some(d) = deadline {
                timers.push(d, s);
            }
            if let Some((_, r)) = flows.at_mut(s) {
                r.scheduled = OptMs::new(deadline);
            }
        }
    }

    fn remove_flow(&mut self, f: &FlowKey) -> Option<Row> {
        let row = self.flows.remove(f)?;
        self.regroup(*f, None);
        Some(row)
    }

    /// A present row's timer; false if there is no such row.
    fn set_timer(&mut self, f: &FlowKey, deadline_ms: u64) -> bool {
        let Some(slot) = self.flows.slot_of(f) else {
            return false;
        };
        let Table { flows, timers, .. } = self;
        if let Some((_, row)) = flows.at_mut(slot) {
            let at = schedule_in(timers, slot, row.scheduled.get(), deadline_ms);
            row.deadline_ms = OptMs::some(deadline_ms);
            row.scheduled = OptMs::some(at);
        }
        true
    }

    /// Pop the queue up to `now_ms`: remove the rows whose deadline passed, re-queue
    /// those whose deadline moved later, drop orphaned entries.
    ///
    /// An entry names a slot. It is live when the slot's row is queued for the entry's
    /// time: an orphan's slot is empty, or holds a row (the same one or a later one
    /// there) queued for another time. A later row queued for the same time is due then
    /// anyway, so an entry that reaches it early only repeats its own entry, and a row
    /// two entries name is taken once. Due rows go in key order, as a heap of keys would
    /// pop them, whatever the slots (a restored replica numbers its rows differently).
    fn expire(&mut self, now_ms: u64, gone: &mut Vec<(FlowKey, Row)>) {
        let mut rows: Vec<(FlowKey, u32)> = Vec::new();
        while let Some((at, due)) = self.timers.pop_due(now_ms) {
            rows.clear();
            rows.extend(due.into_iter().filter_map(|s| {
                let (k, r) = self.flows.at(s)?;
                (r.scheduled.get() == Some(at)).then_some((k, s))
            }));
            rows.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            rows.dedup_by_key(|r| r.1);
            for &(f, s) in &rows {
                let Some(deadline) = self.flows.at(s).map(|(_, r)| r.deadline_ms.get()) else {
                    continue;
                };
                match deadline {
                    Some(d) if d <= now_ms => {
                        gone.extend(self.remove_flow(&f).map(|r| (f, r)));
                    }
                    Some(d) => {
                        self.timers.push(d, s);
                        if let Some((_, row)) = self.flows.at_mut(s) {
                            row.scheduled = OptMs::some(d);
                        }
                    }
                    None => {
                        if let Some((_, row)) = self.flows.at_mut(s) {
                            row.scheduled = OptMs::NONE;
                        }
                    }
                }
            }
        }
    }

    /// Per-flow rows in key order, as snapshots and parts carry them.
    fn sorted_flows(&self) -> Vec<(Vec<u8>, WireRow)> {
        let mut out: Vec<(Vec<u8>, WireRow)> = (self.flows.iter())
            .map(|(k, r)| {
                let group = self.flow_groups.get(&k).map(|g| &**g);
                (k.as_bytes().to_vec(), wire_flow_row(r.clone(), group))
            })
            .collect();
        out.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        out
    }

    fn fold(&mut self, now_ms: u64) {
        for (k, d) in std::mem::take(&mut self.pending) {
            add_lanes(self.folded.entry(k).or_default(), &d);
        }
        self.folded_at_ms = now_ms;
    }

    /// The counters as a fresh read sees them.
    fn counters(&self) -> BTreeMap<Vec<u8>, Vec<u64>> {
        let mut all = self.folded.clone();
        for (k, d) in &self.pending {
            add_lanes(all.entry(k.clone()).or_default(), d);
        }
        all
    }
}

fn count_in(groups: &mut BTreeMap<Vec<u8>, usize>, group: Option<&[u8]>, up: bool) {
    let Some(g) = group else { return };
    if up {
        *groups.entry(g.to_vec()).or_default() += 1;
    } else if let Some(n) = groups.get_mut(g) {
        *n -= 1;
        if *n == 0 {
            groups.remove(g);
        }
    }
}

/// The per-flow timer queue: each deadline (in ms) with the rows queued for it, each
/// named by its slot in the table's map ([`SlabMap::at`]): 4 bytes an entry, where the
/// flow's key took 40, and a per-flow table queues an entry per row at every replica.
///
/// Why not `BinaryHeap`: its one array doubles by copying, and at 400k-odd flows that
/// copy (about 10 MiB into 20 MiB of fresh pages, per table, at all three replicas at
/// once) stopped every replica's chain for a tenth of a second in `bench setup`. Here
/// no insert copies more than one millisecond's list, and the map's nodes are small.
/// Pops go by deadline; the table takes a due list's rows in key order
/// ([`Table::expire`]), so replicas whose queues were filled in different orders (one
/// restored from a snapshot) expire the same flows in the same order.
#[derive(Debug, Clone, Default)]
struct TimerQueue {
    by_ms: BTreeMap<u64, Vec<u32>>,
}

impl TimerQueue {
    fn push(&mut self, at_ms: u64, slot: u32) {
        self.by_ms.entry(at_ms).or_default().push(slot);
    }

    /// The earliest deadline's entries, in the order they were queued, if that deadline
    /// is `now_ms` or earlier.
    fn pop_due(&mut self, now_ms: u64) -> Option<(u64, Vec<u32>)> {
        let first = self.by_ms.first_entry().filter(|e| *e.key() <= now_ms)?;
        Some(first.remove_entry())
    }

    /// Entries queued, orphans included.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_ms.values().map(Vec::len).sum()
    }

    fn clear(&mut self) {
        self.by_ms.clear();
    }
}

/// The queue time of a row whose entry fires at `scheduled` (if any) and whose deadline
/// is now `deadline_ms`: the old entry if it fires no later, else a new one.
fn schedule_in(
    timers: &mut TimerQueue,
    slot: u32,
    scheduled: Option<u64>,
    deadline_ms: u64,
) -> u64 {
    match scheduled {
        Some(at) if at <= deadline_ms => at,
        _ => {
            timers.push(deadline_ms, slot);
            deadline_ms
        }
    }
}

/// `m.get(k)` for a counter table's lanes, without comparing an empty key's bytes.
///
/// An empty `Vec` points at an address that is never mapped (`NonNull::dangling()`), and
/// glibc's AVX-512 `memcmp` (`__memcmp_evex_movbe`) reads even zero bytes with a masked
/// load, whose fault the CPU suppresses by a microcode assist: on the AMD EPYC these
/// builds are measured on, a zero-byte `memcmp` at such an address takes ~135 ns against
/// ~2 ns at a mapped one (docs/nf-api.md, "An empty key's compare"). An NF that counts
/// under the one key `()` compared it on every op: 14% of a SNAT's new flow. The empty
/// key is the smallest, so it is the first if it is there at all.
fn counter_of<'a>(m: &'a BTreeMap<Vec<u8>, Vec<u64>>, k: &[u8]) -> Option<&'a Vec<u64>> {
    if k.is_empty() {
        return m
            .first_key_value()
            .filter(|(f, _)| f.is_empty())
            .map(|(_, v)| v);
    }
    m.get(k)
}

/// [`counter_of`], for a write.
fn counter_mut<'a>(m: &'a mut BTreeMap<Vec<u8>, Vec<u64>>, k: &[u8]) -> Option<&'a mut Vec<u64>> {
    if k.is_empty() {
        return (m.first_entry())
            .filter(|e| e.key().is_empty())
            .map(|e| e.into_mut());
    }
    m.get_mut(k)
}

fn add_lanes(into: &mut Vec<u64>, d: &[u64]) {
    if into.len() < d.len() {
        into.resize(d.len(), 0);
    }
    for (a, b) in into.iter_mut().zip(d) {
        *a = a.saturating_add(*b);
    }
}

/// An NF's tables. Created from its declarations ([`StateTables::create`]); every read
/// and write names a declared table.
#[derive(Debug, Clone, Default)]
pub struct StateTables {
    tables: Tables,
    /// What per-flow rows split by and `flow_hashes` answers with (the chain's
    /// partitioning; configuration, not state, so no snapshot carries it).
    partition: PartitionBy,
    /// Writes to mirrored tables since the platform last took them
    /// ([`StateTables::take_mirror`]): on their way to the chain's other partitions, not
    /// state (no snapshot carries them).
    mirror_out: Vec<MirrorWrite>,
    mirror_dropped: u64,
    /// Whether writes to mirrored tables are recorded for the platform at all: off
    /// until the platform says a partition elsewhere will read them
    /// ([`StateTables::set_mirror_sending`]), so a chain alone in its key space pays
    /// only for its own copy.
    mirror_sending: bool,
}

/// Mirrored writes kept for the platform to take, at most. SC takes them after every op,
/// so only tables used without it (a test, a bench) reach this; the rest are counted.
pub const MAX_MIRROR_OUT: usize = 1 << 16;

/// One write to a mirrored table ([`SplitRule::Mirror`]), as the platform carries it to
/// the chain's other partitions: the row's key and value in postcard form. A delete
/// names the value it deleted, so that it removes only that row: a delete from one
/// partition never removes a newer row another partition put under the same key
/// (a port freed here and taken there), whichever arrives first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MirrorWrite {
    pub table: String,
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub deleted: bool,
}

/// The tables by name, in name order. An NF has a handful, and every call names one: a
/// scan that compares lengths before bytes finds it faster than an ordered map's
/// string comparisons, which showed as a fifth of a SNAT's first packet.
#[derive(Debug, Clone, Default)]
struct Tables(Vec<(String, Table)>);

impl Tables {
    fn at(&self, name: &str) -> Option<usize> {
        let b = name.as_bytes();
        (self.0.iter())
            .position(|(n, _)| n.len() == b.len() && n.bytes().zip(b).all(|(x, y)| x == *y))
    }

    fn get(&self, name: &str) -> Option<&Table> {
        self.at(name).map(|i| &self.0[i].1)
    }

    fn get_mut(&mut self, name: &str) -> Option<&mut Table> {
        self.at(name).map(|i| &mut self.0[i].1)
    }

    fn contains_key(&self, name: &str) -> bool {
        self.at(name).is_some()
    }

    /// Insert in name order (a new name: `create_table` checked).
    fn insert(&mut self, name: String, t: Table) {
        let i = self.0.partition_point(|(n, _)| n.as_str() < name.as_str());
        self.0.insert(i, (name, t));
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn iter(&self) -> impl Iterator<Item = (&String, &Table)> {
        self.0.iter().map(|(n, t)| (n, t))
    }

    fn keys(&self) -> impl Iterator<Item = &String> {
        self.0.iter().map(|(n, _)| n)
    }

    fn values(&self) -> impl Iterator<Item = &Table> {
        self.0.iter().map(|(_, t)| t)
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut Table> {
        self.0.iter_mut().map(|(_, t)| t)
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = (&String, &mut Table)> {
        self.0.iter_mut().map(|(n, t)| (&*n, t))
    }
}

impl FromIterator<(String, Table)> for Tables {
    fn from_iter<I: IntoIterator<Item = (String, Table)>>(it: I) -> Self {
        let mut t = Tables::default();
        for (n, x) in it {
            t.insert(n, x);
        }
        t
    }
}

/// The byte form of a snapshot or split part: magic, version, then postcard.
const MAGIC: &[u8; 4] = b"SFT2";
/// The form before with-flows shares, still taken from older builds.
const MAGIC_V1: &[u8; 4] = b"SFT1";

/// An `SFT1` snapshot: the tables as now, with rows of the older form.
type WireV1 = WireOf<WireRowV1>;

impl From<WireV1> for Wire {
    fn from(w: WireV1) -> Wire {
        w.map_rows(|r| WireRow {
            value: r.value,
            deadline_ms: r.deadline_ms,
            group: r.group,
            share: None,
        })
    }
}

/// A part decoded ahead of its merge ([`StateTables::merge_decoder`]).
struct PreparedTables(Wire);

type Wire = WireOf<WireRow>;
type WireTable = WireTableOf<WireRow>;

/// The tables of a snapshot or part. Generic in the row only because the two wire
/// versions differ in the row alone: one table layout serves both, and a version
/// change maps rows ([`WireOf::map_rows`]). Postcard carries no field names, so the
/// bytes are those of the plain structs.
#[derive(Serialize, Deserialize)]
struct WireOf<R> {
    tables: Vec<WireTableOf<R>>,
}

#[derive(Serialize, Deserialize)]
struct WireTableOf<R> {
    name: String,
    kind: Kind,
    /// A pool table's rows hold a `PoolWire` each.
    rows: Vec<(Vec<u8>, R)>,
    counters: Vec<(Vec<u8>, Vec<u64>)>,
    /// A counter table's lanes (0 until its first add), so an empty part keeps them.
    lanes: usize,
}

impl<R> WireOf<R> {
    /// The same tables with every row converted by `f` (from one wire version to
    /// another).
    fn map_rows<S>(self, mut f: impl FnMut(R) -> S) -> WireOf<S> {
        let tables = (self.tables.into_iter())
            .map(|t| WireTableOf {
                name: t.name,
                kind: t.kind,
                rows: (t.rows.into_iter()).map(|(k, r)| (k, f(r))).collect(),
                counters: t.counters,
                lanes: t.lanes,
            })
            .collect();
        WireOf { tables }
    }
}

/// Bytes of a key or value that [`enc_small`] serialises on the stack before copying
/// them once; anything longer takes postcard's growing form.
const ENC_STACK: usize = 128;

/// `v` serialised into a `SmallVec` of inline capacity `A`. Into a stack buffer first:
/// postcard's extend form grows the vector one field at a time, which was 5% of a SNAT's
/// new flow.
fn enc_small<A, T>(table: &str, v: &T) -> Result<SmallVec<A>, StateError>
where
    A: smallvec::Array<Item = u8>,
    T: Serialize + ?Sized,
{
    let mut buf = [0u8; ENC_STACK];
    let r = match postcard::to_slice(v, &mut buf) {
        Ok(b) => Ok(SmallVec::from_slice(b)),
        Err(postcard::Error::SerializeBufferFull) => postcard::to_extend(v, SmallVec::new()),
        Err(e) => Err(e),
    };
    r.map_err(|e| StateError::Value {
        table: table.into(),
        err: e.to_string(),
    })
}

/// A row's value.
fn enc_value<T: Serialize + ?Sized>(table: &str, v: &T) -> Result<Value, StateError> {
    enc_small(table, v)
}

/// A key encoded for a lookup only: on the stack unless longer than 64 bytes, so a read
/// (and a pool allocation, which only looks its pool up) allocates nothing.
type KeyBuf = SmallVec<[u8; 64]>;

/// A shared table's row key as the table keeps it: inline up to 16 bytes (a SNAT
/// mapping's external endpoint takes 8), in the 24 bytes a `Vec` takes, so a new row
/// costs no allocation of its key. Hashes and compares as the bytes, like the slices
/// lookups borrow it as.
type RowKey = SmallVec<[u8; 16]>;

fn enc_key<T: Serialize + ?Sized>(table: &str, v: &T) -> Result<KeyBuf, StateError> {
    enc_small(table, v)
}

/// A key to keep: one allocation of its exact size (`into_vec` of an inline `SmallVec`
/// collects with an exact length), where `to_allocvec` starts empty and reallocates as it
/// grows (two or three times for a SNAT mapping's key).
fn enc<T: Serialize + ?Sized>(table: &str, v: &T) -> Result<Vec<u8>, StateError> {
    enc_key(table, v).map(SmallVec::into_vec)
}

fn dec<T: DeserializeOwned>(table: &str, b: &[u8]) -> Result<T, StateError> {
    postcard::from_bytes(b).map_err(|e| StateError::Value {
        table: table.into(),
        err: e.to_string(),
    })
}

fn snap_err(msg: impl std::fmt::Display) -> NfError {
    NfError::Snapshot(format!("platform tables: {msg}"))
}

/// A partitioned row's place in the hash space a `SplitHalf` cuts: FNV-1a, then
/// SplitMix64's finaliser, since FNV alone leaves the high bits of short keys (a port
/// number) nearly constant and a `SplitHalf` cuts by high bits. Stable across builds and
/// machines, which std's `DefaultHasher` does not promise.
fn key_hash(k: &[u8]) -> u64 {
    let h = k.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let z = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn flow_of(k: &[u8]) -> Option<FlowKey> {
    let b: [u8; FlowKey::LEN] = k.try_into().ok()?;
    Some(FlowKey::from_bytes(b))
}

impl StateTables {
    /// Serpens `create_table` for each declaration. A bad or repeated declaration is an
    /// error.
    pub fn create(specs: &[TableSpec]) -> Result<Self, NfError> {
        let mut t = StateTables::default();
        for s in specs {
            t.create_table(s)?;
        }
        Ok(t)
    }

    /// Serpens `create_table(table, flags)`.
    pub fn create_table(&mut self, spec: &TableSpec) -> Result<(), NfError> {
        spec.validate()?;
        if self.tables.contains_key(&spec.name) {
            return Err(StateError::Duplicate {
                table: spec.name.clone(),
            }
            .into());
        }
        let table = Table {
            kind: Some(Kind::of(spec)),
            ..Table::default()
        };
        self.tables.insert(spec.name.clone(), table);
        Ok(())
    }

    /// Bound a table to `max_rows` keys. For a counter table, `spill` names the key that
    /// counts what new keys would have counted once the table is full (a monitor's
    /// "other hosts"); the spill key itself is always admitted, one key beyond
    /// `max_rows`.
    pub fn set_capacity<K: Serialize>(
        &mut self,
        table: &str,
        max_rows: usize,
        spill: Option<&K>,
    ) -> Result<(), StateError> {
        let spill = spill.map(|k| enc(table, k)).transpose()?;
        let t = self.table_mut(table)?;
        if spill.is_some() && t.kind() != Kind::Replicated {
            return Err(StateError::WrongKind {
                table: table.into(),
                kind: t.kind().name(),
                op: "a spill key",
            });
        }
        t.max_rows = Some(max_rows);
        t.spill = spill;
        Ok(())
    }

    /// Split per-flow rows by `by` ([`PartitionBy`]), and answer `flow_hashes` with it.
    pub fn set_partition(&mut self, by: PartitionBy) {
        self.partition = by;
    }

    pub fn partition(&self) -> PartitionBy {
        self.partition
    }

    /// Names of the declared tables, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tables.keys().map(String::as_str)
    }

    /// Keys in a table (for a counter table, those a fresh read sees).
    pub fn len(&self, table: &str) -> Result<usize, StateError> {
        Ok(self.table(table)?.len())
    }

    fn table(&self, table: &str) -> Result<&Table, StateError> {
        self.tables
            .get(table)
            .ok_or_else(|| StateError::NoSuchTable {
                table: table.into(),
            })
    }

    fn table_mut(&mut self, table: &str) -> Result<&mut Table, StateError> {
        self.tables
            .get_mut(table)
            .ok_or_else(|| StateError::NoSuchTable {
                table: table.into(),
            })
    }

    fn kinded(&self, table: &str, op: &'static str, want: &[Kind]) -> Result<&Table, StateError> {
        let t = self.table(table)?;
        check_kind(table, t.kind(), op, want)?;
        Ok(t)
    }

    fn kinded_mut(
        &mut self,
        table: &str,
        op: &'static str,
        want: &[Kind],
    ) -> Result<&mut Table, StateError> {
        let t = self.table_mut(table)?;
        check_kind(table, t.kind(), op, want)?;
        Ok(t)
    }

    // ---- per-flow tables ----

    pub fn get_flow<V: DeserializeOwned>(
        &self,
        table: &str,
        flow: &FlowKey,
    ) -> Result<Option<V>, StateError> {
        let t = self.kinded(table, "get_flow", &[Kind::PerFlow])?;
        t.flows.get(flow).map(|r| dec(table, &r.value)).transpose()
    }

    /// [`StateTables::get_flow`] and [`StateTables::timer`] in one lookup.
    pub fn get_flow_timed<V: DeserializeOwned>(
        &self,
        table: &str,
        flow: &FlowKey,
    ) -> Result<Option<(V, Option<u64>)>, StateError> {
        let t = self.kinded(table, "get_flow_timed", &[Kind::PerFlow])?;
        (t.flows.get(flow))
            .map(|r| Ok((dec(table, &r.value)?, r.deadline_ms.get())))
            .transpose()
    }

    /// Insert or replace a flow's row; its timer, if any, stays.
    pub fn put_flow<V: Serialize>(
        &mut self,
        table: &str,
        flow: &FlowKey,
        value: &V,
    ) -> Result<(), StateError> {
        let value = enc_value(table, value)?;
        self.put_flow_row(table, "put_flow", flow, value, None, None)
    }

    /// [`StateTables::put_flow`] and [`StateTables::set_timer`] in one lookup.
    pub fn put_flow_timed<V: Serialize>(
        &mut self,
        table: &str,
        flow: &FlowKey,
        value: &V,
        deadline_ms: u64,
    ) -> Result<(), StateError> {
        let value = enc_value(table, value)?;
        let d = Some(deadline_ms);
        self.put_flow_row(table, "put_flow_timed", flow, value, None, d)
    }

    /// [`StateTables::put_flow`], the row counting in `group` (a host, a tenant), which
    /// [`StateTables::count_group`] answers without a scan. The count follows the rows
    /// through deletes, timers, splits and merges, so an NF keeps no index of its own.
    pub fn put_flow_in<G: Serialize, V: Serialize>(
        &mut self,
        table: &str,
        flow: &FlowKey,
        group: &G,
        value: &V,
    ) -> Result<(), StateError> {
        let (value, g) = (enc_value(table, value)?, Some(enc(table, group)?.into()));
        self.put_flow_row(table, "put_flow_in", flow, value, g, None)
    }

    fn put_flow_row(
        &mut self,
        table: &str,
        op: &'static str,
        flow: &FlowKey,
        value: Value,
        group: Option<Box<[u8]>>,
        deadline: Option<u64>,
    ) -> Result<(), StateError> {
        let t = self.table_mut(table)?;
        if t.kind() == Kind::Replicated {
            return Err(StateError::SingleWriterWrite {
                table: table.into(),
            });
        }
        check_kind(table, t.kind(), op, &[Kind::PerFlow])?;
        let room = t.max_rows.is_none_or(|m| t.flows.len() < m);
        // One probe: this runs for every first packet, at every replica.
        let Table {
            flows,
            timers,
            max_rows,
            ..
        } = &mut *t;
        match flows.entry(*flow) {
            flowmap::Entry::Occupied(mut e) => {
                let slot = e.slot();
                let r = e.get_mut();
                r.value = value;
                if let Some(d) = deadline {
                    r.scheduled = OptMs::some(schedule_in(timers, slot, r.scheduled.get(), d));
                    r.deadline_ms = OptMs::some(d);
                }
            }
            flowmap::Entry::Vacant(_) if !room => {
                return Err(StateError::Full {
                    table: table.into(),
                    max_rows: max_rows.unwrap_or(0),
                })
            }
            flowmap::Entry::Vacant(e) => {
                let slot = e.insert_slot(Row {
                    value,
                    deadline_ms: OptMs::new(deadline),
                    scheduled: OptMs::new(deadline),
                });
                if let Some(d) = deadline {
                    timers.push(d, slot);
                }
            }
        }
        t.regroup(*flow, group);
        Ok(())
    }

    /// Rows of a per-flow table in `group`.
    pub fn count_group<G: Serialize>(&self, table: &str, group: &G) -> Result<usize, StateError> {
        let g = enc_key(table, group)?;
        let t = self.kinded(table, "count_group", &[Kind::PerFlow])?;
        Ok(t.groups.get(g.as_slice()).copied().unwrap_or(0))
    }

    pub fn delete_flow(&mut self, table: &str, flow: &FlowKey) -> Result<bool, StateError> {
        let t = self.kinded_mut(table, "delete_flow", &[Kind::PerFlow])?;
        Ok(t.remove_flow(flow).is_some())
    }

    /// Serpens `timer(table, key, timeout)`: the platform removes the flow's row at
    /// `deadline_ms` and reports the flow from the NF's timer. False if no such row.
    pub fn set_timer(
        &mut self,
        table: &str,
        flow: &FlowKey,
        deadline_ms: u64,
    ) -> Result<bool, StateError> {
        let t = self.kinded_mut(table, "set_timer", &[Kind::PerFlow])?;
        Ok(t.set_timer(flow, deadline_ms))
    }

    /// A flow's timer ([`StateTables::set_timer`]), if it has a row with one.
    pub fn timer(&self, table: &str, flow: &FlowKey) -> Result<Option<u64>, StateError> {
        let t = self.kinded(table, "timer", &[Kind::PerFlow])?;
        Ok(t.flows.get(flow).and_then(|r| r.deadline_ms.get()))
    }

    /// Every flow with a row, in key order, and its value.
    pub fn flows<V: DeserializeOwned>(&self, table: &str) -> Result<Vec<(FlowKey, V)>, StateError> {
        let t = self.kinded(table, "flows", &[Kind::PerFlow])?;
        let mut out = (t.flows.iter())
            .map(|(k, r)| Ok((k, dec(table, &r.value)?)))
            .collect::<Result<Vec<(FlowKey, V)>, StateError>>()?;
        out.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        Ok(out)
    }

    // ---- shared tables, single writer or read ----

    pub fn get<K: Serialize, V: DeserializeOwned>(
        &self,
        table: &str,
        key: &K,
    ) -> Result<Option<V>, StateError> {
        let k = enc_key(table, key)?;
        let t = self.kinded(table, "get", READABLE)?;
        t.rows
            .get(k.as_slice())
            .map(|r| dec(table, &r.value))
            .transpose()
    }

    pub fn put<K: Serialize, V: Serialize>(
        &mut self,
        table: &str,
        key: &K,
        value: &V,
    ) -> Result<(), StateError> {
        let (k, v) = (enc_key(table, key)?, enc_value(table, value)?);
        self.put_row(table, "put", Kind::KEYED, k, v).map(|_| ())
    }

    /// [`Self::put`], answering the row's slot ([`Self::at`]) and whether the row is
    /// new: the one probe a put makes tells both.
    pub fn put_slot<K: Serialize, V: Serialize>(
        &mut self,
        table: &str,
        key: &K,
        value: &V,
    ) -> Result<(u32, bool), StateError> {
        let (k, v) = (enc_key(table, key)?, enc_value(table, value)?);
        self.put_row(table, "put", Kind::KEYED, k, v)
    }

    /// Where a shared table's row is: its slot, which it keeps for as long as it lives.
    /// Rows never move (`SlabMap`); only a restore, split or merge places them anew,
    /// and each of those calls the NF's `tables_changed`. So an NF may keep what it
    /// derives per row in a plain array by slot, where a map keyed by the row's key
    /// would cost it the key again and a probe per insert.
    pub fn slot<K: Serialize>(&self, table: &str, key: &K) -> Result<Option<u32>, StateError> {
        let k = enc_key(table, key)?;
        let t = self.kinded(table, "slot", READABLE)?;
        Ok(t.rows.slot_of(k.as_slice()))
    }

    /// The row in `slot` of a shared table ([`Self::slot`]), decoded; `None` for a
    /// slot that holds no row.
    pub fn at<K: DeserializeOwned, V: DeserializeOwned>(
        &self,
        table: &str,
        slot: u32,
    ) -> Result<Option<(K, V)>, StateError> {
        let t = self.kinded(table, "at", READABLE)?;
        t.rows
            .at(slot)
            .map(|(k, r)| Ok((dec(table, k)?, dec(table, &r.value)?)))
            .transpose()
    }

    /// Fill a read-only table (configuration: an ACL, a backend list) at setup.
    pub fn load<K: Serialize, V: Serialize>(
        &mut self,
        table: &str,
        key: &K,
        value: &V,
    ) -> Result<(), StateError> {
        let (k, v) = (enc_key(table, key)?, enc_value(table, value)?);
        self.put_row(table, "load", &[Kind::Read], k, v).map(|_| ())
    }

    pub fn delete<K: Serialize>(&mut self, table: &str, key: &K) -> Result<bool, StateError> {
        let k = enc_key(table, key)?;
        let sending = self.mirror_sending;
        let t = self.kinded_mut(table, "delete", Kind::KEYED)?;
        t.shares.remove(k.as_slice());
        // Named only while sending: no allocation per write otherwise.
        let mirror = sending
            .then(|| t.mirror_name(table).map(str::to_string))
            .flatten();
        let Some(old) = t.rows.remove(k.as_slice()) else {
            return Ok(false);
        };
        if let Some(mirror) = mirror {
            self.send_mirror(MirrorWrite {
                table: mirror,
                key: k.to_vec(),
                value: old.value.to_vec(),
                deleted: true,
            });
        }
        Ok(true)
    }

    /// Every row of a shared single-writer or read table, in key order.
    pub fn rows<K: DeserializeOwned, V: DeserializeOwned>(
        &self,
        table: &str,
    ) -> Result<Vec<(K, V)>, StateError> {
        let t = self.kinded(table, "rows", READABLE)?;
        let decode = |(k, r): (&RowKey, &Row)| Ok((dec(table, k)?, dec(table, &r.value)?));
        sorted(&t.rows).into_iter().map(decode).collect()
    }

    // ---- rows that go with their flows (SplitRule::WithFlows) ----

    /// Declare which rows of the with-flows table `table` the rows of the per-flow table
    /// `flows` refer to. A split then moves a row with the flows that use it, and copies
    /// it, halving its share, when flows on both sides use it.
    pub fn set_refs(&mut self, table: &str, flows: &str, refs: RefsFn) -> Result<(), StateError> {
        self.kinded(flows, "set_refs", &[Kind::PerFlow])?;
        let t = self.kinded_mut(table, "set_refs", &[Kind::WithFlows])?;
        t.refs = Some((flows.to_string(), refs));
        Ok(())
    }

    /// The share of its whole a with-flows row holds ([`WHOLE_SHARE`] for the only copy),
    /// or None without such a row.
    pub fn share<K: Serialize>(&self, table: &str, key: &K) -> Result<Option<u64>, StateError> {
        let k = enc_key(table, key)?;
        let t = self.kinded(table, "share", &[Kind::WithFlows])?;
        Ok((t.rows.contains_key(k.as_slice()))
            .then(|| t.shares.get(k.as_slice()).copied().unwrap_or(WHOLE_SHARE)))
    }

    /// Insert a with-flows row holding `share` of its whole (an import of state written
    /// by an older build; a plain `put` makes a whole row).
    pub fn put_share<K: Serialize, V: Serialize>(
        &mut self,
        table: &str,
        key: &K,
        value: &V,
        share: u64,
    ) -> Result<(), StateError> {
        if share == 0 || share > WHOLE_SHARE {
            return Err(StateError::Value {
                table: table.into(),
                err: format!("share {share} is not in 1..={WHOLE_SHARE}"),
            });
        }
        let k = enc(table, key)?;
        self.kinded(table, "put_share", &[Kind::WithFlows])?;
        self.put_row(
            table,
            "put_share",
            &[Kind::WithFlows],
            KeyBuf::from_slice(&k),
            enc_value(table, value)?,
        )?;
        let t = self.table_mut(table)?;
        if share < WHOLE_SHARE {
            t.shares.insert(k, share);
        } else {
            t.shares.remove(&k);
        }
        Ok(())
    }

    // ---- pools of free units (SplitRule::Pool) ----

    /// Define a pool row over `lo..=hi`, every unit free (`free`) or in use. A row that
    /// exists keeps its free units if its range is the same, and is refused otherwise.
    pub fn pool_define<K: Serialize>(
        &mut self,
        table: &str,
        key: &K,
        lo: u16,
        hi: u16,
        free: bool,
    ) -> Result<(), StateError> {
        let k = enc(table, key)?;
        let t = self.kinded_mut(table, "pool_define", &[Kind::Pool])?;
        if let Some(p) = t.pools.get(&k) {
            if p.range() == (lo.min(hi), lo.max(hi)) {
                return Ok(());
            }
            return Err(StateError::Value {
                table: table.into(),
                err: format!("pool row redefined from {:?} to {lo}..={hi}", p.range()),
            });
        }
        if !t.has_room(&k) {
            return Err(StateError::Full {
                table: table.into(),
                max_rows: t.max_rows.unwrap_or(0),
            });
        }
        let set = if free {
            UnitSet::full(lo, hi)
        } else {
            UnitSet::empty(lo, hi)
        };
        t.pools.insert(k, set);
        Ok(())
    }

    /// A pool row, to read.
    pub fn pool<K: Serialize>(&self, table: &str, key: &K) -> Result<Option<&UnitSet>, StateError> {
        let k = enc_key(table, key)?;
        let t = self.kinded(table, "pool", &[Kind::Pool])?;
        Ok(t.pools.get(k.as_slice()))
    }

    /// Free units of a pool row (0 without the row).
    pub fn pool_free<K: Serialize>(&self, table: &str, key: &K) -> Result<u32, StateError> {
        Ok(self.pool(table, key)?.map_or(0, UnitSet::free))
    }

    /// Take a unit from a pool row ([`UnitSet::alloc`]): `want` if free, else a random
    /// free one. None when the row has none free, or there is no such row.
    pub fn pool_alloc<K: Serialize>(
        &mut self,
        table: &str,
        key: &K,
        want: u16,
        rng: &mut DetRng,
    ) -> Result<Option<Alloc>, StateError> {
        let k = enc_key(table, key)?;
        let t = self.kinded_mut(table, "pool_alloc", &[Kind::Pool])?;
        Ok(t.pools
            .get_mut(k.as_slice())
            .and_then(|p| p.alloc(want, rng)))
    }

    /// Return a unit to its pool row; false if it was free already, is outside the
    /// row's range, or there is no such row.
    pub fn pool_put<K: Serialize>(
        &mut self,
        table: &str,
        key: &K,
        unit: u16,
    ) -> Result<bool, StateError> {
        let k = enc_key(table, key)?;
        let t = self.kinded_mut(table, "pool_put", &[Kind::Pool])?;
        Ok(t.pools.get_mut(k.as_slice()).is_some_and(|p| p.put(unit)))
    }

    /// Every pool row, in key order.
    pub fn pools<K: DeserializeOwned>(
        &self,
        table: &str,
    ) -> Result<Vec<(K, &UnitSet)>, StateError> {
        let t = self.kinded(table, "pools", &[Kind::Pool])?;
        (t.pools.iter())
            .map(|(k, p)| Ok((dec(table, k)?, p)))
            .collect()
    }

    /// Put a shared table's row; its slot, and whether it is new.
    fn put_row(
        &mut self,
        table: &str,
        op: &'static str,
        want: &[Kind],
        k: KeyBuf,
        value: Value,
    ) -> Result<(u32, bool), StateError> {
        let sending = op == "put" && self.mirror_sending;
        let t = self.table_mut(table)?;
        match (t.kind(), op) {
            (Kind::Replicated, _) => {
                return Err(StateError::SingleWriterWrite {
                    table: table.into(),
                })
            }
            (Kind::Read, "put") => {
                return Err(StateError::ReadOnly {
                    table: table.into(),
                })
            }
            (kind, _) => check_kind(table, kind, op, want)?,
        }
        if !t.has_room(&k) {
            return Err(StateError::Full {
                table: table.into(),
                max_rows: t.max_rows.unwrap_or(0),
            });
        }
        let mirror = sending
            .then(|| t.mirror_name(table).map(str::to_string))
            .flatten();
        if let Some(mirror) = mirror {
            self.send_mirror(MirrorWrite {
                table: mirror,
                key: k.to_vec(),
                value: value.to_vec(),
                deleted: false,
            });
        }
        let t = self.table_mut(table)?;
        Ok(match t.rows.entry(RowKey::from_slice(&k)) {
            crate::slabmap::Entry::Occupied(mut o) => {
                *o.get_mut() = Row::keyed(value);
                (o.slot(), false)
            }
            crate::slabmap::Entry::Vacant(v) => (v.insert_slot(Row::keyed(value)), true),
        })
    }

    // ---- mirrored tables (SplitRule::Mirror) ----

    /// The writes to mirrored tables since the last call: the platform sends them to the
    /// chain's other partitions. Every replica of a group makes the same writes in the
    /// same order, so each takes the same list; the group's tail sends it.
    pub fn take_mirror(&mut self) -> Vec<MirrorWrite> {
        std::mem::take(&mut self.mirror_out)
    }

    /// Mirrored writes dropped because nothing took them (`MAX_MIRROR_OUT` waited):
    /// tables used outside a platform that relays them.
    pub fn mirror_dropped(&self) -> u64 {
        self.mirror_dropped
    }

    /// Make mirrored table `mirror` the shadow of single-writer table `source`: the NF
    /// writes `source` only, and the platform keeps `mirror` holding the *other*
    /// partitions' rows of it. Writes to `source` go out as writes to `mirror`
    /// elsewhere; a split gives each part the other part's `source` rows in its
    /// `mirror`; a merge drops from `mirror` what became this part's own. So a chain
    /// alone in its key space pays nothing for its mirror, and no row is held twice.
    pub fn set_mirror_source(&mut self, mirror: &str, source: &str) -> Result<(), StateError> {
        self.kinded(source, "set_mirror_source", Kind::KEYED)?;
        let m = self.kinded_mut(mirror, "set_mirror_source", &[Kind::Mirror])?;
        m.mirror_of = Some(source.to_string());
        if let Some(t) = self.tables.get_mut(source) {
            t.mirrored_by = Some(mirror.to_string());
        }
        Ok(())
    }

    /// The (mirror, source) pairs of [`StateTables::set_mirror_source`].
    fn shadows(&self) -> Vec<(String, String)> {
        (self.tables.iter())
            .filter_map(|(n, t)| Some((n.clone(), t.mirror_of.clone()?)))
            .collect()
    }

    /// Drop from each shadow mirror the rows its source holds here (a merge or a
    /// restore made them this part's own).
    fn drop_own_from_mirrors(&mut self) {
        for (m, src) in self.shadows() {
            let own: Vec<RowKey> = match self.tables.get(&src) {
                Some(t) => t.rows.keys().cloned().collect(),
                None => continue,
            };
            if let Some(t) = self.tables.get_mut(&m) {
                for k in own {
                    t.rows.remove(&k);
                }
            }
        }
    }

    /// Record mirrored writes for [`StateTables::take_mirror`] from now on, or stop
    /// (the platform's switch: on while other partitions of the chain exist).
    pub fn set_mirror_sending(&mut self, on: bool) {
        self.mirror_sending = on;
    }

    fn send_mirror(&mut self, w: MirrorWrite) {
        if self.mirror_out.len() >= MAX_MIRROR_OUT {
            self.mirror_dropped += 1;
            return;
        }
        self.mirror_out.push(w);
    }

    /// Apply another partition's writes to this part's copy, without sending them on.
    /// A write to a table that is not mirrored here (an NF of another version) or that
    /// does not fit is skipped and counted in the answer (applied, skipped); the rest
    /// still land.
    pub fn import_mirror(&mut self, writes: &[MirrorWrite]) -> (usize, usize) {
        let (mut applied, mut skipped) = (0, 0);
        for w in writes {
            let Ok(t) = self.kinded_mut(&w.table, "import_mirror", &[Kind::Mirror]) else {
                skipped += 1;
                continue;
            };
            if w.deleted {
                if t.rows
                    .get(w.key.as_slice())
                    .is_some_and(|r| r.value.as_slice() == w.value)
                {
                    t.rows.remove(w.key.as_slice());
                }
                applied += 1;
                continue;
            }
            if !t.has_room(&w.key) {
                skipped += 1;
                continue;
            }
            t.rows.insert(
                RowKey::from_slice(&w.key),
                Row::keyed(Value::from_slice(&w.value)),
            );
            applied += 1;
        }
        (applied, skipped)
    }

    // ---- shared multi-writer counters ----

    /// S6's untethered `inc`: add `lanes` (packets, bytes, …; saturating) to a counter
    /// and return at once. Every key of one table takes the same number of lanes.
    pub fn add<K: Serialize>(
        &mut self,
        table: &str,
        key: &K,
        lanes: &[u64],
    ) -> Result<(), StateError> {
        let k = enc(table, key)?;
        let t = self.table_mut(table)?;
        match t.kind() {
            Kind::Replicated => {}
            Kind::Partitioned
            | Kind::PerFlow
            | Kind::Pool
            | Kind::WithFlows
            | Kind::Copy
            | Kind::Mirror => {
                return Err(StateError::MultiWriterWrite {
                    table: table.into(),
                })
            }
            Kind::Read => {
                return Err(StateError::ReadOnly {
                    table: table.into(),
                })
            }
        }
        if t.lanes == 0 {
            t.lanes = lanes.len();
        }
        if lanes.len() != t.lanes || lanes.is_empty() {
            return Err(StateError::Lanes {
                table: table.into(),
                got: lanes.len(),
                want: t.lanes,
            });
        }
        // A key already counting since the last fold: one probe (an NF that counts per
        // op adds to the same few keys over and over).
        if let Some(v) = counter_mut(&mut t.pending, &k) {
            add_lanes(v, lanes);
            return Ok(());
        }
        let k = match (t.has_room(&k), &t.spill) {
            (true, _) => k,
            (false, Some(s)) => s.clone(),
            (false, None) => {
                return Err(StateError::Full {
                    table: table.into(),
                    max_rows: t.max_rows.unwrap_or(0),
                })
            }
        };
        if counter_of(&t.folded, &k).is_none() && counter_of(&t.pending, &k).is_none() {
            t.counter_keys += 1;
        }
        add_lanes(t.pending.entry(k).or_default(), lanes);
        Ok(())
    }

    /// A fresh read: every add so far. Zero lanes for a key never added to.
    pub fn counter<K: Serialize>(&self, table: &str, key: &K) -> Result<Vec<u64>, StateError> {
        let k = enc_key(table, key)?;
        let t = self.kinded(table, "counter", &[Kind::Replicated])?;
        let mut v = counter_of(&t.folded, &k).cloned().unwrap_or_default();
        if let Some(d) = counter_of(&t.pending, &k) {
            add_lanes(&mut v, d);
        }
        v.resize(t.lanes, 0);
        Ok(v)
    }

    /// S6's `get() const stale`: the folded copy if it is at most `max_stale_ms` old at
    /// `now_ms`, else fold the table and read. It may miss adds since the last fold,
    /// never more than `max_stale_ms` worth of them.
    pub fn counter_stale<K: Serialize>(
        &mut self,
        table: &str,
        key: &K,
        now_ms: u64,
        max_stale_ms: u64,
    ) -> Result<Vec<u64>, StateError> {
        let k = enc_key(table, key)?;
        let t = self.kinded_mut(table, "counter_stale", &[Kind::Replicated])?;
        if now_ms.saturating_sub(t.folded_at_ms) > max_stale_ms {
            t.fold(now_ms);
        }
        let mut v = counter_of(&t.folded, &k).cloned().unwrap_or_default();
        v.resize(t.lanes, 0);
        Ok(v)
    }

    /// Every counter of a table, fresh, in key order.
    pub fn counters<K: DeserializeOwned>(
        &self,
        table: &str,
    ) -> Result<Vec<(K, Vec<u64>)>, StateError> {
        let t = self.kinded(table, "counters", &[Kind::Replicated])?;
        t.counters()
            .into_iter()
            .map(|(k, v)| Ok((dec(table, &k)?, v)))
            .collect()
    }

    // ---- what the platform runs ----

    /// Fold every untethered add into its counter.
    pub fn fold(&mut self, now_ms: u64) {
        for t in self.tables.values_mut() {
            t.fold(now_ms);
        }
    }

    /// The platform's timer: fold counters, remove per-flow rows whose timer passed,
    /// and return their flows (sorted, deduplicated).
    pub fn expire(&mut self, now_ms: u64) -> Vec<FlowKey> {
        let mut rows = Vec::new();
        for t in self.tables.values_mut() {
            t.fold(now_ms);
            if t.kind() != Kind::PerFlow {
                continue;
            }
            t.expire(now_ms, &mut rows);
        }
        let mut gone: Vec<FlowKey> = rows.into_iter().map(|(k, _)| k).collect();
        gone.sort_by_key(|k| *k.as_bytes());
        gone.dedup();
        gone
    }

    /// The platform's timer on one per-flow table, answering the removed rows with
    /// their values (sorted by flow), for an NF that must undo something per row (an
    /// index entry keyed by the value).
    pub fn expire_flows<V: DeserializeOwned>(
        &mut self,
        table: &str,
        now_ms: u64,
    ) -> Result<Vec<(FlowKey, V)>, StateError> {
        let t = self.kinded_mut(table, "expire_flows", &[Kind::PerFlow])?;
        let mut rows = Vec::new();
        t.expire(now_ms, &mut rows);
        rows.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        (rows.into_iter())
            .map(|(k, r)| Ok((k, dec(table, &r.value)?)))
            .collect()
    }

    /// Hashes of the flows with a row in some per-flow table.
    pub fn flow_hashes(&self) -> Vec<u64> {
        let by = self.partition;
        let mut out: Vec<u64> = (self.tables.values())
            .filter(|t| t.kind() == Kind::PerFlow)
            .flat_map(|t| t.flows.keys().map(move |k| by.hash(&k)))
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Every table, counters folded: replicas that applied the same ops give the same
    /// bytes, whenever each folded.
    pub fn snapshot(&self) -> Result<Vec<u8>, NfError> {
        self.encode(|_, t| {
            let counters = t.counters().into_iter().collect();
            let rows = match t.kind() {
                Kind::PerFlow => t.sorted_flows(),
                Kind::Pool => pool_rows(t.pools.iter()),
                _ => t.keyed_rows(t.rows.iter()),
            };
            (rows, counters)
        })
    }

    /// Replace every table with a snapshot's. The snapshot must hold exactly the declared
    /// tables, each of its declared kind; otherwise it is refused and nothing changes.
    pub fn restore(&mut self, b: &[u8]) -> Result<(), NfError> {
        let wire = self.decode(b)?;
        let mut empty = self.clone();
        for t in empty.tables.values_mut() {
            t.rows.clear();
            t.flows.clear();
            t.folded.clear();
            t.pending.clear();
            t.counter_keys = 0;
            t.lanes = 0;
            t.groups.clear();
            t.flow_groups.clear();
            t.timers.clear();
            t.shares.clear();
            t.pools.clear();
        }
        empty.check(&wire, false)?;
        empty.apply(wire);
        empty.mirror_out.clear();
        *self = empty;
        Ok(())
    }

    /// Scale-out (Fig. 3): per-flow rows move with their flows, partitioned rows by their
    /// key's hash, pools give away half their free units, with-flows rows go with the
    /// flows that use them, copied and read tables are copied, counters start the new
    /// part from zero.
    pub fn split(&mut self, half: &SplitHalf) -> Result<Vec<u8>, NfError> {
        self.split_where(half, true)
    }

    /// Gradual migration (S6): only per-flow rows move, with the with-flows rows they use
    /// and the copied tables; pools, partitioned rows and counters stay whole here.
    pub fn split_flows(&mut self, half: &SplitHalf) -> Result<Vec<u8>, NfError> {
        self.split_where(half, false)
    }

    fn split_where(&mut self, half: &SplitHalf, shared: bool) -> Result<Vec<u8>, NfError> {
        let in_half = |h: u64| h >= half.moved_lo && h < half.moved_hi;
        let mut moved: BTreeMap<String, Vec<(Vec<u8>, WireRow)>> = BTreeMap::new();
        // Per-flow tables first: the with-flows rows follow the flows that leave.
        let mut leaving: BTreeMap<String, Vec<(Vec<u8>, WireRow)>> = BTreeMap::new();
        let by = self.partition;
        for (name, t) in self.tables.iter_mut() {
            if t.kind() != Kind::PerFlow {
                continue;
            }
            let (part, keep): (FlowMap<_>, FlowMap<_>) = std::mem::take(&mut t.flows)
                .into_iter()
                .partition(|(k, _)| half.moves_by(k, by));
            t.flows = keep;
            // The rows that stay have new slots; those that left are gone from the queue.
            t.requeue();
            let mut part: Vec<(Vec<u8>, WireRow)> = (part.into_iter())
                .map(|(k, r)| {
                    let group = t.flow_groups.remove(&k);
                    count_in(&mut t.groups, group.as_deref(), false);
                    (k.as_bytes().to_vec(), wire_flow_row(r, group.as_deref()))
                })
                .collect();
            part.sort_unstable_by(|a, b| a.0.cmp(&b.0));
            leaving.insert(name.clone(), part);
        }
        // Uses of each with-flows row by the flows that leave and by those that stay.
        let mut uses: BTreeMap<String, (Uses, Uses)> = BTreeMap::new();
        for (name, t) in self.tables.iter() {
            let Some((flows, refs)) = &t.refs else {
                continue;
            };
            let (mut gone, mut stay) = (BTreeMap::new(), BTreeMap::new());
            for (_, r) in leaving.get(flows).into_iter().flatten() {
                for k in refs(&r.value) {
                    *gone.entry(k).or_insert(0u32) += 1;
                }
            }
            if let Some(ft) = self.tables.get(flows) {
                for r in ft.flows.values() {
                    for k in refs(&r.value) {
                        if gone.contains_key(&k) {
                            *stay.entry(k).or_insert(0u32) += 1;
                        }
                    }
                }
            }
            uses.insert(name.clone(), (gone, stay));
        }
        for (name, t) in self.tables.iter_mut() {
            let out = moved.entry(name.clone()).or_default();
            match t.kind() {
                Kind::PerFlow => *out = leaving.remove(name).unwrap_or_default(),
                Kind::Partitioned if shared => {
                    let (part, keep): (SlabMap<RowKey, _>, _) = std::mem::take(&mut t.rows)
                        .into_iter()
                        .partition(|(k, _)| in_half(key_hash(k)));
                    t.rows = keep;
                    *out = t.keyed_rows(part.iter());
                }
                Kind::Pool if shared => {
                    let part: BTreeMap<Vec<u8>, UnitSet> = (t.pools.iter_mut())
                        .map(|(k, p)| (k.clone(), p.split_upper_half()))
                        .collect();
                    *out = pool_rows(part.iter());
                }
                Kind::WithFlows => {
                    let (gone, stay) = uses.remove(name).unwrap_or_default();
                    for k in gone.keys() {
                        let Some(row) = t.rows.get(k.as_slice()).cloned() else {
                            continue;
                        };
                        let share = t.shares.get(k).copied().unwrap_or(WHOLE_SHARE);
                        let give = if stay.contains_key(k) {
                            // Used on both sides: both keep a copy, each half the share.
                            let give = share / 2;
                            t.shares.insert(k.clone(), share - give);
                            give
                        } else {
                            t.rows.remove(k.as_slice());
                            t.shares.remove(k);
                            share
                        };
                        let mut w = WireRow::from(row);
                        w.share = (give < WHOLE_SHARE).then_some(give);
                        out.push((k.clone(), w));
                    }
                }
                Kind::Copy | Kind::Mirror | Kind::Read => *out = t.keyed_rows(t.rows.iter()),
                _ => {}
            }
        }
        // Shadow mirrors: each part's mirror gets the source rows the other part holds
        // (rows both parts hold, copies of a with-flows row, are each part's own).
        for (m, src) in self.shadows() {
            let Some(st) = self.tables.get(&src) else {
                continue;
            };
            let moved_src = moved.get(&src).map(Vec::as_slice).unwrap_or_default();
            let gone: Vec<(Vec<u8>, Value)> = (moved_src.iter())
                .filter(|(k, _)| !st.rows.contains_key(k.as_slice()))
                .map(|(k, w)| (k.clone(), Value::from_slice(&w.value)))
                .collect();
            let moved_keys: hashbrown::HashSet<&[u8]> =
                moved_src.iter().map(|(k, _)| k.as_slice()).collect();
            let staying: Vec<(Vec<u8>, WireRow)> = (st.rows.iter())
                .filter(|(k, _)| !moved_keys.contains(k.as_slice()))
                .map(|(k, r)| {
                    let w = WireRow {
                        value: r.value.to_vec(),
                        deadline_ms: None,
                        group: None,
                        share: None,
                    };
                    (k.to_vec(), w)
                })
                .collect();
            drop(moved_keys);
            let out = moved.entry(m.clone()).or_default();
            out.extend(staying);
            out.sort_unstable_by(|a, b| a.0.cmp(&b.0));
            if let Some(mt) = self.tables.get_mut(&m) {
                for (k, value) in gone {
                    mt.rows.insert(RowKey::from_vec(k), Row::keyed(value));
                }
            }
        }
        self.encode(|name, _| (moved.remove(name).unwrap_or_default(), Vec::new()))
    }

    /// Scale-in: take in a part (a split's or a whole snapshot). Checked whole first, so
    /// a refused part changes nothing.
    pub fn merge(&mut self, part: &[u8]) -> Result<(), NfError> {
        let wire = self.decode(part)?;
        self.check(&wire, true)?;
        self.apply(wire);
        Ok(())
    }

    /// Whether [`StateTables::merge`] would take `part`, without changing anything.
    pub fn check_merge(&self, part: &[u8]) -> Result<(), NfError> {
        self.check(&self.decode(part)?, true)
    }

    /// A decoder for parts, needing none of the tables' rows: SC decodes a part on
    /// another thread before the merge op is sequenced (docs/scaling.md).
    pub fn merge_decoder(&self) -> MergeDecoder {
        let shape = StateTables {
            tables: (self.tables.iter())
                .map(|(n, t)| {
                    let kind = Table {
                        kind: t.kind,
                        ..Table::default()
                    };
                    (n.clone(), kind)
                })
                .collect(),
            partition: self.partition,
            mirror_out: Vec::new(),
            mirror_dropped: 0,
            mirror_sending: false,
        };
        Arc::new(move |b: &[u8]| Ok(PreparedPart::new(PreparedTables(shape.decode(b)?))))
    }

    /// Whether [`StateTables::merge_prepared`] would take a decoded part.
    pub fn check_prepared(&self, part: &PreparedPart) -> Result<(), NfError> {
        let p = (part.downcast_ref::<PreparedTables>())
            .ok_or_else(|| snap_err("a prepared part of another kind"))?;
        self.check(&p.0, true)
    }

    /// [`StateTables::merge`] of a part its decoder decoded.
    pub fn merge_prepared(&mut self, part: PreparedPart) -> Result<(), NfError> {
        let p: PreparedTables = part.downcast()?;
        self.check(&p.0, true)?;
        self.apply(p.0);
        Ok(())
    }

    /// Everything that could make `apply` refuse, checked before it changes a thing.
    fn check(&self, wire: &Wire, merge: bool) -> Result<(), NfError> {
        for wt in &wire.tables {
            let t = (self.tables.get(&wt.name))
                .ok_or_else(|| snap_err(format!("table {} is not declared", wt.name)))?;
            if t.kind() != wt.kind {
                return Err(snap_err(format!("table {} changed kind", wt.name)));
            }
            let full = || {
                snap_err(StateError::Full {
                    table: wt.name.clone(),
                    max_rows: t.max_rows.unwrap_or(0),
                })
            };
            let mut new_keys = 0;
            for (k, row) in &wt.rows {
                if t.kind() == Kind::PerFlow && flow_of(k).is_none() {
                    return Err(snap_err(format!(
                        "{}: a per-flow key is not 40 bytes",
                        wt.name
                    )));
                }
                if t.kind() == Kind::Pool {
                    let part = pool_of(&wt.name, &row.value)?;
                    match t.pools.get(k) {
                        None => new_keys += 1,
                        Some(_) if !merge => {}
                        Some(mine) if mine.range() != part.range() => {
                            return Err(snap_err(format!(
                                "{}: a pool row's range differs ({:?} here, {:?} there)",
                                wt.name,
                                mine.range(),
                                part.range()
                            )))
                        }
                        Some(mine) => {
                            if let Some(u) = mine.overlap(&part) {
                                return Err(snap_err(format!(
                                    "{}: unit {u} is free on both sides",
                                    wt.name
                                )));
                            }
                        }
                    }
                    continue;
                }
                let share = row.share.unwrap_or(WHOLE_SHARE);
                if row.share.is_some()
                    && (t.kind() != Kind::WithFlows || share == 0 || share > WHOLE_SHARE)
                {
                    return Err(snap_err(format!(
                        "{}: a row's share is out of range",
                        wt.name
                    )));
                }
                let present = match flow_of(k) {
                    Some(f) if t.kind() == Kind::PerFlow => t.flows.get(&f),
                    _ => t.rows.get(k.as_slice()),
                };
                match present {
                    // Configuration: this part's copy stays (it may be the newer one).
                    Some(_) if matches!(t.kind(), Kind::Read | Kind::Copy | Kind::Mirror) => {}
                    // A flow both parts hold (a late event raced the move): the row
                    // with the later deadline wins, in `apply`.
                    Some(_) if t.kind() == Kind::PerFlow => {}
                    // Copies of one row that a split made: they come together again.
                    Some(mine) if t.kind() == Kind::WithFlows && merge => {
                        if mine.value.as_slice() != row.value.as_slice() {
                            return Err(snap_err(format!(
                                "{}: a row is in both parts with different values",
                                wt.name
                            )));
                        }
                        let have = t.shares.get(k).copied().unwrap_or(WHOLE_SHARE);
                        if have.saturating_add(share) > WHOLE_SHARE {
                            return Err(snap_err(format!(
                                "{}: a row's copies add up to more than one whole (merged on both sides)",
                                wt.name
                            )));
                        }
                    }
                    Some(_) if merge => {
                        return Err(snap_err(format!(
                            "{}: a key is in both parts ({} writes it once)",
                            wt.name,
                            t.kind().name()
                        )))
                    }
                    Some(_) => {}
                    None => new_keys += 1,
                }
            }
            if t.max_rows.is_some_and(|m| t.len() + new_keys > m) {
                return Err(full());
            }
            let lanes = if t.lanes == 0 { wt.lanes } else { t.lanes };
            if (wt.lanes != 0 && wt.lanes != lanes)
                || wt
                    .counters
                    .iter()
                    .any(|(_, v)| v.len() != lanes || v.is_empty())
            {
                return Err(snap_err(format!("{}: counter lanes differ", wt.name)));
            }
            let new_counters = (wt.counters.iter())
                .filter(|(k, _)| !t.folded.contains_key(k) && !t.pending.contains_key(k))
                .count();
            if t.spill.is_none()
                && t.max_rows
                    .is_some_and(|m| t.counter_keys + new_counters > m)
            {
                return Err(full());
            }
        }
        Ok(())
    }

    /// Take in a part `check` accepted.
    fn apply(&mut self, wire: Wire) {
        for wt in wire.tables {
            let Some(t) = self.tables.get_mut(&wt.name) else {
                continue;
            };
            for (k, w) in wt.rows {
                let share = w.share.unwrap_or(WHOLE_SHARE);
                match (t.kind(), flow_of(&k)) {
                    (Kind::Pool, _) => {
                        let Ok(part) = pool_of(&wt.name, &w.value) else {
                            continue;
                        };
                        match t.pools.get_mut(&k) {
                            Some(mine) => mine.unite(&part),
                            None => _ = t.pools.insert(k, part),
                        }
                    }
                    (Kind::PerFlow, Some(f)) => {
                        let group = w.group.as_deref().map(Box::from);
                        let row = Row::from(w);
                        let later = |r: &Row| r.deadline_ms.get().unwrap_or(u64::MAX);
                        if t.flows.get(&f).is_none_or(|mine| later(mine) < later(&row)) {
                            t.insert_flow(f, row, group);
                        }
                    }
                    (Kind::PerFlow, None) => {}
                    (Kind::Read | Kind::Copy | Kind::Mirror, _)
                        if t.rows.contains_key(k.as_slice()) => {}
                    (Kind::WithFlows, _) => {
                        let have = if t.rows.contains_key(k.as_slice()) {
                            t.shares.get(&k).copied().unwrap_or(WHOLE_SHARE)
                        } else {
                            t.rows.insert(RowKey::from_slice(&k), Row::from(w));
                            0
                        };
                        let sum = have.saturating_add(share).min(WHOLE_SHARE);
                        if sum < WHOLE_SHARE {
                            t.shares.insert(k, sum);
                        } else {
                            t.shares.remove(&k);
                        }
                    }
                    _ => _ = t.rows.insert(RowKey::from_vec(k), Row::from(w)),
                }
            }
            if t.lanes == 0 {
                t.lanes = wt.lanes;
            }
            for (k, v) in wt.counters {
                let k = match (t.has_room(&k), &t.spill) {
                    (false, Some(s)) => s.clone(),
                    _ => k,
                };
                if !t.folded.contains_key(&k) && !t.pending.contains_key(&k) {
                    t.counter_keys += 1;
                }
                add_lanes(t.folded.entry(k).or_default(), &v);
            }
        }
        self.drop_own_from_mirrors();
    }

    #[allow(clippy::type_complexity)]
    fn encode(
        &self,
        mut rows: impl FnMut(&str, &Table) -> (Vec<(Vec<u8>, WireRow)>, Vec<(Vec<u8>, Vec<u64>)>),
    ) -> Result<Vec<u8>, NfError> {
        let tables = (self.tables.iter())
            .map(|(name, t)| {
                let (rows, counters) = rows(name, t);
                WireTable {
                    name: name.clone(),
                    kind: t.kind(),
                    rows,
                    counters,
                    lanes: t.lanes,
                }
            })
            .collect();
        postcard::to_extend(&Wire { tables }, MAGIC.to_vec()).map_err(snap_err)
    }

    /// Decode and check a snapshot or part against the declarations.
    fn decode(&self, b: &[u8]) -> Result<Wire, NfError> {
        let wire: Wire = if let Some(body) = b.strip_prefix(MAGIC.as_slice()) {
            whole(postcard::take_from_bytes(body).map_err(snap_err)?)?
        } else if let Some(body) = b.strip_prefix(MAGIC_V1.as_slice()) {
            let v1: WireV1 = whole(postcard::take_from_bytes(body).map_err(snap_err)?)?;
            v1.into()
        } else {
            return Err(snap_err(
                "not a platform-table snapshot (bad magic or version)",
            ));
        };
        if wire.tables.len() != self.tables.len() {
            return Err(snap_err(format!(
                "{} tables in the snapshot, {} declared",
                wire.tables.len(),
                self.tables.len()
            )));
        }
        for wt in &wire.tables {
            let t = self
                .tables
                .get(&wt.name)
                .ok_or_else(|| snap_err(format!("table {} is not declared", wt.name)))?;
            if t.kind() != wt.kind {
                return Err(snap_err(format!(
                    "table {} is {} here, {} in the snapshot",
                    wt.name,
                    t.kind().name(),
                    wt.kind.name()
                )));
            }
        }
        Ok(wire)
    }
}

/// How many flows use each with-flows row (by key).
type Uses = BTreeMap<Vec<u8>, u32>;

/// A decoded value with nothing after it.
fn whole<T>((v, rest): (T, &[u8])) -> Result<T, NfError> {
    if !rest.is_empty() {
        return Err(snap_err(format!("{} trailing bytes", rest.len())));
    }
    Ok(v)
}

/// A hash map's rows in key order: what reaches a decision or a snapshot's bytes.
fn sorted<V>(m: &SlabMap<RowKey, V>) -> Vec<(&RowKey, &V)> {
    let mut v: Vec<(&RowKey, &V)> = m.iter().collect();
    v.sort_unstable_by(|a, b| a.0.cmp(b.0));
    v
}

fn pool_rows<'a>(
    pools: impl Iterator<Item = (&'a Vec<u8>, &'a UnitSet)>,
) -> Vec<(Vec<u8>, WireRow)> {
    pools
        .map(|(k, p)| {
            let value = postcard::to_allocvec(&p.to_wire()).unwrap_or_default();
            let w = WireRow {
                value,
                deadline_ms: None,
                group: None,
                share: None,
            };
            (k.clone(), w)
        })
        .collect()
}

fn pool_of(table: &str, value: &[u8]) -> Result<UnitSet, NfError> {
    let w: PoolWire =
        postcard::from_bytes(value).map_err(|e| snap_err(format!("{table}: a pool row: {e}")))?;
    UnitSet::from_wire(&w).map_err(|e| snap_err(format!("{table}: {e}")))
}

impl Table {
    /// Keyed rows as parts carry them, in key order, with-flows rows with their shares.
    fn keyed_rows<'a>(
        &self,
        rows: impl Iterator<Item = (&'a RowKey, &'a Row)>,
    ) -> Vec<(Vec<u8>, WireRow)> {
        let mut rows: Vec<(&RowKey, &Row)> = rows.collect();
        rows.sort_unstable_by(|a, b| a.0.cmp(b.0));
        rows.into_iter()
            .map(|(k, r)| {
                let mut w = WireRow::from(r.clone());
                w.share = self.shares.get(k.as_slice()).copied();
                (k.to_vec(), w)
            })
            .collect()
    }
}

/// Tables whose rows `get` and `rows` read.
const READABLE: &[Kind] = &[
    Kind::Partitioned,
    Kind::WithFlows,
    Kind::Copy,
    Kind::Mirror,
    Kind::Read,
];

fn check_kind(table: &str, kind: Kind, op: &'static str, want: &[Kind]) -> Result<(), StateError> {
    if want.contains(&kind) {
        return Ok(());
    }
    Err(StateError::WrongKind {
        table: table.into(),
        kind: kind.name(),
        op,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_is_40_bytes_its_slot_needs_no_tag_and_an_opt_ms_keeps_every_time_but_the_last_two() {
        // A per-flow table faults in this much per flow at every replica: a value
        // inline (24 with smallvec's `union`) and two times (8 each). A group is kept
        // beside the rows (`Table::flow_groups`).
        assert_eq!(std::mem::size_of::<Row>(), 40);
        // The time's niche holds the slab slot's emptiness: a per-flow slot is the key,
        // the row and the slab's tag and generation, nothing more.
        assert_eq!(std::mem::size_of::<Option<(FlowKey, Row)>>(), 80);
        assert_eq!(std::mem::size_of::<Option<(RowKey, Row)>>(), 64);
        for t in [0, 1, 30_000, u64::MAX - 2] {
            assert_eq!(OptMs::some(t).get(), Some(t));
        }
        assert_eq!(OptMs::some(u64::MAX - 1).get(), Some(u64::MAX - 2));
        assert_eq!(OptMs::some(u64::MAX).get(), Some(u64::MAX - 2));
        assert_eq!(OptMs::new(None).get(), None);
        assert_eq!(OptMs::NONE.get(), None);
    }

    #[test]
    fn keys_and_values_are_postcards_bytes_on_either_side_of_the_stack_buffer() {
        let short = (7u32, "a", Some(3u16));
        let want = postcard::to_allocvec(&short).expect("short");
        assert_eq!(enc("t", &short).as_deref(), Ok(&want[..]));
        assert_eq!(enc_value("t", &short).as_deref(), Ok(&want[..]));
        // Byte strings whose postcard form (a one- or two-byte length, then the bytes)
        // is just under, at and over the buffer, and far over it.
        for n in [ENC_STACK - 2, ENC_STACK - 1, ENC_STACK, 3 * ENC_STACK] {
            let v: Vec<u8> = (0..=255).cycle().take(n).collect();
            let want = postcard::to_allocvec(&v).expect("bytes");
            assert_eq!(enc("t", &v).as_deref(), Ok(&want[..]), "{n} bytes");
            assert_eq!(enc_value("t", &v).as_deref(), Ok(&want[..]), "{n} bytes");
        }
    }

    #[test]
    fn a_counter_lookup_answers_as_the_map_does_for_the_empty_key_and_the_others() {
        let mut m: BTreeMap<Vec<u8>, Vec<u64>> = BTreeMap::new();
        assert_eq!(counter_of(&m, &[]), None);
        m.insert(vec![3], vec![30]);
        // Without the empty key, its lookup must not answer with the first row.
        assert_eq!(counter_of(&m, &[]), None);
        assert_eq!(counter_mut(&mut m, &[]), None);
        m.insert(Vec::new(), vec![1]);
        m.insert(vec![0], vec![2]);
        for k in [&[][..], &[0], &[3], &[9]] {
            assert_eq!(counter_of(&m, k), m.get(k), "key {k:?}");
        }
        if let Some(v) = counter_mut(&mut m, &[]) {
            v[0] += 10;
        }
        assert_eq!(m.get(&Vec::new()), Some(&vec![11]));
        // Through the table: adds under `()` sum, before and after a fold.
        let mut t = StateTables::create(&specs()).expect("tables");
        t.add("hits", &(), &[1, 2]).expect("add");
        t.add("hits", &(), &[1, 2]).expect("add");
        assert_eq!(t.counter("hits", &()).expect("read"), vec![2, 4]);
        t.fold(5);
        t.add("hits", &(), &[1, 0]).expect("add");
        assert_eq!(t.counter("hits", &()).expect("read"), vec![3, 4]);
        assert_eq!(t.len("hits").expect("len"), 1);
    }

    fn specs() -> Vec<TableSpec> {
        vec![
            TableSpec::per_flow("conns"),
            TableSpec::shared_write("ports", Consistency::Partitioned),
            TableSpec::shared_write("hits", Consistency::Replicated),
            TableSpec::shared_read("acl"),
        ]
    }

    fn flow(i: u16) -> FlowKey {
        format!("100 tcp 198.18.0.2:{} > 198.19.0.1:80", 1000 + i)
            .parse()
            .expect("flow")
    }

    const HALF: SplitHalf = SplitHalf {
        moved_lo: 0,
        moved_hi: u64::MAX / 2,
    };

    #[test]
    fn wrong_writes_are_typed_errors_and_change_nothing() {
        let mut s = StateTables::create(&specs()).expect("tables");
        s.put_flow("conns", &flow(1), &7u32).expect("put");
        let before = s.snapshot().expect("snapshot");
        assert_eq!(
            s.put("nope", &1u8, &1u8),
            Err(StateError::NoSuchTable {
                table: "nope".into()
            })
        );
        assert_eq!(
            s.add("ports", &1u16, &[1]),
            Err(StateError::MultiWriterWrite {
                table: "ports".into()
            })
        );
        assert_eq!(
            s.add("conns", &1u16, &[1]),
            Err(StateError::MultiWriterWrite {
                table: "conns".into()
            })
        );
        assert_eq!(
            s.put("hits", &1u16, &1u64),
            Err(StateError::SingleWriterWrite {
                table: "hits".into()
            })
        );
        assert_eq!(
            s.put("acl", &1u16, &1u64),
            Err(StateError::ReadOnly {
                table: "acl".into()
            })
        );
        assert!(matches!(
            s.put_flow("ports", &flow(2), &1u8),
            Err(StateError::WrongKind { op: "put_flow", .. })
        ));
        assert!(matches!(
            s.get::<_, u8>("conns", &1u8),
            Err(StateError::WrongKind { op: "get", .. })
        ));
        s.add("hits", &1u16, &[1, 2]).expect("add");
        assert!(matches!(
            s.add("hits", &1u16, &[1]),
            Err(StateError::Lanes {
                got: 1,
                want: 2,
                ..
            })
        ));
        assert!(matches!(
            s.get_flow::<String>("conns", &flow(1)),
            Err(StateError::Value { .. })
        ));
        s.fold(0);
        let mut clean = StateTables::create(&specs()).expect("tables");
        clean.restore(&before).expect("restore");
        clean.add("hits", &1u16, &[1, 2]).expect("add");
        assert_eq!(s.snapshot(), clean.snapshot(), "only the good add counted");
        let twice = [TableSpec::per_flow("a"), TableSpec::per_flow("a")];
        assert!(StateTables::create(&twice).is_err());
        let NfError::State(m) = NfError::from(StateError::NoSuchTable { table: "x".into() }) else {
            panic!("a state error")
        };
        assert!(m.contains("never declared"), "{m}");
    }

    #[test]
    fn a_shared_rows_slot_is_its_own_while_it_lives() {
        let mut s = StateTables::create(&specs()).expect("tables");
        let mut slots = Vec::new();
        for p in 0..1500u16 {
            let (slot, new) = s.put_slot("ports", &p, &u32::from(p)).expect("put");
            assert!(new);
            slots.push(slot);
        }
        // Rows placed since, and growth of the index past them, moved no row.
        for (p, &slot) in slots.iter().enumerate() {
            let p = p as u16;
            assert_eq!(s.slot("ports", &p), Ok(Some(slot)));
            assert_eq!(s.at::<u16, u32>("ports", slot), Ok(Some((p, u32::from(p)))));
        }
        // A put to a row that is there replaces it in place.
        assert_eq!(s.put_slot("ports", &7u16, &70u32), Ok((slots[7], false)));
        assert_eq!(s.at::<u16, u32>("ports", slots[7]), Ok(Some((7, 70))));
        // A deleted row's slot holds nothing until a later row takes it.
        assert_eq!(s.delete("ports", &9u16), Ok(true));
        assert_eq!(s.slot("ports", &9u16), Ok(None));
        assert_eq!(s.at::<u16, u32>("ports", slots[9]), Ok(None));
        assert_eq!(s.at::<u16, u32>("ports", u32::MAX), Ok(None));
        // Per-flow and counter tables have no rows by slot.
        assert!(matches!(
            s.slot("conns", &1u8),
            Err(StateError::WrongKind { op: "slot", .. })
        ));
        assert!(matches!(
            s.at::<u8, u8>("hits", 0),
            Err(StateError::WrongKind { op: "at", .. })
        ));
        assert!(matches!(
            s.at::<String, u32>("ports", slots[1]),
            Err(StateError::Value { .. })
        ));
    }

    #[test]
    fn untethered_adds_and_bounded_staleness() {
        let mut s = StateTables::create(&specs()).expect("tables");
        s.add("hits", &"a", &[1, 10]).expect("add");
        assert_eq!(
            s.counter("hits", &"a"),
            Ok(vec![1, 10]),
            "a fresh read sees it"
        );
        assert_eq!(
            s.counter_stale("hits", &"a", 50, 100),
            Ok(vec![0, 0]),
            "a stale read within its bound answers from the folded copy"
        );
        assert_eq!(
            s.counter_stale("hits", &"a", 150, 100),
            Ok(vec![1, 10]),
            "past the bound it folds first"
        );
        s.add("hits", &"a", &[u64::MAX, 1]).expect("add");
        assert_eq!(
            s.counter("hits", &"a"),
            Ok(vec![u64::MAX, 11]),
            "saturating"
        );
        assert_eq!(s.counter("hits", &"never"), Ok(vec![0, 0]));
        // Replicas that folded at different times serialise alike.
        let mut other = StateTables::create(&specs()).expect("tables");
        other.add("hits", &"a", &[1, 10]).expect("add");
        other.add("hits", &"a", &[u64::MAX, 1]).expect("add");
        assert_eq!(s.snapshot(), other.snapshot());
    }

    #[test]
    fn split_and_merge_follow_the_declarations() {
        let mut a = StateTables::create(&specs()).expect("tables");
        for i in 0..64 {
            a.put_flow("conns", &flow(i), &u32::from(i)).expect("put");
            a.put("ports", &i, &(u32::from(i) * 2)).expect("put");
        }
        a.load("acl", &"allow", &true).expect("load");
        a.add("hits", &"h", &[5]).expect("add");
        let part = a.split(&HALF).expect("split");
        let mut b = StateTables::create(&specs()).expect("tables");
        b.restore(&part).expect("restore");
        let (fa, fb) = (a.len("conns").unwrap(), b.len("conns").unwrap());
        assert_eq!(fa + fb, 64);
        assert!(fa > 10 && fb > 10, "{fa} {fb}");
        for (f, _) in b.flows::<u32>("conns").unwrap() {
            assert!(HALF.moves(&f));
        }
        let (pa, pb) = (a.len("ports").unwrap(), b.len("ports").unwrap());
        assert_eq!(pa + pb, 64);
        assert!(pa > 10 && pb > 10, "{pa} {pb}");
        assert_eq!(
            b.get("acl", &"allow"),
            Ok(Some(true)),
            "read tables are copied"
        );
        assert_eq!(
            b.counter("hits", &"h"),
            Ok(vec![0]),
            "counters start at zero"
        );
        b.add("hits", &"h", &[2]).expect("add");
        assert_eq!(b.flow_hashes().len(), fb);
        // Merge back: the union, and the counters' sum.
        let whole = b.snapshot().expect("snapshot");
        a.merge(&whole).expect("merge");
        assert_eq!(a.len("conns"), Ok(64));
        assert_eq!(a.len("ports"), Ok(64));
        assert_eq!(a.counter("hits", &"h"), Ok(vec![7]));
        // A key in both parts of a single-writer table is refused, and changes nothing.
        let snap = a.snapshot().expect("snapshot");
        assert!(a.merge(&whole).is_err());
        assert_eq!(a.snapshot().expect("snapshot"), snap);
        // A flow in both parts keeps the row with the later timer.
        let only_flows = |v: u32, deadline: u64| {
            let mut t = StateTables::create(&specs()).expect("tables");
            t.put_flow("conns", &flow(1), &v).expect("put");
            t.set_timer("conns", &flow(1), deadline).expect("timer");
            t
        };
        let mut x = only_flows(1, 500);
        x.merge(&only_flows(2, 900).snapshot().unwrap())
            .expect("merge");
        x.merge(&only_flows(3, 100).snapshot().unwrap())
            .expect("merge");
        assert_eq!(x.get_flow("conns", &flow(1)), Ok(Some(2u32)));
        assert_eq!(x.timer("conns", &flow(1)), Ok(Some(900)));
        // A part decoded ahead (off the request stream) merges the same.
        let mut y = only_flows(1, 500);
        let prepared = y.merge_decoder()(&only_flows(2, 900).snapshot().unwrap()).unwrap();
        y.check_prepared(&prepared).expect("check");
        y.merge_prepared(prepared).expect("merge");
        assert_eq!(y.snapshot(), x.snapshot());
        assert!(y.merge_decoder()(b"SFT1junk").is_err());
        // split_flows leaves shared tables whole.
        let part = a.split_flows(&HALF).expect("split");
        assert_eq!(a.len("ports"), Ok(64));
        let mut c = StateTables::create(&specs()).expect("tables");
        c.restore(&part).expect("restore");
        assert_eq!(c.len("ports"), Ok(0));
        assert_eq!(a.len("conns").unwrap() + c.len("conns").unwrap(), 64);
    }

    #[test]
    fn corrupt_or_foreign_snapshots_are_refused_and_change_nothing() {
        let mut a = StateTables::create(&specs()).expect("tables");
        a.put_flow("conns", &flow(1), &1u8).expect("put");
        let good = a.snapshot().expect("snapshot");
        let other = StateTables::create(&[TableSpec::per_flow("conns")]).expect("tables");
        let foreign = other.snapshot().expect("snapshot");
        let renamed = StateTables::create(&[
            TableSpec::per_flow("conns"),
            TableSpec::shared_write("ports", Consistency::Replicated),
            TableSpec::shared_write("hits", Consistency::Replicated),
            TableSpec::shared_read("acl"),
        ])
        .expect("tables")
        .snapshot()
        .expect("snapshot");
        let mut truncated = good.clone();
        truncated.truncate(good.len() - 3);
        let mut trailing = good.clone();
        trailing.push(0);
        for bad in [&b"{}"[..], b"", &truncated, &trailing, &foreign, &renamed] {
            assert!(a.restore(bad).is_err(), "{bad:?}");
            assert!(a.merge(bad).is_err(), "{bad:?}");
            assert_eq!(a.snapshot().expect("snapshot"), good);
        }
        let mut fresh = StateTables::create(&specs()).expect("tables");
        fresh
            .restore(&good)
            .expect("a replica rejoins by a fresh snapshot");
        assert_eq!(fresh.snapshot().expect("snapshot"), good);
    }

    #[test]
    fn group_counts_follow_the_rows_everywhere() {
        let mut a = StateTables::create(&specs()).expect("tables");
        for i in 0..40 {
            a.put_flow_in("conns", &flow(i), &(i % 2), &())
                .expect("put");
        }
        assert_eq!(a.count_group("conns", &0u16), Ok(20));
        a.put_flow_in("conns", &flow(0), &1u16, &())
            .expect("regroup");
        assert_eq!(a.count_group("conns", &0u16), Ok(19));
        assert_eq!(a.count_group("conns", &1u16), Ok(21));
        assert_eq!(a.delete_flow("conns", &flow(1)), Ok(true));
        a.set_timer("conns", &flow(3), 10).expect("timer");
        assert_eq!(a.expire(10), vec![flow(3)]);
        assert_eq!(a.count_group("conns", &1u16), Ok(19));
        let whole = a.snapshot().expect("snapshot");
        let part = a.split(&HALF).expect("split");
        let mut b = StateTables::create(&specs()).expect("tables");
        b.restore(&part).expect("restore");
        for g in [0u16, 1] {
            let (x, y) = (a.count_group("conns", &g), b.count_group("conns", &g));
            assert_eq!(x.unwrap() + y.unwrap(), 19, "group {g}");
        }
        a.merge(&b.snapshot().expect("snapshot")).expect("merge");
        assert_eq!(a.snapshot().expect("snapshot"), whole);
        assert_eq!(a.count_group("conns", &0u16), Ok(19));
        assert!(a.count_group("ports", &0u16).is_err());
    }

    proptest::proptest! {
        /// The queue pops what a min-heap of (deadline, slot) pops, each deadline whole,
        /// whatever order the entries went in.
        #[test]
        fn timer_queue_pops_in_heap_order(
            entries in proptest::collection::vec((0u64..40, 0u16..30), 0..300),
            cut in 0u64..45,
        ) {
            let mut q = TimerQueue::default();
            let mut heap = std::collections::BinaryHeap::new();
            for (at, i) in &entries {
                let k = u32::from(*i);
                q.push(*at, k);
                heap.push(std::cmp::Reverse((*at, k)));
            }
            let mut popped = Vec::new();
            while let Some((at, mut due)) = q.pop_due(cut) {
                // The table orders a due list itself (by the rows' keys).
                due.sort_unstable();
                popped.extend(due.into_iter().map(|k| (at, k)));
            }
            let mut want = Vec::new();
            while heap.peek().is_some_and(|e| e.0 .0 <= cut) {
                want.extend(heap.pop().map(|e| e.0));
            }
            proptest::prop_assert_eq!(&popped, &want);
            proptest::prop_assert_eq!(q.len(), heap.len());
        }
    }

    #[derive(Debug, Clone)]
    enum TimerOp {
        Put(u16, u64),
        PutUntimed(u16),
        PutIn(u16, u8),
        SetTimer(u16, u64),
        Delete(u16),
        Expire(u64),
        Split,
        Restore,
    }

    fn timer_op() -> impl proptest::strategy::Strategy<Value = TimerOp> {
        use proptest::prelude::*;
        prop_oneof![
            6 => (0u16..40, 0u64..60).prop_map(|(i, d)| TimerOp::Put(i, d)),
            1 => (0u16..40).prop_map(TimerOp::PutUntimed),
            2 => (0u16..40, 0u8..3).prop_map(|(i, g)| TimerOp::PutIn(i, g)),
            3 => (0u16..40, 0u64..60).prop_map(|(i, d)| TimerOp::SetTimer(i, d)),
            2 => (0u16..40).prop_map(TimerOp::Delete),
            3 => (0u64..8).prop_map(TimerOp::Expire),
            1 => Just(TimerOp::Split),
            1 => Just(TimerOp::Restore),
        ]
    }

    proptest::proptest! {
        /// Timers name rows by slot, and slots are reused and renumbered (a delete and a
        /// put, a split, a restore): against a model of deadlines by key, every expiry
        /// removes exactly the rows whose deadline passed, in key order, and a replica
        /// that restored from a snapshot (other slots) expires the same flows. Groups,
        /// kept beside the rows, follow them through all of it.
        #[test]
        fn timers_by_slot_expire_what_a_model_of_deadlines_by_key_expires(
            ops in proptest::collection::vec(timer_op(), 0..200),
        ) {
            use std::collections::BTreeMap;
            let mut a = StateTables::create(&specs()).expect("tables");
            let mut b = StateTables::create(&specs()).expect("tables");
            // Rows in the model: key → deadline (None: no timer).
            let mut model: BTreeMap<[u8; FlowKey::LEN], Option<u64>> = BTreeMap::new();
            let mut groups: BTreeMap<[u8; FlowKey::LEN], u8> = BTreeMap::new();
            let k = |i: u16| *flow(i).as_bytes();
            let mut now = 0u64;
            for op in ops {
                match op {
                    TimerOp::Put(i, d) => {
                        let d = now + d;
                        for s in [&mut a, &mut b] {
                            s.put_flow_timed("conns", &flow(i), &u32::from(i), d).expect("put");
                        }
                        model.insert(k(i), Some(d));
                        groups.remove(&k(i));
                    }
                    TimerOp::PutUntimed(i) => {
                        for s in [&mut a, &mut b] {
                            s.put_flow("conns", &flow(i), &u32::from(i)).expect("put");
                        }
                        // A put without a deadline keeps the row's timer; one without
                        // a group takes the row out of its group.
                        model.entry(k(i)).or_insert(None);
                        groups.remove(&k(i));
                    }
                    TimerOp::PutIn(i, g) => {
                        for s in [&mut a, &mut b] {
                            s.put_flow_in("conns", &flow(i), &g, &u32::from(i)).expect("put");
                        }
                        model.entry(k(i)).or_insert(None);
                        groups.insert(k(i), g);
                    }
                    TimerOp::SetTimer(i, d) => {
                        let d = now + d;
                        let had = model.contains_key(&k(i));
                        for s in [&mut a, &mut b] {
                            proptest::prop_assert_eq!(
                                s.set_timer("conns", &flow(i), d).expect("timer"),
                                had
                            );
                        }
                        if let Some(m) = model.get_mut(&k(i)) {
                            *m = Some(d);
                        }
                    }
                    TimerOp::Delete(i) => {
                        let had = model.remove(&k(i)).is_some();
                        groups.remove(&k(i));
                        for s in [&mut a, &mut b] {
                            proptest::prop_assert_eq!(s.delete_flow("conns", &flow(i)), Ok(had));
                        }
                    }
                    TimerOp::Expire(step) => {
                        now += step;
                        let want: Vec<FlowKey> = (model.iter())
                            .filter(|(_, d)| d.is_some_and(|d| d <= now))
                            .map(|(k, _)| FlowKey::from_bytes(*k))
                            .collect();
                        model.retain(|_, d| d.is_none_or(|d| d > now));
                        groups.retain(|k, _| model.contains_key(k));
                        let got = a
                            .expire_flows::<u32>("conns", now)
                            .expect("expire")
                            .into_iter()
                            .map(|(k, _)| k)
                            .collect::<Vec<_>>();
                        proptest::prop_assert_eq!(&got, &want);
                        proptest::prop_assert_eq!(b.expire(now), want);
                    }
                    TimerOp::Split => {
                        // The half that leaves is dropped from the model and from both.
                        for s in [&mut a, &mut b] {
                            s.split_flows(&HALF).expect("split");
                        }
                        model.retain(|k, _| !HALF.moves(&FlowKey::from_bytes(*k)));
                        groups.retain(|k, _| model.contains_key(k));
                    }
                    TimerOp::Restore => {
                        let snap = b.snapshot().expect("snapshot");
                        b = StateTables::create(&specs()).expect("tables");
                        b.restore(&snap).expect("restore");
                    }
                }
                let rows: Vec<FlowKey> = model.keys().map(|k| FlowKey::from_bytes(*k)).collect();
                let of = |s: &StateTables| -> Vec<FlowKey> {
                    s.flows::<u32>("conns").expect("flows").into_iter().map(|(k, _)| k).collect()
                };
                proptest::prop_assert_eq!(of(&a), rows.clone());
                proptest::prop_assert_eq!(of(&b), rows);
                for g in 0u8..3 {
                    let want = groups.values().filter(|&&x| x == g).count();
                    proptest::prop_assert_eq!(a.count_group("conns", &g), Ok(want));
                    proptest::prop_assert_eq!(b.count_group("conns", &g), Ok(want));
                }
                for (key, d) in &model {
                    let key = FlowKey::from_bytes(*key);
                    proptest::prop_assert_eq!(a.timer("conns", &key), Ok(*d));
                }
            }
        }
    }

    #[test]
    fn lazy_timers_fire_at_the_latest_deadline_with_one_live_entry_per_row() {
        let mut s = StateTables::create(&specs()).expect("tables");
        let queued = |s: &StateTables| s.tables.get("conns").map_or(0, |t| t.timers.len());
        s.put_flow_timed("conns", &flow(1), &1u8, 100).expect("put");
        for d in (200..=2000).step_by(100) {
            s.set_timer("conns", &flow(1), d).expect("timer");
        }
        assert_eq!(queued(&s), 1, "moving a deadline later queues nothing");
        assert!(s.expire(1999).is_empty());
        assert_eq!(s.expire(2000), vec![flow(1)]);
        s.put_flow_timed("conns", &flow(2), &1u8, 1000)
            .expect("put");
        s.set_timer("conns", &flow(2), 500).expect("earlier");
        assert!(s.expire(499).is_empty());
        assert_eq!(s.expire(500), vec![flow(2)]);
        assert!(
            s.expire(1000).is_empty(),
            "the orphaned entry fires nothing"
        );
        s.put_flow_timed("conns", &flow(3), &1u8, 3000)
            .expect("put");
        s.delete_flow("conns", &flow(3)).expect("delete");
        s.put_flow_timed("conns", &flow(3), &2u8, 3000)
            .expect("again");
        assert_eq!(s.expire(3000), vec![flow(3)]);
        assert_eq!(s.len("conns"), Ok(0));
        assert_eq!(queued(&s), 0, "every entry fired or was dropped");
    }

    #[test]
    fn timers_expire_flows_and_capacity_bounds_tables() {
        let mut s = StateTables::create(&specs()).expect("tables");
        s.put_flow("conns", &flow(1), &1u8).expect("put");
        s.put_flow("conns", &flow(2), &2u8).expect("put");
        assert_eq!(s.set_timer("conns", &flow(1), 50), Ok(true));
        assert_eq!(s.set_timer("conns", &flow(1), 100), Ok(true), "moved later");
        assert_eq!(s.set_timer("conns", &flow(9), 100), Ok(false));
        s.put_flow("conns", &flow(1), &7u8)
            .expect("a new value keeps the timer");
        assert!(s.expire(60).is_empty(), "the old deadline is gone");
        assert!(s.expire(99).is_empty());
        assert_eq!(s.expire(100), vec![flow(1)]);
        assert_eq!(s.len("conns"), Ok(1));
        s.set_capacity::<u8>("conns", 1, None).expect("cap");
        assert!(matches!(
            s.put_flow("conns", &flow(3), &3u8),
            Err(StateError::Full { max_rows: 1, .. })
        ));
        s.put_flow("conns", &flow(2), &9u8)
            .expect("a present key may change");
        s.set_capacity("hits", 2, Some(&"other")).expect("cap");
        for h in ["a", "b", "c", "d"] {
            s.add("hits", &h, &[1]).expect("add spills");
        }
        assert_eq!(s.len("hits"), Ok(3), "a, b and the spill key");
        assert_eq!(s.counter("hits", &"other"), Ok(vec![2]));
        assert!(s.set_capacity("ports", 1, Some(&"x")).is_err());
    }

    /// A NAT's shape: flows that each use one or two mappings, mappings holding ports of
    /// a pool, and a pairing both parts keep.
    fn nat_specs() -> Vec<TableSpec> {
        vec![
            TableSpec::per_flow("flows"),
            TableSpec::shared_write("maps", Consistency::Partitioned)
                .split_by(SplitRule::WithFlows),
            TableSpec::shared_write("pool", Consistency::Partitioned).split_by(SplitRule::Pool),
            TableSpec::shared_write("pair", Consistency::Partitioned).split_by(SplitRule::Copy),
        ]
    }

    /// A flow row is the list of mapping keys (u16 ports) it uses.
    fn nat_refs(v: &[u8]) -> SmallVec<[Vec<u8>; 2]> {
        let ports: Vec<u16> = postcard::from_bytes(v).unwrap_or_default();
        ports
            .iter()
            .filter_map(|p| postcard::to_allocvec(p).ok())
            .collect()
    }

    fn nat() -> StateTables {
        let mut s = StateTables::create(&nat_specs()).expect("tables");
        s.set_refs("maps", "flows", nat_refs).expect("refs");
        s.pool_define("pool", &1u8, 100, 299, true).expect("pool");
        s
    }

    #[test]
    fn split_rules_are_checked_at_declaration() {
        assert!(TableSpec::per_flow("f")
            .split_by(SplitRule::Pool)
            .validate()
            .is_err());
        assert!(TableSpec::shared_read("r")
            .split_by(SplitRule::Copy)
            .validate()
            .is_err());
        let multi = TableSpec::shared_write("c", Consistency::Replicated);
        assert!(multi.split_by(SplitRule::WithFlows).validate().is_err());
        assert!(TableSpec::per_flow("m")
            .split_by(SplitRule::WithFlows)
            .validate()
            .is_ok());
        let mut s = nat();
        assert!(matches!(
            s.set_refs("flows", "maps", nat_refs),
            Err(StateError::WrongKind { .. })
        ));
        assert!(matches!(
            s.add("pool", &1u8, &[1]),
            Err(StateError::MultiWriterWrite { .. })
        ));
        assert!(matches!(
            s.put("pool", &1u8, &1u8),
            Err(StateError::WrongKind { .. })
        ));
        assert!(
            s.pool_define("pool", &1u8, 100, 200, true).is_err(),
            "range changed"
        );
        s.pool_define("pool", &1u8, 100, 299, true)
            .expect("same range again");
        assert_eq!(s.pool_free("pool", &1u8), Ok(200));
    }

    #[test]
    fn pools_halve_their_free_units_and_unite_again() {
        let mut a = nat();
        let mut rng = DetRng::new(1);
        let got = a.pool_alloc("pool", &1u8, 150, &mut rng).expect("alloc");
        assert_eq!(got.map(|g| (g.unit, g.preserved)), Some((150, true)));
        let mut b = nat();
        b.restore(&a.split(&HALF).expect("split")).expect("restore");
        let (fa, fb) = (
            a.pool_free("pool", &1u8).unwrap(),
            b.pool_free("pool", &1u8).unwrap(),
        );
        assert_eq!((fa, fb), (100, 99));
        let pa = a.pool("pool", &1u8).unwrap().unwrap().clone();
        let pb = b.pool("pool", &1u8).unwrap().unwrap().clone();
        assert_eq!(pa.overlap(&pb), None);
        assert!(
            !pa.is_free(150) && !pb.is_free(150),
            "the unit in use is nobody's"
        );
        // Each part allocates from its own half only.
        for _ in 0..99 {
            assert!(b.pool_alloc("pool", &1u8, 0, &mut rng).unwrap().is_some());
        }
        assert_eq!(
            b.pool_alloc("pool", &1u8, 0, &mut rng),
            Ok(None),
            "b is out"
        );
        assert!(b.pool_put("pool", &1u8, 299).unwrap());
        assert!(!b.pool_put("pool", &1u8, 299).unwrap(), "free twice");
        // Merged with itself, every free unit would be owned twice.
        let before = a.snapshot().unwrap();
        let err = a.merge(&before).unwrap_err().to_string();
        assert!(err.contains("free on both sides"), "{err}");
        assert_eq!(a.snapshot().unwrap(), before);
        a.merge(&b.snapshot().unwrap()).expect("merge");
        assert_eq!(a.pool_free("pool", &1u8), Ok(101));
        // split_flows leaves the pool alone.
        let mut c = nat();
        let part = a.split_flows(&HALF).unwrap();
        c.restore(&part).unwrap();
        assert_eq!(a.pool_free("pool", &1u8), Ok(101));
        assert_eq!(c.pools::<u8>("pool").unwrap().len(), 0);
    }

    #[test]
    fn with_flows_rows_follow_their_flows_and_split_their_share() {
        let mut a = nat();
        let f = |i| flow(i);
        // Find one flow on each side of HALF.
        let go = (0..200).find(|&i| HALF.moves(&f(i))).unwrap();
        let stay = (0..200).find(|&i| !HALF.moves(&f(i))).unwrap();
        let go2 = (go + 1..300).find(|&i| HALF.moves(&f(i))).unwrap();
        a.put("maps", &7u16, &"shared").unwrap();
        a.put("maps", &8u16, &"only-moving").unwrap();
        a.put("maps", &9u16, &"only-staying").unwrap();
        a.put("maps", &10u16, &"unused").unwrap();
        a.put("pair", &1u8, &"pref").unwrap();
        a.put_flow("flows", &f(go), &vec![7u16, 8]).unwrap();
        a.put_flow("flows", &f(go2), &vec![8u16]).unwrap();
        a.put_flow("flows", &f(stay), &vec![7u16, 9]).unwrap();
        let mut b = nat();
        b.restore(&a.split(&HALF).unwrap()).unwrap();
        let keys = |s: &StateTables| {
            s.rows::<u16, String>("maps")
                .unwrap()
                .into_iter()
                .map(|(k, _)| k)
                .collect::<Vec<_>>()
        };
        assert_eq!(keys(&a), vec![7, 9, 10]);
        assert_eq!(keys(&b), vec![7, 8]);
        assert_eq!(a.share("maps", &7u16), Ok(Some(WHOLE_SHARE / 2)));
        assert_eq!(b.share("maps", &7u16), Ok(Some(WHOLE_SHARE / 2)));
        assert_eq!(b.share("maps", &8u16), Ok(Some(WHOLE_SHARE)), "moved whole");
        assert_eq!(a.share("maps", &9u16), Ok(Some(WHOLE_SHARE)));
        assert_eq!(
            b.get::<u8, String>("pair", &1).unwrap().as_deref(),
            Some("pref")
        );
        assert_eq!(
            a.get::<u8, String>("pair", &1).unwrap().as_deref(),
            Some("pref")
        );
        // A copy's value must match, and copies never add up past one whole.
        let twice = b.snapshot().unwrap();
        let mut c = a.clone();
        c.merge(&twice).expect("the copies reunite");
        assert_eq!(c.share("maps", &7u16), Ok(Some(WHOLE_SHARE)));
        let before = c.snapshot().unwrap();
        let err = c.merge(&twice).unwrap_err().to_string();
        assert!(err.contains("more than one whole"), "{err}");
        assert_eq!(c.snapshot().unwrap(), before, "refused, unchanged");
        let mut d = a.clone();
        d.put("maps", &7u16, &"other").unwrap();
        let err = d.merge(&twice).unwrap_err().to_string();
        assert!(err.contains("different values"), "{err}");
        // Snapshots carry shares: a restored copy knows it is not whole.
        let mut e = nat();
        e.restore(&a.snapshot().unwrap()).unwrap();
        assert_eq!(e.share("maps", &7u16), Ok(Some(WHOLE_SHARE / 2)));
        // Gradual migration moves with-flows rows too.
        let mut g = nat();
        g.restore(
            &b.split_flows(&SplitHalf {
                moved_lo: 0,
                moved_hi: u64::MAX,
            })
            .unwrap(),
        )
        .unwrap();
        assert_eq!(keys(&g), vec![7, 8]);
        assert!(keys(&b).is_empty());
    }

    #[test]
    fn parts_of_the_older_format_are_still_taken() {
        let mut a = StateTables::create(&specs()).expect("tables");
        a.put_flow_timed("conns", &flow(1), &7u32, 99).unwrap();
        a.put("ports", &5u16, &6u16).unwrap();
        a.add("hits", &1u8, &[3]).unwrap();
        // The same state, written as SFT1 wrote it.
        let snap = a.snapshot().unwrap();
        let wire: Wire = whole(postcard::take_from_bytes(&snap[4..]).unwrap()).unwrap();
        let v1: WireV1 = wire.map_rows(|r| WireRowV1 {
            value: r.value,
            deadline_ms: r.deadline_ms,
            group: r.group,
        });
        let old = postcard::to_extend(&v1, MAGIC_V1.to_vec()).unwrap();
        let mut b = StateTables::create(&specs()).expect("tables");
        b.restore(&old).expect("an SFT1 snapshot");
        assert_eq!(b.snapshot().unwrap(), snap);
    }

    #[test]
    fn mirrored_writes_go_out_imports_come_in_and_a_split_copies_the_table() {
        let specs = [TableSpec::mirror("m"), TableSpec::shared_read("acl")];
        let mut a = StateTables::create(&specs).expect("tables");
        a.put("m", &0u16, &"zero").unwrap();
        assert!(
            a.take_mirror().is_empty(),
            "not sent until the platform asks"
        );
        a.set_mirror_sending(true);
        a.put("m", &1u16, &"one").unwrap();
        a.put("m", &2u16, &"two").unwrap();
        assert!(a.delete("m", &2u16).unwrap());
        assert!(
            !a.delete("m", &9u16).unwrap(),
            "nothing to delete: nothing sent"
        );
        let out = a.take_mirror();
        assert_eq!(out.len(), 3);
        assert_eq!(
            (out[2].deleted, &out[2].value),
            (true, &postcard::to_allocvec(&"two").unwrap())
        );
        assert!(a.take_mirror().is_empty(), "taken once");

        // Another partition applies them, sends nothing on, and reads the rows.
        let mut b = StateTables::create(&specs).expect("tables");
        b.set_mirror_sending(true);
        assert_eq!(b.import_mirror(&out), (3, 0));
        assert!(b.take_mirror().is_empty());
        assert_eq!(
            b.get::<_, String>("m", &1u16).unwrap().as_deref(),
            Some("one")
        );
        assert_eq!(b.get::<_, String>("m", &2u16).unwrap(), None);

        // A delete removes only the row it names: a newer row under the key (put by
        // another partition, arrived first) stays.
        b.import_mirror(&[MirrorWrite {
            table: "m".into(),
            key: postcard::to_allocvec(&1u16).unwrap(),
            value: postcard::to_allocvec(&"older").unwrap(),
            deleted: true,
        }]);
        assert_eq!(
            b.get::<_, String>("m", &1u16).unwrap().as_deref(),
            Some("one")
        );
        // A write for a table that is not mirrored here is skipped; the rest land.
        let stray = MirrorWrite {
            table: "acl".into(),
            ..out[0].clone()
        };
        let mut three = out[0].clone();
        three.key = postcard::to_allocvec(&3u16).unwrap();
        assert_eq!(b.import_mirror(&[stray, three]), (1, 1));

        // A split copies the mirror to both parts; a merge keeps this part's rows and
        // adds the others'. Neither sends anything.
        let part = b
            .split(&SplitHalf {
                moved_lo: 0,
                moved_hi: u64::MAX,
            })
            .unwrap();
        let mut c = StateTables::create(&specs).expect("tables");
        c.restore(&part).unwrap();
        assert_eq!(c.rows::<u16, String>("m").unwrap().len(), 2);
        assert_eq!(b.rows::<u16, String>("m").unwrap().len(), 2);
        c.put("m", &4u16, &"four").unwrap();
        c.take_mirror();
        b.merge(&c.snapshot().unwrap()).unwrap();
        assert_eq!(b.rows::<u16, String>("m").unwrap().len(), 3);
        assert!(b.take_mirror().is_empty() && c.take_mirror().is_empty());
        // Only the mirrored table takes `put` from the platform's import; the NF's
        // own `put` on a read table is still refused.
        assert!(matches!(
            a.put("acl", &1u16, &"x"),
            Err(StateError::ReadOnly { .. })
        ));
    }

    #[test]
    fn a_shadow_mirror_holds_the_other_parts_source_rows_and_never_this_parts() {
        let specs = [
            TableSpec::shared_write("src", Consistency::Partitioned),
            TableSpec::mirror("m"),
        ];
        let mut a = StateTables::create(&specs).expect("tables");
        a.set_mirror_source("m", "src").unwrap();
        assert!(matches!(
            a.set_mirror_source("src", "m"),
            Err(StateError::WrongKind { .. })
        ));
        for k in 0..64u16 {
            a.put("src", &k, &u32::from(k)).unwrap();
        }
        assert!(a.take_mirror().is_empty(), "alone: nothing recorded");
        assert_eq!(
            a.rows::<u16, u32>("m").unwrap().len(),
            0,
            "nothing held twice"
        );

        // A split: each part's mirror holds exactly the other part's source rows.
        let part = a
            .split(&SplitHalf {
                moved_lo: 0,
                moved_hi: u64::MAX / 2,
            })
            .unwrap();
        let mut b = StateTables::create(&specs).expect("tables");
        b.set_mirror_source("m", "src").unwrap();
        b.restore(&part).unwrap();
        let keys = |t: &StateTables, table: &str| -> Vec<u16> {
            t.rows::<u16, u32>(table)
                .unwrap()
                .into_iter()
                .map(|(k, _)| k)
                .collect()
        };
        let (a_src, b_src) = (keys(&a, "src"), keys(&b, "src"));
        assert!(!a_src.is_empty() && !b_src.is_empty());
        assert_eq!(a_src.len() + b_src.len(), 64);
        assert_eq!(keys(&a, "m"), b_src);
        assert_eq!(keys(&b, "m"), a_src);

        // With partitions to send to, a write to the source goes out as the mirror's.
        b.set_mirror_sending(true);
        b.put("src", &100u16, &100u32).unwrap();
        assert!(b.delete("src", &b_src[0]).unwrap());
        let out = b.take_mirror();
        assert_eq!(out.len(), 2);
        assert!(out.iter().all(|w| w.table == "m"));
        assert_eq!((out[0].deleted, out[1].deleted), (false, true));
        assert_eq!(a.import_mirror(&out), (2, 0));
        assert!(keys(&a, "m").contains(&100) && !keys(&a, "m").contains(&b_src[0]));

        // A merge: the source rows come home, and the mirror keeps none of them.
        b.take_mirror();
        a.merge(&b.snapshot().unwrap()).unwrap();
        assert_eq!(keys(&a, "src").len(), 64, "63 of the first + the new one");
        assert!(keys(&a, "m").is_empty(), "{:?}", keys(&a, "m"));
    }
}
