//! Firewall connection tracking: replies of allowed flows, unsolicited inbound, TCP
//! state and timeouts on a controlled clock, non-SYN first packets, ICMP errors,
//! snapshot/restore and split/merge.

use std::time::Duration;

use nf::{Decision, FirstPacket, FlowEvent, NetworkFunction, NfEnv, NfError, SplitHalf, Verdict};
use nfs::fw::{AclAction, CtState, Firewall, FwConfig};
use packet::tcp_flags::{ACK, FIN, PSH, RST, SYN};
use pipeline::{FlowKey, PacketMeta};

mod fw_util;

/// Tenant 1 may open anything outbound from its VPC (198.18.0.0/16, 2001:2::/48).
fn outbound_only() -> FwConfig {
    fw_util::outbound_only("2001:2::/48")
}

fn key(s: &str) -> FlowKey {
    s.parse().unwrap()
}

fn out_flow(i: u16) -> FlowKey {
    key(&format!("1 tcp 198.18.0.5:{} > 198.19.7.7:443", 20_000 + i))
}

fn first(f: &mut Firewall, k: FlowKey, flags: u8, now_ms: u64) -> Decision {
    let p = FirstPacket::new(k, 1, PacketMeta::new(60, flags));
    f.first_packet(&p, &mut NfEnv::new(now_ms, 0)).unwrap()
}

fn pass(secs: u64) -> Decision {
    Decision {
        idle_timeout: Some(Duration::from_secs(secs)),
        ..Decision::pass()
    }
}

fn drop(reason: &str, secs: u64) -> Decision {
    Decision {
        idle_timeout: Some(Duration::from_secs(secs)),
        ..Decision::drop(reason)
    }
}

fn timer(f: &mut Firewall, now_ms: u64) -> Vec<FlowKey> {
    f.on_timer(&mut NfEnv::new(now_ms, 0))
}

fn event(f: &mut Firewall, ev: FlowEvent, now_ms: u64) {
    f.on_event(&ev, &mut NfEnv::new(now_ms, 0));
}

#[test]
fn reply_of_an_allowed_flow_passes_unsolicited_inbound_does_not() {
    let mut f = Firewall::new(outbound_only()).unwrap();
    let k = out_flow(1);
    // PP's rule gets the established timeout (it cannot be lengthened once the
    // handshake completes); conntrack's own deadline is syn-sent's 120 s.
    assert_eq!(first(&mut f, k, SYN, 0), pass(7440));
    assert_eq!(f.conn_deadline(&k), Some(120_000));
    assert_eq!(f.conn_state(&k), Some(CtState::TcpSynSent));
    // The reply direction reaches SC (its PP rule was evicted): allowed, although the
    // ACL denies everything inbound, and the handshake is evidently done.
    assert_eq!(first(&mut f, k.reversed(), SYN | ACK, 1_000), pass(7440));
    assert_eq!(f.conn_state(&k), Some(CtState::TcpEstablished));
    assert_eq!(f.acl_action(1, &k.reversed()), AclAction::Deny);
    // Unsolicited inbound SYN from the same peer on another port pair.
    let inbound = key("1 tcp 198.19.7.7:443 > 198.18.0.5:22");
    assert_eq!(first(&mut f, inbound, SYN, 1_000), drop("acl-deny", 60));
    assert_eq!(f.conn_count(), 1);
}

#[test]
fn non_syn_first_packet_is_refused_even_when_the_acl_allows() {
    let mut f = Firewall::new(outbound_only()).unwrap();
    for (i, flags) in [
        ACK,
        SYN | ACK,
        FIN | ACK,
        RST,
        SYN | FIN,
        SYN | RST,
        PSH | ACK,
        0,
    ]
    .into_iter()
    .enumerate()
    {
        let k = out_flow(100 + i as u16);
        assert_eq!(
            first(&mut f, k, flags, 0),
            drop("tcp-not-syn", 10),
            "flags {flags:#x}"
        );
    }
    assert_eq!(f.conn_count(), 0);
    // SYN with ECN bits (ECE/CWR) is still a pure SYN.
    assert_eq!(first(&mut f, out_flow(200), SYN | 0xc0, 0), pass(7440));
}

#[test]
fn syn_sent_expires_after_its_timeout() {
    let mut f = Firewall::new(outbound_only()).unwrap();
    first(&mut f, out_flow(1), SYN, 5_000);
    // SYN retransmitted at SC (PP lost the rule): still syn-sent, deadline refreshed.
    assert_eq!(first(&mut f, out_flow(1), SYN, 10_000), pass(7440));
    assert_eq!(timer(&mut f, 129_999), vec![]);
    assert_eq!(timer(&mut f, 130_000), vec![out_flow(1)]);
    assert_eq!(f.conn_state(&out_flow(1)), None);
    // Gone: the reply is now unsolicited, and a non-SYN forward packet is refused.
    assert_eq!(
        first(&mut f, out_flow(1).reversed(), ACK, 130_001),
        drop("tcp-not-syn", 10)
    );
    assert_eq!(
        first(&mut f, out_flow(1), ACK, 130_001),
        drop("tcp-not-syn", 10)
    );
}

#[test]
fn established_then_fin_then_time_wait() {
    let mut f = Firewall::new(outbound_only()).unwrap();
    let k = out_flow(2);
    first(&mut f, k, SYN, 0);
    // A later first packet without SYN: the connection got established.
    assert_eq!(first(&mut f, k, ACK | PSH, 60_000), pass(7440));
    assert_eq!(f.conn_state(&k), Some(CtState::TcpEstablished));
    assert_eq!(timer(&mut f, 60_000 + 7_439_999), vec![]);
    // PP saw FIN: closing (time-wait) timeout from now.
    event(&mut f, FlowEvent::TcpClosing { key: k }, 1_000_000);
    assert_eq!(f.conn_state(&k), Some(CtState::TcpClosing));
    assert_eq!(timer(&mut f, 1_119_999), vec![]);
    assert_eq!(timer(&mut f, 1_120_000), vec![k]);
}

#[test]
fn rst_or_fin_on_a_re_request_closes() {
    let mut f = Firewall::new(outbound_only()).unwrap();
    let (a, b) = (out_flow(3), out_flow(4));
    first(&mut f, a, SYN, 0);
    first(&mut f, b, SYN, 0);
    assert_eq!(first(&mut f, a.reversed(), RST | ACK, 1_000), pass(120));
    assert_eq!(first(&mut f, b, FIN | ACK, 1_000), pass(120));
    assert_eq!(f.conn_state(&a), Some(CtState::TcpClosing));
    assert_eq!(f.conn_state(&b), Some(CtState::TcpClosing));
    // A late ACK does not resurrect a closing flow.
    assert_eq!(first(&mut f, b, ACK, 2_000), pass(120));
    assert_eq!(f.conn_state(&b), Some(CtState::TcpClosing));
    // The TcpClosing event is found from either direction.
    event(&mut f, FlowEvent::TcpClosing { key: a.reversed() }, 50_000);
    // b was last refreshed at 2 s (the late ACK), a closed at 50 s: 120 s later each.
    assert_eq!(timer(&mut f, 121_999), vec![]);
    assert_eq!(timer(&mut f, 122_000), vec![b]);
    assert_eq!(timer(&mut f, 170_000), vec![a]);
}

#[test]
fn new_syn_on_a_closing_flow_is_judged_anew() {
    let mut f = Firewall::new(outbound_only()).unwrap();
    let k = out_flow(5);
    first(&mut f, k, SYN, 0);
    event(&mut f, FlowEvent::TcpClosing { key: k }, 1_000);
    // Port reuse while still in time-wait: a new connection, subject to today's ACL.
    let mut deny_all = outbound_only();
    deny_all.tenants[0].rules.clear();
    f.update(deny_all).unwrap();
    assert_eq!(first(&mut f, k, SYN, 2_000), drop("acl-deny", 60));
    assert_eq!(f.conn_state(&k), None);
}

#[test]
fn tracked_connections_survive_an_acl_change() {
    let mut f = Firewall::new(outbound_only()).unwrap();
    let k = out_flow(6);
    first(&mut f, k, SYN, 0);
    let mut deny_all = outbound_only();
    deny_all.tenants[0].rules.clear();
    f.update(deny_all).unwrap();
    assert_eq!(first(&mut f, k, ACK, 1_000), pass(7440));
    assert_eq!(first(&mut f, k.reversed(), ACK, 1_000), pass(7440));
    assert_eq!(first(&mut f, out_flow(7), SYN, 1_000), drop("acl-deny", 60));
}

#[test]
fn udp_icmp_and_other_timeouts() {
    let mut f = Firewall::new(outbound_only()).unwrap();
    let udp = key("1 udp 198.18.0.5:5000 > 198.19.0.53:53");
    let icmp = key("1 icmp 198.18.0.5:77 > 198.19.0.1:0");
    let icmp6 = key("1 icmp6 [2001:2::5]:77 > [2001:2:1::1]:0");
    let gre = key("1 47 198.18.0.5:0 > 198.19.0.1:0");
    assert_eq!(first(&mut f, udp, 0, 0), pass(180));
    assert_eq!(first(&mut f, icmp, 0, 0), pass(30));
    assert_eq!(first(&mut f, icmp6, 0, 0), pass(30));
    assert_eq!(first(&mut f, gre, 0, 0), pass(600));
    // The echo reply is the reversed key: allowed by conntrack.
    assert_eq!(first(&mut f, icmp.reversed(), 0, 1_000), pass(30));
    // Expiry of PP's rules does not end the flow early; the deadline does.
    event(&mut f, FlowEvent::Expired { key: udp }, 2_000);
    // FIN/RST mean nothing to a UDP flow.
    event(&mut f, FlowEvent::TcpClosing { key: udp }, 2_000);
    assert_eq!(f.conn_state(&udp), Some(CtState::Udp));
    let mut gone = timer(&mut f, 31_000);
    gone.sort_by_key(|k| *k.as_bytes());
    let mut want = vec![icmp, icmp6];
    want.sort_by_key(|k| *k.as_bytes());
    assert_eq!(gone, want);
    assert_eq!(timer(&mut f, 180_000), vec![udp]);
    assert_eq!(timer(&mut f, 600_000), vec![gre]);
}

#[test]
fn configured_timeouts_apply() {
    let mut cfg = outbound_only();
    cfg.timeouts.tcp_syn_sent_s = 5;
    cfg.timeouts.tcp_established_s = 100;
    cfg.timeouts.udp_s = 30;
    let mut f = Firewall::new(cfg).unwrap();
    assert_eq!(first(&mut f, out_flow(1), SYN, 0), pass(100));
    assert_eq!(f.conn_deadline(&out_flow(1)), Some(5_000));
    assert_eq!(first(&mut f, out_flow(1), ACK, 1_000), pass(100));
    assert_eq!(
        first(&mut f, key("1 udp 198.18.0.5:5000 > 198.19.0.53:53"), 0, 0),
        pass(30)
    );
}

#[test]
fn icmp_errors_pass_for_known_flows_only() {
    let mut f = Firewall::new(outbound_only()).unwrap();
    let k = out_flow(8);
    first(&mut f, k, SYN, 0);
    let err = |key: FlowKey| FirstPacket {
        key,
        flow: key,
        tenant: 1,
        meta: PacketMeta {
            len: 90,
            tcp_flags: 0,
            icmp_error: true,
            ingress_port: 0,
        },
    };
    // A port-unreachable from the server quotes our SYN; PP keys it on the reversed
    // quote, i.e. the reply direction of the flow.
    let d = f
        .first_packet(&err(k.reversed()), &mut NfEnv::new(1, 0))
        .unwrap();
    assert_eq!(d, pass(7440));
    assert_eq!(f.conn_state(&k), Some(CtState::TcpSynSent));
    let d = f
        .first_packet(&err(out_flow(9).reversed()), &mut NfEnv::new(1, 0))
        .unwrap();
    assert_eq!(d, drop("icmp-unrelated", 10));
}

#[test]
fn snapshot_restore_round_trip() {
    let mut f = Firewall::new(outbound_only()).unwrap();
    for i in 0..50 {
        first(&mut f, out_flow(i), SYN, i as u64);
    }
    first(&mut f, out_flow(3), ACK, 100);
    let snap = f.snapshot().unwrap();
    let mut g = Firewall::new(FwConfig::default()).unwrap();
    g.restore(&snap).unwrap();
    assert_eq!(g.config(), f.config());
    assert_eq!(g.snapshot().unwrap(), snap);
    assert_eq!(g.conn_state(&out_flow(3)), Some(CtState::TcpEstablished));
    assert_eq!(first(&mut g, out_flow(7).reversed(), ACK, 200), pass(7440));
    for bad in [&b""[..], b"[]", br#"{"version":9,"config":{},"conns":[]}"#] {
        assert!(matches!(g.restore(bad), Err(NfError::Snapshot(_))));
        assert!(matches!(g.merge(bad), Err(NfError::Snapshot(_))));
    }
    for cut in 0..snap.len() {
        assert!(f.restore(&snap[..cut]).is_err());
    }
    assert_eq!(f.snapshot().unwrap(), snap);
}

#[test]
fn split_and_merge_keep_conntrack() {
    let mut f = Firewall::new(outbound_only()).unwrap();
    for i in 0..400 {
        first(&mut f, out_flow(i), SYN, 0);
    }
    let half = SplitHalf {
        moved_lo: 0,
        moved_hi: 1 << 63,
    };
    let part = f.split(&half).unwrap();
    let moved: Vec<u16> = (0..400).filter(|&i| half.moves(&out_flow(i))).collect();
    assert!(moved.len() > 150 && moved.len() < 250, "{}", moved.len());
    let mut g = Firewall::new(outbound_only()).unwrap();
    g.merge(&part).unwrap();
    assert_eq!(f.conn_count() + g.conn_count(), 400);
    for i in 0..400 {
        let (owner, other) = if half.moves(&out_flow(i)) {
            (&mut g, &mut f)
        } else {
            (&mut f, &mut g)
        };
        assert_eq!(other.conn_state(&out_flow(i)), None);
        // The reply is allowed where the flow's state now lives.
        assert_eq!(
            first(owner, out_flow(i).reversed(), SYN | ACK, 10),
            pass(7440)
        );
    }
    // Scale-in.
    let all = g
        .split(&SplitHalf {
            moved_lo: 0,
            moved_hi: u64::MAX,
        })
        .unwrap();
    f.merge(&all).unwrap();
    assert_eq!(f.conn_count(), 400);
    assert_eq!(g.conn_count(), 0);
}

#[test]
fn replicas_agree_byte_for_byte() {
    let mut a = Firewall::new(outbound_only()).unwrap();
    let mut b = Firewall::new(outbound_only()).unwrap();
    for i in 0..100 {
        let (fa, fb) = (
            first(&mut a, out_flow(i), SYN, i as u64),
            first(&mut b, out_flow(i), SYN, i as u64),
        );
        assert_eq!(fa, fb);
    }
    assert_eq!(a.snapshot().unwrap(), b.snapshot().unwrap());
    assert_eq!(timer(&mut a, 120_050), timer(&mut b, 120_050));
    assert!(matches!(
        first(&mut a, out_flow(0), SYN, 0).verdict,
        Verdict::Pass { .. }
    ));
}

#[test]
fn tables_are_declared_honestly() {
    let f = Firewall::new(FwConfig::default()).unwrap();
    assert_eq!(
        f.tables(),
        vec![
            nf::TableSpec::shared_read("acl"),
            nf::TableSpec::per_flow("conntrack")
        ]
    );
}

#[test]
fn handshake_reported_by_pp_moves_syn_sent_to_established() {
    // Linux nf_conntrack: SYN_SENT (120 s) until the handshake completes (RFC 9293
    // §3.5), then ESTABLISHED (here 7440 s, RFC 5382 REQ-5's minimum for NATs).
    let mut f = Firewall::new(outbound_only()).unwrap();
    let k = out_flow(1);
    first(&mut f, k, SYN, 0);
    event(&mut f, FlowEvent::TcpEstablished { key: k }, 1_000);
    assert_eq!(f.conn_state(&k), Some(CtState::TcpEstablished));
    assert_eq!(f.conn_deadline(&k), Some(1_000 + 7_440_000));
    assert_eq!(timer(&mut f, 1_000 + 7_440_000 - 1), vec![]);
    // FIN/RST: the closing timeout; a late establishment report does not revive it.
    event(&mut f, FlowEvent::TcpClosing { key: k.reversed() }, 2_000);
    event(&mut f, FlowEvent::TcpEstablished { key: k }, 3_000);
    assert_eq!(f.conn_state(&k), Some(CtState::TcpClosing));
    assert_eq!(f.conn_deadline(&k), Some(2_000 + 120_000));
}

#[test]
fn activity_reported_by_pp_refreshes_the_current_state() {
    let mut f = Firewall::new(outbound_only()).unwrap();
    let k = out_flow(1);
    first(&mut f, k, SYN, 0);
    // Half-open and busy (retransmitted SYNs): refreshed, still syn-sent.
    event(&mut f, FlowEvent::Active { key: k }, 100_000);
    assert_eq!(f.conn_state(&k), Some(CtState::TcpSynSent));
    assert_eq!(f.conn_deadline(&k), Some(100_000 + 120_000));
    event(&mut f, FlowEvent::TcpEstablished { key: k }, 110_000);
    // A long-lived flow outlives the established timeout while PP reports it.
    event(&mut f, FlowEvent::Active { key: k.reversed() }, 7_000_000);
    assert_eq!(timer(&mut f, 7_440_000 + 110_000), vec![]);
    assert_eq!(f.conn_deadline(&k), Some(7_000_000 + 7_440_000));
    // An unknown flow's report creates nothing.
    event(&mut f, FlowEvent::Active { key: out_flow(2) }, 7_000_000);
    assert_eq!(f.conn_count(), 1);
}
