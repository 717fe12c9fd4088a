//! Property tests: every incremental (RFC 1624) checksum update equals a full
//! recomputation, for random packets and random rewrites. The oracle is etherparse, an
//! independent implementation, plus a from-scratch RFC 1071 sum for ICMP messages.

use etherparse::{NetHeaders, PacketHeaders, TransportHeader};
use packet::build::{ip_frame, udp_v4, L4Spec};
use packet::csum;
use packet::rewrite::{rewrite_endpoint, rewrite_icmp_error, Addr, Side};
use packet::{parse_frame, VXLAN_PORT};
use proptest::prelude::*;

fn addr(v6: bool) -> impl Strategy<Value = Addr> {
    if v6 {
        any::<[u8; 16]>()
            // v4-mapped addresses are refused by the parser by design.
            .prop_filter("not v4-mapped", |a| {
                !(a[..10].iter().all(|&x| x == 0) && a[10] == 0xff && a[11] == 0xff)
            })
            .prop_map(Addr::V6)
            .boxed()
    } else {
        any::<[u8; 4]>().prop_map(Addr::V4).boxed()
    }
}

fn l4() -> impl Strategy<Value = L4Spec> {
    prop_oneof![
        // UDP to the VXLAN port is parsed as VXLAN by design (wire_props covers it), so a
        // random payload there is a correct parse error, not a checksum case.
        (any::<u16>(), any::<u16>())
            .prop_filter("not VXLAN", |(_, d)| *d != VXLAN_PORT)
            .prop_map(|(s, d)| L4Spec::Udp { sport: s, dport: d }),
        (any::<u16>(), any::<u16>(), any::<u8>(), any::<u32>()).prop_map(|(s, d, f, q)| {
            L4Spec::Tcp {
                sport: s,
                dport: d,
                flags: f,
                seq: q,
            }
        }),
        (any::<bool>(), any::<u16>(), any::<u16>()).prop_map(|(r, i, q)| L4Spec::Echo {
            request: r,
            id: i,
            seq: q
        }),
    ]
}

#[derive(Debug, Clone)]
struct Case {
    src: Addr,
    dst: Addr,
    l4: L4Spec,
    payload: Vec<u8>,
    udp_zero: bool,
    side: Side,
    new_addr: Option<Addr>,
    new_port: Option<u16>,
}

fn case() -> impl Strategy<Value = Case> {
    any::<bool>().prop_flat_map(|v6| {
        (
            addr(v6),
            addr(v6),
            l4(),
            proptest::collection::vec(any::<u8>(), 0..80),
            any::<bool>(),
            any::<bool>(),
            proptest::option::of(addr(v6)),
            proptest::option::of(any::<u16>()),
        )
            .prop_map(
                |(src, dst, l4, payload, udp_zero, src_side, new_addr, new_port)| Case {
                    src,
                    dst,
                    l4,
                    payload,
                    udp_zero,
                    side: if src_side { Side::Src } else { Side::Dst },
                    new_addr,
                    new_port,
                },
            )
    })
}

/// Assert every checksum in an Ethernet frame is what a full recomputation gives.
fn assert_checksums_valid(frame: &[u8], udp_zero_expected: bool) {
    let h = PacketHeaders::from_ethernet_slice(frame).expect("etherparse parses our frame");
    let payload = h.payload.slice();
    match (
        h.net.as_ref().expect("ip"),
        h.transport.as_ref().expect("l4"),
    ) {
        (NetHeaders::Ipv4(ip, _), t) => {
            assert_eq!(ip.header_checksum, ip.calc_header_checksum(), "IPv4 header");
            match t {
                TransportHeader::Udp(u) if udp_zero_expected => assert_eq!(u.checksum, 0),
                TransportHeader::Udp(u) => {
                    assert_eq!(
                        u.checksum,
                        u.calc_checksum_ipv4(ip, payload).unwrap(),
                        "UDP/v4"
                    )
                }
                TransportHeader::Tcp(t) => {
                    assert_eq!(
                        t.checksum,
                        t.calc_checksum_ipv4(ip, payload).unwrap(),
                        "TCP/v4"
                    )
                }
                TransportHeader::Icmpv4(i) => {
                    assert_eq!(i.checksum, i.icmp_type.calc_checksum(payload), "ICMPv4")
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        (NetHeaders::Ipv6(ip, _), t) => match t {
            TransportHeader::Udp(u) => {
                assert_eq!(
                    u.checksum,
                    u.calc_checksum_ipv6(ip, payload).unwrap(),
                    "UDP/v6"
                )
            }
            TransportHeader::Tcp(t) => {
                assert_eq!(
                    t.checksum,
                    t.calc_checksum_ipv6(ip, payload).unwrap(),
                    "TCP/v6"
                )
            }
            TransportHeader::Icmpv6(i) => assert_eq!(
                i.checksum,
                i.icmp_type
                    .calc_checksum(ip.source, ip.destination, payload)
                    .unwrap(),
                "ICMPv6"
            ),
            other => panic!("unexpected {other:?}"),
        },
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn incremental_update_equals_full_recompute(c in case()) {
        let mut f = ip_frame(c.src, c.dst, c.l4, &c.payload);
        let v4_udp = matches!(c.src, Addr::V4(_)) && matches!(c.l4, L4Spec::Udp { .. });
        let zero = c.udp_zero && v4_udp;
        if zero {
            csum::put16(&mut f, 14 + 20 + 6, 0);
        }
        let p = parse_frame(&f).unwrap();
        let ip = *p.ip().unwrap();
        rewrite_endpoint(&mut f, &ip, c.side, c.new_addr.as_ref(), c.new_port).unwrap();
        assert_checksums_valid(&f, zero);
        if let Some(a) = c.new_addr {
            let r = match c.side { Side::Src => ip.src_range(), Side::Dst => ip.dst_range() };
            prop_assert_eq!(&f[r], a.as_bytes());
        }
    }

    /// ICMP errors: outer address, quoted address and port, and every checksum involved.
    #[test]
    fn icmp_error_translation_keeps_every_checksum_valid(
        v6 in any::<bool>(),
        seed in any::<[u8; 16]>(),
        tcp in any::<bool>(),
        ports in (any::<u16>(), any::<u16>()),
        payload in proptest::collection::vec(any::<u8>(), 0..40),
        quote_extra in 0usize..60,
        side_dst in any::<bool>(),
        new_port in any::<u16>(),
    ) {
        let mk = |b: u8| -> Addr {
            if v6 {
                let mut a = [0x20u8, 0x01, 0, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, b];
                a[8..14].copy_from_slice(&seed[..6]);
                Addr::V6(a)
            } else {
                Addr::V4([198, 18, seed[0], b])
            }
        };
        let (client, server, router, newa) = (mk(1), mk(2), mk(3), mk(4));
        let l4 = |s, d| if tcp {
            L4Spec::Tcp { sport: s, dport: d, flags: 0x18, seq: 7 }
        } else {
            L4Spec::Udp { sport: s, dport: d }
        };
        // The packet that caused the error went client → server.
        let quoted_full = ip_frame(client, server, l4(ports.0, ports.1), &payload);
        let ip_hdr = if v6 { 40 } else { 20 };
        let qlen = (ip_hdr + 8 + quote_extra).min(quoted_full.len() - 14);
        let quote = &quoted_full[14..14 + qlen];
        // The router reports to the client: ICMP error router → client.
        let mut icmp = vec![if v6 { 1 } else { 3 }, if v6 { 4 } else { 3 }, 0, 0, 0, 0, 0, 0];
        icmp.extend_from_slice(quote);
        let mut f = build_error(router, client, &icmp, v6);
        let p = parse_frame(&f).unwrap();
        let ip = *p.ip().unwrap();
        let q = *ip.icmp_quote().expect("quote parsed");
        // The rule the error matches is for traffic toward the client (reply direction):
        // set-dst rewrites the outer dst and the quoted src; set-src the other pair.
        let side = if side_dst { Side::Dst } else { Side::Src };
        rewrite_icmp_error(&mut f, &ip, &q, side, Some(&newa), Some(new_port)).unwrap();

        // Expected quoted packet, built from scratch with the translation applied.
        let (qs, qd, qsp, qdp) = if side_dst {
            (newa, server, new_port, ports.1)
        } else {
            (client, newa, ports.0, new_port)
        };
        let want_full = ip_frame(qs, qd, l4(qsp, qdp), &payload);
        let mut want_quote = want_full[14..14 + qlen].to_vec();
        // A transport checksum only partly inside the quote is left alone, as Linux's
        // tcp_manip_pkt does: it can't be updated meaningfully.
        let c = ip_hdr + if tcp { 16 } else { 6 };
        if c < qlen && c + 2 > qlen {
            want_quote[c] = quote[c];
        }
        let icmp_off = 14 + ip_hdr;
        prop_assert_eq!(&f[icmp_off + 8..], &want_quote[..]);
        // Outer address changed on the right side.
        let (os, od) = if side_dst { (router, newa) } else { (newa, client) };
        let want_outer = build_error(os, od, &f[icmp_off..], v6);
        prop_assert_eq!(&f[14..icmp_off], &want_outer[14..icmp_off]);
        // The ICMP checksum over the whole (translated) message is valid.
        let pseudo = match (os, od) {
            (Addr::V6(s), Addr::V6(d)) => csum::pseudo_v6(&s, &d, 58, (f.len() - icmp_off) as u32),
            _ => 0,
        };
        prop_assert_eq!(csum::fold(pseudo + csum::sum(&f[icmp_off..])), 0xffff);
    }
}

/// An Ethernet + IP frame carrying `icmp` (whose checksum field is recomputed here).
fn build_error(src: Addr, dst: Addr, icmp: &[u8], v6: bool) -> Vec<u8> {
    let mut m = icmp.to_vec();
    m[2] = 0;
    m[3] = 0;
    let pseudo = match (src, dst) {
        (Addr::V6(s), Addr::V6(d)) => csum::pseudo_v6(&s, &d, 58, m.len() as u32),
        _ => 0,
    };
    let c = csum::checksum(pseudo, &m);
    csum::put16(&mut m, 2, c);
    // Reuse the builder for the IP header: an echo of the right size, then swap in `m`.
    let f = ip_frame(
        src,
        dst,
        L4Spec::Echo {
            request: true,
            id: 0,
            seq: 0,
        },
        &vec![0; m.len() - 8],
    );
    let off = if v6 { 54 } else { 34 };
    let mut out = f[..off].to_vec();
    out.extend_from_slice(&m);
    assert_eq!(out.len(), f.len());
    out
}

#[test]
fn rewrite_refuses_family_mismatch() {
    let mut f = udp_v4([198, 18, 0, 1], 1, [198, 18, 0, 2], 2, b"");
    let p = parse_frame(&f).unwrap();
    let ip = *p.ip().unwrap();
    assert!(rewrite_endpoint(&mut f, &ip, Side::Src, Some(&Addr::V6([1; 16])), None).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(5000))]

    /// The VXLAN fast recogniser agrees with the full parser wherever it answers.
    #[test]
    fn vxlan_fast_agrees_with_full_parse(
        inner_len in 0usize..100,
        flips in proptest::collection::vec((0usize..60, any::<u8>()), 0..4),
        cut in 0usize..200,
    ) {
        let inner = udp_v4([198, 18, 0, 2], 1, [198, 19, 0, 2], 2, &vec![7u8; inner_len]);
        let mut f = packet::build::vxlan_wrap([198, 18, 0, 1], [198, 18, 0, 9], 49200, 42, &inner);
        for (at, x) in flips {
            if at < f.len() { f[at] ^= x; }
        }
        f.truncate(cut.max(1));
        if let Some(v) = packet::vxlan_fast(&f, packet::VXLAN_PORT) {
            let full = parse_frame(&f);
            prop_assert!(full.is_ok(), "fast accepted what full rejects: {:?}", full);
            prop_assert_eq!(full.unwrap().vxlan, Some(v));
        }
    }
}
