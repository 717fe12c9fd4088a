//! The SNAT in a chain partitioned by inside host (`PartitionBy::SourceAddress`): a
//! split never separates a host's flows, so its endpoint-independent mapping and its
//! address pairing stay whole in one partition (docs/nf-api.md "Partition key per NF").

mod snat_util;

use nf::{NetworkFunction, PartitionBy, SplitHalf};
use nfs::snat::{Snat, SnatConfig, SnatPool};
use snat_util::*;

const HALF: SplitHalf = SplitHalf {
    moved_lo: 0,
    moved_hi: u64::MAX / 2,
};

fn nat() -> Snat {
    Snat::new(SnatConfig::new(vec![SnatPool::new(
        vec![ip(POOL_A), ip(POOL_B)],
        20_000,
        20_999,
    )
    .sources(&[INSIDE])]))
    .expect("config")
}

/// 40 hosts, each with one source port to 6 remotes (one mapping, six flows).
fn flows() -> Vec<String> {
    (0..40u32)
        .flat_map(|h| {
            (0..6u32)
                .map(move |r| format!("100 udp 198.18.0.{}:5000 > 198.19.0.{}:53", h + 1, r + 1))
        })
        .collect()
}

fn split(by: PartitionBy) -> (Snat, Snat) {
    let mut a = nat();
    assert_eq!(
        a.partition_by(),
        PartitionBy::SourceAddress,
        "what the SNAT asks for"
    );
    a.set_partition(by)
        .expect("platform tables split by anything");
    for (i, f) in flows().iter().enumerate() {
        decide_at(&mut a, &pkt(f), 1000, i as u64);
    }
    let mut b = nat();
    b.set_partition(by).expect("partition");
    b.restore(&a.split(&HALF).expect("split")).expect("restore");
    (a, b)
}

#[test]
fn split_by_source_keeps_every_host_whole_on_one_side() {
    let (a, b) = split(PartitionBy::SourceAddress);
    assert!(a.flow_count() > 0 && b.flow_count() > 0);
    assert_eq!(a.flow_count() + b.flow_count(), 240);
    for side in [&a, &b] {
        assert_eq!(side.flow_count() % 6, 0, "a host's six flows together");
        assert!(
            side.mappings().iter().all(|m| m.sole_owner && m.flows == 6),
            "no mapping is shared across the split: {:?}",
            side.mappings().iter().find(|m| !m.sole_owner)
        );
    }
    // Each flow is where the chain's partition hash sends it.
    for f in flows() {
        let moved = HALF.moves_by(&key(&f), PartitionBy::SourceAddress);
        let owner = if moved { &b } else { &a };
        assert!(owner.flow_deadline(&key(&f)).is_some(), "{f}");
    }
}

#[test]
fn split_by_flow_shares_mappings_between_the_sides() {
    // The control: by the flow hash, a host's flows land on both sides, and their
    // mapping is copied with its share halved.
    let (a, _) = split(PartitionBy::Flow);
    assert!(a.mappings().iter().any(|m| !m.sole_owner));
}

#[test]
fn the_partition_hash_is_the_hosts() {
    let by = PartitionBy::SourceAddress;
    let h = |s: &str| by.hash(&key(s));
    let one = h("100 udp 198.18.0.9:5000 > 198.19.0.1:53");
    assert_eq!(one, h("100 tcp 198.18.0.9:40000 > 198.19.0.7:443"));
    assert_ne!(one, h("100 udp 198.18.0.10:5000 > 198.19.0.1:53"));
    assert_ne!(
        one,
        h("200 udp 198.18.0.9:5000 > 198.19.0.1:53"),
        "VPCs apart"
    );
    let f = "100 udp 198.18.0.9:5000 > 198.19.0.1:53";
    assert_eq!(PartitionBy::Flow.hash(&key(f)), key(f).hash());
}

/// A host whose flows the split sent to `b`'s side, and one that stayed on `a`'s: the
/// first of the inside hosts not among the 40 already talking.
fn hosts_on_each_side() -> (String, String) {
    let side = |moved: bool| {
        (100..200u32)
            .map(|h| format!("198.18.0.{h}"))
            .find(|h| {
                let f = format!("100 udp {h}:7000 > 198.19.0.10:3478");
                HALF.moves_by(&key(&f), PartitionBy::SourceAddress) == moved
            })
            .expect("a host on each side")
    };
    (side(false), side(true))
}

/// RFC 4787 REQ-9 across partitions: the sender's flow is decided where its host is,
/// and the mapping it reaches was made in the other partition after the split. The
/// mapping mirror (`TableSpec::mirror`) carries it there, and carries its end too.
#[test]
fn hairpinning_reaches_a_mapping_another_partition_made_once_its_mirror_arrives() {
    let (mut a, mut b) = split(PartitionBy::SourceAddress);
    for side in [&mut a, &mut b] {
        // What SC does while the chain has more than one partition.
        side.state_mut()
            .expect("platform tables")
            .set_mirror_sending(true);
    }
    let (sender, target) = hosts_on_each_side();
    // The mappings the split moved are in the other side's mirror at once: a host on
    // a's side reaches one of the hosts that went to b.
    let moved = b.mappings()[0].external;
    let f = format!("100 udp {sender}:5999 > {}:{}", moved.addr, moved.port);
    let d = decide_at(&mut a, &pkt(&f), 1999, 3);
    assert_eq!(d.forward.dst.addr, Some(b.mappings()[0].key.addr), "{d:?}");
    // (The sender's new mapping is a's write, on its way to b.)
    let sent = a.state_mut().expect("tables").take_mirror();
    assert_eq!(sent.len(), 1, "{sent:?}");
    // The target talks out in its own partition: a new mapping there, written to the
    // mirror.
    let t_flow = format!("100 udp {target}:7000 > 198.19.0.10:3478");
    let t_ext = ext(&decide_at(&mut b, &pkt(&t_flow), 2000, 1));
    let writes = b.state_mut().expect("tables").take_mirror();
    assert!(
        writes
            .iter()
            .any(|w| !w.deleted && w.table == "mapping-mirror"),
        "the new mapping is written to the mirror: {writes:?}"
    );
    let hairpin = |n: &mut Snat, port: u16| {
        let f = format!("100 udp {sender}:{port} > {}:{}", t_ext.0, t_ext.1);
        decide_at(n, &pkt(&f), 2001, 2)
    };
    // Before the mirror reaches the sender's partition: no mapping there.
    let d = hairpin(&mut a, 6000);
    assert_eq!(drop_reason(&d), nfs::snat::reason::NO_MAPPING);
    let (applied, skipped) = a.state_mut().expect("tables").import_mirror(&writes);
    assert_eq!((applied, skipped), (writes.len(), 0));
    assert!(
        a.state_mut().expect("tables").take_mirror().is_empty(),
        "an import is not sent on"
    );
    let d = hairpin(&mut a, 6001);
    assert_eq!(d.forward.dst.addr, Some(ip(&target)));
    assert_eq!(d.forward.dst.port, Some(7000));
    assert_eq!(
        (d.reverse.src.addr, d.reverse.src.port),
        (Some(t_ext.0), Some(t_ext.1))
    );
    assert_eq!(a.stats().hairpinned, 2, "the moved host's and this one");
    // The target's flow ends: its mapping is freed where it lives, and the delete
    // reaches the mirror.
    event(&mut b, nf::FlowEvent::Expired { key: key(&t_flow) }, 2002);
    let writes = b.state_mut().expect("tables").take_mirror();
    assert!(writes.iter().any(|w| w.deleted), "{writes:?}");
    a.state_mut().expect("tables").import_mirror(&writes);
    let d = hairpin(&mut a, 6002);
    assert_eq!(drop_reason(&d), nfs::snat::reason::NO_MAPPING);
}
