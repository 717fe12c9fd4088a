//! Plane security: mutual TLS on every plane link (PP↔FM, SC↔FM, SC replica chains,
//! nodes↔orchestrator), with identities issued by the orchestrator's CA.
//!
//! A node certificate names the node's role and id twice: as a SAN URI
//! `spiffe://starfabric/<role>/<id>`, which authorisation reads, and as a SAN DNS name
//! `<role>.starfabric`, which clients use as the TLS server name. A client that dials an
//! FM therefore asks for `fm.starfabric` and webpki's own name check refuses a server of
//! another role; servers check the client's role in their certificate verifier.
//!
//! tonic 0.12's `ServerTlsConfig`/`ClientTlsConfig` take one fixed identity, so a
//! certificate could not rotate without rebuilding the server. Servers here accept over a
//! tokio-rustls acceptor stream (`serve_with_incoming`) and clients connect with
//! `connect_with_connector`, both built on rustls' dynamic certificate resolvers: a
//! rotated certificate serves new handshakes while established connections go on.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, SystemTime};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::ResolvesClientCert;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore,
    ServerConfig, SignatureScheme,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

/// Default lifetime of a node certificate in production.
pub const DEFAULT_CERT_TTL: Duration = Duration::from_secs(24 * 3600);

/// Trust domain of the SAN URIs.
const TRUST_DOMAIN: &str = "starfabric";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("certificate generation: {0}")]
    Gen(#[from] rcgen::Error),
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("{0}")]
    Pem(String),
    #[error("{path}: {error}")]
    File { path: String, error: io::Error },
    #[error("bad identity: {0}")]
    Identity(String),
}

type Result<T, E = TlsError> = std::result::Result<T, E>;

// ------------------------------------------------------------------ identities

/// What a certificate allows its holder to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    Pp,
    Fm,
    Sc,
    Orchestrator,
    /// A person's or a tool's client identity (`starfabric scale`, `events --fm`,
    /// `autoscale`): it may call FM's operator services, never open a plane session.
    Operator,
}

impl Role {
    pub const ALL: [Role; 5] = [
        Role::Pp,
        Role::Fm,
        Role::Sc,
        Role::Orchestrator,
        Role::Operator,
    ];
    /// Who may call FM's operator services (scaling, maps, events, flows, traffic).
    pub const OPERATORS: [Role; 2] = [Role::Orchestrator, Role::Operator];
    /// The roles that run the data and state planes and hold a control session.
    pub const NODES: [Role; 3] = [Role::Pp, Role::Fm, Role::Sc];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Pp => "pp",
            Role::Fm => "fm",
            Role::Sc => "sc",
            Role::Orchestrator => "orchestrator",
            Role::Operator => "operator",
        }
    }

    /// The TLS server name a client asks for to reach a server of this role.
    pub fn server_name(self) -> String {
        format!("{}.{TRUST_DOMAIN}", self.as_str())
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = TlsError;
    fn from_str(s: &str) -> Result<Self> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| {
                TlsError::Identity(format!(
                    "unknown role {s:?} (pp, fm, sc, orchestrator, operator)"
                ))
            })
    }
}

/// A node's identity, as its certificate names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Identity {
    pub role: Role,
    pub id: String,
}

impl Identity {
    pub fn new(role: Role, id: impl Into<String>) -> Result<Self> {
        let id = id.into();
        let ok = !id.is_empty()
            && id.len() <= 64
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
        if !ok {
            return Err(TlsError::Identity(format!(
                "node id {id:?}: 1-64 characters of [A-Za-z0-9._:-]"
            )));
        }
        Ok(Identity { role, id })
    }

    pub fn uri(&self) -> String {
        format!("spiffe://{TRUST_DOMAIN}/{}/{}", self.role, self.id)
    }

    fn from_uri(uri: &str) -> Option<Self> {
        let rest = uri.strip_prefix("spiffe://")?.strip_prefix(TRUST_DOMAIN)?;
        let mut parts = rest.strip_prefix('/')?.splitn(2, '/');
        let role = parts.next()?.parse().ok()?;
        Identity::new(role, parts.next()?).ok()
    }

    /// The identity a DER certificate names (its first `spiffe://starfabric/` SAN URI).
    pub fn from_cert(der: &[u8]) -> Option<Self> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        let san = cert.subject_alternative_name().ok()??;
        san.value.general_names.iter().find_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u) => Identity::from_uri(u),
            _ => None,
        })
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.role, self.id)
    }
}

// ------------------------------------------------------------------ CA and issuance

/// The orchestrator's certificate authority: made once, kept in the store as PEM.
pub struct Ca {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
    /// The certificate as made (or as stored): re-signing on load gives the same
    /// subject and key but another ECDSA signature, so nodes' `ca.pem` files and the
    /// store keep these exact bytes.
    pem: String,
}

impl Ca {
    /// A new self-signed CA (ECDSA P-256, ten years).
    pub fn generate() -> Result<Self> {
        let key = rcgen::KeyPair::generate()?;
        let mut params = rcgen::CertificateParams::default();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "starfabric CA");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        let now = SystemTime::now();
        params.not_before = (now - Duration::from_secs(3600)).into();
        params.not_after = (now + Duration::from_secs(10 * 365 * 86400)).into();
        let cert = params.self_signed(&key)?;
        let pem = cert.pem();
        Ok(Ca { cert, key, pem })
    }

    /// The CA kept as PEM (certificate and key).
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self> {
        let key = rcgen::KeyPair::from_pem(key_pem)?;
        let params = rcgen::CertificateParams::from_ca_cert_pem(cert_pem)?;
        // rcgen signs with a `Certificate`; re-signing the same parameters with the same
        // key gives an issuer whose subject and key match the stored certificate.
        let cert = params.self_signed(&key)?;
        Ok(Ca {
            cert,
            key,
            pem: cert_pem.to_string(),
        })
    }

    pub fn cert_pem(&self) -> String {
        self.pem.clone()
    }

    pub fn key_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// Signs a node's CSR for `id`, valid for `ttl` from now. The identity is the
    /// authority's (the token's role, the node's registered id), never the CSR's: only
    /// the CSR's public key is used.
    pub fn sign_csr(&self, csr_pem: &str, id: &Identity, ttl: Duration) -> Result<String> {
        let now = SystemTime::now();
        // A minute back: nodes' clocks differ by a little.
        self.sign_csr_between(csr_pem, id, now - Duration::from_secs(60), now + ttl)
    }

    /// [`Ca::sign_csr`] with explicit validity (tests make expired certificates).
    pub fn sign_csr_between(
        &self,
        csr_pem: &str,
        id: &Identity,
        not_before: SystemTime,
        not_after: SystemTime,
    ) -> Result<String> {
        let csr = rcgen::CertificateSigningRequestParams::from_pem(csr_pem)?;
        let params = node_params(id, not_before, not_after)?;
        let cert = params.signed_by(&csr.public_key, &self.cert, &self.key)?;
        Ok(cert.pem())
    }
}

impl Ca {
    /// Checks that `cert_pem` is a node certificate of this CA, valid now; its identity.
    pub fn verify(&self, cert_pem: &str) -> Result<Identity> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        for c in pem_certs(&self.cert_pem())? {
            roots.add(c)?;
        }
        let v = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .map_err(|e| TlsError::Pem(format!("verifier: {e}")))?;
        let chain = pem_certs(cert_pem)?;
        v.verify_client_cert(&chain[0], &chain[1..], UnixTime::now())?;
        Identity::from_cert(&chain[0])
            .ok_or_else(|| TlsError::Identity("certificate names no starfabric identity".into()))
    }

    /// A renewed certificate for the holder of `cert_pem` (valid, of this CA), for the
    /// same identity and the same key: the CSR must carry the certificate's public key.
    /// So no proof of possession beyond the CSR's own signature is needed: whoever
    /// sends a stolen (public) certificate gets a new one for a key they do not hold.
    pub fn renew(
        &self,
        cert_pem: &str,
        csr_pem: &str,
        ttl: Duration,
    ) -> Result<(Identity, String)> {
        let id = self.verify(cert_pem)?;
        let csr = rcgen::CertificateSigningRequestParams::from_pem(csr_pem)?;
        let chain = pem_certs(cert_pem)?;
        let (_, cert) = x509_parser::parse_x509_certificate(&chain[0])
            .map_err(|e| TlsError::Pem(format!("certificate: {e}")))?;
        use rcgen::PublicKeyData;
        if cert.public_key().subject_public_key.data.as_ref() != csr.public_key.der_bytes() {
            return Err(TlsError::Identity(
                "a renewal keeps the key: the CSR's public key is not the certificate's".into(),
            ));
        }
        let signed = self.sign_csr(csr_pem, &id, ttl)?;
        Ok((id, signed))
    }
}

fn node_params(
    id: &Identity,
    not_before: SystemTime,
    not_after: SystemTime,
) -> Result<rcgen::CertificateParams> {
    let mut params = rcgen::CertificateParams::new(vec![id.role.server_name()])?;
    params.subject_alt_names.push(rcgen::SanType::URI(
        rcgen::Ia5String::try_from(id.uri()).map_err(TlsError::Gen)?,
    ));
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, id.to_string());
    params.is_ca = rcgen::IsCa::ExplicitNoCa;
    params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.not_before = not_before.into();
    params.not_after = not_after.into();
    params.serial_number = Some(rcgen::SerialNumber::from_slice(
        &rand::random::<[u8; 16]>().map(|b| b & 0x7f),
    ));
    Ok(params)
}

/// A node's private key: generated on the node and never sent anywhere; the node sends
/// a CSR, which carries only the public key.
pub struct NodeKey(rcgen::KeyPair);

impl NodeKey {
    pub fn generate() -> Result<Self> {
        Ok(NodeKey(rcgen::KeyPair::generate()?))
    }

    pub fn from_pem(pem: &str) -> Result<Self> {
        Ok(NodeKey(rcgen::KeyPair::from_pem(pem)?))
    }

    pub fn pem(&self) -> String {
        self.0.serialize_pem()
    }

    /// A CSR for `id` (the CA fills in the identity itself; this names it for logs).
    pub fn csr_pem(&self, id: &Identity) -> Result<String> {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, id.to_string());
        Ok(params.serialize_request(&self.0)?.pem()?)
    }
}

/// Certificate, key and CA of a node: what `--tls-dir` holds (`ca.pem`, `node.pem`,
/// `node.key`) and what issuance returns.
#[derive(Clone)]
pub struct Bundle {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl Bundle {
    /// Issues a node bundle directly from `ca` (for `starfabric up` and tests; a remote
    /// node joins with a token instead and sends only its CSR).
    pub fn issue(ca: &Ca, id: &Identity, ttl: Duration) -> Result<Self> {
        let key = NodeKey::generate()?;
        let cert_pem = ca.sign_csr(&key.csr_pem(id)?, id, ttl)?;
        Ok(Bundle {
            ca_pem: ca.cert_pem(),
            cert_pem,
            key_pem: key.pem(),
        })
    }

    pub fn read_dir(dir: &Path) -> Result<Self> {
        let read = |name: &str| {
            let p = dir.join(name);
            std::fs::read_to_string(&p).map_err(|error| TlsError::File {
                path: p.display().to_string(),
                error,
            })
        };
        Ok(Bundle {
            ca_pem: read("ca.pem")?,
            cert_pem: read("node.pem")?,
            key_pem: read("node.key")?,
        })
    }

    pub fn write_dir(&self, dir: &Path) -> Result<()> {
        let io = |p: &Path, error| TlsError::File {
            path: p.display().to_string(),
            error,
        };
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        for (name, text) in [
            ("ca.pem", &self.ca_pem),
            ("node.pem", &self.cert_pem),
            ("node.key", &self.key_pem),
        ] {
            let p = dir.join(name);
            // Written beside and renamed: a node reading the dir never sees half a key.
            let tmp = dir.join(format!(".{name}.tmp"));
            std::fs::write(&tmp, text).map_err(|e| io(&tmp, e))?;
            #[cfg(unix)]
            if name == "node.key" {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
                    .map_err(|e| io(&tmp, e))?;
            }
            std::fs::rename(&tmp, &p).map_err(|e| io(&p, e))?;
        }
        Ok(())
    }
}

fn pem_certs(pem: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs: Vec<_> = rustls_pemfile::certs(&mut pem.as_bytes())
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| TlsError::Pem(format!("certificate PEM: {e}")))?;
    if certs.is_empty() {
        return Err(TlsError::Pem("no certificate in PEM".into()));
    }
    Ok(certs)
}

fn pem_key(pem: &str) -> Result<PrivateKeyDer<'static>> {
    rustls_pemfile::private_key(&mut pem.as_bytes())
        .map_err(|e| TlsError::Pem(format!("key PEM: {e}")))?
        .ok_or_else(|| TlsError::Pem("no private key in PEM".into()))
}

/// Validity of a DER certificate.
fn validity(der: &[u8]) -> Option<(SystemTime, SystemTime)> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let at = |t: i64| Some(SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(t).ok()?));
    Some((
        at(cert.validity().not_before.timestamp())?,
        at(cert.validity().not_after.timestamp())?,
    ))
}

// ------------------------------------------------------------------ refusals

/// Why a peer was refused; the `reason` label of `starfabric_tls_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    NoCert,
    Expired,
    UnknownCa,
    WrongRole,
    Revoked,
    BadCert,
    Handshake,
}

impl Refusal {
    pub const ALL: [Refusal; 7] = [
        Refusal::NoCert,
        Refusal::Expired,
        Refusal::UnknownCa,
        Refusal::WrongRole,
        Refusal::Revoked,
        Refusal::BadCert,
        Refusal::Handshake,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::NoCert => "no_cert",
            Refusal::Expired => "expired",
            Refusal::UnknownCa => "unknown_ca",
            Refusal::WrongRole => "wrong_role",
            Refusal::Revoked => "revoked",
            Refusal::BadCert => "bad_cert",
            Refusal::Handshake => "handshake",
        }
    }

    fn of(e: &rustls::Error) -> Refusal {
        use rustls::Error as E;
        match e {
            E::NoCertificatesPresented => Refusal::NoCert,
            E::InvalidCertificate(c) => match c {
                CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                    Refusal::Expired
                }
                CertificateError::UnknownIssuer | CertificateError::BadSignature => {
                    Refusal::UnknownCa
                }
                CertificateError::Revoked => Refusal::Revoked,
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. }
                | CertificateError::ApplicationVerificationFailure => Refusal::WrongRole,
                _ => Refusal::BadCert,
            },
            _ => Refusal::Handshake,
        }
    }

    fn of_io(e: &io::Error) -> Refusal {
        e.get_ref()
            .and_then(|i| i.downcast_ref::<rustls::Error>())
            .map(Refusal::of)
            .unwrap_or(Refusal::Handshake)
    }
}

/// Refused peers per reason, for the plane's `/metrics`.
#[derive(Debug, Default)]
pub struct Refusals([AtomicU64; 7]);

impl Refusals {
    pub fn count(&self, r: Refusal, peer: Option<SocketAddr>, detail: &dyn fmt::Display) {
        self.0[r as usize].fetch_add(1, Ordering::Relaxed);
        warn!(peer = ?peer, reason = r.as_str(), %detail, "TLS peer refused");
    }

    pub fn get(&self, r: Refusal) -> u64 {
        self.0[r as usize].load(Ordering::Relaxed)
    }

    /// Prometheus text lines (`starfabric_tls_refused_total{reason=...}`).
    pub fn render(&self) -> String {
        let mut s = String::from(
            "# HELP starfabric_tls_refused_total Peers refused at the TLS handshake or by role.\n\
             # TYPE starfabric_tls_refused_total counter\n",
        );
        for r in Refusal::ALL {
            s.push_str(&format!(
                "starfabric_tls_refused_total{{reason=\"{}\"}} {}\n",
                r.as_str(),
                self.get(r)
            ));
        }
        s
    }
}

// ------------------------------------------------------------------ the node's TLS state

/// One connection's kill switch: revocation sets it and wakes the connection's reader.
#[derive(Default)]
pub struct Cut {
    cut: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl Cut {
    fn fire(&self) {
        self.cut.store(true, Ordering::Release);
        if let Some(w) = self.waker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            w.wake();
        }
    }
}

/// A node's TLS state: its identity and current certificate (swapped on rotation), the
/// CA it trusts, the revoked node ids, the refusal counters and the live sessions.
pub struct NodeTls {
    identity: Identity,
    provider: Arc<CryptoProvider>,
    roots: Arc<RootCertStore>,
    current: RwLock<Arc<CertifiedKey>>,
    /// The current certificate (PEM), its key (PEM) and validity: what renewal sends
    /// and when it is due.
    held: RwLock<Held>,
    revoked: RwLock<HashSet<String>>,
    refusals: Refusals,
    sessions: Mutex<HashMap<String, Vec<Weak<Cut>>>>,
}

struct Held {
    cert_pem: String,
    key_pem: String,
    not_before: SystemTime,
    not_after: SystemTime,
}

impl fmt::Debug for NodeTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeTls")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl NodeTls {
    pub fn new(bundle: &Bundle) -> Result<Arc<Self>> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        for c in pem_certs(&bundle.ca_pem)? {
            roots.add(c)?;
        }
        let (key, identity, held) = certified(&provider, bundle)?;
        Ok(Arc::new(NodeTls {
            identity,
            provider,
            roots: Arc::new(roots),
            current: RwLock::new(key),
            held: RwLock::new(held),
            revoked: RwLock::new(HashSet::new()),
            refusals: Refusals::default(),
            sessions: Mutex::new(HashMap::new()),
        }))
    }

    pub fn from_dir(dir: &Path) -> Result<Arc<Self>> {
        Self::new(&Bundle::read_dir(dir)?)
    }

    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    pub fn refusals(&self) -> &Refusals {
        &self.refusals
    }

    /// When the current certificate expires.
    pub fn not_after(&self) -> SystemTime {
        self.held
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .not_after
    }

    /// When the certificate is due for renewal: at two thirds of its lifetime.
    pub fn renew_at(&self) -> SystemTime {
        let h = self.held.read().unwrap_or_else(|e| e.into_inner());
        let life = h.not_after.duration_since(h.not_before).unwrap_or_default();
        h.not_before + life * 2 / 3
    }

    /// The current certificate (PEM), which renewal presents.
    pub fn cert_pem(&self) -> String {
        self.held
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .cert_pem
            .clone()
    }

    /// A CSR for renewal: same identity, same key (see [`Ca::renew`]).
    pub fn renewal_csr(&self) -> Result<String> {
        let key = self
            .held
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .key_pem
            .clone();
        NodeKey::from_pem(&key)?.csr_pem(&self.identity)
    }

    /// [`NodeTls::rotate`] to a renewed certificate for the current key.
    pub fn rotate_cert(&self, cert_pem: &str) -> Result<()> {
        let key = self
            .held
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .key_pem
            .clone();
        self.rotate(cert_pem, &key)
    }

    /// The node's bundle as it stands (to write back to its `--tls-dir`).
    pub fn bundle(&self, ca_pem: &str) -> Bundle {
        let h = self.held.read().unwrap_or_else(|e| e.into_inner());
        Bundle {
            ca_pem: ca_pem.to_string(),
            cert_pem: h.cert_pem.clone(),
            key_pem: h.key_pem.clone(),
        }
    }

    /// Installs a renewed certificate (same identity). New handshakes use it at once;
    /// established connections keep theirs, so no session drops.
    pub fn rotate(&self, cert_pem: &str, key_pem: &str) -> Result<()> {
        let b = Bundle {
            ca_pem: String::new(),
            cert_pem: cert_pem.into(),
            key_pem: key_pem.into(),
        };
        let (key, identity, held) = certified(&self.provider, &b)?;
        if identity != self.identity {
            return Err(TlsError::Identity(format!(
                "renewed certificate names {identity}, this node is {}",
                self.identity
            )));
        }
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = key;
        *self.held.write().unwrap_or_else(|e| e.into_inner()) = held;
        Ok(())
    }

    /// Refuses `id`'s future handshakes and cuts its established sessions.
    pub fn revoke(&self, id: &str) {
        self.revoked
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string());
        let cuts = self
            .sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id)
            .unwrap_or_default();
        let mut n = 0;
        for c in cuts.iter().filter_map(Weak::upgrade) {
            c.fire();
            n += 1;
        }
        warn!(
            node = id,
            sessions = n,
            "node revoked; its sessions are cut"
        );
    }

    pub fn is_revoked(&self, id: &str) -> bool {
        self.revoked
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(id)
    }

    fn current(&self) -> Arc<CertifiedKey> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn register(&self, id: &str) -> Arc<Cut> {
        let cut = Arc::new(Cut::default());
        let mut s = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        let v = s.entry(id.to_string()).or_default();
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(&cut));
        cut
    }

    /// A server config that requires a client certificate from the CA whose role is in
    /// `allowed` and whose id is not revoked.
    pub fn server_config(self: &Arc<Self>, allowed: &[Role]) -> Result<Arc<ServerConfig>> {
        let inner =
            WebPkiClientVerifier::builder_with_provider(self.roots.clone(), self.provider.clone())
                .build()
                .map_err(|e| TlsError::Pem(format!("client verifier: {e}")))?;
        let verifier = Arc::new(RoleVerifier {
            inner,
            allowed: allowed.to_vec(),
            tls: Arc::downgrade(self),
        });
        let mut cfg = ServerConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_cert_resolver(Arc::new(Resolver(Arc::downgrade(self))));
        // No resumption: a resumed session skips the certificate checks, so a revoked
        // or expired peer could come back on an old ticket. Plane connections are
        // long-lived; a full handshake per reconnect costs nothing that matters.
        cfg.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(cfg))
    }

    /// A client config presenting this node's certificate and trusting only the CA.
    pub fn client_config(self: &Arc<Self>) -> Result<Arc<ClientConfig>> {
        let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
            self.roots.clone(),
            self.provider.clone(),
        )
        .build()
        .map_err(|e| TlsError::Pem(format!("server verifier: {e}")))?;
        let verifier = Arc::new(ServerRevocationCheck {
            inner,
            tls: Arc::downgrade(self),
        });
        let mut cfg = ClientConfig::builder_with_provider(self.provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_cert_resolver(Arc::new(Resolver(Arc::downgrade(self))));
        cfg.resumption = rustls::client::Resumption::disabled();
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(cfg))
    }
}

fn certified(provider: &CryptoProvider, b: &Bundle) -> Result<(Arc<CertifiedKey>, Identity, Held)> {
    let chain = pem_certs(&b.cert_pem)?;
    let identity = Identity::from_cert(&chain[0])
        .ok_or_else(|| TlsError::Identity("certificate names no starfabric identity".into()))?;
    let (not_before, not_after) =
        validity(&chain[0]).ok_or_else(|| TlsError::Pem("unreadable validity".into()))?;
    let key = provider
        .key_provider
        .load_private_key(pem_key(&b.key_pem)?)?;
    let held = Held {
        cert_pem: b.cert_pem.clone(),
        key_pem: b.key_pem.clone(),
        not_before,
        not_after,
    };
    Ok((Arc::new(CertifiedKey::new(chain, key)), identity, held))
}

/// Serves (and presents) whatever certificate the node currently holds.
#[derive(Debug)]
struct Resolver(Weak<NodeTls>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.upgrade()?.current())
    }
}

impl ResolvesClientCert for Resolver {
    fn resolve(&self, _: &[&[u8]], _: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.0.upgrade()?.current())
    }
    fn has_certs(&self) -> bool {
        true
    }
}

/// The handshake-signature half of a verifier: webpki's (`self.inner`), unchanged. Both
/// verifiers below add a revocation check to the certificate half only.
macro_rules! signatures_by_webpki {
    () => {
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.inner.verify_tls12_signature(message, cert, dss)
        }
        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.inner.verify_tls13_signature(message, cert, dss)
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.inner.supported_verify_schemes()
        }
    };
}

/// The CA chain check (webpki), then the role and revocation checks.
#[derive(Debug)]
struct RoleVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    allowed: Vec<Role>,
    tls: Weak<NodeTls>,
}

fn check_peer(tls: &Weak<NodeTls>, der: &[u8], allowed: &[Role]) -> Result<(), rustls::Error> {
    let Some(id) = Identity::from_cert(der) else {
        return Err(rustls::Error::InvalidCertificate(
            CertificateError::BadEncoding,
        ));
    };
    if !allowed.contains(&id.role) {
        return Err(rustls::Error::InvalidCertificate(
            CertificateError::ApplicationVerificationFailure,
        ));
    }
    if tls.upgrade().is_some_and(|t| t.is_revoked(&id.id)) {
        return Err(rustls::Error::InvalidCertificate(CertificateError::Revoked));
    }
    Ok(())
}

impl ClientCertVerifier for RoleVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }
    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner
            .verify_client_cert(end_entity, intermediates, now)?;
        check_peer(&self.tls, end_entity, &self.allowed)?;
        Ok(ClientCertVerified::assertion())
    }
    signatures_by_webpki!();
}

/// webpki's server check (CA chain and the role's server name), then revocation.
#[derive(Debug)]
struct ServerRevocationCheck {
    inner: Arc<rustls::client::WebPkiServerVerifier>,
    tls: Weak<NodeTls>,
}

impl ServerCertVerifier for ServerRevocationCheck {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.inner
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)?;
        check_peer(&self.tls, end_entity, &Role::ALL)?;
        Ok(ServerCertVerified::assertion())
    }
    signatures_by_webpki!();
}

// ------------------------------------------------------------------ serving

/// What a request's extensions carry about its connection.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    pub remote: Option<SocketAddr>,
    /// `None` on an `--insecure` (plaintext) server.
    pub identity: Option<Identity>,
}

/// An accepted connection: plaintext (`--insecure`) or mTLS.
pub enum Conn {
    Plain(TcpStream),
    Tls(
        Box<tokio_rustls::server::TlsStream<TcpStream>>,
        PeerInfo,
        Arc<Cut>,
    ),
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = PeerInfo;
    fn connect_info(&self) -> PeerInfo {
        match self {
            Conn::Plain(s) => PeerInfo {
                remote: s.peer_addr().ok(),
                identity: None,
            },
            Conn::Tls(_, p, _) => p.clone(),
        }
    }
}

fn cut_err() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "peer revoked")
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s, _, cut) => {
                *cut.waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(cx.waker().clone());
                if cut.cut.load(Ordering::Acquire) {
                    return Poll::Ready(Err(cut_err()));
                }
                Pin::new(s.as_mut()).poll_read(cx, buf)
            }
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Tls(s, _, cut) => {
                if cut.cut.load(Ordering::Acquire) {
                    return Poll::Ready(Err(cut_err()));
                }
                Pin::new(s.as_mut()).poll_write(cx, buf)
            }
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Tls(s, _, _) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s, _, _) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// How long an accepted connection may take to finish its TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// The accepted connections of `listener` (TCP_NODELAY set): mTLS-checked against
/// `allowed` roles with `tls`, or plaintext when `tls` is `None` (`--insecure`).
/// Handshakes run concurrently, so one slow or hostile peer delays no one else.
pub fn incoming(
    listener: TcpListener,
    tls: Option<Arc<NodeTls>>,
    allowed: &[Role],
) -> Result<tokio_stream::wrappers::ReceiverStream<io::Result<Conn>>> {
    let acceptor = match &tls {
        Some(t) => Some(tokio_rustls::TlsAcceptor::from(t.server_config(allowed)?)),
        None => None,
    };
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) => {
                        // Out of descriptors and the like: back off, keep serving.
                        debug!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = tx.closed() => return,
            };
            let _ = tcp.set_nodelay(true);
            let (Some(acceptor), Some(tls)) = (&acceptor, &tls) else {
                if tx.send(Ok(Conn::Plain(tcp))).await.is_err() {
                    return;
                }
                continue;
            };
            let (acceptor, tls, tx) = (acceptor.clone(), tls.clone(), tx.clone());
            tokio::spawn(async move {
                let s = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        tls.refusals.count(Refusal::of_io(&e), Some(peer), &e);
                        return;
                    }
                    Err(_) => {
                        tls.refusals
                            .count(Refusal::Handshake, Some(peer), &"handshake timed out");
                        return;
                    }
                };
                let identity = s
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .and_then(|c| Identity::from_cert(c));
                let Some(identity) = identity else {
                    // The verifier already demanded an identity; unreachable in practice.
                    tls.refusals
                        .count(Refusal::BadCert, Some(peer), &"no identity");
                    return;
                };
                let cut = tls.register(&identity.id);
                debug!(%peer, peer_id = %identity, "TLS session accepted");
                let info = PeerInfo {
                    remote: Some(peer),
                    identity: Some(identity),
                };
                let _ = tx.send(Ok(Conn::Tls(Box::new(s), info, cut))).await;
            });
        }
    });
    Ok(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// The peer identity of a request served over [`incoming`].
pub fn peer<T>(req: &tonic::Request<T>) -> Option<&PeerInfo> {
    req.extensions().get::<PeerInfo>()
}

/// Refuses a request whose peer certificate is not of one of `allowed` roles (one
/// server may host services for several roles, e.g. FM's PP and SC sessions). On a
/// plaintext server (`tls` is `None`) everything passes: that is what `--insecure` means.
#[allow(clippy::result_large_err)]
pub fn authorize<T>(
    req: &tonic::Request<T>,
    tls: Option<&NodeTls>,
    allowed: &[Role],
) -> Result<Identity, tonic::Status> {
    let Some(tls) = tls else {
        return Ok(Identity {
            role: allowed[0],
            id: String::new(),
        });
    };
    let p = peer(req);
    let remote = p.and_then(|p| p.remote);
    match p.and_then(|p| p.identity.clone()) {
        Some(id) if allowed.contains(&id.role) => Ok(id),
        Some(id) => {
            tls.refusals.count(
                Refusal::WrongRole,
                remote,
                &format_args!("{id} not allowed here"),
            );
            Err(tonic::Status::permission_denied(format!(
                "a {} certificate cannot open this session",
                id.role
            )))
        }
        None => {
            tls.refusals
                .count(Refusal::NoCert, remote, &"no peer identity");
            Err(tonic::Status::unauthenticated("no client certificate"))
        }
    }
}

// ------------------------------------------------------------------ connecting

/// Connects `endpoint` (built by [`crate::endpoint`]) to a server of role `server`:
/// over mTLS with `tls`, or plaintext when `tls` is `None` (`--insecure`).
pub async fn connect(
    endpoint: tonic::transport::Endpoint,
    tls: Option<&Arc<NodeTls>>,
    server: Role,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    match tls {
        None => endpoint.connect().await,
        Some(t) => {
            let c = Connector::new(t, server).map_err(|e| {
                // A config error surfaces on the first connect; tonic's error has no
                // public constructor, so it rides in as a connector error.
                warn!(error = %e, "TLS client config");
                e
            });
            match c {
                Ok(c) => endpoint.connect_with_connector(c).await,
                Err(_) => endpoint.connect_with_connector(FailConnector).await,
            }
        }
    }
}

/// [`connect`] without dialling now: the channel connects on its first call and
/// reconnects on later ones, so a server that is down at start (or restarts) is retried
/// rather than failing the caller (the autoscaler's FM clients).
pub fn connect_lazy(
    endpoint: tonic::transport::Endpoint,
    tls: Option<&Arc<NodeTls>>,
    server: Role,
) -> tonic::transport::Channel {
    match tls {
        None => endpoint.connect_lazy(),
        Some(t) => match Connector::new(t, server) {
            Ok(c) => endpoint.connect_with_connector_lazy(c),
            Err(e) => {
                warn!(error = %e, "TLS client config");
                endpoint.connect_with_connector_lazy(FailConnector)
            }
        },
    }
}

/// Dials TCP, then TLS with this node's certificate, asking for `server`'s role name.
#[derive(Clone)]
struct Connector {
    tls: tokio_rustls::TlsConnector,
    name: ServerName<'static>,
}

impl Connector {
    fn new(t: &Arc<NodeTls>, server: Role) -> Result<Self> {
        let name = ServerName::try_from(server.server_name())
            .map_err(|e| TlsError::Identity(e.to_string()))?;
        Ok(Connector {
            tls: tokio_rustls::TlsConnector::from(t.client_config()?),
            name,
        })
    }
}

type BoxFut<T> = Pin<Box<dyn std::future::Future<Output = io::Result<T>> + Send>>;

impl tower_service::Service<http::Uri> for Connector {
    type Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = BoxFut<Self::Response>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let c = self.clone();
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no host in URI"))?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let port = uri.port_u16().unwrap_or(443);
            let tcp = TcpStream::connect((host, port)).await?;
            tcp.set_nodelay(true)?;
            let s = c.tls.connect(c.name, tcp).await?;
            Ok(hyper_util::rt::TokioIo::new(s))
        })
    }
}

#[derive(Clone)]
struct FailConnector;

impl tower_service::Service<http::Uri> for FailConnector {
    type Response = hyper_util::rt::TokioIo<TcpStream>;
    type Error = io::Error;
    type Future = BoxFut<Self::Response>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn call(&mut self, _: http::Uri) -> Self::Future {
        Box::pin(async { Err(io::Error::other("TLS client configuration is invalid")) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_stream::StreamExt;

    const HOUR: Duration = Duration::from_secs(3600);

    fn node(ca: &Ca, role: Role, id: &str) -> Arc<NodeTls> {
        let id = Identity::new(role, id).unwrap();
        NodeTls::new(&Bundle::issue(ca, &id, HOUR).unwrap()).unwrap()
    }

    struct Server {
        addr: SocketAddr,
        tls: Arc<NodeTls>,
        conns: tokio_stream::wrappers::ReceiverStream<io::Result<Conn>>,
    }

    async fn server(tls: Arc<NodeTls>, allowed: &[Role]) -> Server {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let conns = incoming(l, Some(tls.clone()), allowed).unwrap();
        Server { addr, tls, conns }
    }

    /// A TLS client; the handshake's outcome for the client is only known after a
    /// round trip (TLS 1.3 sends the client's certificate last).
    async fn dial(
        cfg: Arc<ClientConfig>,
        addr: SocketAddr,
        as_role: Role,
    ) -> io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let tcp = TcpStream::connect(addr).await?;
        tokio_rustls::TlsConnector::from(cfg)
            .connect(ServerName::try_from(as_role.server_name()).unwrap(), tcp)
            .await
    }

    /// Dial `addr` as FM and trade a byte, whatever the handshake gives: the server's
    /// side of a refused handshake is what the caller checks.
    async fn knock(cfg: Arc<ClientConfig>, addr: SocketAddr) {
        if let Ok(mut c) = dial(cfg, addr, Role::Fm).await {
            let _ = c.write_all(b"x").await;
            let _ = c.read(&mut [0u8; 1]).await;
        }
    }

    /// A client with `cfg` knocks on `s`, which must refuse it and count `r`.
    async fn refuses(s: &Server, cfg: Arc<ClientConfig>, r: Refusal) {
        knock(cfg, s.addr).await;
        // The refusal is counted by the handshake task; wait for it (bounded).
        for _ in 0..500 {
            if s.tls.refusals().get(r) > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "no {} refusal counted; metrics:\n{}",
            r.as_str(),
            s.tls.refusals().render()
        );
    }

    /// FM `fm-1` of `ca`, taking sessions from `allowed` roles.
    async fn fm_server(ca: &Ca, allowed: &[Role]) -> Server {
        server(node(ca, Role::Fm, "fm-1"), allowed).await
    }

    async fn accepted(s: &mut Server) -> Conn {
        s.conns.next().await.unwrap().unwrap()
    }

    /// A session to `s` dialled with `cfg` (as `as_role`'s server name), opened by the
    /// client's `hello` (the server accepts once the client's handshake is done):
    /// both ends, the client's kept open.
    async fn session(
        s: &mut Server,
        cfg: Arc<ClientConfig>,
        as_role: Role,
        hello: &[u8],
    ) -> (tokio_rustls::client::TlsStream<TcpStream>, Conn) {
        let mut c = dial(cfg, s.addr, as_role).await.unwrap();
        c.write_all(hello).await.unwrap();
        (c, accepted(s).await)
    }

    #[tokio::test]
    async fn a_node_of_an_allowed_role_is_accepted_with_its_identity() {
        let ca = Ca::generate().unwrap();
        let mut s = fm_server(&ca, &[Role::Pp]).await;
        let pp = node(&ca, Role::Pp, "pp-7");
        let (_c, mut conn) = session(&mut s, pp.client_config().unwrap(), Role::Fm, b"hi").await;
        let info = tonic::transport::server::Connected::connect_info(&conn);
        assert_eq!(
            info.identity,
            Some(Identity::new(Role::Pp, "pp-7").unwrap())
        );
        let mut b = [0u8; 2];
        conn.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"hi");
        assert!(Refusal::ALL.iter().all(|r| s.tls.refusals().get(*r) == 0));
    }

    #[tokio::test]
    async fn a_client_without_a_certificate_is_refused_and_counted() {
        let ca = Ca::generate().unwrap();
        let s = fm_server(&ca, &[Role::Pp]).await;
        let mut roots = RootCertStore::empty();
        roots
            .add(pem_certs(&ca.cert_pem()).unwrap().remove(0))
            .unwrap();
        let cfg =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_protocol_versions(&[&rustls::version::TLS13])
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
        refuses(&s, Arc::new(cfg), Refusal::NoCert).await;
        assert!(s.tls.refusals().render().contains("reason=\"no_cert\"} 1"));
    }

    #[tokio::test]
    async fn an_expired_certificate_is_refused_and_counted() {
        let ca = Ca::generate().unwrap();
        let s = fm_server(&ca, &[Role::Sc]).await;
        let id = Identity::new(Role::Sc, "sc-1").unwrap();
        let key = NodeKey::generate().unwrap();
        let now = SystemTime::now();
        let cert = ca
            .sign_csr_between(&key.csr_pem(&id).unwrap(), &id, now - 2 * HOUR, now - HOUR)
            .unwrap();
        let old = NodeTls::new(&Bundle {
            ca_pem: ca.cert_pem(),
            cert_pem: cert,
            key_pem: key.pem(),
        })
        .unwrap();
        refuses(&s, old.client_config().unwrap(), Refusal::Expired).await;
    }

    #[tokio::test]
    async fn a_certificate_from_another_ca_is_refused_both_ways() {
        let ca = Ca::generate().unwrap();
        let rogue_ca = Ca::generate().unwrap();
        let s = fm_server(&ca, &[Role::Sc]).await;
        let rogue = node(&rogue_ca, Role::Sc, "sc-1");
        // The rogue does not trust our FM either: its own handshake fails.
        assert!(dial(rogue.client_config().unwrap(), s.addr, Role::Fm)
            .await
            .is_err());
        // A rogue that trusts our CA (so its own check passes) is refused by the server.
        let mut b =
            Bundle::issue(&rogue_ca, &Identity::new(Role::Sc, "sc-1").unwrap(), HOUR).unwrap();
        b.ca_pem = ca.cert_pem();
        let rogue = NodeTls::new(&b).unwrap();
        refuses(&s, rogue.client_config().unwrap(), Refusal::UnknownCa).await;
    }

    #[tokio::test]
    async fn a_certificate_of_the_wrong_role_is_refused_and_counted() {
        let ca = Ca::generate().unwrap();
        let s = fm_server(&ca, &[Role::Sc]).await;
        let pp = node(&ca, Role::Pp, "pp-1");
        refuses(&s, pp.client_config().unwrap(), Refusal::WrongRole).await;
    }

    #[tokio::test]
    async fn a_client_refuses_a_server_of_the_wrong_role() {
        let ca = Ca::generate().unwrap();
        // An SC posing as FM: the PP asks for fm.starfabric, the SC cert does not name it.
        let s = server(node(&ca, Role::Sc, "sc-1"), &[Role::Pp]).await;
        let pp = node(&ca, Role::Pp, "pp-1");
        let e = dial(pp.client_config().unwrap(), s.addr, Role::Fm)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("not valid for name"), "{e}");
    }

    #[tokio::test]
    async fn revocation_cuts_live_sessions_and_refuses_reconnects() {
        let ca = Ca::generate().unwrap();
        let mut s = fm_server(&ca, &[Role::Sc]).await;
        let sc = node(&ca, Role::Sc, "sc-9");
        let (_c, mut conn) = session(&mut s, sc.client_config().unwrap(), Role::Fm, b"a").await;
        let mut b = [0u8; 1];
        conn.read_exact(&mut b).await.unwrap();
        let reader = tokio::spawn(async move {
            let mut b = [0u8; 1];
            conn.read(&mut b).await
        });
        s.tls.revoke("sc-9");
        let e = reader.await.unwrap().unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted);
        refuses(&s, sc.client_config().unwrap(), Refusal::Revoked).await;
    }

    #[tokio::test]
    async fn rotation_keeps_established_sessions_and_new_ones_get_the_new_cert() {
        let ca = Ca::generate().unwrap();
        let fm = node(&ca, Role::Fm, "fm-1");
        let mut s = server(fm.clone(), &[Role::Sc]).await;
        let sc = node(&ca, Role::Sc, "sc-1");
        let cfg = sc.client_config().unwrap();
        let (mut c1, mut conn1) = session(&mut s, cfg.clone(), Role::Fm, b"1").await;
        let old = c1.get_ref().1.peer_certificates().unwrap()[0].clone();

        let renewed = Bundle::issue(&ca, fm.identity(), HOUR).unwrap();
        fm.rotate(&renewed.cert_pem, &renewed.key_pem).unwrap();

        // The established session still carries traffic both ways.
        let mut b = [0u8; 1];
        conn1.read_exact(&mut b).await.unwrap();
        conn1.write_all(b"2").await.unwrap();
        c1.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"2");
        // A new session is served the renewed certificate.
        let c2 = dial(cfg, s.addr, Role::Fm).await.unwrap();
        let new = c2.get_ref().1.peer_certificates().unwrap()[0].clone();
        assert_ne!(old, new);
        assert_eq!(
            new.as_ref(),
            pem_certs(&renewed.cert_pem).unwrap()[0].as_ref()
        );
    }

    #[test]
    fn rotation_refuses_a_certificate_of_another_identity() {
        let ca = Ca::generate().unwrap();
        let fm = node(&ca, Role::Fm, "fm-1");
        let other = Bundle::issue(&ca, &Identity::new(Role::Fm, "fm-2").unwrap(), HOUR).unwrap();
        assert!(fm.rotate(&other.cert_pem, &other.key_pem).is_err());
    }

    #[tokio::test]
    async fn a_ca_reloaded_from_pem_issues_certificates_the_original_trusts() {
        let ca = Ca::generate().unwrap();
        let again = Ca::from_pem(&ca.cert_pem(), &ca.key_pem()).unwrap();
        let mut s = server(node(&ca, Role::Orchestrator, "o"), &Role::NODES).await;
        let sc = node(&again, Role::Sc, "sc-1");
        let (_c, conn) = session(
            &mut s,
            sc.client_config().unwrap(),
            Role::Orchestrator,
            b"x",
        )
        .await;
        let info = tonic::transport::server::Connected::connect_info(&conn);
        assert_eq!(info.identity.unwrap().role, Role::Sc);
    }

    #[test]
    fn authorize_checks_the_role_of_the_request_peer() {
        let ca = Ca::generate().unwrap();
        let fm = node(&ca, Role::Fm, "fm-1");
        let req = |role| {
            let mut r = tonic::Request::new(());
            r.extensions_mut().insert(PeerInfo {
                remote: None,
                identity: Some(Identity::new(role, "n1").unwrap()),
            });
            r
        };
        assert!(authorize(&req(Role::Pp), Some(&fm), &[Role::Pp]).is_ok());
        let e = authorize(&req(Role::Pp), Some(&fm), &[Role::Sc]).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert_eq!(fm.refusals().get(Refusal::WrongRole), 1);
        let e = authorize(&tonic::Request::new(()), Some(&fm), &[Role::Sc]).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        // --insecure: no TLS, no checks.
        assert!(authorize(&tonic::Request::new(()), None, &[Role::Sc]).is_ok());
    }

    #[test]
    fn bad_identities_and_pem_are_errors() {
        assert!(Identity::new(Role::Sc, "").is_err());
        assert!(Identity::new(Role::Sc, "a/b").is_err());
        assert!("admin".parse::<Role>().is_err());
        assert!(Identity::from_uri("spiffe://other/sc/1").is_none());
        assert_eq!(
            Identity::from_uri("spiffe://starfabric/sc/1"),
            Some(Identity::new(Role::Sc, "1").unwrap())
        );
        let garbage = Bundle {
            ca_pem: "not pem".into(),
            cert_pem: "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".into(),
            key_pem: String::new(),
        };
        assert!(NodeTls::new(&garbage).is_err());
        assert!(Ca::from_pem("x", "y").is_err());
        let ca = Ca::generate().unwrap();
        let id = Identity::new(Role::Sc, "1").unwrap();
        assert!(ca.sign_csr("not a csr", &id, HOUR).is_err());
    }

    #[test]
    fn renewal_keeps_identity_and_key_and_refuses_others() {
        let ca = Ca::generate().unwrap();
        let id = Identity::new(Role::Sc, "sc-4").unwrap();
        let key = NodeKey::generate().unwrap();
        let cert = ca.sign_csr(&key.csr_pem(&id).unwrap(), &id, HOUR).unwrap();
        assert_eq!(ca.verify(&cert).unwrap(), id);
        let (rid, renewed) = ca.renew(&cert, &key.csr_pem(&id).unwrap(), HOUR).unwrap();
        assert_eq!(rid, id);
        assert_ne!(renewed, cert);
        assert_eq!(ca.verify(&renewed).unwrap(), id);
        // Another key: refused (a stolen certificate buys no certificate for the thief).
        let other = NodeKey::generate().unwrap();
        assert!(ca.renew(&cert, &other.csr_pem(&id).unwrap(), HOUR).is_err());
        // Another CA's certificate: refused.
        let rogue = Ca::generate().unwrap();
        let rc = rogue
            .sign_csr(&key.csr_pem(&id).unwrap(), &id, HOUR)
            .unwrap();
        assert!(ca.renew(&rc, &key.csr_pem(&id).unwrap(), HOUR).is_err());
        // An expired one: refused.
        let now = SystemTime::now();
        let old = ca
            .sign_csr_between(&key.csr_pem(&id).unwrap(), &id, now - 2 * HOUR, now - HOUR)
            .unwrap();
        assert!(ca.verify(&old).is_err());
    }

    #[test]
    fn bundles_round_trip_through_a_directory() {
        let ca = Ca::generate().unwrap();
        let id = Identity::new(Role::Pp, "pp-3").unwrap();
        let b = Bundle::issue(&ca, &id, HOUR).unwrap();
        let dir = std::env::temp_dir().join(format!("sf-tls-{}", rand::random::<u64>()));
        b.write_dir(&dir).unwrap();
        let t = NodeTls::from_dir(&dir).unwrap();
        assert_eq!(t.identity(), &id);
        let left = t.not_after().duration_since(SystemTime::now()).unwrap();
        assert!(left <= HOUR && left > HOUR / 2);
        // Renewal is due at two thirds of the lifetime (which starts a minute back).
        let due = t.renew_at().duration_since(SystemTime::now()).unwrap();
        assert!(due < left && due > HOUR / 3, "{due:?}");
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(NodeTls::from_dir(&dir).is_err());
    }
}
