//! In-place NAT rewrites with incremental checksum updates.
//!
//! Every function here changes bytes of a frame that [`crate::parse_frame`] accepted, and
//! keeps every checksum that covers them valid with RFC 1624 deltas: the IPv4 header
//! checksum, the TCP/UDP/ICMPv6 checksums (whose pseudo-header covers the addresses),
//! the ICMPv4/ICMPv6 checksum over a quoted packet, and the quoted packet's own checksums.

use thiserror::Error;

use crate::csum::{self, get16, put16, Delta};
use crate::parse::{IcmpKind, Ip, IpVersion, Quote, L4};
use crate::proto;

/// Which endpoint of a packet a rewrite changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Src,
    Dst,
}

/// An address to write: its length selects the family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Addr {
    V4([u8; 4]),
    V6([u8; 16]),
}

impl Addr {
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Addr::V4(a) => a,
            Addr::V6(a) => a,
        }
    }

    #[inline]
    pub fn version(&self) -> IpVersion {
        match self {
            Addr::V4(_) => IpVersion::V4,
            Addr::V6(_) => IpVersion::V6,
        }
    }
}

impl From<std::net::IpAddr> for Addr {
    fn from(a: std::net::IpAddr) -> Self {
        match a {
            std::net::IpAddr::V4(a) => Addr::V4(a.octets()),
            std::net::IpAddr::V6(a) => Addr::V6(a.octets()),
        }
    }
}

impl From<Addr> for std::net::IpAddr {
    fn from(a: Addr) -> Self {
        match a {
            Addr::V4(a) => std::net::IpAddr::from(a),
            Addr::V6(a) => std::net::IpAddr::from(a),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum RewriteError {
    #[error("address family of the rewrite does not match the packet")]
    FamilyMismatch,
}

/// Replace the bytes at `range` with `new`, recording the change into `delta`.
#[inline]
fn swap_bytes(buf: &mut [u8], at: usize, new: &[u8], delta: &mut Delta) {
    let old = &mut buf[at..at + new.len()];
    delta.bytes(old, new);
    old.copy_from_slice(new);
}

/// Replace the u16 at `at`, recording the change into `delta`.
#[inline]
fn swap16(buf: &mut [u8], at: usize, new: u16, delta: &mut Delta) {
    let old = get16(buf, at);
    delta.word(old, new);
    put16(buf, at, new);
}

/// Offset of the transport checksum field for `proto`, if it lies before `end`.
#[inline]
fn l4_csum_off(proto: u8, l4: usize, end: usize) -> Option<usize> {
    let off = match proto {
        proto::TCP => l4 + 16,
        proto::UDP => l4 + 6,
        proto::ICMP | proto::ICMPV6 => l4 + 2,
        _ => return None,
    };
    (off + 2 <= end).then_some(off)
}

/// Where the "port" of `side` lives for an IP packet's own transport header: TCP/UDP
/// ports, or the ICMP echo identifier (source for a request, destination for a reply).
#[inline]
fn port_off(ip: &Ip, side: Side) -> Option<usize> {
    let l4 = ip.l4_off();
    match (ip.l4, side) {
        (L4::Tcp { .. } | L4::Udp { .. }, Side::Src) => Some(l4),
        (L4::Tcp { .. } | L4::Udp { .. }, Side::Dst) => Some(l4 + 2),
        (
            L4::Icmp {
                kind: IcmpKind::EchoRequest { .. },
                ..
            },
            Side::Src,
        )
        | (
            L4::Icmp {
                kind: IcmpKind::EchoReply { .. },
                ..
            },
            Side::Dst,
        ) => Some(l4 + 4),
        _ => None,
    }
}

/// Apply a transport-checksum delta. UDP is special in both families: a zero field means
/// "no checksum" (IPv4, RFC 768) or a tunnel's zero checksum (IPv6, RFC 6935) and stays
/// zero, and a computed zero is sent as 0xffff (RFC 768, RFC 8200 §8.1).
#[inline]
fn patch_l4(buf: &mut [u8], proto: u8, off: usize, delta: Delta) {
    if proto == proto::UDP {
        csum::patch_udp(buf, off, delta);
    } else {
        csum::patch(buf, off, delta);
    }
}

/// Rewrite one endpoint (address and/or port) of a packet's own headers. A port is
/// ignored where the packet has none (other protocols, the id-less side of an echo).
/// Later fragments carry no transport header, so only the address changes.
#[inline]
pub fn rewrite_endpoint(
    buf: &mut [u8],
    ip: &Ip,
    side: Side,
    addr: Option<&Addr>,
    port: Option<u16>,
) -> Result<(), RewriteError> {
    let mut addr_delta = Delta::ZERO;
    if let Some(a) = addr {
        if a.version() != ip.version {
            return Err(RewriteError::FamilyMismatch);
        }
        let at = match side {
            Side::Src => ip.src_range().start,
            Side::Dst => ip.dst_range().start,
        };
        swap_bytes(buf, at, a.as_bytes(), &mut addr_delta);
        if ip.version == IpVersion::V4 {
            csum::patch(buf, ip.off as usize + 10, addr_delta);
        }
    }
    if ip.frag == crate::Frag::NonFirst {
        return Ok(());
    }
    let mut l4_delta = Delta::ZERO;
    // ICMPv4's checksum has no pseudo-header; every other transport checksum does.
    if !(ip.proto == proto::ICMP && ip.version == IpVersion::V4) {
        l4_delta.add(addr_delta);
    }
    if let (Some(p), Some(at)) = (port, port_off(ip, side)) {
        swap16(buf, at, p, &mut l4_delta);
    }
    if l4_delta.is_zero() {
        return Ok(());
    }
    if let Some(c) = l4_csum_off(ip.proto, ip.l4_off(), ip.end as usize) {
        patch_l4(buf, ip.proto, c, l4_delta);
    }
    Ok(())
}

/// Translate an ICMP error the way a NAT translates the flow it belongs to.
///
/// The error is matched on the reversed 5-tuple of the packet it quotes, so the rule it
/// gets is the one for traffic flowing *toward* the quoted packet's source. A rule that
/// rewrites the destination (`side == Dst`) therefore rewrites the outer destination and
/// the quoted source; one that rewrites the source rewrites the outer source and the
/// quoted destination. This mirrors Linux `nf_nat_icmp_reply_translation`.
pub fn rewrite_icmp_error(
    buf: &mut [u8],
    ip: &Ip,
    quote: &Quote,
    side: Side,
    addr: Option<&Addr>,
    port: Option<u16>,
) -> Result<(), RewriteError> {
    let icmp_off = ip.l4_off();
    let icmp_end = ip.end as usize;
    // Change of the ICMP message body (the quote) and, for ICMPv6, of its pseudo-header.
    let mut icmp_delta = Delta::ZERO;

    if let Some(a) = addr {
        if a.version() != ip.version || a.version() != quote.version {
            return Err(RewriteError::FamilyMismatch);
        }
        // Outer header.
        let outer_at = match side {
            Side::Src => ip.src_range().start,
            Side::Dst => ip.dst_range().start,
        };
        let mut outer = Delta::ZERO;
        swap_bytes(buf, outer_at, a.as_bytes(), &mut outer);
        match ip.version {
            IpVersion::V4 => csum::patch(buf, ip.off as usize + 10, outer),
            IpVersion::V6 => icmp_delta.add(outer),
        }
    }

    // The quoted packet travels the other way: our Dst is its Src.
    let qside = match side {
        Side::Src => Side::Dst,
        Side::Dst => Side::Src,
    };
    let qip = quote.as_ip();
    let q_end = quote.end as usize;
    let mut q_addr = Delta::ZERO;
    if let Some(a) = addr {
        let at = match qside {
            Side::Src => qip.src_range().start,
            Side::Dst => qip.dst_range().start,
        };
        swap_bytes(buf, at, a.as_bytes(), &mut q_addr);
        icmp_delta.add(q_addr);
        if quote.version == IpVersion::V4 {
            let at = quote.off as usize + 10;
            let old = get16(buf, at);
            let new = q_addr.apply(old);
            swap16(buf, at, new, &mut icmp_delta);
        }
    }

    // Quoted transport header: port (or echo id) and its checksum, where quoted.
    let q_l4 = quote.l4_off();
    let mut q_l4_delta = Delta::ZERO;
    if !(quote.proto == proto::ICMP && quote.version == IpVersion::V4) {
        q_l4_delta.add(q_addr);
    }
    if let Some(p) = port {
        let at = match (quote.proto, qside) {
            (proto::TCP | proto::UDP, Side::Src) => Some(q_l4),
            (proto::TCP | proto::UDP, Side::Dst) => Some(q_l4 + 2),
            (proto::ICMP | proto::ICMPV6, s) => match (quote.version, quote.icmp_type, s) {
                (IpVersion::V4, 8, Side::Src)
                | (IpVersion::V6, 128, Side::Src)
                | (IpVersion::V4, 0, Side::Dst)
                | (IpVersion::V6, 129, Side::Dst) => Some(q_l4 + 4),
                _ => None,
            },
            _ => None,
        };
        if let Some(at) = at {
            let mut d = Delta::ZERO;
            swap16(buf, at, p, &mut d);
            icmp_delta.add(d);
            q_l4_delta.add(d);
        }
    }
    if !q_l4_delta.is_zero() {
        if let Some(c) = l4_csum_off(quote.proto, q_l4, q_end) {
            let old = get16(buf, c);
            let new = if quote.proto == proto::UDP {
                q_l4_delta.apply_udp(old)
            } else {
                q_l4_delta.apply(old)
            };
            swap16(buf, c, new, &mut icmp_delta);
        }
    }

    if !icmp_delta.is_zero() && icmp_off + 4 <= icmp_end {
        csum::patch(buf, icmp_off + 2, icmp_delta);
    }
    Ok(())
}
