//! Source NAT with ports (NAPT, v4 or v6) as an NF, following RFC 4787 (UDP), RFC 5382
//! (TCP) and RFC 5508 (ICMP).
//!
//! State, in the design's words:
//! - the **PortPool**: per (pool address, protocol) a bitmap of the ports this partition
//!   may still hand out. Shared by every flow, written on allocation, so it is
//!   shared-write with *partitioned* consistency: a split gives each side half of the
//!   *free* ports (paper 000 §4.1: `<addr, 1024-4096>` becomes two ranges), and a merge
//!   takes their union. Ports in use are in nobody's free set; they belong to the
//!   mapping that uses them.
//! - the **mappings**: internal endpoint → external endpoint. Under endpoint-independent
//!   mapping one mapping serves every flow of an internal endpoint, so it is shared state
//!   (declared shared-write, partitioned); under endpoint-dependent mapping each mapping
//!   serves one remote endpoint and is declared per-flow.
//! - the **address pairing**: internal address → the pool address its mappings use
//!   (RFC 4787 REQ-2).
//! - the **flows**: per-flow entries with the rewrites handed to PP, the TCP state and the
//!   expiry deadline.
//!
//! SC only sees a flow's first packet (and FIN/RST and expiry events from PP), which
//! shapes three choices documented in `docs/nf-api.md`: TCP flows are timed with the
//! established timeout until PP reports FIN/RST, inbound unsolicited traffic is refused,
//! and a mapping copied to both sides of a split keeps its port reserved until the
//! copies are merged again (weighted reference counting).

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use nf::{
    Consistency, Decision, DetRng, Endpoint, FirstPacket, FlowEvent, MergeDecoder, NetworkFunction,
    NfEnv, NfError, PreparedPart, Rewrite, SplitHalf, TableSpec,
};
use packet::proto;
use pipeline::FlowKey;
// hashbrown's default hasher (foldhash) rather than SipHash: splits and merges of a
// partition hash every flow key and endpoint several times (docs/scaling.md).
use hashbrown::HashMap;
use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

/// Drop reasons this NF gives, as PP counts them (`rule:<reason>`).
pub mod reason {
    /// No free port left for the flow's protocol in its pool.
    pub const EXHAUSTED: &str = "snat-exhausted";
    /// Inbound to a pool address where no mapping lives.
    pub const NO_MAPPING: &str = "snat-no-mapping";
    /// Inbound to a live mapping from an endpoint the internal host never contacted
    /// (address-and-port-dependent filtering, RFC 4787 §5).
    pub const FILTERED: &str = "snat-filtered";
    /// An ICMP error about a flow this NAT does not know; errors never create state.
    pub const ICMP_ERROR_UNKNOWN_FLOW: &str = "snat-icmp-error-unknown-flow";
    /// A TCP flow whose first packet is FIN, RST or SYN-ACK: nothing to translate.
    pub const TCP_INVALID: &str = "snat-tcp-invalid";
    /// An ICMP echo reply (or other id-less message) from inside with no flow.
    pub const ICMP_NOT_REQUEST: &str = "snat-icmp-not-request";
    /// Not TCP, UDP or ICMP of the address family: no port to translate.
    pub const UNSUPPORTED_PROTOCOL: &str = "snat-unsupported-protocol";
}

// ---------------------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------------------

/// How a pool maps an internal endpoint to external ones (RFC 4787 §4.1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MappingBehaviour {
    /// One external endpoint per internal endpoint, whatever it talks to (REQ-1).
    #[default]
    EndpointIndependent,
    /// One external endpoint per (internal endpoint, remote endpoint): address-and-port
    /// dependent mapping. Uses a port per flow; ports are still never overloaded.
    EndpointDependent,
}

/// Inclusive port range `lo..=hi`. For ICMP the same range holds echo identifiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PortRange {
    pub lo: u16,
    pub hi: u16,
}

impl Default for PortRange {
    /// RFC 6056 §3.2: the whole 1024–65535 range, so random choice has room to hide in.
    fn default() -> Self {
        PortRange {
            lo: 1024,
            hi: 65535,
        }
    }
}

/// A set of public addresses sharing a port range and a mapping behaviour.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnatPool {
    /// Public addresses, all of one family.
    pub addresses: Vec<IpAddr>,
    #[serde(default)]
    pub ports: PortRange,
    #[serde(default)]
    pub mapping: MappingBehaviour,
    /// Internal sources this pool translates, as prefixes (`10.0.0.0/8`, `2001:db8::/32`,
    /// or a bare address). Empty: every source of the pool's family. Naming the inside
    /// explicitly is also what enables hairpinning: a packet to a pool address is
    /// hairpinned only when its source is in some pool's `sources`; otherwise it is taken
    /// as inbound from outside and refused.
    #[serde(default)]
    pub sources: Vec<String>,
}

impl SnatPool {
    /// A pool with endpoint-independent mapping translating every source.
    pub fn new(addresses: Vec<IpAddr>, lo: u16, hi: u16) -> Self {
        SnatPool {
            addresses,
            ports: PortRange { lo, hi },
            mapping: MappingBehaviour::EndpointIndependent,
            sources: Vec::new(),
        }
    }

    pub fn endpoint_dependent(mut self) -> Self {
        self.mapping = MappingBehaviour::EndpointDependent;
        self
    }

    pub fn sources(mut self, prefixes: &[&str]) -> Self {
        self.sources = prefixes.iter().map(|s| s.to_string()).collect();
        self
    }
}

/// Idle timeouts in seconds. Defaults are the RFC recommendations; values below the
/// RFC minimums are accepted (tests and labs want them) but logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SnatTimeouts {
    /// RFC 4787 REQ-5: at least 2 min, 5 min recommended.
    pub udp_s: u64,
    /// RFC 5382 REQ-5: at least 2 h 4 min.
    pub tcp_established_s: u64,
    /// RFC 5382 REQ-5: partially open or closed connections, at least 4 min.
    pub tcp_transitory_s: u64,
    /// RFC 5508 REQ-2: at least 60 s.
    pub icmp_s: u64,
}

impl Default for SnatTimeouts {
    fn default() -> Self {
        SnatTimeouts {
            udp_s: 300,
            tcp_established_s: 7440,
            tcp_transitory_s: 240,
            icmp_s: 60,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnatConfig {
    /// A source uses the first pool of its family whose `sources` contain it.
    pub pools: Vec<SnatPool>,
    #[serde(default)]
    pub timeouts: SnatTimeouts,
}

impl SnatConfig {
    pub fn new(pools: Vec<SnatPool>) -> Self {
        SnatConfig {
            pools,
            timeouts: SnatTimeouts::default(),
        }
    }
}

/// An address prefix, parsed once at construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Prefix {
    bits: u128,
    mask: u128,
    v4: bool,
}

fn addr_bits(a: IpAddr) -> (u128, bool) {
    match a {
        IpAddr::V4(a) => (u128::from(u32::from(a)), true),
        IpAddr::V6(a) => (u128::from(a), false),
    }
}

impl Prefix {
    fn parse(s: &str) -> Result<Prefix, String> {
        let (a, len) = match s.split_once('/') {
            Some((a, l)) => (a, Some(l)),
            None => (s, None),
        };
        let addr: IpAddr = a
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not an address or prefix"))?;
        let (bits, v4) = addr_bits(addr);
        let max: u8 = if v4 { 32 } else { 128 };
        let len = match len {
            None => max,
            Some(l) => l
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|&n| n <= max)
                .ok_or_else(|| format!("{s:?}: prefix length must be 0..={max}"))?,
        };
        let mask = if len == 0 {
            0
        } else {
            (!0u128 << (128 - u32::from(len))) >> (128 - u32::from(max))
        };
        if bits & !mask != 0 {
            return Err(format!(
                "{s:?} has host bits set beyond /{len}; write the network address"
            ));
        }
        Ok(Prefix { bits, mask, v4 })
    }

    fn contains(&self, a: IpAddr) -> bool {
        let (bits, v4) = addr_bits(a);
        v4 == self.v4 && bits & self.mask == self.bits
    }
}

/// A validated pool.
#[derive(Debug, Clone)]
struct Pool {
    addrs: Vec<IpAddr>,
    lo: u16,
    hi: u16,
    mapping: MappingBehaviour,
    sources: Vec<Prefix>,
    v4: bool,
}

impl Pool {
    fn serves(&self, src: IpAddr) -> bool {
        src.is_ipv4() == self.v4
            && (self.sources.is_empty() || self.sources.iter().any(|p| p.contains(src)))
    }

    fn protos(&self) -> [u8; 3] {
        let icmp = if self.v4 { proto::ICMP } else { proto::ICMPV6 };
        [proto::TCP, proto::UDP, icmp]
    }
}

/// The configuration, checked and indexed.
#[derive(Debug, Clone)]
struct Plan {
    pools: Vec<Pool>,
    pool_of: HashMap<IpAddr, usize>,
    timeouts: SnatTimeouts,
}

impl Plan {
    fn new(cfg: &SnatConfig) -> Result<Plan, NfError> {
        fn err<T>(m: String) -> Result<T, NfError> {
            Err(NfError::Config(format!("snat: {m}")))
        }
        if cfg.pools.is_empty() {
            return err("needs at least one pool".into());
        }
        let mut pools = Vec::with_capacity(cfg.pools.len());
        let mut pool_of = HashMap::new();
        for (i, p) in cfg.pools.iter().enumerate() {
            let Some(&first) = p.addresses.first() else {
                return err(format!("pool {i} has no addresses"));
            };
            let v4 = first.is_ipv4();
            for &a in &p.addresses {
                if a.is_ipv4() != v4 {
                    return err(format!(
                        "pool {i} mixes IPv4 and IPv6 addresses ({first} and {a}); use one pool per family"
                    ));
                }
                if a.is_unspecified() || a.is_multicast() || a == IpAddr::from([255, 255, 255, 255])
                {
                    return err(format!("pool {i}: {a} cannot be a source address"));
                }
                if pool_of.insert(a, i).is_some() {
                    return err(format!("address {a} is listed more than once"));
                }
            }
            let PortRange { lo, hi } = p.ports;
            if lo == 0 {
                return err(format!(
                    "pool {i}: port 0 cannot be allocated; start the range at 1 or above"
                ));
            }
            if lo > hi {
                return err(format!(
                    "pool {i}: port range {lo}..={hi} is empty (lo > hi)"
                ));
            }
            let mut sources = Vec::with_capacity(p.sources.len());
            for s in &p.sources {
                let pfx = Prefix::parse(s).or_else(|m| err(format!("pool {i}: source {m}")))?;
                if pfx.v4 != v4 {
                    return err(format!(
                        "pool {i}: source {s} is not of the pool's address family"
                    ));
                }
                sources.push(pfx);
            }
            pools.push(Pool {
                addrs: p.addresses.clone(),
                lo,
                hi,
                mapping: p.mapping,
                sources,
                v4,
            });
        }
        let t = cfg.timeouts;
        for (name, v, rfc_min) in [
            ("udp_s", t.udp_s, 120),
            ("tcp_established_s", t.tcp_established_s, 7440),
            ("tcp_transitory_s", t.tcp_transitory_s, 240),
            ("icmp_s", t.icmp_s, 60),
        ] {
            if v == 0 {
                return err(format!("timeout {name} must be at least 1 s"));
            }
            if v < rfc_min {
                warn!(
                    timeout = name,
                    seconds = v,
                    rfc_minimum = rfc_min,
                    "snat timeout below the RFC minimum"
                );
            }
        }
        Ok(Plan {
            pools,
            pool_of,
            timeouts: t,
        })
    }

    fn is_pool_addr(&self, a: IpAddr) -> bool {
        self.pool_of.contains_key(&a)
    }

    /// The pool translating `src`, if any.
    fn pool_for(&self, src: IpAddr) -> Option<usize> {
        self.pools.iter().position(|p| p.serves(src))
    }

    /// `src` is named as inside by some pool's explicit `sources`.
    fn is_inside(&self, src: IpAddr) -> bool {
        self.pools
            .iter()
            .any(|p| !p.sources.is_empty() && p.serves(src))
    }

    fn timeout_ms(&self, s: FlowState) -> u64 {
        let t = &self.timeouts;
        let secs = match s {
            FlowState::Udp => t.udp_s,
            FlowState::Icmp => t.icmp_s,
            FlowState::TcpOpen => t.tcp_established_s,
            FlowState::TcpClosing => t.tcp_transitory_s,
        };
        secs.saturating_mul(1000)
    }

    fn empty_pool(&self) -> PortPool {
        let mut sets = HashMap::new();
        for p in &self.pools {
            for &a in &p.addrs {
                for pr in p.protos() {
                    sets.insert((a, pr), PortSet::empty(p.lo, p.hi));
                }
            }
        }
        PortPool { sets }
    }

    fn full_pool(&self) -> PortPool {
        let mut pool = self.empty_pool();
        for s in pool.sets.values_mut() {
            s.fill();
        }
        pool
    }
}

// ---------------------------------------------------------------------------------------
// PortPool
// ---------------------------------------------------------------------------------------

/// Random probes before falling back to a scan. At 95 % occupancy 16 probes still find a
/// port 56 % of the time; the scan keeps the tail bounded and allocation exact.
pub const PROBES: usize = 16;

/// Free ports of one (pool address, protocol), one bit per port of the range.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PortSet {
    lo: u16,
    hi: u16,
    bits: Vec<u64>,
    free: u32,
}

impl PortSet {
    fn empty(lo: u16, hi: u16) -> Self {
        let len = u32::from(hi) - u32::from(lo) + 1;
        PortSet {
            lo,
            hi,
            bits: vec![0; len.div_ceil(64) as usize],
            free: 0,
        }
    }

    fn len(&self) -> u32 {
        u32::from(self.hi) - u32::from(self.lo) + 1
    }

    fn fill(&mut self) {
        let len = self.len();
        for w in self.bits.iter_mut() {
            *w = !0;
        }
        let tail = len % 64;
        if tail != 0 {
            if let Some(last) = self.bits.last_mut() {
                *last = (1u64 << tail) - 1;
            }
        }
        self.free = len;
    }

    fn index(&self, port: u16) -> Option<usize> {
        (port >= self.lo && port <= self.hi).then(|| usize::from(port - self.lo))
    }

    fn port_at(&self, i: usize) -> u16 {
        // i < len <= 65535, so this neither truncates nor overflows.
        self.lo.wrapping_add(i as u16)
    }

    fn is_free(&self, port: u16) -> bool {
        self.index(port)
            .and_then(|i| self.bits.get(i / 64).map(|w| w >> (i % 64) & 1 == 1))
            .unwrap_or(false)
    }

    /// Mark in use; false if it was not free.
    fn take(&mut self, port: u16) -> bool {
        let Some(i) = self.index(port) else {
            return false;
        };
        match self.bits.get_mut(i / 64) {
            Some(w) if *w >> (i % 64) & 1 == 1 => {
                *w &= !(1u64 << (i % 64));
                self.free -= 1;
                true
            }
            _ => false,
        }
    }

    /// Mark free; false if outside the range or already free.
    fn put(&mut self, port: u16) -> bool {
        let Some(i) = self.index(port) else {
            return false;
        };
        match self.bits.get_mut(i / 64) {
            Some(w) if *w >> (i % 64) & 1 == 0 => {
                *w |= 1u64 << (i % 64);
                self.free += 1;
                true
            }
            _ => false,
        }
    }

    /// The first free index at or after `start`, wrapping around.
    fn first_free_from(&self, start: usize) -> Option<usize> {
        let n = self.bits.len();
        let (w0, b0) = (start / 64, (start % 64) as u32);
        let head = self.bits.get(w0)? & (!0u64 << b0);
        if head != 0 {
            return Some(w0 * 64 + head.trailing_zeros() as usize);
        }
        for k in 1..=n {
            let w = (w0 + k) % n;
            let mut word = self.bits[w];
            if w == w0 {
                word &= (1u64 << b0).wrapping_sub(1);
            }
            if word != 0 {
                return Some(w * 64 + word.trailing_zeros() as usize);
            }
        }
        None
    }

    fn free_ports(&self) -> impl Iterator<Item = u16> + '_ {
        self.bits.iter().enumerate().flat_map(move |(wi, &w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                (w != 0).then(|| {
                    let b = w.trailing_zeros() as usize;
                    w &= w - 1;
                    self.port_at(wi * 64 + b)
                })
            })
        })
    }

    fn ranges(&self) -> Vec<[u16; 2]> {
        let mut out: Vec<[u16; 2]> = Vec::new();
        for p in self.free_ports() {
            match out.last_mut() {
                Some(r) if u32::from(r[1]) + 1 == u32::from(p) => r[1] = p,
                _ => out.push([p, p]),
            }
        }
        out
    }

    /// Pick a port: the wanted one if free (port preservation), else uniformly random
    /// among free ones (RFC 6056 §3.3.1 style) by probing, then by a scan from a random
    /// point. `None` only when nothing is free.
    fn alloc(&mut self, want: u16, rng: &mut DetRng, stats: &mut SnatStats) -> Option<u16> {
        if self.free == 0 {
            return None;
        }
        if self.take(want) {
            stats.ports_preserved += 1;
            return Some(want);
        }
        let len = u64::from(self.len());
        for tries in 0..PROBES {
            let port = self.port_at(rng.below(len) as usize);
            stats.random_probes += 1;
            if self.take(port) {
                stats.probe_histogram[tries] += 1;
                return Some(port);
            }
        }
        let i = self.first_free_from(rng.below(len) as usize)?;
        let port = self.port_at(i);
        if !self.take(port) {
            return None;
        }
        stats.probe_histogram[PROBES] += 1;
        Some(port)
    }

    /// Give away the upper half (by count) of the free ports.
    fn split_upper_half(&mut self) -> PortSet {
        let mut moved = PortSet::empty(self.lo, self.hi);
        let keep = self.free - self.free / 2;
        let upper: Vec<u16> = self.free_ports().skip(keep as usize).collect();
        for p in upper {
            self.take(p);
            moved.put(p);
        }
        moved
    }
}

/// The free ports of every (pool address, protocol) this partition owns.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PortPool {
    sets: HashMap<(IpAddr, u8), PortSet>,
}

impl PortPool {
    fn free_count(&self, addr: IpAddr, proto: u8) -> u32 {
        self.sets.get(&(addr, proto)).map_or(0, |s| s.free)
    }

    fn is_free(&self, e: &ExternalEndpoint) -> bool {
        self.sets
            .get(&(e.addr, e.proto))
            .is_some_and(|s| s.is_free(e.port))
    }

    fn put(&mut self, e: &ExternalEndpoint) -> bool {
        self.sets
            .get_mut(&(e.addr, e.proto))
            .is_some_and(|s| s.put(e.port))
    }
}

// ---------------------------------------------------------------------------------------
// Mappings and flows
// ---------------------------------------------------------------------------------------

/// A translated endpoint: what the outside sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ExternalEndpoint {
    pub addr: IpAddr,
    pub port: u16,
    pub proto: u8,
}

/// What a mapping is for: an internal endpoint, and under endpoint-dependent mapping the
/// remote endpoint too. The VNI keeps overlapping tenant VPCs apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MappingKey {
    pub vni: u32,
    pub proto: u8,
    pub addr: IpAddr,
    pub port: u16,
    pub remote: Option<(IpAddr, u16)>,
}

/// A mapping as [`Snat::mappings`] shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MappingInfo {
    pub key: MappingKey,
    pub external: ExternalEndpoint,
    /// Flows of this partition translating through it (hairpin flows count on both the
    /// mapping they leave by and the one they reach).
    pub flows: u32,
    /// This partition holds every copy of the mapping, so it frees the port when the last
    /// flow goes. A mapping shared with another partition by a split holds its port until
    /// the copies are merged.
    pub sole_owner: bool,
}

/// Every copy of a mapping together weighs this much; a split divides the weight. Only a
/// copy holding all of it may free the port, so a port never returns to a free set while
/// some other partition still translates through it.
const FULL_WEIGHT: u64 = 1 << 62;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Mapping {
    key: MappingKey,
    flows: u32,
    weight: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum FlowState {
    Udp,
    Icmp,
    TcpOpen,
    TcpClosing,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct FlowEntry {
    /// The mapping the flow's source is translated to.
    own: ExternalEndpoint,
    /// Hairpin flows: the mapping of the internal host they reach.
    peer: Option<ExternalEndpoint>,
    forward: Rewrite,
    reverse: Rewrite,
    state: FlowState,
    deadline_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pairing {
    external: IpAddr,
    /// Mappings of the internal address in this partition; the pairing goes with the last.
    mappings: u32,
}

/// Counters of one partition; a merge sums them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SnatStats {
    pub flows_created: u64,
    /// Flows removed by the timer.
    pub flows_expired: u64,
    /// Flows removed because PP reported their rules gone.
    pub flows_ended: u64,
    /// Requests for flows already decided (PP and FM lost the rule): answered from state.
    pub replayed: u64,
    pub mappings_created: u64,
    /// New flows that joined an existing mapping (endpoint-independent mapping at work).
    pub mappings_reused: u64,
    pub mappings_released: u64,
    pub ports_preserved: u64,
    /// Mappings placed on another address because the paired one was out of ports.
    pub pairing_fallbacks: u64,
    pub hairpinned: u64,
    /// Flows passed untranslated: source served by no pool, or a pool address itself.
    pub untranslated: u64,
    /// Drops.
    pub exhausted: u64,
    pub refused_inbound: u64,
    pub icmp_error_unknown: u64,
    pub invalid: u64,
    pub unsupported_protocol: u64,
    /// Random probes made by the allocator, successful or not.
    pub random_probes: u64,
    /// Allocations by the number of failed random probes before success; the last slot
    /// counts allocations that needed the scan.
    pub probe_histogram: [u64; PROBES + 1],
    /// Flows two merged partitions both had; the incoming copy was dropped.
    pub merge_conflicts: u64,
}

impl SnatStats {
    fn add(&mut self, o: &SnatStats) {
        let pairs = [
            (&mut self.flows_created, o.flows_created),
            (&mut self.flows_expired, o.flows_expired),
            (&mut self.flows_ended, o.flows_ended),
            (&mut self.replayed, o.replayed),
            (&mut self.mappings_created, o.mappings_created),
            (&mut self.mappings_reused, o.mappings_reused),
            (&mut self.mappings_released, o.mappings_released),
            (&mut self.ports_preserved, o.ports_preserved),
            (&mut self.pairing_fallbacks, o.pairing_fallbacks),
            (&mut self.hairpinned, o.hairpinned),
            (&mut self.untranslated, o.untranslated),
            (&mut self.exhausted, o.exhausted),
            (&mut self.refused_inbound, o.refused_inbound),
            (&mut self.icmp_error_unknown, o.icmp_error_unknown),
            (&mut self.invalid, o.invalid),
            (&mut self.unsupported_protocol, o.unsupported_protocol),
            (&mut self.random_probes, o.random_probes),
            (&mut self.merge_conflicts, o.merge_conflicts),
        ];
        for (a, b) in pairs {
            *a = a.saturating_add(b);
        }
        for (a, b) in self.probe_histogram.iter_mut().zip(o.probe_histogram) {
            *a = a.saturating_add(b);
        }
    }
}

/// Replies are looked up without their VNI: a chain that re-encapsulates changes it, and
/// the translated key is unique without it (it holds the flow's own external port).
fn reply_key(translated: &FlowKey) -> FlowKey {
    let mut r = translated.reversed();
    r.set_vni(0);
    r
}

fn timer_entry(deadline: u64, k: &FlowKey) -> (u64, [u8; 40]) {
    (deadline, *k.as_bytes())
}

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

/// All NF state of one partition.
#[derive(Debug, Clone)]
struct State {
    ports: PortPool,
    mappings: HashMap<ExternalEndpoint, Mapping>,
    by_internal: HashMap<MappingKey, ExternalEndpoint>,
    pairings: HashMap<(u32, IpAddr), Pairing>,
    flows: HashMap<FlowKey, FlowEntry>,
    by_reply: HashMap<FlowKey, FlowKey>,
    timers: BTreeSet<(u64, [u8; 40])>,
    stats: SnatStats,
}

impl State {
    fn new(ports: PortPool) -> Self {
        State {
            ports,
            mappings: HashMap::new(),
            by_internal: HashMap::new(),
            pairings: HashMap::new(),
            flows: HashMap::new(),
            by_reply: HashMap::new(),
            timers: BTreeSet::new(),
            stats: SnatStats::default(),
        }
    }

    /// The flow a key (either direction) belongs to.
    fn resolve(&self, key: &FlowKey) -> Option<FlowKey> {
        if self.flows.contains_key(key) {
            return Some(*key);
        }
        let mut k = *key;
        k.set_vni(0);
        self.by_reply.get(&k).copied()
    }

    fn insert_flow(&mut self, key: FlowKey, f: FlowEntry) {
        let translated = f.forward.apply(&key);
        self.by_reply.insert(reply_key(&translated), key);
        self.timers.insert(timer_entry(f.deadline_ms, &key));
        if let Some(m) = self.mappings.get_mut(&f.own) {
            m.flows = m.flows.saturating_add(1);
        }
        if let Some(p) = f.peer {
            if let Some(m) = self.mappings.get_mut(&p) {
                m.flows = m.flows.saturating_add(1);
            }
        }
        self.flows.insert(key, f);
    }

    /// Remove a flow and its references; frees ports whose last flow it was.
    fn remove_flow(&mut self, key: &FlowKey) -> Option<FlowEntry> {
        let f = self.flows.remove(key)?;
        self.timers.remove(&timer_entry(f.deadline_ms, key));
        let rk = reply_key(&f.forward.apply(key));
        if self.by_reply.get(&rk) == Some(key) {
            self.by_reply.remove(&rk);
        }
        self.release(&f.own);
        if let Some(p) = f.peer {
            self.release(&p);
        }
        Some(f)
    }

    fn set_deadline(&mut self, key: &FlowKey, deadline: u64) {
        if let Some(f) = self.flows.get_mut(key) {
            self.timers.remove(&timer_entry(f.deadline_ms, key));
            f.deadline_ms = deadline;
            self.timers.insert(timer_entry(deadline, key));
        }
    }

    fn release(&mut self, ext: &ExternalEndpoint) {
        let Some(m) = self.mappings.get_mut(ext) else {
            return;
        };
        m.flows = m.flows.saturating_sub(1);
        if m.flows == 0 && m.weight >= FULL_WEIGHT {
            self.free_mapping(ext);
        }
    }

    /// Drop a mapping and return its port to the pool.
    fn free_mapping(&mut self, ext: &ExternalEndpoint) {
        let Some(m) = self.mappings.remove(ext) else {
            return;
        };
        if self.by_internal.get(&m.key) == Some(ext) {
            self.by_internal.remove(&m.key);
        }
        let pk = (m.key.vni, m.key.addr);
        if let Some(p) = self.pairings.get_mut(&pk) {
            p.mappings = p.mappings.saturating_sub(1);
            if p.mappings == 0 {
                self.pairings.remove(&pk);
            }
        }
        if !self.ports.put(ext) {
            // A port outside the pool or already free means state was corrupted upstream;
            // keep going rather than take the NAT down, but say so.
            warn!(?ext, "snat: freed a port that was not in use");
        }
        self.stats.mappings_released += 1;
    }

    /// Rebuild pairing counts from the mappings (after bulk changes).
    fn recount_pairings(&mut self) {
        for p in self.pairings.values_mut() {
            p.mappings = 0;
        }
        for m in self.mappings.values() {
            if let Some(p) = self.pairings.get_mut(&(m.key.vni, m.key.addr)) {
                p.mappings += 1;
            }
        }
        self.pairings.retain(|_, p| p.mappings > 0);
    }

    /// Rebuild the internal-endpoint index, preferring the lowest external endpoint when
    /// a merge brought two mappings of one internal endpoint together.
    fn reindex_internal(&mut self) {
        let mut exts: Vec<&ExternalEndpoint> = self.mappings.keys().collect();
        exts.sort();
        self.by_internal.clear();
        for e in exts {
            if let Some(m) = self.mappings.get(e) {
                self.by_internal.entry(m.key).or_insert(*e);
            }
        }
    }
}

/// A part decoded for a merge: its state, with its flows taken out in key order (every
/// replica inserts them in the same order).
struct SnatPart {
    state: State,
    flows: Vec<(FlowKey, FlowEntry)>,
}

impl SnatPart {
    fn decode(plan: &Plan, bytes: &[u8]) -> Result<SnatPart, NfError> {
        let mut state = State::decode(plan, bytes)?;
        let mut flows: Vec<(FlowKey, FlowEntry)> = state.flows.drain().collect();
        flows.sort_by_key(|(k, _)| *k.as_bytes());
        state.by_reply.clear();
        state.timers.clear();
        Ok(SnatPart { state, flows })
    }
}

impl State {
    /// Whether `other` can be merged into this state (see `Snat::merge`).
    fn check_merge(&self, other: &SnatPart) -> Result<(), NfError> {
        let st = self;
        // Word by word and mapping by mapping, not port by port: the free sets hold
        // tens of thousands of ports, and this runs on the request stream.
        for (&(addr, proto), set) in &other.state.ports.sets {
            let Some(mine) = st.ports.sets.get(&(addr, proto)) else {
                continue;
            };
            if (mine.lo, mine.hi) != (set.lo, set.hi) {
                return Err(snap_err(format!("port range of {addr} differs")));
            }
            for (i, (a, b)) in mine.bits.iter().zip(&set.bits).enumerate() {
                let both = a & b;
                if both != 0 {
                    let port = set.port_at(i * 64 + both.trailing_zeros() as usize);
                    return Err(snap_err(format!(
                        "port {port} of {addr} is free on both sides"
                    )));
                }
            }
        }
        for e in st.mappings.keys() {
            if other.state.ports.is_free(e) {
                return Err(snap_err(format!(
                    "port {} of {} is free there and mapped here",
                    e.port, e.addr
                )));
            }
        }
        for (e, m) in &other.state.mappings {
            if st.ports.is_free(e) {
                return Err(snap_err(format!("{e:?} is mapped there and free here")));
            }
            if let Some(mine) = st.mappings.get(e) {
                if mine.key != m.key {
                    return Err(snap_err(format!(
                        "{e:?} is mapped for two internal endpoints"
                    )));
                }
                if mine.weight.saturating_add(m.weight) > FULL_WEIGHT {
                    return Err(snap_err(format!("{e:?} merged more than once")));
                }
            }
        }
        Ok(())
    }

    /// Merge a part `check_merge` accepted.
    fn apply_merge(&mut self, other: SnatPart) {
        let st = self;
        for (k, set) in other.state.ports.sets {
            if let Some(mine) = st.ports.sets.get_mut(&k) {
                for (a, b) in mine.bits.iter_mut().zip(&set.bits) {
                    *a |= b;
                }
                mine.free += set.free;
            }
        }
        let touched: Vec<ExternalEndpoint> = other.state.mappings.keys().copied().collect();
        for (e, m) in other.state.mappings {
            match st.mappings.get_mut(&e) {
                Some(mine) => {
                    mine.weight += m.weight;
                    mine.flows = mine.flows.saturating_add(m.flows);
                }
                None => {
                    st.mappings.insert(e, m);
                }
            }
        }
        for (k, f) in other.flows {
            if st.flows.contains_key(&k) {
                warn!(key = %k, "snat merge: flow decided on both sides, keeping ours");
                st.stats.merge_conflicts += 1;
                for e in std::iter::once(f.own).chain(f.peer) {
                    if let Some(m) = st.mappings.get_mut(&e) {
                        m.flows = m.flows.saturating_sub(1);
                    }
                }
                continue;
            }
            st.by_reply
                .entry(reply_key(&f.forward.apply(&k)))
                .or_insert(k);
            st.timers.insert(timer_entry(f.deadline_ms, &k));
            st.flows.insert(k, f);
        }
        for (pk, p) in other.state.pairings {
            st.pairings.entry(pk).or_insert(Pairing {
                external: p.external,
                mappings: 0,
            });
        }
        st.stats.add(&other.state.stats);
        st.recount_pairings();
        st.reindex_internal();
        // Copies reunited into a whole with no flows left: their port is free again.
        for e in touched {
            if st
                .mappings
                .get(&e)
                .is_some_and(|m| m.flows == 0 && m.weight >= FULL_WEIGHT)
            {
                st.free_mapping(&e);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Snapshots
// ---------------------------------------------------------------------------------------

const SNAPSHOT_VERSION: u32 = 1;

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Snapshot {
    version: u32,
    port_pool: Vec<FreePorts>,
    mappings: Vec<MappingSnap>,
    pairings: Vec<PairingSnap>,
    flows: Vec<FlowSnap>,
    stats: SnatStats,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FreePorts {
    addr: IpAddr,
    proto: u8,
    /// Inclusive ranges.
    free: Vec<[u16; 2]>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct MappingSnap {
    external: ExternalEndpoint,
    key: MappingKey,
    weight: u64,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PairingSnap {
    vni: u32,
    internal: IpAddr,
    external: IpAddr,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FlowSnap {
    /// `FlowKey`'s text form in JSON, its bytes in the binary form.
    key: SnapKey,
    own: ExternalEndpoint,
    peer: Option<ExternalEndpoint>,
    forward: Rewrite,
    reverse: Rewrite,
    state: FlowState,
    deadline_ms: u64,
}

/// A flow key in a snapshot: text in JSON (as older builds wrote it), bytes in binary.
#[derive(Debug)]
struct SnapKey(FlowKey);

impl Serialize for SnapKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(&self.0)
        } else {
            crate::codec::serialize_key_bytes(&self.0, s)
        }
    }
}

impl<'de> Deserialize<'de> for SnapKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let t = String::deserialize(d)?;
            t.parse()
                .map(SnapKey)
                .map_err(|e| serde::de::Error::custom(format!("flow key {t:?}: {e}")))
        } else {
            crate::codec::deserialize_key_bytes(d).map(SnapKey)
        }
    }
}

fn snap_err(m: String) -> NfError {
    NfError::Snapshot(format!("snat: {m}"))
}

impl State {
    /// Sorted, so replicas holding the same state produce the same bytes.
    fn to_snapshot(&self) -> Snapshot {
        let mut port_pool: Vec<FreePorts> = self
            .ports
            .sets
            .iter()
            .filter(|(_, s)| s.free > 0)
            .map(|(&(addr, proto), s)| FreePorts {
                addr,
                proto,
                free: s.ranges(),
            })
            .collect();
        port_pool.sort_by_key(|f| (f.addr, f.proto));
        let mut mappings: Vec<MappingSnap> = self
            .mappings
            .iter()
            .map(|(e, m)| MappingSnap {
                external: *e,
                key: m.key,
                weight: m.weight,
            })
            .collect();
        mappings.sort_by_key(|m| m.external);
        let mut pairings: Vec<PairingSnap> = self
            .pairings
            .iter()
            .map(|(&(vni, internal), p)| PairingSnap {
                vni,
                internal,
                external: p.external,
            })
            .collect();
        pairings.sort_by_key(|p| (p.vni, p.internal));
        let mut flows: Vec<(&FlowKey, &FlowEntry)> = self.flows.iter().collect();
        flows.sort_by_key(|(k, _)| *k.as_bytes());
        let flows = flows
            .into_iter()
            .map(|(k, f)| FlowSnap {
                key: SnapKey(*k),
                own: f.own,
                peer: f.peer,
                forward: f.forward,
                reverse: f.reverse,
                state: f.state,
                deadline_ms: f.deadline_ms,
            })
            .collect();
        Snapshot {
            version: SNAPSHOT_VERSION,
            port_pool,
            mappings,
            pairings,
            flows,
            stats: self.stats,
        }
    }

    fn encode(&self) -> Result<Vec<u8>, NfError> {
        crate::codec::encode(&self.to_snapshot()).map_err(snap_err)
    }

    /// Build and check a state from a snapshot: every port is free or mapped, never both,
    /// and everything lies inside this NF's configured pools.
    fn decode(plan: &Plan, bytes: &[u8]) -> Result<State, NfError> {
        let s: Snapshot = crate::codec::decode(bytes).map_err(snap_err)?;
        if s.version != SNAPSHOT_VERSION {
            return Err(snap_err(format!(
                "snapshot version {} (expected {SNAPSHOT_VERSION})",
                s.version
            )));
        }
        let mut st = State::new(plan.empty_pool());
        for fp in &s.port_pool {
            let set = st.ports.sets.get_mut(&(fp.addr, fp.proto)).ok_or_else(|| {
                snap_err(format!(
                    "free ports for {} proto {}, which is not in the pool",
                    fp.addr, fp.proto
                ))
            })?;
            for &[lo, hi] in &fp.free {
                if lo > hi || lo < set.lo || hi > set.hi {
                    return Err(snap_err(format!(
                        "free range {lo}..={hi} of {} is outside {}..={}",
                        fp.addr, set.lo, set.hi
                    )));
                }
                for p in lo..=hi {
                    if !set.put(p) {
                        return Err(snap_err(format!(
                            "port {p} of {} listed free twice",
                            fp.addr
                        )));
                    }
                }
            }
        }
        for m in &s.mappings {
            let e = m.external;
            let Some(set) = st.ports.sets.get(&(e.addr, e.proto)) else {
                return Err(snap_err(format!(
                    "mapping on {e:?}, which is not in the pool"
                )));
            };
            if set.index(e.port).is_none() {
                return Err(snap_err(format!("mapping on {e:?} outside the port range")));
            }
            if set.is_free(e.port) {
                return Err(snap_err(format!("port of {e:?} is both free and mapped")));
            }
            if m.weight > FULL_WEIGHT {
                return Err(snap_err(format!("mapping {e:?} weighs more than a whole")));
            }
            let prev = st.mappings.insert(
                e,
                Mapping {
                    key: m.key,
                    flows: 0,
                    weight: m.weight,
                },
            );
            if prev.is_some() {
                return Err(snap_err(format!("two mappings on {e:?}")));
            }
        }
        for f in &s.flows {
            let key = f.key.0;
            for e in std::iter::once(&f.own).chain(f.peer.iter()) {
                if !st.mappings.contains_key(e) {
                    return Err(snap_err(format!("flow {key} uses missing mapping {e:?}")));
                }
            }
            if st.flows.contains_key(&key) {
                return Err(snap_err(format!("flow {key} listed twice")));
            }
            st.insert_flow(
                key,
                FlowEntry {
                    own: f.own,
                    peer: f.peer,
                    forward: f.forward,
                    reverse: f.reverse,
                    state: f.state,
                    deadline_ms: f.deadline_ms,
                },
            );
        }
        for p in &s.pairings {
            if !plan.is_pool_addr(p.external) {
                return Err(snap_err(format!(
                    "{} paired with {}, which is not a pool address",
                    p.internal, p.external
                )));
            }
            st.pairings.insert(
                (p.vni, p.internal),
                Pairing {
                    external: p.external,
                    mappings: 0,
                },
            );
        }
        st.recount_pairings();
        st.reindex_internal();
        st.stats = s.stats;
        // A whole mapping without flows should have been freed; finish the job.
        let idle: Vec<ExternalEndpoint> = st
            .mappings
            .iter()
            .filter(|(_, m)| m.flows == 0 && m.weight >= FULL_WEIGHT)
            .map(|(e, _)| *e)
            .collect();
        for e in idle {
            st.free_mapping(&e);
        }
        Ok(st)
    }
}

// ---------------------------------------------------------------------------------------
// The NF
// ---------------------------------------------------------------------------------------

/// Source NAT. See the module docs and `docs/nf-api.md`.
#[derive(Debug, Clone)]
pub struct Snat {
    cfg: SnatConfig,
    plan: Plan,
    state: State,
}

impl Snat {
    /// A NAT owning its whole pool: the first (or only) partition. A partition created by
    /// scale-out must instead `restore` the part its parent split off.
    pub fn new(cfg: SnatConfig) -> Result<Self, NfError> {
        let plan = Plan::new(&cfg)?;
        let state = State::new(plan.full_pool());
        Ok(Snat { cfg, plan, state })
    }

    pub fn config(&self) -> &SnatConfig {
        &self.cfg
    }

    pub fn stats(&self) -> SnatStats {
        self.state.stats
    }

    pub fn flow_count(&self) -> usize {
        self.state.flows.len()
    }

    /// Every mapping, sorted by external endpoint.
    pub fn mappings(&self) -> Vec<MappingInfo> {
        let mut v: Vec<MappingInfo> = self
            .state
            .mappings
            .iter()
            .map(|(e, m)| MappingInfo {
                key: m.key,
                external: *e,
                flows: m.flows,
                sole_owner: m.weight >= FULL_WEIGHT,
            })
            .collect();
        v.sort_by_key(|m| m.external);
        v
    }

    /// The free ports of one pool address and protocol, ascending.
    /// The snapshot in its JSON form, for people and tools (`restore` and `merge` read
    /// it too; `snapshot` writes the compact binary form).
    pub fn snapshot_json(&self) -> Result<Vec<u8>, NfError> {
        serde_json::to_vec(&self.state.to_snapshot()).map_err(|e| snap_err(e.to_string()))
    }

    pub fn free_ports(&self, addr: IpAddr, proto: u8) -> Vec<u16> {
        self.state
            .ports
            .sets
            .get(&(addr, proto))
            .map(|s| s.free_ports().collect())
            .unwrap_or_default()
    }

    pub fn free_port_count(&self, addr: IpAddr, proto: u8) -> usize {
        self.state.ports.free_count(addr, proto) as usize
    }

    fn timeout(&self, s: FlowState) -> Duration {
        Duration::from_millis(self.plan.timeout_ms(s))
    }

    fn deadline(&self, now_ms: u64, s: FlowState) -> u64 {
        now_ms.saturating_add(self.plan.timeout_ms(s))
    }

    /// The state a new flow starts in, or why it is refused.
    fn new_flow_state(key: &FlowKey, tcp_flags: u8) -> Result<FlowState, &'static str> {
        let icmp = if key.is_v4() {
            proto::ICMP
        } else {
            proto::ICMPV6
        };
        match key.proto() {
            proto::TCP => {
                let syn = tcp_flags & TCP_SYN != 0;
                let ack = tcp_flags & TCP_ACK != 0;
                if tcp_flags & (TCP_RST | TCP_FIN) != 0 || (syn && ack) {
                    // What conntrack calls INVALID: the connection is ending, or it
                    // opened from outside; nothing should get a mapping for it.
                    Err(reason::TCP_INVALID)
                } else {
                    // A SYN, or a mid-stream packet of a connection whose state was lost
                    // (conntrack's loose pickup).
                    Ok(FlowState::TcpOpen)
                }
            }
            proto::UDP => Ok(FlowState::Udp),
            p if p == icmp => {
                if key.sport() == 0 && key.dport() != 0 {
                    Err(reason::ICMP_NOT_REQUEST)
                } else {
                    Ok(FlowState::Icmp)
                }
            }
            _ => Err(reason::UNSUPPORTED_PROTOCOL),
        }
    }

    fn refuse(&mut self, why: &'static str) -> Decision {
        let s = &mut self.state.stats;
        match why {
            reason::TCP_INVALID | reason::ICMP_NOT_REQUEST => s.invalid += 1,
            reason::UNSUPPORTED_PROTOCOL => s.unsupported_protocol += 1,
            reason::EXHAUSTED => s.exhausted += 1,
            reason::ICMP_ERROR_UNKNOWN_FLOW => s.icmp_error_unknown += 1,
            _ => s.refused_inbound += 1,
        }
        Decision::drop(why)
    }

    fn flow_decision(&self, f: &FlowEntry, reply: bool) -> Decision {
        let (forward, reverse) = if reply {
            (f.reverse, f.forward)
        } else {
            (f.forward, f.reverse)
        };
        Decision {
            forward,
            reverse,
            idle_timeout: Some(self.timeout(f.state)),
            ..Decision::pass()
        }
    }

    /// A request for a flow already decided, in either direction: PP (and FM's cache) lost
    /// the rule, or an ICMP error arrived about it. Answer with the same translation.
    fn replay(&mut self, pkt: &FirstPacket, now_ms: u64) -> Option<Decision> {
        let fk = self.state.resolve(&pkt.key)?;
        let reply = fk != pkt.key;
        let f = self.state.flows.get(&fk)?;
        let mut state = f.state;
        // A fresh SYN on a closing connection reopens it (TIME_WAIT reuse), as conntrack does.
        let flags = pkt.meta.tcp_flags;
        if !reply && state == FlowState::TcpClosing && flags & TCP_SYN != 0 && flags & TCP_ACK == 0
        {
            state = FlowState::TcpOpen;
        }
        self.state.stats.replayed += 1;
        // An ICMP error neither refreshes nor ends the flow (RFC 5508 REQ-6, RFC 4787 REQ-12).
        if !pkt.meta.icmp_error {
            let d = self.deadline(now_ms, state);
            if let Some(f) = self.state.flows.get_mut(&fk) {
                f.state = state;
            }
            self.state.set_deadline(&fk, d);
        }
        let f = self.state.flows.get(&fk)?;
        Some(self.flow_decision(f, reply))
    }

    fn mapping_key(&self, pool: usize, key: &FlowKey) -> MappingKey {
        let dependent = self
            .plan
            .pools
            .get(pool)
            .is_some_and(|p| p.mapping == MappingBehaviour::EndpointDependent);
        MappingKey {
            vni: key.vni(),
            proto: key.proto(),
            addr: key.src(),
            port: key.sport(),
            remote: dependent.then(|| (key.dst(), key.dport())),
        }
    }

    /// The mapping of `mk`, made if needed: on the paired address while it has ports
    /// (REQ-2), else on the address with most free ports.
    fn mapping_for(
        &mut self,
        pool: usize,
        mk: MappingKey,
        rng: &mut DetRng,
    ) -> Option<ExternalEndpoint> {
        if let Some(e) = self.state.by_internal.get(&mk) {
            self.state.stats.mappings_reused += 1;
            return Some(*e);
        }
        let p = self.plan.pools.get(pool)?;
        let ports = &self.state.ports;
        let paired = self
            .state
            .pairings
            .get(&(mk.vni, mk.addr))
            .map(|p| p.external);
        let addr = match paired {
            Some(a) if p.addrs.contains(&a) && ports.free_count(a, mk.proto) > 0 => a,
            _ => {
                let mut best: Option<(IpAddr, u32)> = None;
                for &a in &p.addrs {
                    let n = ports.free_count(a, mk.proto);
                    if n > 0 && best.is_none_or(|(_, b)| n > b) {
                        best = Some((a, n));
                    }
                }
                let (a, _) = best?;
                if paired.is_some() {
                    self.state.stats.pairing_fallbacks += 1;
                }
                a
            }
        };
        let st = &mut self.state;
        let set = st.ports.sets.get_mut(&(addr, mk.proto))?;
        let port = set.alloc(mk.port, rng, &mut st.stats)?;
        let ext = ExternalEndpoint {
            addr,
            port,
            proto: mk.proto,
        };
        st.mappings.insert(
            ext,
            Mapping {
                key: mk,
                flows: 0,
                weight: FULL_WEIGHT,
            },
        );
        st.by_internal.insert(mk, ext);
        st.pairings
            .entry((mk.vni, mk.addr))
            .or_insert(Pairing {
                external: addr,
                mappings: 0,
            })
            .mappings += 1;
        st.stats.mappings_created += 1;
        Some(ext)
    }

    fn new_flow(&mut self, key: FlowKey, f: FlowEntry) -> Decision {
        let d = self.flow_decision(&f, false);
        self.state.insert_flow(key, f);
        self.state.stats.flows_created += 1;
        d
    }

    fn outbound(&mut self, pkt: &FirstPacket, pool: usize, env: &mut NfEnv) -> Decision {
        let key = pkt.key;
        let state = match Self::new_flow_state(&key, pkt.meta.tcp_flags) {
            Ok(s) => s,
            Err(why) => return self.refuse(why),
        };
        let mk = self.mapping_key(pool, &key);
        let Some(own) = self.mapping_for(pool, mk, &mut env.rng) else {
            debug!(%key, "snat: pool exhausted");
            return self.refuse(reason::EXHAUSTED);
        };
        let f = FlowEntry {
            own,
            peer: None,
            forward: Rewrite::src(own.addr, own.port),
            reverse: Rewrite::dst(key.src(), key.sport()),
            state,
            deadline_ms: self.deadline(env.now_ms, state),
        };
        self.new_flow(key, f)
    }

    /// RFC 4787 REQ-9: an inside host reaching another inside host by its mapping. The
    /// destination becomes that host; the source becomes the sender's own mapping, so the
    /// receiver sees what the outside would see and replies through the NAT.
    fn hairpin(&mut self, pkt: &FirstPacket, env: &mut NfEnv) -> Decision {
        let key = pkt.key;
        let target = ExternalEndpoint {
            addr: key.dst(),
            port: key.dport(),
            proto: key.proto(),
        };
        let Some(peer) = self.state.mappings.get(&target).map(|m| m.key) else {
            return self.refuse(reason::NO_MAPPING);
        };
        let Some(pool) = self.plan.pool_for(key.src()) else {
            return self.refuse(reason::NO_MAPPING);
        };
        let state = match Self::new_flow_state(&key, pkt.meta.tcp_flags) {
            Ok(s) => s,
            Err(why) => return self.refuse(why),
        };
        let mk = self.mapping_key(pool, &key);
        let Some(own) = self.mapping_for(pool, mk, &mut env.rng) else {
            return self.refuse(reason::EXHAUSTED);
        };
        let f = FlowEntry {
            own,
            peer: Some(target),
            forward: Rewrite {
                src: Endpoint::new(own.addr, own.port),
                dst: Endpoint::new(peer.addr, peer.port),
            },
            reverse: Rewrite {
                src: Endpoint::new(target.addr, target.port),
                dst: Endpoint::new(key.src(), key.sport()),
            },
            state,
            deadline_ms: self.deadline(env.now_ms, state),
        };
        self.state.stats.hairpinned += 1;
        self.new_flow(key, f)
    }

    fn decide(&mut self, pkt: &FirstPacket, env: &mut NfEnv) -> Decision {
        if let Some(d) = self.replay(pkt, env.now_ms) {
            return d;
        }
        if pkt.meta.icmp_error {
            return self.refuse(reason::ICMP_ERROR_UNKNOWN_FLOW);
        }
        let (src, dst) = (pkt.key.src(), pkt.key.dst());
        if self.plan.is_pool_addr(dst) {
            if self.plan.is_inside(src) {
                return self.hairpin(pkt, env);
            }
            // Inbound unsolicited: only replies (which PP's reverse rule carries, or
            // `replay` answers) may enter. That is address-and-port-dependent filtering
            // (RFC 4787 §5), stricter than REQ-8's recommendations; it is what PP's
            // exact-match reverse rule gives, as in conntrack and VPP NAT44-ED.
            let target = ExternalEndpoint {
                addr: dst,
                port: pkt.key.dport(),
                proto: pkt.key.proto(),
            };
            return if self.state.mappings.contains_key(&target) {
                self.refuse(reason::FILTERED)
            } else {
                self.refuse(reason::NO_MAPPING)
            };
        }
        let pool = match self.plan.pool_for(src) {
            Some(p) if !self.plan.is_pool_addr(src) => p,
            _ => {
                self.state.stats.untranslated += 1;
                return Decision::pass();
            }
        };
        self.outbound(pkt, pool, env)
    }
}

impl NetworkFunction for Snat {
    fn kind(&self) -> &str {
        "snat"
    }

    fn tables(&self) -> Vec<TableSpec> {
        let shared_mappings = self
            .plan
            .pools
            .iter()
            .any(|p| p.mapping == MappingBehaviour::EndpointIndependent);
        vec![
            TableSpec::shared_write("port-pool", Consistency::Partitioned),
            if shared_mappings {
                TableSpec::shared_write("mappings", Consistency::Partitioned)
            } else {
                TableSpec::per_flow("mappings")
            },
            TableSpec::shared_write("address-pairing", Consistency::Partitioned),
            TableSpec::per_flow("flows"),
        ]
    }

    fn first_packet(&mut self, pkt: &FirstPacket, env: &mut NfEnv) -> Result<Decision, NfError> {
        Ok(self.decide(pkt, env))
    }

    fn on_event(&mut self, ev: &FlowEvent, env: &mut NfEnv) {
        match ev {
            FlowEvent::Expired { key } => {
                if let Some(fk) = self.state.resolve(key) {
                    self.state.remove_flow(&fk);
                    self.state.stats.flows_ended += 1;
                }
            }
            FlowEvent::TcpClosing { key } => {
                let Some(fk) = self.state.resolve(key) else {
                    return;
                };
                let Some(f) = self.state.flows.get_mut(&fk) else {
                    return;
                };
                if matches!(f.state, FlowState::TcpOpen | FlowState::TcpClosing) {
                    f.state = FlowState::TcpClosing;
                    let d = self.deadline(env.now_ms, FlowState::TcpClosing);
                    self.state.set_deadline(&fk, d);
                }
            }
        }
    }

    fn on_timer(&mut self, env: &mut NfEnv) -> Vec<FlowKey> {
        let mut out = Vec::new();
        while let Some(&(deadline, kb)) = self.state.timers.first() {
            if deadline > env.now_ms {
                break;
            }
            self.state.timers.pop_first();
            let k = FlowKey::from_bytes(kb);
            if self.state.remove_flow(&k).is_some() {
                self.state.stats.flows_expired += 1;
                out.push(k);
            }
        }
        out
    }

    fn snapshot(&self) -> Result<Vec<u8>, NfError> {
        self.state.encode()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), NfError> {
        self.state = State::decode(&self.plan, snapshot)?;
        Ok(())
    }

    /// Flows whose key `half` moves go, with the mappings they use. A mapping also used by
    /// flows that stay is copied and its weight halved; the free ports of every (address,
    /// protocol) are halved by count. The part's counters start at zero.
    fn split(&mut self, half: &SplitHalf) -> Result<Vec<u8>, NfError> {
        let st = &mut self.state;
        let mut moving: Vec<FlowKey> = st.flows.keys().filter(|k| half.moves(k)).copied().collect();
        moving.sort_by_key(|k| *k.as_bytes());
        let mut part = State::new(self.plan.empty_pool());
        let mut refs: HashMap<ExternalEndpoint, u32> = HashMap::new();
        let mut moved_flows = Vec::with_capacity(moving.len());
        for k in moving {
            let Some(f) = st.flows.remove(&k) else {
                continue;
            };
            st.timers.remove(&timer_entry(f.deadline_ms, &k));
            let rk = reply_key(&f.forward.apply(&k));
            if st.by_reply.get(&rk) == Some(&k) {
                st.by_reply.remove(&rk);
            }
            for e in std::iter::once(f.own).chain(f.peer) {
                *refs.entry(e).or_default() += 1;
            }
            moved_flows.push((k, f));
        }
        let mut exts: Vec<(ExternalEndpoint, u32)> = refs.into_iter().collect();
        exts.sort();
        for (e, r) in exts {
            let Some(m) = st.mappings.get_mut(&e) else {
                continue;
            };
            let copy = if m.flows > r {
                let give = m.weight / 2;
                m.weight -= give;
                m.flows -= r;
                Mapping {
                    key: m.key,
                    flows: 0,
                    weight: give,
                }
            } else {
                // Only moving flows use it: the whole mapping (and its port) goes.
                let Some(m) = st.mappings.remove(&e) else {
                    continue;
                };
                if st.by_internal.get(&m.key) == Some(&e) {
                    st.by_internal.remove(&m.key);
                }
                m
            };
            // Pairing preferences travel with the mappings of the address.
            if let Some(p) = st.pairings.get(&(copy.key.vni, copy.key.addr)) {
                part.pairings.insert(
                    (copy.key.vni, copy.key.addr),
                    Pairing {
                        external: p.external,
                        mappings: 0,
                    },
                );
            }
            part.mappings.insert(e, Mapping { flows: 0, ..copy });
        }
        for (k, f) in moved_flows {
            part.insert_flow(k, f);
        }
        for (k, set) in st.ports.sets.iter_mut() {
            part.ports.sets.insert(*k, set.split_upper_half());
        }
        st.recount_pairings();
        part.recount_pairings();
        part.reindex_internal();
        part.encode()
    }

    /// Union with another partition's state. Checked first, applied only if sound: a port
    /// owned by both sides, or one external endpoint mapped for two internal ones, is an
    /// error and changes nothing. A flow both sides hold keeps this side's decision.
    fn merge(&mut self, part: &[u8]) -> Result<(), NfError> {
        let other = SnatPart::decode(&self.plan, part)?;
        self.state.check_merge(&other)?;
        self.state.apply_merge(other);
        Ok(())
    }

    /// Decoding (the bulk of a merge: every flow, mapping and free port is read and
    /// checked) needs only the configuration, so it runs off the request stream.
    fn merge_decoder(&self) -> MergeDecoder {
        let plan = Arc::new(self.plan.clone());
        Arc::new(move |b: &[u8]| Ok(PreparedPart::new(SnatPart::decode(&plan, b)?)))
    }

    fn check_prepared(&self, part: &PreparedPart) -> Result<(), NfError> {
        let other = part
            .downcast_ref::<SnatPart>()
            .ok_or_else(|| snap_err("prepared part is not a SNAT part".to_string()))?;
        self.state.check_merge(other)
    }

    fn merge_prepared(&mut self, part: PreparedPart) -> Result<(), NfError> {
        let other: SnatPart = part.downcast()?;
        self.state.check_merge(&other)?;
        self.state.apply_merge(other);
        Ok(())
    }

    fn flow_hashes(&self) -> Option<Vec<u64>> {
        Some(self.state.flows.keys().map(FlowKey::hash).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_set_fill_take_put_and_ranges() {
        let mut s = PortSet::empty(1000, 1069);
        s.fill();
        assert_eq!(s.free, 70);
        assert_eq!(s.free_ports().count(), 70);
        assert!(!s.is_free(999) && !s.is_free(1070));
        assert!(s.take(1000) && !s.take(1000));
        assert!(s.take(1069));
        assert!(s.take(1030));
        assert_eq!(s.ranges(), vec![[1001, 1029], [1031, 1068]]);
        assert!(s.put(1030) && !s.put(1030) && !s.put(5));
        assert_eq!(s.free, 68);
    }

    #[test]
    fn first_free_wraps_around() {
        let mut s = PortSet::empty(1, 200);
        assert_eq!(s.first_free_from(0), None);
        s.put(3);
        assert_eq!(s.first_free_from(150), Some(2));
        assert_eq!(s.first_free_from(2), Some(2));
        assert_eq!(s.first_free_from(3), Some(2), "wraps past the end");
        s.put(130);
        assert_eq!(s.first_free_from(64), Some(129));
        assert_eq!(s.first_free_from(130), Some(2));
    }

    #[test]
    fn split_upper_half_is_disjoint_and_complete() {
        let mut s = PortSet::empty(1, 1000);
        s.fill();
        for p in (1..=1000).step_by(3) {
            s.take(p);
        }
        let before: Vec<u16> = s.free_ports().collect();
        let moved = s.split_upper_half();
        let kept: Vec<u16> = s.free_ports().collect();
        let gone: Vec<u16> = moved.free_ports().collect();
        assert_eq!(kept.len() + gone.len(), before.len());
        assert!(kept.len() >= gone.len() && kept.len() - gone.len() <= 1);
        assert!(
            kept.last() < gone.first(),
            "lower half stays, upper half goes"
        );
        let mut all = [kept, gone].concat();
        all.sort_unstable();
        assert_eq!(all, before);
    }

    #[test]
    fn prefixes() {
        let p = Prefix::parse("198.18.0.0/15").expect("prefix");
        assert!(p.contains("198.19.255.255".parse().expect("ip")));
        assert!(!p.contains("198.20.0.0".parse().expect("ip")));
        assert!(!p.contains("::ffff:198.18.0.1".parse().expect("ip")));
        let p = Prefix::parse("2001:2::/48").expect("prefix");
        assert!(p.contains("2001:2:0:ffff::1".parse().expect("ip")));
        assert!(!p.contains("2001:2:1::".parse().expect("ip")));
        assert!(Prefix::parse("0.0.0.0/0")
            .expect("prefix")
            .contains("203.0.113.9".parse().expect("ip")));
        let host = Prefix::parse("198.18.0.7").expect("bare address");
        assert!(host.contains("198.18.0.7".parse().expect("ip")));
        assert!(!host.contains("198.18.0.8".parse().expect("ip")));
        for bad in [
            "198.18.0.0/33",
            "198.18.0.1/16",
            "x/8",
            "::/129",
            "1.2.3.0/-1",
        ] {
            assert!(Prefix::parse(bad).is_err(), "{bad}");
        }
    }
}
