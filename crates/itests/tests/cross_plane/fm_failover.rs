//! FM failover (docs/planes.md, "FM failover"): two FMs with the same configuration,
//! SC nodes and a PP client given both addresses. The first FM forms the groups and
//! scales the chain out to two partitions; then it dies. The nodes move to the standby,
//! which must rebuild the same partition map from the SC nodes' reports (group ids,
//! epochs, orders, ranges), keep the NF state (flows asked again get the rules they had),
//! serve new flows, and own the map afterwards (it repairs a replica that dies).

use crate::common;

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{ask, fm_pair, mapping, pp_config, pp_session, snat_chain, wait, wait_groups, FmPair};
use pipeline::{FlowKey, RuleSource};

/// [`fm_pair`] over one SNAT chain, with `n_sc` SC nodes.
fn start(n_sc: usize) -> FmPair {
    fm_pair(
        vec![snat_chain(&["198.19.255.1"])],
        n_sc,
        Arc::new(sc::testing::TestNfs),
    )
}

/// Ask for `flows` and wait for every answer: key → mapping (errors are missing).
fn mappings(source: &RuleSource, flows: std::ops::Range<u32>) -> HashMap<FlowKey, (IpAddr, u16)> {
    ask(source, flows)
        .iter()
        .filter_map(|r| Some((r.key, mapping(r)?)))
        .collect()
}

/// (group, lo, hi) of every partition, and each group's order, sorted.
type Shape = (Vec<(u64, u64, u64)>, Vec<(u64, Vec<String>)>);

fn shape(m: &proto::v1::PartitionMap) -> Shape {
    let mut parts: Vec<(u64, u64, u64)> = m
        .partitions
        .iter()
        .map(|p| (p.group, p.hash_lo, p.hash_hi))
        .collect();
    parts.sort_unstable();
    let mut groups: Vec<(u64, Vec<String>)> = m
        .groups
        .iter()
        .map(|g| (g.id, g.replicas.iter().map(|r| r.node_id.clone()).collect()))
        .collect();
    groups.sort();
    (parts, groups)
}

#[test]
fn standby_fm_adopts_a_scaled_out_partition_map_and_keeps_nf_state() {
    let mut fms = start(7);
    let (a, b) = fms.addrs();
    let both = format!("{a},{b}");
    wait_groups(&fms.rt, &fms.active, 1, 3);
    common::scale_out(&fms.rt, &fms.active);

    let (client, link) = pp_session(pp_config(Some(&fms.pki), &both, "pp-1"));
    assert_eq!(client.current_fm().as_deref(), Some(a.as_str()));
    let before = mappings(&link.source, 0..1000);
    assert_eq!(before.len(), 1000);
    let map_a = fms.rt.block_on(fms.active.partition_map()).unwrap();
    let shape_a = shape(&map_a);
    assert_eq!(shape_a.0.len(), 2, "two partitions after the scale-out");
    // The standby has seen no node at all.
    assert!(fms
        .rt
        .block_on(fms.standby.partition_map())
        .unwrap()
        .groups
        .is_empty());

    let killed = Instant::now();
    fms.active.stop();
    let map_b = wait(
        Duration::from_secs(10),
        "the standby to adopt the groups",
        || {
            let m = fms.rt.block_on(fms.standby.partition_map())?;
            let members = fms.rt.block_on(fms.standby.members())?;
            let sc = members
                .members
                .iter()
                .filter(|m| {
                    m.alive
                        && m.node
                            .as_ref()
                            .is_some_and(|n| n.role == proto::v1::Role::Sc as i32)
                })
                .count();
            (shape(&m) == shape_a
                && sc == fms.scs.len()
                && client.current_fm().as_deref() == Some(&b))
            .then_some(m)
        },
    );
    println!(
        "standby FM has both groups and every node after {} ms",
        killed.elapsed().as_millis()
    );
    // Same ids, same epochs: the replicas took nothing for a new configuration.
    let epochs = |m: &proto::v1::PartitionMap| {
        let mut v: Vec<(u64, u64)> = m.groups.iter().map(|g| (g.id, g.epoch)).collect();
        v.sort_unstable();
        v
    };
    assert_eq!(epochs(&map_b), epochs(&map_a));
    let stats = fms.rt.block_on(fms.standby.stats()).unwrap();
    assert_eq!(stats.groups_adopted, 2);

    // NF state survived: the standby's cache is empty, so these reach SC, and SNAT
    // answers known flows with their mappings.
    let again = mappings(&link.source, 0..1000);
    assert_eq!(again, before, "flows got other mappings after the failover");
    // New flows are served, with ports no old flow holds.
    let new = mappings(&link.source, 1000..2000);
    assert_eq!(new.len(), 1000);
    let mut ports: HashSet<(IpAddr, u16)> = before.values().copied().collect();
    for m in new.values() {
        assert!(ports.insert(*m), "port {m:?} handed out twice");
    }

    // The standby owns the map now: a replica that dies is repaired.
    let victim = map_b.groups[0].replicas[1].node_id.clone();
    let i: usize = victim.strip_prefix("sc-").unwrap().parse().unwrap();
    fms.scs[i].kill();
    let gid = map_b.groups[0].id;
    wait(Duration::from_secs(10), "the standby to repair", || {
        let m = fms.rt.block_on(fms.standby.partition_map())?;
        let g = m.groups.iter().find(|g| g.id == gid)?;
        (g.replicas.len() == 3 && !g.replicas.iter().any(|r| r.node_id == victim)).then_some(())
    });
    let last = mappings(&link.source, 0..2000);
    assert_eq!(last.len(), 2000);
    for (k, m) in before.iter().chain(new.iter()) {
        assert_eq!(last.get(k), Some(m));
    }
    drop(client);
    fms.standby.stop();
}

/// The FM dies together with an SC replica, after a repair gave the group a later
/// epoch. The standby adopts the group at that epoch from the two survivors, and at the
/// end of its recovery window treats the replica that never registered as dead: a spare
/// takes its place and no flow changes its mapping.
#[test]
fn standby_fm_replaces_a_replica_that_died_with_the_fm() {
    let mut fms = start(5);
    let (a, b) = fms.addrs();
    let both = format!("{a},{b}");
    let idx = |id: &str| -> usize { id.strip_prefix("sc-").unwrap().parse().unwrap() };
    let first = wait_groups(&fms.rt, &fms.active, 1, 3);
    // A repair first, so the group's epoch is past the one a fresh FM would give it.
    let head = first.groups[0].replicas[0].node_id.clone();
    fms.scs[idx(&head)].kill();
    let repaired = wait(Duration::from_secs(10), "the active FM to repair", || {
        let m = fms.rt.block_on(fms.active.partition_map())?;
        let g = &m.groups[0];
        (g.replicas.len() == 3 && !g.replicas.iter().any(|r| r.node_id == head)).then_some(m)
    });
    let epoch = repaired.groups[0].epoch;
    assert!(epoch > 1);

    let (client, link) = pp_session(pp_config(Some(&fms.pki), &both, "pp-1"));
    let before = mappings(&link.source, 0..500);
    assert_eq!(before.len(), 500);

    // The FM goes, and a replica with it, before the nodes reach the standby.
    let victim = repaired.groups[0].replicas[1].node_id.clone();
    fms.active.stop();
    fms.scs[idx(&victim)].kill();
    let gid = repaired.groups[0].id;
    let after = wait(
        Duration::from_secs(10),
        "the standby to adopt and repair",
        || {
            let m = fms.rt.block_on(fms.standby.partition_map())?;
            let g = m.groups.iter().find(|g| g.id == gid)?;
            (g.replicas.len() == 3
                && !g
                    .replicas
                    .iter()
                    .any(|r| r.node_id == victim || r.node_id == head))
            .then_some(m)
        },
    );
    assert_eq!(after.groups.len(), 1, "no new group was formed");
    assert!(after.groups[0].epoch > epoch, "the repair is a new epoch");
    assert_eq!(
        fms.rt.block_on(fms.standby.stats()).unwrap().groups_adopted,
        1
    );
    wait(Duration::from_secs(5), "PP on the standby", || {
        (client.current_fm().as_deref() == Some(b.as_str())).then_some(())
    });
    let again = mappings(&link.source, 0..500);
    assert_eq!(again, before, "flows got other mappings after the failover");
    drop(client);
    fms.standby.stop();
}
