//! [`ReplyIndex`]: reply-direction key → forward key, which knows without probing it
//! which keys it cannot hold.
//!
//! SNAT and the LB index each flow under its reply direction's key, so that a reply
//! whose rule PP lost finds its flow. Every first packet asks that index whether it is
//! such a reply (SNAT's replay, the LB's first packet, and for packets other than a TCP
//! SYN the chain's `knows_reply`), and nearly every first packet is a new forward flow,
//! whose probe misses: a cache miss in a table of a row per flow, at every replica. A
//! reply key's *end* (for SNAT the external address it is sent to, for the LB the
//! backend it comes from) is one of a handful, so the index counts its keys per end in
//! a small map that stays in cache, and a key at an end that holds none is answered
//! without the probe.

use std::net::IpAddr;

use hashbrown::HashMap;
use nf::slabmap::Entry;
use nf::SlabMap;
use pipeline::FlowKey;

/// Which part of a reply key the index counts its keys by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// Destination address and protocol: SNAT's reply keys go to its external addresses.
    Dst,
    /// Source address, port and protocol: the LB's reply keys come from its backends.
    Src,
}

type EndKey = (IpAddr, u16, u8);

#[derive(Debug, Clone)]
pub(crate) struct ReplyIndex {
    map: SlabMap<FlowKey, FlowKey>,
    /// Keys in `map` per end; an end with none has no entry.
    ends: HashMap<EndKey, u32>,
    by: End,
}

impl ReplyIndex {
    pub(crate) fn new(by: End) -> Self {
        ReplyIndex {
            map: SlabMap::new(),
            ends: HashMap::new(),
            by,
        }
    }

    #[inline]
    fn end(by: End, k: &FlowKey) -> EndKey {
        match by {
            End::Dst => (k.dst(), 0, k.proto()),
            End::Src => (k.src(), k.sport(), k.proto()),
        }
    }

    #[inline]
    pub(crate) fn get(&self, k: &FlowKey) -> Option<&FlowKey> {
        if !self.ends.contains_key(&Self::end(self.by, k)) {
            return None;
        }
        self.map.get(k)
    }

    /// Inserts or replaces; returns the forward key replaced.
    pub(crate) fn insert(&mut self, k: FlowKey, fwd: FlowKey) -> Option<FlowKey> {
        let old = self.map.insert(k, fwd);
        if old.is_none() {
            *self.ends.entry(Self::end(self.by, &k)).or_insert(0) += 1;
        }
        old
    }

    /// The forward key under `k`, inserting `fwd` if there is none.
    pub(crate) fn get_or_insert(&mut self, k: FlowKey, fwd: FlowKey) -> &mut FlowKey {
        let end = Self::end(self.by, &k);
        match self.map.entry(k) {
            Entry::Occupied(o) => o.into_mut(),
            Entry::Vacant(v) => {
                *self.ends.entry(end).or_insert(0) += 1;
                v.insert(fwd)
            }
        }
    }

    pub(crate) fn remove(&mut self, k: &FlowKey) -> Option<FlowKey> {
        let old = self.map.remove(k)?;
        let end = Self::end(self.by, k);
        if let Some(n) = self.ends.get_mut(&end) {
            *n -= 1;
            if *n == 0 {
                self.ends.remove(&end);
            }
        }
        Some(old)
    }

    pub(crate) fn clear(&mut self) {
        self.map.clear();
        self.ends.clear();
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Ends that hold a key.
    #[cfg(test)]
    pub(crate) fn ends(&self) -> usize {
        self.ends.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(s: &str) -> FlowKey {
        s.parse().expect("flow key")
    }

    #[test]
    fn keys_at_an_end_with_none_are_answered_without_the_map_and_counts_follow_every_change() {
        let mut ix = ReplyIndex::new(End::Dst);
        let fwd = k("100 udp 198.18.0.5:4000 > 198.19.0.9:53");
        let rk = k("0 udp 198.19.0.9:53 > 198.19.255.1:1024");
        assert_eq!(ix.insert(rk, fwd), None);
        assert_eq!(ix.get(&rk), Some(&fwd));
        // Another key at the same end is probed and missed; at another end it is not
        // probed, and misses too.
        assert_eq!(ix.get(&k("0 udp 198.19.0.9:53 > 198.19.255.1:1025")), None);
        assert_eq!(ix.get(&k("0 udp 198.19.0.9:53 > 198.19.255.2:1024")), None);
        // Replacing keeps the count; get_or_insert of a present key adds nothing.
        let fwd2 = k("100 udp 198.18.0.6:4000 > 198.19.0.9:53");
        assert_eq!(ix.insert(rk, fwd2), Some(fwd));
        assert_eq!(*ix.get_or_insert(rk, fwd), fwd2);
        let rk2 = k("0 udp 198.19.0.9:53 > 198.19.255.1:1026");
        assert_eq!(*ix.get_or_insert(rk2, fwd), fwd);
        assert_eq!((ix.len(), ix.ends()), (2, 1));
        assert_eq!(ix.remove(&rk), Some(fwd2));
        assert_eq!(ix.remove(&rk), None);
        assert_eq!(ix.get(&rk2), Some(&fwd));
        assert_eq!(ix.remove(&rk2), Some(fwd));
        assert_eq!((ix.len(), ix.ends()), (0, 0));
        ix.insert(rk, fwd);
        ix.clear();
        assert_eq!((ix.get(&rk), ix.ends()), (None, 0));
    }

    #[test]
    fn the_lb_counts_by_backend() {
        let mut ix = ReplyIndex::new(End::Src);
        let fwd = k("100 tcp 198.18.0.5:4000 > 198.19.0.9:80");
        let rk = k("100 tcp 198.19.1.7:8080 > 198.18.0.5:4000");
        ix.insert(rk, fwd);
        assert_eq!(ix.get(&rk), Some(&fwd));
        // The same backend address on another port, or another protocol, is another end.
        assert_eq!(
            ix.get(&k("100 tcp 198.19.1.7:8081 > 198.18.0.5:4000")),
            None
        );
        assert_eq!(
            ix.get(&k("100 udp 198.19.1.7:8080 > 198.18.0.5:4000")),
            None
        );
        assert_eq!(ix.ends(), 1);
    }
}
