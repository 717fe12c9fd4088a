//! FM's rule cache: the rules FM returned, so a repeated request (a restarted or
//! rebalanced PP node re-learning its flows, paper 000 §3.2, §4.1) is answered without
//! touching SC.
//!
//! Bounded in count; an entry lives for its rule's idle timeout after its last use,
//! and SC's timers invalidate entries whose NF state they removed, so a cached rule
//! never outlives the state it was computed from. Replacement is FIFO with a second
//! chance: the periodic sweep moves live entries it passes to the back, expired ones
//! out. Every removal is counted by cause.
//!
//! Two choices keep the master task's latency flat as the cache grows to millions of
//! rules: entries hold the reply *encoded* (one allocation instead of dozens), and the
//! cache is split into shards by key hash, so growing a table rehashes 1/64 of it at a
//! time instead of stalling every request for tens of milliseconds.
//!
//! A flow is one encoded reply, under its forward key. Its reverse-direction key holds
//! only the forward key (`Body::Reverse`) and is answered from the forward entry.

use std::collections::VecDeque;
use std::sync::Arc;

// hashbrown's default hasher (foldhash, seeded per map) rather than std's SipHash:
// these maps are probed for every rule request and reply, with 48-byte keys.
use nf::SlabMap;

use prost::Message;
use proto::v1;

/// (tenant, chain, flow key bytes).
pub type CacheKey = (u32, u32, [u8; 40]);

const SHARDS: usize = 64;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub inserts: u64,
    /// Removed to make room (the cache was full).
    pub evicted_full: u64,
    /// Idle past the rule's timeout.
    pub expired: u64,
    /// Removed because SC dropped the flow's state.
    pub invalidated: u64,
    /// Removed because the entry's bytes did not decode when asked for (SC's encoding
    /// of a reply is cached as it came, `insert_encoded`); the request went to SC.
    pub unreadable: u64,
}

struct Entry {
    body: Body,
    ttl_ms: u64,
    deadline_ms: u64,
    generation: u64,
}

/// What one probe of the cache found (`RuleCache::lookup`).
enum Lookup {
    Missing,
    Forward(Option<v1::RuleReply>),
    Reverse([u8; 40]),
}

/// What an entry holds.
enum Body {
    /// The reply, encoded without the asker's id and worker (`get` also clears
    /// decided_by). Shared: the first answer to PP sends these bytes
    /// (`v1::EncodedReply`).
    Reply(Arc<[u8]>),
    /// The reverse direction of a flow: the forward entry's flow key, under the same
    /// tenant and chain. The forward reply carries the reverse rule among its
    /// companions, so this entry needs no copy of it: it is answered from the forward
    /// entry, lives as long as that one does, and is not a flow of its own (not listed).
    /// With a second encoded copy per flow, caching a flow took 1.28× the time and a
    /// flow 1.25× the memory (`cargo bench -p fm --bench cache`, docs/setup-path.md).
    Reverse([u8; 40]),
}

#[derive(Default)]
struct Shard {
    /// A [`SlabMap`]: the shards fill alike, so hashbrown maps would all double within
    /// a few thousand flows of each other, one FM stall each.
    map: SlabMap<CacheKey, Entry>,
    /// FIFO order: each entry's slot in `map` ([`SlabMap::at`]) and the generation it
    /// was inserted with, so a slot whose entry left or was replaced since is known
    /// stale. 16 bytes a slot, where the entry's 48-byte key took 56: two entries per
    /// flow.
    order: VecDeque<(u32, u64)>,
}

pub struct RuleCache {
    shards: Vec<Shard>,
    /// Flow key → the (tenant, chain) it was last cached under, for requests from PP
    /// nodes that do not know the flow's tenant (`proto::UNBOUND_TENANT`). An entry
    /// leaves with the cache entry it names, so the index never outgrows the cache and
    /// never needs a rebuild. (It used to keep stale keys and, on the insert that found
    /// it twice the cache's size, rebuild itself from every shard in one step.)
    owners: SlabMap<[u8; 40], (u32, u32)>,
    len: usize,
    capacity: usize,
    default_ttl_ms: u64,
    next_gen: u64,
    sweep_at: usize,
    /// Scratch for an inserted reply's companion keys (no allocation per insert).
    also_keys: Vec<[u8; 40]>,
    pub stats: CacheStats,
}

/// `reply` encoded straight into shared memory: one allocation, which the cache entry
/// and the answers to PP hold.
fn encode_shared(reply: &v1::RuleReply) -> Option<Arc<[u8]>> {
    let n = reply.encoded_len();
    // An exact-size iterator collects into one allocation of the Arc itself.
    let mut bytes: Arc<[u8]> = std::iter::repeat_n(0u8, n).collect();
    let mut out: &mut [u8] = Arc::get_mut(&mut bytes)?;
    reply.encode(&mut out).ok()?;
    out.is_empty().then_some(bytes)
}

/// A cached reply as the cache tells it: id, worker and decided_by are the asker's and
/// the master's to fill in, so they are cleared.
fn cached_reply(bytes: &[u8]) -> Option<v1::RuleReply> {
    let mut r = v1::RuleReply::decode(bytes).ok()?;
    r.id = 0;
    r.worker = 0;
    r.decided_by.clear();
    r.decided_by_group = 0;
    Some(r)
}

fn shard_of(key: &CacheKey) -> usize {
    // Every byte of the key counts. Reverse-direction keys of SNAT'd flows to one
    // server differ only in the destination port (the port SNAT gave out); a mix of the
    // addresses and the source port alone put all of them in 8 of the 64 shards, whose
    // per-shard cap then evicted them with the cache mostly empty.
    let k = &key.2;
    let mut h = (u64::from(key.0) << 32) | u64::from(key.1);
    for (i, w) in k.chunks_exact(8).enumerate() {
        let w = u64::from_le_bytes(w.try_into().unwrap_or_default());
        h ^= w.rotate_left(13 * i as u32);
    }
    // murmur3's 64-bit finaliser: the shard is the top bits.
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    (h >> 58) as usize % SHARDS
}

/// Drop `key`'s owner entry if it names `key`'s tenant chain (the same flow key cached
/// under another chain since keeps its entry).
fn forget_owner(owners: &mut SlabMap<[u8; 40], (u32, u32)>, key: &CacheKey) {
    if owners.get(&key.2) == Some(&(key.0, key.1)) {
        owners.remove(&key.2);
    }
}

impl RuleCache {
    pub fn new(capacity: usize, default_ttl_ms: u64) -> Self {
        RuleCache {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            owners: SlabMap::new(),
            len: 0,
            capacity: capacity.max(1),
            default_ttl_ms,
            next_gen: 1,
            sweep_at: 0,
            also_keys: Vec::new(),
            stats: CacheStats::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The cached reply for `key` (id and worker zero), refreshing its idle deadline.
    /// For a flow's reverse-direction key, that is the reverse rule with the forward
    /// rule as its companion, and the forward entry's deadline is what is refreshed.
    pub fn get(&mut self, key: &CacheKey, now_ms: u64) -> Option<v1::RuleReply> {
        let r = match self.lookup(key, now_ms) {
            Lookup::Missing => None,
            Lookup::Forward(r) => r,
            Lookup::Reverse(f) => {
                let r = match self.lookup(&(key.0, key.1, f), now_ms) {
                    Lookup::Forward(fwd) => fwd.and_then(|fwd| reverse_reply(fwd, &key.2)),
                    _ => None,
                };
                if r.is_none() {
                    // Its flow left (or was replaced by one without this direction).
                    self.remove_entry(key);
                    self.stats.expired += 1;
                }
                r
            }
        };
        if r.is_some() {
            self.stats.hits += 1;
        } else {
            self.stats.misses += 1;
        }
        r
    }

    /// One probe for `key`: a forward entry is decoded and its deadline refreshed (an
    /// entry past its deadline is removed, counted expired, and reads as `Forward(None)`);
    /// a reverse entry gives the forward key it names.
    fn lookup(&mut self, key: &CacheKey, now_ms: u64) -> Lookup {
        let Some(e) = self.shards[shard_of(key)].map.get_mut(key) else {
            return Lookup::Missing;
        };
        let bytes = match &e.body {
            Body::Reverse(f) => return Lookup::Reverse(*f),
            Body::Reply(bytes) => bytes,
        };
        if e.deadline_ms <= now_ms {
            self.remove_entry(key);
            self.stats.expired += 1;
            return Lookup::Forward(None);
        }
        let r = cached_reply(bytes);
        e.deadline_ms = now_ms.saturating_add(e.ttl_ms);
        if r.is_none() {
            // Bytes SC encoded that scanned as a rule but do not decode: a miss, so
            // the flow is decided again.
            self.remove_entry(key);
            self.stats.unreadable += 1;
        }
        Lookup::Forward(r)
    }

    /// Whether `key` holds a forward entry within its deadline.
    fn forward_live(&self, key: &CacheKey, now_ms: u64) -> bool {
        self.shards[shard_of(key)]
            .map
            .get(key)
            .is_some_and(|e| matches!(e.body, Body::Reply(_)) && e.deadline_ms > now_ms)
    }

    /// Take `key`'s entry out, with its owner index entry; not counted in the stats.
    fn remove_entry(&mut self, key: &CacheKey) -> Option<Entry> {
        let e = self.shards[shard_of(key)].map.remove(key)?;
        forget_owner(&mut self.owners, key);
        self.len -= 1;
        Some(e)
    }

    /// Cache `reply` (id and worker are cleared; each hit fills in the asker's). Only
    /// rules are cached, never errors.
    ///
    /// Each companion rule's key (the reverse direction) gets an entry too, which names
    /// the forward entry (`Body::Reverse`): asked for, it answers with the reverse
    /// rule and the forward rule as *its* companion. In a PP cluster the underlay
    /// hashes the two directions of a flow independently (each sender picks its own
    /// outer source port), so the first packet a PP node sees of a flow is often a
    /// reply; after a vIP moves it is the reply direction's every packet. Without the
    /// entry that packet would go to SC under a key no NF decided.
    ///
    /// Returns the entry's bytes (a `RuleReply` with id and worker left out), which
    /// the master sends as the flow's first answer; `None` for an error, which is not
    /// cached. The master clears id and worker before it calls this; a reply that
    /// still has them is encoded from a cleared copy.
    pub fn insert(
        &mut self,
        key: CacheKey,
        reply: &v1::RuleReply,
        now_ms: u64,
    ) -> Option<Arc<[u8]>> {
        let Some(v1::rule_reply::Result::Rule(fwd)) = &reply.result else {
            return None;
        };
        let bytes = if reply.id == 0 && reply.worker == 0 {
            encode_shared(reply)
        } else {
            encode_shared(&v1::RuleReply {
                id: 0,
                worker: 0,
                ..reply.clone()
            })
        }?;
        let mut also = std::mem::take(&mut self.also_keys);
        also.clear();
        also.extend(reply.also.iter().filter_map(|a| {
            a.key
                .as_ref()
                .and_then(|k| <[u8; 40]>::try_from(&k.raw[..]).ok())
        }));
        self.insert_flow(key, bytes.clone(), fwd.idle_timeout_ms, &also, now_ms);
        self.also_keys = also;
        Some(bytes)
    }

    /// [`RuleCache::insert`] for a reply SC sent encoded (`v1::EncodedRuleReply`'s
    /// body: id and worker left out), read without decoding it
    /// ([`proto::scan_rule_reply`]). Returns the entry's bytes, a copy of `body` in one
    /// allocation; `None`, caching nothing, for bytes that are not a rule reply or do
    /// not read as one, or that carry an asker's field (id, worker) the answers to PP
    /// could not override.
    pub fn insert_encoded(&mut self, key: CacheKey, body: &[u8], now_ms: u64) -> Option<Arc<[u8]>> {
        let mut also = std::mem::take(&mut self.also_keys);
        also.clear();
        let scanned = proto::scan_rule_reply(body, |k| {
            if let Ok(k) = <[u8; 40]>::try_from(k) {
                also.push(k);
            }
        });
        let r = match scanned {
            Ok(s) if s.rule && !s.asker_fields => {
                let bytes: Arc<[u8]> = Arc::from(body);
                self.insert_flow(key, bytes.clone(), s.idle_timeout_ms, &also, now_ms);
                Some(bytes)
            }
            _ => None,
        };
        self.also_keys = also;
        r
    }

    /// Cache a flow's encoded rule reply under `key`, and an entry naming it under each
    /// of its companions' keys `also`.
    fn insert_flow(
        &mut self,
        key: CacheKey,
        bytes: Arc<[u8]>,
        idle_timeout_ms: Option<u64>,
        also: &[[u8; 40]],
        now_ms: u64,
    ) {
        let ttl_ms = idle_timeout_ms.unwrap_or(self.default_ttl_ms);
        let deadline_ms = now_ms.saturating_add(ttl_ms);
        self.insert_one(key, Body::Reply(bytes), ttl_ms, deadline_ms, now_ms);
        for &k in also {
            if k == key.2 {
                continue;
            }
            // Lives as long as the forward entry: its own deadline never passes.
            self.insert_one((key.0, key.1, k), Body::Reverse(key.2), 0, u64::MAX, now_ms);
        }
    }

    /// The cached reply for flow `key` under whatever tenant chain holds it (see
    /// `owners`), with the cache key it was found under.
    pub fn get_by_flow(
        &mut self,
        key: &[u8; 40],
        now_ms: u64,
    ) -> Option<(CacheKey, v1::RuleReply)> {
        let (t, c) = *self.owners.get(key)?;
        let ck = (t, c, *key);
        match self.get(&ck, now_ms) {
            Some(r) => Some((ck, r)),
            None => {
                self.owners.remove(key);
                None
            }
        }
    }

    /// A reverse entry's `deadline_ms` is `u64::MAX`: it has none of its own.
    fn insert_one(
        &mut self,
        key: CacheKey,
        body: Body,
        ttl_ms: u64,
        deadline_ms: u64,
        now_ms: u64,
    ) {
        self.owners.insert(key.2, (key.0, key.1));
        let s = shard_of(&key);
        let replaces = self.shards[s].map.contains_key(&key);
        if !replaces {
            // Make room in this shard first, then anywhere.
            let per_shard = self.capacity.div_ceil(SHARDS);
            while self.shards[s].map.len() >= per_shard || self.len >= self.capacity {
                let victim = if self.shards[s].map.is_empty() {
                    (s + 1..s + SHARDS)
                        .map(|i| i % SHARDS)
                        .find(|i| !self.shards[*i].map.is_empty())
                } else {
                    Some(s)
                };
                match victim {
                    Some(v) if self.evict_one(v, now_ms) => {}
                    _ => break,
                }
            }
        }
        let generation = self.next_gen;
        self.next_gen += 1;
        let capacity = self.capacity;
        let shard = &mut self.shards[s];
        let entry = Entry {
            body,
            ttl_ms,
            deadline_ms,
            generation,
        };
        let slot = match shard.map.entry(key) {
            nf::slabmap::Entry::Occupied(mut o) => {
                *o.get_mut() = entry;
                o.slot()
            }
            nf::slabmap::Entry::Vacant(v) => v.insert_slot(entry),
        };
        shard.order.push_back((slot, generation));
        if !replaces {
            self.len += 1;
        }
        self.stats.inserts += 1;
        if shard.order.len() > 2 * capacity.div_ceil(SHARDS) + 64 {
            // Replaced entries leave stale order slots behind; drop them in one pass.
            let map = &shard.map;
            shard
                .order
                .retain(|(slot, g)| map.at(*slot).is_some_and(|(_, e)| e.generation == *g));
        }
    }

    /// Drop every entry (not counted as evictions); returns how many there were.
    pub fn clear(&mut self) -> usize {
        let n = self.len;
        self.owners.clear();
        for s in &mut self.shards {
            s.map.clear();
            s.order.clear();
        }
        self.len = 0;
        n
    }

    /// Forget `key`'s flow: its forward entry and its reverse entries, from either
    /// direction's key. Returns the other flow keys the flow's rules named (empty when
    /// `key` was not cached), so their rules can be withdrawn at PP too.
    pub fn invalidate(&mut self, key: &CacheKey) -> Vec<[u8; 40]> {
        let mut others = Vec::new();
        let Some(e) = self.remove_entry(key) else {
            return others;
        };
        self.stats.invalidated += 1;
        let (fwd, bytes) = match e.body {
            Body::Reply(b) => (*key, b),
            Body::Reverse(f) => {
                let fwd = (key.0, key.1, f);
                others.push(f);
                match self.shards[shard_of(&fwd)].map.get(&fwd).map(|e| &e.body) {
                    Some(Body::Reply(_)) => {}
                    _ => return others,
                }
                let Some(Entry {
                    body: Body::Reply(b),
                    ..
                }) = self.remove_entry(&fwd)
                else {
                    return others;
                };
                self.stats.invalidated += 1;
                (fwd, b)
            }
        };
        let Ok(r) = v1::RuleReply::decode(&bytes[..]) else {
            return others;
        };
        for b in also_keys(&r) {
            if b == key.2 || b == fwd.2 {
                continue;
            }
            let ck = (key.0, key.1, b);
            let names_fwd = self.shards[shard_of(&ck)]
                .map
                .get(&ck)
                .is_some_and(|e| matches!(e.body, Body::Reverse(f) if f == fwd.2));
            if names_fwd {
                self.remove_entry(&ck);
                self.stats.invalidated += 1;
            }
            others.push(b);
        }
        others
    }

    /// Forget every rule of one tenant chain (the chain was removed or rebuilt);
    /// returns how many went.
    pub fn remove_chain(&mut self, tenant: u32, chain: u32) -> usize {
        let (n, _) = self.remove_chain_keys(tenant, chain);
        n
    }

    /// Forget one chain's entries: how many, and every flow key their rules cover (each
    /// entry's own key and its companion rules' keys), for revoking them at PP.
    pub fn remove_chain_keys(&mut self, tenant: u32, chain: u32) -> (usize, Vec<[u8; 40]>) {
        let mut n = 0;
        let mut keys = Vec::new();
        for shard in &mut self.shards {
            let before = shard.map.len();
            shard.map.retain(|k, e| {
                if !(k.0 == tenant && k.1 == chain) {
                    return true;
                }
                forget_owner(&mut self.owners, k);
                keys.push(k.2);
                if let Body::Reply(bytes) = &e.body {
                    if let Ok(r) = v1::RuleReply::decode(&bytes[..]) {
                        keys.extend(also_keys(&r));
                    }
                }
                false
            });
            n += before - shard.map.len();
        }
        self.len -= n;
        self.stats.invalidated += n as u64;
        keys.sort_unstable();
        keys.dedup();
        (n, keys)
    }

    /// Live cached flows (their forward entries) whose tenant passes `filter`: up to
    /// `limit` of them (in no particular order), each with its time to expiry, and how
    /// many matched in all.
    /// A scan of the whole cache: for operators (`starfabric flows`), not the data path.
    pub fn list(
        &self,
        filter: impl Fn(u32) -> bool,
        limit: usize,
        now_ms: u64,
    ) -> (Vec<(CacheKey, v1::RuleReply, u64)>, u64) {
        let mut out = Vec::new();
        let mut matched = 0u64;
        for shard in &self.shards {
            for (k, e) in &shard.map {
                let Body::Reply(bytes) = &e.body else {
                    continue;
                };
                if e.deadline_ms <= now_ms || !filter(k.0) {
                    continue;
                }
                matched += 1;
                if out.len() < limit {
                    if let Some(r) = cached_reply(bytes) {
                        out.push((*k, r, e.deadline_ms - now_ms));
                    }
                }
            }
        }
        (out, matched)
    }

    /// The key of the entry in `slot` of shard `s` if it is still the one of generation
    /// `g`, and whether it is past its time: its own deadline, or for a reverse entry
    /// its forward entry's. None when the order slot is stale (the entry left or was
    /// replaced since).
    fn idle(&self, s: usize, slot: u32, g: u64, now_ms: u64) -> Option<(CacheKey, bool)> {
        let (key, e) = self.shards[s]
            .map
            .at(slot)
            .filter(|(_, e)| e.generation == g)?;
        let idle = match e.body {
            Body::Reply(_) => e.deadline_ms <= now_ms,
            Body::Reverse(f) => !self.forward_live(&(key.0, key.1, f), now_ms),
        };
        Some((*key, idle))
    }

    fn evict_one(&mut self, s: usize, now_ms: u64) -> bool {
        while let Some((slot, g)) = self.shards[s].order.pop_front() {
            let Some((k, idle)) = self.idle(s, slot, g, now_ms) else {
                continue;
            };
            self.remove_entry(&k);
            if idle {
                self.stats.expired += 1;
            } else {
                self.stats.evicted_full += 1;
            }
            return true;
        }
        false
    }

    /// Look at up to `budget` entries (of a few shards, round robin): drop expired ones
    /// (and reverse entries whose flow left), give live ones a second chance at the
    /// back.
    pub fn sweep(&mut self, now_ms: u64, budget: usize) {
        let per = budget.div_ceil(4).max(1);
        for _ in 0..4 {
            self.sweep_at = (self.sweep_at + 1) % SHARDS;
            let s = self.sweep_at;
            for _ in 0..per {
                let Some((slot, g)) = self.shards[s].order.pop_front() else {
                    break;
                };
                match self.idle(s, slot, g, now_ms) {
                    Some((k, true)) => {
                        self.remove_entry(&k);
                        self.stats.expired += 1;
                    }
                    Some((_, false)) => self.shards[s].order.push_back((slot, g)),
                    None => {}
                }
            }
        }
    }
}

/// The flow keys of a reply's companion rules.
fn also_keys(r: &v1::RuleReply) -> impl Iterator<Item = [u8; 40]> + '_ {
    r.also.iter().filter_map(|a| {
        a.key
            .as_ref()
            .and_then(|k| <[u8; 40]>::try_from(&k.raw[..]).ok())
    })
}

/// The reply for `rkey`, the reverse direction of the flow whose forward reply is `fwd`:
/// the companion rule under `rkey`, with the forward rule as its companion. None when
/// `fwd` names no rule under `rkey`.
fn reverse_reply(mut fwd: v1::RuleReply, rkey: &[u8; 40]) -> Option<v1::RuleReply> {
    let i = fwd
        .also
        .iter()
        .position(|a| a.key.as_ref().is_some_and(|k| &k.raw[..] == rkey))?;
    let rev = fwd.also.swap_remove(i);
    let Some(v1::rule_reply::Result::Rule(mut rule)) = fwd.result.take() else {
        return None;
    };
    if rule.key.is_none() {
        rule.key = fwd.key.take();
    }
    Some(v1::RuleReply {
        id: 0,
        worker: 0,
        key: rev.key.clone(),
        result: Some(v1::rule_reply::Result::Rule(rev)),
        also: vec![rule],
        decided_by: String::new(),
        decided_by_group: 0,
        frame_forwarded: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(timeout: Option<u64>) -> v1::RuleReply {
        v1::RuleReply {
            id: 9,
            key: None,
            result: Some(v1::rule_reply::Result::Rule(v1::Rule {
                key: None,
                actions: vec![],
                idle_timeout_ms: timeout,
            })),
            also: vec![],
            worker: 3,
            decided_by: String::new(),
            decided_by_group: 0,
            frame_forwarded: false,
        }
    }

    fn key(i: u8) -> CacheKey {
        (1, 1, [i; 40])
    }

    #[test]
    fn hits_refresh_and_idle_entries_expire() {
        let mut c = RuleCache::new(10, 1000);
        c.insert(key(1), &reply(Some(100)), 0);
        assert_eq!(c.get(&key(1), 50).map(|r| (r.id, r.worker)), Some((0, 0)));
        // Refreshed at 50: alive until 150.
        assert!(c.get(&key(1), 140).is_some());
        assert!(c.get(&key(1), 240).is_none());
        assert_eq!(c.stats.expired, 1);
        assert_eq!(c.stats.hits, 2);
        // Errors are not cached.
        let mut e = reply(None);
        e.result = Some(v1::rule_reply::Result::Error("x".into()));
        c.insert(key(2), &e, 0);
        assert!(c.is_empty());
        // The default timeout applies to rules without one.
        c.insert(key(3), &reply(None), 0);
        assert!(c.get(&key(3), 999).is_some());
        for _ in 0..SHARDS {
            c.sweep(5000, 10);
        }
        assert!(c.is_empty());
    }

    #[test]
    fn bounded_with_counted_evictions() {
        let mut c = RuleCache::new(4, 1000);
        for i in 0..10 {
            c.insert(key(i), &reply(None), 0);
        }
        assert_eq!(c.len(), 4);
        assert_eq!(c.stats.evicted_full, 6);
        assert!(c.get(&key(9), 1).is_some());
        // Re-inserting a key replaces it without eviction.
        c.insert(key(9), &reply(None), 2);
        assert_eq!(c.len(), 4);
        assert_eq!(c.stats.evicted_full, 6);
        c.invalidate(&key(9));
        assert_eq!(c.stats.invalidated, 1);
        assert_eq!(c.len(), 3);

        // Many keys over a larger cache: the bound holds and the oldest go first.
        let mut c = RuleCache::new(1000, 1000);
        for i in 0..5000u32 {
            let mut k = [0u8; 40];
            k[12..16].copy_from_slice(&i.to_le_bytes());
            c.insert((1, 1, k), &reply(Some(1 << 30)), u64::from(i));
        }
        assert!(c.len() <= 1000);
        assert_eq!(c.stats.evicted_full + c.len() as u64, 5000);
        let mut newest = [0u8; 40];
        newest[12..16].copy_from_slice(&4999u32.to_le_bytes());
        assert!(c.get(&(1, 1, newest), 5000).is_some());
    }

    #[test]
    fn eviction_goes_oldest_first_past_slots_reused_or_replaced_since() {
        // Five keys of one shard, whose cap is 3.
        let same: Vec<CacheKey> = (0..=u8::MAX)
            .map(|i| (1, 1, [i; 40]))
            .filter(|k| shard_of(k) == shard_of(&(1, 1, [0; 40])))
            .take(5)
            .collect();
        let [a, b, c, d, e] = same[..] else {
            panic!("five keys of one shard among 256");
        };
        let mut c_ = RuleCache::new(3 * SHARDS, 1 << 30);
        c_.insert(a, &reply(None), 0);
        c_.insert(b, &reply(None), 0);
        // `a` leaves and `c` takes its slot: `a`'s order slot is stale, not `c`'s.
        c_.invalidate(&a);
        c_.insert(c, &reply(None), 0);
        c_.insert(d, &reply(None), 0);
        // Full: the oldest live entry goes, `b`.
        c_.insert(e, &reply(None), 0);
        assert_eq!(c_.stats.evicted_full, 1);
        assert!(c_.get(&b, 1).is_none());
        assert!(c_.get(&c, 1).is_some());
        // `c` replaced in place is the newest now: `d` goes next, then `e`, then `c`.
        c_.insert(c, &reply(None), 2);
        for (gone, next) in [(d, a), (e, b), (c, d)] {
            c_.insert(next, &reply(None), 3);
            assert!(c_.get(&gone, 4).is_none(), "{gone:?}");
        }
        assert_eq!(c_.stats.evicted_full, 4);
        assert_eq!(c_.len(), 3);
    }

    #[test]
    fn list_filters_by_tenant_and_remove_chain_forgets_one_chain() {
        let mut c = RuleCache::new(100, 1000);
        for i in 0..6u8 {
            let tenant = 1 + u32::from(i % 2);
            c.insert((tenant, 1, [i; 40]), &reply(Some(500)), 0);
        }
        c.insert((1, 2, [9; 40]), &reply(Some(500)), 0);
        let (flows, matched) = c.list(|t| t == 1, 2, 100);
        assert_eq!(matched, 4);
        assert_eq!(flows.len(), 2);
        assert!(flows.iter().all(|(k, _, ttl)| k.0 == 1 && *ttl == 400));
        // Past their deadline they are not listed.
        assert_eq!(c.list(|_| true, 100, 600).1, 0);
        assert_eq!(c.remove_chain(1, 1), 3);
        assert_eq!(c.len(), 4);
        assert_eq!(c.list(|t| t == 1, 100, 100).1, 1);
        assert_eq!(c.stats.invalidated, 3);
    }

    fn fk(i: u8) -> v1::FlowKey {
        v1::FlowKey {
            raw: vec![i; 40].into(),
        }
    }

    /// A reply for flow key 1 that carries the reverse direction's rule (key 2).
    fn reply_with_reverse() -> v1::RuleReply {
        let mut r = reply(Some(500));
        r.key = Some(fk(1));
        r.also = vec![v1::Rule {
            key: Some(fk(2)),
            actions: vec![],
            idle_timeout_ms: Some(500),
        }];
        r
    }

    #[test]
    fn a_reply_direction_key_is_answered_with_the_forward_rule_as_companion() {
        let mut c = RuleCache::new(100, 1000);
        let r = reply_with_reverse();
        c.insert(key(1), &r, 0);
        assert_eq!(c.len(), 2);
        let rev = c.get(&key(2), 10).expect("reverse key cached");
        assert_eq!(rev.key, Some(fk(2)));
        match rev.result {
            Some(v1::rule_reply::Result::Rule(ref rule)) => assert_eq!(rule.key, Some(fk(2))),
            ref other => panic!("not a rule: {other:?}"),
        }
        assert_eq!(rev.also.len(), 1);
        assert_eq!(rev.also[0].key, Some(fk(1)), "forward rule comes along");
        // SC dropping the flow's state invalidates both directions, from either key.
        c.invalidate(&key(1));
        assert_eq!(c.len(), 0);
        assert!(c.get(&key(2), 20).is_none());
        c.insert(key(1), &r, 30);
        c.invalidate(&key(2));
        assert_eq!(c.len(), 0);
        assert_eq!(c.stats.invalidated, 4);
    }

    /// A reply for flow key `f` whose rules also cover the reverse keys `revs`.
    fn reply_covering(f: u8, revs: &[u8], timeout: u64) -> v1::RuleReply {
        let mut r = reply(Some(timeout));
        r.key = Some(fk(f));
        r.also = revs
            .iter()
            .map(|&k| v1::Rule {
                key: Some(fk(k)),
                actions: vec![],
                idle_timeout_ms: Some(timeout),
            })
            .collect();
        r
    }

    #[test]
    fn a_reverse_entry_holds_no_copy_and_lives_as_long_as_its_flow() {
        let mut c = RuleCache::new(100, 1000);
        c.insert(key(1), &reply_covering(1, &[2], 100), 0);
        let s = &c.shards[shard_of(&key(2))];
        assert!(
            matches!(s.map.get(&key(2)).map(|e| &e.body), Some(Body::Reverse(f)) if *f == [1; 40])
        );
        // Traffic in the reply direction alone keeps the flow: each hit refreshes the
        // forward entry's deadline.
        for t in (50..=500).step_by(50) {
            let r = c.get(&key(2), t).expect("reverse hit");
            assert_eq!(r.key, Some(fk(2)));
            assert_eq!(r.also[0].key, Some(fk(1)));
        }
        assert!(c.get(&key(1), 590).is_some(), "refreshed at 500");
        // Idle past the forward's deadline: both directions miss, and the reverse entry
        // left too, counted as expired.
        assert!(c.get(&key(2), 700).is_none());
        assert_eq!(c.len(), 0);
        assert_eq!(c.stats.expired, 2);
        assert_eq!(c.owners.len(), 0);
    }

    #[test]
    fn reverse_entries_of_a_flow_that_left_are_swept_or_missed() {
        // A forward entry that leaves other than by invalidation (replaced, idle,
        // evicted) leaves its reverse entries behind, until a lookup or the sweep finds
        // their flow gone.
        let mut c = RuleCache::new(100, 1000);
        c.insert(key(1), &reply_covering(1, &[2], 100), 0);
        c.invalidate(&key(1));
        assert_eq!(c.len(), 0, "invalidation takes both");
        c.insert(key(1), &reply_covering(1, &[2], 100), 0);
        // Replaced by a reply that no longer covers key 2: key 2 is a miss and leaves.
        c.insert(key(1), &reply_covering(1, &[3], 100), 10);
        assert!(c.get(&key(2), 20).is_none());
        assert!(c.get(&key(3), 20).is_some());
        assert_eq!(c.len(), 2);
        // Expired forward: the sweep removes the reverse entry as well.
        for _ in 0..SHARDS {
            c.sweep(1000, 64);
        }
        assert_eq!(c.len(), 0);
        assert_eq!(c.owners.len(), 0);
    }

    #[test]
    fn invalidating_either_direction_takes_the_flows_entries_and_no_other() {
        let mut c = RuleCache::new(100, 1000);
        c.insert(key(1), &reply_covering(1, &[2, 3], 100), 0);
        assert_eq!(c.len(), 3);
        let mut others = c.invalidate(&key(3));
        others.sort_unstable();
        assert_eq!(others, vec![[1; 40], [2; 40]]);
        assert_eq!(c.len(), 0);
        assert_eq!(c.stats.invalidated, 3);
        // Key 3 later became another flow's forward key: invalidating flow 1 leaves it.
        c.insert(key(1), &reply_covering(1, &[2, 3], 100), 0);
        c.insert(key(3), &reply(Some(100)), 0);
        c.invalidate(&key(1));
        assert!(c.get(&key(3), 1).is_some());
        assert!(c.get(&key(2), 1).is_none());
    }

    /// A reply-direction key of an SNAT'd flow to one server: only the destination port
    /// (the one SNAT gave out) differs from flow to flow.
    fn reply_key(port: u16) -> [u8; 40] {
        let mut k = [0u8; 40];
        k[10..16].copy_from_slice(&[0xff, 0xff, 198, 19, 1, 7]);
        k[26..32].copy_from_slice(&[0xff, 0xff, 198, 19, 255, 1]);
        k[32..34].copy_from_slice(&53u16.to_be_bytes());
        k[34..36].copy_from_slice(&port.to_be_bytes());
        k[36..40].copy_from_slice(&[0, 0, 200, 17]);
        k
    }

    #[test]
    fn keys_that_differ_only_in_one_port_spread_over_every_shard() {
        let mut per = [0usize; SHARDS];
        for port in 1024..=u16::MAX {
            per[shard_of(&(1, 1, reply_key(port)))] += 1;
        }
        let mean = (u16::MAX as usize - 1023) / SHARDS;
        assert!(
            per.iter().all(|&n| n > mean / 2 && n < mean * 3 / 2),
            "{per:?}"
        );
        // So a cache sized for them holds them all: none is evicted.
        let mut c = RuleCache::new(2 * (u16::MAX as usize - 1023), 1000);
        for port in 1024..=u16::MAX {
            c.insert((1, 1, reply_key(port)), &reply(None), 0);
        }
        assert_eq!(c.stats.evicted_full, 0);
        assert_eq!(c.len(), u16::MAX as usize - 1023);
    }

    #[test]
    fn the_owner_index_leaves_with_its_entries() {
        let mut c = RuleCache::new(8, 1000);
        // Churn far past the capacity, by every way an entry leaves: eviction when full,
        // idle expiry met by a lookup or the sweep, invalidation, a chain's removal.
        for i in 0..200u32 {
            let k = (1 + i % 2, 1, [(i % 251) as u8; 40]);
            c.insert(k, &reply(Some(5)), u64::from(i));
            if i % 5 == 0 {
                c.invalidate(&k);
            }
            c.sweep(u64::from(i), 4);
            assert!(
                c.owners.len() <= c.len(),
                "{} owners for {} entries",
                c.owners.len(),
                c.len()
            );
        }
        assert!(c.get_by_flow(&[199; 40], 1_000_000).is_none());
        c.remove_chain(1, 1);
        c.remove_chain(2, 1);
        assert_eq!((c.len(), c.owners.len()), (0, 0));
        // A flow key cached under two chains: the index names the later one, and
        // losing the earlier one's entry keeps it.
        c.insert((1, 1, [7; 40]), &reply(None), 0);
        c.insert((2, 1, [7; 40]), &reply(None), 0);
        c.invalidate(&(1, 1, [7; 40]));
        let (ck, _) = c
            .get_by_flow(&[7; 40], 1)
            .expect("still cached under chain 2");
        assert_eq!(ck.0, 2);
    }

    #[test]
    fn a_flow_is_found_by_key_alone_under_the_chain_that_cached_it() {
        let mut c = RuleCache::new(100, 1000);
        let r = reply_with_reverse();
        c.insert((4, 2, [1; 40]), &r, 0);
        let (ck, rev) = c.get_by_flow(&[2; 40], 10).expect("reverse key by flow");
        assert_eq!(ck, (4, 2, [2; 40]));
        assert_eq!(rev.also[0].key, Some(fk(1)));
        assert!(c.get_by_flow(&[1; 40], 10).is_some());
        assert!(c.get_by_flow(&[3; 40], 10).is_none());
        // Gone from the cache: not found by flow either.
        c.invalidate(&(4, 2, [1; 40]));
        assert!(c.get_by_flow(&[2; 40], 20).is_none());
    }
}
