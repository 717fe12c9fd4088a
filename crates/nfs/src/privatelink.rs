//! PrivateLink: a provider tenant's service (VIP:port in its VPC) reached from a
//! consumer tenant's VPC through a private endpoint address (endpoint:port) inside the
//! consumer's VPC, with both VPCs free to use the same addresses.
//!
//! The NF sits in the consumer's chain (PP dispatches the consumer's VNI to it); the
//! chain's forward egress is the provider's host on the provider's VNI and its reverse
//! egress the consumer's host (`docs/privatelink.md`). For a flow
//! `client:cport → endpoint:eport` it answers:
//! - forward: dst → service VIP:port, src → an address:port of the provider-side
//!   **source pool** (addresses the provider chose in its own VPC), so the consumer's
//!   addresses never reach the provider and the provider's replies come back to PP;
//! - reverse (replies `VIP:port → pool:port`): src → endpoint:eport, dst → client:cport.
//!
//! Anything else (another address, another port, another protocol) is dropped as
//! [`reason::NO_ENDPOINT`]: only what the provider published is reachable. The
//! provider cannot open anything toward the consumer: its traffic arrives on its own
//! VNI, which PP hands to its own chain; only exact replies match the reverse rules.
//!
//! The source translation is the SNAT NF's (`crate::snat`), used whole, on the key as
//! it entered the chain: its port pool (partitioned, split and merged on scaling),
//! its TCP state and RFC timeouts, its replay of lost rules. The pool uses
//! endpoint-dependent mapping, so every flow has its own provider-side source port and
//! the provider-side 5-tuples of two consumer flows never collide. The DNAT part is a
//! pure function of the configuration, so it needs no state of its own.

use std::collections::HashMap;
use std::net::IpAddr;

use nf::{
    Decision, Endpoint, FirstPacket, FlowEvent, MergeDecoder, NetworkFunction, NfEnv, NfError,
    PreparedPart, Rewrite, SplitHalf, TableSpec, Verdict,
};
use pipeline::FlowKey;
use serde::{Deserialize, Serialize};
use tracing::debug;

use crate::lb::LbProtocol;
use crate::snat::{PortRange, Snat, SnatConfig, SnatPool, SnatTimeouts};

/// Drop reasons this NF gives, as PP counts them (`rule:<reason>`). The SNAT's own
/// reasons (`snat-exhausted`, `snat-tcp-invalid`, …) also appear for endpoint flows.
pub mod reason {
    /// Not an endpoint:port (and protocol) the provider published to this consumer.
    pub const NO_ENDPOINT: &str = "privatelink-no-endpoint";
    /// The source could not be moved into the provider's address space (the consumer's
    /// address is one of the pool's): passing it untranslated would leak it.
    pub const UNTRANSLATED_SOURCE: &str = "privatelink-untranslated-source";
}

/// One private endpoint: `address:port` in the consumer's VPC stands for the provider's
/// `service_addr:service_port`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlEndpoint {
    pub address: IpAddr,
    pub port: u16,
    pub protocol: LbProtocol,
    pub service_addr: IpAddr,
    pub service_port: u16,
}

/// Provider-side source addresses and their ports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlSource {
    pub addresses: Vec<IpAddr>,
    #[serde(default)]
    pub ports: PortRange,
}

/// The NF's configuration: every endpoint of one consumer VPC toward one provider VPC
/// (the chain's forward egress is that VPC's host), and the provider-side source pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrivateLinkConfig {
    pub endpoints: Vec<PlEndpoint>,
    pub source: PlSource,
    #[serde(default)]
    pub timeouts: SnatTimeouts,
}

/// What the NF refused and passed since it started (not part of its state snapshot).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlStats {
    pub forwarded: u64,
    pub no_endpoint: u64,
    pub untranslated_source: u64,
}

/// (address, port, protocol number) of an endpoint, or of a service.
type EndpointKey = (IpAddr, u16, u8);

/// Endpoint → service, and service → endpoint (one endpoint per service).
type Maps = (
    HashMap<EndpointKey, (IpAddr, u16)>,
    HashMap<EndpointKey, (IpAddr, u16)>,
);

pub struct PrivateLink {
    cfg: PrivateLinkConfig,
    /// Endpoint → service (address, port).
    endpoints: HashMap<EndpointKey, (IpAddr, u16)>,
    /// Service → its endpoint (address, port): how a provider-side reply names the
    /// flow the inner SNAT keyed by the endpoint.
    services: HashMap<EndpointKey, (IpAddr, u16)>,
    snat: Snat,
    stats: PlStats,
}

fn check(cfg: &PrivateLinkConfig) -> Result<Maps, NfError> {
    let err = |m: String| NfError::Config(format!("privatelink: {m}"));
    if cfg.endpoints.is_empty() {
        return Err(err("at least one endpoint is needed".into()));
    }
    if cfg.source.addresses.is_empty() {
        return Err(err(
            "source.addresses: at least one provider-side address".into()
        ));
    }
    let mut out = HashMap::new();
    let mut services = HashMap::new();
    for e in &cfg.endpoints {
        let name = format!("endpoint {}:{}/{}", e.address, e.port, e.protocol);
        if e.port == 0 || e.service_port == 0 {
            return Err(err(format!("{name}: port 0 is not a service port")));
        }
        for a in [e.address, e.service_addr] {
            if a.is_unspecified() || a.is_multicast() || a.is_loopback() {
                return Err(err(format!("{name}: {a} is not a unicast address")));
            }
        }
        if e.address.is_ipv4() != e.service_addr.is_ipv4()
            || cfg
                .source
                .addresses
                .iter()
                .any(|s| s.is_ipv4() != e.address.is_ipv4())
        {
            return Err(err(format!(
                "{name}: the endpoint, the service and the source pool must be of one \
                 address family"
            )));
        }
        // The NF sees consumer and provider addresses in one space: a pool address equal
        // to an endpoint would read as traffic to the pool, one equal to the service as
        // a flow to itself.
        if cfg
            .source
            .addresses
            .iter()
            .any(|s| *s == e.address || *s == e.service_addr)
        {
            return Err(err(format!(
                "{name}: a source address may be neither an endpoint nor the service"
            )));
        }
        let k = (e.address, e.port, e.protocol.number());
        if out.insert(k, (e.service_addr, e.service_port)).is_some() {
            return Err(err(format!("{name} is listed twice")));
        }
        // One endpoint per service, so a provider-side flow names its endpoint.
        if services
            .insert(
                (e.service_addr, e.service_port, e.protocol.number()),
                (e.address, e.port),
            )
            .is_some()
        {
            return Err(err(format!(
                "{name}: service {}:{} already has an endpoint",
                e.service_addr, e.service_port
            )));
        }
    }
    Ok((out, services))
}

fn snat_config(cfg: &PrivateLinkConfig) -> SnatConfig {
    SnatConfig {
        pools: vec![SnatPool {
            addresses: cfg.source.addresses.clone(),
            ports: cfg.source.ports,
            ..SnatPool::new(Vec::new(), 0, 0)
        }
        .endpoint_dependent()],
        timeouts: cfg.timeouts,
    }
}

impl PrivateLink {
    pub fn new(cfg: PrivateLinkConfig) -> Result<Self, NfError> {
        let (endpoints, services) = check(&cfg)?;
        let snat = Snat::new(snat_config(&cfg))
            .map_err(|e| NfError::Config(format!("privatelink: source pool: {e}")))?;
        Ok(PrivateLink {
            cfg,
            endpoints,
            services,
            snat,
            stats: PlStats::default(),
        })
    }

    pub fn config(&self) -> &PrivateLinkConfig {
        &self.cfg
    }

    pub fn stats(&self) -> PlStats {
        self.stats
    }

    /// The service a forward key is headed for, if its destination is an endpoint.
    fn service_of(&self, k: &FlowKey) -> Option<(IpAddr, u16)> {
        self.endpoints
            .get(&(k.dst(), k.dport(), k.proto()))
            .copied()
    }

    /// A provider-side reply (service → pool) as the inner SNAT keyed its flow
    /// (endpoint → pool), if the SNAT holds that flow.
    fn snat_reply(&self, k: &FlowKey) -> Option<FlowKey> {
        let &(addr, port) = self.services.get(&(k.src(), k.sport(), k.proto()))?;
        let mut at_endpoint = *k;
        at_endpoint.set_src(addr);
        at_endpoint.set_sport(port);
        self.snat.knows_reply(&at_endpoint).then_some(at_endpoint)
    }

    /// A reply whose reverse rule PP and FM lost: the inner SNAT answers it from its
    /// flow, and the service side is put back to the endpoint (the reverse of what the
    /// flow's first packet decided).
    fn reply(
        &mut self,
        pkt: &FirstPacket,
        at_endpoint: FlowKey,
        env: &mut NfEnv,
    ) -> Result<Decision, NfError> {
        let s = self.snat.first_packet(
            &FirstPacket {
                key: at_endpoint,
                ..*pkt
            },
            env,
        )?;
        if matches!(s.verdict, Verdict::Drop { .. }) {
            return Ok(s);
        }
        Ok(Decision {
            verdict: Verdict::pass(),
            forward: Rewrite {
                src: Endpoint::new(at_endpoint.src(), at_endpoint.sport()),
                dst: s.forward.dst,
            },
            reverse: Rewrite {
                src: s.reverse.src,
                dst: Endpoint::new(pkt.key.src(), pkt.key.sport()),
            },
            idle_timeout: s.idle_timeout,
        })
    }

    fn refuse(&mut self, why: &'static str) -> Decision {
        match why {
            reason::NO_ENDPOINT => self.stats.no_endpoint += 1,
            _ => self.stats.untranslated_source += 1,
        }
        Decision::drop(why)
    }
}

impl NetworkFunction for PrivateLink {
    fn kind(&self) -> &str {
        "privatelink"
    }

    fn tables(&self) -> Vec<TableSpec> {
        let mut t = vec![TableSpec::shared_read("endpoints")];
        t.extend(self.snat.tables());
        t
    }

    fn first_packet(&mut self, pkt: &FirstPacket, env: &mut NfEnv) -> Result<Decision, NfError> {
        let Some((svc, svc_port)) = self.service_of(&pkt.key) else {
            if let Some(at_endpoint) = self.snat_reply(&pkt.key) {
                return self.reply(pkt, at_endpoint, env);
            }
            debug!(key = %pkt.key, "privatelink: not a published endpoint");
            return Ok(self.refuse(reason::NO_ENDPOINT));
        };
        // The SNAT sees the flow as it arrived, so its state is keyed like PP's rule and
        // events, splits and expiries find it; only its source rewrite is used.
        let s = self.snat.first_packet(pkt, env)?;
        if matches!(s.verdict, Verdict::Drop { .. }) {
            return Ok(s);
        }
        let (Some(pool), Some(client)) = (s.forward.src.addr, s.reverse.dst.addr) else {
            return Ok(self.refuse(reason::UNTRANSLATED_SOURCE));
        };
        self.stats.forwarded += 1;
        Ok(Decision {
            verdict: Verdict::pass(),
            forward: Rewrite {
                src: Endpoint {
                    addr: Some(pool),
                    port: s.forward.src.port,
                },
                dst: Endpoint::new(svc, svc_port),
            },
            reverse: Rewrite {
                src: Endpoint::new(pkt.key.dst(), pkt.key.dport()),
                dst: Endpoint {
                    addr: Some(client),
                    port: s.reverse.dst.port,
                },
            },
            idle_timeout: s.idle_timeout,
        })
    }

    fn knows_reply(&self, key: &FlowKey) -> bool {
        self.snat_reply(key).is_some()
    }

    fn on_event(&mut self, ev: &FlowEvent, env: &mut NfEnv) {
        self.snat.on_event(ev, env)
    }

    fn on_timer(&mut self, env: &mut NfEnv) -> Vec<FlowKey> {
        self.snat.on_timer(env)
    }

    fn snapshot(&self) -> Result<Vec<u8>, NfError> {
        self.snat.snapshot()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), NfError> {
        self.snat.restore(snapshot)
    }

    fn split(&mut self, half: &SplitHalf) -> Result<Vec<u8>, NfError> {
        self.snat.split(half)
    }

    fn split_flows(&mut self, half: &SplitHalf) -> Result<Vec<u8>, NfError> {
        self.snat.split_flows(half)
    }

    fn merge(&mut self, part: &[u8]) -> Result<(), NfError> {
        self.snat.merge(part)
    }

    fn merge_decoder(&self) -> MergeDecoder {
        self.snat.merge_decoder()
    }

    fn check_prepared(&self, part: &PreparedPart) -> Result<(), NfError> {
        self.snat.check_prepared(part)
    }

    fn merge_prepared(&mut self, part: PreparedPart) -> Result<(), NfError> {
        self.snat.merge_prepared(part)
    }

    fn flow_hashes(&self) -> Option<Vec<u64>> {
        self.snat.flow_hashes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nf::{Chain, ChainSpec, Egress};
    use packet::tcp_flags::{ACK, SYN};
    use pipeline::{format_actions, PacketMeta};
    use std::net::Ipv4Addr;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn cfg() -> PrivateLinkConfig {
        PrivateLinkConfig {
            endpoints: vec![PlEndpoint {
                address: ip("198.19.7.10"),
                port: 80,
                protocol: LbProtocol::Tcp,
                service_addr: ip("198.19.1.2"),
                service_port: 8080,
            }],
            source: PlSource {
                addresses: vec![ip("198.19.9.1")],
                ports: PortRange { lo: 2000, hi: 2001 },
            },
            timeouts: SnatTimeouts::default(),
        }
    }

    fn pkt(s: &str, flags: u8) -> FirstPacket {
        FirstPacket::new(s.parse().unwrap(), 1, PacketMeta::new(60, flags))
    }

    fn decide(nf: &mut PrivateLink, s: &str) -> Decision {
        nf.first_packet(&pkt(s, SYN), &mut NfEnv::new(0, 3))
            .unwrap()
    }

    #[test]
    fn an_endpoint_flow_is_moved_into_the_providers_space_and_back() {
        let mut nf = PrivateLink::new(cfg()).unwrap();
        let d = decide(&mut nf, "100 tcp 198.19.1.2:40000 > 198.19.7.10:80");
        assert_eq!(d.verdict, Verdict::pass());
        assert_eq!(d.forward.dst, Endpoint::new(ip("198.19.1.2"), 8080));
        assert_eq!(d.forward.src.addr, Some(ip("198.19.9.1")));
        let sport = d.forward.src.port.unwrap();
        assert!(
            (2000..=2001).contains(&sport),
            "port {sport} outside the pool"
        );
        // The reply from the service becomes endpoint → client.
        assert_eq!(d.reverse.src, Endpoint::new(ip("198.19.7.10"), 80));
        assert_eq!(d.reverse.dst, Endpoint::new(ip("198.19.1.2"), 40000));
        assert_eq!(nf.stats().forwarded, 1);
    }

    /// A reply whose reverse rule was lost (service → pool, on the provider's side) is
    /// known, and answered with the flow's own translation turned around; a reply to a
    /// port the flow does not hold, or from another service port, is not.
    #[test]
    fn a_lost_reply_rule_is_answered_from_the_flow() {
        let mut nf = PrivateLink::new(cfg()).unwrap();
        let d = decide(&mut nf, "100 tcp 198.19.1.2:40000 > 198.19.7.10:80");
        let sport = d.forward.src.port.unwrap();
        let reply: FlowKey = format!("200 tcp 198.19.1.2:8080 > 198.19.9.1:{sport}")
            .parse()
            .unwrap();
        assert!(nf.knows_reply(&reply));
        let r = nf
            .first_packet(
                &FirstPacket::new(reply, 1, PacketMeta::new(60, ACK)),
                &mut NfEnv::new(5, 3),
            )
            .unwrap();
        assert_eq!(r.verdict, Verdict::pass());
        assert_eq!((r.forward, r.reverse), (d.reverse, d.forward));
        assert_eq!(nf.stats().forwarded, 1, "a reply is not a new flow");
        let other_port = 2000 + 2001 - sport;
        for k in [
            format!("200 tcp 198.19.1.2:8080 > 198.19.9.1:{other_port}"),
            format!("200 tcp 198.19.1.2:8081 > 198.19.9.1:{sport}"),
            format!("200 udp 198.19.1.2:8080 > 198.19.9.1:{sport}"),
        ] {
            let k: FlowKey = k.parse().unwrap();
            assert!(!nf.knows_reply(&k), "{k}");
            let r = nf
                .first_packet(
                    &FirstPacket::new(k, 1, PacketMeta::new(60, ACK)),
                    &mut NfEnv::new(5, 3),
                )
                .unwrap();
            assert!(matches!(r.verdict, Verdict::Drop { .. }), "{k}: {r:?}");
        }
    }

    #[test]
    fn composed_rules_change_the_vni_both_ways() {
        let fwd = Egress {
            decap: true,
            encap: Some((Ipv4Addr::new(198, 18, 11, 2), 101)),
            inner_dmac: None,
            output: 0,
        };
        let rev = Egress {
            decap: true,
            encap: Some((Ipv4Addr::new(198, 18, 10, 2), 100)),
            inner_dmac: None,
            output: 0,
        };
        let nfs: Vec<Box<dyn NetworkFunction>> = vec![Box::new(PrivateLink::new(cfg()).unwrap())];
        let mut c = Chain::new(nfs, ChainSpec::seq(1), fwd, rev).unwrap();
        let r = c
            .decide(
                &pkt("100 tcp 198.19.1.2:40000 > 198.19.7.10:80", SYN),
                &mut NfEnv::new(0, 3),
            )
            .unwrap();
        let f = format_actions(&r.forward.actions);
        assert!(
            f.starts_with("decap; set-src 198.19.9.1:")
                && f.ends_with("set-dst 198.19.1.2:8080; encap 198.18.11.2 vni 101; out 0"),
            "{f}"
        );
        let rv = r.reverse.unwrap();
        let sport = r.forward.rewritten_key().sport();
        // The reply is matched on the provider's VNI, from the service to the pool.
        assert_eq!(
            rv.key.to_string(),
            format!("101 tcp 198.19.1.2:8080 > 198.19.9.1:{sport}")
        );
        assert_eq!(
            format_actions(&rv.actions),
            "decap; set-src 198.19.7.10:80; set-dst 198.19.1.2:40000; encap 198.18.10.2 vni 100; out 0"
        );
    }

    #[test]
    fn everything_but_a_published_endpoint_port_is_dropped_and_counted() {
        let mut nf = PrivateLink::new(cfg()).unwrap();
        for k in [
            "100 tcp 198.19.1.2:40000 > 198.19.7.10:22",
            "100 udp 198.19.1.2:40000 > 198.19.7.10:80",
            "100 tcp 198.19.1.2:40000 > 198.19.1.2:8080",
            "100 tcp 198.19.1.2:40000 > 198.19.9.1:2000",
        ] {
            let d = decide(&mut nf, k);
            assert_eq!(d.verdict, Verdict::drop(reason::NO_ENDPOINT), "{k}");
        }
        assert_eq!(nf.stats().no_endpoint, 4);
        assert_eq!(nf.stats().forwarded, 0);
    }

    #[test]
    fn a_consumer_source_equal_to_a_pool_address_is_refused_not_leaked() {
        let mut nf = PrivateLink::new(cfg()).unwrap();
        let d = decide(&mut nf, "100 tcp 198.19.9.1:40000 > 198.19.7.10:80");
        assert_eq!(d.verdict, Verdict::drop(reason::UNTRANSLATED_SOURCE));
        assert_eq!(nf.stats().untranslated_source, 1);
    }

    #[test]
    fn the_pool_runs_out_with_the_snats_reason_and_a_replayed_flow_keeps_its_port() {
        let mut nf = PrivateLink::new(cfg()).unwrap();
        let a = decide(&mut nf, "100 tcp 198.19.1.2:40000 > 198.19.7.10:80");
        let b = decide(&mut nf, "100 tcp 198.19.1.3:40000 > 198.19.7.10:80");
        assert_ne!(a.forward.src.port, b.forward.src.port);
        let c = decide(&mut nf, "100 tcp 198.19.1.4:40000 > 198.19.7.10:80");
        assert_eq!(c.verdict, Verdict::drop(crate::snat::reason::EXHAUSTED));
        // PP lost the rule: the same flow asks again and gets the same translation.
        let again = nf
            .first_packet(
                &pkt("100 tcp 198.19.1.2:40000 > 198.19.7.10:80", ACK),
                &mut NfEnv::new(10, 4),
            )
            .unwrap();
        assert_eq!(again.forward, a.forward);
        assert_eq!(again.reverse, a.reverse);
    }

    #[test]
    fn state_survives_snapshot_restore_and_expiry_frees_the_port() {
        let mut nf = PrivateLink::new(cfg()).unwrap();
        let k = "100 tcp 198.19.1.2:40000 > 198.19.7.10:80";
        let a = decide(&mut nf, k);
        let snap = nf.snapshot().unwrap();
        let mut other = PrivateLink::new(cfg()).unwrap();
        other.restore(&snap).unwrap();
        assert_eq!(
            other.flow_hashes().unwrap(),
            vec![k.parse::<FlowKey>().unwrap().hash()]
        );
        let again = other
            .first_packet(&pkt(k, ACK), &mut NfEnv::new(5, 9))
            .unwrap();
        assert_eq!(again.forward, a.forward);
        other.on_event(
            &FlowEvent::Expired {
                key: k.parse().unwrap(),
            },
            &mut NfEnv::new(6, 9),
        );
        assert_eq!(other.flow_hashes().unwrap(), Vec::<u64>::new());
    }

    #[test]
    fn bad_configurations_are_refused_with_a_reason() {
        type Edit = fn(&mut PrivateLinkConfig);
        let cases: Vec<(Edit, &str)> = vec![
            (|c| c.endpoints.clear(), "at least one endpoint"),
            (|c| c.source.addresses.clear(), "source.addresses"),
            (|c| c.endpoints[0].port = 0, "port 0"),
            (|c| c.endpoints[0].service_addr = ip("0.0.0.0"), "unicast"),
            (
                |c| c.endpoints[0].service_addr = ip("2001:db8::1"),
                "one address family",
            ),
            (
                |c| c.source.addresses = vec![ip("198.19.7.10")],
                "neither an endpoint",
            ),
            (
                |c| {
                    let e = c.endpoints[0].clone();
                    c.endpoints.push(e)
                },
                "listed twice",
            ),
            (
                |c| {
                    let mut e = c.endpoints[0].clone();
                    e.address = ip("198.19.7.11");
                    c.endpoints.push(e)
                },
                "already has an endpoint",
            ),
            (
                |c| c.source.ports = PortRange { lo: 9, hi: 1 },
                "source pool",
            ),
        ];
        for (edit, want) in cases {
            let mut c = cfg();
            edit(&mut c);
            let e = PrivateLink::new(c).err().expect("refused").to_string();
            assert!(e.contains(want), "{e:?} should mention {want:?}");
        }
    }

    #[test]
    fn config_is_json_as_the_orchestrator_stores_it() {
        let j = r#"{"kind": "privatelink", "endpoints": [{"address": "198.19.7.10", "port": 80,
            "protocol": "tcp", "service_addr": "198.19.1.2", "service_port": 80}],
            "source": {"addresses": ["198.19.9.1"]}}"#;
        let c: crate::NfConfig = serde_json::from_str(j).unwrap();
        let nf = crate::build(&c).unwrap();
        assert_eq!(nf.kind(), "privatelink");
        let bad =
            r#"{"kind": "privatelink", "endpoints": [], "source": {"addresses": []}, "x": 1}"#;
        assert!(serde_json::from_str::<crate::NfConfig>(bad).is_err());
    }
}
