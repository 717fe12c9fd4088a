//! Nodes and reconciliation: the `Control` gRPC service every PP, FM and SC node keeps
//! a session with, the table of nodes it builds from their reports, and the directives
//! it pushes to them.
//!
//! Reconciliation is level-triggered: a *generation* counter moves whenever anything a
//! directive depends on may have changed (an API write, the store's revision moving
//! under another writer, an FM coming or going). Every session then recomputes its
//! node's complete directive from the desired state and the live nodes, and sends it
//! only if it differs from the last one sent. A node that reconnects simply gets the
//! current directive again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proto::v1::{self, control_server::Control, node_down, node_up};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn};

use crate::desired::{chain_defs, Desired, Snapshot};
use crate::model::Node;

/// Orchestrator settings.
#[derive(Debug, Clone)]
pub struct OrchestratorConfig {
    pub id: String,
    /// How often nodes report.
    pub report_interval: Duration,
    /// Silent report periods before a node is marked down.
    pub miss_limit: u32,
    pub admin_token: String,
    /// How often the store's revision is polled for changes made by other writers.
    pub store_poll: Duration,
    /// Where tenants' shards go (docs/placement.md).
    pub placement: crate::placement::PlacementConfig,
    /// Plane security: mTLS with the CA kept in the store, or plaintext.
    pub security: Security,
    /// The orchestrator's own certificate (role `orchestrator`) for its control server
    /// and its calls to FMs; set by [`crate::start`] under [`Security::Tls`].
    pub tls: Option<Arc<proto::tls::NodeTls>>,
    /// The CA, join tokens and revocations; set by [`crate::start`] under
    /// [`Security::Tls`].
    pub pki: Option<Arc<crate::pki::Pki>>,
    /// Reusable bootstrap tokens, by role (`--bootstrap-token ROLE=FILE`; see
    /// [`crate::pki`]).
    pub bootstrap_tokens: Vec<(proto::tls::Role, String)>,
}

/// Whether the planes speak mTLS (docs/security.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Security {
    /// Plaintext: `--insecure`, lab use only.
    Insecure,
    /// mTLS; node certificates live this long.
    Tls { cert_ttl: Duration },
}

impl OrchestratorConfig {
    pub fn new(admin_token: &str) -> Self {
        OrchestratorConfig {
            id: "orchestrator-1".into(),
            report_interval: Duration::from_millis(500),
            miss_limit: 3,
            admin_token: admin_token.to_string(),
            store_poll: Duration::from_secs(1),
            placement: crate::placement::PlacementConfig::default(),
            // In-process harnesses say which they want; `starfabric orchestrator`
            // defaults to Tls and takes --insecure.
            security: Security::Insecure,
            tls: None,
            pki: None,
            bootstrap_tokens: Vec::new(),
        }
    }
}

/// One registered node.
#[derive(Debug, Clone)]
pub struct NodeEntry {
    pub hello: v1::NodeHello,
    pub session: u64,
    pub up: bool,
    pub last_report: Instant,
    pub report: Option<v1::NodeReport>,
    pub desired_version: u64,
}

impl NodeEntry {
    pub fn info(&self) -> v1::NodeInfo {
        self.hello.node.clone().unwrap_or_default()
    }

    pub fn role(&self) -> v1::Role {
        v1::Role::try_from(self.info().role).unwrap_or(v1::Role::Unspecified)
    }

    pub fn to_api(&self, now: Instant) -> Node {
        let info = self.info();
        let r = self.report.clone().unwrap_or_default();
        let load = r.load.unwrap_or_default();
        Node {
            id: info.id,
            role: match self.role() {
                v1::Role::Pp => "pp",
                v1::Role::Fm => "fm",
                v1::Role::Sc => "sc",
                v1::Role::Unspecified => "unknown",
            }
            .into(),
            addr: info.addr,
            cluster: self.hello.cluster.clone(),
            metrics_url: self.hello.metrics_url.clone(),
            version: self.hello.version.clone(),
            status: if self.up { "up" } else { "down" }.into(),
            ready: self.up && self.report.is_some() && r.ready,
            detail: r.detail,
            last_report_ms: now.duration_since(self.last_report).as_millis() as u64,
            packets_per_s: load.packets_per_s,
            requests_per_s: load.requests_per_s,
            flows: load.flows,
            groups: load.groups,
            applied_version: r.applied_version,
            desired_version: self.desired_version,
        }
    }
}

/// State shared by the REST API and the control sessions.
pub struct Shared {
    pub cfg: OrchestratorConfig,
    pub desired: Desired,
    pub nodes: Mutex<HashMap<String, NodeEntry>>,
    generation: watch::Sender<u64>,
    snapshot: tokio::sync::Mutex<Option<(u64, Arc<Snapshot>)>>,
    next_session: std::sync::atomic::AtomicU64,
    pub started: Instant,
    /// The placement engine; one pass at a time.
    pub placement: tokio::sync::Mutex<crate::placement::Engine>,
    /// The orchestrator's own recent events (placement decisions), for `/v1/events`.
    pub events: crate::events::EventRing,
}

impl Shared {
    pub fn new(cfg: OrchestratorConfig, desired: Desired) -> Arc<Self> {
        let engine = crate::placement::Engine::new(cfg.placement.clone());
        Arc::new(Shared {
            cfg,
            desired,
            placement: tokio::sync::Mutex::new(engine),
            nodes: Mutex::new(HashMap::new()),
            generation: watch::channel(0).0,
            snapshot: tokio::sync::Mutex::new(None),
            next_session: std::sync::atomic::AtomicU64::new(1),
            started: Instant::now(),
            events: Default::default(),
        })
    }

    /// Something directives depend on may have changed: every session re-derives.
    pub fn bump(&self) {
        self.generation.send_modify(|g| *g += 1);
    }

    /// Wakes on every [`Shared::bump`].
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    fn nodes(&self) -> std::sync::MutexGuard<'_, HashMap<String, NodeEntry>> {
        self.nodes.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn node_list(&self) -> Vec<NodeEntry> {
        let mut v: Vec<NodeEntry> = self.nodes().values().cloned().collect();
        v.sort_by_key(|n| (n.role() as i32, n.info().id));
        v
    }

    /// PP clusters with a node up (for placing new tenants).
    pub fn pp_clusters(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .nodes()
            .values()
            .filter(|n| n.up && n.role() == v1::Role::Pp)
            .map(|n| n.hello.cluster.clone())
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// PP clusters with a node up and their forwarding capacity B(c) in Gbit/s: the
    /// sum of their live nodes' stated bandwidth (`default_bw` for a node stating none).
    pub fn pp_cluster_capacity(&self, default_bw: f64) -> Vec<(String, f64)> {
        let mut m: std::collections::BTreeMap<String, f64> = Default::default();
        for n in self
            .nodes()
            .values()
            .filter(|n| n.up && n.role() == v1::Role::Pp)
        {
            let bw = n.hello.capacity.map(|c| c.bw_gbps).unwrap_or(0.0);
            *m.entry(n.hello.cluster.clone()).or_default() +=
                if bw > 0.0 { bw } else { default_bw };
        }
        m.into_iter().collect()
    }

    /// Addresses of the FMs that are up, by node id.
    pub fn fm_addrs(&self) -> Vec<String> {
        let mut v: Vec<(String, String)> = self
            .nodes()
            .values()
            .filter(|n| n.up && n.role() == v1::Role::Fm)
            .map(|n| (n.info().id, n.info().addr))
            .collect();
        v.sort();
        v.into_iter().map(|(_, a)| a).collect()
    }

    /// The desired state at the current generation (read once per generation).
    pub async fn snapshot(&self) -> Result<Arc<Snapshot>, crate::error::ApiError> {
        let generation = *self.generation.borrow();
        let mut cached = self.snapshot.lock().await;
        if let Some((g, s)) = cached.as_ref() {
            if *g == generation {
                return Ok(s.clone());
            }
        }
        let s = Arc::new(self.desired.snapshot().await?);
        *cached = Some((generation, s.clone()));
        Ok(s)
    }

    /// The complete directive for `node` (version left 0; the session numbers it).
    pub fn directive(&self, node: &NodeEntry, snap: &Snapshot) -> v1::Directive {
        let mut d = v1::Directive {
            fm_addrs: self.fm_addrs(),
            revoked: self
                .cfg
                .pki
                .as_ref()
                .map(|p| p.revoked())
                .unwrap_or_default(),
            ..Default::default()
        };
        match node.role() {
            v1::Role::Fm => {
                for def in chain_defs(snap) {
                    match def.to_proto() {
                        Ok(c) => {
                            d.partitions.push(v1::Partition {
                                tenant: c.tenant,
                                chain: c.chain,
                                hash_lo: 0,
                                hash_hi: u64::MAX,
                                group: 0,
                            });
                            d.chains.push(c);
                        }
                        Err(e) => {
                            warn!(tenant = def.tenant, chain = def.chain, error = %e, "chain not served")
                        }
                    }
                }
                d.shards = crate::placement::shards(snap);
            }
            v1::Role::Pp => {
                for t in &snap.tenants {
                    let bound = d.vpcs.len();
                    for v in snap.vpcs.iter().filter(|v| {
                        v.tenant == t.name
                            && crate::placement::vpc_cluster(snap, t, &v.name) == node.hello.cluster
                    }) {
                        if let Some(c) = snap
                            .chains
                            .iter()
                            .find(|c| c.tenant == t.name && c.vpc == v.name)
                        {
                            d.vpcs.push(v1::VpcBinding {
                                vni: v.vni,
                                tenant: t.id,
                                chain: c.id,
                            });
                        }
                    }
                    // IPsec tunnels go where their VPC is (a VPC with no chain too).
                    for tun in snap.ipsec.iter().filter(|x| x.tenant == t.name) {
                        let on_node = snap.vpcs.iter().any(|v| {
                            v.tenant == t.name
                                && v.vni == tun.spec.vni
                                && crate::placement::vpc_cluster(snap, t, &v.name)
                                    == node.hello.cluster
                        });
                        if on_node {
                            match ipsec_tunnel(t.id, tun) {
                                Ok(x) => d.ipsec.push(x),
                                Err(e) => {
                                    warn!(tenant = %t.name, tunnel = %tun.name, error = %e, "IPsec tunnel not served")
                                }
                            }
                        }
                    }
                    // Rates apply where the tenant's traffic is: the PP nodes its VPCs
                    // are bound on (each node enforces them locally, §7.2).
                    if let (Some(r), true) = (&t.rates, d.vpcs.len() > bound) {
                        let spec = |s: &Option<crate::model::RateSpec>| {
                            s.map(|s| v1::RateSpec {
                                min: s.min,
                                base: s.base,
                                burst: s.burst,
                                debt: s.debt,
                            })
                        };
                        d.rates.push(v1::TenantRate {
                            tenant: t.id,
                            requests: spec(&r.requests),
                            packets: spec(&r.packets),
                        });
                    }
                }
                d.vpcs.sort_by_key(|b| b.vni);
            }
            _ => {}
        }
        d
    }

    fn mark_down(&self, id: &str, session: u64, why: &str) {
        let was_fm = {
            let mut nodes = self.nodes();
            match nodes.get_mut(id) {
                Some(n) if n.session == session && n.up => {
                    n.up = false;
                    warn!(node = %id, role = ?n.role(), why, "node down");
                    n.role() == v1::Role::Fm
                }
                _ => return,
            }
        };
        if was_fm {
            self.bump();
        }
    }

    /// Revokes node `id`: recorded in the store, its control session cut here at once,
    /// and pushed with every node's next directive (FM then cuts its sessions).
    pub async fn revoke(&self, id: &str) -> Result<(), crate::error::ApiError> {
        let Some(pki) = &self.cfg.pki else {
            return Err(crate::error::ApiError::unavailable(
                "the planes run --insecure: there are no certificates to revoke",
            ));
        };
        pki.revoke(id).await?;
        if let Some(t) = &self.cfg.tls {
            t.revoke(id);
        }
        self.bump();
        Ok(())
    }

    /// A client of the FM at `addr` (mTLS with the orchestrator's certificate).
    pub async fn fm_client(
        &self,
        addr: &str,
    ) -> Result<v1::fabric_master_client::FabricMasterClient<tonic::transport::Channel>, String>
    {
        let ch = proto::connect(addr, self.cfg.tls.as_ref(), proto::tls::Role::Fm)
            .await
            .map_err(|e| e.to_string())?;
        Ok(v1::fabric_master_client::FabricMasterClient::new(ch)
            .max_decoding_message_size(proto::MAX_MESSAGE))
    }

    /// Background work: mark silent nodes down, and notice writes by other writers.
    pub async fn housekeeping(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.cfg.report_interval.min(self.cfg.store_poll));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_rev = None;
        let mut last_poll = Instant::now();
        loop {
            tick.tick().await;
            let limit = self.cfg.report_interval * self.cfg.miss_limit;
            let silent: Vec<(String, u64)> = self
                .nodes()
                .iter()
                .filter(|(_, n)| n.up && n.last_report.elapsed() > limit)
                .map(|(id, n)| (id.clone(), n.session))
                .collect();
            for (id, s) in silent {
                self.mark_down(&id, s, "stopped reporting");
            }
            if last_poll.elapsed() >= self.cfg.store_poll {
                last_poll = Instant::now();
                match self.desired.store().revision().await {
                    Ok(r) => {
                        if last_rev.is_some_and(|l| l != r) {
                            debug!(revision = r, "store changed");
                            self.bump();
                        }
                        last_rev = Some(r);
                    }
                    Err(e) => warn!(error = %e, "store revision poll failed"),
                }
            }
        }
    }
}

/// The `Control` gRPC service.
pub struct ControlService {
    pub shared: Arc<Shared>,
}

fn check_hello(h: &v1::NodeHello) -> Result<(), Box<Status>> {
    let info = h
        .node
        .as_ref()
        .ok_or_else(|| Box::new(Status::invalid_argument("hello without node info")))?;
    if info.id.is_empty() {
        return Err(Box::new(Status::invalid_argument("empty node id")));
    }
    if info.id.len() > 128 {
        return Err(Box::new(Status::invalid_argument(
            "node id longer than 128 bytes",
        )));
    }
    match v1::Role::try_from(info.role) {
        Ok(v1::Role::Pp | v1::Role::Fm | v1::Role::Sc) => {}
        _ => {
            return Err(Box::new(Status::invalid_argument(format!(
                "bad role {}",
                info.role
            ))))
        }
    }
    if info.proto_version != proto::PROTO_VERSION {
        return Err(Box::new(Status::failed_precondition(format!(
            "protocol version {} (orchestrator speaks {})",
            info.proto_version,
            proto::PROTO_VERSION
        ))));
    }
    Ok(())
}

#[tonic::async_trait]
impl Control for ControlService {
    type NodeSessionStream = UnboundedReceiverStream<Result<v1::NodeDown, Status>>;

    async fn node_session(
        &self,
        req: Request<Streaming<v1::NodeUp>>,
    ) -> Result<Response<Self::NodeSessionStream>, Status> {
        let shared = self.shared.clone();
        let tls = shared.cfg.tls.clone();
        let peer = proto::tls::authorize(&req, tls.as_deref(), &proto::tls::Role::NODES)?;
        let mut inbound = req.into_inner();
        let hello = match inbound.message().await? {
            Some(v1::NodeUp {
                msg: Some(node_up::Msg::Hello(h)),
            }) => h,
            _ => return Err(Status::invalid_argument("a session starts with hello")),
        };
        check_hello(&hello).map_err(|e| *e)?;
        if tls.is_some() {
            // The certificate names who the node is: it cannot say hello as another.
            let n = hello.node.clone().unwrap_or_default();
            if n.id != peer.id || proto::role_name(n.role) != peer.role.as_str() {
                return Err(Status::permission_denied(format!(
                    "certificate of {peer} cannot say hello as {} {:?}",
                    proto::role_name(n.role),
                    n.id
                )));
            }
        }
        let mut hello = hello;
        if hello.cluster.is_empty()
            && hello.node.as_ref().map(|n| n.role) == Some(v1::Role::Pp as i32)
        {
            hello.cluster = "default".into();
        }
        let session = shared
            .next_session
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = hello
            .node
            .as_ref()
            .map(|n| n.id.clone())
            .unwrap_or_default();
        let role = hello.node.as_ref().map(|n| n.role).unwrap_or_default();
        {
            let mut nodes = shared.nodes();
            let desired_version = nodes.get(&id).map_or(0, |n| n.desired_version);
            nodes.insert(
                id.clone(),
                NodeEntry {
                    hello: hello.clone(),
                    session,
                    up: true,
                    last_report: Instant::now(),
                    report: None,
                    desired_version,
                },
            );
        }
        info!(node = %id, role = proto::role_name(role), cluster = %hello.cluster,
              metrics = %hello.metrics_url, "node registered");
        // A new FM changes every node's directive; anything else only its own.
        shared.bump();
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(Ok(v1::NodeDown {
            msg: Some(node_down::Msg::Welcome(v1::ControlWelcome {
                orchestrator_id: shared.cfg.id.clone(),
                report_ms: shared.cfg.report_interval.as_millis() as u32,
                miss_limit: shared.cfg.miss_limit,
            })),
        }));
        tokio::spawn(run_session(shared, id, session, inbound, tx));
        Ok(Response::new(UnboundedReceiverStream::new(rx)))
    }
}

async fn run_session(
    shared: Arc<Shared>,
    id: String,
    session: u64,
    mut inbound: Streaming<v1::NodeUp>,
    tx: mpsc::UnboundedSender<Result<v1::NodeDown, Status>>,
) {
    let mut gen = shared.generation.subscribe();
    gen.mark_changed();
    let mut last_sent: Option<v1::Directive> = None;
    let why = loop {
        tokio::select! {
            m = inbound.message() => match m {
                Ok(Some(v1::NodeUp { msg: Some(node_up::Msg::Report(r)) })) => {
                    let mut nodes = shared.nodes.lock().unwrap_or_else(|e| e.into_inner());
                    match nodes.get_mut(&id) {
                        Some(n) if n.session == session => {
                            let came_back = !n.up;
                            n.up = true;
                            if !r.metrics_url.is_empty() {
                                n.hello.metrics_url = r.metrics_url.clone();
                            }
                            n.last_report = Instant::now();
                            n.report = Some(r);
                            if came_back {
                                info!(node = %id, "node reporting again");
                                drop(nodes);
                                shared.bump();
                            }
                        }
                        _ => break "superseded by a newer session",
                    }
                }
                Ok(Some(_)) => break "unexpected message",
                Ok(None) => break "session closed",
                Err(e) => {
                    debug!(node = %id, error = %e, "control session error");
                    break "session broken";
                }
            },
            changed = gen.changed() => {
                if changed.is_err() {
                    break "orchestrator stopping";
                }
                let snap = match shared.snapshot().await {
                    Ok(s) => s,
                    Err(e) => {
                        warn!(error = %e, "cannot read desired state; directive not updated");
                        continue;
                    }
                };
                let entry = shared.nodes.lock().unwrap_or_else(|e| e.into_inner()).get(&id).cloned();
                let Some(entry) = entry.filter(|e| e.session == session) else {
                    break "superseded by a newer session";
                };
                let mut d = shared.directive(&entry, &snap);
                let same = last_sent.as_ref().is_some_and(|l| {
                    let mut l = l.clone();
                    l.version = 0;
                    l == d
                });
                if same {
                    continue;
                }
                let version = {
                    let mut nodes = shared.nodes.lock().unwrap_or_else(|e| e.into_inner());
                    let Some(n) = nodes.get_mut(&id) else { break "forgotten" };
                    n.desired_version += 1;
                    n.desired_version
                };
                d.version = version;
                debug!(node = %id, version, chains = d.chains.len(), vpcs = d.vpcs.len(),
                       fms = d.fm_addrs.len(), "pushing directive");
                if tx.send(Ok(v1::NodeDown { msg: Some(node_down::Msg::Directive(d.clone())) })).is_err() {
                    break "session closed";
                }
                last_sent = Some(d);
            }
        }
    };
    shared.mark_down(&id, session, why);
}

/// A stored IPsec tunnel as PP takes it.
fn ipsec_tunnel(tenant: u32, t: &crate::model::IpsecTunnel) -> Result<v1::IpsecTunnel, String> {
    let sa = |s: &crate::model::IpsecSaSpec| -> Result<v1::IpsecSa, String> {
        Ok(v1::IpsecSa {
            spi: s.spi,
            keymat: crate::desired::keymat(&s.key)?,
        })
    };
    let spec = &t.spec;
    Ok(v1::IpsecTunnel {
        name: format!("{}/{}", t.tenant, t.name),
        tenant,
        vni: spec.vni,
        peer: spec.peer.clone(),
        local_prefixes: spec.local_prefixes.clone(),
        remote_prefixes: spec.remote_prefixes.clone(),
        vtep: spec.vtep.clone(),
        vm_mac: proto::parse_mac(&spec.vm_mac)
            .map_err(|e| e.to_string())?
            .to_vec(),
        outbound: Some(sa(&spec.outbound)?),
        inbound: spec.inbound.iter().map(sa).collect::<Result<_, _>>()?,
        esn: spec.esn,
        replay_window: spec.replay_window,
    })
}
