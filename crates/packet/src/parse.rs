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

#[inline(always)]
fn parse_ipv4(buf: &[u8], off: usize) -> Result<Ip, ParseError> {
    let b = &buf[off..];
    if b.len() < 20 {
        return Err(ParseError::Truncated(Layer::Ipv4));
    }
    let p = Ipv4Packet::new_unchecked(b);
    if p.version() != 4 {
        return Err(bad(Layer::Ipv4, "version is not 4"));
    }
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
    let b = &buf[off..];
    if b.len() < 40 {
        return Err(ParseError::Truncated(Layer::Ipv6));
    }
    let p = Ipv6Packet::new_unchecked(b);
    if p.version() != 6 {
        return Err(bad(Layer::Ipv6, "version is not 6"));
    }
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
