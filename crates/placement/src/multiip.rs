//! Zeta (paper 003) §VI-B: the Multi IPs Scheduler's policy, as a pure function from a
//! snapshot of PP clusters to an ordered list of actions.
//!
//! A PP cluster serves its address through a group of vIPs (vIP-vMAC pairs, §IV-E,
//! docs/pp-cluster.md); each vIP has exactly one owner node, and moving a vIP moves
//! its share of the underlay's flows with no host or router change. When a node goes
//! over the high water mark (80% in the paper), the scheduler:
//!
//! 1. **Intra-cluster adjustment.** Sorts the cluster's nodes by utilisation,
//!    descending, moves one vIP from the most loaded overloaded node to the lightest
//!    node that can take it, re-sorts, and repeats until no node is over the mark or no
//!    move is allowed.
//! 2. **Cluster scaling.** For a cluster still overloaded, takes a node from the
//!    cluster with the lowest average utilisation (its vIPs first handed to the nodes
//!    that stay), if the source stays under the mark; otherwise asks for a new node.
//!
//! The rules that make it safe to run on every overload report:
//! - A vIP moves only if the receiver ends at or under the mark *and* both ends end
//!   strictly under the donor's utilisation before the move. So no move raises the
//!   maximum, and Σ_n load_n² / cap_n falls with every move, so the same assignment
//!   never comes back: no oscillation, and the loop ends.
//! - Step 1 never takes a node's last vIP: a serving node keeps at least one (moving
//!   the only vIP just moves the whole overload, and FM's balancing assumes every live
//!   node owns some). Step 2's node move is the exception: that node is leaving.
//! - Draining nodes never receive a vIP; nodes are never moved out of a cluster that
//!   has an overloaded node, and a source cluster keeps at least one node.
//! - A zero-load vIP never moves (it would change nothing).
//!
//! Per-vIP load is often unknown (a PP node measures its packet rate, not each vIP's).
//! Where a node reports no load for some of its vIPs, its load beyond the vIPs whose
//! load is known is split evenly over those vIPs: the underlay hashes flows evenly over
//! vIPs, so on average each carries the same share. Where every vIP's load is known,
//! whatever the node carries beyond their sum is load that stays with the node (it
//! moves with the node in step 2). If the known vIP loads add up to more than the
//! node's load (two measurement windows), the vIPs' sum is taken as the node's load.
//! Every projection is therefore an estimate until the next measurement.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};
use tracing::debug;

use crate::problem::{unique_id, PlaceError};

/// Slack on utilisation comparisons: loads are sums of floating-point shares.
const EPS: f64 = 1e-9;

/// A vIP owned by a node, with its load if known.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MipVip {
    pub id: String,
    /// In the node's load unit; `None` if not measured (see the module doc).
    #[serde(default)]
    pub load: Option<f64>,
}

/// A PP node (a gateway in the paper).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MipNode {
    /// Unique across all clusters (a node may move between clusters).
    pub id: String,
    /// Packets/s, or a utilisation fraction with `capacity` = 1.
    pub load: f64,
    /// Same unit as `load`; > 0.
    pub capacity: f64,
    #[serde(default)]
    pub vips: Vec<MipVip>,
    /// A draining node (docs/pp-cluster.md "Drain") never receives vIPs and is never
    /// moved to another cluster.
    #[serde(default)]
    pub draining: bool,
}

/// A PP cluster and its nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MipCluster {
    pub id: String,
    #[serde(default)]
    pub nodes: Vec<MipNode>,
}

/// The scheduler's thresholds and permissions.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    /// The high water mark: a node whose load / capacity exceeds it is overloaded.
    /// In (0, 1]; the paper uses 0.8.
    pub high_water: f64,
    /// Whether step 2 may ask for a new node when no node can be borrowed.
    pub can_start_nodes: bool,
    /// Capacity of a node that [`Action::GrowCluster`] would start; `None`: the mean
    /// capacity of the cluster's nodes.
    #[serde(default)]
    pub new_node_capacity: Option<f64>,
    /// Most actions in one plan (a guard: the rules above end on their own).
    pub max_actions: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            high_water: 0.8,
            can_start_nodes: true,
            new_node_capacity: None,
            max_actions: 1000,
        }
    }
}

/// One action, with what it is projected to leave behind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Action {
    /// Move a vIP-vMAC pair between two nodes of one cluster. FM applies it gainer
    /// first (docs/pp-cluster.md), so the vMAC always has an owner.
    MoveVip {
        cluster: String,
        vip: String,
        from: String,
        to: String,
        /// The vIP's load as used (measured, or the even-split estimate).
        vip_load: f64,
        /// The donor's and the receiver's utilisation after the move.
        from_utilisation: f64,
        to_utilisation: f64,
    },
    /// Move a node (already stripped of its vIPs by the MoveVip steps before it) to
    /// another cluster. Utilisations are the clusters' averages after the move.
    MoveNode {
        node: String,
        from_cluster: String,
        to_cluster: String,
        from_cluster_utilisation: f64,
        to_cluster_utilisation: f64,
    },
    /// Start `nodes` new nodes for `cluster`; FM's join balancing hands them vIPs.
    /// Loads do not change until they join.
    GrowCluster {
        cluster: String,
        nodes: usize,
        node_capacity: f64,
        /// The cluster's average utilisation now and with the new nodes.
        utilisation: f64,
        projected_utilisation: f64,
    },
}

/// An action with a line for the event log and the largest node utilisation over all
/// clusters once it (and every action before it) is applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Step {
    pub action: Action,
    pub reason: String,
    pub max_utilisation: f64,
}

/// An overloaded node the plan could not relieve, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Unresolved {
    pub cluster: String,
    pub node: String,
    pub utilisation: f64,
    pub reason: String,
}

/// A node as the plan leaves it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeProjection {
    pub id: String,
    pub load: f64,
    pub capacity: f64,
    pub utilisation: f64,
    /// (vIP, load as used), in the order the node acquired them.
    pub vips: Vec<(String, f64)>,
}

/// A cluster as the plan leaves it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterProjection {
    pub id: String,
    /// Σ load / Σ capacity (0 for a cluster with no nodes).
    pub utilisation: f64,
    pub nodes: Vec<NodeProjection>,
}

/// The scheduler's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// In the order to apply them.
    pub steps: Vec<Step>,
    pub unresolved: Vec<Unresolved>,
    pub max_utilisation_before: f64,
    pub max_utilisation_after: f64,
    /// Every cluster after the plan (GrowCluster's nodes not included).
    pub clusters: Vec<ClusterProjection>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }
}

#[derive(Debug, Clone)]
struct NodeSt {
    id: String,
    cap: f64,
    /// Load that is not any vIP's: it stays with the node.
    base: f64,
    vips: Vec<(String, f64)>,
    draining: bool,
}

impl NodeSt {
    fn load(&self) -> f64 {
        self.base + self.vips.iter().map(|(_, l)| l).sum::<f64>()
    }
    fn util(&self) -> f64 {
        self.load() / self.cap
    }
}

#[derive(Debug, Clone)]
struct ClusterSt {
    id: String,
    nodes: Vec<NodeSt>,
}

impl ClusterSt {
    fn avg(&self) -> f64 {
        let cap: f64 = self.nodes.iter().map(|n| n.cap).sum();
        if cap > 0.0 {
            self.nodes.iter().map(NodeSt::load).sum::<f64>() / cap
        } else {
            0.0
        }
    }
    fn max(&self) -> f64 {
        self.nodes.iter().map(NodeSt::util).fold(0.0, f64::max)
    }
    fn overloaded(&self, mark: f64) -> bool {
        self.max() > mark + EPS
    }
}

struct Planner {
    cfg: SchedulerConfig,
    clusters: Vec<ClusterSt>,
    steps: Vec<Step>,
}

fn pct(u: f64) -> String {
    format!("{:.0}%", u * 100.0)
}

impl Planner {
    fn global_max(&self) -> f64 {
        self.clusters.iter().map(ClusterSt::max).fold(0.0, f64::max)
    }

    fn push(&mut self, action: Action, reason: String) {
        debug!(%reason, "multi-IPs scheduler");
        let max_utilisation = self.global_max();
        self.steps.push(Step {
            action,
            reason,
            max_utilisation,
        });
    }

    fn budget_left(&self) -> bool {
        self.steps.len() < self.cfg.max_actions
    }
}

/// The best vIP move from `d` among `nodes` under step 1's rules: the lightest
/// receiver (by utilisation) that can take any vIP, and for it the vIP that leaves the
/// pair's maximum lowest (ties: smaller load, then id). `None` if no move is allowed.
fn best_move(nodes: &[NodeSt], d: usize, mark: f64) -> Option<(usize, usize)> {
    let donor = &nodes[d];
    if donor.vips.len() <= 1 {
        return None;
    }
    let ud = donor.util();
    let ld = donor.load();
    let mut receivers: Vec<usize> = (0..nodes.len())
        .filter(|&r| r != d && !nodes[r].draining)
        .collect();
    rank(&mut receivers, Rank::Lowest, |i| {
        (nodes[i].util(), nodes[i].id.as_str())
    });
    for r in receivers {
        let lr = nodes[r].load();
        let mut best: Option<(f64, f64, usize)> = None;
        for (w, (vid, wl)) in donor.vips.iter().enumerate() {
            let new_r = (lr + wl) / nodes[r].cap;
            let new_d = (ld - wl) / donor.cap;
            if *wl <= 0.0 || new_r > mark + EPS || new_r.max(new_d) >= ud - EPS {
                continue;
            }
            let key = (new_r.max(new_d), *wl, w);
            let better = match best {
                None => true,
                Some((m, l, bw)) => {
                    key.0 < m - EPS
                        || ((key.0 - m).abs() <= EPS
                            && (key.1 < l || (key.1 == l && vid < &donor.vips[bw].0)))
                }
            };
            if better {
                best = Some(key);
            }
        }
        if let Some((_, _, w)) = best {
            return Some((r, w));
        }
    }
    None
}

/// Step 1 on cluster `c` of `clusters`, at most `budget` moves, recording MoveVip
/// actions into `out` (with their reasons) if given. Returns the number of moves.
fn step1(
    clusters: &mut [ClusterSt],
    c: usize,
    mark: f64,
    budget: usize,
    mut out: Option<&mut Vec<(Action, String, f64)>>,
) -> usize {
    let mut moves = 0;
    while moves < budget {
        let cl = &clusters[c];
        let mut order: Vec<usize> = (0..cl.nodes.len()).collect();
        rank(&mut order, Rank::Highest, |i| {
            (cl.nodes[i].util(), cl.nodes[i].id.as_str())
        });
        let found = order
            .iter()
            .take_while(|&&d| cl.nodes[d].util() > mark + EPS)
            .find_map(|&d| best_move(&cl.nodes, d, mark).map(|(r, w)| (d, r, w)));
        let Some((d, r, w)) = found else { break };
        let before_d = cl.nodes[d].util();
        let before_r = cl.nodes[r].util();
        let cl = &mut clusters[c];
        let vip = cl.nodes[d].vips.remove(w);
        cl.nodes[r].vips.push(vip.clone());
        moves += 1;
        if let Some(out) = out.as_deref_mut() {
            let (dn, rn) = (&cl.nodes[d], &cl.nodes[r]);
            let action = Action::MoveVip {
                cluster: cl.id.clone(),
                vip: vip.0.clone(),
                from: dn.id.clone(),
                to: rn.id.clone(),
                vip_load: vip.1,
                from_utilisation: dn.util(),
                to_utilisation: rn.util(),
            };
            let reason = format!(
                "cluster {}: {} at {} is over the {} mark; vIP {} (load {:.3}) moves to {} \
                 ({} → {}), leaving {} at {}",
                cl.id,
                dn.id,
                pct(before_d),
                pct(mark),
                vip.0,
                vip.1,
                rn.id,
                pct(before_r),
                pct(rn.util()),
                dn.id,
                pct(dn.util())
            );
            out.push((action, reason, 0.0));
        }
    }
    moves
}

/// Hands every vIP of `nodes[m]` to the other non-draining nodes, largest first, each
/// to the node left lightest, none over the mark. `None` if one does not fit.
fn redistribute(nodes: &[NodeSt], m: usize, mark: f64) -> Option<Vec<(usize, usize)>> {
    let mut sim: Vec<f64> = nodes.iter().map(NodeSt::load).collect();
    let mut vips: Vec<usize> = (0..nodes[m].vips.len()).collect();
    vips.sort_by(|&a, &b| {
        nodes[m].vips[b]
            .1
            .total_cmp(&nodes[m].vips[a].1)
            .then_with(|| nodes[m].vips[a].0.cmp(&nodes[m].vips[b].0))
    });
    let mut plan = Vec::new();
    for w in vips {
        let wl = nodes[m].vips[w].1;
        let r = (0..nodes.len())
            .filter(|&r| r != m && !nodes[r].draining)
            .filter(|&r| (sim[r] + wl) / nodes[r].cap <= mark + EPS)
            .min_by(|&a, &b| {
                ((sim[a] + wl) / nodes[a].cap)
                    .total_cmp(&((sim[b] + wl) / nodes[b].cap))
                    .then_with(|| nodes[a].id.cmp(&nodes[b].id))
            })?;
        sim[r] += wl;
        plan.push((w, r));
    }
    Some(plan)
}

/// Which end of a [`rank`] comes first.
#[derive(Clone, Copy)]
enum Rank {
    Lowest,
    Highest,
}

/// Orders the indices `idx` by the value `key` gives, `first` end first, ties by the
/// id (ascending): every step walks its candidates in this order, so a plan does not
/// depend on the input's order.
fn rank<'a>(idx: &mut [usize], first: Rank, key: impl Fn(usize) -> (f64, &'a str)) {
    idx.sort_by(|&a, &b| {
        let ((ka, ia), (kb, ib)) = (key(a), key(b));
        let by_key = match first {
            Rank::Lowest => ka.total_cmp(&kb),
            Rank::Highest => kb.total_cmp(&ka),
        };
        by_key.then_with(|| ia.cmp(ib))
    });
}

fn validate(clusters: &[MipCluster], cfg: &SchedulerConfig) -> Result<(), PlaceError> {
    if !cfg.high_water.is_finite() || cfg.high_water <= 0.0 || cfg.high_water > 1.0 {
        return Err(PlaceError::invalid(
            "high_water",
            format!("must be in (0, 1], got {}", cfg.high_water),
        ));
    }
    if let Some(c) = cfg.new_node_capacity {
        if !c.is_finite() || c <= 0.0 {
            return Err(PlaceError::invalid(
                "new_node_capacity",
                format!("must be a finite number > 0, got {c}"),
            ));
        }
    }
    let mut cluster_ids = HashSet::new();
    let mut node_ids = HashSet::new();
    for (ci, c) in clusters.iter().enumerate() {
        unique_id(
            &mut cluster_ids,
            &c.id,
            format!("clusters[{ci}].id"),
            || format!("duplicate cluster id {:?}", c.id),
        )?;
        let mut vip_ids = HashSet::new();
        for (ni, n) in c.nodes.iter().enumerate() {
            let f = format!("clusters[{ci}].nodes[{ni}]");
            unique_id(&mut node_ids, &n.id, format!("{f}.id"), || {
                format!(
                    "duplicate node id {:?} (node ids are unique across clusters)",
                    n.id
                )
            })?;
            if !n.load.is_finite() || n.load < 0.0 {
                return Err(PlaceError::invalid(
                    format!("{f}.load"),
                    format!("must be a finite number ≥ 0, got {}", n.load),
                ));
            }
            if !n.capacity.is_finite() || n.capacity <= 0.0 {
                return Err(PlaceError::invalid(
                    format!("{f}.capacity"),
                    format!("must be a finite number > 0, got {}", n.capacity),
                ));
            }
            for (vi, v) in n.vips.iter().enumerate() {
                unique_id(&mut vip_ids, &v.id, format!("{f}.vips[{vi}].id"), || {
                    format!("vIP {:?} has two owners in cluster {:?}", v.id, c.id)
                })?;
                if let Some(l) = v.load {
                    if !l.is_finite() || l < 0.0 {
                        return Err(PlaceError::invalid(
                            format!("{f}.vips[{vi}].load"),
                            format!("must be a finite number ≥ 0, got {l}"),
                        ));
                    }
                }
            }
        }
    }
    Ok(())
}

/// Each vIP's load as used, and the node's load that is no vIP's (module doc).
fn split(n: &MipNode) -> NodeSt {
    let known: f64 = n.vips.iter().filter_map(|v| v.load).sum();
    let unknown = n.vips.iter().filter(|v| v.load.is_none()).count();
    let rest = (n.load - known).max(0.0);
    let (base, share) = if unknown > 0 {
        (0.0, rest / unknown as f64)
    } else {
        (rest, 0.0)
    };
    NodeSt {
        id: n.id.clone(),
        cap: n.capacity,
        base,
        vips: n
            .vips
            .iter()
            .map(|v| (v.id.clone(), v.load.unwrap_or(share)))
            .collect(),
        draining: n.draining,
    }
}

/// The Multi IPs Scheduler (Zeta §VI-B): steps 1 and 2 over every cluster.
///
/// Returns an empty plan when no node is over `cfg.high_water`.
pub fn schedule(clusters: &[MipCluster], cfg: &SchedulerConfig) -> Result<Plan, PlaceError> {
    validate(clusters, cfg)?;
    let mark = cfg.high_water;
    let mut p = Planner {
        cfg: *cfg,
        clusters: clusters
            .iter()
            .map(|c| ClusterSt {
                id: c.id.clone(),
                nodes: c.nodes.iter().map(split).collect(),
            })
            .collect(),
        steps: Vec::new(),
    };
    let before = p.global_max();
    let mut unresolved = Vec::new();

    // Step 1 in every cluster.
    for c in 0..p.clusters.len() {
        run_step1(&mut p, c);
    }

    // Step 2: overloaded clusters, highest average first.
    let mut hot: Vec<usize> = (0..p.clusters.len())
        .filter(|&c| p.clusters[c].overloaded(mark))
        .collect();
    rank(&mut hot, Rank::Highest, |i| {
        (p.clusters[i].avg(), p.clusters[i].id.as_str())
    });
    for x in hot {
        while p.clusters[x].overloaded(mark) && p.budget_left() {
            if !borrow_node(&mut p, x) {
                if !grow(&mut p, x) {
                    let n = p.clusters[x]
                        .nodes
                        .iter()
                        .max_by(|a, b| a.util().total_cmp(&b.util()))
                        .map(|n| (n.id.clone(), n.util()))
                        .unwrap_or_default();
                    unresolved.push(Unresolved {
                        cluster: p.clusters[x].id.clone(),
                        node: n.0,
                        utilisation: n.1,
                        reason: why_stuck(&p.clusters[x], cfg),
                    });
                }
                break;
            }
        }
    }
    let after = p.global_max();
    Ok(Plan {
        steps: p.steps,
        unresolved,
        max_utilisation_before: before,
        max_utilisation_after: after,
        clusters: p
            .clusters
            .iter()
            .map(|c| ClusterProjection {
                id: c.id.clone(),
                utilisation: c.avg(),
                nodes: c
                    .nodes
                    .iter()
                    .map(|n| NodeProjection {
                        id: n.id.clone(),
                        load: n.load(),
                        capacity: n.cap,
                        utilisation: n.util(),
                        vips: n.vips.clone(),
                    })
                    .collect(),
            })
            .collect(),
    })
}

fn run_step1(p: &mut Planner, c: usize) {
    let mut out = Vec::new();
    let budget = p.cfg.max_actions.saturating_sub(p.steps.len());
    // Moves are applied one at a time so each step's max_utilisation is its own.
    let mut done = 0;
    while done < budget {
        if step1(&mut p.clusters, c, p.cfg.high_water, 1, Some(&mut out)) == 0 {
            break;
        }
        done += 1;
        for (a, r, _) in out.drain(..) {
            p.push(a, r);
        }
    }
}

/// Step 2's borrow: a node from the least-loaded cluster that can spare one, if moving
/// it lowers `x`'s maximum. Records the steps and returns true if it did.
fn borrow_node(p: &mut Planner, x: usize) -> bool {
    let mark = p.cfg.high_water;
    let mut donors: Vec<usize> = (0..p.clusters.len())
        .filter(|&d| {
            let cl = &p.clusters[d];
            d != x && cl.nodes.iter().filter(|n| !n.draining).count() >= 2 && !cl.overloaded(mark)
        })
        .collect();
    rank(&mut donors, Rank::Lowest, |i| {
        (p.clusters[i].avg(), p.clusters[i].id.as_str())
    });
    let x_max = p.clusters[x].max();
    // Room the moves may use: every move is one step.
    let budget = p.cfg.max_actions.saturating_sub(p.steps.len());
    for d in donors {
        let cl = &p.clusters[d];
        let mut cands: Vec<usize> = (0..cl.nodes.len())
            .filter(|&m| !cl.nodes[m].draining)
            .collect();
        // The least-loaded node disturbs the fewest flows; then the biggest.
        cands.sort_by(|&a, &b| {
            cl.nodes[a]
                .load()
                .total_cmp(&cl.nodes[b].load())
                .then_with(|| cl.nodes[b].cap.total_cmp(&cl.nodes[a].cap))
                .then_with(|| cl.nodes[a].id.cmp(&cl.nodes[b].id))
        });
        for m in cands {
            let Some(moves) = redistribute(&p.clusters[d].nodes, m, mark) else {
                continue;
            };
            // Simulate: the node, without its vIPs, joins x; step 1 runs there.
            let mut sim = p.clusters.clone();
            let mut node = sim[d].nodes[m].clone();
            node.vips.clear();
            sim[x].nodes.push(node);
            let left = budget.saturating_sub(moves.len() + 1);
            step1(&mut sim, x, mark, left, None);
            if sim[x].max() >= x_max - EPS {
                continue;
            }
            apply_borrow(p, d, m, x, &moves);
            return true;
        }
    }
    false
}

fn apply_borrow(p: &mut Planner, d: usize, m: usize, x: usize, moves: &[(usize, usize)]) {
    let mark = p.cfg.high_water;
    let node_id = p.clusters[d].nodes[m].id.clone();
    let (did, xid) = (p.clusters[d].id.clone(), p.clusters[x].id.clone());
    // Hand the node's vIPs to the nodes that stay, largest first (indices into the
    // node's vIP list as it was; take them out in that order by id).
    let vip_ids: Vec<String> = moves
        .iter()
        .map(|&(w, _)| p.clusters[d].nodes[m].vips[w].0.clone())
        .collect();
    for (vid, &(_, r)) in vip_ids.iter().zip(moves) {
        let cl = &mut p.clusters[d];
        let Some(pos) = cl.nodes[m].vips.iter().position(|(v, _)| v == vid) else {
            continue;
        };
        let before_r = cl.nodes[r].util();
        let vip = cl.nodes[m].vips.remove(pos);
        cl.nodes[r].vips.push(vip.clone());
        let (mn, rn) = (&cl.nodes[m], &cl.nodes[r]);
        let action = Action::MoveVip {
            cluster: did.clone(),
            vip: vip.0.clone(),
            from: mn.id.clone(),
            to: rn.id.clone(),
            vip_load: vip.1,
            from_utilisation: mn.util(),
            to_utilisation: rn.util(),
        };
        let reason = format!(
            "cluster {did}: {} is lent to {xid}; its vIP {} (load {:.3}) moves to {} ({} → {})",
            mn.id,
            vip.0,
            vip.1,
            rn.id,
            pct(before_r),
            pct(rn.util())
        );
        p.push(action, reason);
    }
    let node = p.clusters[d].nodes.remove(m);
    let x_before = p.clusters[x].avg();
    p.clusters[x].nodes.push(node);
    let action = Action::MoveNode {
        node: node_id.clone(),
        from_cluster: did.clone(),
        to_cluster: xid.clone(),
        from_cluster_utilisation: p.clusters[d].avg(),
        to_cluster_utilisation: p.clusters[x].avg(),
    };
    let reason = format!(
        "cluster {xid} stays over the {} mark after moving vIPs inside it; node {node_id} \
         moves from {did} (the least-loaded cluster that stays under the mark without it, \
         now {}) to {xid} (average {} → {})",
        pct(mark),
        pct(p.clusters[d].avg()),
        pct(x_before),
        pct(p.clusters[x].avg())
    );
    p.push(action, reason);
    run_step1(p, x);
}

/// Step 2's fallback: a new node for `x`, if one would help. Returns true if it
/// recorded a GrowCluster.
fn grow(p: &mut Planner, x: usize) -> bool {
    if !p.cfg.can_start_nodes || !p.budget_left() {
        return false;
    }
    let mark = p.cfg.high_water;
    let cl = &p.clusters[x];
    let cap = p.cfg.new_node_capacity.unwrap_or_else(|| {
        if cl.nodes.is_empty() {
            1.0
        } else {
            cl.nodes.iter().map(|n| n.cap).sum::<f64>() / cl.nodes.len() as f64
        }
    });
    // Would one empty node let step 1 lower the maximum? If not (the load sits in one
    // vIP that no node can carry under the mark), a node does not help.
    let mut sim = p.clusters.clone();
    sim[x].nodes.push(NodeSt {
        id: String::new(),
        cap,
        base: 0.0,
        vips: Vec::new(),
        draining: false,
    });
    step1(&mut sim, x, mark, usize::MAX, None);
    if sim[x].max() >= cl.max() - EPS {
        return false;
    }
    let load: f64 = cl.nodes.iter().map(NodeSt::load).sum();
    let total_cap: f64 = cl.nodes.iter().map(|n| n.cap).sum();
    // Enough nodes to bring the average under the mark (at least one).
    let need = ((load / mark - total_cap) / cap).ceil().max(1.0);
    let nodes = if need.is_finite() && need < 1e6 {
        need as usize
    } else {
        1
    };
    let projected = load / (total_cap + nodes as f64 * cap);
    let action = Action::GrowCluster {
        cluster: cl.id.clone(),
        nodes,
        node_capacity: cap,
        utilisation: cl.avg(),
        projected_utilisation: projected,
    };
    let reason = format!(
        "cluster {} stays over the {} mark (hottest node {}) and no cluster can lend a \
         node without going over it; start {nodes} node(s) of capacity {cap:.3} (average \
         {} → {})",
        cl.id,
        pct(mark),
        pct(cl.max()),
        pct(cl.avg()),
        pct(projected)
    );
    p.push(action, reason);
    true
}

fn why_stuck(cl: &ClusterSt, cfg: &SchedulerConfig) -> String {
    let hot = cl.nodes.iter().max_by(|a, b| a.util().total_cmp(&b.util()));
    let Some(hot) = hot else {
        return "the cluster has no nodes".into();
    };
    if hot.vips.len() <= 1 {
        return format!(
            "node {} carries its overload on {} vIP(s); moving its last vIP would only move \
             the overload: the traffic behind it needs more vIPs (a larger group) or a \
             bigger node",
            hot.id,
            hot.vips.len()
        );
    }
    if !cfg.can_start_nodes {
        return format!(
            "no vIP of {} fits under the {} mark on another node, no cluster can lend a \
             node, and starting nodes is not allowed",
            hot.id,
            pct(cfg.high_water)
        );
    }
    format!(
        "no vIP of {} fits under the {} mark on another node, even a new one: a single \
         vIP carries more than a node can take",
        hot.id,
        pct(cfg.high_water)
    )
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    fn node(id: &str, load: f64, vips: &[&str]) -> MipNode {
        MipNode {
            id: id.into(),
            load,
            capacity: 1.0,
            vips: vips
                .iter()
                .map(|v| MipVip {
                    id: (*v).into(),
                    load: None,
                })
                .collect(),
            draining: false,
        }
    }

    fn cluster(id: &str, nodes: Vec<MipNode>) -> MipCluster {
        MipCluster {
            id: id.into(),
            nodes,
        }
    }

    /// Both nodes at 90% with three vIPs each: no vIP move inside the cluster helps.
    fn hot() -> MipCluster {
        cluster(
            "hot",
            vec![
                node("h1", 0.9, &["a1", "a2", "a3"]),
                node("h2", 0.9, &["a4", "a5", "a6"]),
            ],
        )
    }

    /// A scheduler that may not start nodes.
    fn no_start() -> SchedulerConfig {
        SchedulerConfig {
            can_start_nodes: false,
            ..Default::default()
        }
    }

    /// Applies a plan's actions to the input, independently of the planner, and checks
    /// at each step that the maximum never rises and every vIP has one owner. Returns
    /// the final per-node loads.
    fn replay(clusters: &[MipCluster], plan: &Plan, mark: f64) -> HashMap<String, f64> {
        // node -> (cluster, cap, base, vips with loads)
        let mut where_: HashMap<String, String> = HashMap::new();
        let mut cap: HashMap<String, f64> = HashMap::new();
        let mut base: HashMap<String, f64> = HashMap::new();
        let mut owner: HashMap<(String, String), String> = HashMap::new();
        let mut vload: HashMap<(String, String), f64> = HashMap::new();
        for c in clusters {
            for n in &c.nodes {
                let s = split(n);
                where_.insert(n.id.clone(), c.id.clone());
                cap.insert(n.id.clone(), n.capacity);
                base.insert(n.id.clone(), s.base);
                for (v, l) in s.vips {
                    let key = (c.id.clone(), v);
                    assert!(owner.insert(key.clone(), n.id.clone()).is_none());
                    vload.insert(key, l);
                }
            }
        }
        let vip_count = owner.len();
        let loads = |owner: &HashMap<(String, String), String>| {
            let mut l: HashMap<String, f64> = base.clone();
            for (k, n) in owner {
                *l.get_mut(n).unwrap() += vload[k];
            }
            l
        };
        let max_util =
            |l: &HashMap<String, f64>| l.iter().map(|(n, x)| x / cap[n]).fold(0.0, f64::max);
        let mut prev = max_util(&loads(&owner));
        assert!((prev - plan.max_utilisation_before).abs() < 1e-9);
        for s in &plan.steps {
            match &s.action {
                Action::MoveVip {
                    cluster,
                    vip,
                    from,
                    to,
                    ..
                } => {
                    let key = (cluster.clone(), vip.clone());
                    assert_eq!(owner.get(&key), Some(from), "{s:?}");
                    assert_eq!(where_[from], *cluster);
                    assert_eq!(where_[to], *cluster);
                    owner.insert(key, to.clone());
                    // A step-1 receiver ends under the mark.
                    let l = loads(&owner);
                    assert!(l[to] / cap[to] <= mark + 1e-9, "{s:?}");
                }
                Action::MoveNode {
                    node,
                    from_cluster,
                    to_cluster,
                    ..
                } => {
                    assert_eq!(where_[node], *from_cluster);
                    assert!(
                        owner.values().all(|n| n != node),
                        "node moves with vIPs: {s:?}"
                    );
                    where_.insert(node.clone(), to_cluster.clone());
                }
                Action::GrowCluster { .. } => {}
            }
            let now = max_util(&loads(&owner));
            assert!(now <= prev + 1e-9, "max rose {prev} → {now} at {s:?}");
            assert!((now - s.max_utilisation).abs() < 1e-9, "{s:?}");
            prev = now;
        }
        assert_eq!(owner.len(), vip_count);
        assert!((prev - plan.max_utilisation_after).abs() < 1e-9);
        loads(&owner)
    }

    #[test]
    fn an_overloaded_node_sheds_vips_to_the_lightest() {
        let cs = vec![cluster(
            "a",
            vec![
                node("n1", 0.95, &["v1", "v2", "v3", "v4"]),
                node("n2", 0.5, &["v5", "v6"]),
                node("n3", 0.2, &["v7"]),
            ],
        )];
        let plan = schedule(&cs, &SchedulerConfig::default()).unwrap();
        assert!(!plan.steps.is_empty());
        match &plan.steps[0].action {
            Action::MoveVip {
                from, to, vip_load, ..
            } => {
                assert_eq!((from.as_str(), to.as_str()), ("n1", "n3"));
                // Even split: 0.95 over 4 vIPs.
                assert!((vip_load - 0.2375).abs() < 1e-12);
            }
            other => panic!("{other:?}"),
        }
        assert!(plan.max_utilisation_after <= 0.8);
        assert!(plan.unresolved.is_empty());
        replay(&cs, &plan, 0.8);
        assert!(plan.steps[0].reason.contains("n1") && plan.steps[0].reason.contains("80%"));
    }

    #[test]
    fn balanced_clusters_yield_nothing() {
        let cs = vec![
            cluster(
                "a",
                vec![node("n1", 0.6, &["v1"]), node("n2", 0.7, &["v2"])],
            ),
            cluster("b", vec![node("n3", 0.1, &["v1", "v2"])]),
        ];
        let plan = schedule(&cs, &SchedulerConfig::default()).unwrap();
        assert!(plan.is_empty() && plan.unresolved.is_empty());
        assert_eq!(plan.max_utilisation_before, plan.max_utilisation_after);
    }

    #[test]
    fn moves_that_would_overload_the_receiver_are_refused() {
        // Each vIP is 0.45; the light node at 0.4 would reach 0.85.
        let cs = vec![cluster(
            "a",
            vec![node("n1", 0.9, &["v1", "v2"]), node("n2", 0.4, &["v3"])],
        )];
        let plan = schedule(&cs, &no_start()).unwrap();
        assert!(plan.steps.is_empty());
        assert_eq!(plan.unresolved.len(), 1);
        assert_eq!(plan.unresolved[0].node, "n1");
    }

    #[test]
    fn the_last_vip_stays() {
        let cs = vec![cluster(
            "a",
            vec![node("n1", 0.95, &["v1"]), node("n2", 0.0, &[])],
        )];
        let plan = schedule(&cs, &SchedulerConfig::default()).unwrap();
        assert!(plan.steps.is_empty());
        assert!(
            plan.unresolved[0].reason.contains("last vIP"),
            "{:?}",
            plan.unresolved
        );
    }

    #[test]
    fn an_all_overloaded_cluster_borrows_a_node_from_a_light_cluster() {
        let cs = vec![
            hot(),
            cluster(
                "warm",
                vec![node("w1", 0.5, &["b1", "b2"]), node("w2", 0.5, &["b3"])],
            ),
            cluster(
                "cold",
                vec![
                    node("c1", 0.1, &["c1v", "c2v"]),
                    node("c2", 0.2, &["c3v"]),
                    node("c3", 0.1, &["c4v"]),
                ],
            ),
        ];
        let plan = schedule(&cs, &SchedulerConfig::default()).unwrap();
        let mv: Vec<&Step> = plan
            .steps
            .iter()
            .filter(|s| matches!(s.action, Action::MoveNode { .. }))
            .collect();
        assert_eq!(mv.len(), 1, "{plan:#?}");
        match &mv[0].action {
            Action::MoveNode {
                from_cluster,
                to_cluster,
                node,
                ..
            } => {
                assert_eq!(
                    (from_cluster.as_str(), to_cluster.as_str()),
                    ("cold", "hot")
                );
                // The least-loaded node of the coldest cluster, ties by id.
                assert_eq!(node, "c1");
            }
            _ => unreachable!(),
        }
        assert!(plan.max_utilisation_after <= 0.8 + 1e-9, "{plan:#?}");
        let loads = replay(&cs, &plan, 0.8);
        assert!(loads["c1"] > 0.0, "the borrowed node took vIPs in hot");
    }

    #[test]
    fn with_no_node_to_spare_the_cluster_grows() {
        let cs = vec![
            hot(),
            // One node: nothing to lend.
            cluster("solo", vec![node("s1", 0.1, &["b1"])]),
            // Lending would overload the rest.
            cluster(
                "busy",
                vec![
                    node("b1", 0.7, &["x1", "x2"]),
                    node("b2", 0.7, &["x3", "x4"]),
                ],
            ),
        ];
        let plan = schedule(&cs, &SchedulerConfig::default()).unwrap();
        assert_eq!(plan.steps.len(), 1, "{plan:#?}");
        match &plan.steps[0].action {
            Action::GrowCluster {
                cluster,
                nodes,
                projected_utilisation,
                ..
            } => {
                assert_eq!(cluster, "hot");
                // 1.8 of load over 2 + m nodes ≤ 0.8 → m = 1 (0.6).
                assert_eq!(*nodes, 1);
                assert!((projected_utilisation - 0.6).abs() < 1e-9);
            }
            other => panic!("{other:?}"),
        }
        replay(&cs, &plan, 0.8);
        let plan = schedule(&cs, &no_start()).unwrap();
        assert!(plan.steps.is_empty());
        assert_eq!(plan.unresolved[0].cluster, "hot");
    }

    #[test]
    fn known_vip_loads_are_used_and_the_rest_stays() {
        let mut n1 = node("n1", 0.9, &["v1", "v2", "v3"]);
        n1.vips[0].load = Some(0.5);
        n1.vips[1].load = Some(0.1);
        n1.vips[2].load = Some(0.1);
        // 0.2 of n1's load is no vIP's.
        let cs = vec![cluster("a", vec![n1, node("n2", 0.1, &["v4"])])];
        let plan = schedule(&cs, &SchedulerConfig::default()).unwrap();
        // Best pair max: moving v1 (0.5) leaves max(0.4, 0.6) = 0.6; v2 leaves 0.8.
        match &plan.steps[0].action {
            Action::MoveVip { vip, .. } => assert_eq!(vip, "v1"),
            other => panic!("{other:?}"),
        }
        let p = &plan.clusters[0].nodes[0];
        assert!((p.load - 0.4).abs() < 1e-12, "{p:?}");
        replay(&cs, &plan, 0.8);
    }

    #[test]
    fn draining_nodes_receive_nothing() {
        let mut d = node("n2", 0.0, &[]);
        d.draining = true;
        let cs = vec![cluster("a", vec![node("n1", 0.9, &["v1", "v2"]), d])];
        let plan = schedule(&cs, &no_start()).unwrap();
        assert!(plan.steps.is_empty());
    }

    #[test]
    fn bad_input_is_named() {
        let field = |cs: &[MipCluster], cfg: SchedulerConfig| match schedule(cs, &cfg) {
            Err(PlaceError::Invalid { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        let ok = || vec![cluster("a", vec![node("n1", 0.5, &["v1"])])];
        let d = SchedulerConfig::default();
        assert_eq!(
            field(
                &ok(),
                SchedulerConfig {
                    high_water: 1.5,
                    ..d
                }
            ),
            "high_water"
        );
        let mut cs = ok();
        cs[0].nodes[0].load = -1.0;
        assert_eq!(field(&cs, d), "clusters[0].nodes[0].load");
        let mut cs = ok();
        cs[0].nodes[0].capacity = 0.0;
        assert_eq!(field(&cs, d), "clusters[0].nodes[0].capacity");
        let mut cs = ok();
        cs[0].nodes.push(node("n2", 0.1, &["v1"]));
        assert_eq!(field(&cs, d), "clusters[0].nodes[1].vips[0].id");
        let mut cs = ok();
        cs.push(cluster("b", vec![node("n1", 0.1, &["v1"])]));
        assert_eq!(field(&cs, d), "clusters[1].nodes[0].id");
        let mut cs = ok();
        cs.push(cluster("a", vec![]));
        assert_eq!(field(&cs, d), "clusters[1].id");
        let mut cs = ok();
        cs[0].nodes[0].vips[0].load = Some(f64::INFINITY);
        assert_eq!(field(&cs, d), "clusters[0].nodes[0].vips[0].load");
        assert_eq!(
            field(
                &ok(),
                SchedulerConfig {
                    new_node_capacity: Some(0.0),
                    ..d
                }
            ),
            "new_node_capacity"
        );
    }

    #[test]
    fn plans_round_trip_as_json() {
        let cs = vec![cluster(
            "a",
            vec![node("n1", 0.95, &["v1", "v2"]), node("n2", 0.1, &["v3"])],
        )];
        let plan = schedule(&cs, &SchedulerConfig::default()).unwrap();
        let s = serde_json::to_string(&plan).unwrap();
        assert!(s.contains(r#""action":"move_vip""#), "{s}");
        assert_eq!(serde_json::from_str::<Plan>(&s).unwrap(), plan);
    }

    fn arb_clusters() -> impl Strategy<Value = Vec<MipCluster>> {
        // Up to 4 clusters of up to 5 nodes, each with up to 5 vIPs, some with known
        // loads; capacities 0.5–2.
        // Utilisations mostly under 1, so some clusters can lend nodes (step 2).
        let vip = (any::<bool>(), 0.0..0.4f64);
        let node = (
            0.0..1.3f64,
            0.5..2.0f64,
            prop::collection::vec(vip, 0..5),
            any::<bool>(),
        );
        prop::collection::vec(prop::collection::vec(node, 1..6), 1..5).prop_map(|cs| {
            let mut nid = 0;
            cs.into_iter()
                .enumerate()
                .map(|(ci, nodes)| MipCluster {
                    id: format!("c{ci}"),
                    nodes: nodes
                        .into_iter()
                        .map(|(u, cap, vips, drain)| {
                            nid += 1;
                            MipNode {
                                id: format!("n{nid}"),
                                load: u * cap,
                                capacity: cap,
                                vips: vips
                                    .into_iter()
                                    .enumerate()
                                    .map(|(vi, (known, l))| MipVip {
                                        id: format!("v{nid}-{vi}"),
                                        load: known.then_some(l * cap),
                                    })
                                    .collect(),
                                // Few draining nodes.
                                draining: drain && nid % 4 == 0,
                            }
                        })
                        .collect(),
                })
                .collect()
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn max_never_rises_and_vips_keep_one_owner(
            cs in arb_clusters(),
            mark in 0.5..1.0f64,
            grow in any::<bool>(),
        ) {
            let cfg = SchedulerConfig { high_water: mark, can_start_nodes: grow, ..Default::default() };
            let plan = schedule(&cs, &cfg).unwrap();
            replay(&cs, &plan, mark);
            prop_assert!(plan.max_utilisation_after <= plan.max_utilisation_before + 1e-9);
            // Every projected vIP appears once, in its own cluster's nodes.
            let before: usize = cs.iter().flat_map(|c| &c.nodes).map(|n| n.vips.len()).sum();
            let after: usize = plan.clusters.iter().flat_map(|c| &c.nodes).map(|n| n.vips.len()).sum();
            prop_assert_eq!(before, after);
            // Nothing to do when nothing is over the mark.
            if plan.max_utilisation_before <= mark {
                prop_assert!(plan.steps.is_empty());
            }
            // Running the scheduler again on its own projection changes nothing more
            // than the first run could not: no node it relieved is overloaded again.
            if plan.unresolved.is_empty()
                && !plan.steps.iter().any(|s| matches!(s.action, Action::GrowCluster { .. }))
            {
                prop_assert!(plan.max_utilisation_after <= mark + 1e-9);
            }
        }
    }
}
