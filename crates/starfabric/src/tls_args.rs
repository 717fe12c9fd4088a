//! Plane security flags every node command takes (docs/security.md): a certificate
//! directory, a join token, or `--insecure`. Plaintext only when asked for.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context, Result};
use clap::Args;
use proto::tls::{Bundle, Identity, NodeKey, NodeTls, Role};
use serde_json::json;

#[derive(Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// The node's certificate directory: `ca.pem`, `node.pem`, `node.key`. With
    /// --join-token the node writes them there first.
    #[arg(long, env = "STARFABRIC_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,
    /// A one-time join token (`starfabric node token create --role ROLE`): the node
    /// makes its key, has the orchestrator sign it, and keeps the result in --tls-dir.
    #[arg(long, env = "STARFABRIC_JOIN_TOKEN", hide_env_values = true, requires_all = ["tls_dir", "orchestrator_api"])]
    pub join_token: Option<String>,
    /// The orchestrator's REST API (`http://host:port`): where the node joins and
    /// renews its certificate (at two thirds of its lifetime).
    #[arg(long, env = "STARFABRIC_ORCHESTRATOR_API")]
    pub orchestrator_api: Option<String>,
    /// Plaintext plane links, for lab use only: anyone who reaches a port can join.
    #[arg(long, env = "STARFABRIC_INSECURE", conflicts_with_all = ["tls_dir", "join_token"])]
    pub insecure: bool,
}

impl TlsArgs {
    /// The node's TLS state (`None`: --insecure), after joining if given a token, with
    /// renewal running in the background.
    pub fn load(&self, role: Role, id: &str) -> Result<Option<Arc<NodeTls>>> {
        if self.insecure {
            tracing::warn!("--insecure: plane links are plaintext and unauthenticated");
            return Ok(None);
        }
        let Some(dir) = &self.tls_dir else {
            bail!(
                "plane links are mutual TLS: pass --tls-dir DIR (with --join-token T \
                 --orchestrator-api URL to join), or --insecure for plaintext lab use \
                 (docs/security.md)"
            );
        };
        let me = Identity::new(role, id)?;
        if let Some(token) = &self.join_token {
            let api = self.orchestrator_api.as_deref().unwrap_or_default();
            join(
                &orchestrator::client::Client::new(api, None),
                token,
                &me,
                dir,
            )
            .context("joining with --join-token")?;
        }
        let tls = NodeTls::from_dir(dir).with_context(|| format!("--tls-dir {}", dir.display()))?;
        if tls.identity() != &me {
            bail!(
                "--tls-dir {}: the certificate is {}'s, this node is {me}",
                dir.display(),
                tls.identity()
            );
        }
        spawn_renewal(tls.clone(), dir.clone(), self.orchestrator_api.clone());
        Ok(Some(tls))
    }
}

/// Join with a one-time `token`: make a key here, have the orchestrator sign it for
/// `me`, and write the bundle into `dir` (a node at its start, or `starfabric node join`
/// for an operator's certificate). Returns the identity issued: the role is the
/// token's, whatever the request asked for.
pub fn join(
    api: &orchestrator::client::Client,
    token: &str,
    me: &Identity,
    dir: &std::path::Path,
) -> Result<Identity> {
    let key = NodeKey::generate()?;
    let r = api.call(
        "POST",
        "/v1/nodes/join",
        Some(json!({"token": token, "id": me.id, "csr": key.csr_pem(me)?})),
    )?;
    let field = |k: &str| r[k].as_str().map(String::from).context("bad join answer");
    let role: Role = field("role")?.parse()?;
    Bundle {
        ca_pem: field("ca")?,
        cert_pem: field("cert")?,
        key_pem: key.pem(),
    }
    .write_dir(dir)?;
    Ok(Identity::new(role, &me.id)?)
}

/// Keeps the certificate fresh without dropping sessions: with the API, renews at two
/// thirds of its lifetime; without, picks up a renewed `node.pem` written into the
/// directory (by `starfabric up` or an operator's tooling).
fn spawn_renewal(tls: Arc<NodeTls>, dir: PathBuf, api: Option<String>) {
    let _ = std::thread::Builder::new()
        .name("tls-renewal".into())
        .spawn(move || loop {
            let due = tls
                .renew_at()
                .duration_since(SystemTime::now())
                .unwrap_or_default();
            let step = match &api {
                Some(_) if due.is_zero() => Duration::ZERO,
                Some(_) => due.min(Duration::from_secs(60)),
                None => Duration::from_secs(10),
            };
            std::thread::sleep(step.max(Duration::from_millis(500)));
            let r = match &api {
                Some(api) if tls.renew_at() <= SystemTime::now() => renew(&tls, &dir, api),
                Some(_) => Ok(()),
                None => reload(&tls, &dir),
            };
            if let Err(e) = r {
                tracing::warn!(error = %format!("{e:#}"), "certificate renewal failed; retrying");
                std::thread::sleep(Duration::from_secs(5));
            }
        });
}

fn renew(tls: &NodeTls, dir: &std::path::Path, api: &str) -> Result<()> {
    let r = orchestrator::client::Client::new(api, None).call(
        "POST",
        "/v1/nodes/renew",
        Some(json!({"cert": tls.cert_pem(), "csr": tls.renewal_csr()?})),
    )?;
    let cert = r["cert"].as_str().context("bad renewal answer")?;
    let ca = r["ca"].as_str().context("bad renewal answer")?;
    tls.rotate_cert(cert)?;
    tls.bundle(ca).write_dir(dir)?;
    tracing::info!("certificate renewed");
    Ok(())
}

fn reload(tls: &NodeTls, dir: &std::path::Path) -> Result<()> {
    let b = Bundle::read_dir(dir)?;
    if b.cert_pem != tls.cert_pem() {
        tls.rotate(&b.cert_pem, &b.key_pem)?;
        tracing::info!("renewed certificate picked up from the directory");
    }
    Ok(())
}
