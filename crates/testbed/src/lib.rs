//! The netns testbed: starfabric's topology on one machine, built from network namespaces,
//! veth pairs and Linux VXLAN devices, with real traffic tools at its edges.
//!
//! ```text
//!  VPC client c<j>  ──vxlan VNI 100+j──▶ ┐
//!                                        │ underlay router (rt), plain IPv4 routing
//!  PP node (pp)  ◀──────── veth ─────────┤   198.18.0.0/17
//!  control (ctl): FM + SC nodes ◀────────┤
//!  internet gateway (igw) ◀─VNI 200──────┤──▶ internet host (inet): nginx, iperf3, stund
//!  service gateway (svc)  ◀─VNI 300──────┘──▶ nginx backends b<k>
//! ```
//!
//! Everything here is made by the testbed in namespaces named with a per-run prefix,
//! addressed only from 198.18.0.0/15 (RFC 2544's benchmarking range), and deleted again
//! by [`Resources`] on drop, on a panic, on SIGINT/SIGTERM ([`install_signal_cleanup`]),
//! or by `starfabric testbed down` from a state file. Nothing touches the host's own
//! links, routes or namespaces: every device is created from inside a testbed namespace.
//!
//! Modules:
//! - [`topo`]: the topology, its addresses ([`topo::addr`]), VNIs and MACs;
//! - [`cleanup`]: what a run created, and deleting it;
//! - [`services`]: nginx, iperf3 and STUN servers inside the namespaces;
//! - [`platform`]: starting starfabric (FM, SC group, PP) with FM configuration files;
//! - [`chains`]: tenant chains (SNAT, LB, FW, FW → SNAT) wired to this topology;
//! - [`baseline`]: the PP namespace running the Linux kernel instead (forwarding,
//!   nftables SNAT, an nftables DNAT load balancer);
//! - [`elastic`]: SC scale-out, scale-in and replica crashes under live traffic (a
//!   new-connection loop, iperf3 flows, a per-node timeline);
//! - [`isolation`]: tenant isolation at the PP node (paper 000 §7.2, Fig. 10): a tenant's
//!   hping3 SYN flood against another's paced connections, its credit states and
//!   admitted rate from the PP node's metrics, fairness and work conservation among
//!   flooding tenants;
//! - [`ipsec`]: an IPsec remote site (its gateway terminates ESP with the kernel's
//!   `ip xfrm`, or with a userspace peer where the kernel has no ESP) and the kernel
//!   xfrm baseline in the PP namespace (docs/ipsec.md);
//! - [`measure`]: TCP Gbit/s (iperf3), 64-byte UDP packets/s (trafgen), new TCP
//!   connections/s (wrk).

pub mod baseline;
pub mod chains;
pub mod cleanup;
pub mod cmd;
pub mod elastic;
pub mod ipsec;
pub mod isolation;
pub mod ladder;
pub mod measure;
pub mod platform;
pub mod probe;
pub mod services;
pub mod topo;

pub use cleanup::{install_signal_cleanup, interrupted, sweep_stale, Resources};
pub use topo::{Node, Testbed, TopologySpec};

use thiserror::Error;

/// What can go wrong building, running or measuring the testbed.
#[derive(Debug, Error)]
pub enum Error {
    /// A command ran and failed (or printed what it must not).
    #[error("`{cmd}` failed: {msg}")]
    Command { cmd: String, msg: String },
    /// A command or a wait overran its time bound.
    #[error("{what}: timed out after {secs:.1} s")]
    Timeout { what: String, secs: f64 },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// Output of a tool that does not have the expected shape.
    #[error("cannot parse {what}: {msg}")]
    Parse { what: String, msg: String },
    /// The testbed needs root (namespaces, veth, nftables).
    #[error("the testbed needs root (network namespaces, veth, nftables): run as root")]
    NotRoot,
    /// A tool the testbed drives is missing.
    #[error("`{0}` is not installed (scripts/setup.sh installs it)")]
    MissingTool(String),
    /// A SIGINT/SIGTERM arrived; the run was cleaned up.
    #[error("interrupted by a signal")]
    Interrupted,
    #[error("{0}")]
    Setup(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            what: what.into(),
            source,
        }
    }
}

/// Is this process root? Namespaces, veths and nftables need it.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The tools the testbed drives, and the flag that proves each is there.
pub const TOOLS: &[(&str, &str)] = &[
    ("ip", "-V"),
    ("ethtool", "--version"),
    ("nft", "--version"),
    ("nginx", "-v"),
    ("iperf3", "--version"),
    ("wrk", "--version"),
    ("curl", "--version"),
    ("nc", "-h"),
    ("trafgen", "--version"),
    ("stun", "--help"),
    ("stund", "--help"),
];

/// Check that we are root and every tool is installed.
pub fn check_prerequisites() -> Result<()> {
    if !is_root() {
        return Err(Error::NotRoot);
    }
    for (tool, _) in TOOLS {
        if cmd::which(tool).is_none() {
            return Err(Error::MissingTool(tool.to_string()));
        }
    }
    Ok(())
}
