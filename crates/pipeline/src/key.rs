//! `FlowKey`: what PP matches on. VNI + 5-tuple, v4 and v6, in one 40-byte layout.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use packet::{proto, IcmpKind, Ip, IpVersion, L4};

/// Exact-match key: (VNI, src, dst, sport, dport, protocol).
///
/// The bytes are the canonical layout of `docs/golden-corpus.md`: src (16), dst (16),
/// sport (2, BE), dport (2, BE), VNI (3, BE), protocol (1). IPv4 addresses are stored
/// v4-mapped; the parser refuses v4-mapped addresses inside IPv6 packets, so the two
/// families never collide. For ICMP echo the identifier takes the place of a port:
/// the source port for a request, the destination port for a reply, so a reply's key is
/// the reverse of its request's.
#[derive(Clone, Copy, Eq)]
#[repr(C)]
pub struct FlowKey {
    bytes: [u8; 40],
}

impl std::hash::Hash for FlowKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.bytes.hash(state)
    }
}

impl PartialEq for FlowKey {
    /// Five word compares, inlined; `[u8; 40] ==` becomes a libc `memcmp` call, which was
    /// 8% of the hit path.
    #[inline(always)]
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (&self.bytes, &other.bytes);
        (w(a, 0) ^ w(b, 0))
            | (w(a, 8) ^ w(b, 8))
            | (w(a, 16) ^ w(b, 16))
            | (w(a, 24) ^ w(b, 24))
            | (w(a, 32) ^ w(b, 32))
            == 0
    }
}

const V4_MAPPED_PREFIX: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];

/// Why no key could be built for an IP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyError {
    /// A later fragment: the ports are in the first one.
    Fragment,
}

impl FlowKey {
    pub const LEN: usize = 40;

    pub const fn from_bytes(bytes: [u8; 40]) -> Self {
        FlowKey { bytes }
    }

    pub fn as_bytes(&self) -> &[u8; 40] {
        &self.bytes
    }

    /// Build a key from parts.
    pub fn new(vni: u32, proto: u8, src: IpAddr, sport: u16, dst: IpAddr, dport: u16) -> Self {
        let mut k = FlowKey { bytes: [0; 40] };
        k.set_addr(0, src);
        k.set_addr(16, dst);
        k.set_sport(sport);
        k.set_dport(dport);
        k.set_vni(vni);
        k.bytes[39] = proto;
        k
    }

    fn set_addr(&mut self, at: usize, a: IpAddr) {
        match a {
            IpAddr::V4(a) => {
                self.bytes[at..at + 12].copy_from_slice(&V4_MAPPED_PREFIX);
                self.bytes[at + 12..at + 16].copy_from_slice(&a.octets());
            }
            IpAddr::V6(a) => self.bytes[at..at + 16].copy_from_slice(&a.octets()),
        }
    }

    #[inline]
    fn put_raw_addr(&mut self, at: usize, raw: &[u8]) {
        if raw.len() == 4 {
            self.bytes[at..at + 12].copy_from_slice(&V4_MAPPED_PREFIX);
            self.bytes[at + 12..at + 16].copy_from_slice(raw);
        } else {
            self.bytes[at..at + 16].copy_from_slice(raw);
        }
    }

    /// The key of an IP packet parsed from `buf`, with the VNI it arrived on.
    ///
    /// An ICMP error is keyed on the reversed 5-tuple of the packet it quotes, so it
    /// finds the rule of the flow it reports on (see `packet::rewrite::rewrite_icmp_error`).
    #[inline]
    pub fn from_ip(buf: &[u8], ip: &Ip, vni: u32) -> Result<FlowKey, KeyError> {
        let mut k = FlowKey { bytes: [0; 40] };
        let (sport, dport) = match ip.l4 {
            L4::Tcp { sport, dport, .. } | L4::Udp { sport, dport, .. } => (sport, dport),
            L4::Icmp { kind, .. } => match kind {
                IcmpKind::EchoRequest { id } => (id, 0),
                IcmpKind::EchoReply { id } => (0, id),
                IcmpKind::Error(q) => {
                    // Reversed quote: its destination is our source.
                    let qip = q.as_ip();
                    k.put_raw_addr(0, &buf[qip.dst_range()]);
                    k.put_raw_addr(16, &buf[qip.src_range()]);
                    k.set_sport(q.dport);
                    k.set_dport(q.sport);
                    k.set_vni(vni);
                    k.bytes[39] = q.proto;
                    return Ok(k);
                }
                IcmpKind::Other => (0, 0),
            },
            L4::None => {
                if ip.frag == packet::Frag::NonFirst {
                    return Err(KeyError::Fragment);
                }
                (0, 0)
            }
        };
        // The hot path's key: composed as five 8-byte words in registers and stored
        // whole. Built field by field (4-, 2-, 3-, 1-byte stores), the table hash's 8-byte
        // loads that follow at once could not be forwarded from the store buffer when
        // the key went through memory, and whether it did depended on register
        // allocation: unrelated edits to the batch loop swung the hit rate by ~13% at a
        // million flows.
        let (s0, s1) = addr_words(&buf[ip.src_range()]);
        let (d0, d1) = addr_words(&buf[ip.dst_range()]);
        let (sp, dp, v) = (sport.to_be_bytes(), dport.to_be_bytes(), vni.to_be_bytes());
        let tail = u64::from_le_bytes([sp[0], sp[1], dp[0], dp[1], v[1], v[2], v[3], ip.proto]);
        Ok(FlowKey::from_words([s0, s1, d0, d1, tail]))
    }

    /// A key from its five little-endian 8-byte words (see [`FlowKey::from_ip`]).
    #[inline(always)]
    fn from_words(words: [u64; 5]) -> FlowKey {
        let mut bytes = [0u8; 40];
        for (chunk, w) in bytes.chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        FlowKey { bytes }
    }

    /// The key of the opposite direction of this flow.
    pub fn reversed(&self) -> FlowKey {
        let mut k = *self;
        k.bytes[0..16].copy_from_slice(&self.bytes[16..32]);
        k.bytes[16..32].copy_from_slice(&self.bytes[0..16]);
        k.bytes[32..34].copy_from_slice(&self.bytes[34..36]);
        k.bytes[34..36].copy_from_slice(&self.bytes[32..34]);
        k
    }

    pub fn is_v4(&self) -> bool {
        self.bytes[0..12] == V4_MAPPED_PREFIX
    }

    pub fn version(&self) -> IpVersion {
        if self.is_v4() {
            IpVersion::V4
        } else {
            IpVersion::V6
        }
    }

    fn addr(&self, at: usize) -> IpAddr {
        let b = &self.bytes[at..at + 16];
        if b[..12] == V4_MAPPED_PREFIX {
            IpAddr::V4(Ipv4Addr::new(b[12], b[13], b[14], b[15]))
        } else {
            let mut a = [0u8; 16];
            a.copy_from_slice(b);
            IpAddr::V6(Ipv6Addr::from(a))
        }
    }

    pub fn src(&self) -> IpAddr {
        self.addr(0)
    }

    pub fn dst(&self) -> IpAddr {
        self.addr(16)
    }

    pub fn sport(&self) -> u16 {
        u16::from_be_bytes([self.bytes[32], self.bytes[33]])
    }

    pub fn dport(&self) -> u16 {
        u16::from_be_bytes([self.bytes[34], self.bytes[35]])
    }

    pub fn vni(&self) -> u32 {
        u32::from_be_bytes([0, self.bytes[36], self.bytes[37], self.bytes[38]])
    }

    pub fn proto(&self) -> u8 {
        self.bytes[39]
    }

    pub fn set_src(&mut self, a: IpAddr) {
        self.set_addr(0, a)
    }

    pub fn set_dst(&mut self, a: IpAddr) {
        self.set_addr(16, a)
    }

    pub fn set_sport(&mut self, p: u16) {
        self.bytes[32..34].copy_from_slice(&p.to_be_bytes());
    }

    pub fn set_dport(&mut self, p: u16) {
        self.bytes[34..36].copy_from_slice(&p.to_be_bytes());
    }

    pub fn set_vni(&mut self, vni: u32) {
        self.bytes[36..39].copy_from_slice(&vni.to_be_bytes()[1..]);
    }

    /// Stable, unseeded hash of the key (spec in `docs/golden-corpus.md`).
    #[inline]
    pub fn hash(&self) -> u64 {
        flow_hash(&self.bytes)
    }

    /// Hash from a per-worker seed, so table placement can't be predicted from outside.
    ///
    /// Unlike [`FlowKey::hash`], whose value is pinned by the spec, this one is free to be
    /// fast: wyhash-style folded 128-bit multiplies, three of them independent, instead of
    /// a chain of five dependent rounds (the chain was a fifth of the hit path).
    #[inline]
    pub fn hash_seeded(&self, seed: u64) -> u64 {
        const P0: u64 = 0xa076_1d64_78bd_642f;
        const P1: u64 = 0xe703_7ed1_a0b4_28db;
        const P2: u64 = 0x8ebc_6af0_9c88_c6e3;
        const P3: u64 = 0x5899_65cc_7537_4cc3;
        let b = &self.bytes;
        let a = mum(w(b, 0) ^ seed ^ P0, w(b, 8) ^ P1);
        let c = mum(w(b, 16) ^ seed ^ P2, w(b, 24) ^ P3);
        let d = mum(w(b, 32) ^ seed ^ P1, seed ^ P2 ^ 40);
        mum(a ^ c ^ P0, d ^ P3)
    }
}

/// The two little-endian words of a 16-byte address field: IPv6 as is, IPv4 v4-mapped
/// (`::ffff:a.b.c.d`). `raw` is 4 or 16 bytes, as the parser's address ranges are.
#[inline(always)]
fn addr_words(raw: &[u8]) -> (u64, u64) {
    match raw {
        [a, b, c, d] => (
            0,
            0xffff_0000 | u64::from(u32::from_le_bytes([*a, *b, *c, *d])) << 32,
        ),
        _ => {
            let mut x = [0u8; 16];
            x.copy_from_slice(raw);
            let lo = u64::from_le_bytes([x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]]);
            let hi = u64::from_le_bytes([x[8], x[9], x[10], x[11], x[12], x[13], x[14], x[15]]);
            (lo, hi)
        }
    }
}

/// The little-endian 8-byte word of a key at byte `i`.
#[inline(always)]
fn w(b: &[u8; 40], i: usize) -> u64 {
    u64::from_le_bytes([
        b[i],
        b[i + 1],
        b[i + 2],
        b[i + 3],
        b[i + 4],
        b[i + 5],
        b[i + 6],
        b[i + 7],
    ])
}

/// 64×64→128 multiply folded to 64 bits (wyhash's mixing step).
#[inline(always)]
fn mum(a: u64, b: u64) -> u64 {
    let r = (a as u128) * (b as u128);
    (r as u64) ^ ((r >> 64) as u64)
}

#[inline]
fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    h
}

/// The flow hash of 40 canonical key bytes. It must stay stable: the VXLAN source port
/// derives from it, and the golden corpus and the XDP program compute it too.
#[inline]
pub fn flow_hash(b: &[u8; 40]) -> u64 {
    flow_hash_with(b, 0)
}

/// The flow hash started from a per-worker seed: what the flow table indexes with, in a
/// single pass (seed 0 is [`flow_hash`]).
#[inline]
pub fn flow_hash_with(b: &[u8; 40], seed: u64) -> u64 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15 ^ seed;
    for i in (0..40).step_by(8) {
        h = (h ^ w(b, i)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h ^= h >> 31;
    }
    fmix64(h)
}

/// Outer UDP source port for a VXLAN packet carrying the flow with this hash: in the
/// dynamic range, so underlay ECMP spreads flows (RFC 7348 §5).
#[inline]
pub fn vxlan_source_port(h: u64) -> u16 {
    49152 + (((h as u32) ^ ((h >> 32) as u32)) % 16384) as u16
}

impl fmt::Display for FlowKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = match self.proto() {
            proto::TCP => "tcp".to_string(),
            proto::UDP => "udp".to_string(),
            proto::ICMP => "icmp".to_string(),
            proto::ICMPV6 => "icmp6".to_string(),
            n => n.to_string(),
        };
        let ep = |a: IpAddr, port: u16| match a {
            IpAddr::V4(a) => format!("{a}:{port}"),
            IpAddr::V6(a) => format!("[{a}]:{port}"),
        };
        write!(
            f,
            "{} {} {} > {}",
            self.vni(),
            p,
            ep(self.src(), self.sport()),
            ep(self.dst(), self.dport())
        )
    }
}

impl fmt::Debug for FlowKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FlowKey({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_ip_builds_the_canonical_layout() {
        use packet::build::{ip_frame, L4Spec};
        use packet::rewrite::Addr;
        let cases = [
            (
                Addr::V4([198, 18, 10, 2]),
                Addr::V4([198, 19, 0, 9]),
                "198.18.10.2",
                "198.19.0.9",
            ),
            (
                Addr::V6([
                    0x20, 0x01, 0x0d, 0xb8, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                ]),
                Addr::V6([
                    0x20, 0x01, 0x0d, 0xb8, 0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xab, 0xcd,
                ]),
                "2001:db8:102:304:506:708:90a:b0c",
                "2001:db8:ff00::abcd",
            ),
        ];
        for (src, dst, s, d) in cases {
            for (l4, proto) in [
                (
                    L4Spec::Udp {
                        sport: 0x1234,
                        dport: 0xfe53,
                    },
                    17u8,
                ),
                (
                    L4Spec::Tcp {
                        sport: 40000,
                        dport: 80,
                        flags: 2,
                        seq: 1,
                    },
                    6,
                ),
            ] {
                let f = ip_frame(src, dst, l4, &[1, 2, 3]);
                let fr = packet::parse_frame(&f).unwrap();
                let packet::L3::Ip(ip) = fr.l3 else {
                    panic!("not IP")
                };
                let (sp, dp) = match l4 {
                    L4Spec::Udp { sport, dport } | L4Spec::Tcp { sport, dport, .. } => {
                        (sport, dport)
                    }
                    _ => unreachable!(),
                };
                let want = FlowKey::new(
                    0xabcdef,
                    proto,
                    s.parse().unwrap(),
                    sp,
                    d.parse().unwrap(),
                    dp,
                );
                assert_eq!(
                    FlowKey::from_ip(&f, &ip, 0xabcdef).unwrap().as_bytes(),
                    want.as_bytes()
                );
            }
        }
    }

    #[test]
    fn reversed_twice_is_identity() {
        let k = FlowKey::new(
            7,
            proto::TCP,
            "198.18.0.1".parse().unwrap(),
            1234,
            "198.19.0.2".parse().unwrap(),
            80,
        );
        assert_eq!(k.reversed().reversed(), k);
        assert_ne!(k.reversed(), k);
        assert_eq!(k.reversed().sport(), 80);
        assert_eq!(k.to_string(), "7 tcp 198.18.0.1:1234 > 198.19.0.2:80");
    }

    #[test]
    fn v4_and_v6_keys_differ() {
        let a = FlowKey::new(
            1,
            proto::UDP,
            "198.18.0.1".parse().unwrap(),
            1,
            "198.18.0.2".parse().unwrap(),
            2,
        );
        assert!(a.is_v4());
        let b = FlowKey::new(
            1,
            proto::UDP,
            "2001:2::1".parse().unwrap(),
            1,
            "2001:2::2".parse().unwrap(),
            2,
        );
        assert!(!b.is_v4());
        assert_ne!(a.hash(), b.hash());
    }

    #[test]
    fn source_port_in_dynamic_range() {
        for i in 0..1000u64 {
            let p = vxlan_source_port(i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            assert!(p >= 49152);
        }
    }
}
