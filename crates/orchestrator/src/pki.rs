//! The orchestrator's PKI (docs/security.md): its CA, made on first start and kept in
//! the store; one-time node join tokens (only their hash is stored); issuance of node
//! certificates against a token and renewal against a node's current certificate; and
//! revocation, which directives push to every node.
//!
//! Store keys (under the store's own prefix):
//!
//! ```text
//! pki/ca                        {cert, key} PEM of the CA
//! pki/join/{sha256(token)}      JoinRecord
//! pki/revoked/{node id}         unix ms of the revocation
//! ```
//!
//! Bootstrap tokens (`starfabric orchestrator --bootstrap-token ROLE=FILE`) are the
//! exception to "one-time": replicated workloads (a Kubernetes StatefulSet of SC nodes)
//! cannot each be handed a token of their own, so a token from a Secret admits any
//! number of nodes of its role, as kubeadm's bootstrap tokens do. They are held in
//! memory only (the Secret is their store), never expire, and end when the Secret no
//! longer names them at the orchestrator's next start.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use proto::tls::{Ca, Identity, Role};
use serde::{Deserialize, Serialize};
use store::Store;

use crate::error::ApiError;

const CA_KEY: &str = "pki/ca";
const JOIN: &str = "pki/join/";
const REVOKED: &str = "pki/revoked/";
/// Join tokens: this prefix and 32 hex digits (128 random bits).
const TOKEN_PREFIX: &str = "sfj_";
/// Longest a join token may live.
pub const MAX_TOKEN_TTL: Duration = Duration::from_secs(7 * 86400);

#[derive(Serialize, Deserialize)]
struct StoredCa {
    cert: String,
    key: String,
}

#[derive(Serialize, Deserialize)]
struct JoinRecord {
    role: String,
    expires_unix_ms: u64,
}

/// A join token as created (the only time it is seen).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct JoinToken {
    pub token: String,
    pub role: String,
    pub expires_unix_ms: u64,
}

/// `POST /v1/nodes/tokens`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct JoinTokenRequest {
    /// `pp`, `fm` or `sc`.
    pub role: String,
    /// Lifetime in seconds (default 600, at most 7 days).
    #[serde(default)]
    pub ttl_s: Option<u64>,
}

/// `POST /v1/nodes/join`: a join token, the node's id and its CSR (PEM).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct JoinRequest {
    pub token: String,
    pub id: String,
    pub csr: String,
}

/// `POST /v1/nodes/renew`: the node's current certificate and a CSR for the same key.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RenewRequest {
    pub cert: String,
    pub csr: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Revoked {
    pub revoked: String,
}

/// What issuance and renewal answer: the node's certificate and the CA's.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Issued {
    pub id: String,
    pub role: String,
    pub cert: String,
    pub ca: String,
}

pub struct Pki {
    ca: Ca,
    ca_pem: String,
    /// Lifetime of the node certificates issued.
    pub cert_ttl: Duration,
    store: Arc<dyn Store>,
    revoked: RwLock<BTreeSet<String>>,
    /// Reusable bootstrap tokens by their hash (see the module doc).
    bootstrap: RwLock<HashMap<Vec<u8>, Role>>,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki").finish_non_exhaustive()
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn tls_err(e: proto::tls::TlsError) -> ApiError {
    ApiError::internal(format!("PKI: {e}"))
}

impl Pki {
    /// The CA in the store, or a new one stored now (first start).
    pub async fn load_or_create(
        store: Arc<dyn Store>,
        cert_ttl: Duration,
    ) -> Result<Self, ApiError> {
        let ca = match store.get(CA_KEY).await? {
            Some(v) => {
                let s: StoredCa = serde_json::from_slice(&v.value)
                    .map_err(|e| ApiError::internal(format!("stored CA does not decode: {e}")))?;
                Ca::from_pem(&s.cert, &s.key).map_err(tls_err)?
            }
            None => {
                let ca = Ca::generate().map_err(tls_err)?;
                let s = StoredCa {
                    cert: ca.cert_pem(),
                    key: ca.key_pem(),
                };
                // Create-if-absent: of two orchestrators starting at once, one CA wins
                // and both use it.
                let put = store
                    .txn(
                        vec![store::Compare::Absent(CA_KEY.into())],
                        vec![store::TxnOp::Put(
                            CA_KEY.into(),
                            serde_json::to_vec(&s).unwrap_or_default(),
                        )],
                    )
                    .await;
                match put {
                    Ok(_) => {
                        tracing::info!("made the platform CA");
                        ca
                    }
                    Err(store::StoreError::Conflict { .. }) => {
                        return Box::pin(Self::load_or_create(store, cert_ttl)).await
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        };
        let mut revoked = BTreeSet::new();
        for (k, _) in store.list(REVOKED, None, 0).await? {
            revoked.insert(k[REVOKED.len()..].to_string());
        }
        Ok(Pki {
            ca_pem: ca.cert_pem(),
            ca,
            cert_ttl,
            store,
            revoked: RwLock::new(revoked),
            bootstrap: RwLock::new(HashMap::new()),
        })
    }

    pub fn ca(&self) -> &Ca {
        &self.ca
    }

    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// A new one-time join token for a node of `role`, valid for `ttl`.
    pub async fn create_token(&self, role: &str, ttl: Duration) -> Result<JoinToken, ApiError> {
        let r: Role = role
            .parse()
            .map_err(|e| ApiError::invalid("role", format!("{e}")))?;
        if r == Role::Orchestrator {
            return Err(ApiError::invalid(
                "role",
                "nodes join as pp, fm or sc, people and tools as operator",
            ));
        }
        if ttl.is_zero() || ttl > MAX_TOKEN_TTL {
            return Err(ApiError::invalid("ttl_s", "between 1 s and 7 days"));
        }
        let token = format!("{TOKEN_PREFIX}{}", hex::encode(rand::random::<[u8; 16]>()));
        let rec = JoinRecord {
            role: r.as_str().into(),
            expires_unix_ms: now_ms() + ttl.as_millis() as u64,
        };
        self.store
            .put(
                &join_key(&token),
                serde_json::to_vec(&rec).unwrap_or_default(),
            )
            .await?;
        tracing::info!(
            role = r.as_str(),
            ttl_s = ttl.as_secs(),
            "join token created"
        );
        Ok(JoinToken {
            token,
            role: rec.role,
            expires_unix_ms: rec.expires_unix_ms,
        })
    }

    /// Admits `token` as a reusable bootstrap token for nodes of `role` (see the module
    /// doc). Its form is a join token's; `orchestrator` is not a role nodes join as.
    pub fn add_bootstrap(&self, role: Role, token: &str) -> Result<(), ApiError> {
        if !well_formed(token) {
            return Err(ApiError::invalid(
                "token",
                format!("malformed bootstrap token: expected {TOKEN_PREFIX} and 32 hex digits"),
            ));
        }
        if role == Role::Orchestrator {
            return Err(ApiError::invalid("role", "nodes join as pp, fm or sc"));
        }
        self.bootstrap
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(crate::auth::token_hash(token).to_vec(), role);
        tracing::info!(role = role.as_str(), "bootstrap token admitted");
        Ok(())
    }

    /// Spends `token` (once; a bootstrap token is not spent) and signs `csr` for node
    /// `id` in the token's role.
    pub async fn join(&self, token: &str, id: &str, csr: &str) -> Result<Issued, ApiError> {
        if !well_formed(token) {
            return Err(ApiError::invalid(
                "token",
                format!("malformed join token: expected {TOKEN_PREFIX} and 32 hex digits"),
            ));
        }
        let boot = self
            .bootstrap
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(crate::auth::token_hash(token).as_slice())
            .copied();
        if let Some(role) = boot {
            return self.sign(role, id, csr, "bootstrap token");
        }
        let key = join_key(token);
        let Some(v) = self.store.get(&key).await? else {
            return Err(ApiError::unauthorized("join token unknown or already used"));
        };
        // The delete is the spend: of two joins racing on one token, one deletes it.
        if !self.store.delete(&key).await? {
            return Err(ApiError::unauthorized("join token unknown or already used"));
        }
        let rec: JoinRecord = serde_json::from_slice(&v.value)
            .map_err(|e| ApiError::internal(format!("stored join token does not decode: {e}")))?;
        if rec.expires_unix_ms <= now_ms() {
            return Err(ApiError::unauthorized("join token expired"));
        }
        let role: Role = rec.role.parse().map_err(tls_err)?;
        self.sign(role, id, csr, "join token")
    }

    fn sign(&self, role: Role, id: &str, csr: &str, with: &str) -> Result<Issued, ApiError> {
        let ident = Identity::new(role, id).map_err(|e| ApiError::invalid("id", e.to_string()))?;
        if self.is_revoked(id) {
            return Err(ApiError::forbidden(format!("node {id:?} is revoked")));
        }
        let cert = self
            .ca
            .sign_csr(csr, &ident, self.cert_ttl)
            .map_err(|e| ApiError::invalid("csr", e.to_string()))?;
        tracing::info!(node = %ident, with, "node joined");
        Ok(self.issued(&ident, cert))
    }

    /// A renewed certificate for the holder of `cert` (valid, unrevoked), same key.
    pub async fn renew(&self, cert: &str, csr: &str) -> Result<Issued, ApiError> {
        let (ident, signed) = self
            .ca
            .renew(cert, csr, self.cert_ttl)
            .map_err(|e| ApiError::unauthorized(format!("renewal refused: {e}")))?;
        if self.is_revoked(&ident.id) {
            return Err(ApiError::forbidden(format!(
                "node {:?} is revoked",
                ident.id
            )));
        }
        Ok(self.issued(&ident, signed))
    }

    fn issued(&self, ident: &Identity, cert: String) -> Issued {
        Issued {
            id: ident.id.clone(),
            role: ident.role.as_str().into(),
            cert,
            ca: self.ca_pem.clone(),
        }
    }

    /// Records the revocation of node `id` (pushed to every node with its directive).
    pub async fn revoke(&self, id: &str) -> Result<(), ApiError> {
        Identity::new(Role::Sc, id).map_err(|e| ApiError::invalid("id", e.to_string()))?;
        self.store
            .put(&format!("{REVOKED}{id}"), now_ms().to_string().into_bytes())
            .await?;
        self.revoked
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string());
        tracing::warn!(node = id, "node revoked");
        Ok(())
    }

    pub fn is_revoked(&self, id: &str) -> bool {
        self.revoked
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(id)
    }

    pub fn revoked(&self) -> Vec<String> {
        self.revoked
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect()
    }
}

fn well_formed(token: &str) -> bool {
    token
        .strip_prefix(TOKEN_PREFIX)
        .is_some_and(|h| h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn join_key(token: &str) -> String {
    format!("{JOIN}{}", hex::encode(crate::auth::token_hash(token)))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn pki() -> Pki {
        let store: Arc<dyn Store> = Arc::new(store::EmbeddedStore::in_memory().unwrap());
        Pki::load_or_create(store, Duration::from_secs(3600))
            .await
            .unwrap()
    }

    fn csr(role: Role, id: &str) -> (proto::tls::NodeKey, String) {
        let k = proto::tls::NodeKey::generate().unwrap();
        let c = k.csr_pem(&Identity::new(role, id).unwrap()).unwrap();
        (k, c)
    }

    #[tokio::test]
    async fn a_token_joins_one_node_once_in_its_role() {
        let p = pki().await;
        let t = p
            .create_token("sc", Duration::from_secs(600))
            .await
            .unwrap();
        assert!(well_formed(&t.token));
        let (_, c) = csr(Role::Sc, "sc-1");
        let issued = p.join(&t.token, "sc-1", &c).await.unwrap();
        assert_eq!(
            p.ca().verify(&issued.cert).unwrap(),
            Identity::new(Role::Sc, "sc-1").unwrap()
        );
        assert_eq!(issued.ca, p.ca_pem());
        // Reused: refused.
        let e = p.join(&t.token, "sc-2", &c).await.unwrap_err();
        assert_eq!(e.status.as_u16(), 401);
        assert!(e.message.contains("already used"), "{}", e.message);
    }

    #[tokio::test]
    async fn a_bootstrap_token_admits_many_nodes_of_its_role_but_no_revoked_one() {
        let p = pki().await;
        let token = format!("{TOKEN_PREFIX}{}", "ab".repeat(16));
        p.add_bootstrap(Role::Sc, &token).unwrap();
        for id in ["sc-0", "sc-1", "sc-0"] {
            let (_, c) = csr(Role::Sc, id);
            let issued = p.join(&token, id, &c).await.unwrap();
            assert_eq!(
                p.ca().verify(&issued.cert).unwrap(),
                Identity::new(Role::Sc, id).unwrap()
            );
        }
        p.revoke("sc-1").await.unwrap();
        let (_, c) = csr(Role::Sc, "sc-1");
        assert_eq!(
            p.join(&token, "sc-1", &c)
                .await
                .unwrap_err()
                .status
                .as_u16(),
            403
        );
        // Not a one-time token in the store: another token of the same form is unknown.
        let other = format!("{TOKEN_PREFIX}{}", "cd".repeat(16));
        assert_eq!(
            p.join(&other, "sc-2", &c)
                .await
                .unwrap_err()
                .status
                .as_u16(),
            401
        );
        assert!(p.add_bootstrap(Role::Sc, "sfj_short").is_err());
        assert!(p.add_bootstrap(Role::Orchestrator, &other).is_err());
    }

    #[tokio::test]
    async fn malformed_unknown_and_expired_tokens_are_refused_clearly() {
        let p = pki().await;
        let (_, c) = csr(Role::Pp, "pp-1");
        for bad in [
            "",
            "sfj_",
            "sfj_zz",
            "sfa_00112233445566778899aabbccddeeff",
            "sfj_00112233445566778899aabbccddeeff0",
        ] {
            let e = p.join(bad, "pp-1", &c).await.unwrap_err();
            assert_eq!(e.status.as_u16(), 422, "{bad}");
            assert!(e.message.contains("malformed join token"), "{}", e.message);
        }
        let e = p
            .join("sfj_00112233445566778899aabbccddeeff", "pp-1", &c)
            .await
            .unwrap_err();
        assert!(e.message.contains("unknown or already used"));
        // Expired: a token stored already past its time.
        let t = p.create_token("pp", Duration::from_secs(60)).await.unwrap();
        let rec = JoinRecord {
            role: "pp".into(),
            expires_unix_ms: now_ms() - 1,
        };
        p.store
            .put(&join_key(&t.token), serde_json::to_vec(&rec).unwrap())
            .await
            .unwrap();
        let e = p.join(&t.token, "pp-1", &c).await.unwrap_err();
        assert_eq!(e.status.as_u16(), 401);
        assert!(e.message.contains("expired"), "{}", e.message);
        // Bad roles and lifetimes at creation.
        assert!(p
            .create_token("admin", Duration::from_secs(60))
            .await
            .is_err());
        assert!(p
            .create_token("orchestrator", Duration::from_secs(60))
            .await
            .is_err());
        assert!(p.create_token("sc", Duration::ZERO).await.is_err());
        // A bad CSR spends the token but issues nothing, with an error naming the CSR.
        let t = p.create_token("pp", Duration::from_secs(60)).await.unwrap();
        let e = p.join(&t.token, "pp-1", "garbage").await.unwrap_err();
        assert_eq!(e.field.as_deref(), Some("csr"));
    }

    #[tokio::test]
    async fn the_ca_survives_a_restart_and_revocation_blocks_renewal() {
        let store: Arc<dyn Store> = Arc::new(store::EmbeddedStore::in_memory().unwrap());
        let a = Pki::load_or_create(store.clone(), Duration::from_secs(3600))
            .await
            .unwrap();
        let t = a.create_token("fm", Duration::from_secs(60)).await.unwrap();
        let (k, c) = csr(Role::Fm, "fm-1");
        let issued = a.join(&t.token, "fm-1", &c).await.unwrap();
        let b = Pki::load_or_create(store, Duration::from_secs(3600))
            .await
            .unwrap();
        assert_eq!(a.ca_pem(), b.ca_pem());
        let again = k
            .csr_pem(&Identity::new(Role::Fm, "fm-1").unwrap())
            .unwrap();
        let renewed = b.renew(&issued.cert, &again).await.unwrap();
        assert_eq!(renewed.id, "fm-1");
        b.revoke("fm-1").await.unwrap();
        assert_eq!(b.revoked(), vec!["fm-1".to_string()]);
        let e = b.renew(&issued.cert, &again).await.unwrap_err();
        assert_eq!(e.status.as_u16(), 403);
    }
}
