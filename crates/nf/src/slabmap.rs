//! [`SlabMap`]: the per-flow maps' hash map, whose doubling never stops the chain.
//!
//! A hashbrown map doubles by allocating a table twice the size and moving every row
//! into it on one insert. For the per-flow maps of a replica (a row per flow, 229,376
//! of them at the doubling the setup bench meets) that insert took 20–35 ms a map, most
//! of it the kernel faulting in and zeroing the new table (docs/setup-path.md): a chain
//! near its capacity queues behind it for longer still. Staggering the maps' growth
//! points (what `nf::grow` did) spread those stalls but kept each one.
//!
//! Here the rows never move. They live in a slab of fixed-size chunks (a new chunk is a
//! few pages, faulted in as flows arrive), and a hashbrown [`HashTable`] of 8-byte
//! entries (32 bits of hash, the row's slot) indexes them. When the index is full, a new
//! one of four times its capacity is made, in memory the map faulted in a little per
//! insert since the index was 3/4 full (`index_alloc`: the first few thousand inserts
//! into a fresh table would otherwise take all its page faults at once), and the old
//! one stays, read-only, while each later insert or removal moves one more slot's entry
//! across (16 at a time, every 16th op). Lookups probe the new index, then the old. The
//! old index is never erased from (erasing leaves tombstones that lengthen every miss's
//! probe, which is what sank the incremental-resize crate `griddle` here): an entry
//! whose row has since been removed or reused is harmless, because every probe compares
//! the row's key. Each row records the index generation it is in, so the move skips rows inserted
//! into the new index meanwhile. The old index is dropped when the move reaches the
//! slab's end.
//!
//! Why not a crate: hashbrown has no resumable cursor to move rows a few at a time, and
//! `griddle` (the one incremental-resize map) erases from the old half as above.
//!
//! Iteration is in slot order, so it is a function of the map's history, never of the
//! hasher's seed or of when the index grew.

use std::borrow::Borrow;
use std::fmt;
use std::hash::{BuildHasher, Hash};

use hashbrown::hash_table::HashTable;
use hashbrown::DefaultHashBuilder;

use crate::index_alloc::IndexAlloc;

/// Rows per slab chunk: 512 rows of a per-flow table are a few dozen KiB, so a new
/// chunk faults in a handful of pages.
const CHUNK_BITS: u32 = 9;
const CHUNK: usize = 1 << CHUNK_BITS;
/// Slots whose index entries each insert or removal moves while the index grows.
/// Moving one costs a cache miss in the new index (about 75 ns in `bench setup`), and
/// every per-flow map of a chain's three replicas grows on about the same flow, so this
/// is their added cost per flow for as long as the move lasts: with 4 a slot, the
/// built-in chain's 21 maps took 16% of the process's CPU for a second, which a chain
/// at 70% of its capacity could not absorb.
const MOVE_PER_OP: usize = 1;
/// The moves are made in batches of this many slots (every 16th insert or removal
/// moves 16): one at a time, each move's cache miss in the new index came alone among
/// the request's other work, where a loop of 16 keeps several in flight.
const MOVE_BATCH: usize = 16;
/// How much larger a new index is than the one it replaces. One slot moved per insert
/// finishes after at most the old capacity's inserts, when the new index holds twice
/// that: ×4 keeps it from filling first (×2 would fill just as the move ends). The
/// index is 8 bytes a row, so ×4 costs about 18 bytes a row on average.
const GROWTH: usize = 4;
/// Smallest index made.
const MIN_INDEX: usize = 16;
/// Indexes from this size (in bytes) up have their successor's memory faulted in ahead
/// ([`SlabMap::prepare`], `index_alloc`): from 32,768 buckets (28,672 rows).
const PREPARE_MIN: usize = 256 << 10;

#[derive(Clone, Copy)]
struct Idx {
    tag: u32,
    slot: u32,
}

/// The 64-bit hash the index tables are keyed by, rebuilt from the 32 bits kept: the low
/// bits pick the bucket, the top seven are hashbrown's control tag.
#[inline]
fn wide(tag: u32) -> u64 {
    ((tag as u64) << 32) | tag as u64
}

#[derive(Clone)]
struct Slot<K, V> {
    tag: u32,
    /// The index generation this row's entry is in ([`SlabMap`]'s `generation`).
    generation: u32,
    row: Option<(K, V)>,
}

/// A slab chunk: room for [`CHUNK`] rows, filled from the front as rows arrive. Its
/// memory is taken whole, so rows never move, but written (so faulted in) only as far as
/// it is used: a table of a few rows (a configuration, a pool's ranges) touches one
/// page, not the chunk's dozen. A replica's start builds every table of its chain, and
/// faulting in whole chunks there was most of a firewall's build (30 µs against 3).
struct Chunk<K, V>(Vec<Slot<K, V>>);

impl<K, V> Chunk<K, V> {
    fn new() -> Self {
        Chunk(Vec::with_capacity(CHUNK))
    }
}

impl<K: Clone, V: Clone> Clone for Chunk<K, V> {
    /// With the whole chunk's room, as the original: a clone's later rows must not move
    /// its earlier ones.
    fn clone(&self) -> Self {
        let mut c = Chunk::new();
        c.0.extend(self.0.iter().cloned());
        c
    }
}

/// A hash map for per-flow state whose growth moves no rows and stalls no insert; see
/// the module doc. The API is the subset of `HashMap` the NFs use.
#[derive(Clone)]
pub struct SlabMap<K, V, S = DefaultHashBuilder> {
    hasher: S,
    chunks: Vec<Chunk<K, V>>,
    /// Slots ever used (the high-water mark); below it, `free` holds the empty ones.
    slots: usize,
    free: Vec<u32>,
    len: usize,
    index: HashTable<Idx, IndexAlloc>,
    /// While the index grows: the previous one, read-only.
    old: Option<HashTable<Idx, IndexAlloc>>,
    /// The next index's memory, zeroed (so faulted in) a little per insert from when
    /// the index is 3/4 full ([`Self::prepare`]); its capacity is the block's size.
    next: Vec<u128>,
    /// While the index grows: the next slot whose entry moves, and the end of the
    /// slots to move (the slab's end when the growth began: later slots were filled
    /// into the new index).
    cursor: usize,
    move_end: usize,
    /// Moves owed and not made yet ([`MOVE_BATCH`]).
    owed: usize,
    generation: u32,
}

impl<K, V, S: Default> Default for SlabMap<K, V, S> {
    fn default() -> Self {
        SlabMap::empty(S::default())
    }
}

impl<K: fmt::Debug, V: fmt::Debug, S> fmt::Debug for SlabMap<K, V, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<K, V> SlabMap<K, V, DefaultHashBuilder> {
    pub fn new() -> Self {
        Self::default()
    }
}

impl<K, V, S> SlabMap<K, V, S> {
    fn empty(hasher: S) -> Self {
        SlabMap {
            hasher,
            chunks: Vec::new(),
            slots: 0,
            free: Vec::new(),
            len: 0,
            index: HashTable::new_in(IndexAlloc::default()),
            next: Vec::new(),
            old: None,
            cursor: 0,
            move_end: 0,
            owed: 0,
            generation: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rows the index holds before it next grows.
    pub fn capacity(&self) -> usize {
        self.index.capacity()
    }

    /// Whether the index is growing (an old index is still being moved from).
    pub fn is_growing(&self) -> bool {
        self.old.is_some()
    }

    pub fn clear(&mut self) {
        self.chunks.clear();
        self.slots = 0;
        self.free.clear();
        self.len = 0;
        self.index.clear();
        self.old = None;
        self.next = Vec::new();
        self.cursor = 0;
        self.move_end = 0;
        self.owed = 0;
    }

    /// Rows in slot order.
    pub fn iter(&self) -> Iter<'_, K, V> {
        Iter {
            chunks: &self.chunks,
            at: 0,
            left: self.len,
        }
    }

    pub fn keys(&self) -> impl Iterator<Item = &K> {
        self.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }

    /// The row in slot `s`, if it holds one. A slot is a row's address for as long as
    /// the row lives (rows never move; [`Self::clear`], [`Self::drain`] and building a
    /// map anew renumber them); a removed row's slot may be reused by a later insert.
    /// The per-flow timer queue names rows by slot: 4 bytes where a key is 40.
    pub fn at(&self, s: u32) -> Option<(&K, &V)> {
        let s = s as usize;
        let slot = self.chunks.get(s >> CHUNK_BITS)?.0.get(s & (CHUNK - 1))?;
        slot.row.as_ref().map(|(k, v)| (k, v))
    }

    /// [`Self::at`], to change the value.
    pub fn at_mut(&mut self, s: u32) -> Option<(&K, &mut V)> {
        let s = s as usize;
        let slot = (self.chunks.get_mut(s >> CHUNK_BITS)?.0).get_mut(s & (CHUNK - 1))?;
        slot.row.as_mut().map(|(k, v)| (&*k, v))
    }

    /// Rows with their slots, in slot order.
    pub fn slots(&self) -> impl Iterator<Item = (u32, &K, &V)> {
        (self.chunks.iter())
            .flat_map(|c| c.0.iter())
            .enumerate()
            .filter_map(|(s, slot)| slot.row.as_ref().map(|(k, v)| (s as u32, k, v)))
    }

    #[inline]
    fn slot(&self, s: u32) -> &Slot<K, V> {
        let s = s as usize;
        &self.chunks[s >> CHUNK_BITS].0[s & (CHUNK - 1)]
    }

    /// The value in slot `s`, which holds a row (a slot found by a probe, or just
    /// filled).
    fn value(&self, s: u32) -> &V {
        &self.slot(s).row.as_ref().expect("the slot holds a row").1
    }

    fn value_mut(&mut self, s: u32) -> &mut V {
        &mut self
            .slot_mut(s)
            .row
            .as_mut()
            .expect("the slot holds a row")
            .1
    }

    #[inline]
    fn slot_mut(&mut self, s: u32) -> &mut Slot<K, V> {
        let s = s as usize;
        &mut self.chunks[s >> CHUNK_BITS].0[s & (CHUNK - 1)]
    }

    /// Moves the next `n` slots' entries into the new index, and drops the old one
    /// when the move reaches the slab's end.
    fn advance(&mut self, n: usize) {
        if self.old.is_none() {
            return;
        }
        let end = (self.cursor + n).min(self.move_end);
        for s in self.cursor..end {
            let generation = self.generation;
            let slot = self.slot_mut(s as u32);
            if slot.row.is_some() && slot.generation != generation {
                slot.generation = generation;
                let tag = slot.tag;
                self.index.insert_unique(
                    wide(tag),
                    Idx {
                        tag,
                        slot: s as u32,
                    },
                    |e| wide(e.tag),
                );
            }
        }
        self.cursor = end;
        if self.cursor >= self.move_end {
            self.old = None;
        }
    }

    /// One op's share of the move, made a batch at a time.
    #[inline]
    fn step(&mut self) {
        if self.old.is_some() {
            self.owed += MOVE_PER_OP;
            if self.owed >= MOVE_BATCH {
                let n = std::mem::take(&mut self.owed);
                self.advance(n);
            }
        }
    }

    /// Zeroes a share of the next index's block, so that it is all faulted in by the
    /// time the index is 7/8 full: from 3/4 full, each insert zeroes what is left over
    /// the inserts left to 7/8 (a few hundred bytes, a page fault every dozen inserts).
    /// Small indexes are not prepared: their faults are few.
    fn prepare(&mut self) {
        let bytes = self.index.allocation_size();
        let (len, cap) = (self.index.len(), self.index.capacity());
        if bytes < PREPARE_MIN || len < cap - cap / 4 {
            return;
        }
        let want = (bytes * GROWTH).div_ceil(std::mem::size_of::<u128>());
        if self.next.capacity() != want {
            self.next = Vec::with_capacity(want);
        }
        let left = want - self.next.len();
        let inserts_left = (cap - cap / 8).saturating_sub(len).max(1);
        let n = left.div_ceil(inserts_left);
        self.next.resize(self.next.len() + n, 0);
    }

    /// The allocator of the next index, with its block made ahead if there is one (the
    /// rest of it zeroed now if the index filled sooner than planned).
    fn ready_block(&mut self) -> IndexAlloc {
        let mut next = std::mem::take(&mut self.next);
        if next.capacity() == 0 {
            return IndexAlloc::default();
        }
        next.resize(next.capacity(), 0);
        IndexAlloc::with_ready(next.into_boxed_slice())
    }

    /// Before an insert of a new row: starts growing the index if it is full, so that
    /// the insert never makes hashbrown rehash it.
    fn make_room(&mut self) {
        self.step();
        if self.old.is_some() {
            return;
        }
        if self.index.len() < self.index.capacity() {
            self.prepare();
        } else {
            let cap = (self.index.capacity() * GROWTH).max(MIN_INDEX);
            let index = HashTable::with_capacity_in(cap, self.ready_block());
            index.allocator().drop_unused();
            let old = std::mem::replace(&mut self.index, index);
            self.generation = self.generation.wrapping_add(1);
            self.cursor = 0;
            self.move_end = self.slots;
            self.owed = 0;
            if old.is_empty() {
                return;
            }
            self.old = Some(old);
        }
    }

    /// A free slot, or a new one at the slab's end. Slots are numbered in 32 bits: four
    /// billion rows of a per-flow table would be hundreds of GiB, far past any node's
    /// memory and any table's `max_rows`.
    fn alloc(&mut self, tag: u32, key: K, value: V) -> u32 {
        let slot = Slot {
            tag,
            generation: self.generation,
            row: Some((key, value)),
        };
        match self.free.pop() {
            Some(s) => {
                *self.slot_mut(s) = slot;
                s
            }
            None => {
                // The slab's end: the last chunk's next row, in a new chunk when it is full.
                let s = self.slots;
                if s >> CHUNK_BITS == self.chunks.len() {
                    self.chunks.push(Chunk::new());
                }
                if let Some(c) = self.chunks.last_mut() {
                    c.0.push(slot);
                }
                self.slots += 1;
                s as u32
            }
        }
    }
}

impl<K: Eq + Hash, V, S: BuildHasher> SlabMap<K, V, S> {
    pub fn with_hasher(hasher: S) -> Self {
        SlabMap::empty(hasher)
    }

    #[inline]
    fn tag<Q: Hash + ?Sized>(&self, key: &Q) -> u32 {
        self.hasher.hash_one(key) as u32
    }

    /// The slot holding `key`, and whether its entry is in the current index.
    #[inline]
    fn find<Q>(&self, key: &Q) -> Option<(u32, bool)>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if self.len == 0 {
            return None;
        }
        self.find_tagged(key, self.tag(key))
    }

    /// [`Self::find`] with the key's hash already taken (an insert hashes once).
    #[inline]
    fn find_tagged<Q>(&self, key: &Q, tag: u32) -> Option<(u32, bool)>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let hit = |e: &Idx| {
            e.tag == tag && matches!(&self.slot(e.slot).row, Some((k, _)) if k.borrow() == key)
        };
        if let Some(e) = self.index.find(wide(tag), hit) {
            return Some((e.slot, true));
        }
        let old = self.old.as_ref()?;
        old.find(wide(tag), hit).and_then(|e| {
            // An old entry whose row is in the new index is found there first; one found
            // here is a row the move has not reached.
            (self.slot(e.slot).generation != self.generation).then_some((e.slot, false))
        })
    }

    pub fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (s, _) = self.find(key)?;
        Some(self.value(s))
    }

    pub fn get_mut<Q>(&mut self, key: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (s, _) = self.find(key)?;
        Some(self.value_mut(s))
    }

    /// The slot holding `key`'s row ([`Self::at`]).
    pub fn slot_of<Q>(&self, key: &Q) -> Option<u32>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.find(key).map(|(s, _)| s)
    }

    pub fn contains_key<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.find(key).is_some()
    }

    /// Inserts or replaces; returns the value replaced.
    pub fn insert(&mut self, key: K, value: V) -> Option<V> {
        let tag = self.tag(&key);
        if let Some((s, _)) = self.find_tagged(&key, tag) {
            return Some(std::mem::replace(self.value_mut(s), value));
        }
        self.insert_new(tag, key, value);
        None
    }

    /// The row of `key`, to read, change or fill with one probe.
    pub fn entry(&mut self, key: K) -> Entry<'_, K, V, S> {
        let tag = self.tag(&key);
        match self.find_tagged(&key, tag) {
            Some((slot, _)) => Entry::Occupied(OccupiedEntry { map: self, slot }),
            None => Entry::Vacant(VacantEntry {
                map: self,
                key,
                tag,
            }),
        }
    }

    fn insert_new(&mut self, tag: u32, key: K, value: V) -> u32 {
        self.make_room();
        let s = self.alloc(tag, key, value);
        self.index
            .insert_unique(wide(tag), Idx { tag, slot: s }, |e| wide(e.tag));
        self.len += 1;
        s
    }

    pub fn remove<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.remove_entry(key).map(|(_, v)| v)
    }

    pub fn remove_entry<Q>(&mut self, key: &Q) -> Option<(K, V)>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let (s, current) = self.find(key)?;
        Some(self.remove_slot(s, current))
    }

    /// Empties slot `s`; its entry leaves the current index (one in the old index is
    /// left: a probe meeting it compares the key and goes on).
    fn remove_slot(&mut self, s: u32, current: bool) -> (K, V) {
        let tag = self.slot(s).tag;
        if current {
            if let Ok(e) = self.index.find_entry(wide(tag), |e| e.slot == s) {
                e.remove();
            }
        }
        let row = self
            .slot_mut(s)
            .row
            .take()
            .expect("a found slot holds a row");
        self.free.push(s);
        self.len -= 1;
        self.step();
        row
    }

    /// Keeps the rows for which `keep` is true.
    pub fn retain(&mut self, mut keep: impl FnMut(&K, &mut V) -> bool) {
        for s in 0..self.slots as u32 {
            let generation = self.generation;
            let slot = self.slot_mut(s);
            let current = slot.generation == generation;
            let drop = match slot.row.as_mut() {
                Some((k, v)) => !keep(k, v),
                None => false,
            };
            if drop {
                self.remove_slot(s, current);
            }
        }
    }

    /// Removes every row and returns them in slot order; the map keeps nothing.
    pub fn drain(&mut self) -> IntoIter<K, V> {
        let taken = std::mem::take(&mut self.chunks);
        let left = self.len;
        self.clear();
        IntoIter::new(taken, left)
    }
}

/// A row of a [`SlabMap`], present or not ([`SlabMap::entry`]).
pub enum Entry<'a, K, V, S> {
    Occupied(OccupiedEntry<'a, K, V, S>),
    Vacant(VacantEntry<'a, K, V, S>),
}

pub struct OccupiedEntry<'a, K, V, S> {
    map: &'a mut SlabMap<K, V, S>,
    slot: u32,
}

pub struct VacantEntry<'a, K, V, S> {
    map: &'a mut SlabMap<K, V, S>,
    key: K,
    tag: u32,
}

impl<'a, K: Eq + Hash, V, S: BuildHasher> Entry<'a, K, V, S> {
    /// The value, inserting `default` first if the row is absent.
    pub fn or_insert(self, default: V) -> &'a mut V {
        match self {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(default),
        }
    }
}

impl<'a, K, V, S> OccupiedEntry<'a, K, V, S> {
    pub fn get(&self) -> &V {
        self.map.value(self.slot)
    }

    pub fn get_mut(&mut self) -> &mut V {
        self.map.value_mut(self.slot)
    }

    pub fn into_mut(self) -> &'a mut V {
        self.map.value_mut(self.slot)
    }

    /// The row's slot ([`SlabMap::at`]).
    pub fn slot(&self) -> u32 {
        self.slot
    }
}

impl<'a, K: Eq + Hash, V, S: BuildHasher> VacantEntry<'a, K, V, S> {
    pub fn key(&self) -> &K {
        &self.key
    }

    pub fn insert(self, value: V) -> &'a mut V {
        let s = self.map.insert_new(self.tag, self.key, value);
        self.map.value_mut(s)
    }

    /// [`Self::insert`], answering the new row's slot ([`SlabMap::at`]).
    pub fn insert_slot(self, value: V) -> u32 {
        self.map.insert_new(self.tag, self.key, value)
    }
}

impl<K: Eq + Hash, V, S: BuildHasher + Default> FromIterator<(K, V)> for SlabMap<K, V, S> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let mut m = SlabMap::with_hasher(S::default());
        m.extend(iter);
        m
    }
}

impl<K: Eq + Hash, V, S: BuildHasher> Extend<(K, V)> for SlabMap<K, V, S> {
    fn extend<I: IntoIterator<Item = (K, V)>>(&mut self, iter: I) {
        for (k, v) in iter {
            self.insert(k, v);
        }
    }
}

impl<K: Eq + Hash, V: PartialEq, S: BuildHasher> PartialEq for SlabMap<K, V, S> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().all(|(k, v)| other.get(k) == Some(v))
    }
}

/// Rows by reference, in slot order.
pub struct Iter<'a, K, V> {
    chunks: &'a [Chunk<K, V>],
    at: usize,
    left: usize,
}

impl<'a, K, V> Iterator for Iter<'a, K, V> {
    type Item = (&'a K, &'a V);

    fn next(&mut self) -> Option<Self::Item> {
        while self.left > 0 {
            let s = &self.chunks[self.at >> CHUNK_BITS].0[self.at & (CHUNK - 1)];
            self.at += 1;
            if let Some((k, v)) = &s.row {
                self.left -= 1;
                return Some((k, v));
            }
        }
        None
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl<K, V> ExactSizeIterator for Iter<'_, K, V> {}

/// Rows by value, in slot order.
pub struct IntoIter<K, V> {
    chunks: std::vec::IntoIter<Chunk<K, V>>,
    chunk: std::vec::IntoIter<Slot<K, V>>,
    left: usize,
}

impl<K, V> Iterator for IntoIter<K, V> {
    type Item = (K, V);

    fn next(&mut self) -> Option<Self::Item> {
        while self.left > 0 {
            let Some(s) = self.chunk.next() else {
                self.chunk = self.chunks.next()?.0.into_iter();
                continue;
            };
            if let Some(row) = s.row {
                self.left -= 1;
                return Some(row);
            }
        }
        None
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

impl<K, V> ExactSizeIterator for IntoIter<K, V> {}

impl<K, V> IntoIter<K, V> {
    fn new(chunks: Vec<Chunk<K, V>>, left: usize) -> Self {
        IntoIter {
            chunks: chunks.into_iter(),
            chunk: Vec::new().into_iter(),
            left,
        }
    }
}

impl<K, V, S> IntoIterator for SlabMap<K, V, S> {
    type Item = (K, V);
    type IntoIter = IntoIter<K, V>;

    fn into_iter(self) -> IntoIter<K, V> {
        IntoIter::new(self.chunks, self.len)
    }
}

impl<'a, K, V, S> IntoIterator for &'a SlabMap<K, V, S> {
    type Item = (&'a K, &'a V);
    type IntoIter = Iter<'a, K, V>;

    fn into_iter(self) -> Iter<'a, K, V> {
        self.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap as StdMap;

    #[test]
    fn a_chunk_is_written_only_as_far_as_its_rows_and_a_clone_keeps_its_room() {
        let mut m: SlabMap<u64, u64> = SlabMap::new();
        for i in 0..3 {
            m.insert(i, i * 10);
        }
        assert_eq!(m.chunks.len(), 1);
        assert_eq!(m.chunks[0].0.len(), 3);
        assert!(m.chunks[0].0.capacity() >= CHUNK);
        let mut c = m.clone();
        assert!(c.chunks[0].0.capacity() >= CHUNK);
        let first = &c.chunks[0].0[0] as *const Slot<u64, u64>;
        // Filling the clone's chunk and one more moves none of its rows.
        for i in 3..CHUNK as u64 + 1 {
            c.insert(i, i * 10);
        }
        assert_eq!(first, &c.chunks[0].0[0] as *const Slot<u64, u64>);
        assert_eq!(c.chunks.len(), 2);
        assert_eq!(c.chunks[1].0.len(), 1);
        assert!((0..CHUNK as u64 + 1).all(|i| c.get(&i) == Some(&(i * 10))));
        // A freed slot is reused in place.
        c.remove(&1);
        c.insert(1000, 1);
        assert_eq!(c.chunks[1].0.len(), 1);
        assert_eq!(c.get(&1000), Some(&1));
        assert_eq!(m.len(), 3);
    }

    #[test]
    fn grows_without_losing_rows_and_drops_the_old_index() {
        let mut m: SlabMap<u64, u64> = SlabMap::new();
        let mut model = std::collections::HashSet::new();
        let mut growths = 0;
        let mut was_growing = false;
        for i in 0..300_000u64 {
            m.insert(i, i * 3);
            model.insert(i);
            if i % 3 == 0 {
                // Removals mid-growth free slots the move has not reached yet.
                assert_eq!(m.remove(&(i / 3)).is_some(), model.remove(&(i / 3)));
            }
            growths += usize::from(m.is_growing() && !was_growing);
            was_growing = m.is_growing();
        }
        assert!(growths >= 6, "the index grew {growths} times");
        assert_eq!(m.len(), model.len());
        for i in 0..300_000u64 {
            assert_eq!(
                m.get(&i).copied(),
                model.contains(&i).then_some(i * 3),
                "{i}"
            );
        }
        assert_eq!(m.iter().count(), m.len());
        // Enough inserts more finish the move and drop the old index.
        for i in 300_000..400_000u64 {
            m.insert(i, i * 3);
        }
        assert!(!m.is_growing() || m.capacity() > 400_000);
    }

    #[test]
    fn no_insert_ever_rehashes_the_whole_index() {
        // The index a growth starts holds every row until the next one: hashbrown
        // never grows it itself, which is what would move all of its entries at once.
        let mut m: SlabMap<u64, ()> = SlabMap::new();
        let mut cap = m.capacity();
        for i in 0..500_000u64 {
            let growing = m.is_growing();
            m.insert(i, ());
            if m.capacity() != cap {
                assert!(
                    !growing,
                    "the index grew again while it was growing: {cap} -> {} at {i}",
                    m.capacity()
                );
                assert!(m.capacity() >= GROWTH * cap, "{} after {cap}", m.capacity());
                cap = m.capacity();
            }
        }
    }

    #[test]
    fn a_big_index_grows_into_memory_made_ahead() {
        let mut m: SlabMap<u64, ()> = SlabMap::new();
        let mut big_growths = 0;
        let mut was_growing = false;
        for i in 0..400_000u64 {
            let bytes = m.index.allocation_size();
            m.insert(i, ());
            if m.is_growing() && !was_growing && bytes >= PREPARE_MIN {
                big_growths += 1;
                assert!(
                    m.index.allocator().gave_ready_block(),
                    "the index of {bytes} bytes grew into fresh memory at {i}"
                );
            }
            was_growing = m.is_growing();
        }
        assert!(big_growths >= 1);
        assert_eq!(m.len(), 400_000);
        assert!((0..400_000u64).all(|i| m.contains_key(&i)));
    }

    #[test]
    fn iteration_is_in_slot_order_whatever_the_hasher() {
        let a: SlabMap<u32, u32> = (0..5_000).map(|i| (i * 7919 % 10_007, i)).collect();
        let b: SlabMap<u32, u32> = (0..5_000).map(|i| (i * 7919 % 10_007, i)).collect();
        let ka: Vec<_> = a.keys().copied().collect();
        let kb: Vec<_> = b.keys().copied().collect();
        assert_eq!(ka, kb);
        assert_eq!(ka[..3], [0, 7919, 15_838 % 10_007]);
    }

    #[test]
    fn borrowed_lookups_find_owned_keys() {
        let mut m: SlabMap<Vec<u8>, u32> = SlabMap::new();
        m.insert(b"abc".to_vec(), 1);
        assert_eq!(m.get(&b"abc"[..]), Some(&1));
        assert_eq!(m.remove(&b"abc"[..]), Some(1));
        assert!(m.is_empty());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u16, u32),
        Remove(u16),
        Get(u16),
        Retain(u8),
        Drain,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            8 => (any::<u16>(), any::<u32>()).prop_map(|(k, v)| Op::Insert(k % 4096, v)),
            4 => any::<u16>().prop_map(|k| Op::Remove(k % 4096)),
            4 => any::<u16>().prop_map(|k| Op::Get(k % 4096)),
            1 => any::<u8>().prop_map(|m| Op::Retain(m % 5 + 2)),
            1 => Just(Op::Drain).prop_filter("rare", |_| true),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Against std's map as the model, over sequences long enough to grow the index
        /// several times with removals, reinsertions and slot reuse mid-growth.
        #[test]
        fn behaves_as_a_hash_map(ops in proptest::collection::vec(op(), 1..6_000)) {
            let mut m: SlabMap<u16, u32> = SlabMap::new();
            let mut model: StdMap<u16, u32> = StdMap::new();
            // Each row's slot when it went in: a row keeps it until it is removed, through
            // other rows' inserts, removals and the index's growth (the timer queue's
            // entries rely on it).
            let mut slots: StdMap<u16, u32> = StdMap::new();
            for op in ops {
                match op {
                    Op::Insert(k, v) => {
                        prop_assert_eq!(m.insert(k, v), model.insert(k, v));
                        let s = m.slot_of(&k).expect("just inserted");
                        prop_assert_eq!(*slots.entry(k).or_insert(s), s);
                        prop_assert_eq!(m.at(s), Some((&k, &v)));
                    }
                    Op::Remove(k) => {
                        prop_assert_eq!(m.remove(&k), model.remove(&k));
                        slots.remove(&k);
                    }
                    Op::Get(k) => prop_assert_eq!(m.get(&k), model.get(&k)),
                    Op::Retain(d) => {
                        m.retain(|k, _| k % d as u16 != 0);
                        model.retain(|k, _| k % d as u16 != 0);
                        slots.retain(|k, _| k % d as u16 != 0);
                    }
                    Op::Drain => {
                        if model.len() > 3_000 {
                            slots.clear();
                            let mut got: Vec<_> = m.drain().collect();
                            got.sort();
                            let mut want: Vec<_> = model.drain().collect();
                            want.sort();
                            prop_assert_eq!(got, want);
                        }
                    }
                }
                prop_assert_eq!(m.len(), model.len());
            }
            for (k, v) in &model {
                prop_assert_eq!(m.get(k), Some(v));
                prop_assert_eq!(m.slot_of(k), slots.get(k).copied());
            }
            let by_slot: Vec<_> = m.slots().map(|(s, k, v)| (s, *k, *v)).collect();
            prop_assert_eq!(by_slot.len(), model.len());
            for (s, k, v) in by_slot {
                prop_assert_eq!(slots.get(&k), Some(&s));
                prop_assert_eq!(model.get(&k), Some(&v));
            }
            let mut rows: Vec<_> = m.iter().map(|(k, v)| (*k, *v)).collect();
            rows.sort();
            let mut want: Vec<_> = model.into_iter().collect();
            want.sort();
            prop_assert_eq!(rows, want);
        }
    }
}
