//! The fabric master's state and logic, owned by one task (no locks): sessions,
//! membership, the partition map, the rule cache and the requests in flight.
//!
//! The master does no I/O and reads no clock, so it can be driven and checked directly
//! (see `tests`): each input is a method (`on_pp_open`, `on_sc_results`, `tick`, ...)
//! given the time, queries are methods returning their answer, and what is to be sent
//! is queued as [`Out`] for the caller to deliver (`service` owns the channels).
//!
//! Per PP request: answer from the [`RuleCache`] if it can; otherwise join an identical
//! request already in flight (same tenant, chain and key, from any PP node); otherwise
//! number it, look its partition up and queue it for that group's head. Queued
//! requests leave once per burst of input, one `GroupSubmit` per group, so the batch
//! size follows the load. Tail results come back numbered; FM caches the rule and
//! answers every waiter, in one `RuleReplyBatch` per PP session per burst.
//!
//! Group repair: when an SC node dies FM removes it from each of its groups, appends a
//! spare live SC node at the tail if one exists, bumps the epoch and pushes the new
//! order to every member. If the head changed, the requests in flight for the group are
//! submitted again to the new head (the dead head may have taken them with it). Any
//! request unanswered after `retry_after` is submitted again too, up to `max_attempts`;
//! then its waiters get an error. Re-submitting is safe because NFs answer a repeated
//! first packet of a flow they know with that flow's existing rule (the same property a
//! restarted PP node relies on).
//!
//! Recovery: a new FM process (a restarted one, or a standby the nodes failed over to)
//! knows no group. Each SC node reports the groups it hosts right after it registers,
//! and FM adopts them with their ids, epochs, orders and ranges (`on_hosted`). For a
//! short window after the first SC node registers (the SC heartbeat limit) it creates
//! no group and holds requests that have no group yet, so a node that has not
//! reconnected yet is not mistaken for a missing partition; at the end of the window
//! replicas that never came back are treated as dead (docs/planes.md, "FM failover").

mod observe;
mod recovery;
mod scale;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};

// hashbrown (foldhash, seeded per map) rather than std's SipHash: `inflight` and `by_id`
// are probed for every rule request and reply.
use hashbrown::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use pipeline::{FlowKey, LatencyHistogram};
use prost::Message;
use proto::v1::{self, pp_down, sc_down};
use proto::ChainDef;
use serde_json::json;
use smallvec::{smallvec, SmallVec};
use tracing::{debug, info, warn};

use crate::cache::{CacheKey, CacheStats, RuleCache};
use crate::events::{EventKind, EventLog};
use crate::membership::Membership;
use crate::partition::PartitionMap;
use crate::vip::VipTable;

pub use scale::{ScaleOutcome, ScaleRequest};

/// `decided_by` of a reply answered from FM's rule cache.
const CACHE_DECIDER: &str = "FM rule cache";

/// Configuration of the fabric master.
#[derive(Debug, Clone)]
pub struct FmConfig {
    pub fm_id: String,
    /// Heartbeat period nodes are told to keep.
    pub heartbeat: Duration,
    /// Silent periods before a PP node is declared dead.
    pub miss_limit: u32,
    /// Silent periods before an SC node is declared dead. Longer than for PP: a
    /// falsely suspected replica costs its group an epoch change and a state snapshot,
    /// and a replica busy serialising a large snapshot on a loaded machine can go
    /// quiet for a few periods without being dead.
    pub sc_miss_limit: u32,
    /// Replicas per SC group.
    pub replicas: usize,
    pub cache_capacity: usize,
    /// Cache lifetime of rules that name no idle timeout.
    pub cache_default_ttl: Duration,
    /// Submit a request again when no answer came within this.
    pub retry_after: Duration,
    pub max_attempts: u32,
    /// Largest number of requests in one `GroupSubmit`.
    pub max_batch: usize,
    /// Tenant chains served.
    pub chains: Vec<ChainDef>,
    /// Events kept in memory (`starfabric events`).
    pub events_capacity: usize,
    /// Also append every event to this file, one JSON object a line.
    pub events_file: Option<PathBuf>,
    /// The PP cluster's vIP group (empty: PP nodes are not given vIPs).
    pub vips: Vec<crate::vip::VipDef>,
    /// Heartbeat period PP nodes are told to keep. Short, because a dead PP node's vIPs
    /// move only once it is found dead (paper 003 §VIII-C.2: recovery within 50 ms
    /// including detection); SC nodes keep `heartbeat`.
    pub pp_heartbeat: Duration,
    /// Most rule requests in flight to SC groups (summed over groups). A request above
    /// it is answered at once with [`proto::ERR_SETUP_OVERLOAD`]: overload sheds new
    /// flows, counted, instead of queueing them past any useful latency.
    pub max_inflight: usize,
    /// Most rule requests queued for the master task (read off PP sessions but not yet
    /// taken). A PP session's reader answers the excess with
    /// [`proto::ERR_SETUP_OVERLOAD`] itself, so the session never blocks.
    pub max_queued: usize,
    /// Most messages waiting in one session's down stream (FM → a node) before FM
    /// drops what the node will ask for again: rule replies and first packets to a PP
    /// node, request-only submits to an SC node, each counted
    /// (`starfabric_fm_down_queue_full_total`). Control messages always go. Without it
    /// a node that reads slower than FM writes would grow FM's memory without bound.
    pub max_down_queue: usize,
    /// The same bound in encoded bytes: a session's down stream also stops taking
    /// droppable messages once it holds this many. Messages differ in size by 100× (a
    /// one-reply batch, a 9 KB first packet, a submit of 64 requests), so a count alone
    /// let a stalled session hold from a megabyte to half a gigabyte.
    pub max_down_bytes: usize,
    /// How a scale-out moves the flows' state when the request does not say
    /// (docs/scaling.md): in bulk at st, or gradually (S6).
    pub migration: Migration,
    /// mTLS for FM's server and its calls to SC nodes; `None` is plaintext
    /// (`--insecure`, lab use only; docs/security.md).
    pub tls: Option<std::sync::Arc<proto::tls::NodeTls>>,
    /// Chains split over the PP fabric: the PP nodes serving each one's egress stage
    /// (docs/fabric.md).
    pub fabric: Vec<crate::fabric::FabricStage>,
}

/// How a scale-out moves the flows' state (docs/scaling.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Migration {
    /// One part at st (every moved flow and half the free shared state), a delta at
    /// the end step.
    #[default]
    Bulk,
    /// S6: half the free shared state at st; each flow's state moves on its first
    /// access at the new owner, and a background sweep moves the rest.
    Gradual,
}

impl std::str::FromStr for Migration {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "bulk" => Ok(Migration::Bulk),
            "gradual" => Ok(Migration::Gradual),
            _ => Err(format!(
                "migration must be \"bulk\" or \"gradual\", not {s:?}"
            )),
        }
    }
}

impl FmConfig {
    /// How often the master's periodic work runs: the shorter heartbeat period, so a
    /// silent PP node is judged within one of its own periods.
    pub fn tick_period(&self) -> Duration {
        if self.vips.is_empty() {
            self.heartbeat
        } else {
            self.heartbeat
                .min(self.pp_heartbeat)
                .max(Duration::from_millis(1))
        }
    }
}

impl Default for FmConfig {
    fn default() -> Self {
        FmConfig {
            fm_id: "fm-1".into(),
            heartbeat: Duration::from_millis(50),
            miss_limit: 3,
            sc_miss_limit: 10,
            replicas: 3,
            cache_capacity: 1 << 20,
            cache_default_ttl: Duration::from_secs(300),
            retry_after: Duration::from_millis(250),
            max_attempts: 4,
            max_batch: 2048,
            chains: Vec::new(),
            events_capacity: crate::events::DEFAULT_CAPACITY,
            events_file: None,
            vips: Vec::new(),
            pp_heartbeat: Duration::from_millis(10),
            max_inflight: 32 * 1024,
            max_queued: 64 * 1024,
            max_down_queue: 8 * 1024,
            max_down_bytes: 32 << 20,
            migration: Migration::default(),
            tls: None,
            fabric: Vec::new(),
        }
    }
}

/// Counters of the fabric master.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FmStats {
    pub pp_requests: u64,
    /// Joined an identical request already in flight.
    pub coalesced: u64,
    pub submitted: u64,
    pub submits: u64,
    pub resubmitted: u64,
    pub sc_replies: u64,
    /// Answers for requests no longer in flight (repeats after a repair).
    pub duplicate_replies: u64,
    /// Encoded replies from SC that did not read as a reply: their flows were refused
    /// with [`proto::ERR_BAD_SC_REPLY`] (the PP node asks again).
    pub bad_sc_replies: u64,
    pub replies_to_pp: u64,
    /// Flow rules withdrawn from PP nodes because their chain went or was rebuilt.
    pub rules_revoked: u64,
    pub bad_requests: u64,
    pub no_group: u64,
    pub timeouts: u64,
    pub reconfigurations: u64,
    pub nodes_dead: u64,
    /// Groups whose every replica was declared dead. FM keeps the last one listed
    /// (its state is the partition's) and waits for it to come back.
    pub groups_stalled: u64,
    /// Stalled groups whose last replica came back restarted: the partition's state
    /// was lost and the group started over empty.
    pub groups_reset: u64,
    /// Scales finished (fin received, dispatch switched for good).
    pub scale_outs: u64,
    pub scale_ins: u64,
    /// Scales given up (a group died before fin, a step failed, a timeout); dispatch
    /// went back to the old owner.
    pub scale_aborts: u64,
    /// Requests a group refused as moved (or not ready) and FM sent on to the owner.
    pub scale_redirects: u64,
    /// Gradual scale-outs: pull steps started (each carries the keys first accessed
    /// since the last one and a chunk of the sweep), and requests a new owner refused
    /// because their flow's state had not moved yet.
    pub scale_pulls: u64,
    pub scale_migrating: u64,
    /// From st to fin of the last finished scale, and summed over all of them (µs).
    pub scale_last_us: u64,
    pub scale_total_us: u64,
    /// vIPs moved between PP nodes (joins, failovers, drains).
    pub vip_moves: u64,
    /// Requests of unbound tenant (`proto::UNBOUND_TENANT`) with no cached rule.
    pub unknown_flows: u64,
    /// Requests refused with [`proto::ERR_SETUP_OVERLOAD`]: by the master (too many in
    /// flight to SC) and by the PP session readers (the master's queue was full).
    pub setup_overload: u64,
    /// Groups taken over from the SC nodes' reports (after a restart or failover).
    pub groups_adopted: u64,
    /// PP counter reports (`FlowEvent.counters`) received, and routed to an SC group.
    pub counter_events: u64,
    pub counter_events_routed: u64,
    /// Counter reports dropped, by reason: unbound tenant and no cached rule to tell
    /// it; no partition owns the key; more than `MAX_QUEUED_EVENTS` waiting for the
    /// next flush.
    pub counter_events_unknown_flow: u64,
    pub counter_events_no_group: u64,
    pub counter_events_queue_full: u64,
    /// Writes to mirrored NF tables relayed from one group's results to the chain's
    /// other groups (counted once per receiving group), and those dropped because more
    /// than `MAX_QUEUED_EVENTS` waited for the next flush (docs/nf-api.md, "Mirrored
    /// tables").
    pub mirror_relayed: u64,
    pub mirror_dropped: u64,
    pub cache: CacheStats,
    /// The fabric's PP↔PP routes (docs/fabric.md).
    pub fabric: crate::fabric::FabricStats,
}

/// Flow events queued for SC between two flushes, at most; more are dropped and
/// counted. PP batches its counter reports per second, so this is far above a healthy
/// fabric's need and bounds FM's memory against a misbehaving PP node.
pub const MAX_QUEUED_EVENTS: usize = 1 << 18;

/// Observability beyond [`FmStats`]: what needs more than a counter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FmMetrics {
    /// Rule requests from PP nodes per tenant, ascending by tenant.
    pub tenant_requests: Vec<(u32, u64)>,
    /// From a PP request reaching the master task to its reply leaving it (cache hits,
    /// SC round trips, coalesced waiters and error answers alike).
    pub request_latency: LatencyHistogram,
    /// Rules in the cache.
    pub cache_entries: usize,
    /// Requests waiting for an SC answer.
    pub inflight: usize,
    /// The fabric's routes per serving PP node, ascending by node (docs/fabric.md).
    pub fabric_routes: Vec<(String, usize)>,
}

/// How long a new FM waits for PP nodes coming over from another FM to report their
/// vIPs before it balances the table (a few of their 10 ms heartbeat periods plus a
/// reconnect).
const VIP_SETTLE_MS: u64 = 500;

/// What the master wants sent, in order. The caller (the service loop, or a test)
/// drains it with [`Master::take_out`] and delivers it: a message for a session that has
/// gone since is dropped, as a send on a closed stream would be.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Out {
    Pp {
        session: u64,
        msg: v1::PpDown,
    },
    /// Boxed: an `ScDown` is several times the size of the other variants.
    Sc {
        session: u64,
        msg: Box<v1::ScDown>,
    },
    /// The master forgot this session (its node died or registered again on another):
    /// end its down stream, after what was sent on it before.
    Close {
        session: u64,
    },
    /// A scale [`Master::scale`] started has ended (done or aborted).
    Scaled(ScaleOutcome),
}

/// A node's new session, as its registration opened it.
pub(crate) struct Opened {
    pub(crate) session: u64,
    pub(crate) info: v1::NodeInfo,
    /// When the node was last heard from (ms), stamped by the session's reader as
    /// messages arrive (see [`crate::membership::MemberEntry::seen`]).
    pub(crate) seen: Arc<AtomicU64>,
    /// What this session's liveness beacons carry ([`proto::liveness`]).
    pub(crate) liveness_token: u64,
}

/// What applying a desired configuration changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DesiredChange {
    pub added: usize,
    pub changed: usize,
    pub removed: usize,
}

struct Waiter {
    session: u64,
    id: u64,
    worker: u32,
    /// When the request reached the master task (µs on its clock).
    arrived_us: u64,
    /// The flow's first packet, if it came with the request: handed to the next-hop
    /// PP node if the answer is a fabric route (docs/fabric.md).
    frame: Option<proto::Bytes>,
}

struct Inflight {
    id: u64,
    group: u64,
    request: v1::RuleRequest,
    sent_ms: u64,
    attempts: u32,
    /// Almost always one: a second asker of the same flow is rare, and an inline
    /// first saves an allocation per flow.
    waiters: SmallVec<[Waiter; 1]>,
}

#[derive(Default)]
struct PpSession {
    /// The node on the session: whom a fabric route is relative to.
    node: String,
    out: Vec<v1::RuleReply>,
    /// Replies sent as the cache encoded them (`RuleReplyBatch::encoded`).
    out_encoded: Vec<v1::EncodedReply>,
    /// Arrival time (µs) of the request each reply (of either list) answers.
    out_arrived: Vec<u64>,
    /// First packets handed to this node since the last flush (bounded by
    /// [`MAX_FABRIC_FRAMES`]).
    frames: usize,
}

/// First packets FM hands one PP node between two flushes, at most; more are dropped
/// and counted (`fabric_first_dropped{reason="queue-full"}`), and their ingress nodes
/// release them over the fabric themselves. It bounds what a burst of new flows puts
/// on one node's control stream.
pub const MAX_FABRIC_FRAMES: usize = 1024;

/// Whether this FM still learns its groups from the SC nodes (see `on_hosted`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Recovery {
    /// No SC node has registered yet.
    Waiting,
    /// SC nodes' reports are adopted until this time (ms); no group is created.
    Until(u64),
    /// FM owns the map: reports of unknown groups are ignored.
    Done,
}

/// Most PP requests held while FM waits for its groups.
const MAX_HELD: usize = 1 << 16;

pub(crate) struct Master {
    cfg: FmConfig,
    /// The caller's clock (µs since FM started), as of the input being handled.
    now_us: u64,
    /// What to send, for the caller to deliver (see [`Out`]).
    out: Vec<Out>,
    chains: Vec<v1::ChainConfig>,
    /// Desired hash ranges per chain; a chain with none gets one partition of the whole
    /// key space.
    partitions: Vec<v1::Partition>,
    /// Each tenant's shard set from the orchestrator's placement: the only SC nodes its
    /// groups are formed, refilled or scaled out on. A tenant with no entry uses any.
    shards: HashMap<u32, Vec<String>>,
    members: Membership,
    map: PartitionMap,
    cache: RuleCache,
    inflight: HashMap<CacheKey, Inflight>,
    by_id: HashMap<u64, CacheKey>,
    next_id: u64,
    pp: HashMap<u64, PpSession>,
    /// Live SC sessions.
    sc: HashSet<u64>,
    sc_by_node: HashMap<String, u64>,
    to_submit: HashMap<u64, Vec<v1::RuleRequest>>,
    events_to_submit: HashMap<u64, Vec<v1::FlowEvent>>,
    /// Events in `events_to_submit` (bounded by [`MAX_QUEUED_EVENTS`]).
    queued_events: usize,
    /// Other partitions' mirrored writes for each group, and how many writes wait in
    /// all (bounded by [`MAX_QUEUED_EVENTS`] too).
    mirror_to_submit: HashMap<u64, Vec<v1::MirrorBatch>>,
    queued_mirror: usize,
    /// When each group's tail last answered (ms): a group that answers is making
    /// progress, and its unanswered requests are queued, not lost.
    group_progress: HashMap<u64, u64>,
    last_tick: u64,
    stats: FmStats,
    tenant_requests: HashMap<u32, u64>,
    request_latency: LatencyHistogram,
    /// Scales under way, by id (see `scale`).
    scales: BTreeMap<u64, scale::ScaleJob>,
    next_scale: u64,
    /// Requests dispatched per group (how "busiest" is judged).
    group_load: HashMap<u64, u64>,
    /// Requests refused as moved whose new owner is not known yet.
    parked: Vec<CacheKey>,
    /// Groups a scale dissolved: anything they still send is ignored.
    dissolved: HashSet<u64>,
    /// Rules the old owner of a scale under way decided in the moved range, kept out of
    /// the cache's reach until the new owner has merged their state (the cache may
    /// evict; these must be answered here until then).
    pins: HashMap<CacheKey, v1::RuleReply>,
    /// What happened, for operators (`Events`); see `crate::events`.
    pub(crate) events: EventLog,
    /// FM's UDP port for liveness beacons, 0 when it has none.
    pub(crate) liveness_port: u16,
    /// The PP cluster's Multi IPs Mapping Table (see `vip`).
    vips: VipTable,
    /// Until this time (ms) PP nodes that claim vIPs only adopt them and the table is
    /// balanced once it passes: set when the first node to join this FM claims vIPs,
    /// i.e. the nodes are coming over from another (or an earlier) FM.
    vip_settle_until: Option<u64>,
    vip_joined: bool,
    recovery: Recovery,
    /// PP requests that found no group while `recovery` is not done: (session, request).
    held: Vec<(u64, v1::RuleRequest)>,
    /// Adopted groups that reported a scale under way: group → scale id.
    adopted_scales: HashMap<u64, u64>,
    /// The fabric's PP↔PP routes (paper 000 §5.2).
    fabric: crate::fabric::FabricTable,
}

impl Master {
    pub(crate) fn new(cfg: FmConfig, chains: Vec<v1::ChainConfig>) -> Self {
        let events = EventLog::new(cfg.events_capacity);
        let cfg_vips = cfg.vips.clone();
        let fabric = crate::fabric::FabricTable::new(&cfg.fabric);
        let map_of_chains = PartitionMap::with_partitioning(&chains);
        Master {
            cache: RuleCache::new(cfg.cache_capacity, cfg.cache_default_ttl.as_millis() as u64),
            cfg,
            now_us: 0,
            out: Vec::new(),
            chains,
            partitions: Vec::new(),
            members: Membership::default(),
            map: map_of_chains,
            shards: HashMap::new(),
            inflight: HashMap::new(),
            by_id: HashMap::new(),
            next_id: 1,
            pp: HashMap::new(),
            sc: HashSet::new(),
            sc_by_node: HashMap::new(),
            to_submit: HashMap::new(),
            events_to_submit: HashMap::new(),
            queued_events: 0,
            mirror_to_submit: HashMap::new(),
            queued_mirror: 0,
            group_progress: HashMap::new(),
            last_tick: 0,
            stats: FmStats::default(),
            tenant_requests: HashMap::new(),
            request_latency: LatencyHistogram::default(),
            scales: BTreeMap::new(),
            next_scale: 1,
            group_load: HashMap::new(),
            parked: Vec::new(),
            dissolved: HashSet::new(),
            pins: HashMap::new(),
            events,
            liveness_port: 0,
            vips: VipTable::new(cfg_vips),
            vip_settle_until: None,
            vip_joined: false,
            recovery: Recovery::Waiting,
            held: Vec::new(),
            adopted_scales: HashMap::new(),
            fabric,
        }
    }

    /// Tell every node in `change` its new set of vIPs, gainers first (the order of
    /// `change.nodes`): a vMAC gets its new owner's filter before the old owner drops it.
    fn push_vips(&mut self, change: &crate::vip::VipChange, why: &str) {
        if change.is_empty() {
            return;
        }
        let epoch = self.vips.epoch();
        for node in &change.nodes {
            let Some(session) = self
                .members
                .get(node)
                .filter(|e| e.alive)
                .map(|e| e.session)
            else {
                continue;
            };
            if !self.pp.contains_key(&session) {
                continue;
            }
            let vips = self
                .vips
                .owned_by(node)
                .into_iter()
                .map(|i| self.vip_proto(i))
                .collect();
            self.send_pp(session, pp_down::Msg::Vips(v1::VipAssign { epoch, vips }));
        }
        info!(epoch, moved = change.moved, nodes = ?change.nodes, %why, "vIPs moved");
        let owners: BTreeMap<String, Vec<usize>> = change
            .nodes
            .iter()
            .map(|n| (n.clone(), self.vips.owned_by(n)))
            .collect();
        self.event(
            EventKind::VipMoved,
            format!("{} vIPs moved: {why}", change.moved),
            json!({"epoch": epoch, "moved": change.moved, "why": why, "owners": owners}),
        );
    }

    fn vip_proto(&self, i: usize) -> v1::Vip {
        let d = self.vips.vips()[i];
        v1::Vip {
            index: i as u32,
            ip: d.ip.to_string(),
            mac: d.mac.to_vec(),
        }
    }

    pub(crate) fn vip_map(&self) -> v1::VipMapReply {
        v1::VipMapReply {
            epoch: self.vips.epoch(),
            vips: (0..self.vips.vips().len())
                .map(|i| v1::VipOwner {
                    vip: Some(self.vip_proto(i)),
                    node: self.vips.owner_of(i).unwrap_or_default().to_string(),
                })
                .collect(),
            nodes: self.vips.nodes().map(|(n, _)| n.to_string()).collect(),
            draining: self
                .vips
                .nodes()
                .filter(|(_, d)| *d)
                .map(|(n, _)| n.to_string())
                .collect(),
            moves: self.vips.moves(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.now_us / 1000
    }

    fn now_us(&self) -> u64 {
        self.now_us
    }

    /// Take the caller's clock for the input being handled; returns it in ms.
    fn at(&mut self, now_us: u64) -> u64 {
        self.now_us = now_us;
        self.now_ms()
    }

    /// Everything queued for sending since the last call, in order.
    pub(crate) fn take_out(&mut self) -> Vec<Out> {
        std::mem::take(&mut self.out)
    }

    fn send_pp(&mut self, session: u64, msg: pp_down::Msg) {
        self.out.push(Out::Pp {
            session,
            msg: v1::PpDown { msg: Some(msg) },
        });
    }

    /// Send `msg` to SC node `node`, if it has a live session.
    fn send_sc(&mut self, node: &str, msg: sc_down::Msg) {
        if let Some(&session) = self.sc_by_node.get(node).filter(|s| self.sc.contains(*s)) {
            self.out.push(Out::Sc {
                session,
                msg: Box::new(v1::ScDown { msg: Some(msg) }),
            });
        }
    }

    fn register_ack(&self, role: v1::Role, liveness_token: u64) -> v1::RegisterAck {
        let period = if role == v1::Role::Pp {
            self.cfg.pp_heartbeat
        } else {
            self.cfg.heartbeat
        };
        v1::RegisterAck {
            fm_id: self.cfg.fm_id.clone(),
            heartbeat_ms: period.as_millis().max(1) as u32,
            miss_limit: self.cfg.miss_limit,
            proto_version: proto::PROTO_VERSION,
            liveness_port: u32::from(self.liveness_port),
            liveness_token: if self.liveness_port == 0 {
                0
            } else {
                liveness_token
            },
            // First packets are worth their bytes only where a chain is split.
            fabric_frames: role == v1::Role::Pp && !self.fabric.is_empty(),
            encoded_replies: role == v1::Role::Sc,
        }
    }

    /// A PP node registered.
    pub(crate) fn on_pp_open(&mut self, open: Opened, now_us: u64) {
        let now = self.registered(open.session, open.liveness_token, v1::Role::Pp, now_us);
        let (session, info, seen) = (open.session, open.info, open.seen);
        info!(node = %info.id, session, vip_capable = info.vip_capable, "PP node registered");
        self.event(
            EventKind::PpNodeJoined,
            format!("PP node {} registered", info.id),
            json!({"node": info.id, "addr": info.addr}),
        );
        let id = info.id.clone();
        if let Ok(mac) = <[u8; 6]>::try_from(info.fabric_mac.as_slice()) {
            self.fabric.join(&id, mac);
        }
        let vip_join = (info.vip_capable && !self.vips.is_empty()).then(|| {
            info.owned_vips
                .iter()
                .map(|v| v.index as usize)
                .collect::<Vec<_>>()
        });
        if let Some(old) = self.members.register(info, session, seen, now) {
            if self.pp.remove(&old).is_some() {
                self.close(old);
            }
        }
        self.pp.insert(
            session,
            PpSession {
                node: id.clone(),
                ..Default::default()
            },
        );
        if let Some(claimed) = vip_join {
            if !self.vip_joined && !claimed.is_empty() {
                self.vip_settle_until = Some(now + VIP_SETTLE_MS);
            }
            self.vip_joined = true;
            let change = if self.vip_settle_until.is_some() {
                self.vips.adopt(&id, &claimed)
            } else {
                self.vips.join(&id, &claimed)
            };
            info!(node = %id, moved = change.moved, epoch = self.vips.epoch(), "PP node joined the vIP group");
            self.push_vips(&change, &format!("{id} joined"));
        }
    }

    /// Take the clock of a registration and acknowledge it on the new session (not
    /// by node id: the node's previous session may still be the one on record).
    /// Returns the time in ms.
    fn registered(&mut self, session: u64, token: u64, role: v1::Role, now_us: u64) -> u64 {
        let now = self.at(now_us);
        let ack = self.register_ack(role, token);
        if role == v1::Role::Pp {
            self.send_pp(session, pp_down::Msg::Registered(ack));
        } else {
            self.out.push(Out::Sc {
                session,
                msg: Box::new(v1::ScDown {
                    msg: Some(sc_down::Msg::Registered(ack)),
                }),
            });
        }
        now
    }

    /// The master forgot `session`: have its down stream ended, as dropping its sender
    /// did when the master held it.
    fn close(&mut self, session: u64) {
        self.out.push(Out::Close { session });
    }

    pub(crate) fn on_pp_requests(
        &mut self,
        session: u64,
        requests: Vec<v1::RuleRequest>,
        now_us: u64,
    ) {
        let now = self.at(now_us);
        self.on_requests(session, requests, now);
    }

    /// Flow events from a PP node, queued for the groups owning their keys. A counter
    /// report of an unbound tenant (a reply rule on a VNI its PP node has no binding
    /// for) takes its tenant and chain from the rule cache, as the request did.
    pub(crate) fn on_pp_events(&mut self, events: Vec<v1::FlowEvent>, now_us: u64) {
        let now = self.at(now_us);
        for mut e in events {
            let counters = matches!(e.kind, Some(v1::flow_event::Kind::Counters(_)));
            let Ok(key) = proto::event_key(&e) else {
                self.stats.bad_requests += 1;
                continue;
            };
            if counters {
                self.stats.counter_events += 1;
                if e.tenant == proto::UNBOUND_TENANT {
                    match self.cache.get_by_flow(key.as_bytes(), now) {
                        Some(((t, c, _), _)) => (e.tenant, e.chain) = (t, c),
                        None => {
                            self.drop_counter_event("unknown-flow");
                            continue;
                        }
                    }
                }
            }
            if self.queued_events >= MAX_QUEUED_EVENTS {
                if counters {
                    self.drop_counter_event("queue-full");
                }
                continue;
            }
            match self.map.lookup_key(e.tenant, e.chain, &key) {
                Some(g) => {
                    if counters {
                        self.stats.counter_events_routed += 1;
                    }
                    self.queued_events += 1;
                    self.events_to_submit.entry(g).or_default().push(e);
                }
                None if counters => self.drop_counter_event("no-group"),
                None => {}
            }
        }
    }

    fn drop_counter_event(&mut self, reason: &'static str) {
        let c = match reason {
            "unknown-flow" => &mut self.stats.counter_events_unknown_flow,
            "no-group" => &mut self.stats.counter_events_no_group,
            _ => &mut self.stats.counter_events_queue_full,
        };
        *c += 1;
    }

    /// An SC node registered.
    pub(crate) fn on_sc_open(&mut self, open: Opened, now_us: u64) {
        let now = self.registered(open.session, open.liveness_token, v1::Role::Sc, now_us);
        let (session, info, seen) = (open.session, open.info, open.seen);
        info!(node = %info.id, addr = %info.addr, session, "SC node registered");
        if self.recovery == Recovery::Waiting {
            // Give every SC node the FM had (before a restart or failover) the
            // time FM would wait before declaring it dead to report its groups.
            let grace =
                self.cfg.heartbeat.as_millis() as u64 * u64::from(self.cfg.sc_miss_limit.max(1));
            self.recovery = Recovery::Until(now + grace);
            info!(
                grace_ms = grace,
                "first SC node registered; adopting reported groups"
            );
        }
        self.event(
            EventKind::ScNodeJoined,
            format!("SC node {} registered", info.id),
            json!({"node": info.id, "addr": info.addr}),
        );
        let id = info.id.clone();
        let restarted = self
            .members
            .get(&id)
            .is_some_and(|e| e.info.incarnation != info.incarnation);
        if let Some(old) = self.members.register(info, session, seen, now) {
            // Re-registered before its old session was found dead: the old
            // incarnation's replicas are gone with it.
            if self.sc.remove(&old) {
                self.close(old);
            }
            self.sc_died(&id);
        }
        self.sc.insert(session);
        self.sc_by_node.insert(id.clone(), session);
        let chains = self.chains.clone();
        self.deploy(&chains, Some(&id));
        self.sc_returned(&id, restarted);
        self.ensure_groups();
    }

    /// Send `chains` to SC node `node` (None: every live one), each only to the nodes in
    /// its tenant's shard set: they build the chains' NFs ahead, so that a replica's
    /// start there does not (docs/workers.md, "Spare chains").
    fn deploy(&mut self, chains: &[v1::ChainConfig], node: Option<&str>) {
        let nodes: Vec<String> = match node {
            Some(n) => vec![n.to_string()],
            None => self.sc_by_node.keys().cloned().collect(),
        };
        for c in chains {
            for n in &nodes {
                if self.in_shard_set(c.tenant, n) {
                    self.send_sc(n, sc_down::Msg::Deploy(c.clone()));
                }
            }
        }
    }

    pub(crate) fn on_sc_results(&mut self, session: u64, results: v1::GroupResults, now_us: u64) {
        let now = self.at(now_us);
        self.on_results(session, results, now);
    }

    /// fin travels in the install op's result (so a new tail repeats it); a bare
    /// `ScaleFin` on the session is taken the same way.
    pub(crate) fn on_sc_fin(&mut self, fin: v1::ScaleFin, now_us: u64) {
        self.at(now_us);
        self.on_scale_fin(fin.group, fin);
    }

    /// The groups an SC node hosts, sent right after its registration.
    pub(crate) fn on_sc_hosted(
        &mut self,
        session: u64,
        node: &str,
        groups: Vec<v1::HostedGroup>,
        now_us: u64,
    ) {
        self.at(now_us);
        self.on_hosted(session, node, groups);
    }

    /// A heartbeat's load report (its arrival is already stamped in the node's `seen`).
    pub(crate) fn on_heartbeat(&mut self, session: u64, node: &str, load: Option<v1::Load>) {
        if let Some(l) = &load {
            if self.vips.contains(node) {
                self.vips.set_load(node, l.packets_per_s);
            }
        }
        self.members.heartbeat(node, session, load)
    }

    /// A session's stream ended.
    pub(crate) fn on_closed(&mut self, session: u64, node: &str, now_us: u64) {
        self.at(now_us);
        if self.members.mark_dead(node, session) {
            self.node_dead(node, session);
        }
    }

    /// Start a scale. `Ok(scale id)`: its end comes out as [`Out::Scaled`]; `Err`: FM
    /// refused to start it, and why.
    pub(crate) fn scale(&mut self, req: ScaleRequest, now_us: u64) -> Result<u64, String> {
        self.at(now_us);
        self.scale_request(req)
    }

    /// The orchestrator's desired configuration: tenant chains, their partitions and
    /// shard sets.
    pub(crate) fn set_desired(
        &mut self,
        chains: Vec<v1::ChainConfig>,
        partitions: Vec<v1::Partition>,
        shards: Vec<v1::TenantShards>,
        now_us: u64,
    ) -> DesiredChange {
        self.at(now_us);
        self.set_shards(shards);
        self.apply_desired(chains, partitions)
    }

    pub(crate) fn members_view(&self, now_ms: u64) -> v1::MembershipView {
        self.members.view(now_ms)
    }

    pub(crate) fn partition_map(&self) -> v1::PartitionMap {
        self.map.to_proto()
    }

    pub(crate) fn stats(&self) -> FmStats {
        let mut s = self.stats;
        s.cache = self.cache.stats;
        s.vip_moves = self.vips.moves();
        s.fabric = self.fabric.stats;
        s
    }

    pub(crate) fn metrics(&self) -> FmMetrics {
        let mut tenant_requests: Vec<(u32, u64)> =
            self.tenant_requests.iter().map(|(&t, &n)| (t, n)).collect();
        tenant_requests.sort_unstable();
        FmMetrics {
            tenant_requests,
            request_latency: self.request_latency,
            cache_entries: self.cache.len(),
            inflight: self.inflight.len(),
            fabric_routes: self.fabric.routes_by_node(),
        }
    }

    pub(crate) fn events_reply(&self, req: &v1::EventsRequest) -> v1::EventsReply {
        self.events.reply(req)
    }

    /// Drop every cached rule (pinned ones stay); returns how many were dropped.
    pub(crate) fn clear_cache(&mut self) -> usize {
        self.cache.clear()
    }

    /// Rules in the cache.
    pub(crate) fn flows(&self, req: &v1::FlowsRequest, now_ms: u64) -> v1::FlowsReply {
        let limit = if req.limit == 0 { 100 } else { req.limit } as usize;
        let (flows, matched) =
            self.cache
                .list(|t| req.all_tenants || t == req.tenant, limit, now_ms);
        let flows = flows
            .into_iter()
            .map(|(k, r, ttl)| v1::CachedFlow {
                tenant: k.0,
                chain: k.1,
                rule: match r.result {
                    Some(v1::rule_reply::Result::Rule(rule)) => Some(rule),
                    _ => None,
                },
                also: r.also,
                expires_in_ms: ttl,
            })
            .collect();
        v1::FlowsReply { flows, matched }
    }

    /// Move PP node `node`'s vIPs away; the error says why it cannot be drained.
    /// A node that serves only fabric stages (in no vIP group) drains too: its routes go.
    pub(crate) fn pp_drain(&mut self, node: &str) -> Result<v1::VipMapReply, String> {
        match self.vips.drain(node) {
            Ok(change) => {
                info!(%node, moved = change.moved, "PP node draining: its vIPs moved away");
                self.push_vips(&change, &format!("{node} drained"));
            }
            Err(crate::vip::VipError::UnknownNode(_)) if self.fabric.has_node(node) => {
                info!(%node, "PP node draining: in no vIP group, its fabric routes go");
            }
            Err(e) => return Err(e.to_string()),
        }
        self.fabric_leave(node, "draining");
        Ok(self.vip_map())
    }

    /// A PP node stops serving fabric stages: its routes go, and every PP node forgets
    /// the flows' rules, so their next packets ask again and get routes to live nodes.
    fn fabric_leave(&mut self, node: &str, why: &str) {
        let keys = self.fabric.leave(node);
        if keys.is_empty() {
            return;
        }
        warn!(%node, flows = keys.len(), "fabric routes to a {why} PP node withdrawn");
        self.event(
            EventKind::FabricRoutesWithdrawn,
            format!(
                "fabric: {} routes to {why} PP node {node} withdrawn",
                keys.len()
            ),
            json!({"node": node, "fabric_routes": keys.len()}),
        );
        self.revoke_at_pp(keys);
    }

    /// Move one vIP to a PP node; the error says why it cannot move.
    pub(crate) fn vip_move(&mut self, req: &v1::VipMoveRequest) -> Result<v1::VipMapReply, String> {
        let change = self
            .vips
            .move_vip(req.vip as usize, &req.to)
            .map_err(|e| e.to_string())?;
        let why = if req.reason.is_empty() {
            format!("vIP {} moved to {}", req.vip, req.to)
        } else {
            req.reason.clone()
        };
        self.push_vips(&change, &why);
        Ok(self.vip_map())
    }

    /// Replace the served chains. A removed chain's groups leave and its cached rules
    /// go; a chain whose configuration changed is rebuilt the same way (NF state starts
    /// empty: the NF API has no reconfigure hook yet), and new chains get groups as soon
    /// as enough SC nodes are live. Requests in flight for a removed or rebuilt chain are
    /// answered with an error, so no PP packet waits for a group that will not answer.
    fn apply_desired(
        &mut self,
        chains: Vec<v1::ChainConfig>,
        partitions: Vec<v1::Partition>,
    ) -> DesiredChange {
        let mut change = DesiredChange::default();
        let old: HashMap<(u32, u32), v1::ChainConfig> = self
            .chains
            .drain(..)
            .map(|c| ((c.tenant, c.chain), c))
            .collect();
        let new: HashMap<(u32, u32), &v1::ChainConfig> =
            chains.iter().map(|c| ((c.tenant, c.chain), c)).collect();
        let ranges_of = |ps: &[v1::Partition], t: u32, c: u32| -> Vec<(u64, u64)> {
            let mut v: Vec<(u64, u64)> = ps
                .iter()
                .filter(|p| p.tenant == t && p.chain == c)
                .map(|p| (p.hash_lo, p.hash_hi))
                .collect();
            v.sort_unstable();
            v
        };
        let mut teardown = Vec::new();
        for (k, c) in &old {
            match new.get(k) {
                None => {
                    change.removed += 1;
                    teardown.push(*k);
                }
                Some(n)
                    if *n != c
                        || ranges_of(&partitions, k.0, k.1)
                            != ranges_of(&self.partitions, k.0, k.1) =>
                {
                    change.changed += 1;
                    teardown.push(*k);
                }
                Some(_) => {}
            }
        }
        change.added = new.keys().filter(|k| !old.contains_key(*k)).count();
        // It borrows `chains`, which moves into `self` below.
        drop(new);
        for (tenant, chain) in teardown {
            self.teardown_chain(tenant, chain);
        }
        self.map.set_partitioning(&chains);
        // Added or changed chains (`self.chains` was drained into `old` above).
        let fresh: Vec<v1::ChainConfig> = chains
            .iter()
            .filter(|c| old.get(&(c.tenant, c.chain)) != Some(*c))
            .cloned()
            .collect();
        self.chains = chains;
        self.deploy(&fresh, None);
        self.partitions = partitions;
        if change != DesiredChange::default() {
            info!(
                added = change.added,
                changed = change.changed,
                removed = change.removed,
                chains = self.chains.len(),
                "desired chains applied"
            );
        }
        self.ensure_groups();
        change
    }

    /// Tell every PP node to drop these flows' rules: they came from a chain that is gone
    /// or rebuilt, so a PP (or its XDP fast path) must not keep running them. FM does not
    /// track which PP holds which flow, so every PP gets the list.
    fn revoke_at_pp(&mut self, keys: Vec<[u8; 40]>) {
        if keys.is_empty() {
            return;
        }
        self.stats.rules_revoked += keys.len() as u64;
        // Bounded messages: a 100k-flow chain is revoked in a few dozen batches.
        for chunk in keys.chunks(4096) {
            let msg = pp_down::Msg::Revoked(v1::RuleRevoke {
                keys: chunk
                    .iter()
                    .map(|k| v1::FlowKey {
                        raw: proto::owned(*k),
                    })
                    .collect(),
            });
            let mut sessions: Vec<u64> = self.pp.keys().copied().collect();
            // The order the map gave before, but stable, so tests can compare outboxes.
            sessions.sort_unstable();
            for s in sessions {
                self.send_pp(s, msg.clone());
            }
        }
    }

    fn teardown_chain(&mut self, tenant: u32, chain: u32) {
        self.drop_scales_of(tenant, chain);
        let gids: Vec<u64> = self
            .map
            .groups()
            .filter(|g| g.partition.tenant == tenant && g.partition.chain == chain)
            .map(|g| g.group.id)
            .collect();
        for gid in gids {
            info!(tenant, chain, group = gid, "chain torn down");
            // Marked dissolved as a scale's retired group is: group ids are never handed
            // out again (see `PartitionMap::reserve_id`), and whatever the group still
            // sends is about a chain configuration that no longer exists — replies to
            // requests answered below with "chain-reconfigured", keys of rules revoked
            // below, steps of scales `drop_scales_of` ended. Taking them would only
            // count them as duplicates and leave `group_progress` entries behind.
            self.dissolve(gid);
        }
        let (_, keys) = self.cache.remove_chain_keys(tenant, chain);
        self.revoke_at_pp(keys);
        let gone: Vec<CacheKey> = self
            .inflight
            .keys()
            .filter(|k| k.0 == tenant && k.1 == chain)
            .copied()
            .collect();
        for ck in gone {
            if let Some(f) = self.inflight.remove(&ck) {
                self.by_id.remove(&f.id);
                for w in &f.waiters {
                    let mut r = proto::error_reply(&f.request, "chain-reconfigured");
                    r.id = w.id;
                    r.worker = w.worker;
                    self.answer_pp(w.session, r, w.arrived_us);
                }
            }
        }
    }

    fn on_requests(&mut self, session: u64, requests: Vec<v1::RuleRequest>, now: u64) {
        let arrived = self.now_us();
        for mut req in requests {
            self.stats.pp_requests += 1;
            // The first packet is FM's to hand on, never SC's to see.
            let frame = self.take_frame(&mut req);
            *self.tenant_requests.entry(req.tenant).or_insert(0) += 1;
            let key = match req.key.as_ref().map(FlowKey::try_from) {
                Some(Ok(k)) => k,
                _ => {
                    self.stats.bad_requests += 1;
                    let reply = proto::error_reply(&req, "bad request: flow key");
                    self.answer_pp(session, reply, arrived);
                    continue;
                }
            };
            if req.tenant == proto::UNBOUND_TENANT {
                // A PP node that cannot tell the flow's tenant (a reply on a gateway VNI
                // of a flow it never saw start): only a rule FM already has will do.
                let reply = match self.cache.get_by_flow(key.as_bytes(), now) {
                    Some((ck, mut r)) => {
                        r.id = req.id;
                        r.worker = req.worker;
                        r.decided_by = CACHE_DECIDER.into();
                        r.decided_by_group = 0;
                        self.fabric_route(session, ck.0, ck.1, r, frame)
                    }
                    None => {
                        self.stats.unknown_flows += 1;
                        proto::error_reply(&req, proto::ERR_UNKNOWN_FLOW)
                    }
                };
                self.answer_pp(session, reply, arrived);
                continue;
            }
            let ck: CacheKey = (req.tenant, req.chain, *key.as_bytes());
            if let Some(mut r) = self
                .cache
                .get(&ck, now)
                .or_else(|| self.pins.get(&ck).cloned())
            {
                r.id = req.id;
                r.worker = req.worker;
                r.decided_by = CACHE_DECIDER.into();
                r.decided_by_group = 0;
                let r = self.fabric_route(session, req.tenant, req.chain, r, frame);
                self.answer_pp(session, r, arrived);
                continue;
            }
            let waiter = Waiter {
                session,
                id: req.id,
                worker: req.worker,
                arrived_us: arrived,
                frame,
            };
            if let Some(f) = self.inflight.get_mut(&ck) {
                self.stats.coalesced += 1;
                f.waiters.push(waiter);
                continue;
            }
            if self.inflight.len() >= self.cfg.max_inflight {
                // SC is this far behind: shed the new flow, counted, rather than queue
                // it past any useful latency (its next packet asks again).
                self.stats.setup_overload += 1;
                let reply = proto::error_reply(&req, proto::ERR_SETUP_OVERLOAD);
                self.answer_pp(session, reply, arrived);
                continue;
            }
            // Partition by the key's own hash, not the one PP sent: PP is not trusted
            // with where state lives.
            let Some(group) = self.map.lookup_key(req.tenant, req.chain, &key) else {
                if self.recovery != Recovery::Done && self.held.len() < MAX_HELD {
                    // The group may be on its way (an SC node that has not reported
                    // yet): answered when it comes or the recovery window ends.
                    req.frame = waiter.frame.unwrap_or_default();
                    self.held.push((session, req));
                    continue;
                }
                self.stats.no_group += 1;
                let msg = format!("no SC group for tenant {} chain {}", req.tenant, req.chain);
                self.answer_pp(session, proto::error_reply(&req, msg), arrived);
                continue;
            };
            let id = self.next_id;
            self.next_id += 1;
            let mut request = req;
            request.id = id;
            self.to_submit
                .entry(group)
                .or_default()
                .push(request.clone());
            self.by_id.insert(id, ck);
            self.inflight.insert(
                ck,
                Inflight {
                    id,
                    group,
                    request,
                    sent_ms: now,
                    attempts: 1,
                    waiters: smallvec![waiter],
                },
            );
        }
    }

    /// Queue `reply` for PP session `session`; `arrived_us` is when its request reached
    /// this task, for the request latency observed when the reply leaves in `flush`.
    /// A reply no one else claimed is FM's own (a refusal): `decided_by` says so.
    fn answer_pp(&mut self, session: u64, mut reply: v1::RuleReply, arrived_us: u64) {
        if reply.decided_by.is_empty() && reply.decided_by_group == 0 {
            reply.decided_by = "FM".into();
        }
        if let Some(s) = self.pp.get_mut(&session) {
            s.out.push(reply);
            s.out_arrived.push(arrived_us);
        }
    }

    /// [`Master::answer_pp`] for a reply FM already holds encoded, naming its group.
    fn answer_pp_encoded(&mut self, session: u64, reply: v1::EncodedReply, arrived_us: u64) {
        if let Some(s) = self.pp.get_mut(&session) {
            s.out_encoded.push(reply);
            s.out_arrived.push(arrived_us);
        }
    }

    /// Route a rule answer over the fabric (paper 000 §5.2). For a chain split over PP
    /// nodes, a node that does not serve the flow's stage gets a forwarding entry
    /// instead of the rule: decap, then [`pipeline::Action::Fabric`] to the stage's node,
    /// in both directions, so the flow's frames go on to that node, which gets the
    /// whole rule when it asks. A drop stays a drop where the flow entered: a flow the
    /// chain refuses never crosses the fabric.
    ///
    /// `frame` is the flow's first packet if it came with the request: when the answer
    /// is a forwarding entry, FM hands it to the next-hop node with that node's rule
    /// (paper 000 §5.2: "the packet is sent to one of FM nodes to be forwarded to the
    /// next hop PP") and marks the reply `frame_forwarded`.
    fn fabric_route(
        &mut self,
        session: u64,
        tenant: u32,
        chain: u32,
        mut reply: v1::RuleReply,
        frame: Option<proto::Bytes>,
    ) -> v1::RuleReply {
        if self.fabric.is_empty() {
            return reply;
        }
        let Some(v1::rule_reply::Result::Rule(rule)) = &reply.result else {
            return reply;
        };
        // A drop (the firewall's, say) is applied where the flow entered: no route.
        if !forwards_vxlan(rule) {
            return reply;
        }
        let keys: Vec<[u8; 40]> = std::iter::once(rule)
            .chain(reply.also.iter())
            .filter_map(|r| r.key.as_ref())
            .filter_map(|k| <[u8; 40]>::try_from(&k.raw[..]).ok())
            .collect();
        let asker = self
            .pp
            .get(&session)
            .map(|s| s.node.clone())
            .unwrap_or_default();
        match self.fabric.hop(tenant, chain, &keys, &asker) {
            crate::fabric::Hop::Unsplit | crate::fabric::Hop::Local => {}
            crate::fabric::Hop::NoNode => {
                reply.result = Some(v1::rule_reply::Result::Error(format!(
                    "no PP node serves the fabric stage of tenant {tenant} chain {chain}"
                )));
                reply.also.clear();
                reply.decided_by = "FM fabric".into();
                reply.decided_by_group = 0;
            }
            crate::fabric::Hop::Peer { mac, node } => {
                if let Some(frame) = frame {
                    reply.frame_forwarded =
                        self.forward_first(&node, tenant, chain, &keys, &reply, frame);
                }
                if let Some(v1::rule_reply::Result::Rule(r)) = reply.result.as_mut() {
                    to_fabric(r, mac);
                }
                for r in &mut reply.also {
                    to_fabric(r, mac);
                }
            }
        }
        reply
    }

    /// Take a request's first packet off it, if it has one FM can carry: one larger
    /// than [`proto::MAX_FABRIC_FRAME`] is dropped here, counted, and its ingress node
    /// releases the packet itself.
    fn take_frame(&mut self, req: &mut v1::RuleRequest) -> Option<proto::Bytes> {
        let frame = std::mem::take(&mut req.frame);
        if frame.is_empty() {
            return None;
        }
        if frame.len() > proto::MAX_FABRIC_FRAME {
            self.fabric.stats.first_dropped.oversized += 1;
            return None;
        }
        Some(frame)
    }

    /// Hand a flow's first packet to `node`, the next hop FM just routed the flow to,
    /// on its session: the flow's rule for that node (what it would get asking, `reply`
    /// before it became a forwarding entry), then the packet, in one message, so the
    /// node installs the rule before it runs the packet. Sent ahead of the ingress
    /// node's answer, so the packets the ingress node releases after it find the rule
    /// there too. Whether it went; a frame that cannot go is dropped, counted, and the
    /// ingress node releases the packet itself.
    fn forward_first(
        &mut self,
        node: &str,
        tenant: u32,
        chain: u32,
        keys: &[[u8; 40]],
        reply: &v1::RuleReply,
        frame: proto::Bytes,
    ) -> bool {
        let drops = &mut self.fabric.stats.first_dropped;
        let Some(entry) = self.members.get(node) else {
            drops.unknown_peer += 1;
            return false;
        };
        let session = entry.session;
        if !entry.alive || !self.pp.contains_key(&session) {
            drops.no_session += 1;
            return false;
        }
        if !entry.info.fabric_frames {
            drops.peer_cannot_take += 1;
            return false;
        }
        if self
            .pp
            .get(&session)
            .is_some_and(|s| s.frames >= MAX_FABRIC_FRAMES)
        {
            drops.queue_full += 1;
            return false;
        }
        // The route is `node`'s, so this is the whole rule (and counted `fabric_local`,
        // as the answer to the node's own request would be).
        if self.fabric.hop(tenant, chain, keys, node) != crate::fabric::Hop::Local {
            self.fabric.stats.first_dropped.unknown_peer += 1;
            return false;
        }
        let install = v1::RuleReply {
            id: 0,
            worker: 0,
            frame_forwarded: false,
            ..reply.clone()
        };
        if let Some(s) = self.pp.get_mut(&session) {
            s.frames += 1;
        }
        self.fabric.stats.first_forwarded += 1;
        self.send_pp(
            session,
            pp_down::Msg::Fabric(v1::FabricFrame {
                install: Some(install),
                frame,
            }),
        );
        true
    }

    fn on_results(&mut self, _session: u64, results: v1::GroupResults, now: u64) {
        if self.scale_ignores(results.group) {
            debug!(
                group = results.group,
                "results of a group a scale dropped; ignored"
            );
            return;
        }
        self.group_progress.insert(results.group, now);
        let part = self.map.group(results.group).map(|g| g.partition);
        let mut withdraw: Vec<[u8; 40]> = Vec::new();
        for mut r in results.results {
            if let Some(p) = r.part.take() {
                self.on_scale_part(results.group, p);
            }
            if let Some(f) = r.fin {
                self.on_scale_fin(results.group, f);
            }
            if let (Some(p), false) = (part, r.mirror.is_empty()) {
                self.relay_mirror(results.group, &p, std::mem::take(&mut r.mirror));
            }
            if let Some(p) = part {
                for k in &r.expired {
                    if let Ok(k) = FlowKey::try_from(k) {
                        let ck = (p.tenant, p.chain, *k.as_bytes());
                        self.fabric.forget(p.tenant, p.chain, k.as_bytes());
                        withdraw.extend(self.cache.invalidate(&ck));
                        withdraw.push(*k.as_bytes());
                        self.pins.remove(&ck);
                    }
                }
            }
            for reply in r.replies {
                self.on_sc_reply(results.group, reply, now);
            }
            for reply in r.encoded_replies {
                self.on_sc_encoded(results.group, reply, now);
            }
        }
        // The NF's timer forgot these flows. PP's rules may be set to outlive the NF's
        // deadline (a TCP flow's rule gets the established timeout from its SYN on, see
        // docs/nf-api.md "Timeouts"), so withdraw them: PP must not keep translating
        // with state — a port, a backend — the NF has given back. A flow still busy had
        // been refreshed by PP's `Active` reports and is not among them.
        self.revoke_at_pp(withdraw);
    }

    /// A decoded reply from group `group`'s tail: an error (which FM may act on: a
    /// moved key, a migrating flow) or a rule from an SC node that sent it decoded.
    fn on_sc_reply(&mut self, group: u64, mut reply: v1::RuleReply, now: u64) {
        self.stats.sc_replies += 1;
        reply.decided_by_group = group;
        if let Some(v1::rule_reply::Result::Error(e)) = &reply.result {
            if e == proto::ERR_MOVED || e == proto::ERR_NOT_READY {
                self.redirect(reply.id, group, now);
                return;
            }
            if e == proto::ERR_MIGRATING {
                self.stats.scale_migrating += 1;
                self.migrating(reply.id, group, now);
                return;
            }
        }
        let Some((ck, f)) = self.take_inflight(reply.id) else {
            return;
        };
        // The asker's fields, which each waiter's answer fills in: the cached body
        // leaves them out.
        reply.id = 0;
        reply.worker = 0;
        let body = self.cache.insert(ck, &reply, now);
        if matches!(reply.result, Some(v1::rule_reply::Result::Rule(_)))
            && self.scale_pinned(group, ck)
        {
            self.pins.insert(ck, proto::detached(&reply));
        }
        self.answer_waiters(group, ck, f, body, reply);
    }

    /// A rule reply the tail encoded (`OpResult.encoded_replies`): cached as its bytes
    /// and, in the common case, sent on to each waiter as they are, never decoded here.
    fn on_sc_encoded(&mut self, group: u64, e: v1::EncodedRuleReply, now: u64) {
        self.stats.sc_replies += 1;
        let Some((ck, f)) = self.take_inflight(e.id) else {
            return;
        };
        let body = self.cache.insert_encoded(ck, &e.body, now);
        let decoded = match &body {
            // Decoded only where something needs the message: a scale's pin, a fabric
            // route, a reply FM must name itself.
            Some(b) => {
                let pinned = self.scale_pinned(group, ck);
                if !pinned && self.fabric.is_empty() && group != 0 {
                    self.answer_waiters(group, ck, f, body, v1::RuleReply::default());
                    return;
                }
                let r = v1::RuleReply::decode(&b[..]);
                if let (true, Ok(r)) = (pinned, &r) {
                    self.pins.insert(ck, r.clone());
                }
                r
            }
            // Not a rule after all, or bytes that do not read as one.
            None => v1::RuleReply::decode(&e.body[..]),
        };
        match decoded {
            Ok(reply) => self.answer_waiters(group, ck, f, body, reply),
            Err(err) => {
                // Scanned as a rule but not a whole reply: nothing of it is kept.
                self.stats.bad_sc_replies += 1;
                warn!(group, error = %err, "an SC reply that does not decode; its flow is refused");
                let _ = self.cache.invalidate(&ck);
                self.pins.remove(&ck);
                let refusal = v1::RuleReply {
                    result: Some(v1::rule_reply::Result::Error(
                        proto::ERR_BAD_SC_REPLY.into(),
                    )),
                    ..Default::default()
                };
                self.answer_waiters(group, ck, f, None, refusal);
            }
        }
    }

    /// The request FM numbered `id` and what waits for it, taken out of flight; a
    /// reply to no request in flight (a repeat after a repair) is counted.
    fn take_inflight(&mut self, id: u64) -> Option<(CacheKey, Inflight)> {
        let Some(ck) = self.by_id.remove(&id) else {
            self.stats.duplicate_replies += 1;
            return None;
        };
        let Some(f) = self.inflight.remove(&ck) else {
            self.stats.duplicate_replies += 1;
            return None;
        };
        Some((ck, f))
    }

    /// Answer every waiter of flow `ck` with `reply` (id and worker cleared), or with
    /// `body`, the cache's bytes of it, when nothing changes the reply on the way: no
    /// fabric route to make, and a group to name (the decoded path's `answer_pp` would
    /// name FM for group 0). proto's `reply_batch` says what sending the bytes saves.
    fn answer_waiters(
        &mut self,
        group: u64,
        ck: CacheKey,
        f: Inflight,
        body: Option<Arc<[u8]>>,
        reply: v1::RuleReply,
    ) {
        if let Some(body) = body.filter(|_| self.fabric.is_empty() && group != 0) {
            for w in &f.waiters {
                self.answer_pp_encoded(
                    w.session,
                    v1::EncodedReply {
                        id: w.id,
                        worker: w.worker,
                        body: body.clone(),
                    },
                    w.arrived_us,
                );
            }
            return;
        }
        let mut reply = Some(reply);
        for (i, w) in f.waiters.iter().enumerate() {
            let mut r = if i + 1 == f.waiters.len() {
                reply.take().unwrap_or_default()
            } else {
                reply.clone().unwrap_or_default()
            };
            r.id = w.id;
            r.worker = w.worker;
            let frame = w.frame.clone();
            let r = self.fabric_route(w.session, ck.0, ck.1, r, frame);
            self.answer_pp(w.session, r, w.arrived_us);
        }
    }

    /// A group's writes to mirrored NF tables, queued for every other group of its
    /// chain (in the same order, so each receiver applies one group's writes in the
    /// order they were made). Groups that come later (a scale-out's new one) start from
    /// their parent's copy instead.
    fn relay_mirror(&mut self, from: u64, p: &v1::Partition, writes: Vec<v1::MirrorWrite>) {
        let to: Vec<u64> = (self.map.groups())
            .filter(|g| g.partition.tenant == p.tenant && g.partition.chain == p.chain)
            .map(|g| g.group.id)
            .filter(|&g| g != from)
            .collect();
        let n = writes.len();
        let batch = v1::MirrorBatch {
            writes,
            from_group: from,
        };
        for g in to {
            if self.queued_mirror + n > MAX_QUEUED_EVENTS {
                self.stats.mirror_dropped += n as u64;
                continue;
            }
            self.queued_mirror += n;
            self.stats.mirror_relayed += n as u64;
            self.mirror_to_submit
                .entry(g)
                .or_default()
                .push(batch.clone());
        }
    }

    /// Periodic work: failure detection, retries, cache sweep, group creation.
    #[cfg(test)]
    pub(crate) fn tick(&mut self, now_us: u64) {
        self.tick_late(now_us, 0)
    }

    /// [`Master::tick`] run `lag_ms` after it was due (this task was busy, or not
    /// scheduled): a node's silence is judged against its limit plus that lag, since
    /// what FM could not hear meanwhile is FM's own doing.
    pub(crate) fn tick_late(&mut self, now_us: u64, lag_ms: u64) {
        let now = self.at(now_us);
        let period = self.cfg.heartbeat.as_millis() as u64;
        let pp_period = self.cfg.pp_heartbeat.as_millis().max(1) as u64;
        let limit = pp_period * u64::from(self.cfg.miss_limit);
        let sc_limit = period * u64::from(self.cfg.sc_miss_limit.max(1));
        // If this task itself ran late, the silence it sees may be its own: judge no
        // node on this tick. (Ticks come every `tick_period`, the shorter period.)
        let late =
            now.saturating_sub(self.last_tick) > 2 * self.cfg.tick_period().as_millis() as u64;
        self.last_tick = now;
        let silent = if late {
            Vec::new()
        } else {
            self.members.silent(now, |role| {
                lag_ms
                    + if role == v1::Role::Sc as i32 {
                        sc_limit
                    } else {
                        limit
                    }
            })
        };
        for (node, session) in silent {
            warn!(%node, pp_limit_ms = limit, sc_limit_ms = sc_limit, "node missed its heartbeats");
            if self.members.mark_dead(&node, session) {
                self.node_dead(&node, session);
            }
        }
        // A request is submitted again when its group has said nothing since it was sent
        // (lost with a replica, or the group is stuck), and in any case once it is four
        // times overdue. Re-submitting everything slow would multiply the load exactly
        // when the group is busiest.
        let retry = self.cfg.retry_after.as_millis() as u64;
        let progress = &self.group_progress;
        let stale: Vec<CacheKey> = self
            .inflight
            .iter()
            .filter(|(_, f)| {
                let age = now.saturating_sub(f.sent_ms);
                let silent = progress.get(&f.group).is_none_or(|t| *t <= f.sent_ms);
                age >= retry && (silent || age >= 4 * retry)
            })
            .map(|(k, _)| *k)
            .collect();
        for ck in stale {
            self.retry(&ck, now);
        }
        if self.vip_settle_until.is_some_and(|t| now >= t) {
            self.vip_settle_until = None;
            let change = self.vips.rebalance();
            self.push_vips(&change, "settled after a takeover");
        }
        self.cache.sweep(now, 1024);
        self.scale_tick(now);
        if let Recovery::Until(t) = self.recovery {
            if now >= t {
                self.finish_recovery();
            }
        }
        self.ensure_groups();
    }

    fn retry(&mut self, ck: &CacheKey, now: u64) {
        let Some(f) = self.inflight.get(ck) else {
            return;
        };
        if f.attempts >= self.cfg.max_attempts {
            let f = match self.inflight.remove(ck) {
                Some(f) => f,
                None => return,
            };
            self.by_id.remove(&f.id);
            self.stats.timeouts += 1;
            for w in &f.waiters {
                let mut r = proto::error_reply(&f.request, "sc-timeout");
                r.id = w.id;
                r.worker = w.worker;
                self.answer_pp(w.session, r, w.arrived_us);
            }
            return;
        }
        let Some(f) = self.inflight.get_mut(ck) else {
            return;
        };
        f.attempts += 1;
        f.sent_ms = now;
        // The partition may have moved to another group since. Not away from the old
        // owner of a scale under way, though: it may have decided the flow already (its
        // answer then comes), and otherwise it refuses and FM redirects.
        let key = FlowKey::from_bytes(ck.2);
        let group = f.group;
        if !self.scale_source(group) {
            if let Some(g) = self.map.lookup_key(ck.0, ck.1, &key) {
                if let Some(f) = self.inflight.get_mut(ck) {
                    f.group = g;
                }
            }
        }
        let Some(f) = self.inflight.get_mut(ck) else {
            return;
        };
        self.stats.resubmitted += 1;
        self.to_submit
            .entry(f.group)
            .or_default()
            .push(f.request.clone());
    }

    fn node_dead(&mut self, node: &str, session: u64) {
        self.stats.nodes_dead += 1;
        if self.pp.remove(&session).is_some() {
            self.close(session);
            info!(%node, "PP node gone");
            self.event(
                EventKind::PpNodeDead,
                format!("PP node {node} dead"),
                json!({"node": node}),
            );
            let change = self.vips.leave(node);
            if !change.is_empty() {
                warn!(%node, moved = change.moved, "dead PP node's vIPs moved to live nodes");
                self.push_vips(&change, &format!("{node} dead"));
            }
            self.fabric_leave(node, "dead");
            return;
        }
        if self.sc.remove(&session) {
            self.close(session);
            if self.sc_by_node.get(node) == Some(&session) {
                self.sc_by_node.remove(node);
            }
            warn!(%node, "SC node dead; repairing its groups");
            self.event(
                EventKind::ScNodeDead,
                format!("SC node {node} dead"),
                json!({"node": node, "groups": self.map.groups_of(node)}),
            );
            self.sc_died(node);
        }
    }

    /// Remove a dead SC node from its groups and push the repaired orders.
    fn sc_died(&mut self, node: &str) {
        for gid in self.map.groups_of(node) {
            if self.scale_group_lost(gid) {
                continue;
            }
            let Some(g) = self.map.group(gid) else {
                continue;
            };
            let old_head = g.head().map(|r| r.node_id.clone());
            let mut replicas: Vec<v1::Replica> = g
                .group
                .replicas
                .iter()
                .filter(|r| r.node_id != node)
                .cloned()
                .collect();
            if replicas.is_empty() {
                // The dead node holds the partition's only copy of its state. Starting
                // the group over empty would hand out NAT ports and LB choices that
                // live flows still use, so keep it listed and wait: a node that was
                // only slow or cut off comes back with its state (see `sc_returned`).
                warn!(
                    group = gid,
                    %node,
                    "SC group lost its last live replica; stalled until it returns"
                );
                self.stats.groups_stalled += 1;
                self.group_event(
                    EventKind::ScGroupStalled,
                    gid,
                    format!(
                        "group {gid} lost its last live replica ({node}); stalled until it returns"
                    ),
                    json!({"dead": node}),
                );
                continue;
            }
            let spare = self.spare_for(g.partition.tenant, &replicas);
            if let Some(spare) = spare.clone() {
                info!(group = gid, node = %spare.node_id, "adding a spare replica at the tail");
                replicas.push(spare);
            }
            self.map.set_replicas(gid, replicas);
            self.stats.reconfigurations += 1;
            self.push_config(gid);
            let added = spare.map(|r| r.node_id);
            self.group_event(
                EventKind::ScGroupRepaired,
                gid,
                match &added {
                    Some(a) => format!("group {gid} repaired: {node} dead, {a} added at the tail"),
                    None => format!("group {gid} re-linked without {node}; no spare SC node"),
                },
                json!({"dead": node, "added": added}),
            );
            // Repeat any scaling step the group owes, ahead of the re-submits below.
            self.scale_head_changed(gid);
            let new_head = self
                .map
                .group(gid)
                .and_then(|g| g.head())
                .map(|r| r.node_id.clone());
            if new_head != old_head {
                // Requests the old head held may be lost with it: submit them again.
                let now = self.now_ms();
                let keys: Vec<CacheKey> = self
                    .inflight
                    .iter()
                    .filter(|(_, f)| f.group == gid)
                    .map(|(k, _)| *k)
                    .collect();
                for k in keys {
                    if let Some(f) = self.inflight.get_mut(&k) {
                        f.sent_ms = now;
                        self.stats.resubmitted += 1;
                        self.to_submit
                            .entry(gid)
                            .or_default()
                            .push(f.request.clone());
                    }
                }
            }
        }
    }

    /// SC node `node` registered again. After [`Master::sc_died`] it is listed only in
    /// groups it was the last replica of. If it is the same process it still holds
    /// their state: push it a new epoch and let `ensure_groups` refill the group. If it
    /// restarted, that state is gone and the group starts over empty.
    fn sc_returned(&mut self, node: &str, restarted: bool) {
        for gid in self.map.groups_of(node) {
            let Some(g) = self.map.group(gid) else {
                continue;
            };
            let others_live = g
                .group
                .replicas
                .iter()
                .any(|r| r.node_id != node && self.sc_by_node.contains_key(&r.node_id));
            if others_live {
                continue;
            }
            if restarted {
                warn!(group = gid, %node, "last replica restarted: partition state lost, starting over");
                self.stats.groups_reset += 1;
                self.scale_group_reset(gid);
                self.map.remove(gid);
                continue;
            }
            info!(group = gid, %node, "last replica is back; group resumes");
            let replicas = g.group.replicas.clone();
            self.map.set_replicas(gid, replicas);
            self.stats.reconfigurations += 1;
            self.push_config(gid);
        }
    }

    /// A live SC node not in `current`, hosting the fewest groups.
    fn spare_for(&self, tenant: u32, current: &[v1::Replica]) -> Option<v1::Replica> {
        self.members
            .live(v1::Role::Sc)
            .filter(|m| self.sc_by_node.contains_key(&m.info.id))
            .filter(|m| self.in_shard_set(tenant, &m.info.id))
            .filter(|m| !current.iter().any(|r| r.node_id == m.info.id))
            .min_by_key(|m| (self.map.groups_of(&m.info.id).len(), m.info.id.clone()))
            .map(|m| v1::Replica {
                node_id: m.info.id.clone(),
                addr: m.info.addr.clone(),
            })
    }

    /// Whether `tenant`'s groups may use SC node `node` (its shard set, if it has one).
    pub(crate) fn in_shard_set(&self, tenant: u32, node: &str) -> bool {
        self.shards
            .get(&tenant)
            .is_none_or(|set| set.iter().any(|n| n == node))
    }

    /// Take the orchestrator's shard sets. A changed set moves no existing replica: a
    /// set changes when a node failed (and its replacement is added) or a tenant is
    /// new, and `ensure_groups` then forms or refills groups inside the new set.
    fn set_shards(&mut self, shards: Vec<v1::TenantShards>) {
        let new: HashMap<u32, Vec<String>> = shards
            .into_iter()
            .filter(|s| !s.sc_nodes.is_empty())
            .map(|s| (s.tenant, s.sc_nodes))
            .collect();
        if new != self.shards {
            info!(tenants = new.len(), "shard sets applied");
            let old = std::mem::replace(&mut self.shards, new);
            // A node a tenant's set gained has no spare of the tenant's chains yet.
            let mut gained: Vec<(String, v1::ChainConfig)> = Vec::new();
            for n in self.sc_by_node.keys() {
                for c in &self.chains {
                    let had = old.get(&c.tenant).is_none_or(|set| set.contains(n));
                    if !had && self.in_shard_set(c.tenant, n) {
                        gained.push((n.clone(), c.clone()));
                    }
                }
            }
            for (n, c) in gained {
                self.send_sc(&n, sc_down::Msg::Deploy(c));
            }
        }
    }

    /// Create groups for chains that have none, form groups over ranges a reset left
    /// with no owner, and refill degraded groups, when enough SC nodes are live.
    fn ensure_groups(&mut self) {
        if self.recovery != Recovery::Done {
            // Groups may still be reported: a group formed now could be a second owner
            // of a partition whose nodes have not reconnected yet.
            return;
        }
        for i in 0..self.chains.len() {
            let (tenant, chain) = (self.chains[i].tenant, self.chains[i].chain);
            if self.map.has_chain(tenant, chain) {
                self.fill_gaps(tenant, chain);
                continue;
            }
            let mut ranges: Vec<(u64, u64)> = self
                .partitions
                .iter()
                .filter(|p| p.tenant == tenant && p.chain == chain)
                .map(|p| (p.hash_lo, p.hash_hi))
                .collect();
            if ranges.is_empty() {
                ranges.push((0, u64::MAX));
            }
            // All of a chain's partitions come up together, or none: a chain with part
            // of its key space unowned would refuse some flows and not others.
            let mut planned: Vec<Vec<v1::Replica>> = Vec::new();
            for _ in &ranges {
                match self.plan_replicas(tenant) {
                    Some(replicas) => planned.push(replicas),
                    None => break,
                }
            }
            if planned.len() < ranges.len() {
                continue;
            }
            for ((lo, hi), replicas) in ranges.into_iter().zip(planned) {
                self.form_group(tenant, chain, (lo, hi), replicas, "");
            }
        }
        let degraded: Vec<u64> = self
            .map
            .groups()
            .filter(|g| g.group.replicas.len() < self.cfg.replicas)
            .map(|g| g.group.id)
            .collect();
        for gid in degraded {
            let Some(g) = self.map.group(gid) else {
                continue;
            };
            let mut replicas = g.group.replicas.clone();
            if let Some(spare) = self.spare_for(g.partition.tenant, &replicas) {
                info!(group = gid, node = %spare.node_id, "refilling a degraded group");
                let added = spare.node_id.clone();
                replicas.push(spare);
                self.map.set_replicas(gid, replicas);
                self.stats.reconfigurations += 1;
                self.push_config(gid);
                self.group_event(
                    EventKind::ScGroupRepaired,
                    gid,
                    format!("group {gid} refilled: {added} added at the tail"),
                    json!({"added": added}),
                );
            }
        }
    }

    /// A group reset by its restarted last replica left its range with no owner while
    /// the chain's other groups serve on: form a fresh (empty) group over each such gap,
    /// as the chain's first groups are formed. Not while one of the chain's scales is
    /// under way: its switch moves ranges, and a group formed in between could be a
    /// second owner of a key hash the switch hands out.
    fn fill_gaps(&mut self, tenant: u32, chain: u32) {
        if self
            .scales
            .values()
            .any(|j| (j.tenant, j.chain) == (tenant, chain))
        {
            return;
        }
        for range in self.map.chain_gaps(tenant, chain) {
            let Some(replicas) = self.plan_replicas(tenant) else {
                return;
            };
            warn!(
                tenant,
                chain,
                hash_lo = range.0,
                hash_hi = range.1,
                "a range has no owner; forming a group over it"
            );
            self.form_group(
                tenant,
                chain,
                range,
                replicas,
                " over a range with no owner",
            );
        }
    }

    /// `cfg.replicas` live SC nodes for a new group of `tenant`, or `None` if there are
    /// not that many.
    fn plan_replicas(&self, tenant: u32) -> Option<Vec<v1::Replica>> {
        let mut replicas = Vec::new();
        while replicas.len() < self.cfg.replicas {
            replicas.push(self.spare_for(tenant, &replicas)?);
        }
        Some(replicas)
    }

    /// Create a group owning `range` of (tenant, chain) on `replicas`, configure its
    /// nodes and record the event (`why` is appended to its message).
    fn form_group(
        &mut self,
        tenant: u32,
        chain: u32,
        (lo, hi): (u64, u64),
        replicas: Vec<v1::Replica>,
        why: &str,
    ) {
        let gid = self.map.create(tenant, chain, lo, hi, replicas);
        info!(
            tenant,
            chain,
            group = gid,
            hash_lo = lo,
            hash_hi = hi,
            "SC group created"
        );
        self.push_config(gid);
        self.group_event(
            EventKind::ScGroupCreated,
            gid,
            format!("group {gid} formed for tenant {tenant} chain {chain}{why}"),
            json!({"hash_lo": lo, "hash_hi": hi}),
        );
    }

    fn push_config(&mut self, gid: u64) {
        let Some(g) = self.map.group(gid) else {
            return;
        };
        let chain = self
            .chains
            .iter()
            .find(|c| c.tenant == g.partition.tenant && c.chain == g.partition.chain)
            .cloned();
        let cfg = v1::GroupConfig {
            group: Some(g.group.clone()),
            partition: Some(g.partition),
            chain,
            joining: g.joining.clone(),
            awaiting_scale: g.awaiting_scale,
        };
        debug!(group = gid, epoch = g.group.epoch, "pushing group config");
        let nodes: Vec<String> = g.group.replicas.iter().map(|r| r.node_id.clone()).collect();
        for node in nodes {
            self.send_sc(&node, sc_down::Msg::Configure(cfg.clone()));
        }
    }

    /// Send everything queued: one submit per group, one reply batch per PP session.
    pub(crate) fn flush(&mut self, now_us: u64) {
        self.at(now_us);
        let max = self.cfg.max_batch.max(1);
        let groups: Vec<u64> = self
            .to_submit
            .keys()
            .chain(self.events_to_submit.keys())
            .chain(self.mirror_to_submit.keys())
            .copied()
            .collect::<BTreeSet<u64>>()
            .into_iter()
            .collect();
        for gid in groups {
            let mut reqs = self.to_submit.remove(&gid).unwrap_or_default();
            let events = self.events_to_submit.remove(&gid).unwrap_or_default();
            self.queued_events = self.queued_events.saturating_sub(events.len());
            let mut mirror = self.mirror_to_submit.remove(&gid).unwrap_or_default();
            let queued: usize = mirror.iter().map(|b| b.writes.len()).sum();
            self.queued_mirror = self.queued_mirror.saturating_sub(queued);
            let head = self.map.group(gid).and_then(|g| {
                let session = g
                    .head()
                    .and_then(|h| self.sc_by_node.get(&h.node_id))
                    .filter(|s| self.sc.contains(*s))
                    .copied()?;
                Some((session, g.group.epoch))
            });
            let Some((session, epoch)) = head else {
                // Requests are retried against the current map later; mirrored writes
                // are not (the group starts from its parent's or a replica's copy).
                self.stats.mirror_dropped += queued as u64;
                continue;
            };
            *self.group_load.entry(gid).or_insert(0) += reqs.len() as u64;
            let mut events = Some(events).filter(|e| !e.is_empty());
            while !reqs.is_empty() || events.is_some() || !mirror.is_empty() {
                let rest = if reqs.len() > max {
                    reqs.split_off(max)
                } else {
                    Vec::new()
                };
                self.stats.submitted += reqs.len() as u64;
                self.stats.submits += 1;
                self.out.push(Out::Sc {
                    session,
                    msg: Box::new(v1::ScDown {
                        msg: Some(sc_down::Msg::Submit(v1::GroupSubmit {
                            group: gid,
                            epoch,
                            requests: Some(v1::RuleRequestBatch { requests: reqs }),
                            events: events.take().map(|events| v1::FlowEventBatch { events }),
                            mirror: std::mem::take(&mut mirror),
                        })),
                    }),
                });
                reqs = rest;
            }
        }
        for (&session, s) in self.pp.iter_mut() {
            s.frames = 0;
            if s.out.is_empty() && s.out_encoded.is_empty() {
                continue;
            }
            for t in s.out_arrived.drain(..) {
                self.request_latency.observe_us(now_us.saturating_sub(t));
            }
            let batch = v1::RuleReplyBatch {
                replies: std::mem::take(&mut s.out),
                encoded: std::mem::take(&mut s.out_encoded),
                wire: Vec::new(),
            };
            self.stats.replies_to_pp += batch.len() as u64;
            self.out.push(Out::Pp {
                session,
                msg: v1::PpDown {
                    msg: Some(pp_down::Msg::Replies(batch)),
                },
            });
        }
    }
}

/// A rule turned into the fabric's forwarding entry toward `peer`: the flow's frames are
/// decapsulated and sent on as they came. The idle timeout stays the rule's.
fn to_fabric(r: &mut v1::Rule, peer: [u8; 6]) {
    // Only a rule that forwards a VXLAN flow is routed; a drop is decided here.
    if !forwards_vxlan(r) {
        return;
    }
    r.actions = vec![
        v1::Action {
            kind: Some(v1::action::Kind::Decap(v1::Empty {})),
        },
        v1::Action {
            kind: Some(v1::action::Kind::Fabric(proto::owned(peer))),
        },
    ];
}

/// Whether `r` decapsulates a VXLAN flow and sends it on (rather than dropping it).
fn forwards_vxlan(r: &v1::Rule) -> bool {
    let decap = r
        .actions
        .first()
        .is_some_and(|a| matches!(a.kind, Some(v1::action::Kind::Decap(_))));
    let output = r
        .actions
        .last()
        .is_some_and(|a| matches!(a.kind, Some(v1::action::Kind::Output(_))));
    decap && output
}
