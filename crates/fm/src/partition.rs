//! The partition map: (tenant, chain, key-hash range) → SC group, and the groups'
//! replica orders.

use std::collections::{BTreeMap, HashMap};

use nf::PartitionBy;
use pipeline::FlowKey;
use proto::v1;

#[derive(Debug, Clone)]
pub struct GroupEntry {
    pub group: v1::ScGroup,
    pub partition: v1::Partition,
    /// Members the current epoch added (they start from a snapshot).
    pub joining: Vec<String>,
    /// Non-zero: created by this scale-out and not installed yet (see
    /// `GroupConfig.awaiting_scale`).
    pub awaiting_scale: u64,
}

impl GroupEntry {
    pub fn head(&self) -> Option<&v1::Replica> {
        self.group.replicas.first()
    }
}

/// A range of key hashes, inclusive, and the group owning it: (lo, hi, group).
type Range = (u64, u64, u64);

#[derive(Debug, Default)]
pub struct PartitionMap {
    pub version: u64,
    /// Per (tenant, chain): ranges sorted by `hash_lo`, disjoint.
    ranges: HashMap<(u32, u32), Vec<Range>>,
    groups: BTreeMap<u64, GroupEntry>,
    next_group: u64,
    /// Per (tenant, chain): what its requests are dispatched by (`ChainConfig.partition`;
    /// the flow hash if absent).
    partitioning: HashMap<(u32, u32), PartitionBy>,
}

impl PartitionMap {
    pub fn with_partitioning(chains: &[v1::ChainConfig]) -> Self {
        let mut m = PartitionMap::default();
        m.set_partitioning(chains);
        m
    }

    /// The chains' partitionings, from their configurations (a name FM does not know
    /// was refused with the chain; here it falls back to the flow hash).
    pub fn set_partitioning(&mut self, chains: &[v1::ChainConfig]) {
        self.partitioning = (chains.iter())
            .map(|c| {
                let by = proto::partition_from_proto(&c.partition).unwrap_or_default();
                ((c.tenant, c.chain), by)
            })
            .collect();
    }

    /// The hash `key` is dispatched by in chain (tenant, chain).
    pub fn key_hash(&self, tenant: u32, chain: u32, key: &FlowKey) -> u64 {
        (self.partitioning.get(&(tenant, chain)).copied())
            .unwrap_or_default()
            .hash(key)
    }

    /// The group owning `key` of (tenant, chain), by the chain's partitioning.
    pub fn lookup_key(&self, tenant: u32, chain: u32, key: &FlowKey) -> Option<u64> {
        self.lookup(tenant, chain, self.key_hash(tenant, chain, key))
    }

    /// The group owning `hash` of (tenant, chain).
    pub fn lookup(&self, tenant: u32, chain: u32, hash: u64) -> Option<u64> {
        let v = self.ranges.get(&(tenant, chain))?;
        let i = v.partition_point(|(lo, _, _)| *lo <= hash);
        let (lo, hi, g) = *v.get(i.checked_sub(1)?)?;
        (lo <= hash && hash <= hi).then_some(g)
    }

    pub fn has_chain(&self, tenant: u32, chain: u32) -> bool {
        self.ranges
            .get(&(tenant, chain))
            .is_some_and(|v| !v.is_empty())
    }

    /// Create a group owning [lo, hi] of (tenant, chain) with `replicas` in chain order.
    pub fn create(
        &mut self,
        tenant: u32,
        chain: u32,
        lo: u64,
        hi: u64,
        replicas: Vec<v1::Replica>,
    ) -> u64 {
        self.next_group += 1;
        let id = self.next_group;
        let partition = v1::Partition {
            tenant,
            chain,
            hash_lo: lo,
            hash_hi: hi,
            group: id,
        };
        self.groups.insert(
            id,
            GroupEntry {
                group: v1::ScGroup {
                    id,
                    epoch: 1,
                    replicas,
                },
                partition,
                joining: Vec::new(),
                awaiting_scale: 0,
            },
        );
        let v = self.ranges.entry((tenant, chain)).or_default();
        v.push((lo, hi, id));
        v.sort_unstable();
        self.version += 1;
        id
    }

    /// Create a group that owns no range yet (a scale-out's new group before FM switches
    /// dispatch to it). `lo..=hi` is the range it is meant to get.
    pub fn create_detached(
        &mut self,
        tenant: u32,
        chain: u32,
        lo: u64,
        hi: u64,
        replicas: Vec<v1::Replica>,
    ) -> u64 {
        let id = self.create(tenant, chain, lo, hi, replicas);
        self.set_range(id, None);
        id
    }

    /// Take over group `group` as an SC node reported it (FM recovery): its id, epoch and
    /// order, owning `lo..=hi` of `partition`'s chain. Refused if FM already has a group
    /// of that id or the range overlaps one of the chain's (two owners of a key would
    /// hand out its state twice).
    pub fn adopt(
        &mut self,
        group: v1::ScGroup,
        partition: v1::Partition,
        (lo, hi): (u64, u64),
        joining: Vec<String>,
    ) -> Result<(), String> {
        let id = group.id;
        if id == 0 || lo > hi {
            return Err(format!("group {id}: bad id or range [{lo}, {hi}]"));
        }
        if self.groups.contains_key(&id) {
            return Err(format!("group {id} exists"));
        }
        let key = (partition.tenant, partition.chain);
        if let Some((olo, ohi, og)) = self
            .ranges
            .get(&key)
            .and_then(|v| v.iter().find(|(olo, ohi, _)| lo <= *ohi && *olo <= hi))
        {
            return Err(format!(
                "group {id}'s range [{lo}, {hi}] overlaps group {og}'s [{olo}, {ohi}]"
            ));
        }
        self.reserve_id(id);
        self.groups.insert(
            id,
            GroupEntry {
                group,
                partition: v1::Partition {
                    hash_lo: lo,
                    hash_hi: hi,
                    group: id,
                    ..partition
                },
                joining,
                awaiting_scale: 0,
            },
        );
        let v = self.ranges.entry(key).or_default();
        v.push((lo, hi, id));
        v.sort_unstable();
        self.version += 1;
        Ok(())
    }

    /// Never hand out group ids up to `id` again: an SC node may still host a replica
    /// of that group, and would take a new group of the same id for a stale epoch.
    pub fn reserve_id(&mut self, id: u64) {
        self.next_group = self.next_group.max(id);
    }

    /// A newer order of an adopted group than the one FM has (another replica had
    /// applied a later epoch): take it as is, epoch included.
    pub fn replace_group(&mut self, group: v1::ScGroup, joining: Vec<String>) {
        if let Some(g) = self.groups.get_mut(&group.id) {
            g.group = group;
            g.joining = joining;
            self.version += 1;
        }
    }

    /// Give group `id` the range `lo..=hi` of its chain, or none. The caller keeps the
    /// chain's ranges disjoint.
    pub fn set_range(&mut self, id: u64, range: Option<(u64, u64)>) {
        let Some(g) = self.groups.get_mut(&id) else {
            return;
        };
        let v = self
            .ranges
            .entry((g.partition.tenant, g.partition.chain))
            .or_default();
        v.retain(|(_, _, gid)| *gid != id);
        if let Some((lo, hi)) = range {
            g.partition.hash_lo = lo;
            g.partition.hash_hi = hi;
            v.push((lo, hi, id));
            v.sort_unstable();
        }
        self.version += 1;
    }

    /// The range group `id` owns in dispatch, if any.
    pub fn range_of(&self, id: u64) -> Option<(u64, u64)> {
        let g = self.groups.get(&id)?;
        self.ranges
            .get(&(g.partition.tenant, g.partition.chain))?
            .iter()
            .find(|(_, _, gid)| *gid == id)
            .map(|(lo, hi, _)| (*lo, *hi))
    }

    /// The parts of (tenant, chain)'s key space no group owns, as inclusive ranges in
    /// order. Empty for a chain with no group at all (it has no key space yet).
    pub fn chain_gaps(&self, tenant: u32, chain: u32) -> Vec<(u64, u64)> {
        let Some(v) = self.ranges.get(&(tenant, chain)).filter(|v| !v.is_empty()) else {
            return Vec::new();
        };
        let mut gaps = Vec::new();
        let mut next = Some(0u64);
        for &(lo, hi, _) in v {
            if let Some(n) = next.filter(|&n| n < lo) {
                gaps.push((n, lo - 1));
            }
            next = hi.checked_add(1);
        }
        if let Some(n) = next {
            gaps.push((n, u64::MAX));
        }
        gaps
    }

    /// The groups owning ranges of (tenant, chain), ascending by range.
    pub fn chain_ranges(&self, tenant: u32, chain: u32) -> Vec<(u64, u64, u64)> {
        self.ranges
            .get(&(tenant, chain))
            .cloned()
            .unwrap_or_default()
    }

    pub fn group_mut(&mut self, id: u64) -> Option<&mut GroupEntry> {
        self.groups.get_mut(&id)
    }

    /// Drop a group whose state is lost; its range has no owner until recreated.
    pub fn remove(&mut self, id: u64) -> Option<GroupEntry> {
        let g = self.groups.remove(&id)?;
        if let Some(v) = self
            .ranges
            .get_mut(&(g.partition.tenant, g.partition.chain))
        {
            v.retain(|(_, _, gid)| *gid != id);
        }
        self.version += 1;
        Some(g)
    }

    pub fn group(&self, id: u64) -> Option<&GroupEntry> {
        self.groups.get(&id)
    }

    /// Change a group's replica order; bumps its epoch.
    pub fn set_replicas(&mut self, id: u64, replicas: Vec<v1::Replica>) -> Option<&GroupEntry> {
        let g = self.groups.get_mut(&id)?;
        g.joining = replicas
            .iter()
            .filter(|r| !g.group.replicas.iter().any(|o| o.node_id == r.node_id))
            .map(|r| r.node_id.clone())
            .collect();
        g.group.replicas = replicas;
        g.group.epoch += 1;
        self.version += 1;
        Some(g)
    }

    pub fn groups(&self) -> impl Iterator<Item = &GroupEntry> {
        self.groups.values()
    }

    /// Groups `node` is a replica of.
    pub fn groups_of(&self, node: &str) -> Vec<u64> {
        self.groups
            .values()
            .filter(|g| g.group.replicas.iter().any(|r| r.node_id == node))
            .map(|g| g.group.id)
            .collect()
    }

    pub fn to_proto(&self) -> v1::PartitionMap {
        v1::PartitionMap {
            version: self.version,
            // Only ranges in dispatch: a scale-out's new group is listed among the groups
            // but owns no partition until FM switches to it.
            partitions: self
                .groups
                .values()
                .filter(|g| self.range_of(g.group.id).is_some())
                .map(|g| g.partition)
                .collect(),
            groups: self.groups.values().map(|g| g.group.clone()).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chain_partitioned_by_source_sends_a_hosts_flows_to_one_group() {
        let chain = |chain: u32, partition: &str| v1::ChainConfig {
            tenant: 1,
            chain,
            nfs: vec!["{}".into()],
            partition: partition.into(),
            ..Default::default()
        };
        let mut m = PartitionMap::with_partitioning(&[chain(1, "source_address"), chain(2, "")]);
        for c in [1, 2] {
            m.create(1, c, 0, u64::MAX / 2, vec![]);
            m.create(1, c, u64::MAX / 2 + 1, u64::MAX, vec![]);
        }
        let key = |s: String| -> FlowKey { s.parse().expect("key") };
        let host = |h: u32, c: u32| -> std::collections::BTreeSet<u64> {
            (0..64)
                .map(|i| {
                    key(format!(
                        "100 udp 198.18.0.{h}:{} > 198.19.0.{}:53",
                        1000 + i,
                        i % 200 + 1
                    ))
                })
                .filter_map(|k| m.lookup_key(1, c, &k))
                .collect()
        };
        for h in 1..20 {
            assert_eq!(host(h, 1).len(), 1, "host {h}: one group");
        }
        assert_eq!(host(1, 2).len(), 2, "by the flow hash: both groups");
        let k = key("100 udp 198.18.0.1:1 > 198.19.0.1:53".into());
        assert_eq!(m.key_hash(1, 2, &k), k.hash());
        assert_eq!(m.key_hash(1, 1, &k), PartitionBy::SourceAddress.hash(&k));
        assert_eq!(
            m.key_hash(9, 9, &k),
            k.hash(),
            "an unknown chain: the flow hash"
        );
    }

    #[test]
    fn lookup_by_hash_range() {
        let mut m = PartitionMap::default();
        let a = m.create(1, 1, 0, u64::MAX / 2, vec![]);
        let b = m.create(1, 1, u64::MAX / 2 + 1, u64::MAX, vec![]);
        let c = m.create(2, 1, 0, u64::MAX, vec![]);
        assert_eq!(m.lookup(1, 1, 0), Some(a));
        assert_eq!(m.lookup(1, 1, u64::MAX / 2), Some(a));
        assert_eq!(m.lookup(1, 1, u64::MAX / 2 + 1), Some(b));
        assert_eq!(m.lookup(1, 1, u64::MAX), Some(b));
        assert_eq!(m.lookup(2, 1, 77), Some(c));
        assert_eq!(m.lookup(3, 1, 77), None);
        m.remove(a);
        assert_eq!(m.lookup(1, 1, 5), None);
        assert_eq!(m.lookup(1, 1, u64::MAX), Some(b));
        let e = m.set_replicas(b, vec![]).unwrap().group.epoch;
        assert_eq!(e, 2);
    }

    fn group(id: u64, epoch: u64) -> v1::ScGroup {
        v1::ScGroup {
            id,
            epoch,
            replicas: vec![],
        }
    }

    #[test]
    fn adopted_groups_keep_ids_epochs_and_ranges() {
        let mut m = PartitionMap::default();
        let p = v1::Partition {
            tenant: 1,
            chain: 1,
            ..Default::default()
        };
        // A map after a scale-out: group 4 owns the lower half, group 1 the upper.
        m.adopt(group(4, 2), p, (0, 99), vec![]).unwrap();
        m.adopt(group(1, 5), p, (100, u64::MAX), vec![]).unwrap();
        assert_eq!(m.lookup(1, 1, 5), Some(4));
        assert_eq!(m.lookup(1, 1, 100), Some(1));
        assert_eq!(m.group(1).unwrap().group.epoch, 5);
        assert_eq!(m.group(4).unwrap().partition.hash_hi, 99);
        // Overlaps and repeats are refused.
        assert!(m.adopt(group(7, 1), p, (50, 150), vec![]).is_err());
        assert!(m.adopt(group(4, 3), p, (0, 99), vec![]).is_err());
        // A newer order replaces the adopted one, epoch and all.
        m.replace_group(group(4, 3), vec!["sc-9".into()]);
        assert_eq!(m.group(4).unwrap().group.epoch, 3);
        // New groups never reuse an id an SC node may still host.
        m.reserve_id(9);
        let n = m.create(2, 1, 0, u64::MAX, vec![]);
        assert_eq!(n, 10);
    }

    #[test]
    fn detached_groups_get_ranges_when_switched() {
        let mut m = PartitionMap::default();
        let a = m.create(1, 1, 0, u64::MAX, vec![]);
        let b = m.create_detached(1, 1, 0, 99, vec![]);
        assert_eq!(m.lookup(1, 1, 5), Some(a));
        assert_eq!(m.range_of(b), None);
        assert_eq!(m.to_proto().partitions.len(), 1);
        m.set_range(a, Some((100, u64::MAX)));
        m.set_range(b, Some((0, 99)));
        assert_eq!(m.lookup(1, 1, 5), Some(b));
        assert_eq!(m.lookup(1, 1, 100), Some(a));
        assert_eq!(m.chain_ranges(1, 1), vec![(0, 99, b), (100, u64::MAX, a)]);
        assert_eq!(m.to_proto().partitions.len(), 2);
        m.set_range(b, None);
        m.set_range(a, Some((0, u64::MAX)));
        assert_eq!(m.lookup(1, 1, 5), Some(a));
    }
}
