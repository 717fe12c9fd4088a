#!/usr/bin/python3
"""Golden NF-decision corpus generator: (flow, state before) -> (rule, state after) for the
built-in SNAT, FW and LB.

Usage (the same interpreter as gen.py, whose flow_hash it imports):

    nf_gen.py > tests/golden/nf_corpus.txt

The format is in docs/golden-corpus.md ("NF decisions"); crates/nfs/tests/nf_golden.rs
replays every case against the Rust NFs.

Independence: the expected decisions and states come from the small models below, each
written from the NFs' documented semantics (docs/nf-api.md, the module docs of
crates/nfs/src/{snat,fw,lb}.rs and the RFCs they cite), not by running Rust. Shared with
Rust are only what the documents pin as a specification: the flow hash
(docs/golden-corpus.md, taken from gen.py), the SplitMix64 request rng (crates/nf, env.rs),
and the seeded Maglev identity and flow hashes (crates/nfs/src/lb/maglev.rs). Output is
deterministic: fixed clocks, fixed seeds, sorted iteration.
"""

import ipaddress
import json
import os
import sys
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen import Ep as GenEp, Key as GenKey, flow_hash, write_corpus  # noqa: E402

M64 = (1 << 64) - 1
TCP, UDP, ICMP, ICMP6 = 6, 17, 1, 58
PROTO_NAME = {TCP: "tcp", UDP: "udp", ICMP: "icmp", ICMP6: "icmp6"}
FIN, SYN, RST, PSH, ACK = 0x01, 0x02, 0x04, 0x08, 0x10
FLAG_LETTERS = [("F", FIN), ("S", SYN), ("R", RST), ("P", PSH), ("A", ACK)]


# --------------------------------------------------------------------------------------
# Keys, hashes, rng
# --------------------------------------------------------------------------------------


def is_v6(a: str) -> bool:
    return ":" in a


def addr_sort(a: str) -> Tuple[int, bytes]:
    """Rust's IpAddr order: every V4 before every V6, then by octets."""
    ip = ipaddress.ip_address(a)
    return (ip.version, ip.packed)


def ep(a: str, p: Optional[int]) -> str:
    if p is None:
        return a
    return f"[{a}]:{p}" if is_v6(a) else f"{a}:{p}"


@dataclass(frozen=True)
class K:
    vni: int
    proto: int
    src: str
    sport: int
    dst: str
    dport: int

    def reversed(self) -> "K":
        return replace(self, src=self.dst, sport=self.dport, dst=self.src, dport=self.sport)

    def canonical(self) -> bytes:
        def a16(a: str) -> bytes:
            ip = ipaddress.ip_address(a)
            return (b"\x00" * 10 + b"\xff\xff" + ip.packed) if ip.version == 4 else ip.packed

        return (
            a16(self.src)
            + a16(self.dst)
            + self.sport.to_bytes(2, "big")
            + self.dport.to_bytes(2, "big")
            + self.vni.to_bytes(3, "big")
            + bytes([self.proto])
        )

    def hash(self) -> int:
        return flow_hash(self.canonical())

    def __str__(self) -> str:
        p = PROTO_NAME.get(self.proto, str(self.proto))
        return f"{self.vni} {p} {ep(self.src, self.sport)} > {ep(self.dst, self.dport)}"


def key(vni: int, proto: int, src: str, dst: str) -> K:
    """`src`/`dst` as `addr:port` (v6 in brackets)."""

    def split(s: str) -> Tuple[str, int]:
        a, p = s.rsplit(":", 1)
        return a.strip("[]"), int(p)

    (sa, sp), (da, dp) = split(src), split(dst)
    return K(vni, proto, sa, sp, da, dp)


def mix(z: int) -> int:
    """SplitMix64's finaliser."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class DetRng:
    """SplitMix64, seeded per request (crates/nf env.rs)."""

    def __init__(self, seed: int):
        self.s = seed & M64

    def next_u64(self) -> int:
        self.s = (self.s + 0x9E3779B97F4A7C15) & M64
        return mix(self.s)

    def below(self, n: int) -> int:
        return (self.next_u64() * n) >> 64


# --------------------------------------------------------------------------------------
# Decisions
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rw:
    """A rewrite; the NFs here always write whole endpoints."""

    src: Optional[Tuple[str, int]] = None
    dst: Optional[Tuple[str, int]] = None

    def apply(self, k: K) -> K:
        if self.src:
            k = replace(k, src=self.src[0], sport=self.src[1])
        if self.dst:
            k = replace(k, dst=self.dst[0], dport=self.dst[1])
        return k

    def text(self) -> str:
        out = []
        if self.src:
            out.append("set-src " + ep(*self.src))
        if self.dst:
            out.append("set-dst " + ep(*self.dst))
        return "; ".join(out)


NONE_RW = Rw()


def idle_text(ms: Optional[int]) -> str:
    if ms is None:
        return "none"
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def passed(fwd: Rw = NONE_RW, rev: Rw = NONE_RW, idle_ms: Optional[int] = None) -> str:
    return f"pass fwd [{fwd.text()}] rev [{rev.text()}] idle {idle_text(idle_ms)}"


def dropped(reason: str, idle_ms: Optional[int] = None) -> str:
    return f"drop {reason} idle {idle_text(idle_ms)}"


def flags_text(f: int) -> str:
    return "".join(l for l, b in FLAG_LETTERS if f & b) or "-"


def flags_of(s: str) -> int:
    return 0 if s == "-" else sum(b for l, b in FLAG_LETTERS if l in s)


# --------------------------------------------------------------------------------------
# SNAT model (docs/nf-api.md "The built-in SNAT"; RFC 4787, 5382, 5508, 7857)
# --------------------------------------------------------------------------------------

PROBES = 16


def prefix_contains(pfx: str, a: str) -> bool:
    try:
        net = ipaddress.ip_network(pfx)
    except ValueError:
        return False
    ip = ipaddress.ip_address(a)
    return ip.version == net.version and ip in net


class PortSet:
    """Free ports of one (pool address, protocol)."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = lo, hi
        self.free = set(range(lo, hi + 1))

    def take(self, p: int) -> bool:
        if p in self.free:
            self.free.remove(p)
            return True
        return False

    def alloc(self, want: int, rng: DetRng) -> Optional[int]:
        """Port preservation (RFC 4787 §4.2.1), else RFC 6056-style random: probes, then
        a scan upwards (wrapping) from a random point."""
        if not self.free:
            return None
        if self.take(want):
            return want
        n = self.hi - self.lo + 1
        for _ in range(PROBES):
            p = self.lo + rng.below(n)
            if self.take(p):
                return p
        start = rng.below(n)
        for i in range(n):
            p = self.lo + (start + i) % n
            if self.take(p):
                return p
        return None


@dataclass
class SFlow:
    own: Tuple[str, int, int]
    peer: Optional[Tuple[str, int, int]]
    fwd: Rw
    rev: Rw
    state: str
    deadline: int


class SnatModel:
    def __init__(self, cfg: dict):
        t = {"udp_s": 300, "tcp_established_s": 7440, "tcp_transitory_s": 240, "icmp_s": 60}
        t.update(cfg.get("timeouts", {}))
        self.t = t
        self.pools = []
        self.ports: Dict[Tuple[str, int], PortSet] = {}
        for p in cfg["pools"]:
            r = p.get("ports", {"lo": 1024, "hi": 65535})
            v6 = is_v6(p["addresses"][0])
            pool = {
                "addrs": p["addresses"],
                "edm": p.get("mapping", "endpoint_independent") == "endpoint_dependent",
                "sources": p.get("sources", []),
                "v6": v6,
            }
            self.pools.append(pool)
            for a in p["addresses"]:
                for pr in (TCP, UDP, ICMP6 if v6 else ICMP):
                    self.ports[(a, pr)] = PortSet(r["lo"], r["hi"])
        self.pool_addrs = {a for p in self.pools for a in p["addrs"]}
        self.mappings: Dict[Tuple[str, int, int], dict] = {}  # ext (addr, port, proto) -> mapping
        self.by_internal: Dict[tuple, Tuple[str, int, int]] = {}
        self.pairings: Dict[Tuple[int, str], dict] = {}
        self.flows: Dict[K, SFlow] = {}
        self.by_reply: Dict[K, K] = {}
        # Drops by cause, as the NF counts them (every drop is counted, none silently).
        self.drops = {"exhausted": 0, "invalid": 0, "unsupported": 0, "icmp-error-unknown": 0, "refused-inbound": 0}

    def refuse(self, reason: str) -> str:
        cause = {
            "snat-exhausted": "exhausted",
            "snat-tcp-invalid": "invalid",
            "snat-icmp-not-request": "invalid",
            "snat-unsupported-protocol": "unsupported",
            "snat-icmp-error-unknown-flow": "icmp-error-unknown",
            "snat-no-mapping": "refused-inbound",
            "snat-filtered": "refused-inbound",
        }[reason]
        self.drops[cause] += 1
        return dropped(reason)

    # -- configuration lookups
    def serves(self, p: dict, a: str) -> bool:
        return is_v6(a) == p["v6"] and (not p["sources"] or any(prefix_contains(s, a) for s in p["sources"]))

    def pool_for(self, a: str) -> Optional[int]:
        return next((i for i, p in enumerate(self.pools) if self.serves(p, a)), None)

    def is_inside(self, a: str) -> bool:
        return any(p["sources"] and self.serves(p, a) for p in self.pools)

    def timeout_ms(self, state: str) -> int:
        return 1000 * {
            "udp": self.t["udp_s"],
            "icmp": self.t["icmp_s"],
            "open": self.t["tcp_established_s"],
            "closing": self.t["tcp_transitory_s"],
            "syn": self.t["tcp_transitory_s"],
        }[state]

    def rule_timeout_ms(self, state: str) -> int:
        # PP's rule cannot be lengthened later: a SYN-opened flow gets the established one.
        return self.timeout_ms("open" if state == "syn" else state)

    # -- state helpers
    @staticmethod
    def reply_key(translated: K) -> K:
        return replace(translated.reversed(), vni=0)

    def resolve(self, k: K) -> Optional[K]:
        if k in self.flows:
            return k
        return self.by_reply.get(replace(k, vni=0))

    def release(self, ext) -> None:
        m = self.mappings.get(ext)
        if m is None:
            return
        m["flows"] = max(0, m["flows"] - 1)
        if m["flows"] == 0:
            del self.mappings[ext]
            if self.by_internal.get(m["key"]) == ext:
                del self.by_internal[m["key"]]
            pk = (m["key"][0], m["key"][2])
            pr = self.pairings.get(pk)
            if pr:
                pr["mappings"] -= 1
                if pr["mappings"] == 0:
                    del self.pairings[pk]
            self.ports[(ext[0], ext[2])].free.add(ext[1])

    def remove_flow(self, k: K) -> bool:
        f = self.flows.pop(k, None)
        if f is None:
            return False
        rk = self.reply_key(f.fwd.apply(k))
        if self.by_reply.get(rk) == k:
            del self.by_reply[rk]
        self.release(f.own)
        if f.peer:
            self.release(f.peer)
        return True

    def insert_flow(self, k: K, f: SFlow) -> None:
        self.by_reply[self.reply_key(f.fwd.apply(k))] = k
        for e in [f.own] + ([f.peer] if f.peer else []):
            if e in self.mappings:
                self.mappings[e]["flows"] += 1
        self.flows[k] = f

    def decision(self, f: SFlow, reply: bool) -> str:
        fwd, rev = (f.rev, f.fwd) if reply else (f.fwd, f.rev)
        return passed(fwd, rev, self.rule_timeout_ms(f.state))

    @staticmethod
    def new_state(k: K, flags: int):
        icmp = ICMP6 if is_v6(k.src) else ICMP
        if k.proto == TCP:
            if flags & (RST | FIN) or (flags & SYN and flags & ACK):
                return None, "snat-tcp-invalid"
            return ("syn" if flags & SYN else "open"), None
        if k.proto == UDP:
            return "udp", None
        if k.proto == icmp:
            if k.sport == 0 and k.dport != 0:
                return None, "snat-icmp-not-request"
            return "icmp", None
        return None, "snat-unsupported-protocol"

    def mapping_for(self, pool: int, k: K, rng: DetRng):
        p = self.pools[pool]
        mk = (k.vni, k.proto, k.src, k.sport, (k.dst, k.dport) if p["edm"] else None)
        if mk in self.by_internal:
            return self.by_internal[mk]
        free = lambda a: len(self.ports[(a, k.proto)].free)  # noqa: E731
        paired = self.pairings.get((k.vni, k.src), {}).get("external")
        if paired in p["addrs"] and free(paired) > 0:
            addr = paired  # RFC 4787 REQ-2: paired address pooling
        else:
            best = None
            for a in p["addrs"]:
                if free(a) > 0 and (best is None or free(a) > free(best)):
                    best = a
            if best is None:
                return None
            addr = best
        port = self.ports[(addr, k.proto)].alloc(k.sport, rng)
        if port is None:
            return None
        ext = (addr, port, k.proto)
        self.mappings[ext] = {"key": mk, "flows": 0}
        self.by_internal[mk] = ext
        self.pairings.setdefault((k.vni, k.src), {"external": addr, "mappings": 0})["mappings"] += 1
        return ext

    def first_packet(self, k: K, flags: int, tenant: int, icmp_error: bool, now: int, seed: int) -> str:
        rng = DetRng(seed)
        fk = self.resolve(k)
        if fk is not None:
            # A replay: the same translation, in the direction asked.
            reply = fk != k
            f = self.flows[fk]
            state = f.state
            if not reply and state == "closing" and flags & SYN and not flags & ACK:
                state = "syn"  # TIME_WAIT reuse reopens
            if state == "syn" and k.proto == TCP and not flags & (SYN | FIN | RST) and flags & ACK:
                state = "open"  # the handshake got through
            if not icmp_error:  # RFC 5508 REQ-6: errors do not refresh
                f.state = state
                f.deadline = now + self.timeout_ms(state)
            return self.decision(f, reply)
        if icmp_error:
            return self.refuse("snat-icmp-error-unknown-flow")
        if k.dst in self.pool_addrs:
            if self.is_inside(k.src):
                return self.hairpin(k, flags, now, rng)
            if (k.dst, k.dport, k.proto) in self.mappings:
                return self.refuse("snat-filtered")
            return self.refuse("snat-no-mapping")
        pool = self.pool_for(k.src)
        if pool is None or k.src in self.pool_addrs:
            return passed()
        got = self.state_and_mapping(pool, k, flags, rng)
        if isinstance(got, str):
            return got
        state, own = got
        f = SFlow(own, None, Rw(src=(own[0], own[1])), Rw(dst=(k.src, k.sport)), state, now + self.timeout_ms(state))
        self.insert_flow(k, f)
        return self.decision(f, False)

    def state_and_mapping(self, pool, k: K, flags: int, rng: DetRng):
        """A new flow's state and its own mapping, or the refusal (both paths of a new flow
        share it: outbound and hairpin)."""
        state, why = self.new_state(k, flags)
        if why:
            return self.refuse(why)
        own = self.mapping_for(pool, k, rng)
        if own is None:
            return self.refuse("snat-exhausted")
        return state, own

    def hairpin(self, k: K, flags: int, now: int, rng: DetRng) -> str:
        target = (k.dst, k.dport, k.proto)
        if target not in self.mappings:
            return self.refuse("snat-no-mapping")
        peer = self.mappings[target]["key"]
        pool = self.pool_for(k.src)
        if pool is None:
            return self.refuse("snat-no-mapping")
        got = self.state_and_mapping(pool, k, flags, rng)
        if isinstance(got, str):
            return got
        state, own = got
        f = SFlow(
            own,
            target,
            Rw(src=(own[0], own[1]), dst=(peer[2], peer[3])),
            Rw(src=(target[0], target[1]), dst=(k.src, k.sport)),
            state,
            now + self.timeout_ms(state),
        )
        self.insert_flow(k, f)
        return self.decision(f, False)

    def on_event(self, kind: str, k: K, now: int) -> None:
        fk = self.resolve(k)
        if fk is None:
            return
        f = self.flows[fk]
        if kind == "expired":
            self.remove_flow(fk)
        elif kind == "closing" and f.state in ("open", "closing", "syn"):
            f.state, f.deadline = "closing", now + self.timeout_ms("closing")
        elif kind == "established" and f.state == "syn":
            f.state, f.deadline = "open", now + self.timeout_ms("open")
        elif kind == "active":
            f.deadline = now + self.timeout_ms(f.state)

    def on_timer(self, now: int) -> List[K]:
        due = sorted((f.deadline, k.canonical(), k) for k, f in self.flows.items() if f.deadline <= now)
        out = []
        for _, _, k in due:
            if self.remove_flow(k):
                out.append(k)
        return out

    def state_lines(self, keys: List[K]) -> List[str]:
        out = [f"flows {len(self.flows)}", "drops " + " ".join(f"{k}={v}" for k, v in self.drops.items())]
        for ext in sorted(self.mappings, key=lambda e: (addr_sort(e[0]), e[1], e[2])):
            m = self.mappings[ext]
            vni, proto, a, p, remote = m["key"]
            r = f" remote {ep(*remote)}" if remote else ""
            out.append(
                f"mapping {vni} {PROTO_NAME[proto]} {ep(a, p)}{r} -> {ep(ext[0], ext[1])} flows {m['flows']}"
            )
        for (a, pr), s in self.ports.items():
            out.append(f"free {a} {PROTO_NAME[pr]} {len(s.free)}")
        for k in keys:
            fk = self.resolve(k)
            d = self.flows[fk].deadline if fk is not None else "none"
            out.append(f"deadline {k} {d}")
        return out


# --------------------------------------------------------------------------------------
# FW model (crates/nfs/src/fw.rs module docs: ordered ACL, first match; Linux conntrack
# with nf_conntrack_tcp_loose = 0)
# --------------------------------------------------------------------------------------

FW_TIMEOUTS = {
    "tcp_syn_sent_s": 120,
    "tcp_established_s": 7440,
    "tcp_closing_s": 120,
    "udp_s": 180,
    "icmp_s": 30,
    "other_s": 600,
    "deny_s": 60,
    "invalid_s": 10,
}
CT_TIMEOUT = {
    "tcp-syn-sent": "tcp_syn_sent_s",
    "tcp-established": "tcp_established_s",
    "tcp-closing": "tcp_closing_s",
    "udp": "udp_s",
    "icmp": "icmp_s",
    "other": "other_s",
}


def port_range(p) -> Tuple[int, int]:
    if isinstance(p, int):
        return p, p
    lo, _, hi = p.partition("-")
    return int(lo), int(hi or lo)


def rule_matches(r: dict, k: K) -> bool:
    want = {"any": None, "tcp": TCP, "udp": UDP, "icmp": ICMP, "icmp6": ICMP6}[r.get("proto", "any")]
    if want is not None and want != k.proto:
        return False
    if ("sport" in r or "dport" in r) and k.proto not in (TCP, UDP):
        return False
    for f, v in (("sport", k.sport), ("dport", k.dport)):
        if f in r:
            lo, hi = port_range(r[f])
            if not lo <= v <= hi:
                return False
    for f, a in (("src", k.src), ("dst", k.dst)):
        if r.get(f) and not any(prefix_contains(p, a) for p in r[f]):
            return False
    return True


class FwModel:
    def __init__(self, cfg: dict):
        self.set_config(cfg)
        self.conns: Dict[K, dict] = {}  # original key -> {tenant, state, deadline}

    def set_config(self, cfg: dict) -> None:
        self.cfg = cfg
        self.t = dict(FW_TIMEOUTS, **cfg.get("timeouts", {}))

    def acl(self, tenant: int, k: K) -> str:
        for ta in self.cfg.get("tenants", []):
            if ta["tenant"] == tenant:
                for r in ta.get("rules", []):
                    if rule_matches(r, k):
                        return r["action"]
                return ta.get("default_action", "deny")
        return self.cfg.get("default_action", "deny")

    def find(self, k: K):
        if k in self.conns:
            return k, "orig", self.conns[k]
        r = k.reversed()
        if r in self.conns:
            return r, "reply", self.conns[r]
        return None

    def timeout_ms(self, state: str) -> int:
        return 1000 * self.t[CT_TIMEOUT[state]]

    def rule_timeout_ms(self, state: str) -> int:
        return self.timeout_ms("tcp-established" if state == "tcp-syn-sent" else state)

    def set(self, k: K, tenant: int, state: str, now: int) -> int:
        self.conns[k] = {"tenant": tenant, "state": state, "deadline": now + self.timeout_ms(state)}
        return self.rule_timeout_ms(state)

    @staticmethod
    def pure_syn(flags: int) -> bool:
        return flags & (SYN | ACK | FIN | RST) == SYN

    @staticmethod
    def tcp_next(cur: str, flags: int, direction: str) -> Optional[str]:
        if flags & (FIN | RST):
            return "tcp-closing"
        if FwModel.pure_syn(flags):
            if cur == "tcp-closing" and direction == "orig":
                return None  # a new connection on a closing 5-tuple, judged anew
            return cur
        return "tcp-closing" if cur == "tcp-closing" else "tcp-established"

    def first_packet(self, k: K, flags: int, tenant: int, icmp_error: bool, now: int, seed: int) -> str:
        found = self.find(k)
        if found and found[2]["tenant"] == tenant:
            orig, direction, c = found
            if icmp_error:
                return passed(idle_ms=self.rule_timeout_ms(c["state"]))  # RELATED
            nxt = self.tcp_next(c["state"], flags, direction) if k.proto == TCP else c["state"]
            if nxt is not None:
                return passed(idle_ms=self.set(orig, c["tenant"], nxt, now))
            del self.conns[orig]
        if icmp_error:
            return dropped("icmp-unrelated", 1000 * self.t["invalid_s"])
        if k.proto == TCP and not self.pure_syn(flags):
            return dropped("tcp-not-syn", 1000 * self.t["invalid_s"])
        if self.acl(tenant, k) == "deny":
            return dropped("acl-deny", 1000 * self.t["deny_s"])
        state = {TCP: "tcp-syn-sent", UDP: "udp", ICMP: "icmp", ICMP6: "icmp"}.get(k.proto, "other")
        return passed(idle_ms=self.set(k, tenant, state, now))

    def on_event(self, kind: str, k: K, now: int) -> None:
        found = self.find(k)
        if not found:
            return
        orig, _, c = found
        if kind == "closing" and k.proto == TCP:
            self.set(orig, c["tenant"], "tcp-closing", now)
        elif kind == "established" and k.proto == TCP and c["state"] == "tcp-syn-sent":
            self.set(orig, c["tenant"], "tcp-established", now)
        elif kind == "active":
            self.set(orig, c["tenant"], c["state"], now)

    def on_timer(self, now: int) -> List[K]:
        gone = sorted((k for k, c in self.conns.items() if c["deadline"] <= now), key=K.canonical)
        for k in gone:
            del self.conns[k]
        return gone

    def update(self, cfg: dict, now: int) -> List[K]:
        self.set_config(cfg)  # tracked connections stay (as in Linux)
        return []

    def state_lines(self, keys: List[K]) -> List[str]:
        out = [f"conns {len(self.conns)}"]
        for k in keys:
            found = self.find(k)
            if found:
                out.append(f"conn {k} {found[2]['state']} deadline {found[2]['deadline']}")
            else:
                out.append(f"conn {k} none")
        return out


# --------------------------------------------------------------------------------------
# LB model (crates/nfs/src/lb.rs module docs; Maglev, NSDI 2016 §3.4 with katran's
# weight credits; IPVS timeouts)
# --------------------------------------------------------------------------------------

OFFSET_SALT = 0x6F66667365740001
SKIP_SALT = 0x736B697000000002
FLOW_SALT = 0x666C6F7700000003
NO_BACKEND_HOLD_MS = 10_000


def identity_hash(addr: str, port: int, seed: int, salt: int) -> int:
    ip = ipaddress.ip_address(addr)
    octets = (b"\x00" * 10 + b"\xff\xff" + ip.packed) if ip.version == 4 else ip.packed
    h = mix(seed ^ salt)
    for w in (int.from_bytes(octets[:8], "big"), int.from_bytes(octets[8:], "big"), port):
        h = mix(((h + 0x9E3779B97F4A7C15) & M64) ^ w)
    return h


def maglev(backends: List[Tuple[str, int, int]], m: int, seed: int) -> List[Tuple[str, int]]:
    """Slot owners of a table of `m` slots for (addr, port, weight) backends."""
    live = sorted(((a, p, w) for a, p, w in backends if w > 0), key=lambda b: (addr_sort(b[0]), b[1]))
    if not live:
        return []
    perms = []
    for a, p, _ in live:
        off = identity_hash(a, p, seed, OFFSET_SALT) % m
        skip = identity_hash(a, p, seed, SKIP_SALT) % (m - 1) + 1
        perms.append([off, skip])
    slots: List[Optional[int]] = [None] * m
    credit = [0] * len(live)
    top = max(w for _, _, w in live)
    filled = 0
    while True:
        for i, (_, _, w) in enumerate(live):
            credit[i] += w
            if credit[i] < top:
                continue
            credit[i] -= top
            while slots[perms[i][0]] is not None:
                perms[i][0] = (perms[i][0] + perms[i][1]) % m
            slots[perms[i][0]] = i
            perms[i][0] = (perms[i][0] + perms[i][1]) % m
            filled += 1
            if filled == m:
                return [(live[s][0], live[s][1]) for s in slots]


class LbModel:
    def __init__(self, cfg: dict):
        self.flows: Dict[K, dict] = {}  # forward key -> {backend, deadline, closing}
        self.set_config(cfg)

    def set_config(self, cfg: dict) -> None:
        self.cfg = cfg
        self.t = dict({"tcp_s": 900, "tcp_fin_s": 120, "udp_s": 300}, **cfg.get("timeouts", {}))
        self.services = {}
        for s in cfg.get("services", []):
            proto = {"tcp": TCP, "udp": UDP}[s["protocol"]]
            states = {(b["addr"], b["port"]): b.get("state", "active") for b in s.get("backends", [])}
            weighted = [
                (b["addr"], b["port"], b.get("weight", 1) if b.get("state", "active") == "active" else 0)
                for b in s.get("backends", [])
            ]
            table = maglev(weighted, cfg.get("table_size", 65537), cfg.get("seed", 0))
            self.services[(s["vip"], s["port"], proto)] = {"s": s, "states": states, "table": table}

    def service_of(self, k: K):
        return self.services.get((k.dst, k.dport, k.proto))

    def timeout_ms(self, k: K, closing: bool) -> int:
        if k.proto == TCP:
            return 1000 * (self.t["tcp_fin_s"] if closing else self.t["tcp_s"])
        return 1000 * self.t["udp_s"]

    @staticmethod
    def reply_key(k: K, backend) -> K:
        return Rw(dst=backend).apply(k).reversed()

    def replies(self) -> Dict[K, K]:
        """Reply key -> forward key; on a clash the smaller forward key (canonical bytes)."""
        out: Dict[K, K] = {}
        for k in sorted(self.flows, key=K.canonical, reverse=True):
            out[self.reply_key(k, self.flows[k]["backend"])] = k
        return out

    def first_packet(self, k: K, flags: int, tenant: int, icmp_error: bool, now: int, seed: int) -> str:
        svc = self.service_of(k)
        if k in self.flows and svc:
            f = self.flows[k]  # a known flow keeps its backend, whatever the table says
            t = self.timeout_ms(k, f["closing"])
            f["deadline"] = now + t
            return passed(Rw(dst=f["backend"]), Rw(src=(svc["s"]["vip"], svc["s"]["port"])), t)
        fwd = self.replies().get(k)
        if fwd is not None and self.service_of(fwd):
            f, s = self.flows[fwd], self.service_of(fwd)["s"]
            t = self.timeout_ms(fwd, f["closing"])
            f["deadline"] = now + t
            return passed(Rw(src=(s["vip"], s["port"])), Rw(dst=f["backend"]), t)
        if svc is None:
            return dropped("lb-not-vip") if self.cfg.get("non_vip") == "drop" else passed()
        if icmp_error:
            return dropped("lb-icmp-unrelated", NO_BACKEND_HOLD_MS)
        table = svc["table"]
        if not table:
            return dropped("lb-no-backend", NO_BACKEND_HOLD_MS)
        h = mix(k.hash() ^ mix(self.cfg.get("seed", 0) ^ FLOW_SALT))
        backend = table[h % len(table)]
        t = self.timeout_ms(k, False)
        self.flows[k] = {"backend": backend, "deadline": now + t, "closing": False}
        return passed(Rw(dst=backend), Rw(src=(svc["s"]["vip"], svc["s"]["port"])), t)

    def forward_of(self, k: K) -> Optional[K]:
        return k if k in self.flows else self.replies().get(k)

    def on_event(self, kind: str, k: K, now: int) -> None:
        fwd = self.forward_of(k)
        if fwd is None:
            return
        f = self.flows[fwd]
        if kind == "closing":
            f["closing"] = True
            f["deadline"] = now + self.timeout_ms(fwd, True)
        elif kind == "active":
            f["deadline"] = now + self.timeout_ms(fwd, f["closing"])

    def remove_where(self, doomed) -> List[K]:
        gone = sorted((k for k, f in self.flows.items() if doomed(k, f)), key=K.canonical)
        for k in gone:
            del self.flows[k]
        return gone

    def on_timer(self, now: int) -> List[K]:
        return self.remove_where(lambda k, f: f["deadline"] <= now)

    def update(self, cfg: dict, now: int) -> List[K]:
        self.set_config(cfg)

        def doomed(k: K, f: dict) -> bool:
            svc = self.service_of(k)
            return svc is None or svc["states"].get(f["backend"], "down") == "down"

        return self.remove_where(doomed)

    def state_lines(self, keys: List[K]) -> List[str]:
        out = [f"flows {len(self.flows)}"]
        for s in self.cfg.get("services", []):
            svc = self.services[(s["vip"], s["port"], {"tcp": TCP, "udp": UDP}[s["protocol"]])]
            counts: Dict[Tuple[str, int], int] = {}
            for b in svc["table"]:
                counts[b] = counts.get(b, 0) + 1
            order = sorted(counts, key=lambda b: (addr_sort(b[0]), b[1]))
            body = " ".join(f"{ep(*b)}={counts[b]}" for b in order) or "empty"
            out.append(f"table {ep(s['vip'], s['port'])}/{s['protocol']} {body}")
        for k in keys:
            f = self.flows.get(k)
            out.append(f"backend {k} {ep(*f['backend']) if f else 'none'}")
        return out


# --------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------

MODELS = {"snat": SnatModel, "fw": FwModel, "lb": LbModel}


class Case:
    def __init__(self, name: str, doc: str, cfg: dict):
        self.kind = cfg["kind"]
        self.name = f"{self.kind}/{name}"
        body = {k: v for k, v in cfg.items() if k != "kind"}
        self.model = MODELS[self.kind](body)
        self.lines = [f"case {self.name}", f"doc {doc}", "config " + json.dumps(cfg, separators=(",", ":"))]
        self.keys: List[K] = []
        self.steps = 0

    def pkt(self, k: K, flags: str = "S", t: int = 0, tenant: int = 1, icmp_error: bool = False) -> "Case":
        self.steps += 1
        seed = self.steps * 7919
        d = self.model.first_packet(k, flags_of(flags), tenant, icmp_error, t, seed)
        err = " icmp-error" if icmp_error else ""
        self.lines.append(f"pkt t={t} seed={seed} tenant={tenant} flags={flags}{err} {k} => {d}")
        if k not in self.keys:
            self.keys.append(k)
        return self

    def event(self, kind: str, k: K, t: int) -> "Case":
        self.model.on_event(kind, k, t)
        self.lines.append(f"event t={t} {kind} {k}")
        return self

    def timer(self, t: int) -> "Case":
        gone = self.model.on_timer(t)
        self.lines.append(f"timer t={t} => {' ; '.join(map(str, gone)) or '-'}")
        return self

    def update(self, cfg: dict, t: int = 0) -> "Case":
        gone = self.model.update({k: v for k, v in cfg.items() if k != "kind"}, t)
        text = json.dumps(cfg, separators=(",", ":"))
        self.lines.append(f"update t={t} {text} => {' ; '.join(map(str, gone)) or '-'}")
        return self

    def text(self) -> List[str]:
        return self.lines + ["state " + s for s in self.model.state_lines(self.keys)]


CASES: List[Case] = []


def case(name: str, doc: str, cfg: dict) -> Case:
    c = Case(name, doc, cfg)
    CASES.append(c)
    return c


# Address plan: RFC 2544 198.18.0.0/15 and RFC 5180 2001:2::/48, as gen.py.
IN1, IN2, IN3 = "198.18.1.10", "198.18.1.11", "198.18.2.20"
OUT1, OUT2 = "198.18.200.1", "198.18.200.2"
NAT1, NAT2 = "198.19.0.1", "198.19.0.2"
IN6, OUT6, NAT6 = "2001:2:0:10::2", "2001:2:0:20::5", "2001:2:0:ff::1"


def u(vni, src, dst) -> K:
    return key(vni, UDP, src, dst)


def tcp(vni, src, dst) -> K:
    return key(vni, TCP, src, dst)


def snat_cfg(addrs=(NAT1,), lo=1024, hi=1031, mapping=None, sources=None, timeouts=None) -> dict:
    pool = {"addresses": list(addrs), "ports": {"lo": lo, "hi": hi}}
    if mapping:
        pool["mapping"] = mapping
    if sources:
        pool["sources"] = sources
    cfg = {"kind": "snat", "pools": [pool]}
    if timeouts:
        cfg["timeouts"] = timeouts
    return cfg


def snat_cases() -> None:
    c = snat_cfg()
    case("udp-port-preserved", "RFC 4787 §4.2.1: a free source port in range is kept", c).pkt(
        u(7, f"{IN1}:1025", f"{OUT1}:53"), "-"
    )
    case("udp-port-out-of-range-random", "a source port outside the range gets a random one", c).pkt(
        u(7, f"{IN1}:40000", f"{OUT1}:53"), "-"
    )
    case("eim-reuse", "RFC 4787 REQ-1: one mapping for every remote of an endpoint", c).pkt(
        u(7, f"{IN1}:1025", f"{OUT1}:53"), "-"
    ).pkt(u(7, f"{IN1}:1025", f"{OUT2}:123"), "-", t=1000)
    case(
        "edm-new-mapping-per-remote",
        "endpoint-dependent mapping: another remote, another mapping",
        snat_cfg(mapping="endpoint_dependent"),
    ).pkt(u(7, f"{IN1}:1025", f"{OUT1}:53"), "-").pkt(u(7, f"{IN1}:1025", f"{OUT2}:53"), "-")
    case("port-taken-random", "no port overloading (REQ-3): a taken port makes the next random", c).pkt(
        u(7, f"{IN1}:1026", f"{OUT1}:53"), "-"
    ).pkt(u(7, f"{IN2}:1026", f"{OUT1}:53"), "-")
    s = case("protocols-have-own-ports", "TCP, UDP and ICMP ports are separate pools: each keeps 1025", c)
    for k in (u(7, f"{IN1}:1025", f"{OUT1}:53"), tcp(7, f"{IN1}:1025", f"{OUT1}:80"), key(7, ICMP, f"{IN1}:1025", f"{OUT1}:0")):
        s.pkt(k, "S" if k.proto == TCP else "-")
    case("vni-separates-tenants", "the same inside endpoint in two VPCs gets two mappings", c).pkt(
        u(7, f"{IN1}:1027", f"{OUT1}:53"), "-"
    ).pkt(u(8, f"{IN1}:1027", f"{OUT1}:53"), "-")
    c2 = snat_cfg(addrs=(NAT1, NAT2), lo=2000, hi=2003)
    case("pairing-first-address-most-free", "a new host gets the address with most free ports", c2).pkt(
        u(7, f"{IN1}:2000", f"{OUT1}:53"), "-"
    ).pkt(u(7, f"{IN2}:2000", f"{OUT1}:53"), "-")
    s = case("pairing-holds", "RFC 4787 REQ-2: a host's mappings stay on its paired address", c2)
    s.pkt(u(7, f"{IN1}:2000", f"{OUT1}:53"), "-").pkt(u(7, f"{IN2}:2001", f"{OUT1}:53"), "-")
    s.pkt(u(7, f"{IN2}:2002", f"{OUT1}:53"), "-").pkt(u(7, f"{IN1}:2003", f"{OUT1}:53"), "-")
    s = case("pairing-falls-back-when-full", "the paired address out of ports: the other one", c2)
    for p in range(2000, 2005):
        s.pkt(u(7, f"{IN1}:{p}", f"{OUT1}:53"), "-", t=p)
    s = case("exhaustion-drops", "no free port: snat-exhausted", snat_cfg(lo=3000, hi=3001))
    for p in (3000, 3001, 3002):
        s.pkt(u(7, f"{IN1}:{p}", f"{OUT1}:53"), "-")
    s.pkt(tcp(7, f"{IN1}:3003", f"{OUT1}:80"), "S")
    s = case("exhaustion-recovers-after-expiry", "an expired flow's port serves the next", snat_cfg(lo=3000, hi=3001))
    s.pkt(u(7, f"{IN1}:3000", f"{OUT1}:53"), "-").pkt(u(7, f"{IN2}:3000", f"{OUT1}:53"), "-", t=100_000)
    s.pkt(u(7, f"{IN3}:3000", f"{OUT1}:53"), "-", t=200_000).timer(300_000)
    s.pkt(u(7, f"{IN3}:3000", f"{OUT1}:53"), "-", t=300_001)
    s = case("exhaustion-by-random-probing", "out-of-range sources fill a small range by probes and scan", snat_cfg(lo=4000, hi=4005))
    for i in range(7):
        s.pkt(u(7, f"{IN1}:{50000 + i}", f"{OUT1}:53"), "-", t=i)
    s = case("random-ports-many-hosts", "seeded random ports for many hosts (rng replayed)", snat_cfg(lo=5000, hi=5063))
    for i in range(12):
        s.pkt(u(7, f"198.18.3.{i + 1}:{40000 + i}", f"{OUT1}:443"), "-", t=i)
    s = case("tcp-syn-transitory", "RFC 5382 REQ-5: a SYN-opened flow is transitory; PP's rule gets 7440 s", c)
    s.pkt(tcp(7, f"{IN1}:1024", f"{OUT1}:80"), "S")
    s = case("tcp-established-by-event", "TcpEstablished: the established timeout from then", c)
    s.pkt(tcp(7, f"{IN1}:1024", f"{OUT1}:80"), "S").event("established", tcp(7, f"{IN1}:1024", f"{OUT1}:80"), 5000)
    s = case("tcp-established-by-rerequest", "a re-request with ACK and no SYN shows the handshake done", c)
    s.pkt(tcp(7, f"{IN1}:1024", f"{OUT1}:80"), "S").pkt(tcp(7, f"{IN1}:1024", f"{OUT1}:80"), "A", t=2000)
    s = case("tcp-closing-transitory", "RFC 7857 §2.2: FIN/RST moves the flow back to transitory", c)
    k = tcp(7, f"{IN1}:1024", f"{OUT1}:80")
    s.pkt(k, "S").event("established", k, 1000).event("closing", k, 9000)
    s = case("tcp-syn-reopens-closing", "a SYN on a closing flow reopens it as transitory", c)
    s.pkt(k, "S").event("closing", k, 1000).pkt(k, "S", t=2000)
    s = case("tcp-established-not-after-close", "a late TcpEstablished does not revive a closing flow", c)
    s.pkt(k, "S").event("closing", k, 1000).event("established", k, 2000)
    s = case("tcp-midstream-ack-established", "a mid-stream ACK (state lost elsewhere) starts established", c)
    s.pkt(tcp(7, f"{IN1}:1024", f"{OUT1}:80"), "PA")
    for fl in ("R", "FA", "SA"):
        case(f"tcp-invalid-first-{fl}", f"a first packet with {fl} opens nothing", c).pkt(
            tcp(7, f"{IN1}:1024", f"{OUT1}:80"), fl
        )
    s = case("icmp-echo-identifier", "RFC 5508 REQ-1/2: the echo identifier is translated; 60 s", c)
    s.pkt(key(7, ICMP, f"{IN1}:1029", f"{OUT1}:0"), "-")
    case("icmp-echo-reply-from-inside", "an echo reply with no flow is not a request", c).pkt(
        key(7, ICMP, f"{IN1}:0", f"{OUT1}:1029"), "-"
    )
    case("icmp-error-unknown-flow", "RFC 5508 REQ-4: errors never create state", c).pkt(
        u(0, f"{OUT1}:53", f"{NAT1}:1025"), "-", icmp_error=True
    )
    s = case("icmp-error-known-flow", "an error about a known flow is translated and refreshes nothing", c)
    s.pkt(u(7, f"{IN1}:1025", f"{OUT1}:53"), "-").pkt(u(0, f"{OUT1}:53", f"{NAT1}:1025"), "-", t=50_000, icmp_error=True)
    case("inbound-unsolicited-no-mapping", "inbound to a pool address with nothing mapped", c).pkt(
        u(0, f"{OUT1}:53", f"{NAT1}:1025"), "-"
    )
    s = case("inbound-filtered", "RFC 4787 §5: address-and-port-dependent filtering", c)
    s.pkt(u(7, f"{IN1}:1025", f"{OUT1}:53"), "-").pkt(u(0, f"{OUT2}:53", f"{NAT1}:1025"), "-")
    s = case("reply-direction-replay", "a re-request of the reply direction gets the mirror translation", c)
    s.pkt(u(7, f"{IN1}:1025", f"{OUT1}:53"), "-").pkt(u(0, f"{OUT1}:53", f"{NAT1}:1025"), "-", t=10_000)
    s = case("forward-replay-refreshes", "asked again: the same answer and a fresh deadline", c)
    s.pkt(u(7, f"{IN1}:1025", f"{OUT1}:53"), "-").pkt(u(7, f"{IN1}:1025", f"{OUT1}:53"), "-", t=100_000)
    case("untranslated-source-outside-pools", "a source no pool serves passes untouched", snat_cfg(sources=["198.18.1.0/24"])).pkt(
        u(7, f"{IN3}:1025", f"{OUT1}:53"), "-"
    )
    case("untranslated-v6-with-v4-pool", "a v6 flow with only v4 pools passes", c).pkt(
        key(7, UDP, f"[{IN6}]:1025", f"[{OUT6}]:53"), "-"
    )
    case("unsupported-protocol", "no port to translate (GRE)", c).pkt(K(7, 47, IN1, 0, OUT1, 0), "-")
    hc = snat_cfg(sources=["198.18.0.0/16"])
    s = case("hairpin-udp", "RFC 4787 REQ-9: inside to inside through the mapping", hc)
    s.pkt(u(7, f"{IN1}:1025", f"{OUT1}:53"), "-").pkt(u(7, f"{IN2}:1026", f"{NAT1}:1025"), "-", t=1000)
    s = case("hairpin-tcp", "RFC 5382 REQ-8: TCP hairpinning", hc)
    s.pkt(tcp(7, f"{IN1}:1025", f"{OUT1}:80"), "S").pkt(tcp(7, f"{IN2}:1027", f"{NAT1}:1025"), "S", t=1000)
    case("hairpin-unmapped", "inside to a pool port nobody holds", hc).pkt(u(7, f"{IN2}:1026", f"{NAT1}:1030"), "-")
    s = case("hairpin-reply-replay", "the hairpinned peer's re-request of the reply direction", hc)
    s.pkt(u(7, f"{IN1}:1025", f"{OUT1}:53"), "-").pkt(u(7, f"{IN2}:1026", f"{NAT1}:1025"), "-", t=1000)
    s.pkt(u(7, f"{IN1}:1025", f"{NAT1}:1026"), "-", t=2000)
    s = case("closing-event-ignored-for-udp", "TcpClosing changes nothing for a UDP flow", c)
    s.pkt(u(7, f"{IN1}:1025", f"{OUT1}:53"), "-").event("closing", u(7, f"{IN1}:1025", f"{OUT1}:53"), 100_000)
    case("inbound-without-sources-is-outside", "without sources, a pool-address destination is refused", c).pkt(
        u(7, f"{IN2}:1026", f"{NAT1}:1030"), "-"
    )
    s = case("udp-timer-expiry-frees-port", "RFC 4787 REQ-5: 300 s idle, then the port is free", c)
    s.pkt(u(7, f"{IN1}:1025", f"{OUT1}:53"), "-").timer(299_999).timer(300_000)
    s = case("active-refreshes", "RFC 4787 REQ-6: activity keeps the mapping alive", c)
    k = u(7, f"{IN1}:1025", f"{OUT1}:53")
    s.pkt(k, "-").event("active", k, 200_000).timer(300_000).timer(500_000)
    s = case("mapping-lives-while-any-flow", "EIM: the mapping stays until its last flow ends", c)
    s.pkt(u(7, f"{IN1}:1025", f"{OUT1}:53"), "-").pkt(u(7, f"{IN1}:1025", f"{OUT2}:53"), "-", t=100_000)
    s.timer(300_000).timer(400_000)
    s = case("expired-event-removes", "PP's Expired removes the flow at once", c)
    s.pkt(k, "-").event("expired", k, 1000).pkt(u(7, f"{IN2}:1025", f"{OUT1}:53"), "-", t=2000)
    s = case("v6-pool", "a v6 pool translates v6 sources", snat_cfg(addrs=(NAT6,), lo=1024, hi=1031))
    s.pkt(key(7, UDP, f"[{IN6}]:1030", f"[{OUT6}]:53"), "-").pkt(key(7, ICMP6, f"[{IN6}]:77", f"[{OUT6}]:0"), "-")
    s = case("custom-timeouts", "configured timeouts apply", snat_cfg(timeouts={"udp_s": 120, "tcp_transitory_s": 300, "tcp_established_s": 8000, "icmp_s": 90}))
    s.pkt(u(7, f"{IN1}:1025", f"{OUT1}:53"), "-").pkt(tcp(7, f"{IN1}:1026", f"{OUT1}:80"), "S")
    s.pkt(key(7, ICMP, f"{IN1}:9", f"{OUT1}:0"), "-").timer(120_000)


ACL_CFG = {
    "kind": "fw",
    "tenants": [
        {
            "tenant": 1,
            "rules": [
                {"name": "no-telnet", "action": "deny", "proto": "tcp", "dport": 23},
                {"action": "allow", "proto": "tcp", "dport": "1-1023", "dst": ["198.18.200.0/24"]},
                {"action": "deny", "src": ["198.18.2.0/24"]},
                {"action": "allow", "proto": "udp", "sport": "1024-65535", "dport": 53},
                {"action": "allow", "proto": "icmp"},
                {"action": "allow", "proto": "icmp6"},
                {"action": "allow", "dst": ["2001:2:0:20::/64"]},
            ],
            "default_action": "deny",
        },
        {"tenant": 2, "rules": [{"action": "deny", "proto": "udp"}], "default_action": "allow"},
    ],
    "default_action": "deny",
}


def fw_cases() -> None:
    c = ACL_CFG
    k80 = tcp(7, f"{IN1}:40000", f"{OUT1}:80")
    case("acl-first-match-allow", "an ordered ACL: the first matching rule decides", c).pkt(k80, "S")
    case("acl-first-match-deny", "telnet is denied before the broader allow", c).pkt(tcp(7, f"{IN1}:40000", f"{OUT1}:23"), "S")
    case("acl-port-range-outside", "a port above the range falls through to the default", c).pkt(
        tcp(7, f"{IN1}:40000", f"{OUT1}:8080"), "S"
    )
    case("acl-dst-prefix-miss", "a destination outside the prefix falls through", c).pkt(tcp(7, f"{IN1}:40000", "198.18.201.1:80"), "S")
    case("acl-src-deny", "a denied source prefix", c).pkt(u(7, f"{IN3}:5000", f"{OUT1}:53"), "-")
    case("acl-sport-range", "udp dns from an unprivileged port is allowed", c).pkt(u(7, f"{IN1}:5000", f"{OUT1}:53"), "-")
    case("acl-sport-range-miss", "udp dns from a privileged port is not", c).pkt(u(7, f"{IN1}:53", f"{OUT1}:53"), "-")
    case("acl-icmp-allowed", "icmp echo allowed; 30 s", c).pkt(key(7, ICMP, f"{IN1}:7", f"{OUT1}:0"), "-")
    case("acl-icmp6-allowed", "icmp6 allowed", c).pkt(key(7, ICMP6, f"[{IN6}]:7", f"[{OUT6}]:0"), "-")
    case("acl-v6-prefix", "a v6 destination prefix, any protocol", c).pkt(key(7, UDP, f"[{IN6}]:5000", f"[{OUT6}]:9999"), "-")
    case("acl-other-protocol", "GRE to an allowed v6 prefix tracks as other (600 s)", c).pkt(K(7, 47, IN6, 0, OUT6, 0), "-")
    case("acl-ports-skip-non-tcp-udp", "a port rule never matches GRE; the default denies", c).pkt(K(7, 47, IN1, 0, OUT1, 0), "-")
    case("tenant-default-allow", "tenant 2's own default allows", c).pkt(tcp(9, f"{IN1}:40000", f"{OUT1}:8080"), "S", tenant=2)
    case("tenant-rule-deny", "tenant 2 denies udp", c).pkt(u(9, f"{IN1}:5000", f"{OUT1}:53"), "-", tenant=2)
    case("tenant-without-acl", "a tenant without an ACL gets the firewall-wide default", c).pkt(k80, "S", tenant=3)
    case("tcp-not-syn", "conntrack loose=0: an ACK opens nothing, before the ACL", c).pkt(k80, "A")
    case("tcp-synack-not-syn", "a SYN-ACK first is not a pure SYN", c).pkt(k80, "SA")
    case("icmp-error-unrelated", "an ICMP error about an unknown flow", c).pkt(u(0, f"{OUT1}:53", f"{IN1}:5000"), "-", icmp_error=True)
    s = case("icmp-error-related", "an error about a known flow passes (RELATED), state untouched", c)
    s.pkt(u(7, f"{IN1}:5000", f"{OUT1}:53"), "-").pkt(u(7, f"{OUT1}:53", f"{IN1}:5000"), "-", t=9000, icmp_error=True)
    s = case("reply-admitted-despite-acl", "the reply direction of a tracked flow passes whatever the ACL", c)
    s.pkt(k80, "S").pkt(k80.reversed(), "SA", t=100)
    s = case("reply-udp-admitted", "a udp reply re-request passes and refreshes", c)
    s.pkt(u(7, f"{IN1}:5000", f"{OUT1}:53"), "-").pkt(u(7, f"{OUT1}:53", f"{IN1}:5000"), "-", t=60_000)
    case("reply-unknown-denied", "an inbound packet with no flow meets the ACL", c).pkt(u(7, f"{OUT1}:53", f"{IN1}:5000"), "-")
    s = case("established-by-event", "TcpEstablished: SYN_SENT becomes established", c)
    s.pkt(k80, "S").event("established", k80, 500)
    s = case("established-by-rerequest", "a re-request with ACK: the handshake got through", c)
    s.pkt(k80, "S").pkt(k80, "A", t=700)
    s = case("closing-by-event", "TcpClosing: 120 s (TIME_WAIT)", c)
    s.pkt(k80, "S").event("established", k80, 500).event("closing", k80, 1000)
    s = case("closing-by-fin-rerequest", "a re-request carrying FIN closes", c)
    s.pkt(k80, "S").pkt(k80, "FA", t=800)
    s = case("reply-syn-on-closing-stays-closing", "a SYN in the reply direction does not reopen a closing flow", c)
    s.pkt(k80, "S").event("closing", k80, 500).pkt(k80.reversed(), "S", t=600)
    s = case("closing-event-ignored-for-udp", "TcpClosing is TCP's only", c)
    s.pkt(u(7, f"{IN1}:5000", f"{OUT1}:53"), "-").event("closing", u(7, f"{IN1}:5000", f"{OUT1}:53"), 1000)
    s = case("established-after-close-stays-closing", "a late TcpEstablished leaves a closing flow", c)
    s.pkt(k80, "S").event("closing", k80, 500).event("established", k80, 600)
    s = case("syn-on-closing-rejudged", "a fresh SYN on a closing 5-tuple is judged anew by the ACL now", c)
    s.pkt(k80, "S").event("closing", k80, 500)
    deny80 = json.loads(json.dumps(c))
    deny80["tenants"][0]["rules"].insert(0, {"action": "deny", "proto": "tcp", "dport": 80})
    s.update(deny80, 600).pkt(k80, "S", t=700)
    s = case("update-keeps-tracked", "an ACL change keeps tracked connections (as Linux)", c)
    s.pkt(k80, "S").update(deny80, 100).pkt(k80, "A", t=200).pkt(tcp(7, f"{IN1}:40001", f"{OUT1}:80"), "S", t=300)
    s = case("timer-expiry-by-state", "each state's timeout: syn 120, udp 180, icmp 30, established 7440", c)
    s.pkt(k80, "S").pkt(u(7, f"{IN1}:5000", f"{OUT1}:53"), "-").pkt(key(7, ICMP, f"{IN1}:7", f"{OUT1}:0"), "-")
    k443 = tcp(7, f"{IN1}:40002", f"{OUT1}:443")
    s.pkt(k443, "S").event("established", k443, 0)
    s.timer(29_999).timer(30_000).timer(120_000).timer(180_000).timer(7_440_000)
    s = case("active-refreshes", "Active restarts the deadline in the current state", c)
    s.pkt(u(7, f"{IN1}:5000", f"{OUT1}:53"), "-").event("active", u(7, f"{IN1}:5000", f"{OUT1}:53"), 100_000).timer(180_000)
    s = case("active-by-reply-key", "an event on the reply key finds the flow", c)
    s.pkt(k80, "S").event("active", k80.reversed(), 50_000)
    s = case("expired-event-ignored", "PP forgetting a rule does not end the flow", c)
    s.pkt(k80, "S").event("expired", k80, 100)
    s = case("tenant-mismatch-not-admitted", "one tenant's entry never admits another's packets", c)
    s.pkt(u(7, f"{IN1}:5000", f"{OUT1}:53"), "-").pkt(u(7, f"{OUT1}:53", f"{IN1}:5000"), "-", t=10, tenant=2)
    s = case("custom-timeouts", "configured timeouts", dict(c, timeouts={"udp_s": 30, "deny_s": 5, "invalid_s": 2}))
    s.pkt(u(7, f"{IN1}:5000", f"{OUT1}:53"), "-").pkt(tcp(7, f"{IN1}:40000", f"{OUT1}:23"), "S").pkt(k80, "A")


def lb_cfg(services, table_size=251, seed=0, non_vip=None, timeouts=None) -> dict:
    cfg = {"kind": "lb", "services": services, "table_size": table_size, "seed": seed}
    if non_vip:
        cfg["non_vip"] = non_vip
    if timeouts:
        cfg["timeouts"] = timeouts
    return cfg


VIP, VIP6 = "198.19.0.80", "2001:2:0:ff::80"
BACKENDS = [f"198.18.5.{i}" for i in range(1, 7)]


def svc(vip=VIP, port=80, proto="tcp", backends=BACKENDS[:3], bport=8080, **per) -> dict:
    bs = []
    for b in backends:
        d = {"addr": b, "port": bport}
        d.update(per.get(b, {}))
        bs.append(d)
    return {"vip": vip, "port": port, "protocol": proto, "backends": bs}


def lb_cases() -> None:
    base = lb_cfg([svc()])
    for i in range(8):
        case(f"maglev-choice-{i}", "a new flow goes to the Maglev owner of its slot", base).pkt(
            tcp(7, f"198.18.{10 + i}.{i + 2}:{30000 + 7 * i}", f"{VIP}:80"), "S"
        )
    for seed in (1, 0xDEADBEEF):
        s = case(f"maglev-seeded-{seed:x}", "the seed moves permutations and flow slots", lb_cfg([svc()], seed=seed))
        for i in range(4):
            s.pkt(tcp(7, f"198.18.11.{i + 1}:41000", f"{VIP}:80"), "S")
    weighted = lb_cfg([svc(backends=BACKENDS[:3], **{BACKENDS[0]: {"weight": 3}, BACKENDS[2]: {"weight": 0}})], table_size=31)
    s = case("weighted-table", "weights share slots (katran credits); weight 0 takes none", weighted)
    for i in range(4):
        s.pkt(tcp(7, f"198.18.12.{i + 1}:42000", f"{VIP}:80"), "S")
    case("big-table-default-size", "the default table size (65537)", {"kind": "lb", "services": [svc(backends=BACKENDS[:2])]}).pkt(
        tcp(7, f"{IN1}:43000", f"{VIP}:80"), "S"
    )
    s = case("known-flow-keeps-backend", "asked again: the pinned backend and a fresh deadline", base)
    k = tcp(7, f"{IN1}:44000", f"{VIP}:80")
    s.pkt(k, "S").pkt(k, "A", t=60_000)
    s = case("backend-added-flow-stays", "a flow keeps its backend when the table changes", base)
    for i in range(4):
        s.pkt(tcp(7, f"198.18.13.{i + 1}:45000", f"{VIP}:80"), "S")
    more = lb_cfg([svc(backends=BACKENDS)])
    s.update(more, 1000)
    for i in range(4):
        s.pkt(tcp(7, f"198.18.13.{i + 1}:45000", f"{VIP}:80"), "A", t=2000)
    s.pkt(tcp(7, f"198.18.13.9:45000", f"{VIP}:80"), "S", t=2000)
    s = case("backend-down-flows-rebalanced", "a backend marked down loses its flows; they balance afresh", base)
    keys = [tcp(7, f"198.18.14.{i + 1}:46000", f"{VIP}:80") for i in range(6)]
    for kk in keys:
        s.pkt(kk, "S")
    s.update(lb_cfg([svc(**{BACKENDS[0]: {"state": "down"}})]), 1000)
    for kk in keys:
        s.pkt(kk, "S", t=2000)
    s = case("backend-removed", "a removed backend loses its flows", base)
    for kk in keys:
        s.pkt(kk, "S")
    s.update(lb_cfg([svc(backends=BACKENDS[1:3])]), 1000)
    for kk in keys[:3]:
        s.pkt(kk, "S", t=2000)
    s = case("backend-draining", "draining keeps its flows and takes no new ones", base)
    for kk in keys:
        s.pkt(kk, "S")
    s.update(lb_cfg([svc(**{BACKENDS[1]: {"state": "draining"}})]), 1000)
    for kk in keys:
        s.pkt(kk, "A", t=2000)
    for i in range(4):
        s.pkt(tcp(7, f"198.18.15.{i + 1}:47000", f"{VIP}:80"), "S", t=3000)
    s = case("service-removed", "a removed service forgets its flows", base)
    s.pkt(k, "S").update(lb_cfg([]), 1000).pkt(k, "S", t=2000)
    case("no-active-backend", "every backend down: lb-no-backend, held 10 s", lb_cfg([svc(**{b: {"state": "down"} for b in BACKENDS[:3]})])).pkt(
        k, "S"
    )
    case("service-without-backends", "an empty service: lb-no-backend", lb_cfg([svc(backends=[])])).pkt(k, "S")
    case("non-vip-pass", "a destination that is not a VIP passes by default", base).pkt(tcp(7, f"{IN1}:44000", f"{OUT1}:80"), "S")
    case("non-vip-drop", "non_vip drop: lb-not-vip", lb_cfg([svc()], non_vip="drop")).pkt(tcp(7, f"{IN1}:44000", f"{OUT1}:80"), "S")
    case("proto-mismatch-not-vip", "udp to a tcp service's VIP:port is not the service", base).pkt(u(7, f"{IN1}:44000", f"{VIP}:80"), "-")
    case("port-mismatch-not-vip", "another port of the VIP is not the service", base).pkt(tcp(7, f"{IN1}:44000", f"{VIP}:81"), "S")
    case("icmp-error-unrelated", "an ICMP error for an unbalanced flow: held 10 s", base).pkt(k, "-", icmp_error=True)
    s = case("reply-direction-rerequest", "the reply direction of a known flow: the mirror image", base)
    s.pkt(k, "S")
    # The reply comes from the backend the model chose.
    b = s.model.flows[k]["backend"]
    s.pkt(K(7, TCP, b[0], b[1], IN1, 44000), "SA", t=500)
    s = case("closing-fin-timeout", "after FIN/RST the flow has 120 s", base)
    s.pkt(k, "S").event("closing", k, 1000).timer(120_999).timer(121_000)
    s = case("active-refreshes", "Active restarts the deadline", base)
    s.pkt(k, "S").event("active", k, 800_000).timer(900_000).timer(1_700_000)
    s = case("established-and-expired-ignored", "the LB times TCP alike before and after the handshake", base)
    s.pkt(k, "S").event("established", k, 100).event("expired", k, 200).timer(899_999).timer(900_000)
    udp_svc = lb_cfg([svc(port=53, proto="udp", backends=BACKENDS[3:6], bport=53)])
    s = case("udp-service", "a udp service, 300 s", udp_svc)
    s.pkt(u(7, f"{IN1}:5353", f"{VIP}:53"), "-").timer(300_000)
    v6 = lb_cfg([svc(vip=VIP6, port=443, backends=["2001:2:0:5::1", "2001:2:0:5::2"], bport=8443)])
    s = case("v6-service", "a v6 VIP and backends", v6)
    for i in range(3):
        s.pkt(key(7, TCP, f"[2001:2:0:10::{i + 2}]:50000", f"[{VIP6}]:443"), "S")
    two = lb_cfg([svc(), svc(port=443, backends=BACKENDS[2:5], bport=8443)])
    s = case("two-services", "each service balances over its own table", two)
    s.pkt(tcp(7, f"{IN1}:48000", f"{VIP}:80"), "S").pkt(tcp(7, f"{IN1}:48000", f"{VIP}:443"), "S")
    s = case("closing-by-reply-key", "an event on the reply key finds the flow", base)
    s.pkt(k, "S")
    b = s.model.flows[k]["backend"]
    s.event("closing", K(7, TCP, b[0], b[1], IN1, 44000), 1000).timer(121_000)
    shared = lb_cfg([svc(backends=BACKENDS[:1]), svc(port=443, backends=BACKENDS[:1])])
    s = case("shared-backend-reply-key", "two VIPs sharing a backend, one client port: the smaller forward key owns the reply key", shared)
    s.pkt(tcp(7, f"{IN1}:49000", f"{VIP}:443"), "S").pkt(tcp(7, f"{IN1}:49000", f"{VIP}:80"), "S")
    s.pkt(tcp(7, f"{BACKENDS[0]}:8080", f"{IN1}:49000"), "SA", t=100)
    for gone, stays in ((80, 443), (443, 80)):
        s = case(f"shared-reply-key-survivor-{stays}", f"the flow to VIP:{gone} goes; the reply key is VIP:{stays}'s now", shared)
        s.pkt(tcp(7, f"{IN1}:49000", f"{VIP}:443"), "S").pkt(tcp(7, f"{IN1}:49000", f"{VIP}:80"), "S")
        s.event("closing", tcp(7, f"{IN1}:49000", f"{VIP}:{gone}"), 1000).timer(121_000)
        s.pkt(tcp(7, f"{BACKENDS[0]}:8080", f"{IN1}:49000"), "SA", t=122_000)
    s = case("custom-timeouts", "configured timeouts", lb_cfg([svc()], timeouts={"tcp_s": 60, "tcp_fin_s": 5, "udp_s": 30}))
    s.pkt(k, "S").event("closing", k, 1000).timer(6000)


def build() -> List[Case]:
    CASES.clear()
    snat_cases()
    fw_cases()
    lb_cases()
    return CASES


HEADER = """# Golden NF decisions: (flow, state before) -> (rule, state after) for SNAT, FW, LB.
# Generated by tests/golden/nf_gen.py (make golden); do not edit. Format: docs/golden-corpus.md,
# "NF decisions". Checked by crates/nfs/tests/nf_golden.rs."""


def main(argv: List[str]) -> int:
    if argv[1:]:
        print(__doc__, file=sys.stderr)
        return 2
    # The key layout here is gen.py's (docs/golden-corpus.md), so flow_hash means the same.
    probe = K(7, UDP, IN1, 1025, OUT1, 53)
    assert probe.canonical() == GenKey(7, "udp", GenEp(IN1, 1025), GenEp(OUT1, 53)).canonical()
    cases = build()
    names = set()
    for c in cases:
        assert c.name not in names, c.name
        names.add(c.name)
    return write_corpus([HEADER], (c.text() for c in cases))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
