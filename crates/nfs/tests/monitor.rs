//! Monitor: per-tenant and per-host counters as replicated state (Serpens "eventual"):
//! parts count on their own, a split starts the new part at zero, a merge sums.

use std::net::IpAddr;

use nf::{Consistency, Decision, FirstPacket, NetworkFunction, NfEnv, SplitHalf};
use nfs::monitor::{Counters, Monitor, MonitorConfig};
use pipeline::PacketMeta;

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}

fn pkt(tenant: u32, flow: &str, len: u16) -> FirstPacket {
    FirstPacket {
        key: flow.parse().expect("flow key"),
        flow: flow.parse().expect("flow key"),
        tenant,
        meta: PacketMeta {
            len,
            tcp_flags: 2,
            icmp_error: false,
            ingress_port: 0,
        },
    }
}

fn mon() -> Monitor {
    Monitor::new(MonitorConfig::default()).expect("config")
}

fn c(packets: u64, bytes: u64) -> Counters {
    Counters { packets, bytes }
}

const HALF: SplitHalf = SplitHalf {
    moved_lo: 0,
    moved_hi: u64::MAX / 2,
};

#[test]
fn first_packets_count_per_tenant_and_source_host_and_pass_unchanged() {
    let mut m = mon();
    let mut env = NfEnv::new(0, 1);
    for (t, f, len) in [
        (1, "100 tcp 198.18.0.2:40000 > 198.19.0.10:80", 60),
        (1, "100 udp 198.18.0.2:5000 > 198.19.0.10:53", 80),
        (1, "100 udp 198.18.0.3:5000 > 198.19.0.10:53", 100),
        (2, "200 udp 198.18.0.2:5000 > 198.19.0.10:53", 1500),
    ] {
        let d = m.first_packet(&pkt(t, f, len), &mut env).expect("decides");
        assert_eq!(d, Decision::pass());
    }
    assert_eq!(m.tenant(1), c(3, 240));
    assert_eq!(m.tenant(2), c(1, 1500));
    assert_eq!(m.host(1, ip("198.18.0.2")), c(2, 140));
    assert_eq!(m.host(1, ip("198.18.0.3")), c(1, 100));
    assert_eq!(
        m.host(2, ip("198.18.0.2")),
        c(1, 1500),
        "tenants are kept apart"
    );
    assert_eq!(m.tenant(9), Counters::default());
    // Later counts reported by PP's rule counters.
    m.record(1, ip("198.18.0.3"), 10, 15_000);
    assert_eq!(m.host(1, ip("198.18.0.3")), c(11, 15_100));
    assert_eq!(m.tenant(1), c(13, 15_240));
    assert_eq!(m.tenants().len(), 2);
    assert_eq!(m.hosts(1).len(), 2);
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
