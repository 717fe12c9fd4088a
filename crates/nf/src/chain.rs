//! Chains: sequence, branch on a verdict label, join; compiled per flow into one rule per
//! direction.

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use pipeline::{Action, Actions, FlowKey, Rule};
use smallvec::SmallVec;
use thiserror::Error;

use crate::env::{NfEnv, Trigger};
use crate::state::MirrorWrite;
use crate::types::{
    FirstPacket, FlowEvent, MergeDecoder, NetworkFunction, NfError, PartitionBy, PreparedPart,
    Rewrite, SplitHalf, Verdict,
};

/// One step of a chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChainSpec {
    /// Run NF number `n` of the chain.
    Nf(usize),
    /// Run steps in order.
    Seq(Vec<ChainSpec>),
    /// Run NF `nf`, then the arm whose label its verdict carries (or `default`), then
    /// continue after the branch: Serpens `distribute` followed by a join.
    Branch {
        nf: usize,
        arms: Vec<(String, ChainSpec)>,
        default: Box<ChainSpec>,
    },
}

impl ChainSpec {
    /// NFs 0..n in order.
    pub fn seq(n: usize) -> Self {
        ChainSpec::Seq((0..n).map(ChainSpec::Nf).collect())
    }

    /// The NFs in the order a flow meets them, if that order is fixed (no branch).
    fn linear(&self) -> Option<Vec<usize>> {
        match self {
            ChainSpec::Nf(i) => Some(vec![*i]),
            ChainSpec::Seq(v) => {
                let mut out = Vec::new();
                for s in v {
                    out.extend(s.linear()?);
                }
                Some(out)
            }
            ChainSpec::Branch { .. } => None,
        }
    }

    fn check(&self, n: usize) -> Result<(), ChainError> {
        match self {
            ChainSpec::Nf(i) if *i >= n => Err(ChainError::NoSuchNf(*i)),
            ChainSpec::Nf(_) => Ok(()),
            ChainSpec::Seq(v) => v.iter().try_for_each(|s| s.check(n)),
            ChainSpec::Branch { nf, arms, default } => {
                if *nf >= n {
                    return Err(ChainError::NoSuchNf(*nf));
                }
                arms.iter().try_for_each(|(_, s)| s.check(n))?;
                default.check(n)
            }
        }
    }
}

/// How a composed rule leaves PP in one direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Egress {
    /// Strip the tenant's VXLAN header first (traffic arrived encapsulated).
    pub decap: bool,
    /// Re-encapsulate toward this VTEP with this VNI.
    pub encap: Option<(Ipv4Addr, u32)>,
    pub inner_dmac: Option<[u8; 6]>,
    pub output: u8,
}

impl Egress {
    pub const LOCAL: Egress = Egress {
        decap: false,
        encap: None,
        inner_dmac: None,
        output: 0,
    };

    /// The rule's actions: decap, `rw`'s rewrites, encap, count (if `count`), output.
    /// At most six, held inline: a decision allocates nothing for its rules.
    fn frame(&self, rw: &Rewrite, count: bool) -> Actions {
        let mut v = Actions::new();
        if self.decap {
            v.push(Action::DecapVxlan);
        }
        rw.push_actions(&mut v);
        if let Some((dst, vni)) = self.encap {
            v.push(Action::EncapVxlan {
                dst,
                vni,
                inner_dmac: self.inner_dmac,
                inner_smac: None,
            });
        }
        if count {
            v.push(Action::Count);
        }
        v.push(Action::Output(self.output));
        v
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ChainError {
    #[error("chain refers to NF {0}, which it does not have")]
    NoSuchNf(usize),
    #[error("chain has no NFs")]
    Empty,
    #[error("NF {nf} ({kind}): {err}")]
    Nf {
        nf: usize,
        kind: String,
        err: NfError,
    },
}

/// The NFs a decision ran through, by kind, in order. Inline up to four: a decision
/// makes no allocation for it.
pub type NfPath = SmallVec<[Arc<str>; 4]>;

/// The rules a chain produced for one flow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComposedRules {
    /// Keyed on the first packet's key.
    pub forward: Rule,
    /// Keyed on the reverse of the forward-rewritten key, on the forward egress VNI;
    /// absent when the flow is dropped.
    pub reverse: Option<Rule>,
    /// NF kinds in the order they ran (shared with the chain: no allocation per flow).
    pub path: NfPath,
}

impl ComposedRules {
    /// [`ComposedRules::path`] as plain names.
    pub fn path_names(&self) -> Vec<&str> {
        self.path.iter().map(|k| &**k).collect()
    }
}

/// A chain instance: its NFs (with their state) and its shape.
pub struct Chain {
    nfs: Vec<Box<dyn NetworkFunction>>,
    /// Each NF's `kind()`, once: what a decision's path holds.
    kinds: Vec<Arc<str>>,
    /// Updates NFs asked for through `NfEnv::trigger` since the last
    /// [`Chain::run_triggers`], with the asking NF's index.
    triggered: Vec<(usize, Trigger)>,
    /// Shared, so that a decision borrows it while the NFs change: one reference count
    /// per flow rather than a copy of the spec.
    spec: Arc<ChainSpec>,
    /// The spec as replies meet it (NFs last first), if it has no branch.
    reply_spec: Option<Arc<ChainSpec>>,
    partition: PartitionBy,
    /// Whether one of the NFs reads PP's counters
    /// ([`NetworkFunction::counts_traffic`]): then the chain's rules count.
    counts: bool,
    pub forward_egress: Egress,
    pub reverse_egress: Egress,
}

impl Chain {
    pub fn new(
        nfs: Vec<Box<dyn NetworkFunction>>,
        spec: ChainSpec,
        forward_egress: Egress,
        reverse_egress: Egress,
    ) -> Result<Self, ChainError> {
        if nfs.is_empty() {
            return Err(ChainError::Empty);
        }
        spec.check(nfs.len())?;
        for (i, nf) in nfs.iter().enumerate() {
            for t in nf.tables() {
                t.validate().map_err(|err| ChainError::Nf {
                    nf: i,
                    kind: nf.kind().to_string(),
                    err,
                })?;
            }
        }
        let reply_spec = spec.linear().map(|mut order| {
            order.reverse();
            Arc::new(ChainSpec::Seq(
                order.into_iter().map(ChainSpec::Nf).collect(),
            ))
        });
        let kinds = nfs.iter().map(|nf| Arc::from(nf.kind())).collect();
        let counts = nfs.iter().any(|nf| nf.counts_traffic());
        Ok(Chain {
            nfs,
            kinds,
            triggered: Vec::new(),
            spec: Arc::new(spec),
            reply_spec,
            partition: PartitionBy::Flow,
            counts,
            forward_egress,
            reverse_egress,
        })
    }

    pub fn nfs(&self) -> &[Box<dyn NetworkFunction>] {
        &self.nfs
    }

    /// NF `i`, to change in place (not to replace: its kind is the chain's record of it).
    pub fn nf_mut(&mut self, i: usize) -> Option<&mut dyn NetworkFunction> {
        Some(self.nfs.get_mut(i)?.as_mut())
    }

    /// What the chain's NFs ask it to be partitioned by: the first answer of theirs that
    /// is not the flow (`NetworkFunction::partition_by`).
    pub fn partition_by(&self) -> PartitionBy {
        (self.nfs.iter())
            .map(|nf| nf.partition_by())
            .find(|p| !p.is_flow())
            .unwrap_or_default()
    }

    /// Partition the chain by `by`: every NF splits its per-flow state by it, and
    /// [`Chain::partition`] answers it. An NF that cannot refuses, and then nothing
    /// changes.
    pub fn set_partition(&mut self, by: PartitionBy) -> Result<(), ChainError> {
        for (i, nf) in self.nfs.iter().enumerate() {
            if !by.is_flow() && nf.state().is_none() {
                return Err(ChainError::Nf {
                    nf: i,
                    kind: nf.kind().to_string(),
                    err: NfError::Config(format!(
                        "keeps its own state, which splits by the flow hash only, not by {by:?}"
                    )),
                });
            }
        }
        for (i, nf) in self.nfs.iter_mut().enumerate() {
            nf.set_partition(by).map_err(|err| ChainError::Nf {
                nf: i,
                kind: nf.kind().to_string(),
                err,
            })?;
        }
        self.partition = by;
        Ok(())
    }

    /// What the chain is partitioned by ([`Chain::set_partition`]; the flow until then).
    pub fn partition(&self) -> PartitionBy {
        self.partition
    }

    /// Run the chain on a flow's first packet and compose the per-direction rules.
    pub fn decide(
        &mut self,
        pkt: &FirstPacket,
        env: &mut NfEnv,
    ) -> Result<ComposedRules, ChainError> {
        let mut walk = Walk {
            key: pkt.key,
            forward: Rewrite::NONE,
            reverse: Rewrite::NONE,
            timeout: None,
            path: NfPath::new(),
            dropped: None,
        };
        // A reply whose rule PP and FM lost (evicted, a PP node that took over a vIP)
        // meets the NFs in reverse order, each seeing the reply as the NF after it
        // rewrote it, as the reverse rule would have carried it. Run forward, an SNAT
        // before a firewall would never see it and the firewall, not knowing the
        // translated address, would refuse a live connection.
        let reply = self.is_reply(pkt);
        let spec = match (&self.reply_spec, reply) {
            (Some(r), true) => Arc::clone(r),
            _ => Arc::clone(&self.spec),
        };
        self.run(&spec, pkt, env, &mut walk)?;
        let (fwd_egress, rev_egress) = match reply {
            true => (&self.reverse_egress, &self.forward_egress),
            false => (&self.forward_egress, &self.reverse_egress),
        };
        let timeout = walk.timeout;
        if let Some(reason) = walk.dropped {
            let mut forward = Rule::new(pkt.key, Actions::new());
            if self.counts {
                forward.actions.push(Action::Count);
            }
            forward.actions.push(Action::Drop { reason });
            forward.idle_timeout = timeout;
            return Ok(ComposedRules {
                forward,
                reverse: None,
                path: walk.path,
            });
        }
        let mut forward = Rule::new(pkt.key, fwd_egress.frame(&walk.forward, self.counts));
        forward.idle_timeout = timeout;
        let mut rkey: FlowKey = walk.key.reversed();
        if let Some((_, vni)) = fwd_egress.encap {
            rkey.set_vni(vni);
        }
        let mut reverse = Rule::new(rkey, rev_egress.frame(&walk.reverse, self.counts));
        reverse.idle_timeout = timeout;
        Ok(ComposedRules {
            forward,
            reverse: Some(reverse),
            path: walk.path,
        })
    }

    /// Whether the request is the reply direction of a flow some NF holds, so that the
    /// NFs meet it last first. A chain with branches has no single reverse order and
    /// runs every request forward; a bare TCP SYN opens a connection and is never a
    /// reply, so the common first packet asks no NF.
    fn is_reply(&self, pkt: &FirstPacket) -> bool {
        use packet::tcp_flags::{ACK, SYN};
        let flags = pkt.meta.tcp_flags;
        if self.reply_spec.is_none()
            || (pkt.key.proto() == packet::proto::TCP && flags & SYN != 0 && flags & ACK == 0)
        {
            return false;
        }
        self.nfs.iter().rev().any(|nf| nf.knows_reply(&pkt.key))
    }

    fn run(
        &mut self,
        spec: &ChainSpec,
        pkt: &FirstPacket,
        env: &mut NfEnv,
        w: &mut Walk,
    ) -> Result<Option<String>, ChainError> {
        if w.dropped.is_some() {
            return Ok(None);
        }
        match spec {
            ChainSpec::Nf(i) => self.run_nf(*i, pkt, env, w),
            ChainSpec::Seq(steps) => {
                let mut label = None;
                for s in steps {
                    label = self.run(s, pkt, env, w)?;
                    if w.dropped.is_some() {
                        break;
                    }
                }
                Ok(label)
            }
            ChainSpec::Branch { nf, arms, default } => {
                let label = self.run_nf(*nf, pkt, env, w)?;
                if w.dropped.is_some() {
                    return Ok(None);
                }
                let arm = arms
                    .iter()
                    .find(|(l, _)| Some(l) == label.as_ref())
                    .map(|(_, s)| s)
                    .unwrap_or(default);
                self.run(arm, pkt, env, w)
            }
        }
    }

    fn run_nf(
        &mut self,
        i: usize,
        pkt: &FirstPacket,
        env: &mut NfEnv,
        w: &mut Walk,
    ) -> Result<Option<String>, ChainError> {
        let nf = self.nfs.get_mut(i).ok_or(ChainError::NoSuchNf(i))?;
        let seen = FirstPacket { key: w.key, ..*pkt };
        let d = nf.first_packet(&seen, env);
        self.triggered
            .extend(env.triggers.drain(..).map(|t| (i, t)));
        let d = d.map_err(|err| ChainError::Nf {
            nf: i,
            kind: self.nfs[i].kind().to_string(),
            err,
        })?;
        w.path.push(Arc::clone(&self.kinds[i]));
        if let Some(t) = d.idle_timeout {
            w.timeout = Some(w.timeout.map_or(t, |cur: Duration| cur.min(t)));
        }
        match d.verdict {
            Verdict::Drop { reason } => {
                w.dropped = Some(reason);
                Ok(None)
            }
            Verdict::Pass { label } => {
                w.key = d.forward.apply(&w.key);
                w.forward = w.forward.then(&d.forward);
                // Replies meet the NFs in reverse order: this NF's reverse rewrite comes
                // before those of the NFs it follows (`then` is associative).
                w.reverse = d.reverse.then(&w.reverse);
                Ok(label)
            }
        }
    }

    /// Pass an event to every NF.
    pub fn on_event(&mut self, ev: &FlowEvent, env: &mut NfEnv) {
        for (i, nf) in self.nfs.iter_mut().enumerate() {
            nf.on_event(ev, env);
            self.triggered
                .extend(env.triggers.drain(..).map(|t| (i, t)));
        }
    }

    /// Whether the chain's rules count (`Action::Count`): one of its NFs reads PP's
    /// counters ([`NetworkFunction::counts_traffic`]).
    pub fn counts_traffic(&self) -> bool {
        self.counts
    }

    /// What the chain's traffic-counting NFs counted, summed; None if none counts.
    pub fn traffic(&self) -> Option<crate::TrafficReport> {
        let mut out: Option<crate::TrafficReport> = None;
        for nf in &self.nfs {
            if let Some(r) = nf.traffic() {
                out.get_or_insert_with(Default::default).add(&r);
            }
        }
        out
    }

    /// Timers of every NF; returns the flows any of them forgot. A timer is also where
    /// an NF asks for periodic updates (Serpens: `update` "on time via a timer").
    pub fn on_timer(&mut self, env: &mut NfEnv) -> Vec<FlowKey> {
        let mut out = Vec::new();
        for (i, nf) in self.nfs.iter_mut().enumerate() {
            out.extend(nf.on_timer(env));
            self.triggered
                .extend(env.triggers.drain(..).map(|t| (i, t)));
        }
        out.sort_by_key(|k| *k.as_bytes());
        out.dedup();
        out
    }

    /// Serpens' on-demand `update`: run it for every update an NF asked for since the
    /// last call (through `NfEnv::trigger`) and every condition its
    /// `NetworkFunction::trigger` reports now, on the NF that asked, in NF order. The
    /// platform calls this after each op it applies. Returns how many updates ran and
    /// the errors of those that failed (an NF's failed update changes nothing else).
    pub fn run_triggers(&mut self, env: &mut NfEnv) -> (usize, Vec<ChainError>) {
        let mut todo = std::mem::take(&mut self.triggered);
        for (i, nf) in self.nfs.iter_mut().enumerate() {
            todo.extend(nf.trigger(env).into_iter().map(|t| (i, t)));
        }
        // Stable by NF, so every replica runs them in one order.
        todo.sort_by_key(|(i, _)| *i);
        let mut errors = Vec::new();
        let n = todo.len();
        for (i, t) in todo {
            let nf = &mut self.nfs[i];
            if let Err(err) = nf.update(&t.table, t.key, env) {
                errors.push(ChainError::Nf {
                    nf: i,
                    kind: nf.kind().to_string(),
                    err,
                });
            }
            // What an update asks for waits for the next op: no loops within one.
            self.triggered
                .extend(env.triggers.drain(..).map(|t| (i, t)));
        }
        (n, errors)
    }

    /// The writes the NFs made to their mirrored tables since the last call, with each
    /// NF's index in the chain: what the platform carries to the chain's other
    /// partitions ([`crate::SplitRule::Mirror`]). Taken after every op it applies.
    pub fn take_mirror(&mut self) -> Vec<(u32, MirrorWrite)> {
        let mut out = Vec::new();
        for (i, nf) in self.nfs.iter_mut().enumerate() {
            if let Some(s) = nf.state_mut() {
                out.extend(s.take_mirror().into_iter().map(|w| (i as u32, w)));
            }
        }
        out
    }

    /// Whether the NFs record their mirrored writes for [`Chain::take_mirror`]: the
    /// platform turns it on while the chain has other partitions to send them to.
    pub fn set_mirror_sending(&mut self, on: bool) {
        for nf in &mut self.nfs {
            if let Some(s) = nf.state_mut() {
                s.set_mirror_sending(on);
            }
        }
    }

    /// Another partition's mirrored writes, into this part's copies. Returns (applied,
    /// skipped): a write for an NF index this chain does not have, an NF without
    /// platform tables, or a table that is not mirrored here is skipped, not an error
    /// (the other partition may run another version of the chain for a moment).
    pub fn import_mirror(&mut self, writes: &[(u32, MirrorWrite)]) -> (usize, usize) {
        let (mut applied, mut skipped) = (0, 0);
        for (i, w) in writes {
            match self.nfs.get_mut(*i as usize).and_then(|nf| nf.state_mut()) {
                Some(s) => {
                    let (a, k) = s.import_mirror(std::slice::from_ref(w));
                    applied += a;
                    skipped += k;
                }
                None => skipped += 1,
            }
        }
        (applied, skipped)
    }

    /// State of every NF, framed as length-prefixed parts.
    pub fn snapshot(&self) -> Result<Vec<u8>, NfError> {
        let parts = self
            .nfs
            .iter()
            .map(|nf| nf.snapshot())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(frame_parts(&parts))
    }

    pub fn restore(&mut self, snap: &[u8]) -> Result<(), NfError> {
        let parts = unframe_parts(snap, self.nfs.len())?;
        for (nf, p) in self.nfs.iter_mut().zip(parts) {
            nf.restore(p)?;
        }
        Ok(())
    }

    /// Split every NF's state (Fig. 3); the result is the new owner's snapshot.
    pub fn split(&mut self, half: &SplitHalf) -> Result<Vec<u8>, NfError> {
        self.take_parts(|nf| nf.split(half))
    }

    /// Move out the per-flow state `half` names, every NF's (gradual migration: shared
    /// state stays); the result merges like a split's part.
    pub fn split_flows(&mut self, half: &SplitHalf) -> Result<Vec<u8>, NfError> {
        self.take_parts(|nf| nf.split_flows(half))
    }

    /// One part from every NF, in chain order, framed as a snapshot is (both splits).
    fn take_parts(
        &mut self,
        take: impl FnMut(&mut Box<dyn NetworkFunction>) -> Result<Vec<u8>, NfError>,
    ) -> Result<Vec<u8>, NfError> {
        let parts = self
            .nfs
            .iter_mut()
            .map(take)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(frame_parts(&parts))
    }

    /// Hashes of every flow some NF of the chain holds per-flow state for, sorted and
    /// deduplicated; None if any NF cannot tell (see `NetworkFunction::flow_hashes`).
    pub fn flow_hashes(&self) -> Option<Vec<u64>> {
        let mut out = Vec::new();
        for nf in &self.nfs {
            out.extend(nf.flow_hashes()?);
        }
        out.sort_unstable();
        out.dedup();
        Some(out)
    }

    /// Merge a part (a chain snapshot or split). Same as decoding it with
    /// [`Chain::merge_decoder`] and [`Chain::merge_prepared`].
    pub fn merge(&mut self, part: &[u8]) -> Result<(), NfError> {
        let prepared = self.merge_decoder().decode(part)?;
        self.merge_prepared(prepared)
    }

    /// A decoder for parts to merge into this chain, independent of its state: it can
    /// run on another thread while the chain keeps deciding flows.
    pub fn merge_decoder(&self) -> ChainDecoder {
        ChainDecoder(self.nfs.iter().map(|nf| nf.merge_decoder()).collect())
    }

    /// Merge a decoded part. Every NF checks its share first, and nothing is merged
    /// unless all accept (for NFs whose `check_prepared` is complete, as the built-in
    /// ones are), so a refused merge leaves the chain as it was.
    pub fn merge_prepared(&mut self, part: PreparedChainPart) -> Result<(), NfError> {
        if part.0.len() != self.nfs.len() {
            return Err(NfError::Snapshot(format!(
                "prepared part for {} NFs, chain has {}",
                part.0.len(),
                self.nfs.len()
            )));
        }
        for (nf, p) in self.nfs.iter().zip(&part.0) {
            nf.check_prepared(p)?;
        }
        for (nf, p) in self.nfs.iter_mut().zip(part.0) {
            nf.merge_prepared(p)?;
        }
        Ok(())
    }
}

/// Decodes chain parts for [`Chain::merge_prepared`] (from [`Chain::merge_decoder`]).
#[derive(Clone)]
pub struct ChainDecoder(Vec<MergeDecoder>);

impl ChainDecoder {
    pub fn decode(&self, part: &[u8]) -> Result<PreparedChainPart, NfError> {
        let parts = unframe_parts(part, self.0.len())?;
        let prepared = self
            .0
            .iter()
            .zip(parts)
            .map(|(d, p)| d(p))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(PreparedChainPart(prepared))
    }
}

impl std::fmt::Debug for ChainDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ChainDecoder({} NFs)", self.0.len())
    }
}

/// A chain part decoded ahead of its merge: one [`PreparedPart`] per NF.
#[derive(Debug)]
pub struct PreparedChainPart(Vec<PreparedPart>);

struct Walk {
    key: FlowKey,
    forward: Rewrite,
    /// The reverse rewrites composed so far, last NF's first.
    reverse: Rewrite,
    timeout: Option<Duration>,
    path: NfPath,
    dropped: Option<String>,
}

fn frame_parts(parts: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for p in parts {
        out.extend_from_slice(&(p.len() as u64).to_le_bytes());
        out.extend_from_slice(p);
    }
    out
}

fn unframe_parts(mut b: &[u8], n: usize) -> Result<Vec<&[u8]>, NfError> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let Some((len, rest)) = b.split_first_chunk::<8>() else {
            return Err(NfError::Snapshot("truncated chain snapshot".into()));
        };
        let len = u64::from_le_bytes(*len) as usize;
        if rest.len() < len {
            return Err(NfError::Snapshot("truncated chain snapshot part".into()));
        }
        out.push(&rest[..len]);
        b = &rest[len..];
    }
    if !b.is_empty() {
        return Err(NfError::Snapshot(format!(
            "chain snapshot has parts for more than {n} NFs"
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{Decision, TableSpec};
    use pipeline::{format_actions, PacketMeta};
    use std::net::IpAddr;

    /// A stateless test NF: fixed decision.
    struct Fixed(&'static str, Decision);
    impl NetworkFunction for Fixed {
        fn kind(&self) -> &str {
            self.0
        }
        fn tables(&self) -> Vec<TableSpec> {
            vec![]
        }
        fn first_packet(&mut self, _: &FirstPacket, _: &mut NfEnv) -> Result<Decision, NfError> {
            Ok(self.1.clone())
        }
        /// The stand-in for the monitor reads PP's counters, as the monitor does.
        fn counts_traffic(&self) -> bool {
            self.0 == "monitor"
        }
        fn snapshot(&self) -> Result<Vec<u8>, NfError> {
            Ok(self.0.as_bytes().to_vec())
        }
        fn restore(&mut self, s: &[u8]) -> Result<(), NfError> {
            assert_eq!(s, self.0.as_bytes());
            Ok(())
        }
        fn split(&mut self, _: &SplitHalf) -> Result<Vec<u8>, NfError> {
            self.snapshot()
        }
        fn merge(&mut self, s: &[u8]) -> Result<(), NfError> {
            self.restore(s)
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn pkt() -> FirstPacket {
        let key = "100 tcp 198.18.10.2:40000 > 198.19.0.100:80";
        FirstPacket::new(key.parse().unwrap(), 1, PacketMeta::new(60, 2))
    }

    /// A stub NF that passes with these rewrites.
    fn rewriter(
        kind: &'static str,
        forward: Rewrite,
        reverse: Rewrite,
    ) -> Box<dyn NetworkFunction> {
        Box::new(Fixed(
            kind,
            Decision {
                forward,
                reverse,
                ..Decision::pass()
            },
        ))
    }

    /// What the stub SNAT decides for [`pkt`]'s flow.
    fn snat_rewrites() -> Decision {
        Decision {
            forward: Rewrite::src(ip("198.19.255.1"), 50000),
            reverse: Rewrite::dst(ip("198.18.10.2"), 40000),
            ..Decision::pass()
        }
    }

    /// These three NFs in sequence, both directions leaving locally.
    fn local_chain(nfs: Vec<Box<dyn NetworkFunction>>) -> Chain {
        Chain::new(nfs, ChainSpec::seq(3), Egress::LOCAL, Egress::LOCAL).unwrap()
    }

    fn fw_lb_snat() -> Vec<Box<dyn NetworkFunction>> {
        vec![
            Box::new(Fixed("fw", Decision::pass())),
            rewriter(
                "lb",
                Rewrite::dst(ip("198.19.1.7"), 8080),
                Rewrite::src(ip("198.19.0.100"), 80),
            ),
            Box::new(Fixed(
                "snat",
                Decision {
                    idle_timeout: Some(Duration::from_secs(240)),
                    ..snat_rewrites()
                },
            )),
        ]
    }

    #[test]
    fn fw_lb_snat_composes_into_one_rule_per_direction() {
        let fwd = Egress {
            decap: true,
            encap: Some((Ipv4Addr::new(198, 18, 0, 9), 200)),
            inner_dmac: None,
            output: 1,
        };
        let rev = Egress {
            decap: true,
            encap: Some((Ipv4Addr::new(198, 18, 0, 50), 100)),
            inner_dmac: None,
            output: 1,
        };
        let mut c = Chain::new(fw_lb_snat(), ChainSpec::seq(3), fwd, rev).unwrap();
        assert!(!c.counts_traffic());
        let r = c.decide(&pkt(), &mut NfEnv::new(0, 1)).unwrap();
        assert_eq!(r.path_names(), ["fw", "lb", "snat"]);
        // No NF of the chain reads PP's counters: the rules do not count.
        assert_eq!(
            format_actions(&r.forward.actions),
            "decap; set-src 198.19.255.1:50000; set-dst 198.19.1.7:8080; encap 198.18.0.9 vni 200; out 1"
        );
        let rv = r.reverse.unwrap();
        assert_eq!(
            rv.key.to_string(),
            "200 tcp 198.19.1.7:8080 > 198.19.255.1:50000"
        );
        // The reply becomes VIP → client: SNAT's reverse, then LB's.
        assert_eq!(
            format_actions(&rv.actions),
            "decap; set-src 198.19.0.100:80; set-dst 198.18.10.2:40000; encap 198.18.0.50 vni 100; out 1"
        );
        assert_eq!(rv.idle_timeout, Some(Duration::from_secs(240)));
    }

    #[test]
    fn a_chain_with_a_counting_nf_counts_both_directions_and_drops() {
        let mut nfs = fw_lb_snat();
        nfs.push(Box::new(Fixed("monitor", Decision::pass())));
        let mut c = Chain::new(nfs, ChainSpec::seq(4), Egress::LOCAL, Egress::LOCAL).unwrap();
        assert!(c.counts_traffic());
        let r = c.decide(&pkt(), &mut NfEnv::new(0, 1)).unwrap();
        assert_eq!(
            format_actions(&r.forward.actions),
            "set-src 198.19.255.1:50000; set-dst 198.19.1.7:8080; count; out 0"
        );
        assert_eq!(
            format_actions(&r.reverse.unwrap().actions),
            "set-src 198.19.0.100:80; set-dst 198.18.10.2:40000; count; out 0"
        );

        let mut nfs = fw_lb_snat();
        nfs[0] = Box::new(Fixed("fw", Decision::drop("acl-deny")));
        nfs.push(Box::new(Fixed("monitor", Decision::pass())));
        let mut c = Chain::new(nfs, ChainSpec::seq(4), Egress::LOCAL, Egress::LOCAL).unwrap();
        let r = c.decide(&pkt(), &mut NfEnv::new(0, 1)).unwrap();
        assert_eq!(r.path_names(), ["fw"]);
        assert_eq!(format_actions(&r.forward.actions), "count; drop acl-deny");
    }

    /// Records the keys it is shown.
    struct Recorder(std::sync::Arc<std::sync::Mutex<Vec<(FlowKey, FlowKey)>>>);
    impl NetworkFunction for Recorder {
        fn kind(&self) -> &str {
            "recorder"
        }
        fn tables(&self) -> Vec<TableSpec> {
            vec![]
        }
        fn first_packet(&mut self, p: &FirstPacket, _: &mut NfEnv) -> Result<Decision, NfError> {
            self.0.lock().unwrap().push((p.key, p.flow));
            Ok(Decision::pass())
        }
        crate::no_flow_state!();
    }

    #[test]
    fn a_later_nf_sees_the_rewritten_key_and_the_original_flow() {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let nfs: Vec<Box<dyn NetworkFunction>> = vec![
            Box::new(Recorder(seen.clone())),
            Box::new(Fixed("snat", snat_rewrites())),
            Box::new(Recorder(seen.clone())),
        ];
        let mut c = local_chain(nfs);
        let p = FirstPacket::new(pkt().key, 1, pkt().meta);
        c.decide(&p, &mut NfEnv::new(0, 1)).unwrap();
        let seen = seen.lock().unwrap();
        // Before SNAT both are the ingress key; after it, the key is translated and the
        // flow is still the one PP asked about.
        assert_eq!(seen[0], (p.key, p.key));
        assert_eq!(
            seen[1].0.to_string(),
            "100 tcp 198.19.255.1:50000 > 198.19.0.100:80"
        );
        assert_eq!(seen[1].1, p.key);
    }

    /// A port pool of `free` ports that asks for a refill (Serpens Fig. 9 line 15) when
    /// it runs out, and counts flows aside to be folded by its own condition.
    #[derive(Default)]
    struct Pool {
        free: u32,
        updates: Vec<(String, u64)>,
        counted_aside: u64,
        total: u64,
        fail_updates: bool,
    }
    impl NetworkFunction for Pool {
        fn kind(&self) -> &str {
            "pool"
        }
        fn tables(&self) -> Vec<TableSpec> {
            vec![
                TableSpec::shared_write("pool", crate::Consistency::Partitioned),
                TableSpec::shared_write("flows", crate::Consistency::Replicated),
            ]
        }
        fn first_packet(&mut self, _: &FirstPacket, env: &mut NfEnv) -> Result<Decision, NfError> {
            self.counted_aside += 1;
            if self.free == 0 {
                env.trigger("pool", 7);
                return Ok(Decision::drop("exhausted"));
            }
            self.free -= 1;
            Ok(Decision::pass())
        }
        fn update(&mut self, table: &str, key: u64, _: &mut NfEnv) -> Result<(), NfError> {
            if self.fail_updates {
                return Err(NfError::Other("no".into()));
            }
            self.updates.push((table.to_string(), key));
            match table {
                "pool" => self.free += 2,
                _ => self.total += std::mem::take(&mut self.counted_aside),
            }
            Ok(())
        }
        fn trigger(&mut self, _: &mut NfEnv) -> Vec<Trigger> {
            if self.counted_aside >= 3 {
                vec![Trigger {
                    table: "flows".into(),
                    key: 0,
                }]
            } else {
                vec![]
            }
        }
        fn snapshot(&self) -> Result<Vec<u8>, NfError> {
            Ok(format!("{} {} {:?}", self.free, self.total, self.updates).into_bytes())
        }
        fn restore(&mut self, _: &[u8]) -> Result<(), NfError> {
            Ok(())
        }
        fn split(&mut self, _: &SplitHalf) -> Result<Vec<u8>, NfError> {
            Ok(Vec::new())
        }
        fn merge(&mut self, _: &[u8]) -> Result<(), NfError> {
            Ok(())
        }
    }

    fn pool_chain(p: Pool) -> Chain {
        let nfs: Vec<Box<dyn NetworkFunction>> =
            vec![Box::new(Fixed("fw", Decision::pass())), Box::new(p)];
        Chain::new(nfs, ChainSpec::seq(2), Egress::LOCAL, Egress::LOCAL).unwrap()
    }

    fn pool_state(c: &Chain) -> String {
        String::from_utf8(c.nfs()[1].snapshot().unwrap()).unwrap()
    }

    #[test]
    fn trigger_from_a_handler_runs_update_after_the_op() {
        let mut c = pool_chain(Pool::default());
        let env = &mut NfEnv::new(0, 1);
        let r = c.decide(&pkt(), env).unwrap();
        assert_eq!(format_actions(&r.forward.actions), "drop exhausted");
        // Nothing ran inside the op: the handler did not wait.
        assert_eq!(pool_state(&c), "0 0 []");
        let (n, errors) = c.run_triggers(env);
        assert_eq!((n, errors.len()), (1, 0));
        assert_eq!(pool_state(&c), "2 0 [(\"pool\", 7)]");
        // Refilled: the next flow passes, and nothing is left to run.
        let r = c.decide(&pkt(), env).unwrap();
        assert_eq!(r.path_names(), ["fw", "pool"]);
        assert!(r.reverse.is_some());
        assert_eq!(c.run_triggers(env).0, 0);
    }

    #[test]
    fn trigger_condition_is_polled_and_update_folds_counts_aside() {
        let mut c = pool_chain(Pool {
            free: 10,
            ..Pool::default()
        });
        let env = &mut NfEnv::new(0, 1);
        for _ in 0..2 {
            c.decide(&pkt(), env).unwrap();
            assert_eq!(c.run_triggers(env).0, 0, "below the condition");
        }
        c.decide(&pkt(), env).unwrap();
        assert_eq!(c.run_triggers(env).0, 1);
        assert_eq!(pool_state(&c), "7 3 [(\"flows\", 0)]");
    }

    #[test]
    fn a_failed_update_is_reported_not_fatal() {
        let mut c = pool_chain(Pool {
            fail_updates: true,
            ..Pool::default()
        });
        let env = &mut NfEnv::new(0, 1);
        c.decide(&pkt(), env).unwrap();
        let (n, errors) = c.run_triggers(env);
        assert_eq!(n, 1);
        assert!(matches!(errors[..], [ChainError::Nf { nf: 1, .. }]));
        assert_eq!(pool_state(&c), "0 0 []");
    }

    #[test]
    fn a_drop_stops_the_chain_and_yields_a_drop_rule() {
        let mut nfs = fw_lb_snat();
        nfs[0] = Box::new(Fixed("fw", Decision::drop("acl-deny")));
        let mut c = local_chain(nfs);
        let r = c.decide(&pkt(), &mut NfEnv::new(0, 1)).unwrap();
        assert_eq!(r.path_names(), ["fw"]);
        assert_eq!(format_actions(&r.forward.actions), "drop acl-deny");
        assert!(r.reverse.is_none());
    }

    #[test]
    fn branch_follows_the_label_then_joins() {
        let nfs: Vec<Box<dyn NetworkFunction>> = vec![
            Box::new(Fixed(
                "classify",
                Decision {
                    verdict: Verdict::label("web"),
                    ..Decision::pass()
                },
            )),
            rewriter("web-lb", Rewrite::dst(ip("198.19.1.1"), 80), Rewrite::NONE),
            rewriter(
                "other-lb",
                Rewrite::dst(ip("198.19.2.2"), 80),
                Rewrite::NONE,
            ),
            Box::new(Fixed("monitor", Decision::pass())),
        ];
        let spec = ChainSpec::Seq(vec![
            ChainSpec::Branch {
                nf: 0,
                arms: vec![("web".into(), ChainSpec::Nf(1))],
                default: Box::new(ChainSpec::Nf(2)),
            },
            ChainSpec::Nf(3),
        ]);
        let mut c = Chain::new(nfs, spec, Egress::LOCAL, Egress::LOCAL).unwrap();
        let r = c.decide(&pkt(), &mut NfEnv::new(0, 1)).unwrap();
        assert_eq!(r.path_names(), ["classify", "web-lb", "monitor"]);
        assert_eq!(
            format_actions(&r.forward.actions),
            "set-dst 198.19.1.1:80; count; out 0"
        );
    }

    #[test]
    fn bad_specs_and_snapshots_are_errors() {
        assert!(matches!(
            Chain::new(fw_lb_snat(), ChainSpec::Nf(3), Egress::LOCAL, Egress::LOCAL),
            Err(ChainError::NoSuchNf(3))
        ));
        assert!(matches!(
            Chain::new(vec![], ChainSpec::seq(0), Egress::LOCAL, Egress::LOCAL),
            Err(ChainError::Empty)
        ));
        let mut c = local_chain(fw_lb_snat());
        let s = c.snapshot().unwrap();
        c.restore(&s).unwrap();
        assert!(c.restore(&s[..s.len() - 1]).is_err());
        let mut extra = s.clone();
        extra.extend_from_slice(&[0; 8]);
        assert!(c.restore(&extra).is_err());
    }

    #[test]
    fn only_platform_tables_split_by_something_else_than_the_flow() {
        // The stub NFs of these tests keep state of their own: by the flow hash only.
        let mut c = local_chain(fw_lb_snat());
        assert_eq!(c.partition_by(), PartitionBy::Flow);
        let err = c.set_partition(PartitionBy::SourceAddress).unwrap_err();
        assert!(err.to_string().contains("flow hash only"), "{err}");
        assert_eq!(c.partition(), PartitionBy::Flow, "refused, unchanged");
        c.set_partition(PartitionBy::Flow).unwrap();
    }

    #[test]
    fn shared_write_tables_must_name_consistency() {
        let t = TableSpec {
            consistency: None,
            ..TableSpec::shared_write("pool", crate::Consistency::Partitioned)
        };
        assert!(t.validate().is_err());
        assert!(
            TableSpec::shared_write("pool", crate::Consistency::Partitioned)
                .validate()
                .is_ok()
        );
        let t = TableSpec {
            consistency: Some(crate::Consistency::Replicated),
            ..TableSpec::per_flow("map")
        };
        assert!(t.validate().is_err());
    }
}
