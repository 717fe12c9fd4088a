//! Rules: a match plus a composed action list, and their compiled per-worker form.
//!
//! `Rule` is what the control plane (FM/SC) hands to PP. A worker compiles it into a
//! 16-byte [`RuleSlot`]: addresses, next hops and drop reasons are interned in
//! per-worker tables and referenced by 16-bit index, so the compiled actions fit in the
//! flow's table entry beside its 40-byte key, and a hit reads one cache line.

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr};
use std::str::FromStr;
use std::time::Duration;

use packet::build::EncapV4;
use packet::rewrite::Addr;
use smallvec::SmallVec;
use thiserror::Error;

use crate::key::FlowKey;

/// One step of a rule's action list. Order matters: actions run left to right.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Strip the outer Ethernet/IP/UDP/VXLAN headers.
    DecapVxlan,
    /// Rewrite the source address and/or port (ICMP echo: the identifier).
    SetSrc {
        addr: Option<IpAddr>,
        port: Option<u16>,
    },
    /// Rewrite the destination address and/or port.
    SetDst {
        addr: Option<IpAddr>,
        port: Option<u16>,
    },
    /// Push an IPv4 VXLAN header toward `dst` with `vni`; the outer source port comes
    /// from the hash of the (rewritten) inner flow. `inner_dmac`, when set, replaces the
    /// inner destination MAC with the far VTEP device's, which a Linux VXLAN device needs.
    EncapVxlan {
        dst: Ipv4Addr,
        vni: u32,
        inner_dmac: Option<[u8; 6]>,
        /// Replaces the inner source MAC; needed when the reply goes back to the VTEP it
        /// came from, since Linux drops frames carrying its own MAC as source.
        inner_smac: Option<[u8; 6]>,
    },
    /// Count packets and bytes on the rule.
    Count,
    /// Ask the rate manager whether policer `class` admits the packet.
    Police { class: u16 },
    /// Hand the flow to the offload path (XDP) once it qualifies.
    Offload,
    /// Transmit on output port `port`.
    Output(u8),
    /// Drop, counting under `reason`.
    Drop { reason: String },
    /// The fabric's forwarding entry (paper 000 §5.2, docs/fabric.md): send the frame to
    /// the next-hop PP node `peer` (its MAC on the PP nodes' L2 segment), which serves the
    /// chain stage this node does not. The frame leaves as it came, re-encapsulated with
    /// the flow's own VNI toward the node address every PP node takes VXLAN on, so the
    /// peer sees the same flow key and applies its own rule. Terminal, like `Output`.
    Fabric { peer: [u8; 6] },
}

/// A rule's action list, held inline up to six actions: decap, a source and a
/// destination rewrite, encap, count and output, the longest list a built-in chain
/// composes. A rule is made for every new flow at each SC replica and read from every
/// reply at PP, so a heap list cost an allocation per direction per flow at each of
/// them (docs/setup-path.md, "Action lists held inline"). Longer lists spill to the heap.
pub type Actions = SmallVec<[Action; 6]>;

/// A match plus a composed action list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub key: FlowKey,
    pub actions: Actions,
    /// Idle timeout; `None` uses the worker's default for the protocol.
    pub idle_timeout: Option<Duration>,
}

impl Rule {
    pub fn new(key: FlowKey, actions: impl Into<Actions>) -> Self {
        Rule {
            key,
            actions: actions.into(),
            idle_timeout: None,
        }
    }

    pub fn with_idle_timeout(mut self, t: Duration) -> Self {
        self.idle_timeout = Some(t);
        self
    }

    /// The key the flow has after this rule's rewrites, with the encap VNI if any: what
    /// the next hop sees, and what the VXLAN source port is hashed from.
    pub fn rewritten_key(&self) -> FlowKey {
        let mut k = self.key;
        for a in &self.actions {
            match a {
                Action::SetSrc { addr, port } => {
                    if let Some(a) = addr {
                        k.set_src(*a);
                    }
                    if let Some(p) = port {
                        k.set_sport(*p);
                    }
                }
                Action::SetDst { addr, port } => {
                    if let Some(a) = addr {
                        k.set_dst(*a);
                    }
                    if let Some(p) = port {
                        k.set_dport(*p);
                    }
                }
                Action::EncapVxlan { vni, .. } => k.set_vni(*vni),
                _ => {}
            }
        }
        k
    }
}

/// Why a rule cannot be compiled.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RuleError {
    #[error("rule has no terminal action (output or drop)")]
    NoTerminal,
    #[error("action {0} after the terminal action")]
    AfterTerminal(usize),
    #[error("decap must be the first action")]
    DecapNotFirst,
    #[error("more than one encap")]
    TwoEncaps,
    #[error("rewrite after encap would change the outer header")]
    RewriteAfterEncap,
    #[error("rewrite address family differs from the flow's")]
    FamilyMismatch,
    #[error("VNI {0} does not fit in 24 bits")]
    BadVni(u32),
    #[error("address table full (65535 distinct addresses)")]
    AddrTableFull,
    #[error("next-hop table full (65535 distinct encap targets)")]
    NexthopTableFull,
    #[error("drop-reason table full (255 distinct reasons)")]
    ReasonTableFull,
    #[error("timeout table full (255 distinct idle timeouts)")]
    TimeoutTableFull,
    #[error("fabric forwarding needs decap first (it re-encapsulates the inner frame)")]
    FabricWithoutDecap,
    #[error("cannot parse {what}: {text:?}")]
    Parse { what: &'static str, text: String },
}

/// Flags of [`RuleSlot::flags`]. Userspace-only bits: the XDP program's rule flags
/// (`xdp::rule_flag`) are a different set with different values, and `XdpRule::from_rule`
/// compiles from the rule's actions, never from these bits.
pub(crate) mod slot_flag {
    pub const SLOT_DECAP: u16 = 1;
    pub const SLOT_SRC_ADDR: u16 = 1 << 1;
    pub const SLOT_SRC_PORT: u16 = 1 << 2;
    pub const SLOT_DST_ADDR: u16 = 1 << 3;
    pub const SLOT_DST_PORT: u16 = 1 << 4;
    pub const SLOT_ENCAP: u16 = 1 << 5;
    pub const SLOT_OUTPUT: u16 = 1 << 6;
    pub const SLOT_COUNT: u16 = 1 << 7;
    pub const SLOT_POLICE: u16 = 1 << 8;
    pub const SLOT_DROP: u16 = 1 << 9;
    pub const SLOT_OFFLOAD: u16 = 1 << 10;
}

/// A compiled rule: one flow's composed action list in 16 bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub struct RuleSlot {
    pub(crate) flags: u16,
    /// Output port (OUTPUT) or drop-reason index (DROP).
    pub(crate) arg: u8,
    pub(crate) timeout_class: u8,
    pub(crate) police: u16,
    pub(crate) nexthop: u16,
    pub(crate) src_addr: u16,
    pub(crate) dst_addr: u16,
    pub(crate) sport: u16,
    pub(crate) dport: u16,
}

const _: () = assert!(std::mem::size_of::<RuleSlot>() == 16);

/// A rule's packet and byte counters, kept apart from the entry: the hit path only
/// adds to them, so they need not share the line the lookup reads. Elephant detection's
/// window is not here but in an arena of its own that only a pipeline detecting
/// elephants has ([`crate::table::ElephantWindow`]), so that a flow costs 16 bytes of
/// counters, not 32.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub struct RuleCounters {
    pub packets: u64,
    pub bytes: u64,
}

const _: () = assert!(std::mem::size_of::<RuleCounters>() == 16);

impl RuleSlot {
    pub fn is_drop(&self) -> bool {
        self.flags & slot_flag::SLOT_DROP != 0
    }
    pub fn wants_offload(&self) -> bool {
        self.flags & slot_flag::SLOT_OFFLOAD != 0
    }
}

/// An encap target: the precomputed outer header and the optional inner MAC rewrite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nexthop {
    pub encap: EncapV4,
    pub inner_dmac: Option<[u8; 6]>,
    pub inner_smac: Option<[u8; 6]>,
    /// A fabric next hop ([`Action::Fabric`]): the peer PP node's MAC, which is also the
    /// outer destination MAC (the underlay router would route the node address back to
    /// the vIP group, not to the peer).
    pub fabric_peer: Option<[u8; 6]>,
}

/// The PP node's own underlay identity, which encap writes as the outer source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeAddr {
    pub ip: Ipv4Addr,
    pub mac: [u8; 6],
    /// MAC of the underlay next hop (router or peer).
    pub gw_mac: [u8; 6],
}

/// Interned values with reference counts; index 0 is never handed out so a zero field
/// in a slot means "none".
#[derive(Debug)]
struct Interner<T: Eq + std::hash::Hash + Clone> {
    values: Vec<Option<T>>,
    refs: Vec<u32>,
    index: HashMap<T, u16>,
    free: Vec<u16>,
    limit: usize,
}

impl<T: Eq + std::hash::Hash + Clone> Interner<T> {
    fn new(limit: usize) -> Self {
        Interner {
            values: vec![None],
            refs: vec![0],
            index: HashMap::new(),
            free: Vec::new(),
            limit,
        }
    }

    fn acquire(&mut self, v: &T) -> Option<u16> {
        if let Some(&i) = self.index.get(v) {
            self.refs[i as usize] += 1;
            return Some(i);
        }
        let i = if let Some(i) = self.free.pop() {
            i
        } else if self.values.len() <= self.limit {
            self.values.push(None);
            self.refs.push(0);
            (self.values.len() - 1) as u16
        } else {
            return None;
        };
        self.values[i as usize] = Some(v.clone());
        self.refs[i as usize] = 1;
        self.index.insert(v.clone(), i);
        Some(i)
    }

    fn release(&mut self, i: u16) {
        if i == 0 {
            return;
        }
        let r = &mut self.refs[i as usize];
        *r = r.saturating_sub(1);
        if *r == 0 {
            if let Some(v) = self.values[i as usize].take() {
                self.index.remove(&v);
                self.free.push(i);
            }
        }
    }

    #[inline]
    fn get(&self, i: u16) -> Option<&T> {
        self.values.get(i as usize).and_then(|v| v.as_ref())
    }

    fn live(&self) -> usize {
        self.index.len()
    }
}

/// Per-worker tables that compiled rules point into, and the compiler itself.
#[derive(Debug)]
pub struct RuleContext {
    node: NodeAddr,
    addrs: Interner<Addr>,
    nexthops: Interner<NexthopKey>,
    nexthop_cache: Vec<Option<Nexthop>>,
    reasons: Vec<String>,
    timeouts_ms: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct NexthopKey {
    dst: Ipv4Addr,
    vni: u32,
    inner_dmac: Option<[u8; 6]>,
    inner_smac: Option<[u8; 6]>,
    fabric_peer: Option<[u8; 6]>,
}

impl RuleContext {
    /// `default_timeout` is timeout class 0, used by rules that name none.
    pub fn new(node: NodeAddr, default_timeout: Duration) -> Self {
        RuleContext {
            node,
            addrs: Interner::new(u16::MAX as usize - 1),
            nexthops: Interner::new(u16::MAX as usize - 1),
            nexthop_cache: vec![None],
            reasons: vec!["unnamed".to_string()],
            timeouts_ms: vec![duration_ms(default_timeout)],
        }
    }

    pub fn node(&self) -> &NodeAddr {
        &self.node
    }

    /// Compile `rule` into a slot, taking references on the interned values it uses.
    pub fn compile(&mut self, rule: &Rule) -> Result<RuleSlot, RuleError> {
        let mut s = RuleSlot::default();
        let mut terminal = false;
        // Kept only to undo a failed compile. A rule holds two addresses at most (a
        // later rewrite of a field releases the earlier one), so this stays inline: a
        // `Vec` here was an allocation per installed rule.
        let mut acquired_addrs: smallvec::SmallVec<[u16; 4]> = smallvec::SmallVec::new();
        let family_v4 = rule.key.is_v4();
        let result = (|| {
            for (i, a) in rule.actions.iter().enumerate() {
                if terminal {
                    return Err(RuleError::AfterTerminal(i));
                }
                match a {
                    Action::DecapVxlan => {
                        if i != 0 {
                            return Err(RuleError::DecapNotFirst);
                        }
                        s.flags |= slot_flag::SLOT_DECAP;
                    }
                    Action::SetSrc { addr, port } | Action::SetDst { addr, port } => {
                        if s.flags & slot_flag::SLOT_ENCAP != 0 {
                            return Err(RuleError::RewriteAfterEncap);
                        }
                        let is_src = matches!(a, Action::SetSrc { .. });
                        if let Some(ip) = addr {
                            if ip.is_ipv4() != family_v4 {
                                return Err(RuleError::FamilyMismatch);
                            }
                            let idx = self
                                .addrs
                                .acquire(&Addr::from(*ip))
                                .ok_or(RuleError::AddrTableFull)?;
                            acquired_addrs.push(idx);
                            // A later rewrite of the same field wins (chain composition).
                            let (slot, f) = if is_src {
                                (&mut s.src_addr, slot_flag::SLOT_SRC_ADDR)
                            } else {
                                (&mut s.dst_addr, slot_flag::SLOT_DST_ADDR)
                            };
                            if *slot != 0 {
                                self.addrs.release(*slot);
                                if let Some(at) = acquired_addrs.iter().position(|&x| x == *slot) {
                                    acquired_addrs.swap_remove(at);
                                }
                            }
                            *slot = idx;
                            s.flags |= f;
                        }
                        if let Some(p) = port {
                            if is_src {
                                s.sport = *p;
                                s.flags |= slot_flag::SLOT_SRC_PORT;
                            } else {
                                s.dport = *p;
                                s.flags |= slot_flag::SLOT_DST_PORT;
                            }
                        }
                    }
                    Action::EncapVxlan {
                        dst,
                        vni,
                        inner_dmac,
                        inner_smac,
                    } => {
                        if s.flags & slot_flag::SLOT_ENCAP != 0 {
                            return Err(RuleError::TwoEncaps);
                        }
                        if *vni >= 1 << 24 {
                            return Err(RuleError::BadVni(*vni));
                        }
                        let key = NexthopKey {
                            dst: *dst,
                            vni: *vni,
                            inner_dmac: *inner_dmac,
                            inner_smac: *inner_smac,
                            fabric_peer: None,
                        };
                        s.nexthop = self.acquire_nexthop(key)?;
                        s.flags |= slot_flag::SLOT_ENCAP;
                    }
                    Action::Fabric { peer } => {
                        if s.flags & slot_flag::SLOT_ENCAP != 0 {
                            return Err(RuleError::TwoEncaps);
                        }
                        if s.flags & slot_flag::SLOT_DECAP == 0 {
                            return Err(RuleError::FabricWithoutDecap);
                        }
                        // The peer takes VXLAN to the same node address as this node
                        // (the vIP group's), on the flow's own VNI: it must see the
                        // key this node saw.
                        let key = NexthopKey {
                            dst: self.node.ip,
                            vni: rule.key.vni(),
                            inner_dmac: None,
                            inner_smac: None,
                            fabric_peer: Some(*peer),
                        };
                        s.nexthop = self.acquire_nexthop(key)?;
                        s.flags |= slot_flag::SLOT_ENCAP | slot_flag::SLOT_OUTPUT;
                        s.arg = 0;
                        terminal = true;
                    }
                    Action::Count => s.flags |= slot_flag::SLOT_COUNT,
                    Action::Police { class } => {
                        s.flags |= slot_flag::SLOT_POLICE;
                        s.police = *class;
                    }
                    Action::Offload => s.flags |= slot_flag::SLOT_OFFLOAD,
                    Action::Output(p) => {
                        s.flags |= slot_flag::SLOT_OUTPUT;
                        s.arg = *p;
                        terminal = true;
                    }
                    Action::Drop { reason } => {
                        s.flags |= slot_flag::SLOT_DROP;
                        s.arg = self.reason_index(reason)?;
                        terminal = true;
                    }
                }
            }
            if !terminal {
                return Err(RuleError::NoTerminal);
            }
            if let Some(t) = rule.idle_timeout {
                s.timeout_class = self.timeout_class(t)?;
            }
            Ok(())
        })();
        match result {
            Ok(()) => Ok(s),
            Err(e) => {
                // Undo the references taken so far.
                for i in acquired_addrs {
                    self.addrs.release(i);
                }
                if s.flags & slot_flag::SLOT_ENCAP != 0 {
                    self.nexthops.release(s.nexthop);
                }
                Err(e)
            }
        }
    }

    /// Drop the references a slot holds (when its flow leaves the table).
    pub fn release(&mut self, s: &RuleSlot) {
        if s.flags & slot_flag::SLOT_SRC_ADDR != 0 {
            self.addrs.release(s.src_addr);
        }
        if s.flags & slot_flag::SLOT_DST_ADDR != 0 {
            self.addrs.release(s.dst_addr);
        }
        if s.flags & slot_flag::SLOT_ENCAP != 0 {
            self.nexthops.release(s.nexthop);
        }
    }

    /// Intern an encap target, building its outer header once.
    fn acquire_nexthop(&mut self, key: NexthopKey) -> Result<u16, RuleError> {
        let idx = self
            .nexthops
            .acquire(&key)
            .ok_or(RuleError::NexthopTableFull)?;
        if self.nexthop_cache.len() <= idx as usize {
            self.nexthop_cache.resize(idx as usize + 1, None);
        }
        self.nexthop_cache[idx as usize] = Some(Nexthop {
            encap: EncapV4::new(
                self.node.mac,
                key.fabric_peer.unwrap_or(self.node.gw_mac),
                self.node.ip.octets(),
                key.dst.octets(),
                key.vni,
            ),
            inner_dmac: key.inner_dmac,
            inner_smac: key.inner_smac,
            fabric_peer: key.fabric_peer,
        });
        Ok(idx)
    }

    fn reason_index(&mut self, reason: &str) -> Result<u8, RuleError> {
        if let Some(i) = self.reasons.iter().position(|r| r == reason) {
            return Ok(i as u8);
        }
        if self.reasons.len() > u8::MAX as usize {
            return Err(RuleError::ReasonTableFull);
        }
        self.reasons.push(reason.to_string());
        Ok((self.reasons.len() - 1) as u8)
    }

    fn timeout_class(&mut self, t: Duration) -> Result<u8, RuleError> {
        let ms = duration_ms(t);
        if let Some(i) = self.timeouts_ms.iter().position(|&x| x == ms) {
            return Ok(i as u8);
        }
        if self.timeouts_ms.len() > u8::MAX as usize {
            return Err(RuleError::TimeoutTableFull);
        }
        self.timeouts_ms.push(ms);
        Ok((self.timeouts_ms.len() - 1) as u8)
    }

    #[inline]
    pub(crate) fn addr(&self, i: u16) -> Option<&Addr> {
        self.addrs.get(i)
    }

    #[inline]
    pub(crate) fn nexthop(&self, i: u16) -> Option<&Nexthop> {
        self.nexthop_cache.get(i as usize).and_then(|n| n.as_ref())
    }

    #[inline]
    pub(crate) fn timeout_ms(&self, class: u8) -> u32 {
        self.timeouts_ms
            .get(class as usize)
            .copied()
            .unwrap_or(u32::MAX)
    }

    /// Drop-reason names, indexed as in [`crate::Stats::rule_drops`].
    pub fn reasons(&self) -> &[String] {
        &self.reasons
    }

    /// Interned addresses and next hops currently referenced.
    pub fn interned(&self) -> (usize, usize) {
        (self.addrs.live(), self.nexthops.live())
    }

    /// Rebuild the API-level action list of a compiled slot.
    pub fn decompile(&self, s: &RuleSlot) -> Actions {
        let mut out = Actions::new();
        let f = s.flags;
        let ip = |i: u16| self.addr(i).map(|a| IpAddr::from(*a));
        if f & slot_flag::SLOT_DECAP != 0 {
            out.push(Action::DecapVxlan);
        }
        if f & (slot_flag::SLOT_SRC_ADDR | slot_flag::SLOT_SRC_PORT) != 0 {
            out.push(Action::SetSrc {
                addr: (f & slot_flag::SLOT_SRC_ADDR != 0)
                    .then(|| ip(s.src_addr))
                    .flatten(),
                port: (f & slot_flag::SLOT_SRC_PORT != 0).then_some(s.sport),
            });
        }
        if f & (slot_flag::SLOT_DST_ADDR | slot_flag::SLOT_DST_PORT) != 0 {
            out.push(Action::SetDst {
                addr: (f & slot_flag::SLOT_DST_ADDR != 0)
                    .then(|| ip(s.dst_addr))
                    .flatten(),
                port: (f & slot_flag::SLOT_DST_PORT != 0).then_some(s.dport),
            });
        }
        let fabric = (f & slot_flag::SLOT_ENCAP != 0)
            .then(|| self.nexthop(s.nexthop).and_then(|n| n.fabric_peer))
            .flatten();
        if f & slot_flag::SLOT_ENCAP != 0 && fabric.is_none() {
            if let Some(n) = self.nexthop(s.nexthop) {
                out.push(Action::EncapVxlan {
                    dst: n.encap.dst().into(),
                    vni: n.encap.vni(),
                    inner_dmac: n.inner_dmac,
                    inner_smac: n.inner_smac,
                });
            }
        }
        if f & slot_flag::SLOT_COUNT != 0 {
            out.push(Action::Count);
        }
        if f & slot_flag::SLOT_POLICE != 0 {
            out.push(Action::Police { class: s.police });
        }
        if f & slot_flag::SLOT_OFFLOAD != 0 {
            out.push(Action::Offload);
        }
        // Fabric is terminal and stands for its own encap and output.
        if let Some(peer) = fabric {
            out.push(Action::Fabric { peer });
        } else if f & slot_flag::SLOT_OUTPUT != 0 {
            out.push(Action::Output(s.arg));
        }
        if f & slot_flag::SLOT_DROP != 0 {
            out.push(Action::Drop {
                reason: self
                    .reasons
                    .get(s.arg as usize)
                    .cloned()
                    .unwrap_or_default(),
            });
        }
        out
    }
}

/// Milliseconds of an idle timeout; `u32::MAX` (from `Duration::MAX` or anything past
/// 49 days) means never, since no wrapping age exceeds it.
fn duration_ms(t: Duration) -> u32 {
    t.as_millis().min(u32::MAX as u128) as u32
}

// ---- Text form: `decap; set-src 198.19.0.1:40000; encap 198.18.0.9 vni 200; out 1` ----

fn perr(what: &'static str, text: &str) -> RuleError {
    RuleError::Parse {
        what,
        text: text.to_string(),
    }
}

/// Parse `addr`, `addr:port`, `:port`, `[v6]`, `[v6]:port` or a bare v6 address.
pub fn parse_endpoint(s: &str) -> Result<(Option<IpAddr>, Option<u16>), RuleError> {
    let port = |p: &str| p.parse::<u16>().map_err(|_| perr("port", s));
    if let Some(p) = s.strip_prefix(':') {
        return Ok((None, Some(port(p)?)));
    }
    if let Some(rest) = s.strip_prefix('[') {
        let (a, after) = rest.split_once(']').ok_or_else(|| perr("endpoint", s))?;
        let a: IpAddr = a.parse().map_err(|_| perr("address", s))?;
        return match after.strip_prefix(':') {
            Some(p) => Ok((Some(a), Some(port(p)?))),
            None if after.is_empty() => Ok((Some(a), None)),
            None => Err(perr("endpoint", s)),
        };
    }
    if let Ok(a) = s.parse::<IpAddr>() {
        return Ok((Some(a), None));
    }
    let (a, p) = s.rsplit_once(':').ok_or_else(|| perr("endpoint", s))?;
    let a: Ipv4Addr = a.parse().map_err(|_| perr("address", s))?;
    Ok((Some(IpAddr::V4(a)), Some(port(p)?)))
}

fn parse_mac(s: &str) -> Result<[u8; 6], RuleError> {
    let mut m = [0u8; 6];
    let mut parts = s.split(':');
    for b in m.iter_mut() {
        let p = parts.next().ok_or_else(|| perr("mac", s))?;
        *b = u8::from_str_radix(p, 16).map_err(|_| perr("mac", s))?;
    }
    if parts.next().is_some() {
        return Err(perr("mac", s));
    }
    Ok(m)
}

impl FromStr for Action {
    type Err = RuleError;

    fn from_str(s: &str) -> Result<Self, RuleError> {
        let words: Vec<&str> = s.split_whitespace().collect();
        match words.as_slice() {
            ["decap"] => Ok(Action::DecapVxlan),
            ["set-src", ep] => {
                let (addr, port) = parse_endpoint(ep)?;
                Ok(Action::SetSrc { addr, port })
            }
            ["set-dst", ep] => {
                let (addr, port) = parse_endpoint(ep)?;
                Ok(Action::SetDst { addr, port })
            }
            ["encap", dst, "vni", vni, rest @ ..] => {
                let dst = dst.parse().map_err(|_| perr("encap destination", s))?;
                let vni = vni.parse().map_err(|_| perr("vni", s))?;
                let (mut inner_dmac, mut inner_smac) = (None, None);
                for pair in rest.chunks(2) {
                    match pair {
                        ["dmac", m] if inner_dmac.is_none() => inner_dmac = Some(parse_mac(m)?),
                        ["smac", m] if inner_smac.is_none() => inner_smac = Some(parse_mac(m)?),
                        _ => return Err(perr("encap", s)),
                    }
                }
                Ok(Action::EncapVxlan {
                    dst,
                    vni,
                    inner_dmac,
                    inner_smac,
                })
            }
            ["count"] => Ok(Action::Count),
            ["offload"] => Ok(Action::Offload),
            ["police", c] => Ok(Action::Police {
                class: c.parse().map_err(|_| perr("police class", s))?,
            }),
            ["out", p] => Ok(Action::Output(
                p.parse().map_err(|_| perr("output port", s))?,
            )),
            ["drop", reason] => Ok(Action::Drop {
                reason: reason.to_string(),
            }),
            ["fabric", m] => Ok(Action::Fabric {
                peer: parse_mac(m)?,
            }),
            _ => Err(perr("action", s)),
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ep = |a: &Option<IpAddr>, p: &Option<u16>| -> String {
            let a = match a {
                Some(IpAddr::V6(a)) if p.is_some() => format!("[{a}]"),
                Some(a) => a.to_string(),
                None => String::new(),
            };
            match p {
                Some(p) => format!("{a}:{p}"),
                None => a,
            }
        };
        match self {
            Action::DecapVxlan => write!(f, "decap"),
            Action::SetSrc { addr, port } => write!(f, "set-src {}", ep(addr, port)),
            Action::SetDst { addr, port } => write!(f, "set-dst {}", ep(addr, port)),
            Action::EncapVxlan {
                dst,
                vni,
                inner_dmac,
                inner_smac,
            } => {
                write!(f, "encap {dst} vni {vni}")?;
                for (name, mac) in [("dmac", inner_dmac), ("smac", inner_smac)] {
                    if let Some(m) = mac {
                        write!(
                            f,
                            " {name} {:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
                            m[0], m[1], m[2], m[3], m[4], m[5]
                        )?;
                    }
                }
                Ok(())
            }
            Action::Count => write!(f, "count"),
            Action::Police { class } => write!(f, "police {class}"),
            Action::Offload => write!(f, "offload"),
            Action::Output(p) => write!(f, "out {p}"),
            Action::Drop { reason } => write!(f, "drop {reason}"),
            Action::Fabric { peer: m } => write!(
                f,
                "fabric {:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
                m[0], m[1], m[2], m[3], m[4], m[5]
            ),
        }
    }
}

/// Parse a `;`-separated action list.
pub fn parse_actions(s: &str) -> Result<Vec<Action>, RuleError> {
    s.split(';')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(str::parse)
        .collect()
}

/// Format an action list in the text form [`parse_actions`] reads.
pub fn format_actions(actions: &[Action]) -> String {
    actions
        .iter()
        .map(|a| a.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

impl FromStr for FlowKey {
    type Err = RuleError;

    /// `<vni> <proto> <src>[:<sport>] > <dst>[:<dport>]`, proto one of tcp, udp, icmp,
    /// icmp6 or a number.
    fn from_str(s: &str) -> Result<Self, RuleError> {
        let w: Vec<&str> = s.split_whitespace().collect();
        let [vni, proto, src, ">", dst] = w.as_slice() else {
            return Err(perr("match", s));
        };
        let vni: u32 = vni.parse().map_err(|_| perr("vni", s))?;
        if vni >= 1 << 24 {
            return Err(RuleError::BadVni(vni));
        }
        let proto = match *proto {
            "tcp" => packet::proto::TCP,
            "udp" => packet::proto::UDP,
            "icmp" => packet::proto::ICMP,
            "icmp6" => packet::proto::ICMPV6,
            n => n.parse().map_err(|_| perr("protocol", s))?,
        };
        let (sa, sp) = parse_endpoint(src)?;
        let (da, dp) = parse_endpoint(dst)?;
        let (Some(sa), Some(da)) = (sa, da) else {
            return Err(perr("match addresses", s));
        };
        if sa.is_ipv4() != da.is_ipv4() {
            return Err(RuleError::FamilyMismatch);
        }
        Ok(FlowKey::new(
            vni,
            proto,
            sa,
            sp.unwrap_or(0),
            da,
            dp.unwrap_or(0),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> RuleContext {
        RuleContext::new(
            NodeAddr {
                ip: Ipv4Addr::new(198, 18, 0, 1),
                mac: [2, 0, 0, 0, 0, 1],
                gw_mac: [2, 0, 0, 0, 0, 2],
            },
            Duration::from_secs(300),
        )
    }

    #[test]
    fn text_round_trip() {
        let text = "decap; set-src 198.19.0.1:40000; set-dst :8080; encap 198.18.0.9 vni 200 dmac 02:00:00:00:00:09 smac 02:00:00:00:00:0a; count; police 3; offload; out 1";
        let a = parse_actions(text).unwrap();
        assert_eq!(format_actions(&a), text);
        assert_eq!(
            parse_actions("set-src [2001:2::1]:80; drop acl-deny").unwrap(),
            vec![
                Action::SetSrc {
                    addr: Some("2001:2::1".parse().unwrap()),
                    port: Some(80)
                },
                Action::Drop {
                    reason: "acl-deny".into()
                }
            ]
        );
    }

    #[test]
    fn bad_text_is_an_error() {
        for bad in [
            "set-src 1.2.3.4:99999",
            "encap x vni 1",
            "frobnicate",
            "out",
            "set-src [::1",
        ] {
            assert!(parse_actions(bad).is_err(), "{bad}");
        }
        assert!("1 tcp 1.2.3.4:1 > [::1]:2".parse::<FlowKey>().is_err());
        assert!("16777216 tcp 1.2.3.4:1 > 1.2.3.5:2"
            .parse::<FlowKey>()
            .is_err());
    }

    #[test]
    fn compile_validates_order_and_family() {
        let key: FlowKey = "5 udp 198.18.0.2:1000 > 198.19.0.1:53".parse().unwrap();
        let mut c = ctx();
        let r = |t: &str| Rule::new(key, parse_actions(t).unwrap());
        assert_eq!(c.compile(&r("count")), Err(RuleError::NoTerminal));
        assert_eq!(
            c.compile(&r("out 1; count")),
            Err(RuleError::AfterTerminal(1))
        );
        assert_eq!(
            c.compile(&r("count; decap; out 1")),
            Err(RuleError::DecapNotFirst)
        );
        assert_eq!(
            c.compile(&r("set-src [2001:2::1]:1; out 1")),
            Err(RuleError::FamilyMismatch)
        );
        assert_eq!(
            c.compile(&r("encap 198.18.0.9 vni 1; set-src :1; out 1")),
            Err(RuleError::RewriteAfterEncap)
        );
        assert_eq!(c.interned(), (0, 0), "failed compiles leak no references");
        let s = c
            .compile(&r(
                "decap; set-src 198.19.0.1:40000; encap 198.18.0.9 vni 200; out 1",
            ))
            .unwrap();
        assert_eq!(c.interned(), (1, 1));
        assert_eq!(
            format_actions(&c.decompile(&s)),
            "decap; set-src 198.19.0.1:40000; encap 198.18.0.9 vni 200; out 1"
        );
        c.release(&s);
        assert_eq!(c.interned(), (0, 0));
    }

    #[test]
    fn chained_rewrites_compose_last_wins() {
        let key: FlowKey = "5 udp 198.18.0.2:1000 > 198.19.0.1:53".parse().unwrap();
        let mut c = ctx();
        let rule = Rule::new(
            key,
            parse_actions("set-dst 198.19.0.7:80; set-dst 198.19.0.8; out 0").unwrap(),
        );
        let s = c.compile(&rule).unwrap();
        assert_eq!(
            format_actions(&c.decompile(&s)),
            "set-dst 198.19.0.8:80; out 0"
        );
        assert_eq!(c.interned(), (1, 0));
        assert_eq!(
            rule.rewritten_key().dst(),
            "198.19.0.8".parse::<IpAddr>().unwrap()
        );
        assert_eq!(rule.rewritten_key().dport(), 80);
    }

    #[test]
    fn fabric_next_hop_goes_to_the_peer_mac_on_the_flows_own_vni() {
        let key: FlowKey = "100 tcp 198.19.1.2:40000 > 198.18.200.10:80"
            .parse()
            .unwrap();
        let mut c = ctx();
        let r = |t: &str| Rule::new(key, parse_actions(t).unwrap());
        assert_eq!(
            c.compile(&r("fabric 02:00:00:00:00:0b")),
            Err(RuleError::FabricWithoutDecap)
        );
        assert_eq!(
            c.compile(&r(
                "decap; encap 198.18.0.9 vni 200; fabric 02:00:00:00:00:0b"
            )),
            Err(RuleError::TwoEncaps)
        );
        assert_eq!(
            c.compile(&r("decap; fabric 02:00:00:00:00:0b; out 1")),
            Err(RuleError::AfterTerminal(2))
        );
        assert_eq!(c.interned(), (0, 0), "failed compiles leak no references");
        let text = "decap; count; fabric 02:00:00:00:00:0b";
        let s = c.compile(&r(text)).unwrap();
        assert_eq!(format_actions(&c.decompile(&s)), text);
        let nh = *c.nexthop(s.nexthop).unwrap();
        assert_eq!(nh.fabric_peer, Some([2, 0, 0, 0, 0, 0x0b]));
        // Outer header: to the peer's MAC, from this node, to the node address itself,
        // on the flow's VNI.
        let mut frame = vec![0u8; packet::build::VXLAN_V4_OVERHEAD + 64];
        nh.encap.write(&mut frame, 64, 1234);
        assert_eq!(&frame[0..6], &[2, 0, 0, 0, 0, 0x0b]);
        assert_eq!(&frame[6..12], &[2, 0, 0, 0, 0, 1]);
        assert_eq!(&frame[26..30], &[198, 18, 0, 1]);
        assert_eq!(&frame[30..34], &[198, 18, 0, 1]);
        assert_eq!(nh.encap.vni(), 100);
        // An ordinary encap to the same address is another next hop (via the router).
        let t = c
            .compile(&r("decap; encap 198.18.0.1 vni 100; out 1"))
            .unwrap();
        assert_ne!(t.nexthop, s.nexthop);
        assert_eq!(&c.nexthop(t.nexthop).unwrap().encap.dst(), &[198, 18, 0, 1]);
        c.release(&s);
        c.release(&t);
        assert_eq!(c.interned(), (0, 0));
    }
}
