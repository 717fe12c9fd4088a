//! A cluster for tests: an FM (or an active and a standby FM) and SC nodes, all real
//! gRPC on 127.0.0.1 with ephemeral ports. FM runs on a tokio runtime of the test's;
//! each SC node on its own runtime thread ([`sc::ScProcess`]), so killing one looks like
//! a crashed process. Also the flows, chain and PP session the tests drive it with.
//!
//! Every plane link runs mTLS, as production does (docs/security.md): a cluster has
//! its own CA ([`Pki`]) and each node, PP client and test probe a certificate of its
//! role from it. [`Cluster::insecure`] is plaintext, for a test *about* plaintext.

#![allow(dead_code)]

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fm::{FmConfig, FmHandle};
use pipeline::{RuleReply, RuleSource};
use pp::{FmClient, FmClientConfig, WorkerLink};
use proto::tls::{NodeTls, Role};
use proto::{v1, ChainDef};
use sc::{ChainFactory, ScConfig, ScProcess};
pub use testkit::pki::Pki;
use tokio::runtime::Runtime;

pub struct Cluster {
    pub rt: tokio::runtime::Runtime,
    pub fm: FmHandle,
    pub scs: Vec<ScProcess>,
    /// The cluster's CA; `None` for a plaintext cluster ([`Cluster::insecure`]).
    pub pki: Option<Pki>,
    /// FM's own TLS state (rotation and revocation act on it).
    pub fm_tls: Option<Arc<NodeTls>>,
    /// The test's own identities: an FM-role probe for SC nodes' GroupStatus (SC
    /// servers admit SC and FM peers) and an operator for FM's operator services.
    probe: Option<Arc<NodeTls>>,
    operator: Option<Arc<NodeTls>>,
}

pub fn local() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// The runtime FM runs on, with the test's logs set up first: `RUST_LOG=info cargo test
/// ...` shows FM's and SC's logs (repairs, stalls).
pub fn runtime() -> Runtime {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// SC nodes `sc-0` to `sc-{n-1}`, given `fm_addrs` (one FM, or a comma-separated list),
/// each with a certificate from `pki` (plaintext without).
pub fn spawn_scs(
    n: usize,
    fm_addrs: &str,
    factory: Arc<dyn ChainFactory>,
    pki: Option<&Pki>,
) -> Vec<ScProcess> {
    spawn_tuned_scs(n, fm_addrs, factory, pki, |_| {})
}

/// [`spawn_scs`] with each node's config changed by `tune` first.
pub fn spawn_tuned_scs(
    n: usize,
    fm_addrs: &str,
    factory: Arc<dyn ChainFactory>,
    pki: Option<&Pki>,
    tune: impl Fn(&mut ScConfig),
) -> Vec<ScProcess> {
    let cpus = sc::workers::allowed_cpus();
    (0..n)
        .map(|i| {
            let id = format!("sc-{i}");
            let mut c = ScConfig::new(&id, local(), fm_addrs);
            c.tls = pki.map(|p| p.node(Role::Sc, &id));
            c.worker_cpus = Some(sc::workers::rotated(&cpus, i));
            tune(&mut c);
            ScProcess::spawn(c, factory.clone()).unwrap()
        })
        .collect()
}

/// Scale tenant 1's chain 1 out by one group (FM picks the group to split) and check
/// that the scale finished.
pub fn scale_out(rt: &Runtime, fm: &FmHandle) -> fm::ScaleOutcome {
    let out = rt
        .block_on(fm.scale(fm::ScaleRequest::Out {
            tenant: 1,
            chain: 1,
            group: None,
            migration: None,
        }))
        .unwrap();
    assert_eq!(out.aborted, None);
    out
}

/// Wait until `fm`'s map has `chains` groups, each of `replicas`.
pub fn wait_groups(
    rt: &Runtime,
    fm: &FmHandle,
    chains: usize,
    replicas: usize,
) -> v1::PartitionMap {
    wait(Duration::from_secs(10), "SC groups", || {
        let m = rt.block_on(fm.partition_map())?;
        (m.groups.len() == chains && m.groups.iter().all(|g| g.replicas.len() == replicas))
            .then_some(m)
    })
}

impl Cluster {
    pub fn start(chains: Vec<ChainDef>, n_sc: usize, factory: Arc<dyn ChainFactory>) -> Cluster {
        Self::start_with(
            FmConfig {
                chains,
                ..FmConfig::default()
            },
            n_sc,
            factory,
        )
    }

    pub fn start_with(cfg: FmConfig, n_sc: usize, factory: Arc<dyn ChainFactory>) -> Cluster {
        Self::start_tuned(cfg, n_sc, factory, |_| {})
    }

    /// [`Cluster::start_with`] with each SC node's config changed by `tune` first.
    pub fn start_tuned(
        cfg: FmConfig,
        n_sc: usize,
        factory: Arc<dyn ChainFactory>,
        tune: impl Fn(&mut ScConfig),
    ) -> Cluster {
        Self::launch(Some(Pki::new()), cfg, n_sc, factory, tune)
    }

    /// [`Cluster::start_with`] in plaintext (`--insecure`): only for a test about
    /// plaintext itself.
    pub fn insecure(cfg: FmConfig, n_sc: usize, factory: Arc<dyn ChainFactory>) -> Cluster {
        Self::launch(None, cfg, n_sc, factory, |_| {})
    }

    fn launch(
        pki: Option<Pki>,
        mut cfg: FmConfig,
        n_sc: usize,
        factory: Arc<dyn ChainFactory>,
        tune: impl Fn(&mut ScConfig),
    ) -> Cluster {
        let rt = runtime();
        cfg.tls = pki.as_ref().map(|p| p.node(Role::Fm, &cfg.fm_id));
        let fm_tls = cfg.tls.clone();
        let fm = rt.block_on(fm::start(cfg, local())).unwrap();
        let scs = spawn_tuned_scs(n_sc, &fm.addr().to_string(), factory, pki.as_ref(), tune);
        Cluster {
            rt,
            fm,
            scs,
            probe: pki.as_ref().map(|p| p.node(Role::Fm, "fm-probe")),
            operator: pki
                .as_ref()
                .map(|p| p.node(Role::Operator, "operator-test")),
            pki,
            fm_tls,
        }
    }

    pub fn fm_addr(&self) -> String {
        self.fm.addr().to_string()
    }

    /// Node `id`'s TLS state as `role`, from the cluster's CA (`None` in plaintext).
    pub fn node_tls(&self, role: Role, id: &str) -> Option<Arc<NodeTls>> {
        self.pki.as_ref().map(|p| p.node(role, id))
    }

    /// PP node `id`'s FM client config for this cluster's FM, with its certificate.
    pub fn pp_config(&self, id: &str) -> FmClientConfig {
        pp_config(self.pki.as_ref(), &self.fm_addr(), id)
    }

    /// A FabricMaster client to FM `addr` as an operator (FM's operator services admit
    /// the operator and orchestrator roles only).
    pub async fn fm_operator(
        &self,
        addr: &str,
    ) -> v1::fabric_master_client::FabricMasterClient<tonic::transport::Channel> {
        fm_operator(self.operator.as_ref(), addr).await
    }

    /// The operator identity [`Cluster::fm_operator`] dials with, for a test's own
    /// thread.
    pub fn operator_tls(&self) -> Option<Arc<NodeTls>> {
        self.operator.clone()
    }

    pub fn map(&self) -> v1::PartitionMap {
        self.rt.block_on(self.fm.partition_map()).unwrap()
    }

    pub fn stats(&self) -> fm::FmStats {
        self.rt.block_on(self.fm.stats()).unwrap()
    }

    /// Wait until every chain has a group of `replicas`.
    pub fn wait_groups(&self, chains: usize, replicas: usize) -> v1::PartitionMap {
        wait_groups(&self.rt, &self.fm, chains, replicas)
    }

    /// The first chain's one group after [`Cluster::wait_groups`]: its replica ids in
    /// chain order, and an SC node outside it (the spare a replacement comes from).
    pub fn group_and_spare(&self) -> (v1::ScGroup, Vec<String>, String) {
        let map = self.wait_groups(1, 3);
        let group = map.groups[0].clone();
        let order: Vec<String> = group.replicas.iter().map(|r| r.node_id.clone()).collect();
        let spare = (self.scs.iter())
            .map(|s| s.node_id().to_string())
            .find(|n| !order.contains(n))
            .expect("a spare SC node");
        (group, order, spare)
    }

    /// Every group state of SC node `addr`, via its GroupStatus RPC.
    pub fn group_status(&self, addr: SocketAddr, snapshots: bool) -> Vec<v1::GroupState> {
        let req = v1::GroupStatusRequest {
            snapshots,
            ..Default::default()
        };
        group_query(&self.rt, self.probe.as_ref(), addr, req)
    }

    /// Every group state of SC node `addr` with its traffic counters (the monitor's).
    pub fn group_traffic(&self, addr: SocketAddr) -> Vec<v1::GroupState> {
        let req = v1::GroupStatusRequest {
            traffic: true,
            ..Default::default()
        };
        group_query(&self.rt, self.probe.as_ref(), addr, req)
    }
}

/// PP node `id`'s FM client config for `fm_addrs`, with a certificate from `pki`
/// (plaintext without).
pub fn pp_config(pki: Option<&Pki>, fm_addrs: &str, id: &str) -> FmClientConfig {
    let mut c = FmClientConfig::new(fm_addrs, id);
    c.tls = pki.map(|p| p.node(Role::Pp, id));
    c
}

/// A FabricMaster client to FM `addr`, over mTLS as `operator` (plaintext without).
pub async fn fm_operator(
    operator: Option<&Arc<NodeTls>>,
    addr: &str,
) -> v1::fabric_master_client::FabricMasterClient<tonic::transport::Channel> {
    let ch = proto::connect(addr, operator, Role::Fm).await.unwrap();
    v1::fabric_master_client::FabricMasterClient::new(ch)
}

/// SC node `addr`'s answer to a GroupStatus `req`, asked as `probe`.
fn group_query(
    rt: &Runtime,
    probe: Option<&Arc<NodeTls>>,
    addr: SocketAddr,
    req: v1::GroupStatusRequest,
) -> Vec<v1::GroupState> {
    rt.block_on(async {
        let ch = proto::connect(&addr.to_string(), probe, Role::Sc)
            .await
            .unwrap();
        let mut c = v1::service_computation_client::ServiceComputationClient::new(ch)
            .max_decoding_message_size(proto::MAX_MESSAGE);
        c.group_status(req).await.unwrap().into_inner().groups
    })
}

/// Two FMs with the same chains, `fm-a` (active: the nodes try it first) and `fm-b`
/// (standby), and SC nodes given both, all on mTLS with one CA.
///
/// Fields drop in the order they are declared: the SC nodes before the FMs, and the
/// runtime the FMs run on last.
pub struct FmPair {
    pub pki: Pki,
    pub scs: Vec<ScProcess>,
    pub standby: FmHandle,
    pub active: FmHandle,
    pub rt: Runtime,
}

impl FmPair {
    /// The two FMs' addresses: (active, standby).
    pub fn addrs(&self) -> (String, String) {
        (
            self.active.addr().to_string(),
            self.standby.addr().to_string(),
        )
    }
}

/// [`FmPair`] of these chains with `n_sc` SC nodes.
pub fn fm_pair(chains: Vec<ChainDef>, n_sc: usize, factory: Arc<dyn ChainFactory>) -> FmPair {
    let rt = runtime();
    let pki = Pki::new();
    let start = |id: &str| {
        let cfg = FmConfig {
            fm_id: id.into(),
            chains: chains.clone(),
            tls: Some(pki.node(Role::Fm, id)),
            ..FmConfig::default()
        };
        rt.block_on(fm::start(cfg, local())).unwrap()
    };
    let (active, standby) = (start("fm-a"), start("fm-b"));
    let scs = spawn_scs(
        n_sc,
        &format!("{},{}", active.addr(), standby.addr()),
        factory,
        Some(&pki),
    );
    FmPair {
        rt,
        active,
        standby,
        scs,
        pki,
    }
}

/// Tenant 1's chain 1 of these NFs (a JSON array), decapsulating and re-encapsulating
/// VXLAN both ways.
pub fn chain(nfs: serde_json::Value) -> ChainDef {
    serde_json::from_value(serde_json::json!({
        "tenant": 1, "chain": 1,
        "nfs": nfs,
        "forward": {"decap": true, "encap": {"dst": "198.18.0.9", "vni": 200}},
        "reverse": {"decap": true, "encap": {"dst": "198.18.0.50", "vni": 100}}
    }))
    .unwrap()
}

/// [`chain`] of one built-in SNAT (nfs crate) with ports 1024-65535 on `addrs`.
pub fn snat_chain(addrs: &[&str]) -> ChainDef {
    chain(serde_json::json!([{"kind": "snat", "pools": [
        {"addresses": addrs, "ports": {"lo": 1024, "hi": 65535}}]}]))
}

/// Flow `i` of [`chain`] (tenant 1's chain 1), as a PP worker asks for its rule; shared
/// with the lab's benches.
pub use testkit::flows::flow;

/// The source address and port a rule maps a flow to (SNAT); None for an error reply.
pub fn mapping(r: &RuleReply) -> Option<(IpAddr, u16)> {
    r.mapped_source()
}

/// Ask for [`flow`]s `flows` all at once and wait (20 s at most) for every answer.
pub fn ask(source: &RuleSource, flows: std::ops::Range<u32>) -> Vec<RuleReply> {
    let RuleSource::Channel { requests, replies } = source else {
        unreachable!()
    };
    let n = flows.len();
    for i in flows {
        requests.send(flow(i)).unwrap();
    }
    let mut out = Vec::with_capacity(n);
    let deadline = Instant::now() + Duration::from_secs(20);
    while out.len() < n && Instant::now() < deadline {
        if let Ok(r) = replies.recv_timeout(Duration::from_millis(100)) {
            // FM withdrawing a rule (an NF's timer forgot the flow) is not an answer.
            if !r.revoke {
                out.push(r);
            }
        }
    }
    assert_eq!(out.len(), n, "flows left unanswered");
    out
}

/// A PP node's FM client, once its session is up, and its first worker's link.
pub fn pp_session(cfg: FmClientConfig) -> (FmClient, WorkerLink) {
    let (client, mut links) = FmClient::start(cfg).unwrap();
    wait(Duration::from_secs(5), "PP session", || {
        client.connected().then_some(())
    });
    (client, links.remove(0))
}

/// Poll `f` every 10 ms until it returns Some, or fail after `limit`.
pub use testkit::wait_until as wait;

/// Part `i` of a chain snapshot (length-prefixed parts, one per NF).
pub fn nf_part(snap: &[u8], i: usize) -> Vec<u8> {
    let mut b = snap;
    for j in 0.. {
        let (len, rest) = b.split_first_chunk::<8>().unwrap();
        let len = u64::from_le_bytes(*len) as usize;
        if j == i {
            return rest[..len].to_vec();
        }
        b = &rest[len..];
    }
    unreachable!()
}
