//! [`FlowMap`]: a per-flow table's map, keyed by [`FlowKey`] and holding an IPv4 flow's
//! key in 16 bytes.
//!
//! A `FlowKey` is 40 bytes so that one layout serves IPv4 and IPv6 (an IPv4 address is
//! kept v4-mapped, in 16 bytes). Every per-flow table of every NF holds a row per flow
//! at each of a group's three replicas, so for IPv4 traffic that layout is 24 bytes of
//! zeros and `ffff` prefixes per row, about 216 bytes per flow across the built-in
//! chain's three NFs and three replicas (docs/setup-path.md). Here an IPv4 flow's key
//! is kept as its two addresses, two ports, VNI and protocol ([`Key4`]); other keys are
//! kept whole, in a second map. A slot number names a row in either map (the top bit
//! says which), so the per-flow timer queue and everything else that names rows by
//! slot works as with one [`SlabMap`].

use std::fmt;

use pipeline::FlowKey;

use crate::slabmap::{self, SlabMap};

/// The prefix of an IPv4 address kept v4-mapped in a `FlowKey`.
const V4_MAPPED: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];

/// Slots of the whole-key map carry this bit.
const WIDE: u32 = 1 << 31;

/// An IPv4 flow's key: source and destination address (4 bytes each), then the key's
/// ports, VNI and protocol as `FlowKey` lays them out (its last 8 bytes).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Key4([u8; 16]);

impl Key4 {
    /// The short form of `k`, if both its addresses are v4-mapped.
    #[inline]
    fn of(k: &FlowKey) -> Option<Key4> {
        let b = k.as_bytes();
        if b[0..12] != V4_MAPPED || b[16..28] != V4_MAPPED {
            return None;
        }
        let mut s = [0u8; 16];
        s[0..4].copy_from_slice(&b[12..16]);
        s[4..8].copy_from_slice(&b[28..32]);
        s[8..16].copy_from_slice(&b[32..40]);
        Some(Key4(s))
    }

    #[inline]
    fn key(&self) -> FlowKey {
        let mut b = [0u8; 40];
        b[0..12].copy_from_slice(&V4_MAPPED);
        b[12..16].copy_from_slice(&self.0[0..4]);
        b[16..28].copy_from_slice(&V4_MAPPED);
        b[28..32].copy_from_slice(&self.0[4..8]);
        b[32..40].copy_from_slice(&self.0[8..16]);
        FlowKey::from_bytes(b)
    }
}

/// A map from flow key to `V` whose rows never move (two [`SlabMap`]s: IPv4 keys in
/// 16 bytes, others whole). The API is the subset the platform's tables use; a key is
/// handed out by value, since an IPv4 one is rebuilt from its short form.
#[derive(Clone)]
pub struct FlowMap<V> {
    v4: SlabMap<Key4, V>,
    wide: SlabMap<FlowKey, V>,
}

impl<V> Default for FlowMap<V> {
    fn default() -> Self {
        FlowMap {
            v4: SlabMap::new(),
            wide: SlabMap::new(),
        }
    }
}

impl<V: fmt::Debug> fmt::Debug for FlowMap<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl<V> FlowMap<V> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.v4.len() + self.wide.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn clear(&mut self) {
        self.v4.clear();
        self.wide.clear();
    }

    pub fn get(&self, k: &FlowKey) -> Option<&V> {
        match Key4::of(k) {
            Some(s) => self.v4.get(&s),
            None => self.wide.get(k),
        }
    }

    pub fn contains_key(&self, k: &FlowKey) -> bool {
        self.get(k).is_some()
    }

    pub fn remove(&mut self, k: &FlowKey) -> Option<V> {
        match Key4::of(k) {
            Some(s) => self.v4.remove(&s),
            None => self.wide.remove(k),
        }
    }

    /// The slot holding `k`'s row ([`Self::at`]).
    pub fn slot_of(&self, k: &FlowKey) -> Option<u32> {
        match Key4::of(k) {
            Some(s) => self.v4.slot_of(&s),
            None => self.wide.slot_of(k).map(|s| s | WIDE),
        }
    }

    /// The row in slot `s`, if it holds one. A slot is a row's address for as long as
    /// the row lives, as in [`SlabMap::at`].
    pub fn at(&self, s: u32) -> Option<(FlowKey, &V)> {
        if s & WIDE == 0 {
            self.v4.at(s).map(|(k, v)| (k.key(), v))
        } else {
            self.wide.at(s & !WIDE).map(|(k, v)| (*k, v))
        }
    }

    /// [`Self::at`], to change the value.
    pub fn at_mut(&mut self, s: u32) -> Option<(FlowKey, &mut V)> {
        if s & WIDE == 0 {
            self.v4.at_mut(s).map(|(k, v)| (k.key(), v))
        } else {
            self.wide.at_mut(s & !WIDE).map(|(k, v)| (*k, v))
        }
    }

    /// The row of `k`, to read, change or fill with one probe.
    pub fn entry(&mut self, k: FlowKey) -> Entry<'_, V> {
        match Key4::of(&k) {
            Some(s) => match self.v4.entry(s) {
                slabmap::Entry::Occupied(o) => Entry::Occupied(OccupiedEntry::V4(o)),
                slabmap::Entry::Vacant(v) => Entry::Vacant(VacantEntry::V4(v)),
            },
            None => match self.wide.entry(k) {
                slabmap::Entry::Occupied(o) => Entry::Occupied(OccupiedEntry::Wide(o)),
                slabmap::Entry::Vacant(v) => Entry::Vacant(VacantEntry::Wide(v)),
            },
        }
    }

    /// Inserts or replaces; returns the value replaced.
    pub fn insert(&mut self, k: FlowKey, v: V) -> Option<V> {
        match Key4::of(&k) {
            Some(s) => self.v4.insert(s, v),
            None => self.wide.insert(k, v),
        }
    }

    /// Rows in slot order (the IPv4 map's, then the other's).
    pub fn iter(&self) -> impl Iterator<Item = (FlowKey, &V)> {
        (self.v4.iter().map(|(k, v)| (k.key(), v))).chain(self.wide.iter().map(|(k, v)| (*k, v)))
    }

    pub fn keys(&self) -> impl Iterator<Item = FlowKey> + '_ {
        self.iter().map(|(k, _)| k)
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.v4.values().chain(self.wide.values())
    }

    /// Rows with their slots, in slot order.
    pub fn slots(&self) -> impl Iterator<Item = (u32, FlowKey, &V)> {
        (self.v4.slots().map(|(s, k, v)| (s, k.key(), v)))
            .chain(self.wide.slots().map(|(s, k, v)| (s | WIDE, *k, v)))
    }
}

fn widen<V>((k, v): (Key4, V)) -> (FlowKey, V) {
    (k.key(), v)
}

impl<V> IntoIterator for FlowMap<V> {
    type Item = (FlowKey, V);
    type IntoIter = std::iter::Chain<
        std::iter::Map<slabmap::IntoIter<Key4, V>, fn((Key4, V)) -> (FlowKey, V)>,
        slabmap::IntoIter<FlowKey, V>,
    >;

    fn into_iter(self) -> Self::IntoIter {
        let widen: fn((Key4, V)) -> (FlowKey, V) = widen;
        self.v4.into_iter().map(widen).chain(self.wide)
    }
}

impl<V> Extend<(FlowKey, V)> for FlowMap<V> {
    fn extend<I: IntoIterator<Item = (FlowKey, V)>>(&mut self, iter: I) {
        for (k, v) in iter {
            self.insert(k, v);
        }
    }
}

impl<V> FromIterator<(FlowKey, V)> for FlowMap<V> {
    fn from_iter<I: IntoIterator<Item = (FlowKey, V)>>(iter: I) -> Self {
        let mut m = FlowMap::new();
        m.extend(iter);
        m
    }
}

pub enum Entry<'a, V> {
    Occupied(OccupiedEntry<'a, V>),
    Vacant(VacantEntry<'a, V>),
}

pub enum OccupiedEntry<'a, V> {
    V4(slabmap::OccupiedEntry<'a, Key4, V, hashbrown::DefaultHashBuilder>),
    Wide(slabmap::OccupiedEntry<'a, FlowKey, V, hashbrown::DefaultHashBuilder>),
}

pub enum VacantEntry<'a, V> {
    V4(slabmap::VacantEntry<'a, Key4, V, hashbrown::DefaultHashBuilder>),
    Wide(slabmap::VacantEntry<'a, FlowKey, V, hashbrown::DefaultHashBuilder>),
}

impl<'a, V> OccupiedEntry<'a, V> {
    pub fn get(&self) -> &V {
        match self {
            OccupiedEntry::V4(o) => o.get(),
            OccupiedEntry::Wide(o) => o.get(),
        }
    }

    pub fn get_mut(&mut self) -> &mut V {
        match self {
            OccupiedEntry::V4(o) => o.get_mut(),
            OccupiedEntry::Wide(o) => o.get_mut(),
        }
    }

    /// The row's slot ([`FlowMap::at`]).
    pub fn slot(&self) -> u32 {
        match self {
            OccupiedEntry::V4(o) => o.slot(),
            OccupiedEntry::Wide(o) => o.slot() | WIDE,
        }
    }
}

impl<'a, V> VacantEntry<'a, V> {
    /// Fill the row; its slot ([`FlowMap::at`]).
    pub fn insert_slot(self, v: V) -> u32 {
        match self {
            VacantEntry::V4(e) => e.insert_slot(v),
            VacantEntry::Wide(e) => e.insert_slot(v) | WIDE,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> FlowKey {
        s.parse().expect("flow key")
    }

    #[test]
    fn an_ipv4_key_is_kept_in_16_bytes_and_given_back_whole() {
        assert_eq!(std::mem::size_of::<Key4>(), 16);
        let k = key("100 tcp 198.18.0.2:1000 > 198.19.0.1:80");
        let s = Key4::of(&k).expect("v4");
        assert_eq!(s.key(), k);
        assert_eq!(s.key().as_bytes(), k.as_bytes());
        // Every byte of the key counts.
        for other in [
            "101 tcp 198.18.0.2:1000 > 198.19.0.1:80",
            "100 udp 198.18.0.2:1000 > 198.19.0.1:80",
            "100 tcp 198.18.0.3:1000 > 198.19.0.1:80",
            "100 tcp 198.18.0.2:1001 > 198.19.0.1:80",
            "100 tcp 198.18.0.2:1000 > 198.19.0.9:80",
            "100 tcp 198.18.0.2:1000 > 198.19.0.1:81",
        ] {
            assert_ne!(Key4::of(&key(other)), Some(s), "{other}");
        }
        assert_eq!(
            Key4::of(&key("100 tcp [2001:db8::1]:1000 > [2001:db8::2]:80")),
            None
        );
        // A key with one v4-mapped address and one other is kept whole.
        let mut b = *k.as_bytes();
        b[16] = 0x20;
        assert_eq!(Key4::of(&FlowKey::from_bytes(b)), None);
    }

    #[test]
    fn both_families_live_side_by_side_and_slots_name_their_rows() {
        let mut m: FlowMap<u32> = FlowMap::new();
        let v4: Vec<FlowKey> = (0..1200u32)
            .map(|i| {
                key(&format!(
                    "7 udp 198.18.{}.{}:53 > 198.19.0.1:53",
                    i / 250,
                    i % 250
                ))
            })
            .collect();
        let v6: Vec<FlowKey> = (0..700u32)
            .map(|i| key(&format!("7 udp [2001:db8::{i:x}]:53 > [2001:db8::1]:53")))
            .collect();
        let mut mixed = *v4[0].as_bytes();
        mixed[20] = 1;
        let mixed = FlowKey::from_bytes(mixed);
        let all: Vec<FlowKey> = v4.iter().chain(&v6).copied().chain([mixed]).collect();
        let mut slots = Vec::new();
        for (i, k) in all.iter().enumerate() {
            let Entry::Vacant(e) = m.entry(*k) else {
                panic!("{k} is new")
            };
            slots.push(e.insert_slot(i as u32));
        }
        assert_eq!(m.len(), all.len());
        for (i, k) in all.iter().enumerate() {
            assert_eq!(m.get(k), Some(&(i as u32)));
            assert_eq!(m.slot_of(k), Some(slots[i]));
            assert_eq!(m.at(slots[i]), Some((*k, &(i as u32))));
        }
        // Replacing keeps the slot.
        match m.entry(v6[3]) {
            Entry::Occupied(mut o) => {
                assert_eq!(o.slot(), slots[1203]);
                *o.get_mut() = 99;
            }
            Entry::Vacant(_) => panic!("present"),
        }
        if let Some((_, v)) = m.at_mut(slots[5]) {
            *v = 55;
        }
        assert_eq!(m.get(&v6[3]), Some(&99));
        assert_eq!(m.get(&v4[5]), Some(&55));
        // Iteration gives every row once, with its own key and slot.
        let mut seen: Vec<(u32, FlowKey)> = m.slots().map(|(s, k, _)| (s, k)).collect();
        seen.sort_unstable_by_key(|x| x.0);
        let mut want: Vec<(u32, FlowKey)> =
            slots.iter().copied().zip(all.iter().copied()).collect();
        want.sort_unstable_by_key(|x| x.0);
        assert_eq!(seen, want);
        assert_eq!(m.keys().count(), all.len());
        assert_eq!(m.values().count(), all.len());
        // Removal empties the slot; a lookup misses.
        assert_eq!(m.remove(&v4[7]), Some(7));
        assert_eq!(m.remove(&mixed), Some(all.len() as u32 - 1));
        assert_eq!(m.at(slots[7]), None);
        assert!(!m.contains_key(&v4[7]) && !m.contains_key(&mixed));
        // Built anew from its rows: the same rows.
        let copy: FlowMap<u32> = m.clone().into_iter().collect();
        assert_eq!(copy.len(), m.len());
        for (k, v) in m.iter() {
            assert_eq!(copy.get(&k), Some(v));
        }
    }
}
