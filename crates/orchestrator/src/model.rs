//! The API's resources, as the REST API reads and writes them and as the store keeps
//! them (JSON). A `…Spec` is what a client PUTs; the resource adds what the
//! orchestrator assigns (ids, the PP cluster) and the store revision.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Largest VNI (24 bits); 0 is reserved.
pub const MAX_VNI: u32 = (1 << 24) - 1;

/// A tenant: the unit of isolation. Its `id` is the tenant number the data plane uses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Tenant {
    pub name: String,
    /// Data-plane tenant number, assigned at creation, never reused while it exists.
    pub id: u32,
    /// The PP cluster whose nodes carry this tenant's VPCs.
    pub pp_cluster: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// What the tenant asks of the SC tier (paper 000 App. A.1: b, c, m); absent: the
    /// orchestrator's default demand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub demand: Option<Demand>,
    /// The operator named `pp_cluster`: every VPC of the tenant goes there, and RGCM
    /// does not choose.
    #[serde(default)]
    pub pinned_cluster: bool,
    /// Its rates at PP (paper 000 §7.2), set with `PUT /v1/tenants/{tenant}/rates`;
    /// absent: not rate-managed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rates: Option<TenantRatesSpec>,
    /// Store revision of the last change (read-only).
    #[serde(default)]
    pub revision: u64,
}

#[cfg(test)]
impl Tenant {
    /// Tenant `name` numbered `id` on the default PP cluster, with nothing else set: the
    /// unit tests' tenant.
    pub(crate) fn test(name: &str, id: u32) -> Tenant {
        Tenant {
            name: name.into(),
            id,
            pp_cluster: "default".into(),
            labels: Default::default(),
            demand: None,
            pinned_cluster: false,
            rates: None,
            revision: 0,
        }
    }
}

/// Per-second rates of one kind of op at each PP node (paper 000 §7.2, Fig. 6): the
/// tenant is guaranteed `base`, may burst to `burst` while it has credit (earned below
/// `base`), yields down to `min` when idle, and may run `debt` ops into negative credit
/// while the node has spare capacity.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RateSpec {
    #[serde(default)]
    pub min: f64,
    pub base: f64,
    pub burst: f64,
    #[serde(default)]
    pub debt: f64,
}

/// PUT /v1/tenants/{tenant}/rates: new flows (rule requests) per second and packets
/// per second; an absent kind is not managed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TenantRatesSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests: Option<RateSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packets: Option<RateSpec>,
}

/// One tenant's rate manager at one PP node, from its latest report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RateStatus {
    pub node: String,
    /// `requests` or `packets`.
    pub kind: String,
    /// `min`, `base` or `burst` (S_min, S_base, S_burst).
    pub state: String,
    pub credit: f64,
    /// Ops per second the tenant may use until the node's next tick.
    pub allowance: f64,
    pub offered_rate: f64,
    pub admitted_rate: f64,
    /// Ops refused as `rate-limited` since the node started.
    pub refused: u64,
}

/// GET /v1/tenants/{tenant}/rates
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TenantRatesView {
    pub tenant: String,
    pub id: u32,
    /// What is set (empty: not rate-managed).
    pub rates: TenantRatesSpec,
    /// Each PP node's state for it.
    pub status: Vec<RateStatus>,
}

/// A tenant's demand, or a node's capacity, for placement.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Demand {
    /// Gbit/s.
    pub bw_gbps: f64,
    /// Cores.
    pub cpu: f64,
    /// GiB.
    pub mem_gib: f64,
}

impl Demand {
    pub fn to_resources(self) -> ::placement::Resources {
        ::placement::Resources::new(self.bw_gbps, self.cpu, self.mem_gib)
    }

    pub fn from_resources(r: ::placement::Resources) -> Self {
        Demand {
            bw_gbps: r.bw,
            cpu: r.cpu,
            mem_gib: r.mem,
        }
    }
}

/// PUT /v1/tenants/{tenant}
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TenantSpec {
    /// PP cluster to place the tenant on; absent: the orchestrator picks the least
    /// loaded cluster (and keeps it on later PUTs).
    #[serde(default)]
    pub pp_cluster: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Placement demand; absent: keep the current one (the default for a new tenant).
    #[serde(default)]
    pub demand: Option<Demand>,
}

/// A tenant VPC: its traffic reaches PP VXLAN-encapsulated with this VNI.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Vpc {
    pub tenant: String,
    pub name: String,
    pub vni: u32,
    /// The VPC's address prefixes (informational; NF configurations name their own).
    #[serde(default)]
    pub cidrs: Vec<String>,
    #[serde(default)]
    pub revision: u64,
}

/// PUT /v1/tenants/{tenant}/vpcs/{vpc}
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VpcSpec {
    /// 1..=16777215, unique across all tenants.
    pub vni: u32,
    #[serde(default)]
    pub cidrs: Vec<String>,
}

/// The NF kinds the platform builds in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum NfKind {
    Snat,
    Lb,
    Fw,
    Monitor,
    /// The per-host connection limiter (`nfs::connlimit`).
    ConnLimit,
    /// A consumer's PrivateLink endpoints (`nfs::privatelink`, docs/privatelink.md).
    PrivateLink,
}

impl NfKind {
    pub fn name(self) -> &'static str {
        match self {
            NfKind::Snat => "snat",
            NfKind::Lb => "lb",
            NfKind::Fw => "fw",
            NfKind::Monitor => "monitor",
            NfKind::ConnLimit => "connlimit",
            NfKind::PrivateLink => "privatelink",
        }
    }
}

/// An NF instance of a tenant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct NfInstance {
    pub tenant: String,
    pub name: String,
    pub kind: NfKind,
    /// The configuration as given (see [`NfSpec`]).
    #[schema(value_type = Object)]
    pub config: serde_json::Value,
    #[serde(default)]
    pub revision: u64,
}

/// PUT /v1/tenants/{tenant}/nfs/{nf}
///
/// `config` is the NF's configuration, checked by building the NF:
/// - `snat`: `{"pools": [{"addresses": ["198.18.100.1"], "ports": {"lo": 1024, "hi": 65535},
///   "mapping": "endpoint-independent", "sources": ["198.19.0.0/16"]}], "timeouts": {...}}`
/// - `lb`: `{"services": [{"vip": "198.19.0.100", "port": 80, "protocol": "tcp",
///   "backends": [{"addr": "198.19.1.7", "port": 8080}]}], "table_size": 65537}`
/// - `fw`: the tenant's own ACL, `{"rules": [{"action": "deny", "proto": "tcp",
///   "dport": 23}], "default_action": "allow", "timeouts": {...}}`
/// - `monitor`: `{"max_hosts": 65536}`
/// - `connlimit`: `{"limit": 64, "idle_timeout_s": 300}`
/// - `privatelink`: `{"endpoints": ["web"]}`, names of the tenant's PrivateLink endpoints;
///   stored resolved into the endpoints' services (docs/privatelink.md)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NfSpec {
    pub kind: NfKind,
    #[serde(default = "empty_object")]
    #[schema(value_type = Object)]
    pub config: serde_json::Value,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(Default::default())
}

/// A chain of a tenant's NFs bound to one of its VPCs: PP runs it as one composed rule
/// per flow and direction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Chain {
    pub tenant: String,
    pub name: String,
    /// Data-plane chain number within the tenant, assigned at creation.
    pub id: u32,
    pub vpc: String,
    /// NF instance names, in order.
    pub nfs: Vec<String>,
    /// Shape over `nfs` indices (absent: each in order); see docs/nf-api.md.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub spec: Option<proto::StepDef>,
    #[schema(value_type = Object)]
    pub forward: proto::EgressDef,
    #[schema(value_type = Object)]
    pub reverse: proto::EgressDef,
    #[serde(default)]
    pub revision: u64,
}

/// PUT /v1/tenants/{tenant}/chains/{chain}
///
/// `forward`/`reverse`: how the chain's rules leave PP, e.g.
/// `{"decap": true, "encap": {"dst": "198.18.0.9", "vni": 200}, "output": 0}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChainSpec {
    pub vpc: String,
    pub nfs: Vec<String>,
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub spec: Option<proto::StepDef>,
    #[serde(default)]
    #[schema(value_type = Object)]
    pub forward: proto::EgressDef,
    #[serde(default)]
    #[schema(value_type = Object)]
    pub reverse: proto::EgressDef,
}

/// POST /v1/apply: objects written all together or not at all (one store txn). Items
/// are applied in order, so a chain may name a VPC and NFs created earlier in the list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ApplyRequest {
    pub items: Vec<ApplyItem>,
}

/// One object of an [`ApplyRequest`]: the body its own PUT would take, and its path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ApplyItem {
    Tenant {
        name: String,
        spec: TenantSpec,
    },
    Vpc {
        tenant: String,
        name: String,
        spec: VpcSpec,
    },
    Nf {
        tenant: String,
        name: String,
        spec: NfSpec,
    },
    Chain {
        tenant: String,
        name: String,
        spec: ChainSpec,
    },
}

impl ApplyItem {
    /// `kind/tenant/name` (`tenant/name` for a tenant), as the CLI prints objects.
    pub fn path(&self) -> String {
        match self {
            ApplyItem::Tenant { name, .. } => format!("tenant/{name}"),
            ApplyItem::Vpc { tenant, name, .. } => format!("vpc/{tenant}/{name}"),
            ApplyItem::Nf { tenant, name, .. } => format!("nf/{tenant}/{name}"),
            ApplyItem::Chain { tenant, name, .. } => format!("chain/{tenant}/{name}"),
        }
    }
}

/// What POST /v1/apply did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ApplyResult {
    /// The store revision of the one write (the current one if nothing changed).
    pub revision: u64,
    pub items: Vec<AppliedItem>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct AppliedItem {
    /// `kind/tenant/name`.
    pub object: String,
    /// `created`, `updated` or `unchanged`.
    pub result: String,
}

/// A node as the orchestrator sees it (observed state; nodes register themselves).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Node {
    pub id: String,
    /// `pp`, `fm` or `sc`.
    pub role: String,
    /// Where peers reach it.
    pub addr: String,
    /// PP: its PP cluster.
    pub cluster: String,
    pub metrics_url: String,
    pub version: String,
    /// `up` or `down`.
    pub status: String,
    /// Up and serving (a PP node with an FM session, an FM with SC groups, ...).
    pub ready: bool,
    pub detail: String,
    /// Milliseconds since its last report.
    pub last_report_ms: u64,
    /// PP: packets received per second, over its last report interval.
    #[serde(default)]
    pub packets_per_s: f64,
    /// PP: rule requests sent to FM per second; SC: requests applied at its groups'
    /// tails per second.
    pub requests_per_s: f64,
    pub flows: u64,
    pub groups: u32,
    /// Directive version it runs / the one it should run.
    pub applied_version: u64,
    pub desired_version: u64,
}

/// A partition of a tenant chain's key space and the SC group owning it, as FM reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Partition {
    pub tenant: String,
    pub chain: String,
    /// Flow-hash range, inclusive, as 16 hex digits.
    pub hash_lo: String,
    pub hash_hi: String,
    pub group: u64,
    pub epoch: u64,
    /// Replica node ids, head first.
    pub replicas: Vec<String>,
    /// The FM that reported it.
    pub fm: String,
}

/// One flow's rule, from FM's rule cache.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Flow {
    pub chain: String,
    /// `VNI PROTO SRC:PORT > DST:PORT`
    pub key: String,
    pub actions: String,
    /// The reverse direction's rule, if it came with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reverse_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reverse_actions: Option<String>,
    pub expires_in_ms: u64,
}

/// Counters of one tenant, summed over the nodes' latest reports.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TenantStats {
    pub tenant: String,
    pub id: u32,
    /// PP: packets, bytes and drops of the tenant's VNIs.
    pub packets: u64,
    pub bytes: u64,
    pub drops: u64,
    /// PP: rules installed for new flows.
    pub flows_set_up: u64,
    /// FM: rule requests.
    pub rule_requests: u64,
    /// SC: requests applied (at the tail).
    pub requests_applied: u64,
    /// Nodes that reported counters for it.
    pub nodes: u32,
    /// PP: its credit state per node and kind (paper 000 §7.2); empty when it has no
    /// rates.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rates: Vec<RateStatus>,
}

/// Packets, bytes and flows a monitor NF counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TrafficCount {
    pub packets: u64,
    pub bytes: u64,
    /// Flows (first packets) the monitor saw.
    pub flows: u64,
}

/// One source host's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct HostTraffic {
    pub host: String,
    pub packets: u64,
    pub bytes: u64,
    pub flows: u64,
}

/// GET /v1/tenants/{tenant}/monitor: what the tenant's monitor NFs counted, summed over
/// its SC groups: every packet and byte PP's counted rules matched (reported by PP per
/// second and when a rule leaves), and the flows SC decided.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TenantMonitor {
    pub tenant: String,
    pub id: u32,
    pub total: TrafficCount,
    /// The top hosts by bytes (at most `top`), by the source address of the rule's key:
    /// the client for requests, the server for replies.
    pub hosts: Vec<HostTraffic>,
    /// Hosts counted one by one, in all.
    pub hosts_total: u64,
    /// Traffic of hosts beyond the monitor's host bound.
    pub overflow: TrafficCount,
    /// SC groups of the tenant, and those whose counters were read.
    pub groups: u32,
    pub groups_read: u32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
}

/// A tenant-scoped API token. `token` is shown once, at creation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Token {
    pub id: String,
    pub tenant: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

/// GET /v1/status
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Status {
    pub orchestrator: String,
    pub version: String,
    /// `embedded` or `etcd`.
    pub store: String,
    pub store_revision: u64,
    pub tenants: u64,
    pub chains: u64,
    pub nodes_up: u64,
    pub nodes_down: u64,
    /// Every node up and ready.
    pub healthy: bool,
    pub nodes: Vec<Node>,
}

/// One event: the orchestrator's own (placement) or one from an FM's event log (scales,
/// node joins and deaths, vIP moves, the autoscaler's decisions). `GET /v1/events`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Event {
    /// `orchestrator`, or the id of the FM whose log it is from.
    pub source: String,
    /// Increasing per source (an FM restarted starts again at 1).
    pub seq: u64,
    pub unix_ms: u64,
    /// snake_case, e.g. `placement_written`, `sc_scale_out_done`, `autoscale_decision`.
    pub kind: String,
    /// The tenant it is about, if any: a tenant token sees only its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    pub message: String,
    #[schema(value_type = Object)]
    pub detail: serde_json::Value,
}

/// `GET /v1/events`: newest first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EventsView {
    pub items: Vec<Event>,
    /// Sources that could not be read (an FM that did not answer).
    #[serde(default)]
    pub errors: Vec<String>,
}

/// A page of a list. Pass `next` as `after` to get the following page.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Page<T> {
    pub items: Vec<T>,
    #[serde(default)]
    pub next: Option<String>,
}

/// The body of every error response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// HTTP status.
    pub status: u16,
    /// Machine-readable: `invalid_json`, `invalid_field`, `not_found`, `conflict`,
    /// `unauthorized`, `forbidden`, `unavailable`, `internal`.
    pub code: String,
    pub message: String,
    /// The request field at fault, when one is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

/// Where the placement engine put a tenant: its shard set of SC nodes (paper 000 §7.1,
/// App. A). Kept at `placements/{tenant}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TenantPlacement {
    pub tenant: String,
    /// SC node ids, sorted: the only nodes FM forms or repairs this tenant's groups on.
    pub sc_nodes: Vec<String>,
    /// The demand reserved when it was placed.
    pub demand: Demand,
    /// The algorithm that chose the set (`ddqn`, `bf`, `ff`; `+repair` after a failure).
    pub algorithm: String,
    /// Shards moved off failed nodes since the tenant was placed.
    #[serde(default)]
    pub moves: u64,
    /// Why the last attempt to change it failed (the set above was kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// PUT /v1/placement/limits: U, G_min, G_max and O. Signed so a negative value is
/// named in a 422 rather than failing to parse.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PlacementLimits {
    /// U, in (0, 1].
    pub threshold: f64,
    pub g_min: i64,
    pub g_max: i64,
    /// O: most SC nodes two tenants may share.
    pub overlap: i64,
}

/// One SC node as the placement engine sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PlacementNode {
    pub id: String,
    pub up: bool,
    pub capacity: Demand,
    pub price: f64,
    /// Reserved by the tenants placed on it.
    pub reserved: Demand,
    pub tenants: Vec<String>,
}

/// One tenant's placement as `starfabric placement show` prints it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TenantPlacementView {
    pub tenant: String,
    pub id: u32,
    pub sc_nodes: Vec<String>,
    pub pp_clusters: Vec<String>,
    pub vpcs: Vec<VpcPlacement>,
    pub demand: Demand,
    pub algorithm: String,
    pub moves: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct VpcPlacement {
    pub vpc: String,
    pub vni: u32,
    pub pp_cluster: String,
}

/// GET /v1/placement
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PlacementView {
    pub limits: PlacementLimits,
    /// The configured algorithm, and what it falls back to.
    pub algorithm: String,
    /// The learned model in use, or why none is.
    pub model: String,
    pub nodes: Vec<PlacementNode>,
    pub tenants: Vec<TenantPlacementView>,
    /// `shared[i][j]`: SC nodes tenants `i` and `j` share (Eq. 6 bounds it by O).
    pub overlap: OverlapMatrix,
    /// Constraints the current placement breaks (nodes down, capacity shrunk).
    pub violations: Vec<String>,
    /// Placement decisions made, and how many fell back to Best Fit.
    pub decisions: u64,
    pub fallbacks: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct OverlapMatrix {
    pub tenants: Vec<String>,
    pub shared: Vec<Vec<usize>>,
}

/// Which PP cluster each of a tenant's VPCs is mapped to (Zeta §VI-A: one cluster per
/// VPC, at most k per tenant). Kept at `vpc-clusters/{tenant}`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct VpcClusters {
    pub tenant: String,
    /// VPC name → PP cluster.
    pub vpcs: BTreeMap<String, String>,
}

/// One ESP SA of an IPsec tunnel (docs/ipsec.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct IpsecSaSpec {
    /// 256..=4294967295 (1..=255 are reserved, RFC 4303 §2.1). Inbound SPIs are unique
    /// across every tunnel of every tenant: PP finds an inbound SA by its SPI.
    pub spi: u32,
    /// The RFC 4106 KEYMAT in hex: the AES-128 or AES-256 key followed by the 4-byte
    /// salt (40 or 72 hex digits, `0x` optional), as `ip xfrm state ... aead
    /// 'rfc4106(gcm(aes))' 0x<KEYMAT> 128` takes it. Write-only: reads show `key_bits`.
    pub key: String,
}

/// PUT /v1/tenants/{tenant}/ipsec/{tunnel}: an IPsec VPN tunnel (ESP tunnel mode,
/// AES-GCM) between a VPC and a remote site. IKE is out of scope: the SAs and keys are
/// set here, and a rekey is a PUT with the new SAs (docs/ipsec.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct IpsecTunnelSpec {
    /// The VNI of one of the tenant's VPCs (another's: 403).
    pub vni: u32,
    /// The remote site's tunnel endpoint (IPv4).
    pub peer: String,
    /// The VPC side's traffic selector (IPv4 prefixes); empty: any source in the VPC.
    #[serde(default)]
    pub local_prefixes: Vec<String>,
    /// The remote site's prefixes: VPC traffic to them goes into the tunnel (1..=16).
    pub remote_prefixes: Vec<String>,
    /// Where decrypted packets go: the VTEP of the VPC's host...
    pub vtep: String,
    /// ...and the MAC of its VXLAN device (`aa:bb:cc:dd:ee:ff`).
    pub vm_mac: String,
    /// The SA PP seals with.
    pub outbound: IpsecSaSpec,
    /// The SAs PP opens with: one, or two while a rekey is under way. An inbound SA left
    /// out of a PUT stays valid at PP for a grace period (30 s), so a rekey loses nothing.
    pub inbound: Vec<IpsecSaSpec>,
    /// Extended (64-bit) sequence numbers (RFC 4303 §2.2.1).
    #[serde(default)]
    pub esn: bool,
    /// The anti-replay window, 64..=4096 packets (default 64).
    #[serde(default = "default_replay_window")]
    pub replay_window: u32,
}

fn default_replay_window() -> u32 {
    64
}

/// An IPsec tunnel as the store holds it (keys included).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IpsecTunnel {
    pub tenant: String,
    pub name: String,
    pub spec: IpsecTunnelSpec,
    #[serde(default)]
    pub revision: u64,
}

/// An SA as reads show it: never its key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct IpsecSaView {
    pub spi: u32,
    pub key_bits: u16,
}

/// One PP node's view of a tunnel, from its latest report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct IpsecNodeStatus {
    pub node: String,
    pub outbound_spi: u32,
    pub outbound_seq: u64,
    pub outbound_packets: u64,
    pub outbound_bytes: u64,
    pub inbound: Vec<IpsecSaStatus>,
    /// Packets of the tunnel dropped (replay, ICV, selectors, too big, ...).
    pub drops: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct IpsecSaStatus {
    pub spi: u32,
    pub packets: u64,
    pub bytes: u64,
    /// No longer configured; valid until its grace period ends.
    pub retiring: bool,
}

/// GET /v1/tenants/{tenant}/ipsec/{tunnel}.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct IpsecTunnelView {
    pub tenant: String,
    pub name: String,
    pub vni: u32,
    pub peer: String,
    pub local_prefixes: Vec<String>,
    pub remote_prefixes: Vec<String>,
    pub vtep: String,
    pub vm_mac: String,
    pub outbound: IpsecSaView,
    pub inbound: Vec<IpsecSaView>,
    pub esn: bool,
    pub replay_window: u32,
    /// Each PP node serving the tunnel, as it last reported.
    pub status: Vec<IpsecNodeStatus>,
    pub revision: u64,
}
