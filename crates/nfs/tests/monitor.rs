//! Monitor: per-tenant and per-host counters as replicated state (Serpens "eventual"):
//! parts count on their own, a split starts the new part at zero, a merge sums.

use std::net::IpAddr;

use nf::{Consistency, Decision, FirstPacket, FlowEvent, NetworkFunction, NfEnv, SplitHalf};
use nfs::monitor::{Counters, Monitor, MonitorConfig};
use pipeline::PacketMeta;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

fn pkt(tenant: u32, flow: &str, len: u16) -> FirstPacket {
    FirstPacket::new(
        flow.parse().expect("flow key"),
        tenant,
        PacketMeta::new(len, 2),
    )
}

fn mon() -> Monitor {
    Monitor::new(MonitorConfig::default()).expect("config")
}

fn c(packets: u64, bytes: u64) -> Counters {
    Counters {
        packets,
        bytes,
        flows: 0,
    }
}

fn cf(packets: u64, bytes: u64, flows: u64) -> Counters {
    Counters {
        packets,
        bytes,
        flows,
    }
}

/// PP's counters of `flow`'s rule since its last report.
fn delta(tenant: u32, flow: &str, packets: u64, bytes: u64) -> FlowEvent {
    FlowEvent::Counters {
        key: flow.parse().expect("flow key"),
        tenant,
        packets,
        bytes,
    }
}

const HALF: SplitHalf = SplitHalf {
    moved_lo: 0,
    moved_hi: u64::MAX / 2,
};

#[test]
fn first_packets_count_flows_and_pp_deltas_count_packets_and_bytes() {
    let mut m = mon();
    let mut env = NfEnv::new(0, 1);
    let flows = [
        (1, "100 tcp 198.18.0.2:40000 > 198.19.0.10:80", 60),
        (1, "100 udp 198.18.0.2:5000 > 198.19.0.10:53", 80),
        (1, "100 udp 198.18.0.3:5000 > 198.19.0.10:53", 100),
        (2, "200 udp 198.18.0.2:5000 > 198.19.0.10:53", 1500),
    ];
    for (t, f, len) in flows {
        let d = m.first_packet(&pkt(t, f, len), &mut env).expect("decides");
        assert_eq!(d, Decision::pass());
    }
    // The first packet is a flow; its packet arrives with PP's counters.
    assert_eq!(m.tenant(1), cf(0, 0, 3));
    assert_eq!(m.host(1, ip("198.18.0.2")), cf(0, 0, 2));
    // PP reports each rule's counters as deltas, in batches, possibly several per flow.
    for (t, f, len) in flows {
        m.on_event(&delta(t, f, 1, u64::from(len)), &mut env);
    }
    m.on_event(&delta(1, flows[0].1, 9, 9 * 1400), &mut env);
    m.on_event(&delta(1, flows[0].1, 5, 5 * 1400), &mut env);
    // Replies are counted on the reverse rule, under the server's address.
    m.on_event(
        &delta(1, "100 tcp 198.19.0.10:80 > 198.18.0.2:40000", 7, 7 * 60),
        &mut env,
    );
    assert_eq!(m.tenant(1), cf(3 + 14 + 7, 240 + 14 * 1400 + 420, 3));
    assert_eq!(m.tenant(2), cf(1, 1500, 1));
    assert_eq!(m.host(1, ip("198.18.0.2")), cf(16, 140 + 14 * 1400, 2));
    assert_eq!(m.host(1, ip("198.18.0.3")), cf(1, 100, 1));
    assert_eq!(m.host(1, ip("198.19.0.10")), cf(7, 420, 0));
    assert_eq!(
        m.host(2, ip("198.18.0.2")),
        cf(1, 1500, 1),
        "tenants are kept apart"
    );
    assert_eq!(m.tenant(9), Counters::default());
    // Other events and empty deltas change nothing.
    let before = m.snapshot().expect("snapshot");
    m.on_event(&delta(1, flows[0].1, 0, 0), &mut env);
    m.on_event(
        &FlowEvent::Expired {
            key: flows[0].1.parse().expect("key"),
        },
        &mut env,
    );
    assert_eq!(m.snapshot().expect("snapshot"), before);
    assert_eq!(m.tenants().len(), 2);
    assert_eq!(m.hosts(1).len(), 3);
    let r = m.traffic().expect("the monitor reports traffic");
    assert_eq!(r.tenants.len(), 2);
    assert_eq!(r.tenants[0].1.packets, 24);
    assert_eq!(r.hosts.len(), 4);
}

#[test]
fn replicas_applying_the_same_deltas_agree_whatever_the_batching() {
    // Two replicas get the same events (one op log); a third gets them in another order
    // and batching, as parts of a split partition would. All three sum the same.
    let events: Vec<FlowEvent> = (0..40u64)
        .map(|i| {
            delta(
                1 + (i % 3) as u32,
                &format!("100 udp 198.18.0.{}:{} > 198.19.0.1:53", i % 7, 1000 + i),
                i + 1,
                (i + 1) * 100,
            )
        })
        .collect();
    let mut a = mon();
    let mut b = mon();
    let mut r = mon();
    let mut env = NfEnv::new(5, 9);
    for e in &events {
        a.on_event(e, &mut env);
        b.on_event(e, &mut env);
    }
    for e in events.iter().rev() {
        r.on_event(e, &mut env);
    }
    assert_eq!(a.snapshot().expect("a"), b.snapshot().expect("b"));
    assert_eq!(a.snapshot().expect("a"), r.snapshot().expect("r"));
    let total: u64 = (1..=40).sum();
    let seen: u64 = a.tenants().iter().map(|(_, c)| c.packets).sum();
    assert_eq!(seen, total);
}

#[test]
fn deltas_on_split_parts_merge_back_to_the_sum() {
    let mut a = mon();
    let mut env = NfEnv::new(0, 1);
    let f = "100 udp 198.18.0.2:5000 > 198.19.0.10:53";
    a.on_event(&delta(1, f, 10, 1000), &mut env);
    let part = a.split(&HALF).expect("split");
    let mut b = mon();
    b.restore(&part).expect("restore");
    // After the split, deltas of the flow go to whichever part owns its key now.
    a.on_event(&delta(1, f, 3, 300), &mut env);
    b.on_event(&delta(1, f, 4, 400), &mut env);
    let sum = a.tenant(1).packets + b.tenant(1).packets;
    assert_eq!(sum, 17, "the parts' sum is every packet reported");
    a.merge(&b.snapshot().expect("b")).expect("merge");
    assert_eq!(a.tenant(1), c(17, 1700));
    assert_eq!(a.host(1, ip("198.18.0.2")), c(17, 1700));
}

#[test]
fn tables_are_replicated() {
    for t in mon().tables() {
        t.validate().expect("valid");
        assert_eq!(t.consistency, Some(Consistency::Replicated));
    }
}

#[test]
fn split_starts_the_new_part_at_zero_and_merge_sums() {
    let mut a = mon();
    a.record(1, ip("198.18.0.2"), 5, 500);
    a.record(1, ip("198.18.0.3"), 1, 100);
    let part = a.split(&HALF).expect("split");
    let mut b = mon();
    b.restore(&part).expect("restore");
    assert_eq!(b.tenant(1), Counters::default());
    assert_eq!(a.tenant(1), c(6, 600), "the old part keeps what it counted");
    // Each part counts on its own...
    a.record(1, ip("198.18.0.2"), 1, 10);
    b.record(1, ip("198.18.0.2"), 2, 20);
    b.record(1, ip("198.18.0.9"), 3, 30);
    b.record(7, ip("198.18.0.9"), 4, 40);
    // ...and the merge is the sum.
    a.merge(&b.snapshot().expect("snapshot")).expect("merge");
    assert_eq!(a.tenant(1), c(12, 660));
    assert_eq!(a.tenant(7), c(4, 40));
    assert_eq!(a.host(1, ip("198.18.0.2")), c(8, 530));
    assert_eq!(a.host(1, ip("198.18.0.9")), c(3, 30));
    assert_eq!(a.host(1, ip("198.18.0.3")), c(1, 100));
}

#[test]
fn merge_is_order_independent_and_snapshots_round_trip() {
    let parts: Vec<Monitor> = (0..3u64)
        .map(|i| {
            let mut m = mon();
            for h in 0..5u64 {
                m.record(
                    1 + (h % 2) as u32,
                    ip(&format!("198.18.0.{h}")),
                    i + h,
                    100 * (i + h),
                );
            }
            m
        })
        .collect();
    let snaps: Vec<Vec<u8>> = parts.iter().map(|m| m.snapshot().expect("s")).collect();
    let mut x = mon();
    let mut y = mon();
    for s in &snaps {
        x.merge(s).expect("merge");
    }
    for s in snaps.iter().rev() {
        y.merge(s).expect("merge");
    }
    assert_eq!(x.snapshot().expect("x"), y.snapshot().expect("y"));
    let mut z = mon();
    z.restore(&x.snapshot().expect("x")).expect("restore");
    assert_eq!(z.snapshot().expect("z"), x.snapshot().expect("x"));
    assert!(z.restore(b"{").is_err());
    assert!(z.merge(b"[]").is_err());
    assert_eq!(
        z.snapshot().expect("z"),
        x.snapshot().expect("x"),
        "failed restore changes nothing"
    );
}

#[test]
fn hosts_beyond_the_cap_fold_into_overflow() {
    let mut m = Monitor::new(MonitorConfig { max_hosts: 2 }).expect("config");
    for h in 1..=4 {
        m.record(1, ip(&format!("198.18.0.{h}")), 1, 10);
    }
    assert_eq!(m.hosts(1).len(), 2);
    assert_eq!(m.overflow(), c(2, 20));
    assert_eq!(
        m.tenant(1),
        c(4, 40),
        "the tenant total still has everything"
    );
    m.record(1, ip("198.18.0.1"), 1, 10);
    assert_eq!(
        m.host(1, ip("198.18.0.1")),
        c(2, 20),
        "known hosts keep counting"
    );
    // Saturating, never overflowing.
    m.record(1, ip("198.18.0.1"), u64::MAX, u64::MAX);
    assert_eq!(m.host(1, ip("198.18.0.1")).packets, u64::MAX);
    assert!(Monitor::new(MonitorConfig { max_hosts: 0 }).is_err());
    let cfg: nfs::NfConfig = serde_json::from_str(r#"{"kind":"monitor"}"#).expect("defaults");
    assert_eq!(nfs::build(&cfg).expect("builds").kind(), "monitor");
}
