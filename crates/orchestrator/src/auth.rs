//! API authentication: bearer tokens.
//!
//! - The **admin token** sees and changes everything. The orchestrator reads it from a
//!   file (`--admin-token-file`), creating the file with a fresh random token (mode 0600)
//!   when it does not exist; `starfabric up` writes it into the CLI's credentials.
//! - A **tenant token** (`POST /v1/tenants/{t}/tokens`) sees and changes only its
//!   tenant's objects: any other tenant's are refused with 403, and lists show only its
//!   own. Only the SHA-256 of a tenant token is stored.

use std::path::Path;

use sha2::{Digest, Sha256};

use crate::error::ApiError;

/// Who a request acts as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    Admin,
    Tenant(String),
}

impl Principal {
    /// May this principal touch tenant `tenant`'s objects?
    pub fn check_tenant(&self, tenant: &str) -> Result<(), ApiError> {
        match self {
            Principal::Admin => Ok(()),
            Principal::Tenant(t) if t == tenant => Ok(()),
            Principal::Tenant(t) => Err(ApiError::forbidden(format!(
                "this token belongs to tenant {t:?} and cannot access tenant {tenant:?}"
            ))),
        }
    }

    pub fn require_admin(&self, what: &str) -> Result<(), ApiError> {
        match self {
            Principal::Admin => Ok(()),
            Principal::Tenant(t) => Err(ApiError::forbidden(format!(
                "{what} needs the admin token; this token belongs to tenant {t:?}"
            ))),
        }
    }

    pub fn tenant(&self) -> Option<&str> {
        match self {
            Principal::Admin => None,
            Principal::Tenant(t) => Some(t),
        }
    }
}

/// Who `token` acts as: the admin token, a live tenant token, or nobody (`None`). The
/// REST API (`Authorization: Bearer`) and the dashboard (its session cookie) both ask
/// this, so they authorize alike.
pub async fn authenticate(
    token: &str,
    admin_token: &str,
    desired: &crate::desired::Desired,
) -> Result<Option<Principal>, ApiError> {
    if same_secret(token, admin_token) {
        return Ok(Some(Principal::Admin));
    }
    Ok(desired.token_tenant(token).await?.map(Principal::Tenant))
}

pub fn token_hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Compare two secrets in time independent of where they differ.
pub fn same_secret(a: &str, b: &str) -> bool {
    token_hash(a) == token_hash(b)
}

/// The admin token in `path`; created (0600) with a random token if missing.
pub fn load_or_create_admin_token(path: &Path) -> std::io::Result<String> {
    match std::fs::read_to_string(path) {
        Ok(s) if !s.trim().is_empty() => return Ok(s.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let token = format!("sfa_{}", hex::encode(rand::random::<[u8; 24]>()));
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    writeln!(f, "{token}")?;
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_principal_is_confined_to_its_tenant() {
        let p = Principal::Tenant("acme".into());
        assert!(p.check_tenant("acme").is_ok());
        let e = p.check_tenant("globex").unwrap_err();
        assert_eq!(e.status.as_u16(), 403);
        assert!(e.message.contains("\"acme\"") && e.message.contains("\"globex\""));
        assert!(p.require_admin("listing nodes").is_err());
        assert!(Principal::Admin.check_tenant("globex").is_ok());
    }

    #[test]
    fn admin_token_file_is_created_once_and_private() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/admin-token");
        let a = load_or_create_admin_token(&path).unwrap();
        let b = load_or_create_admin_token(&path).unwrap();
        assert_eq!(a, b);
        assert!(a.starts_with("sfa_") && a.len() == 4 + 48);
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(same_secret(&a, &b) && !same_secret(&a, "sfa_x"));
    }
}
