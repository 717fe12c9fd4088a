//! The starfabric wire protocol: protobuf package `starfabric.v1` (tonic + prost), and
//! validated conversions between its messages and the pipeline / NF types.
//!
//! - [`v1`] is the generated code: messages, the `FabricMaster` and
//!   `ServiceComputation` services (client and server).
//! - `From` builds a message from a pipeline type and cannot fail; `TryFrom` reads one
//!   back and checks everything a peer could get wrong (key length, VNI width, address
//!   and MAC lengths, port ranges, unknown actions), returning a [`ConvertError`] and
//!   never panicking. Receivers count these errors; they do not trust peers.
//! - [`ChainDef`] is the JSON form of a tenant chain (NF configurations, shape, egress)
//!   that configuration files use, and [`ChainParts`] what an SC node builds a chain from.
//! - [`tls`] is plane security: the orchestrator's CA, node certificates naming role and
//!   id, mTLS servers and clients with rotation and revocation (docs/security.md).

pub use bytes::Bytes;

use bytes::BytesMut;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use nf::{ChainSpec, Egress, PartitionBy};
use pipeline::{Action, DecidedBy, FlowKey, PacketMeta, Rule, RuleReply, RuleRequest};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Generated messages and services of `starfabric.v1`.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    pub use crate::reply_batch::{EncodedReply, RuleReplyBatch};
    pub use crate::rule_msg::Rule;
    tonic::include_proto!("starfabric.v1");
}

pub mod agent;
mod encoded_rules;
mod fm_addrs;
pub mod json;
pub mod lanes;
pub mod liveness;
mod read_reply;
mod reply_batch;
mod rule_msg;
pub mod tls;
pub use encoded_rules::{
    decode_rule_replies, encode_rule_replies, op_replies, scan_rule_reply, DecidedReply,
    ScannedReply,
};
pub use fm_addrs::{FmAddrs, FmAddrsError, Next};
pub use read_reply::{read_rule_reply, ReadError, ReadReply};
pub use reply_batch::refusal_of;

/// Major version of the protocol this build speaks (`NodeInfo.proto_version`).
pub const PROTO_VERSION: u32 = 1;

/// Largest gRPC message any starfabric endpoint accepts. State snapshots of a large
/// partition travel in one message, far past tonic's 4 MiB default.
pub const MAX_MESSAGE: usize = 512 << 20;

/// Error an SC group answers for a request whose key hash it no longer (or not yet)
/// serves: a scale moved it. Not an answer: FM sends the request to the current owner.
pub const ERR_MOVED: &str = "sc-moved";

/// Tenant of a rule request for a flow whose VNI the PP node has no binding for: a
/// reply arriving on a gateway VNI (the internet's, the services') at a PP node that
/// never saw the flow's first direction, as happens in a PP cluster where the underlay
/// hashes the two directions independently. FM answers such a request from its cache
/// only, by flow key, and never sends it to SC (no NF decided that key).
pub const UNBOUND_TENANT: u32 = 0;

/// Error FM answers for an [`UNBOUND_TENANT`] request whose key it has no rule for.
pub const ERR_UNKNOWN_FLOW: &str = "unknown-flow";

/// Error a scale-out's new group answers before its install op: FM tries again.
pub const ERR_NOT_READY: &str = "sc-not-ready";

/// A new owner's refusal during a gradual scale-out: the flow's state is still at the
/// old owner. FM has it pulled over (ScalePull) and sends the request again after.
pub const ERR_MIGRATING: &str = "sc-migrating";

/// Error FM answers for a flow whose reply from SC did not read as one (an encoded
/// rule reply that does not decode; FM counts it). The PP node asks again.
pub const ERR_BAD_SC_REPLY: &str = "sc-bad-reply";

/// Error FM answers for a rule request it sheds because its setup path (its input
/// queue, or the requests in flight to SC) is over its bound. The flow is refused, not
/// the session: the PP node counts it and the flow's next packet asks again.
pub const ERR_SETUP_OVERLOAD: &str = "setup-overload";

/// Largest first packet a rule request carries to FM, and FM on to the next-hop PP
/// node (`RuleRequest.frame`, `FabricFrame.frame`; docs/fabric.md): what a PP frame
/// slot holds. Larger ones are not sent, and FM and PP drop them, counted.
pub const MAX_FABRIC_FRAME: usize = pipeline::MAX_FRAME;

/// Deepest chain shape accepted from the wire (guards the recursive conversion).
pub const MAX_CHAIN_DEPTH: usize = 32;

/// Why a message could not be turned into a pipeline / NF value.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConvertError {
    #[error("missing field {0}")]
    Missing(&'static str),
    #[error("flow key must be 40 bytes, got {0}")]
    KeyLength(usize),
    #[error("address must be 4 or 16 bytes, got {0}")]
    AddrLength(usize),
    #[error("IPv4 address expected, got {0} bytes")]
    NotIpv4(usize),
    #[error("MAC must be 6 bytes, got {0}")]
    MacLength(usize),
    #[error("VNI {0} does not fit in 24 bits")]
    BadVni(u32),
    #[error("{what} {value} out of range")]
    OutOfRange { what: &'static str, value: u64 },
    #[error("unknown or empty action")]
    UnknownAction,
    #[error("bad chain configuration: {0}")]
    Chain(String),
}

type Result<T, E = ConvertError> = std::result::Result<T, E>;

fn narrow<T: TryFrom<u64>>(what: &'static str, v: impl Into<u64>) -> Result<T> {
    let v = v.into();
    T::try_from(v).map_err(|_| ConvertError::OutOfRange { what, value: v })
}

fn addr_bytes(a: IpAddr) -> Bytes {
    match a {
        IpAddr::V4(a) => interned(&a.octets()),
        IpAddr::V6(a) => interned(&a.octets()),
    }
}

/// Slots of [`interned`]'s cache, per thread.
const INTERNED_SLOTS: usize = 64;

/// One slot: the value's length (`u8::MAX` for an empty slot), its bytes, and the
/// `Bytes` that holds them.
type InternedSlot = (u8, [u8; 16], Bytes);

thread_local! {
    static INTERNED: std::cell::RefCell<Vec<InternedSlot>> =
        std::cell::RefCell::new(vec![(u8::MAX, [0; 16], Bytes::new()); INTERNED_SLOTS]);
}

/// A small byte field (an address, a MAC; at most 16 bytes) as `Bytes`, from a
/// per-thread, direct-mapped cache of the last ones made. A chain's rules repeat a
/// few of them in every reply (the SNAT pool's address, the backends', the egress
/// MACs), and a cached one costs a reference count where a new one is an allocation.
/// A value that misses replaces its slot's; nothing grows.
fn interned(b: &[u8]) -> Bytes {
    if b.is_empty() || b.len() > 16 {
        return Bytes::copy_from_slice(b);
    }
    let mut h = b.len() as u64;
    for &x in b {
        h = (h ^ u64::from(x)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    let slot = (h >> 58) as usize % INTERNED_SLOTS;
    // `try_with`: a conversion run while the thread's locals are being torn down gets
    // a fresh copy instead of a panic.
    let hit = INTERNED.try_with(|c| {
        let mut c = c.borrow_mut();
        let (len, bytes, held) = &mut c[slot];
        if usize::from(*len) == b.len() && bytes[..b.len()] == *b {
            return held.clone();
        }
        let mut a = [0u8; 16];
        a[..b.len()].copy_from_slice(b);
        let v = Bytes::from_owner(a).slice(..b.len());
        *len = b.len() as u8;
        *bytes = a;
        *held = v.clone();
        v
    });
    hit.unwrap_or_else(|_| Bytes::copy_from_slice(b))
}

/// `m` with every byte field in storage of its own. A decoded message's `Bytes` fields
/// are slices of the buffer it arrived in, and each keeps all of that buffer alive. That
/// is free while a message passes through (every hop of the setup path); a message kept
/// for long, such as FM's scale pins, is detached first.
pub fn detached<M: prost::Message + Default>(m: &M) -> M {
    // Decoding from a plain slice copies each field out (`Buf::copy_to_bytes` on
    // `&[u8]`). It cannot fail on bytes just encoded; a default is the safe answer if
    // it ever did.
    M::decode(m.encode_to_vec().as_slice()).unwrap_or_default()
}

/// A byte field made here, for a message about to be sent. prost encodes a `Bytes`
/// field by cloning it, and the clone of a `Bytes` made from a `Vec` allocates its
/// shared header (`Bytes::from(vec)` defers that). One made from an owned array
/// allocates once, here, and every clone after that is a reference count: the same
/// one allocation per field that a `Vec<u8>` field took.
pub fn owned<const N: usize>(b: [u8; N]) -> Bytes {
    Bytes::from_owner(b)
}

fn addr_from(b: &[u8]) -> Result<Option<IpAddr>> {
    match b.len() {
        0 => Ok(None),
        4 => Ok(Some(IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3])))),
        16 => {
            let mut a = [0u8; 16];
            a.copy_from_slice(b);
            Ok(Some(IpAddr::V6(Ipv6Addr::from(a))))
        }
        n => Err(ConvertError::AddrLength(n)),
    }
}

fn ipv4_from(b: &[u8]) -> Result<Ipv4Addr> {
    match b.len() {
        4 => Ok(Ipv4Addr::new(b[0], b[1], b[2], b[3])),
        n => Err(ConvertError::NotIpv4(n)),
    }
}

fn mac_from(b: &[u8]) -> Result<Option<[u8; 6]>> {
    match b.len() {
        0 => Ok(None),
        6 => {
            let mut m = [0u8; 6];
            m.copy_from_slice(b);
            Ok(Some(m))
        }
        n => Err(ConvertError::MacLength(n)),
    }
}

fn check_vni(vni: u32) -> Result<u32> {
    if vni >> 24 != 0 {
        Err(ConvertError::BadVni(vni))
    } else {
        Ok(vni)
    }
}

// ------------------------------------------------------------------ keys

impl From<&FlowKey> for v1::FlowKey {
    fn from(k: &FlowKey) -> Self {
        v1::FlowKey {
            raw: owned(*k.as_bytes()),
        }
    }
}

impl TryFrom<&v1::FlowKey> for FlowKey {
    type Error = ConvertError;
    fn try_from(k: &v1::FlowKey) -> Result<Self> {
        key_from_raw(&k.raw)
    }
}

/// A key from `FlowKey.raw`'s bytes.
fn key_from_raw(raw: &[u8]) -> Result<FlowKey> {
    let b: [u8; 40] = raw
        .try_into()
        .map_err(|_| ConvertError::KeyLength(raw.len()))?;
    Ok(FlowKey::from_bytes(b))
}

/// A required key field.
pub fn key_of(k: Option<&v1::FlowKey>) -> Result<FlowKey> {
    FlowKey::try_from(k.ok_or(ConvertError::Missing("key"))?)
}

// ------------------------------------------------------------------ actions and rules

fn endpoint_msg(addr: Option<IpAddr>, port: Option<u16>) -> v1::Endpoint {
    v1::Endpoint {
        addr: addr.map(addr_bytes).unwrap_or_default(),
        port: port.map(u32::from),
    }
}

impl From<&Action> for v1::Action {
    fn from(a: &Action) -> Self {
        use v1::action::Kind;
        let kind = match a {
            Action::DecapVxlan => Kind::Decap(v1::Empty {}),
            Action::SetSrc { addr, port } => Kind::SetSrc(endpoint_msg(*addr, *port)),
            Action::SetDst { addr, port } => Kind::SetDst(endpoint_msg(*addr, *port)),
            Action::EncapVxlan {
                dst,
                vni,
                inner_dmac,
                inner_smac,
            } => Kind::Encap(v1::Encap {
                dst: interned(&dst.octets()),
                vni: *vni,
                inner_dmac: inner_dmac.map(|m| interned(&m)).unwrap_or_default(),
                inner_smac: inner_smac.map(|m| interned(&m)).unwrap_or_default(),
            }),
            Action::Count => Kind::Count(v1::Empty {}),
            Action::Police { class } => Kind::Police(u32::from(*class)),
            Action::Offload => Kind::Offload(v1::Empty {}),
            Action::Output(p) => Kind::Output(u32::from(*p)),
            Action::Drop { reason } => Kind::Drop(reason.clone()),
            Action::Fabric { peer } => Kind::Fabric(interned(peer)),
        };
        v1::Action { kind: Some(kind) }
    }
}

impl TryFrom<&v1::Action> for Action {
    type Error = ConvertError;
    fn try_from(a: &v1::Action) -> Result<Self> {
        // One set of checks for a message and for bytes read directly (`read_reply`).
        read_reply::Kind::of(a).convert()
    }
}

fn timeout_ms(t: Duration) -> u64 {
    u64::try_from(t.as_millis()).unwrap_or(u64::MAX)
}

fn timeout_from(ms: u64) -> Duration {
    // u64::MAX ms is how "never" (Duration::MAX) travels.
    if ms == u64::MAX {
        Duration::MAX
    } else {
        Duration::from_millis(ms)
    }
}

impl From<&Rule> for v1::Rule {
    fn from(r: &Rule) -> Self {
        rule_keyed(r, None)
    }
}

/// `r` as a message, under `key` when that is already `r`'s key as a message: the
/// rule a flow's request is answered with matches the key the request carried, and a
/// received key costs nothing to send on (a slice of its receive buffer), where a new
/// one is an allocation.
pub fn rule_keyed(r: &Rule, key: Option<&v1::FlowKey>) -> v1::Rule {
    let key = match key {
        Some(k) if k.raw[..] == r.key.as_bytes()[..] => k.clone(),
        _ => (&r.key).into(),
    };
    v1::Rule {
        key: Some(key),
        actions: r.actions.iter().map(v1::Action::from).collect(),
        idle_timeout_ms: r.idle_timeout.map(timeout_ms),
    }
}

impl TryFrom<&v1::Rule> for Rule {
    type Error = ConvertError;
    fn try_from(r: &v1::Rule) -> Result<Self> {
        let mut actions = pipeline::Actions::with_capacity(r.actions.len());
        for a in &r.actions {
            actions.push(Action::try_from(a)?);
        }
        Ok(Rule {
            key: key_of(r.key.as_ref())?,
            actions,
            idle_timeout: r.idle_timeout_ms.map(timeout_from),
        })
    }
}

// ------------------------------------------------------------------ requests and replies

impl From<&PacketMeta> for v1::PacketMeta {
    fn from(m: &PacketMeta) -> Self {
        v1::PacketMeta {
            len: u32::from(m.len),
            tcp_flags: u32::from(m.tcp_flags),
            icmp_error: m.icmp_error,
            ingress_port: u32::from(m.ingress_port),
        }
    }
}

impl TryFrom<&v1::PacketMeta> for PacketMeta {
    type Error = ConvertError;
    fn try_from(m: &v1::PacketMeta) -> Result<Self> {
        Ok(PacketMeta {
            len: narrow("packet length", m.len)?,
            tcp_flags: narrow("tcp flags", m.tcp_flags)?,
            icmp_error: m.icmp_error,
            ingress_port: narrow("ingress port", m.ingress_port)?,
        })
    }
}

/// A pipeline request as a message with the sender's request id.
pub fn request_to_proto(r: &RuleRequest, id: u64) -> v1::RuleRequest {
    request_with(
        r,
        id,
        owned(*r.key.as_bytes()),
        r.frame
            .as_deref()
            .map(Bytes::copy_from_slice)
            .unwrap_or_default(),
    )
}

/// [`request_to_proto`] for one of a batch: its byte fields (the key, the frame) cut
/// from `slab`, so the batch's keys take one allocation between them rather than one
/// each.
pub fn request_in(r: &RuleRequest, id: u64, slab: &mut FieldSlab) -> v1::RuleRequest {
    let frame = r.frame.as_deref().map(|f| slab.cut(f)).unwrap_or_default();
    request_with(r, id, slab.cut(r.key.as_bytes()), frame)
}

fn request_with(r: &RuleRequest, id: u64, key: Bytes, frame: Bytes) -> v1::RuleRequest {
    v1::RuleRequest {
        id,
        key: Some(v1::FlowKey { raw: key }),
        hash: r.hash,
        tenant: r.tenant,
        chain: r.chain,
        meta: Some((&r.meta).into()),
        worker: u32::from(r.worker),
        frame,
    }
}

/// Byte fields for a batch of messages about to be sent, cut from one buffer.
///
/// A field made on its own is an allocation ([`owned`]); a flow's request key is 40
/// bytes, and PP sends a few hundred keys a batch. Cut from a buffer sized for the
/// batch, each key is a slice of it (a reference count), and the batch costs two
/// allocations: the buffer and its shared header. The buffer lives until the last of
/// its fields is dropped, which for a request is its answer or its timeout.
pub struct FieldSlab {
    buf: BytesMut,
    chunk: usize,
}

impl FieldSlab {
    /// A slab that takes `chunk` bytes at a time (at least the field being cut).
    pub fn new(chunk: usize) -> Self {
        FieldSlab {
            buf: BytesMut::new(),
            chunk,
        }
    }

    /// `b` as a field, copied into the slab.
    pub fn cut(&mut self, b: &[u8]) -> Bytes {
        if self.buf.capacity() < b.len() {
            self.buf = BytesMut::with_capacity(b.len().max(self.chunk));
        }
        self.buf.extend_from_slice(b);
        self.buf.split().freeze()
    }
}

impl TryFrom<&v1::RuleRequest> for RuleRequest {
    type Error = ConvertError;
    fn try_from(r: &v1::RuleRequest) -> Result<Self> {
        Ok(RuleRequest {
            key: key_of(r.key.as_ref())?,
            hash: r.hash,
            tenant: r.tenant,
            chain: r.chain,
            meta: PacketMeta::try_from(r.meta.as_ref().ok_or(ConvertError::Missing("meta"))?)?,
            worker: narrow("worker", r.worker)?,
            frame: (!r.frame.is_empty()).then(|| r.frame.as_ref().into()),
        })
    }
}

/// A pipeline reply as a message answering request `id` of `worker`.
pub fn reply_to_proto(r: &RuleReply, id: u64, worker: u16) -> v1::RuleReply {
    v1::RuleReply {
        id,
        key: Some((&r.key).into()),
        result: Some(match &r.result {
            Ok(rule) => v1::rule_reply::Result::Rule(rule.into()),
            Err(e) => v1::rule_reply::Result::Error(e.clone()),
        }),
        also: r.also.iter().map(v1::Rule::from).collect(),
        worker: u32::from(worker),
        decided_by: match &r.decided_by {
            DecidedBy::Named(n) => n.clone(),
            DecidedBy::Unsaid | DecidedBy::ScGroup(_) => String::new(),
        },
        decided_by_group: match r.decided_by {
            DecidedBy::ScGroup(g) => g,
            DecidedBy::Unsaid | DecidedBy::Named(_) => 0,
        },
        frame_forwarded: r.frame_forwarded,
    }
}

/// Who decided, from a reply's two fields (see `RuleReply.decided_by_group`).
fn decided_by(group: u64, name: String) -> DecidedBy {
    match (group, name.is_empty()) {
        (0, true) => DecidedBy::Unsaid,
        (0, false) => DecidedBy::Named(name),
        (g, _) => DecidedBy::ScGroup(g),
    }
}

impl TryFrom<&v1::RuleReply> for RuleReply {
    type Error = ConvertError;
    fn try_from(r: &v1::RuleReply) -> Result<Self> {
        let key = key_of(r.key.as_ref())?;
        let result = match r.result.as_ref().ok_or(ConvertError::Missing("result"))? {
            v1::rule_reply::Result::Rule(rule) => Ok(Rule::try_from(rule)?),
            v1::rule_reply::Result::Error(e) => Err(e.clone()),
        };
        Ok(RuleReply {
            key,
            result,
            also: r.also.iter().map(Rule::try_from).collect::<Result<_>>()?,
            revoke: false,
            decided_by: decided_by(r.decided_by_group, r.decided_by.clone()),
            frame_forwarded: r.frame_forwarded,
            inject: None,
        })
    }
}

/// The same as the conversion from `&v1::RuleReply`, moving the reply's strings (its
/// error and `decided_by`) instead of copying them: PP's FM session converts every
/// reply it receives, and each copy was an allocation per flow.
impl TryFrom<v1::RuleReply> for RuleReply {
    type Error = ConvertError;
    fn try_from(mut r: v1::RuleReply) -> Result<Self> {
        let key = key_of(r.key.as_ref())?;
        let result = match r.result.take().ok_or(ConvertError::Missing("result"))? {
            v1::rule_reply::Result::Rule(rule) => Ok(Rule::try_from(&rule)?),
            v1::rule_reply::Result::Error(e) => Err(e),
        };
        Ok(RuleReply {
            key,
            result,
            also: r.also.iter().map(Rule::try_from).collect::<Result<_>>()?,
            revoke: false,
            decided_by: decided_by(r.decided_by_group, std::mem::take(&mut r.decided_by)),
            frame_forwarded: r.frame_forwarded,
            inject: None,
        })
    }
}

/// An error reply to request `req`.
pub fn error_reply(req: &v1::RuleRequest, error: impl Into<String>) -> v1::RuleReply {
    v1::RuleReply {
        id: req.id,
        key: req.key.clone(),
        result: Some(v1::rule_reply::Result::Error(error.into())),
        also: Vec::new(),
        worker: req.worker,
        decided_by: String::new(),
        decided_by_group: 0,
        frame_forwarded: false,
    }
}

// ------------------------------------------------------------------ flow events

/// A flow event of a tenant chain, as the NF model sees it.
pub fn event_from(e: &v1::FlowEvent) -> Result<nf::FlowEvent> {
    match e.kind.as_ref().ok_or(ConvertError::Missing("event kind"))? {
        v1::flow_event::Kind::TcpClosing(k) => Ok(nf::FlowEvent::TcpClosing {
            key: FlowKey::try_from(k)?,
        }),
        v1::flow_event::Kind::Expired(k) => Ok(nf::FlowEvent::Expired {
            key: FlowKey::try_from(k)?,
        }),
        v1::flow_event::Kind::TcpEstablished(k) => Ok(nf::FlowEvent::TcpEstablished {
            key: FlowKey::try_from(k)?,
        }),
        v1::flow_event::Kind::Active(k) => Ok(nf::FlowEvent::Active {
            key: FlowKey::try_from(k)?,
        }),
        v1::flow_event::Kind::Counters(c) => Ok(nf::FlowEvent::Counters {
            key: FlowKey::try_from(
                c.key
                    .as_ref()
                    .ok_or(ConvertError::Missing("counters key"))?,
            )?,
            tenant: e.tenant,
            packets: c.packets,
            bytes: c.bytes,
        }),
    }
}

/// The flow key an event is about.
pub fn event_key(e: &v1::FlowEvent) -> Result<FlowKey> {
    match e.kind.as_ref().ok_or(ConvertError::Missing("event kind"))? {
        v1::flow_event::Kind::TcpClosing(k)
        | v1::flow_event::Kind::Expired(k)
        | v1::flow_event::Kind::TcpEstablished(k)
        | v1::flow_event::Kind::Active(k) => FlowKey::try_from(k),
        v1::flow_event::Kind::Counters(c) => FlowKey::try_from(
            c.key
                .as_ref()
                .ok_or(ConvertError::Missing("counters key"))?,
        ),
    }
}

/// PP's counter report for one rule, as the FlowEvent PP sends.
pub fn counters_event(
    tenant: u32,
    chain: u32,
    key: &FlowKey,
    packets: u64,
    bytes: u64,
) -> v1::FlowEvent {
    v1::FlowEvent {
        tenant,
        chain,
        kind: Some(v1::flow_event::Kind::Counters(v1::RuleCounters {
            key: Some(key.into()),
            packets,
            bytes,
        })),
    }
}

fn traffic_count(c: &nf::TrafficCount) -> v1::TrafficCount {
    v1::TrafficCount {
        packets: c.packets,
        bytes: c.bytes,
        flows: c.flows,
    }
}

fn traffic_count_from(c: Option<&v1::TrafficCount>) -> nf::TrafficCount {
    c.map(|c| nf::TrafficCount {
        packets: c.packets,
        bytes: c.bytes,
        flows: c.flows,
    })
    .unwrap_or_default()
}

pub fn traffic_to_proto(r: &nf::TrafficReport) -> v1::TrafficReport {
    v1::TrafficReport {
        tenants: r
            .tenants
            .iter()
            .map(|(t, c)| v1::TenantTraffic {
                tenant: *t,
                count: Some(traffic_count(c)),
            })
            .collect(),
        hosts: r
            .hosts
            .iter()
            .map(|(t, a, c)| v1::HostTraffic {
                tenant: *t,
                addr: match a {
                    std::net::IpAddr::V4(a) => a.octets().to_vec(),
                    std::net::IpAddr::V6(a) => a.octets().to_vec(),
                },
                count: Some(traffic_count(c)),
            })
            .collect(),
        overflow: Some(traffic_count(&r.overflow)),
    }
}

/// A traffic report off the wire; hosts with an address of neither 4 nor 16 bytes are an
/// error.
pub fn traffic_from(r: &v1::TrafficReport) -> Result<nf::TrafficReport> {
    let mut hosts = Vec::with_capacity(r.hosts.len());
    for h in &r.hosts {
        let addr = if let Ok(a) = <[u8; 4]>::try_from(&h.addr[..]) {
            std::net::IpAddr::from(a)
        } else if let Ok(a) = <[u8; 16]>::try_from(&h.addr[..]) {
            std::net::IpAddr::from(a)
        } else {
            return Err(ConvertError::AddrLength(h.addr.len()));
        };
        hosts.push((h.tenant, addr, traffic_count_from(h.count.as_ref())));
    }
    Ok(nf::TrafficReport {
        tenants: r
            .tenants
            .iter()
            .map(|t| (t.tenant, traffic_count_from(t.count.as_ref())))
            .collect(),
        hosts,
        overflow: traffic_count_from(r.overflow.as_ref()),
    })
}

pub fn event_to_proto(tenant: u32, chain: u32, e: &nf::FlowEvent) -> v1::FlowEvent {
    let kind = match e {
        nf::FlowEvent::TcpClosing { key } => v1::flow_event::Kind::TcpClosing(key.into()),
        nf::FlowEvent::Expired { key } => v1::flow_event::Kind::Expired(key.into()),
        nf::FlowEvent::TcpEstablished { key } => v1::flow_event::Kind::TcpEstablished(key.into()),
        nf::FlowEvent::Active { key } => v1::flow_event::Kind::Active(key.into()),
        nf::FlowEvent::Counters {
            key,
            tenant: t,
            packets,
            bytes,
        } => {
            return counters_event(*t, chain, key, *packets, *bytes);
        }
    };
    v1::FlowEvent {
        tenant,
        chain,
        kind: Some(kind),
    }
}

// ------------------------------------------------------------------ chain configuration

/// A chain's shape in configuration files: a number runs that NF, a list runs its steps
/// in order, an object branches on an NF's verdict label (Serpens `distribute`) and
/// joins afterwards: `[0, {"nf": 1, "arms": [{"label": "web", "step": 2}], "default": 3}, 4]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StepDef {
    Nf(usize),
    Seq(Vec<StepDef>),
    Branch {
        nf: usize,
        arms: Vec<ArmDef>,
        default: Box<StepDef>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArmDef {
    pub label: String,
    pub step: StepDef,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EncapDef {
    pub dst: Ipv4Addr,
    pub vni: u32,
}

/// How a chain's rules leave PP in one direction (see [`nf::Egress`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressDef {
    #[serde(default)]
    pub decap: bool,
    #[serde(default)]
    pub encap: Option<EncapDef>,
    /// `aa:bb:cc:dd:ee:ff`
    #[serde(default)]
    pub inner_dmac: Option<String>,
    #[serde(default)]
    pub output: u8,
}

/// One tenant chain as configuration files write it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChainDef {
    pub tenant: u32,
    pub chain: u32,
    /// NF configurations in chain order (`nfs::NfConfig` JSON, e.g. `{"kind": "snat", ...}`).
    pub nfs: Vec<serde_json::Value>,
    /// Shape; absent: every NF in order.
    #[serde(default)]
    pub spec: Option<StepDef>,
    #[serde(default)]
    pub forward: EgressDef,
    #[serde(default)]
    pub reverse: EgressDef,
    /// What FM dispatches the chain's requests by and SC splits its state by
    /// (`nf::PartitionBy`); the orchestrator fills it from the chain's NFs. Absent: the
    /// flow hash.
    #[serde(default, skip_serializing_if = "PartitionBy::is_flow")]
    pub partition: PartitionBy,
}

/// The text of a chain's partitioning on the wire (`ChainConfig.partition`).
pub fn partition_to_proto(p: PartitionBy) -> String {
    match p {
        PartitionBy::Flow => String::new(),
        PartitionBy::SourceAddress => "source_address".into(),
    }
}

/// The partitioning a `ChainConfig.partition` names; an unknown name is an error.
pub fn partition_from_proto(s: &str) -> Result<PartitionBy> {
    match s {
        "" | "flow" => Ok(PartitionBy::Flow),
        "source_address" => Ok(PartitionBy::SourceAddress),
        other => Err(ConvertError::Chain(format!(
            "unknown partitioning {other:?}"
        ))),
    }
}

/// Parse `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Result<[u8; 6]> {
    let bad = || ConvertError::Chain(format!("bad MAC {s:?}"));
    let mut m = [0u8; 6];
    let mut parts = s.split(':');
    for b in m.iter_mut() {
        *b = u8::from_str_radix(parts.next().ok_or_else(bad)?, 16).map_err(|_| bad())?;
    }
    if parts.next().is_some() {
        return Err(bad());
    }
    Ok(m)
}

fn step_to_proto(s: &StepDef) -> Result<v1::ChainStep> {
    use v1::chain_step::Step;
    let step = match s {
        StepDef::Nf(i) => Step::Nf(narrow("nf index", *i as u64)?),
        StepDef::Seq(v) => Step::Seq(v1::ChainSeq {
            steps: v.iter().map(step_to_proto).collect::<Result<_>>()?,
        }),
        StepDef::Branch { nf, arms, default } => Step::Branch(Box::new(v1::ChainBranch {
            nf: narrow("nf index", *nf as u64)?,
            arms: arms
                .iter()
                .map(|a| {
                    Ok(v1::ChainArm {
                        label: a.label.clone(),
                        step: Some(step_to_proto(&a.step)?),
                    })
                })
                .collect::<Result<_>>()?,
            default: Some(Box::new(step_to_proto(default)?)),
        })),
    };
    Ok(v1::ChainStep { step: Some(step) })
}

fn egress_to_proto(e: &EgressDef) -> Result<v1::Egress> {
    Ok(v1::Egress {
        decap: e.decap,
        encap_dst: e.encap.map(|x| x.dst.octets().to_vec()).unwrap_or_default(),
        encap_vni: match e.encap {
            Some(x) => check_vni(x.vni)?,
            None => 0,
        },
        inner_dmac: match &e.inner_dmac {
            Some(m) => parse_mac(m)?.to_vec(),
            None => Vec::new(),
        },
        output: u32::from(e.output),
    })
}

impl ChainDef {
    /// The chain as FM pushes it to SC nodes (validated: NF indices, VNIs, MACs).
    pub fn to_proto(&self) -> Result<v1::ChainConfig> {
        let spec = self
            .spec
            .clone()
            .unwrap_or_else(|| StepDef::Seq((0..self.nfs.len()).map(StepDef::Nf).collect()));
        let c = v1::ChainConfig {
            tenant: self.tenant,
            chain: self.chain,
            nfs: self.nfs.iter().map(|v| v.to_string()).collect(),
            spec: Some(step_to_proto(&spec)?),
            forward: Some(egress_to_proto(&self.forward)?),
            reverse: Some(egress_to_proto(&self.reverse)?),
            partition: partition_to_proto(self.partition),
        };
        // Reject now what an SC node would reject later.
        ChainParts::try_from(&c)?;
        Ok(c)
    }
}

/// What an SC node builds a chain from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainParts {
    pub tenant: u32,
    pub chain: u32,
    /// NF configurations (JSON text), in chain order.
    pub nfs: Vec<String>,
    pub spec: ChainSpec,
    pub forward: Egress,
    pub reverse: Egress,
    pub partition: PartitionBy,
}

fn step_from(s: &v1::ChainStep, n: usize, depth: usize) -> Result<ChainSpec> {
    use v1::chain_step::Step;
    if depth > MAX_CHAIN_DEPTH {
        return Err(ConvertError::Chain("chain shape nested too deeply".into()));
    }
    let nf_index = |i: u32| -> Result<usize> {
        let i = i as usize;
        if i >= n {
            Err(ConvertError::Chain(format!("step names NF {i} of {n}")))
        } else {
            Ok(i)
        }
    };
    Ok(
        match s.step.as_ref().ok_or(ConvertError::Missing("chain step"))? {
            Step::Nf(i) => ChainSpec::Nf(nf_index(*i)?),
            Step::Seq(v) => ChainSpec::Seq(
                v.steps
                    .iter()
                    .map(|s| step_from(s, n, depth + 1))
                    .collect::<Result<_>>()?,
            ),
            Step::Branch(b) => ChainSpec::Branch {
                nf: nf_index(b.nf)?,
                arms: b
                    .arms
                    .iter()
                    .map(|a| {
                        let st = a.step.as_ref().ok_or(ConvertError::Missing("arm step"))?;
                        Ok((a.label.clone(), step_from(st, n, depth + 1)?))
                    })
                    .collect::<Result<_>>()?,
                default: Box::new(step_from(
                    b.default
                        .as_deref()
                        .ok_or(ConvertError::Missing("branch default"))?,
                    n,
                    depth + 1,
                )?),
            },
        },
    )
}

fn egress_from(e: Option<&v1::Egress>) -> Result<Egress> {
    let Some(e) = e else {
        return Ok(Egress::LOCAL);
    };
    Ok(Egress {
        decap: e.decap,
        encap: if e.encap_dst.is_empty() {
            None
        } else {
            Some((ipv4_from(&e.encap_dst)?, check_vni(e.encap_vni)?))
        },
        inner_dmac: mac_from(&e.inner_dmac)?,
        output: narrow("output port", e.output)?,
    })
}

impl TryFrom<&v1::ChainConfig> for ChainParts {
    type Error = ConvertError;
    fn try_from(c: &v1::ChainConfig) -> Result<Self> {
        if c.nfs.is_empty() {
            return Err(ConvertError::Chain("chain has no NFs".into()));
        }
        let spec = match &c.spec {
            Some(s) => step_from(s, c.nfs.len(), 0)?,
            None => ChainSpec::seq(c.nfs.len()),
        };
        Ok(ChainParts {
            tenant: c.tenant,
            chain: c.chain,
            nfs: c.nfs.clone(),
            spec,
            forward: egress_from(c.forward.as_ref())?,
            reverse: egress_from(c.reverse.as_ref())?,
            partition: partition_from_proto(&c.partition)?,
        })
    }
}

// ------------------------------------------------------------------ helpers

/// Role name for logs and status output.
pub fn role_name(r: i32) -> &'static str {
    match v1::Role::try_from(r) {
        Ok(v1::Role::Pp) => "pp",
        Ok(v1::Role::Fm) => "fm",
        Ok(v1::Role::Sc) => "sc",
        _ => "unspecified",
    }
}

/// HTTP/2 flow-control windows of every starfabric connection. One message carries a
/// batch of hundreds of requests or rules; with h2's 64 KiB default a stream stalls for a
/// window update round trip every few batches.
pub const STREAM_WINDOW: u32 = 8 << 20;
pub const CONNECTION_WINDOW: u32 = 16 << 20;

/// A gRPC server configured as every starfabric plane serves.
pub fn server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
}

/// Accepted connections of `listener`, with TCP_NODELAY set. (A server given its own
/// listener does not set it: Nagle's algorithm then meets delayed ACKs and every small
/// batch waits 40 ms.)
pub fn incoming(
    listener: tokio::net::TcpListener,
) -> Result<tonic::transport::server::TcpIncoming, String> {
    tonic::transport::server::TcpIncoming::from_listener(listener, true, None)
        .map_err(|e| e.to_string())
}

/// A gRPC endpoint (`host:port`) configured as every starfabric plane connects.
pub fn endpoint(addr: &str) -> Result<tonic::transport::Endpoint, tonic::transport::Error> {
    Ok(tonic::transport::Endpoint::from_shared(endpoint_uri(addr))?
        .tcp_nodelay(true)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .connect_timeout(std::time::Duration::from_secs(1)))
}

/// A channel to the server of role `server` at `addr` (`host:port`), configured as
/// [`endpoint`]: over mTLS with `tls`, plaintext when `tls` is `None` (`--insecure`).
pub async fn connect(
    addr: &str,
    tls: Option<&std::sync::Arc<tls::NodeTls>>,
    server: tls::Role,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    tls::connect(endpoint(addr)?, tls, server).await
}

/// `host:port` → `http://host:port`, the form tonic endpoints take.
pub fn endpoint_uri(addr: &str) -> String {
    if addr.starts_with("http://") || addr.starts_with("https://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipeline::{format_actions, parse_actions};
    use prost::Message;

    fn key() -> FlowKey {
        "100 tcp 198.18.10.2:40000 > 198.19.0.100:80"
            .parse()
            .unwrap()
    }

    #[test]
    fn interned_fields_share_storage_and_keep_their_values() {
        let a = interned(&[198, 18, 0, 1]);
        let b = interned(&[198, 18, 0, 1]);
        assert_eq!(&a[..], &[198, 18, 0, 1]);
        assert_eq!(a.as_ptr(), b.as_ptr(), "the second is the first's storage");
        // Enough other values to evict every slot: each still reads its own bytes.
        for i in 0..4 * INTERNED_SLOTS as u32 {
            let v = (0xC612_0000 + i).to_be_bytes();
            assert_eq!(&interned(&v)[..], &v);
            let mac = [2, 0, 0, 0, (i >> 8) as u8, i as u8];
            assert_eq!(&interned(&mac)[..], &mac);
        }
        assert_eq!(&a[..], &[198, 18, 0, 1], "evicted, still intact");
        assert_eq!(&interned(&[198, 18, 0, 1])[..], &[198, 18, 0, 1]);
        let v6 = [0x20, 1, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
        assert_eq!(&interned(&v6)[..], &v6);
        assert!(interned(&[]).is_empty());
        assert_eq!(&interned(&[7; 40])[..], &[7; 40][..], "too long to intern");
    }

    #[test]
    fn decoded_fields_slice_the_buffer_until_detached() {
        let wire = Bytes::from(
            reply_to_proto(&RuleReply::ok(Rule::new(key(), vec![])), 1, 0).encode_to_vec(),
        );
        let range = wire.as_ptr() as usize..wire.as_ptr() as usize + wire.len();
        let inside = |m: &v1::RuleReply| {
            let p = m.key.as_ref().unwrap().raw.as_ptr() as usize;
            range.contains(&p)
        };
        let m = v1::RuleReply::decode(wire.clone()).unwrap();
        assert!(
            inside(&m),
            "a decoded key is a slice of what it was decoded from"
        );
        let d = detached(&m);
        assert_eq!(d, m);
        assert!(!inside(&d), "a detached key has storage of its own");
    }

    #[test]
    fn flow_events_round_trip_through_bytes() {
        let k = key();
        for e in [
            nf::FlowEvent::TcpClosing { key: k },
            nf::FlowEvent::Expired { key: k },
            nf::FlowEvent::TcpEstablished { key: k },
            nf::FlowEvent::Active { key: k },
        ] {
            let p = event_to_proto(7, 2, &e);
            let back = v1::FlowEvent::decode(p.encode_to_vec().as_slice()).unwrap();
            assert_eq!((back.tenant, back.chain), (7, 2));
            assert_eq!(event_from(&back).unwrap(), e);
        }
        assert!(event_from(&v1::FlowEvent::default()).is_err());
    }

    #[test]
    fn rules_round_trip_through_bytes() {
        let text = "decap; set-src 198.19.255.1:50000; set-dst 198.19.1.7; \
                    encap 198.18.0.9 vni 200 dmac 02:00:00:00:00:03 smac 02:00:00:00:00:04; \
                    count; police 7; offload; out 1";
        let mut rule = Rule::new(key(), parse_actions(text).unwrap());
        rule.idle_timeout = Some(Duration::from_secs(240));
        let bytes = v1::Rule::from(&rule).encode_to_vec();
        let back = Rule::try_from(&v1::Rule::decode(bytes.as_slice()).unwrap()).unwrap();
        assert_eq!(back, rule);
        assert_eq!(format_actions(&back.actions), format_actions(&rule.actions));

        let mut never = Rule::new(key(), parse_actions("drop acl-deny").unwrap());
        never.idle_timeout = Some(Duration::MAX);
        let back = Rule::try_from(&v1::Rule::from(&never)).unwrap();
        assert_eq!(back.idle_timeout, Some(Duration::MAX));

        let v6: FlowKey = "7 udp [2001:2::1]:5 > [2001:2::2]:6".parse().unwrap();
        let r = Rule::new(v6, parse_actions("set-dst [2001:2::9]:7; out 0").unwrap());
        assert_eq!(Rule::try_from(&v1::Rule::from(&r)).unwrap(), r);
    }

    #[test]
    fn requests_and_replies_round_trip() {
        let req = RuleRequest {
            key: key(),
            hash: key().hash(),
            tenant: 3,
            chain: 4,
            meta: PacketMeta {
                len: 60,
                tcp_flags: 2,
                icmp_error: false,
                ingress_port: 1,
            },
            worker: 2,
            frame: None,
        };
        let m = request_to_proto(&req, 77);
        assert_eq!(m.id, 77);
        assert!(m.frame.is_empty());
        assert_eq!(RuleRequest::try_from(&m).unwrap(), req);
        // The fabric's first packet travels with the request, byte for byte.
        let with = RuleRequest {
            frame: Some(vec![0xab; 90].into()),
            ..req.clone()
        };
        let m = request_to_proto(&with, 78);
        assert_eq!(m.frame, vec![0xab; 90]);
        assert_eq!(RuleRequest::try_from(&m).unwrap(), with);

        // A batch's fields cut from one slab: the same messages, and the keys side by
        // side in one buffer until a chunk is full.
        let mut slab = FieldSlab::new(3 * FlowKey::LEN);
        let batch: Vec<v1::RuleRequest> = [&req, &req, &with, &req]
            .iter()
            .enumerate()
            .map(|(i, r)| request_in(r, i as u64, &mut slab))
            .collect();
        for (i, (m, r)) in batch.iter().zip([&req, &req, &with, &req]).enumerate() {
            assert_eq!(*m, request_to_proto(r, i as u64));
        }
        let at = |i: usize| batch[i].key.as_ref().unwrap().raw.as_ptr() as usize;
        assert_eq!(at(1), at(0) + FlowKey::LEN, "one buffer, not one per key");
        // The frame did not fit the 40 bytes left, nor the key after it the 30 left
        // after the frame: each began a chunk, and the next key follows on.
        let frame = batch[2].frame.as_ptr() as usize;
        assert_ne!(frame, at(1) + FlowKey::LEN);
        assert_ne!(at(2), frame + 90);
        assert_eq!(at(3), at(2) + FlowKey::LEN);

        let mut reply = RuleReply::ok(Rule::new(key(), parse_actions("out 0").unwrap()));
        reply.also.push(Rule::new(
            key().reversed(),
            parse_actions("count; out 0").unwrap(),
        ));
        let m = reply_to_proto(&reply, 77, 2);
        assert_eq!((m.id, m.worker), (77, 2));
        assert_eq!(RuleReply::try_from(&m).unwrap(), reply);
        let e = RuleReply::err(key(), "snat-exhausted");
        assert_eq!(RuleReply::try_from(&reply_to_proto(&e, 1, 0)).unwrap(), e);
        reply.frame_forwarded = true;
        let m = reply_to_proto(&reply, 79, 0);
        assert!(m.frame_forwarded);
        assert_eq!(RuleReply::try_from(&m).unwrap(), reply);
    }

    #[test]
    fn bad_messages_are_typed_errors() {
        let short = v1::FlowKey {
            raw: vec![0; 39].into(),
        };
        assert_eq!(FlowKey::try_from(&short), Err(ConvertError::KeyLength(39)));
        assert_eq!(key_of(None), Err(ConvertError::Missing("key")));
        assert_eq!(
            Action::try_from(&v1::Action { kind: None }),
            Err(ConvertError::UnknownAction)
        );
        let enc = |vni, dst: Vec<u8>, mac: Vec<u8>| v1::Action {
            kind: Some(v1::action::Kind::Encap(v1::Encap {
                dst: dst.into(),
                vni,
                inner_dmac: mac.into(),
                inner_smac: Bytes::new(),
            })),
        };
        assert_eq!(
            Action::try_from(&enc(1 << 24, vec![1, 2, 3, 4], vec![])),
            Err(ConvertError::BadVni(1 << 24))
        );
        assert_eq!(
            Action::try_from(&enc(5, vec![1; 16], vec![])),
            Err(ConvertError::NotIpv4(16))
        );
        assert_eq!(
            Action::try_from(&enc(5, vec![1; 4], vec![1; 5])),
            Err(ConvertError::MacLength(5))
        );
        let port = v1::Action {
            kind: Some(v1::action::Kind::SetSrc(v1::Endpoint {
                addr: vec![1; 3].into(),
                port: None,
            })),
        };
        assert_eq!(Action::try_from(&port), Err(ConvertError::AddrLength(3)));
        let port = v1::Action {
            kind: Some(v1::action::Kind::SetDst(v1::Endpoint {
                addr: Bytes::new(),
                port: Some(70000),
            })),
        };
        assert!(matches!(
            Action::try_from(&port),
            Err(ConvertError::OutOfRange { what: "port", .. })
        ));
        let out = v1::Action {
            kind: Some(v1::action::Kind::Output(256)),
        };
        assert!(Action::try_from(&out).is_err());
        let mut req = request_to_proto(
            &RuleRequest {
                key: key(),
                hash: 0,
                tenant: 0,
                chain: 0,
                meta: PacketMeta {
                    len: 0,
                    tcp_flags: 0,
                    icmp_error: false,
                    ingress_port: 0,
                },
                worker: 0,
                frame: None,
            },
            1,
        );
        req.worker = 1 << 20;
        assert!(RuleRequest::try_from(&req).is_err());
        req.worker = 0;
        req.meta = None;
        assert_eq!(
            RuleRequest::try_from(&req),
            Err(ConvertError::Missing("meta"))
        );
        // Garbage bytes are a decode error, not a panic.
        assert!(v1::RuleRequestBatch::decode(&[0xff, 0xff, 0xff][..]).is_err());
    }

    #[test]
    fn a_chains_partitioning_travels_to_sc_and_unknown_ones_are_refused() {
        let j = r#"{"tenant": 1, "chain": 2, "nfs": [{"kind": "snat"}],
                    "partition": "source_address"}"#;
        let d: ChainDef = serde_json::from_str(j).unwrap();
        assert_eq!(d.partition, PartitionBy::SourceAddress);
        let c = d.to_proto().unwrap();
        assert_eq!(c.partition, "source_address");
        assert_eq!(
            ChainParts::try_from(&c).unwrap().partition,
            PartitionBy::SourceAddress
        );
        // Absent is the flow hash, and a chain written without it reads back the same.
        let plain: ChainDef =
            serde_json::from_str(r#"{"tenant": 1, "chain": 2, "nfs": [{"kind": "snat"}]}"#)
                .unwrap();
        assert_eq!(plain.partition, PartitionBy::Flow);
        assert!(!serde_json::to_string(&plain).unwrap().contains("partition"));
        let mut bad = c.clone();
        bad.partition = "by-moon-phase".into();
        assert!(ChainParts::try_from(&bad).is_err());
        assert!(serde_json::from_str::<ChainDef>(
            r#"{"tenant": 1, "chain": 2, "nfs": [], "partition": "nope"}"#
        )
        .is_err());
    }

    #[test]
    fn chain_defs_parse_and_validate() {
        let j = r#"{
            "tenant": 1, "chain": 2,
            "nfs": [{"kind": "fw"}, {"kind": "snat"}, {"kind": "lb"}, {"kind": "monitor"}],
            "spec": [{"nf": 0, "arms": [{"label": "web", "step": 2}], "default": [1]}, 3],
            "forward": {"decap": true, "encap": {"dst": "198.18.0.9", "vni": 200},
                        "inner_dmac": "02:00:00:00:00:09", "output": 1},
            "reverse": {"decap": true}
        }"#;
        let d: ChainDef = serde_json::from_str(j).unwrap();
        let c = d.to_proto().unwrap();
        let p = ChainParts::try_from(&c).unwrap();
        assert_eq!(p.nfs.len(), 4);
        assert_eq!(
            p.spec,
            ChainSpec::Seq(vec![
                ChainSpec::Branch {
                    nf: 0,
                    arms: vec![("web".into(), ChainSpec::Nf(2))],
                    default: Box::new(ChainSpec::Seq(vec![ChainSpec::Nf(1)])),
                },
                ChainSpec::Nf(3)
            ])
        );
        assert_eq!(p.forward.encap, Some((Ipv4Addr::new(198, 18, 0, 9), 200)));
        assert_eq!(p.forward.inner_dmac, Some([2, 0, 0, 0, 0, 9]));
        assert_eq!(
            p.reverse,
            Egress {
                decap: true,
                ..Egress::LOCAL
            }
        );

        let mut bad = d.clone();
        bad.spec = Some(StepDef::Nf(9));
        assert!(bad.to_proto().is_err());
        let mut bad = d.clone();
        bad.forward.encap = Some(EncapDef {
            dst: Ipv4Addr::LOCALHOST,
            vni: 1 << 24,
        });
        assert!(bad.to_proto().is_err());
        let mut bad = d;
        bad.nfs.clear();
        assert!(bad.to_proto().is_err());
    }
}
