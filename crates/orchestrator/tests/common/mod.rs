//! What the orchestrator's tests over real gRPC share: an orchestrator on loopback with an
//! in-memory store, an admin HTTP call, and a polling wait.
//!
//! The control service runs mTLS, as `starfabric orchestrator` does (docs/security.md):
//! the orchestrator makes its CA in the store, and each test node agent holds a
//! certificate of its role and id from it. A test about plaintext sets
//! `cfg.security = Security::Insecure` in its `tune`.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use orchestrator::agent::{Agent, AgentConfig, ReportFn};
use proto::tls::{Bundle, Identity, NodeTls, Role};
use proto::v1;
use serde_json::Value;

pub const ADMIN: &str = "sfa_orchestrator_test";

/// testkit's `wait_until`, polling every 20 ms.
pub fn wait<T>(limit: Duration, what: &str, f: impl FnMut() -> Option<T>) -> T {
    testkit::wait_until_every(limit, Duration::from_millis(20), what, f)
}

/// An orchestrator on 127.0.0.1 (ephemeral ports) with an in-memory store and nodes
/// reporting every 100 ms, on mTLS; `tune` adjusts the rest of its configuration.
pub struct Orch {
    /// The REST API, `http://…`.
    pub base: String,
    /// The gRPC control address.
    pub control: String,
    /// The orchestrator's CA, join tokens and revocations; `None` in plaintext.
    pub pki: Option<Arc<orchestrator::pki::Pki>>,
    _orch: orchestrator::OrchestratorHandle,
    pub rt: tokio::runtime::Runtime,
}

impl Orch {
    pub fn start(tune: impl FnOnce(&mut orchestrator::OrchestratorConfig)) -> Orch {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let mut cfg = orchestrator::OrchestratorConfig::new(ADMIN);
        cfg.report_interval = Duration::from_millis(100);
        cfg.security = orchestrator::control::Security::Tls {
            cert_ttl: Duration::from_secs(3600),
        };
        tune(&mut cfg);
        let orch = rt
            .block_on(orchestrator::start(
                cfg,
                Arc::new(store::EmbeddedStore::in_memory().unwrap()),
                "127.0.0.1:0".parse().unwrap(),
                "127.0.0.1:0".parse().unwrap(),
            ))
            .unwrap();
        Orch {
            base: format!("http://{}", orch.api_addr),
            control: orch.control_addr.to_string(),
            pki: orch.shared.cfg.pki.clone(),
            _orch: orch,
            rt,
        }
    }

    /// Node `id`'s TLS state as `role`, issued by the orchestrator's CA (`None` in
    /// plaintext).
    pub fn node_tls(&self, role: Role, id: &str) -> Option<Arc<NodeTls>> {
        let pki = self.pki.as_ref()?;
        let ident = Identity::new(role, id).unwrap();
        let b = Bundle::issue(pki.ca(), &ident, Duration::from_secs(3600)).unwrap();
        Some(NodeTls::new(&b).unwrap())
    }

    /// A node agent saying `hello` to this orchestrator, with a certificate naming the
    /// hello's role and id (the control service refuses a hello its certificate does
    /// not name).
    pub fn agent(&self, hello: v1::NodeHello, report: ReportFn) -> Agent {
        let node = hello.node.clone().unwrap_or_default();
        let role: Role = proto::role_name(node.role).parse().unwrap();
        agent(&self.control, hello, self.node_tls(role, &node.id), report)
    }
}

/// An admin call to the REST API at `base`: its status and JSON body.
pub fn http(base: &str, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let r = orchestrator::client::Client::new(base, Some(ADMIN))
        .exchange(method, path, body)
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    (r.status, r.body)
}

/// A `PUT` that must create (201), naming the path and reply otherwise.
pub fn put_created(base: &str, path: &str, body: Value) {
    let (s, v) = http(base, "PUT", path, Some(body));
    assert_eq!(s, 201, "PUT {path}: {v}");
}

/// A node of this protocol version.
pub fn node_info(id: &str, role: v1::Role, addr: &str) -> v1::NodeInfo {
    v1::NodeInfo {
        id: id.into(),
        role: role as i32,
        addr: addr.into(),
        proto_version: proto::PROTO_VERSION,
        ..Default::default()
    }
}

/// A node agent saying `hello` to the orchestrator at `control`, over mTLS with `tls`
/// (plaintext without).
pub fn agent(
    control: &str,
    hello: v1::NodeHello,
    tls: Option<Arc<NodeTls>>,
    report: ReportFn,
) -> Agent {
    Agent::start(
        AgentConfig {
            orchestrator: control.to_string(),
            hello,
            tls,
        },
        report,
    )
    .unwrap()
}

/// Reports that say ready and nothing else.
pub fn ready() -> ReportFn {
    Arc::new(|| v1::NodeReport {
        ready: true,
        ..Default::default()
    })
}
