//! The orchestrator: the tenant-facing side of starfabric (paper 000 §3.2, §7.1).
//!
//! - A REST API ([`api`], axum, OpenAPI at `/openapi.json`) over the **desired state**:
//!   tenants, VPCs (VNIs), NF instances and chains, kept in a [`store::Store`] (redb for
//!   one node, etcd for many) by [`desired`], which validates every write and applies it
//!   as one transaction.
//! - **Observed state and reconciliation** ([`control`]): every PP, FM and SC node keeps a
//!   `Control` gRPC session, reports health, load and counters, and is pushed a complete
//!   directive whenever its desired configuration changes: chains and partitions to FM,
//!   VNI → (tenant, chain) bindings of its PP cluster's tenants to PP, and the FM
//!   addresses to PP and SC. A node that stops reporting is marked down.
//! - [`agent`] is the node side of that session, used by `starfabric pp|fm|sc`.
//! - [`auth`]: the admin token and tenant-scoped tokens.
//! - [`placement`]: each tenant's shard set of SC nodes (shuffle sharding, paper 000
//!   App. A), decided by the `placement` crate and handed to FM.
//! - [`autoscale`]: scale SC groups and PP nodes between water marks of utilisation,
//!   from FM's load counters, recording every decision in FM's event log.

/// The node side of the control session lives in `proto` so planes need not depend on
/// the orchestrator; re-exported here where it used to be.
pub use proto::agent;
pub mod api;
pub mod auth;
pub mod autoscale;
pub mod autoscaler;
pub mod client;
pub mod control;
pub mod desired;
pub mod error;
pub mod events;
pub mod fm_link;
pub mod model;
pub mod pki;
pub mod placement;
pub mod provider;
pub mod ui;

use std::net::SocketAddr;
use std::sync::Arc;

use thiserror::Error;
use tokio::task::JoinHandle;
use tracing::{info, warn};

pub use control::{OrchestratorConfig, Shared};
pub use desired::Desired;
pub use error::ApiError;

#[derive(Debug, Error)]
pub enum OrchestratorError {
    #[error("cannot bind {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("plane security: {0}")]
    Pki(String),
}

/// A running orchestrator.
pub struct OrchestratorHandle {
    pub api_addr: SocketAddr,
    pub control_addr: SocketAddr,
    pub shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl OrchestratorHandle {
    pub fn stop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }
}

impl Drop for OrchestratorHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The orchestrator's own certificate, re-issued from its CA at two thirds of its life.
async fn renew_own(pki: Arc<pki::Pki>, tls: Arc<proto::tls::NodeTls>) {
    loop {
        let wait = tls
            .renew_at()
            .duration_since(std::time::SystemTime::now())
            .unwrap_or_default();
        tokio::time::sleep(wait.max(std::time::Duration::from_secs(1))).await;
        let b = proto::tls::Bundle::issue(pki.ca(), tls.identity(), pki.cert_ttl);
        match b.and_then(|b| tls.rotate(&b.cert_pem, &b.key_pem)) {
            Ok(()) => info!("orchestrator certificate renewed"),
            Err(e) => warn!(error = %e, "orchestrator certificate renewal failed"),
        }
    }
}

/// A listener on `addr` for `what`, the service a bind error names.
async fn bind(
    what: &'static str,
    addr: SocketAddr,
) -> Result<tokio::net::TcpListener, OrchestratorError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| OrchestratorError::Bind { what, addr, source })
}

/// Start the API on `api` and the control service on `control` (port 0: any), on the
/// current tokio runtime.
pub async fn start(
    mut cfg: OrchestratorConfig,
    store: Arc<dyn store::Store>,
    api: SocketAddr,
    control: SocketAddr,
) -> Result<OrchestratorHandle, OrchestratorError> {
    let mut renew = None;
    if let control::Security::Tls { cert_ttl } = cfg.security {
        let pki_err = |e: &dyn std::fmt::Display| OrchestratorError::Pki(e.to_string());
        let pki = Arc::new(
            pki::Pki::load_or_create(store.clone(), cert_ttl)
                .await
                .map_err(|e| pki_err(&e))?,
        );
        let me = proto::tls::Identity::new(proto::tls::Role::Orchestrator, &cfg.id)
            .map_err(|e| pki_err(&e))?;
        let b = proto::tls::Bundle::issue(pki.ca(), &me, cert_ttl).map_err(|e| pki_err(&e))?;
        let tls = proto::tls::NodeTls::new(&b).map_err(|e| pki_err(&e))?;
        for id in pki.revoked() {
            tls.revoke(&id);
        }
        for (role, token) in &cfg.bootstrap_tokens {
            pki.add_bootstrap(*role, token)
                .map_err(|e| pki_err(&e.message))?;
        }
        renew = Some((pki.clone(), tls.clone()));
        cfg.tls = Some(tls);
        cfg.pki = Some(pki);
    }
    let shared = Shared::new(cfg, Desired::new(store));
    let api_listener = bind("the API", api).await?;
    let api_addr = api_listener.local_addr()?;
    let control_listener = bind("the control service", control).await?;
    let control_addr = control_listener.local_addr()?;
    let mut tasks = Vec::new();
    let router = api::router(shared.clone());
    tasks.push(tokio::spawn(async move {
        if let Err(e) = axum::serve(api_listener, router).await {
            warn!(error = %e, "API server stopped");
        }
    }));
    let svc = proto::v1::control_server::ControlServer::new(control::ControlService {
        shared: shared.clone(),
    })
    .max_decoding_message_size(proto::MAX_MESSAGE)
    .max_encoding_message_size(proto::MAX_MESSAGE);
    let incoming = proto::tls::incoming(
        control_listener,
        shared.cfg.tls.clone(),
        &proto::tls::Role::NODES,
    )
    .map_err(std::io::Error::other)?;
    tasks.push(tokio::spawn(async move {
        if let Err(e) = proto::server()
            .add_service(svc)
            .serve_with_incoming(incoming)
            .await
        {
            warn!(error = %e, "control server stopped");
        }
    }));
    tasks.push(tokio::spawn(shared.clone().housekeeping()));
    if let Some((pki, tls)) = renew {
        tasks.push(tokio::spawn(renew_own(pki, tls)));
    }
    tasks.push(tokio::spawn(crate::placement::run(
        shared.clone(),
        shared.cfg.report_interval,
    )));
    info!(%api_addr, %control_addr, store = shared.desired.store().backend(), "orchestrator listening");
    Ok(OrchestratorHandle {
        api_addr,
        control_addr,
        shared,
        tasks,
    })
}
