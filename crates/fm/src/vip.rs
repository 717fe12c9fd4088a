//! The vIP group of a PP cluster: Zeta's *Multi IPs Mapping Table* (paper 003 §IV-E)
//! and the first step of its *Multi IPs Scheduler* (§VI-B).
//!
//! The underlay hashes VXLAN flows (by outer source port) over a fixed set of vIPs: an
//! ECMP route whose next hops are the vIPs, each resolved to its own vMAC by a permanent
//! neighbour entry (docs/pp-cluster.md). Which PP node gets a vIP's flows is decided
//! only by which node last announced the vMAC to the switch. So FM moves traffic between
//! PP nodes by moving vIPs, and never touches a host's or router's rule:
//! - a node that joins takes vIPs from the nodes that have the most (scale-out);
//! - a dead node's vIPs go to the live nodes with the fewest (failover);
//! - a draining node gives all of its vIPs away before it is stopped (scale-in).
//!
//! Every PP node holds the same rules (those it learns from FM's cache), so a vIP can
//! move with no state transfer; the flows it carries miss once on the new owner and are
//! answered from FM's cache.
//!
//! The table is plain data with no I/O: FM's master pushes each changed node its new
//! set, gainers before losers, so a vMAC always has an owner that filters it in.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use thiserror::Error;

/// One vIP-vMAC pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VipDef {
    pub ip: Ipv4Addr,
    pub mac: [u8; 6],
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum VipError {
    #[error("no PP node {0} in the vIP group")]
    UnknownNode(String),
    #[error("{0} is the last PP node that is not draining: its vIPs would have no owner")]
    LastNode(String),
    #[error("no vIP {0} in the group")]
    UnknownVip(usize),
    #[error("PP node {0} is draining and takes no vIP")]
    Draining(String),
}

#[derive(Debug, Clone, Default)]
struct NodeState {
    draining: bool,
    /// Packets per second from its last heartbeat: ties between nodes owning as many
    /// vIPs are broken toward the lighter one.
    load: f64,
}

/// The result of a change: every node whose set of vIPs changed, gainers first (they
/// must filter a vMAC in before its old owner stops).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VipChange {
    pub nodes: Vec<String>,
    pub moved: usize,
}

impl VipChange {
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

/// The Multi IPs Mapping Table.
#[derive(Debug, Clone, Default)]
pub struct VipTable {
    vips: Vec<VipDef>,
    owner: Vec<Option<String>>,
    nodes: BTreeMap<String, NodeState>,
    /// What each node said it owned when it joined: balancing moves a vIP to a node
    /// that still filters it in rather than away from one, where it can.
    claims: BTreeMap<String, Vec<usize>>,
    epoch: u64,
    moves: u64,
}

impl VipTable {
    pub fn new(vips: Vec<VipDef>) -> Self {
        let owner = vec![None; vips.len()];
        VipTable {
            vips,
            owner,
            nodes: BTreeMap::new(),
            claims: BTreeMap::new(),
            epoch: 0,
            moves: 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.vips.is_empty()
    }

    pub fn vips(&self) -> &[VipDef] {
        &self.vips
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// vIP moves since the table was made.
    pub fn moves(&self) -> u64 {
        self.moves
    }

    pub fn owner_of(&self, index: usize) -> Option<&str> {
        self.owner.get(index).and_then(|o| o.as_deref())
    }

    /// The vIPs `node` owns, by index.
    pub fn owned_by(&self, node: &str) -> Vec<usize> {
        (0..self.vips.len())
            .filter(|&i| self.owner[i].as_deref() == Some(node))
            .collect()
    }

    /// Live nodes, and which of them are draining.
    pub fn nodes(&self) -> impl Iterator<Item = (&str, bool)> {
        self.nodes.iter().map(|(n, s)| (n.as_str(), s.draining))
    }

    pub fn contains(&self, node: &str) -> bool {
        self.nodes.contains_key(node)
    }

    pub fn set_load(&mut self, node: &str, packets_per_s: f64) {
        if let Some(s) = self.nodes.get_mut(node) {
            s.load = packets_per_s;
        }
    }

    /// A node (re)joined. It keeps the vIPs it says it owns that no other live node
    /// owns (a node re-registering after an FM restart or failover keeps serving what it
    /// served), then the group is balanced: unowned vIPs first, then from the nodes with
    /// the most.
    pub fn join(&mut self, node: &str, claimed: &[usize]) -> VipChange {
        let before = self.take_claims(node, claimed);
        self.balance();
        self.finish(before)
    }

    /// A node (re)joined while FM is taking over from another FM: it keeps what it
    /// claims that nobody else has, and nothing else moves until [`VipTable::rebalance`].
    /// The nodes reconnecting one by one would otherwise each be handed the vIPs of
    /// those not back yet, and give them back a moment later.
    pub fn adopt(&mut self, node: &str, claimed: &[usize]) -> VipChange {
        let before = self.take_claims(node, claimed);
        self.finish(before)
    }

    /// Registers `node` and gives it what it claims that no other node owns; returns
    /// the ownership as it was, for [`VipTable::finish`].
    fn take_claims(&mut self, node: &str, claimed: &[usize]) -> BTreeMap<String, Vec<usize>> {
        let mut before = self.snapshot();
        self.nodes.insert(node.to_string(), NodeState::default());
        self.claims.insert(node.to_string(), claimed.to_vec());
        for &i in claimed {
            if i < self.vips.len() && self.owner[i].is_none() {
                self.owner[i] = Some(node.to_string());
            }
        }
        // What it claimed but lost to another owner is not its any more: it must hear so.
        before
            .entry(node.to_string())
            .or_insert_with(|| claimed.to_vec());
        before
    }

    /// Balance the group now (after a run of [`VipTable::adopt`]).
    pub fn rebalance(&mut self) -> VipChange {
        let before = self.snapshot();
        self.balance();
        self.finish(before)
    }

    /// A node is dead or gone: its vIPs go to the live nodes with the fewest.
    pub fn leave(&mut self, node: &str) -> VipChange {
        if self.nodes.remove(node).is_none() {
            return VipChange::default();
        }
        self.claims.remove(node);
        let before = self.snapshot();
        for o in &mut self.owner {
            if o.as_deref() == Some(node) {
                *o = None;
            }
        }
        self.balance();
        self.finish(before)
    }

    /// Scale-in: `node` gives every vIP away and takes none until it leaves.
    pub fn drain(&mut self, node: &str) -> Result<VipChange, VipError> {
        let Some(s) = self.nodes.get(node) else {
            return Err(VipError::UnknownNode(node.to_string()));
        };
        if !s.draining && !self.nodes.iter().any(|(n, s)| n != node && !s.draining) {
            return Err(VipError::LastNode(node.to_string()));
        }
        let before = self.snapshot();
        if let Some(s) = self.nodes.get_mut(node) {
            s.draining = true;
        }
        for o in &mut self.owner {
            if o.as_deref() == Some(node) {
                *o = None;
            }
        }
        self.balance();
        Ok(self.finish(before))
    }

    /// The Multi IPs Scheduler's intra-cluster step (Zeta §VI-B step 1): vIP `index`
    /// moves to `to`, a live node that is not draining. Moving a vIP to its owner
    /// changes nothing.
    pub fn move_vip(&mut self, index: usize, to: &str) -> Result<VipChange, VipError> {
        if index >= self.vips.len() {
            return Err(VipError::UnknownVip(index));
        }
        match self.nodes.get(to) {
            None => return Err(VipError::UnknownNode(to.to_string())),
            Some(s) if s.draining => return Err(VipError::Draining(to.to_string())),
            Some(_) => {}
        }
        let before = self.snapshot();
        self.owner[index] = Some(to.to_string());
        Ok(self.finish(before))
    }

    /// Who owns what, by node (nodes with none included).
    fn snapshot(&self) -> BTreeMap<String, Vec<usize>> {
        self.nodes
            .keys()
            .map(|n| (n.clone(), self.owned_by(n)))
            .collect()
    }

    fn finish(&mut self, before: BTreeMap<String, Vec<usize>>) -> VipChange {
        let mut gainers = Vec::new();
        let mut losers = Vec::new();
        let mut moved = 0;
        let mut names: Vec<&String> = before.keys().collect();
        for n in self.nodes.keys() {
            if !before.contains_key(n) {
                names.push(n);
            }
        }
        for n in names {
            let old = before.get(n).cloned().unwrap_or_default();
            let new = self.owned_by(n);
            if old == new && self.nodes.contains_key(n) {
                continue;
            }
            let gained = new.iter().filter(|i| !old.contains(i)).count();
            moved += gained;
            if gained > 0 {
                gainers.push(n.clone());
            } else if self.nodes.contains_key(n) {
                losers.push(n.clone());
            }
        }
        gainers.extend(losers);
        if !gainers.is_empty() {
            self.epoch += 1;
            self.moves += moved as u64;
        }
        VipChange {
            nodes: gainers,
            moved,
        }
    }

    /// Give unowned vIPs to the least-loaded active nodes, then move vIPs from the
    /// fullest to the emptiest until no two active nodes differ by more than one.
    fn balance(&mut self) {
        let active: Vec<String> = self
            .nodes
            .iter()
            .filter(|(_, s)| !s.draining)
            .map(|(n, _)| n.clone())
            .collect();
        if active.is_empty() {
            return;
        }
        for i in 0..self.vips.len() {
            if self.owner[i].is_none() {
                let to = self.lightest(&active);
                self.owner[i] = Some(to);
            }
        }
        loop {
            let to = self.lightest(&active);
            let from = self.heaviest(&active);
            let (nt, nf) = (self.owned_by(&to).len(), self.owned_by(&from).len());
            if nf <= nt + 1 {
                break;
            }
            // Which of the fullest node's vIPs moves: first one the receiver claims and
            // the giver did not (it still has it in its filter), then any the giver did
            // not claim, then its highest-numbered one, so that repeated joins and
            // leaves move the same few vIPs back and forth rather than reshuffling.
            let owned = self.owned_by(&from);
            let claimed = |n: &str, i: usize| self.claims.get(n).is_some_and(|c| c.contains(&i));
            let pick = owned
                .iter()
                .rev()
                .find(|&&i| claimed(&to, i) && !claimed(&from, i))
                .or_else(|| owned.iter().rev().find(|&&i| !claimed(&from, i)))
                .or_else(|| owned.last())
                .copied();
            match pick {
                Some(i) => self.owner[i] = Some(to),
                None => break,
            }
        }
    }

    fn lightest(&self, active: &[String]) -> String {
        let mut best: Option<(&String, usize, f64)> = None;
        for n in active {
            let c = self.owned_by(n).len();
            let l = self.nodes.get(n).map_or(0.0, |s| s.load);
            if best.is_none_or(|(_, bc, bl)| c < bc || (c == bc && l < bl)) {
                best = Some((n, c, l));
            }
        }
        best.map(|b| b.0.clone()).unwrap_or_default()
    }

    fn heaviest(&self, active: &[String]) -> String {
        let mut best: Option<(&String, usize, f64)> = None;
        for n in active {
            let c = self.owned_by(n).len();
            let l = self.nodes.get(n).map_or(0.0, |s| s.load);
            if best.is_none_or(|(_, bc, bl)| c > bc || (c == bc && l > bl)) {
                best = Some((n, c, l));
            }
        }
        best.map(|b| b.0.clone()).unwrap_or_default()
    }
}

/// `02:5f:76:00:00:07`-style MAC text.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut out = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut out {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(n: u8) -> VipTable {
        VipTable::new(
            (0..n)
                .map(|i| VipDef {
                    ip: Ipv4Addr::new(198, 18, 1, 100 + i),
                    mac: [2, 0x5f, 0x76, 0, 0, i],
                })
                .collect(),
        )
    }

    fn counts(t: &VipTable) -> Vec<usize> {
        t.nodes().map(|(n, _)| t.owned_by(n).len()).collect()
    }

    fn every_vip_owned_once(t: &VipTable) {
        for i in 0..t.vips().len() {
            let o = t.owner_of(i).expect("owned");
            assert!(t.contains(o), "vIP {i} owned by a node not in the group");
        }
    }

    #[test]
    fn a_scheduled_move_tells_the_gainer_first_and_refuses_bad_targets() {
        let mut t = table(4);
        t.join("pp-0", &[]);
        t.join("pp-1", &[]);
        let v = t.owned_by("pp-0")[0];
        let c = t.move_vip(v, "pp-1").unwrap();
        assert_eq!(c.nodes, vec!["pp-1", "pp-0"]);
        assert_eq!(c.moved, 1);
        assert_eq!(t.owner_of(v), Some("pp-1"));
        assert_eq!(counts(&t), vec![1, 3]);
        every_vip_owned_once(&t);
        assert!(t.move_vip(v, "pp-1").unwrap().is_empty());
        assert_eq!(t.move_vip(9, "pp-0"), Err(VipError::UnknownVip(9)));
        assert_eq!(
            t.move_vip(v, "pp-9"),
            Err(VipError::UnknownNode("pp-9".into()))
        );
        t.join("pp-2", &[]);
        t.drain("pp-2").unwrap();
        assert_eq!(
            t.move_vip(v, "pp-2"),
            Err(VipError::Draining("pp-2".into()))
        );
    }

    #[test]
    fn the_first_node_takes_everything_and_joiners_take_a_fair_share() {
        let mut t = table(8);
        let c = t.join("pp-0", &[]);
        assert_eq!(c.nodes, vec!["pp-0"]);
        assert_eq!(c.moved, 8);
        assert_eq!(t.owned_by("pp-0").len(), 8);
        let c = t.join("pp-1", &[]);
        // The gainer is told first, then the node that gave vIPs up.
        assert_eq!(c.nodes, vec!["pp-1", "pp-0"]);
        assert_eq!(c.moved, 4);
        assert_eq!(counts(&t), vec![4, 4]);
        let c = t.join("pp-2", &[]);
        assert_eq!(c.nodes[0], "pp-2");
        assert_eq!(c.moved, 2);
        let mut cs = counts(&t);
        cs.sort();
        assert_eq!(cs, vec![2, 3, 3]);
        every_vip_owned_once(&t);
        assert_eq!(t.epoch(), 3);
        assert_eq!(t.moves(), 14);
    }

    #[test]
    fn a_dead_nodes_vips_go_to_the_survivors_and_nobody_else_moves() {
        let mut t = table(8);
        t.join("a", &[]);
        t.join("b", &[]);
        t.join("c", &[]);
        let a_before = t.owned_by("a");
        let b_before = t.owned_by("b");
        let c_before = t.owned_by("c");
        let ch = t.leave("b");
        assert_eq!(ch.moved, b_before.len());
        assert!(!ch.nodes.contains(&"b".to_string()));
        // Survivors keep what they had (their flows do not move) and gain b's.
        for i in &a_before {
            assert_eq!(t.owner_of(*i), Some("a"));
        }
        for i in &c_before {
            assert_eq!(t.owner_of(*i), Some("c"));
        }
        assert_eq!(counts(&t), vec![4, 4]);
        every_vip_owned_once(&t);
        // Leaving twice changes nothing.
        assert!(t.leave("b").is_empty());
    }

    #[test]
    fn the_last_node_leaving_leaves_vips_unowned_until_one_joins() {
        let mut t = table(4);
        t.join("a", &[]);
        let ch = t.leave("a");
        assert!(ch.nodes.is_empty());
        assert_eq!(t.owner_of(0), None);
        let ch = t.join("b", &[]);
        assert_eq!(ch.moved, 4);
        every_vip_owned_once(&t);
    }

    #[test]
    fn draining_gives_everything_away_and_refuses_the_last_node() {
        let mut t = table(8);
        t.join("a", &[]);
        assert_eq!(t.drain("a"), Err(VipError::LastNode("a".into())));
        assert_eq!(t.owned_by("a").len(), 8, "a refused drain changes nothing");
        t.join("b", &[]);
        let ch = t.drain("a").unwrap();
        assert_eq!(ch.nodes, vec!["b", "a"]);
        assert!(t.owned_by("a").is_empty());
        assert_eq!(t.owned_by("b").len(), 8);
        // A draining node takes nothing when others leave or join.
        t.join("c", &[]);
        assert!(t.owned_by("a").is_empty());
        assert_eq!(counts(&t), vec![0, 4, 4]);
        assert_eq!(t.drain("zz"), Err(VipError::UnknownNode("zz".into())));
    }

    #[test]
    fn a_rejoining_node_keeps_what_it_claims_unless_someone_else_has_it() {
        let mut t = table(4);
        // After an FM restart: b registers first claiming 2 and 3, a claims 0..=3.
        t.join("b", &[2, 3]);
        assert_eq!(t.owned_by("b"), vec![0, 1, 2, 3]);
        let mut t = table(4);
        t.join("b", &[2, 3]);
        let ch = t.join("a", &[0, 1, 2, 3]);
        // a gets 0 and 1 back only through balancing; 2, 3 stay b's.
        assert_eq!(t.owner_of(2), Some("b"));
        assert_eq!(t.owner_of(3), Some("b"));
        assert_eq!(t.owned_by("a").len(), 2);
        assert!(ch.nodes.contains(&"a".to_string()));
        every_vip_owned_once(&t);
    }

    #[test]
    fn ties_go_to_the_lighter_node() {
        let mut t = table(3);
        t.join("a", &[]);
        t.join("b", &[]);
        // a and b own 2 and 1 (or 1 and 2); make both own 1 by adding c, then kill c.
        t.join("c", &[]);
        t.set_load("a", 1000.0);
        t.set_load("b", 10.0);
        let c = t.owned_by("c");
        assert_eq!(c.len(), 1);
        t.leave("c");
        assert_eq!(t.owner_of(c[0]), Some("b"));
    }

    #[test]
    fn macs_parse() {
        assert_eq!(
            parse_mac("02:5f:76:00:00:0a"),
            Some([2, 0x5f, 0x76, 0, 0, 10])
        );
        assert_eq!(parse_mac("02:5f:76:00:00"), None);
        assert_eq!(parse_mac("02:5f:76:00:00:0a:01"), None);
        assert_eq!(parse_mac("zz:5f:76:00:00:0a"), None);
    }

    #[test]
    fn nodes_reconnecting_to_a_new_fm_keep_their_vips() {
        let mut t = table(8);
        // The old FM had a: 0..4, b: 4..8. They reconnect one by one.
        let ch = t.adopt("a", &[0, 1, 2, 3]);
        assert!(ch.is_empty(), "a keeps what it has: nothing to tell it");
        assert_eq!(t.owner_of(5), None, "b's vIPs wait for b");
        t.adopt("b", &[4, 5, 6, 7]);
        let ch = t.rebalance();
        assert!(ch.is_empty(), "nothing to move: {ch:?}");
        assert_eq!(t.owned_by("a"), vec![0, 1, 2, 3]);
        assert_eq!(t.owned_by("b"), vec![4, 5, 6, 7]);
        // b never came back: the rebalance gives its vIPs out.
        let mut t = table(8);
        t.adopt("a", &[0, 1, 2, 3]);
        let ch = t.rebalance();
        assert_eq!(ch.moved, 4);
        assert_eq!(t.owned_by("a").len(), 8);
    }
}
