//! SNAT behaviour, one test per RFC requirement (RFC 4787 UDP, RFC 5382 TCP, RFC 5508
//! ICMP), driven by `NfEnv`'s clock: no sleeps.

mod snat_util;

use std::collections::HashSet;
use std::time::Duration;

use nf::{FlowEvent, NetworkFunction};
use nfs::snat::{reason, MappingBehaviour, SnatPool};
use packet::proto;
use snat_util::*;

const MIN: u64 = 60_000;

#[test]
fn rfc4787_req1_endpoint_independent_mapping() {
    let mut n = nat(1024, 65535);
    let a = ext(&decide(&mut n, "100 udp 198.18.0.2:5000 > 198.19.0.10:53"));
    let b = ext(&decide(&mut n, "100 udp 198.18.0.2:5000 > 198.19.0.11:53"));
    let c = ext(&decide(
        &mut n,
        "100 udp 198.18.0.2:5000 > 198.19.0.10:5353",
    ));
    assert_eq!(
        a, b,
        "same internal endpoint, other remote address: same mapping"
    );
    assert_eq!(
        a, c,
        "same internal endpoint, other remote port: same mapping"
    );
    assert_eq!(n.mappings().len(), 1);
    assert_eq!(n.mappings()[0].flows, 3);
    assert_eq!(n.stats().mappings_reused, 2);
    // TCP too (RFC 5382 REQ-1).
    let t1 = ext(&decide(&mut n, "100 tcp 198.18.0.2:40000 > 198.19.0.10:80"));
    let t2 = ext(&decide(
        &mut n,
        "100 tcp 198.18.0.2:40000 > 198.19.0.12:443",
    ));
    assert_eq!(t1, t2);
}

#[test]
fn rfc4787_req2_paired_address_pooling() {
    let mut n = nat_with(vec![SnatPool::new(
        vec![ip(POOL_A), ip(POOL_B)],
        1024,
        65535,
    )
    .sources(&[INSIDE])]);
    let mut seen = HashSet::new();
    for (i, flow) in [
        "100 udp 198.18.0.2:5000 > 198.19.0.10:53",
        "100 udp 198.18.0.2:5001 > 198.19.0.10:53",
        "100 tcp 198.18.0.2:40000 > 198.19.0.10:80",
        "100 icmp 198.18.0.2:77 > 198.19.0.10:0",
        "100 udp 198.18.0.2:6000 > 198.19.0.99:123",
    ]
    .iter()
    .enumerate()
    {
        seen.insert(ext(&decide_at(&mut n, &pkt(flow), 0, i as u64)).0);
    }
    assert_eq!(
        seen.len(),
        1,
        "one internal address, one external address: {seen:?}"
    );
    // The next host is placed on the address with more free ports.
    let other = ext(&decide(&mut n, "100 udp 198.18.0.3:5000 > 198.19.0.10:53")).0;
    assert_ne!(Some(&other), seen.iter().next());
}

#[test]
fn rfc4787_req2_pairing_falls_back_only_when_the_address_is_out_of_ports() {
    // Two ports per address: host .2 takes both of its paired address's UDP ports, then
    // its third mapping must go elsewhere rather than fail.
    let mut n = nat_with(vec![SnatPool::new(
        vec![ip(POOL_A), ip(POOL_B)],
        2000,
        2001,
    )
    .sources(&[INSIDE])]);
    let a1 = ext(&decide(&mut n, "100 udp 198.18.0.2:1 > 198.19.0.10:53")).0;
    let a2 = ext(&decide(&mut n, "100 udp 198.18.0.2:2 > 198.19.0.10:53")).0;
    assert_eq!(a1, a2);
    let a3 = ext(&decide(&mut n, "100 udp 198.18.0.2:3 > 198.19.0.10:53")).0;
    assert_ne!(a3, a1);
    assert_eq!(n.stats().pairing_fallbacks, 1);
    // TCP ports of the paired address are still there: TCP stays paired.
    let t = ext(&decide(&mut n, "100 tcp 198.18.0.2:4 > 198.19.0.10:80")).0;
    assert_eq!(t, a1);
}

#[test]
fn port_preservation_keeps_the_source_port_when_free() {
    let mut n = nat(1024, 65535);
    let (_, p) = ext(&decide(&mut n, "100 udp 198.18.0.2:5000 > 198.19.0.10:53"));
    assert_eq!(p, 5000);
    // Another host with the same port can't have it (no overloading): random instead.
    let (_, q) = ext(&decide(&mut n, "100 udp 198.18.0.3:5000 > 198.19.0.10:53"));
    assert_ne!(q, 5000);
    assert!((1024..=65535).contains(&q));
    // Ports outside the pool range are never preserved.
    let (_, r) = ext(&decide(&mut n, "100 udp 198.18.0.4:80 > 198.19.0.10:53"));
    assert!(r >= 1024);
    // The same port number is free for another protocol.
    let (_, t) = ext(&decide(&mut n, "100 tcp 198.18.0.3:5000 > 198.19.0.10:80"));
    assert_eq!(t, 5000);
    assert_eq!(n.stats().ports_preserved, 2);
}

#[test]
fn no_port_overloading() {
    // 200 hosts all using source port 5000, to the same server, over 300 ports.
    let mut n = nat(10_000, 10_299);
    let mut owners = std::collections::HashMap::new();
    for h in 0..200u32 {
        let flow = format!(
            "100 udp 198.18.{}.{}:5000 > 198.19.0.10:53",
            h / 250,
            h % 250 + 1
        );
        let e = ext(&decide_at(&mut n, &pkt(&flow), 0, u64::from(h)));
        let prev = owners.insert(e, flow.clone());
        assert!(prev.is_none(), "{e:?} given to {flow} and {prev:?}");
    }
    let ms = n.mappings();
    let distinct: HashSet<_> = ms.iter().map(|m| m.external).collect();
    assert_eq!(distinct.len(), ms.len());
    assert_eq!(n.free_port_count(ip(POOL_A), proto::UDP), 100);
}

#[test]
fn rfc4787_req5_udp_timeout_300s() {
    let mut n = nat(1024, 65535);
    let t0 = 1_000_000;
    let d = decide_at(
        &mut n,
        &pkt("100 udp 198.18.0.2:5000 > 198.19.0.10:53"),
        t0,
        1,
    );
    assert_eq!(d.idle_timeout, Some(Duration::from_secs(300)));
    assert!(
        timer(&mut n, t0 + 5 * MIN - 1).is_empty(),
        "alive before 300 s"
    );
    assert_eq!(
        timer(&mut n, t0 + 5 * MIN),
        vec![key("100 udp 198.18.0.2:5000 > 198.19.0.10:53")]
    );
    assert!(n.mappings().is_empty(), "last flow gone: mapping gone");
    assert_eq!(n.free_port_count(ip(POOL_A), proto::UDP), 65535 - 1024 + 1);
}

#[test]
fn rfc4787_req6_mapping_lives_while_any_flow_does() {
    // Outbound traffic of a new flow refreshes the shared mapping (REQ-6): the mapping
    // outlives the first flow as long as a later one is alive.
    let mut n = nat(1024, 65535);
    let a = ext(&decide_at(
        &mut n,
        &pkt("100 udp 198.18.0.2:5000 > 198.19.0.10:53"),
        0,
        1,
    ));
    decide_at(
        &mut n,
        &pkt("100 udp 198.18.0.2:5000 > 198.19.0.11:53"),
        4 * MIN,
        2,
    );
    assert_eq!(timer(&mut n, 5 * MIN).len(), 1);
    assert_eq!(n.mappings().len(), 1);
    let b = ext(&decide_at(
        &mut n,
        &pkt("100 udp 198.18.0.2:5000 > 198.19.0.12:53"),
        6 * MIN,
        3,
    ));
    assert_eq!(a, b);
    assert_eq!(timer(&mut n, 11 * MIN).len(), 2);
    assert!(n.mappings().is_empty());
}

#[test]
fn rfc5382_req5_a_syn_opened_flow_is_transitory_until_established() {
    // RFC 5382 REQ-5 / RFC 7857 §2.1: before the handshake completes the transitory
    // idle timeout (>= 4 min) applies; a half-open connection must not hold its port
    // for 2 h 4 min.
    let mut n = nat(1024, 65535);
    let flow = "100 tcp 198.18.0.2:40000 > 198.19.0.10:80";
    let d = decide_at(&mut n, &pkt(flow), 0, 1);
    // PP's rule cannot be lengthened once the handshake completes, so it gets the
    // established timeout from the SYN on; the NF's deadline is the transitory one.
    assert_eq!(d.idle_timeout, Some(Duration::from_secs(7440)));
    assert_eq!(n.flow_deadline(&key(flow)), Some(240_000));
    assert!(timer(&mut n, 240_000 - 1).is_empty());
    assert_eq!(timer(&mut n, 240_000), vec![key(flow)]);
    assert!(n.mappings().is_empty(), "the port went back");
}

#[test]
fn rfc5382_tcp_established_timeout_7440s() {
    // RFC 5382 REQ-5: once established, idle for no less than 2 h 4 min.
    let mut n = nat(1024, 65535);
    let flow = "100 tcp 198.18.0.2:40000 > 198.19.0.10:80";
    decide_at(&mut n, &pkt(flow), 0, 1);
    event(&mut n, FlowEvent::TcpEstablished { key: key(flow) }, 1_000);
    assert_eq!(n.flow_deadline(&key(flow)), Some(1_000 + 7_440_000));
    assert!(timer(&mut n, 1_000 + 7_440_000 - 1).is_empty());
    assert_eq!(timer(&mut n, 1_000 + 7_440_000), vec![key(flow)]);
    // A mid-stream packet (state lost elsewhere) is picked up as established.
    let d = decide_at(&mut n, &pkt_flags(flow, ACK), 8_000_000, 2);
    assert_eq!(d.idle_timeout, Some(Duration::from_secs(7440)));
    assert_eq!(n.flow_deadline(&key(flow)), Some(8_000_000 + 7_440_000));
}

#[test]
fn rfc5382_req5_a_re_request_without_syn_shows_the_handshake_done() {
    // RFC 5382 REQ-5: PP lost the rule of a half-open flow and asks again with the
    // handshake's ACK; the NF sees it got through.
    let mut n = nat(1024, 65535);
    let flow = "100 tcp 198.18.0.2:40000 > 198.19.0.10:80";
    let d1 = decide_at(&mut n, &pkt(flow), 0, 1);
    let d2 = decide_at(&mut n, &pkt_flags(flow, ACK), 1_000, 2);
    assert_eq!(ext(&d1), ext(&d2));
    assert_eq!(n.flow_deadline(&key(flow)), Some(1_000 + 7_440_000));
}

#[test]
fn rfc5382_req5_established_reported_by_either_key_and_not_after_close() {
    let mut n = nat(1024, 65535);
    let flow = "100 tcp 198.18.0.2:40000 > 198.19.0.10:80";
    let d = decide_at(&mut n, &pkt(flow), 0, 1);
    // The translated reply's key finds the flow too.
    event(
        &mut n,
        FlowEvent::TcpEstablished {
            key: reply_to(flow, &d),
        },
        2_000,
    );
    assert_eq!(n.flow_deadline(&key(flow)), Some(2_000 + 7_440_000));
    // RFC 7857 §2.2: FIN/RST move it to transitory; a late establishment report must
    // not move it back.
    event(&mut n, FlowEvent::TcpClosing { key: key(flow) }, 3_000);
    event(&mut n, FlowEvent::TcpEstablished { key: key(flow) }, 4_000);
    assert_eq!(n.flow_deadline(&key(flow)), Some(3_000 + 240_000));
}

#[test]
fn rfc4787_req6_rfc5382_req5_activity_refreshes_in_the_current_state() {
    // RFC 4787 REQ-6 (outbound refresh) and RFC 5382 REQ-5: a busy flow is not idle.
    // PP reports `Active` periodically; the deadline restarts with the state's timeout.
    let mut n = nat(1024, 65535);
    let tcp = "100 tcp 198.18.0.2:40000 > 198.19.0.10:80";
    let udp = "100 udp 198.18.0.2:5000 > 198.19.0.10:53";
    decide_at(&mut n, &pkt(tcp), 0, 1);
    decide_at(&mut n, &pkt(udp), 0, 2);
    // Half-open: refreshed by the transitory timeout, not promoted.
    event(&mut n, FlowEvent::Active { key: key(tcp) }, 200_000);
    assert_eq!(n.flow_deadline(&key(tcp)), Some(200_000 + 240_000));
    event(&mut n, FlowEvent::TcpEstablished { key: key(tcp) }, 210_000);
    // A long-lived established flow outlives 2 h 4 min while it keeps reporting.
    let t = 7_000_000;
    event(&mut n, FlowEvent::Active { key: key(tcp) }, t);
    event(&mut n, FlowEvent::Active { key: key(udp) }, 250_000);
    assert_eq!(n.flow_deadline(&key(tcp)), Some(t + 7_440_000));
    assert_eq!(n.flow_deadline(&key(udp)), Some(250_000 + 300_000));
    assert_eq!(timer(&mut n, 7_440_000 + 210_000), vec![key(udp)]);
    assert_eq!(n.mappings().len(), 1, "the TCP mapping stays");
    // An unknown flow's report changes nothing.
    event(
        &mut n,
        FlowEvent::Active {
            key: key("100 tcp 198.18.0.3:1 > 198.19.0.10:80"),
        },
        t,
    );
    assert_eq!(n.flow_count(), 1);
}

#[test]
fn rfc5382_tcp_transitory_timeout_240s() {
    let mut n = nat(1024, 65535);
    let flow = "100 tcp 198.18.0.2:40000 > 198.19.0.10:80";
    let d = decide_at(&mut n, &pkt(flow), 0, 1);
    event(&mut n, FlowEvent::TcpEstablished { key: key(flow) }, 1_000);
    let t_fin = 3_600_000;
    event(&mut n, FlowEvent::TcpClosing { key: key(flow) }, t_fin);
    assert!(timer(&mut n, t_fin + 4 * MIN - 1).is_empty());
    assert_eq!(timer(&mut n, t_fin + 4 * MIN), vec![key(flow)]);
    // The reply direction's FIN finds the flow too.
    let d2 = decide_at(&mut n, &pkt(flow), 0, 1);
    assert_eq!(ext(&d), ext(&d2));
    event(&mut n, FlowEvent::TcpEstablished { key: key(flow) }, 1_000);
    event(
        &mut n,
        FlowEvent::TcpClosing {
            key: reply_to(flow, &d2),
        },
        10 * MIN,
    );
    // A re-request while closing is answered with the transitory timeout.
    let again = decide_at(&mut n, &pkt_flags(flow, ACK), 11 * MIN, 3);
    assert_eq!(again.idle_timeout, Some(Duration::from_secs(240)));
    assert_eq!(timer(&mut n, 15 * MIN - 1).len(), 0);
    assert_eq!(timer(&mut n, 15 * MIN).len(), 1);
}

#[test]
fn rfc5382_syn_on_a_closing_connection_reopens_it() {
    let mut n = nat(1024, 65535);
    let flow = "100 tcp 198.18.0.2:40000 > 198.19.0.10:80";
    let d = decide_at(&mut n, &pkt(flow), 0, 1);
    event(&mut n, FlowEvent::TcpClosing { key: key(flow) }, MIN);
    let again = decide_at(&mut n, &pkt(flow), 2 * MIN, 2);
    assert_eq!(ext(&again), ext(&d), "same mapping");
    // Reopened as a new handshake: PP's rule gets the established timeout, the NF the
    // transitory one until PP reports the handshake done.
    assert_eq!(again.idle_timeout, Some(Duration::from_secs(7440)));
    assert_eq!(n.flow_deadline(&key(flow)), Some(2 * MIN + 240_000));
    event(
        &mut n,
        FlowEvent::TcpEstablished { key: key(flow) },
        3 * MIN,
    );
    assert!(timer(&mut n, 3 * MIN + 7_440_000 - 1).is_empty());
}

#[test]
fn rfc5382_first_packets_that_open_nothing_are_dropped() {
    let mut n = nat(1024, 65535);
    for flags in [RST, FIN | ACK, SYN | ACK, RST | ACK] {
        let d = decide_at(
            &mut n,
            &pkt_flags("100 tcp 198.18.0.2:40000 > 198.19.0.10:80", flags),
            0,
            1,
        );
        assert_eq!(drop_reason(&d), reason::TCP_INVALID, "flags {flags:#x}");
    }
    assert!(n.mappings().is_empty());
    assert_eq!(n.stats().invalid, 4);
}

#[test]
fn rfc5508_icmp_timeout_60s() {
    let mut n = nat(1024, 65535);
    let flow = "100 icmp 198.18.0.2:4242 > 198.19.0.10:0";
    let d = decide_at(&mut n, &pkt(flow), 0, 1);
    // Queries from inside pass (REQ-1), their identifier translated like a port.
    assert_eq!(ext(&d), (ip(POOL_A), 4242));
    assert_eq!(d.idle_timeout, Some(Duration::from_secs(60)));
    // The echo reply arrives keyed with the identifier as destination port.
    let reply = reply_to(flow, &d);
    assert_eq!(
        reply.to_string(),
        "100 icmp 198.19.0.10:0 > 198.19.255.1:4242"
    );
    assert!(timer(&mut n, MIN - 1).is_empty());
    assert_eq!(timer(&mut n, MIN), vec![key(flow)]);
    // An unsolicited echo reply from inside opens nothing.
    let d = decide(&mut n, "100 icmp 198.18.0.2:0 > 198.19.0.10:7");
    assert_eq!(drop_reason(&d), reason::ICMP_NOT_REQUEST);
}

#[test]
fn rfc5508_icmp_errors_never_create_mappings() {
    let mut n = nat(1024, 65535);
    // Errors keyed as the reversed quote; about a flow the NAT never saw.
    let d = decide_at(
        &mut n,
        &icmp_error("100 udp 198.18.0.2:5000 > 198.19.0.10:53"),
        0,
        1,
    );
    assert_eq!(drop_reason(&d), reason::ICMP_ERROR_UNKNOWN_FLOW);
    let d = decide_at(
        &mut n,
        &icmp_error("100 udp 198.19.0.10:53 > 198.19.255.1:5000"),
        0,
        1,
    );
    assert_eq!(drop_reason(&d), reason::ICMP_ERROR_UNKNOWN_FLOW);
    assert!(n.mappings().is_empty());
    assert_eq!(n.stats().icmp_error_unknown, 2);

    // About a known flow (PP lost the rule): the flow's own translation, from outside
    // (REQ-4: router → NAT, quoting NAT → server) and from inside (REQ-5); no new state,
    // and no refresh (REQ-6).
    let flow = "100 udp 198.18.0.2:5000 > 198.19.0.10:53";
    let d = decide_at(&mut n, &pkt(flow), 0, 1);
    let mut from_out = icmp_error("0 udp 0.0.0.0:0 > 0.0.0.0:0");
    from_out.key = reply_to(flow, &d);
    let e = decide_at(&mut n, &from_out, 4 * MIN, 2);
    assert_eq!(e.forward, d.reverse);
    assert_eq!(e.reverse, d.forward);
    let e = decide_at(&mut n, &icmp_error(flow), 4 * MIN, 3);
    assert_eq!(e.forward, d.forward);
    assert_eq!(n.mappings().len(), 1);
    assert_eq!(
        timer(&mut n, 5 * MIN).len(),
        1,
        "errors do not refresh the flow"
    );
}

#[test]
fn rfc4787_sec5_address_and_port_dependent_filtering() {
    let mut n = nat(1024, 65535);
    let d = decide(&mut n, "100 udp 198.19.0.66:4444 > 198.19.255.1:5000");
    assert_eq!(drop_reason(&d), reason::NO_MAPPING);
    // A live mapping only admits the endpoint it talked to (address-and-port-dependent
    // filtering); that one is carried by PP's reverse rule, or answered by replay.
    let flow = "100 udp 198.18.0.2:5000 > 198.19.0.10:53";
    let out = decide(&mut n, flow);
    let d = decide(&mut n, "100 udp 198.19.0.66:4444 > 198.19.255.1:5000");
    assert_eq!(drop_reason(&d), reason::FILTERED);
    let mut reply = pkt_flags("0 udp 0.0.0.0:0 > 0.0.0.0:0", 0);
    reply.key = reply_to(flow, &out);
    let d = decide_at(&mut n, &reply, 0, 1);
    assert_eq!(
        d.forward, out.reverse,
        "reply translated back to the inside host"
    );
    assert_eq!(n.stats().refused_inbound, 2);
    assert_eq!(n.stats().replayed, 1);
}

#[test]
fn rfc4787_req9_hairpinning() {
    let mut n = nat(1024, 65535);
    // B talks out, getting a mapping; A reaches B by that external endpoint.
    let b_flow = "100 udp 198.18.0.3:7000 > 198.19.0.10:3478";
    let b_ext = ext(&decide(&mut n, b_flow));
    let a_flow = format!("100 udp 198.18.0.2:6000 > {}:{}", b_ext.0, b_ext.1);
    let d = decide_at(&mut n, &pkt(&a_flow), 0, 9);
    let a_ext = ext(&d);
    assert_eq!(d.forward.dst.addr, Some(ip("198.18.0.3")));
    assert_eq!(d.forward.dst.port, Some(7000));
    assert_eq!(a_ext, (ip(POOL_A), 6000), "A appears as its own mapping");
    // B's reply comes back through the NAT: from A's mapping back to B's.
    assert_eq!(d.reverse.src.addr, Some(b_ext.0));
    assert_eq!(d.reverse.src.port, Some(b_ext.1));
    assert_eq!(d.reverse.dst.addr, Some(ip("198.18.0.2")));
    assert_eq!(d.reverse.dst.port, Some(6000));
    assert_eq!(n.stats().hairpinned, 1);
    // B's mapping lives while the hairpin flow does, even after B's own flow ends.
    event(&mut n, FlowEvent::Expired { key: key(b_flow) }, 1);
    assert!(n
        .mappings()
        .iter()
        .any(|m| (m.external.addr, m.external.port) == b_ext));
    // A replayed request for B's reply direction is translated consistently.
    let mut b_reply = pkt_flags("0 udp 0.0.0.0:0 > 0.0.0.0:0", 0);
    b_reply.key = reply_to(&a_flow, &d);
    assert_eq!(b_reply.key.src(), ip("198.18.0.3"));
    let r = decide_at(&mut n, &b_reply, 2, 1);
    assert_eq!(r.forward, d.reverse);
    // To a pool address with nothing mapped: refused.
    let d = decide(&mut n, "100 udp 198.18.0.2:6001 > 198.19.255.1:9");
    assert_eq!(drop_reason(&d), reason::NO_MAPPING);
}

#[test]
fn rfc5382_req8_tcp_hairpinning() {
    let mut n = nat(1024, 65535);
    let b = ext(&decide(&mut n, "100 tcp 198.18.0.3:8080 > 198.19.0.10:443"));
    let a_flow = format!("100 tcp 198.18.0.2:40000 > {}:{}", b.0, b.1);
    let d = decide_at(&mut n, &pkt(&a_flow), 0, 3);
    assert_eq!(ext(&d), (ip(POOL_A), 40000));
    assert_eq!(d.forward.dst.addr, Some(ip("198.18.0.3")));
    assert_eq!(d.forward.dst.port, Some(8080));
    assert_eq!(d.idle_timeout, Some(Duration::from_secs(7440)));
    // B's SYN-ACK arrives at SC only if PP lost the reverse rule; it is then a replay.
    let mut synack = pkt_flags("0 tcp 0.0.0.0:0 > 0.0.0.0:0", SYN | ACK);
    synack.key = reply_to(&a_flow, &d);
    assert_eq!(decide_at(&mut n, &synack, 1, 4).forward, d.reverse);
}

#[test]
fn hairpinning_needs_the_inside_named() {
    // Without `sources`, a packet to a pool address can't be told from an outside one,
    // and is refused rather than let an outsider allocate ports.
    let mut n = nat_with(vec![SnatPool::new(vec![ip(POOL_A)], 1024, 65535)]);
    let b = ext(&decide(
        &mut n,
        "100 udp 198.18.0.3:7000 > 198.19.0.10:3478",
    ));
    let d = decide(
        &mut n,
        &format!("100 udp 198.18.0.2:6000 > {}:{}", b.0, b.1),
    );
    assert_eq!(drop_reason(&d), reason::FILTERED);
}

#[test]
fn exhaustion_drops_counts_and_recovers_after_expiry() {
    let mut n = nat(3000, 3003);
    for h in 1..=4 {
        ext(&decide_at(
            &mut n,
            &pkt(&format!("100 udp 198.18.0.{h}:5000 > 198.19.0.10:53")),
            0,
            h,
        ));
    }
    let d = decide_at(
        &mut n,
        &pkt("100 udp 198.18.0.9:5000 > 198.19.0.10:53"),
        1000,
        5,
    );
    assert_eq!(drop_reason(&d), reason::EXHAUSTED);
    assert_eq!(n.stats().exhausted, 1);
    // An existing endpoint-independent mapping needs no port: still served.
    ext(&decide_at(
        &mut n,
        &pkt("100 udp 198.18.0.1:5000 > 198.19.0.11:53"),
        1000,
        6,
    ));
    // Other protocols have their own ports.
    ext(&decide_at(
        &mut n,
        &pkt("100 tcp 198.18.0.9:5000 > 198.19.0.10:80"),
        1000,
        7,
    ));
    // The four UDP flows of 0 s, and the half-open TCP flow (transitory since 1 s).
    assert_eq!(timer(&mut n, 5 * MIN).len(), 5);
    // Host 1 still has a flow (started at 1 s), so three ports came back.
    assert_eq!(n.free_port_count(ip(POOL_A), proto::UDP), 3);
    ext(&decide_at(
        &mut n,
        &pkt("100 udp 198.18.0.9:5000 > 198.19.0.10:53"),
        5 * MIN,
        8,
    ));
    // The PP-side expiry event frees immediately.
    event(
        &mut n,
        FlowEvent::Expired {
            key: key("100 udp 198.18.0.9:5000 > 198.19.0.10:53"),
        },
        5 * MIN,
    );
    assert_eq!(n.free_port_count(ip(POOL_A), proto::UDP), 3);
    assert_eq!(n.stats().flows_ended, 1);
}

#[test]
fn endpoint_dependent_mapping_option() {
    let mut n = nat_with(vec![SnatPool::new(vec![ip(POOL_A)], 1024, 65535)
        .endpoint_dependent()
        .sources(&[INSIDE])]);
    assert_eq!(
        n.tables()
            .iter()
            .find(|t| t.name == "mappings")
            .map(|t| t.scope),
        Some(nf::Scope::PerFlow)
    );
    let a = ext(&decide(&mut n, "100 udp 198.18.0.2:5000 > 198.19.0.10:53"));
    let b = ext(&decide(&mut n, "100 udp 198.18.0.2:5000 > 198.19.0.11:53"));
    let c = ext(&decide(&mut n, "100 udp 198.18.0.2:5000 > 198.19.0.10:54"));
    assert_eq!(a.0, b.0, "still paired to one address");
    assert_ne!(a.1, b.1, "other remote address: other mapping");
    assert_ne!(a.1, c.1, "other remote port: other mapping");
    assert_eq!(n.mappings().len(), 3);
    // The same remote again (re-request) is the same mapping.
    assert_eq!(
        ext(&decide(&mut n, "100 udp 198.18.0.2:5000 > 198.19.0.10:53")),
        a
    );
    assert!(n
        .mappings()
        .iter()
        .all(|m| m.key.remote.is_some() && m.flows == 1));
    assert_eq!(
        nfs::snat::SnatConfig::new(vec![
            SnatPool::new(vec![ip(POOL_A)], 1, 2).endpoint_dependent()
        ])
        .pools[0]
            .mapping,
        MappingBehaviour::EndpointDependent
    );
}

#[test]
fn sources_outside_every_pool_pass_untranslated() {
    let mut n = nat(1024, 65535);
    let d = decide(&mut n, "100 udp 10.9.9.9:5000 > 198.19.0.10:53");
    assert_eq!(d, nf::Decision::pass());
    // No v6 pool: v6 passes too.
    let d = decide(&mut n, "100 udp [2001:2::1]:5000 > [2001:2::2]:53");
    assert_eq!(d, nf::Decision::pass());
    assert_eq!(n.stats().untranslated, 2);
    let d = decide(&mut n, "100 47 198.18.0.2:0 > 198.19.0.10:0");
    assert_eq!(drop_reason(&d), reason::UNSUPPORTED_PROTOCOL);
}

#[test]
fn ipv6_pools_translate_v6() {
    let mut n = nat_with(vec![
        SnatPool::new(vec![ip("2001:2:ff::1")], 1024, 65535).sources(&["2001:2::/48"])
    ]);
    let d = decide(&mut n, "100 udp [2001:2::5]:5000 > [2001:2:1::9]:53");
    assert_eq!(ext(&d), (ip("2001:2:ff::1"), 5000));
    let d = decide(&mut n, "100 icmp6 [2001:2::5]:3333 > [2001:2:1::9]:0");
    assert_eq!(ext(&d), (ip("2001:2:ff::1"), 3333));
    assert_eq!(
        decide(&mut n, "100 udp 198.18.0.2:5000 > 198.19.0.10:53"),
        nf::Decision::pass()
    );
}

#[test]
fn replayed_requests_get_the_same_answer() {
    let mut n = nat(1024, 65535);
    let flow = "100 tcp 198.18.0.2:40000 > 198.19.0.10:80";
    let d1 = decide_at(&mut n, &pkt(flow), 0, 1);
    let d2 = decide_at(&mut n, &pkt_flags(flow, ACK), 1000, 2);
    assert_eq!(d1, d2);
    assert_eq!(n.mappings()[0].flows, 1, "a replay is not a second flow");
    // And it refreshes: the flow now lives until 1 s + 7440 s.
    assert!(timer(&mut n, 7_440_000).is_empty());
    assert_eq!(timer(&mut n, 7_441_000).len(), 1);
}

#[test]
fn chain_rules_carry_replies_back() {
    use nf::{Chain, ChainSpec, Egress};
    let mut c = Chain::new(
        vec![Box::new(nat(1024, 65535))],
        ChainSpec::seq(1),
        Egress::LOCAL,
        Egress::LOCAL,
    )
    .expect("chain");
    let flow = "100 udp 198.18.0.2:5000 > 198.19.0.10:53";
    let r = c
        .decide(&pkt(flow), &mut nf::NfEnv::new(0, 1))
        .expect("decided");
    assert_eq!(
        pipeline::format_actions(&r.forward.actions),
        "set-src 198.19.255.1:5000; out 0"
    );
    let rev = r.reverse.expect("reverse rule");
    assert_eq!(
        rev.key.to_string(),
        "100 udp 198.19.0.10:53 > 198.19.255.1:5000"
    );
    assert_eq!(
        pipeline::format_actions(&rev.actions),
        "set-dst 198.18.0.2:5000; out 0"
    );
    // If PP asks about that reply key, the chain answers with the same rules.
    let mut again = pkt_flags(flow, 0);
    again.key = rev.key;
    let r2 = c
        .decide(&again, &mut nf::NfEnv::new(1, 2))
        .expect("decided");
    assert_eq!(r2.forward.actions, rev.actions);
    assert_eq!(r2.reverse.map(|x| x.key), Some(key(flow)));
}

#[test]
fn config_errors_are_clear() {
    use nfs::snat::{PortRange, Snat, SnatConfig, SnatTimeouts};
    let bad = |cfg: SnatConfig, needle: &str| {
        let e = Snat::new(cfg).expect_err("must be refused").to_string();
        assert!(e.contains(needle), "{e:?} should mention {needle:?}");
    };
    bad(SnatConfig::new(vec![]), "at least one pool");
    bad(
        SnatConfig::new(vec![SnatPool::new(vec![], 1, 2)]),
        "no addresses",
    );
    bad(
        SnatConfig::new(vec![SnatPool::new(vec![ip(POOL_A)], 0, 100)]),
        "port 0",
    );
    bad(
        SnatConfig::new(vec![SnatPool::new(vec![ip(POOL_A)], 200, 100)]),
        "lo > hi",
    );
    bad(
        SnatConfig::new(vec![SnatPool::new(vec![ip(POOL_A), ip("2001:2::1")], 1, 2)]),
        "mixes IPv4 and IPv6",
    );
    bad(
        SnatConfig::new(vec![
            SnatPool::new(vec![ip(POOL_A)], 1, 2),
            SnatPool::new(vec![ip(POOL_A)], 3, 4),
        ]),
        "more than once",
    );
    bad(
        SnatConfig::new(vec![
            SnatPool::new(vec![ip(POOL_A)], 1, 2).sources(&["2001:2::/32"])
        ]),
        "address family",
    );
    bad(
        SnatConfig::new(vec![
            SnatPool::new(vec![ip(POOL_A)], 1, 2).sources(&["198.18.0.1/16"])
        ]),
        "host bits",
    );
    bad(
        SnatConfig::new(vec![
            SnatPool::new(vec![ip(POOL_A)], 1, 2).sources(&["nonsense"])
        ]),
        "not an address",
    );
    bad(
        SnatConfig::new(vec![SnatPool::new(vec![ip("0.0.0.0")], 1, 2)]),
        "cannot be a source",
    );
    bad(
        SnatConfig {
            timeouts: SnatTimeouts {
                udp_s: 0,
                ..SnatTimeouts::default()
            },
            ..SnatConfig::new(vec![SnatPool::new(vec![ip(POOL_A)], 1, 2)])
        },
        "udp_s",
    );
    assert_eq!(
        PortRange::default(),
        PortRange {
            lo: 1024,
            hi: 65535
        }
    );
}

#[test]
fn config_from_json_through_nfs_build() {
    let json = r#"{"kind":"snat","pools":[{"addresses":["198.19.255.1"],
        "ports":{"lo":20000,"hi":29999},"sources":["198.18.0.0/16"]}],
        "timeouts":{"udp_s":120}}"#;
    let cfg: nfs::NfConfig = serde_json::from_str(json).expect("parses");
    let nf = nfs::build(&cfg).expect("builds");
    assert_eq!(nf.kind(), "snat");
    let nfs::NfConfig::Snat(s) = &cfg else {
        panic!("not snat: {cfg:?}");
    };
    assert_eq!(s.timeouts.udp_s, 120);
    assert_eq!(
        s.timeouts.tcp_established_s, 7440,
        "unnamed timeouts keep defaults"
    );
    assert_eq!(s.pools[0].mapping, MappingBehaviour::EndpointIndependent);
    // Typos are errors, not silently ignored.
    let typo = r#"{"kind":"snat","pools":[{"addresses":["198.19.255.1"]}],"timeouts":{"udp":120}}"#;
    assert!(serde_json::from_str::<nfs::NfConfig>(typo).is_err());
    let back: nfs::NfConfig =
        serde_json::from_str(&serde_json::to_string(&cfg).expect("serialises")).expect("parses");
    assert_eq!(back, cfg);
}

#[test]
fn tables_declare_pool_partitioned_and_flows_per_flow() {
    use nf::{Consistency, Scope};
    let n = nat(1024, 65535);
    let t = n.tables();
    for spec in &t {
        spec.validate().expect("valid declaration");
    }
    let get = |name: &str| t.iter().find(|s| s.name == name).expect(name).clone();
    assert_eq!(get("port-pool").consistency, Some(Consistency::Partitioned));
    assert_eq!(
        get("mappings").scope,
        Scope::Shared,
        "EIM mappings are shared by flows"
    );
    assert_eq!(get("flows").scope, Scope::PerFlow);
}
