//! Kernel baselines: the PP namespace runs Linux instead of starfabric, on the same
//! topology, for the same traffic.
//!
//! The PP namespace gets the VXLAN devices the PP node replaces: `vx100` toward VPC 0's
//! client (the MAC and address of the client's default gateway, so the client needs no
//! change), `vx200` toward the internet gateway and `vx300` toward the service gateway
//! (the MACs and addresses the gateways already have as static neighbours). The kernel
//! decapsulates, routes, optionally NATs, and encapsulates again: the same two VXLAN
//! hops per packet as through the PP node.
//!
//! - [`KernelMode::Forward`]: routing only; the internet host sees the client's private
//!   address (the internet gateway routes 198.19.0.0/16 back).
//! - [`KernelMode::Snat`]: nftables source NAT to the tenant's pool address, i.e.
//!   masquerade with the pool address as the translated source (masquerade proper would
//!   take the address of `vx200`; the NAT engine, conntrack, is the same).
//! - [`KernelMode::DnatLb`]: an nftables DNAT load balancer, the VIP's TCP port 80
//!   spread over the nginx backends by a hash of the client's address and port (`jhash`
//!   map), since this kernel has no IPVS.
//!
//! Only VPC 0 is served (one routing table cannot hold overlapping tenants; the
//! baselines measure one tenant's traffic).

use std::fmt::Write as _;

use crate::cmd::{self, CONFIG_LIMIT};
use crate::services::HTTP_PORT;
use crate::topo::{addr, mac, vni, Node, Testbed};
use crate::Result;

/// What the kernel does in the PP namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelMode {
    Forward,
    Snat,
    DnatLb,
}

impl KernelMode {
    pub fn name(self) -> &'static str {
        match self {
            KernelMode::Forward => "kernel forward",
            KernelMode::Snat => "kernel nft SNAT",
            KernelMode::DnatLb => "kernel nft DNAT LB",
        }
    }
}

/// The nftables ruleset of `mode` (empty for plain forwarding).
pub fn ruleset(mode: KernelMode, backends: usize) -> String {
    match mode {
        KernelMode::Forward => String::new(),
        KernelMode::Snat => format!(
            "table ip sfbase {{\n\
             \x20 chain post {{ type nat hook postrouting priority srcnat; policy accept;\n\
             \x20   oifname \"vx{}\" snat ip to {}; }}\n\
             }}\n",
            vni::INTERNET,
            addr::pool(0)
        ),
        KernelMode::DnatLb => {
            let mut map = String::new();
            for k in 0..backends {
                let _ = write!(
                    map,
                    "{}{k} : {}",
                    if k > 0 { ", " } else { "" },
                    addr::backend(k)
                );
            }
            format!(
                "table ip sfbase {{\n\
                 \x20 chain pre {{ type nat hook prerouting priority dstnat; policy accept;\n\
                 \x20   ip daddr {} tcp dport {HTTP_PORT} dnat ip to jhash ip saddr . tcp sport mod {backends} seed 0x5f5f map {{ {map} }}; }}\n\
                 }}\n",
                addr::VIP
            )
        }
    }
}

/// The kernel in the PP namespace, configured for one mode.
pub struct Kernel {
    pub mode: KernelMode,
    devs: Vec<String>,
}

/// Configure the PP namespace's kernel for `mode`. No starfabric PP node may run (they
/// would both want UDP 4789).
pub fn start_kernel(tb: &Testbed, mode: KernelMode) -> Result<Kernel> {
    let ns = tb.ns(Node::Pp);
    let t = vni::tenant(0);
    let mut s = format!(
        "link add vx{t} address {} type vxlan id {t} local {} remote {} dstport 4789 dev up0\n\
         addr add {}/24 dev vx{t}\n\
         link set vx{t} up\n\
         link add vx{i} address {} type vxlan id {i} local {} remote {} dstport 4789 dev up0\n\
         addr add {}/24 dev vx{i}\n\
         link set vx{i} up\n\
         route add {} via {} dev vx{i}\n",
        mac::tenant_gw(0),
        addr::PP,
        addr::client_underlay(0),
        addr::TENANT_GW,
        mac::PP_IGW,
        addr::PP,
        addr::IGW,
        addr::PP_IGW_VX,
        addr::PUBLIC,
        addr::IGW_VX,
        i = vni::INTERNET,
    );
    let mut devs = vec![format!("vx{t}"), format!("vx{}", vni::INTERNET)];
    if tb.spec.backends > 0 {
        let v = vni::SERVICES;
        let _ = write!(
            s,
            "link add vx{v} address {} type vxlan id {v} local {} remote {} dstport 4789 dev up0\n\
             addr add {}/24 dev vx{v}\n\
             link set vx{v} up\n\
             route add 198.19.3.0/24 via {} dev vx{v}\n",
            mac::PP_SVC,
            addr::PP,
            addr::SVC,
            addr::PP_SVC_VX,
            addr::SVC_VX,
        );
        devs.push(format!("vx{v}"));
    }
    let k = Kernel { mode, devs };
    if let Err(e) = cmd::ip_batch(&ns, &s) {
        k.remove(tb);
        return Err(e);
    }
    let rules = ruleset(mode, tb.spec.backends);
    if !rules.is_empty() {
        if let Err(e) = cmd::nft(&ns, &rules) {
            k.remove(tb);
            return Err(e);
        }
    }
    Ok(k)
}

/// Spread the receive processing of `dev` in `n`'s namespace over every CPU (RPS): a
/// veth has no RSS, so without it the whole kernel path of a packet runs on the CPU of
/// whoever sent it into the veth. Returns the mask written.
pub fn enable_rps(tb: &Testbed, n: Node, dev: &str) -> Result<String> {
    let cpus = std::thread::available_parallelism()
        .map_or(1, |c| c.get())
        .min(32);
    let mask = format!("{:x}", (1u64 << cpus) - 1);
    // `ip netns exec` mounts a sysfs of the namespace, so the path names its `dev`.
    let script = format!("echo {mask} > /sys/class/net/{dev}/queues/rx-0/rps_cpus");
    cmd::in_ns(&tb.ns(n), &["sh", "-c", &script], CONFIG_LIMIT)?;
    Ok(mask)
}

/// Undo [`enable_rps`].
pub fn disable_rps(tb: &Testbed, n: Node, dev: &str) -> Result<()> {
    let script = format!("echo 0 > /sys/class/net/{dev}/queues/rx-0/rps_cpus");
    cmd::in_ns(&tb.ns(n), &["sh", "-c", &script], CONFIG_LIMIT).map(drop)
}

impl Kernel {
    /// Undo [`start_kernel`]: the devices and the nftables table go.
    pub fn stop(self, tb: &Testbed) {
        self.remove(tb);
    }

    fn remove(&self, tb: &Testbed) {
        let ns = tb.ns(Node::Pp);
        for d in &self.devs {
            let _ = cmd::ip(&["-n", &ns, "link", "del", d]);
        }
        let _ = cmd::in_ns(
            &ns,
            &["nft", "delete", "table", "ip", "sfbase"],
            CONFIG_LIMIT,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rulesets() {
        assert!(ruleset(KernelMode::Forward, 3).is_empty());
        let s = ruleset(KernelMode::Snat, 3);
        assert!(
            s.contains("oifname \"vx200\" snat ip to 198.18.201.1;"),
            "{s}"
        );
        let l = ruleset(KernelMode::DnatLb, 3);
        assert!(
            l.contains("map { 0 : 198.19.3.11, 1 : 198.19.3.12, 2 : 198.19.3.13 }"),
            "{l}"
        );
        assert!(l.contains("ip daddr 198.19.2.100 tcp dport 80"), "{l}");
    }
}
