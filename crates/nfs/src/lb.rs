//! L4 load balancer: DNAT from a service's VIP:port to one of its backends, chosen by a
//! Maglev table (see [`maglev`]) and then pinned by per-flow state.
//!
//! State, as declared in [`NetworkFunction::tables`], kept in platform tables
//! ([`nf::StateTables`]), which the platform snapshots, splits and merges:
//! - `services` (shared, read): the configuration (services and their backends), from
//!   which each service's Maglev table is built. Every partition holds the whole of it; a
//!   split copies it to both halves, a merge keeps this part's.
//! - `conntrack` (per-flow): flow → backend, the row's platform timer its idle deadline. A flow keeps its
//!   backend while this entry lives, whatever happens to the table (backends added,
//!   reweighted or drained), so Maglev's imperfect minimal disruption never breaks an
//!   existing connection. Only a backend marked `down` (or removed) loses its flows:
//!   [`LoadBalancer::update`] forgets them and returns their keys so the platform can
//!   withdraw their rules, and their next packet is balanced afresh.
//!
//! A new flow's backend is the owner of slot `flow_slot_hash(FlowKey::hash(), seed) % M`
//! of its service's table: built only on spec-pinned hashes, so every replica and every
//! release picks the same backend.
//!
//! Decisions for a flow `client → VIP:port` to a service with backend `b`:
//! forward rewrites dst → b, reverse (replies `b → client`) rewrites src → VIP:port.
//! A first packet in the reply direction of a known flow (its reverse rule was evicted or
//! idled at PP while the forward one lives) gets the mirror image: src → VIP:port forward,
//! dst → b on its reverse.
//!
//! Flows to an address that is not a VIP pass unchanged by default, so the LB can sit in
//! a chain that also carries other traffic; `non_vip: "drop"` drops them as `lb-not-vip`
//! instead. A service without an active backend drops as `lb-no-backend`.
//!
//! Timeouts follow Linux IPVS, the closest relative of this NF (an L4 DNAT balancer):
//! TCP 900 s, TCP after FIN/RST 120 s, UDP 300 s.
//!
//! A reply's flow is found without an index of reply keys: a reply comes from a backend
//! to the client, so the services that list that backend give the candidate forward keys
//! (client → VIP:port), and `conntrack` says which is a flow pinned to that backend
//! (`LoadBalancer::reply_to`). Snapshots of older builds (version-1 JSON) are still
//! read, so a group can take state from one.

pub mod maglev;

use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

// hashbrown's default hasher (foldhash) rather than SipHash, as in the SNAT and the FW:
// `services` and `vips_of` are probed for every first packet, at every replica.
use hashbrown::HashMap;

use nf::{
    Decision, FirstPacket, FlowEvent, NetworkFunction, NfEnv, NfError, Rewrite, StateTables,
    TableSpec,
};
use packet::proto;
use pipeline::FlowKey;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tracing::{debug, info, warn};

pub use maglev::{BackendId, MaglevTable, DEFAULT_TABLE_SIZE};

/// Longest timeout accepted (30 days): keeps millisecond deadlines far from overflow and
/// catches unit mistakes (milliseconds written where seconds are meant).
pub const MAX_TIMEOUT_S: u64 = 30 * 24 * 3600;

/// Idle timeout of the drop rules PP caches for `lb-no-backend` and `lb-icmp-unrelated`.
/// Short: a service's backends may come back at any moment, and PP keys an ICMP error on
/// the flow it quotes, so that drop rule also holds back the flow's own packets.
const SHORT_DROP_HOLD: Duration = Duration::from_secs(10);

/// The version of the JSON snapshots older builds wrote (read, never written).
const SNAPSHOT_VERSION: u32 = 1;

const SERVICES: &str = "services";
const CONNTRACK: &str = "conntrack";
/// The `services` table's one row: the configuration, as JSON text (its serde form has
/// untagged and skipped fields, which need a self-describing format).
const CONFIG: &str = "config";

/// A `conntrack` row (its deadline is the row's timer).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct FlowRow {
    backend: BackendId,
    closing: bool,
}

/// Transport protocol of a service.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LbProtocol {
    Tcp,
    Udp,
}

impl LbProtocol {
    pub fn number(self) -> u8 {
        match self {
            LbProtocol::Tcp => proto::TCP,
            LbProtocol::Udp => proto::UDP,
        }
    }
}

impl fmt::Display for LbProtocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LbProtocol::Tcp => "tcp",
            LbProtocol::Udp => "udp",
        })
    }
}

/// Administrative state of a backend.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendState {
    /// Takes new flows in proportion to its weight.
    #[default]
    Active,
    /// Takes no new flows but keeps the ones it has (graceful removal).
    Draining,
    /// Takes nothing: its flows are forgotten and re-balanced on their next packet.
    Down,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendConfig {
    pub addr: IpAddr,
    pub port: u16,
    /// Relative share of new flows; 0 takes none (like `draining`).
    #[serde(default = "default_weight")]
    pub weight: u32,
    #[serde(default)]
    pub state: BackendState,
}

fn default_weight() -> u32 {
    1
}

impl BackendConfig {
    pub fn new(addr: IpAddr, port: u16, weight: u32) -> Self {
        BackendConfig {
            addr,
            port,
            weight,
            state: BackendState::Active,
        }
    }

    pub fn id(&self) -> BackendId {
        BackendId::new(self.addr, self.port)
    }
}

/// A service: VIP, port and protocol, and the backends behind it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    pub vip: IpAddr,
    pub port: u16,
    pub protocol: LbProtocol,
    #[serde(default)]
    pub backends: Vec<BackendConfig>,
}

impl ServiceConfig {
    fn name(&self) -> String {
        format!("{}/{}", BackendId::new(self.vip, self.port), self.protocol)
    }
}

/// What to do with a flow whose destination is not a VIP.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NonVipAction {
    /// Pass unchanged (the LB is transparent to other traffic of the chain).
    #[default]
    Pass,
    /// Drop as `lb-not-vip`.
    Drop,
}

/// Idle timeouts of per-flow state and of the rules PP caches, in seconds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LbTimeouts {
    pub tcp_s: u64,
    /// After PP reports FIN or RST.
    pub tcp_fin_s: u64,
    pub udp_s: u64,
}

impl Default for LbTimeouts {
    fn default() -> Self {
        LbTimeouts {
            tcp_s: 900,
            tcp_fin_s: 120,
            udp_s: 300,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LbConfig {
    #[serde(default)]
    pub services: Vec<ServiceConfig>,
    /// M, the Maglev table size of every service: a prime, ideally > 100× the largest
    /// backend count.
    #[serde(default = "default_table_size")]
    pub table_size: u32,
    /// Seeds the backend permutations and the flow hash, so placement cannot be predicted
    /// from outside. Every replica of a partition must use the same seed.
    #[serde(default)]
    pub seed: u64,
    #[serde(default)]
    pub non_vip: NonVipAction,
    #[serde(default)]
    pub timeouts: LbTimeouts,
}

fn default_table_size() -> u32 {
    DEFAULT_TABLE_SIZE
}

impl Default for LbConfig {
    fn default() -> Self {
        LbConfig {
            services: Vec::new(),
            table_size: DEFAULT_TABLE_SIZE,
            seed: 0,
            non_vip: NonVipAction::Pass,
            timeouts: LbTimeouts::default(),
        }
    }
}

impl LbConfig {
    /// Parse JSON configuration, reporting any problem as [`NfError::Config`].
    pub fn from_json(s: &str) -> Result<Self, NfError> {
        serde_json::from_str(s).map_err(|e| NfError::Config(format!("lb: {e}")))
    }
}

/// (VIP, port, protocol number): what a flow's destination is matched on.
type ServiceKey = (IpAddr, u16, u8);

/// A service, compiled: backend states by identity and the Maglev table of its active
/// backends.
#[derive(Debug, Clone)]
struct Service {
    vip: IpAddr,
    port: u16,
    states: HashMap<BackendId, BackendState>,
    table: MaglevTable,
}

/// Per-flow state: which backend the flow went to, until when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LbFlow {
    backend: BackendId,
    deadline_ms: u64,
    /// PP saw FIN or RST: the shorter `tcp_fin_s` applies from then on.
    closing: bool,
}

pub struct LoadBalancer {
    cfg: LbConfig,
    /// Compiled from `cfg`, the `services` table's row.
    services: HashMap<ServiceKey, Service>,
    /// `conntrack` keyed on the forward key as this NF saw it (client → VIP:port).
    state: StateTables,
    /// Compiled from `services`: each backend (address, port, protocol) with the
    /// services (VIP, port) that list it, in any state. A reply comes from a backend, so
    /// these are where its flow can be ([`LoadBalancer::reply_to`]); a key from anything
    /// else (every new flow's) is answered by this one probe of a small map.
    vips_of: HashMap<(IpAddr, u16, u8), Vec<(IpAddr, u16)>>,
}

fn compile(cfg: &LbConfig) -> Result<HashMap<ServiceKey, Service>, NfError> {
    let err = |m: String| NfError::Config(format!("lb: {m}"));
    maglev::check_size(cfg.table_size).map_err(|e| err(e.to_string()))?;
    for (name, v) in [
        ("tcp_s", cfg.timeouts.tcp_s),
        ("tcp_fin_s", cfg.timeouts.tcp_fin_s),
        ("udp_s", cfg.timeouts.udp_s),
    ] {
        if !(1..=MAX_TIMEOUT_S).contains(&v) {
            return Err(err(format!(
                "timeouts.{name} = {v} s: must be from 1 to {MAX_TIMEOUT_S} s"
            )));
        }
    }
    let mut out = HashMap::new();
    for s in &cfg.services {
        let name = s.name();
        if s.port == 0 {
            return Err(err(format!("service {name}: port 0 is not a service port")));
        }
        if s.vip.is_unspecified() || s.vip.is_multicast() {
            return Err(err(format!(
                "service {name}: VIP must be a unicast address"
            )));
        }
        let mut states = HashMap::new();
        let mut weighted = Vec::new();
        for b in &s.backends {
            let id = b.id();
            if b.port == 0 {
                return Err(err(format!("service {name}: backend {id}: port 0")));
            }
            if b.addr.is_ipv4() != s.vip.is_ipv4() {
                return Err(err(format!(
                    "service {name}: backend {id} is of the other address family than \
                     the VIP; DNAT cannot translate between IPv4 and IPv6"
                )));
            }
            if states.insert(id, b.state).is_some() {
                return Err(err(format!("service {name}: backend {id} is listed twice")));
            }
            // Only active backends take slots: draining and down ones get no new flows.
            let w = if b.state == BackendState::Active {
                b.weight
            } else {
                0
            };
            weighted.push((id, w));
        }
        let active = weighted.iter().filter(|(_, w)| *w > 0).count();
        if active > 0 && (cfg.table_size as u64) < 100 * active as u64 {
            warn!(
                service = %name,
                table_size = cfg.table_size,
                active,
                "Maglev table is smaller than 100x the backends; shares will be uneven"
            );
        }
        let table = MaglevTable::build(&weighted, cfg.table_size, cfg.seed)
            .map_err(|e| err(format!("service {name}: {e}")))?;
        let key = (s.vip, s.port, s.protocol.number());
        let svc = Service {
            vip: s.vip,
            port: s.port,
            states,
            table,
        };
        if out.insert(key, svc).is_some() {
            return Err(err(format!("service {name} is defined twice")));
        }
    }
    Ok(out)
}

/// Each backend with the services that list it ([`LoadBalancer::vips_of`]).
fn vips_of(
    services: &HashMap<ServiceKey, Service>,
) -> HashMap<(IpAddr, u16, u8), Vec<(IpAddr, u16)>> {
    let mut out: HashMap<(IpAddr, u16, u8), Vec<(IpAddr, u16)>> = HashMap::new();
    for (&(vip, port, proto), svc) in services {
        for b in svc.states.keys() {
            out.entry((b.addr, b.port, proto))
                .or_default()
                .push((vip, port));
        }
    }
    out
}

impl LoadBalancer {
    pub fn new(cfg: LbConfig) -> Result<Self, NfError> {
        let services = compile(&cfg)?;
        let mut state = StateTables::create(&Self::specs())?;
        state.load(SERVICES, &CONFIG, &config_text(&cfg)?)?;
        Ok(LoadBalancer {
            cfg,
            vips_of: vips_of(&services),
            services,
            state,
        })
    }

    fn specs() -> Vec<TableSpec> {
        vec![
            TableSpec::shared_read(SERVICES),
            TableSpec::per_flow(CONNTRACK),
        ]
    }

    /// A flow's row and timer.
    fn flow(&self, key: &FlowKey) -> Option<LbFlow> {
        let (row, deadline): (FlowRow, _) = self.state.get_flow_timed(CONNTRACK, key).ok()??;
        Some(LbFlow {
            backend: row.backend,
            deadline_ms: deadline.unwrap_or(u64::MAX),
            closing: row.closing,
        })
    }

    /// Every flow, in key order.
    fn flows(&self) -> Vec<(FlowKey, LbFlow)> {
        let rows = self.state.flows::<FlowRow>(CONNTRACK).unwrap_or_default();
        rows.into_iter()
            .filter_map(|(k, _)| Some((k, self.flow(&k)?)))
            .collect()
    }

    pub fn config(&self) -> &LbConfig {
        &self.cfg
    }

    /// Replace the configuration at runtime and rebuild the Maglev tables. Flows keep
    /// their backends unless the backend went down, was removed, or its service was
    /// removed: those flows are forgotten and their keys returned (sorted), so the
    /// platform can withdraw their rules; their next packet is balanced afresh. A bad
    /// configuration changes nothing.
    pub fn update(&mut self, cfg: LbConfig) -> Result<Vec<FlowKey>, NfError> {
        let services = compile(&cfg)?;
        self.state.load(SERVICES, &CONFIG, &config_text(&cfg)?)?;
        self.cfg = cfg;
        self.vips_of = vips_of(&services);
        self.services = services;
        let dropped = self.prune();
        info!(
            services = self.services.len(),
            dropped = dropped.len(),
            "lb configuration updated"
        );
        Ok(dropped)
    }

    /// The Maglev table of a service, for inspection.
    pub fn table(&self, vip: IpAddr, port: u16, protocol: LbProtocol) -> Option<&MaglevTable> {
        self.services
            .get(&(vip, port, protocol.number()))
            .map(|s| &s.table)
    }

    /// The backend a known flow is pinned to.
    pub fn flow_backend(&self, key: &FlowKey) -> Option<BackendId> {
        self.flow(key).map(|f| f.backend)
    }

    /// Number of flows with state.
    pub fn flow_count(&self) -> usize {
        self.state.len(CONNTRACK).unwrap_or(0)
    }

    fn service_of(&self, key: &FlowKey) -> Option<&Service> {
        self.services.get(&(key.dst(), key.dport(), key.proto()))
    }

    /// Whether a flow's backend may keep it: its service exists and lists the backend
    /// as active or draining.
    fn keeps(&self, key: &FlowKey, backend: &BackendId) -> bool {
        self.service_of(key)
            .and_then(|s| s.states.get(backend))
            .is_some_and(|st| *st != BackendState::Down)
    }

    fn timeout(&self, key: &FlowKey, closing: bool) -> Duration {
        let t = &self.cfg.timeouts;
        Duration::from_secs(match key.proto() {
            proto::TCP if closing => t.tcp_fin_s,
            proto::TCP => t.tcp_s,
            _ => t.udp_s,
        })
    }

    /// The forward key of the flow whose reply key is `k`: of the flows `k` could answer
    /// (from one of `k`'s source's services' VIPs to `k`'s destination), those pinned to
    /// `k`'s source as their backend, the smallest key. Two flows share a reply key only
    /// when one client port reaches two VIPs that share a backend; PP's reverse rules
    /// collide then too, and every replica, whatever order its flows came in, answers
    /// the same one.
    fn reply_to(&self, k: &FlowKey) -> Option<FlowKey> {
        let vips = self.vips_of.get(&(k.src(), k.sport(), k.proto()))?;
        let backend = BackendId::new(k.src(), k.sport());
        (vips.iter())
            .map(|&(vip, port)| FlowKey::new(k.vni(), k.proto(), k.dst(), k.dport(), vip, port))
            .filter(|fwd| self.flow(fwd).is_some_and(|f| f.backend == backend))
            .min_by(|a, b| a.as_bytes().cmp(b.as_bytes()))
    }

    /// Put a flow's row.
    fn insert(&mut self, key: FlowKey, flow: LbFlow) -> Result<(), NfError> {
        let row = FlowRow {
            backend: flow.backend,
            closing: flow.closing,
        };
        (self.state).put_flow_timed(CONNTRACK, &key, &row, flow.deadline_ms)?;
        Ok(())
    }

    fn remove(&mut self, key: &FlowKey) {
        let _ = self.state.delete_flow(CONNTRACK, key);
    }

    /// Give a known flow its full timeout again from `now_ms`; answers the timeout.
    fn rearm(&mut self, key: FlowKey, f: LbFlow, now_ms: u64) -> Result<Duration, NfError> {
        let t = self.timeout(&key, f.closing);
        let deadline = now_ms.saturating_add(t.as_millis() as u64);
        self.state.set_timer(CONNTRACK, &key, deadline)?;
        Ok(t)
    }

    /// Forget flows whose backend may no longer keep them; sorted keys.
    fn prune(&mut self) -> Vec<FlowKey> {
        self.remove_where(|lb, k, f| !lb.keeps(k, &f.backend))
    }

    /// Remove the flows `doomed` picks; their keys, sorted so every replica removes (and
    /// reports) them in the same order.
    fn remove_where(&mut self, doomed: impl Fn(&Self, &FlowKey, &LbFlow) -> bool) -> Vec<FlowKey> {
        let gone: Vec<FlowKey> = (self.flows().into_iter())
            .filter(|(k, f)| doomed(self, k, f))
            .map(|(k, _)| k)
            .collect();
        for k in &gone {
            self.remove(k);
        }
        gone
    }

    fn forward_decision(svc_vip: IpAddr, svc_port: u16, b: &BackendId, t: Duration) -> Decision {
        Decision {
            forward: Rewrite::dst(b.addr, b.port),
            reverse: Rewrite::src(svc_vip, svc_port),
            idle_timeout: Some(t),
            ..Decision::pass()
        }
    }
}

impl NetworkFunction for LoadBalancer {
    fn knows_reply(&self, key: &FlowKey) -> bool {
        self.reply_to(key).is_some()
    }

    fn kind(&self) -> &str {
        "lb"
    }

    fn tables(&self) -> Vec<TableSpec> {
        Self::specs()
    }

    nf::platform_state!(self.state);

    /// The platform moved rows (split, merge): flows a merged part pinned to backends
    /// our configuration has down or gone are re-balanced, as `update` would.
    fn tables_changed(&mut self) {
        self.prune();
    }

    fn first_packet(&mut self, pkt: &FirstPacket, env: &mut NfEnv) -> Result<Decision, NfError> {
        let key = pkt.key;
        // A known flow keeps its backend, whatever the table says now.
        if let Some(f) = self.flow(&key) {
            if let Some(svc) = self.service_of(&key) {
                let (vip, port) = (svc.vip, svc.port);
                let t = self.rearm(key, f, env.now_ms)?;
                return Ok(Self::forward_decision(vip, port, &f.backend, t));
            }
        }
        // The reply direction of a known flow: the mirror image of its rewrites.
        if let Some(fwd) = self.reply_to(&key) {
            if let (Some(f), Some(svc)) = (self.flow(&fwd), self.service_of(&fwd)) {
                let (vip, port) = (svc.vip, svc.port);
                let t = self.rearm(fwd, f, env.now_ms)?;
                return Ok(Decision {
                    forward: Rewrite::src(vip, port),
                    reverse: Rewrite::dst(f.backend.addr, f.backend.port),
                    idle_timeout: Some(t),
                    ..Decision::pass()
                });
            }
        }
        let Some(svc) = self.service_of(&key) else {
            return Ok(match self.cfg.non_vip {
                NonVipAction::Pass => Decision::pass(),
                NonVipAction::Drop => Decision::drop("lb-not-vip"),
            });
        };
        if pkt.meta.icmp_error {
            // An error about a flow we never balanced: there is no backend to send it to,
            // and creating state for it would pin a flow that does not exist.
            debug!(%key, "lb: ICMP error for an unknown flow");
            return Ok(Decision {
                idle_timeout: Some(SHORT_DROP_HOLD),
                ..Decision::drop("lb-icmp-unrelated")
            });
        }
        let Some(backend) = svc
            .table
            .lookup(maglev::flow_slot_hash(key.hash(), self.cfg.seed))
        else {
            debug!(%key, "lb: service has no active backend");
            return Ok(Decision {
                idle_timeout: Some(SHORT_DROP_HOLD),
                ..Decision::drop("lb-no-backend")
            });
        };
        let (vip, port) = (svc.vip, svc.port);
        let t = self.timeout(&key, false);
        self.insert(
            key,
            LbFlow {
                backend,
                deadline_ms: env.now_ms.saturating_add(t.as_millis() as u64),
                closing: false,
            },
        )?;
        debug!(%key, %backend, "lb: new flow");
        Ok(Self::forward_decision(vip, port, &backend, t))
    }

    fn on_event(&mut self, ev: &FlowEvent, env: &mut NfEnv) {
        match ev {
            FlowEvent::TcpClosing { key } | FlowEvent::Active { key } => {
                let closing = matches!(ev, FlowEvent::TcpClosing { .. });
                let Some((fwd, f)) = (self.flow(key).map(|f| (*key, f)))
                    .or_else(|| self.reply_to(key).and_then(|k| Some((k, self.flow(&k)?))))
                else {
                    return;
                };
                let f = LbFlow {
                    closing: f.closing || closing,
                    deadline_ms: 0,
                    ..f
                };
                let t = self.timeout(&fwd, f.closing);
                let f = LbFlow {
                    deadline_ms: env.now_ms.saturating_add(t.as_millis() as u64),
                    ..f
                };
                if let Err(e) = self.insert(fwd, f) {
                    warn!(%fwd, error = %e, "lb: conntrack refused an update");
                }
            }
            // PP forgetting one direction's rule does not end the flow (the other
            // direction may still be busy); the entry's own deadline governs. The LB
            // times TCP alike before and after the handshake.
            FlowEvent::Expired { .. } | FlowEvent::TcpEstablished { .. } => {}
            // Traffic counts are the monitor's; they change no connection state.
            FlowEvent::Counters { .. } => {}
        }
    }

    /// The platform's timer forgets flows past their deadline.
    fn on_timer(&mut self, env: &mut NfEnv) -> Vec<FlowKey> {
        let gone =
            (self.state.expire_flows::<FlowRow>(CONNTRACK, env.now_ms)).unwrap_or_else(|e| {
                warn!(error = %e, "lb: conntrack timer");
                Vec::new()
            });
        gone.into_iter().map(|(k, _)| k).collect()
    }

    /// The platform's restore (or a version-1 JSON snapshot of an older build), then
    /// the services compiled from the snapshot's configuration; a snapshot that fails
    /// either changes nothing.
    fn restore(&mut self, snapshot: &[u8]) -> Result<(), NfError> {
        let next = Self::tables_from(snapshot)?;
        let cfg: String = (next.get(SERVICES, &CONFIG))
            .map_err(|e| NfError::Snapshot(format!("lb: {e}")))?
            .ok_or_else(|| NfError::Snapshot("lb: the snapshot has no configuration".into()))?;
        let cfg: LbConfig =
            serde_json::from_str(&cfg).map_err(|e| NfError::Snapshot(format!("lb: {e}")))?;
        let services = compile(&cfg)
            .map_err(|e| NfError::Snapshot(format!("lb: configuration in snapshot: {e}")))?;
        self.vips_of = vips_of(&services);
        (self.cfg, self.services, self.state) = (cfg, services, next);
        self.tables_changed();
        Ok(())
    }

    /// The platform's decoder, which also takes a version-1 JSON part of an older build.
    fn merge_decoder(&self) -> nf::MergeDecoder {
        let ours = self.state.merge_decoder();
        std::sync::Arc::new(move |b: &[u8]| match b.first() {
            Some(b'{') => ours(&Self::tables_from(b)?.snapshot()?),
            _ => ours(b),
        })
    }

    /// The platform's merge, or a version-1 JSON part of an older build merged the same
    /// way (its configuration is ignored: ours stays).
    fn merge(&mut self, part: &[u8]) -> Result<(), NfError> {
        if part.first() == Some(&b'{') {
            let legacy = Self::tables_from(part)?.snapshot()?;
            let mut next = self.state.clone();
            next.merge(&legacy)?;
            self.state = next;
        } else {
            self.state.merge(part)?;
        }
        self.tables_changed();
        Ok(())
    }
}

impl LoadBalancer {
    /// Platform tables from a snapshot: ours, or a version-1 JSON one.
    fn tables_from(b: &[u8]) -> Result<StateTables, NfError> {
        let mut next = StateTables::create(&Self::specs())?;
        if b.first() != Some(&b'{') {
            next.restore(b)?;
            return Ok(next);
        }
        let snap = LbSnapshot::parse(b)?;
        next.load(SERVICES, &CONFIG, &config_text(&snap.config)?)?;
        for f in snap.flows {
            let row = FlowRow {
                backend: f.backend,
                closing: f.closing,
            };
            next.put_flow(CONNTRACK, &f.key.0, &row)?;
            next.set_timer(CONNTRACK, &f.key.0, f.deadline_ms)?;
        }
        Ok(next)
    }
}

fn config_text(cfg: &LbConfig) -> Result<String, NfError> {
    serde_json::to_string(cfg).map_err(|e| NfError::Config(format!("lb: {e}")))
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct LbSnapshot {
    version: u32,
    config: LbConfig,
    flows: Vec<FlowSnap>,
}

impl LbSnapshot {
    fn parse(b: &[u8]) -> Result<Self, NfError> {
        let s: LbSnapshot =
            serde_json::from_slice(b).map_err(|e| NfError::Snapshot(format!("lb: {e}")))?;
        if s.version != SNAPSHOT_VERSION {
            return Err(NfError::Snapshot(format!(
                "lb: snapshot version {} (this build reads {SNAPSHOT_VERSION})",
                s.version
            )));
        }
        Ok(s)
    }
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FlowSnap {
    key: HexKey,
    backend: BackendId,
    deadline_ms: u64,
    closing: bool,
}

/// A `FlowKey` in snapshots: its 40 canonical bytes (as hex in JSON), so it round-trips
/// exactly (the display form would not for odd protocol numbers or ICMP identifiers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct HexKey(pub FlowKey);

impl Serialize for HexKey {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if !s.is_human_readable() {
            return crate::codec::serialize_key_bytes(&self.0, s);
        }
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = String::with_capacity(FlowKey::LEN * 2);
        for b in self.0.as_bytes() {
            out.push(HEX[(b >> 4) as usize] as char);
            out.push(HEX[(b & 15) as usize] as char);
        }
        s.serialize_str(&out)
    }
}

impl<'de> Deserialize<'de> for HexKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if !d.is_human_readable() {
            return crate::codec::deserialize_key_bytes(d).map(HexKey);
        }
        let s = String::deserialize(d)?;
        let bad = || serde::de::Error::custom(format!("flow key {s:?}: want 80 hex digits"));
        let raw = s.as_bytes();
        if raw.len() != FlowKey::LEN * 2 {
            return Err(bad());
        }
        let nib = |c: u8| (c as char).to_digit(16).map(|v| v as u8);
        let mut bytes = [0u8; FlowKey::LEN];
        for (i, b) in bytes.iter_mut().enumerate() {
            match (nib(raw[2 * i]), nib(raw[2 * i + 1])) {
                (Some(h), Some(l)) => *b = (h << 4) | l,
                _ => return Err(bad()),
            }
        }
        Ok(HexKey(FlowKey::from_bytes(bytes)))
    }
}
