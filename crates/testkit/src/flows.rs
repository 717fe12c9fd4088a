//! The client flows the plane tests and the lab's benches ask rules for, and the rule a
//! SNAT answers for one: the itests, `starfabric bench workers`, the demo and the
//! pipeline bench all use these, so they are written once.

use std::net::{IpAddr, Ipv4Addr};

use pipeline::{Action, FlowKey, PacketMeta, RuleRequest};

/// The tenant of every [`flow`].
pub const TENANT: u32 = 1;
/// The chain of every [`flow`].
pub const CHAIN: u32 = 1;
/// The VNI of every [`flow`].
pub const VNI: u32 = 100;

/// The first of the 250 clients [`flow`] spreads flows over.
const FIRST_CLIENT: Ipv4Addr = Ipv4Addr::new(198, 18, 10, 0);

/// Flow `i` of tenant [`TENANT`]'s chain [`CHAIN`], as a PP worker asks for its rule:
/// UDP to 198.19.0.9:53 from one of 250 clients, a distinct source port each (so a
/// distinct SNAT mapping per flow).
pub fn flow(i: u32) -> RuleRequest {
    let client = Ipv4Addr::from(u32::from(FIRST_CLIENT) + i % 250);
    let key = FlowKey::new(
        VNI,
        packet::proto::UDP,
        IpAddr::V4(client),
        1024 + (i / 250) as u16,
        IpAddr::V4(Ipv4Addr::new(198, 19, 0, 9)),
        53,
    );
    RuleRequest::new(key, TENANT, CHAIN, PacketMeta::new(60, 0))
}

/// Inverse of [`flow`].
pub fn flow_index(k: &FlowKey) -> u32 {
    let IpAddr::V4(a) = k.src() else {
        unreachable!()
    };
    (u32::from(a) - u32::from(FIRST_CLIENT)) + 250 * u32::from(k.sport() - 1024)
}

/// A SNAT's rule for a tenant flow, source port `port` on 198.19.255.1: decapsulate,
/// rewrite the source, re-encapsulate to 198.18.0.9 on VNI 200, count, out port 1.
pub fn snat_actions(port: u16) -> Vec<Action> {
    vec![
        Action::DecapVxlan,
        Action::SetSrc {
            addr: Some(IpAddr::V4(Ipv4Addr::new(198, 19, 255, 1))),
            port: Some(port),
        },
        Action::EncapVxlan {
            dst: Ipv4Addr::new(198, 18, 0, 9),
            vni: 200,
            inner_dmac: None,
            inner_smac: None,
        },
        Action::Count,
        Action::Output(1),
    ]
}
