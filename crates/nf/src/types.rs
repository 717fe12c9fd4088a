//! The contract between an NF and the platform.

use std::any::Any;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use pipeline::{Action, Actions, FlowKey, PacketMeta};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::env::NfEnv;
use crate::state::StateTables;

/// Who may touch a table's entries (Serpens Fig. 8 flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Scope {
    /// Touched only by packets of one flow (a NAT mapping, a conntrack entry).
    PerFlow,
    /// Touched by many flows (a port pool, a counter, an ACL).
    Shared,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Access {
    Read,
    Write,
}

/// How shared-write state survives scaling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Consistency {
    /// Single-writer, split into disjoint parts (Serpens "release"): a port pool's ranges.
    Partitioned,
    /// Multi-writer, each part counts on its own and parts merge by sum (Serpens
    /// "eventual"): per-host packet counters.
    Replicated,
}

/// How the platform cuts a single-writer table's rows at a scale-out and joins them at
/// a scale-in ([`crate::StateTables`]). The NF names the rule; the platform runs it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SplitRule {
    /// A row goes by a stable hash of its key; a key in both parts refuses a merge.
    #[default]
    ByKey,
    /// Each row is a pool of free units (the ports of one address): a split gives the
    /// new part half of every row's free units by count (paper 000 §4.1, `<addr,
    /// 1024-4096>` becomes two ranges); a merge unites them, and a unit free in both
    /// parts refuses it. Units in use belong to nobody's free set.
    Pool,
    /// Rows that flows use (a NAT mapping): a row goes with the flows whose rows refer to
    /// it ([`crate::StateTables::set_refs`]). A row used on both sides is copied and the
    /// copies split its share, so only the copy holding the whole share knows it is the
    /// last one (weighted reference counting); a merge sums the shares.
    WithFlows,
    /// A preference both parts keep (an address pairing): copied at a split; at a merge
    /// this part's row stays.
    Copy,
    /// A read copy of rows that every partition of the chain writes (a NAT's mappings,
    /// for hairpinning to a host another partition translates): a `put` or `delete`
    /// here is also handed to the platform ([`crate::StateTables::take_mirror`]), which
    /// carries it through FM to the chain's other partitions, where it lands in the
    /// same table as an op of their logs ([`crate::StateTables::import_mirror`]). So
    /// each part reads every part's rows, eventually (S6's bounded staleness, unbounded
    /// here: a row reaches the others one FM round trip later). Copied at a split; at a
    /// merge this part's row stays.
    Mirror,
}

/// A state table an NF declares.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableSpec {
    pub name: String,
    pub scope: Scope,
    pub access: Access,
    /// Required for shared-write tables, absent otherwise (checked by [`TableSpec::validate`]).
    pub consistency: Option<Consistency>,
    /// How a single-writer table splits; [`SplitRule::ByKey`] unless the NF names another.
    #[serde(default)]
    pub split: SplitRule,
}

impl TableSpec {
    pub fn per_flow(name: &str) -> Self {
        TableSpec {
            name: name.into(),
            scope: Scope::PerFlow,
            access: Access::Write,
            consistency: None,
            split: SplitRule::ByKey,
        }
    }

    pub fn shared_read(name: &str) -> Self {
        TableSpec {
            name: name.into(),
            scope: Scope::Shared,
            access: Access::Read,
            consistency: None,
            split: SplitRule::ByKey,
        }
    }

    /// A mirrored table ([`SplitRule::Mirror`]): each partition writes its own rows and
    /// reads every partition's. Single-writer per key: a key is written by the one
    /// partition that owns what it names.
    pub fn mirror(name: &str) -> Self {
        Self::shared_write(name, Consistency::Partitioned).split_by(SplitRule::Mirror)
    }

    pub fn shared_write(name: &str, c: Consistency) -> Self {
        TableSpec {
            name: name.into(),
            scope: Scope::Shared,
            access: Access::Write,
            consistency: Some(c),
            split: SplitRule::ByKey,
        }
    }

    /// The same table, split by `rule` ([`SplitRule`]).
    pub fn split_by(mut self, rule: SplitRule) -> Self {
        self.split = rule;
        self
    }

    /// A shared-write table must name its consistency; nothing else may.
    pub fn validate(&self) -> Result<(), NfError> {
        match (self.scope, self.access, self.consistency) {
            (Scope::Shared, Access::Write, None) => Err(NfError::BadTable(format!(
                "shared-write table {} must name partitioned or replicated consistency",
                self.name
            ))),
            (Scope::Shared, Access::Write, Some(_)) => Ok(()),
            (_, _, Some(_)) => Err(NfError::BadTable(format!(
                "table {} is not shared-write, so it takes no consistency",
                self.name
            ))),
            _ => Ok(()),
        }?;
        // A rule other than by key fits a single-writer table; rows that go with their
        // flows fit a per-flow declaration too (a mapping each flow has its own of).
        let single_writer = matches!(
            (self.scope, self.access, self.consistency),
            (Scope::Shared, Access::Write, Some(Consistency::Partitioned))
        );
        match self.split {
            SplitRule::ByKey => Ok(()),
            SplitRule::WithFlows if self.scope == Scope::PerFlow || single_writer => Ok(()),
            _ if single_writer => Ok(()),
            r => Err(NfError::BadTable(format!(
                "table {} is not shared single-writer, so it cannot split by {r:?}",
                self.name
            ))),
        }
    }
}

/// An address and/or port to write.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    pub addr: Option<IpAddr>,
    pub port: Option<u16>,
}

impl Endpoint {
    pub fn new(addr: IpAddr, port: u16) -> Self {
        Endpoint {
            addr: Some(addr),
            port: Some(port),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.addr.is_none() && self.port.is_none()
    }
}

/// Header rewrites of one direction of a flow.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rewrite {
    pub src: Endpoint,
    pub dst: Endpoint,
}

impl Rewrite {
    pub const NONE: Rewrite = Rewrite {
        src: Endpoint {
            addr: None,
            port: None,
        },
        dst: Endpoint {
            addr: None,
            port: None,
        },
    };

    pub fn src(addr: IpAddr, port: u16) -> Self {
        Rewrite {
            src: Endpoint::new(addr, port),
            ..Rewrite::NONE
        }
    }

    pub fn dst(addr: IpAddr, port: u16) -> Self {
        Rewrite {
            dst: Endpoint::new(addr, port),
            ..Rewrite::NONE
        }
    }

    pub fn is_empty(&self) -> bool {
        self.src.is_empty() && self.dst.is_empty()
    }

    /// The key as it looks after this rewrite.
    pub fn apply(&self, k: &FlowKey) -> FlowKey {
        let mut k = *k;
        if let Some(a) = self.src.addr {
            k.set_src(a);
        }
        if let Some(p) = self.src.port {
            k.set_sport(p);
        }
        if let Some(a) = self.dst.addr {
            k.set_dst(a);
        }
        if let Some(p) = self.dst.port {
            k.set_dport(p);
        }
        k
    }

    /// This rewrite followed by `later`: a field `later` writes takes its value.
    pub fn then(&self, later: &Rewrite) -> Rewrite {
        Rewrite {
            src: Endpoint {
                addr: later.src.addr.or(self.src.addr),
                port: later.src.port.or(self.src.port),
            },
            dst: Endpoint {
                addr: later.dst.addr.or(self.dst.addr),
                port: later.dst.port.or(self.dst.port),
            },
        }
    }

    /// As PP actions.
    pub fn actions(&self) -> Actions {
        let mut v = Actions::new();
        self.push_actions(&mut v);
        v
    }

    /// As PP actions, added to `v`.
    pub fn push_actions(&self, v: &mut Actions) {
        if !self.src.is_empty() {
            v.push(Action::SetSrc {
                addr: self.src.addr,
                port: self.src.port,
            });
        }
        if !self.dst.is_empty() {
            v.push(Action::SetDst {
                addr: self.dst.addr,
                port: self.dst.port,
            });
        }
    }
}

/// What an NF says about a flow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    /// Continue along the chain; `label` picks the branch when the next chain step is a
    /// branch on this NF's verdict (Serpens `distribute`).
    Pass { label: Option<String> },
    /// Drop the flow, counting under `reason` (e.g. `acl-deny`, `snat-exhausted`).
    Drop { reason: String },
}

impl Verdict {
    pub fn pass() -> Self {
        Verdict::Pass { label: None }
    }

    pub fn label(l: &str) -> Self {
        Verdict::Pass {
            label: Some(l.to_string()),
        }
    }

    pub fn drop(reason: &str) -> Self {
        Verdict::Drop {
            reason: reason.to_string(),
        }
    }
}

/// An NF's answer for a flow's first packet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    pub verdict: Verdict,
    /// Applied to packets in the direction of the first packet.
    pub forward: Rewrite,
    /// Applied to replies, which arrive as the reverse of the forward-rewritten key.
    pub reverse: Rewrite,
    /// How long the flow may idle before PP forgets its rules and the NF its state.
    pub idle_timeout: Option<Duration>,
}

impl Decision {
    /// Pass unchanged.
    pub fn pass() -> Self {
        Decision {
            verdict: Verdict::pass(),
            forward: Rewrite::NONE,
            reverse: Rewrite::NONE,
            idle_timeout: None,
        }
    }

    pub fn drop(reason: &str) -> Self {
        Decision {
            verdict: Verdict::drop(reason),
            ..Decision::pass()
        }
    }
}

/// The first packet of a flow, as the NF sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FirstPacket {
    /// The key as rewritten by the NFs before this one in the chain: what this NF
    /// matches on and rewrites further.
    pub key: FlowKey,
    /// The key as it entered the chain, before any NF rewrote it: the key PP asked
    /// about, FM dispatches on, and PP reports [`FlowEvent`]s on. An NF after a
    /// rewriting NF (a FW after SNAT or LB) keys its per-flow state by this to find the
    /// flow again in events and splits ([`SplitHalf::moves`]).
    pub flow: FlowKey,
    pub tenant: u32,
    pub meta: PacketMeta,
}

impl FirstPacket {
    /// A packet entering the chain: `flow` and `key` are the same.
    pub fn new(key: FlowKey, tenant: u32, meta: PacketMeta) -> Self {
        FirstPacket {
            key,
            flow: key,
            tenant,
            meta,
        }
    }
}

/// Something that happened to a flow after its first packet, reported by PP or FM.
///
/// PP reports every event on the key it asked SC about (the flow's forward rule), so an
/// NF finds the flow as it finds a replayed first packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowEvent {
    /// PP saw TCP FIN or RST on the flow (key in the forward direction).
    TcpClosing { key: FlowKey },
    /// PP's rules for the flow idled out.
    Expired { key: FlowKey },
    /// PP saw the flow's TCP handshake complete: the first packet in the forward
    /// direction with ACK and without SYN, FIN or RST — the opener's third handshake
    /// packet, sent only after the SYN-ACK came back through the reverse rule. Reported
    /// once per flow. RFC 5382 REQ-5 and RFC 7857 §2.1: the established idle timeout
    /// applies from here on, the transitory one before.
    TcpEstablished { key: FlowKey },
    /// The flow carried traffic since PP's previous activity report (reports are
    /// periodic and batched): refresh its idle deadline. PP's rules outlive an idle NF
    /// deadline, so without this a busy long-lived flow would lose its NF state.
    Active { key: FlowKey },
    /// PP's counters of a counted rule (`Action::Count`) since its last report: the
    /// packets and bytes the rule matched after SC decided the flow, first packet
    /// included. `key` is the rule's match key (either direction of the flow); `tenant`
    /// the tenant whose chain decided it. Deltas, so replicas and parts add them up in
    /// any order.
    Counters {
        key: FlowKey,
        tenant: u32,
        packets: u64,
        bytes: u64,
    },
}

impl FlowEvent {
    /// The flow the event is about.
    pub fn key(&self) -> &FlowKey {
        match self {
            FlowEvent::TcpClosing { key }
            | FlowEvent::Expired { key }
            | FlowEvent::TcpEstablished { key }
            | FlowEvent::Active { key }
            | FlowEvent::Counters { key, .. } => key,
        }
    }
}

/// Packets, bytes and flows counted by an NF that watches traffic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrafficCount {
    pub packets: u64,
    pub bytes: u64,
    /// Flows decided (first packets seen by SC).
    #[serde(default)]
    pub flows: u64,
}

impl TrafficCount {
    pub fn add(&mut self, o: &TrafficCount) {
        self.packets = self.packets.saturating_add(o.packets);
        self.bytes = self.bytes.saturating_add(o.bytes);
        self.flows = self.flows.saturating_add(o.flows);
    }
}

/// What a traffic-watching NF (the monitor) has counted, for `starfabric stats`. Reports
/// of several NFs, replicas' parts or partitions add up with [`TrafficReport::add`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrafficReport {
    /// By tenant id, sorted.
    pub tenants: Vec<(u32, TrafficCount)>,
    /// By (tenant, source host), sorted.
    pub hosts: Vec<(u32, std::net::IpAddr, TrafficCount)>,
    /// Traffic of hosts beyond the NF's host bound.
    pub overflow: TrafficCount,
}

impl TrafficReport {
    /// Add `o` in, tenant by tenant and host by host.
    pub fn add(&mut self, o: &TrafficReport) {
        let mut t: std::collections::BTreeMap<u32, TrafficCount> = self.tenants.drain(..).collect();
        for (k, c) in &o.tenants {
            t.entry(*k).or_default().add(c);
        }
        self.tenants = t.into_iter().collect();
        let mut h: std::collections::BTreeMap<(u32, std::net::IpAddr), TrafficCount> =
            self.hosts.drain(..).map(|(a, b, c)| ((a, b), c)).collect();
        for (a, b, c) in &o.hosts {
            h.entry((*a, *b)).or_default().add(c);
        }
        self.hosts = h.into_iter().map(|((a, b), c)| (a, b, c)).collect();
        self.overflow.add(&o.overflow);
    }

    pub fn is_empty(&self) -> bool {
        self.tenants.is_empty() && self.hosts.is_empty() && self.overflow == TrafficCount::default()
    }
}

/// Which half of a partition's key space a split keeps (paper 000 Fig. 3: per-flow state
/// moves by key range, partitioned shared state splits in two).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitHalf {
    /// Per-flow state whose `FlowKey::hash()` falls in `[lo, hi)` moves to the new owner.
    pub moved_lo: u64,
    pub moved_hi: u64,
}

impl SplitHalf {
    pub fn moves(&self, key: &FlowKey) -> bool {
        self.holds(key.hash())
    }

    /// Whether per-flow state of `key` moves when the chain partitions by `by`.
    pub fn moves_by(&self, key: &FlowKey, by: PartitionBy) -> bool {
        self.holds(by.hash(key))
    }

    /// Whether a partition hash falls in the moved range.
    pub fn holds(&self, h: u64) -> bool {
        h >= self.moved_lo && h < self.moved_hi
    }
}

/// What a chain's requests are dispatched by and its per-flow state is split by: the
/// hash FM looks a request's partition up with, and `SplitHalf` cuts. The default is
/// the flow's own hash. An NF whose state is per host asks for the host
/// ([`NetworkFunction::partition_by`]): the SNAT's endpoint-independent mappings and
/// address pairing, a per-host limit, are then whole in one partition (docs/nf-api.md,
/// "Partition key per NF").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PartitionBy {
    #[default]
    Flow,
    /// The flow's VNI and source address: every flow an inside host opens lands in one
    /// partition. Replies (whose source is the remote end) are not dispatched by it;
    /// they find their flow through FM's rule cache, as before.
    SourceAddress,
}

impl PartitionBy {
    pub fn hash(self, key: &FlowKey) -> u64 {
        match self {
            PartitionBy::Flow => key.hash(),
            PartitionBy::SourceAddress => {
                let none: IpAddr = if key.is_v4() {
                    std::net::Ipv4Addr::UNSPECIFIED.into()
                } else {
                    std::net::Ipv6Addr::UNSPECIFIED.into()
                };
                FlowKey::new(key.vni(), 0, key.src(), 0, none, 0).hash()
            }
        }
    }

    pub fn is_flow(&self) -> bool {
        *self == PartitionBy::Flow
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum NfError {
    #[error("bad table declaration: {0}")]
    BadTable(String),
    #[error("bad configuration: {0}")]
    Config(String),
    #[error("state snapshot: {0}")]
    Snapshot(String),
    /// A platform table refused a call ([`crate::StateError`], as text so that
    /// `NfError` stays one comparable value across NFs).
    #[error("state table: {0}")]
    State(String),
    #[error("{0}")]
    Other(String),
}

/// A part to merge, decoded ahead of the merge by a [`MergeDecoder`]: what the NF's
/// decoder made of the bytes, for [`NetworkFunction::merge_prepared`] of the same NF.
pub struct PreparedPart(Box<dyn Any + Send>);

impl PreparedPart {
    pub fn new<T: Any + Send>(v: T) -> Self {
        PreparedPart(Box::new(v))
    }

    /// The decoded value, if it is a `T`.
    pub fn downcast_ref<T: Any>(&self) -> Option<&T> {
        self.0.downcast_ref()
    }

    /// The decoded value, if it is a `T`; an error (not a panic) otherwise.
    pub fn downcast<T: Any>(self) -> Result<T, NfError> {
        self.0
            .downcast()
            .map(|b| *b)
            .map_err(|_| NfError::Snapshot("prepared part of another NF kind".into()))
    }
}

impl std::fmt::Debug for PreparedPart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PreparedPart")
    }
}

/// Decodes parts for one NF without its state, on any thread, while the NF keeps
/// serving ([`NetworkFunction::merge_decoder`]).
pub type MergeDecoder = Arc<dyn Fn(&[u8]) -> Result<PreparedPart, NfError> + Send + Sync>;

/// What the default [`NetworkFunction::merge_decoder`] keeps: the bytes themselves.
struct RawPart(Vec<u8>);

/// A network function. Built-in NFs and tenant NFs implement the same trait.
pub trait NetworkFunction: Send {
    /// Short kind name (`snat`, `lb`, `fw`, `monitor`, or the tenant's own).
    fn kind(&self) -> &str;

    /// The state tables this NF keeps.
    fn tables(&self) -> Vec<TableSpec>;

    /// Decide a new flow. Must be deterministic in (state, packet, env).
    fn first_packet(&mut self, pkt: &FirstPacket, env: &mut NfEnv) -> Result<Decision, NfError>;

    /// What this NF needs its chain partitioned by ([`PartitionBy`]): the flow (the
    /// default), or the inside host when its state is per host. A chain takes the first
    /// of its NFs' answers that is not the default, and is partitioned by it only where
    /// its configuration says so (`proto::ChainDef::partition`, which the orchestrator
    /// fills from this answer), so that FM and SC always agree.
    fn partition_by(&self) -> PartitionBy {
        PartitionBy::Flow
    }

    /// Split per-flow state by `by` from now on: the chain's partitioning. On platform
    /// tables the platform does it; an NF keeping state of its own splits by the flow
    /// hash only (`SplitHalf::moves`) and refuses another.
    fn set_partition(&mut self, by: PartitionBy) -> Result<(), NfError> {
        if let Some(s) = self.state_mut() {
            s.set_partition(by);
            return Ok(());
        }
        if by.is_flow() {
            return Ok(());
        }
        Err(NfError::Config(format!(
            "{}: keeps its own state, which splits by the flow hash only, not by {by:?}",
            self.kind()
        )))
    }

    /// Whether `key` is the reply direction of a flow this NF decided and still holds
    /// (a server's answer, a reply to a translated address). When PP and FM lost a
    /// flow's reverse rule, the reply's packet asks SC again; a chain then runs the NFs
    /// in the order replies meet them (last first) if one of them knows the key, and each
    /// NF answers it from its state as it would a re-request. Default: not known.
    fn knows_reply(&self, _key: &FlowKey) -> bool {
        false
    }

    /// A later event on a flow this NF decided (TCP close, expiry, PP's counters).
    fn on_event(&mut self, _ev: &FlowEvent, _env: &mut NfEnv) {}

    /// Whether this NF reads PP's counters of the flows it decides
    /// ([`FlowEvent::Counters`]). A chain's rules carry `Action::Count` only when one of
    /// its NFs answers yes: a counted rule costs PP a second cache line per packet and a
    /// report per flow per interval, and FM an op through every replica of the group, so
    /// a chain nobody reads the counters of does not pay for them. Default: no.
    fn counts_traffic(&self) -> bool {
        false
    }

    /// The traffic this NF has counted, if it counts traffic (the monitor does); read by
    /// `starfabric stats` through SC's `GroupStatus`.
    fn traffic(&self) -> Option<TrafficReport> {
        None
    }

    /// Periodic housekeeping at `env.now_ms`: expire per-flow state past its timeout, fold
    /// replicated counters. Returns the flows whose state was removed.
    ///
    /// The default is the platform's timer on the NF's [`StateTables`]: fold the
    /// untethered counter adds, remove per-flow rows whose `set_timer` deadline passed.
    fn on_timer(&mut self, env: &mut NfEnv) -> Vec<FlowKey> {
        (self.state_mut())
            .map(|s| s.expire(env.now_ms))
            .unwrap_or_default()
    }

    /// Serpens `update(table, key)` (paper 004 Fig. 8, §III-B): bring one entry of a
    /// shared-write table up to date — for a replicated table, fold what was counted
    /// aside into it; for a partitioned one, rebalance what this part holds. The
    /// platform calls it after the op in which the NF asked for it (through
    /// [`NfEnv::trigger`] or [`NetworkFunction::trigger`]), in the group's order, so every
    /// replica runs it at the same point; it never waits for another partition. An
    /// error is counted by the platform and changes nothing else. Default: nothing to do.
    fn update(&mut self, _table: &str, _key: u64, _env: &mut NfEnv) -> Result<(), NfError> {
        Ok(())
    }

    /// Serpens `trigger(table, key)` as a condition: polled by the platform after every
    /// op it applies (requests, events, timer), it returns the table entries this NF wants
    /// updated now (a pool below its low-water mark, a counter batch full). A handler can
    /// also ask directly with [`NfEnv::trigger`]. Default: none.
    fn trigger(&mut self, _env: &mut NfEnv) -> Vec<crate::Trigger> {
        Vec::new()
    }

    /// The platform-owned tables this NF keeps all of its state in ([`StateTables`],
    /// S6 objects), if it does. Then the platform, not the NF, snapshots, restores,
    /// splits, merges and expires that state: the defaults of the methods below run
    /// [`StateTables`]' own, and the NF writes none of them. An NF that keeps state of
    /// its own answers None (the default) and implements them.
    fn state(&self) -> Option<&StateTables> {
        None
    }

    /// The same tables, to change ([`NetworkFunction::state`]).
    fn state_mut(&mut self) -> Option<&mut StateTables> {
        None
    }

    /// The platform just replaced or moved rows of this NF's tables wholesale (the
    /// default restore, split, split_flows, merge and merge_prepared): rebuild what the
    /// NF derives from them, such as a count per host. Default: nothing to rebuild.
    fn tables_changed(&mut self) {}

    /// All state, for a new replica or a state transfer.
    fn snapshot(&self) -> Result<Vec<u8>, NfError> {
        self.state()
            .ok_or_else(|| own_state(self.kind()))?
            .snapshot()
    }

    /// Replace all state with a snapshot. A snapshot that does not fit (corrupt, or of
    /// other tables) is refused and changes nothing.
    fn restore(&mut self, snapshot: &[u8]) -> Result<(), NfError> {
        let kind = self.kind().to_string();
        self.state_mut()
            .ok_or_else(|| own_state(&kind))?
            .restore(snapshot)?;
        self.tables_changed();
        Ok(())
    }

    /// Scale-out (Fig. 3): keep one half of the state, return the other half as a
    /// snapshot for the new owner. Per-flow state moves by `half`; partitioned shared
    /// state splits; replicated state starts the new part from zero.
    fn split(&mut self, half: &SplitHalf) -> Result<Vec<u8>, NfError> {
        let kind = self.kind().to_string();
        let part = self
            .state_mut()
            .ok_or_else(|| own_state(&kind))?
            .split(half)?;
        self.tables_changed();
        Ok(part)
    }

    /// Gradual migration (S6): like [`split`](Self::split), but only per-flow state
    /// moves (with the with-flows rows its flows use); shared state (a port pool,
    /// counters) stays whole here. On platform tables the default does that
    /// ([`StateTables::split_flows`]); otherwise it is `split`, right for NFs whose split
    /// moves per-flow state only, and an NF of its own state that splits a pool must
    /// override it, or each pull of a gradual scale-out halves its pool.
    fn split_flows(&mut self, half: &SplitHalf) -> Result<Vec<u8>, NfError> {
        let Some(s) = self.state_mut() else {
            return self.split(half);
        };
        let part = s.split_flows(half)?;
        self.tables_changed();
        Ok(part)
    }

    /// Scale-in: take in a part another owner split off (or its whole state).
    fn merge(&mut self, part: &[u8]) -> Result<(), NfError> {
        let kind = self.kind().to_string();
        self.state_mut()
            .ok_or_else(|| own_state(&kind))?
            .merge(part)?;
        self.tables_changed();
        Ok(())
    }

    /// A decoder for parts to merge that needs none of this NF's state, so SC can decode
    /// a part on another thread before the merge op is sequenced (docs/scaling.md): the
    /// ordered merge is then [`NetworkFunction::merge_prepared`] on decoded state. The
    /// default keeps the bytes, and `merge_prepared` runs [`NetworkFunction::merge`].
    fn merge_decoder(&self) -> MergeDecoder {
        match self.state() {
            Some(s) => s.merge_decoder(),
            None => Arc::new(|b: &[u8]| Ok(PreparedPart::new(RawPart(b.to_vec())))),
        }
    }

    /// Whether [`NetworkFunction::merge_prepared`] would take `part` (from this NF's
    /// decoder). A chain checks every NF before it merges any, so that a refused merge
    /// changes nothing. The default checks a part for platform tables in full, and
    /// accepts anything else (its `merge_prepared` may still refuse).
    fn check_prepared(&self, part: &PreparedPart) -> Result<(), NfError> {
        match self.state() {
            Some(s) => s.check_prepared(part),
            None => Ok(()),
        }
    }

    /// Merge a part this NF's [`NetworkFunction::merge_decoder`] decoded. Same outcome
    /// as [`NetworkFunction::merge`] on the bytes.
    fn merge_prepared(&mut self, part: PreparedPart) -> Result<(), NfError> {
        if let Some(s) = self.state_mut() {
            s.merge_prepared(part)?;
            self.tables_changed();
            return Ok(());
        }
        let raw: RawPart = part.downcast()?;
        self.merge(&raw.0)
    }

    /// `FlowKey::hash()` of every flow this NF holds per-flow state for, or None if it
    /// cannot tell. During a scale (docs/scaling.md) the old owner keeps deciding new
    /// flows of the moved range, and must refuse flows whose state already left with the
    /// part: this is how it tells them apart. None makes it refuse every moved flow
    /// until the new owner serves them, which is correct but makes them wait.
    fn flow_hashes(&self) -> Option<Vec<u64>> {
        self.state().map(StateTables::flow_hashes)
    }
}

fn own_state(kind: &str) -> NfError {
    NfError::Snapshot(format!(
        "{kind}: keeps no platform tables (NetworkFunction::state), so it must implement \
         its own snapshot, restore, split and merge"
    ))
}

/// The state methods of a [`NetworkFunction`] that keeps all of its state in platform
/// tables: `platform_state!(self.state)` answers [`NetworkFunction::state`] and
/// [`NetworkFunction::state_mut`] with that field, so the platform's snapshot, restore,
/// split, merge and expiry run on it.
#[macro_export]
macro_rules! platform_state {
    (self.$($field:ident).+) => {
        fn state(&self) -> ::std::option::Option<&$crate::StateTables> {
            Some(&self.$($field).+)
        }
        fn state_mut(&mut self) -> ::std::option::Option<&mut $crate::StateTables> {
            Some(&mut self.$($field).+)
        }
    };
}

/// The state methods of a [`NetworkFunction`] with no state to move (a stub or test NF):
/// an empty snapshot and split, and a restore and merge that accept anything.
///
/// `no_flow_state!(holds no flows)` also answers [`NetworkFunction::flow_hashes`] with an
/// empty list, so a scale never makes its moved flows wait; plain `no_flow_state!()`
/// keeps the default (cannot tell).
#[macro_export]
macro_rules! no_flow_state {
    () => {
        fn snapshot(&self) -> ::std::result::Result<::std::vec::Vec<u8>, $crate::NfError> {
            Ok(::std::vec::Vec::new())
        }
        fn restore(&mut self, _: &[u8]) -> ::std::result::Result<(), $crate::NfError> {
            Ok(())
        }
        fn split(
            &mut self,
            _: &$crate::SplitHalf,
        ) -> ::std::result::Result<::std::vec::Vec<u8>, $crate::NfError> {
            Ok(::std::vec::Vec::new())
        }
        fn merge(&mut self, _: &[u8]) -> ::std::result::Result<(), $crate::NfError> {
            Ok(())
        }
    };
    (holds no flows) => {
        $crate::no_flow_state!();
        fn flow_hashes(&self) -> ::std::option::Option<::std::vec::Vec<u64>> {
            Some(::std::vec::Vec::new())
        }
    };
}
