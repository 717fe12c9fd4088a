//! Internet checksum (RFC 1071) and its incremental update (RFC 1624).
//!
//! The data plane never recomputes a checksum over a payload: every rewrite accumulates
//! a [`Delta`] over the 16-bit words it changed and applies it with RFC 1624 eqn. 3,
//! `HC' = ~(~HC + ~m + m')`, which (unlike eqn. 2) never produces a spurious -0.

/// One's-complement sum of `data` as big-endian 16-bit words (an odd last byte is padded
/// with zero), not yet folded.
#[inline]
pub fn sum(data: &[u8]) -> u64 {
    let mut s: u64 = 0;
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        s += u16::from_be_bytes([c[0], c[1]]) as u64;
    }
    if let [last] = chunks.remainder() {
        s += (*last as u64) << 8;
    }
    s
}

/// Fold a wide one's-complement sum to 16 bits with end-around carry.
#[inline]
pub fn fold(mut s: u64) -> u16 {
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// The checksum field value for `data` (plus a pre-summed pseudo-header `initial`).
#[inline]
pub fn checksum(initial: u64, data: &[u8]) -> u16 {
    !fold(initial + sum(data))
}

/// Sum of the IPv4 pseudo-header for a transport checksum.
pub fn pseudo_v4(src: &[u8; 4], dst: &[u8; 4], proto: u8, len: u16) -> u64 {
    sum(src) + sum(dst) + proto as u64 + len as u64
}

/// Sum of the IPv6 pseudo-header (RFC 8200 §8.1) for a transport checksum.
pub fn pseudo_v6(src: &[u8; 16], dst: &[u8; 16], proto: u8, len: u32) -> u64 {
    sum(src) + sum(dst) + (len >> 16) as u64 + (len & 0xffff) as u64 + proto as u64
}

/// Accumulated change of a checksummed region: the sum of `~m + m'` over every 16-bit
/// word that changed (RFC 1624 §3).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Delta(u64);

impl Delta {
    pub const ZERO: Delta = Delta(0);

    /// Record that one 16-bit word changed from `old` to `new`.
    #[inline]
    pub fn word(&mut self, old: u16, new: u16) {
        self.0 += (!old) as u64 + new as u64;
    }

    /// Record that a run of whole 16-bit words changed. `old` and `new` have the same
    /// even length and start at an even offset of the checksummed region.
    #[inline]
    pub fn bytes(&mut self, old: &[u8], new: &[u8]) {
        debug_assert_eq!(old.len(), new.len());
        for (o, n) in old.chunks_exact(2).zip(new.chunks_exact(2)) {
            self.word(
                u16::from_be_bytes([o[0], o[1]]),
                u16::from_be_bytes([n[0], n[1]]),
            );
        }
    }

    /// Merge another delta into this one.
    #[inline]
    pub fn add(&mut self, other: Delta) {
        self.0 += other.0;
    }

    pub fn is_zero(&self) -> bool {
        self.0 == 0
    }

    /// Apply to a checksum field: RFC 1624 eqn. 3.
    #[inline]
    pub fn apply(self, csum: u16) -> u16 {
        !fold((!csum) as u64 + self.0)
    }

    /// Apply to a UDP checksum field: zero means "no checksum" (IPv4) or a tunnel's zero
    /// checksum (IPv6) and stays zero; a computed zero is sent as 0xffff.
    #[inline]
    pub fn apply_udp(self, csum: u16) -> u16 {
        if csum == 0 {
            return 0;
        }
        match self.apply(csum) {
            0 => 0xffff,
            c => c,
        }
    }
}

/// Read the big-endian u16 at `off`.
#[inline]
pub fn get16(buf: &[u8], off: usize) -> u16 {
    u16::from_be_bytes([buf[off], buf[off + 1]])
}

/// Write a big-endian u16 at `off`.
#[inline]
pub fn put16(buf: &mut [u8], off: usize, v: u16) {
    buf[off..off + 2].copy_from_slice(&v.to_be_bytes());
}

/// Apply `delta` to the checksum field at `off`.
#[inline]
pub fn patch(buf: &mut [u8], off: usize, delta: Delta) {
    let c = get16(buf, off);
    put16(buf, off, delta.apply(c));
}

/// Apply `delta` to the UDP checksum field at `off` (zero-aware).
#[inline]
pub fn patch_udp(buf: &mut [u8], off: usize, delta: Delta) {
    let c = get16(buf, off);
    put16(buf, off, delta.apply_udp(c));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc1071_example() {
        // RFC 1071 §3 example bytes: 00 01 f2 03 f4 f5 f6 f7 sum to 0xddf2.
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(fold(sum(&data)), 0xddf2);
        assert_eq!(checksum(0, &data), !0xddf2);
    }

    #[test]
    fn incremental_matches_full_for_one_word() {
        let mut data = [0x45u8, 0x00, 0x00, 0x54, 0x12, 0x34, 0x40, 0x00];
        let before = checksum(0, &data);
        let old = get16(&data, 4);
        put16(&mut data, 4, 0xbeef);
        let mut d = Delta::ZERO;
        d.word(old, 0xbeef);
        assert_eq!(d.apply(before), checksum(0, &data));
    }

    #[test]
    fn udp_zero_stays_zero() {
        let mut d = Delta::ZERO;
        d.word(1, 2);
        assert_eq!(d.apply_udp(0), 0);
    }
}
