//! Tenant chains wired to this topology: the NF configurations (`nfs::NfConfig`) and
//! the egress of each direction, as FM configuration files carry them
//! (`proto::ChainDef`).
//!
//! Forward traffic leaves the PP node re-encapsulated toward a gateway (the internet
//! gateway on VNI 200, or the service gateway on VNI 300) with the inner destination MAC
//! of the gateway's VXLAN device; reverse traffic goes back to the tenant's client host
//! on its VPC's VNI with the client's VXLAN MAC.

use std::net::{IpAddr, Ipv4Addr};

use nfs::fw::{AclAction, AclProto, AclRule, FwConfig, PortSpec, TenantAcl};
use nfs::lb::{BackendConfig, LbConfig, LbProtocol, ServiceConfig};
use nfs::privatelink::{PlEndpoint, PlSource, PrivateLinkConfig};
use nfs::snat::{SnatConfig, SnatPool};
use nfs::NfConfig;
use proto::{ChainDef, EgressDef, EncapDef};

use crate::services::HTTP_PORT;
use crate::topo::{addr, mac, vni};
use crate::{Error, Result};

/// Where a chain's forward direction goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Toward {
    /// The internet gateway (VNI 200).
    Internet,
    /// The service gateway in front of the nginx backends (VNI 300).
    Services,
    /// VPC `j`'s client host on its own VNI: another tenant's VPC, which a PrivateLink
    /// chain reaches (docs/privatelink.md).
    Vpc(usize),
}

fn forward(t: Toward) -> EgressDef {
    let (dst, vni, dmac) = match t {
        Toward::Internet => (addr::IGW, vni::INTERNET, mac::IGW),
        Toward::Services => (addr::SVC, vni::SERVICES, mac::SVC),
        Toward::Vpc(j) => return reverse(j),
    };
    EgressDef {
        decap: true,
        encap: Some(EncapDef { dst, vni }),
        inner_dmac: Some(dmac.to_string()),
        output: 0,
    }
}

fn reverse(j: usize) -> EgressDef {
    EgressDef {
        decap: true,
        encap: Some(EncapDef {
            dst: addr::client_underlay(j),
            vni: vni::tenant(j),
        }),
        inner_dmac: Some(mac::client(j)),
        output: 0,
    }
}

/// Chain `chain` of tenant `tenant`, serving VPC `j`'s client, running `nfs` in order.
pub fn chain(
    tenant: u32,
    chain: u32,
    j: usize,
    toward: Toward,
    nfs: &[NfConfig],
) -> Result<ChainDef> {
    // As the orchestrator does: what the NFs need the chain partitioned by.
    let partition = nfs::chain_partition(nfs)
        .map_err(|e| Error::Setup(format!("chain {tenant}:{chain}: {e}")))?;
    let nfs = nfs
        .iter()
        .map(serde_json::to_value)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Setup(format!("NF configuration: {e}")))?;
    let def = ChainDef {
        tenant,
        chain,
        nfs,
        spec: None,
        forward: forward(toward),
        reverse: reverse(j),
        partition,
    };
    // What FM would reject, rejected here with a clearer origin.
    def.to_proto()
        .map_err(|e| Error::Setup(format!("chain {tenant}:{chain}: {e}")))?;
    Ok(def)
}

/// SNAT of VPC `j` to its pool address, ports 1024–65535, endpoint-independent mapping.
pub fn snat(j: usize) -> NfConfig {
    NfConfig::Snat(SnatConfig {
        pools: vec![SnatPool::new(vec![IpAddr::V4(addr::pool(j))], 1024, 65535)],
        timeouts: Default::default(),
    })
}

/// A load balancer with the VIP (TCP 80) in front of `backends` nginx backends.
pub fn lb(backends: usize) -> NfConfig {
    NfConfig::Lb(LbConfig {
        services: vec![ServiceConfig {
            vip: IpAddr::V4(addr::VIP),
            port: HTTP_PORT,
            protocol: LbProtocol::Tcp,
            backends: (0..backends)
                .map(|k| BackendConfig::new(IpAddr::V4(addr::backend(k)), HTTP_PORT, 1))
                .collect(),
        }],
        ..LbConfig::default()
    })
}

/// PrivateLink: `endpoint`:80 in the consumer's VPC stands for the provider's
/// `service`:80; provider-side sources come from `source`, ports 1024–65535.
pub fn privatelink(endpoint: Ipv4Addr, service: Ipv4Addr, source: Ipv4Addr) -> NfConfig {
    NfConfig::PrivateLink(PrivateLinkConfig {
        endpoints: vec![PlEndpoint {
            address: IpAddr::V4(endpoint),
            port: HTTP_PORT,
            protocol: LbProtocol::Tcp,
            service_addr: IpAddr::V4(service),
            service_port: HTTP_PORT,
        }],
        source: PlSource {
            addresses: vec![IpAddr::V4(source)],
            ports: Default::default(),
        },
        timeouts: Default::default(),
    })
}

/// A firewall for `tenant`: `rules` in order, then `default`.
pub fn fw(tenant: u32, rules: Vec<AclRule>, default: AclAction) -> NfConfig {
    NfConfig::Fw(FwConfig {
        tenants: vec![TenantAcl {
            tenant,
            rules,
            default_action: default,
        }],
        default_action: AclAction::Deny,
        timeouts: Default::default(),
    })
}

/// An ACL rule for `proto` to destination port `dport`.
pub fn acl(action: AclAction, proto: AclProto, dport: u16) -> AclRule {
    AclRule {
        name: Some(format!("{action:?} {proto:?} {dport}").to_lowercase()),
        dport: Some(PortSpec::Port(dport)),
        proto,
        ..AclRule::new(action)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_validate_and_point_back_at_their_vpc() {
        let c = chain(2, 1, 1, Toward::Internet, &[snat(1)]).unwrap();
        let enc = c.reverse.encap.unwrap();
        assert_eq!((enc.dst, enc.vni), (addr::client_underlay(1), 101));
        assert_eq!(c.forward.encap.unwrap().vni, vni::INTERNET);
        assert_eq!(c.nfs[0]["kind"], "snat");
        assert_eq!(c.nfs[0]["pools"][0]["addresses"][0], "198.18.201.2");

        let l = chain(1, 2, 0, Toward::Services, &[lb(3)]).unwrap();
        assert_eq!(l.forward.inner_dmac.as_deref(), Some(mac::SVC));
        assert_eq!(
            l.nfs[0]["services"][0]["backends"]
                .as_array()
                .unwrap()
                .len(),
            3
        );

        let f = chain(
            1,
            3,
            0,
            Toward::Internet,
            &[
                fw(
                    1,
                    vec![acl(AclAction::Allow, AclProto::Tcp, 80)],
                    AclAction::Deny,
                ),
                snat(0),
            ],
        )
        .unwrap();
        assert_eq!(f.nfs[0]["kind"], "fw");
        assert_eq!(f.nfs[0]["tenants"][0]["rules"][0]["dport"], 80);

        // A PrivateLink chain leaves toward the provider VPC's host on its VNI.
        let p = chain(
            1,
            1,
            0,
            Toward::Vpc(1),
            &[privatelink(
                Ipv4Addr::new(198, 19, 7, 10),
                addr::CLIENT,
                Ipv4Addr::new(198, 19, 9, 1),
            )],
        )
        .unwrap();
        let fe = p.forward.encap.unwrap();
        assert_eq!((fe.dst, fe.vni), (addr::client_underlay(1), 101));
        assert_eq!(p.forward.inner_dmac, Some(mac::client(1)));
        assert_eq!(p.reverse.encap.unwrap().vni, 100);
        assert_eq!(p.nfs[0]["kind"], "privatelink");
    }
}
