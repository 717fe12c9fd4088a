//! Property tests of `wire` against the parser: for random valid header values, emit
//! then parse gives back the same values; for random bytes, parsing never panics.

use packet::wire::{
    EthernetRepr, FrameRepr, IpRepr, Ipv4Repr, Ipv6Ext, Ipv6Repr, L4Repr, TcpRepr, Vlans, VxlanRepr,
};
use packet::{
    parse_frame, parse_frame_with, proto, Frag, IcmpKind, IpVersion, ParseOptions, L4, VXLAN_PORT,
};
use proptest::collection::vec;
use proptest::prelude::*;

fn vlans() -> impl Strategy<Value = Vlans> {
    prop_oneof![
        Just(Vlans::None),
        any::<u16>().prop_map(|tci| Vlans::One { tci }),
        (any::<u16>(), any::<u16>()).prop_map(|(outer, inner)| Vlans::Two { outer, inner }),
    ]
}

fn eth() -> impl Strategy<Value = EthernetRepr> {
    (any::<[u8; 6]>(), any::<[u8; 6]>(), vlans()).prop_map(|(dst, src, vlans)| EthernetRepr {
        dst,
        src,
        vlans,
    })
}

fn v6_addr() -> impl Strategy<Value = [u8; 16]> {
    any::<[u8; 16]>().prop_filter("not v4-mapped", |a| {
        !(a[..10].iter().all(|&x| x == 0) && a[10] == 0xff && a[11] == 0xff)
    })
}

/// (more fragments, offset): a whole datagram, a first fragment or a later one.
fn frag() -> impl Strategy<Value = (bool, u16)> {
    prop_oneof![
        3 => Just((false, 0)),
        1 => Just((true, 0)),
        1 => (any::<bool>(), 1u16..0x2000),
    ]
}

fn ipv4(proto: u8) -> impl Strategy<Value = IpRepr> {
    (
        any::<([u8; 4], [u8; 4], u8, u16, bool)>(),
        frag(),
        (0usize..=10).prop_flat_map(|w| vec(any::<u8>(), 4 * w)),
    )
        .prop_map(
            move |((src, dst, ttl, ident, df), (more_frags, frag_offset), options)| {
                IpRepr::V4(Ipv4Repr {
                    src,
                    dst,
                    proto,
                    ttl,
                    ident,
                    dont_frag: df,
                    more_frags,
                    frag_offset,
                    options,
                })
            },
        )
}

/// Options headers, AH, and at most one fragment header, last (after it a later
/// fragment's bytes are not headers).
fn exts() -> impl Strategy<Value = Vec<Ipv6Ext>> {
    let ext = prop_oneof![
        (prop::sample::select(vec![43u8, 60]), 0u8..4)
            .prop_map(|(kind, len8)| Ipv6Ext::Opts { kind, len8 }),
        (any::<u32>(), any::<u32>(), 0u8..5).prop_map(|(spi, seq, icv_words)| Ipv6Ext::Auth {
            spi,
            seq,
            icv_words
        }),
    ];
    (
        any::<bool>(),
        0u8..4,
        vec(ext, 0..4),
        prop::option::of((frag(), any::<u32>())),
    )
        .prop_map(|(hbh, hbh_len, mut exts, fragment)| {
            if hbh {
                exts.insert(
                    0,
                    Ipv6Ext::Opts {
                        kind: 0,
                        len8: hbh_len,
                    },
                );
            }
            if let Some(((more, offset), ident)) = fragment {
                exts.push(Ipv6Ext::Fragment {
                    offset,
                    more,
                    ident,
                });
            }
            exts
        })
}

fn ipv6(proto: u8) -> impl Strategy<Value = IpRepr> {
    (
        v6_addr(),
        v6_addr(),
        any::<(u8, u8)>(),
        0u32..1 << 20,
        exts(),
    )
        .prop_map(
            move |(src, dst, (hop_limit, traffic_class), flow_label, exts)| {
                IpRepr::V6(Ipv6Repr {
                    src,
                    dst,
                    proto,
                    hop_limit,
                    traffic_class,
                    flow_label,
                    exts,
                })
            },
        )
}

/// A transport header the parser reads without looking further (no VXLAN port, no ICMP
/// error, which needs a quote).
fn l4(v6: bool) -> impl Strategy<Value = L4Repr> {
    let icmp_ty = any::<u8>().prop_filter("not an error", move |&t| {
        if v6 {
            !(1..=4).contains(&t)
        } else {
            !matches!(t, 3 | 11 | 12)
        }
    });
    prop_oneof![
        (any::<u16>(), any::<u16>(), any::<bool>())
            .prop_filter("not VXLAN", |(_, d, _)| *d != VXLAN_PORT)
            .prop_map(move |(sport, dport, c)| L4Repr::Udp {
                sport,
                dport,
                checksum: c || v6,
            }),
        (
            any::<(u16, u16, u32, u32, u8, u16)>(),
            (0usize..=10).prop_flat_map(|w| vec(any::<u8>(), 4 * w))
        )
            .prop_map(|((sport, dport, seq, ack, flags, window), options)| {
                L4Repr::Tcp(TcpRepr {
                    sport,
                    dport,
                    seq,
                    ack,
                    flags,
                    window,
                    options,
                })
            }),
        (icmp_ty, any::<u8>(), any::<[u8; 4]>()).prop_map(|(ty, code, rest)| L4Repr::Icmp {
            ty,
            code,
            rest
        }),
    ]
}

fn frame() -> impl Strategy<Value = (FrameRepr, Vec<u8>)> {
    any::<bool>()
        .prop_flat_map(|v6| {
            l4(v6).prop_flat_map(move |l4| {
                let p = l4.proto(v6).unwrap();
                let ip = if v6 { ipv6(p).boxed() } else { ipv4(p).boxed() };
                (eth(), ip, Just(l4))
            })
        })
        .prop_map(|(eth, ip, l4)| FrameRepr { eth, ip, l4 })
        .prop_flat_map(|f| (Just(f), vec(any::<u8>(), 0..64)))
}

/// The fragment state the IP header (or the IPv6 fragment header) says.
fn expected_frag(ip: &IpRepr) -> Frag {
    let (more, offset) = match ip {
        IpRepr::V4(ip) => (ip.more_frags, ip.frag_offset),
        IpRepr::V6(ip) => match ip.exts.last() {
            Some(&Ipv6Ext::Fragment { offset, more, .. }) => (more, offset),
            _ => (false, 0),
        },
    };
    match (more, offset) {
        (_, 1..) => Frag::NonFirst,
        (true, 0) => Frag::First,
        (false, 0) => Frag::None,
    }
}

fn expected_l4(f: &FrameRepr, payload_len: usize) -> L4 {
    let v6 = f.ip.is_v6();
    match &f.l4 {
        L4Repr::Udp { sport, dport, .. } => L4::Udp {
            sport: *sport,
            dport: *dport,
            len: (8 + payload_len) as u16,
        },
        L4Repr::Tcp(t) => L4::Tcp {
            sport: t.sport,
            dport: t.dport,
            flags: t.flags,
        },
        &L4Repr::Icmp { ty, code, rest } => {
            let id = u16::from_be_bytes([rest[0], rest[1]]);
            let kind = match (v6, ty) {
                (false, 8) | (true, 128) => IcmpKind::EchoRequest { id },
                (false, 0) | (true, 129) => IcmpKind::EchoReply { id },
                _ => IcmpKind::Other,
            };
            L4::Icmp { ty, code, kind }
        }
        L4Repr::Raw => L4::None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn emit_then_parse_gives_back_the_values((f, payload) in frame()) {
        let bytes = f.to_vec(&payload);
        prop_assert_eq!(bytes.len(), f.len(payload.len()));
        let p = parse_frame(&bytes).unwrap();
        prop_assert_eq!(p.len as usize, bytes.len());
        prop_assert_eq!(p.vlan_tags as usize, f.eth.vlans.count());
        prop_assert_eq!(p.vlan_tci, f.eth.vlans.outer_tci());
        prop_assert_eq!(p.ethertype, f.ip.ethertype());
        prop_assert_eq!(p.l3_off as usize, f.eth.header_len());
        prop_assert_eq!(&bytes[..6], &f.eth.dst[..]);
        prop_assert_eq!(&bytes[6..12], &f.eth.src[..]);
        prop_assert_eq!(p.vxlan, None);
        let ip = *p.ip().unwrap();
        let (src, dst): (&[u8], &[u8]) = match &f.ip {
            IpRepr::V4(ip) => (&ip.src, &ip.dst),
            IpRepr::V6(ip) => (&ip.src, &ip.dst),
        };
        prop_assert_eq!(&bytes[ip.src_range()], src);
        prop_assert_eq!(&bytes[ip.dst_range()], dst);
        let version = if f.ip.is_v6() { IpVersion::V6 } else { IpVersion::V4 };
        prop_assert_eq!(ip.version, version);
        prop_assert_eq!(ip.hdr_len as usize, f.ip.header_len());
        prop_assert_eq!(ip.end as usize, bytes.len());
        prop_assert_eq!(ip.proto, f.ip.proto());
        let frag = expected_frag(&f.ip);
        prop_assert_eq!(ip.frag, frag);
        let want = if frag == Frag::NonFirst { L4::None } else { expected_l4(&f, payload.len()) };
        prop_assert_eq!(ip.l4, want);
    }

    #[test]
    fn vxlan_emit_then_parse_gives_back_the_vni(
        outer_v6 in any::<bool>(),
        (inner, inner_payload) in frame(),
        vni in 0u32..1 << 24,
        sport in any::<u16>(),
    ) {
        let inner = inner.to_vec(&inner_payload);
        let mut payload = VxlanRepr::new(vni).to_bytes().to_vec();
        payload.extend_from_slice(&inner);
        let l4 = L4Repr::Udp { sport, dport: VXLAN_PORT, checksum: true };
        let ip = if outer_v6 {
            IpRepr::V6(Ipv6Repr::new([0x20; 16], [0x21; 16], proto::UDP))
        } else {
            IpRepr::V4(Ipv4Repr::new([198, 18, 0, 1], [198, 18, 0, 2], proto::UDP))
        };
        let eth = EthernetRepr { dst: [2; 6], src: [4; 6], vlans: Vlans::None };
        let bytes = FrameRepr { eth, ip, l4 }.to_vec(&payload);
        let p = parse_frame(&bytes).unwrap();
        prop_assert_eq!(p.vxlan.unwrap().vni, vni);
        prop_assert_eq!(p.vxlan_inner(&bytes).unwrap(), &inner[..]);
        prop_assert!(parse_frame(p.vxlan_inner(&bytes).unwrap()).is_ok());
    }

    #[test]
    fn random_bytes_never_panic(bytes in vec(any::<u8>(), 0..300), port in any::<u16>()) {
        let _ = parse_frame(&bytes);
        let _ = parse_frame_with(&bytes, &ParseOptions { vxlan_port: port });
    }

    /// Random bytes rarely get past the Ethernet type; damaged valid frames reach every
    /// layer.
    #[test]
    fn damaged_frames_never_panic(
        (f, payload) in frame(),
        damage in vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = f.to_vec(&payload);
        for (at, v) in damage {
            let i = at.index(bytes.len());
            bytes[i] = v;
        }
        let _ = parse_frame(&bytes);
        let _ = parse_frame(&bytes[..cut.index(bytes.len() + 1)]);
    }
}
