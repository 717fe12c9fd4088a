//! Wire formats for the PP data plane.
//!
//! Zero-copy parsing of Ethernet (+802.1Q/QinQ), ARP, IPv4 (options kept, fragments
//! flagged), IPv6 (extension headers walked), TCP, UDP, ICMPv4/ICMPv6 (errors quote an
//! inner header) and VXLAN into a small `Copy` [`Frame`] of offsets and scalar fields;
//! RFC 1624 incremental checksum updates ([`csum`]); in-place NAT rewrites ([`rewrite`]);
//! and header writers for encapsulation and for building test frames ([`build`]).
//!
//! Nothing here allocates per packet. Truncated or malformed input yields a typed
//! [`ParseError`], never a panic (the `parse_frame` fuzz target checks this).
//!
//! Field access goes through `smoltcp::wire` views; smoltcp has no 802.1Q, no VXLAN,
//! no incremental checksum and only untyped length errors, so those parts and the length
//! validation (which decides *which* typed error a frame gets) are written here.

pub mod build;
pub mod csum;
mod error;
mod parse;
pub mod rewrite;
pub mod wire;

pub use error::{Layer, ParseError};
pub use parse::{
    parse_frame, parse_frame_with, vxlan_fast, Frag, Frame, IcmpKind, Ip, IpVersion, ParseOptions,
    Quote, VxlanMeta, L3, L4, VXLAN_PORT,
};

/// IP protocol numbers used by the data plane.
pub mod proto {
    pub const ICMP: u8 = 1;
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const ICMPV6: u8 = 58;
}

/// TCP header flag bits (RFC 9293 §3.1), for the data plane and the frames tests build.
pub mod tcp_flags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const PSH: u8 = 0x08;
    pub const ACK: u8 = 0x10;
}

/// EtherTypes used by the data plane.
pub mod ethertype {
    pub const IPV4: u16 = 0x0800;
    pub const ARP: u16 = 0x0806;
    pub const VLAN: u16 = 0x8100;
    pub const QINQ: u16 = 0x88a8;
    pub const IPV6: u16 = 0x86dd;
}
