//! Zero-copy frame parsing into offsets.

use smoltcp::wire::{EthernetFrame, Ipv4Packet, Ipv6Packet, TcpPacket, UdpPacket};

use crate::error::{Layer, ParseError};
use crate::{ethertype, proto};

/// IANA-assigned VXLAN UDP port (RFC 7348 §5).
pub const VXLAN_PORT: u16 = 4789;

/// IPv6 extension headers walked before giving up; real traffic uses two or three.
const MAX_V6_EXT_HEADERS: usize = 8;

/// Knobs of the parser.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseOptions {
    /// UDP destination port that marks VXLAN (Linux's own default device uses 8472).
    pub vxlan_port: u16,
}

impl Default for ParseOptions {
    fn default() -> Self {
        ParseOptions {
            vxlan_port: VXLAN_PORT,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpVersion {
    V4,
    V6,
}

/// Fragmentation state of an IP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frag {
    /// A whole datagram.
    None,
    /// The first fragment: it carries the transport header.
    First,
    /// A later fragment: no transport header, so no ports.
    NonFirst,
}

/// What an ICMP message is, as far as flow matching cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IcmpKind {
    EchoRequest {
        id: u16,
    },
    EchoReply {
        id: u16,
    },
    /// An error quoting (the start of) the packet that caused it.
    Error(Quote),
    Other,
}

/// The transport header of an IP packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L4 {
    /// A later fragment, or a protocol the data plane does not look into.
    None,
    Tcp {
        sport: u16,
        dport: u16,
        flags: u8,
    },
    Udp {
        sport: u16,
        dport: u16,
        len: u16,
    },
    Icmp {
        ty: u8,
        code: u8,
        kind: IcmpKind,
    },
}

/// An IP packet inside a frame. Offsets are from the start of the frame buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ip {
    pub version: IpVersion,
    /// Offset of the IP header.
    pub off: u16,
    /// IPv4 IHL·4; IPv6 40 plus the extension headers.
    pub hdr_len: u16,
    /// One past the last byte of the IP packet. Bytes after it are Ethernet padding.
    pub end: u16,
    /// Upper-layer protocol (after IPv6 extension headers).
    pub proto: u8,
    pub frag: Frag,
    pub l4: L4,
}

impl Ip {
    /// The same header seen from `by` bytes earlier in the buffer (for an inner frame
    /// parsed from a sub-slice).
    pub fn shifted(mut self, by: u16) -> Ip {
        self.off += by;
        self.end += by;
        if let L4::Icmp {
            kind: IcmpKind::Error(q),
            ..
        } = &mut self.l4
        {
            *q = q.shifted(by);
        }
        self
    }

    /// The quote of an ICMP error, if this is one.
    pub fn icmp_quote(&self) -> Option<&Quote> {
        match &self.l4 {
            L4::Icmp {
                kind: IcmpKind::Error(q),
                ..
            } => Some(q),
            _ => None,
        }
    }

    /// Offset of the transport header.
    #[inline]
    pub fn l4_off(&self) -> usize {
        self.off as usize + self.hdr_len as usize
    }

    /// Offset and length of the source address.
    #[inline]
    pub fn src_range(&self) -> core::ops::Range<usize> {
        match self.version {
            IpVersion::V4 => self.off as usize + 12..self.off as usize + 16,
            IpVersion::V6 => self.off as usize + 8..self.off as usize + 24,
        }
    }

    /// Offset and length of the destination address.
    #[inline]
    pub fn dst_range(&self) -> core::ops::Range<usize> {
        match self.version {
            IpVersion::V4 => self.off as usize + 16..self.off as usize + 20,
            IpVersion::V6 => self.off as usize + 24..self.off as usize + 40,
        }
    }
}

/// The packet an ICMP error quotes (RFC 792 / RFC 4443 §2.4(c)): its IP header and at
/// least the first 8 bytes of its transport header. Offsets are from the frame start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quote {
    pub version: IpVersion,
    pub off: u16,
    pub hdr_len: u16,
    /// One past the last quoted byte (the quote is usually truncated).
    pub end: u16,
    pub proto: u8,
    /// Quoted ports; for a quoted ICMP echo the identifier sits in `sport` (request) or
    /// `dport` (reply), the same convention as flow keys.
    pub sport: u16,
    pub dport: u16,
    /// For a quoted ICMP message: its type.
    pub icmp_type: u8,
}

impl Quote {
    pub fn shifted(mut self, by: u16) -> Quote {
        self.off += by;
        self.end += by;
        self
    }

    #[inline]
    pub fn l4_off(&self) -> usize {
        self.off as usize + self.hdr_len as usize
    }

    pub fn as_ip(&self) -> Ip {
        Ip {
            version: self.version,
            off: self.off,
            hdr_len: self.hdr_len,
            end: self.end,
            proto: self.proto,
            frag: Frag::None,
            l4: L4::None,
        }
    }
}

/// VXLAN header found inside a UDP datagram (RFC 7348 §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VxlanMeta {
    pub vni: u32,
    /// Offset of the VXLAN header.
    pub off: u16,
    /// Offset of the inner Ethernet frame.
    pub inner_off: u16,
    /// One past the inner frame's last byte.
    pub inner_end: u16,
}

/// Network layer of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L3 {
    Ip(Ip),
    Arp,
    /// Any other EtherType; the data plane passes or drops it without parsing.
    Other,
}

/// A parsed frame: offsets and the scalar fields flow matching needs. `Copy`, no
/// borrows, no allocation: it is read alongside the buffer it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame {
    /// Total frame length as parsed.
    pub len: u16,
    /// EtherType after any VLAN tags.
    pub ethertype: u16,
    /// Number of 802.1Q/802.1ad tags (0–2).
    pub vlan_tags: u8,
    /// TCI of the outermost tag, if any.
    pub vlan_tci: u16,
    /// Offset of the network header.
    pub l3_off: u16,
    pub l3: L3,
    pub vxlan: Option<VxlanMeta>,
}

impl Frame {
    #[inline]
    pub fn ip(&self) -> Option<&Ip> {
        match &self.l3 {
            L3::Ip(ip) => Some(ip),
            _ => None,
        }
    }

    /// The VXLAN payload (the inner Ethernet frame), when this frame carries one.
    #[inline]
    pub fn vxlan_inner<'a>(&self, buf: &'a [u8]) -> Option<&'a [u8]> {
        let v = self.vxlan?;
        buf.get(v.inner_off as usize..v.inner_end as usize)
    }
}

/// The common tenant-traffic outer header, recognised in a handful of compares: untagged
/// Ethernet, IPv4 without options or fragmentation, UDP to the VXLAN port, I flag set,
/// consistent lengths. Returns the VXLAN header's place, or `None` for anything else,
/// which then takes [`parse_frame_with`] (whose result on the frames accepted here is the
/// same; a property test checks it). VPP's vxlan4-input makes the same bet.
#[inline(always)]
pub fn vxlan_fast(buf: &[u8], vxlan_port: u16) -> Option<VxlanMeta> {
    let h = buf.get(..50)?;
    if h[12] != 0x08 || h[13] != 0x00 || h[14] != 0x45 || h[23] != proto::UDP {
        return None;
    }
    let total = u16::from_be_bytes([h[16], h[17]]) as usize;
    let udp_len = u16::from_be_bytes([h[38], h[39]]) as usize;
    if u16::from_be_bytes([h[20], h[21]]) & 0x3fff != 0
        || u16::from_be_bytes([h[36], h[37]]) != vxlan_port
        || total + 14 > buf.len()
        || udp_len < 16
        || udp_len + 20 > total
        || h[42] & 0x08 == 0
    {
        return None;
    }
    Some(VxlanMeta {
        vni: u32::from_be_bytes([0, h[46], h[47], h[48]]),
        off: 42,
        inner_off: 50,
        inner_end: (34 + udp_len) as u16,
    })
}

/// Parse a frame with the default options.
#[inline]
pub fn parse_frame(buf: &[u8]) -> Result<Frame, ParseError> {
    parse_frame_with(buf, &ParseOptions::default())
}

/// Parse a frame: Ethernet, VLAN tags, then IPv4/IPv6/ARP, the transport header, an ICMP
/// error's quote, and a VXLAN header. The inner frame of VXLAN is not parsed: call
/// `parse_frame` again on [`Frame::vxlan_inner`].
#[inline(always)]
pub fn parse_frame_with(buf: &[u8], opts: &ParseOptions) -> Result<Frame, ParseError> {
    if buf.len() > u16::MAX as usize {
        return Err(ParseError::BadHeader {
            layer: Layer::Ethernet,
            what: "frame longer than 65535 bytes",
        });
    }
    EthernetFrame::new_checked(buf).map_err(|_| ParseError::Truncated(Layer::Ethernet))?;
    // Raw EtherType: smoltcp's `ethertype()` maps through an enum, measurably slower.
    let mut et: u16 = u16::from_be_bytes([buf[12], buf[13]]);
    let mut off = EthernetFrame::<&[u8]>::header_len();
    let mut vlan_tags = 0u8;
    let mut vlan_tci = 0u16;
    while et == ethertype::VLAN || et == ethertype::QINQ {
        if vlan_tags == 2 {
            return Err(ParseError::BadHeader {
                layer: Layer::Vlan,
                what: "more than two VLAN tags",
            });
        }
        let tag = buf
            .get(off..off + 4)
            .ok_or(ParseError::Truncated(Layer::Vlan))?;
        if vlan_tags == 0 {
            vlan_tci = u16::from_be_bytes([tag[0], tag[1]]);
        }
        et = u16::from_be_bytes([tag[2], tag[3]]);
        off += 4;
        vlan_tags += 1;
    }
    let mut frame = Frame {
        len: buf.len() as u16,
        ethertype: et,
        vlan_tags,
        vlan_tci,
        l3_off: off as u16,
        l3: L3::Other,
        vxlan: None,
    };
    match et {
        ethertype::IPV4 => {
            let ip = parse_ipv4(buf, off)?;
            frame.vxlan = parse_vxlan(buf, &ip, opts)?;
            frame.l3 = L3::Ip(ip);
        }
        ethertype::IPV6 => {
            let ip = parse_ipv6(buf, off)?;
            frame.vxlan = parse_vxlan(buf, &ip, opts)?;
            frame.l3 = L3::Ip(ip);
        }
        ethertype::ARP => {
            // Ethernet/IPv4 ARP is 28 bytes (RFC 826).
            if buf.len() < off + 28 {
                return Err(ParseError::Truncated(Layer::Arp));
            }
            frame.l3 = L3::Arp;
        }
        _ => {}
    }
    Ok(frame)
}

fn bad(layer: Layer, what: &'static str) -> ParseError {
    ParseError::BadHeader { layer, what }
}

/// The IP header at `off`: at least `min` bytes, with version `version`.
#[inline(always)]
fn ip_header<'a>(
    buf: &'a [u8],
    off: usize,
    min: usize,
    version: u8,
    layer: Layer,
    what: &'static str,
) -> Result<&'a [u8], ParseError> {
    let b = &buf[off..];
    if b.len() < min {
        return Err(ParseError::Truncated(layer));
    }
    if b[0] >> 4 != version {
        return Err(bad(layer, what));
    }
    Ok(b)
}

#[inline(always)]
fn parse_ipv4(buf: &[u8], off: usize) -> Result<Ip, ParseError> {
    let b = ip_header(buf, off, 20, 4, Layer::Ipv4, "version is not 4")?;
    let p = Ipv4Packet::new_unchecked(b);
    let hl = p.header_len() as usize;
    if hl < 20 {
        return Err(bad(Layer::Ipv4, "IHL below 5"));
    }
    if b.len() < hl {
        return Err(ParseError::Truncated(Layer::Ipv4));
    }
    let total = p.total_len() as usize;
    if total < hl {
        return Err(bad(Layer::Ipv4, "total length below header length"));
    }
    if total > b.len() {
        return Err(ParseError::Truncated(Layer::Ipv4));
    }
    let frag = if p.frag_offset() != 0 {
        Frag::NonFirst
    } else if p.more_frags() {
        Frag::First
    } else {
        Frag::None
    };
    // Raw protocol byte: smoltcp's `next_header()` maps through an enum (not inlined).
    let proto: u8 = b[9];
    let end = off + total;
    let l4 = if frag == Frag::NonFirst {
        L4::None
    } else {
        parse_l4(buf, off + hl, end, proto, IpVersion::V4, frag)?
    };
    Ok(Ip {
        version: IpVersion::V4,
        off: off as u16,
        hdr_len: hl as u16,
        end: end as u16,
        proto,
        frag,
        l4,
    })
}

/// IPv4-mapped IPv6 address `::ffff:0:0/96`.
#[inline]
fn is_v4_mapped(a: &[u8]) -> bool {
    a[..10].iter().all(|&x| x == 0) && a[10] == 0xff && a[11] == 0xff
}

/// Walk IPv6 extension headers from `off` (the first header after the fixed header, whose
/// type is `next`) up to `end`. Returns (upper protocol, offset of it, fragment state).
/// `strict` = false for quotes, where running out of bytes inside the extension chain is
/// reported as a truncated quote.
#[inline(never)]
fn walk_v6_ext(
    buf: &[u8],
    mut next: u8,
    mut off: usize,
    end: usize,
    layer: Layer,
) -> Result<(u8, usize, Frag), ParseError> {
    let mut frag = Frag::None;
    for i in 0..=MAX_V6_EXT_HEADERS {
        match next {
            // Hop-by-Hop must come first (RFC 8200 §4.1).
            0 if i > 0 => return Err(bad(layer, "hop-by-hop header not first")),
            0 | 43 | 60 => {
                let h = buf
                    .get(off..off + 2)
                    .filter(|_| off + 2 <= end)
                    .ok_or(ParseError::Truncated(layer))?;
                let len = (h[1] as usize + 1) * 8;
                if off + len > end {
                    return Err(ParseError::Truncated(layer));
                }
                next = h[0];
                off += len;
            }
            44 => {
                if off + 8 > end {
                    return Err(ParseError::Truncated(layer));
                }
                let h = &buf[off..off + 8];
                let fo = u16::from_be_bytes([h[2], h[3]]) >> 3;
                let more = h[3] & 1 != 0;
                frag = if fo != 0 {
                    Frag::NonFirst
                } else if more {
                    Frag::First
                } else {
                    // An atomic fragment (RFC 6946): a whole datagram.
                    frag
                };
                next = h[0];
                off += 8;
                if frag == Frag::NonFirst {
                    return Ok((next, off, frag));
                }
            }
            // Authentication Header: length in 4-byte units minus 2 (RFC 4302 §2.2).
            51 => {
                let h = buf
                    .get(off..off + 2)
                    .filter(|_| off + 2 <= end)
                    .ok_or(ParseError::Truncated(layer))?;
                let len = (h[1] as usize + 2) * 4;
                if off + len > end {
                    return Err(ParseError::Truncated(layer));
                }
                next = h[0];
                off += len;
            }
            _ => return Ok((next, off, frag)),
        }
    }
    Err(bad(layer, "too many extension headers"))
}

#[inline(never)]
fn parse_ipv6(buf: &[u8], off: usize) -> Result<Ip, ParseError> {
    let b = ip_header(buf, off, 40, 6, Layer::Ipv6, "version is not 6")?;
    let p = Ipv6Packet::new_unchecked(b);
    let plen = p.payload_len() as usize;
    if plen == 0 && b[6] != 59 {
        // Jumbograms (RFC 2675) cannot occur on Ethernet.
        return Err(bad(Layer::Ipv6, "zero payload length"));
    }
    if 40 + plen > b.len() {
        return Err(ParseError::Truncated(Layer::Ipv6));
    }
    if is_v4_mapped(&b[8..24]) || is_v4_mapped(&b[24..40]) {
        return Err(ParseError::V4MappedAddress);
    }
    let end = off + 40 + plen;
    let (proto, l4_off, frag) = walk_v6_ext(buf, b[6], off + 40, end, Layer::Ipv6Ext)?;
    let l4 = if frag == Frag::NonFirst {
        L4::None
    } else {
        parse_l4(buf, l4_off, end, proto, IpVersion::V6, frag)?
    };
    Ok(Ip {
        version: IpVersion::V6,
        off: off as u16,
        hdr_len: (l4_off - off) as u16,
        end: end as u16,
        proto,
        frag,
        l4,
    })
}

#[inline(always)]
fn parse_l4(
    buf: &[u8],
    off: usize,
    end: usize,
    proto: u8,
    v: IpVersion,
    frag: Frag,
) -> Result<L4, ParseError> {
    let b = &buf[off..end];
    match (proto, v) {
        (proto::TCP, _) => {
            if b.len() < 20 {
                return Err(ParseError::Truncated(Layer::Tcp));
            }
            let t = TcpPacket::new_unchecked(b);
            let hl = t.header_len() as usize;
            if hl < 20 {
                return Err(bad(Layer::Tcp, "data offset below 5"));
            }
            if hl > b.len() {
                return Err(ParseError::Truncated(Layer::Tcp));
            }
            Ok(L4::Tcp {
                sport: t.src_port(),
                dport: t.dst_port(),
                flags: b[13],
            })
        }
        (proto::UDP, _) => {
            if b.len() < 8 {
                return Err(ParseError::Truncated(Layer::Udp));
            }
            let u = UdpPacket::new_unchecked(b);
            let len = u.len() as usize;
            if len < 8 {
                return Err(bad(Layer::Udp, "length below 8"));
            }
            // A first fragment's UDP length covers the whole datagram.
            if len > b.len() && frag != Frag::First {
                return Err(ParseError::Truncated(Layer::Udp));
            }
            Ok(L4::Udp {
                sport: u.src_port(),
                dport: u.dst_port(),
                len: len as u16,
            })
        }
        (proto::ICMP, IpVersion::V4) | (proto::ICMPV6, IpVersion::V6) => {
            parse_icmp(buf, off, end, v, frag)
        }
        _ => Ok(L4::None),
    }
}

#[inline(never)]
fn parse_icmp(
    buf: &[u8],
    off: usize,
    end: usize,
    v: IpVersion,
    frag: Frag,
) -> Result<L4, ParseError> {
    let b = &buf[off..end];
    {
        {
            if b.len() < 8 {
                return Err(ParseError::Truncated(Layer::Icmp));
            }
            let (ty, code) = (b[0], b[1]);
            let id = u16::from_be_bytes([b[4], b[5]]);
            let kind = match (v, ty) {
                (IpVersion::V4, 8) | (IpVersion::V6, 128) => IcmpKind::EchoRequest { id },
                (IpVersion::V4, 0) | (IpVersion::V6, 129) => IcmpKind::EchoReply { id },
                (IpVersion::V4, 3 | 11 | 12) | (IpVersion::V6, 1..=4) => {
                    if frag != Frag::None {
                        return Err(bad(Layer::Icmp, "fragmented ICMP error"));
                    }
                    IcmpKind::Error(parse_quote(buf, off + 8, end, v)?)
                }
                _ => IcmpKind::Other,
            };
            Ok(L4::Icmp { ty, code, kind })
        }
    }
}

/// Parse the packet an ICMP error quotes. The quote is truncated by design, so only
/// the IP header and the first 8 bytes of the transport header are required.
#[cold]
#[inline(never)]
fn parse_quote(buf: &[u8], off: usize, end: usize, v: IpVersion) -> Result<Quote, ParseError> {
    let b = &buf[off..end];
    let (hdr_len, proto) = match v {
        IpVersion::V4 => {
            if b.len() < 20 {
                return Err(ParseError::Truncated(Layer::IcmpQuote));
            }
            if b[0] >> 4 != 4 {
                return Err(bad(Layer::IcmpQuote, "quoted version is not 4"));
            }
            let hl = (b[0] & 0x0f) as usize * 4;
            if hl < 20 {
                return Err(bad(Layer::IcmpQuote, "quoted IHL below 5"));
            }
            if b.len() < hl {
                return Err(ParseError::Truncated(Layer::IcmpQuote));
            }
            if u16::from_be_bytes([b[6], b[7]]) & 0x1fff != 0 {
                return Err(bad(Layer::IcmpQuote, "quoted packet is a later fragment"));
            }
            (hl, b[9])
        }
        IpVersion::V6 => {
            if b.len() < 40 {
                return Err(ParseError::Truncated(Layer::IcmpQuote));
            }
            if b[0] >> 4 != 6 {
                return Err(bad(Layer::IcmpQuote, "quoted version is not 6"));
            }
            if is_v4_mapped(&b[8..24]) || is_v4_mapped(&b[24..40]) {
                return Err(ParseError::V4MappedAddress);
            }
            let (p, l4, frag) = walk_v6_ext(buf, b[6], off + 40, end, Layer::IcmpQuote)?;
            if frag == Frag::NonFirst {
                return Err(bad(Layer::IcmpQuote, "quoted packet is a later fragment"));
            }
            (l4 - off, p)
        }
    };
    let l4 = &b[hdr_len..];
    let (mut sport, mut dport, mut icmp_type) = (0, 0, 0);
    match proto {
        proto::TCP | proto::UDP => {
            if l4.len() < 8 {
                return Err(ParseError::Truncated(Layer::IcmpQuote));
            }
            sport = u16::from_be_bytes([l4[0], l4[1]]);
            dport = u16::from_be_bytes([l4[2], l4[3]]);
        }
        proto::ICMP | proto::ICMPV6 => {
            if l4.len() < 8 {
                return Err(ParseError::Truncated(Layer::IcmpQuote));
            }
            icmp_type = l4[0];
            let id = u16::from_be_bytes([l4[4], l4[5]]);
            match (v, icmp_type) {
                (IpVersion::V4, 8) | (IpVersion::V6, 128) => sport = id,
                (IpVersion::V4, 0) | (IpVersion::V6, 129) => dport = id,
                _ => {}
            }
        }
        _ => {}
    }
    Ok(Quote {
        version: v,
        off: off as u16,
        hdr_len: hdr_len as u16,
        end: end as u16,
        proto,
        sport,
        dport,
        icmp_type,
    })
}

#[inline(always)]
fn parse_vxlan(buf: &[u8], ip: &Ip, opts: &ParseOptions) -> Result<Option<VxlanMeta>, ParseError> {
    let L4::Udp { dport, len, .. } = ip.l4 else {
        return Ok(None);
    };
    if dport != opts.vxlan_port || ip.frag != Frag::None {
        return Ok(None);
    }
    let off = ip.l4_off() + 8;
    let end = ip.l4_off() + len as usize;
    let h = buf
        .get(off..off + 8)
        .filter(|_| off + 8 <= end)
        .ok_or(ParseError::Truncated(Layer::Vxlan))?;
    if h[0] & 0x08 == 0 {
        return Err(bad(Layer::Vxlan, "I flag clear"));
    }
    let vni = u32::from_be_bytes([0, h[4], h[5], h[6]]);
    Ok(Some(VxlanMeta {
        vni,
        off: off as u16,
        inner_off: (off + 8) as u16,
        inner_end: end as u16,
    }))
}

#[cfg(test)]
mod tests {
    //! The parser's verdict on each protocol's edge cases. Well-formed frames come from
    //! `wire`; malformed ones are those with one field broken by hand.

    use super::*;
    use crate::wire::{
        EthernetRepr, FrameRepr, IpRepr, Ipv4Repr, Ipv6Ext, Ipv6Repr, L4Repr, TcpRepr, Vlans,
        VxlanRepr,
    };

    const ETH: EthernetRepr = EthernetRepr {
        dst: [2, 0, 0, 0, 0, 2],
        src: [2, 0, 0, 0, 0, 1],
        vlans: Vlans::None,
    };
    const A4: [u8; 4] = [10, 0, 0, 1];
    const B4: [u8; 4] = [10, 0, 0, 2];
    const A6: [u8; 16] = [0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    const B6: [u8; 16] = [0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];

    fn udp(sport: u16, dport: u16) -> L4Repr {
        L4Repr::Udp {
            sport,
            dport,
            checksum: true,
        }
    }

    fn tcp_repr(flags: u8) -> TcpRepr {
        TcpRepr {
            sport: 1000,
            dport: 80,
            seq: 1,
            ack: 0,
            flags,
            window: 100,
            options: Vec::new(),
        }
    }

    fn tcp(flags: u8) -> L4Repr {
        L4Repr::Tcp(tcp_repr(flags))
    }

    fn frame(ip: impl Into<IpRepr>, l4: L4Repr, payload: &[u8]) -> Vec<u8> {
        FrameRepr {
            eth: ETH,
            ip: ip.into(),
            l4,
        }
        .to_vec(payload)
    }

    fn v4(proto: u8) -> Ipv4Repr {
        Ipv4Repr::new(A4, B4, proto)
    }

    fn v6(proto: u8) -> Ipv6Repr {
        Ipv6Repr::new(A6, B6, proto)
    }

    fn udp4(payload: &[u8]) -> Vec<u8> {
        frame(v4(proto::UDP), udp(1000, 2000), payload)
    }

    fn ip(buf: &[u8]) -> Ip {
        *parse_frame(buf).unwrap().ip().unwrap()
    }

    fn err(buf: &[u8]) -> ParseError {
        parse_frame(buf).unwrap_err()
    }

    fn truncated(layer: Layer) -> ParseError {
        ParseError::Truncated(layer)
    }

    // Ethernet and VLAN.

    #[test]
    fn ethernet_shorter_than_its_header_is_truncated() {
        assert_eq!(err(&udp4(b"")[..13]), truncated(Layer::Ethernet));
        assert_eq!(err(&udp4(b"")[..14]), truncated(Layer::Ipv4));
        assert_eq!(err(&udp4(b"")[..33]), truncated(Layer::Ipv4));
    }

    #[test]
    fn frames_over_64k_are_refused() {
        let mut f = udp4(b"");
        f.resize(65536, 0);
        assert_eq!(
            err(&f),
            bad(Layer::Ethernet, "frame longer than 65535 bytes")
        );
    }

    #[test]
    fn one_and_two_vlan_tags_are_skipped_and_a_third_refused() {
        let tagged = |vlans| {
            FrameRepr {
                eth: EthernetRepr { vlans, ..ETH },
                ip: v4(proto::UDP).into(),
                l4: udp(1, 2),
            }
            .to_vec(b"")
        };
        let f = parse_frame(&tagged(Vlans::One { tci: 0x2064 })).unwrap();
        assert_eq!((f.vlan_tags, f.vlan_tci, f.l3_off), (1, 0x2064, 18));
        let b = tagged(Vlans::Two {
            outer: 0x0100,
            inner: 0x0200,
        });
        let f = parse_frame(&b).unwrap();
        assert_eq!((f.vlan_tags, f.vlan_tci, f.l3_off), (2, 0x0100, 22));
        assert_eq!(f.ip().unwrap().off, 22);
        // A third tag where the EtherType should be.
        let mut three = b.clone();
        three[20..22].copy_from_slice(&ethertype::VLAN.to_be_bytes());
        assert_eq!(err(&three), bad(Layer::Vlan, "more than two VLAN tags"));
        assert_eq!(err(&b[..16]), truncated(Layer::Vlan));
        assert_eq!(err(&b[..20]), truncated(Layer::Vlan));
    }

    #[test]
    fn arp_needs_28_bytes_and_other_ethertypes_pass_unparsed() {
        let mut f = udp4(b"");
        f.truncate(14 + 28);
        f[12..14].copy_from_slice(&ethertype::ARP.to_be_bytes());
        assert_eq!(parse_frame(&f).unwrap().l3, L3::Arp);
        assert_eq!(err(&f[..14 + 27]), truncated(Layer::Arp));
        f[12..14].copy_from_slice(&0x88ccu16.to_be_bytes());
        let p = parse_frame(&f[..14]).unwrap();
        assert_eq!((p.l3, p.ethertype), (L3::Other, 0x88cc));
    }

    // IPv4.

    #[test]
    fn ipv4_bad_version_ihl_and_lengths() {
        let good = udp4(b"abcd");
        let with = |at: usize, v: u8| {
            let mut f = good.clone();
            f[at] = v;
            f
        };
        assert_eq!(err(&with(14, 0x55)), bad(Layer::Ipv4, "version is not 4"));
        assert_eq!(err(&with(14, 0x44)), bad(Layer::Ipv4, "IHL below 5"));
        // IHL 15 (60 bytes) in a 32-byte packet.
        assert_eq!(err(&with(14, 0x4f)), truncated(Layer::Ipv4));
        // Total length 19, below the header's 20.
        assert_eq!(
            err(&with(17, 19)),
            bad(Layer::Ipv4, "total length below header length")
        );
        assert_eq!(err(&good[..good.len() - 1]), truncated(Layer::Ipv4));
    }

    #[test]
    fn ipv4_options_move_the_transport_header() {
        let ip4 = Ipv4Repr {
            options: vec![1, 1, 1, 0, 0x94, 4, 0, 0],
            ..v4(proto::UDP)
        };
        let f = frame(ip4, udp(7, 8), b"x");
        let p = ip(&f);
        assert_eq!((p.hdr_len, p.l4_off()), (28, 42));
        assert_eq!(
            p.l4,
            L4::Udp {
                sport: 7,
                dport: 8,
                len: 9
            }
        );
    }

    #[test]
    fn ethernet_padding_is_outside_the_ip_packet() {
        let mut f = udp4(b"");
        let n = f.len();
        f.resize(60, 0xee);
        let p = ip(&f);
        assert_eq!((p.end as usize, parse_frame(&f).unwrap().len), (n, 60));
    }

    #[test]
    fn ipv4_fragments() {
        let first = Ipv4Repr {
            more_frags: true,
            ..v4(proto::UDP)
        };
        let p = ip(&frame(first.clone(), udp(1, 2), b"abc"));
        assert_eq!(p.frag, Frag::First);
        assert!(matches!(p.l4, L4::Udp { sport: 1, .. }));
        // A later fragment has no transport header, whatever its bytes say.
        let later = Ipv4Repr {
            frag_offset: 100,
            ..v4(proto::TCP)
        };
        let p = ip(&frame(later, L4Repr::Raw, b"no tcp header"));
        assert_eq!(
            (p.frag, p.l4, p.proto),
            (Frag::NonFirst, L4::None, proto::TCP)
        );
        // A first fragment's UDP length may cover more than this fragment.
        let mut f = frame(first, udp(1, 2), b"abc");
        f[38..40].copy_from_slice(&1000u16.to_be_bytes());
        assert!(matches!(ip(&f).l4, L4::Udp { len: 1000, .. }));
        // A whole datagram's may not.
        let mut f = udp4(b"abc");
        f[38..40].copy_from_slice(&1000u16.to_be_bytes());
        assert_eq!(err(&f), truncated(Layer::Udp));
    }

    #[test]
    fn other_protocols_have_no_transport_header() {
        let p = ip(&frame(v4(47), L4Repr::Raw, b"gre"));
        assert_eq!((p.proto, p.l4, p.frag), (47, L4::None, Frag::None));
        // ICMPv6 over IPv4 is not looked into.
        let p = ip(&frame(v4(proto::ICMPV6), L4Repr::Raw, &[128; 8]));
        assert_eq!(p.l4, L4::None);
    }

    // IPv6 and its extension headers.

    #[test]
    fn ipv6_bad_version_lengths_and_mapped_addresses() {
        let good = frame(v6(proto::UDP), udp(1, 2), b"");
        assert_eq!(err(&good[..14 + 39]), truncated(Layer::Ipv6));
        let mut f = good.clone();
        f[14] = 0x40;
        assert_eq!(err(&f), bad(Layer::Ipv6, "version is not 6"));
        let mut f = good.clone();
        f[18..20].copy_from_slice(&[0, 0]);
        assert_eq!(err(&f), bad(Layer::Ipv6, "zero payload length"));
        // With no next header (59) a zero payload length is fine.
        let p = ip(&frame(v6(59), L4Repr::Raw, b""));
        assert_eq!((p.proto, p.hdr_len, p.l4), (59, 40, L4::None));
        assert_eq!(err(&good[..good.len() - 1]), truncated(Layer::Ipv6));
        let mut mapped = [0u8; 16];
        mapped[10..12].copy_from_slice(&[0xff, 0xff]);
        for (s, d) in [(mapped, B6), (A6, mapped)] {
            let f = frame(Ipv6Repr::new(s, d, proto::UDP), udp(1, 2), b"");
            assert_eq!(err(&f), ParseError::V4MappedAddress);
        }
    }

    fn v6_with(exts: Vec<Ipv6Ext>, proto: u8) -> Ipv6Repr {
        Ipv6Repr { exts, ..v6(proto) }
    }

    fn opts(kind: u8, len8: u8) -> Ipv6Ext {
        Ipv6Ext::Opts { kind, len8 }
    }

    #[test]
    fn ipv6_extension_chain_is_walked_to_the_transport_header() {
        let exts = vec![
            opts(0, 0),
            opts(60, 1),
            opts(43, 0),
            Ipv6Ext::Auth {
                spi: 9,
                seq: 1,
                icv_words: 3,
            },
            Ipv6Ext::Fragment {
                offset: 0,
                more: false,
                ident: 5,
            },
        ];
        let p = ip(&frame(v6_with(exts, proto::TCP), tcp(0x02), b""));
        assert_eq!(p.hdr_len, 40 + 8 + 16 + 8 + 24 + 8);
        assert_eq!((p.proto, p.frag), (proto::TCP, Frag::None));
        assert_eq!(
            p.l4,
            L4::Tcp {
                sport: 1000,
                dport: 80,
                flags: 0x02
            }
        );
    }

    #[test]
    fn ipv6_extension_chain_errors() {
        let f = frame(v6_with(vec![opts(60, 0), opts(0, 0)], 17), udp(1, 2), b"");
        assert_eq!(err(&f), bad(Layer::Ipv6Ext, "hop-by-hop header not first"));
        let nine = vec![opts(60, 0); MAX_V6_EXT_HEADERS + 1];
        let f = frame(v6_with(nine, 17), udp(1, 2), b"");
        assert_eq!(err(&f), bad(Layer::Ipv6Ext, "too many extension headers"));
        let eight = vec![opts(60, 0); MAX_V6_EXT_HEADERS];
        assert_eq!(ip(&frame(v6_with(eight, 17), udp(1, 2), b"")).proto, 17);
        // The payload length ends inside an extension header.
        let mut f = frame(v6_with(vec![opts(60, 1)], 59), L4Repr::Raw, b"");
        f[18..20].copy_from_slice(&8u16.to_be_bytes());
        f.truncate(14 + 48);
        assert_eq!(err(&f), truncated(Layer::Ipv6Ext));
        let mut f = frame(v6_with(vec![opts(60, 0)], 59), L4Repr::Raw, b"");
        f[18..20].copy_from_slice(&1u16.to_be_bytes());
        f.truncate(14 + 41);
        assert_eq!(err(&f), truncated(Layer::Ipv6Ext));
    }

    #[test]
    fn ipv6_fragments() {
        let frag = |offset, more| {
            vec![Ipv6Ext::Fragment {
                offset,
                more,
                ident: 1,
            }]
        };
        let p = ip(&frame(v6_with(frag(0, true), 17), udp(1, 2), b"x"));
        assert_eq!((p.frag, p.hdr_len), (Frag::First, 48));
        assert!(matches!(p.l4, L4::Udp { sport: 1, .. }));
        let p = ip(&frame(v6_with(frag(3, true), 17), L4Repr::Raw, b"x"));
        assert_eq!((p.frag, p.l4, p.proto), (Frag::NonFirst, L4::None, 17));
        // The walk stops at a later fragment: what follows is not a header.
        let mut exts = frag(3, false);
        exts.push(opts(0, 0));
        let p = ip(&frame(v6_with(exts, 17), L4Repr::Raw, b"x"));
        assert_eq!((p.frag, p.proto, p.hdr_len), (Frag::NonFirst, 0, 48));
    }

    // TCP and UDP.

    #[test]
    fn tcp_truncated_and_bad_data_offset() {
        let good = frame(v4(proto::TCP), tcp(0x18), b"");
        assert!(matches!(ip(&good).l4, L4::Tcp { flags: 0x18, .. }));
        let short = frame(v4(proto::TCP), L4Repr::Raw, &good[34..53]);
        assert_eq!(err(&short), truncated(Layer::Tcp));
        let mut f = good.clone();
        f[46] = 4 << 4;
        assert_eq!(err(&f), bad(Layer::Tcp, "data offset below 5"));
        f[46] = 6 << 4;
        assert_eq!(err(&f), truncated(Layer::Tcp));
        let with_opts = L4Repr::Tcp(TcpRepr {
            options: vec![2, 4, 5, 0xb4],
            ..tcp_repr(0x02)
        });
        let f = frame(v4(proto::TCP), with_opts, b"");
        assert_eq!((ip(&f).hdr_len, f[46] >> 4), (20, 6));
    }

    #[test]
    fn udp_truncated_and_bad_length() {
        let short = frame(v4(proto::UDP), L4Repr::Raw, &[0; 7]);
        assert_eq!(err(&short), truncated(Layer::Udp));
        let mut f = udp4(b"");
        f[38..40].copy_from_slice(&7u16.to_be_bytes());
        assert_eq!(err(&f), bad(Layer::Udp, "length below 8"));
        let p = ip(&frame(v6(proto::UDP), udp(5, 6), b"abc"));
        assert_eq!(
            p.l4,
            L4::Udp {
                sport: 5,
                dport: 6,
                len: 11
            }
        );
    }

    // ICMP.

    #[test]
    fn icmp_echo_and_other_kinds() {
        let cases = [
            (false, true, IcmpKind::EchoRequest { id: 7 }),
            (false, false, IcmpKind::EchoReply { id: 7 }),
            (true, true, IcmpKind::EchoRequest { id: 7 }),
            (true, false, IcmpKind::EchoReply { id: 7 }),
        ];
        for (is_v6, request, kind) in cases {
            let l4 = L4Repr::echo(is_v6, request, 7, 1);
            let f = if is_v6 {
                frame(v6(proto::ICMPV6), l4, b"")
            } else {
                frame(v4(proto::ICMP), l4, b"")
            };
            assert!(matches!(ip(&f).l4, L4::Icmp { kind: k, .. } if k == kind));
        }
        let other = L4Repr::Icmp {
            ty: 13,
            code: 0,
            rest: [0; 4],
        };
        let p = ip(&frame(v4(proto::ICMP), other, b""));
        assert_eq!(
            p.l4,
            L4::Icmp {
                ty: 13,
                code: 0,
                kind: IcmpKind::Other
            }
        );
        let short = frame(v4(proto::ICMP), L4Repr::Raw, &[8; 7]);
        assert_eq!(err(&short), truncated(Layer::Icmp));
    }

    fn icmp_error(ty: u8) -> L4Repr {
        L4Repr::Icmp {
            ty,
            code: 1,
            rest: [0; 4],
        }
    }

    #[test]
    fn icmpv4_error_quotes_the_offending_packet() {
        // The quote: the IP header and the first 8 bytes of the UDP header.
        let inner = frame(Ipv4Repr::new(B4, A4, proto::UDP), udp(53, 1000), b"dns");
        let quote = &inner[14..42];
        for ty in [3, 11, 12] {
            let f = frame(v4(proto::ICMP), icmp_error(ty), quote);
            let p = ip(&f);
            let q = p.icmp_quote().unwrap();
            assert_eq!((q.off, q.hdr_len, q.end), (42, 20, 70));
            assert_eq!((q.proto, q.sport, q.dport), (proto::UDP, 53, 1000));
            assert_eq!(p.shifted(4).icmp_quote().unwrap().off, 46);
        }
        // A quoted echo request: its identifier is the source port.
        let echo = frame(
            Ipv4Repr::new(B4, A4, proto::ICMP),
            L4Repr::echo(false, true, 77, 1),
            b"",
        );
        let q = *ip(&frame(v4(proto::ICMP), icmp_error(3), &echo[14..]))
            .icmp_quote()
            .unwrap();
        assert_eq!((q.sport, q.dport, q.icmp_type), (77, 0, 8));

        let err_of = |quote: &[u8]| err(&frame(v4(proto::ICMP), icmp_error(3), quote));
        assert_eq!(err_of(&quote[..19]), truncated(Layer::IcmpQuote));
        assert_eq!(err_of(&quote[..27]), truncated(Layer::IcmpQuote));
        let mut q = quote.to_vec();
        q[0] = 0x65;
        assert_eq!(err_of(&q), bad(Layer::IcmpQuote, "quoted version is not 4"));
        q[0] = 0x43;
        assert_eq!(err_of(&q), bad(Layer::IcmpQuote, "quoted IHL below 5"));
        q[0] = 0x46;
        assert_eq!(err_of(&q[..23]), truncated(Layer::IcmpQuote));
        let mut q = quote.to_vec();
        q[7] = 1;
        assert_eq!(
            err_of(&q),
            bad(Layer::IcmpQuote, "quoted packet is a later fragment")
        );
        // An error that is itself fragmented is refused.
        let first = Ipv4Repr {
            more_frags: true,
            ..v4(proto::ICMP)
        };
        assert_eq!(
            err(&frame(first, icmp_error(3), quote)),
            bad(Layer::Icmp, "fragmented ICMP error")
        );
    }

    #[test]
    fn icmpv6_error_quotes_through_extension_headers() {
        let inner = frame(
            v6_with(vec![opts(60, 0)], proto::ICMPV6),
            L4Repr::echo(true, true, 9, 1),
            b"",
        );
        let quote = &inner[14..];
        for ty in 1..=4 {
            let q = *ip(&frame(v6(proto::ICMPV6), icmp_error(ty), quote))
                .icmp_quote()
                .unwrap();
            assert_eq!((q.hdr_len, q.proto), (48, proto::ICMPV6));
            assert_eq!((q.sport, q.icmp_type), (9, 128));
        }
        let err_of = |quote: &[u8]| err(&frame(v6(proto::ICMPV6), icmp_error(1), quote));
        assert_eq!(err_of(&quote[..39]), truncated(Layer::IcmpQuote));
        assert_eq!(err_of(&quote[..47]), truncated(Layer::IcmpQuote));
        let mut q = quote.to_vec();
        q[0] = 0x45;
        assert_eq!(err_of(&q), bad(Layer::IcmpQuote, "quoted version is not 6"));
        let mut q = quote.to_vec();
        q[8..24].fill(0);
        q[18..20].fill(0xff);
        assert_eq!(err_of(&q), ParseError::V4MappedAddress);
        let later = frame(
            v6_with(
                vec![Ipv6Ext::Fragment {
                    offset: 1,
                    more: false,
                    ident: 0,
                }],
                proto::UDP,
            ),
            L4Repr::Raw,
            &[0; 8],
        );
        assert_eq!(
            err_of(&later[14..]),
            bad(Layer::IcmpQuote, "quoted packet is a later fragment")
        );
    }

    // VXLAN.

    fn vxlan_frame(outer: impl Into<IpRepr>, dport: u16, vxlan: VxlanRepr) -> Vec<u8> {
        let inner = udp4(b"inner");
        let mut payload = vxlan.to_bytes().to_vec();
        payload.extend_from_slice(&inner);
        frame(outer, udp(50000, dport), &payload)
    }

    #[test]
    fn vxlan_header_is_found_on_its_port() {
        for outer in [IpRepr::V4(v4(proto::UDP)), IpRepr::V6(v6(proto::UDP))] {
            let f = vxlan_frame(outer.clone(), VXLAN_PORT, VxlanRepr::new(0xabcdef));
            let p = parse_frame(&f).unwrap();
            let v = p.vxlan.unwrap();
            assert_eq!(v.vni, 0xabcdef);
            assert_eq!(p.vxlan_inner(&f).unwrap(), &udp4(b"inner")[..]);
            assert_eq!(v.inner_off as usize, p.ip().unwrap().l4_off() + 16);
            let fast = vxlan_fast(&f, VXLAN_PORT);
            assert_eq!(fast, outer.is_v6().then_some(()).map_or(Some(v), |_| None));
        }
        // Another port is plain UDP, unless the options name it.
        let f = vxlan_frame(v4(proto::UDP), 8472, VxlanRepr::new(1));
        assert_eq!(parse_frame(&f).unwrap().vxlan, None);
        let opts = ParseOptions { vxlan_port: 8472 };
        assert_eq!(parse_frame_with(&f, &opts).unwrap().vxlan.unwrap().vni, 1);
    }

    #[test]
    fn vxlan_flags_and_truncation() {
        let clear = VxlanRepr {
            flags: 0x00,
            vni: 5,
        };
        let f = vxlan_frame(v4(proto::UDP), VXLAN_PORT, clear);
        assert_eq!(err(&f), bad(Layer::Vxlan, "I flag clear"));
        assert_eq!(vxlan_fast(&f, VXLAN_PORT), None);
        // Reserved bits are ignored.
        let extra = VxlanRepr {
            flags: 0xff,
            vni: 5,
        };
        let f = vxlan_frame(v4(proto::UDP), VXLAN_PORT, extra);
        assert_eq!(parse_frame(&f).unwrap().vxlan.unwrap().vni, 5);
        let short = frame(
            v4(proto::UDP),
            udp(1, VXLAN_PORT),
            &[0x08, 0, 0, 0, 0, 0, 1],
        );
        assert_eq!(err(&short), truncated(Layer::Vxlan));
        // A fragmented datagram to the VXLAN port is not looked into.
        let first = Ipv4Repr {
            more_frags: true,
            ..v4(proto::UDP)
        };
        let f = frame(first, udp(1, VXLAN_PORT), &[0; 7]);
        assert_eq!(parse_frame(&f).unwrap().vxlan, None);
    }
}
