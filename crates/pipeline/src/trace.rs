//! Packet tracing (`starfabric trace`, like `vppctl trace` and Hubble): per matching
//! packet, the stages it passed in this worker's pipeline.
//!
//! Off, it costs the hot loop one predictable branch per chunk of packets: the pipeline
//! holds an `Option<Box<Tracer>>` and checks it once per chunk. Nothing is allocated,
//! locked or called when it is `None`. Armed, every packet is tested against the
//! [`TraceFilter`] (tenant/VNI, then a small BPF-like expression on the flow key); only a
//! packet that matches, while the count lasts, costs a [`TraceRecord`] (its frames copied
//! up to the snap length). Records go to a bounded channel with `try_send`: when the
//! reader is slow, records are counted as lost, never waited for.
//!
//! For a miss the record says whether a rule request went out (or the flow was already
//! waiting for one), and the worker watches that flow: when FM's reply for it comes back
//! (matched by flow key, as the pending queue matches it) a [`TraceDecision`] record
//! carries what the reply holds: the rule's actions or FM's error, its companion rules,
//! and the time from the held packet to the reply. FM's replies name no SC group, so
//! neither does the trace.
//!
//! Packets the XDP fast path forwards never reach userspace and are not traced; a traced
//! hit that marks its flow for offload says so (`offload: flow handed to the XDP fast
//! path`).

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_channel::{Sender, TrySendError};
use thiserror::Error;

use crate::key::FlowKey;

/// Frames are copied up to this many bytes unless the tracer says otherwise.
pub const DEFAULT_SNAPLEN: usize = 256;
/// Misses whose FM decision is awaited at once; more misses are traced without it.
const MAX_WATCHED: usize = 256;

// ---------------------------------------------------------------------- the filter

/// A filter expression that did not parse: where, and what was wrong.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("bad match expression at column {col}: {msg}")]
pub struct FilterError {
    /// 1-based column of the offending token (one past the end for a missing one).
    pub col: usize,
    pub msg: String,
}

/// Which end of the flow a `host`/`port` primitive looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    Src,
    Dst,
    Either,
}

/// A parsed match expression over a packet's flow key (its inner 5-tuple).
///
/// The grammar is a small subset of tcpdump's (pcap-filter(7)):
/// `tcp`, `udp`, `icmp`, `icmp6`, `ip`, `ip6`, `proto N`, `[src|dst] host ADDR`,
/// `[src|dst] port N`, `and`/`&&`, `or`/`||`, `not`/`!`, parentheses; two primitives
/// side by side mean `and` (`tcp port 80`), as in tcpdump.
///
/// Written here rather than taken from a crate: the BPF filter crates compile to
/// classic-BPF bytecode over raw packet bytes (and most link libpcap), while a trace
/// matches a parsed flow key of VXLAN's *inner* packet, which BPF offsets at the outer
/// frame cannot express without a VXLAN-aware compiler. The grammar is small enough
/// that a recursive-descent parser with exact error positions is the simpler thing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expr {
    True,
    Proto(u8),
    /// IPv4 (`ip`, 4) or IPv6 (`ip6`, 6).
    Family(u8),
    Host(Dir, IpAddr),
    /// Matches TCP, UDP and SCTP ports only.
    Port(Dir, u16),
    Not(Box<Expr>),
    And(Box<Expr>, Box<Expr>),
    Or(Box<Expr>, Box<Expr>),
}

impl Expr {
    /// Parse a match expression; the empty string (or only blanks) matches everything.
    pub fn parse(s: &str) -> Result<Expr, FilterError> {
        let toks = tokenize(s)?;
        let mut p = Parser {
            toks,
            i: 0,
            end: s.chars().count() + 1,
        };
        if p.toks.is_empty() {
            return Ok(Expr::True);
        }
        let e = p.or()?;
        if let Some(t) = p.peek() {
            return Err(p.err_at(t, format!("unexpected `{}`", t.text)));
        }
        Ok(e)
    }

    /// Whether the flow key matches.
    pub fn matches(&self, k: &FlowKey) -> bool {
        match self {
            Expr::True => true,
            Expr::Proto(p) => k.proto() == *p,
            Expr::Family(4) => k.is_v4(),
            Expr::Family(_) => !k.is_v4(),
            Expr::Host(d, a) => match d {
                Dir::Src => k.src() == *a,
                Dir::Dst => k.dst() == *a,
                Dir::Either => k.src() == *a || k.dst() == *a,
            },
            Expr::Port(d, p) => {
                matches!(k.proto(), 6 | 17 | 132)
                    && match d {
                        Dir::Src => k.sport() == *p,
                        Dir::Dst => k.dport() == *p,
                        Dir::Either => k.sport() == *p || k.dport() == *p,
                    }
            }
            Expr::Not(e) => !e.matches(k),
            Expr::And(a, b) => a.matches(k) && b.matches(k),
            Expr::Or(a, b) => a.matches(k) || b.matches(k),
        }
    }

    /// Whether it is the match-everything expression (packets without a flow key, such
    /// as parse errors, are traced only then).
    pub fn is_true(&self) -> bool {
        *self == Expr::True
    }
}

#[derive(Debug, Clone)]
struct Tok {
    text: String,
    col: usize,
}

fn tokenize(s: &str) -> Result<Vec<Tok>, FilterError> {
    let cs: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < cs.len() {
        let c = cs[i];
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        let col = i + 1;
        match c {
            '(' | ')' => {
                out.push(Tok {
                    text: c.to_string(),
                    col,
                });
                i += 1;
            }
            '!' => {
                out.push(Tok {
                    text: "not".into(),
                    col,
                });
                i += 1;
            }
            '&' | '|' => {
                if cs.get(i + 1) != Some(&c) {
                    return Err(FilterError {
                        col,
                        msg: format!("`{c}` alone; did you mean `{c}{c}`?"),
                    });
                }
                out.push(Tok {
                    text: if c == '&' { "and" } else { "or" }.into(),
                    col,
                });
                i += 2;
            }
            c if c.is_ascii_alphanumeric() || matches!(c, '.' | ':' | '_' | '-') => {
                let start = i;
                while i < cs.len()
                    && (cs[i].is_ascii_alphanumeric() || matches!(cs[i], '.' | ':' | '_' | '-'))
                {
                    i += 1;
                }
                out.push(Tok {
                    text: cs[start..i].iter().collect::<String>().to_ascii_lowercase(),
                    col,
                });
            }
            c => {
                return Err(FilterError {
                    col,
                    msg: format!("unexpected character `{c}`"),
                })
            }
        }
    }
    Ok(out)
}

struct Parser {
    toks: Vec<Tok>,
    i: usize,
    end: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.i)
    }

    fn next(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.i).cloned();
        self.i += 1;
        t
    }

    fn err_at(&self, t: &Tok, msg: String) -> FilterError {
        FilterError { col: t.col, msg }
    }

    fn err_end(&self, msg: &str) -> FilterError {
        FilterError {
            col: self.end,
            msg: format!("{msg}, found the end of the expression"),
        }
    }

    fn or(&mut self) -> Result<Expr, FilterError> {
        let mut e = self.and()?;
        while self.peek().is_some_and(|t| t.text == "or") {
            self.i += 1;
            let r = self.and()?;
            e = Expr::Or(Box::new(e), Box::new(r));
        }
        Ok(e)
    }

    fn and(&mut self) -> Result<Expr, FilterError> {
        let mut e = self.unary()?;
        loop {
            match self.peek().map(|t| t.text.as_str()) {
                Some("and") => self.i += 1,
                // Juxtaposition is `and` (`tcp port 80`), as in tcpdump.
                Some(t) if t != "or" && t != ")" => {}
                _ => break,
            }
            let r = self.unary()?;
            e = Expr::And(Box::new(e), Box::new(r));
        }
        Ok(e)
    }

    fn unary(&mut self) -> Result<Expr, FilterError> {
        if self.peek().is_some_and(|t| t.text == "not") {
            self.i += 1;
            return Ok(Expr::Not(Box::new(self.unary()?)));
        }
        self.primary()
    }

    fn primary(&mut self) -> Result<Expr, FilterError> {
        const WANT: &str =
            "expected tcp, udp, icmp, icmp6, ip, ip6, proto, host, port, src, dst, not or `(`";
        let Some(t) = self.next() else {
            return Err(self.err_end(WANT));
        };
        Ok(match t.text.as_str() {
            "(" => {
                let e = self.or()?;
                match self.next() {
                    Some(c) if c.text == ")" => e,
                    Some(c) => {
                        return Err(self.err_at(&c, format!("expected `)`, found `{}`", c.text)))
                    }
                    None => {
                        return Err(self.err_end(&format!(
                            "expected `)` to close the `(` at column {}",
                            t.col
                        )))
                    }
                }
            }
            "tcp" => Expr::Proto(6),
            "udp" => Expr::Proto(17),
            "icmp" => Expr::Proto(1),
            "icmp6" => Expr::Proto(58),
            "sctp" => Expr::Proto(132),
            "ip" => Expr::Family(4),
            "ip6" => Expr::Family(6),
            "proto" => {
                let n = self.value("a protocol number")?;
                match n.text.parse::<u8>() {
                    Ok(p) => Expr::Proto(p),
                    Err(_) => {
                        return Err(self
                            .err_at(&n, format!("`{}` is not a protocol number (0-255)", n.text)))
                    }
                }
            }
            "src" | "dst" => {
                let d = if t.text == "src" { Dir::Src } else { Dir::Dst };
                let Some(q) = self.next() else {
                    return Err(self.err_end(&format!("expected host or port after `{}`", t.text)));
                };
                match q.text.as_str() {
                    "host" => self.host(d)?,
                    "port" => self.port(d)?,
                    _ => {
                        return Err(self.err_at(
                            &q,
                            format!(
                                "expected host or port after `{}`, found `{}`",
                                t.text, q.text
                            ),
                        ))
                    }
                }
            }
            "host" => self.host(Dir::Either)?,
            "port" => self.port(Dir::Either)?,
            ")" => return Err(self.err_at(&t, "unmatched `)`".into())),
            "and" | "or" => {
                return Err(self.err_at(&t, format!("`{}` needs an expression before it", t.text)))
            }
            other => return Err(self.err_at(&t, format!("unknown primitive `{other}`; {WANT}"))),
        })
    }

    fn value(&mut self, what: &str) -> Result<Tok, FilterError> {
        match self.next() {
            Some(v) if !matches!(v.text.as_str(), "(" | ")" | "and" | "or" | "not") => Ok(v),
            Some(v) => Err(self.err_at(&v, format!("expected {what}, found `{}`", v.text))),
            None => Err(self.err_end(&format!("expected {what}"))),
        }
    }

    fn host(&mut self, d: Dir) -> Result<Expr, FilterError> {
        let v = self.value("an IPv4 or IPv6 address")?;
        match v.text.parse::<IpAddr>() {
            Ok(a) => Ok(Expr::Host(d, a)),
            Err(_) => Err(self.err_at(&v, format!("`{}` is not an IPv4 or IPv6 address", v.text))),
        }
    }

    fn port(&mut self, d: Dir) -> Result<Expr, FilterError> {
        let v = self.value("a port number")?;
        match v.text.parse::<u16>() {
            Ok(p) => Ok(Expr::Port(d, p)),
            Err(_) => Err(self.err_at(&v, format!("`{}` is not a port number (0-65535)", v.text))),
        }
    }
}

/// Which packets a trace takes: a tenant (by the VNI binding the packet arrived on)
/// and/or a VNI, and a match expression on the inner flow key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceFilter {
    pub tenant: Option<u32>,
    pub vni: Option<u32>,
    pub expr: Expr,
}

impl TraceFilter {
    /// A filter from its parts; the expression is parsed ([`Expr::parse`]).
    pub fn new(tenant: Option<u32>, vni: Option<u32>, expr: &str) -> Result<Self, FilterError> {
        Ok(TraceFilter {
            tenant,
            vni,
            expr: Expr::parse(expr)?,
        })
    }

    #[inline]
    fn scope(&self, tenant: Option<u32>, vni: u32) -> bool {
        self.vni.is_none_or(|v| v == vni) && self.tenant.is_none_or(|t| Some(t) == tenant)
    }
}

// ---------------------------------------------------------------------- records

/// What the flow table said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The packet did not get that far (a parse error).
    NotReached,
    /// Hit flow-table entry `entry` (its index: the rule's id on this worker).
    Hit { entry: u32 },
    /// Missed. `expired`: an entry was there but idle past its timeout. `request`:
    /// whether this packet sent the rule request (false: the flow was already waiting
    /// for one, or the request could not be sent).
    Miss { expired: bool, request: bool },
}

/// One traced packet.
#[derive(Debug, Clone)]
pub struct TracePacket {
    /// The packet's number in this trace, from 1.
    pub seq: u64,
    /// Wall-clock time, µs since the Unix epoch.
    pub ts_us: u64,
    pub worker: u16,
    /// The tenant its VNI is bound to, if any.
    pub tenant: Option<u32>,
    pub vni: u32,
    /// A packet held on a miss and run again after its rule came (not newly received).
    pub released: bool,
    /// The flow key (inner 5-tuple), when the packet parsed that far.
    pub key: Option<FlowKey>,
    pub tcp_flags: Option<u8>,
    /// `ok`, or the parse error's drop reason name.
    pub parse: String,
    pub lookup: Lookup,
    /// The rule's actions, for a hit (`format_actions`).
    pub actions: Option<String>,
    /// `tx N`, `drop`, `held`.
    pub verdict: String,
    pub drop_reason: Option<String>,
    /// The XDP fast path took the flow on this packet.
    pub offloaded: bool,
    /// The frame as received (outer, VXLAN-encapsulated for tenant traffic), cut at the
    /// snap length, and its full length.
    pub outer: Vec<u8>,
    pub outer_len: u32,
    /// The inner frame (empty when not encapsulated), cut, and its full length.
    pub inner: Vec<u8>,
    pub inner_len: u32,
    /// The frame as transmitted, after the actions (empty unless `tx`).
    pub out: Vec<u8>,
    pub out_len: u32,
}

impl TracePacket {
    /// Packet `seq` as `worker` received it: the frame and its inner frame (when
    /// encapsulated) cut at `snaplen`, now as its timestamp, and what the pipeline
    /// learns later (tenant, key, parse, lookup, verdict) still unset.
    pub(crate) fn received(
        seq: u64,
        worker: u16,
        frame: &[u8],
        inner: Option<&[u8]>,
        snaplen: usize,
    ) -> Self {
        let inner = inner.unwrap_or_default();
        TracePacket {
            seq,
            ts_us: wall_us(),
            worker,
            tenant: None,
            vni: 0,
            released: false,
            key: None,
            tcp_flags: None,
            parse: String::new(),
            lookup: Lookup::NotReached,
            actions: None,
            verdict: String::new(),
            drop_reason: None,
            offloaded: false,
            outer: frame[..frame.len().min(snaplen)].to_vec(),
            outer_len: frame.len() as u32,
            inner: inner[..inner.len().min(snaplen)].to_vec(),
            inner_len: inner.len() as u32,
            out: Vec::new(),
            out_len: 0,
        }
    }
}

/// FM's answer to a traced miss's rule request, as the reply holds it.
#[derive(Debug, Clone)]
pub struct TraceDecision {
    pub ts_us: u64,
    pub worker: u16,
    /// The traced packet whose miss asked.
    pub for_seq: u64,
    pub key: FlowKey,
    /// The rule's actions, or FM's error.
    pub result: Result<String, String>,
    /// Companion rules installed with it (the reverse direction), as `key: actions`.
    pub also: Vec<String>,
    /// Whether the rule compiled and was installed.
    pub installed: bool,
    /// Who decided, as FM's reply says (`SC group 3`, `FM rule cache`, `FM`); empty
    /// when the reply does not say.
    pub decided_by: String,
    /// From the traced packet to the reply, µs.
    pub after_us: u64,
}

/// What a tracer emits.
#[derive(Debug, Clone)]
pub enum TraceRecord {
    Packet(Box<TracePacket>),
    Decision(Box<TraceDecision>),
}

// ---------------------------------------------------------------------- the tracer

/// Counters shared with the reader.
#[derive(Debug, Default)]
pub struct TraceCounters {
    /// Records emitted.
    pub emitted: AtomicU64,
    /// Records lost: the channel was full.
    pub lost: AtomicU64,
    /// Packets tested against the filter.
    pub tested: AtomicU64,
}

/// An armed trace, owned by one worker's pipeline ([`crate::Pipeline::set_tracer`]).
pub struct Tracer {
    pub(crate) filter: TraceFilter,
    pub(crate) remaining: u64,
    pub(crate) snaplen: usize,
    tx: Sender<TraceRecord>,
    counters: Arc<TraceCounters>,
    seq: u64,
    tested: u64,
    /// Misses awaiting FM's answer: (flow, traced packet's seq, its time in µs).
    watch: Vec<(FlowKey, u64, u64)>,
}

impl Tracer {
    /// The same trace for another worker's pipeline: its filter, count and snap length,
    /// recording into the same session. Each worker counts its own packets, so a node
    /// with N workers records up to N × `count`.
    pub fn fork(&self) -> Tracer {
        Tracer::new(
            self.filter.clone(),
            self.remaining,
            self.snaplen,
            self.tx.clone(),
            self.counters.clone(),
        )
    }

    /// Trace up to `count` matching packets into `tx` (bounded: a full channel loses
    /// records, counted in `counters`).
    pub fn new(
        filter: TraceFilter,
        count: u64,
        snaplen: usize,
        tx: Sender<TraceRecord>,
        counters: Arc<TraceCounters>,
    ) -> Self {
        Tracer {
            filter,
            remaining: count,
            snaplen: snaplen.max(1),
            tx,
            counters,
            seq: 0,
            tested: 0,
            watch: Vec::new(),
        }
    }

    /// Whether this packet is to be traced (and if so, takes one of the count).
    #[inline]
    pub(crate) fn wants(&mut self, tenant: Option<u32>, vni: u32, key: Option<&FlowKey>) -> bool {
        if self.remaining == 0 {
            return false;
        }
        self.tested += 1;
        let m = self.filter.scope(tenant, vni)
            && match key {
                Some(k) => self.filter.expr.matches(k),
                None => self.filter.expr.is_true(),
            };
        if m {
            self.remaining -= 1;
        }
        m
    }

    pub(crate) fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    pub(crate) fn emit(&mut self, r: TraceRecord) {
        match self.tx.try_send(r) {
            Ok(()) => {
                self.counters.emitted.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.counters.lost.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Publish the tested count (once per chunk, not per packet).
    pub(crate) fn flush_counts(&mut self) {
        if self.tested > 0 {
            self.counters
                .tested
                .fetch_add(self.tested, Ordering::Relaxed);
            self.tested = 0;
        }
    }

    pub(crate) fn watch(&mut self, key: FlowKey, seq: u64, t_us: u64) {
        if self.watch.len() < MAX_WATCHED && !self.watch.iter().any(|w| w.0 == key) {
            self.watch.push((key, seq, t_us));
        }
    }

    /// The watched miss of `key`, removed.
    pub(crate) fn unwatch(&mut self, key: &FlowKey) -> Option<(u64, u64)> {
        let i = self.watch.iter().position(|w| w.0 == *key)?;
        let (_, s, t) = self.watch.swap_remove(i);
        Some((s, t))
    }

    /// Forget misses older than `max_age_us` (their packets timed out).
    pub(crate) fn expire_watch(&mut self, now_us: u64, max_age_us: u64) {
        self.watch
            .retain(|w| now_us.saturating_sub(w.2) <= max_age_us);
    }

    /// Nothing left to do: the count is used up and no decision is awaited.
    pub fn done(&self) -> bool {
        self.remaining == 0 && self.watch.is_empty()
    }

    pub fn remaining(&self) -> u64 {
        self.remaining
    }
}

/// Wall-clock µs since the Unix epoch (read only for traced packets).
pub(crate) fn wall_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn k(proto: u8, s: [u8; 4], sp: u16, d: [u8; 4], dp: u16) -> FlowKey {
        FlowKey::new(
            100,
            proto,
            IpAddr::V4(Ipv4Addr::from(s)),
            sp,
            IpAddr::V4(Ipv4Addr::from(d)),
            dp,
        )
    }

    #[test]
    fn parses_and_matches_the_bpf_subset() {
        let web = k(6, [10, 0, 0, 2], 40000, [198, 19, 0, 1], 80);
        let dns = k(17, [10, 0, 0, 2], 40001, [198, 19, 0, 1], 53);
        let ping = k(1, [10, 0, 0, 2], 7, [198, 19, 0, 1], 0);
        let cases: &[(&str, [bool; 3])] = &[
            ("", [true, true, true]),
            ("tcp", [true, false, false]),
            ("udp", [false, true, false]),
            ("icmp", [false, false, true]),
            ("tcp and port 80", [true, false, false]),
            ("tcp port 80", [true, false, false]),
            ("port 80 or port 53", [true, true, false]),
            ("dst port 53", [false, true, false]),
            ("src port 53", [false, false, false]),
            ("src port 40000", [true, false, false]),
            // `port` is for TCP/UDP only: the echo id in the key is no port.
            ("port 7", [false, false, false]),
            ("host 198.19.0.1", [true, true, true]),
            ("src host 198.19.0.1", [false, false, false]),
            ("dst host 198.19.0.1 and not icmp", [true, true, false]),
            ("not (tcp or udp)", [false, false, true]),
            ("!tcp && !udp", [false, false, true]),
            ("(tcp || udp) && dst port 53", [false, true, false]),
            ("ip", [true, true, true]),
            ("ip6", [false, false, false]),
            ("proto 17", [false, true, false]),
            ("TCP AND PORT 80", [true, false, false]),
            ("host ::1", [false, false, false]),
        ];
        for (s, want) in cases {
            let e = Expr::parse(s).unwrap_or_else(|e| panic!("{s:?}: {e}"));
            let got = [e.matches(&web), e.matches(&dns), e.matches(&ping)];
            assert_eq!(got, *want, "{s:?} parsed as {e:?}");
        }
        // `and` binds tighter than `or`.
        assert_eq!(
            Expr::parse("udp or tcp and port 1").unwrap(),
            Expr::Or(
                Box::new(Expr::Proto(17)),
                Box::new(Expr::And(
                    Box::new(Expr::Proto(6)),
                    Box::new(Expr::Port(Dir::Either, 1))
                ))
            )
        );
    }

    #[test]
    fn bad_expressions_say_where_and_why() {
        let cases: &[(&str, usize, &str)] = &[
            ("tcp and", 8, "found the end"),
            ("port", 5, "expected a port number"),
            ("port http", 6, "not a port number"),
            ("port 70000", 6, "not a port number"),
            ("host 10.0.0.300", 6, "not an IPv4 or IPv6 address"),
            ("tcp or or udp", 8, "needs an expression before it"),
            ("(tcp", 5, "expected `)`"),
            ("tcp)", 4, "unexpected `)`"),
            ("foo", 1, "unknown primitive `foo`"),
            ("src 10.0.0.1", 5, "expected host or port after `src`"),
            ("tcp & udp", 5, "did you mean `&&`"),
            ("tcp; udp", 4, "unexpected character `;`"),
            ("proto 300", 7, "not a protocol number"),
            ("not", 4, "found the end"),
        ];
        for (s, col, msg) in cases {
            let e = Expr::parse(s).expect_err(s);
            assert_eq!(e.col, *col, "{s:?}: {e}");
            assert!(e.to_string().contains(msg), "{s:?}: {e}");
            assert!(
                e.to_string().starts_with("bad match expression at column"),
                "{e}"
            );
        }
    }

    #[test]
    fn the_tracer_takes_count_matches_and_counts_lost_records() {
        let (tx, rx) = crossbeam_channel::bounded(2);
        let c = Arc::new(TraceCounters::default());
        let f = TraceFilter::new(Some(1), None, "tcp").unwrap();
        let mut t = Tracer::new(f, 3, 64, tx, c.clone());
        let web = k(6, [10, 0, 0, 2], 1, [10, 0, 0, 3], 80);
        let dns = k(17, [10, 0, 0, 2], 1, [10, 0, 0, 3], 53);
        assert!(!t.wants(Some(2), 100, Some(&web)), "another tenant");
        assert!(!t.wants(Some(1), 100, Some(&dns)), "not tcp");
        assert!(
            !t.wants(Some(1), 100, None),
            "no key, and the filter needs one"
        );
        assert!(t.wants(Some(1), 100, Some(&web)));
        assert!(t.wants(Some(1), 101, Some(&web)));
        assert!(t.wants(Some(1), 100, Some(&web)));
        assert!(!t.wants(Some(1), 100, Some(&web)), "the count is used up");
        assert_eq!(t.remaining(), 0);
        t.flush_counts();
        assert_eq!(c.tested.load(Ordering::Relaxed), 6);
        // The ring holds two; the third is lost, not waited for.
        for _ in 0..3 {
            t.emit(TraceRecord::Decision(Box::new(TraceDecision {
                ts_us: 0,
                worker: 0,
                for_seq: 1,
                key: web,
                result: Err("x".into()),
                also: vec![],
                installed: false,
                decided_by: String::new(),
                after_us: 0,
            })));
        }
        assert_eq!(c.emitted.load(Ordering::Relaxed), 2);
        assert_eq!(c.lost.load(Ordering::Relaxed), 1);
        assert_eq!(rx.len(), 2);
        // Watched misses keep the tracer alive until answered or expired.
        assert!(t.done());
        t.watch(web, 1, 1_000);
        t.watch(web, 2, 1_000);
        assert!(!t.done());
        assert_eq!(t.unwatch(&dns), None);
        assert_eq!(t.unwatch(&web), Some((1, 1_000)));
        t.watch(web, 3, 1_000);
        t.expire_watch(5_000, 1_000);
        assert!(t.done());
        let f = TraceFilter::new(None, Some(7), "").unwrap();
        let (tx, _rx) = crossbeam_channel::bounded(1);
        let mut t = Tracer::new(f, 5, 64, tx, Arc::new(TraceCounters::default()));
        assert!(
            t.wants(None, 7, None),
            "no expression: packets without a key too"
        );
        assert!(!t.wants(Some(1), 8, Some(&web)), "another VNI");
    }
}
