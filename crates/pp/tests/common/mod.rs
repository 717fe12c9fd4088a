//! What both PP I/O tests send and expect: the client's request, the reflected reply,
//! the rule that reflects it, and a from-scratch checksum check.

// Each test binary that includes this module uses a different part of it.
#![allow(dead_code)]

use packet::build::udp_v4;
use packet::csum;
use packet::{parse_frame, L4};
use pipeline::{parse_actions, FlowKey, Rule};

/// The client's inner MAC: the reply's inner destination.
pub const CLIENT_MAC: [u8; 6] = [0x02, 0xc1, 0, 0, 0, 0x02];

/// The inner frame the client sends: 198.19.10.2:`sport` → 198.19.10.9:7.
pub fn request(sport: u16, payload: &[u8]) -> Vec<u8> {
    udp_v4([198, 19, 10, 2], sport, [198, 19, 10, 9], 7, payload)
}

/// The reply the reflect rule should produce, built from scratch (full checksums).
pub fn expected_reply(sport: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = udp_v4([198, 19, 10, 9], 7, [198, 19, 10, 2], sport, payload);
    f[..6].copy_from_slice(&CLIENT_MAC);
    f
}

/// The rule that answers the client's flow from port `sport`: the request comes back
/// as the server's reply, re-encapsulated to `encap_dst` (VNI 100, the client's MAC),
/// with `extra` actions (each ending in "; ") before the output.
pub fn reflect_rule(sport: u16, encap_dst: &str, extra: &str) -> Rule {
    let key: FlowKey = format!("100 udp 198.19.10.2:{sport} > 198.19.10.9:7")
        .parse()
        .unwrap();
    let actions = format!(
        "decap; set-src 198.19.10.9:7; set-dst 198.19.10.2:{sport}; \
         encap {encap_dst} vni 100 dmac 02:c1:00:00:00:02; {extra}out 0"
    );
    Rule::new(key, parse_actions(&actions).unwrap())
}

/// Verify every checksum of an inner IPv4/UDP frame from scratch.
pub fn check_checksums(f: &[u8]) {
    let p = parse_frame(f).unwrap();
    let ip = p.ip().unwrap();
    let iph = &f[ip.off as usize..ip.l4_off()];
    assert_eq!(csum::checksum(0, iph), 0, "inner IPv4 header checksum");
    let L4::Udp { len, .. } = ip.l4 else {
        panic!("not UDP")
    };
    let s: [u8; 4] = f[ip.src_range()].try_into().unwrap();
    let d: [u8; 4] = f[ip.dst_range()].try_into().unwrap();
    let udp = &f[ip.l4_off()..ip.l4_off() + len as usize];
    assert_eq!(
        csum::checksum(csum::pseudo_v4(&s, &d, 17, len), udp),
        0,
        "inner UDP checksum"
    );
}
