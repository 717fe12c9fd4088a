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
//! - **Gradual (S6).** With [`Migration::Gradual`] the part at st is only half the free
//!   shared state, and names the flows that stayed (`pending`). After the switch and the
//!   end step, a request for one of those reaches the new owner, which refuses it
//!   (`sc-migrating`); FM parks it and sends a [`v1::ScalePull`] for its key to the old
//!   owner, relays the pulled state to the new owner as a merge op, and sends the
//!   request again once that is applied. Every pull also carries the next chunk of a
//!   background sweep over the moved range, so flows never accessed move too; the scale
//!   completes (and the old owner holds nothing of the range) after the last chunk.
//!   Requests for other flows never wait on a pull.
//!
//! FM relays parts (rather than SC sending them SC→SC) because FM is the one place that
//! orders them against requests: it owns both the dispatch switch and the stream to
//! each head. The cost is one extra hop for the bytes.

use std::collections::{BTreeSet, HashSet};
use std::time::Duration;

use pipeline::FlowKey;
use proto::v1::{self, sc_down};
use serde_json::json;
use tracing::{info, warn};

use super::{CacheKey, Master, Migration, Out};
use crate::events::EventKind;

/// Re-send a step whose outcome FM has not heard within this (a lost head, a slow
/// group). Steps are idempotent by scale id at SC.
const RESEND_MS: u64 = 2_000;
/// Abort a scale that has not reached fin within this.
const TIMEOUT_MS: u64 = 30_000;
/// A gradual scale-out's background sweep moves the range in this many chunks, one per
/// pull, so no single op carries more than about this fraction of the moved flows.
pub(super) const SWEEP_CHUNKS: u64 = 16;

/// An operator's scaling request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleRequest {
    /// Split a partition of (tenant, chain): the one `group` owns, or the busiest.
    Out {
        tenant: u32,
        chain: u32,
        group: Option<u64>,
        /// How the flows' state moves; None: `FmConfig::migration`.
        migration: Option<Migration>,
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
    /// Gradual, after the merge of the end step's list: flows move by pulls
    /// ([`ScaleJob::pull`]) until the sweep's last chunk is merged.
    Migrating,
}

/// A pull under way (gradual migration): sent to the old owner, then (once it reported
/// the parts) relayed to the new owner as a merge op.
#[derive(Debug, Clone)]
struct PullJob {
    id: u64,
    /// Keys first accessed at the new owner.
    keys: Vec<u64>,
    /// The sweep's chunk, inclusive.
    chunk: (u64, u64),
    last: bool,
    /// The old owner's parts, once reported: the merge step is next.
    parts: Option<Vec<Vec<u8>>>,
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
    /// S6's gradual migration (scale-out only).
    gradual: bool,
    /// Gradual: flows at the old owner, from its part (st) and its end step, for the
    /// new owner to refuse until pulled.
    pending: Vec<u64>,
    /// Gradual: keys the new owner refused, not yet in a pull; requests parked for
    /// them; the pull under way; the next pull's id; the sweep's next start.
    wanted: BTreeSet<u64>,
    waiting: Vec<CacheKey>,
    pull: Option<PullJob>,
    next_pull: u64,
    sweep_from: u64,
    /// Gradual, after the switch: the old owner's group was reset (its restarted last
    /// replica lost the state), so nothing more can be pulled. The new owner is told,
    /// by one last merge of nothing, to stop refusing the flows it was waiting for.
    source_lost: bool,
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
        pending: j.pending.clone(),
        ..Default::default()
    })
}

/// Gradual: the step pull `p` is at (the old owner's pull, or the new owner's merge).
fn pull_step(j: &ScaleJob, p: &PullJob) -> (u64, sc_down::Msg) {
    match &p.parts {
        None => (
            j.from,
            sc_down::Msg::Pull(v1::ScalePull {
                scale_id: j.id,
                group: j.from,
                pull: p.id,
                keys: p.keys.clone(),
                sweep: true,
                lo: p.chunk.0,
                hi: p.chunk.1,
                last: p.last,
            }),
        ),
        Some(parts) => (
            j.to,
            sc_down::Msg::Install(v1::ScaleInstall {
                scale_id: j.id,
                kind: j.kind as i32,
                group: j.to,
                range_lo: j.to_after.0,
                range_hi: j.to_after.1,
                pull: p.id,
                parts: parts.clone(),
                keys: p.keys.clone(),
                swept: true,
                swept_lo: p.chunk.0,
                swept_hi: p.chunk.1,
                last: p.last,
                ..Default::default()
            }),
        ),
    }
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
                migration,
            } => self.start_out(tenant, chain, group, migration),
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
                    ..
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

    fn start_out(
        &mut self,
        tenant: u32,
        chain: u32,
        group: Option<u64>,
        migration: Option<Migration>,
    ) -> Result<u64, String> {
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
            gradual: migration.unwrap_or(self.cfg.migration) == Migration::Gradual,
            sweep_from: moved.0,
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
            gradual: false,
            pending: Vec::new(),
            wanted: BTreeSet::new(),
            waiting: Vec::new(),
            pull: None,
            next_pull: 1,
            sweep_from: 0,
            source_lost: false,
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
                    gradual: j.gradual,
                }),
            ),
            Phase::Installing => (j.to, install(j, j.part.as_ref(), false)),
            Phase::HandingOver => (j.from, end(j, false)),
            Phase::Merging => (j.to, install(j, j.delta.as_ref(), true)),
            Phase::Aborting => (j.from, end(j, true)),
            Phase::Migrating => match &j.pull {
                Some(p) => pull_step(j, p),
                None => return,
            },
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
                Phase::Migrating => j.pull.as_ref().is_some_and(|p| pull_step(j, p).0 == gid),
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

    /// Whether flow `ck`, which group `gid` just decided (a rule), must be pinned: `gid`
    /// is the old owner of a scale under way and the key is in the moved range. FM then
    /// holds the rule until the new owner has merged the delta, so the flow is answered
    /// here and never decided again by the new owner.
    pub(super) fn scale_pinned(&self, gid: u64, ck: CacheKey) -> bool {
        if self.scales.is_empty() {
            return false;
        }
        let h = self.map.key_hash(ck.0, ck.1, &FlowKey::from_bytes(ck.2));
        self.scales.values().any(|j| {
            j.from == gid
                && j.phase != Phase::Aborting
                && (j.tenant, j.chain) == (ck.0, ck.1)
                && j.moved.0 <= h
                && h <= j.moved.1
        })
    }

    fn unpin(&mut self, tenant: u32, chain: u32, moved: (u64, u64)) {
        self.pins.retain(|k, _| {
            let h = self.map.key_hash(k.0, k.1, &FlowKey::from_bytes(k.2));
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
        j.pending = part.pending;
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
                if let Some(j) = self.scales.get_mut(&id).filter(|j| j.gradual) {
                    // The flows still at the old owner, those it decided since st
                    // among them: the merge step tells the new owner.
                    j.pending = fin.pending.clone();
                }
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
                if j.gradual {
                    self.start_migrating(id);
                } else {
                    self.complete_scale(id);
                }
            }
            Phase::Migrating => self.on_pull_fin(id, gid, fin),
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
        let empty = delta.is_empty() && j.pending.is_empty();
        let gradual = j.gradual;
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
                let owner = self.map.lookup_key(k.0, k.1, &FlowKey::from_bytes(k.2));
                if let (Some(g), Some(f)) = (owner, self.inflight.get_mut(&k)) {
                    f.group = g;
                    f.sent_ms = now;
                    self.to_submit.entry(g).or_default().push(f.request.clone());
                }
            }
        }
        if !empty {
            self.send_step(id);
        } else if gradual {
            self.start_migrating(id);
        } else {
            self.complete_scale(id);
        }
    }

    /// Gradual: the new owner knows every flow still at the old owner, so the pinned
    /// rules may go (a re-asked flow is refused there and pulled). Pulls start.
    fn start_migrating(&mut self, id: u64) {
        let Some(j) = self.scales.get_mut(&id) else {
            return;
        };
        j.phase = Phase::Migrating;
        j.pending = Vec::new();
        let (tenant, chain, moved) = (j.tenant, j.chain, j.moved);
        info!(scale = id, "gradual migration: pulls start");
        self.unpin(tenant, chain, moved);
        self.next_pull(id);
    }

    /// Gradual: start the next pull if none is under way: the keys first accessed since
    /// the last one, and the sweep's next chunk.
    fn next_pull(&mut self, id: u64) {
        let Some(j) = self.scales.get_mut(&id) else {
            return;
        };
        if j.phase != Phase::Migrating || j.pull.is_some() {
            return;
        }
        // Rounded up, so the range takes at most SWEEP_CHUNKS chunks.
        let width = (j.moved.1 - j.moved.0) / SWEEP_CHUNKS + 1;
        let lo = j.sweep_from.min(j.moved.1);
        let hi = if j.source_lost {
            j.moved.1
        } else {
            lo.saturating_add(width - 1).min(j.moved.1)
        };
        let last = hi >= j.moved.1;
        j.sweep_from = hi.saturating_add(1);
        j.pull = Some(PullJob {
            id: j.next_pull,
            keys: std::mem::take(&mut j.wanted).into_iter().collect(),
            chunk: (lo, hi),
            last,
            // With the old owner gone, the new owner merges nothing: what it waited for
            // is lost, and it decides those flows afresh.
            parts: j.source_lost.then(Vec::new),
        });
        j.next_pull += 1;
        self.stats.scale_pulls += 1;
        self.send_step(id);
    }

    /// Gradual: a pull's result from the old owner (relay it) or its merge at the new
    /// owner (send the requests that waited for it again, then the next pull).
    fn on_pull_fin(&mut self, id: u64, gid: u64, fin: v1::ScaleFin) {
        let Some(j) = self.scales.get_mut(&id) else {
            return;
        };
        let Some(p) = j.pull.as_mut().filter(|p| p.id == fin.pull) else {
            return; // a repeat, or stale
        };
        if !fin.error.is_empty() {
            warn!(scale = id, group = gid, pull = p.id, error = %fin.error, "pull step");
        }
        if p.parts.is_none() && gid == j.from {
            p.parts = Some(fin.parts);
            self.send_step(id);
            return;
        }
        if p.parts.is_none() || gid != j.to {
            return;
        }
        let Some(p) = j.pull.take() else {
            return;
        };
        let arrived: HashSet<u64> = p.keys.iter().copied().collect();
        let (chunk, last) = (p.chunk, p.last);
        let waiting = std::mem::take(&mut j.waiting);
        let (back, still): (Vec<CacheKey>, Vec<CacheKey>) = waiting.into_iter().partition(|ck| {
            let h = self.map.key_hash(ck.0, ck.1, &FlowKey::from_bytes(ck.2));
            last || arrived.contains(&h) || (chunk.0 <= h && h <= chunk.1)
        });
        j.waiting = still;
        self.parked.extend(back);
        if last {
            self.complete_scale(id);
        } else {
            self.next_pull(id);
        }
        self.unpark();
    }

    /// Gradual: the new owner `gid` refused request `id` because the flow's state is
    /// still at the old owner. Park it and have the key pulled.
    pub(super) fn migrating(&mut self, id: u64, gid: u64, now: u64) {
        let Some(ck) = self.by_id.get(&id).copied() else {
            return;
        };
        let Some(f) = self.inflight.get_mut(&ck) else {
            return;
        };
        if f.group != gid {
            return; // already sent elsewhere
        }
        f.sent_ms = now;
        let h = self.map.key_hash(ck.0, ck.1, &FlowKey::from_bytes(ck.2));
        let job = self.scales.values_mut().find(|j| {
            j.gradual
                && j.to == gid
                && (j.tenant, j.chain) == (ck.0, ck.1)
                && j.moved.0 <= h
                && h <= j.moved.1
        });
        match job {
            Some(j) => {
                j.wanted.insert(h);
                j.waiting.push(ck);
                let id = j.id;
                self.next_pull(id);
            }
            // The migration ended meanwhile: the new owner has the flow now.
            None => self.parked.push(ck),
        }
    }

    fn complete_scale(&mut self, id: u64) {
        let Some(mut j) = self.scales.remove(&id) else {
            return;
        };
        self.parked.append(&mut j.waiting);
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
                self.parked.append(&mut j.waiting);
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

    /// Group `gid` is about to be reset: its restarted last replica lost the state.
    /// End or steer every scale it is in, so that no scale waits forever on a step the
    /// group can no longer answer and no switch hands out a range FM then forms a fresh
    /// group over (two owners of a key hash).
    /// - Before fin, the new owner lost: the old owner takes its part back (an abort).
    /// - Before fin (or aborting), the old owner lost: nobody can take the part back or
    ///   hand it over; the scale ends, and a scale-out's new group (outside dispatch) is
    ///   dissolved.
    /// - After fin, the new owner lost: the scale ends; its range is formed afresh.
    /// - After fin, the old owner lost: its delta and unpulled flows are gone; the scale
    ///   goes on without them (an empty delta, then one last empty merge if gradual).
    pub(super) fn scale_group_reset(&mut self, gid: u64) {
        let ids: Vec<u64> = self
            .scales
            .values()
            .filter(|j| j.from == gid || j.to == gid)
            .map(|j| j.id)
            .collect();
        for id in ids {
            let Some(j) = self.scales.get(&id) else {
                continue;
            };
            let (phase, kind, from, to) = (j.phase, j.kind, j.from, j.to);
            let reason = format!("group {gid} reset: its restarted last replica lost the state");
            if phase.before_fin() && gid == to {
                self.abort_scale(id, reason);
            } else if phase.before_fin() || phase == Phase::Aborting {
                if gid == from {
                    self.end_scale(id, reason);
                    if kind == v1::ScaleKind::Out {
                        self.dissolve(to);
                    }
                }
                // Aborting, the new owner lost: the old owner still answers the abort,
                // and `finish_abort` dissolves the new group.
            } else if gid == to {
                self.end_scale(id, reason);
                if kind == v1::ScaleKind::In && self.map.group(from).is_some() {
                    // A retired group outside dispatch, its hand-over now pointless.
                    self.dissolve(from);
                }
            } else {
                warn!(scale = id, group = gid, "scale's old owner reset after the switch; its state is lost, the scale goes on without it");
                if let Some(j) = self.scales.get_mut(&id) {
                    j.source_lost = true;
                    if j.pull.as_ref().is_some_and(|p| p.parts.is_none()) {
                        j.pull = None; // asked of the old owner, which cannot answer
                    }
                }
                match phase {
                    Phase::HandingOver => self.on_delta(id, Vec::new()),
                    Phase::Migrating => self.next_pull(id),
                    _ => {}
                }
            }
        }
    }

    /// End scale `id` where it stands: neither owner is asked for anything more. Its
    /// requester is told it was aborted, for `reason`.
    fn end_scale(&mut self, id: u64, reason: String) {
        let Some(mut j) = self.scales.remove(&id) else {
            return;
        };
        warn!(scale = id, reason = %reason, "scale ended");
        self.stats.scale_aborts += 1;
        self.parked.append(&mut j.waiting);
        self.unpin(j.tenant, j.chain, j.moved);
        j.aborted = Some(reason.clone());
        self.event(
            EventKind::ScaleAborted,
            format!("scale {id} ended: {reason}"),
            job_detail(&j, json!({"reason": reason})),
        );
        let now_us = self.now_us();
        self.answer_scale(&mut j, now_us);
        self.unpark();
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
        match self.map.lookup_key(ck.0, ck.1, &key) {
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
            if let Some(g) = self.map.lookup_key(ck.0, ck.1, &key) {
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
