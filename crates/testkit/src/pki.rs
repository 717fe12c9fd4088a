//! A test cluster's PKI: one CA, a certificate per node with the role it plays, made
//! in-process with `proto::tls` as the orchestrator's CA would issue them
//! (docs/security.md). In-process harnesses run their planes on mTLS with it, so the
//! tests exercise the handshakes and role checks production runs.

use std::sync::Arc;
use std::time::Duration;

use proto::tls::{Bundle, Ca, Identity, NodeTls, Role};

/// How long a test certificate lives: longer than any test, so none expires mid-run
/// (tests that want an expired one sign it themselves with [`Ca::sign_csr_between`]).
pub const CERT_TTL: Duration = Duration::from_secs(3600);

/// One CA and the node certificates it issues.
pub struct Pki {
    ca: Ca,
}

impl Default for Pki {
    fn default() -> Self {
        Self::new()
    }
}

impl Pki {
    /// A fresh CA.
    pub fn new() -> Pki {
        Pki {
            ca: Ca::generate().expect("test CA"),
        }
    }

    pub fn ca(&self) -> &Ca {
        &self.ca
    }

    /// A certificate, key and CA for node `id` of `role`.
    pub fn bundle(&self, role: Role, id: &str) -> Bundle {
        let ident = Identity::new(role, id).unwrap_or_else(|e| panic!("identity {role}/{id}: {e}"));
        Bundle::issue(&self.ca, &ident, CERT_TTL)
            .unwrap_or_else(|e| panic!("certificate for {ident}: {e}"))
    }

    /// Node `id`'s TLS state as `role` (FmConfig/ScConfig/FmClientConfig's `tls`).
    pub fn node(&self, role: Role, id: &str) -> Arc<NodeTls> {
        NodeTls::new(&self.bundle(role, id))
            .unwrap_or_else(|e| panic!("TLS state of {role}/{id}: {e}"))
    }
}
