//! Flow notices: what PP tells SC after a flow's first packet. TCP establishment and
//! close are noticed on the hit path, once per flow and reported on the flow's forward
//! rule (the key PP asked about): establishment seen there, close seen there or on its
//! linked reply rule; activity (either direction) by a periodic walk. The queue is bounded, and what
//! does not fit is counted.

use packet::build::{tcp_v4, vxlan_wrap};
use packet::tcp_flags::{ACK, FIN, PSH, RST, SYN};
use pipeline::{
    parse_actions, FlowKey, FlowNotice, NoticeConfig, NoticeKind, PipelineConfig, Rule, RuleReply,
};
use testkit::rig::{node, Rig};

/// A tenant TCP segment 198.18.10.2:`sport` → 198.19.0.9:80 on VNI 100 (or its reply).
fn tcp(sport: u16, flags: u8, reply: bool) -> Vec<u8> {
    let (a, b) = ([198, 18, 10, 2], [198, 19, 0, 9]);
    let inner = if reply {
        tcp_v4(b, 80, a, sport, flags, 1, b"")
    } else {
        tcp_v4(a, sport, b, 80, flags, 1, b"")
    };
    vxlan_wrap([198, 18, 0, 50], [198, 18, 0, 1], 50000, 100, &inner)
}

fn key(sport: u16) -> FlowKey {
    format!("100 tcp 198.18.10.2:{sport} > 198.19.0.9:80")
        .parse()
        .unwrap()
}

fn rig(notices: NoticeConfig) -> Rig {
    let mut cfg = PipelineConfig::new(node());
    cfg.flow_capacity = 1024;
    cfg.notices = notices;
    Rig::tenant(cfg, 64)
}

fn no_walk() -> NoticeConfig {
    NoticeConfig {
        active_period_ms: 0,
        ..NoticeConfig::default()
    }
}

/// Open flow `sport` by a SYN through the miss path: its forward rule is the reply to
/// PP's request, the reverse one a companion.
fn open(r: &mut Rig, sport: u16) {
    r.send([tcp(sport, SYN, false)]);
    let req = r.requests.try_recv().expect("a request");
    assert_eq!(req.key, key(sport));
    let fwd = Rule::new(key(sport), parse_actions("count; out 0").unwrap());
    let rev = Rule::new(
        key(sport).reversed(),
        parse_actions("count; out 0").unwrap(),
    );
    let mut reply = RuleReply::ok(fwd);
    reply.also.push(rev);
    r.replies.send(reply).unwrap();
    r.worker.run_once().unwrap();
}

fn kinds(n: &[FlowNotice]) -> Vec<(NoticeKind, FlowKey)> {
    n.iter().map(|n| (n.kind, n.key)).collect()
}

#[test]
fn the_handshake_is_noticed_once_on_the_forward_key() {
    let mut r = rig(no_walk());
    open(&mut r, 1000);
    // SYN (released from pending), SYN-ACK on the reverse rule: nothing yet.
    r.send([tcp(1000, SYN | ACK, true)]);
    assert!(r.worker.pipeline.take_notices().is_empty());
    // The opener's ACK completes the handshake; data and later ACKs say nothing new.
    r.send([
        tcp(1000, ACK, false),
        tcp(1000, PSH | ACK, false),
        tcp(1000, ACK, true),
        tcp(1000, ACK, false),
    ]);
    let n = r.worker.pipeline.take_notices();
    assert_eq!(kinds(&n), [(NoticeKind::TcpEstablished, key(1000))]);
    assert_eq!((n[0].tenant, n[0].chain), (7, 3));
    // A retransmitted SYN is not an establishment.
    open(&mut r, 1001);
    r.send([tcp(1001, SYN, false)]);
    assert!(r.worker.pipeline.take_notices().is_empty());
    assert_eq!(r.worker.pipeline.stats().notices, 1);
}

#[test]
fn fin_or_rst_on_the_forward_rule_is_noticed_once() {
    let mut r = rig(no_walk());
    open(&mut r, 1000);
    open(&mut r, 1001);
    r.send([
        tcp(1000, FIN | ACK, false),
        tcp(1000, FIN | ACK, false),
        tcp(1001, RST, false),
    ]);
    assert_eq!(
        kinds(&r.worker.pipeline.take_notices()),
        [
            (NoticeKind::TcpClosing, key(1000)),
            (NoticeKind::TcpClosing, key(1001))
        ]
    );
}

#[test]
fn fin_or_rst_on_the_reply_rule_is_noticed_on_the_forward_key() {
    let mut r = rig(no_walk());
    // A server's RST alone (the client never sends FIN/RST): reported on the key SC
    // decided the flow on, once, whichever direction closes first or again.
    open(&mut r, 1002);
    r.send([tcp(1002, RST | ACK, true), tcp(1002, RST, true)]);
    r.send([tcp(1002, FIN | ACK, false)]);
    assert_eq!(
        kinds(&r.worker.pipeline.take_notices()),
        [(NoticeKind::TcpClosing, key(1002))]
    );
    // Closed from the client first: the server's FIN that follows is not news.
    open(&mut r, 1003);
    r.send([tcp(1003, FIN | ACK, false), tcp(1003, FIN | ACK, true)]);
    assert_eq!(
        kinds(&r.worker.pipeline.take_notices()),
        [(NoticeKind::TcpClosing, key(1003))]
    );
    // Data and ACKs on the reply rule say nothing.
    open(&mut r, 1004);
    r.send([tcp(1004, ACK, true), tcp(1004, PSH | ACK, true)]);
    assert!(r.worker.pipeline.take_notices().is_empty());
}

#[test]
fn a_reply_rule_whose_forward_rule_left_reports_nothing() {
    let mut r = rig(no_walk());
    open(&mut r, 1005);
    assert!(r.worker.pipeline.remove_rule(&key(1005)).is_some());
    r.send([tcp(1005, RST, true)]);
    assert!(r.worker.pipeline.take_notices().is_empty());
    // A new flow that takes the freed entry is not linked to the old reply rule.
    open(&mut r, 1006);
    r.send([tcp(1005, RST, true)]);
    assert!(r.worker.pipeline.take_notices().is_empty());
    r.send([tcp(1006, RST, true)]);
    assert_eq!(
        kinds(&r.worker.pipeline.take_notices()),
        [(NoticeKind::TcpClosing, key(1006))]
    );
}

#[test]
fn rules_not_asked_for_report_nothing() {
    // A rule installed directly (a rules file, a companion) has no SC state behind it.
    let mut r = rig(NoticeConfig {
        active_period_ms: 1_000,
        ..NoticeConfig::default()
    });
    r.worker
        .pipeline
        .install_rule(
            &Rule::new(key(1000), parse_actions("count; out 0").unwrap()),
            0,
        )
        .unwrap();
    r.send([tcp(1000, ACK, false), tcp(1000, FIN, false)]);
    r.clock.advance(5_000);
    r.send([tcp(1000, ACK, false)]);
    r.worker.run_once().unwrap();
    assert!(r.worker.pipeline.take_notices().is_empty());
}

/// Serve through one whole activity walk (started by the first service): 8 s in
/// 250 ms steps, with the notices it reported.
fn walk(r: &mut Rig) -> Vec<FlowNotice> {
    walk_with_traffic(r, None)
}

/// [`walk`], with a packet of flow `sport` at every step.
fn walk_with_traffic(r: &mut Rig, sport: Option<u16>) -> Vec<FlowNotice> {
    let mut n = Vec::new();
    for _ in 0..32 {
        if let Some(s) = sport {
            r.send([tcp(s, PSH | ACK, false)]);
        }
        r.worker.run_once().unwrap();
        n.extend(r.worker.pipeline.take_notices());
        r.clock.advance(250);
    }
    n
}

#[test]
fn activity_is_reported_per_walk_for_flows_seen_since_the_last() {
    let mut r = rig(NoticeConfig {
        active_period_ms: 10_000,
        active_budget: 64,
        queue: 4096,
    });
    // The first walk runs at the first service, before any flow.
    open(&mut r, 1000);
    open(&mut r, 1001);
    assert!(r.worker.pipeline.take_notices().is_empty());
    // The next, a period later, reports both: seen (installed) since the first. A walk
    // is paced over 3/4 of the period (`pipeline::report_budget`).
    r.clock.advance(10_000);
    let n = walk(&mut r);
    let active: Vec<_> = kinds(&n)
        .into_iter()
        .filter(|(k, _)| *k == NoticeKind::Active)
        .collect();
    assert_eq!(
        active,
        [
            (NoticeKind::Active, key(1000)),
            (NoticeKind::Active, key(1001))
        ]
    );
    // Within the period no walk starts, whatever the traffic.
    r.clock.advance(1_000);
    r.send([tcp(1000, ACK, false)]);
    r.worker.pipeline.take_notices();
    r.send([tcp(1000, PSH | ACK, false)]);
    assert!(r.worker.pipeline.take_notices().is_empty());
    // After it, only the flow with traffic since the previous walk is reported.
    r.clock.advance(6_000);
    assert_eq!(kinds(&walk(&mut r)), [(NoticeKind::Active, key(1000))]);
    // Another period of silence: nothing.
    r.clock.advance(11_000);
    assert!(walk(&mut r).is_empty());
    // Traffic only toward the client (the reply rule) keeps the flow active too.
    r.clock.advance(1_000);
    r.send([tcp(1001, PSH | ACK, true)]);
    r.clock.advance(10_000);
    assert_eq!(kinds(&walk(&mut r)), [(NoticeKind::Active, key(1001))]);
    // A flow with traffic all through the walks is active, though every hit is newer
    // than the walk's start by the time the paced walk reaches its slot.
    r.clock.advance(10_000);
    let mut n = walk_with_traffic(&mut r, Some(1000));
    r.clock.advance(2_000);
    n.extend(walk_with_traffic(&mut r, Some(1000)));
    let active = kinds(&n)
        .into_iter()
        .filter(|k| *k == (NoticeKind::Active, key(1000)))
        .count();
    assert_eq!(active, 2, "once per walk: {n:?}");
}

#[test]
fn a_full_queue_drops_and_counts() {
    let mut r = rig(NoticeConfig {
        active_period_ms: 0,
        active_budget: 64,
        queue: 2,
    });
    for s in 0..4 {
        open(&mut r, 2000 + s);
    }
    r.send((0..4).map(|s| tcp(2000 + s, ACK, false)));
    assert_eq!(r.worker.pipeline.take_notices().len(), 2);
    let s = r.worker.pipeline.stats();
    assert_eq!((s.notices, s.notices_dropped), (2, 2));
    // A dropped establishment is not retried on every packet.
    r.send((0..4).map(|s| tcp(2000 + s, ACK, false)));
    assert!(r.worker.pipeline.take_notices().is_empty());
}
