//! SNAT configuration: the serde types an operator writes, and the checked, indexed plan
//! the NF runs from.

use std::net::IpAddr;

use ::nf::NfError;
use hashbrown::HashMap;
use packet::proto;
use serde::{Deserialize, Serialize};
use tracing::warn;

use super::table::FlowState;
use super::table::{FLOWS, MAPPINGS, MIRROR, PAIRINGS, PORTS, STATS};
use ::nf::{Consistency, SplitRule, TableSpec};

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
pub(super) struct Prefix {
    pub(super) bits: u128,
    pub(super) mask: u128,
    pub(super) v4: bool,
}

pub(super) fn addr_bits(a: IpAddr) -> (u128, bool) {
    match a {
        IpAddr::V4(a) => (u128::from(u32::from(a)), true),
        IpAddr::V6(a) => (u128::from(a), false),
    }
}

impl Prefix {
    pub(super) fn parse(s: &str) -> Result<Prefix, String> {
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

    pub(super) fn contains(&self, a: IpAddr) -> bool {
        let (bits, v4) = addr_bits(a);
        v4 == self.v4 && bits & self.mask == self.bits
    }
}

/// A validated pool.
#[derive(Debug, Clone)]
pub(super) struct Pool {
    pub(super) addrs: Vec<IpAddr>,
    pub(super) lo: u16,
    pub(super) hi: u16,
    pub(super) mapping: MappingBehaviour,
    pub(super) sources: Vec<Prefix>,
    pub(super) v4: bool,
}

impl Pool {
    pub(super) fn serves(&self, src: IpAddr) -> bool {
        src.is_ipv4() == self.v4
            && (self.sources.is_empty() || self.sources.iter().any(|p| p.contains(src)))
    }

    pub(super) fn protos(&self) -> [u8; 3] {
        let icmp = if self.v4 { proto::ICMP } else { proto::ICMPV6 };
        [proto::TCP, proto::UDP, icmp]
    }
}

/// The configuration, checked and indexed.
#[derive(Debug, Clone)]
pub(super) struct Plan {
    pub(super) pools: Vec<Pool>,
    pub(super) pool_of: HashMap<IpAddr, usize>,
    pub(super) timeouts: SnatTimeouts,
}

impl Plan {
    pub(super) fn new(cfg: &SnatConfig) -> Result<Plan, NfError> {
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

    pub(super) fn is_pool_addr(&self, a: IpAddr) -> bool {
        self.pool_of.contains_key(&a)
    }

    /// The pool translating `src`, if any.
    pub(super) fn pool_for(&self, src: IpAddr) -> Option<usize> {
        self.pools.iter().position(|p| p.serves(src))
    }

    /// `src` is named as inside by some pool's explicit `sources`.
    pub(super) fn is_inside(&self, src: IpAddr) -> bool {
        self.pools
            .iter()
            .any(|p| !p.sources.is_empty() && p.serves(src))
    }

    pub(super) fn timeout_ms(&self, s: FlowState) -> u64 {
        let t = &self.timeouts;
        let secs = match s {
            FlowState::Udp => t.udp_s,
            FlowState::Icmp => t.icmp_s,
            FlowState::TcpOpen => t.tcp_established_s,
            FlowState::TcpClosing | FlowState::TcpSynSent => t.tcp_transitory_s,
        };
        secs.saturating_mul(1000)
    }

    /// The idle timeout of PP's rules for a flow in state `s`: the longest the NF may keep
    /// the flow without a new first packet. A TCP flow not yet closing may become
    /// established, and PP's rule cannot be lengthened later, so it gets the established
    /// timeout from its SYN on; the NF's own (shorter) deadline governs until then, and
    /// FM withdraws PP's rules when the NF's timer forgets the flow.
    pub(super) fn rule_timeout_ms(&self, s: FlowState) -> u64 {
        match s {
            FlowState::TcpSynSent => self.timeout_ms(FlowState::TcpOpen),
            _ => self.timeout_ms(s),
        }
    }

    /// Every (pool address, protocol) and its port range: the rows of the port pool.
    pub(super) fn port_rows(&self) -> Vec<(IpAddr, u8, u16, u16)> {
        let mut out = Vec::new();
        for p in &self.pools {
            for &a in &p.addrs {
                for pr in p.protos() {
                    out.push((a, pr, p.lo, p.hi));
                }
            }
        }
        out
    }

    /// The tables the NF keeps, and how the platform splits each: the port pool halves
    /// its free ports, a mapping goes with the flows that use it (shared by an internal
    /// endpoint's flows under endpoint-independent mapping, one flow's own otherwise),
    /// the pairings are copied, the counters add up.
    pub(super) fn tables(&self) -> Vec<TableSpec> {
        let shared_mappings = self
            .pools
            .iter()
            .any(|p| p.mapping == MappingBehaviour::EndpointIndependent);
        vec![
            TableSpec::shared_write(PORTS, Consistency::Partitioned).split_by(SplitRule::Pool),
            if shared_mappings {
                TableSpec::shared_write(MAPPINGS, Consistency::Partitioned)
            } else {
                TableSpec::per_flow(MAPPINGS)
            }
            .split_by(SplitRule::WithFlows),
            TableSpec::shared_write(PAIRINGS, Consistency::Partitioned).split_by(SplitRule::Copy),
            TableSpec::per_flow(FLOWS),
            TableSpec::shared_write(STATS, Consistency::Replicated),
            TableSpec::mirror(MIRROR),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
