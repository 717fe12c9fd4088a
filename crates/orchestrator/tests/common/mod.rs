//! What the orchestrator's tests over real gRPC share: an orchestrator on loopback with an
//! in-memory store, an admin HTTP call, and a polling wait.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use orchestrator::agent::{Agent, AgentConfig, ReportFn};
use proto::v1;
use serde_json::Value;

pub const ADMIN: &str = "sfa_orchestrator_test";

/// testkit's `wait_until`, polling every 20 ms.
pub fn wait<T>(limit: Duration, what: &str, f: impl FnMut() -> Option<T>) -> T {
    testkit::wait_until_every(limit, Duration::from_millis(20), what, f)
}

/// An orchestrator on 127.0.0.1 (ephemeral ports) with an in-memory store and nodes
/// reporting every 100 ms; `tune` adjusts the rest of its configuration.
pub struct Orch {
    /// The REST API, `http://…`.
    pub base: String,
    /// The gRPC control address.
    pub control: String,
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
            _orch: orch,
            rt,
        }
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

/// A node agent saying `hello` to the orchestrator at `control`.
pub fn agent(control: &str, hello: v1::NodeHello, report: ReportFn) -> Agent {
    Agent::start(
        AgentConfig {
            orchestrator: control.to_string(),
            hello,
            tls: None,
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
