//! Source NAT with ports (NAPT, v4 or v6) as an NF, following RFC 4787 (UDP), RFC 5382
//! (TCP) and RFC 5508 (ICMP).
//!
//! State, in the design's words, all of it in platform-owned tables (`nf::StateTables`),
//! which the platform snapshots, splits, merges and replicates by each table's
//! `SplitRule` (`table.rs`):
//! - the **PortPool** (`port-pool`, a pool table): per (pool address, protocol) the
//!   ports this partition may still hand out. A split gives each side half of the
//!   *free* ports (paper 000 §4.1: `<addr, 1024-4096>` becomes two ranges), and a merge
//!   takes their union. Ports in use are in nobody's free set; they belong to the
//!   mapping that uses them.
//! - the **mappings** (`mappings`, a with-flows table): external endpoint → internal
//!   endpoint. Under endpoint-independent mapping one mapping serves every flow of an
//!   internal endpoint (declared shared-write, partitioned); under endpoint-dependent
//!   mapping each serves one remote endpoint (declared per-flow). Either way a mapping
//!   goes with the flows that use it, and one used on both sides of a split is copied
//!   with its share halved.
//! - the **address pairing** (`address-pairing`, copied): internal address → the pool
//!   address its mappings use (RFC 4787 REQ-2).
//! - the **flows** (`flows`, per-flow): the rewrites handed to PP and the TCP state, with
//!   the expiry deadline as the row's timer.
//! - the counters (`stats`, replicated).
//!
//! SC only sees a flow's first packet (and the events PP reports: handshake done,
//! FIN/RST, activity, expiry), which shapes three choices documented in
//! `docs/nf-api.md`: a SYN-opened TCP flow is transitory until PP reports its handshake
//! done while PP's rule gets the established timeout, inbound unsolicited traffic is refused,
//! and a mapping copied to both sides of a split keeps its port reserved until the
//! copies are merged again (weighted reference counting).

mod config;
mod nf;
mod snapshot;
mod table;

pub use ::nf::pool::PROBES;
pub use config::{MappingBehaviour, PortRange, SnatConfig, SnatPool, SnatTimeouts};
pub use nf::Snat;
pub use table::{ExternalEndpoint, MappingInfo, MappingKey, SnatStats};

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
