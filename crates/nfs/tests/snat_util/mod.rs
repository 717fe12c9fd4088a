//! Helpers shared by the SNAT tests: flows written as text, a NAT on test addresses
//! (RFC 2544's 198.18.0.0/15), and shorthands for the decision fields.
#![allow(dead_code, unused_imports)]

use std::net::IpAddr;

use nf::{Decision, FirstPacket, FlowEvent, NetworkFunction, NfEnv, Verdict};
use nfs::snat::{Snat, SnatConfig, SnatPool};
use pipeline::{FlowKey, PacketMeta};

pub use packet::tcp_flags::{ACK, FIN, RST, SYN};

/// Inside hosts live in 198.18.0.0/16, servers in 198.19.0.0/24, the pool in 198.19.255.0/24.
pub const INSIDE: &str = "198.18.0.0/16";
pub const POOL_A: &str = "198.19.255.1";
pub const POOL_B: &str = "198.19.255.2";

pub fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address")
}

pub fn key(s: &str) -> FlowKey {
    s.parse().expect("test flow key")
}

/// A first packet; TCP ones carry a SYN.
pub fn pkt(s: &str) -> FirstPacket {
    let k = key(s);
    let flags = if k.proto() == packet::proto::TCP {
        SYN
    } else {
        0
    };
    pkt_flags(s, flags)
}

pub fn pkt_flags(s: &str, tcp_flags: u8) -> FirstPacket {
    FirstPacket::new(key(s), 1, PacketMeta::new(60, tcp_flags))
}

pub fn icmp_error(s: &str) -> FirstPacket {
    let mut p = pkt_flags(s, 0);
    p.meta.icmp_error = true;
    p
}

/// One pool address, ports `lo..=hi`, inside named (so hairpinning works).
pub fn nat_with(pools: Vec<SnatPool>) -> Snat {
    Snat::new(SnatConfig::new(pools)).expect("valid config")
}

pub fn nat(lo: u16, hi: u16) -> Snat {
    nat_with(vec![
        SnatPool::new(vec![ip(POOL_A)], lo, hi).sources(&[INSIDE])
    ])
}

pub fn decide_at(n: &mut Snat, p: &FirstPacket, now_ms: u64, seed: u64) -> Decision {
    n.first_packet(p, &mut NfEnv::new(now_ms, seed))
        .expect("snat never fails a first packet")
}

pub fn decide(n: &mut Snat, s: &str) -> Decision {
    decide_at(n, &pkt(s), 0, 7)
}

/// The external source a passing decision rewrites to.
pub fn ext(d: &Decision) -> (IpAddr, u16) {
    assert_eq!(d.verdict, Verdict::pass(), "expected a pass, got {d:?}");
    (
        d.forward.src.addr.expect("source address rewritten"),
        d.forward.src.port.expect("source port rewritten"),
    )
}

pub fn drop_reason(d: &Decision) -> &str {
    match &d.verdict {
        Verdict::Drop { reason } => reason,
        v => panic!("expected a drop, got {v:?}"),
    }
}

pub fn timer(n: &mut Snat, now_ms: u64) -> Vec<FlowKey> {
    n.on_timer(&mut NfEnv::new(now_ms, 0))
}

pub fn event(n: &mut Snat, ev: FlowEvent, now_ms: u64) {
    n.on_event(&ev, &mut NfEnv::new(now_ms, 0));
}

/// The key of a reply to a flow after the NAT: remote → external endpoint.
pub fn reply_to(flow: &str, d: &Decision) -> FlowKey {
    d.forward.apply(&key(flow)).reversed()
}

/// Port accounting across partitions of one NAT, for one (address, protocol): every port
/// of `lo..=hi` is free in exactly one partition or mapped, never both; one external
/// endpoint serves one internal endpoint. Returns (free, mapped).
pub fn check_ports(parts: &[&Snat], addr: IpAddr, proto: u8, lo: u16, hi: u16) -> (usize, usize) {
    use std::collections::HashMap;
    let mut free: HashMap<u16, usize> = HashMap::new();
    for (i, p) in parts.iter().enumerate() {
        for port in p.free_ports(addr, proto) {
            assert!((lo..=hi).contains(&port), "port {port} outside the pool");
            if let Some(j) = free.insert(port, i) {
                panic!("port {port} of {addr} free in partitions {j} and {i}");
            }
        }
    }
    let mut mapped: HashMap<u16, nfs::snat::MappingKey> = HashMap::new();
    for p in parts {
        for m in p.mappings() {
            let e = m.external;
            if e.addr != addr || e.proto != proto {
                continue;
            }
            assert!(!free.contains_key(&e.port), "{e:?} both free and mapped");
            if let Some(k) = mapped.insert(e.port, m.key) {
                assert_eq!(k, m.key, "{e:?} mapped for two internal endpoints");
            }
        }
    }
    assert_eq!(
        free.len() + mapped.len(),
        usize::from(hi - lo) + 1,
        "ports of {addr} proto {proto} lost or invented"
    );
    (free.len(), mapped.len())
}
