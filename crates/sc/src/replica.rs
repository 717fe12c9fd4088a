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
//!   with its result, in an *unacked* buffer.
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

use std::collections::VecDeque;

use nf::{Chain, FirstPacket, NfEnv};
use pipeline::RuleRequest;
use proto::{v1, ChainParts};
use tracing::{debug, info, warn};

use crate::factory::ChainFactory;

/// An applied op and what it produced.
#[derive(Debug, Clone)]
pub struct Applied {
    pub op: v1::Op,
    pub result: v1::OpResult,
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
    pub stats: ReplicaStats,
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
            stats: ReplicaStats::default(),
        };
        r.cfg = cfg;
        r
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
            if !a.result.replies.is_empty() || !a.result.expired.is_empty() {
                out.results.push(a.result);
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
                pending_results: self.unacked.iter().map(|a| a.result.clone()).collect(),
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
            .map(|(op, result)| Applied { op, result })
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
        for op in ops {
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
        let result = self.apply(&op);
        self.route(op, result, out);
    }

    fn route(&mut self, op: v1::Op, result: v1::OpResult, out: &mut Outbox) {
        if self.is_tail() {
            if !result.replies.is_empty() || !result.expired.is_empty() {
                out.results.push(result);
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

    /// Apply one op to the chain. Deterministic in (state, op).
    fn apply(&mut self, op: &v1::Op) -> v1::OpResult {
        self.applied = op.seq;
        self.last_now = self.last_now.max(op.now_ms);
        self.stats.ops_applied += 1;
        let mut result = v1::OpResult {
            seq: op.seq,
            ..Default::default()
        };
        let partition = self.cfg.partition.unwrap_or_default();
        match &op.body {
            Some(v1::op::Body::Requests(b)) => {
                result.replies.reserve(b.requests.len());
                for (i, m) in b.requests.iter().enumerate() {
                    self.stats.requests_applied += 1;
                    let seed = op.seed ^ splitmix(i as u64);
                    let reply = self.decide(m, &partition, op.now_ms, seed);
                    result.replies.push(reply);
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
            None => {}
        }
        result
    }

    fn decide(
        &mut self,
        m: &v1::RuleRequest,
        partition: &v1::Partition,
        now_ms: u64,
        seed: u64,
    ) -> v1::RuleReply {
        let req = match RuleRequest::try_from(m) {
            Ok(r) => r,
            Err(e) => {
                self.stats.bad_requests += 1;
                return proto::error_reply(m, format!("bad request: {e}"));
            }
        };
        if req.tenant != partition.tenant || req.chain != partition.chain {
            self.stats.bad_requests += 1;
            return proto::error_reply(m, "request for another partition");
        }
        let chain = match &mut self.chain {
            Ok(c) => c,
            Err(e) => return proto::error_reply(m, format!("chain unavailable: {e}")),
        };
        let pkt = FirstPacket {
            key: req.key,
            tenant: req.tenant,
            meta: req.meta,
        };
        let mut env = NfEnv::new(now_ms, seed);
        match chain.decide(&pkt, &mut env) {
            Ok(rules) => v1::RuleReply {
                id: m.id,
                key: m.key.clone(),
                result: Some(v1::rule_reply::Result::Rule((&rules.forward).into())),
                also: rules.reverse.iter().map(v1::Rule::from).collect(),
                worker: m.worker,
            },
            Err(e) => proto::error_reply(m, e.to_string()),
        }
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
        }
    }
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
        let def: proto::ChainDef = serde_json::from_value(serde_json::json!({
            "tenant": 1, "chain": 1,
            "nfs": [{"kind": "test-snat", "addrs": ["198.19.255.1"], "ports": [1024, 1100]}],
            "forward": {"decap": true, "encap": {"dst": "198.18.0.9", "vni": 200}},
            "reverse": {"decap": true, "encap": {"dst": "198.18.0.50", "vni": 100}}
        }))
        .unwrap();
        v1::GroupConfig {
            group: Some(v1::ScGroup {
                id: 7,
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
                hash_lo: 0,
                hash_hi: u64::MAX,
                group: 7,
            }),
            chain: Some(def.to_proto().unwrap()),
            joining: joining.iter().map(|s| s.to_string()).collect(),
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
}
