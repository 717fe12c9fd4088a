//! RFC 4787 REQ-9 hairpinning across the partitions of a SNAT chain partitioned by
//! inside host, through a real FM and SC nodes over gRPC: the sender's flow is decided
//! in its host's partition, the mapping it reaches was made in the other one, and the
//! SNAT's mapping mirror (`nf::TableSpec::mirror`), relayed by FM from one group's op
//! results into the other group's op log, is what lets it find the host behind it
//! (docs/nf-api.md, "Mirrored tables").

use crate::common;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{chain, pp_session, Cluster};
use fm::FmConfig;
use nf::PartitionBy;
use pipeline::{Action, FlowKey, PacketMeta, RuleReply, RuleRequest, RuleSource};

const POOL: &str = "198.19.255.1";

/// An inside host and its mapping.
type Host = (Ipv4Addr, (IpAddr, u16));

fn ask(source: &RuleSource, key: FlowKey) -> RuleReply {
    let RuleSource::Channel { requests, replies } = source else {
        unreachable!()
    };
    requests
        .send(RuleRequest::new(key, 1, 1, PacketMeta::new(60, 0)))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(r) = replies.recv_timeout(Duration::from_millis(100)) {
            if !r.revoke && r.key == key {
                return r;
            }
        }
    }
    panic!("no answer for {key}");
}

fn udp(src: Ipv4Addr, sport: u16, dst: IpAddr, dport: u16) -> FlowKey {
    FlowKey::new(100, packet::proto::UDP, IpAddr::V4(src), sport, dst, dport)
}

fn set_dst(r: &RuleReply) -> Option<(Option<IpAddr>, Option<u16>)> {
    r.result
        .as_ref()
        .ok()?
        .actions
        .iter()
        .find_map(|a| match a {
            Action::SetDst { addr, port } => Some((*addr, *port)),
            _ => None,
        })
}

#[test]
fn a_host_reaches_a_host_the_other_partition_translates_by_its_mapping() {
    let mut def = chain(serde_json::json!([{"kind": "snat", "pools": [
        {"addresses": [POOL], "ports": {"lo": 1024, "hi": 65535},
         "sources": ["198.18.0.0/16"]}]}]));
    def.partition = PartitionBy::SourceAddress;
    let cfg = FmConfig {
        chains: vec![def],
        replicas: 1,
        ..FmConfig::default()
    };
    let cluster = Cluster::start_with(cfg, 2, Arc::new(sc::BuiltinNfs));
    cluster.wait_groups(1, 1);
    common::scale_out(&cluster.rt, &cluster.fm);
    let (_client, link) = pp_session(cluster.pp_config("pp-1"));

    // Forty hosts talk out, after the split: each mapping is made in its host's
    // partition, and only the mirror carries it to the other.
    let mut hosts: BTreeMap<String, Vec<Host>> = BTreeMap::new();
    for h in 1..=40u8 {
        let host = Ipv4Addr::new(198, 18, 20, h);
        let r = ask(
            &link.source,
            udp(host, 7000, "198.19.0.9".parse().unwrap(), 53),
        );
        let ext = r.mapped_source().expect("a mapping");
        hosts
            .entry(r.decided_by.to_string())
            .or_default()
            .push((host, ext));
    }
    assert_eq!(
        hosts.len(),
        2,
        "hosts in both partitions: {:?}",
        hosts.keys()
    );
    let mut sides = hosts.values();
    let (target, t_ext) = sides.next().unwrap()[0];
    let (sender, _) = sides.next().unwrap()[0];

    // The sender's partition learns the target's mapping one FM relay later; until
    // then it refuses (a drop rule FM caches, so each try is a new flow).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut sport = 6000;
    let r = loop {
        let r = ask(&link.source, udp(sender, sport, t_ext.0, t_ext.1));
        if set_dst(&r).is_some() || Instant::now() > deadline {
            break r;
        }
        sport += 1;
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        set_dst(&r),
        Some((Some(IpAddr::V4(target)), Some(7000))),
        "hairpinned to the target host: {r:?}"
    );
    let sender_group = &hosts.iter().find(|(_, v)| v[0].0 == sender).unwrap().0;
    assert_eq!(
        &r.decided_by.to_string(),
        *sender_group,
        "decided in the sender's partition"
    );
    let fm = cluster.stats();
    assert!(fm.mirror_relayed >= 40, "{} relayed", fm.mirror_relayed);
    assert_eq!(fm.mirror_dropped, 0);
}
