//! The port allocator: per (pool address, protocol) a bitmap of the free ports.

use std::net::IpAddr;

use ::nf::DetRng;
use hashbrown::HashMap;

use super::table::{ExternalEndpoint, SnatStats};

/// Random probes before falling back to a scan. At 95 % occupancy 16 probes still find a
/// port 56 % of the time; the scan keeps the tail bounded and allocation exact.
pub const PROBES: usize = 16;

/// Free ports of one (pool address, protocol), one bit per port of the range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PortSet {
    pub(super) lo: u16,
    pub(super) hi: u16,
    pub(super) bits: Vec<u64>,
    pub(super) free: u32,
}

impl PortSet {
    pub(super) fn empty(lo: u16, hi: u16) -> Self {
        let len = u32::from(hi) - u32::from(lo) + 1;
        PortSet {
            lo,
            hi,
            bits: vec![0; len.div_ceil(64) as usize],
            free: 0,
        }
    }

    pub(super) fn len(&self) -> u32 {
        u32::from(self.hi) - u32::from(self.lo) + 1
    }

    pub(super) fn fill(&mut self) {
        let len = self.len();
        for w in self.bits.iter_mut() {
            *w = !0;
        }
        let tail = len % 64;
        if tail != 0 {
            if let Some(last) = self.bits.last_mut() {
                *last = (1u64 << tail) - 1;
            }
        }
        self.free = len;
    }

    pub(super) fn index(&self, port: u16) -> Option<usize> {
        (port >= self.lo && port <= self.hi).then(|| usize::from(port - self.lo))
    }

    pub(super) fn port_at(&self, i: usize) -> u16 {
        // i < len <= 65535, so this neither truncates nor overflows.
        self.lo.wrapping_add(i as u16)
    }

    pub(super) fn is_free(&self, port: u16) -> bool {
        self.index(port)
            .and_then(|i| self.bits.get(i / 64).map(|w| w >> (i % 64) & 1 == 1))
            .unwrap_or(false)
    }

    /// Mark in use; false if it was not free.
    pub(super) fn take(&mut self, port: u16) -> bool {
        let Some(i) = self.index(port) else {
            return false;
        };
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
    pub(super) fn put(&mut self, port: u16) -> bool {
        let Some(i) = self.index(port) else {
            return false;
        };
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
    pub(super) fn first_free_from(&self, start: usize) -> Option<usize> {
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

    pub(super) fn free_ports(&self) -> impl Iterator<Item = u16> + '_ {
        self.bits.iter().enumerate().flat_map(move |(wi, &w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                (w != 0).then(|| {
                    let b = w.trailing_zeros() as usize;
                    w &= w - 1;
                    self.port_at(wi * 64 + b)
                })
            })
        })
    }

    pub(super) fn ranges(&self) -> Vec<[u16; 2]> {
        let mut out: Vec<[u16; 2]> = Vec::new();
        for p in self.free_ports() {
            match out.last_mut() {
                Some(r) if u32::from(r[1]) + 1 == u32::from(p) => r[1] = p,
                _ => out.push([p, p]),
            }
        }
        out
    }

    /// Pick a port: the wanted one if free (port preservation), else uniformly random
    /// among free ones (RFC 6056 §3.3.1 style) by probing, then by a scan from a random
    /// point. `None` only when nothing is free.
    pub(super) fn alloc(
        &mut self,
        want: u16,
        rng: &mut DetRng,
        stats: &mut SnatStats,
    ) -> Option<u16> {
        if self.free == 0 {
            return None;
        }
        if self.take(want) {
            stats.ports_preserved += 1;
            return Some(want);
        }
        let len = u64::from(self.len());
        for tries in 0..PROBES {
            let port = self.port_at(rng.below(len) as usize);
            stats.random_probes += 1;
            if self.take(port) {
                stats.probe_histogram[tries] += 1;
                return Some(port);
            }
        }
        let i = self.first_free_from(rng.below(len) as usize)?;
        let port = self.port_at(i);
        if !self.take(port) {
            return None;
        }
        stats.probe_histogram[PROBES] += 1;
        Some(port)
    }

    /// Give away the upper half (by count) of the free ports.
    pub(super) fn split_upper_half(&mut self) -> PortSet {
        let mut moved = PortSet::empty(self.lo, self.hi);
        let keep = self.free - self.free / 2;
        let upper: Vec<u16> = self.free_ports().skip(keep as usize).collect();
        for p in upper {
            self.take(p);
            moved.put(p);
        }
        moved
    }
}

/// The free ports of every (pool address, protocol) this partition owns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PortPool {
    pub(super) sets: HashMap<(IpAddr, u8), PortSet>,
}

impl PortPool {
    pub(super) fn free_count(&self, addr: IpAddr, proto: u8) -> u32 {
        self.sets.get(&(addr, proto)).map_or(0, |s| s.free)
    }

    pub(super) fn is_free(&self, e: &ExternalEndpoint) -> bool {
        self.sets
            .get(&(e.addr, e.proto))
            .is_some_and(|s| s.is_free(e.port))
    }

    pub(super) fn put(&mut self, e: &ExternalEndpoint) -> bool {
        self.sets
            .get_mut(&(e.addr, e.proto))
            .is_some_and(|s| s.put(e.port))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_set_fill_take_put_and_ranges() {
        let mut s = PortSet::empty(1000, 1069);
        s.fill();
        assert_eq!(s.free, 70);
        assert_eq!(s.free_ports().count(), 70);
        assert!(!s.is_free(999) && !s.is_free(1070));
        assert!(s.take(1000) && !s.take(1000));
        assert!(s.take(1069));
        assert!(s.take(1030));
        assert_eq!(s.ranges(), vec![[1001, 1029], [1031, 1068]]);
        assert!(s.put(1030) && !s.put(1030) && !s.put(5));
        assert_eq!(s.free, 68);
    }

    #[test]
    fn first_free_wraps_around() {
        let mut s = PortSet::empty(1, 200);
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
        let mut s = PortSet::empty(1, 1000);
        s.fill();
        for p in (1..=1000).step_by(3) {
            s.take(p);
        }
        let before: Vec<u16> = s.free_ports().collect();
        let moved = s.split_upper_half();
        let kept: Vec<u16> = s.free_ports().collect();
        let gone: Vec<u16> = moved.free_ports().collect();
        assert_eq!(kept.len() + gone.len(), before.len());
        assert!(kept.len() >= gone.len() && kept.len() - gone.len() <= 1);
        assert!(
            kept.last() < gone.first(),
            "lower half stays, upper half goes"
        );
        let mut all = [kept, gone].concat();
        all.sort_unstable();
        assert_eq!(all, before);
    }
}
