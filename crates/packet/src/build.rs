//! Header writers: the VXLAN encapsulation template the data plane pushes, and frame
//! builders for tests, benchmarks and demos.
//!
//! The encap path writes a precomputed 50-byte outer header and patches four fields
//! (IP total length and checksum, UDP source port and length), as katran's encap does;
//! building the header field by field through a `Repr` per packet would cost more than
//! the whole rewrite.

use crate::csum::{fold, put16};
use crate::proto;
use crate::rewrite::Addr;
use crate::wire::{EthernetRepr, FrameRepr, IpRepr, Ipv4Repr, L4Repr, TcpRepr, Vlans, VxlanRepr};

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
        let ip = Ipv4Repr {
            dont_frag: true,
            ..Ipv4Repr::new(src, dst, proto::UDP)
        };
        let base_sum = ip.sum_without_len();
        let outer = FrameRepr {
            eth: EthernetRepr {
                dst: dst_mac,
                src: src_mac,
                vlans: Vlans::None,
            },
            ip: IpRepr::V4(ip),
            l4: L4Repr::Udp {
                sport: 0,
                dport: crate::VXLAN_PORT,
                checksum: false,
            },
        };
        // The lengths, IP checksum and source port written here are those of an empty
        // inner frame; `write` replaces them.
        let mut bytes = [0u8; VXLAN_V4_OVERHEAD];
        outer.emit(&mut bytes, &VxlanRepr::new(vni).to_bytes());
        EncapV4 { bytes, base_sum }
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
    let l4 = match l4 {
        L4Spec::Udp { sport, dport } => L4Repr::Udp {
            sport,
            dport,
            checksum: true,
        },
        L4Spec::Tcp {
            sport,
            dport,
            flags,
            seq,
        } => L4Repr::Tcp(TcpRepr {
            sport,
            dport,
            seq,
            ack: 0,
            flags,
            window: 65535,
            options: Vec::new(),
        }),
        L4Spec::Echo { request, id, seq } => L4Repr::echo(v6, request, id, seq),
    };
    let proto = l4.proto(v6).expect("a transport header");
    FrameRepr {
        eth: EthernetRepr {
            dst: DEFAULT_DST_MAC,
            src: DEFAULT_SRC_MAC,
            vlans: Vlans::None,
        },
        ip: IpRepr::new(src, dst, proto),
        l4,
    }
    .to_vec(payload)
}

/// [`ip_frame`] of an IPv4 UDP datagram from `src:sport` to `dst:dport`: the frame most
/// tests and demos send.
pub fn udp_v4(src: [u8; 4], sport: u16, dst: [u8; 4], dport: u16, payload: &[u8]) -> Vec<u8> {
    ip_frame(
        Addr::V4(src),
        Addr::V4(dst),
        L4Spec::Udp { sport, dport },
        payload,
    )
}

/// [`ip_frame`] of an IPv4 TCP segment from `src:sport` to `dst:dport` with `flags`
/// ([`crate::tcp_flags`]) and sequence number `seq`.
pub fn tcp_v4(
    src: [u8; 4],
    sport: u16,
    dst: [u8; 4],
    dport: u16,
    flags: u8,
    seq: u32,
    payload: &[u8],
) -> Vec<u8> {
    let l4 = L4Spec::Tcp {
        sport,
        dport,
        flags,
        seq,
    };
    ip_frame(Addr::V4(src), Addr::V4(dst), l4, payload)
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
        let inner = udp_v4([198, 18, 0, 10], 1000, [198, 19, 0, 1], 53, b"hello");
        let f = vxlan_wrap([198, 18, 0, 1], [198, 18, 0, 2], 50000, 77, &inner);
        assert_eq!(crate::csum::checksum(0, &f[14..34]), 0);
        let p = parse_frame(&f).unwrap();
        let v = p.vxlan.unwrap();
        assert_eq!(v.vni, 77);
        assert_eq!(p.vxlan_inner(&f).unwrap(), &inner[..]);
        let ip = p.ip().unwrap();
        assert!(matches!(ip.l4, L4::Udp { sport: 50000, .. }));
    }

    /// The builders' output from before they were rewritten over `wire`, by FNV-1a of
    /// the hex of every case: callers across the workspace compare against these bytes.
    #[test]
    fn builder_output_is_unchanged() {
        let mut out = String::new();
        let (v4s, v4d) = (Addr::V4([198, 18, 0, 10]), Addr::V4([198, 19, 0, 1]));
        let mut s6 = [0u8; 16];
        s6[..2].copy_from_slice(&[0x20, 0x01]);
        s6[15] = 1;
        let mut d6 = s6;
        d6[15] = 2;
        let l4s = [
            L4Spec::Udp {
                sport: 1000,
                dport: 53,
            },
            L4Spec::Udp {
                sport: 0xffff,
                dport: 0,
            },
            L4Spec::Tcp {
                sport: 40000,
                dport: 80,
                flags: 0x12,
                seq: 0xdeadbeef,
            },
            L4Spec::Echo {
                request: true,
                id: 7,
                seq: 9,
            },
            L4Spec::Echo {
                request: false,
                id: 0xabcd,
                seq: 1,
            },
        ];
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        for (s, d) in [(v4s, v4d), (Addr::V6(s6), Addr::V6(d6))] {
            for l in l4s {
                for p in [&b""[..], b"hello", b"\x00\x00\xff\xff odd"] {
                    out += &hex(&ip_frame(s, d, l, p));
                    out += "\n";
                }
            }
        }
        let inner = ip_frame(v4s, v4d, l4s[0], b"x");
        out += &hex(&vxlan_wrap(
            [198, 18, 0, 1],
            [198, 18, 0, 2],
            50000,
            77,
            &inner,
        ));
        out += "\n";
        out += &hex(&vxlan_wrap([10, 0, 0, 1], [10, 0, 0, 2], 1, 0xffffff, &[]));
        out += "\n";
        let e = EncapV4::new([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [1; 4], [2; 4], 5);
        let mut b = [0u8; VXLAN_V4_OVERHEAD];
        e.write(&mut b, 1400, 4242);
        out += &hex(&b);
        out += &format!("\n{} {:?}\n", e.vni(), e.dst());
        let fnv = out.bytes().fold(0xcbf29ce484222325u64, |h, b| {
            (h ^ b as u64).wrapping_mul(0x100000001b3)
        });
        assert_eq!(fnv, 0x7760d09c9f027559, "{out}");
    }
}
