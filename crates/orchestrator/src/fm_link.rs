//! How operator-side code reaches FM's operator services (`starfabric scale`,
//! `events --fm`, `autoscale`, the orchestrator's own autoscaler): over mTLS with an
//! operator or orchestrator certificate, or plaintext only when asked for (`--insecure`),
//! as every node command does (docs/security.md).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use proto::tls::{NodeTls, Role};
use proto::v1::fabric_master_client::FabricMasterClient;
use tonic::transport::Channel;

/// A client of FM's gRPC API.
pub type FmClient = FabricMasterClient<Channel>;

/// The certificate flags of a tool that calls FM.
#[derive(clap::Args, Debug, Clone, Default, PartialEq)]
pub struct FmTlsArgs {
    /// An operator certificate directory (`ca.pem`, `node.pem`, `node.key`), made by
    /// `starfabric node join --role operator` (`starfabric up` leaves one in
    /// DIR/tls/operator).
    #[arg(long = "tls-dir", env = "STARFABRIC_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,
    /// FM runs plaintext (`--insecure`, lab use only).
    #[arg(long, env = "STARFABRIC_INSECURE", conflicts_with = "tls_dir")]
    pub insecure: bool,
}

impl FmTlsArgs {
    /// The certificate to present (`None`: --insecure). Neither flag is an error that
    /// says what to pass, rather than a TLS handshake failure later.
    pub fn load(&self) -> Result<Option<Arc<NodeTls>>, String> {
        if self.insecure {
            return Ok(None);
        }
        let Some(dir) = &self.tls_dir else {
            return Err(
                "FM's API is mutual TLS: pass --tls-dir DIR with an operator \
                        certificate (`starfabric node join --role operator`), or \
                        --insecure for a plaintext lab FM (docs/security.md)"
                    .into(),
            );
        };
        let tls =
            NodeTls::from_dir(dir).map_err(|e| format!("--tls-dir {}: {e}", dir.display()))?;
        if !Role::OPERATORS.contains(&tls.identity().role) {
            return Err(format!(
                "--tls-dir {}: the certificate is {}'s; FM's operator services take an \
                 operator or orchestrator certificate",
                dir.display(),
                tls.identity()
            ));
        }
        Ok(Some(tls))
    }

    /// The arguments that reproduce these flags on another command line.
    pub fn argv(&self) -> Vec<String> {
        match &self.tls_dir {
            _ if self.insecure => vec!["--insecure".into()],
            Some(d) => vec!["--tls-dir".into(), d.display().to_string()],
            None => Vec::new(),
        }
    }
}

/// A client of the FM at `fm` (`host:port`) that connects on its first call and
/// reconnects after FM restarts.
pub fn lazy(fm: &str, tls: Option<&Arc<NodeTls>>) -> Result<FmClient, String> {
    let ep = proto::endpoint(fm)
        .map_err(|e| format!("FM address {fm}: {e}"))?
        .connect_timeout(Duration::from_secs(3));
    Ok(FmClient::new(proto::tls::connect_lazy(ep, tls, Role::Fm))
        .max_decoding_message_size(proto::MAX_MESSAGE))
}

/// A client of the FM at `fm`, connected now (so an unreachable FM is reported at once).
pub async fn connect(fm: &str, tls: Option<&Arc<NodeTls>>) -> Result<FmClient, String> {
    let ch = proto::connect(fm, tls, Role::Fm)
        .await
        .map_err(|e| format!("cannot reach FM at {fm}: {e}"))?;
    Ok(FmClient::new(ch).max_decoding_message_size(proto::MAX_MESSAGE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neither_flag_is_a_clear_error() {
        let e = FmTlsArgs::default().load().unwrap_err();
        assert!(e.contains("--tls-dir") && e.contains("--insecure"), "{e}");
        let plain = FmTlsArgs {
            insecure: true,
            ..Default::default()
        };
        assert!(plain.load().unwrap().is_none());
        assert_eq!(plain.argv(), ["--insecure"]);
    }

    #[test]
    fn a_node_certificate_is_not_an_operator_certificate() {
        let ca = proto::tls::Ca::generate().unwrap();
        let dir = std::env::temp_dir().join(format!("sf-fm-link-{}", std::process::id()));
        let id = proto::tls::Identity::new(Role::Pp, "pp-0").unwrap();
        proto::tls::Bundle::issue(&ca, &id, Duration::from_secs(3600))
            .unwrap()
            .write_dir(&dir)
            .unwrap();
        let a = FmTlsArgs {
            tls_dir: Some(dir.clone()),
            insecure: false,
        };
        let e = a.load().unwrap_err();
        assert!(e.contains("operator or orchestrator"), "{e}");
        let op = proto::tls::Identity::new(Role::Operator, "alice").unwrap();
        proto::tls::Bundle::issue(&ca, &op, Duration::from_secs(3600))
            .unwrap()
            .write_dir(&dir)
            .unwrap();
        assert_eq!(a.load().unwrap().unwrap().identity(), &op);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
