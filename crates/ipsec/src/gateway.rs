//! The IPsec VPN gateway of one PP worker: the security policy (which VPC traffic goes
//! into which tunnel), the SA database (outbound SA per tunnel, inbound SAs by SPI with
//! their replay windows), and the batch that seals and opens a burst of frames.
//!
//! ESP state is per SA, not per flow (as VPP keeps it): nothing here is in the flow
//! table, and a tunnel's flows need no rule from SC.
//!
//! - **Outbound**: a VXLAN frame from a tunnel's VNI whose inner IPv4 destination is in
//!   the tunnel's remote prefixes (and source in its local ones, if it names any) is
//!   decapsulated, sealed with the tunnel's outbound SA and sent to the peer as
//!   Ethernet/IPv4/ESP. A packet that would not fit the MTU and has DF set is answered
//!   with ICMP "fragmentation needed" into the VPC, so TCP there lowers its MSS.
//! - **Inbound**: an ESP frame to the node is looked up by SPI, checked against the
//!   replay window, verified and decrypted, checked against the SA's selectors, and
//!   re-encapsulated in VXLAN toward the VPC's host on the tunnel's VNI.
//!
//! Rekeying is make-before-break: [`Gateway::apply`] keeps the state (sequence numbers,
//! replay windows) of every SA whose SPI and key did not change, and an inbound SA
//! that left the configuration stays valid for [`GatewayConfig::grace_ms`] so packets
//! the peer sealed with it before switching still arrive.

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use hashbrown::HashMap;
use packet::build::{EncapV4, VXLAN_V4_OVERHEAD};
use packet::csum;

use crate::esp::{self, EspDrop, OuterV4, SaKey, ETH_LEN, NH_IPV4};
use crate::replay::ReplayWindow;

/// The inner source MAC of frames the gateway delivers into a VPC (any MAC but the
/// receiving device's own is taken by a Linux VXLAN device).
pub const GATEWAY_MAC: [u8; 6] = [0x02, 0x5f, 0xec, 0x00, 0x00, 0x01];

/// An IPv4 prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Prefix {
    pub addr: Ipv4Addr,
    pub len: u8,
}

impl Prefix {
    pub fn new(addr: Ipv4Addr, len: u8) -> Self {
        Prefix { addr, len }
    }

    #[inline]
    fn mask(&self) -> u32 {
        if self.len == 0 {
            0
        } else {
            u32::MAX << (32 - u32::from(self.len.min(32)))
        }
    }

    #[inline]
    pub fn contains(&self, a: Ipv4Addr) -> bool {
        (u32::from(a) ^ u32::from(self.addr)) & self.mask() == 0
    }

    /// Whether the two prefixes share an address.
    pub fn overlaps(&self, o: &Prefix) -> bool {
        let m = self.mask() & o.mask();
        (u32::from(self.addr) ^ u32::from(o.addr)) & m == 0
    }
}

impl std::str::FromStr for Prefix {
    type Err = String;

    /// `a.b.c.d/n` with no host bits set (`a.b.c.d` alone is a /32).
    fn from_str(s: &str) -> Result<Self, String> {
        let (a, l) = s.split_once('/').unwrap_or((s, "32"));
        let addr: Ipv4Addr = a
            .parse()
            .map_err(|_| format!("{s:?} is not an IPv4 prefix (a.b.c.d/n)"))?;
        let len: u8 = l
            .parse()
            .ok()
            .filter(|l| *l <= 32)
            .ok_or_else(|| format!("{s:?}: the prefix length must be 0..=32"))?;
        let p = Prefix { addr, len };
        if u32::from(addr) & !p.mask() != 0 {
            return Err(format!("{s:?} has host bits set"));
        }
        Ok(p)
    }
}

impl std::fmt::Display for Prefix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// One SA as configured: SPI and RFC 4106 KEYMAT (key + 4-byte salt).
#[derive(Clone, PartialEq, Eq)]
pub struct SaConfig {
    pub spi: u32,
    pub keymat: Vec<u8>,
}

impl std::fmt::Debug for SaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SaConfig {{ spi: {:#x}, keymat: <{} bytes> }}",
            self.spi,
            self.keymat.len()
        )
    }
}

/// One tunnel (a VPN connection) as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelConfig {
    /// `tenant/name`, for counters and logs.
    pub name: String,
    pub tenant: u32,
    /// The VPC's VNI: its traffic goes in, decrypted traffic comes out on it.
    pub vni: u32,
    /// The remote site's tunnel endpoint.
    pub peer: Ipv4Addr,
    /// The VPC side's traffic selector; empty: any source.
    pub local_prefixes: Vec<Prefix>,
    /// The remote site's prefixes (at least one).
    pub remote_prefixes: Vec<Prefix>,
    /// Where decrypted packets go: the VTEP of the VPC's host and the inner destination
    /// MAC its VXLAN device takes.
    pub vtep: Ipv4Addr,
    pub vm_mac: [u8; 6],
    pub outbound: SaConfig,
    /// One or two (the new one while the old one is still in use by the peer).
    pub inbound: Vec<SaConfig>,
    pub esn: bool,
    pub replay_window: u32,
}

/// The gateway's own addresses and limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatewayConfig {
    /// Outer source of ESP and VXLAN: the PP node's underlay address.
    pub node_ip: Ipv4Addr,
    pub node_mac: [u8; 6],
    /// The underlay next hop's MAC.
    pub gw_mac: [u8; 6],
    /// The outer MTU ESP packets must fit.
    pub mtu: usize,
    /// How long an inbound SA stays valid after it left the configuration.
    pub grace_ms: u32,
}

impl GatewayConfig {
    pub fn new(node_ip: Ipv4Addr, node_mac: [u8; 6], gw_mac: [u8; 6]) -> Self {
        GatewayConfig {
            node_ip,
            node_mac,
            gw_mac,
            mtu: 1500,
            grace_ms: 30_000,
        }
    }
}

/// Counters of one SA.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SaCounters {
    pub packets: u64,
    pub bytes: u64,
}

struct OutSa {
    cfg: SaConfig,
    key: SaKey,
    /// The last sequence number sent.
    seq: OutSeq,
    counters: SaCounters,
}

/// An outbound SA's last sequence number: the gateway's own, or one shared with the
/// node's other workers' gateways through a [`SeqSpace`]. A lone gateway keeps a plain
/// counter, so a one-worker node's seal path pays no atomic step per packet.
enum OutSeq {
    Own(u64),
    Shared(Arc<AtomicU64>),
}

impl OutSeq {
    /// The next number, if it does not pass `max`. A shared counter takes it in one
    /// atomic step, so two workers never send the same one; a seal that then fails
    /// leaves a gap, which the peer's window allows.
    #[inline]
    fn take(&mut self, max: u64) -> Option<u64> {
        match self {
            OutSeq::Own(s) => (*s < max).then(|| {
                *s += 1;
                *s
            }),
            OutSeq::Shared(c) => c
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                    (s < max).then_some(s + 1)
                })
                .ok()
                .map(|last| last + 1),
        }
    }

    fn last(&self) -> u64 {
        match self {
            OutSeq::Own(s) => *s,
            OutSeq::Shared(c) => c.load(Ordering::Relaxed),
        }
    }

    fn set(&mut self, v: u64) {
        match self {
            OutSeq::Own(s) => *s = v,
            OutSeq::Shared(c) => c.store(v, Ordering::Relaxed),
        }
    }
}

/// The outbound sequence numbers of one PP node's gateways. A node runs a gateway per
/// worker, and an SA's outbound packets leave from whichever worker their flow's
/// packets arrive on; RFC 4303 §3.3.3 wants every sequence number used once per SA
/// (the peer's replay window drops a repeat). Gateways made with the same `SeqSpace`
/// ([`Gateway::with_seq_space`]) draw an SA's numbers from one counter: an SA is its SPI
/// and key, so a rekeyed SA starts a counter of its own. An SA no gateway holds any more
/// is forgotten.
#[derive(Default)]
pub struct SeqSpace {
    sas: Mutex<Vec<(SaConfig, Weak<AtomicU64>)>>,
}

impl SeqSpace {
    pub fn new() -> Arc<SeqSpace> {
        Arc::new(SeqSpace::default())
    }

    /// The counter of `sa`: the one a gateway already holds, else a new one at 0.
    fn counter(&self, sa: &SaConfig) -> Arc<AtomicU64> {
        let mut sas = self.sas.lock().unwrap_or_else(|e| e.into_inner());
        sas.retain(|(_, w)| w.strong_count() > 0);
        if let Some(c) = sas
            .iter()
            .find(|(c, _)| c == sa)
            .and_then(|(_, w)| w.upgrade())
        {
            return c;
        }
        let c = Arc::new(AtomicU64::new(0));
        sas.push((sa.clone(), Arc::downgrade(&c)));
        c
    }

    /// SAs some gateway holds.
    pub fn len(&self) -> usize {
        let sas = self.sas.lock().unwrap_or_else(|e| e.into_inner());
        sas.iter().filter(|(_, w)| w.strong_count() > 0).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

struct InSa {
    cfg: SaConfig,
    key: SaKey,
    /// Index into the tunnels, and the tunnel's name (indices change on apply).
    tunnel: usize,
    tunnel_name: String,
    esn: bool,
    window: ReplayWindow,
    /// Set when the SA left the configuration: valid until then (ms, the caller's clock).
    retire_at: Option<u32>,
    counters: SaCounters,
}

struct Tunnel {
    cfg: TunnelConfig,
    out: OutSa,
    outer: OuterV4,
    deliver: EncapV4,
    drops: u64,
}

/// What the gateway's counters say about one tunnel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelStatus {
    pub name: String,
    pub tenant: u32,
    pub vni: u32,
    pub peer: Ipv4Addr,
    pub outbound_spi: u32,
    pub outbound_seq: u64,
    pub outbound: SaCounters,
    /// SPI, counters, whether it is retiring (out of the configuration, in its grace).
    pub inbound: Vec<(u32, SaCounters, bool)>,
    pub drops: u64,
}

/// Gateway-wide counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GatewayStats {
    pub out_packets: u64,
    pub out_bytes: u64,
    pub in_packets: u64,
    pub in_bytes: u64,
    /// ICMP "fragmentation needed" sent into VPCs.
    pub icmp_too_big: u64,
    /// Drops, indexed like [`EspDrop::ALL`].
    pub drops: [u64; EspDrop::ALL.len()],
    /// Bursts and packets through [`Gateway::process`].
    pub batches: u64,
    pub batched: u64,
}

impl GatewayStats {
    pub fn dropped(&self, r: EspDrop) -> u64 {
        EspDrop::ALL
            .iter()
            .position(|x| *x == r)
            .map_or(0, |i| self.drops[i])
    }
}

/// Why a configuration was refused (the API validates first; this is the last line).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("tunnel {tunnel}: {why}")]
    Tunnel { tunnel: String, why: String },
}

/// What a job is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// A VXLAN frame from a VPC into tunnel `tunnel` (from [`Gateway::outbound_tunnel`]);
    /// its inner IPv4 packet is at `ip_off..ip_end` from the frame's start.
    Out {
        tunnel: u16,
        ip_off: u16,
        ip_end: u16,
    },
    /// An ESP frame to the node.
    In,
}

/// How a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Pending,
    /// Send the frame now at `start..start + len` (absolute in the region). `tenant` and
    /// `vni` are the tunnel's, for the caller's accounting.
    Tx {
        start: usize,
        len: usize,
        tenant: u32,
        vni: u32,
    },
    Drop(EspDrop),
}

/// One frame of a burst. `slot..slot + cap` is its buffer in the region; the frame is
/// at `start..start + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Job {
    pub slot: usize,
    pub cap: usize,
    pub start: usize,
    pub len: usize,
    pub dir: Dir,
    pub outcome: Outcome,
}

/// One worker's gateway.
pub struct Gateway {
    cfg: GatewayConfig,
    /// Where outbound SAs' sequence numbers come from (None: this gateway's own).
    seqs: Option<Arc<SeqSpace>>,
    tunnels: Vec<Tunnel>,
    /// VNI → tunnels of that VPC.
    by_vni: HashMap<u32, Vec<u16>>,
    /// SPI → inbound SA.
    inbound: HashMap<u32, InSa>,
    /// The earliest `retire_at` among inbound SAs.
    next_retire: Option<u32>,
    stats: GatewayStats,
}

#[inline]
fn v4(b: &[u8]) -> Ipv4Addr {
    Ipv4Addr::new(b[0], b[1], b[2], b[3])
}

/// `a` is at or after `b` on a wrapping millisecond clock.
#[inline]
fn reached(a: u32, b: u32) -> bool {
    a.wrapping_sub(b) < u32::MAX / 2
}

impl Gateway {
    pub fn new(cfg: GatewayConfig) -> Self {
        Gateway {
            cfg,
            seqs: None,
            tunnels: Vec::new(),
            by_vni: HashMap::new(),
            inbound: HashMap::new(),
            next_retire: None,
            stats: GatewayStats::default(),
        }
    }

    /// A gateway whose outbound sequence numbers come from `seqs`, shared with the other
    /// gateways (workers) of its node.
    pub fn with_seq_space(cfg: GatewayConfig, seqs: Arc<SeqSpace>) -> Self {
        Gateway {
            seqs: Some(seqs),
            ..Gateway::new(cfg)
        }
    }

    pub fn config(&self) -> &GatewayConfig {
        &self.cfg
    }

    /// Change the node's addresses (the outer headers of every tunnel follow).
    pub fn set_node(&mut self, node_ip: Ipv4Addr, node_mac: [u8; 6], gw_mac: [u8; 6]) {
        self.cfg.node_ip = node_ip;
        self.cfg.node_mac = node_mac;
        self.cfg.gw_mac = gw_mac;
        for t in &mut self.tunnels {
            let (outer, deliver) = Self::headers(&self.cfg, &t.cfg);
            t.outer = outer;
            t.deliver = deliver;
        }
    }

    pub fn stats(&self) -> &GatewayStats {
        &self.stats
    }

    /// No tunnel configured: the pipeline skips the outbound lookup.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.tunnels.is_empty() && self.inbound.is_empty()
    }

    fn headers(g: &GatewayConfig, t: &TunnelConfig) -> (OuterV4, EncapV4) {
        (
            OuterV4 {
                src_mac: g.node_mac,
                dst_mac: g.gw_mac,
                src: g.node_ip,
                dst: t.peer,
                ttl: 64,
            },
            EncapV4::new(
                g.node_mac,
                g.gw_mac,
                g.node_ip.octets(),
                t.vtep.octets(),
                t.vni,
            ),
        )
    }

    /// Take a complete configuration. SAs whose SPI and key are unchanged keep their
    /// state; inbound SAs no longer configured retire after the grace period; an SPI
    /// configured twice is refused (nothing changes then).
    pub fn apply(&mut self, tunnels: &[TunnelConfig], now_ms: u32) -> Result<(), ConfigError> {
        let err = |t: &TunnelConfig, why: String| ConfigError::Tunnel {
            tunnel: t.name.clone(),
            why,
        };
        // Validate everything first.
        let mut spis: HashMap<u32, &str> = HashMap::new();
        for t in tunnels {
            if t.remote_prefixes.is_empty() {
                return Err(err(t, "no remote prefix".into()));
            }
            if t.inbound.is_empty() || t.inbound.len() > 2 {
                return Err(err(t, "one or two inbound SAs".into()));
            }
            for sa in std::iter::once(&t.outbound).chain(&t.inbound) {
                SaKey::new(&sa.keymat).map_err(|e| err(t, e.to_string()))?;
                if sa.spi < 256 {
                    return Err(err(
                        t,
                        format!("SPI {} is reserved (RFC 4303 §2.1)", sa.spi),
                    ));
                }
            }
            for sa in &t.inbound {
                if let Some(other) = spis.insert(sa.spi, &t.name) {
                    return Err(err(
                        t,
                        format!("inbound SPI {:#x} is also {other}'s", sa.spi),
                    ));
                }
            }
        }
        // Outbound SAs: kept when the tunnel, SPI and key are the same.
        let mut old: HashMap<String, OutSa> = self
            .tunnels
            .drain(..)
            .map(|t| (t.cfg.name.clone(), t.out))
            .collect();
        for t in tunnels {
            let out = match old.remove(&t.name) {
                Some(o) if o.cfg == t.outbound => o,
                _ => OutSa {
                    key: SaKey::new(&t.outbound.keymat).expect("validated"),
                    cfg: t.outbound.clone(),
                    seq: match &self.seqs {
                        Some(s) => OutSeq::Shared(s.counter(&t.outbound)),
                        None => OutSeq::Own(0),
                    },
                    counters: SaCounters::default(),
                },
            };
            let (outer, deliver) = Self::headers(&self.cfg, t);
            self.tunnels.push(Tunnel {
                cfg: t.clone(),
                out,
                outer,
                deliver,
                drops: 0,
            });
        }
        self.by_vni.clear();
        for (i, t) in self.tunnels.iter().enumerate() {
            self.by_vni.entry(t.cfg.vni).or_default().push(i as u16);
        }
        // Inbound SAs: kept (window and all) when SPI and key are the same; the rest of
        // the old ones retire.
        let mut old_in = std::mem::take(&mut self.inbound);
        for (i, t) in tunnels.iter().enumerate() {
            for sa in &t.inbound {
                let entry = match old_in.remove(&sa.spi) {
                    Some(mut o) if o.cfg == *sa && o.esn == t.esn => {
                        o.tunnel = i;
                        o.tunnel_name.clone_from(&t.name);
                        o.retire_at = None;
                        o
                    }
                    _ => InSa {
                        key: SaKey::new(&sa.keymat).expect("validated"),
                        cfg: sa.clone(),
                        tunnel: i,
                        tunnel_name: t.name.clone(),
                        esn: t.esn,
                        window: ReplayWindow::new(t.replay_window),
                        retire_at: None,
                        counters: SaCounters::default(),
                    },
                };
                self.inbound.insert(sa.spi, entry);
            }
        }
        let grace = self.cfg.grace_ms;
        for (spi, mut o) in old_in {
            // Its tunnel must still exist to deliver into; found by name.
            let Some(ti) = self
                .tunnels
                .iter()
                .position(|t| t.cfg.name == o.tunnel_name)
            else {
                continue;
            };
            if grace == 0 {
                continue;
            }
            o.tunnel = ti;
            let at = *o.retire_at.get_or_insert(now_ms.wrapping_add(grace));
            self.next_retire = Some(match self.next_retire {
                Some(n) if reached(at, n) => n,
                _ => at,
            });
            self.inbound.insert(spi, o);
        }
        Ok(())
    }

    /// Remove inbound SAs whose grace period is over.
    pub fn expire(&mut self, now_ms: u32) {
        let Some(n) = self.next_retire else { return };
        if !reached(now_ms, n) {
            return;
        }
        self.inbound
            .retain(|_, sa| sa.retire_at.is_none_or(|at| !reached(now_ms, at)));
        self.next_retire = self
            .inbound
            .values()
            .filter_map(|sa| sa.retire_at)
            .reduce(|a, b| if reached(a, b) { b } else { a });
    }

    /// The tunnel a VPC packet on `vni` from `src` to `dst` goes into, if any: the one
    /// whose remote prefix matching `dst` is longest.
    #[inline]
    pub fn outbound_tunnel(&self, vni: u32, src: Ipv4Addr, dst: Ipv4Addr) -> Option<u16> {
        let list = self.by_vni.get(&vni)?;
        let mut best: Option<(u8, u16)> = None;
        for &i in list {
            let t = &self.tunnels[usize::from(i)].cfg;
            if !t.local_prefixes.is_empty() && !t.local_prefixes.iter().any(|p| p.contains(src)) {
                continue;
            }
            for p in &t.remote_prefixes {
                if p.contains(dst) && best.is_none_or(|(l, _)| p.len > l) {
                    best = Some((p.len, i));
                }
            }
        }
        best.map(|(_, i)| i)
    }

    /// Whether the gateway has tunnels on `vni` (cheap pre-test for the pipeline).
    #[inline]
    pub fn has_vni(&self, vni: u32) -> bool {
        !self.by_vni.is_empty() && self.by_vni.contains_key(&vni)
    }

    pub fn tunnels(&self) -> Vec<TunnelStatus> {
        self.tunnels
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let mut inbound: Vec<(u32, SaCounters, bool)> = self
                    .inbound
                    .values()
                    .filter(|sa| sa.tunnel == i)
                    .map(|sa| (sa.cfg.spi, sa.counters, sa.retire_at.is_some()))
                    .collect();
                inbound.sort_by_key(|s| s.0);
                TunnelStatus {
                    name: t.cfg.name.clone(),
                    tenant: t.cfg.tenant,
                    vni: t.cfg.vni,
                    peer: t.cfg.peer,
                    outbound_spi: t.out.cfg.spi,
                    outbound_seq: t.out.seq.last(),
                    outbound: t.out.counters,
                    inbound,
                    drops: t.drops,
                }
            })
            .collect()
    }

    /// Set tunnel `i`'s last outbound sequence number (tests reach exhaustion this way).
    #[doc(hidden)]
    pub fn set_outbound_seq_for_test(&mut self, i: usize, seq: u64) {
        if let Some(t) = self.tunnels.get_mut(i) {
            t.out.seq.set(seq);
        }
    }

    fn count_drop(&mut self, r: EspDrop, tunnel: Option<usize>) -> Outcome {
        if let Some(i) = EspDrop::ALL.iter().position(|x| *x == r) {
            self.stats.drops[i] += 1;
        }
        if let Some(t) = tunnel.and_then(|t| self.tunnels.get_mut(t)) {
            t.drops += 1;
        }
        Outcome::Drop(r)
    }

    /// Seal or open a burst of frames in one call. Jobs are independent; each ends
    /// `Tx` or `Drop`. Consecutive jobs of one SA reuse its lookup (the key schedule
    /// stays hot in cache); sequence numbers are handed out in job order.
    pub fn process(&mut self, region: &mut [u8], jobs: &mut [Job], now_ms: u32) {
        self.expire(now_ms);
        self.stats.batches += 1;
        self.stats.batched += jobs.len() as u64;
        // The last inbound SA looked up, by SPI: bursts are mostly one SA's.
        for j in jobs.iter_mut() {
            j.outcome = match j.dir {
                Dir::Out {
                    tunnel,
                    ip_off,
                    ip_end,
                } => self.seal_one(region, j, usize::from(tunnel), ip_off, ip_end),
                Dir::In => self.open_one(region, j),
            };
        }
    }

    fn seal_one(
        &mut self,
        region: &mut [u8],
        j: &Job,
        ti: usize,
        ip_off: u16,
        ip_end: u16,
    ) -> Outcome {
        let Some(t) = self.tunnels.get(ti) else {
            return self.count_drop(EspDrop::Policy, None);
        };
        let ip = j.start + usize::from(ip_off);
        let len = usize::from(ip_end.saturating_sub(ip_off));
        let slot_end = j.slot + j.cap;
        if len < 20 || ip + len > slot_end || region.len() < slot_end {
            return self.count_drop(EspDrop::Truncated, Some(ti));
        }
        if esp::outer_len(len) > self.cfg.mtu {
            // DF: tell the sender the tunnel's MTU (RFC 4301 §8.2, RFC 1191).
            if region[ip + 6] & 0x40 != 0 {
                if let Some((s, l)) = self.too_big(region, j, ip, len, ti) {
                    self.stats.icmp_too_big += 1;
                    let t = &self.tunnels[ti];
                    return Outcome::Tx {
                        start: s,
                        len: l,
                        tenant: t.cfg.tenant,
                        vni: t.cfg.vni,
                    };
                }
            }
            return self.count_drop(EspDrop::TooBig, Some(ti));
        }
        if ip < j.slot + esp::FRONT || ip + len + esp::MAX_TRAILER > slot_end {
            return self.count_drop(EspDrop::TooBig, Some(ti));
        }
        let max = if t.cfg.esn {
            u64::MAX
        } else {
            u64::from(u32::MAX)
        };
        let Some(seq) = self.tunnels[ti].out.seq.take(max) else {
            return self.count_drop(EspDrop::SeqExhausted, Some(ti));
        };
        let t = &mut self.tunnels[ti];
        let buf = &mut region[j.slot..slot_end];
        let Some((s, l)) = esp::seal(
            &t.out.key,
            t.out.cfg.spi,
            seq,
            t.cfg.esn,
            &t.outer,
            NH_IPV4,
            buf,
            ip - j.slot,
            len,
        ) else {
            return self.count_drop(EspDrop::TooBig, Some(ti));
        };
        t.out.counters.packets += 1;
        t.out.counters.bytes += len as u64;
        self.stats.out_packets += 1;
        self.stats.out_bytes += l as u64;
        Outcome::Tx {
            start: j.slot + s,
            len: l,
            tenant: t.cfg.tenant,
            vni: t.cfg.vni,
        }
    }

    /// Rewrite the VPC frame in place into ICMP "fragmentation needed" back to its
    /// sender, quoting its IP header and 8 bytes (RFC 792). Returns the new frame.
    fn too_big(
        &self,
        region: &mut [u8],
        j: &Job,
        ip: usize,
        len: usize,
        ti: usize,
    ) -> Option<(usize, usize)> {
        let t = &self.tunnels[ti];
        let ihl = usize::from(region[ip] & 0x0f) * 4;
        let quote = (ihl + 8).min(len);
        let icmp = ip.checked_sub(8)?;
        let new_ip = icmp.checked_sub(20)?;
        let eth = new_ip.checked_sub(ETH_LEN)?;
        let outer = eth.checked_sub(VXLAN_V4_OVERHEAD)?;
        if outer < j.slot || ip < j.start + VXLAN_V4_OVERHEAD + ETH_LEN {
            return None;
        }
        // What the new headers overwrite: the sender's VTEP and its inner MACs.
        let vtep = v4(&region[j.start + 26..j.start + 30]);
        let mut dmac = [0u8; 6];
        let mut smac = [0u8; 6];
        let inner_eth = ip - ETH_LEN;
        dmac.copy_from_slice(&region[inner_eth + 6..inner_eth + 12]); // back to its source
        smac.copy_from_slice(&region[inner_eth..inner_eth + 6]);
        let src = v4(&region[ip + 12..ip + 16]);
        let dst = v4(&region[ip + 16..ip + 20]);
        // ICMP header + quote.
        let mtu = esp::max_inner(self.cfg.mtu) as u16;
        let h = &mut region[icmp..icmp + 8];
        h.copy_from_slice(&[3, 4, 0, 0, 0, 0, 0, 0]);
        h[6..8].copy_from_slice(&mtu.to_be_bytes());
        let c = csum::checksum(0, &region[icmp..ip + quote]);
        region[icmp + 2..icmp + 4].copy_from_slice(&c.to_be_bytes());
        // IPv4 from the packet's destination back to its source.
        let h = &mut region[new_ip..new_ip + 20];
        h[0] = 0x45;
        h[1] = 0xc0;
        h[2..4].copy_from_slice(&((28 + quote) as u16).to_be_bytes());
        h[4..10].copy_from_slice(&[0, 0, 0, 0, 64, 1]);
        h[10..12].copy_from_slice(&[0, 0]);
        h[12..16].copy_from_slice(&dst.octets());
        h[16..20].copy_from_slice(&src.octets());
        let c = csum::checksum(0, h);
        h[10..12].copy_from_slice(&c.to_be_bytes());
        region[eth..eth + 6].copy_from_slice(&dmac);
        region[eth + 6..eth + 12].copy_from_slice(&smac);
        region[eth + 12..eth + 14].copy_from_slice(&[0x08, 0x00]);
        let inner_len = ETH_LEN + 28 + quote;
        let encap = EncapV4::new(
            self.cfg.node_mac,
            self.cfg.gw_mac,
            self.cfg.node_ip.octets(),
            vtep.octets(),
            t.cfg.vni,
        );
        encap.write(&mut region[outer..], inner_len, source_port(src, dst, 1, 0));
        Some((outer, VXLAN_V4_OVERHEAD + inner_len))
    }

    fn open_one(&mut self, region: &mut [u8], j: &Job) -> Outcome {
        let slot_end = j.slot + j.cap;
        if region.len() < slot_end || j.start + j.len > slot_end {
            return self.count_drop(EspDrop::Truncated, None);
        }
        let frame = &mut region[j.start..j.start + j.len];
        let e = match esp::parse(frame) {
            Ok(e) => e,
            Err(r) => return self.count_drop(r, None),
        };
        let Some(sa) = self.inbound.get_mut(&e.spi) else {
            return self.count_drop(EspDrop::UnknownSpi, None);
        };
        let ti = sa.tunnel;
        // Replay first: a duplicate costs no decryption (RFC 4303 §3.4.3).
        let Some(seq) = sa.window.infer(e.seq_lo, sa.esn) else {
            return self.count_drop(EspDrop::Replay, Some(ti));
        };
        if sa.window.check(seq).is_err() {
            return self.count_drop(EspDrop::Replay, Some(ti));
        }
        let (off, len, _nh) = match esp::open(&sa.key, &e, seq, sa.esn, frame) {
            Ok(x) => x,
            Err(r) => return self.count_drop(r, Some(ti)),
        };
        // Only now, authenticated, may it move the window.
        if sa.window.accept(seq).is_err() {
            return self.count_drop(EspDrop::Replay, Some(ti));
        }
        sa.counters.packets += 1;
        sa.counters.bytes += len as u64;
        let t = &self.tunnels[ti];
        let inner = j.start + off;
        let src = v4(&region[inner + 12..inner + 16]);
        let dst = v4(&region[inner + 16..inner + 20]);
        // The inner packet must be one the SA protects (RFC 4301 §5.2 step 4).
        if !t.cfg.remote_prefixes.iter().any(|p| p.contains(src))
            || (!t.cfg.local_prefixes.is_empty()
                && !t.cfg.local_prefixes.iter().any(|p| p.contains(dst)))
        {
            return self.count_drop(EspDrop::Policy, Some(ti));
        }
        // VXLAN toward the VPC's host: outer 50 bytes (with the inner Ethernet after it).
        let Some(start) = inner.checked_sub(VXLAN_V4_OVERHEAD + ETH_LEN) else {
            return self.count_drop(EspDrop::TooBig, Some(ti));
        };
        if start < j.slot {
            return self.count_drop(EspDrop::TooBig, Some(ti));
        }
        let eth = inner - ETH_LEN;
        region[eth..eth + 6].copy_from_slice(&t.cfg.vm_mac);
        region[eth + 6..eth + 12].copy_from_slice(&GATEWAY_MAC);
        region[eth + 12..eth + 14].copy_from_slice(&[0x08, 0x00]);
        let ihl = usize::from(region[inner] & 0x0f) * 4;
        let proto = region[inner + 9];
        let ports = if len >= ihl + 4 && (proto == 6 || proto == 17) {
            u32::from_be_bytes([
                region[inner + ihl],
                region[inner + ihl + 1],
                region[inner + ihl + 2],
                region[inner + ihl + 3],
            ])
        } else {
            0
        };
        t.deliver.write(
            &mut region[start..],
            ETH_LEN + len,
            source_port(src, dst, proto, ports),
        );
        self.stats.in_packets += 1;
        self.stats.in_bytes += (j.len) as u64;
        Outcome::Tx {
            start,
            len: VXLAN_V4_OVERHEAD + ETH_LEN + len,
            tenant: t.cfg.tenant,
            vni: t.cfg.vni,
        }
    }
}

/// A VXLAN source port from the inner flow (RFC 7348 §5: 49152..=65535), so the
/// underlay's ECMP spreads flows.
#[inline]
fn source_port(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, ports: u32) -> u16 {
    let mut h = (u64::from(u32::from(src)) << 32 | u64::from(u32::from(dst)))
        ^ (u64::from(ports) << 8 | u64::from(proto)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    h ^= h >> 29;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 32;
    49152 | (h as u16 & 0x3fff)
}
