#!/usr/bin/python3
"""Golden-packet corpus generator for the starfabric PP pipeline.

Usage (Debian's scapy: `apt-get install python3-scapy`, run with /usr/bin/python3):

    gen.py                  > tests/golden/corpus.txt       the corpus (docs/golden-corpus.md)
    gen.py --hash-vectors   > tests/golden/hash_vectors.txt flow_hash / vxlan_source_port vectors
    gen.py --check          self-check: every valid frame re-parses in scapy, round-trips
                            byte for byte, and its checksums equal scapy's recomputation

Output is deterministic: no randomness, no timestamps, every scapy default that could
depend on the host (MACs, source addresses) is set explicitly.

Independence: every frame, input and expected, is built from scratch by scapy and every
checksum is computed by scapy over the finished bytes. An expected frame is never derived
from the input frame by patching bytes: each case family has a builder
`build(src, dst) -> scapy packet`, called once with the original endpoints (input) and once
with the endpoints after the rule's rewrite (expected output).

Decisions where docs/golden-corpus.md leaves room (Linux netfilter NAT behaviour chosen
where it applies):

  D1  The VXLAN source port of `encap` hashes the inner key after the rule's rewrites,
      with the VNI replaced by the `encap` action's VNI (the key the flow has on the
      overlay it is sent into).
  D2  For an ICMP error, "the key after the rewrites" is the (reversed-quote) key with the
      set-src / set-dst fields substituted, exactly as for any other flow.
  D3  A UDP checksum of 0 over IPv4 means "no checksum" and stays 0 after a rewrite
      (Linux: udp_manip_pkt leaves it alone). A recomputed UDP checksum of 0x0000 is sent
      as 0xffff (RFC 768); TCP and ICMP checksums of 0x0000 stay 0x0000.
  D4  An IPv4 first fragment (MF set, offset 0) is keyed and rewritten; its L4 checksum
      covers the whole datagram, so the expected checksum is that of the whole rewritten
      datagram (what the RFC 1624 update yields, and what netfilter yields after
      reassembly). The UDP length field names the whole datagram and is larger than the
      fragment's payload: that is not "truncated". Non-first fragments (v4 offset > 0,
      v6 Fragment header with offset > 0) have no ports: `drop fragment`.
  D5  UDP to port 4789 carrying a VXLAN header whose I flag is clear is `bad-header`
      (Linux's vxlan driver drops such packets as invalid) rather than ordinary UDP.
  D6  An 802.1Q/QinQ tag on the outer frame goes away with `decap`; a bare tagged frame
      that is only rewritten keeps its tags. Ethernet padding behind the IP packet of a
      bare frame is kept unchanged and is not covered by any checksum.
  D7  `decap` keeps the inner Ethernet header (MACs untouched); `encap` wraps the whole
      (possibly rewritten) inner Ethernet frame. No padding is added to short outputs.
  D8  Malformed inputs carry otherwise valid checksums (an IPv4 header with a bad field
      still has a correct header checksum), so only the named defect decides the verdict.
      Truncated inputs are not padded to 60 bytes.
  D9  In `match` lines every port is written, including 0 (ICMP echo). v6 addresses are
      always in brackets; rules never rewrite a v6 address without a port.
  D10 For ICMP errors, `set-src` also rewrites the outer source even if it is a router's
      address (netfilter's nf_nat_icmp_reply_translation manips the outer header the same
      way), and the quoted packet's checksums are those of the full quoted packet rebuilt
      with the translated fields, then cut to the original quote length.
"""

import ipaddress
import logging
import struct
import sys
from dataclasses import dataclass, replace
from typing import Callable, Iterable, List, Optional, Tuple

logging.getLogger("scapy.runtime").setLevel(logging.ERROR)

from scapy.all import (  # noqa: E402
    ARP,
    IP,
    TCP,
    UDP,
    ICMP,
    VXLAN,
    Dot1AD,
    Dot1Q,
    Ether,
    IPOption_Router_Alert,
    IPOption_RR,
    IPv6,
    IPv6ExtHdrDestOpt,
    IPv6ExtHdrFragment,
    IPv6ExtHdrHopByHop,
    IPv6ExtHdrRouting,
    ICMPv6DestUnreach,
    ICMPv6EchoReply,
    ICMPv6EchoRequest,
    ICMPv6PacketTooBig,
    ICMPv6TimeExceeded,
    Packet,
    PadN,
    RouterAlert,
    Raw,
    raw,
)
from scapy.utils import checksum  # noqa: E402

# --------------------------------------------------------------------------------------
# Node and address plan (RFC 2544 198.18.0.0/15, RFC 5180 2001:2::/48 only)
# --------------------------------------------------------------------------------------

NODE_IP = "198.18.0.1"
NODE_MAC = "02:00:00:00:00:01"
GW_MAC = "02:00:00:00:00:02"
VXLAN_PORT = 4789

REMOTE_VTEP = "198.18.0.20"  # sender of the tenant traffic we receive
NEXT_VTEP = "198.18.0.9"  # `encap` destination
NODE_IP6 = "2001:2::1"  # v6 underlay (input only: encap is IPv4)
REMOTE_VTEP6 = "2001:2::20"
OUTER_SPORT = 51000  # UDP source port of received VXLAN frames

VM_MAC = "02:00:00:00:10:02"  # tenant endpoint
VGW_MAC = "02:00:00:00:10:01"  # tenant's virtual gateway

CLIENT = "198.18.10.2"
SERVER = "198.18.20.5"
SERVER2 = "198.18.20.6"
NAT_IP = "198.19.0.1"
VIP = "198.19.0.80"
ROUTER = "198.18.30.1"

CLIENT6 = "2001:2:0:10::2"
SERVER6 = "2001:2:0:20::5"
NAT_IP6 = "2001:2:0:ff::1"
VIP6 = "2001:2:0:ff::80"
ROUTER6 = "2001:2:0:30::1"

PROTO_NUM = {"icmp": 1, "tcp": 6, "udp": 17, "icmp6": 58}


# --------------------------------------------------------------------------------------
# Flow keys, flow_hash, vxlan_source_port
# --------------------------------------------------------------------------------------

M64 = (1 << 64) - 1


@dataclass(frozen=True)
class Ep:
    """An endpoint: address and port (ICMP echo: the identifier, or 0)."""

    addr: str
    port: int


@dataclass(frozen=True)
class Key:
    vni: int
    proto: str
    src: Ep
    dst: Ep

    def canonical(self) -> bytes:
        def a16(a: str) -> bytes:
            ip = ipaddress.ip_address(a)
            if ip.version == 4:
                return b"\x00" * 10 + b"\xff\xff" + ip.packed
            return ip.packed

        return (
            a16(self.src.addr)
            + a16(self.dst.addr)
            + struct.pack("!HH", self.src.port, self.dst.port)
            + self.vni.to_bytes(3, "big")
            + bytes([PROTO_NUM[self.proto]])
        )


def flow_hash(canon: bytes) -> int:
    assert len(canon) == 40
    h = 0x9E3779B97F4A7C15
    for i in range(0, 40, 8):
        w = int.from_bytes(canon[i : i + 8], "little")
        h = ((h ^ w) * 0xBF58476D1CE4E5B9) & M64
        h ^= h >> 31
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & M64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & M64
    h ^= h >> 33
    return h


def vxlan_source_port(key: Key) -> int:
    h = flow_hash(key.canonical())
    return 49152 + (((h & 0xFFFFFFFF) ^ (h >> 32)) % 16384)


def fmt_addr(a: str) -> str:
    return f"[{a}]" if ":" in a else a


def fmt_ep(e: Ep) -> str:
    return f"{fmt_addr(e.addr)}:{e.port}"


def fmt_match(k: Key) -> str:
    return f"{k.vni} {k.proto} {fmt_ep(k.src)} > {fmt_ep(k.dst)}"


@dataclass(frozen=True)
class Rewrite:
    """set-src / set-dst; None leaves the field alone."""

    src_addr: Optional[str] = None
    src_port: Optional[int] = None
    dst_addr: Optional[str] = None
    dst_port: Optional[int] = None

    def apply(self, k: Key) -> Key:
        s = Ep(self.src_addr or k.src.addr, k.src.port if self.src_port is None else self.src_port)
        d = Ep(self.dst_addr or k.dst.addr, k.dst.port if self.dst_port is None else self.dst_port)
        return replace(k, src=s, dst=d)

    def actions(self) -> List[str]:
        out = []
        for verb, a, p in (("set-src", self.src_addr, self.src_port), ("set-dst", self.dst_addr, self.dst_port)):
            if a is None and p is None:
                continue
            if a is not None and ":" in a:
                assert p is not None, "D9: no address-only v6 rewrites"
            addr = fmt_addr(a) if a is not None else ""
            port = f":{p}" if p is not None else ""
            out.append(f"{verb} {addr}{port}")
        return out


def snat(addr=None, port=None) -> Rewrite:
    return Rewrite(src_addr=addr, src_port=port)


def dnat(addr=None, port=None) -> Rewrite:
    return Rewrite(dst_addr=addr, dst_port=port)


NO_REWRITE = Rewrite()


# --------------------------------------------------------------------------------------
# Cases and corpus output
# --------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    doc: str
    inp: bytes
    match: Optional[Key] = None
    rule: Optional[str] = None
    out_port: Optional[int] = None
    out: Optional[bytes] = None
    drop: Optional[str] = None
    valid_in: bool = True  # --check: input must re-parse cleanly
    l4_csum_check: bool = True  # --check: L4 checksum recomputable (not a fragment)

    def lines(self) -> List[str]:
        ls = [f"# {self.doc}", f"case {self.name}"]
        if self.match is not None:
            ls.append(f"match {fmt_match(self.match)}")
            ls.append(f"rule {self.rule}")
        ls.append(f"in {self.inp.hex()}")
        if self.drop is not None:
            ls.append(f"drop {self.drop}")
        else:
            ls.append(f"out {self.out_port} {self.out.hex()}")
        return ls


CASES: List[Case] = []


def add(case: Case) -> None:
    assert all(c.name != case.name for c in CASES), case.name
    assert (case.drop is None) != (case.out is None)
    CASES.append(case)


# --------------------------------------------------------------------------------------
# Underlay helpers
# --------------------------------------------------------------------------------------


def vxlan_in(inner: bytes, vni: int, vlan: Optional[int] = None, v6: bool = False) -> bytes:
    """A received VXLAN frame: remote VTEP -> this node, outer UDP checksum 0 (v4)."""
    eth = Ether(src=GW_MAC, dst=NODE_MAC)
    if vlan is not None:
        eth = eth / Dot1Q(vlan=vlan, prio=0)
    if v6:
        ip = IPv6(src=REMOTE_VTEP6, dst=NODE_IP6, hlim=64)
        udp = UDP(sport=OUTER_SPORT, dport=VXLAN_PORT)  # scapy computes the v6 checksum
    else:
        ip = IP(src=REMOTE_VTEP, dst=NODE_IP, id=0x1c46, flags="DF", ttl=62)
        udp = UDP(sport=OUTER_SPORT, dport=VXLAN_PORT, chksum=0)
    return raw(eth / ip / udp / VXLAN(flags=0x08, vni=vni) / Raw(inner))


def encap_out(inner: bytes, outer_dst: str, vni: int, sport_key: Key) -> bytes:
    """The outer header `encap` writes (docs/golden-corpus.md, "Encap and the outer source port")."""
    return raw(
        Ether(src=NODE_MAC, dst=GW_MAC, type=0x0800)
        / IP(version=4, ihl=5, tos=0, id=0, flags="DF", frag=0, ttl=64, proto=17, src=NODE_IP, dst=outer_dst)
        / UDP(sport=vxlan_source_port(sport_key), dport=VXLAN_PORT, chksum=0)
        / VXLAN(flags=0x08, vni=vni)
        / Raw(inner)
    )


def tenant_l2() -> Packet:
    return Ether(src=VM_MAC, dst=VGW_MAC)


def bare_l2() -> Packet:
    return Ether(src=GW_MAC, dst=NODE_MAC)


# --------------------------------------------------------------------------------------
# L3/L4 builders: build(src: Ep, dst: Ep) -> scapy packet starting at the IP header
# --------------------------------------------------------------------------------------

Builder = Callable[[Ep, Ep], Packet]


def l3(src: Ep, dst: Ep, ttl: int = 64, ip_id: int = 0x4d2, **kw) -> Packet:
    if ":" in src.addr:
        return IPv6(src=src.addr, dst=dst.addr, hlim=ttl, **kw)
    return IP(src=src.addr, dst=dst.addr, ttl=ttl, id=ip_id, flags="DF", **kw)


def udp(payload: bytes = b"starfabric golden udp", **l3kw) -> Builder:
    return lambda s, d: l3(s, d, **l3kw) / UDP(sport=s.port, dport=d.port) / Raw(payload)


def udp_zero_csum(payload: bytes = b"no checksum here") -> Builder:
    return lambda s, d: l3(s, d) / UDP(sport=s.port, dport=d.port, chksum=0) / Raw(payload)


SYN_OPTS = [("MSS", 1460), ("SAckOK", b""), ("Timestamp", (1000, 0)), ("NOP", None), ("WScale", 7)]


def tcp_syn(**l3kw) -> Builder:
    return lambda s, d: l3(s, d, **l3kw) / TCP(
        sport=s.port, dport=d.port, seq=0x11223344, ack=0, flags="S", window=64240, options=SYN_OPTS
    )


def tcp_data(payload: bytes = b"GET / HTTP/1.1\r\nHost: golden\r\n\r\n", **l3kw) -> Builder:
    return lambda s, d: l3(s, d, **l3kw) / TCP(
        sport=s.port, dport=d.port, seq=0x11223345, ack=0x55667788, flags="PA", window=502
    ) / Raw(payload)


def tcp_ack(**l3kw) -> Builder:
    return lambda s, d: l3(s, d, **l3kw) / TCP(
        sport=s.port, dport=d.port, seq=0x01020304, ack=0x0a0b0c0d, flags="A", window=1024
    )


def icmp_echo(reply: bool, seq: int = 1, payload: bytes = b"golden ping 0123456789") -> Builder:
    """Echo request: the identifier is the source port; echo reply: the destination port."""

    def build(s: Ep, d: Ep) -> Packet:
        ident = d.port if reply else s.port
        assert (s.port if reply else d.port) == 0
        if ":" in s.addr:
            msg = (ICMPv6EchoReply if reply else ICMPv6EchoRequest)(id=ident, seq=seq, data=payload)
            return l3(s, d) / msg
        return l3(s, d) / ICMP(type=0 if reply else 8, code=0, id=ident, seq=seq) / Raw(payload)

    return build


def v6_exthdrs_tcp(payload: bytes = b"ext headers then tcp") -> Builder:
    """Hop-by-Hop (Router Alert) + Destination Options (PadN) + Routing type 0, segleft 0."""

    def build(s: Ep, d: Ep) -> Packet:
        return (
            l3(s, d)
            / IPv6ExtHdrHopByHop(options=[RouterAlert(value=0)])
            / IPv6ExtHdrDestOpt(options=[PadN(optdata=b"\x00" * 4)])
            / IPv6ExtHdrRouting(type=0, segleft=0, addresses=[ROUTER6])
            / TCP(sport=s.port, dport=d.port, seq=7, ack=9, flags="PA", window=300)
            / Raw(payload)
        )

    return build


def with_ip_options(inner: Builder, options) -> Builder:
    def build(s: Ep, d: Ep) -> Packet:
        p = inner(s, d)
        p[IP].options = options
        return p

    return build


def v4_first_fragment(full: Builder, frag_payload_len: int) -> Builder:
    """First fragment (MF, offset 0) of the datagram `full` builds; see D4."""

    def build(s: Ep, d: Ep) -> Packet:
        dgram = IP(raw(full(s, d)))
        l4 = raw(dgram.payload)
        assert frag_payload_len % 8 == 0 and frag_payload_len < len(l4)
        return IP(src=dgram.src, dst=dgram.dst, id=dgram.id, ttl=dgram.ttl, flags="MF", frag=0,
                  proto=dgram.proto) / Raw(l4[:frag_payload_len])

    return build


# --------------------------------------------------------------------------------------
# Family: ordinary flows (tenant VXLAN or bare)
# --------------------------------------------------------------------------------------


def rule_text(actions: List[str]) -> str:
    return "; ".join(actions)


def flow_case(
    name: str,
    doc: str,
    proto: str,
    src: Ep,
    dst: Ep,
    build: Builder,
    rw: Rewrite = NO_REWRITE,
    *,
    vxlan_vni: Optional[int] = 100,  # None: bare frame (key VNI 0)
    outer_vlan: Optional[int] = None,
    v6_underlay: bool = False,
    l2: Optional[Callable[[], Packet]] = None,
    encap: Optional[Tuple[str, int]] = (NEXT_VTEP, 200),
    extra: Tuple[str, ...] = ("count",),
    out_port: int = 1,
    pad: bytes = b"",
    drop_rule: Optional[str] = None,
    l4_csum_check: bool = True,
) -> None:
    tenant = vxlan_vni is not None
    l2 = l2 or (tenant_l2 if tenant else bare_l2)
    key = Key(vxlan_vni if tenant else 0, proto, src, dst)

    frame_in = raw(l2() / build(src, dst)) + pad
    inp = vxlan_in(frame_in, vxlan_vni, vlan=outer_vlan, v6=v6_underlay) if tenant else frame_in

    if drop_rule is not None:
        add(Case(name, doc, inp, key, rule_text(list(extra) + [f"drop {drop_rule}"]),
                 drop=f"rule:{drop_rule}"))
        return

    key2 = rw.apply(key)
    frame_out = raw(l2() / build(key2.src, key2.dst)) + pad
    actions = (["decap"] if tenant else []) + rw.actions()
    if encap is not None:
        outer_dst, vni = encap
        actions.append(f"encap {outer_dst} vni {vni}")
        out = encap_out(frame_out, outer_dst, vni, replace(key2, vni=vni))  # D1
    else:
        out = frame_out
    actions += list(extra) + [f"out {out_port}"]
    add(Case(name, doc, inp, key, rule_text(actions), out_port=out_port, out=out,
             l4_csum_check=l4_csum_check))


# --------------------------------------------------------------------------------------
# Family: ICMP errors (keyed on the reversed quoted 5-tuple)
# --------------------------------------------------------------------------------------

ErrBuilder = Callable[[str, str, bytes], Packet]  # (outer src, outer dst, quote) -> IP/ICMP


def icmp4_err(icmp_type: int, code: int, **kw) -> ErrBuilder:
    return lambda s, d, q: IP(src=s, dst=d, ttl=64, id=0x0bad, tos=0xc0) / ICMP(type=icmp_type, code=code, **kw) / Raw(q)


def icmp6_err(cls, **kw) -> ErrBuilder:
    return lambda s, d, q: IPv6(src=s, dst=d, hlim=64) / cls(**kw) / Raw(q)


def icmp_error_case(
    name: str,
    doc: str,
    qproto: str,
    qsrc: Ep,
    qdst: Ep,
    quoted: Builder,
    quote_len: Optional[int],
    err: ErrBuilder,
    osrc: str,
    odst: str,
    rw: Rewrite,
    *,
    vxlan_vni: Optional[int] = None,
    encap: Optional[Tuple[str, int]] = None,
    out_port: int = 2,
) -> None:
    """`quoted` builds the full original packet (addresses/ports qsrc -> qdst); the error
    quotes its first `quote_len` bytes (None: all of it)."""
    tenant = vxlan_vni is not None
    l2 = tenant_l2 if tenant else bare_l2
    key = Key(vxlan_vni if tenant else 0, qproto, qdst, qsrc)  # reversed quote

    def frame(o_src: str, o_dst: str, q_src: Ep, q_dst: Ep) -> bytes:
        q = raw(quoted(q_src, q_dst))
        if quote_len is not None:
            assert quote_len < len(q)
            q = q[:quote_len]
        return raw(l2() / err(o_src, o_dst, q))

    frame_in = frame(osrc, odst, qsrc, qdst)
    inp = vxlan_in(frame_in, vxlan_vni) if tenant else frame_in

    key2 = rw.apply(key)
    # set-src: outer source + quoted destination; set-dst: outer destination + quoted source.
    o_src2 = rw.src_addr or osrc
    o_dst2 = rw.dst_addr or odst
    frame_out = frame(o_src2, o_dst2, key2.dst, key2.src)

    actions = (["decap"] if tenant else []) + rw.actions()
    if encap is not None:
        outer_dst, vni = encap
        actions.append(f"encap {outer_dst} vni {vni}")
        out = encap_out(frame_out, outer_dst, vni, replace(key2, vni=vni))  # D1, D2
    else:
        out = frame_out
    actions += ["count", f"out {out_port}"]
    add(Case(name, doc, inp, key, rule_text(actions), out_port=out_port, out=out))


# --------------------------------------------------------------------------------------
# Family: drops without a rule (malformed, not-ip, fragment, no-rule)
# --------------------------------------------------------------------------------------


def drop_case(name: str, doc: str, inp: bytes, reason: str, valid_in: bool = False, match: Optional[Key] = None,
              rule: Optional[str] = None) -> None:
    add(Case(name, doc, inp, match, rule, drop=reason, valid_in=valid_in))


def fix_ipv4_csum(b: bytes, off: int, hlen: int = 20) -> bytes:
    """Recompute (scapy's checksum) an IPv4 header checksum after a field was mangled (D8)."""
    h = bytearray(b[off : off + hlen])
    h[10:12] = b"\x00\x00"
    h[10:12] = struct.pack("!H", checksum(bytes(h)))
    return b[:off] + bytes(h) + b[off + hlen :]


# --------------------------------------------------------------------------------------
# Searches for checksum edge values (deterministic: first hit in a fixed range)
# --------------------------------------------------------------------------------------


def l4_csum(pkt: Packet) -> int:
    p = IP(raw(pkt)) if IP in pkt else IPv6(raw(pkt))
    for layer in (UDP, TCP):
        if layer in p:
            return p[layer].chksum
    raise ValueError


def find_port(pred: Callable[[int], bool], start: int = 1024) -> int:
    for port in range(start, 65536):
        if pred(port):
            return port
    raise RuntimeError("no port found")


def find_csum_port(csum: Callable[[int], int], want: int, start: int = 1024) -> int:
    """The first value from `start` at which `csum(value)` is `want`: what
    `find_port(lambda v: csum(v) == want, start)` returns, without building 64k packets
    in scapy (that took minutes of `make golden-check`).

    `csum` is a 16-bit one's complement checksum over a packet in which the value is one
    16-bit word and nothing else changes (a port, an IPv4 id). Its one's complement sum
    then moves by exactly 1 (mod 0xffff) per step of the value, so one evaluation places
    every value that can give `want`; each of those is checked with `csum` itself, and
    anything unexpected falls back on the full search."""
    def total(c: int) -> int:  # the one's complement sum behind checksum c, mod 0xffff
        return (0xFFFF - c) % 0xFFFF

    first = start + (total(want) - total(csum(start))) % 0xFFFF
    for v in range(first, 65536, 0xFFFF):
        if csum(v) == want:
            return v
    return find_port(lambda v: csum(v) == want, start)


# --------------------------------------------------------------------------------------
# The cases
# --------------------------------------------------------------------------------------

C4, S4 = Ep(CLIENT, 5000), Ep(SERVER, 9000)
C6, S6 = Ep(CLIENT6, 5000), Ep(SERVER6, 443)
SNAT4 = snat(NAT_IP, 40000)
SNAT6 = snat(NAT_IP6, 40000)


def tenant_cases() -> None:
    flow_case("v4-udp-snat-reencap", "tenant UDP, SNAT to 198.19.0.1:40000, re-encap into VNI 200",
              "udp", C4, S4, udp(), SNAT4)
    flow_case("v4-tcp-syn-snat-reencap", "tenant TCP SYN with options, SNAT, re-encap",
              "tcp", Ep(CLIENT, 5001), Ep(SERVER, 80), tcp_syn(), SNAT4, extra=("count", "offload"))
    flow_case("v4-tcp-data-snat-reencap", "tenant TCP data segment, SNAT, re-encap",
              "tcp", Ep(CLIENT, 5001), Ep(SERVER, 80), tcp_data(), SNAT4)
    flow_case("v4-tcp-syn-dnat-reencap", "tenant TCP SYN to a VIP, DNAT to a backend, re-encap",
              "tcp", Ep(CLIENT, 5002), Ep(VIP, 80), tcp_syn(), dnat(SERVER, 8080))
    flow_case("v4-udp-snat-dnat-reencap", "tenant UDP, both source and destination rewritten",
              "udp", Ep(CLIENT, 5003), Ep(VIP, 9000), udp(), Rewrite(NAT_IP, 40003, SERVER, 9053))
    flow_case("v4-udp-port-only-snat-reencap", "set-src :40000 (port only)",
              "udp", Ep(CLIENT, 5004), S4, udp(), snat(port=40000))
    flow_case("v4-tcp-addr-only-snat-reencap", "set-src 198.19.0.1 (address only, port kept)",
              "tcp", Ep(CLIENT, 5005), Ep(SERVER, 80), tcp_data(), snat(NAT_IP))
    flow_case("v4-udp-addr-only-dnat-decap", "address-only DNAT, decap without re-encap",
              "udp", Ep(CLIENT, 5006), Ep(VIP, 9000), udp(), dnat(SERVER2), encap=None, out_port=2)
    flow_case("v4-udp-port-only-dnat-decap", "set-dst :9053 (port only), decap without re-encap",
              "udp", Ep(CLIENT, 5007), S4, udp(), dnat(port=9053), encap=None, out_port=2)
    flow_case("v4-icmp-echo-request-snat-reencap", "ICMP echo request: set-src 198.19.0.1:777 rewrites the identifier",
              "icmp", Ep(CLIENT, 0x1234), Ep(SERVER, 0), icmp_echo(reply=False), snat(NAT_IP, 777))
    flow_case("v4-icmp-echo-reply-unsnat-reencap", "ICMP echo reply: the identifier is the destination port",
              "icmp", Ep(SERVER, 0), Ep(NAT_IP, 777), icmp_echo(reply=True), dnat(CLIENT, 0x1234))
    flow_case("v4-udp-zero-csum-snat-reencap", "UDP checksum 0 over IPv4 stays 0 after SNAT (D3)",
              "udp", Ep(CLIENT, 5008), S4, udp_zero_csum(), SNAT4)
    flow_case("v4-udp-vlan-outer-snat-reencap", "802.1Q-tagged outer frame: the tag goes with the outer headers (D6)",
              "udp", Ep(CLIENT, 5009), S4, udp(), SNAT4, outer_vlan=42)
    flow_case("v4-tcp-options-rr-dnat-reencap", "inner IPv4 with options (IHL 8, record route): options preserved",
              "tcp", Ep(CLIENT, 5010), Ep(VIP, 80),
              with_ip_options(tcp_data(), [IPOption_RR(pointer=4, routers=["0.0.0.0", "0.0.0.0"])]),
              dnat(SERVER, 8080))
    flow_case("v4-udp-acl-deny", "tenant flow whose rule drops it",
              "udp", Ep(CLIENT, 5011), S4, udp(), drop_rule="acl-deny")

    # IPv6 tenant traffic (IPv4 underlay)
    flow_case("v6-tcp-syn-snat-reencap", "tenant IPv6 TCP SYN, SNAT, re-encap",
              "tcp", C6, S6, tcp_syn(), SNAT6)
    flow_case("v6-tcp-data-dnat-reencap", "tenant IPv6 TCP data to a VIP, DNAT, re-encap",
              "tcp", Ep(CLIENT6, 5001), Ep(VIP6, 443), tcp_data(), dnat(SERVER6, 8443))
    flow_case("v6-udp-snat-dnat-reencap", "tenant IPv6 UDP, source and destination rewritten",
              "udp", Ep(CLIENT6, 5002), Ep(VIP6, 9000), udp(), Rewrite(NAT_IP6, 40002, SERVER6, 9053))
    flow_case("v6-icmp6-echo-request-snat-reencap", "ICMPv6 echo request, identifier rewritten by set-src",
              "icmp6", Ep(CLIENT6, 0x4321), Ep(SERVER6, 0), icmp_echo(reply=False), snat(NAT_IP6, 777))
    flow_case("v6-icmp6-echo-reply-unsnat-reencap", "ICMPv6 echo reply, identifier rewritten by set-dst",
              "icmp6", Ep(SERVER6, 0), Ep(NAT_IP6, 777), icmp_echo(reply=True), dnat(CLIENT6, 0x4321))
    flow_case("v6-tcp-exthdrs-snat-reencap", "IPv6 Hop-by-Hop + Destination Options + Routing (type 0, segleft 0) before TCP",
              "tcp", Ep(CLIENT6, 5004), Ep(SERVER6, 80), v6_exthdrs_tcp(), SNAT6)
    flow_case("v6-tcp-exthdrs-dnat-decap", "IPv6 extension headers, DNAT (pseudo-header dst = IPv6 dst as segleft is 0)",
              "tcp", Ep(CLIENT6, 5005), Ep(VIP6, 80), v6_exthdrs_tcp(), dnat(SERVER6, 8080), encap=None,
              out_port=2)

    # decap only / encap only / underlay variants
    flow_case("v4-udp-decap-only", "decap; out 2: the inner Ethernet frame unchanged",
              "udp", Ep(CLIENT, 5012), S4, udp(), encap=None, extra=(), out_port=2)
    flow_case("v6-tcp-decap-only", "decap only, inner IPv6 TCP",
              "tcp", Ep(CLIENT6, 5006), Ep(SERVER6, 80), tcp_data(), encap=None, extra=(), out_port=2)
    flow_case("v4-udp-vlan-outer-decap-only", "802.1Q-tagged VXLAN frame, decap only: tag removed with the outer headers",
              "udp", Ep(CLIENT, 5013), S4, udp(), outer_vlan=7, encap=None, extra=(), out_port=2)
    flow_case("v4-udp-v6-underlay-decap-only", "VXLAN over an IPv6 underlay, decap only",
              "udp", Ep(CLIENT, 5014), S4, udp(), v6_underlay=True, encap=None, extra=("count",), out_port=2)
    flow_case("v4-udp-bare-encap-only", "bare IPv4 frame (VNI 0) encapsulated into VNI 300",
              "udp", Ep(CLIENT, 5015), S4, udp(), vxlan_vni=None, encap=(NEXT_VTEP, 300))


def bare_cases() -> None:
    flow_case("v4-udp-bare-snat", "bare IPv4 UDP (VNI 0), SNAT only",
              "udp", Ep(CLIENT, 6000), S4, udp(), SNAT4, vxlan_vni=None, encap=None)
    flow_case("v4-udp-vlan-bare-snat", "802.1Q-tagged bare frame, SNAT only: the tag stays (D6)",
              "udp", Ep(CLIENT, 6001), S4, udp(), SNAT4, vxlan_vni=None, encap=None,
              l2=lambda: Ether(src=GW_MAC, dst=NODE_MAC) / Dot1Q(vlan=42, prio=3))
    flow_case("v4-tcp-qinq-bare-snat", "QinQ (802.1ad + 802.1Q) bare frame, SNAT only: both tags stay",
              "tcp", Ep(CLIENT, 6002), Ep(SERVER, 80), tcp_data(), SNAT4, vxlan_vni=None, encap=None,
              l2=lambda: Ether(src=GW_MAC, dst=NODE_MAC, type=0x88A8) / Dot1AD(vlan=100, type=0x8100) / Dot1Q(vlan=42))
    flow_case("v4-udp-options-ra-bare-snat", "IPv4 with a Router Alert option (IHL 6): option preserved",
              "udp", Ep(CLIENT, 6003), S4, with_ip_options(udp(), [IPOption_Router_Alert()]), SNAT4,
              vxlan_vni=None, encap=None)
    flow_case("v4-udp-eth-pad-bare-snat", "60-byte frame, IPv4 total length 32: the 14 zero pad bytes are kept",
              "udp", Ep(CLIENT, 6004), S4, udp(b"pad!"), SNAT4, vxlan_vni=None, encap=None, pad=b"\x00" * 14)
    flow_case("v4-tcp-ack-eth-pad-nonzero-bare-dnat", "60-byte pure ACK with 6 non-zero pad bytes: kept unchanged",
              "tcp", Ep(CLIENT, 6005), Ep(VIP, 80), tcp_ack(), dnat(SERVER, 8080), vxlan_vni=None, encap=None,
              pad=bytes.fromhex("a5a5c3c35a5a"))
    flow_case("v4-udp-first-fragment-snat", "IPv4 first fragment (MF, offset 0) of a UDP datagram: keyed and rewritten (D4)",
              "udp", Ep(CLIENT, 6006), S4, v4_first_fragment(udp(bytes(range(64)) * 2), 48), SNAT4,
              vxlan_vni=None, encap=None, l4_csum_check=False)
    flow_case("v6-tcp-bare-acl-deny", "bare IPv6 flow whose rule drops it",
              "tcp", Ep(CLIENT6, 6000), Ep(SERVER6, 22), tcp_syn(), vxlan_vni=None, drop_rule="acl-deny")

    # Checksum edge values (D3). Each search fixes one port so the recomputed checksum
    # hits the edge; scapy's UDP checksum reads 0xffff exactly when the computed one is 0.
    src = Ep(CLIENT, 6007)
    p = find_csum_port(lambda port: l4_csum(udp()(Ep(NAT_IP, port), S4)), 0xFFFF)
    flow_case("v4-udp-csum-becomes-ffff-snat", f"after SNAT to :{p} the UDP checksum computes to 0 and is sent as 0xffff",
              "udp", src, S4, udp(), snat(NAT_IP, p), vxlan_vni=None, encap=None)
    p = find_csum_port(lambda port: l4_csum(udp()(Ep(CLIENT, port), S4)), 0xFFFF)
    flow_case("v4-udp-csum-was-ffff-snat", f"input UDP checksum is 0xffff (computed 0, source port {p}); SNAT changes it",
              "udp", Ep(CLIENT, p), S4, udp(), SNAT4, vxlan_vni=None, encap=None)
    s6 = Ep(SERVER6, 9000)
    p = find_csum_port(lambda port: l4_csum(udp()(Ep(NAT_IP6, port), s6)), 0xFFFF)
    flow_case("v6-udp-csum-becomes-ffff-snat", f"IPv6: after SNAT to :{p} the UDP checksum computes to 0, sent as 0xffff",
              "udp", Ep(CLIENT6, 6008), s6, udp(), snat(NAT_IP6, p), vxlan_vni=None, encap=None)
    d = Ep(SERVER, 80)
    p = find_csum_port(lambda port: l4_csum(tcp_data()(Ep(NAT_IP, port), d)), 0)
    flow_case("v4-tcp-csum-becomes-zero-snat", f"after SNAT to :{p} the TCP checksum is 0x0000 (not 0xffff)",
              "tcp", Ep(CLIENT, 6009), d, tcp_data(), snat(NAT_IP, p), vxlan_vni=None, encap=None)
    ip_id = find_csum_port(lambda i: IP(raw(udp(ip_id=i)(Ep(NAT_IP, 40000), S4))).chksum, 0, start=0)
    flow_case("v4-udp-iphdr-csum-becomes-zero-snat", f"IPv4 id {ip_id}: after SNAT the header checksum is 0x0000",
              "udp", Ep(CLIENT, 6010), S4, udp(ip_id=ip_id), SNAT4, vxlan_vni=None, encap=None)


def icmp_error_cases() -> None:
    # Forward flow CLIENT:5000 -> SERVER:9000 was SNATed to NAT_IP:40000. Errors about it
    # come back to NAT_IP quoting NAT_IP:40000 -> SERVER:9000; the reversed quote is the
    # reply-direction key SERVER:9000 > NAT_IP:40000, whose rule is set-dst CLIENT:5000.
    qs, qd = Ep(NAT_IP, 40000), Ep(SERVER, 9000)
    unsnat = dnat(CLIENT, 5000)
    q_udp = udp(b"a quoted UDP request....", ttl=1)
    icmp_error_case("v4-icmp-port-unreach-udp-unsnat", "ICMP port unreachable from the server, full UDP quote",
                    "udp", qs, qd, udp(b"a quoted UDP request...."), None, icmp4_err(3, 3), SERVER, NAT_IP, unsnat)
    icmp_error_case("v4-icmp-time-exceeded-udp-unsnat", "ICMP time exceeded from a router, full UDP quote",
                    "udp", qs, qd, q_udp, None, icmp4_err(11, 0), ROUTER, NAT_IP, unsnat)
    qt_s, qt_d = Ep(NAT_IP, 40001), Ep(SERVER, 80)
    unsnat_t = dnat(CLIENT, 5001)
    q_tcp = tcp_data(ttl=1)
    icmp_error_case("v4-icmp-time-exceeded-tcp-quote8-unsnat",
                    "time exceeded quoting 8 bytes of TCP: the TCP checksum is not in the quote",
                    "tcp", qt_s, qt_d, q_tcp, 20 + 8, icmp4_err(11, 0), ROUTER, NAT_IP, unsnat_t)
    icmp_error_case("v4-icmp-time-exceeded-tcp-hdr-unsnat",
                    "time exceeded quoting the whole TCP header + 8 payload bytes: quoted TCP checksum updated",
                    "tcp", qt_s, qt_d, q_tcp, 20 + 20 + 8, icmp4_err(11, 0), ROUTER, NAT_IP, unsnat_t)
    icmp_error_case("v4-icmp-frag-needed-tcp-unsnat", "fragmentation needed (MTU 1400) quoting a TCP header",
                    "tcp", qt_s, qt_d, tcp_data(), 20 + 20, icmp4_err(3, 4, nexthopmtu=1400), ROUTER, NAT_IP,
                    unsnat_t)
    # DNAT: client -> VIP:9000 became client -> SERVER:9053; an error from the server side
    # quotes CLIENT:5002 -> SERVER:9053; the reversed quote is the reply key
    # SERVER:9053 > CLIENT:5002, whose rule is set-src VIP:9000.
    icmp_error_case("v4-icmp-port-unreach-udp-undnat", "port unreachable for a DNATed flow: set-src rewrites outer src and quoted dst",
                    "udp", Ep(CLIENT, 5002), Ep(SERVER, 9053), udp(), None, icmp4_err(3, 3), SERVER, CLIENT,
                    snat(VIP, 9000))
    icmp_error_case("v4-icmp-time-exceeded-udp-undnat-router", "time exceeded from a router for a DNATed flow (D10)",
                    "udp", Ep(CLIENT, 5002), Ep(SERVER, 9053), udp(ttl=1), None, icmp4_err(11, 0), ROUTER, CLIENT,
                    snat(VIP, 9000))
    # Tenant (VXLAN) errors.
    icmp_error_case("v4-icmp-port-unreach-udp-unsnat-vxlan-decap", "VXLAN-wrapped port unreachable, decap + un-SNAT",
                    "udp", qs, qd, udp(b"a quoted UDP request...."), None, icmp4_err(3, 3), SERVER, NAT_IP, unsnat,
                    vxlan_vni=100)
    icmp_error_case("v4-icmp-time-exceeded-tcp-unsnat-vxlan-reencap",
                    "VXLAN-wrapped time exceeded (TCP header quoted), un-SNAT, re-encap into VNI 200 (D1, D2)",
                    "tcp", qt_s, qt_d, q_tcp, 20 + 20, icmp4_err(11, 0), ROUTER, NAT_IP, unsnat_t,
                    vxlan_vni=100, encap=(NEXT_VTEP, 200), out_port=1)

    # ICMPv6
    q6s, q6d = Ep(NAT_IP6, 40000), Ep(SERVER6, 9000)
    unsnat6 = dnat(CLIENT6, 5000)
    icmp_error_case("v6-icmp6-port-unreach-udp-unsnat", "ICMPv6 destination unreachable (port), full UDP quote",
                    "udp", q6s, q6d, udp(), None, icmp6_err(ICMPv6DestUnreach, code=4), SERVER6, NAT_IP6, unsnat6)
    icmp_error_case("v6-icmp6-packet-too-big-udp-unsnat", "ICMPv6 packet too big (MTU 1280) from a router, full UDP quote",
                    "udp", q6s, q6d, udp(b"x" * 120), None, icmp6_err(ICMPv6PacketTooBig, mtu=1280), ROUTER6, NAT_IP6,
                    unsnat6)
    icmp_error_case("v6-icmp6-time-exceeded-tcp-undnat", "ICMPv6 time exceeded for a DNATed TCP flow (set-src)",
                    "tcp", Ep(CLIENT6, 5002), Ep(SERVER6, 8443), tcp_syn(ttl=1), None,
                    icmp6_err(ICMPv6TimeExceeded, code=0), ROUTER6, CLIENT6, snat(VIP6, 443))
    icmp_error_case("v6-icmp6-dest-unreach-udp-unsnat-vxlan-reencap",
                    "VXLAN-wrapped ICMPv6 destination unreachable, un-SNAT, re-encap (D1, D2)",
                    "udp", q6s, q6d, udp(), None, icmp6_err(ICMPv6DestUnreach, code=4), SERVER6, NAT_IP6, unsnat6,
                    vxlan_vni=100, encap=(NEXT_VTEP, 200), out_port=1)


def drop_cases() -> None:
    eth = bare_l2()
    good4 = eth / udp()(Ep(CLIENT, 7000), S4)
    drop_case("v4-udp-no-rule", "valid IPv4 UDP without a rule", raw(good4), "no-rule", valid_in=True)
    t_in = raw(tenant_l2() / udp()(Ep(CLIENT, 7000), S4))
    drop_case("v4-udp-vxlan-no-rule", "valid tenant UDP without a rule", vxlan_in(t_in, 100), "no-rule", valid_in=True)

    # Fragments
    full = IP(raw(udp(bytes(range(64)) * 2)(Ep(CLIENT, 7001), S4)))
    l4 = raw(full.payload)
    mid = IP(src=CLIENT, dst=SERVER, id=full.id, ttl=64, flags="MF", frag=48 // 8, proto=17) / Raw(l4[48:96])
    last = IP(src=CLIENT, dst=SERVER, id=full.id, ttl=64, flags=0, frag=96 // 8, proto=17) / Raw(l4[96:])
    k = Key(0, "udp", Ep(CLIENT, 7001), S4)
    drop_case("v4-udp-middle-fragment", "IPv4 non-first fragment (MF, offset 48), even with a rule for the flow",
              raw(eth / mid), "fragment", valid_in=True, match=k, rule="set-src 198.19.0.1:40000; out 1")
    drop_case("v4-udp-last-fragment", "IPv4 last fragment (offset 96, MF clear)", raw(eth / last), "fragment",
              valid_in=True)
    full6 = raw(udp(bytes(range(64)) * 2)(Ep(CLIENT6, 7001), Ep(SERVER6, 9000)).payload)
    frag6 = IPv6(src=CLIENT6, dst=SERVER6, hlim=64) / IPv6ExtHdrFragment(nh=17, offset=48 // 8, m=1, id=0x2468) / Raw(
        full6[48:96])
    drop_case("v6-udp-nonfirst-fragment", "IPv6 Fragment header with offset 48", raw(eth / frag6), "fragment",
              valid_in=True)

    # Malformed / truncated
    drop_case("eth-runt-truncated", "10-byte frame, shorter than an Ethernet header", raw(good4)[:10], "truncated")
    drop_case("v4-hdr-cut-truncated", "IPv4 header cut after 12 bytes", raw(good4)[: 14 + 12], "truncated")
    b = bytearray(raw(good4))
    b[14] = 0x44
    drop_case("v4-ihl4-bad-header", "IPv4 IHL 4", fix_ipv4_csum(bytes(b), 14), "bad-header")
    b = bytearray(raw(good4))
    b[14] = 0x65
    drop_case("v4-version6-bad-header", "version 6 in an EtherType 0x0800 frame", fix_ipv4_csum(bytes(b), 14), "bad-header")
    p = eth / IP(src=CLIENT, dst=SERVER, id=1, len=200) / UDP(sport=7002, dport=9000) / Raw(b"short")
    drop_case("v4-total-len-past-frame-truncated", "IPv4 total length 200, frame carries 33 IP bytes", raw(p), "truncated")
    tcp_bytes = raw(tcp_data()(Ep(CLIENT, 7003), Ep(SERVER, 80))[TCP])
    p = eth / IP(src=CLIENT, dst=SERVER, id=1, proto=6) / Raw(tcp_bytes[:10])
    drop_case("v4-tcp-hdr-cut-truncated", "IPv4 total length 30: only 10 bytes of TCP header", raw(p), "truncated")
    p = eth / IP(src=CLIENT, dst=SERVER, id=1) / TCP(sport=7004, dport=80, dataofs=4, flags="A") / Raw(b"data offset 4")
    drop_case("v4-tcp-dataofs4-bad-header", "TCP data offset 4", raw(p), "bad-header")
    p = eth / IP(src=CLIENT, dst=SERVER, id=1) / UDP(sport=7005, dport=9000, len=6) / Raw(b"udp len 6")
    drop_case("v4-udp-len6-bad-header", "UDP length 6 (< 8)", raw(p), "bad-header")
    p = eth / IPv6(src=CLIENT6, dst=SERVER6, plen=64) / UDP(sport=7006, dport=9000) / Raw(b"payload length says 64")
    drop_case("v6-payload-cut-truncated", "IPv6 payload length 64, 30 bytes present", raw(p), "truncated")
    hbh = bytes([6, 2]) + bytes([1, 4, 0, 0, 0, 0])  # next header TCP, claims 24 bytes, 8 present
    p = eth / IPv6(src=CLIENT6, dst=SERVER6, nh=0) / Raw(hbh)
    drop_case("v6-exthdr-past-end-truncated", "Hop-by-Hop header claims 24 bytes, payload length 8", raw(p), "truncated")
    p = eth / IPv6(src="::ffff:198.18.0.5", dst=SERVER6) / UDP(sport=7007, dport=9000) / Raw(b"v4-mapped source")
    drop_case("v6-v4-mapped-src", "IPv6 source ::ffff:198.18.0.5 (RFC 4942 2.1.4)", raw(p), "v4-mapped", valid_in=True)
    p = eth / ARP(op=1, hwsrc=GW_MAC, psrc="198.18.0.2", hwdst="00:00:00:00:00:00", pdst=NODE_IP)
    drop_case("arp-not-ip", "ARP request", raw(p), "not-ip", valid_in=True)

    # VXLAN
    p = (Ether(src=GW_MAC, dst=NODE_MAC) / IP(src=REMOTE_VTEP, dst=NODE_IP, id=1, flags="DF")
         / UDP(sport=OUTER_SPORT, dport=VXLAN_PORT, chksum=0) / VXLAN(flags=0x00, vni=100) / Raw(t_in))
    drop_case("vxlan-i-flag-clear-bad-header", "UDP to 4789 whose VXLAN I flag is clear (D5)", raw(p), "bad-header")
    drop_case("vxlan-inner-eth-cut-truncated", "VXLAN carrying a 10-byte inner frame", vxlan_in(t_in[:10], 100),
              "truncated")
    p = (Ether(src=GW_MAC, dst=NODE_MAC) / IP(src=REMOTE_VTEP, dst=NODE_IP, id=1, flags="DF")
         / UDP(sport=OUTER_SPORT, dport=VXLAN_PORT, chksum=0) / Raw(b"\x08\x00\x00\x00"))
    drop_case("vxlan-hdr-cut-truncated", "UDP to 4789 with only 4 bytes of VXLAN header", raw(p), "truncated")


def build_cases() -> List[Case]:
    if not CASES:
        tenant_cases()
        bare_cases()
        icmp_error_cases()
        drop_cases()
    return CASES


# --------------------------------------------------------------------------------------
# Hash vectors
# --------------------------------------------------------------------------------------

HASH_VECTOR_KEYS = [
    Key(100, "udp", Ep(CLIENT, 5000), Ep(SERVER, 9000)),
    Key(200, "udp", Ep(NAT_IP, 40000), Ep(SERVER, 9000)),
    Key(0, "tcp", Ep(CLIENT, 5001), Ep(SERVER, 80)),
    Key(0xFFFFFF, "tcp", Ep("198.19.255.255", 65535), Ep("198.18.0.0", 1)),
    Key(200, "icmp", Ep(NAT_IP, 777), Ep(SERVER, 0)),
    Key(100, "tcp", Ep(CLIENT6, 5000), Ep(SERVER6, 443)),
    Key(300, "udp", Ep("2001:2::", 0), Ep("2001:2:0:ffff:ffff:ffff:ffff:ffff", 65535)),
    Key(200, "icmp6", Ep(SERVER6, 0), Ep(CLIENT6, 0x4321)),
]


def hash_vector_lines() -> List[str]:
    out = []
    for k in HASH_VECTOR_KEYS:
        c = k.canonical()
        out.append(f"{c.hex()} {flow_hash(c):016x} {vxlan_source_port(k)}")
    return out


# --------------------------------------------------------------------------------------
# Self-check
# --------------------------------------------------------------------------------------

CSUM_LAYERS = (IP, TCP, UDP, ICMP, ICMPv6DestUnreach, ICMPv6PacketTooBig, ICMPv6TimeExceeded,
               ICMPv6EchoRequest, ICMPv6EchoReply)


def check_frame(b: bytes, what: str, l4_csum_check: bool) -> List[str]:
    """Re-parse a frame that should be valid: it must round-trip byte for byte, end in a
    known upper layer, and rebuild identically when scapy recomputes every checksum and
    length it knows (outer, inner, ICMP message; not the quoted *error layers, not zero
    UDP checksums, not a fragment's L4)."""
    errs = []
    p = Ether(b)
    if raw(p) != b:
        errs.append(f"{what}: does not round-trip")
    names = [lay.__class__.__name__ for lay in p.iterpayloads()]
    if "VXLAN" in names and names[names.index("VXLAN") + 1] != "Ether":
        errs.append(f"{what}: VXLAN payload not parsed as Ethernet: {names}")
    l4_names = ("TCP", "UDP", "ICMP", "ARP", "ICMPv6EchoRequest", "ICMPv6EchoReply", "ICMPv6DestUnreach",
                "ICMPv6PacketTooBig", "ICMPv6TimeExceeded", "IPv6ExtHdrFragment")
    while len(names) > 1 and names[-2] not in l4_names and names[-1] in ("Raw", "Padding"):
        names.pop()
    tail = [n for n in names if n not in ("Raw", "Padding")][-1]
    if tail not in ("TCP", "UDP", "ICMP", "ARP", "ICMPv6EchoRequest", "ICMPv6EchoReply", "IP",
                    "IPv6ExtHdrFragment", "UDPerror", "TCPerror"):
        errs.append(f"{what}: parses as {names}")
    if tail == "IP" and not (p[IP].frag or p[IP].flags.MF):
        errs.append(f"{what}: IP without an upper layer: {names}")
    q = p.copy()
    for lay in q.iterpayloads():
        t = type(lay)
        if t not in CSUM_LAYERS or (t in (TCP, UDP) and not l4_csum_check):
            continue
        if t is UDP and lay.chksum == 0:
            lay.len = None
            continue
        csum_field = "cksum" if any(f.name == "cksum" for f in lay.fields_desc) else "chksum"
        setattr(lay, csum_field, None)
        if t in (IP, UDP):
            lay.len = None
    for lay in q.iterpayloads():
        if type(lay) is IPv6:
            lay.plen = None
    if raw(q) != b:
        errs.append(f"{what}: checksums/lengths differ from scapy's recomputation")
    errs += check_quote(p, what)
    return errs


def check_quote(p: Packet, what: str) -> List[str]:
    """The packet an ICMP error quotes: its IPv4 header checksum must verify; quoted
    whole, it must also pass check_frame's recomputation as a packet of its own."""
    from scapy.layers.inet import IPerror
    from scapy.layers.inet6 import IPerror6

    if IPerror in p:
        qb = raw(p[IPerror])
        if checksum(qb[: (qb[0] & 0xF) * 4]) != 0:
            return [f"{what}: quoted IPv4 header checksum wrong"]
        full = len(qb) == struct.unpack("!H", qb[2:4])[0]
        outer = Ether(src=GW_MAC, dst=NODE_MAC) / IP(qb)
    elif IPerror6 in p:
        qb = raw(p[IPerror6])
        full = len(qb) == 40 + struct.unpack("!H", qb[4:6])[0]
        outer = Ether(src=GW_MAC, dst=NODE_MAC) / IPv6(qb)
    else:
        return []
    return check_frame(raw(outer), what + " (quote)", True) if full else []


def self_check() -> int:
    errs = []
    for c in build_cases():
        if c.valid_in:
            errs += check_frame(c.inp, f"{c.name} in", c.l4_csum_check)
        if c.out is not None:
            errs += check_frame(c.out, f"{c.name} out", c.l4_csum_check)
        # match lines must describe the input (parsed by scapy, not by the generator)
        if c.match is not None and (c.out is not None or c.drop.startswith("rule:")):
            errs += check_key(c)
        if c.out is not None:
            errs += check_out(c)
    for e in errs:
        print(e, file=sys.stderr)
    n = len(CASES)
    print(f"check: {n} cases, {len(errs)} problems", file=sys.stderr)
    return 1 if errs else 0


def scapy_key(frame: bytes) -> Tuple[int, str, Ep, Ep]:
    """Key extraction re-done on scapy's parse, as an independent check of the match lines."""
    p = Ether(frame)
    vni = 0
    if VXLAN in p:
        vni = p[VXLAN].vni
        p = Ether(raw(p[VXLAN].payload))
    ip = p[IP] if IP in p else p[IPv6]
    from scapy.layers.inet import IPerror, UDPerror, TCPerror
    from scapy.layers.inet6 import IPerror6

    if ICMP in ip and ip[ICMP].type in (3, 11, 12) or any(
        c in ip for c in (ICMPv6DestUnreach, ICMPv6PacketTooBig, ICMPv6TimeExceeded)
    ):
        qb = raw(ip[IPerror] if IPerror in ip else ip[IPerror6])
        q = IP(qb) if IPerror in ip else IPv6(qb)
        l4 = q[TCP] if TCP in q else q[UDP]
        proto = "tcp" if TCP in q else "udp"
        return vni, proto, Ep(q.dst, l4.dport), Ep(q.src, l4.sport)
    if TCP in ip:
        return vni, "tcp", Ep(ip.src, ip[TCP].sport), Ep(ip.dst, ip[TCP].dport)
    if UDP in ip:
        return vni, "udp", Ep(ip.src, ip[UDP].sport), Ep(ip.dst, ip[UDP].dport)
    if ICMP in ip:
        i = ip[ICMP]
        return (vni, "icmp", Ep(ip.src, i.id if i.type == 8 else 0), Ep(ip.dst, i.id if i.type == 0 else 0))
    if ICMPv6EchoRequest in ip:
        return vni, "icmp6", Ep(ip.src, ip[ICMPv6EchoRequest].id), Ep(ip.dst, 0)
    if ICMPv6EchoReply in ip:
        return vni, "icmp6", Ep(ip.src, 0), Ep(ip.dst, ip[ICMPv6EchoReply].id)
    raise ValueError("no key")


def norm_ep(e: Ep) -> Ep:
    """The address in its canonical text form, so v6 spellings compare equal."""
    return Ep(str(ipaddress.ip_address(e.addr)), e.port)


def normalised_key(frame: bytes) -> Key:
    """The flow key scapy sees in `frame`, addresses normalised; raises as scapy_key."""
    vni, proto, s, d = scapy_key(frame)
    return Key(vni, proto, norm_ep(s), norm_ep(d))


def check_key(c: Case) -> List[str]:
    try:
        got = normalised_key(c.inp)
    except Exception as e:  # noqa: BLE001
        return [f"{c.name}: key extraction failed: {e!r}"]
    want = Key(c.match.vni, c.match.proto, norm_ep(c.match.src), norm_ep(c.match.dst))
    return [] if got == want else [f"{c.name}: match {want} but scapy sees {got}"]


def parse_ep_arg(arg: str) -> Tuple[Optional[str], Optional[int]]:
    """`a:p`, `[v6]:p`, `:p`, `a` as written in rule lines."""
    if arg.startswith("["):
        addr, rest = arg[1:].split("]", 1)
        return addr, int(rest[1:]) if rest else None
    if arg.startswith(":"):
        return None, int(arg[1:])
    if ":" in arg:
        addr, port = arg.split(":")
        return addr, int(port)
    return arg, None


def check_out(c: Case) -> List[str]:
    """Re-reads the rule *text* (not the generator's Rewrite objects), applies it to the
    match key and compares with what scapy sees in the expected output frame."""
    key = c.match
    encap = None
    for act in (a.strip() for a in c.rule.split(";")):
        verb, _, arg = act.partition(" ")
        if verb in ("set-src", "set-dst"):
            a, port = parse_ep_arg(arg)
            ep = key.src if verb == "set-src" else key.dst
            ep = Ep(a or ep.addr, ep.port if port is None else port)
            key = replace(key, src=ep) if verb == "set-src" else replace(key, dst=ep)
        elif verb == "encap":
            dst, _, vni = arg.split()
            encap = (dst, int(vni))
        elif verb == "out":
            if int(arg) != c.out_port:
                return [f"{c.name}: out port {c.out_port} but rule says {arg}"]
    key = replace(key, vni=encap[1] if encap else 0)
    errs = []
    try:
        got = normalised_key(c.out)
    except Exception as e:  # noqa: BLE001
        return [f"{c.name}: key extraction of the output failed: {e!r}"]
    want = replace(key, src=norm_ep(key.src), dst=norm_ep(key.dst))
    if got != want:
        errs.append(f"{c.name}: output carries {got}, rule text gives {want}")
    o = Ether(c.out)
    if encap:
        if not (o[IP].dst == encap[0] and o[IP].src == NODE_IP and o.src == NODE_MAC and o.dst == GW_MAC
                and o[UDP].sport == vxlan_source_port(key) and o[UDP].chksum == 0 and o[IP].ttl == 64
                and o[IP].id == 0 and o[IP].flags == 2 and o[VXLAN].flags == 0x08):
            errs.append(f"{c.name}: outer header differs from the encap spec")
        if Dot1Q in o and o.type == 0x8100:
            errs.append(f"{c.name}: VLAN tag on an encap output")
    elif VXLAN in o:
        errs.append(f"{c.name}: VXLAN in a non-encap output")
    return errs


# --------------------------------------------------------------------------------------


HEADER = """\
# Golden-packet corpus for the starfabric PP pipeline (format: docs/golden-corpus.md).
# GENERATED by tests/golden/gen.py -- do not edit by hand; run `make golden` instead.
# Frames and all checksums are built from scratch by scapy; addresses are from the
# RFC 2544 (198.18.0.0/15) and RFC 5180 (2001:2::/48) benchmarking ranges."""


def main(argv: List[str]) -> int:
    if argv[1:] == ["--hash-vectors"]:
        print("\n".join(hash_vector_lines()))
        return 0
    if argv[1:] == ["--check"]:
        return self_check()
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    node = f"node ip={NODE_IP} mac={NODE_MAC} gw-mac={GW_MAC}"
    return write_corpus([HEADER, node], (c.lines() for c in build_cases()))


def write_corpus(head: List[str], cases: Iterable[List[str]]) -> int:
    """Print a corpus: the `head` lines, then each case's lines after a blank line.
    Both generators (this one and nf_gen.py) write their corpus so."""
    lines = list(head)
    for case in cases:
        lines.append("")
        lines += case
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
