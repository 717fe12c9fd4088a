//! `FlowTable`: the per-worker exact-match flow cache.
//!
//! Layout (one table per worker, so no locks anywhere):
//! - `buckets`: one cache line each, 8 × (32-bit signature, 32-bit entry index). A key
//!   may live in either of two buckets (two-choice hashing); no cuckoo kicks, so an insert
//!   touches at most two lines and a full pair evicts the oldest of its 16 flows.
//! - `entries`: a dense arena of one-cache-line entries: the 40-byte key, the last-seen
//!   timestamp, the encap source port and the 16-byte compiled rule ([`RuleSlot`]). A
//!   hit reads exactly one line. `counters`, parallel to it, takes the per-rule packet and
//!   byte counts, which the hit path only adds to; `windows`, parallel too and only in a
//!   table that detects elephants, their measuring windows.
//!
//! Idle timeout follows Zeta §IV-D: the timestamp lives inside the entry, so a hit is one
//! read (key compare) and one write (timestamp) of the same line, and no second "timer"
//! map exists. Expired entries are reaped when a lookup meets them, by an incremental
//! sweep, and first when the table must evict.
//!
//! A hand-written table rather than hashbrown: the data path needs batch prefetching of
//! buckets and arena slots, a bounded eviction policy, and stable entry indices shared by
//! two arenas, none of which a general map exposes.

use allocator_api2::vec::Vec as ArenaVec;
use thiserror::Error;

use crate::arena::HugeArena;
use crate::key::FlowKey;
use crate::rule::{slot_flag, RuleCounters, RuleSlot};

const WAYS: usize = 8;
/// Largest supported capacity (entry indices are 31-bit: a bucket way's top bit is
/// `WAY_COUNTS`).
pub const MAX_CAPACITY: usize = (WAY_IDX - 1) as usize;
/// A bucket way's index bits.
const WAY_IDX: u32 = (1 << 31) - 1;
/// Set on a way whose rule counts (`SLOT_COUNT`): the lookup prefetches the entry's
/// counters only then. The counters are a second random line per packet; prefetching
/// them for every hit cost the 1M-flow hit path 4–5% where no rule counts, and the
/// rule's flags are in the entry, which has not arrived when the prefetch is issued.
const WAY_COUNTS: u32 = 1 << 31;

/// A bucket way as the batched lookup carries it from [`FlowTable::candidate`] to
/// [`FlowTable::confirm`]: the entry index and whether its rule counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Way(u32);

impl Way {
    fn for_rule(idx: u32, rule: &RuleSlot) -> Way {
        let counts = if rule.flags & slot_flag::SLOT_COUNT != 0 {
            WAY_COUNTS
        } else {
            0
        };
        Way(idx | counts)
    }

    /// The entry's index.
    #[inline]
    pub fn idx(self) -> u32 {
        self.0 & WAY_IDX
    }

    /// Whether the entry's rule adds to its counters on a hit.
    #[inline]
    pub fn counts(self) -> bool {
        self.0 & WAY_COUNTS != 0
    }
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Bucket {
    sig: [u32; WAYS],
    idx: [u32; WAYS],
}

const EMPTY_BUCKET: Bucket = Bucket {
    sig: [0; WAYS],
    idx: [0; WAYS],
};

const LIVE: u16 = 1;
/// The flow's rule also runs in the XDP fast path (see [`FlowTable::set_offloaded`]).
const OFFLOADED: u16 = 2;
/// The flow's forward rule, the answer to this PP's own request: the key SC decided the
/// flow on, so PP reports the flow's events on this entry (see `Pipeline` flow notices).
pub(crate) const REPORTS: u16 = 4;
/// `TcpEstablished` was reported for the flow (once per entry).
pub(crate) const ESTABLISHED_SEEN: u16 = 8;
/// `TcpClosing` was reported for the flow (once per entry).
pub(crate) const CLOSING_SEEN: u16 = 16;
/// The reply rule of a flow whose forward rule (a [`REPORTS`] entry) is its companion
/// (see [`FlowTable::link`]): a FIN or RST seen here is the flow's news too.
pub(crate) const REPLY_OF: u16 = 32;

/// No companion.
const NO_COMPANION: u32 = u32::MAX;

/// A flow's entry: key, last-seen time (ms, wrapping), cached encap source port and the
/// compiled rule, in one cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct FlowEntry {
    pub key: FlowKey,
    pub last_seen: u32,
    pub encap_sport: u16,
    flags: u16,
    pub rule: RuleSlot,
}

const _: () = assert!(std::mem::size_of::<FlowEntry>() == 64);

impl FlowEntry {
    pub(crate) fn is_live(&self) -> bool {
        self.flags & LIVE != 0
    }

    /// Whether the flow's rule was handed to the fast path and not taken back.
    pub fn is_offloaded(&self) -> bool {
        self.flags & OFFLOADED != 0
    }
}

/// Something that happened to an offloaded flow's entry which the fast path must follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffloadEvent {
    /// The entry left the table (removed, expired, evicted): take the rule out of the
    /// fast path too.
    Gone(FlowKey),
    /// The entry's rule was replaced (an update from FM): the fast path must run the new
    /// one, or give the flow back to userspace.
    Replaced(FlowKey),
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum TableError {
    #[error("flow table capacity must be between 1 and {MAX_CAPACITY}, got {0}")]
    BadCapacity(usize),
}

/// Why an entry left the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictReason {
    /// Idle longer than its timeout.
    Expired,
    /// The table (or the key's bucket pair) was full and this was the oldest candidate.
    TableFull,
    /// Removed on request.
    Removed,
}

/// Counters kept by the table itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableStats {
    pub inserts: u64,
    pub replaces: u64,
    pub removes: u64,
    pub expired: u64,
    pub evicted_full: u64,
}

/// What an insert did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inserted {
    /// A new entry; it may have displaced a victim.
    New {
        idx: u32,
        victim: Option<(FlowKey, RuleSlot, EvictReason)>,
    },
    /// The key existed; its rule was replaced in one store, and this was the old one.
    Replaced { idx: u32, old: RuleSlot },
}

/// What the first candidate bucket says about a key ([`FlowTable::candidate_near`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Near {
    /// A way whose signature matches.
    Hit(Way),
    /// No match in the first bucket; the key may be in the second.
    Far,
    /// No match, and there is no second bucket to look in.
    Absent,
}

/// Signature and the two candidate buckets of a hash.
#[derive(Debug, Clone, Copy)]
pub struct Probe {
    sig: u32,
    b1: u32,
    b2: u32,
}

/// Elephant detection's window of one flow (Zeta §IV-C/D): when the current measuring
/// window started (ms) and the packets and bytes seen in it. One read and one write per
/// packet: a window older than the period restarts in the same write that counts the
/// packet. Sixteen bytes, four flows to a line.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub struct ElephantWindow {
    pub start: u32,
    pub packets: u32,
    pub bytes: u64,
}

pub struct FlowTable {
    /// Changes to offloaded entries since the fast path last drained them. Only entries
    /// marked offloaded add to it, so without a fast path it stays empty.
    offload_events: Vec<OffloadEvent>,
    /// With [`FlowTable::set_counter_reports`]: the unreported counters of counted rules
    /// that left the table or were replaced (key, packets, bytes), and the keys of
    /// counted rules that left while offloaded (the fast path folds their last counts
    /// after the entry is gone). Drained by the pipeline between batches.
    finals: Vec<(FlowKey, u64, u64)>,
    offloaded_gone: Vec<FlowKey>,
    report_finals: bool,
    report_cursor: usize,
    buckets: ArenaVec<Bucket, HugeArena>,
    mask: usize,
    entries: ArenaVec<FlowEntry, HugeArena>,
    counters: ArenaVec<RuleCounters, HugeArena>,
    /// Parallel to `entries` when the table tracks elephant windows
    /// ([`FlowTable::track_windows`]), else empty.
    windows: ArenaVec<ElephantWindow, HugeArena>,
    tracks_windows: bool,
    /// Per entry, the other direction's entry of the same flow ([`FlowTable::link`]),
    /// or `NO_COMPANION`. Apart from the entry (its line is full), and read only for
    /// news: a FIN/RST on a reply rule, and the activity walk.
    companion: ArenaVec<u32, HugeArena>,
    free: Vec<u32>,
    capacity: usize,
    len: usize,
    seed: u64,
    sweep_cursor: usize,
    pub stats: TableStats,
}

/// Most slots a sweep prefetches for its next call: the default budget's 16 and then
/// some, but never a large budget's worth of lines at once.
const SWEEP_PREFETCH: usize = 32;

#[inline(always)]
fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: PREFETCHT0 is a hint: it never faults and never changes memory,
        // whatever the address; `sse` is part of the x86_64 baseline. Memory-level
        // parallelism across a batch is what keeps a 1M-flow table near cache speed.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Age in ms of a wrapping timestamp.
#[inline]
pub fn age(now: u32, then: u32) -> u32 {
    now.wrapping_sub(then)
}

/// The later of two wrapping timestamps (less than 2^31 ms apart).
#[inline]
pub(crate) fn newer(a: u32, b: u32) -> u32 {
    if (b.wrapping_sub(a) as i32) > 0 {
        b
    } else {
        a
    }
}

impl FlowTable {
    /// A table for up to `capacity` flows with hash seed `seed`. Buckets are sized for
    /// a load of at most 80% of their slots at full capacity.
    pub fn new(capacity: usize, seed: u64) -> Result<Self, TableError> {
        if capacity == 0 || capacity > MAX_CAPACITY {
            return Err(TableError::BadCapacity(capacity));
        }
        let nb = (capacity * 5 / 4).div_ceil(WAYS).next_power_of_two().max(2);
        // Each large arena is a fresh mapping advised for huge pages (`HugeArena`).
        let mut buckets = ArenaVec::with_capacity_in(nb, HugeArena);
        let entries = ArenaVec::with_capacity_in(capacity, HugeArena);
        let counters = ArenaVec::with_capacity_in(capacity, HugeArena);
        buckets.resize(nb, EMPTY_BUCKET);
        Ok(FlowTable {
            offload_events: Vec::new(),
            finals: Vec::new(),
            offloaded_gone: Vec::new(),
            report_finals: false,
            report_cursor: 0,
            buckets,
            mask: nb - 1,
            entries,
            counters,
            windows: ArenaVec::new_in(HugeArena),
            tracks_windows: false,
            companion: ArenaVec::with_capacity_in(capacity, HugeArena),
            free: Vec::new(),
            capacity,
            len: 0,
            seed,
            sweep_cursor: 0,
            stats: TableStats::default(),
        })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Flows that sit in their second candidate bucket (inserted there when the first
    /// was full, or moved there by a displacement). A batched lookup of these takes the
    /// extra pass of [`FlowTable::candidate_near`]. Walks the whole table.
    pub fn second_bucket_residents(&self) -> usize {
        let mut n = 0;
        for (b, bk) in self.buckets.iter().enumerate() {
            for w in 0..WAYS {
                if bk.sig[w] == 0 {
                    continue;
                }
                let i = Way(bk.idx[w]).idx() as usize;
                let p = self.probe(self.hash(&self.entries[i].key));
                if p.b2 as usize == b && p.b1 != p.b2 {
                    n += 1;
                }
            }
        }
        n
    }

    /// Keep an elephant window per flow ([`ElephantWindow`]), for a pipeline that
    /// detects elephants. Flows already in the table start with empty windows.
    pub fn track_windows(&mut self) {
        if self.tracks_windows {
            return;
        }
        self.tracks_windows = true;
        self.windows = ArenaVec::with_capacity_in(self.capacity, HugeArena);
        // Parallel to `entries` from here on: a window for every slot already used.
        self.windows
            .resize(self.entries.len(), ElephantWindow::default());
    }

    /// Bytes the table holds for `capacity` flows once every arena slot is used: the
    /// buckets, and per flow its entry (key and rule), its counters, its companion
    /// index and, when tracked, its elephant window. (Until 2026-11-26 this counted a
    /// `RuleSlot`, which is inside the entry, instead of the counters beside it: 16
    /// bytes per flow too few.)
    pub fn bytes_at_capacity(&self) -> usize {
        let window = if self.tracks_windows {
            std::mem::size_of::<ElephantWindow>()
        } else {
            0
        };
        self.buckets.len() * std::mem::size_of::<Bucket>()
            + self.capacity
                * (std::mem::size_of::<FlowEntry>()
                    + std::mem::size_of::<RuleCounters>()
                    + std::mem::size_of::<u32>()
                    + window)
    }

    /// The table's (seeded) hash of a key.
    #[inline]
    pub fn hash(&self, key: &FlowKey) -> u64 {
        key.hash_seeded(self.seed)
    }

    /// Signature and candidate buckets for a table hash (from [`FlowTable::hash`]).
    #[inline]
    pub fn probe(&self, h: u64) -> Probe {
        let sig = ((h >> 32) as u32) | 1;
        let b1 = (h as usize) & self.mask;
        let b2 = self.alt_bucket(b1, sig);
        Probe {
            sig,
            b1: b1 as u32,
            b2: b2 as u32,
        }
    }

    /// The other bucket of a key with signature `sig` that sits in bucket `b`. XOR makes
    /// it an involution, so a resident can move without rehashing its key.
    #[inline]
    fn alt_bucket(&self, b: usize, sig: u32) -> usize {
        (b ^ (sig.wrapping_mul(0x5bd1_e995) as usize >> 3)) & self.mask
    }

    /// Move one resident of bucket `b` to its alternate bucket to free a way (one level of
    /// cuckoo displacement). Returns whether a way was freed.
    fn relocate_from(&mut self, b: u32) -> bool {
        for w in 0..WAYS {
            let sig = self.buckets[b as usize].sig[w];
            let alt = self.alt_bucket(b as usize, sig) as u32;
            if alt != b && self.bucket_has_room(alt) {
                let way = Way(self.buckets[b as usize].idx[w]);
                self.place(alt, sig, way);
                self.buckets[b as usize].sig[w] = 0;
                self.buckets[b as usize].idx[w] = 0;
                return true;
            }
        }
        false
    }

    /// Stage 1 of a batched lookup: bring the first candidate bucket toward the core.
    /// Inserts fill `b1` first, so most keys live there; prefetching `b2` too doubled the
    /// outstanding misses past what the core's fill buffers hold, and prefetches stalled.
    #[inline]
    pub fn prefetch_buckets(&self, p: &Probe) {
        prefetch(&self.buckets[p.b1 as usize]);
    }

    /// Stage 2, first bucket only: the entry whose signature matches in `b1`, or
    /// `Near::Far` when the key can only be in `b2` (a bucket not yet prefetched; the
    /// caller prefetches it with [`FlowTable::prefetch_far`] and asks
    /// [`FlowTable::candidate_far`] a pass later), or `Near::Absent` when `b2` is
    /// `b1`. At 60% load about 2% of keys live in `b2`, and reading it here cost a full
    /// memory latency each.
    #[inline]
    pub fn candidate_near(&self, p: &Probe) -> Near {
        let bk = &self.buckets[p.b1 as usize];
        let m = Self::sig_mask(bk, p.sig);
        if m != 0 {
            Near::Hit(Way(bk.idx[m.trailing_zeros() as usize]))
        } else if p.b2 != p.b1 {
            Near::Far
        } else {
            Near::Absent
        }
    }

    /// Bring a key's second bucket toward the core (see [`FlowTable::candidate_near`]).
    #[inline]
    pub fn prefetch_far(&self, p: &Probe) {
        prefetch(&self.buckets[p.b2 as usize]);
    }

    /// The entry whose signature matches in the second bucket, if any.
    #[inline]
    pub fn candidate_far(&self, p: &Probe) -> Option<Way> {
        let bk = &self.buckets[p.b2 as usize];
        let m = Self::sig_mask(bk, p.sig);
        (m != 0).then(|| Way(bk.idx[m.trailing_zeros() as usize]))
    }

    /// Stage 2 in one step, both buckets (for callers that do not batch): the entry
    /// index whose signature matches, if any. A signature match still needs the key
    /// compare of [`FlowTable::confirm`].
    #[inline]
    pub fn candidate(&self, p: &Probe) -> Option<Way> {
        match self.candidate_near(p) {
            Near::Hit(w) => Some(w),
            Near::Far => self.candidate_far(p),
            Near::Absent => None,
        }
    }

    /// Bit w set when way w holds `sig`. Branch-free so it compiles to two SSE2 compares
    /// and a movemask: the matching way is random, so a compare-and-branch chain
    /// mispredicts on most packets.
    #[inline(always)]
    fn sig_mask(bk: &Bucket, sig: u32) -> u32 {
        let mut m = 0u32;
        for w in 0..WAYS {
            m |= ((bk.sig[w] == sig) as u32) << w;
        }
        m
    }

    /// Prefetch an entry (one line: key and rule), its counters if its rule counts (a
    /// counted hit adds to them, and the add's load would otherwise miss), and its
    /// elephant window if `window` (the caller counts every hit in it).
    #[inline]
    pub fn prefetch_entry(&self, way: Way, window: bool) {
        let i = way.idx() as usize;
        prefetch(&self.entries[i]);
        if way.counts() {
            prefetch(&self.counters[i]);
        }
        if window {
            // No bounds check: a prefetch never faults, and an untracked table's
            // window arena is empty.
            prefetch(self.windows.as_ptr().wrapping_add(i));
        }
    }

    /// Stage 3: whether entry `idx` holds `key`. Falls back to a full probe when the
    /// first signature match was a collision.
    #[inline]
    pub fn confirm(&self, p: &Probe, cand: Option<Way>, key: &FlowKey) -> Option<u32> {
        if let Some(w) = cand {
            let i = w.idx();
            if self.entries[i as usize].key == *key {
                return Some(i);
            }
        } else {
            return None;
        }
        self.find(p, key).map(|(_, _, i)| i)
    }

    /// Full probe of both buckets: (bucket, way, entry index).
    fn find(&self, p: &Probe, key: &FlowKey) -> Option<(u32, usize, u32)> {
        for b in [p.b1, p.b2] {
            let bk = &self.buckets[b as usize];
            for w in 0..WAYS {
                let i = bk.idx[w] & WAY_IDX;
                if bk.sig[w] == p.sig && self.entries[i as usize].key == *key {
                    return Some((b, w, i));
                }
            }
        }
        None
    }

    /// Unbatched lookup.
    #[inline]
    pub fn lookup(&self, key: &FlowKey) -> Option<u32> {
        let p = self.probe(self.hash(key));
        self.find(&p, key).map(|(_, _, i)| i)
    }

    #[inline]
    pub fn entry(&self, idx: u32) -> &FlowEntry {
        &self.entries[idx as usize]
    }

    /// Mark (or unmark) entry `idx` as running in the fast path. While marked, its
    /// removal or replacement is queued as an [`OffloadEvent`].
    pub fn set_offloaded(&mut self, idx: u32, on: bool) {
        let e = &mut self.entries[idx as usize];
        if on {
            e.flags |= OFFLOADED;
        } else {
            e.flags &= !OFFLOADED;
        }
    }

    #[inline(always)]
    pub(crate) fn flags(&self, idx: u32) -> u16 {
        self.entries[idx as usize].flags
    }

    pub(crate) fn set_flags(&mut self, idx: u32, f: u16) {
        self.entries[idx as usize].flags |= f;
    }

    /// Make `fwd` (a flow's forward rule, the one that reports) and `reply` (its reply
    /// rule) each other's companion, so news seen on the reply rule is reported on the
    /// flow. A link ends when either entry leaves the table; linking again replaces it.
    pub(crate) fn link(&mut self, fwd: u32, reply: u32) {
        if fwd == reply {
            return;
        }
        self.unlink(fwd);
        self.unlink(reply);
        self.companion[fwd as usize] = reply;
        self.companion[reply as usize] = fwd;
        self.entries[reply as usize].flags |= REPLY_OF;
    }

    fn unlink(&mut self, idx: u32) {
        let c = std::mem::replace(&mut self.companion[idx as usize], NO_COMPANION);
        if c != NO_COMPANION {
            self.companion[c as usize] = NO_COMPANION;
            self.entries[c as usize].flags &= !REPLY_OF;
            self.entries[idx as usize].flags &= !REPLY_OF;
        }
    }

    /// The other direction's entry of `idx`'s flow, if linked.
    pub(crate) fn companion(&self, idx: u32) -> Option<u32> {
        let c = self.companion[idx as usize];
        (c != NO_COMPANION).then_some(c)
    }

    /// Arena slots (live or free), for a walk by index with [`FlowTable::entry`].
    pub(crate) fn slots(&self) -> usize {
        self.entries.len()
    }

    /// Keep the unreported counters of counted rules that leave the table (see
    /// [`FlowTable::take_finals`]); off by default, so that nothing piles up unread.
    pub fn set_counter_reports(&mut self, on: bool) {
        self.report_finals = on;
        if !on {
            self.finals.clear();
            self.offloaded_gone.clear();
        }
    }

    /// Counters of counted rules that left or were replaced since the last call, and
    /// the keys of counted rules that left while offloaded.
    pub fn take_finals(&mut self, finals: &mut Vec<(FlowKey, u64, u64)>, gone: &mut Vec<FlowKey>) {
        finals.append(&mut self.finals);
        gone.append(&mut self.offloaded_gone);
    }

    /// Keep the counters of entry `idx` if it is counted and has counted something.
    fn keep_final(&mut self, idx: u32, rule: &RuleSlot) {
        if !self.report_finals || rule.flags & slot_flag::SLOT_COUNT == 0 {
            return;
        }
        let c = &self.counters[idx as usize];
        let key = self.entries[idx as usize].key;
        if c.packets != 0 || c.bytes != 0 {
            self.finals.push((key, c.packets, c.bytes));
        }
        if self.entries[idx as usize].is_offloaded() {
            self.offloaded_gone.push(key);
        }
    }

    /// Where the counter report pass is: the hand's slot and the arena's length.
    pub fn report_position(&self) -> (usize, usize) {
        (self.report_cursor, self.entries.len())
    }

    /// Start the next report pass from the arena's first slot.
    pub fn restart_report_pass(&mut self) {
        self.report_cursor = 0;
    }

    /// Continue the counter report pass: examine up to `budget` arena slots from the
    /// report hand and offer every live counted rule with new counts to `report`, which
    /// returns whether it took them (then they are zeroed: counters are deltas since
    /// the last report). A refusal (the report queue is full) stops the pass where it
    /// is, so nothing is lost. Returns true when the hand passed the arena's end (the
    /// pass is complete; the next starts from slot 0).
    pub fn report_counters(
        &mut self,
        budget: usize,
        mut report: impl FnMut(&FlowKey, u64, u64) -> bool,
    ) -> bool {
        let n = self.entries.len();
        let end = (self.report_cursor + budget).min(n);
        while self.report_cursor < end {
            let i = self.report_cursor;
            let e = &self.entries[i];
            if e.is_live() && e.rule.flags & slot_flag::SLOT_COUNT != 0 {
                let c = &mut self.counters[i];
                if c.packets != 0 || c.bytes != 0 {
                    if !report(&e.key, c.packets, c.bytes) {
                        return false;
                    }
                    c.packets = 0;
                    c.bytes = 0;
                }
            }
            self.report_cursor += 1;
        }
        if self.report_cursor >= n {
            self.report_cursor = 0;
            return true;
        }
        false
    }

    /// Take the [`OffloadEvent`]s queued since the last call.
    pub fn take_offload_events(&mut self) -> Vec<OffloadEvent> {
        std::mem::take(&mut self.offload_events)
    }

    /// The one write of a hit: refresh the entry's timestamp.
    #[inline]
    pub fn touch(&mut self, idx: u32, now: u32) {
        self.entries[idx as usize].last_seen = now;
    }

    #[inline]
    pub fn rule(&self, idx: u32) -> &RuleSlot {
        &self.entries[idx as usize].rule
    }

    #[inline]
    pub fn counters(&self, idx: u32) -> &RuleCounters {
        &self.counters[idx as usize]
    }

    #[inline]
    pub fn counters_mut(&mut self, idx: u32) -> &mut RuleCounters {
        &mut self.counters[idx as usize]
    }

    /// Entry `idx`'s elephant window; `None` unless the table tracks windows.
    #[inline]
    pub fn window_mut(&mut self, idx: u32) -> Option<&mut ElephantWindow> {
        self.windows.get_mut(idx as usize)
    }

    /// Insert or replace the rule for `key`. `timeout_of` gives a rule's idle timeout in
    /// ms; it decides whether a victim had already expired.
    pub fn insert(
        &mut self,
        key: &FlowKey,
        rule: RuleSlot,
        encap_sport: u16,
        now: u32,
        timeout_of: impl Fn(&RuleSlot) -> u32,
    ) -> Inserted {
        let p = self.probe(self.hash(key));
        if let Some((b, w, i)) = self.find(&p, key) {
            self.buckets[b as usize].idx[w] = Way::for_rule(i, &rule).0;
            let old_rule = self.entries[i as usize].rule;
            if self.report_finals && old_rule.flags & slot_flag::SLOT_COUNT != 0 {
                let c = &self.counters[i as usize];
                if c.packets != 0 || c.bytes != 0 {
                    self.finals.push((*key, c.packets, c.bytes));
                }
            }
            let e = &mut self.entries[i as usize];
            if e.is_offloaded() {
                self.offload_events.push(OffloadEvent::Replaced(*key));
            }
            // One 16-byte store: no packet can see half of the old rule and half the new.
            let old = std::mem::replace(&mut e.rule, rule);
            e.last_seen = now;
            e.encap_sport = encap_sport;
            self.counters[i as usize] = RuleCounters::default();
            if let Some(w) = self.windows.get_mut(i as usize) {
                *w = ElephantWindow::default();
            }
            self.stats.replaces += 1;
            return Inserted::Replaced { idx: i, old };
        }
        let mut victim = None;
        let have_slot = self.bucket_has_room(p.b1)
            || self.bucket_has_room(p.b2)
            || self.relocate_from(p.b1)
            || self.relocate_from(p.b2);
        if !have_slot || (self.free.is_empty() && self.entries.len() == self.capacity) {
            victim = Some(self.evict_for(&p, now, &timeout_of));
        }
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.entries.push(FlowEntry {
                    key: *key,
                    last_seen: now,
                    encap_sport,
                    flags: 0,
                    rule,
                });
                self.counters.push(RuleCounters::default());
                if self.tracks_windows {
                    self.windows.push(ElephantWindow::default());
                }
                self.companion.push(NO_COMPANION);
                (self.entries.len() - 1) as u32
            }
        };
        self.entries[idx as usize] = FlowEntry {
            key: *key,
            last_seen: now,
            encap_sport,
            flags: LIVE,
            rule,
        };
        self.counters[idx as usize] = RuleCounters::default();
        if let Some(w) = self.windows.get_mut(idx as usize) {
            *w = ElephantWindow::default();
        }
        let way = Way::for_rule(idx, &rule);
        let placed = self.place(p.b1, p.sig, way) || self.place(p.b2, p.sig, way);
        debug_assert!(placed, "eviction freed a way in one of the buckets");
        self.len += 1;
        self.stats.inserts += 1;
        Inserted::New { idx, victim }
    }

    fn bucket_has_room(&self, b: u32) -> bool {
        self.buckets[b as usize].sig.contains(&0)
    }

    fn place(&mut self, b: u32, sig: u32, way: Way) -> bool {
        let bk = &mut self.buckets[b as usize];
        for w in 0..WAYS {
            if bk.sig[w] == 0 {
                bk.sig[w] = sig;
                bk.idx[w] = way.0;
                return true;
            }
        }
        false
    }

    /// Make room for `p`: evict the oldest flow of its two buckets (expired ones first by
    /// construction: they are the oldest relative to their timeouts). If both buckets have
    /// room but the arena is full, evict the next live entry under the sweep hand.
    fn evict_for(
        &mut self,
        p: &Probe,
        now: u32,
        timeout_of: &impl Fn(&RuleSlot) -> u32,
    ) -> (FlowKey, RuleSlot, EvictReason) {
        let mut best: Option<(u32, u32)> = None; // (overdue-ness score, idx)
        if !(self.bucket_has_room(p.b1) || self.bucket_has_room(p.b2)) {
            for b in [p.b1, p.b2] {
                for w in 0..WAYS {
                    let i = self.buckets[b as usize].idx[w] & WAY_IDX;
                    let e = &self.entries[i as usize];
                    let a = age(now, e.last_seen);
                    // Prefer the flow furthest past (or closest to) its own timeout.
                    let t = timeout_of(&e.rule);
                    let score = a.saturating_sub(t).saturating_add(a.min(t) / 2);
                    if best.is_none_or(|(s, _)| score > s) {
                        best = Some((score, i));
                    }
                }
            }
        }
        let idx = match best {
            Some((_, i)) => i,
            None => self.hand_victim(),
        };
        let e = self.entries[idx as usize];
        let reason = if age(now, e.last_seen) > timeout_of(&e.rule) {
            EvictReason::Expired
        } else {
            EvictReason::TableFull
        };
        let rule = self.remove_idx(idx, reason);
        (e.key, rule, reason)
    }

    fn hand_victim(&mut self) -> u32 {
        let n = self.entries.len();
        for _ in 0..n {
            let i = self.sweep_cursor % n;
            self.sweep_cursor = i + 1;
            if self.entries[i].is_live() {
                return i as u32;
            }
        }
        unreachable!("hand_victim is only called on a full arena")
    }

    /// Remove entry `idx`, returning its rule.
    fn remove_idx(&mut self, idx: u32, reason: EvictReason) -> RuleSlot {
        let key = self.entries[idx as usize].key;
        let p = self.probe(self.hash(&key));
        for b in [p.b1, p.b2] {
            let bk = &mut self.buckets[b as usize];
            for w in 0..WAYS {
                if bk.sig[w] == p.sig && bk.idx[w] & WAY_IDX == idx {
                    bk.sig[w] = 0;
                    bk.idx[w] = 0;
                }
            }
        }
        let rule = self.entries[idx as usize].rule;
        self.keep_final(idx, &rule);
        if self.entries[idx as usize].is_offloaded() {
            self.offload_events.push(OffloadEvent::Gone(key));
        }
        self.entries[idx as usize].flags = 0;
        self.unlink(idx);
        self.free.push(idx);
        self.len -= 1;
        match reason {
            EvictReason::Expired => self.stats.expired += 1,
            EvictReason::TableFull => self.stats.evicted_full += 1,
            EvictReason::Removed => self.stats.removes += 1,
        }
        std::mem::take(&mut self.entries[idx as usize].rule)
    }

    /// Remove `key`, returning its rule.
    pub fn remove(&mut self, key: &FlowKey) -> Option<RuleSlot> {
        let p = self.probe(self.hash(key));
        let (_, _, i) = self.find(&p, key)?;
        Some(self.remove_idx(i, EvictReason::Removed))
    }

    /// Remove an entry found expired by a lookup.
    pub fn expire(&mut self, idx: u32) -> RuleSlot {
        self.remove_idx(idx, EvictReason::Expired)
    }

    /// Examine up to `budget` arena slots from the sweep hand and remove the expired ones,
    /// handing each to `on_remove`. Returns how many were removed.
    pub fn sweep(
        &mut self,
        now: u32,
        budget: usize,
        timeout_of: impl Fn(&RuleSlot) -> u32,
        mut on_remove: impl FnMut(&FlowKey, &RuleSlot),
    ) -> usize {
        let n = self.entries.len();
        if n == 0 {
            return 0;
        }
        let mut removed = 0;
        // The hand wraps by a compare: a 64-bit `%` per slot cost more than the slot.
        let mut i = if self.sweep_cursor >= n {
            0
        } else {
            self.sweep_cursor
        };
        for _ in 0..budget.min(n) {
            if i == n {
                i = 0;
            }
            let at = i;
            i += 1;
            let e = self.entries[at];
            if e.is_live() && age(now, e.last_seen) > timeout_of(&e.rule) {
                let r = self.remove_idx(at as u32, EvictReason::Expired);
                on_remove(&e.key, &r);
                removed += 1;
            }
        }
        // The next call's slots, so that its reads hit: the hardware's stream prefetcher
        // does not carry a run of 16 lines across a batch of packets' random misses.
        self.sweep_cursor = i;
        for j in 0..budget.min(n).min(SWEEP_PREFETCH) {
            let at = i + j;
            prefetch(&self.entries[if at >= n { at - n } else { at }]);
        }
        removed
    }

    /// Live flows with their counters.
    pub fn iter(&self) -> impl Iterator<Item = (&FlowEntry, &RuleCounters)> {
        self.entries
            .iter()
            .zip(self.counters.iter())
            .filter(|(e, _)| e.is_live())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> FlowKey {
        FlowKey::new(
            1,
            17,
            std::net::Ipv4Addr::from(0xc612_0000 + i).into(),
            1000,
            "198.19.0.1".parse().unwrap(),
            53,
        )
    }

    fn slot(p: u16) -> RuleSlot {
        RuleSlot {
            sport: p,
            ..Default::default()
        }
    }

    const NEVER: fn(&RuleSlot) -> u32 = |_| u32::MAX;

    #[test]
    fn insert_lookup_replace_remove() {
        let mut t = FlowTable::new(1000, 42).unwrap();
        for i in 0..1000 {
            let k = key(i);
            assert!(matches!(
                t.insert(&k, slot(i as u16), 0, 0, NEVER),
                Inserted::New { victim: None, .. }
            ));
        }
        assert_eq!(t.len(), 1000);
        for i in 0..1000 {
            let k = key(i);
            let idx = t.lookup(&k).expect("present");
            assert_eq!(t.rule(idx).sport, i as u16);
        }
        let k = key(7);
        match t.insert(&k, slot(9999), 0, 5, NEVER) {
            Inserted::Replaced { old, .. } => assert_eq!(old.sport, 7),
            other => panic!("{other:?}"),
        }
        assert_eq!(t.rule(t.lookup(&k).unwrap()).sport, 9999);
        assert_eq!(t.remove(&k).unwrap().sport, 9999);
        assert!(t.lookup(&k).is_none());
        assert_eq!(t.len(), 999);
        assert!(t.lookup(&key(5000)).is_none());
    }

    #[test]
    fn full_table_evicts_oldest_and_counts() {
        let mut t = FlowTable::new(64, 1).unwrap();
        for i in 0..64 {
            let k = key(i);
            t.insert(&k, slot(0), 0, i, NEVER);
        }
        let mut victims = 0;
        for i in 64..200 {
            let k = key(i);
            if let Inserted::New {
                victim: Some((_, _, r)),
                ..
            } = t.insert(&k, slot(0), 0, 1000 + i, NEVER)
            {
                assert_eq!(r, EvictReason::TableFull);
                victims += 1;
            }
            assert!(t.lookup(&k).is_some(), "new flow is always inserted");
        }
        assert_eq!(t.len(), 64);
        assert_eq!(victims, 136);
        assert_eq!(t.stats.evicted_full, 136);
    }

    #[test]
    fn sweep_removes_only_expired() {
        let mut t = FlowTable::new(100, 3).unwrap();
        for i in 0..100 {
            let k = key(i);
            t.insert(&k, slot(0), 0, if i % 2 == 0 { 0 } else { 900 }, NEVER);
        }
        let mut seen = 0;
        let removed = t.sweep(1000, 1000, |_| 500, |_, _| seen += 1);
        assert_eq!((removed, seen), (50, 50));
        assert_eq!(t.len(), 50);
        assert_eq!(t.stats.expired, 50);
    }

    #[test]
    fn the_sweep_hand_wraps_and_visits_every_slot_once_a_lap() {
        let mut t = FlowTable::new(100, 3).unwrap();
        for i in 0..100 {
            t.insert(&key(i), slot(0), 0, 0, NEVER);
        }
        let n = t.entries.len();
        // A budget that does not divide the arena: the hand crosses its end mid-call.
        let budget = 7;
        let laps = n.div_ceil(budget);
        let mut per_call = Vec::new();
        for _ in 0..laps {
            per_call.push(t.sweep(1000, budget, |_| 500, |_, _| {}));
        }
        assert!(per_call.iter().all(|&r| r <= budget), "{per_call:?}");
        assert_eq!(
            per_call.iter().sum::<usize>(),
            100,
            "one lap reaps every idle flow"
        );
        assert_eq!(t.len(), 0);
        // The next lap starts over where the hand stopped and finds nothing.
        assert_eq!(t.sweep(1000, n + 5, |_| 500, |_, _| {}), 0);
    }

    fn counting(p: u16) -> RuleSlot {
        RuleSlot {
            flags: slot_flag::SLOT_COUNT,
            ..slot(p)
        }
    }

    /// The way a batched lookup of `k` finds, confirmed.
    fn way_of(t: &FlowTable, k: &FlowKey) -> Way {
        let p = t.probe(t.hash(k));
        let w = t.candidate(&p).expect("a signature match");
        assert_eq!(t.confirm(&p, Some(w), k), t.lookup(k));
        w
    }

    /// Issue 18: at most 64 bytes per flow beyond the 40-byte key, at a million flows
    /// (buckets, entry, counters, companion). Elephant windows add 16 only to a table
    /// that tracks them.
    #[test]
    fn a_flow_costs_at_most_64_bytes_beyond_its_key() {
        let n = 1_000_000;
        let mut t = FlowTable::new(n, 0).unwrap();
        let plain = t.bytes_at_capacity() as f64 / n as f64;
        assert!(
            plain - FlowKey::LEN as f64 <= 64.0,
            "{plain} bytes per flow"
        );
        t.track_windows();
        let tracked = t.bytes_at_capacity() as f64 / n as f64;
        assert_eq!(tracked - plain, 16.0);
    }

    #[test]
    fn elephant_windows_start_empty_for_every_new_or_replaced_rule() {
        let mut t = FlowTable::new(100, 3).unwrap();
        t.insert(&key(0), slot(0), 0, 0, NEVER);
        assert!(t.window_mut(0).is_none(), "no windows unless tracked");
        t.track_windows();
        assert_eq!(
            *t.window_mut(0)
                .expect("a slot used before tracking has a window"),
            ElephantWindow::default()
        );
        let Inserted::New { idx, .. } = t.insert(&key(1), slot(1), 0, 0, NEVER) else {
            panic!("new")
        };
        let w = t.window_mut(idx).expect("tracked");
        (w.start, w.packets, w.bytes) = (7, 3, 300);
        let Inserted::Replaced { idx: again, .. } = t.insert(&key(1), slot(2), 0, 0, NEVER) else {
            panic!("replaced")
        };
        assert_eq!(again, idx);
        assert_eq!(*t.window_mut(idx).unwrap(), ElephantWindow::default());
        let w = t.window_mut(idx).unwrap();
        w.packets = 9;
        t.remove(&key(1)).unwrap();
        let Inserted::New { idx: reused, .. } = t.insert(&key(2), slot(3), 0, 0, NEVER) else {
            panic!("new")
        };
        assert_eq!(reused, idx, "the freed slot is reused");
        assert_eq!(*t.window_mut(reused).unwrap(), ElephantWindow::default());
    }

    #[test]
    fn a_ways_counts_bit_follows_its_rule_through_replace_and_relocation() {
        // A small table, full to its buckets' load, so inserts relocate residents.
        let mut t = FlowTable::new(100, 9).unwrap();
        for i in 0..100 {
            let r = if i % 3 == 0 {
                counting(i as u16)
            } else {
                slot(i as u16)
            };
            t.insert(&key(i), r, 0, 0, NEVER);
        }
        for i in 0..100 {
            let k = key(i);
            let Some(idx) = t.lookup(&k) else { continue }; // evicted by a full pair
            let w = way_of(&t, &k);
            assert_eq!(w.idx(), idx);
            assert_eq!(w.counts(), i % 3 == 0, "flow {i}");
            assert_eq!(t.rule(idx).sport, i as u16);
        }
        // Every occupied way's bit is its entry's rule's, wherever inserts placed or
        // relocated it, and some keys live in their second bucket.
        let mut in_b2 = 0;
        for (b, bk) in t.buckets.iter().enumerate() {
            for w in 0..WAYS {
                if bk.sig[w] == 0 {
                    continue;
                }
                let way = Way(bk.idx[w]);
                let e = &t.entries[way.idx() as usize];
                assert_eq!(way.counts(), e.rule.flags & slot_flag::SLOT_COUNT != 0);
                in_b2 += usize::from(t.probe(t.hash(&e.key)).b1 as usize != b);
            }
        }
        assert!(
            in_b2 > 0,
            "no key left its first bucket: the test lost its point"
        );
        // Replacing the rule moves the bit both ways; the index stays.
        let (a, b) = (key(0), key(1));
        let (ia, ib) = (t.lookup(&a).unwrap(), t.lookup(&b).unwrap());
        t.insert(&a, slot(7), 0, 0, NEVER);
        t.insert(&b, counting(8), 0, 0, NEVER);
        assert_eq!(
            (way_of(&t, &a), way_of(&t, &b)),
            (Way(ia), Way(ib | WAY_COUNTS))
        );
        // Removal finds a counting way by its index.
        assert!(t.remove(&b).is_some());
        assert_eq!(t.lookup(&b), None);
        assert!(t
            .buckets
            .iter()
            .all(|bk| !bk.idx.contains(&(ib | WAY_COUNTS))));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert { k: u32, sport: u16, counts: bool },
        Remove { k: u32 },
        Expire { k: u32 },
        Sweep { budget: usize },
        Advance { ms: u32 },
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        // 96 keys over a 48-flow table: full pairs, relocations and evictions are common.
        prop_oneof![
            6 => (0u32..96, any::<u16>(), any::<bool>())
                .prop_map(|(k, sport, counts)| Op::Insert { k, sport, counts }),
            1 => (0u32..96).prop_map(|k| Op::Remove { k }),
            1 => (0u32..96).prop_map(|k| Op::Expire { k }),
            1 => (1usize..64).prop_map(|budget| Op::Sweep { budget }),
            1 => (0u32..400).prop_map(|ms| Op::Advance { ms }),
        ]
    }

    /// The table against a map of what it should hold: every key the table reports
    /// gone (evicted, expired, removed) leaves the model, and after every step each model
    /// key is found by both lookups with its rule, its way says whether that rule
    /// counts, and the buckets hold exactly the live entries, once each.
    fn check_against(t: &FlowTable, model: &std::collections::HashMap<u32, (u16, bool)>) {
        assert_eq!(t.len(), model.len());
        for (&k, &(sport, counts)) in model {
            let key = key(k);
            let p = t.probe(t.hash(&key));
            let (b, w, i) = t.find(&p, &key).unwrap_or_else(|| panic!("key {k} lost"));
            assert_eq!(t.lookup(&key), Some(i));
            assert_eq!(t.confirm(&p, t.candidate(&p), &key), Some(i));
            let way = Way(t.buckets[b as usize].idx[w]);
            assert_eq!((way.idx(), way.counts()), (i, counts), "key {k}");
            assert_eq!(t.rule(i).sport, sport);
        }
        let mut seen = vec![0u8; t.entries.len()];
        for bk in &t.buckets {
            for w in 0..WAYS {
                if bk.sig[w] != 0 {
                    let i = Way(bk.idx[w]).idx() as usize;
                    assert!(t.entries[i].is_live(), "a way names a dead entry");
                    seen[i] += 1;
                }
            }
        }
        for (i, e) in t.entries.iter().enumerate() {
            assert_eq!(seen[i], u8::from(e.is_live()), "entry {i}");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        #[test]
        fn the_table_keeps_what_a_map_keeps(ops in proptest::collection::vec(op(), 1..200)) {
            let mut t = FlowTable::new(48, 5).unwrap();
            let mut model = std::collections::HashMap::new();
            let mut now = 0u32;
            let timeout = |_: &RuleSlot| 500u32;
            let num = |k: &FlowKey| (0..96).find(|&i| key(i) == *k).expect("a test key");
            for op in ops {
                match op {
                    Op::Insert { k, sport, counts } => {
                        let rule = if counts { counting(sport) } else { slot(sport) };
                        if let Inserted::New { victim: Some((v, _, _)), .. } =
                            t.insert(&key(k), rule, 0, now, timeout)
                        {
                            model.remove(&num(&v));
                        }
                        model.insert(k, (sport, counts));
                    }
                    Op::Remove { k } => {
                        let gone = t.remove(&key(k)).map(|r| r.sport);
                        proptest::prop_assert_eq!(gone, model.remove(&k).map(|m| m.0));
                    }
                    Op::Expire { k } => {
                        if let Some(i) = t.lookup(&key(k)) {
                            proptest::prop_assert_eq!(t.expire(i).sport, model[&k].0);
                            model.remove(&k);
                        }
                    }
                    Op::Sweep { budget } => {
                        let mut gone = Vec::new();
                        t.sweep(now, budget, timeout, |k, _| gone.push(*k));
                        for k in &gone {
                            proptest::prop_assert!(model.remove(&num(k)).is_some());
                        }
                    }
                    Op::Advance { ms } => now = now.wrapping_add(ms),
                }
                check_against(&t, &model);
            }
        }
    }

    #[test]
    fn rejects_bad_capacity() {
        assert_eq!(FlowTable::new(0, 0).err(), Some(TableError::BadCapacity(0)));
    }
}
