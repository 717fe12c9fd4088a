//! FM recovery: a new FM process (restarted on the same address, or a standby the PP
//! and SC nodes failed over to) rebuilds its partition map from what the SC nodes
//! report they host (docs/planes.md, "FM failover").
//!
//! FM keeps no state of its own anywhere but in memory. The SC replicas, though, each
//! hold their group's configuration (id, epoch, order, partition) and, in their log, the
//! range they serve now (a scale may have moved it from the configured one). That is
//! the partition map, spread over the nodes. So a new FM:
//! - adopts every group a node reports, with its id, epoch and order, and the range
//!   the replica's log says it serves; if another replica reports a newer epoch later,
//!   that order wins;
//! - creates no group, and holds requests with no group, for a window after the first
//!   SC node registered (the time FM would give a silent node before declaring it dead),
//!   so the nodes that have not reconnected yet can report;
//! - at the end of the window treats replicas of adopted groups that never registered
//!   as dead (the ordinary repair: survivors move up, spares join), forms groups for
//!   chains that still have none, and answers the held requests.

use proto::v1::{self, sc_down};
use tracing::{error, info, warn};

use super::{Master, Recovery};

impl Master {
    /// SC node `node` (session `session`) reports the groups it hosts.
    pub(super) fn on_hosted(&mut self, session: u64, node: &str, groups: Vec<v1::HostedGroup>) {
        if self.sc_by_node.get(node) != Some(&session) {
            return; // an old session's report
        }
        let adopting = self.recovery != Recovery::Done;
        let mut adopted = false;
        for h in groups {
            let Some(cfg) = h.config else {
                self.stats.bad_requests += 1;
                continue;
            };
            let (Some(g), Some(p)) = (cfg.group, cfg.partition) else {
                self.stats.bad_requests += 1;
                continue;
            };
            self.map.reserve_id(g.id);
            if !adopting {
                // FM owns the map; a node it had dropped is handled by `sc_returned`.
                continue;
            }
            let gid = g.id;
            if let Some(known) = self.map.group(gid) {
                if g.epoch > known.group.epoch {
                    info!(group = gid, epoch = g.epoch, %node, "a newer order of an adopted group");
                    self.map.replace_group(g, cfg.joining);
                    self.push_config(gid);
                    adopted = true;
                }
                continue;
            }
            if !h.serving {
                // A scale-out's new group that never got its install (it decided
                // nothing), or a group a scale-in retired (it handed everything over):
                // nothing to keep. The scale that made it is not resumed.
                info!(group = gid, %node, "reported group serves no range; told to leave");
                self.send_sc(
                    node,
                    sc_down::Msg::Leave(v1::LeaveGroup {
                        group: gid,
                        epoch: g.epoch,
                    }),
                );
                continue;
            }
            if !self
                .chains
                .iter()
                .any(|c| c.tenant == p.tenant && c.chain == p.chain)
            {
                warn!(group = gid, tenant = p.tenant, chain = p.chain, %node,
                      "reported group of a chain this FM does not serve; not adopted");
                continue;
            }
            let replicas: Vec<String> = g.replicas.iter().map(|r| r.node_id.clone()).collect();
            let epoch = g.epoch;
            match self.map.adopt(g, p, (h.range_lo, h.range_hi), cfg.joining) {
                Ok(()) => {
                    self.stats.groups_adopted += 1;
                    info!(group = gid, epoch, ?replicas, tenant = p.tenant, chain = p.chain,
                          hash_lo = h.range_lo, hash_hi = h.range_hi, %node, "SC group adopted");
                    if h.scale != 0 {
                        self.adopted_scales.insert(gid, h.scale);
                    }
                    self.push_config(gid);
                    adopted = true;
                }
                Err(e) => {
                    // Only while a scale was switching (both groups serve part of the
                    // moved range per their logs): the first report wins.
                    error!(group = gid, %node, error = %e, "reported group not adopted");
                    if let Some((_, _, other)) = self
                        .map
                        .chain_ranges(p.tenant, p.chain)
                        .into_iter()
                        .find(|(lo, hi, _)| h.range_lo <= *hi && *lo <= h.range_hi)
                    {
                        // That scale must not be aborted on a guess: its part may be
                        // in use by the group not adopted.
                        self.adopted_scales.remove(&other);
                    }
                }
            }
        }
        if adopted {
            // The node may head a group whose requests are waiting for it.
            self.release_held();
        }
    }

    /// The recovery window is over: FM owns the map from now on.
    pub(super) fn finish_recovery(&mut self) {
        self.recovery = Recovery::Done;
        let mut missing: Vec<String> = self
            .map
            .groups()
            .flat_map(|g| g.group.replicas.iter().map(|r| r.node_id.clone()))
            .filter(|n| !self.sc_by_node.contains_key(n))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        for n in &missing {
            warn!(node = %n, "replica of an adopted group did not register in time; treated as dead");
            self.sc_died(n);
        }
        // A scale under way when the old FM went is not resumed: give the part back to
        // the group that split it off (its new group, never installed, was told to leave).
        for (gid, scale) in std::mem::take(&mut self.adopted_scales) {
            let Some(head) = self.map.group(gid).and_then(|g| g.head()).cloned() else {
                continue;
            };
            warn!(
                group = gid,
                scale, "aborting a scale the previous FM left under way"
            );
            self.send_sc(
                &head.node_id,
                sc_down::Msg::End(v1::ScaleEnd {
                    scale_id: scale,
                    group: gid,
                    abort: true,
                }),
            );
        }
        info!(
            groups = self.map.groups().count(),
            adopted = self.stats.groups_adopted,
            missing = missing.len(),
            held = self.held.len(),
            "recovery window over"
        );
        self.ensure_groups();
        self.release_held();
    }

    /// Run the held requests again: now answered, queued for a group, or held on.
    pub(super) fn release_held(&mut self) {
        if self.held.is_empty() {
            return;
        }
        let held = std::mem::take(&mut self.held);
        let mut by_session: Vec<(u64, Vec<v1::RuleRequest>)> = Vec::new();
        for (s, r) in held {
            if !self.pp.contains_key(&s) {
                continue; // that PP session is gone; the node asks again on its new one
            }
            match by_session.last_mut() {
                Some((last, v)) if *last == s => v.push(r),
                _ => by_session.push((s, vec![r])),
            }
        }
        let now = self.now_ms();
        for (s, reqs) in by_session {
            self.on_requests(s, reqs, now);
        }
    }
}
