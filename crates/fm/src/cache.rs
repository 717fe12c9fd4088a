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

use std::collections::VecDeque;

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
}

struct Entry {
    /// The reply, encoded as it came (`get` clears id, worker and decided_by).
    reply: Vec<u8>,
    ttl_ms: u64,
    deadline_ms: u64,
    generation: u64,
    /// The reverse direction of a flow cached under its own key (see `insert`): not a
    /// flow of its own, so not listed.
    companion: bool,
}

#[derive(Default)]
struct Shard {
    /// A [`SlabMap`]: the shards fill alike, so hashbrown maps would all double within
    /// a few thousand flows of each other, one FM stall each.
    map: SlabMap<CacheKey, Entry>,
    order: VecDeque<(CacheKey, u64)>,
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
    pub stats: CacheStats,
}

/// A cached reply as the cache tells it: id, worker and decided_by are the asker's and
/// the master's to fill in, so they are cleared.
fn cached_reply(bytes: &[u8]) -> Option<v1::RuleReply> {
    let mut r = v1::RuleReply::decode(bytes).ok()?;
    r.id = 0;
    r.worker = 0;
    r.decided_by.clear();
    Some(r)
}

fn shard_of(key: &CacheKey) -> usize {
    // The key bytes are already well mixed by the flow's addresses and ports; fold in
    // tenant and chain so two tenants' identical keys spread too.
    let k = &key.2;
    let h = u64::from_le_bytes([k[12], k[13], k[14], k[15], k[28], k[29], k[30], k[31]])
        ^ u64::from(u16::from_le_bytes([k[32], k[33]]))
        ^ (u64::from(key.0) << 17)
        ^ (u64::from(key.1) << 41);
    (h.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58) as usize % SHARDS
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
    pub fn get(&mut self, key: &CacheKey, now_ms: u64) -> Option<v1::RuleReply> {
        let shard = &mut self.shards[shard_of(key)];
        let Some(e) = shard.map.get_mut(key) else {
            self.stats.misses += 1;
            return None;
        };
        if e.deadline_ms <= now_ms {
            shard.map.remove(key);
            forget_owner(&mut self.owners, key);
            self.len -= 1;
            self.stats.expired += 1;
            self.stats.misses += 1;
            return None;
        }
        e.deadline_ms = now_ms.saturating_add(e.ttl_ms);
        match cached_reply(&e.reply) {
            Some(r) => {
                self.stats.hits += 1;
                Some(r)
            }
            None => {
                // Cannot happen (we encoded it); treat as a miss.
                shard.map.remove(key);
                forget_owner(&mut self.owners, key);
                self.len -= 1;
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Cache `reply` (id and worker are cleared; each hit fills in the asker's). Only
    /// rules are cached, never errors.
    ///
    /// Each companion rule (the reverse direction) is cached under its own key too,
    /// with the forward rule as *its* companion. In a PP cluster the underlay hashes the
    /// two directions of a flow independently (each sender picks its own outer source
    /// port), so the first packet a PP node sees of a flow is often a reply; after a vIP
    /// moves it is the reply direction's every packet. Without the entry that packet
    /// would go to SC under a key no NF decided.
    pub fn insert(&mut self, key: CacheKey, reply: &v1::RuleReply, now_ms: u64) {
        self.insert_one(key, reply, now_ms, false);
        let Some(v1::rule_reply::Result::Rule(fwd)) = &reply.result else {
            return;
        };
        for a in &reply.also {
            let Some(k) = a
                .key
                .as_ref()
                .and_then(|k| <[u8; 40]>::try_from(k.raw.as_slice()).ok())
            else {
                continue;
            };
            if k == key.2 {
                continue;
            }
            let mut fwd = fwd.clone();
            if fwd.key.is_none() {
                fwd.key = reply.key.clone();
            }
            let rev = v1::RuleReply {
                id: 0,
                worker: 0,
                key: a.key.clone(),
                result: Some(v1::rule_reply::Result::Rule(a.clone())),
                also: vec![fwd],
                decided_by: String::new(),
                frame_forwarded: false,
            };
            self.insert_one((key.0, key.1, k), &rev, now_ms, true);
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

    fn insert_one(&mut self, key: CacheKey, reply: &v1::RuleReply, now_ms: u64, companion: bool) {
        self.owners.insert(key.2, (key.0, key.1));
        let ttl_ms = match &reply.result {
            Some(v1::rule_reply::Result::Rule(r)) => {
                r.idle_timeout_ms.unwrap_or(self.default_ttl_ms)
            }
            _ => return,
        };
        // Encoded as it is, without a stripped copy: `get` clears what is the asker's.
        let mut bytes = Vec::with_capacity(reply.encoded_len());
        if reply.encode(&mut bytes).is_err() {
            return;
        }
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
        shard.map.insert(
            key,
            Entry {
                reply: bytes,
                ttl_ms,
                deadline_ms: now_ms.saturating_add(ttl_ms),
                generation,
                companion,
            },
        );
        shard.order.push_back((key, generation));
        if !replaces {
            self.len += 1;
        }
        self.stats.inserts += 1;
        if shard.order.len() > 2 * capacity.div_ceil(SHARDS) + 64 {
            // Replaced entries leave stale order slots behind; drop them in one pass.
            let map = &shard.map;
            shard
                .order
                .retain(|(k, g)| map.get(k).is_some_and(|e| e.generation == *g));
        }
    }

    /// Forget `key` (its NF state is gone).
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

    /// Forget `key` and its companions' entries (the flow's other direction). Returns
    /// the companions' flow keys the cached reply named (empty when `key` was not
    /// cached), so their rules can be withdrawn at PP too.
    pub fn invalidate(&mut self, key: &CacheKey) -> Vec<[u8; 40]> {
        let mut companions = Vec::new();
        let Some(e) = self.shards[shard_of(key)].map.remove(key) else {
            return companions;
        };
        forget_owner(&mut self.owners, key);
        self.len -= 1;
        self.stats.invalidated += 1;
        let Ok(r) = v1::RuleReply::decode(e.reply.as_slice()) else {
            return companions;
        };
        for a in &r.also {
            if let Some(Ok(b)) = a
                .key
                .as_ref()
                .map(|k| <[u8; 40]>::try_from(k.raw.as_slice()))
            {
                let ck = (key.0, key.1, b);
                if self.shards[shard_of(&ck)].map.remove(&ck).is_some() {
                    forget_owner(&mut self.owners, &ck);
                    self.len -= 1;
                    self.stats.invalidated += 1;
                }
                companions.push(b);
            }
        }
        companions
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
                if let Ok(r) = v1::RuleReply::decode(e.reply.as_slice()) {
                    for a in &r.also {
                        if let Some(Ok(b)) = a
                            .key
                            .as_ref()
                            .map(|k| <[u8; 40]>::try_from(k.raw.as_slice()))
                        {
                            keys.push(b);
                        }
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

    /// Live cached flows (not their companion entries) whose tenant passes `filter`: up to `limit` of them (in no
    /// particular order), each with its time to expiry, and how many matched in all.
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
                if e.deadline_ms <= now_ms || e.companion || !filter(k.0) {
                    continue;
                }
                matched += 1;
                if out.len() < limit {
                    if let Some(r) = cached_reply(&e.reply) {
                        out.push((*k, r, e.deadline_ms - now_ms));
                    }
                }
            }
        }
        (out, matched)
    }

    fn evict_one(&mut self, s: usize, now_ms: u64) -> bool {
        let shard = &mut self.shards[s];
        while let Some((k, g)) = shard.order.pop_front() {
            let live = shard.map.get(&k).map(|e| (e.generation, e.deadline_ms));
            match live {
                Some((eg, deadline)) if eg == g => {
                    shard.map.remove(&k);
                    forget_owner(&mut self.owners, &k);
                    self.len -= 1;
                    if deadline <= now_ms {
                        self.stats.expired += 1;
                    } else {
                        self.stats.evicted_full += 1;
                    }
                    return true;
                }
                _ => continue,
            }
        }
        false
    }

    /// Look at up to `budget` entries (of a few shards, round robin): drop expired ones,
    /// give live ones a second chance at the back.
    pub fn sweep(&mut self, now_ms: u64, budget: usize) {
        let per = budget.div_ceil(4).max(1);
        for _ in 0..4 {
            self.sweep_at = (self.sweep_at + 1) % SHARDS;
            let shard = &mut self.shards[self.sweep_at];
            for _ in 0..per {
                let Some((k, g)) = shard.order.pop_front() else {
                    break;
                };
                match shard.map.get(&k) {
                    Some(e) if e.generation == g => {
                        if e.deadline_ms <= now_ms {
                            shard.map.remove(&k);
                            forget_owner(&mut self.owners, &k);
                            self.len -= 1;
                            self.stats.expired += 1;
                        } else {
                            shard.order.push_back((k, g));
                        }
                    }
                    _ => {}
                }
            }
        }
    }
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
        v1::FlowKey { raw: vec![i; 40] }
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
