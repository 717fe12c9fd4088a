//! [`ReplyIndex`]: reply-direction key → forward key, which knows without probing it
//! which keys it cannot hold.
//!
//! SNAT indexes the flows whose reply key it cannot derive through their mapping
//! (hairpin flows, `snat::table::State::reply_to`) under that key, so that a reply whose
//! rule PP lost finds its flow. Every first packet asks whether it is such a reply
//! (SNAT's replay, and for packets other than a TCP SYN the chain's `knows_reply`), and
//! nearly every first packet is a new forward flow, whose probe misses. A reply key's
//! *end* (the external address it is sent to) is one of a handful, so the index counts
//! its keys per end in a small map that stays in cache, and a key at an end that holds
//! none is answered without the probe. (The LB finds a reply's flow through the
//! services that list the reply's source as a backend, and keeps no index.)

use std::net::IpAddr;

use hashbrown::HashMap;
use nf::slabmap::Entry;
use nf::SlabMap;
use pipeline::FlowKey;

/// A reply key's end: its destination address and protocol (SNAT's reply keys go to
/// its external addresses).
type EndKey = (IpAddr, u8);

#[derive(Debug, Clone)]
pub(crate) struct ReplyIndex {
    map: SlabMap<FlowKey, FlowKey>,
    /// Keys in `map` per end; an end with none has no entry.
    ends: HashMap<EndKey, u32>,
}

impl ReplyIndex {
    pub(crate) fn new() -> Self {
        ReplyIndex {
            map: SlabMap::new(),
            ends: HashMap::new(),
        }
    }

    #[inline]
    fn end(k: &FlowKey) -> EndKey {
        (k.dst(), k.proto())
    }

    #[inline]
    pub(crate) fn get(&self, k: &FlowKey) -> Option<&FlowKey> {
        if !self.ends.contains_key(&Self::end(k)) {
            return None;
        }
        self.map.get(k)
    }

    /// Inserts or replaces; returns the forward key replaced.
    pub(crate) fn insert(&mut self, k: FlowKey, fwd: FlowKey) -> Option<FlowKey> {
        let old = self.map.insert(k, fwd);
        if old.is_none() {
            *self.ends.entry(Self::end(&k)).or_insert(0) += 1;
        }
        old
    }

    /// The forward key under `k`, inserting `fwd` if there is none.
    pub(crate) fn get_or_insert(&mut self, k: FlowKey, fwd: FlowKey) -> &mut FlowKey {
        let end = Self::end(&k);
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
        let end = Self::end(k);
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
        let mut ix = ReplyIndex::new();
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
}
