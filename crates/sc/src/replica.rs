//! One replica of an SC group: chain replication as a state machine without I/O.
//!
//! Paper 000's packet-pass-through (§3.2) is chain replication (van Renesse & Schneider,
//! OSDI '04) with the NF chain as the replicated state machine:
//! - The head takes requests from FM, turns each batch into an [`v1::Op`] stamped with
//!   the next sequence number, the group clock (`now_ms`) and a seed, applies it, and
//!   sends it on. NF code is deterministic in (state, request, env), so every replica
//!   applying the same ops in the same order holds the same state and computes the same
//!   rules (`nf::Chain::decide`).
//! - Every replica applies each op in sequence order, then forwards it and keeps it,
//!   with its result, in an *unacked* buffer. (With [`ReplicaCore::forward_first`], as
//!   the SC node runs it, scale ops, which carry or produce a partition's bulk state,
//!   and, behind the head, request ops are forwarded first and then applied, so the
//!   replicas apply them side by side.)
//! - The tail sends the results to FM (it "answers") and acknowledges the op upstream;
//!   an op is *committed* once the tail has applied it. Acks flow tail → head, and each
//!   replica trims its unacked buffer as they pass.
//!
//! Repair, driven by FM pushing a new [`v1::GroupConfig`] (a new epoch):
//! - **Middle dies:** its predecessor connects to its new successor, learns the last
//!   sequence number that successor applied, and resends its unacked ops after it.
//!   Nothing committed is lost: every op the successor lacks is still unacked upstream,
//!   because acks only come from downstream of it.
//! - **Tail dies:** the predecessor becomes tail and answers, from its unacked buffer,
//!   every op it holds (some may have been answered already; FM ignores repeats).
//! - **Head dies:** the successor becomes head and numbers ops from its own applied
//!   sequence. Ops only the dead head had seen were never committed; FM re-submits the
//!   requests it has no answer for, to the new head.
//! - **A replica joins** (FM appends it at the tail): its predecessor sends a
//!   [`v1::StateSnapshot`] (`Chain::snapshot`) with its unacked ops and their results,
//!   then the ops after it. The joiner takes the unacked ops as its own, so when it is
//!   the new tail it answers them.
//!
//! Timers (`Chain::on_timer`) and flow events are ops as well, numbered by the head, so
//! replicas stay identical.
//!
//! Scaling (paper 000 Fig. 3, docs/scaling.md) is ops too: FM's *st*, install, end and
//! delta-merge messages reach the head, which stamps each as a [`v1::ScaleOp`]. So a
//! split happens at one definite sequence number on every replica: flows decided before
//! it are in the part that leaves; after it the group keeps serving the moved range for
//! new flows only (with its half of the shared state), and refuses flows whose state
//! left with the part ([`proto::ERR_MOVED`]; FM sends them to the new owner once it
//! serves). The end op hands over what was decided there since the split (the delta).
//! The range, readiness and the kept copy of the part are replicated state, carried in
//! snapshots to joiners.

use std::collections::{BTreeSet, VecDeque};

use nf::{Chain, ComposedRules, FirstPacket, NfEnv, SplitHalf};
use pipeline::RuleRequest;
use prost::bytes::BytesMut;
use proto::{v1, ChainParts};
use tracing::{debug, info, warn};

use crate::factory::ChainFactory;

/// An applied op and what it produced.
#[derive(Debug, Clone)]
pub struct Applied {
    pub op: v1::Op,
    pub result: Outcome,
}

/// What an applied op produced. The chain's decisions stay native until a result is
/// sent: only the tail answers FM, so building proto replies at the head and the
/// middle (then holding them until the tail's ack) was a third of each replica's
/// allocation on the setup path. A replica turns its unacked outcomes into proto
/// results only when it becomes tail or hands them to a joiner in a snapshot.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Everything but the decisions' replies (for an outcome restored from a
    /// snapshot, the replies too).
    pub rest: v1::OpResult,
    /// One per request of the op, in the op's order.
    pub decisions: Vec<Result<ComposedRules, String>>,
}

impl Outcome {
    fn restored(rest: v1::OpResult) -> Self {
        Outcome {
            rest,
            decisions: Vec::new(),
        }
    }

    /// Whether the tail must send this to FM.
    fn worth_sending(&self) -> bool {
        !self.decisions.is_empty() || worth_sending(&self.rest)
    }

    /// The proto result of `op`, whose requests the decisions answer in order.
    fn to_proto(&self, op: &v1::Op) -> v1::OpResult {
        self.clone().into_proto(op, None)
    }

    /// With `encoding`, each rule reply goes straight to its encoded body
    /// (`encoded_replies`, [`proto::DecidedReply`]) instead of a message.
    fn into_proto(self, op: &v1::Op, encoding: Option<&mut ReplyEncoding>) -> v1::OpResult {
        let mut r = self.rest;
        if self.decisions.is_empty() {
            return r;
        }
        let Some(v1::op::Body::Requests(b)) = &op.body else {
            return r;
        };
        let mut encoding = encoding.filter(|e| e.on);
        if encoding.is_some() {
            r.encoded_replies.reserve(self.decisions.len());
        } else {
            r.replies.reserve(self.decisions.len());
        }
        // By reference: a decision holds its two rules inline (about 560 bytes), and
        // moving each out of the list only to read it would copy that much per flow.
        for (m, d) in b.requests.iter().zip(&self.decisions) {
            if let (Some(enc), Ok(rules)) = (encoding.as_deref_mut(), d) {
                r.encoded_replies.push(enc.encode(m, rules));
                continue;
            }
            r.replies.push(match d {
                Ok(rules) => v1::RuleReply {
                    id: m.id,
                    key: m.key.clone(),
                    result: Some(v1::rule_reply::Result::Rule(proto::rule_keyed(
                        &rules.forward,
                        m.key.as_ref(),
                    ))),
                    also: rules.reverse.iter().map(v1::Rule::from).collect(),
                    worker: m.worker,
                    // FM names the group when it forwards the reply.
                    decided_by: String::new(),
                    decided_by_group: 0,
                    frame_forwarded: false,
                },
                Err(e) => proto::error_reply(m, e.as_str()),
            });
        }
        r
    }
}

/// How the tail hands its rule replies to its node: as messages, or (when the node's
/// FM takes them, `RegisterAck.encoded_replies`) as the bodies FM passes on to PP,
/// encoded from the chain's rules without a message in between.
#[derive(Debug, Default)]
struct ReplyEncoding {
    on: bool,
    group: u64,
    /// The bodies' storage: each body is split off it, so a chunk's one allocation
    /// serves many flows; a new chunk is taken when one is used up.
    buf: BytesMut,
}

/// Bytes allocated at a time for encoded bodies (a built-in chain's reply is about
/// 200 bytes).
const REPLY_CHUNK: usize = 64 * 1024;

impl ReplyEncoding {
    fn encode(&mut self, m: &v1::RuleRequest, rules: &ComposedRules) -> v1::EncodedRuleReply {
        let body = proto::DecidedReply {
            key: m.key.as_ref(),
            rule: &rules.forward,
            also: rules.reverse.as_ref(),
            group: self.group,
        };
        let n = body.encoded_len();
        if self.buf.capacity() < n {
            self.buf = BytesMut::with_capacity(n.max(REPLY_CHUNK));
        }
        body.encode(&mut self.buf);
        v1::EncodedRuleReply {
            id: m.id,
            body: self.buf.split().freeze(),
        }
    }
}

/// Where this replica sends what it produced. The caller flushes it after each input
/// (or after a burst of inputs, which is how batches form down the chain).
#[derive(Debug, Default)]
pub struct Outbox {
    /// For the successor, in order, after `snapshot` if that is set.
    pub snapshot: Option<v1::StateSnapshot>,
    pub down: Vec<v1::Op>,
    /// Highest committed sequence number to acknowledge to the predecessor.
    pub ack_up: Option<u64>,
    /// Results for FM (only the tail produces these).
    pub results: Vec<v1::OpResult>,
}

impl Outbox {
    pub fn is_empty(&self) -> bool {
        self.snapshot.is_none()
            && self.down.is_empty()
            && self.ack_up.is_none()
            && self.results.is_empty()
    }
}

/// What the replica's link to its successor must do after a configuration change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkChange {
    Keep,
    /// Connect (or reconnect) to this node.
    Connect {
        node_id: String,
        addr: String,
    },
    /// No successor any more (this replica is the tail, or left the group).
    Drop,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Succ {
    None,
    /// Link being (re)established; ops accumulate in `unacked`.
    Waiting {
        node_id: String,
    },
    /// Handshake done on connection `conn`; every unacked op has been sent.
    Ready {
        node_id: String,
        conn: u64,
    },
}

/// Counters of one replica.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReplicaStats {
    pub ops_applied: u64,
    pub requests_applied: u64,
    pub duplicate_ops: u64,
    pub out_of_order_ops: u64,
    pub bad_requests: u64,
    pub submits_not_head: u64,
    pub resent_ops: u64,
    pub snapshots_sent: u64,
    pub snapshots_restored: u64,
    /// Configurations of a newer epoch after the first one: FM repairing or refilling
    /// the group.
    pub reconfigurations: u64,
    /// Requests refused because a scale moved their key's range away (or the group
    /// awaits its install op).
    pub moved_requests: u64,
    /// Scaling ops applied (split, install, end, pull; repeats included).
    pub scale_ops: u64,
    /// Requests a new owner refused because the flow's state was still at the old
    /// owner (gradual migration; FM has it pulled and asks again).
    pub migrating_requests: u64,
    /// NF `update`s run after an op because an NF triggered them (Serpens
    /// `update`/`trigger`); and those that failed.
    pub nf_updates: u64,
    pub nf_update_errors: u64,
    /// Writes this group's NFs made to mirrored tables, sent for the chain's other
    /// partitions (docs/nf-api.md, "Mirrored tables"); and other partitions' writes
    /// applied here, and skipped (an NF or table this chain does not mirror, a full
    /// table).
    pub mirror_sent: u64,
    pub mirror_imported: u64,
    pub mirror_skipped: u64,
}

/// The part a split (or retire) took out of the group, kept until the scale ends so an
/// abort can take it back and a repeated *st* can report it again.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Outgoing {
    scale: u64,
    kind: v1::ScaleKind,
    part: Vec<u8>,
    /// The range the group served before the split (it serves it until the end step).
    old_range: Option<(u64, u64)>,
    /// The moved key-hash range, inclusive.
    moved: (u64, u64),
    /// Hashes of the flows whose state left with the part, sorted; None if the chain
    /// cannot tell (then every moved flow is refused until the end step). Gradual: the
    /// flows whose state stayed here.
    old: Option<Vec<u64>>,
    /// S6's gradual migration: the part holds no flow, so this group keeps deciding
    /// every flow of its range until the end step.
    gradual: bool,
}

impl Outgoing {
    /// Whether this group decides key hash `h` while the scale is under way: only new
    /// flows of the moved range are (flows whose state is in the part are refused, so
    /// only the new owner, which has that state, ever decides them again).
    fn decides(&self, h: u64) -> bool {
        if self.gradual || h < self.moved.0 || h > self.moved.1 {
            return true;
        }
        self.old
            .as_ref()
            .is_some_and(|old| old.binary_search(&h).is_err())
    }
}

/// One side of a gradual scale-out's per-flow migration (S6; docs/scaling.md, "Gradual
/// migration"). Kept after it finished (nothing pending), so repeated steps still get
/// their answers; the next scale replaces it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Migration {
    scale: u64,
    /// The moved key-hash range, inclusive.
    moved: (u64, u64),
    /// Hashes of the moved range's flows whose state is still at the old owner: there,
    /// those it still owes; at the new owner, those it refuses until they arrive.
    pending: BTreeSet<u64>,
    /// Old owner: the last pull applied and the parts it moved out (a repeat reports
    /// them again). New owner: the last pull merged.
    pull: u64,
    parts: Vec<Vec<u8>>,
}

impl Migration {
    fn to_proto(&self) -> v1::MigrationState {
        v1::MigrationState {
            scale_id: self.scale,
            moved_lo: self.moved.0,
            moved_hi: self.moved.1,
            pending: self.pending.iter().copied().collect(),
            pull: self.pull,
            parts: self.parts.clone(),
        }
    }

    fn from_proto(m: &v1::MigrationState) -> Self {
        Migration {
            scale: m.scale_id,
            moved: (m.moved_lo, m.moved_hi),
            pending: m.pending.iter().copied().collect(),
            pull: m.pull,
            parts: m.parts.clone(),
        }
    }
}

/// A group's replicated scaling state.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ScaleState {
    /// Key hashes the group serves, inclusive; None after scale-in retired it.
    range: Option<(u64, u64)>,
    /// False while a scale-out's new group waits for its install op.
    ready: bool,
    outgoing: Option<Outgoing>,
    /// Scale ids a step of which was applied here.
    done: BTreeSet<u64>,
    /// The last committed end step (scale id, delta), so a repeated one reports the
    /// same delta.
    ended: Option<(u64, Vec<u8>)>,
    /// Scale ids whose delta was merged here.
    merged: BTreeSet<u64>,
    /// Gradual migrations: flows this group still owes (old owner) and flows it waits
    /// for (new owner).
    migrating_out: Option<Migration>,
    migrating_in: Option<Migration>,
}

impl ScaleState {
    /// The new owner's record of incoming scale `scale` (moving `moved`); a record of
    /// an earlier scale is replaced.
    fn migrating_in_for(&mut self, scale: u64, moved: (u64, u64)) -> &mut Migration {
        let m = self.migrating_in.get_or_insert_with(Migration::default);
        if m.scale != scale {
            *m = Migration {
                scale,
                moved,
                ..Migration::default()
            };
        }
        m
    }

    fn initial(cfg: &v1::GroupConfig) -> Self {
        ScaleState {
            range: cfg.partition.map(|p| (p.hash_lo, p.hash_hi)),
            ready: cfg.awaiting_scale == 0,
            outgoing: None,
            done: BTreeSet::new(),
            ended: None,
            merged: BTreeSet::new(),
            migrating_out: None,
            migrating_in: None,
        }
    }

    /// Whether the new owner must refuse `h` for now: its state is still at the old one.
    fn awaits(&self, h: u64) -> bool {
        self.migrating_in
            .as_ref()
            .is_some_and(|m| m.pending.contains(&h))
    }

    fn to_proto(&self) -> v1::ScaleState {
        let (has_range, (range_lo, range_hi)) = match self.range {
            Some(r) => (true, r),
            None => (false, (0, 0)),
        };
        let mut s = v1::ScaleState {
            has_range,
            range_lo,
            range_hi,
            ready: self.ready,
            done: self.done.iter().copied().collect(),
            merged: self.merged.iter().copied().collect(),
            migrating_out: self.migrating_out.as_ref().map(Migration::to_proto),
            migrating_in: self.migrating_in.as_ref().map(Migration::to_proto),
            ..Default::default()
        };
        if let Some(o) = &self.outgoing {
            s.outgoing_scale = o.scale;
            s.outgoing_kind = o.kind as i32;
            s.outgoing_part = o.part.clone();
            s.outgoing_gradual = o.gradual;
            if let Some((lo, hi)) = o.old_range {
                s.outgoing_had_range = true;
                s.outgoing_lo = lo;
                s.outgoing_hi = hi;
            }
            (s.outgoing_moved_lo, s.outgoing_moved_hi) = o.moved;
            if let Some(old) = &o.old {
                s.outgoing_old_known = true;
                s.outgoing_old = old.clone();
            }
        }
        if let Some((id, delta)) = &self.ended {
            s.ended_scale = *id;
            s.ended_delta = delta.clone();
        }
        s
    }

    fn from_proto(s: &v1::ScaleState) -> Self {
        ScaleState {
            range: s.has_range.then_some((s.range_lo, s.range_hi)),
            ready: s.ready,
            outgoing: (s.outgoing_scale != 0).then(|| Outgoing {
                scale: s.outgoing_scale,
                kind: v1::ScaleKind::try_from(s.outgoing_kind)
                    .unwrap_or(v1::ScaleKind::Unspecified),
                part: s.outgoing_part.clone(),
                old_range: s
                    .outgoing_had_range
                    .then_some((s.outgoing_lo, s.outgoing_hi)),
                moved: (s.outgoing_moved_lo, s.outgoing_moved_hi),
                old: s.outgoing_old_known.then(|| s.outgoing_old.clone()),
                gradual: s.outgoing_gradual,
            }),
            done: s.done.iter().copied().collect(),
            ended: (s.ended_scale != 0).then(|| (s.ended_scale, s.ended_delta.clone())),
            merged: s.merged.iter().copied().collect(),
            migrating_out: s.migrating_out.as_ref().map(Migration::from_proto),
            migrating_in: s.migrating_in.as_ref().map(Migration::from_proto),
        }
    }
}

/// The state of one replica of one group.
pub struct ReplicaCore {
    node_id: String,
    cfg: v1::GroupConfig,
    epoch: u64,
    pos: Option<usize>,
    chain: Result<Chain, String>,
    /// False for a joiner until its snapshot arrives.
    initialized: bool,
    applied: u64,
    acked: u64,
    last_now: u64,
    unacked: VecDeque<Applied>,
    succ: Succ,
    pred_conn: Option<u64>,
    /// A successor handshake that arrived before this replica had state.
    deferred_succ: Option<(u64, v1::ReplicaHelloAck)>,
    scale: ScaleState,
    /// Forward scale ops before applying them (see [`ReplicaCore::forward_first`]).
    forward_first: bool,
    /// A scale op already forwarded but not yet applied, and the ops of its batch after
    /// it (with the predecessor connection they came on).
    pending: Option<Pending>,
    /// How results' rule replies are made ([`ReplicaCore::encode_replies`]).
    encoding: ReplyEncoding,
    pub stats: ReplicaStats,
}

struct Pending {
    op: v1::Op,
    rest: Vec<v1::Op>,
    conn: Option<u64>,
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn group_of(cfg: &v1::GroupConfig) -> (u64, u64, &[v1::Replica]) {
    match &cfg.group {
        Some(g) => (g.id, g.epoch, &g.replicas),
        None => (0, 0, &[]),
    }
}

impl ReplicaCore {
    /// A replica created by its first configuration. Members of a group's first epoch
    /// start from the chain's empty state at sequence 0; a replica added later waits
    /// for a snapshot from its predecessor.
    pub fn new(node_id: &str, cfg: v1::GroupConfig, factory: &dyn ChainFactory) -> Self {
        let chain = build_chain(&cfg, factory);
        Self::with_chain(node_id, cfg, chain)
    }

    /// [`ReplicaCore::new`] with its chain built already (a spare, [`crate::spares`]):
    /// `chain` must be what the factory builds from `cfg.chain`.
    pub fn with_chain(node_id: &str, cfg: v1::GroupConfig, chain: Result<Chain, String>) -> Self {
        let (_, epoch, _) = group_of(&cfg);
        let mut r = ReplicaCore {
            node_id: node_id.to_string(),
            cfg: v1::GroupConfig::default(),
            epoch: 0,
            pos: None,
            chain,
            initialized: epoch <= 1,
            applied: 0,
            acked: 0,
            last_now: 0,
            unacked: VecDeque::new(),
            succ: Succ::None,
            pred_conn: None,
            deferred_succ: None,
            scale: ScaleState::initial(&cfg),
            forward_first: false,
            pending: None,
            encoding: ReplyEncoding::default(),
            stats: ReplicaStats::default(),
        };
        r.cfg = cfg;
        r
    }

    /// Make results' rule replies as encoded bodies (`OpResult.encoded_replies`, what
    /// `proto::encode_rule_replies` would make of the messages), or as messages. Off
    /// by default; the node turns it on for an FM that takes encoded replies.
    pub fn encode_replies(&mut self, on: bool) {
        self.encoding.on = on;
        self.encoding.group = self.group_id();
    }

    /// Let a non-tail replica send a scale op (a split, install or merge, which carries
    /// or produces a partition's bulk state), and a middle replica a request op too, to
    /// its successor before it applies it, so the replicas of the chain apply it side by
    /// side instead of one after the other: the requests queued behind it wait for one
    /// apply, not one per replica, and a table that doubles under one op stalls the
    /// chain once. The op then waits in [`ReplicaCore::has_pending`] until the caller
    /// has sent the outbox and calls [`ReplicaCore::run_pending`]; nothing else may
    /// happen in between. Chain replication allows it: the successor may apply an op
    /// before this replica did, and results and acks still come from the tail.
    pub fn forward_first(&mut self, on: bool) {
        self.forward_first = on;
    }

    /// Ops applied here and not yet acknowledged by the tail: how far the chain behind
    /// this replica lags (the head's backpressure signal).
    pub fn unacked_len(&self) -> usize {
        self.unacked.len()
    }

    /// A scale op has been forwarded and waits for [`ReplicaCore::run_pending`].
    pub fn has_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Apply the forwarded scale op, then the rest of its batch (which may leave another
    /// one pending). Errors as [`ReplicaCore::on_ops`].
    pub fn run_pending(&mut self, out: &mut Outbox) -> Result<(), String> {
        let Some(p) = self.pending.take() else {
            return Ok(());
        };
        let result = self.apply(&p.op);
        // Already in the successor's hands: keep it unacked like any forwarded op.
        self.unacked.push_back(Applied { op: p.op, result });
        match p.conn {
            Some(conn) if !p.rest.is_empty() => self.on_ops(conn, p.rest, out),
            _ => Ok(()),
        }
    }

    /// Whether `op` is sent on before it is applied (see `forward_first`): scale ops
    /// anywhere but at the tail, and, at a middle replica (`from_pred`), request ops
    /// too, so that the replicas behind the head apply a batch side by side rather
    /// than one after the other (the head stamps several ops per submit and applies
    /// each before it numbers the next, so it never defers them).
    fn defer(&self, op: &v1::Op, from_pred: bool) -> bool {
        self.forward_first
            && !self.is_tail()
            && matches!(self.succ, Succ::Ready { .. })
            && match op.body {
                Some(v1::op::Body::Scale(_)) => true,
                Some(v1::op::Body::Requests(_)) => from_pred,
                _ => false,
            }
    }

    pub fn group_id(&self) -> u64 {
        group_of(&self.cfg).0
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The partition (tenant, chain, hash range) this group owns.
    pub fn partition(&self) -> Option<v1::Partition> {
        self.cfg.partition
    }

    pub fn applied(&self) -> u64 {
        self.applied
    }

    pub fn is_head(&self) -> bool {
        self.pos == Some(0)
    }

    pub fn is_tail(&self) -> bool {
        let (_, _, members) = group_of(&self.cfg);
        self.pos.is_some() && self.pos == members.len().checked_sub(1)
    }

    /// Whether the current configuration lists this node.
    pub fn is_member(&self) -> bool {
        self.pos.is_some()
    }

    pub fn initialized(&self) -> bool {
        self.initialized
    }

    /// The key-hash range this group serves now (inclusive), per its own log.
    pub fn serving(&self) -> Option<(u64, u64)> {
        self.scale.range
    }

    /// False while a scale-out's new group waits for its install op.
    pub fn ready(&self) -> bool {
        self.scale.ready
    }

    /// What this replica tells an FM when the node registers: enough for an FM that
    /// never saw the group (a restarted FM, or a standby after a failover) to adopt it
    /// with its current epoch, order and range.
    pub fn hosted(&self) -> v1::HostedGroup {
        let (lo, hi) = self.scale.range.unwrap_or((0, 0));
        v1::HostedGroup {
            config: Some(self.cfg.clone()),
            serving: self.scale.ready && self.scale.range.is_some(),
            range_lo: lo,
            range_hi: hi,
            initialized: self.initialized,
            scale: self.scale.outgoing.as_ref().map_or(0, |o| o.scale),
            applied: self.applied,
        }
    }

    /// Apply configuration `cfg` (call once after [`ReplicaCore::new`] too). Returns
    /// what the successor link must do; `out` gets the answers a new tail owes.
    pub fn configure(&mut self, cfg: v1::GroupConfig, out: &mut Outbox) -> LinkChange {
        let (gid, epoch, members) = group_of(&cfg);
        if epoch < self.epoch {
            debug!(
                group = gid,
                epoch,
                current = self.epoch,
                "stale group config"
            );
            return LinkChange::Keep;
        }
        let pos = members.iter().position(|m| m.node_id == self.node_id);
        let succ = pos.and_then(|p| members.get(p + 1)).cloned();
        if self.epoch > 0 && epoch > self.epoch {
            self.stats.reconfigurations += 1;
        }
        let rejoining = self.epoch > 0 && epoch > self.epoch && cfg.joining.contains(&self.node_id);
        if rejoining {
            // FM dropped this replica at some point and adds it back now. What it still
            // holds may include ops that no other replica applied (it was the head and
            // was cut off), so it must not be resumed: start over from a snapshot.
            info!(group = gid, epoch, node = %self.node_id, "rejoining: discarding old state");
            self.initialized = false;
            self.applied = 0;
            self.acked = 0;
            self.unacked.clear();
            self.deferred_succ = None;
        }
        let was_tail = self.is_tail() && self.epoch > 0 && !rejoining;
        self.cfg = cfg;
        self.epoch = epoch;
        self.pos = pos;
        info!(group = gid, epoch, pos = ?pos, len = group_of(&self.cfg).2.len(),
              node = %self.node_id, "group configured");

        if self.is_tail() && !was_tail && self.initialized {
            // Promoted to tail: everything unacked is committed now, and its results
            // may never have reached FM.
            self.become_tail(out);
        }
        match (&succ, &self.succ) {
            (None, Succ::None) => LinkChange::Keep,
            (None, _) => {
                self.succ = Succ::None;
                self.deferred_succ = None;
                LinkChange::Drop
            }
            (Some(s), Succ::Waiting { node_id } | Succ::Ready { node_id, .. })
                if *node_id == s.node_id =>
            {
                LinkChange::Keep
            }
            (Some(s), _) => {
                self.deferred_succ = None;
                self.succ = Succ::Waiting {
                    node_id: s.node_id.clone(),
                };
                LinkChange::Connect {
                    node_id: s.node_id.clone(),
                    addr: s.addr.clone(),
                }
            }
        }
    }

    fn become_tail(&mut self, out: &mut Outbox) {
        for a in self.unacked.drain(..) {
            if a.result.worth_sending() {
                out.results
                    .push(a.result.into_proto(&a.op, Some(&mut self.encoding)));
            }
        }
        self.acked = self.applied;
        if self.pos != Some(0) {
            out.ack_up = Some(self.applied);
        }
    }

    /// The successor link `conn` finished its handshake: the successor has applied up
    /// to `ack.applied`. Resend what it lacks, or a snapshot if it has no state.
    pub fn successor_ready(&mut self, conn: u64, ack: &v1::ReplicaHelloAck, out: &mut Outbox) {
        let node_id = match &self.succ {
            Succ::Waiting { node_id } | Succ::Ready { node_id, .. } => node_id.clone(),
            Succ::None => return,
        };
        if !self.initialized {
            // Nothing to give it yet: serve it once our own snapshot is in.
            self.deferred_succ = Some((conn, *ack));
            return;
        }
        // The successor lacks ops we no longer hold (a replica that came back empty):
        // only a snapshot can bring it up to date.
        let gap = ack.applied < self.applied
            && self
                .unacked
                .front()
                .is_none_or(|a| a.op.seq > ack.applied + 1);
        if !ack.initialized || gap {
            let state = match &self.chain {
                Ok(c) => match c.snapshot() {
                    Ok(s) => s,
                    Err(e) => {
                        warn!(error = %e, "snapshot failed; successor stays waiting");
                        return;
                    }
                },
                Err(_) => Vec::new(),
            };
            out.snapshot = Some(v1::StateSnapshot {
                seq: self.applied,
                state,
                pending: self.unacked.iter().map(|a| a.op.clone()).collect(),
                pending_results: self
                    .unacked
                    .iter()
                    .map(|a| a.result.to_proto(&a.op))
                    .collect(),
                scale: Some(self.scale.to_proto()),
            });
            self.stats.snapshots_sent += 1;
        } else {
            if ack.applied > self.applied {
                warn!(
                    succ = ack.applied,
                    mine = self.applied,
                    "successor is ahead of its predecessor"
                );
            }
            for a in self.unacked.iter().filter(|a| a.op.seq > ack.applied) {
                out.down.push(a.op.clone());
                self.stats.resent_ops += 1;
            }
        }
        self.succ = Succ::Ready { node_id, conn };
    }

    /// The successor link `conn` broke; it is being re-established.
    pub fn successor_lost(&mut self, conn: u64) {
        if self.deferred_succ.is_some_and(|(c, _)| c == conn) {
            self.deferred_succ = None;
        }
        if let Succ::Ready { node_id, conn: c } = &self.succ {
            if *c == conn {
                self.succ = Succ::Waiting {
                    node_id: node_id.clone(),
                };
            }
        }
    }

    /// Acknowledgement from the successor on `conn`: `seq` is committed.
    pub fn on_ack(&mut self, conn: u64, seq: u64, out: &mut Outbox) {
        if !matches!(&self.succ, Succ::Ready { conn: c, .. } if *c == conn) {
            return;
        }
        while self.unacked.front().is_some_and(|a| a.op.seq <= seq) {
            self.unacked.pop_front();
        }
        if seq > self.acked {
            self.acked = seq;
            if self.pos != Some(0) {
                out.ack_up = Some(seq);
            }
        }
    }

    /// A predecessor on connection `conn` says hello. Accepts it (and forgets the old
    /// one) unless it speaks for an older configuration.
    pub fn predecessor_hello(
        &mut self,
        conn: u64,
        hello: &v1::ReplicaHello,
    ) -> Result<v1::ReplicaHelloAck, String> {
        if hello.epoch < self.epoch {
            return Err(format!(
                "hello from {} for epoch {} but the group is at epoch {}",
                hello.from, hello.epoch, self.epoch
            ));
        }
        self.pred_conn = Some(conn);
        Ok(v1::ReplicaHelloAck {
            applied: self.applied,
            initialized: self.initialized,
        })
    }

    pub fn predecessor_gone(&mut self, conn: u64) {
        if self.pred_conn == Some(conn) {
            self.pred_conn = None;
        }
    }

    fn is_current_pred(&self, conn: u64) -> bool {
        self.pred_conn == Some(conn)
    }

    /// A snapshot from the predecessor (this replica joined the group).
    pub fn on_snapshot(
        &mut self,
        conn: u64,
        snap: v1::StateSnapshot,
        factory: &dyn ChainFactory,
        out: &mut Outbox,
    ) {
        if !self.is_current_pred(conn) {
            return;
        }
        let mut chain = build_chain(&self.cfg, factory);
        if let Ok(c) = &mut chain {
            if let Err(e) = c.restore(&snap.state) {
                warn!(error = %e, "cannot restore snapshot; staying uninitialized");
                return;
            }
        }
        self.chain = chain;
        self.initialized = true;
        if let Some(s) = &snap.scale {
            self.scale = ScaleState::from_proto(s);
        }
        self.applied = snap.seq;
        self.acked = self.acked.min(snap.seq);
        self.stats.snapshots_restored += 1;
        info!(
            group = self.group_id(),
            seq = snap.seq,
            pending = snap.pending.len(),
            "restored from snapshot"
        );
        self.unacked = snap
            .pending
            .into_iter()
            .zip(snap.pending_results)
            .map(|(op, result)| Applied {
                op,
                result: Outcome::restored(result),
            })
            .collect();
        if self.is_tail() {
            self.become_tail(out);
        } else if matches!(self.succ, Succ::Ready { .. }) {
            out.down.extend(self.unacked.iter().map(|a| a.op.clone()));
        } else if let Some((c, ack)) = self.deferred_succ.take() {
            self.successor_ready(c, &ack, out);
        }
    }

    /// Ops from the predecessor on `conn`.
    pub fn on_ops(&mut self, conn: u64, ops: Vec<v1::Op>, out: &mut Outbox) -> Result<(), String> {
        if !self.is_current_pred(conn) {
            return Ok(());
        }
        if !self.initialized {
            return Err("ops before the snapshot".into());
        }
        let mut ops = ops.into_iter();
        while let Some(op) = ops.next() {
            if op.seq <= self.applied {
                self.stats.duplicate_ops += 1;
                continue;
            }
            if op.seq != self.applied + 1 {
                self.stats.out_of_order_ops += 1;
                return Err(format!(
                    "gap: op {} after {}; the predecessor must resend",
                    op.seq, self.applied
                ));
            }
            if self.defer(&op, true) {
                out.down.push(op.clone());
                self.pending = Some(Pending {
                    op,
                    rest: ops.collect(),
                    conn: Some(conn),
                });
                return Ok(());
            }
            let result = self.apply(&op);
            self.route(op, result, out);
        }
        Ok(())
    }

    /// Requests and events FM submitted (head only). Returns false if this replica is
    /// not the head of the current configuration (FM will retry at the right one).
    pub fn submit(&mut self, sub: v1::GroupSubmit, wall_ms: u64, out: &mut Outbox) -> bool {
        if !self.is_head() || !self.initialized {
            self.stats.submits_not_head += 1;
            return false;
        }
        if let Some(reqs) = sub.requests.filter(|r| !r.requests.is_empty()) {
            let op = self.stamp(wall_ms, v1::op::Body::Requests(reqs));
            self.apply_and_route(op, out);
        }
        if let Some(evs) = sub.events.filter(|e| !e.events.is_empty()) {
            let op = self.stamp(wall_ms, v1::op::Body::Events(evs));
            self.apply_and_route(op, out);
        }
        for m in sub.mirror.into_iter().filter(|m| !m.writes.is_empty()) {
            let op = self.stamp(wall_ms, v1::op::Body::Mirror(m));
            self.apply_and_route(op, out);
        }
        true
    }

    /// A scaling step from FM (head only): stamped as an op so every replica applies it
    /// at the same point of the log. Returns false if this replica is not the head (FM
    /// sends the step again to the right one).
    pub fn scale(&mut self, step: v1::scale_op::Step, wall_ms: u64, out: &mut Outbox) -> bool {
        if !self.is_head() || !self.initialized {
            return false;
        }
        let op = self.stamp(
            wall_ms,
            v1::op::Body::Scale(v1::ScaleOp { step: Some(step) }),
        );
        self.apply_and_route(op, out);
        true
    }

    /// Timer (head only): an op that runs every NF's `on_timer` on every replica.
    pub fn timer(&mut self, wall_ms: u64, out: &mut Outbox) {
        if !self.is_head() || !self.initialized {
            return;
        }
        let op = self.stamp(wall_ms, v1::op::Body::Timer(v1::Timer {}));
        self.apply_and_route(op, out);
    }

    fn stamp(&mut self, wall_ms: u64, body: v1::op::Body) -> v1::Op {
        // The group clock never goes back, even across a change of head.
        let now_ms = wall_ms.max(self.last_now);
        let seq = self.applied + 1;
        v1::Op {
            seq,
            now_ms,
            seed: splitmix(self.group_id() ^ splitmix(seq)),
            body: Some(body),
        }
    }

    fn apply_and_route(&mut self, op: v1::Op, out: &mut Outbox) {
        if self.defer(&op, false) {
            out.down.push(op.clone());
            self.pending = Some(Pending {
                op,
                rest: Vec::new(),
                conn: None,
            });
            return;
        }
        let result = self.apply(&op);
        self.route(op, result, out);
    }

    fn route(&mut self, op: v1::Op, result: Outcome, out: &mut Outbox) {
        if self.is_tail() {
            if result.worth_sending() {
                out.results
                    .push(result.into_proto(&op, Some(&mut self.encoding)));
            }
            self.acked = self.applied;
            if self.pos != Some(0) {
                out.ack_up = Some(self.applied);
            }
        } else {
            if matches!(self.succ, Succ::Ready { .. }) {
                out.down.push(op.clone());
            }
            self.unacked.push_back(Applied { op, result });
        }
    }

    /// The NF updates the op's handlers triggered (Serpens `update`/`trigger`), run
    /// after the op on every replica, so they are in the group's order too.
    fn run_triggers(&mut self, op: &v1::Op) {
        let Ok(chain) = &mut self.chain else { return };
        // A seed of its own: the op's handlers drew from `op.seed` already.
        let mut env = NfEnv::new(op.now_ms, op.seed ^ splitmix(u64::MAX));
        let (n, errors) = chain.run_triggers(&mut env);
        self.stats.nf_updates += n as u64;
        self.stats.nf_update_errors += errors.len() as u64;
        for e in errors {
            warn!(seq = op.seq, error = %e, "NF update failed");
        }
    }

    /// Apply one op to the chain. Deterministic in (state, op).
    fn apply(&mut self, op: &v1::Op) -> Outcome {
        self.applied = op.seq;
        self.last_now = self.last_now.max(op.now_ms);
        self.stats.ops_applied += 1;
        let mut result = v1::OpResult {
            seq: op.seq,
            ..Default::default()
        };
        let mut decisions = Vec::new();
        let partition = self.cfg.partition.unwrap_or_default();
        // A group that owns the chain's whole key space (per its own log: a scale
        // changes the range, the configuration FM sent does not follow), with no scale
        // under way, has nobody to send mirrored writes to: its own copy is complete,
        // and a later split copies it to the new group. Its NFs record none.
        let alone = self.scale.range == Some((0, u64::MAX))
            && self.scale.outgoing.is_none()
            && self.scale.migrating_out.is_none();
        if let Ok(chain) = &mut self.chain {
            chain.set_mirror_sending(!alone);
        }
        match &op.body {
            Some(v1::op::Body::Requests(b)) => {
                decisions.reserve(b.requests.len());
                for (i, m) in b.requests.iter().enumerate() {
                    self.stats.requests_applied += 1;
                    let seed = op.seed ^ splitmix(i as u64);
                    decisions.push(self.decide(m, &partition, op.now_ms, seed));
                }
            }
            Some(v1::op::Body::Events(b)) => {
                if let Ok(chain) = &mut self.chain {
                    for (i, e) in b.events.iter().enumerate() {
                        match proto::event_from(e) {
                            Ok(ev) => {
                                let mut env = NfEnv::new(op.now_ms, op.seed ^ splitmix(i as u64));
                                chain.on_event(&ev, &mut env);
                            }
                            Err(_) => self.stats.bad_requests += 1,
                        }
                    }
                }
            }
            Some(v1::op::Body::Timer(_)) => {
                if let Ok(chain) = &mut self.chain {
                    let mut env = NfEnv::new(op.now_ms, op.seed);
                    result.expired = chain.on_timer(&mut env).iter().map(Into::into).collect();
                }
            }
            Some(v1::op::Body::Scale(s)) => {
                self.stats.scale_ops += 1;
                if let Some(step) = &s.step {
                    self.apply_scale(step, op.seq, &mut result);
                }
            }
            Some(v1::op::Body::Mirror(b)) => {
                if let Ok(chain) = &mut self.chain {
                    let writes: Vec<(u32, nf::MirrorWrite)> =
                        b.writes.iter().map(mirror_from).collect();
                    let (applied, skipped) = chain.import_mirror(&writes);
                    self.stats.mirror_imported += applied as u64;
                    self.stats.mirror_skipped += skipped as u64;
                }
            }
            None => {}
        }
        self.run_triggers(op);
        // The range per the group's own log (a scale changes it; the configuration FM
        // sent at the start does not follow).
        if let Ok(chain) = &mut self.chain {
            // After the triggers: an update may write mirrored rows too. Imports write
            // none (`import_mirror` does not send on), so nothing echoes back.
            result.mirror = chain.take_mirror().into_iter().map(mirror_to).collect();
            self.stats.mirror_sent += result.mirror.len() as u64;
        }
        Outcome {
            rest: result,
            decisions,
        }
    }

    /// Apply a scaling step. Deterministic in (state, step) like every op, and
    /// idempotent by scale id: FM repeats a step whose outcome it did not hear.
    fn apply_scale(&mut self, step: &v1::scale_op::Step, seq: u64, result: &mut v1::OpResult) {
        use v1::scale_op::Step;
        let gid = self.group_id();
        let fin = |scale: u64, error: String| v1::ScaleFin {
            scale_id: scale,
            group: gid,
            seq,
            error,
            ..Default::default()
        };
        match step {
            Step::Split(st) => {
                if self.scale.done.contains(&st.scale_id) {
                    // A repeated st: report the part again if it is still kept.
                    if let Some(o) = self
                        .scale
                        .outgoing
                        .as_ref()
                        .filter(|o| o.scale == st.scale_id)
                    {
                        result.part = Some(v1::ScalePart {
                            scale_id: o.scale,
                            group: gid,
                            part: o.part.clone(),
                            seq,
                            pending: gradual_pending(o),
                        });
                    }
                    return;
                }
                match self.split(st) {
                    Ok(part) => {
                        self.scale.done.insert(st.scale_id);
                        info!(group = gid, scale = st.scale_id, seq, bytes = part.len(),
                              range = ?self.scale.range, gradual = st.gradual, "split applied");
                        result.part = Some(v1::ScalePart {
                            scale_id: st.scale_id,
                            group: gid,
                            part,
                            seq,
                            pending: self
                                .scale
                                .outgoing
                                .as_ref()
                                .map(gradual_pending)
                                .unwrap_or_default(),
                        });
                    }
                    Err(e) => {
                        warn!(group = gid, scale = st.scale_id, error = %e, "split refused");
                        result.fin = Some(fin(st.scale_id, e));
                    }
                }
            }
            Step::Install(ins) if ins.pull > 0 => {
                result.fin = Some(v1::ScaleFin {
                    pull: ins.pull,
                    ..fin(ins.scale_id, self.merge_pulled(ins))
                });
            }
            Step::Install(ins) if ins.delta => {
                // The second transfer: what the old owner decided in the moved range
                // after st. FM sends it after the switch, so requests this group
                // decided before it are new flows the old owner never saw (the flows it
                // did decide are answered from FM's pinned cache until this op).
                // Gradual: no state, only the flows still at the old owner.
                if self.scale.merged.insert(ins.scale_id) {
                    if !ins.pending.is_empty() {
                        self.await_flows(ins);
                    }
                    let merged = match &mut self.chain {
                        Ok(_) if ins.part.is_empty() => Ok(()),
                        Ok(c) => c.merge(&ins.part).map_err(|e| format!("merge delta: {e}")),
                        Err(e) => Err(e.clone()),
                    };
                    if let Err(e) = merged {
                        // Refused as a whole (merges check before they apply): a repeat
                        // reports the same error rather than a success.
                        self.scale.merged.remove(&ins.scale_id);
                        warn!(group = gid, scale = ins.scale_id, error = %e, "delta merge failed");
                        result.fin = Some(fin(ins.scale_id, e));
                        return;
                    }
                    info!(
                        group = gid,
                        scale = ins.scale_id,
                        seq,
                        bytes = ins.part.len(),
                        "scale delta merged"
                    );
                }
                result.fin = Some(fin(ins.scale_id, String::new()));
            }
            Step::Install(ins) => {
                if self.scale.done.insert(ins.scale_id) {
                    if let Err(e) = self.install(ins) {
                        warn!(group = gid, scale = ins.scale_id, error = %e, "install failed");
                        result.fin = Some(fin(ins.scale_id, e));
                        return;
                    }
                    info!(group = gid, scale = ins.scale_id, seq, range = ?self.scale.range,
                          "scale install applied");
                }
                result.fin = Some(fin(ins.scale_id, String::new()));
            }
            Step::End(end) => {
                self.scale.done.insert(end.scale_id);
                let Some(o) = self.scale.outgoing.take_if(|o| o.scale == end.scale_id) else {
                    // A repeat (or an end for a scale that never split here).
                    let mut f = fin(end.scale_id, String::new());
                    if let Some((_, delta)) =
                        self.scale.ended.as_ref().filter(|e| e.0 == end.scale_id)
                    {
                        f.delta = delta.clone();
                    }
                    // Gradual: the flows still owed, so a repeat (its first fin lost)
                    // still tells the new owner which flows to refuse.
                    if let Some(m) = self
                        .scale
                        .migrating_out
                        .as_ref()
                        .filter(|m| m.scale == end.scale_id)
                    {
                        f.pending = m.pending.iter().copied().collect();
                    }
                    result.fin = Some(f);
                    return;
                };
                let mut f = fin(end.scale_id, String::new());
                if end.abort {
                    // Take the part back. It is disjoint from what was decided here
                    // since st (other flows, the other half of the free ports), so the
                    // union is the state as if no scale had started.
                    if let Ok(c) = &mut self.chain {
                        if let Err(e) = c.merge(&o.part) {
                            f.error = format!("merging the part back: {e}");
                        }
                    }
                    self.scale.range = o.old_range;
                    info!(group = gid, scale = end.scale_id, seq, range = ?self.scale.range,
                          "scale aborted; part taken back");
                } else if o.gradual {
                    f.pending = self.lend(&o);
                    info!(group = gid, scale = end.scale_id, seq, pending = f.pending.len(),
                          range = ?self.scale.range, "scale ended; flows move on first access");
                } else {
                    match self.hand_over(&o) {
                        Ok(delta) => {
                            info!(group = gid, scale = end.scale_id, seq, bytes = delta.len(),
                                  range = ?self.scale.range, "scale ended; delta handed over");
                            self.scale.ended = Some((end.scale_id, delta.clone()));
                            f.delta = delta;
                        }
                        Err(e) => {
                            warn!(group = gid, scale = end.scale_id, error = %e, "hand-over failed");
                            f.error = e;
                        }
                    }
                }
                result.fin = Some(f);
            }
            Step::Pull(p) => {
                let (parts, error) = self.pull(p);
                result.fin = Some(v1::ScaleFin {
                    pull: p.pull,
                    parts,
                    ..fin(p.scale_id, error)
                });
            }
        }
    }

    /// Gradual, at the committed end step: stop serving the moved range, and keep the
    /// flows of it this group holds (decided before st or since) until they are pulled.
    /// Returns their hashes, for the new owner to refuse until then.
    fn lend(&mut self, o: &Outgoing) -> Vec<u64> {
        let (mlo, mhi) = o.moved;
        self.scale.range = match o.old_range {
            Some((lo, hi)) if mlo == lo => Some((mhi + 1, hi)),
            Some((lo, _)) => Some((lo, mlo.saturating_sub(1))),
            None => None,
        };
        // The chain told at st (else st refused a gradual split), so it tells now.
        let pending: BTreeSet<u64> = self
            .chain
            .as_ref()
            .ok()
            .and_then(Chain::flow_hashes)
            .unwrap_or_default()
            .into_iter()
            .filter(|h| mlo <= *h && *h <= mhi)
            .collect();
        let out: Vec<u64> = pending.iter().copied().collect();
        self.scale.migrating_out = Some(Migration {
            scale: o.scale,
            moved: o.moved,
            pending,
            pull: 0,
            parts: Vec::new(),
        });
        out
    }

    /// A pull at the old owner: move out the state of the flows asked for (first
    /// accesses at the new owner) and of the sweep's chunk. A repeat reports the same
    /// parts. Returns the parts and an error ("" if none); what moved before an error
    /// is reported with it, so no state is lost.
    fn pull(&mut self, p: &v1::ScalePull) -> (Vec<Vec<u8>>, String) {
        let Some(m) = self
            .scale
            .migrating_out
            .as_mut()
            .filter(|m| m.scale == p.scale_id)
        else {
            return (
                Vec::new(),
                format!("no migration of scale {} here", p.scale_id),
            );
        };
        if p.pull == m.pull {
            return (m.parts.clone(), String::new());
        }
        if p.pull < m.pull {
            return (Vec::new(), format!("stale pull {} (at {})", p.pull, m.pull));
        }
        let chain = match &mut self.chain {
            Ok(c) => c,
            Err(e) => return (Vec::new(), e.clone()),
        };
        let mut parts = Vec::new();
        let mut error = String::new();
        let mut keys: Vec<u64> = p.keys.clone();
        keys.sort_unstable();
        keys.dedup();
        let mut take = |lo: u64, hi: u64, parts: &mut Vec<Vec<u8>>| {
            // SplitHalf's upper bound is exclusive; the moved range never ends at
            // u64::MAX (FM moves the lower end).
            let Some(end) = hi.checked_add(1) else {
                return;
            };
            match chain.split_flows(&SplitHalf {
                moved_lo: lo,
                moved_hi: end,
            }) {
                Ok(part) => parts.push(part),
                Err(e) => error = format!("pull [{lo}, {hi}]: {e}"),
            }
        };
        for h in keys {
            if m.pending.remove(&h) {
                take(h, h, &mut parts);
            }
        }
        if p.sweep {
            let (lo, hi) = (p.lo.max(m.moved.0), p.hi.min(m.moved.1));
            if lo <= hi && m.pending.range(lo..=hi).next().is_some() {
                take(lo, hi, &mut parts);
                m.pending.retain(|h| *h < lo || *h > hi);
            }
        }
        if p.last && !m.pending.is_empty() {
            // FM's sweep covered the range; whatever is left (none expected) goes now.
            let (lo, hi) = m.moved;
            take(lo, hi, &mut parts);
            m.pending.clear();
        }
        m.pull = p.pull;
        m.parts = parts.clone();
        (parts, error)
    }

    /// The new owner learns flows whose state is still at the old owner.
    fn await_flows(&mut self, ins: &v1::ScaleInstall) {
        let moved = self.scale.range.unwrap_or((ins.range_lo, ins.range_hi));
        let m = self.scale.migrating_in_for(ins.scale_id, moved);
        m.pending.extend(ins.pending.iter().copied());
    }

    /// A pull's merge at the new owner: the pulled flows' state goes in and they are
    /// served from now on. Idempotent by pull id. Returns an error ("" if none).
    fn merge_pulled(&mut self, ins: &v1::ScaleInstall) -> String {
        let m = self
            .scale
            .migrating_in_for(ins.scale_id, (ins.range_lo, ins.range_hi));
        if ins.pull <= m.pull {
            return String::new();
        }
        let mut error = String::new();
        if let Ok(c) = &mut self.chain {
            for part in &ins.parts {
                if let Err(e) = c.merge(part) {
                    error = format!("merge pulled part: {e}");
                }
            }
        }
        for h in &ins.keys {
            m.pending.remove(h);
        }
        if ins.swept {
            m.pending.retain(|h| *h < ins.swept_lo || *h > ins.swept_hi);
        }
        if ins.last {
            m.pending.clear();
        }
        m.pull = ins.pull;
        error
    }

    /// Split off the part `st` names and keep serving the group's whole range, the
    /// moved range for new flows only, until the end step. Changes nothing on error.
    fn split(&mut self, st: &v1::ScaleStart) -> Result<Vec<u8>, String> {
        let chain = self.chain.as_mut().map_err(|e| e.clone())?;
        let Some((lo, hi)) = self.scale.range else {
            return Err("the group serves no range".into());
        };
        if self.scale.outgoing.is_some() {
            return Err("a previous scale of this group has not ended".into());
        }
        let (mlo, mhi) = (st.moved_lo, st.moved_hi);
        let kind = v1::ScaleKind::try_from(st.kind).unwrap_or(v1::ScaleKind::Unspecified);
        // Taken before the split: the flows whose state the part takes along.
        let old = chain.flow_hashes().map(|mut v| {
            v.retain(|h| mlo <= *h && *h <= mhi);
            v
        });
        let part = match kind {
            v1::ScaleKind::Out => {
                // What stays must be one contiguous range: the moved range is the lower
                // or the upper end of ours, and not all of it.
                if !((mlo == lo && mhi < hi) || (mhi == hi && mlo > lo)) {
                    return Err(format!(
                        "moved range [{mlo}, {mhi}] is not an end of the group's [{lo}, {hi}]"
                    ));
                }
                // SplitHalf's upper bound is exclusive, so [x, u64::MAX] cannot be named
                // (FM always moves the lower end).
                let Some(end) = mhi.checked_add(1) else {
                    return Err("cannot move a range ending at u64::MAX".into());
                };
                if st.gradual {
                    // S6: no flow moves now; the part is half the free shared state
                    // (an empty range moves no flow). The flows move on first access.
                    if old.is_none() {
                        return Err("gradual migration needs every NF's flow_hashes".into());
                    }
                    chain
                        .split(&SplitHalf {
                            moved_lo: 0,
                            moved_hi: 0,
                        })
                        .map_err(|e| format!("split: {e}"))?
                } else {
                    chain
                        .split(&SplitHalf {
                            moved_lo: mlo,
                            moved_hi: end,
                        })
                        .map_err(|e| format!("split: {e}"))?
                }
            }
            v1::ScaleKind::In => {
                if (mlo, mhi) != (lo, hi) {
                    return Err(format!(
                        "scale-in must move the group's whole range [{lo}, {hi}], not [{mlo}, {mhi}]"
                    ));
                }
                // Everything goes except half of the free shared state (an empty split
                // moves no flows, only that half): the group keeps deciding new flows
                // with it until the end step, disjoint from what the neighbour holds.
                let keep = chain
                    .split(&SplitHalf {
                        moved_lo: 0,
                        moved_hi: 0,
                    })
                    .map_err(|e| format!("split: {e}"))?;
                let all = chain.snapshot().and_then(|all| {
                    chain.restore(&keep)?;
                    Ok(all)
                });
                match all {
                    Ok(all) => all,
                    Err(e) => {
                        let _ = chain.merge(&keep);
                        return Err(format!("retire: {e}"));
                    }
                }
            }
            v1::ScaleKind::Unspecified => return Err("scale kind unspecified".into()),
        };
        self.scale.outgoing = Some(Outgoing {
            scale: st.scale_id,
            kind,
            part: part.clone(),
            old_range: self.scale.range,
            moved: (mlo, mhi),
            old,
            gradual: st.gradual && kind == v1::ScaleKind::Out,
        });
        Ok(part)
    }

    /// The committed end step: stop serving the moved range and return what was
    /// decided there since st (scale-in: everything the group holds).
    fn hand_over(&mut self, o: &Outgoing) -> Result<Vec<u8>, String> {
        let chain = self.chain.as_mut().map_err(|e| e.clone())?;
        let (mlo, mhi) = o.moved;
        let delta = match o.kind {
            v1::ScaleKind::Out => {
                let end = mhi.checked_add(1).ok_or("moved range ends at u64::MAX")?;
                let delta = chain
                    .split(&SplitHalf {
                        moved_lo: mlo,
                        moved_hi: end,
                    })
                    .map_err(|e| format!("split: {e}"))?;
                self.scale.range = match o.old_range {
                    Some((lo, hi)) if mlo == lo => Some((mhi + 1, hi)),
                    Some((lo, _)) => Some((lo, mlo.saturating_sub(1))),
                    None => None,
                };
                delta
            }
            _ => {
                let delta = chain.snapshot().map_err(|e| format!("snapshot: {e}"))?;
                self.scale.range = None;
                delta
            }
        };
        Ok(delta)
    }

    fn install(&mut self, ins: &v1::ScaleInstall) -> Result<(), String> {
        let chain = self.chain.as_mut().map_err(|e| e.clone())?;
        if ins.range_lo > ins.range_hi {
            return Err(format!("empty range [{}, {}]", ins.range_lo, ins.range_hi));
        }
        match v1::ScaleKind::try_from(ins.kind).unwrap_or(v1::ScaleKind::Unspecified) {
            v1::ScaleKind::Out => {
                if self.scale.ready {
                    return Err("install into a group that already serves".into());
                }
                // The new group starts from the part alone: its NFs were built with the
                // configuration's full pools, which belong to the parent.
                chain
                    .restore(&ins.part)
                    .map_err(|e| format!("restore: {e}"))?;
                self.scale.ready = true;
                if !ins.pending.is_empty() {
                    self.scale.range = Some((ins.range_lo, ins.range_hi));
                    self.await_flows(ins);
                }
            }
            v1::ScaleKind::In => {
                chain.merge(&ins.part).map_err(|e| format!("merge: {e}"))?;
            }
            v1::ScaleKind::Unspecified => return Err("scale kind unspecified".into()),
        }
        self.scale.range = Some((ins.range_lo, ins.range_hi));
        Ok(())
    }

    fn decide(
        &mut self,
        m: &v1::RuleRequest,
        partition: &v1::Partition,
        now_ms: u64,
        seed: u64,
    ) -> Result<ComposedRules, String> {
        let req = match RuleRequest::try_from(m) {
            Ok(r) => r,
            Err(e) => {
                self.stats.bad_requests += 1;
                return Err(format!("bad request: {e}"));
            }
        };
        if req.tenant != partition.tenant || req.chain != partition.chain {
            self.stats.bad_requests += 1;
            return Err("request for another partition".into());
        }
        // Decided only by the group whose log says it owns the key now: after a split
        // op the moved range belongs to the new group, before its install op the new
        // group owns nothing.
        if !self.scale.ready {
            self.stats.moved_requests += 1;
            return Err(proto::ERR_NOT_READY.into());
        }
        // The chain's partition hash: what FM dispatched the request by.
        let h = match &self.chain {
            Ok(c) => c.partition().hash(&req.key),
            Err(_) => req.key.hash(),
        };
        let serves = self.scale.range.is_some_and(|(lo, hi)| lo <= h && h <= hi)
            && self.scale.outgoing.as_ref().is_none_or(|o| o.decides(h));
        if !serves {
            self.stats.moved_requests += 1;
            return Err(proto::ERR_MOVED.into());
        }
        if self.scale.awaits(h) {
            self.stats.migrating_requests += 1;
            return Err(proto::ERR_MIGRATING.into());
        }
        let chain = match &mut self.chain {
            Ok(c) => c,
            Err(e) => return Err(format!("chain unavailable: {e}")),
        };
        let pkt = FirstPacket::new(req.key, req.tenant, req.meta);
        let mut env = NfEnv::new(now_ms, seed);
        chain.decide(&pkt, &mut env).map_err(|e| e.to_string())
    }

    /// What the chain's traffic-counting NFs (the monitor) counted; None for chains
    /// without one, or a replica with no chain yet.
    pub fn traffic(&self) -> Option<v1::TrafficReport> {
        let c = self.chain.as_ref().ok()?;
        c.traffic().map(|t| proto::traffic_to_proto(&t))
    }

    /// Status for `GroupStatus`.
    pub fn state(&self, with_snapshot: bool) -> v1::GroupState {
        let (gid, _, members) = group_of(&self.cfg);
        v1::GroupState {
            group: gid,
            epoch: self.epoch,
            position: self.pos.map(|p| p as u32).unwrap_or(u32::MAX),
            length: members.len() as u32,
            initialized: self.initialized,
            applied: self.applied,
            acked: self.acked,
            unacked: self.unacked.len() as u64,
            snapshot: match (&self.chain, with_snapshot) {
                (Ok(c), true) => c.snapshot().unwrap_or_default(),
                _ => Vec::new(),
            },
            traffic: None,
        }
    }
}

/// Whether the tail must send a result to FM.
/// Gradual: the hashes of the flows whose state stayed at the old owner.
fn gradual_pending(o: &Outgoing) -> Vec<u64> {
    if o.gradual {
        o.old.clone().unwrap_or_default()
    } else {
        Vec::new()
    }
}

fn worth_sending(r: &v1::OpResult) -> bool {
    !r.replies.is_empty()
        || !r.expired.is_empty()
        || r.part.is_some()
        || r.fin.is_some()
        || !r.mirror.is_empty()
}

fn mirror_to((nf, w): (u32, nf::MirrorWrite)) -> v1::MirrorWrite {
    v1::MirrorWrite {
        nf,
        table: w.table,
        key: w.key,
        value: w.value,
        deleted: w.deleted,
    }
}

fn mirror_from(w: &v1::MirrorWrite) -> (u32, nf::MirrorWrite) {
    (
        w.nf,
        nf::MirrorWrite {
            table: w.table.clone(),
            key: w.key.clone(),
            value: w.value.clone(),
            deleted: w.deleted,
        },
    )
}

fn build_chain(cfg: &v1::GroupConfig, factory: &dyn ChainFactory) -> Result<Chain, String> {
    let c = cfg.chain.as_ref().ok_or("group config has no chain")?;
    let parts = ChainParts::try_from(c).map_err(|e| e.to_string())?;
    factory.build(&parts).map_err(|e| {
        warn!(error = %e, tenant = parts.tenant, chain = parts.chain, "cannot build chain");
        e.to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::TestNfs;

    fn config(epoch: u64, members: &[&str], joining: &[&str]) -> v1::GroupConfig {
        let nf = serde_json::json!({
            "kind": "test-snat", "addrs": ["198.19.255.1"], "ports": [1024, 1100]
        });
        group_config(nf, 7, epoch, members, (0, u64::MAX), joining, 0)
    }

    /// Group `gid` of tenant 1's chain 1: the one NF `nf`, between fixed encaps.
    fn group_config(
        nf: serde_json::Value,
        gid: u64,
        epoch: u64,
        members: &[&str],
        range: (u64, u64),
        joining: &[&str],
        awaiting: u64,
    ) -> v1::GroupConfig {
        // One NF, or an array of them.
        let nfs = if nf.is_array() {
            nf
        } else {
            serde_json::json!([nf])
        };
        let def: proto::ChainDef = serde_json::from_value(serde_json::json!({
            "tenant": 1, "chain": 1,
            "nfs": nfs,
            "forward": {"decap": true, "encap": {"dst": "198.18.0.9", "vni": 200}},
            "reverse": {"decap": true, "encap": {"dst": "198.18.0.50", "vni": 100}}
        }))
        .unwrap();
        v1::GroupConfig {
            group: Some(v1::ScGroup {
                id: gid,
                epoch,
                replicas: members
                    .iter()
                    .map(|m| v1::Replica {
                        node_id: m.to_string(),
                        addr: format!("{m}:1"),
                    })
                    .collect(),
            }),
            partition: Some(v1::Partition {
                tenant: 1,
                chain: 1,
                hash_lo: range.0,
                hash_hi: range.1,
                group: gid,
            }),
            chain: Some(def.to_proto().unwrap()),
            joining: joining.iter().map(|s| s.to_string()).collect(),
            awaiting_scale: awaiting,
        }
    }

    fn timer_op(seq: u64) -> v1::Op {
        v1::Op {
            seq,
            now_ms: seq,
            seed: seq,
            body: Some(v1::op::Body::Timer(v1::Timer {})),
        }
    }

    /// A tail `b` of epoch 1 that has applied two ops.
    fn tail_with_state() -> ReplicaCore {
        let mut b = ReplicaCore::new("b", config(1, &["a", "b"], &[]), &TestNfs);
        let mut out = Outbox::default();
        b.configure(config(1, &["a", "b"], &[]), &mut out);
        let hello = v1::ReplicaHello {
            group: 7,
            epoch: 1,
            from: "a".into(),
        };
        b.predecessor_hello(1, &hello).unwrap();
        b.on_ops(1, vec![timer_op(1), timer_op(2)], &mut out)
            .unwrap();
        assert_eq!((b.applied(), b.initialized()), (2, true));
        b
    }

    #[test]
    fn a_replica_fm_adds_back_discards_its_old_state() {
        let mut b = tail_with_state();
        let mut out = Outbox::default();
        // FM dropped b (epoch 2, not seen by b) and adds it back as a joiner.
        b.configure(config(3, &["a", "b"], &["b"]), &mut out);
        assert!(!b.initialized(), "a joiner must wait for a snapshot");
        assert_eq!(b.applied(), 0);
        assert!(
            out.results.is_empty(),
            "a joiner answers nothing from old state"
        );
        // The same configuration pushed again does not reset it a second time; ops
        // before the snapshot are refused.
        b.configure(config(3, &["a", "b"], &["b"]), &mut out);
        b.predecessor_hello(
            2,
            &v1::ReplicaHello {
                group: 7,
                epoch: 3,
                from: "a".into(),
            },
        )
        .unwrap();
        assert!(b.on_ops(2, vec![timer_op(3)], &mut out).is_err());
    }

    #[test]
    fn a_member_kept_across_epochs_keeps_its_state() {
        let mut b = tail_with_state();
        let mut out = Outbox::default();
        // A new epoch that only adds someone else: b keeps what it applied.
        b.configure(config(2, &["a", "b", "c"], &["c"]), &mut out);
        assert_eq!((b.applied(), b.initialized()), (2, true));
        // Resumed after a stall (same members, no joiners).
        b.configure(config(3, &["a", "b", "c"], &[]), &mut out);
        assert_eq!((b.applied(), b.initialized()), (2, true));
    }

    // ------------------------------------------------------------ scaling ops

    const MID: u64 = 1 << 63;

    /// Epoch 1 of group `gid` running `nfs` (one NF or an array), no joiners: what
    /// the scaling and migration tests start from.
    fn scaling_config(
        nfs: serde_json::Value,
        gid: u64,
        members: &[&str],
        range: (u64, u64),
        awaiting: u64,
    ) -> v1::GroupConfig {
        group_config(nfs, gid, 1, members, range, &[], awaiting)
    }

    /// A SNAT with 512 ports on one address.
    fn snat() -> serde_json::Value {
        serde_json::json!({"kind": "snat", "pools": [
            {"addresses": ["198.19.255.1"], "ports": {"lo": 1024, "hi": 1535}}]})
    }

    fn replica(node: &str, cfg: v1::GroupConfig) -> ReplicaCore {
        let mut r = ReplicaCore::new(node, cfg.clone(), &TestNfs);
        r.configure(cfg, &mut Outbox::default());
        r
    }

    fn request(i: u16) -> v1::RuleRequest {
        let key = pipeline::FlowKey::new(
            100,
            17,
            "198.18.10.2".parse().unwrap(),
            1000 + i,
            "198.19.0.9".parse().unwrap(),
            53,
        );
        let r = RuleRequest::new(key, 1, 1, pipeline::PacketMeta::new(60, 0));
        proto::request_to_proto(&r, u64::from(i))
    }

    fn hash_of(r: &v1::RuleRequest) -> u64 {
        RuleRequest::try_from(r).unwrap().key.hash()
    }

    fn submit(r: &mut ReplicaCore, reqs: Vec<v1::RuleRequest>, out: &mut Outbox) {
        assert!(r.submit(
            v1::GroupSubmit {
                group: r.group_id(),
                epoch: r.epoch(),
                requests: Some(v1::RuleRequestBatch { requests: reqs }),
                events: None,
                mirror: Vec::new(),
            },
            1_000,
            out,
        ));
    }

    fn replies(out: &Outbox) -> Vec<v1::RuleReply> {
        out.results.iter().flat_map(|r| r.replies.clone()).collect()
    }

    fn split_step(scale: u64) -> v1::scale_op::Step {
        v1::scale_op::Step::Split(v1::ScaleStart {
            scale_id: scale,
            kind: v1::ScaleKind::Out as i32,
            from_group: 7,
            to_group: 8,
            moved_lo: 0,
            moved_hi: MID - 1,
            gradual: false,
        })
    }

    /// A head `a` and a tail `b` linked (connection 1), with 64 flows decided.
    fn chain_of_two() -> (ReplicaCore, ReplicaCore, Vec<v1::RuleReply>) {
        chain_of_two_with(scaling_config(snat(), 7, &["a", "b"], (0, u64::MAX), 0))
    }

    fn chain_of_two_with(cfg: v1::GroupConfig) -> (ReplicaCore, ReplicaCore, Vec<v1::RuleReply>) {
        let mut a = replica("a", cfg.clone());
        let mut b = replica("b", cfg);
        let hello = v1::ReplicaHello {
            group: 7,
            epoch: 1,
            from: "a".into(),
        };
        let ack = b.predecessor_hello(1, &hello).unwrap();
        let mut out = Outbox::default();
        a.successor_ready(1, &ack, &mut out);
        submit(&mut a, (0..64).map(request).collect(), &mut out);
        let mut tail = Outbox::default();
        b.on_ops(1, std::mem::take(&mut out.down), &mut tail)
            .unwrap();
        let decided = replies(&tail);
        assert_eq!(decided.len(), 64);
        (a, b, decided)
    }

    #[test]
    fn a_tail_that_encodes_its_replies_sends_what_encoding_its_messages_makes() {
        // One replica (head and tail) per way, the same 600 flows: SNAT's 512 ports
        // run out (drop rules), and every 50th request has a key that does not read
        // (a refusal, which stays a message).
        let cfg = scaling_config(snat(), 7, &["b"], (0, u64::MAX), 0);
        let mut plain = replica("b", cfg.clone());
        let mut encoding = replica("b", cfg);
        encoding.encode_replies(true);
        let reqs: Vec<_> = (0..600)
            .map(|i| {
                let mut r = request(i);
                if i % 50 == 7 {
                    r.key = Some(v1::FlowKey {
                        raw: vec![1, 2, 3].into(),
                    });
                }
                r
            })
            .collect();
        let (mut as_messages, mut as_bodies) = (Outbox::default(), Outbox::default());
        for chunk in reqs.chunks(100) {
            submit(&mut plain, chunk.to_vec(), &mut as_messages);
            submit(&mut encoding, chunk.to_vec(), &mut as_bodies);
        }
        let refusals = replies(&as_messages)
            .into_iter()
            .filter(|r| matches!(r.result, Some(v1::rule_reply::Result::Error(_))))
            .count();
        assert_eq!(refusals, 12);
        let dropped = replies(&as_messages)
            .iter()
            .filter(|r| format!("{:?}", r.result).contains("snat-exhausted"))
            .count();
        assert_eq!(dropped, 600 - 12 - 512);
        let mut want = as_messages.results;
        proto::encode_rule_replies(&mut want, 7);
        assert_eq!(
            want.iter().map(|r| r.encoded_replies.len()).sum::<usize>(),
            588
        );
        assert_eq!(as_bodies.results, want);
        // Off again: messages, as before.
        encoding.encode_replies(false);
        let mut out = Outbox::default();
        submit(&mut encoding, vec![request(0)], &mut out);
        assert_eq!(
            (replies(&out).len(), out.results[0].encoded_replies.len()),
            (1, 0)
        );
    }

    #[test]
    fn a_head_promoted_to_tail_answers_its_unacked_decisions_as_the_tail_did() {
        // The head keeps its decisions native until it must answer: promoted to tail
        // before the old tail's ack came, it answers each one as the old tail did.
        let (mut a, _b, decided) = chain_of_two();
        assert_eq!(a.unacked_len(), 1, "the head still holds the op unacked");
        let mut out = Outbox::default();
        let mut cfg = scaling_config(snat(), 7, &["a"], (0, u64::MAX), 0);
        cfg.group.as_mut().unwrap().epoch = 2;
        a.configure(cfg, &mut out);
        assert!(a.is_tail());
        assert_eq!(replies(&out), decided);
    }

    #[test]
    fn a_joiners_snapshot_carries_the_unacked_decisions_as_proto_replies() {
        let (mut a, _b, decided) = chain_of_two();
        let mut out = Outbox::default();
        // A successor with no state: it gets a snapshot with the unacked op's result.
        a.successor_lost(1);
        a.successor_ready(
            2,
            &v1::ReplicaHelloAck {
                applied: 0,
                initialized: false,
            },
            &mut out,
        );
        let snap = out.snapshot.expect("a snapshot for the joiner");
        assert_eq!(snap.pending.len(), 1);
        assert_eq!(snap.pending_results.len(), 1);
        assert_eq!(snap.pending_results[0].replies, decided);
    }

    /// NFs that count flows aside and fold them in an `update` they trigger per flow.
    struct TallyNfs;
    struct Tally {
        aside: u64,
        tally: u64,
    }
    impl nf::NetworkFunction for Tally {
        fn kind(&self) -> &str {
            "tally"
        }
        fn tables(&self) -> Vec<nf::TableSpec> {
            vec![nf::TableSpec::shared_write(
                "tally",
                nf::Consistency::Replicated,
            )]
        }
        fn first_packet(
            &mut self,
            _: &nf::FirstPacket,
            env: &mut NfEnv,
        ) -> Result<nf::Decision, nf::NfError> {
            self.aside += 1;
            env.trigger("tally", 0);
            Ok(nf::Decision::pass())
        }
        fn update(&mut self, table: &str, _: u64, _: &mut NfEnv) -> Result<(), nf::NfError> {
            if table != "tally" {
                return Err(nf::NfError::Other(format!("no table {table}")));
            }
            self.tally += std::mem::take(&mut self.aside);
            Ok(())
        }
        fn snapshot(&self) -> Result<Vec<u8>, nf::NfError> {
            Ok(format!("{}/{}", self.tally, self.aside).into_bytes())
        }
        fn restore(&mut self, _: &[u8]) -> Result<(), nf::NfError> {
            Ok(())
        }
        fn split(&mut self, _: &nf::SplitHalf) -> Result<Vec<u8>, nf::NfError> {
            Ok(Vec::new())
        }
        fn merge(&mut self, _: &[u8]) -> Result<(), nf::NfError> {
            Ok(())
        }
    }
    impl ChainFactory for TallyNfs {
        fn build_nf(&self, _: &str) -> Result<Box<dyn nf::NetworkFunction>, crate::ScError> {
            Ok(Box::new(Tally { aside: 0, tally: 0 }))
        }
    }

    /// Two partitions of one SNAT chain, each a group of one replica: what one's SNAT
    /// writes to its mapping mirror leaves in its op results, and the other applies it
    /// as an op of its own and hairpins to the mapping (docs/nf-api.md, "Mirrored
    /// tables").
    #[test]
    fn a_replica_on_a_spare_chain_decides_as_one_that_built_its_own() {
        // The built-in FW → SNAT → LB, as a node's spare shelf would build it ahead.
        let nfs = serde_json::json!([
            {"kind": "fw", "default_action": "allow"},
            snat(),
            {"kind": "lb", "services": [{"vip": "198.19.0.9", "port": 53, "protocol": "udp",
              "backends": [{"addr": "198.19.1.1", "port": 5353},
                           {"addr": "198.19.1.2", "port": 5353}]}]}
        ]);
        let cfg = group_config(nfs, 7, 1, &["a"], (0, u64::MAX), &[], 0);
        let spares = crate::spares::SpareChains::new("a", 1, std::sync::Arc::new(TestNfs));
        let c = cfg.chain.clone().unwrap();
        assert!(spares.take(&c).0.is_none());
        let t = std::time::Instant::now();
        let spare = loop {
            if let (Some(chain), _) = spares.take(&c) {
                break chain;
            }
            let failed = spares
                .counters
                .failed
                .load(std::sync::atomic::Ordering::Relaxed);
            assert_eq!(failed, 0, "the chain does not build");
            assert!(t.elapsed() < std::time::Duration::from_secs(10));
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        let mut built = replica("a", cfg.clone());
        let mut taken = ReplicaCore::with_chain("a", cfg.clone(), Ok(spare));
        taken.configure(cfg, &mut Outbox::default());
        let (mut x, mut y) = (Outbox::default(), Outbox::default());
        submit(&mut built, (0..64).map(request).collect(), &mut x);
        submit(&mut taken, (0..64).map(request).collect(), &mut y);
        assert_eq!(replies(&x).len(), 64);
        assert!(
            replies(&x).iter().all(|r| port(r).is_some()),
            "every flow mapped"
        );
        assert_eq!(replies(&x), replies(&y));
        spares.shutdown();
    }

    #[test]
    fn mirrored_writes_leave_in_results_and_land_as_an_op_at_the_other_partition() {
        let nf = serde_json::json!({"kind": "snat", "pools": [
            {"addresses": ["198.19.255.1"], "ports": {"lo": 1024, "hi": 1535},
             "sources": ["198.18.0.0/16"]}]});
        let cfg = |gid, node, range| group_config(nf.clone(), gid, 1, &[node], range, &[], 0);
        // Alone in the chain's key space: nobody to send to, so nothing leaves.
        let mut whole = replica("w", cfg(6, "w", (0, u64::MAX)));
        let mut out = Outbox::default();
        submit(&mut whole, vec![request(0)], &mut out);
        assert!(out.results.iter().all(|r| r.mirror.is_empty()));
        assert_eq!(whole.stats.mirror_sent, 0);

        // Two groups that each own (nearly) every key, so that the requests below land
        // in both whatever their hashes; neither owns the whole space.
        let a = replica("a", cfg(7, "a", (0, u64::MAX - 1)));
        let (mut a, mut b) = (a, replica("b", cfg(8, "b", (1, u64::MAX))));
        let mut out = Outbox::default();
        submit(&mut a, vec![request(0)], &mut out);
        let writes: Vec<v1::MirrorWrite> =
            out.results.iter().flat_map(|r| r.mirror.clone()).collect();
        assert_eq!(writes.len(), 1, "one new mapping: {writes:?}");
        assert_eq!((writes[0].nf, writes[0].deleted), (0, false));
        assert_eq!(a.stats.mirror_sent, 1);
        let mapped = port(&replies(&out)[0]).expect("a translated port");

        // b has never seen the mapping: a hairpin to it has nothing to reach.
        let hairpin = |sport| {
            let key = pipeline::FlowKey::new(
                100,
                17,
                "198.18.10.3".parse().unwrap(),
                sport,
                "198.19.255.1".parse().unwrap(),
                mapped as u16,
            );
            let r = RuleRequest::new(key, 1, 1, pipeline::PacketMeta::new(60, 0));
            proto::request_to_proto(&r, u64::from(sport))
        };
        let mut out = Outbox::default();
        submit(&mut b, vec![hairpin(5000)], &mut out);
        let dropped = |out: &Outbox| {
            match &replies(out)[0].result {
            Some(v1::rule_reply::Result::Rule(r)) => r.actions.iter().any(|x| {
                matches!(&x.kind, Some(v1::action::Kind::Drop(why)) if why == "snat-no-mapping")
            }),
            _ => false,
        }
        };
        assert!(dropped(&out), "{:?}", replies(&out));
        let mut out = Outbox::default();
        assert!(b.submit(
            v1::GroupSubmit {
                group: 8,
                epoch: 1,
                requests: None,
                events: None,
                mirror: vec![v1::MirrorBatch {
                    writes,
                    from_group: 7,
                }],
            },
            1_000,
            &mut out,
        ));
        assert_eq!((b.stats.mirror_imported, b.stats.mirror_skipped), (1, 0));
        assert!(
            out.results.iter().all(|r| r.mirror.is_empty()),
            "an import is not sent on"
        );
        let mut out = Outbox::default();
        submit(&mut b, vec![hairpin(5001)], &mut out);
        let Some(v1::rule_reply::Result::Rule(rule)) = &replies(&out)[0].result else {
            panic!("hairpinned: {:?}", replies(&out));
        };
        let rule = pipeline::Rule::try_from(rule).expect("a valid rule");
        let to = rule.actions.iter().find_map(|x| match x {
            pipeline::Action::SetDst { addr, port } => Some((*addr, *port)),
            _ => None,
        });
        let inside: std::net::IpAddr = "198.18.10.2".parse().unwrap();
        assert_eq!(to, Some((Some(inside), Some(1000))), "to a's inside host");
    }

    #[test]
    fn updates_an_nf_triggers_run_after_the_op_on_the_replica() {
        let cfg = group_config(
            serde_json::json!({"kind": "tally"}),
            7,
            1,
            &["a"],
            (0, u64::MAX),
            &[],
            0,
        );
        let mut a = ReplicaCore::new("a", cfg.clone(), &TallyNfs);
        let mut out = Outbox::default();
        a.configure(cfg, &mut out);
        submit(&mut a, (0..3).map(request).collect(), &mut out);
        assert_eq!(replies(&out).len(), 3);
        assert_eq!((a.stats.nf_updates, a.stats.nf_update_errors), (3, 0));
        // Folded after the op: nothing left aside.
        let snap = a.state(true).snapshot;
        assert_eq!(&snap[8..], b"3/0");
    }

    fn is_err(r: &v1::RuleReply, e: &str) -> bool {
        matches!(&r.result, Some(v1::rule_reply::Result::Error(x)) if x == e)
    }

    fn port(r: &v1::RuleReply) -> Option<u32> {
        match &r.result {
            Some(v1::rule_reply::Result::Rule(rule)) => {
                rule.actions.iter().find_map(|x| match &x.kind {
                    Some(v1::action::Kind::SetSrc(e)) => e.port,
                    _ => None,
                })
            }
            _ => None,
        }
    }

    #[test]
    fn forward_first_sends_a_scale_op_on_before_applying_it() {
        let (mut a, mut b, _) = chain_of_two();
        a.forward_first(true);
        b.forward_first(true);
        let mut out = Outbox::default();
        submit(&mut a, (0..8).map(request).collect(), &mut out);
        assert!(a.scale(split_step(1), 2_000, &mut out));
        // The split is in the outbox, behind the requests, and not applied yet.
        assert!(a.has_pending());
        assert_eq!(out.down.len(), 2);
        assert!(a.scale.outgoing.is_none());
        let down = std::mem::take(&mut out.down);
        a.run_pending(&mut out).unwrap();
        assert!(!a.has_pending());
        assert!(out.down.is_empty(), "forwarded once");
        submit(&mut a, (8..16).map(request).collect(), &mut out);
        // The tail (no successor) applies at once.
        let mut tail = Outbox::default();
        b.on_ops(1, down, &mut tail).unwrap();
        b.on_ops(1, std::mem::take(&mut out.down), &mut tail)
            .unwrap();
        assert!(!b.has_pending());
        assert_eq!(a.scale.outgoing, b.scale.outgoing);
        assert_eq!(a.state(true).snapshot, b.state(true).snapshot);
        assert_eq!(replies(&tail).len(), 16);
        assert!(
            a.unacked
                .iter()
                .any(|x| matches!(x.op.body, Some(v1::op::Body::Scale(_)))),
            "the split is kept unacked like any op"
        );
    }

    #[test]
    fn a_middle_replica_forwards_request_ops_before_applying_them() {
        let cfg = scaling_config(snat(), 7, &["a", "b", "c"], (0, u64::MAX), 0);
        let (mut a, mut b, mut c) = (
            replica("a", cfg.clone()),
            replica("b", cfg.clone()),
            replica("c", cfg),
        );
        for r in [&mut a, &mut b, &mut c] {
            r.forward_first(true);
        }
        let mut out = Outbox::default();
        let hello = |from: &str| v1::ReplicaHello {
            group: 7,
            epoch: 1,
            from: from.into(),
        };
        let ack = b.predecessor_hello(1, &hello("a")).unwrap();
        a.successor_ready(1, &ack, &mut out);
        let ack = c.predecessor_hello(2, &hello("b")).unwrap();
        let mut mid = Outbox::default();
        b.successor_ready(2, &ack, &mut mid);
        // The head applies as it numbers: two submits, two ops, nothing pending.
        submit(&mut a, (0..8).map(request).collect(), &mut out);
        submit(&mut a, (8..16).map(request).collect(), &mut out);
        assert!(!a.has_pending());
        assert_eq!(out.down.len(), 2);
        // The middle forwards each op before it applies it, one at a time.
        b.on_ops(1, std::mem::take(&mut out.down), &mut mid)
            .unwrap();
        assert!(b.has_pending());
        assert_eq!(mid.down.len(), 1, "the first op only");
        assert_eq!(b.applied, 0, "sent on, not yet applied");
        let mut to_tail = std::mem::take(&mut mid.down);
        b.run_pending(&mut mid).unwrap();
        assert_eq!(b.applied, 1);
        assert!(b.has_pending(), "the second op waits its turn");
        to_tail.append(&mut mid.down);
        b.run_pending(&mut mid).unwrap();
        assert!(!b.has_pending());
        assert_eq!(b.applied, 2);
        assert_eq!(to_tail.len(), 2);
        // The tail applies at once and answers every request; all three agree.
        let mut tail = Outbox::default();
        c.on_ops(2, to_tail, &mut tail).unwrap();
        assert!(!c.has_pending());
        assert_eq!(replies(&tail).len(), 16);
        assert_eq!(a.state(true).snapshot, b.state(true).snapshot);
        assert_eq!(b.state(true).snapshot, c.state(true).snapshot);
        assert_eq!(b.unacked_len(), 2, "kept unacked like any forwarded op");
    }

    #[test]
    fn a_split_is_an_op_every_replica_applies_at_the_same_point() {
        let (mut a, mut b, decided) = chain_of_two();
        let mut out = Outbox::default();
        assert!(a.scale(split_step(1), 2_000, &mut out));
        // After the split: old flows of the moved range are refused (their state left
        // with the part), every other flow is served, new flows of the moved range too.
        submit(&mut a, (0..128).map(request).collect(), &mut out);
        let mut tail = Outbox::default();
        b.on_ops(1, std::mem::take(&mut out.down), &mut tail)
            .unwrap();
        // Only the tail reports the part, once the split is applied there.
        let parts: Vec<&v1::ScalePart> = tail
            .results
            .iter()
            .filter_map(|r| r.part.as_ref())
            .collect();
        assert_eq!(parts.len(), 1);
        assert_eq!(parts[0].scale_id, 1);
        let part = parts[0].part.clone();
        // Both replicas split identically: same part kept, same state left.
        assert_eq!(a.scale.outgoing, b.scale.outgoing);
        assert_eq!(a.scale.outgoing.as_ref().unwrap().part, part);
        assert_eq!(a.state(true).snapshot, b.state(true).snapshot);
        assert_eq!(
            a.serving(),
            Some((0, u64::MAX)),
            "served until the end step"
        );
        let after = replies(&tail);
        assert_eq!(after.len(), 128);
        let mut refused = 0;
        let mut new_moved = 0;
        for (r, req) in after.iter().zip((0..128).map(request)) {
            let moved = hash_of(&req) < MID;
            let old = req.id < 64;
            assert_eq!(is_err(r, proto::ERR_MOVED), moved && old, "flow {}", req.id);
            if old && !moved {
                let orig = decided.iter().find(|d| d.id == r.id).unwrap();
                assert_eq!(r.result, orig.result, "kept flow {} changed its rule", r.id);
            }
            refused += usize::from(moved && old);
            new_moved += usize::from(moved && !old);
        }
        assert!(
            refused > 0 && new_moved > 0,
            "the test flows straddle the split"
        );

        // A repeated st changes nothing and reports the same part again.
        let before = a.state(true).snapshot;
        let mut out2 = Outbox::default();
        assert!(a.scale(split_step(1), 3_000, &mut out2));
        let mut tail2 = Outbox::default();
        b.on_ops(1, out2.down, &mut tail2).unwrap();
        assert_eq!(a.state(true).snapshot, before);
        assert_eq!(tail2.results[0].part.as_ref().unwrap().part, part);

        // The new group (awaiting scale 1) serves nothing before its install op...
        let mut c = replica("c", scaling_config(snat(), 8, &["c"], (0, MID - 1), 1));
        let moved_req: Vec<v1::RuleRequest> =
            (0..128).map(request).filter(|r| hash_of(r) < MID).collect();
        let mut co = Outbox::default();
        submit(&mut c, moved_req.clone(), &mut co);
        assert!(replies(&co).iter().all(|r| is_err(r, proto::ERR_NOT_READY)));
        let mut co = Outbox::default();
        assert!(c.scale(
            v1::scale_op::Step::Install(v1::ScaleInstall {
                part,
                delta: false,
                ..install_to_8()
            }),
            4_000,
            &mut co,
        ));
        let fin = co.results.iter().find_map(|r| r.fin.clone()).unwrap();
        assert_eq!((fin.scale_id, fin.group, fin.error.as_str()), (1, 8, ""));
        // fin: the old group's end op hands over what it decided in the moved range.
        let end = v1::scale_op::Step::End(v1::ScaleEnd {
            scale_id: 1,
            group: 7,
            abort: false,
        });
        assert!(a.scale(end.clone(), 5_000, &mut out));
        assert!(a.scale(end, 5_001, &mut out), "a repeated end");
        let mut tail3 = Outbox::default();
        b.on_ops(1, std::mem::take(&mut out.down), &mut tail3)
            .unwrap();
        let fins: Vec<v1::ScaleFin> = tail3.results.iter().filter_map(|r| r.fin.clone()).collect();
        assert_eq!(fins.len(), 2);
        assert!(!fins[0].delta.is_empty());
        assert_eq!(
            fins[0].delta, fins[1].delta,
            "a repeat reports the same delta"
        );
        assert_eq!(b.serving(), Some((MID, u64::MAX)));
        assert!(b.scale.outgoing.is_none());
        let mut co = Outbox::default();
        c.scale(
            v1::scale_op::Step::Install(v1::ScaleInstall {
                part: fins[0].delta.clone(),
                delta: true,
                ..install_to_8()
            }),
            6_000,
            &mut co,
        );
        assert_eq!(co.results[0].fin.as_ref().unwrap().error, "");
        // Every moved flow, old or decided by the old group after st, keeps its rule
        // at the new group; the old group refuses them now.
        let mut co = Outbox::default();
        submit(&mut c, moved_req.clone(), &mut co);
        for r in replies(&co) {
            let orig = decided
                .iter()
                .chain(&after)
                .find(|d| d.id == r.id && !is_err(d, proto::ERR_MOVED))
                .unwrap();
            assert_eq!(r.result, orig.result, "flow {} changed its rule", r.id);
        }
        submit(&mut a, moved_req, &mut out);
        let mut tail4 = Outbox::default();
        b.on_ops(1, std::mem::take(&mut out.down), &mut tail4)
            .unwrap();
        assert!(replies(&tail4).iter().all(|r| is_err(r, proto::ERR_MOVED)));
        // New flows on both sides get ports outside everything either holds.
        let new_moved: Vec<v1::RuleRequest> = (200..400)
            .map(request)
            .filter(|r| hash_of(r) < MID)
            .take(5)
            .collect();
        let new_kept: Vec<v1::RuleRequest> = (200..400)
            .map(request)
            .filter(|r| hash_of(r) >= MID)
            .take(5)
            .collect();
        let mut co = Outbox::default();
        submit(&mut c, new_moved, &mut co);
        submit(&mut a, new_kept, &mut out);
        let mut tail5 = Outbox::default();
        b.on_ops(1, out.down, &mut tail5).unwrap();
        // One port per flow (a flow asked twice has one), none shared by two flows.
        let by_flow: std::collections::HashMap<u64, u32> = decided
            .iter()
            .chain(&after)
            .chain(&replies(&co))
            .chain(&replies(&tail5))
            .filter_map(|r| Some((r.id, port(r)?)))
            .collect();
        let mut ports: Vec<u32> = by_flow.values().copied().collect();
        let n = ports.len();
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(
            ports.len(),
            n,
            "a port was handed out twice across the split"
        );
        assert_eq!(n, 128 + 10);
    }

    #[test]
    fn an_aborted_split_takes_the_part_back() {
        let (mut a, mut b, decided) = chain_of_two();
        let mut out = Outbox::default();
        a.scale(split_step(3), 2_000, &mut out);
        a.scale(
            v1::scale_op::Step::End(v1::ScaleEnd {
                scale_id: 3,
                group: 7,
                abort: true,
            }),
            2_001,
            &mut out,
        );
        // A late st of the aborted scale does nothing.
        a.scale(split_step(3), 2_002, &mut out);
        submit(&mut a, (0..64).map(request).collect(), &mut out);
        let mut tail = Outbox::default();
        b.on_ops(1, out.down, &mut tail).unwrap();
        let fin = tail.results.iter().find_map(|r| r.fin.clone()).unwrap();
        assert_eq!((fin.scale_id, fin.error.as_str()), (3, ""));
        assert_eq!(b.serving(), Some((0, u64::MAX)));
        assert!(b.scale.outgoing.is_none());
        assert_eq!(a.state(true).snapshot, b.state(true).snapshot);
        // Every flow is served again, with its old rule.
        let again = replies(&tail);
        assert_eq!(again.len(), 64);
        for r in again {
            let orig = decided.iter().find(|d| d.id == r.id).unwrap();
            assert_eq!(r.result, orig.result);
        }
    }

    /// Epoch 2 of group 7 under `cfg` (listing a, b, c) with c joining: c is configured,
    /// b (its predecessor) too; b's outbox, and the hello b sends c.
    fn joiner_c(
        b: &mut ReplicaCore,
        mut cfg: v1::GroupConfig,
    ) -> (ReplicaCore, Outbox, v1::ReplicaHello) {
        cfg.group.as_mut().unwrap().epoch = 2;
        cfg.joining = vec!["c".into()];
        let mut c = ReplicaCore::new("c", cfg.clone(), &TestNfs);
        c.configure(cfg.clone(), &mut Outbox::default());
        let mut bo = Outbox::default();
        b.configure(cfg, &mut bo);
        let hello = v1::ReplicaHello {
            group: 7,
            epoch: 2,
            from: "b".into(),
        };
        (c, bo, hello)
    }

    #[test]
    fn a_joiner_gets_the_scaling_state_in_its_snapshot() {
        let (mut a, mut b, _) = chain_of_two();
        let mut out = Outbox::default();
        a.scale(split_step(5), 2_000, &mut out);
        let mut tail = Outbox::default();
        b.on_ops(1, out.down, &mut tail).unwrap();
        // b serves a snapshot to a joiner c.
        let (mut c, mut bo, hello) = joiner_c(
            &mut b,
            scaling_config(snat(), 7, &["a", "b", "c"], (0, u64::MAX), 0),
        );
        let ack = c.predecessor_hello(9, &hello).unwrap();
        assert!(!ack.initialized);
        b.successor_ready(9, &ack, &mut bo);
        let snap = bo.snapshot.unwrap();
        c.on_snapshot(9, snap, &TestNfs, &mut Outbox::default());
        assert_eq!(c.serving(), Some((0, u64::MAX)));
        assert!(c.scale.outgoing.as_ref().is_some_and(|o| o.old.is_some()));
        assert_eq!(c.scale.outgoing, b.scale.outgoing);
        assert_eq!(c.scale.done, b.scale.done);
    }

    /// Issue 19's bad input: a joiner handed a corrupt snapshot (the FW's platform
    /// tables cut short) refuses it, stays uninitialized and says so in its next ack;
    /// its predecessor then sends a fresh snapshot, which brings it in.
    #[test]
    fn a_corrupt_snapshot_is_refused_and_the_joiner_rejoins_by_a_fresh_one() {
        let (_a, mut b, _) =
            chain_of_two_with(scaling_config(fw_snat(), 7, &["a", "b"], (0, u64::MAX), 0));
        let (mut c, mut bo, hello) = joiner_c(
            &mut b,
            scaling_config(fw_snat(), 7, &["a", "b", "c"], (0, u64::MAX), 0),
        );
        let ack = c.predecessor_hello(9, &hello).unwrap();
        b.successor_ready(9, &ack, &mut bo);
        let mut snap = bo.snapshot.take().expect("a snapshot for the joiner");
        let good = snap.state.clone();
        snap.state.truncate(good.len() - 5);
        c.on_snapshot(9, snap, &TestNfs, &mut Outbox::default());
        assert!(!c.initialized, "a corrupt snapshot is refused");
        assert_eq!(c.stats.snapshots_restored, 0);
        let ack = c.predecessor_hello(9, &hello).unwrap();
        assert!(!ack.initialized, "the joiner says it still needs state");
        b.successor_ready(9, &ack, &mut bo);
        let snap = bo.snapshot.take().expect("a fresh snapshot");
        assert_eq!(snap.state, good);
        c.on_snapshot(9, snap, &TestNfs, &mut Outbox::default());
        assert!(c.initialized);
        assert_eq!(c.stats.snapshots_restored, 1);
        let state = |r: &ReplicaCore| r.chain.as_ref().unwrap().snapshot().unwrap();
        assert_eq!(
            state(&c),
            state(&b),
            "the joiner holds the predecessor's state"
        );
    }

    // ------------------------------------------------------------ gradual migration

    /// FW (conntrack, outbound only) then SNAT: both keep per-flow state.
    fn fw_snat() -> serde_json::Value {
        let fw = serde_json::json!({"kind": "fw", "tenants": [{"tenant": 1, "default_action": "deny",
            "rules": [{"action": "allow", "src": ["198.18.0.0/16"]}]}]});
        serde_json::json!([fw, snat()])
    }

    /// The scale-out install the migration tests send to the new group 8: scale 1,
    /// the lower half of the range; each test adds what it carries.
    fn install_to_8() -> v1::ScaleInstall {
        v1::ScaleInstall {
            scale_id: 1,
            kind: v1::ScaleKind::Out as i32,
            group: 8,
            range_lo: 0,
            range_hi: MID - 1,
            ..Default::default()
        }
    }

    /// Run `step` through the old group `a` → `b`; the tail's fins.
    fn old_step(
        a: &mut ReplicaCore,
        b: &mut ReplicaCore,
        step: v1::scale_op::Step,
    ) -> Vec<v1::OpResult> {
        let mut out = Outbox::default();
        assert!(a.scale(step, 5_000, &mut out));
        let mut tail = Outbox::default();
        b.on_ops(1, out.down, &mut tail).unwrap();
        tail.results
    }

    fn new_step(c: &mut ReplicaCore, step: v1::scale_op::Step) -> v1::ScaleFin {
        let mut co = Outbox::default();
        assert!(c.scale(step, 5_000, &mut co));
        co.results.iter().find_map(|r| r.fin.clone()).unwrap()
    }

    /// A gradual scale-out of the FW → SNAT group a → b (64 flows decided) to a new
    /// one-replica group c, up to the switch: split (no flow moves), install at c, the
    /// end step at the old group and the merge of its list of flows still there.
    fn gradual_until_switch() -> (ReplicaCore, ReplicaCore, ReplicaCore, Vec<v1::RuleReply>) {
        let (mut a, mut b, decided) =
            chain_of_two_with(scaling_config(fw_snat(), 7, &["a", "b"], (0, u64::MAX), 0));
        let mut st = split_step(1);
        if let v1::scale_op::Step::Split(s) = &mut st {
            s.gradual = true;
        }
        let res = old_step(&mut a, &mut b, st);
        let part = res.iter().find_map(|r| r.part.clone()).unwrap();
        // No flow left with the part: the old group still holds all 64.
        let held = |r: &ReplicaCore| r.chain.as_ref().unwrap().flow_hashes().unwrap();
        let moved: Vec<u64> = (0..64)
            .map(request)
            .map(|r| hash_of(&r))
            .filter(|h| *h < MID)
            .collect::<BTreeSet<u64>>()
            .into_iter()
            .collect();
        assert!(
            !moved.is_empty() && moved.len() < 64,
            "flows straddle the split"
        );
        assert_eq!(part.pending, moved, "the part names the flows that stayed");
        assert_eq!(held(&b).len(), 64);
        let mut c = replica("c", scaling_config(fw_snat(), 8, &["c"], (0, MID - 1), 1));
        let fin = new_step(
            &mut c,
            v1::scale_op::Step::Install(v1::ScaleInstall {
                part: part.part,
                pending: part.pending,
                ..install_to_8()
            }),
        );
        assert_eq!(fin.error, "");
        assert!(held(&c).is_empty(), "the new group starts with no flow");
        let res = old_step(
            &mut a,
            &mut b,
            v1::scale_op::Step::End(v1::ScaleEnd {
                scale_id: 1,
                group: 7,
                abort: false,
            }),
        );
        let end = res.iter().find_map(|r| r.fin.clone()).unwrap();
        assert_eq!(end.pending, moved);
        assert!(end.delta.is_empty(), "nothing moves in bulk");
        assert_eq!(b.serving(), Some((MID, u64::MAX)));
        let fin = new_step(
            &mut c,
            v1::scale_op::Step::Install(v1::ScaleInstall {
                delta: true,
                pending: end.pending,
                ..install_to_8()
            }),
        );
        assert_eq!(fin.error, "");
        (a, b, c, decided)
    }

    fn pull(id: u64, keys: Vec<u64>, chunk: Option<(u64, u64)>, last: bool) -> v1::scale_op::Step {
        let (lo, hi) = chunk.unwrap_or((0, 0));
        v1::scale_op::Step::Pull(v1::ScalePull {
            scale_id: 1,
            group: 7,
            pull: id,
            keys,
            sweep: chunk.is_some(),
            lo,
            hi,
            last,
        })
    }

    fn merge(
        id: u64,
        parts: Vec<Vec<u8>>,
        keys: Vec<u64>,
        chunk: Option<(u64, u64)>,
        last: bool,
    ) -> v1::scale_op::Step {
        let (swept_lo, swept_hi) = chunk.unwrap_or((0, 0));
        v1::scale_op::Step::Install(v1::ScaleInstall {
            pull: id,
            parts,
            keys,
            swept: chunk.is_some(),
            swept_lo,
            swept_hi,
            last,
            ..install_to_8()
        })
    }

    #[test]
    fn a_flow_accessed_after_a_gradual_scale_out_moves_with_its_state_and_others_never_wait() {
        let (mut a, mut b, mut c, decided) = gradual_until_switch();
        let old_moved: Vec<v1::RuleRequest> =
            (0..64).map(request).filter(|r| hash_of(r) < MID).collect();
        let new_moved: Vec<v1::RuleRequest> = (200..400)
            .map(request)
            .filter(|r| hash_of(r) < MID)
            .take(4)
            .collect();
        // One batch: the old flows are refused (their state is still at the old owner),
        // the new flows of the same range are decided at once.
        let mut co = Outbox::default();
        submit(
            &mut c,
            old_moved.iter().chain(&new_moved).cloned().collect(),
            &mut co,
        );
        let first = replies(&co);
        assert_eq!(first.len(), old_moved.len() + new_moved.len());
        for r in &first {
            let old = r.id < 64;
            assert_eq!(is_err(r, proto::ERR_MIGRATING), old, "flow {}", r.id);
            assert_eq!(port(r).is_some(), !old, "flow {} decided", r.id);
        }
        assert_eq!(c.stats.migrating_requests, old_moved.len() as u64);
        // First access: FM pulls that one flow's state from the old group.
        let k = &old_moved[0];
        let res = old_step(&mut a, &mut b, pull(1, vec![hash_of(k)], None, false));
        let fin = res.iter().find_map(|r| r.fin.clone()).unwrap();
        assert_eq!((fin.pull, fin.error.as_str(), fin.parts.len()), (1, "", 1));
        // A repeat reports the same parts and moves nothing more.
        let again = old_step(&mut a, &mut b, pull(1, vec![hash_of(k)], None, false));
        assert_eq!(
            again.iter().find_map(|r| r.fin.clone()).unwrap().parts,
            fin.parts
        );
        assert_eq!(a.state(true).snapshot, b.state(true).snapshot);
        let held = |r: &ReplicaCore| r.chain.as_ref().unwrap().flow_hashes().unwrap();
        assert!(
            !held(&b).contains(&hash_of(k)),
            "the flow left the old group"
        );
        let m = new_step(
            &mut c,
            merge(1, fin.parts.clone(), vec![hash_of(k)], None, false),
        );
        assert_eq!((m.pull, m.error.as_str()), (1, ""));
        // Merged once: a repeated merge step is a no-op.
        let snap = c.state(true).snapshot;
        new_step(&mut c, merge(1, fin.parts, vec![hash_of(k)], None, false));
        assert_eq!(c.state(true).snapshot, snap);
        // Both the FW's conntrack entry and the SNAT mapping arrived: the same rule
        // (the same external port, the same verdict) as the old group decided.
        assert!(held(&c).contains(&hash_of(k)));
        let mut co = Outbox::default();
        submit(&mut c, old_moved.clone(), &mut co);
        for r in replies(&co) {
            if r.id == k.id {
                let orig = decided.iter().find(|d| d.id == k.id).unwrap();
                assert_eq!(r.result, orig.result, "the pulled flow kept its rule");
                assert!(port(&r).is_some());
            } else {
                assert!(
                    is_err(&r, proto::ERR_MIGRATING),
                    "flow {} not pulled yet",
                    r.id
                );
            }
        }
    }

    #[test]
    fn the_sweep_moves_flows_never_accessed_and_the_old_group_retires_only_at_its_end() {
        let (mut a, mut b, mut c, decided) = gradual_until_switch();
        let held = |r: &ReplicaCore| r.chain.as_ref().unwrap().flow_hashes().unwrap();
        let in_moved = |r: &ReplicaCore| held(r).into_iter().filter(|h| *h < MID).count();
        let total = in_moved(&b);
        assert!(total > 0);
        let chunks = 4u64;
        let width = (MID - 1) / chunks;
        for i in 0..chunks {
            let lo = i * width;
            let hi = if i + 1 == chunks {
                MID - 1
            } else {
                lo + width - 1
            };
            let last = i + 1 == chunks;
            // Not retired before the last chunk: it still owes flows (or their
            // migration record says so).
            let owes = a
                .scale
                .migrating_out
                .as_ref()
                .is_some_and(|m| !m.pending.is_empty());
            assert!(owes, "chunk {i}: the old group still owes flows");
            let res = old_step(&mut a, &mut b, pull(i + 1, vec![], Some((lo, hi)), last));
            let fin = res.iter().find_map(|r| r.fin.clone()).unwrap();
            assert_eq!(fin.error, "");
            let m = new_step(
                &mut c,
                merge(i + 1, fin.parts, vec![], Some((lo, hi)), last),
            );
            assert_eq!(m.error, "");
            // Chain replication holds on the old side: both replicas pulled alike.
            assert_eq!(a.state(true).snapshot, b.state(true).snapshot);
        }
        // Retired: nothing of the moved range is left at the old group, nothing is
        // awaited at the new one, and every flow is there.
        assert_eq!(in_moved(&b), 0);
        assert!(b
            .scale
            .migrating_out
            .as_ref()
            .is_some_and(|m| m.pending.is_empty()));
        assert!(c
            .scale
            .migrating_in
            .as_ref()
            .is_some_and(|m| m.pending.is_empty()));
        assert_eq!(held(&c).len(), total);
        let old_moved: Vec<v1::RuleRequest> =
            (0..64).map(request).filter(|r| hash_of(r) < MID).collect();
        let mut co = Outbox::default();
        submit(&mut c, old_moved.clone(), &mut co);
        let got = replies(&co);
        assert_eq!(got.len(), old_moved.len());
        for r in got {
            let orig = decided.iter().find(|d| d.id == r.id).unwrap();
            assert_eq!(r.result, orig.result, "flow {} kept its rule", r.id);
        }
        // The old group refuses them now (FM sends them on to the new one).
        let mut out = Outbox::default();
        submit(&mut a, old_moved, &mut out);
        let mut tail = Outbox::default();
        b.on_ops(1, out.down, &mut tail).unwrap();
        assert!(replies(&tail).iter().all(|r| is_err(r, proto::ERR_MOVED)));
    }

    #[test]
    fn a_joiner_of_the_new_group_gets_the_flows_it_must_wait_for() {
        let (_a, _b, c, _) = gradual_until_switch();
        let snap = c.state(true);
        let mut cfg = scaling_config(fw_snat(), 8, &["c", "d"], (0, MID - 1), 0);
        cfg.group.as_mut().unwrap().epoch = 2;
        let mut d = ReplicaCore::new("d", cfg.clone(), &TestNfs);
        d.configure(cfg, &mut Outbox::default());
        let s = ScaleState::from_proto(&c.scale.to_proto());
        assert_eq!(s, c.scale, "the scaling state survives a snapshot");
        assert!(!snap.snapshot.is_empty());
        d.scale = s;
        let old: Vec<v1::RuleRequest> = (0..64).map(request).filter(|r| hash_of(r) < MID).collect();
        assert!(old.iter().all(|r| d.scale.awaits(hash_of(r))));
    }
}
