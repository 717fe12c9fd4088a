//! Stateful firewall: per-tenant ordered ACLs plus connection tracking.
//!
//! State, as declared in [`NetworkFunction::tables`], kept in platform tables
//! ([`nf::StateTables`]), which the platform snapshots, splits and merges:
//! - `acl` (shared, read): the configuration, whose compiled form answers: each tenant's
//!   ordered rules and default action. First match wins. A tenant without an ACL gets the
//!   firewall-wide `default_action` (deny unless configured otherwise). A split copies
//!   it; a merge keeps this part's.
//! - `conntrack` (per-flow): allowed flows, keyed on the key of the packet that opened
//!   them (the "original" direction), with a state; the row's platform timer is the
//!   flow's deadline, so the platform's timer forgets it.
//!
//! An allowed flow gets a pass decision without rewrites; the chain turns that into a
//! forward and a reverse rule, so replies pass at PP without asking. When a first packet
//! reaches SC for a flow conntrack knows (in either direction: PP evicted a rule, a PP
//! node restarted, the reverse rule of a one-way flow idled out) it is allowed whatever the
//! ACL says now, like Linux keeps established connections across ruleset changes.
//!
//! New flows follow Linux conntrack with `nf_conntrack_tcp_loose = 0`: only a pure SYN
//! (SYN without ACK, FIN or RST) opens a TCP flow; any other first TCP packet of an unknown
//! flow is refused as `tcp-not-syn` before the ACL is consulted, as Linux marks it INVALID
//! before the filter rules run. An ICMP error about an unknown flow is refused as
//! `icmp-unrelated`; about a known flow it passes (Linux's RELATED).
//!
//! Timeouts (seconds, all configurable), after Linux `nf_conntrack`:
//! - TCP opened by SYN: `tcp_syn_sent_s` 120, until PP reports the handshake complete
//!   ([`FlowEvent::TcpEstablished`]) or a later first packet of the flow (a re-request)
//!   carries no SYN; then `tcp_established_s` 7440. [`FlowEvent::Active`] (PP's periodic
//!   report of flows that carried traffic) refreshes the deadline in any state.
//! - PP's rules for a TCP flow not yet closing idle after `tcp_established_s` (see
//!   `rule_timeout`): PP must not cut a connection conntrack may still hold as
//!   established. The entry's deadline governs; FM withdraws PP's rules when it passes.
//! - TCP after PP reports FIN or RST ([`FlowEvent::TcpClosing`]), or a re-request carrying
//!   FIN or RST: `tcp_closing_s` 120 (Linux's TIME_WAIT).
//! - UDP: `udp_s` 180, Linux's timeout for a UDP flow that saw replies. Linux gives
//!   unreplied flows 30 s, but SC never learns whether a reply came (replies hit PP's
//!   reverse rule), and 30 s would cut quiet request/response flows.
//! - ICMP and ICMPv6: `icmp_s` 30. Other protocols: `other_s` 600 (Linux generic).
//! - Drop rules PP caches: `deny_s` 60 for `acl-deny`; `invalid_s` 10 for `tcp-not-syn`
//!   and `icmp-unrelated`, short because the drop rule also holds back a legitimate SYN
//!   on the same 5-tuple until it idles out.
//!
//! Otherwise the same timeout is the decision's idle timeout, so PP's rule and the
//! conntrack entry age alike. [`NetworkFunction::on_timer`] forgets entries past their deadline.

use std::net::IpAddr;
use std::time::Duration;

use hashbrown::HashMap;
use nf::{
    Decision, FirstPacket, FlowEvent, NetworkFunction, NfEnv, NfError, StateTables, TableSpec,
};
use packet::proto;
use pipeline::FlowKey;
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use crate::lb::MAX_TIMEOUT_S;

const ACL: &str = "acl";
const CONNTRACK: &str = "conntrack";
/// The `acl` table's one row: the configuration.
const CONFIG: &str = "config";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AclAction {
    Allow,
    Deny,
}

fn deny() -> AclAction {
    AclAction::Deny
}

/// Protocol a rule matches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AclProto {
    #[default]
    Any,
    Tcp,
    Udp,
    Icmp,
    Icmp6,
}

/// A port or an inclusive port range: `80`, `"80"` or `"1024-65535"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PortSpec {
    Port(u16),
    Text(String),
}

/// One ACL rule. Empty prefix lists and absent port ranges match anything. A rule with a
/// port range matches TCP and UDP flows only (with `proto: any`, either of them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AclRule {
    /// For logs and error messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub action: AclAction,
    #[serde(default)]
    pub proto: AclProto,
    /// Source prefixes (`198.18.0.0/15`, `2001:db8::/32`, or a bare address).
    #[serde(default)]
    pub src: Vec<String>,
    #[serde(default)]
    pub dst: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sport: Option<PortSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dport: Option<PortSpec>,
}

impl AclRule {
    pub fn new(action: AclAction) -> Self {
        AclRule {
            name: None,
            action,
            proto: AclProto::Any,
            src: Vec::new(),
            dst: Vec::new(),
            sport: None,
            dport: None,
        }
    }
}

/// One tenant's ordered ACL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantAcl {
    pub tenant: u32,
    #[serde(default)]
    pub rules: Vec<AclRule>,
    /// When no rule matches.
    #[serde(default = "deny")]
    pub default_action: AclAction,
}

/// Timeouts in seconds; see the module documentation for the defaults' origin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FwTimeouts {
    pub tcp_syn_sent_s: u64,
    pub tcp_established_s: u64,
    pub tcp_closing_s: u64,
    pub udp_s: u64,
    pub icmp_s: u64,
    pub other_s: u64,
    pub deny_s: u64,
    pub invalid_s: u64,
}

impl Default for FwTimeouts {
    fn default() -> Self {
        FwTimeouts {
            tcp_syn_sent_s: 120,
            tcp_established_s: 7440,
            tcp_closing_s: 120,
            udp_s: 180,
            icmp_s: 30,
            other_s: 600,
            deny_s: 60,
            invalid_s: 10,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FwConfig {
    #[serde(default)]
    pub tenants: Vec<TenantAcl>,
    /// For tenants without an ACL.
    #[serde(default = "deny")]
    pub default_action: AclAction,
    #[serde(default)]
    pub timeouts: FwTimeouts,
}

impl Default for FwConfig {
    fn default() -> Self {
        FwConfig {
            tenants: Vec::new(),
            default_action: AclAction::Deny,
            timeouts: FwTimeouts::default(),
        }
    }
}

impl FwConfig {
    /// Parse JSON configuration, reporting any problem as [`NfError::Config`].
    pub fn from_json(s: &str) -> Result<Self, NfError> {
        serde_json::from_str(s).map_err(|e| NfError::Config(format!("fw: {e}")))
    }
}

/// An address prefix, compiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Prefix {
    V4 { net: u32, len: u8 },
    V6 { net: u128, len: u8 },
}

impl Prefix {
    fn parse(s: &str) -> Result<Prefix, String> {
        let (addr, len) = match s.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not an address or prefix"))?;
        let bits = if addr.is_ipv4() { 32 } else { 128 };
        let len: u8 = match len {
            None => bits,
            Some(l) => match l.trim().parse::<u8>() {
                Ok(l) if l <= bits => l,
                _ => return Err(format!("{s:?}: prefix length must be 0 to {bits}")),
            },
        };
        let p = match addr {
            IpAddr::V4(a) => Prefix::V4 {
                net: u32::from(a),
                len,
            },
            IpAddr::V6(a) => Prefix::V6 {
                net: u128::from(a),
                len,
            },
        };
        // Host bits set usually means a typo in the length or the address; refusing it
        // beats silently widening or narrowing what the rule covers.
        let host_bits = match p {
            Prefix::V4 { net, len } => net & !Self::mask32(len) != 0,
            Prefix::V6 { net, len } => net & !Self::mask128(len) != 0,
        };
        if host_bits {
            return Err(format!(
                "{s:?} has host bits set (did you mean {}?)",
                p.masked()
            ));
        }
        Ok(p)
    }

    fn mask32(len: u8) -> u32 {
        u32::MAX.checked_shl(32 - len as u32).unwrap_or(0)
    }

    fn mask128(len: u8) -> u128 {
        u128::MAX.checked_shl(128 - len as u32).unwrap_or(0)
    }

    fn contains(&self, a: IpAddr) -> bool {
        match (self, a) {
            (Prefix::V4 { net, len }, IpAddr::V4(a)) => {
                let m = Self::mask32(*len);
                u32::from(a) & m == net & m
            }
            (Prefix::V6 { net, len }, IpAddr::V6(a)) => {
                let m = Self::mask128(*len);
                u128::from(a) & m == net & m
            }
            _ => false,
        }
    }

    fn masked(&self) -> String {
        match *self {
            Prefix::V4 { net, len } => {
                format!(
                    "{}/{len}",
                    std::net::Ipv4Addr::from(net & Self::mask32(len))
                )
            }
            Prefix::V6 { net, len } => {
                format!(
                    "{}/{len}",
                    std::net::Ipv6Addr::from(net & Self::mask128(len))
                )
            }
        }
    }

    fn is_v4(&self) -> bool {
        matches!(self, Prefix::V4 { .. })
    }
}

fn parse_ports(p: &PortSpec) -> Result<(u16, u16), String> {
    let (lo, hi) = match p {
        PortSpec::Port(n) => (*n, *n),
        PortSpec::Text(s) => {
            let num = |t: &str| {
                t.trim()
                    .parse::<u16>()
                    .map_err(|_| format!("{s:?}: ports are numbers from 0 to 65535"))
            };
            match s.split_once('-') {
                Some((a, b)) => (num(a)?, num(b)?),
                None => {
                    let n = num(s)?;
                    (n, n)
                }
            }
        }
    };
    if lo > hi {
        return Err(format!("range {lo}-{hi} starts above its end"));
    }
    Ok((lo, hi))
}

/// Address families a flow may have to match: (v4, v6).
type Families = (bool, bool);

fn families_of(prefixes: &[Prefix]) -> Families {
    if prefixes.is_empty() {
        return (true, true);
    }
    (
        prefixes.iter().any(|p| p.is_v4()),
        prefixes.iter().any(|p| !p.is_v4()),
    )
}

/// A rule, compiled.
#[derive(Debug, Clone)]
struct Rule {
    action: AclAction,
    proto: Option<u8>,
    src: Vec<Prefix>,
    dst: Vec<Prefix>,
    sport: Option<(u16, u16)>,
    dport: Option<(u16, u16)>,
}

impl Rule {
    fn compile(r: &AclRule, what: &str) -> Result<Rule, String> {
        let ctx = |m: String| format!("{what}: {m}");
        let prefixes = |v: &[String], field: &str| {
            v.iter()
                .map(|s| Prefix::parse(s).map_err(|e| ctx(format!("{field} {e}"))))
                .collect::<Result<Vec<_>, _>>()
        };
        let src = prefixes(&r.src, "src")?;
        let dst = prefixes(&r.dst, "dst")?;
        let ports = |p: &Option<PortSpec>, field: &str| {
            p.as_ref()
                .map(|p| parse_ports(p).map_err(|e| ctx(format!("{field} {e}"))))
                .transpose()
        };
        let sport = ports(&r.sport, "sport")?;
        let dport = ports(&r.dport, "dport")?;
        let (proto, proto_fam) = match r.proto {
            AclProto::Any => (None, (true, true)),
            AclProto::Tcp => (Some(proto::TCP), (true, true)),
            AclProto::Udp => (Some(proto::UDP), (true, true)),
            AclProto::Icmp => (Some(proto::ICMP), (true, false)),
            AclProto::Icmp6 => (Some(proto::ICMPV6), (false, true)),
        };
        if matches!(r.proto, AclProto::Icmp | AclProto::Icmp6)
            && (sport.is_some() || dport.is_some())
        {
            return Err(ctx(
                "port ranges apply to tcp and udp only, not to icmp/icmp6".into(),
            ));
        }
        let (s4, s6) = families_of(&src);
        let (d4, d6) = families_of(&dst);
        if !(s4 && d4 && proto_fam.0 || s6 && d6 && proto_fam.1) {
            return Err(ctx(
                "can never match: its src, dst and protocol share no address family \
                 (icmp is IPv4 only, icmp6 IPv6 only)"
                    .into(),
            ));
        }
        Ok(Rule {
            action: r.action,
            proto,
            src,
            dst,
            sport,
            dport,
        })
    }

    fn matches(&self, k: &FlowKey) -> bool {
        let p = k.proto();
        if self.proto.is_some_and(|want| want != p) {
            return false;
        }
        if (self.sport.is_some() || self.dport.is_some()) && p != proto::TCP && p != proto::UDP {
            return false;
        }
        let in_range = |r: Option<(u16, u16)>, v: u16| r.is_none_or(|(lo, hi)| lo <= v && v <= hi);
        let in_any = |ps: &[Prefix], a: IpAddr| ps.is_empty() || ps.iter().any(|p| p.contains(a));
        in_range(self.sport, k.sport())
            && in_range(self.dport, k.dport())
            && in_any(&self.src, k.src())
            && in_any(&self.dst, k.dst())
    }
}

#[derive(Debug, Clone)]
struct Acl {
    rules: Vec<Rule>,
    default_action: AclAction,
}

impl Acl {
    fn decide(&self, k: &FlowKey) -> AclAction {
        self.rules
            .iter()
            .find(|r| r.matches(k))
            .map_or(self.default_action, |r| r.action)
    }
}

fn compile(cfg: &FwConfig) -> Result<HashMap<u32, Acl>, NfError> {
    let err = |m: String| NfError::Config(format!("fw: {m}"));
    let t = &cfg.timeouts;
    for (name, v) in [
        ("tcp_syn_sent_s", t.tcp_syn_sent_s),
        ("tcp_established_s", t.tcp_established_s),
        ("tcp_closing_s", t.tcp_closing_s),
        ("udp_s", t.udp_s),
        ("icmp_s", t.icmp_s),
        ("other_s", t.other_s),
        ("deny_s", t.deny_s),
        ("invalid_s", t.invalid_s),
    ] {
        if !(1..=MAX_TIMEOUT_S).contains(&v) {
            return Err(err(format!(
                "timeouts.{name} = {v} s: must be from 1 to {MAX_TIMEOUT_S} s"
            )));
        }
    }
    let mut out = HashMap::new();
    for ta in &cfg.tenants {
        let rules = ta
            .rules
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let what = match &r.name {
                    Some(n) => format!("tenant {} rule {i} ({n})", ta.tenant),
                    None => format!("tenant {} rule {i}", ta.tenant),
                };
                Rule::compile(r, &what)
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        let acl = Acl {
            rules,
            default_action: ta.default_action,
        };
        if out.insert(ta.tenant, acl).is_some() {
            return Err(err(format!("tenant {} has two ACLs", ta.tenant)));
        }
    }
    Ok(out)
}

/// Connection-tracking state of a flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CtState {
    TcpSynSent,
    TcpEstablished,
    TcpClosing,
    Udp,
    Icmp,
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Conn {
    /// The tenant whose ACL admitted the flow. VNIs are per tenant, so keys of two
    /// tenants should never meet; should they, one tenant's entry must not admit the
    /// other's packets.
    tenant: u32,
    state: CtState,
    deadline_ms: u64,
}

/// Which way a first packet goes relative to the flow's original direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    Original,
    Reply,
}

/// A `conntrack` row (its deadline is the row's timer).
#[derive(Serialize, Deserialize)]
struct ConnRow {
    tenant: u32,
    state: CtState,
}

pub struct Firewall {
    cfg: FwConfig,
    /// Compiled from `cfg`, the `acl` table's row.
    acls: HashMap<u32, Acl>,
    state: StateTables,
}

fn is_pure_syn(flags: u8) -> bool {
    use packet::tcp_flags::{ACK, FIN, RST, SYN};
    flags & (SYN | ACK | FIN | RST) == SYN
}

impl Firewall {
    pub fn new(cfg: FwConfig) -> Result<Self, NfError> {
        let acls = compile(&cfg)?;
        let mut state = StateTables::create(&Self::specs())?;
        state.load(ACL, &CONFIG, &ConfigText(cfg.clone()))?;
        Ok(Firewall { cfg, acls, state })
    }

    fn specs() -> Vec<TableSpec> {
        vec![TableSpec::shared_read(ACL), TableSpec::per_flow(CONNTRACK)]
    }

    pub fn config(&self) -> &FwConfig {
        &self.cfg
    }

    /// Replace the ACLs and timeouts at runtime. Tracked connections stay allowed (as in
    /// Linux); new timeouts apply from their next refresh. A bad configuration changes
    /// nothing.
    pub fn update(&mut self, cfg: FwConfig) -> Result<(), NfError> {
        let acls = compile(&cfg)?;
        self.state.load(ACL, &CONFIG, &ConfigText(cfg.clone()))?;
        self.acls = acls;
        self.cfg = cfg;
        info!(tenants = self.acls.len(), "fw configuration updated");
        Ok(())
    }

    /// The ACL verdict for a flow of a tenant, ignoring conntrack.
    pub fn acl_action(&self, tenant: u32, key: &FlowKey) -> AclAction {
        self.acls
            .get(&tenant)
            .map_or(self.cfg.default_action, |a| a.decide(key))
    }

    /// Conntrack state of a flow, looked up in either direction.
    pub fn conn_state(&self, key: &FlowKey) -> Option<CtState> {
        self.find(key).map(|(_, _, c)| c.state)
    }

    /// When conntrack forgets a flow (ms on the group clock) unless refreshed; either
    /// direction's key.
    pub fn conn_deadline(&self, key: &FlowKey) -> Option<u64> {
        self.find(key).map(|(_, _, c)| c.deadline_ms)
    }

    pub fn conn_count(&self) -> usize {
        self.state.len(CONNTRACK).unwrap_or(0)
    }

    /// The flow a key belongs to: its original key, the key's direction, its state.
    fn find(&self, key: &FlowKey) -> Option<(FlowKey, Dir, Conn)> {
        let at = |k: &FlowKey| -> Option<Conn> {
            let (row, deadline): (ConnRow, _) = self.state.get_flow_timed(CONNTRACK, k).ok()??;
            Some(Conn {
                tenant: row.tenant,
                state: row.state,
                deadline_ms: deadline.unwrap_or(u64::MAX),
            })
        };
        if let Some(c) = at(key) {
            return Some((*key, Dir::Original, c));
        }
        let r = key.reversed();
        at(&r).map(|c| (r, Dir::Reply, c))
    }

    fn timeout(&self, s: CtState) -> Duration {
        let t = &self.cfg.timeouts;
        Duration::from_secs(match s {
            CtState::TcpSynSent => t.tcp_syn_sent_s,
            CtState::TcpEstablished => t.tcp_established_s,
            CtState::TcpClosing => t.tcp_closing_s,
            CtState::Udp => t.udp_s,
            CtState::Icmp => t.icmp_s,
            CtState::Other => t.other_s,
        })
    }

    /// The idle timeout of PP's rules for a flow in state `s`: the longest conntrack may
    /// keep it without a new first packet. A SYN-opened flow may become established, and
    /// PP's rule cannot be lengthened later, so it gets the established timeout; the
    /// entry's own deadline (`tcp_syn_sent_s`) governs until PP reports the handshake, and
    /// FM withdraws PP's rules when the timer forgets the flow.
    fn rule_timeout(&self, s: CtState) -> Duration {
        match s {
            CtState::TcpSynSent => self.timeout(CtState::TcpEstablished),
            _ => self.timeout(s),
        }
    }

    /// Track `key` in `state` from `now_ms`; returns the idle timeout for PP's rules.
    fn set(
        &mut self,
        key: FlowKey,
        tenant: u32,
        state: CtState,
        now_ms: u64,
    ) -> Result<Duration, NfError> {
        let t = self.timeout(state);
        let deadline = now_ms.saturating_add(t.as_millis() as u64);
        let row = ConnRow { tenant, state };
        self.state.put_flow_timed(CONNTRACK, &key, &row, deadline)?;
        Ok(self.rule_timeout(state))
    }

    /// [`Firewall::set`] from an event, which has no one to answer an error to.
    fn set_on_event(&mut self, key: FlowKey, tenant: u32, state: CtState, now_ms: u64) {
        if let Err(e) = self.set(key, tenant, state, now_ms) {
            warn!(%key, error = %e, "fw: conntrack refused an update");
        }
    }

    fn allow(t: Duration) -> Decision {
        Decision {
            idle_timeout: Some(t),
            ..Decision::pass()
        }
    }

    fn refuse(reason: &str, secs: u64) -> Decision {
        Decision {
            idle_timeout: Some(Duration::from_secs(secs)),
            ..Decision::drop(reason)
        }
    }

    /// State of a known TCP flow after a first packet with `flags` going `dir`; `None`
    /// when the packet opens a new connection on the 5-tuple instead.
    fn tcp_next(cur: CtState, flags: u8, dir: Dir) -> Option<CtState> {
        use packet::tcp_flags::{FIN, RST};
        if flags & (FIN | RST) != 0 {
            return Some(CtState::TcpClosing);
        }
        if is_pure_syn(flags) {
            return match (cur, dir) {
                // Port reuse after a close, as Linux reopens from TIME_WAIT.
                (CtState::TcpClosing, Dir::Original) => None,
                _ => Some(cur),
            };
        }
        // Anything else (ACK, SYN-ACK, data) means the handshake got through.
        Some(match cur {
            CtState::TcpClosing => CtState::TcpClosing,
            _ => CtState::TcpEstablished,
        })
    }

    fn new_state(p: u8) -> CtState {
        match p {
            proto::TCP => CtState::TcpSynSent,
            proto::UDP => CtState::Udp,
            proto::ICMP | proto::ICMPV6 => CtState::Icmp,
            _ => CtState::Other,
        }
    }
}

impl NetworkFunction for Firewall {
    /// One probe: a key whose reverse is tracked. (A key tracked both ways round would
    /// be two flows; `find` prefers the original direction, and so does the chain's
    /// forward run.)
    fn knows_reply(&self, key: &FlowKey) -> bool {
        let r = key.reversed();
        self.state.timer(CONNTRACK, &r).ok().flatten().is_some() && r != *key
    }

    fn kind(&self) -> &str {
        "fw"
    }

    fn tables(&self) -> Vec<TableSpec> {
        Self::specs()
    }

    nf::platform_state!(self.state);

    fn first_packet(&mut self, pkt: &FirstPacket, env: &mut NfEnv) -> Result<Decision, NfError> {
        let key = pkt.key;
        let now = env.now_ms;
        let is_tcp = key.proto() == proto::TCP;
        if let Some((orig, dir, conn)) = self.find(&key).filter(|(_, _, c)| c.tenant == pkt.tenant)
        {
            let cur = conn.state;
            if pkt.meta.icmp_error {
                // RELATED: let the error through without touching the flow's state.
                return Ok(Self::allow(self.rule_timeout(cur)));
            }
            let next = if is_tcp {
                Self::tcp_next(cur, pkt.meta.tcp_flags, dir)
            } else {
                Some(cur)
            };
            if let Some(next) = next {
                return Ok(Self::allow(self.set(orig, conn.tenant, next, now)?));
            }
            // A fresh SYN on a closing flow's 5-tuple: a new connection, judged anew.
            self.state.delete_flow(CONNTRACK, &orig)?;
        }
        if pkt.meta.icmp_error {
            debug!(%key, "fw: ICMP error for an unknown flow");
            return Ok(Self::refuse("icmp-unrelated", self.cfg.timeouts.invalid_s));
        }
        if is_tcp && !is_pure_syn(pkt.meta.tcp_flags) {
            debug!(%key, flags = pkt.meta.tcp_flags, "fw: TCP flow does not start with SYN");
            return Ok(Self::refuse("tcp-not-syn", self.cfg.timeouts.invalid_s));
        }
        match self.acl_action(pkt.tenant, &key) {
            AclAction::Deny => {
                debug!(%key, tenant = pkt.tenant, "fw: denied");
                Ok(Self::refuse("acl-deny", self.cfg.timeouts.deny_s))
            }
            AclAction::Allow => {
                let t = self.set(key, pkt.tenant, Self::new_state(key.proto()), now)?;
                debug!(%key, tenant = pkt.tenant, "fw: allowed");
                Ok(Self::allow(t))
            }
        }
    }

    fn on_event(&mut self, ev: &FlowEvent, env: &mut NfEnv) {
        match ev {
            FlowEvent::TcpClosing { key } => {
                if key.proto() != proto::TCP {
                    return;
                }
                if let Some((orig, _, c)) = self.find(key) {
                    self.set_on_event(orig, c.tenant, CtState::TcpClosing, env.now_ms);
                }
            }
            FlowEvent::TcpEstablished { key } => {
                if key.proto() != proto::TCP {
                    return;
                }
                // Only SYN_SENT moves: a closing flow stays closing, whatever arrives late.
                if let Some((orig, _, c)) = self.find(key) {
                    if c.state == CtState::TcpSynSent {
                        self.set_on_event(orig, c.tenant, CtState::TcpEstablished, env.now_ms);
                    }
                }
            }
            FlowEvent::Active { key } => {
                if let Some((orig, _, c)) = self.find(key) {
                    self.set_on_event(orig, c.tenant, c.state, env.now_ms);
                }
            }
            // PP forgetting one direction's rule does not end the flow: the other may be
            // busy, and a late reply must still find it. The deadline governs.
            FlowEvent::Expired { .. } => {}
            // Traffic counts are the monitor's; they change no connection state.
            FlowEvent::Counters { .. } => {}
        }
    }

    /// The platform's restore, then the ACL compiled from the snapshot's configuration;
    /// a snapshot that fails either changes nothing.
    fn restore(&mut self, snapshot: &[u8]) -> Result<(), NfError> {
        let mut next = StateTables::create(&Self::specs())?;
        next.restore(snapshot)?;
        let cfg: ConfigText = (next.get(ACL, &CONFIG))
            .map_err(|e| NfError::Snapshot(format!("fw: {e}")))?
            .ok_or_else(|| NfError::Snapshot("fw: the snapshot has no configuration".into()))?;
        let acls = compile(&cfg.0)
            .map_err(|e| NfError::Snapshot(format!("fw: configuration in snapshot: {e}")))?;
        (self.cfg, self.acls, self.state) = (cfg.0, acls, next);
        Ok(())
    }
}

/// The configuration in a snapshot. Its serde form (untagged port specs, skipped
/// fields) needs a self-describing format, so the binary form carries it as JSON text.
struct ConfigText(FwConfig);

impl Serialize for ConfigText {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            self.0.serialize(s)
        } else {
            let t = serde_json::to_string(&self.0).map_err(serde::ser::Error::custom)?;
            s.serialize_str(&t)
        }
    }
}

impl<'de> Deserialize<'de> for ConfigText {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            FwConfig::deserialize(d).map(ConfigText)
        } else {
            let t = String::deserialize(d)?;
            serde_json::from_str(&t)
                .map(ConfigText)
                .map_err(serde::de::Error::custom)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes() {
        let p = Prefix::parse("198.18.0.0/15").unwrap();
        assert!(p.contains("198.19.255.255".parse().unwrap()));
        assert!(!p.contains("198.20.0.0".parse().unwrap()));
        assert!(!p.contains("::ffff:198.18.0.1".parse().unwrap()));
        assert!(Prefix::parse("0.0.0.0/0")
            .unwrap()
            .contains("1.2.3.4".parse().unwrap()));
        assert!(Prefix::parse("::/0")
            .unwrap()
            .contains("2001:db8::1".parse().unwrap()));
        let e = Prefix::parse("198.18.0.1/15").unwrap_err();
        assert!(e.contains("198.18.0.0/15"), "{e}");
        assert!(Prefix::parse("198.18.0.0/33").is_err());
        assert!(Prefix::parse("2001:db8::/129").is_err());
        assert!(Prefix::parse("nonsense").is_err());
        assert_eq!(
            Prefix::parse("2001:db8::1").unwrap(),
            Prefix::V6 {
                net: u128::from("2001:db8::1".parse::<std::net::Ipv6Addr>().unwrap()),
                len: 128
            }
        );
    }

    #[test]
    fn ports() {
        assert_eq!(parse_ports(&PortSpec::Port(80)), Ok((80, 80)));
        assert_eq!(
            parse_ports(&PortSpec::Text("1024-65535".into())),
            Ok((1024, 65535))
        );
        assert!(parse_ports(&PortSpec::Text("2000-1000".into())).is_err());
        assert!(parse_ports(&PortSpec::Text("70000".into())).is_err());
        assert!(parse_ports(&PortSpec::Text("-".into())).is_err());
    }
}
