//! SC scale-out and scale-in (paper 000 §4.1, Fig. 3), FM's side. The protocol, who owns
//! what when, and the failure cases are in docs/scaling.md; in short:
//!
//! - **st.** FM sends `ScaleStart` to the old owner's head, which stamps it as an op: at
//!   that sequence number every replica splits the part off (the moved flows' state and
//!   half of the free shared state, e.g. NAT ports) and keeps a copy until the scale
//!   ends. The old owner keeps serving the moved range, with its own half, for new flows
//!   only; flows whose state left with the part are refused (`sc-moved`) and parked
//!   here until the switch.
//! - **Install.** The old owner's tail reports the part (so only once the split is
//!   committed); FM relays it to the new owner's head as `ScaleInstall`. Dispatch does
//!   not change: nothing waits behind the install.
//! - **fin, switch.** The new owner's tail reports the install; FM switches dispatch and
//!   sends `ScaleEnd` to the old owner, whose op hands over the *delta* (what it decided
//!   in the moved range after st). FM relays it to the new owner as a merge op
//!   (`ScaleInstall{delta}`). Until that merge is applied FM answers the flows the old
//!   owner decided after st from pinned cache entries, so they never reach the new
//!   owner before their state does.
//!
//! FM relays parts (rather than SC sending them SC→SC) because FM is the one place that
//! orders them against requests: it owns both the dispatch switch and the stream to
//! each head. The cost is one extra hop for the bytes.

use std::collections::HashSet;
use std::time::Duration;

use pipeline::FlowKey;
use proto::v1::{self, sc_down};
use serde_json::json;
use tracing::{info, warn};

use super::{CacheKey, Master, Out};
use crate::events::EventKind;

/// Re-send a step whose outcome FM has not heard within this (a lost head, a slow
/// group). Steps are idempotent by scale id at SC.
const RESEND_MS: u64 = 2_000;
/// Abort a scale that has not reached fin within this.
const TIMEOUT_MS: u64 = 30_000;

/// An operator's scaling request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleRequest {
    /// Split a partition of (tenant, chain): the one `group` owns, or the busiest.
    Out {
        tenant: u32,
        chain: u32,
        group: Option<u64>,
    },
    /// Merge the partition `group` owns (or the newest) into an adjacent one.
    In {
        tenant: u32,
        chain: u32,
        group: Option<u64>,
    },
}

/// How a scale ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScaleOutcome {
    pub scale_id: u64,
    pub kind: v1::ScaleKind,
    /// The old owner (scale-out: the split group; scale-in: the retired group).
    pub from_group: u64,
    /// The new owner (scale-out: the new group; scale-in: the neighbour).
    pub to_group: u64,
    /// The key-hash range that moved, inclusive.
    pub moved_lo: u64,
    pub moved_hi: u64,
    /// None: done, dispatch switched. Some: aborted (dispatch is as before), and why.
    pub aborted: Option<String>,
    /// From FM sending st to FM receiving fin (or the abort).
    pub st_to_fin: Duration,
}

impl ScaleOutcome {
    pub fn to_proto(&self) -> v1::ScaleReply {
        v1::ScaleReply {
            scale_id: self.scale_id,
            kind: self.kind as i32,
            from_group: self.from_group,
            to_group: self.to_group,
            moved_lo: self.moved_lo,
            moved_hi: self.moved_hi,
            aborted: self.aborted.clone().unwrap_or_default(),
            st_to_fin_us: self.st_to_fin.as_micros() as u64,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// st sent to the old owner; waiting for its part.
    Splitting,
    /// Part relayed to the new owner; waiting for fin. Dispatch is unchanged.
    Installing,
    /// fin: dispatch switched, end step sent to the old owner; waiting for its delta.
    HandingOver,
    /// Delta relayed to the new owner; waiting for its merge. Pins stay until then.
    Merging,
    /// Before fin: waiting for the old owner to take its part back.
    Aborting,
}

impl Phase {
    /// Before fin: the scale can still be aborted, and dispatch is as before it.
    fn before_fin(self) -> bool {
        matches!(self, Phase::Splitting | Phase::Installing)
    }
}

pub(super) struct ScaleJob {
    id: u64,
    pub(super) kind: v1::ScaleKind,
    pub(super) tenant: u32,
    pub(super) chain: u32,
    pub(super) from: u64,
    pub(super) to: u64,
    moved: (u64, u64),
    /// The old owner's and the new owner's ranges after the switch.
    from_after: Option<(u64, u64)>,
    to_after: (u64, u64),
    phase: Phase,
    part: Option<Vec<u8>>,
    delta: Option<Vec<u8>>,
    started_us: u64,
    /// st → fin, once fin arrived.
    fin_us: Option<u64>,
    started_ms: u64,
    sent_ms: u64,
    /// Its requester has been told how it ended (see `Master::answer_scale`).
    answered: bool,
    aborted: Option<String>,
}

impl ScaleJob {
    fn outcome(&self, now_us: u64) -> ScaleOutcome {
        ScaleOutcome {
            scale_id: self.id,
            kind: self.kind,
            from_group: self.from,
            to_group: self.to,
            moved_lo: self.moved.0,
            moved_hi: self.moved.1,
            aborted: self.aborted.clone(),
            st_to_fin: Duration::from_micros(
                self.fin_us
                    .unwrap_or_else(|| now_us.saturating_sub(self.started_us)),
            ),
        }
    }
}

/// A scale's fields for an event's detail, plus `extra`'s.
fn job_detail(j: &ScaleJob, extra: serde_json::Value) -> serde_json::Value {
    let mut d = json!({
        "scale": j.id,
        "kind": if j.kind == v1::ScaleKind::Out { "out" } else { "in" },
        "tenant": j.tenant,
        "chain": j.chain,
        "from_group": j.from,
        "to_group": j.to,
        "moved_lo": j.moved.0,
        "moved_hi": j.moved.1,
    });
    if let (Some(d), serde_json::Value::Object(x)) = (d.as_object_mut(), extra) {
        d.extend(x);
    }
    d
}

/// The step that installs `part` at the new (or absorbing) group: the part at *fin*, or
/// the delta after the hand-over.
fn install(j: &ScaleJob, part: Option<&Vec<u8>>, delta: bool) -> sc_down::Msg {
    sc_down::Msg::Install(v1::ScaleInstall {
        scale_id: j.id,
        kind: j.kind as i32,
        group: j.to,
        part: part.cloned().unwrap_or_default(),
        range_lo: j.to_after.0,
        range_hi: j.to_after.1,
        delta,
    })
}

/// The old group's end op: hand over (and narrow its range), or merge the part back.
fn end(j: &ScaleJob, abort: bool) -> sc_down::Msg {
    sc_down::Msg::End(v1::ScaleEnd {
        scale_id: j.id,
        group: j.from,
        abort,
    })
}

impl Master {
    /// Record an event about scale `id` (which must still be under way).
    fn scale_event(&mut self, id: u64, kind: EventKind, what: String) {
        let Some(j) = self.scales.get(&id) else {
            return;
        };
        let verb = if j.kind == v1::ScaleKind::Out {
            "scale-out"
        } else {
            "scale-in"
        };
        let message = format!(
            "{verb} {id} of tenant {} chain {}: group {} -> group {}: {what}",
            j.tenant, j.chain, j.from, j.to
        );
        let mut extra = json!({ "to_replicas": self.replica_ids(j.to) });
        if let Some(r) = &j.aborted {
            extra["reason"] = json!(r);
        }
        let detail = job_detail(j, extra);
        self.event(kind, message, detail);
    }

    /// Start the scale `req` asks for: its id, or why FM refused.
    pub(super) fn scale_request(&mut self, req: ScaleRequest) -> Result<u64, String> {
        let r = match req {
            ScaleRequest::Out {
                tenant,
                chain,
                group,
            } => self.start_out(tenant, chain, group),
            ScaleRequest::In {
                tenant,
                chain,
                group,
            } => self.start_in(tenant, chain, group),
        };
        if let Err(e) = &r {
            warn!(error = %e, "scale refused");
            let (kind, tenant, chain, group) = match req {
                ScaleRequest::Out {
                    tenant,
                    chain,
                    group,
                } => ("out", tenant, chain, group),
                ScaleRequest::In {
                    tenant,
                    chain,
                    group,
                } => ("in", tenant, chain, group),
            };
            self.event(
                EventKind::ScaleRefused,
                format!("scale-{kind} of tenant {tenant} chain {chain} refused: {e}"),
                json!({"kind": kind, "tenant": tenant, "chain": chain, "group": group, "reason": e}),
            );
        }
        r
    }

    /// Tell scale `j`'s requester how it ended, once.
    fn answer_scale(&mut self, j: &mut ScaleJob, now_us: u64) {
        if !std::mem::replace(&mut j.answered, true) {
            self.out.push(Out::Scaled(j.outcome(now_us)));
        }
    }

    fn check_chain(&self, tenant: u32, chain: u32) -> Result<(), String> {
        if !self
            .chains
            .iter()
            .any(|c| c.tenant == tenant && c.chain == chain)
        {
            return Err(format!("FM serves no chain {chain} of tenant {tenant}"));
        }
        if let Some(j) = self
            .scales
            .values()
            .find(|j| j.tenant == tenant && j.chain == chain)
        {
            return Err(format!(
                "scale {} of tenant {tenant} chain {chain} is still under way",
                j.id
            ));
        }
        if !self.map.has_chain(tenant, chain) {
            return Err(format!("tenant {tenant} chain {chain} has no SC group yet"));
        }
        Ok(())
    }

    fn start_out(&mut self, tenant: u32, chain: u32, group: Option<u64>) -> Result<u64, String> {
        self.check_chain(tenant, chain)?;
        let ranges = self.map.chain_ranges(tenant, chain);
        let (lo, hi, from) = match group {
            Some(g) => *ranges.iter().find(|r| r.2 == g).ok_or_else(|| {
                format!("group {g} owns no partition of tenant {tenant} chain {chain}")
            })?,
            // The busiest: most requests dispatched to it so far.
            None => *ranges
                .iter()
                .filter(|r| r.0 < r.1)
                .max_by_key(|r| {
                    (
                        self.group_load.get(&r.2).copied().unwrap_or(0),
                        std::cmp::Reverse(r.2),
                    )
                })
                .ok_or("no partition of the chain is wide enough to split")?,
        };
        if lo >= hi {
            return Err(format!(
                "group {from}'s partition is the single hash {lo}; it cannot split"
            ));
        }
        if self.map.group(from).is_none_or(|g| g.head().is_none()) {
            return Err(format!("group {from} has no live head"));
        }
        // The new group's members: live SC nodes in none of the chain's groups, so that
        // one node failing never takes a replica of both halves.
        let used: HashSet<String> = self
            .map
            .groups()
            .filter(|g| g.partition.tenant == tenant && g.partition.chain == chain)
            .flat_map(|g| g.group.replicas.iter().map(|r| r.node_id.clone()))
            .collect();
        let mut spares: Vec<(usize, String, String)> = self
            .members
            .live(v1::Role::Sc)
            .filter(|m| self.sc_by_node.contains_key(&m.info.id) && !used.contains(&m.info.id))
            // Shuffle sharding: a tenant's new group stays inside its shard set.
            .filter(|m| self.in_shard_set(tenant, &m.info.id))
            .map(|m| {
                (
                    self.map.groups_of(&m.info.id).len(),
                    m.info.id.clone(),
                    m.info.addr.clone(),
                )
            })
            .collect();
        if spares.len() < self.cfg.replicas {
            return Err(format!(
                "scale-out of tenant {tenant} chain {chain} needs {} live SC nodes outside \
                 the chain's groups (and inside its shard set, if it has one); {} available",
                self.cfg.replicas,
                spares.len()
            ));
        }
        spares.sort();
        let replicas: Vec<v1::Replica> = spares
            .into_iter()
            .take(self.cfg.replicas)
            .map(|(_, node_id, addr)| v1::Replica { node_id, addr })
            .collect();
        // The lower half moves (SplitHalf's exclusive upper bound can always name it).
        let mid = lo + (hi - lo) / 2 + 1;
        let moved = (lo, mid - 1);
        let id = self.next_scale;
        self.next_scale += 1;
        let to = self
            .map
            .create_detached(tenant, chain, moved.0, moved.1, replicas);
        if let Some(g) = self.map.group_mut(to) {
            g.awaiting_scale = id;
        }
        self.push_config(to);
        let job = ScaleJob {
            moved,
            from_after: Some((mid, hi)),
            to_after: moved,
            ..self.new_job(id, v1::ScaleKind::Out, tenant, chain, from, to)
        };
        self.scales.insert(id, job);
        info!(
            scale = id,
            tenant,
            chain,
            from,
            to,
            moved_lo = moved.0,
            moved_hi = moved.1,
            "scale-out: st"
        );
        self.scale_event(id, EventKind::ScScaleOutStart, "st sent".into());
        self.send_step(id);
        Ok(id)
    }

    /// Job `id` moving from group `from` to group `to`, at its first step and started
    /// now; its ranges (`moved`, `from_after`, `to_after`) are for the caller to set.
    fn new_job(
        &self,
        id: u64,
        kind: v1::ScaleKind,
        tenant: u32,
        chain: u32,
        from: u64,
        to: u64,
    ) -> ScaleJob {
        let now = self.now_ms();
        ScaleJob {
            id,
            kind,
            tenant,
            chain,
            from,
            to,
            moved: (0, 0),
            from_after: None,
            to_after: (0, 0),
            phase: Phase::Splitting,
            part: None,
            delta: None,
            started_us: self.now_us(),
            fin_us: None,
            started_ms: now,
            sent_ms: now,
            answered: false,
            aborted: None,
        }
    }

    fn start_in(&mut self, tenant: u32, chain: u32, group: Option<u64>) -> Result<u64, String> {
        self.check_chain(tenant, chain)?;
        let ranges = self.map.chain_ranges(tenant, chain);
        if ranges.len() < 2 {
            return Err(format!(
                "tenant {tenant} chain {chain} has one partition; there is nothing to merge"
            ));
        }
        let i = match group {
            Some(g) => ranges.iter().position(|r| r.2 == g).ok_or_else(|| {
                format!("group {g} owns no partition of tenant {tenant} chain {chain}")
            })?,
            // The newest partition.
            None => ranges
                .iter()
                .enumerate()
                .max_by_key(|(_, r)| r.2)
                .map(|(i, _)| i)
                .unwrap_or(0),
        };
        let (lo, hi, from) = ranges[i];
        // An adjacent neighbour, so the merged range is one contiguous range.
        let lower = i
            .checked_sub(1)
            .map(|j| ranges[j])
            .filter(|r| r.1.checked_add(1) == Some(lo));
        let upper = ranges
            .get(i + 1)
            .copied()
            .filter(|r| hi.checked_add(1) == Some(r.0));
        let Some((nlo, nhi, to)) = lower.or(upper) else {
            return Err(format!(
                "group {from}'s partition has no adjacent partition"
            ));
        };
        if self.map.group(from).is_none_or(|g| g.head().is_none()) {
            return Err(format!("group {from} has no live head"));
        }
        let id = self.next_scale;
        self.next_scale += 1;
        let job = ScaleJob {
            moved: (lo, hi),
            from_after: None,
            to_after: (lo.min(nlo), hi.max(nhi)),
            ..self.new_job(id, v1::ScaleKind::In, tenant, chain, from, to)
        };
        self.scales.insert(id, job);
        info!(scale = id, tenant, chain, from, to, "scale-in: st");
        self.scale_event(id, EventKind::ScScaleInStart, "st sent".into());
        self.send_step(id);
        Ok(id)
    }

    /// Send job `id`'s current step to the head of the group that must take it.
    pub(super) fn send_step(&mut self, id: u64) {
        let now = self.now_ms();
        let Some(j) = self.scales.get_mut(&id) else {
            return;
        };
        j.sent_ms = now;
        let (gid, msg) = match j.phase {
            Phase::Splitting => (
                j.from,
                sc_down::Msg::St(v1::ScaleStart {
                    scale_id: j.id,
                    kind: j.kind as i32,
                    from_group: j.from,
                    to_group: j.to,
                    moved_lo: j.moved.0,
                    moved_hi: j.moved.1,
                }),
            ),
            Phase::Installing => (j.to, install(j, j.part.as_ref(), false)),
            Phase::HandingOver => (j.from, end(j, false)),
            Phase::Merging => (j.to, install(j, j.delta.as_ref(), true)),
            Phase::Aborting => (j.from, end(j, true)),
        };
        self.send_to_head(gid, msg);
    }

    fn send_to_head(&mut self, gid: u64, msg: sc_down::Msg) {
        if let Some(head) = self.map.group(gid).and_then(|g| g.head()) {
            let node = head.node_id.clone();
            self.send_sc(&node, msg);
        }
    }

    /// Group `gid`'s head may have changed: repeat the steps it owes (they are
    /// idempotent), ahead of the requests FM re-submits to it.
    pub(super) fn scale_head_changed(&mut self, gid: u64) {
        let ids: Vec<u64> = self
            .scales
            .values()
            .filter(|j| match j.phase {
                Phase::Splitting | Phase::HandingOver | Phase::Aborting => j.from == gid,
                Phase::Installing | Phase::Merging => j.to == gid,
            })
            .map(|j| j.id)
            .collect();
        for id in ids {
            self.send_step(id);
        }
    }

    /// A replica of group `gid` died. Returns true if `gid` is a scale-out's new group
    /// before fin: the scale is aborted and the group dropped rather than repaired. It
    /// has decided nothing yet (dispatch only moves at fin), so nothing is lost, and
    /// repairing it would need a live member that holds the install (its joiners could
    /// otherwise wait forever for a snapshot); trying the scale again is cheaper and
    /// always safe. After fin the group serves, and is repaired like any other.
    pub(super) fn scale_group_lost(&mut self, gid: u64) -> bool {
        let Some((id, phase)) = self
            .scales
            .values()
            .find(|j| j.kind == v1::ScaleKind::Out && j.to == gid)
            .map(|j| (j.id, j.phase))
        else {
            return false;
        };
        if phase.before_fin() {
            self.abort_scale(id, format!("a replica of new group {gid} died before fin"));
        }
        phase.before_fin() || phase == Phase::Aborting
    }

    /// Results from a scale-out's new group whose scale is being aborted are not
    /// answers: the old owner takes the range back.
    pub(super) fn scale_ignores(&self, gid: u64) -> bool {
        self.dissolved.contains(&gid)
            || self
                .scales
                .values()
                .any(|j| j.kind == v1::ScaleKind::Out && j.to == gid && j.phase == Phase::Aborting)
    }

    /// Whether group `gid` is the old owner of a scale under way: a request sent to it
    /// is retried there, never at the new owner, since it may have decided it already
    /// (its answer then comes, or it refuses the key and FM redirects it).
    pub(super) fn scale_source(&self, gid: u64) -> bool {
        self.scales
            .values()
            .any(|j| j.from == gid && j.phase != Phase::Aborting)
    }

    /// The old owner of a scale under way decided flow `ck` (a rule, `reply`): if its key
    /// is in the moved range, pin the rule until the new owner has merged the delta, so
    /// the flow is answered here and never decided again by the new owner.
    pub(super) fn scale_pin(&mut self, gid: u64, ck: CacheKey, reply: &v1::RuleReply) {
        let h = FlowKey::from_bytes(ck.2).hash();
        let pinned = self.scales.values().any(|j| {
            j.from == gid
                && j.phase != Phase::Aborting
                && (j.tenant, j.chain) == (ck.0, ck.1)
                && j.moved.0 <= h
                && h <= j.moved.1
        });
        if pinned {
            self.pins.insert(ck, reply.clone());
        }
    }

    fn unpin(&mut self, tenant: u32, chain: u32, moved: (u64, u64)) {
        self.pins.retain(|k, _| {
            let h = FlowKey::from_bytes(k.2).hash();
            !((k.0, k.1) == (tenant, chain) && moved.0 <= h && h <= moved.1)
        });
    }

    /// A split or retire op's result: the part that left group `gid`.
    pub(super) fn on_scale_part(&mut self, gid: u64, part: v1::ScalePart) {
        let Some(j) = self.scales.get_mut(&part.scale_id) else {
            return;
        };
        if j.phase != Phase::Splitting || j.from != gid {
            return; // a repeat
        }
        let (id, from, to) = (j.id, j.from, j.to);
        j.part = Some(part.part);
        j.phase = Phase::Installing;
        // Dispatch stays as it is: the old owner keeps deciding new flows of the moved
        // range with its half, so nothing waits for the install.
        info!(
            scale = id,
            from,
            to,
            seq = part.seq,
            "split committed; relaying the part"
        );
        self.send_step(id);
    }

    /// An install, end or merge op's result.
    pub(super) fn on_scale_fin(&mut self, gid: u64, fin: v1::ScaleFin) {
        let Some(j) = self.scales.get(&fin.scale_id) else {
            return;
        };
        let id = j.id;
        match j.phase {
            Phase::Splitting if gid == j.from && !fin.error.is_empty() => {
                self.abort_scale(id, format!("group {gid} refused the split: {}", fin.error));
            }
            Phase::Installing if gid == j.to => {
                if fin.error.is_empty() {
                    self.switch_scale(id);
                } else {
                    self.abort_scale(id, format!("install at group {gid}: {}", fin.error));
                }
            }
            Phase::HandingOver if gid == j.from => {
                if !fin.error.is_empty() {
                    // Cannot be undone after the switch: what the old owner decided in
                    // the moved range since st stays there (its rules stay pinned
                    // until the merge step, then age out).
                    warn!(scale = id, group = gid, error = %fin.error, "hand-over failed");
                }
                self.on_delta(id, fin.delta);
            }
            Phase::Merging if gid == j.to => {
                if !fin.error.is_empty() {
                    warn!(scale = id, group = gid, error = %fin.error, "delta merge failed");
                }
                self.complete_scale(id);
            }
            Phase::Aborting if gid == j.from => {
                if !fin.error.is_empty() {
                    warn!(scale = id, group = gid, error = %fin.error, "abort step failed");
                }
                self.finish_abort(id);
            }
            _ => {}
        }
    }

    /// fin: the new owner holds the part. Switch dispatch, then ask the old owner for
    /// the delta (its end op comes before any request `flush` sends it afterwards, so
    /// every moved-range request it applies later is refused and redirected).
    fn switch_scale(&mut self, id: u64) {
        let now_us = self.now_us();
        let Some(j) = self.scales.get_mut(&id) else {
            return;
        };
        let us = now_us.saturating_sub(j.started_us);
        j.fin_us = Some(us);
        j.phase = Phase::HandingOver;
        j.part = None;
        let (kind, from, to) = (j.kind, j.from, j.to);
        let (from_after, to_after) = (j.from_after, j.to_after);
        self.stats.scale_last_us = us;
        self.stats.scale_total_us += us;
        match kind {
            v1::ScaleKind::Out => {
                self.stats.scale_outs += 1;
                if let Some(g) = self.map.group_mut(to) {
                    g.awaiting_scale = 0;
                }
            }
            _ => self.stats.scale_ins += 1,
        }
        self.map.set_range(from, from_after);
        self.map.set_range(to, Some(to_after));
        info!(
            scale = id,
            ?kind,
            from,
            to,
            st_to_fin_us = us,
            "fin; dispatch switched"
        );
        self.send_step(id);
        // Flows the old owner refused as already moved go to the new owner now.
        self.unpark();
    }

    /// The old owner's end op handed over `delta`.
    fn on_delta(&mut self, id: u64, delta: Vec<u8>) {
        let Some(j) = self.scales.get_mut(&id) else {
            return;
        };
        let (kind, from) = (j.kind, j.from);
        let empty = delta.is_empty();
        j.delta = Some(delta);
        j.phase = Phase::Merging;
        if kind == v1::ScaleKind::In {
            // The retired group handed over everything; its nodes are spares again.
            // Requests still on their way to it were applied after its end op (their
            // results would come after the delta), so it decided none of them: they go
            // to the new owner now rather than waiting to be retried.
            self.dissolve(from);
            let now = self.now_ms();
            let keys: Vec<CacheKey> = self
                .inflight
                .iter()
                .filter(|(_, f)| f.group == from)
                .map(|(k, _)| *k)
                .collect();
            for k in keys {
                let owner = self.map.lookup(k.0, k.1, FlowKey::from_bytes(k.2).hash());
                if let (Some(g), Some(f)) = (owner, self.inflight.get_mut(&k)) {
                    f.group = g;
                    f.sent_ms = now;
                    self.to_submit.entry(g).or_default().push(f.request.clone());
                }
            }
        }
        if empty {
            self.complete_scale(id);
        } else {
            self.send_step(id);
        }
    }

    fn complete_scale(&mut self, id: u64) {
        let Some(mut j) = self.scales.remove(&id) else {
            return;
        };
        // The new owner has everything the old one decided: cache entries may go.
        self.unpin(j.tenant, j.chain, j.moved);
        let now_us = self.now_us();
        let out = j.outcome(now_us);
        info!(scale = id, kind = ?j.kind, from = j.from, to = j.to,
              st_to_fin_us = out.st_to_fin.as_micros() as u64, "scale finished");
        let kind = if j.kind == v1::ScaleKind::Out {
            EventKind::ScScaleOutDone
        } else {
            EventKind::ScScaleInDone
        };
        let total_ms = self.now_ms().saturating_sub(j.started_ms);
        self.event(
            kind,
            format!(
                "scale {id} done: group {} -> group {}, st->fin {:.1} ms, {total_ms} ms in all",
                j.from,
                j.to,
                out.st_to_fin.as_secs_f64() * 1e3
            ),
            job_detail(
                &j,
                json!({"st_to_fin_us": out.st_to_fin.as_micros() as u64, "total_ms": total_ms}),
            ),
        );
        self.answer_scale(&mut j, now_us);
        self.unpark();
    }

    /// Give up on scale `id` (only before fin; dispatch never moved): the old owner
    /// takes its part back (an op, like the split). The caller is answered now.
    pub(super) fn abort_scale(&mut self, id: u64, reason: String) {
        let now_us = self.now_us();
        let Some(j) = self.scales.get_mut(&id) else {
            return;
        };
        if !j.phase.before_fin() {
            return;
        }
        warn!(scale = id, reason = %reason, "scale aborted");
        self.stats.scale_aborts += 1;
        j.phase = Phase::Aborting;
        j.aborted = Some(reason.clone());
        let answered = std::mem::replace(&mut j.answered, true);
        let out = j.outcome(now_us);
        let (tenant, chain, moved) = (j.tenant, j.chain, j.moved);
        self.scale_event(id, EventKind::ScaleAborted, format!("aborted: {reason}"));
        // Sent before any request `flush` sends the old owner afterwards, the parked
        // ones included: those it refused as moved it decides again once the part is
        // back, with the state that was there.
        self.send_step(id);
        if !answered {
            self.out.push(Out::Scaled(out));
        }
        self.unpin(tenant, chain, moved);
        self.unpark();
    }

    fn finish_abort(&mut self, id: u64) {
        let Some(j) = self.scales.remove(&id) else {
            return;
        };
        if j.kind == v1::ScaleKind::Out {
            self.dissolve(j.to);
        }
        info!(
            scale = id,
            from = j.from,
            "scale abort complete; old owner serves again"
        );
        self.unpark();
    }

    /// The chain is being torn down: its scales end with it.
    pub(super) fn drop_scales_of(&mut self, tenant: u32, chain: u32) {
        let ids: Vec<u64> = self
            .scales
            .values()
            .filter(|j| j.tenant == tenant && j.chain == chain)
            .map(|j| j.id)
            .collect();
        let now_us = self.now_us();
        for id in ids {
            if let Some(mut j) = self.scales.remove(&id) {
                self.unpin(j.tenant, j.chain, j.moved);
                j.aborted = Some("chain reconfigured".into());
                self.stats.scale_aborts += 1;
                self.event(
                    EventKind::ScaleAborted,
                    format!("scale {id} aborted: chain reconfigured"),
                    job_detail(&j, json!({"reason": "chain reconfigured"})),
                );
                self.answer_scale(&mut j, now_us);
            }
        }
    }

    /// Remove a group FM no longer needs and tell its members to drop it.
    pub(super) fn dissolve(&mut self, gid: u64) {
        if let Some(g) = self.map.remove(gid) {
            for r in &g.group.replicas {
                self.send_sc(
                    &r.node_id,
                    sc_down::Msg::Leave(v1::LeaveGroup {
                        group: gid,
                        epoch: g.group.epoch,
                    }),
                );
            }
        }
        self.to_submit.remove(&gid);
        self.events_to_submit.remove(&gid);
        self.group_progress.remove(&gid);
        self.group_load.remove(&gid);
        self.dissolved.insert(gid);
        info!(group = gid, "SC group dissolved; its nodes are spares");
    }

    /// Periodic: repeat steps nobody answered, abort scales that take too long.
    pub(super) fn scale_tick(&mut self, now: u64) {
        let ids: Vec<(u64, Phase, u64, u64)> = self
            .scales
            .values()
            .map(|j| (j.id, j.phase, j.started_ms, j.sent_ms))
            .collect();
        for (id, phase, started, sent) in ids {
            if phase.before_fin() && now.saturating_sub(started) > TIMEOUT_MS {
                self.abort_scale(id, format!("no fin within {} s", TIMEOUT_MS / 1000));
            } else if now.saturating_sub(sent) >= RESEND_MS {
                self.send_step(id);
            }
        }
        self.unpark();
    }

    /// A reply saying the group no longer (or not yet) serves the request's key.
    pub(super) fn redirect(&mut self, id: u64, from_group: u64, now: u64) {
        self.stats.scale_redirects += 1;
        let Some(ck) = self.by_id.get(&id).copied() else {
            return;
        };
        let Some(f) = self.inflight.get_mut(&ck) else {
            return;
        };
        if f.group != from_group {
            return; // already sent elsewhere
        }
        f.sent_ms = now;
        let key = FlowKey::from_bytes(ck.2);
        match self.map.lookup(ck.0, ck.1, key.hash()) {
            Some(g) if g != from_group => {
                f.group = g;
                self.to_submit.entry(g).or_default().push(f.request.clone());
            }
            // The old owner refused a flow whose state left with the part, and FM has
            // not switched yet: it goes to the new owner at the switch.
            _ => self.parked.push(ck),
        }
    }

    /// Send parked requests to whoever owns their key now.
    pub(super) fn unpark(&mut self) {
        if self.parked.is_empty() {
            return;
        }
        let now = self.now_ms();
        for ck in std::mem::take(&mut self.parked) {
            let Some(f) = self.inflight.get_mut(&ck) else {
                continue;
            };
            let key = FlowKey::from_bytes(ck.2);
            if let Some(g) = self.map.lookup(ck.0, ck.1, key.hash()) {
                f.group = g;
            }
            f.sent_ms = now;
            self.to_submit
                .entry(f.group)
                .or_default()
                .push(f.request.clone());
        }
    }
}
