use thiserror::Error;

/// The header a parse error refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layer {
    Ethernet,
    Vlan,
    Arp,
    Ipv4,
    Ipv6,
    Ipv6Ext,
    Tcp,
    Udp,
    Icmp,
    Vxlan,
    /// The header an ICMP error quotes.
    IcmpQuote,
}

/// Why a frame could not be parsed. Each variant maps to one counted drop reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum ParseError {
    #[error("{0:?} header truncated")]
    Truncated(Layer),
    #[error("{layer:?} header invalid: {what}")]
    BadHeader { layer: Layer, what: &'static str },
    /// RFC 4942 §2.1.4: IPv4-mapped addresses must not appear in IPv6 packets on the wire.
    /// Refusing them also keeps the v4 and v6 flow-key spaces disjoint.
    #[error("IPv6 packet carries an IPv4-mapped address")]
    V4MappedAddress,
}

impl ParseError {
    /// The stable drop-reason name used in counters and in the golden corpus.
    pub fn reason(&self) -> &'static str {
        match self {
            ParseError::Truncated(_) => "truncated",
            ParseError::BadHeader { .. } => "bad-header",
            ParseError::V4MappedAddress => "v4-mapped",
        }
    }
}
