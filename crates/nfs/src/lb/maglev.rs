//! Maglev consistent hashing: the lookup table that maps a flow hash to a backend.
//!
//! Population follows the Maglev paper (Eisenbud et al., "Maglev: A Fast and Reliable
//! Software Network Load Balancer", NSDI 2016, §3.4, Pseudo-code 1): every backend owns a
//! permutation of the table's slots, `offset + j·skip (mod M)`, and the backends take turns
//! claiming their next free preferred slot until the table is full.
//!
//! Weights follow katran's `MaglevHashV2::generateHashRing`
//! (facebookincubator/katran, `katran/lib/MaglevHashV2.cpp`; the permutation is in
//! `katran/lib/MaglevBase.cpp`): each round every backend adds its weight to a credit, and
//! takes a turn only when the credit reaches the largest weight, paying that back. The
//! heaviest backend thus claims a slot every round and the others in proportion to their
//! weight, so slot counts are proportional to weights up to about one slot.
//!
//! Unlike katran, the permutation is derived from the backend's *identity* (address and
//! port) with a seeded hash, and the turn order is the identity order, so the table is a
//! function of the backend *set* and not of the order a configuration lists it in.

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The paper's recommended size for production: prime, and > 100× the backend count
/// for services with up to ~650 backends.
pub const DEFAULT_TABLE_SIZE: u32 = 65_537;

/// Largest table accepted: 2^24 slots of 4 bytes is 64 MiB per service, which is already
/// far more than any service here needs.
pub const MAX_TABLE_SIZE: u32 = 1 << 24;

/// Slot value of a table without backends. Never stored in a filled table.
const EMPTY: u32 = u32::MAX;

/// Salts that make the offset and skip hashes of one backend independent.
const OFFSET_SALT: u64 = 0x6f66_6673_6574_0001; // "offset"
const SKIP_SALT: u64 = 0x736b_6970_0000_0002; // "skip"

/// A backend's identity: what its permutation is derived from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BackendId {
    pub addr: IpAddr,
    pub port: u16,
}

impl BackendId {
    pub fn new(addr: IpAddr, port: u16) -> Self {
        BackendId { addr, port }
    }
}

impl fmt::Display for BackendId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.addr {
            IpAddr::V4(a) => write!(f, "{a}:{}", self.port),
            IpAddr::V6(a) => write!(f, "[{a}]:{}", self.port),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MaglevError {
    #[error(
        "Maglev table size {0} is not prime: each backend's skip must step through every \
         slot, which only a prime size guarantees (the default is 65537)"
    )]
    NotPrime(u32),
    #[error("Maglev table size {size} is out of range: it must be a prime from 2 to {max}")]
    OutOfRange { size: u32, max: u32 },
    #[error("backend {0} is listed twice")]
    Duplicate(BackendId),
}

/// Whether `n` is prime, by trial division (n ≤ 2^24 here, so ≤ 2048 divisions).
pub fn is_prime(n: u32) -> bool {
    if n < 2 {
        return false;
    }
    if n % 2 == 0 {
        return n == 2;
    }
    let n = n as u64;
    let mut d = 3u64;
    while d * d <= n {
        if n % d == 0 {
            return false;
        }
        d += 2;
    }
    true
}

/// Check a table size before building with it.
pub fn check_size(size: u32) -> Result<(), MaglevError> {
    if !(2..=MAX_TABLE_SIZE).contains(&size) {
        return Err(MaglevError::OutOfRange {
            size,
            max: MAX_TABLE_SIZE,
        });
    }
    if !is_prime(size) {
        return Err(MaglevError::NotPrime(size));
    }
    Ok(())
}

/// SplitMix64's finaliser: a bijective 64-bit mixer. Written out here, not borrowed from a
/// library, because the table must be identical on every replica and across releases.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Stable seeded hash of a backend's identity. IPv4 addresses are hashed v4-mapped, as
/// `FlowKey` stores them, so v4 and v6 identities never collide.
pub fn identity_hash(id: &BackendId, seed: u64, salt: u64) -> u64 {
    let octets = match id.addr {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    };
    let [hi, lo] = [&octets[..8], &octets[8..]].map(|half| {
        let mut w = [0u8; 8];
        w.copy_from_slice(half);
        u64::from_be_bytes(w)
    });
    let mut h = mix(seed ^ salt);
    for w in [hi, lo, id.port as u64] {
        h = mix(h.wrapping_add(0x9e37_79b9_7f4a_7c15) ^ w);
    }
    h
}

/// Salt of the flow hash, so it is independent of the backend hashes under one seed.
const FLOW_SALT: u64 = 0x666c_6f77_0000_0003; // "flow"

/// The hash a flow is looked up with: the flow's spec-pinned hash (`FlowKey::hash`, fixed
/// by `docs/golden-corpus.md`) mixed with the seed. Not `FlowKey::hash_seeded`: that one
/// serves PP's flow table and may change between releases, and a changed slot would move
/// every unpinned flow, or make replicas of different releases disagree.
pub fn flow_slot_hash(flow_hash: u64, seed: u64) -> u64 {
    mix(flow_hash ^ mix(seed ^ FLOW_SALT))
}

/// A backend's permutation of the table: (offset, skip), per the paper's
/// `offset = h1 % M`, `skip = h2 % (M − 1) + 1`.
pub fn permutation(id: &BackendId, size: u32, seed: u64) -> (u32, u32) {
    let m = size as u64;
    let offset = identity_hash(id, seed, OFFSET_SALT) % m;
    let skip = if m > 1 {
        identity_hash(id, seed, SKIP_SALT) % (m - 1) + 1
    } else {
        1
    };
    (offset as u32, skip as u32)
}

/// A populated Maglev lookup table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaglevTable {
    /// The backends with weight > 0, in identity order; slots index into this.
    backends: Vec<BackendId>,
    /// `size` slots, each an index into `backends`; empty when there are no backends.
    /// Shared by every table built from the same backends, size and seed in this
    /// process ([`shared_slots`]).
    slots: Arc<[u32]>,
    size: u32,
}

/// What a table is a function of: its weighted backends in identity order (weight > 0),
/// its size and its seed.
type TableKey = (Vec<(BackendId, u32)>, u32, u64);

/// Tables built in this process, by what they are a function of. Every replica of a
/// chain builds its LB's tables, and a node hosts many: one per partition group and
/// scale step. A table of the default size takes 100s of µs to populate (its probes
/// are random reads over 256 KiB: about 130,000 of them for two backends, 420,000 for
/// ten) and holds 256 KiB, so the replicas of one service share one: a replica's start
/// then costs a lookup here, not a population. Entries are weak: a table no LB holds is
/// freed, and its entry goes at the next insert.
fn built() -> &'static Mutex<HashMap<TableKey, Weak<[u32]>>> {
    static BUILT: OnceLock<Mutex<HashMap<TableKey, Weak<[u32]>>>> = OnceLock::new();
    BUILT.get_or_init(Default::default)
}

/// The slots of the table for `key`: a live one built before, or a new population.
fn shared_slots(key: TableKey, ids: &[BackendId], weights: &[u64]) -> Arc<[u32]> {
    // A poisoned lock only means a thread panicked while holding it; the map is still
    // whole (every write is one insert or retain), so it is used as it is.
    let lookup = |key: &TableKey| {
        let map = built().lock().unwrap_or_else(|p| p.into_inner());
        map.get(key).and_then(Weak::upgrade)
    };
    if let Some(slots) = lookup(&key) {
        return slots;
    }
    // Populated without the lock, so a build of another service never waits for this
    // one; two replicas building the same table at once both populate it, and the
    // second keeps the first's (they are equal).
    let slots: Arc<[u32]> = populate(ids, weights, key.1, key.2).into();
    let mut map = built().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(live) = map.get(&key).and_then(Weak::upgrade) {
        return live;
    }
    map.retain(|_, w| w.strong_count() > 0);
    map.insert(key, Arc::downgrade(&slots));
    slots
}

impl MaglevTable {
    /// Build the table of `size` slots (a prime) for weighted backends. Backends of
    /// weight 0 take no slots. The result depends on the set of (identity, weight)
    /// pairs and the seed only.
    pub fn build(backends: &[(BackendId, u32)], size: u32, seed: u64) -> Result<Self, MaglevError> {
        check_size(size)?;
        let mut all: Vec<(BackendId, u32)> = backends.to_vec();
        all.sort_by_key(|(id, _)| *id);
        if let Some(w) = all.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(MaglevError::Duplicate(w[0].0));
        }
        all.retain(|(_, w)| *w > 0);
        let ids: Vec<BackendId> = all.iter().map(|(id, _)| *id).collect();
        if ids.is_empty() {
            return Ok(MaglevTable {
                backends: ids,
                slots: Arc::from(Vec::new()),
                size,
            });
        }
        let weights: Vec<u64> = all.iter().map(|(_, w)| *w as u64).collect();
        let slots = shared_slots((all, size, seed), &ids, &weights);
        Ok(MaglevTable {
            backends: ids,
            slots,
            size,
        })
    }

    /// The backend for a flow hash; `None` when no backend has weight.
    pub fn lookup(&self, hash: u64) -> Option<BackendId> {
        if self.slots.is_empty() {
            return None;
        }
        let slot = (hash % self.slots.len() as u64) as usize;
        self.owner(slot)
    }

    /// Owner of one slot.
    pub fn owner(&self, slot: usize) -> Option<BackendId> {
        let i = *self.slots.get(slot)?;
        self.backends.get(i as usize).copied()
    }

    /// M, the configured number of slots (also when the table is empty).
    pub fn size(&self) -> u32 {
        self.size
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The backends that own slots, in identity order.
    pub fn backends(&self) -> &[BackendId] {
        &self.backends
    }

    /// Number of slots each backend owns, in identity order.
    pub fn counts(&self) -> Vec<(BackendId, usize)> {
        let mut n = vec![0usize; self.backends.len()];
        for &i in self.slots.iter() {
            if let Some(c) = n.get_mut(i as usize) {
                *c += 1;
            }
        }
        self.backends.iter().copied().zip(n).collect()
    }

    /// The owner of every slot, as identities (empty for an empty table).
    pub fn owners(&self) -> Vec<BackendId> {
        (0..self.slots.len())
            .filter_map(|s| self.owner(s))
            .collect()
    }
}

/// Pseudo-code 1 with katran's weight credits. `ids` is non-empty, weights are > 0, and
/// `size` is prime, so every permutation visits every slot and each round fills at least
/// one slot (the heaviest backend's): the loop ends after at most `size` rounds.
fn populate(ids: &[BackendId], weights: &[u64], size: u32, seed: u64) -> Vec<u32> {
    let m = size as usize;
    let mut slots = vec![EMPTY; m];
    let perms: Vec<(usize, usize)> = ids
        .iter()
        .map(|id| {
            let (o, s) = permutation(id, size, seed);
            (o as usize, s as usize)
        })
        .collect();
    // `next[i]` of the paper, kept as the slot it points at: offset + next·skip (mod M).
    let mut cursor: Vec<usize> = perms.iter().map(|(o, _)| *o).collect();
    let mut credit = vec![0u64; ids.len()];
    let max_weight = weights.iter().copied().max().unwrap_or(1);
    let mut filled = 0usize;
    loop {
        for i in 0..ids.len() {
            credit[i] += weights[i];
            if credit[i] < max_weight {
                continue;
            }
            credit[i] -= max_weight;
            // `skip < m` and `cursor < m`, so one subtraction is the modulo. The
            // division per probe cost about a tenth of a build (first_packet's
            // `lb/build_first`: medians 348 against 383 µs for two backends); the rest
            // is the probes' random reads.
            let skip = perms[i].1;
            let step = |c: usize| {
                let n = c + skip;
                if n >= m {
                    n - m
                } else {
                    n
                }
            };
            let mut c = cursor[i];
            while slots[c] != EMPTY {
                c = step(c);
            }
            slots[c] = i as u32;
            cursor[i] = step(c);
            filled += 1;
            if filled == m {
                return slots;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(i: u32) -> BackendId {
        BackendId::new(IpAddr::from([198, 19, 1, i as u8]), 8080)
    }

    /// Pseudo-code 1 as first written here, with a division per probe: what `populate`
    /// must still produce, slot for slot, since replicas of different releases must
    /// agree on every table.
    fn populate_by_division(ids: &[BackendId], weights: &[u64], size: u32, seed: u64) -> Vec<u32> {
        let m = size as usize;
        let mut slots = vec![EMPTY; m];
        let perms: Vec<(usize, usize)> = ids
            .iter()
            .map(|id| {
                let (o, s) = permutation(id, size, seed);
                (o as usize, s as usize)
            })
            .collect();
        let mut cursor: Vec<usize> = perms.iter().map(|(o, _)| *o).collect();
        let mut credit = vec![0u64; ids.len()];
        let max_weight = weights.iter().copied().max().unwrap_or(1);
        let mut filled = 0usize;
        loop {
            for i in 0..ids.len() {
                credit[i] += weights[i];
                if credit[i] < max_weight {
                    continue;
                }
                credit[i] -= max_weight;
                let skip = perms[i].1;
                while slots[cursor[i]] != EMPTY {
                    cursor[i] = (cursor[i] + skip) % m;
                }
                slots[cursor[i]] = i as u32;
                cursor[i] = (cursor[i] + skip) % m;
                filled += 1;
                if filled == m {
                    return slots;
                }
            }
        }
    }

    #[test]
    fn population_without_division_is_the_same_table() {
        for (n, size, seed) in [
            (1, 13, 0),
            (2, 65_537, 0),
            (3, 251, 7),
            (10, 65_537, 42),
            (40, 4099, 3),
        ] {
            let ids: Vec<BackendId> = (0..n).map(id).collect();
            let weights: Vec<u64> = (0..n as u64).map(|i| 1 + i % 4).collect();
            assert_eq!(
                populate(&ids, &weights, size, seed),
                populate_by_division(&ids, &weights, size, seed),
                "{n} backends, size {size}, seed {seed}"
            );
        }
    }

    #[test]
    fn tables_of_one_backend_set_share_their_slots_while_one_lives() {
        // A seed no other test uses, so no other test's tables are in the way.
        let seed = 0x5eed_7ab1e;
        let b: Vec<_> = (0..4).map(|i| (id(i), 1)).collect();
        let t1 = MaglevTable::build(&b, 251, seed).unwrap();
        // The same set in another order, and the same set with a weight 0 backend
        // added: the same table.
        let mut shuffled = b.clone();
        shuffled.reverse();
        shuffled.push((id(9), 0));
        let t2 = MaglevTable::build(&shuffled, 251, seed).unwrap();
        assert!(Arc::ptr_eq(&t1.slots, &t2.slots));
        assert_eq!(t1, t2);
        // Another weight, size or seed: another table.
        let mut heavier = b.clone();
        heavier[0].1 = 2;
        let t3 = MaglevTable::build(&heavier, 251, seed).unwrap();
        let t4 = MaglevTable::build(&b, 257, seed).unwrap();
        let t5 = MaglevTable::build(&b, 251, seed + 1).unwrap();
        for t in [&t3, &t4, &t5] {
            assert!(!Arc::ptr_eq(&t1.slots, &t.slots));
        }
        // Once no table holds them the slots are freed (the cache's entry is weak),
        // and the next build populates the same table anew.
        let weak = Arc::downgrade(&t1.slots);
        let owners = t1.owners();
        drop((t1, t2));
        assert!(weak.upgrade().is_none());
        let again = MaglevTable::build(&b, 251, seed).unwrap();
        assert_eq!(again.owners(), owners);
    }

    #[test]
    fn primes() {
        let p: Vec<u32> = (0..30).filter(|&n| is_prime(n)).collect();
        assert_eq!(p, [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]);
        assert!(is_prime(65_537));
        assert!(!is_prime(65_536));
        assert!(is_prime(16_777_213));
    }

    #[test]
    fn small_table_is_full_and_balanced() {
        let b: Vec<_> = (0..3).map(|i| (id(i), 1)).collect();
        let t = MaglevTable::build(&b, 7, 0).unwrap();
        let c = t.counts();
        assert_eq!(c.iter().map(|(_, n)| n).sum::<usize>(), 7);
        assert!(c.iter().all(|(_, n)| (2..=3).contains(n)), "{c:?}");
    }

    #[test]
    fn single_backend_and_empty() {
        let t = MaglevTable::build(&[(id(1), 5)], 13, 9).unwrap();
        assert!((0..13).all(|s| t.owner(s) == Some(id(1))));
        let t = MaglevTable::build(&[(id(1), 0)], 13, 9).unwrap();
        assert!(t.is_empty());
        assert_eq!(t.lookup(42), None);
    }
}
