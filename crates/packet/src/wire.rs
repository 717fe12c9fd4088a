//! Typed headers and their emit: the writing side of [`crate::parse_frame`], after
//! smoltcp's `wire` (a `Repr` per header, `emit` into the caller's buffer, lengths and
//! checksums filled in). A [`FrameRepr`] emits a frame the parser parses back to the same
//! values (the `wire_props` property tests check it).
//!
//! The header bytes are written by etherparse, which has every header the parser reads
//! with every field settable. smoltcp's reprs do not serve: its `Ipv4Repr` always sets DF
//! and has no options, and it has no 802.1Q, IPv6 fragment or AH repr. Written here:
//! VXLAN, which neither crate knows ([`VxlanRepr`]), and the IPv6 fragment header, which
//! etherparse 0.16 encodes wrongly (see [`Ipv6Ext::emit`]).
//!
//! For building frames (tests, benchmarks, the encap template), not for the per-packet
//! path: the reprs own `Vec`s, and `emit` panics on a repr no header can carry (an
//! unaligned option length, a fragment offset past 13 bits), a programming error.

use etherparse::{
    EtherType, Ethernet2Header, Icmpv4Header, Icmpv4Type, Icmpv6Header, Icmpv6Type, IpAuthHeader,
    IpFragOffset, IpNumber, Ipv4Header, Ipv4Options, Ipv6FlowLabel, Ipv6Header, Ipv6RawExtHeader,
    SingleVlanHeader, TcpHeader, UdpHeader, VlanId, VlanPcp,
};

use crate::csum;
use crate::rewrite::Addr;
use crate::{ethertype, proto};

/// Length of a VXLAN header (RFC 7348 §5).
pub const VXLAN_HEADER_LEN: usize = 8;
/// The VXLAN I flag: the VNI is valid. The parser refuses a header without it.
pub const VXLAN_FLAG_I: u8 = 0x08;

/// Copy `bytes` to the front of `buf` and say how many they were.
fn put(buf: &mut [u8], bytes: &[u8]) -> usize {
    buf[..bytes.len()].copy_from_slice(bytes);
    bytes.len()
}

/// The 802.1Q/802.1ad tags of a frame (the parser takes at most two).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Vlans {
    #[default]
    None,
    /// One 802.1Q tag (TPID 0x8100).
    One { tci: u16 },
    /// QinQ: an 802.1ad service tag (TPID 0x88a8), then an 802.1Q customer tag.
    Two { outer: u16, inner: u16 },
}

impl Vlans {
    /// (TPID, TCI) of each tag, outermost first.
    fn tags(&self) -> ([(u16, u16); 2], usize) {
        match *self {
            Vlans::None => ([(0, 0); 2], 0),
            Vlans::One { tci } => ([(ethertype::VLAN, tci), (0, 0)], 1),
            Vlans::Two { outer, inner } => {
                ([(ethertype::QINQ, outer), (ethertype::VLAN, inner)], 2)
            }
        }
    }

    pub fn count(&self) -> usize {
        self.tags().1
    }

    /// TCI of the outermost tag (0 without one), as [`crate::Frame::vlan_tci`] reports.
    pub fn outer_tci(&self) -> u16 {
        self.tags().0[0].1
    }
}

/// An Ethernet II header with its VLAN tags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EthernetRepr {
    pub dst: [u8; 6],
    pub src: [u8; 6],
    pub vlans: Vlans,
}

impl EthernetRepr {
    pub fn header_len(&self) -> usize {
        14 + 4 * self.vlans.count()
    }

    /// Write the header with `ethertype` after the tags; returns its length.
    pub fn emit(&self, buf: &mut [u8], ethertype: u16) -> usize {
        let (tags, n) = self.vlans.tags();
        let first = if n > 0 { tags[0].0 } else { ethertype };
        let eth = Ethernet2Header {
            source: self.src,
            destination: self.dst,
            ether_type: EtherType(first),
        };
        let mut off = put(buf, &eth.to_bytes());
        for i in 0..n {
            let tci = tags[i].1;
            let next = if i + 1 < n { tags[i + 1].0 } else { ethertype };
            let tag = SingleVlanHeader {
                pcp: VlanPcp::try_new((tci >> 13) as u8).expect("3 bits"),
                drop_eligible_indicator: tci & 0x1000 != 0,
                vlan_id: VlanId::try_new(tci & 0x0fff).expect("12 bits"),
                ether_type: EtherType(next),
            };
            off += put(&mut buf[off..], &tag.to_bytes());
        }
        off
    }
}

/// An IPv4 header. `emit` fills in the total length and the header checksum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ipv4Repr {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub proto: u8,
    pub ttl: u8,
    pub ident: u16,
    pub dont_frag: bool,
    pub more_frags: bool,
    /// Fragment offset in 8-byte units (13 bits).
    pub frag_offset: u16,
    /// Options: a multiple of 4 bytes, at most 40.
    pub options: Vec<u8>,
}

impl Ipv4Repr {
    /// A whole datagram: TTL 64, identification 0, no flags, no options.
    pub fn new(src: [u8; 4], dst: [u8; 4], proto: u8) -> Self {
        Ipv4Repr {
            src,
            dst,
            proto,
            ttl: 64,
            ident: 0,
            dont_frag: false,
            more_frags: false,
            frag_offset: 0,
            options: Vec::new(),
        }
    }

    pub fn header_len(&self) -> usize {
        20 + self.options.len()
    }

    fn header(&self, total_len: u16) -> Ipv4Header {
        Ipv4Header {
            total_len,
            identification: self.ident,
            dont_fragment: self.dont_frag,
            more_fragments: self.more_frags,
            fragment_offset: IpFragOffset::try_new(self.frag_offset)
                .expect("fragment offset fits 13 bits"),
            time_to_live: self.ttl,
            protocol: IpNumber(self.proto),
            source: self.src,
            destination: self.dst,
            options: Ipv4Options::try_from(&self.options[..])
                .expect("options a multiple of 4 bytes, at most 40"),
            ..Default::default()
        }
    }

    /// One's-complement sum of the header with zero total length and checksum: what an
    /// encap template adds the per-packet length to.
    pub fn sum_without_len(&self) -> u64 {
        csum::sum(&self.header(0).to_bytes())
    }

    /// Write the header for `payload_len` bytes after it; returns its length.
    pub fn emit(&self, buf: &mut [u8], payload_len: usize) -> usize {
        let total = u16::try_from(self.header_len() + payload_len).expect("IPv4 total length");
        let mut h = self.header(total);
        h.header_checksum = h.calc_header_checksum();
        put(buf, &h.to_bytes())
    }
}

/// An IPv6 extension header the parser walks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ipv6Ext {
    /// Hop-by-Hop (0), Routing (43) or Destination Options (60), zero-filled: `len8` is
    /// the header's length field, 8-byte units after the first 8.
    Opts { kind: u8, len8: u8 },
    /// Fragment header (44); `offset` in 8-byte units (13 bits).
    Fragment { offset: u16, more: bool, ident: u32 },
    /// Authentication Header (51) with `icv_words` 4-byte words of zero ICV (at most 254).
    Auth { spi: u32, seq: u32, icv_words: u8 },
}

impl Ipv6Ext {
    /// The header's protocol number, which the header before it names.
    pub fn kind(&self) -> u8 {
        match *self {
            Ipv6Ext::Opts { kind, .. } => kind,
            Ipv6Ext::Fragment { .. } => 44,
            Ipv6Ext::Auth { .. } => 51,
        }
    }

    pub fn header_len(&self) -> usize {
        match *self {
            Ipv6Ext::Opts { len8, .. } => (len8 as usize + 1) * 8,
            Ipv6Ext::Fragment { .. } => 8,
            Ipv6Ext::Auth { icv_words, .. } => 12 + 4 * icv_words as usize,
        }
    }

    /// Write the header, naming `next` as the one after it; returns its length.
    pub fn emit(&self, buf: &mut [u8], next: u8) -> usize {
        let next = IpNumber(next);
        match *self {
            Ipv6Ext::Opts { len8, .. } => {
                let payload = [0u8; Ipv6RawExtHeader::MAX_PAYLOAD_LEN];
                let h = Ipv6RawExtHeader::new_raw(next, &payload[..len8 as usize * 8 + 6])
                    .expect("length in range");
                put(buf, &h.to_bytes())
            }
            // Written here: etherparse before 0.20 puts the offset's low bits and the M
            // flag in the wrong places of bytes 2..3 (etherparse issue #150, fixed by its
            // PR #149). RFC 8200 §4.5: a big-endian word, offset << 3 | M.
            Ipv6Ext::Fragment {
                offset,
                more,
                ident,
            } => {
                assert!(offset < 1 << 13, "fragment offset fits 13 bits");
                let [a, b] = (offset << 3 | more as u16).to_be_bytes();
                let [c, d, e, f] = ident.to_be_bytes();
                put(buf, &[next.0, 0, a, b, c, d, e, f])
            }
            Ipv6Ext::Auth {
                spi,
                seq,
                icv_words,
            } => {
                let icv = [0u8; IpAuthHeader::MAX_ICV_LEN];
                let h = IpAuthHeader::new(next, spi, seq, &icv[..4 * icv_words as usize])
                    .expect("ICV length in range");
                put(buf, &h.to_bytes())
            }
        }
    }
}

/// An IPv6 header and its extension headers. `emit` fills in the payload length and
/// chains the next-header fields, ending at `proto`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ipv6Repr {
    pub src: [u8; 16],
    pub dst: [u8; 16],
    /// The upper-layer protocol, after the extension headers.
    pub proto: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    /// 20 bits.
    pub flow_label: u32,
    pub exts: Vec<Ipv6Ext>,
}

impl Ipv6Repr {
    /// Hop limit 64, no traffic class, flow label or extension headers.
    pub fn new(src: [u8; 16], dst: [u8; 16], proto: u8) -> Self {
        Ipv6Repr {
            src,
            dst,
            proto,
            hop_limit: 64,
            traffic_class: 0,
            flow_label: 0,
            exts: Vec::new(),
        }
    }

    /// The fixed header and the extension headers.
    pub fn header_len(&self) -> usize {
        40 + self.exts.iter().map(Ipv6Ext::header_len).sum::<usize>()
    }

    /// Write the headers for `payload_len` bytes of upper-layer data after them; returns
    /// their length.
    pub fn emit(&self, buf: &mut [u8], payload_len: usize) -> usize {
        let next = |i: usize| self.exts.get(i).map_or(self.proto, Ipv6Ext::kind);
        let h = Ipv6Header {
            traffic_class: self.traffic_class,
            flow_label: Ipv6FlowLabel::try_new(self.flow_label).expect("flow label fits 20 bits"),
            payload_length: u16::try_from(self.header_len() - 40 + payload_len)
                .expect("IPv6 payload length"),
            next_header: IpNumber(next(0)),
            hop_limit: self.hop_limit,
            source: self.src,
            destination: self.dst,
        };
        let mut off = put(buf, &h.to_bytes());
        for (i, e) in self.exts.iter().enumerate() {
            off += e.emit(&mut buf[off..], next(i + 1));
        }
        off
    }
}

/// The network header of a [`FrameRepr`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IpRepr {
    V4(Ipv4Repr),
    V6(Ipv6Repr),
}

impl IpRepr {
    /// An IPv4 or IPv6 header with the defaults of [`Ipv4Repr::new`] / [`Ipv6Repr::new`].
    ///
    /// # Panics
    /// If the two addresses are of different families.
    pub fn new(src: Addr, dst: Addr, proto: u8) -> Self {
        match (src, dst) {
            (Addr::V4(s), Addr::V4(d)) => IpRepr::V4(Ipv4Repr::new(s, d, proto)),
            (Addr::V6(s), Addr::V6(d)) => IpRepr::V6(Ipv6Repr::new(s, d, proto)),
            _ => panic!("mixed address families"),
        }
    }

    pub fn proto(&self) -> u8 {
        match self {
            IpRepr::V4(ip) => ip.proto,
            IpRepr::V6(ip) => ip.proto,
        }
    }

    pub fn is_v6(&self) -> bool {
        matches!(self, IpRepr::V6(_))
    }

    pub fn ethertype(&self) -> u16 {
        match self {
            IpRepr::V4(_) => ethertype::IPV4,
            IpRepr::V6(_) => ethertype::IPV6,
        }
    }

    pub fn header_len(&self) -> usize {
        match self {
            IpRepr::V4(ip) => ip.header_len(),
            IpRepr::V6(ip) => ip.header_len(),
        }
    }

    pub fn emit(&self, buf: &mut [u8], payload_len: usize) -> usize {
        match self {
            IpRepr::V4(ip) => ip.emit(buf, payload_len),
            IpRepr::V6(ip) => ip.emit(buf, payload_len),
        }
    }

    /// The pseudo-header sum of a transport checksum over `l4_len` bytes. ICMPv4 has none.
    fn pseudo_sum(&self, l4_len: usize) -> u64 {
        match self {
            IpRepr::V4(ip) if ip.proto == proto::ICMP => 0,
            IpRepr::V4(ip) => csum::pseudo_v4(&ip.src, &ip.dst, ip.proto, l4_len as u16),
            IpRepr::V6(ip) => csum::pseudo_v6(&ip.src, &ip.dst, ip.proto, l4_len as u32),
        }
    }
}

/// TCP flag bits as byte 13 of the header carries them.
fn tcp_flags(h: &mut TcpHeader, f: u8) {
    h.fin = f & 0x01 != 0;
    h.syn = f & 0x02 != 0;
    h.rst = f & 0x04 != 0;
    h.psh = f & 0x08 != 0;
    h.ack = f & 0x10 != 0;
    h.urg = f & 0x20 != 0;
    h.ece = f & 0x40 != 0;
    h.cwr = f & 0x80 != 0;
}

impl From<Ipv4Repr> for IpRepr {
    fn from(ip: Ipv4Repr) -> Self {
        IpRepr::V4(ip)
    }
}

impl From<Ipv6Repr> for IpRepr {
    fn from(ip: Ipv6Repr) -> Self {
        IpRepr::V6(ip)
    }
}

/// A TCP header (checksum filled in by [`L4Repr::emit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpRepr {
    pub sport: u16,
    pub dport: u16,
    pub seq: u32,
    pub ack: u32,
    /// Byte 13: FIN 0x01 … CWR 0x80, as [`crate::L4::Tcp`] reports them.
    pub flags: u8,
    pub window: u16,
    /// Options: a multiple of 4 bytes, at most 40.
    pub options: Vec<u8>,
}

impl TcpRepr {
    fn header(&self, checksum: u16) -> TcpHeader {
        let mut h = TcpHeader::new(self.sport, self.dport, self.seq, self.window);
        h.acknowledgment_number = self.ack;
        tcp_flags(&mut h, self.flags);
        h.set_options_raw(&self.options)
            .expect("options a multiple of 4 bytes, at most 40");
        h.checksum = checksum;
        h
    }
}

/// The transport header of a [`FrameRepr`]. `emit` fills in lengths and checksums.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum L4Repr {
    /// `checksum: false` sends 0, "no checksum" (allowed over IPv4 only, RFC 768).
    Udp {
        sport: u16,
        dport: u16,
        checksum: bool,
    },
    Tcp(TcpRepr),
    /// ICMP or ICMPv6 (by the IP version): type, code and the 4 bytes after the checksum
    /// (an echo's identifier and sequence number; unused in errors).
    Icmp {
        ty: u8,
        code: u8,
        rest: [u8; 4],
    },
    /// No transport header: the payload follows the IP header as is.
    Raw,
}

impl L4Repr {
    /// An ICMP or ICMPv6 echo request or reply.
    pub fn echo(v6: bool, request: bool, id: u16, seq: u16) -> Self {
        let ty = match (v6, request) {
            (false, true) => 8,
            (false, false) => 0,
            (true, true) => 128,
            (true, false) => 129,
        };
        let [a, b] = id.to_be_bytes();
        let [c, d] = seq.to_be_bytes();
        L4Repr::Icmp {
            ty,
            code: 0,
            rest: [a, b, c, d],
        }
    }

    /// The IP protocol number for this header under IPv4 or IPv6 (`None` for `Raw`).
    pub fn proto(&self, v6: bool) -> Option<u8> {
        match self {
            L4Repr::Udp { .. } => Some(proto::UDP),
            L4Repr::Tcp(_) => Some(proto::TCP),
            L4Repr::Icmp { .. } if v6 => Some(proto::ICMPV6),
            L4Repr::Icmp { .. } => Some(proto::ICMP),
            L4Repr::Raw => None,
        }
    }

    pub fn header_len(&self) -> usize {
        match self {
            L4Repr::Udp { .. } | L4Repr::Icmp { .. } => 8,
            L4Repr::Tcp(t) => 20 + t.options.len(),
            L4Repr::Raw => 0,
        }
    }

    /// Write the header with checksum `c`.
    fn emit_header(&self, buf: &mut [u8], v6: bool, l4_len: usize, c: u16) {
        match self {
            L4Repr::Udp { sport, dport, .. } => {
                let h = UdpHeader {
                    source_port: *sport,
                    destination_port: *dport,
                    length: u16::try_from(l4_len).expect("UDP length"),
                    checksum: c,
                };
                put(buf, &h.to_bytes());
            }
            L4Repr::Tcp(t) => {
                put(buf, &t.header(c).to_bytes());
            }
            &L4Repr::Icmp { ty, code, rest } => {
                if v6 {
                    let icmp_type = Icmpv6Type::Unknown {
                        type_u8: ty,
                        code_u8: code,
                        bytes5to8: rest,
                    };
                    put(
                        buf,
                        &Icmpv6Header {
                            icmp_type,
                            checksum: c,
                        }
                        .to_bytes(),
                    );
                } else {
                    let icmp_type = Icmpv4Type::Unknown {
                        type_u8: ty,
                        code_u8: code,
                        bytes5to8: rest,
                    };
                    put(
                        buf,
                        &Icmpv4Header {
                            icmp_type,
                            checksum: c,
                        }
                        .to_bytes(),
                    );
                }
            }
            L4Repr::Raw => {}
        }
    }

    /// Write the header and `payload` under `ip`, checksum included; returns their length.
    pub fn emit(&self, buf: &mut [u8], ip: &IpRepr, payload: &[u8]) -> usize {
        let v6 = ip.is_v6();
        let hl = self.header_len();
        let len = hl + payload.len();
        buf[hl..len].copy_from_slice(payload);
        if *self == L4Repr::Raw {
            return len;
        }
        self.emit_header(buf, v6, len, 0);
        let c = match self {
            L4Repr::Udp {
                checksum: false, ..
            } => 0,
            _ => {
                let c = csum::checksum(ip.pseudo_sum(len), &buf[..len]);
                // A computed UDP checksum of 0 is sent as all ones (RFC 768).
                if c == 0 && matches!(self, L4Repr::Udp { .. }) {
                    0xffff
                } else {
                    c
                }
            }
        };
        self.emit_header(buf, v6, len, c);
        len
    }
}

/// A VXLAN header (RFC 7348 §5): the payload of a UDP datagram to the VXLAN port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VxlanRepr {
    /// [`VXLAN_FLAG_I`] for a valid VNI.
    pub flags: u8,
    /// 24 bits.
    pub vni: u32,
}

impl VxlanRepr {
    pub fn new(vni: u32) -> Self {
        VxlanRepr {
            flags: VXLAN_FLAG_I,
            vni,
        }
    }

    pub fn to_bytes(&self) -> [u8; VXLAN_HEADER_LEN] {
        let [_, a, b, c] = self.vni.to_be_bytes();
        [self.flags, 0, 0, 0, a, b, c, 0]
    }

    pub fn emit(&self, buf: &mut [u8]) -> usize {
        put(buf, &self.to_bytes())
    }
}

/// A whole frame: Ethernet, IP, transport header. The payload is given to `emit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameRepr {
    pub eth: EthernetRepr,
    pub ip: IpRepr,
    pub l4: L4Repr,
}

impl FrameRepr {
    /// The frame's length with `payload_len` bytes of payload.
    pub fn len(&self, payload_len: usize) -> usize {
        self.eth.header_len() + self.ip.header_len() + self.l4.header_len() + payload_len
    }

    /// Write the frame into `buf`; returns its length.
    ///
    /// # Panics
    /// If `buf` is shorter than [`FrameRepr::len`], or the transport header is not the
    /// IP header's protocol.
    pub fn emit(&self, buf: &mut [u8], payload: &[u8]) -> usize {
        if let Some(p) = self.l4.proto(self.ip.is_v6()) {
            assert_eq!(
                p,
                self.ip.proto(),
                "transport header differs from IP protocol"
            );
        }
        let mut off = self.eth.emit(buf, self.ip.ethertype());
        let l4_len = self.l4.header_len() + payload.len();
        off += self.ip.emit(&mut buf[off..], l4_len);
        off + self.l4.emit(&mut buf[off..], &self.ip, payload)
    }

    pub fn to_vec(&self, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8; self.len(payload.len())];
        self.emit(&mut f, payload);
        f
    }
}
