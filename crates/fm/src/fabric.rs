//! The fabric's PP↔PP routes (paper 000 §5.2, docs/fabric.md).
//!
//! The PP nodes form a virtual full mesh: any node can hand a flow's frame to any other
//! over the cluster's switch. A chain may have a *stage* that only some PP nodes serve
//! (its egress stage: in the paper's Figure 4, the service sits behind those nodes). A
//! flow that enters on another node goes on to a node of the stage through a forwarding
//! entry ([`pipeline::Action::Fabric`]) that records that next-hop node.
//!
//! PP nodes are stateless, so FM keeps the routes: one per flow (under both of its
//! directions' keys), from the first time any node asks about the flow. An existing
//! route stays where it is while its node lives, so a node joining the stage takes new
//! flows only. When a stage node leaves or fails, FM drops its routes and has every PP
//! node forget the flows' rules: their next packet asks again and gets a route to a live
//! node of the stage.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// One chain's stage placement: the PP nodes that serve its egress stage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FabricStage {
    pub tenant: u32,
    pub chain: u32,
    /// PP node ids, in preference order; nodes that are not running yet join the stage
    /// when they register (scale-out).
    pub nodes: Vec<String>,
}

/// Counters of the route table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FabricStats {
    /// Routes made (one per flow, whichever direction asked first).
    pub routes: u64,
    /// Answers that sent a flow on to another node (a forwarding entry installed).
    pub forwarded: u64,
    /// Answers to a node of the flow's stage (its full rule).
    pub local: u64,
    /// Routes dropped because their node left or failed.
    pub withdrawn: u64,
    /// Requests for a split chain while no node of its stage was live.
    pub no_node: u64,
    /// First packets of new flows FM carried from the ingress node to the next-hop node
    /// (paper 000 §5.2), and those it could not carry (their ingress nodes released them
    /// over the fabric themselves).
    pub first_forwarded: u64,
    pub first_dropped: FirstDrops,
}

/// First packets FM did not carry on, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FirstDrops {
    /// Larger than `proto::MAX_FABRIC_FRAME`.
    pub oversized: u64,
    /// The next hop is not a member FM knows (it left between routing and sending).
    pub unknown_peer: u64,
    /// The next hop is known but has no live session to carry the packet on.
    pub no_session: u64,
    /// The next hop already has `MAX_FABRIC_FRAMES` first packets waiting this flush.
    pub queue_full: u64,
    /// The next hop did not say at registration that it takes them
    /// (`NodeInfo.fabric_frames`: an older PP node).
    pub peer_cannot_take: u64,
}

impl FirstDrops {
    /// (reason, count), as metrics label them.
    pub fn by_reason(&self) -> [(&'static str, u64); 5] {
        [
            ("oversized", self.oversized),
            ("unknown-peer", self.unknown_peer),
            ("no-session", self.no_session),
            ("queue-full", self.queue_full),
            ("peer-cannot-take", self.peer_cannot_take),
        ]
    }

    pub fn total(&self) -> u64 {
        self.by_reason().iter().map(|(_, n)| n).sum()
    }
}

/// Where a flow's stage runs, as FM answers the node that asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hop {
    /// The chain is not split: the asking node runs the whole rule.
    Unsplit,
    /// The asking node serves the flow's stage: it runs the whole rule.
    Local,
    /// Send the flow on to this node (its fabric MAC).
    Peer { node: String, mac: [u8; 6] },
    /// The chain is split but no node of its stage is live.
    NoNode,
}

type RouteKey = (u32, u32, [u8; 40]);

#[derive(Debug, Default)]
pub struct FabricTable {
    stages: HashMap<(u32, u32), Vec<String>>,
    /// Live PP nodes that take fabric frames, and where.
    macs: HashMap<String, [u8; 6]>,
    /// Flow (either direction) → the node serving its stage.
    routes: HashMap<RouteKey, String>,
    pub stats: FabricStats,
}

impl FabricTable {
    pub fn new(stages: &[FabricStage]) -> Self {
        FabricTable {
            stages: stages
                .iter()
                .map(|s| ((s.tenant, s.chain), s.nodes.clone()))
                .collect(),
            ..Default::default()
        }
    }

    pub fn is_empty(&self) -> bool {
        self.stages.is_empty()
    }

    /// A PP node registered with a fabric MAC (a node that registers again replaces
    /// its entry).
    pub fn join(&mut self, node: &str, mac: [u8; 6]) {
        self.macs.insert(node.to_string(), mac);
    }

    /// Whether `node` takes fabric frames (registered with a fabric MAC).
    pub fn has_node(&self, node: &str) -> bool {
        self.macs.contains_key(node)
    }

    /// A PP node left or failed: its routes go. Returns the flow keys whose rules every
    /// PP node must forget, so their next packets ask again.
    pub fn leave(&mut self, node: &str) -> Vec<[u8; 40]> {
        if self.macs.remove(node).is_none() {
            return Vec::new();
        }
        let mut keys = Vec::new();
        self.routes.retain(|k, n| {
            if n == node {
                keys.push(k.2);
                false
            } else {
                true
            }
        });
        self.stats.withdrawn += keys.len() as u64;
        keys
    }

    /// The route of a flow of chain (`tenant`, `chain`), as seen by node `asker`. `keys`
    /// are the flow's keys (the one asked about first, then its companions'): a new
    /// route is recorded under all of them, so the other direction finds it.
    pub fn hop(&mut self, tenant: u32, chain: u32, keys: &[[u8; 40]], asker: &str) -> Hop {
        let Some(nodes) = self.stages.get(&(tenant, chain)) else {
            return Hop::Unsplit;
        };
        let Some(first) = keys.first() else {
            return Hop::Unsplit;
        };
        let existing = keys
            .iter()
            .find_map(|k| self.routes.get(&(tenant, chain, *k)))
            .filter(|n| self.macs.contains_key(*n))
            .cloned();
        let node = match existing {
            Some(n) => n,
            None => {
                let live: Vec<&String> = nodes
                    .iter()
                    .filter(|n| self.macs.contains_key(*n))
                    .collect();
                if live.is_empty() {
                    self.stats.no_node += 1;
                    return Hop::NoNode;
                }
                // Spread new flows over the stage's live nodes by the flow's key, so a
                // node that joins takes a share of the new flows.
                let h = fnv(first);
                let n = live[(h % live.len() as u64) as usize].clone();
                self.stats.routes += 1;
                for k in keys {
                    self.routes.insert((tenant, chain, *k), n.clone());
                }
                n
            }
        };
        // Keys seen later (a companion the first answer lacked) join the route.
        for k in keys {
            self.routes
                .entry((tenant, chain, *k))
                .or_insert_with(|| node.clone());
        }
        if node == asker {
            self.stats.local += 1;
            return Hop::Local;
        }
        match self.macs.get(&node) {
            Some(mac) => {
                self.stats.forwarded += 1;
                Hop::Peer { node, mac: *mac }
            }
            None => Hop::NoNode,
        }
    }

    /// Forget a flow's route (its rule was withdrawn or expired).
    pub fn forget(&mut self, tenant: u32, chain: u32, key: &[u8; 40]) {
        self.routes.remove(&(tenant, chain, *key));
    }

    /// Routes per serving node, ascending by node (for the status line and tests).
    pub fn routes_by_node(&self) -> Vec<(String, usize)> {
        let mut m: std::collections::BTreeMap<&str, usize> = Default::default();
        for n in self.routes.values() {
            *m.entry(n.as_str()).or_default() += 1;
        }
        m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
    }

    pub fn len(&self) -> usize {
        self.routes.len()
    }
}

/// FNV-1a: a fixed hash, so a flow's first route does not depend on the process.
fn fnv(k: &[u8; 40]) -> u64 {
    k.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> [u8; 40] {
        let mut k = [0u8; 40];
        k[0] = i;
        k[39] = 6;
        k
    }

    fn table() -> FabricTable {
        FabricTable::new(&[FabricStage {
            tenant: 1,
            chain: 1,
            nodes: vec!["pp-1".into(), "pp-2".into()],
        }])
    }

    const M1: [u8; 6] = [2, 0, 0, 0, 0, 1];
    const M2: [u8; 6] = [2, 0, 0, 0, 0, 2];

    #[test]
    fn an_unsplit_chain_has_no_route() {
        let mut t = table();
        t.join("pp-1", M1);
        assert_eq!(t.hop(1, 2, &[key(1)], "pp-0"), Hop::Unsplit);
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn a_flow_goes_to_its_stage_node_and_both_directions_share_the_route() {
        let mut t = table();
        t.join("pp-0", [2, 0, 0, 0, 0, 9]);
        assert_eq!(t.hop(1, 1, &[key(1)], "pp-0"), Hop::NoNode);
        t.join("pp-1", M1);
        let hop = t.hop(1, 1, &[key(1), key(2)], "pp-0");
        assert_eq!(
            hop,
            Hop::Peer {
                node: "pp-1".into(),
                mac: M1
            }
        );
        // The stage node itself runs the whole rule; the reply direction follows.
        assert_eq!(t.hop(1, 1, &[key(1)], "pp-1"), Hop::Local);
        assert_eq!(t.hop(1, 1, &[key(2)], "pp-0"), hop);
        assert_eq!(t.stats.routes, 1);
        assert_eq!(t.routes_by_node(), vec![("pp-1".to_string(), 2)]);
    }

    #[test]
    fn routes_follow_scale_out_and_failure() {
        let mut t = table();
        t.join("pp-1", M1);
        for i in 0..64 {
            t.hop(1, 1, &[key(i)], "pp-0");
        }
        assert_eq!(t.routes_by_node(), vec![("pp-1".to_string(), 64)]);
        // Scale-out: existing flows stay, new ones spread over both.
        t.join("pp-2", M2);
        for i in 0..64 {
            t.hop(1, 1, &[key(i)], "pp-0");
        }
        assert_eq!(t.routes_by_node(), vec![("pp-1".to_string(), 64)]);
        for i in 64..192 {
            t.hop(1, 1, &[key(i)], "pp-0");
        }
        let by = t.routes_by_node();
        assert_eq!(by.len(), 2, "{by:?}");
        let on2 = by[1].1;
        assert!(on2 > 0 && on2 < 128, "{by:?}");
        // Failure: pp-1's routes are withdrawn and the flows go to pp-2 on their next ask.
        let gone = t.leave("pp-1");
        assert_eq!(gone.len(), 192 - on2);
        assert_eq!(t.stats.withdrawn, gone.len() as u64);
        assert_eq!(
            t.hop(1, 1, &[key(0)], "pp-0"),
            Hop::Peer {
                node: "pp-2".into(),
                mac: M2
            }
        );
        assert!(t.leave("pp-9").is_empty());
        t.leave("pp-2");
        assert_eq!(t.hop(1, 1, &[key(0)], "pp-0"), Hop::NoNode);
        assert_eq!(t.len(), 0);
    }
}
