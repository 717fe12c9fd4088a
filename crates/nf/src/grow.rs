//! Staggered growth of the per-flow hash maps.
//!
//! Every per-flow map of a chain (each NF's platform table, SNAT's mapping and reply
//! indexes, the LB's reply index) holds about one entry per flow, so with hashbrown's
//! fixed growth point (7/8 of a power of two) they would all double on the same flow,
//! and that one request would pay for rehashing every map of the replica: at 229,376
//! rows 20–35 ms a map (docs/setup-path.md, "Staggered doublings"). A chain near its
//! capacity then queues for several times the stall. Here each map doubles at its own
//! fill, from 3/4 to all of its capacity, set by a seed handed out in creation order,
//! so the same work comes as separate short stalls spread over the growth.
//!
//! Capacity never reaches a decision: nothing iterates these maps where order matters
//! (those paths sort), so replicas whose maps grew at different points agree.

use std::hash::{BuildHasher, Hash};
use std::sync::atomic::{AtomicU8, Ordering};

use hashbrown::HashMap;

/// Maps smaller than this grow at hashbrown's own point: alone, their rehash is too
/// short to matter (FM's 64 cache shards of a few thousand entries each are why it is
/// not higher: together they are one map's worth).
pub const STAGGER_FROM: usize = 3_584;
/// Distinct growth points.
const LEVELS: usize = 16;

static NEXT: AtomicU8 = AtomicU8::new(0);

/// A growth point for the next map made.
pub fn next_seed() -> u8 {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The fill at which a map of `capacity` with `seed` doubles: from all of it (seed 0)
/// down to 49/64 of it. Not lower: a map that doubles early holds its larger table (and
/// faults it in) that much sooner; from 1/2 up, a chain setting up flows flat out paid
/// about 5% of its rate for it.
pub fn grow_at(capacity: usize, seed: u8) -> usize {
    let s = seed as usize % LEVELS;
    capacity - capacity / (4 * LEVELS) * s
}

/// Call before an insert: doubles `map` now if it has reached its staggered growth
/// point (and is large enough for it to matter). A map bounded to `limit` entries
/// (`usize::MAX`: unbounded) that its capacity already holds never grows early: it
/// would never have grown at all.
#[inline]
pub fn stagger<K: Eq + Hash, V, S: BuildHasher>(
    map: &mut HashMap<K, V, S>,
    seed: u8,
    limit: usize,
) {
    let cap = map.capacity();
    if cap >= STAGGER_FROM && limit > cap {
        let len = map.len();
        if len >= grow_at(cap, seed) && len < cap {
            map.reserve(cap - len + 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_with_distinct_seeds_double_on_distinct_inserts() {
        let mut doubled_at = Vec::new();
        for seed in 0..LEVELS as u8 {
            let mut m: HashMap<u64, u64> = HashMap::new();
            let mut at = None;
            for i in 0..200_000u64 {
                let before = m.capacity();
                stagger(&mut m, seed, usize::MAX);
                m.insert(i, i);
                if before == 114_688 && m.capacity() != before {
                    // Still a doubling, never a smaller step.
                    assert_eq!(m.capacity(), 229_376);
                    at = Some(i);
                }
            }
            for k in (0..200_000u64).step_by(101) {
                assert_eq!(m.get(&k), Some(&k));
            }
            doubled_at.push(at.expect("the map doubled from 114,688"));
        }
        assert_eq!(doubled_at[0], 114_688);
        let mut distinct = doubled_at.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), LEVELS, "{doubled_at:?}");
        assert!(distinct[0] > 114_688 * 3 / 4, "{doubled_at:?}");
    }

    #[test]
    fn a_map_bounded_within_its_capacity_never_grows_early() {
        let mut m: HashMap<u64, u64> = HashMap::with_capacity(100_000);
        let cap = m.capacity();
        for i in 0..cap as u64 {
            stagger(&mut m, 15, cap);
            m.insert(i, i);
        }
        assert_eq!(m.capacity(), cap);
        // Bounded past it: it grows at its staggered point, before it is full.
        let mut m2: HashMap<u64, u64> = HashMap::with_capacity(100_000);
        for i in 0..(cap as u64 - 1) {
            stagger(&mut m2, 15, cap + 1);
            m2.insert(i, i);
        }
        assert!(m2.capacity() > cap);
    }

    #[test]
    fn the_growth_points_run_from_full_to_just_over_three_quarters() {
        assert_eq!(grow_at(229_376, 0), 229_376);
        assert_eq!(grow_at(229_376, 16), 229_376);
        let low = grow_at(229_376, 15);
        assert!(low > 229_376 * 3 / 4 && low < 229_376 * 25 / 32, "{low}");
    }
}
