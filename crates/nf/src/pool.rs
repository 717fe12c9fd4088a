//! A pool of free units (the ports of one address, ids): the row of a
//! [`SplitRule::Pool`](crate::SplitRule::Pool) table.
//!
//! One bit per unit of an inclusive range, set while the unit is free. A bitmap rather
//! than a free list: the split that halves a pool by count (paper 000 §4.1), the merge
//! that unites two, and the check that no unit is free on both sides all run word by
//! word over tens of thousands of units, on the request stream.

use serde::{Deserialize, Serialize};

use crate::DetRng;

/// Random probes before falling back to a scan. At 95 % occupancy 16 probes still find a
/// unit 56 % of the time; the scan keeps the tail bounded and allocation exact.
pub const PROBES: usize = 16;

/// Free units of one pool row, one bit per unit of `lo..=hi`.
#[derive(Debug, Clone)]
pub struct UnitSet {
    lo: u16,
    hi: u16,
    /// One bit per unit, set while it is free; empty while every unit is free (a set
    /// made by [`UnitSet::full`] and not taken from yet). A replica's start builds its
    /// SNAT's pool rows, 8 KiB of bitmap per address for a whole port range, and wrote
    /// every word of each: 32 addresses were most of a start's NF build. The first take
    /// writes the bitmap.
    bits: Vec<u64>,
    free: u32,
}

impl PartialEq for UnitSet {
    /// By the free units, however they are held.
    fn eq(&self, other: &Self) -> bool {
        if (self.lo, self.hi, self.free) != (other.lo, other.hi, other.free) {
            return false;
        }
        // Every unit free on both sides, or (neither set unwritten) the same bits.
        self.free == self.len() || self.bits == other.bits
    }
}

impl Eq for UnitSet {}

/// How [`UnitSet::alloc`] found its unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Alloc {
    pub unit: u16,
    /// The wanted unit was free (port preservation).
    pub preserved: bool,
    /// Random probes made, the successful one included.
    pub probes: usize,
    /// Failed random probes before success; [`PROBES`] when the scan found it.
    pub failed_probes: usize,
}

/// A pool row as snapshots carry it: its range and its free units as inclusive ranges.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PoolWire {
    pub(crate) lo: u16,
    pub(crate) hi: u16,
    pub(crate) free: Vec<[u16; 2]>,
}

impl UnitSet {
    /// `lo..=hi`, every unit in use (a part's row before its free units arrive).
    pub fn empty(lo: u16, hi: u16) -> Self {
        let (lo, hi) = (lo.min(hi), lo.max(hi));
        let len = u32::from(hi) - u32::from(lo) + 1;
        UnitSet {
            lo,
            hi,
            bits: vec![0; len.div_ceil(64) as usize],
            free: 0,
        }
    }

    /// `lo..=hi`, every unit free. The bitmap is written at the first take.
    pub fn full(lo: u16, hi: u16) -> Self {
        let (lo, hi) = (lo.min(hi), lo.max(hi));
        let mut s = UnitSet {
            lo,
            hi,
            bits: Vec::new(),
            free: 0,
        };
        s.free = s.len();
        s
    }

    /// Whether the bitmap is unwritten: every unit free.
    fn unwritten(&self) -> bool {
        self.bits.is_empty()
    }

    /// Write the bitmap of an unwritten set (every unit free).
    fn write(&mut self) {
        if !self.unwritten() {
            return;
        }
        let len = self.len();
        self.bits = vec![!0; len.div_ceil(64) as usize];
        let tail = len % 64;
        if tail != 0 {
            if let Some(last) = self.bits.last_mut() {
                *last = (1u64 << tail) - 1;
            }
        }
    }

    pub fn range(&self) -> (u16, u16) {
        (self.lo, self.hi)
    }

    /// Units in the range.
    pub fn len(&self) -> u32 {
        u32::from(self.hi) - u32::from(self.lo) + 1
    }

    /// Free units.
    pub fn free(&self) -> u32 {
        self.free
    }

    pub fn is_empty(&self) -> bool {
        self.free == 0
    }

    fn index(&self, unit: u16) -> Option<usize> {
        (unit >= self.lo && unit <= self.hi).then(|| usize::from(unit - self.lo))
    }

    pub fn contains(&self, unit: u16) -> bool {
        self.index(unit).is_some()
    }

    fn unit_at(&self, i: usize) -> u16 {
        // i < len <= 65536 and lo + i <= hi, so this neither truncates nor overflows.
        self.lo.wrapping_add(i as u16)
    }

    pub fn is_free(&self, unit: u16) -> bool {
        if self.unwritten() {
            return self.contains(unit);
        }
        self.index(unit)
            .and_then(|i| self.bits.get(i / 64).map(|w| w >> (i % 64) & 1 == 1))
            .unwrap_or(false)
    }

    /// Mark in use; false if it was not free.
    pub fn take(&mut self, unit: u16) -> bool {
        let Some(i) = self.index(unit) else {
            return false;
        };
        self.write();
        match self.bits.get_mut(i / 64) {
            Some(w) if *w >> (i % 64) & 1 == 1 => {
                *w &= !(1u64 << (i % 64));
                self.free -= 1;
                true
            }
            _ => false,
        }
    }

    /// Mark free; false if outside the range or already free.
    pub fn put(&mut self, unit: u16) -> bool {
        let Some(i) = self.index(unit) else {
            return false;
        };
        if self.unwritten() {
            return false;
        }
        match self.bits.get_mut(i / 64) {
            Some(w) if *w >> (i % 64) & 1 == 0 => {
                *w |= 1u64 << (i % 64);
                self.free += 1;
                true
            }
            _ => false,
        }
    }

    /// The first free index at or after `start`, wrapping around.
    fn first_free_from(&self, start: usize) -> Option<usize> {
        if self.unwritten() {
            return (start < self.len() as usize).then_some(start);
        }
        let n = self.bits.len();
        let (w0, b0) = (start / 64, (start % 64) as u32);
        let head = self.bits.get(w0)? & (!0u64 << b0);
        if head != 0 {
            return Some(w0 * 64 + head.trailing_zeros() as usize);
        }
        for k in 1..=n {
            let w = (w0 + k) % n;
            let mut word = self.bits[w];
            if w == w0 {
                word &= (1u64 << b0).wrapping_sub(1);
            }
            if word != 0 {
                return Some(w * 64 + word.trailing_zeros() as usize);
            }
        }
        None
    }

    /// The free units, ascending.
    pub fn free_units(&self) -> impl Iterator<Item = u16> + '_ {
        // An unwritten set's units are the range; its bitmap, empty, adds none.
        let all = self.unwritten().then_some(self.lo..=self.hi);
        let written = self.bits.iter().enumerate().flat_map(move |(wi, &w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                (w != 0).then(|| {
                    let b = w.trailing_zeros() as usize;
                    w &= w - 1;
                    self.unit_at(wi * 64 + b)
                })
            })
        });
        all.into_iter().flatten().chain(written)
    }

    /// The free units as inclusive ranges, ascending.
    pub fn ranges(&self) -> Vec<[u16; 2]> {
        if self.unwritten() {
            return vec![[self.lo, self.hi]];
        }
        let mut out: Vec<[u16; 2]> = Vec::new();
        for p in self.free_units() {
            match out.last_mut() {
                Some(r) if u32::from(r[1]) + 1 == u32::from(p) => r[1] = p,
                _ => out.push([p, p]),
            }
        }
        out
    }

    /// Pick a unit: the wanted one if free (port preservation), else uniformly random
    /// among free ones (RFC 6056 §3.3.1 style) by probing, then by a scan from a random
    /// point. `None` only when nothing is free.
    pub fn alloc(&mut self, want: u16, rng: &mut DetRng) -> Option<Alloc> {
        if self.free == 0 {
            return None;
        }
        if self.take(want) {
            return Some(Alloc {
                unit: want,
                preserved: true,
                probes: 0,
                failed_probes: 0,
            });
        }
        let len = u64::from(self.len());
        for tries in 0..PROBES {
            let unit = self.unit_at(rng.below(len) as usize);
            if self.take(unit) {
                return Some(Alloc {
                    unit,
                    preserved: false,
                    probes: tries + 1,
                    failed_probes: tries,
                });
            }
        }
        let i = self.first_free_from(rng.below(len) as usize)?;
        let unit = self.unit_at(i);
        self.take(unit).then_some(Alloc {
            unit,
            preserved: false,
            probes: PROBES,
            failed_probes: PROBES,
        })
    }

    /// Give away the upper half (by count) of the free units.
    pub fn split_upper_half(&mut self) -> UnitSet {
        let mut moved = UnitSet::empty(self.lo, self.hi);
        let keep = self.free - self.free / 2;
        let upper: Vec<u16> = self.free_units().skip(keep as usize).collect();
        for p in upper {
            self.take(p);
            moved.put(p);
        }
        moved
    }

    /// The first unit free in both sets, if any (a merge that would own it twice).
    pub fn overlap(&self, other: &UnitSet) -> Option<u16> {
        if self.range() != other.range() {
            return None;
        }
        match (self.unwritten(), other.unwritten()) {
            (true, _) => return other.free_units().next(),
            (_, true) => return self.free_units().next(),
            _ => {}
        }
        (self.bits.iter().zip(&other.bits).enumerate())
            .find(|(_, (a, b))| *a & *b != 0)
            .map(|(i, (a, b))| self.unit_at(i * 64 + (a & b).trailing_zeros() as usize))
    }

    /// Take in another set's free units (same range, no overlap: checked by the caller).
    pub(crate) fn unite(&mut self, other: &UnitSet) {
        if other.unwritten() {
            *self = UnitSet::full(self.lo, self.hi);
            return;
        }
        self.write();
        for (a, b) in self.bits.iter_mut().zip(&other.bits) {
            *a |= b;
        }
        self.free = self.bits.iter().map(|w| w.count_ones()).sum();
    }

    pub(crate) fn to_wire(&self) -> PoolWire {
        PoolWire {
            lo: self.lo,
            hi: self.hi,
            free: self.ranges(),
        }
    }

    /// A snapshot's row, checked: ranges inside `lo..=hi`, no unit listed twice.
    pub(crate) fn from_wire(w: &PoolWire) -> Result<UnitSet, String> {
        if w.lo > w.hi {
            return Err(format!("range {}..={} is reversed", w.lo, w.hi));
        }
        let mut s = UnitSet::empty(w.lo, w.hi);
        for &[lo, hi] in &w.free {
            if lo > hi || lo < s.lo || hi > s.hi {
                return Err(format!(
                    "free range {lo}..={hi} is outside {}..={}",
                    s.lo, s.hi
                ));
            }
            for p in lo..=hi {
                if !s.put(p) {
                    return Err(format!("unit {p} listed free twice"));
                }
            }
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `lo..=hi` every unit free, with its bitmap written (as a snapshot's row is).
    fn written_full(lo: u16, hi: u16) -> UnitSet {
        let mut s = UnitSet::full(lo, hi);
        s.write();
        assert!(!s.unwritten());
        s
    }

    #[derive(Debug, Clone)]
    enum Op {
        Take(u16),
        Put(u16),
        Alloc(u16, u64),
        Split,
        Unite,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            any::<u16>().prop_map(Op::Take),
            any::<u16>().prop_map(Op::Put),
            (any::<u16>(), any::<u64>()).prop_map(|(w, r)| Op::Alloc(w, r)),
            Just(Op::Split),
            Just(Op::Unite),
        ]
    }

    proptest! {
        /// A full set whose bitmap is not written yet answers every question and every
        /// change as one whose bitmap is: the same free units, ranges, allocations,
        /// splits, merges, overlaps and wire rows.
        #[test]
        fn an_unwritten_full_set_is_a_written_one(
            lo in 0u16..2000,
            len in 1u16..300,
            ops in proptest::collection::vec(op(), 0..24),
        ) {
            let hi = lo.saturating_add(len - 1);
            let mut a = UnitSet::full(lo, hi);
            let mut b = written_full(lo, hi);
            prop_assert_eq!(&a, &b);
            let map = |u: u16| lo.wrapping_add(u % (len + 4)).wrapping_sub(2);
            for op in ops {
                match op {
                    Op::Take(u) => prop_assert_eq!(a.take(map(u)), b.take(map(u))),
                    Op::Put(u) => prop_assert_eq!(a.put(map(u)), b.put(map(u))),
                    Op::Alloc(w, r) => prop_assert_eq!(
                        a.alloc(map(w), &mut DetRng::new(r)),
                        b.alloc(map(w), &mut DetRng::new(r))
                    ),
                    Op::Split => {
                        let (ma, mb) = (a.split_upper_half(), b.split_upper_half());
                        prop_assert_eq!(&ma, &mb);
                        prop_assert_eq!(a.overlap(&ma), b.overlap(&mb));
                    }
                    Op::Unite => {
                        // Whatever is not free here, as a part of its own.
                        let mut rest = UnitSet::empty(lo, hi);
                        (lo..=hi).filter(|&u| !a.is_free(u)).for_each(|u| { rest.put(u); });
                        prop_assert_eq!(a.overlap(&rest), None);
                        prop_assert_eq!(b.overlap(&rest), None);
                        a.unite(&rest);
                        b.unite(&rest);
                    }
                }
                prop_assert_eq!(&a, &b);
                prop_assert_eq!(a.free(), b.free());
                prop_assert_eq!(a.ranges(), b.ranges());
                prop_assert_eq!(a.free_units().collect::<Vec<_>>(), b.free_units().collect::<Vec<_>>());
                prop_assert_eq!(a.to_wire(), b.to_wire());
                prop_assert_eq!(a.is_free(map(7)), b.is_free(map(7)));
                let full = written_full(lo, hi);
                prop_assert_eq!(a.overlap(&full), b.overlap(&full));
                prop_assert_eq!(full.overlap(&a), full.overlap(&b));
                prop_assert_eq!(UnitSet::full(lo, hi).overlap(&a), a.free_units().next());
            }
        }
    }

    #[test]
    fn a_full_set_writes_its_bitmap_at_the_first_take() {
        let mut s = UnitSet::full(1024, 65_535);
        assert!(s.unwritten(), "nothing written at build");
        assert!(s.is_free(2000) && !s.is_free(1023));
        assert!(!s.put(2000), "already free");
        assert!(s.unwritten());
        assert!(s.take(2000));
        assert!(!s.unwritten());
        assert_eq!(s.free(), 64_511);
        assert_eq!(s.ranges(), vec![[1024, 1999], [2001, 65_535]]);
    }

    #[test]
    fn fill_take_put_and_ranges() {
        let mut s = UnitSet::full(1000, 1069);
        assert_eq!(s.free(), 70);
        assert_eq!(s.free_units().count(), 70);
        assert!(!s.is_free(999) && !s.is_free(1070));
        assert!(s.take(1000) && !s.take(1000));
        assert!(s.take(1069));
        assert!(s.take(1030));
        assert_eq!(s.ranges(), vec![[1001, 1029], [1031, 1068]]);
        assert!(s.put(1030) && !s.put(1030) && !s.put(5));
        assert_eq!(s.free(), 68);
        assert_eq!(UnitSet::from_wire(&s.to_wire()), Ok(s));
    }

    #[test]
    fn first_free_wraps_around() {
        let mut s = UnitSet::empty(1, 200);
        assert_eq!(s.first_free_from(0), None);
        s.put(3);
        assert_eq!(s.first_free_from(150), Some(2));
        assert_eq!(s.first_free_from(2), Some(2));
        assert_eq!(s.first_free_from(3), Some(2), "wraps past the end");
        s.put(130);
        assert_eq!(s.first_free_from(64), Some(129));
        assert_eq!(s.first_free_from(130), Some(2));
    }

    #[test]
    fn split_upper_half_is_disjoint_and_complete() {
        let mut s = UnitSet::full(1, 1000);
        for p in (1..=1000).step_by(3) {
            s.take(p);
        }
        let before: Vec<u16> = s.free_units().collect();
        let moved = s.split_upper_half();
        let kept: Vec<u16> = s.free_units().collect();
        let gone: Vec<u16> = moved.free_units().collect();
        assert_eq!(kept.len() + gone.len(), before.len());
        assert!(kept.len() >= gone.len() && kept.len() - gone.len() <= 1);
        assert!(
            kept.last() < gone.first(),
            "lower half stays, upper half goes"
        );
        assert_eq!(s.overlap(&moved), None);
        let mut all = [kept, gone].concat();
        all.sort_unstable();
        assert_eq!(all, before);
        let mut back = s.clone();
        back.unite(&moved);
        assert_eq!(back.free_units().collect::<Vec<_>>(), before);
        assert_eq!(back.free() as usize, before.len());
        assert_eq!(back.overlap(&moved), moved.free_units().next());
    }

    #[test]
    fn the_whole_u16_range_and_bad_wire_rows() {
        let s = UnitSet::full(0, u16::MAX);
        assert_eq!(s.free(), 65_536);
        assert_eq!(s.ranges(), vec![[0, u16::MAX]]);
        let bad = |free: Vec<[u16; 2]>| {
            UnitSet::from_wire(&PoolWire {
                lo: 10,
                hi: 20,
                free,
            })
        };
        assert!(bad(vec![[5, 12]]).unwrap_err().contains("outside"));
        assert!(bad(vec![[12, 11]]).unwrap_err().contains("outside"));
        assert!(bad(vec![[12, 14], [14, 15]]).unwrap_err().contains("twice"));
        assert!(UnitSet::from_wire(&PoolWire {
            lo: 9,
            hi: 3,
            free: vec![]
        })
        .is_err());
    }
}
