//! Header writers: the VXLAN encapsulation template the data plane pushes, and frame
//! builders for tests, benchmarks and demos.
//!
//! The encap path writes a precomputed 50-byte outer header and patches four fields
//! (IP total length and checksum, UDP source port and length), as katran's encap does;
//! building the header field by field through a `Repr` per packet would cost more than
//! the whole rewrite.

use crate::csum::{self, fold, put16};
use crate::rewrite::Addr;
use crate::{ethertype, proto};

/// Outer Ethernet + IPv4 + UDP + VXLAN.
pub const VXLAN_V4_OVERHEAD: usize = 14 + 20 + 8 + 8;

/// A precomputed IPv4 VXLAN outer header toward one next hop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncapV4 {
    bytes: [u8; VXLAN_V4_OVERHEAD],
    /// One's-complement sum of the IPv4 header with zero length and checksum.
    base_sum: u64,
}

impl EncapV4 {
    /// Outer header from `src` to `dst` with the given MACs and VNI. IPv4 id 0 with DF,
    /// TTL 64, UDP checksum 0 (RFC 7348 §5 allows it over IPv4), VXLAN I flag set.
    pub fn new(src_mac: [u8; 6], dst_mac: [u8; 6], src: [u8; 4], dst: [u8; 4], vni: u32) -> Self {
        let mut b = [0u8; VXLAN_V4_OVERHEAD];
        b[0..6].copy_from_slice(&dst_mac);
        b[6..12].copy_from_slice(&src_mac);
        put16(&mut b, 12, ethertype::IPV4);
        b[14] = 0x45;
        b[20] = 0x40; // DF
        b[22] = 64;
        b[23] = proto::UDP;
        b[26..30].copy_from_slice(&src);
        b[30..34].copy_from_slice(&dst);
        put16(&mut b, 36, crate::VXLAN_PORT);
        b[42] = 0x08;
        b[46..49].copy_from_slice(&vni.to_be_bytes()[1..]);
        let base_sum = csum::sum(&b[14..34]);
        EncapV4 { bytes: b, base_sum }
    }

    pub fn vni(&self) -> u32 {
        u32::from_be_bytes([0, self.bytes[46], self.bytes[47], self.bytes[48]])
    }

    pub fn dst(&self) -> [u8; 4] {
        [
            self.bytes[30],
            self.bytes[31],
            self.bytes[32],
            self.bytes[33],
        ]
    }

    /// Write the outer header into `out[..50]` for an inner frame of `inner_len` bytes.
    #[inline]
    pub fn write(&self, out: &mut [u8], inner_len: usize, sport: u16) {
        let out = &mut out[..VXLAN_V4_OVERHEAD];
        out.copy_from_slice(&self.bytes);
        let total = (20 + 8 + 8 + inner_len) as u16;
        put16(out, 16, total);
        put16(out, 24, !fold(self.base_sum + total as u64));
        put16(out, 34, sport);
        put16(out, 38, total - 20);
    }
}

/// MAC addresses the frame builders use unless told otherwise.
pub const DEFAULT_SRC_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0a];
pub const DEFAULT_DST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0b];

/// Transport header of a frame to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L4Spec {
    Udp {
        sport: u16,
        dport: u16,
    },
    Tcp {
        sport: u16,
        dport: u16,
        flags: u8,
        seq: u32,
    },
    /// ICMP or ICMPv6 echo, by the address family.
    Echo {
        request: bool,
        id: u16,
        seq: u16,
    },
}

/// Build an Ethernet frame carrying one IP packet with valid checksums. For tests,
/// benchmarks and demos: it allocates.
pub fn ip_frame(src: Addr, dst: Addr, l4: L4Spec, payload: &[u8]) -> Vec<u8> {
    let v6 = matches!(src, Addr::V6(_));
    assert_eq!(v6, matches!(dst, Addr::V6(_)), "mixed address families");
    let (l4_proto, l4_hdr_len) = match l4 {
        L4Spec::Udp { .. } => (proto::UDP, 8),
        L4Spec::Tcp { .. } => (proto::TCP, 20),
        L4Spec::Echo { .. } => (if v6 { proto::ICMPV6 } else { proto::ICMP }, 8),
    };
    let l4_len = l4_hdr_len + payload.len();
    let ip_hdr = if v6 { 40 } else { 20 };
    let mut f = vec![0u8; 14 + ip_hdr + l4_len];
    f[0..6].copy_from_slice(&DEFAULT_DST_MAC);
    f[6..12].copy_from_slice(&DEFAULT_SRC_MAC);
    put16(
        &mut f,
        12,
        if v6 { ethertype::IPV6 } else { ethertype::IPV4 },
    );
    let pseudo = match (src, dst) {
        (Addr::V4(s), Addr::V4(d)) => {
            let ip = &mut f[14..34];
            ip[0] = 0x45;
            put16(ip, 2, (20 + l4_len) as u16);
            ip[8] = 64;
            ip[9] = l4_proto;
            ip[12..16].copy_from_slice(&s);
            ip[16..20].copy_from_slice(&d);
            let c = csum::checksum(0, ip);
            put16(ip, 10, c);
            if l4_proto == proto::ICMP {
                0
            } else {
                csum::pseudo_v4(&s, &d, l4_proto, l4_len as u16)
            }
        }
        (Addr::V6(s), Addr::V6(d)) => {
            let ip = &mut f[14..54];
            ip[0] = 0x60;
            put16(ip, 4, l4_len as u16);
            ip[6] = l4_proto;
            ip[7] = 64;
            ip[8..24].copy_from_slice(&s);
            ip[24..40].copy_from_slice(&d);
            csum::pseudo_v6(&s, &d, l4_proto, l4_len as u32)
        }
        _ => unreachable!("checked above"),
    };
    let l4o = 14 + ip_hdr;
    let csum_at = {
        let t = &mut f[l4o..];
        match l4 {
            L4Spec::Udp { sport, dport } => {
                put16(t, 0, sport);
                put16(t, 2, dport);
                put16(t, 4, l4_len as u16);
                6
            }
            L4Spec::Tcp {
                sport,
                dport,
                flags,
                seq,
            } => {
                put16(t, 0, sport);
                put16(t, 2, dport);
                t[4..8].copy_from_slice(&seq.to_be_bytes());
                t[12] = 5 << 4;
                t[13] = flags;
                put16(t, 14, 65535);
                16
            }
            L4Spec::Echo { request, id, seq } => {
                t[0] = match (v6, request) {
                    (false, true) => 8,
                    (false, false) => 0,
                    (true, true) => 128,
                    (true, false) => 129,
                };
                put16(t, 4, id);
                put16(t, 6, seq);
                2
            }
        }
    };
    f[l4o + l4_hdr_len..].copy_from_slice(payload);
    let mut c = csum::checksum(pseudo, &f[l4o..]);
    if l4_proto == proto::UDP && c == 0 {
        c = 0xffff;
    }
    put16(&mut f, l4o + csum_at, c);
    f
}

/// Wrap `inner` in an IPv4 VXLAN outer header from `src` to `dst`.
pub fn vxlan_wrap(src: [u8; 4], dst: [u8; 4], sport: u16, vni: u32, inner: &[u8]) -> Vec<u8> {
    let t = EncapV4::new(DEFAULT_SRC_MAC, DEFAULT_DST_MAC, src, dst, vni);
    let mut f = vec![0u8; VXLAN_V4_OVERHEAD + inner.len()];
    t.write(&mut f, inner.len(), sport);
    f[VXLAN_V4_OVERHEAD..].copy_from_slice(inner);
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{parse_frame, L4};

    #[test]
    fn encap_header_checksum_is_valid() {
        let inner = ip_frame(
            Addr::V4([198, 18, 0, 10]),
            Addr::V4([198, 19, 0, 1]),
            L4Spec::Udp {
                sport: 1000,
                dport: 53,
            },
            b"hello",
        );
        let f = vxlan_wrap([198, 18, 0, 1], [198, 18, 0, 2], 50000, 77, &inner);
        assert_eq!(csum::checksum(0, &f[14..34]), 0);
        let p = parse_frame(&f).unwrap();
        let v = p.vxlan.unwrap();
        assert_eq!(v.vni, 77);
        assert_eq!(p.vxlan_inner(&f).unwrap(), &inner[..]);
        let ip = p.ip().unwrap();
        assert!(matches!(ip.l4, L4::Udp { sport: 50000, .. }));
    }
}
