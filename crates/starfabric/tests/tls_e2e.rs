//! Plane security end to end (docs/security.md): a real `starfabric fm` with a
//! certificate refuses rogue peers — no certificate, an expired one, one of another CA,
//! one of the wrong role, plaintext — and counts each in its `/metrics`; a node without
//! --tls-dir or --insecure refuses to start.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use proto::tls::{Bundle, Ca, Identity, NodeKey, NodeTls, Role};
use telemetry::scrape;
use testkit::child::{line_matching, stdout_lines};
use testkit::{wait_until_every, ChildGuard};

const HOUR: Duration = Duration::from_secs(3600);

fn node_tls(ca: &Ca, role: Role, id: &str) -> Arc<NodeTls> {
    NodeTls::new(&Bundle::issue(ca, &Identity::new(role, id).unwrap(), HOUR).unwrap()).unwrap()
}

fn refused(metrics: SocketAddr, reason: &str) -> f64 {
    let r = scrape::get(metrics, "/metrics").unwrap();
    scrape::value(
        &scrape::parse(&r.body),
        "starfabric_fm_tls_refused_total",
        &[("reason", reason)],
    )
    .unwrap_or_else(|| panic!("no tls_refused series for {reason}:\n{}", r.body))
}

/// One attempt to open an SC session at FM with `tls` (None: plaintext); the error.
async fn sc_session(fm: &str, tls: Option<&Arc<NodeTls>>) -> String {
    let ch = match proto::connect(fm, tls, Role::Fm).await {
        Ok(ch) => ch,
        Err(e) => return format!("connect: {e}"),
    };
    let mut c = proto::v1::fabric_master_client::FabricMasterClient::new(ch);
    let hello = proto::v1::ScUp::default();
    match c.sc_session(tokio_stream::iter(vec![hello])).await {
        Ok(_) => "accepted".into(),
        Err(s) => format!("{:?}: {}", s.code(), s.message()),
    }
}

/// `cmd` started with its stdout piped (warnings to stderr): a guard that kills it on
/// drop, and its stdout lines.
fn spawn(cmd: &mut Command) -> (ChildGuard, std::sync::mpsc::Receiver<String>) {
    let mut child = cmd
        .env("STARFABRIC_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let lines = stdout_lines(&mut child);
    (ChildGuard::with_grace(child, Duration::ZERO), lines)
}

/// A real `starfabric fm` on loopback with an FM certificate of `ca` (in `dir`): its
/// guard, gRPC address and metrics address.
fn start_fm(ca: &Ca, dir: &std::path::Path) -> (ChildGuard, String, SocketAddr) {
    let fm_dir = dir.join("fm");
    Bundle::issue(ca, &Identity::new(Role::Fm, "fm-1").unwrap(), HOUR)
        .unwrap()
        .write_dir(&fm_dir)
        .unwrap();
    let (guard, lines) = spawn(
        Command::new(env!("CARGO_BIN_EXE_starfabric"))
            .args(["fm", "--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0"])
            .args(["--duration", "60", "--tls-dir"])
            .arg(&fm_dir),
    );
    let fm_addr = line_matching(&lines, Duration::from_secs(20), |l| {
        l.strip_prefix("fm: listening on ")
            .map(|r| r.split(',').next().unwrap().to_string())
    })
    .unwrap();
    let metrics: SocketAddr = line_matching(&lines, Duration::from_secs(20), |l| {
        l.strip_prefix("metrics: listening on http://")
            .and_then(|r| r.strip_suffix("/metrics"))
            .map(str::to_string)
    })
    .unwrap()
    .parse()
    .unwrap();
    (guard, fm_addr, metrics)
}

#[test]
fn fm_refuses_rogue_peers_and_counts_each_reason() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::generate().unwrap();
    let (_guard, fm_addr, metrics) = start_fm(&ca, dir.path());

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // An expired certificate of the right CA and role.
    let id = Identity::new(Role::Sc, "sc-old").unwrap();
    let key = NodeKey::generate().unwrap();
    let now = SystemTime::now();
    let expired = NodeTls::new(&Bundle {
        ca_pem: ca.cert_pem(),
        cert_pem: ca
            .sign_csr_between(&key.csr_pem(&id).unwrap(), &id, now - 2 * HOUR, now - HOUR)
            .unwrap(),
        key_pem: key.pem(),
    })
    .unwrap();
    // A certificate of another CA that trusts ours (so only the server can refuse it).
    let mut b = Bundle::issue(
        &Ca::generate().unwrap(),
        &Identity::new(Role::Sc, "sc-x").unwrap(),
        HOUR,
    )
    .unwrap();
    b.ca_pem = ca.cert_pem();
    let rogue = NodeTls::new(&b).unwrap();
    // A PP certificate on the SC session.
    let pp = node_tls(&ca, Role::Pp, "pp-1");
    // An SC certificate registering nothing valid: admitted by TLS, refused by FM's
    // registration check (not a TLS refusal).
    let sc = node_tls(&ca, Role::Sc, "sc-1");
    rt.block_on(async {
        for t in [Some(&expired), Some(&rogue), None] {
            let r = sc_session(&fm_addr, t).await;
            assert_ne!(r, "accepted");
        }
        let r = sc_session(&fm_addr, Some(&pp)).await;
        assert!(r.starts_with("PermissionDenied"), "{r}");
        let r = sc_session(&fm_addr, Some(&sc)).await;
        assert!(!r.starts_with("PermissionDenied"), "{r}");
        // No certificate at all, over TLS.
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_pemfile_certs(&ca.cert_pem()) {
            roots.add(c).unwrap();
        }
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(&fm_addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("fm.starfabric").unwrap();
        if let Ok(mut s) = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(name, tcp)
            .await
        {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let _ = s.write_all(b"PRI * HTTP/2.0\r\n\r\n").await;
            let _ = s.read(&mut [0u8; 16]).await;
        }
    });
    for reason in [
        "expired",
        "unknown_ca",
        "handshake",
        "wrong_role",
        "no_cert",
    ] {
        wait_until_every(
            Duration::from_secs(10),
            Duration::from_millis(50),
            &format!("a {reason} refusal counted"),
            || (refused(metrics, reason) >= 1.0).then_some(()),
        );
    }
    assert_eq!(refused(metrics, "revoked"), 0.0);
}

/// `starfabric ARGS` run to completion: success, stdout, stderr.
fn cli(args: &[&str]) -> (bool, String, String) {
    testkit::child::output_of(
        Command::new(env!("CARGO_BIN_EXE_starfabric"))
            .args(args)
            .env("STARFABRIC_LOG", "warn")
            .env_remove("STARFABRIC_TLS_DIR")
            .env_remove("STARFABRIC_INSECURE"),
    )
}

#[test]
fn fms_operator_services_answer_operator_certificates_only() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::generate().unwrap();
    let (_guard, fm, metrics) = start_fm(&ca, dir.path());
    let issue = |role, id: &str| {
        let d = dir.path().join(id);
        Bundle::issue(&ca, &Identity::new(role, id).unwrap(), HOUR)
            .unwrap()
            .write_dir(&d)
            .unwrap();
        d.display().to_string()
    };
    let op = issue(Role::Operator, "alice");
    let pp = issue(Role::Pp, "pp-1");

    // Neither flag: told what to pass, before any handshake.
    let (ok, _, err) = cli(&["scale", "map", "--fm", &fm]);
    assert!(
        !ok && err.contains("--tls-dir") && err.contains("--insecure"),
        "{err}"
    );
    // A node's certificate is refused by the tool itself.
    let (ok, _, err) = cli(&["scale", "map", "--fm", &fm, "--tls-dir", &pp]);
    assert!(!ok && err.contains("operator or orchestrator"), "{err}");
    // Plaintext against a TLS FM fails.
    let (ok, _, _) = cli(&["scale", "map", "--fm", &fm, "--insecure", "--timeout", "5"]);
    assert!(!ok);
    // The operator's certificate gets FM's answers.
    let (ok, out, err) = cli(&["scale", "map", "--fm", &fm, "--tls-dir", &op, "-o", "json"]);
    assert!(ok, "{err}");
    let map: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(map.get("partitions").is_some(), "{out}");
    let (ok, _, err) = cli(&["events", "--fm", &fm, "--tls-dir", &op, "-o", "json"]);
    assert!(ok, "{err}");

    // A PP or SC node's certificate passes the handshake but not the operator services.
    let before = refused(metrics, "wrong_role");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for t in [
            node_tls(&ca, Role::Pp, "pp-2"),
            node_tls(&ca, Role::Sc, "sc-2"),
        ] {
            let ch = proto::connect(&fm, Some(&t), Role::Fm).await.unwrap();
            let mut c = proto::v1::fabric_master_client::FabricMasterClient::new(ch);
            let e = c
                .get_partition_map(proto::v1::PartitionMapRequest {})
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
            let e = c
                .scale_out(proto::v1::ScaleOutRequest::default())
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        }
    });
    assert!(refused(metrics, "wrong_role") >= before + 4.0);
}

#[test]
fn a_bootstrap_token_from_a_file_admits_several_nodes_of_its_role() {
    let dir = tempfile::tempdir().unwrap();
    let token = format!("sfj_{}", "5a".repeat(16));
    let token_file = dir.path().join("join-sc");
    std::fs::write(&token_file, format!("{token}\n")).unwrap();
    let mut orch = Command::new(env!("CARGO_BIN_EXE_starfabric"));
    orch.args([
        "orchestrator",
        "--api",
        "127.0.0.1:0",
        "--control",
        "127.0.0.1:0",
    ])
    .arg("--store")
    .arg(format!("embedded:{}", dir.path().join("o.redb").display()))
    .arg("--admin-token-file")
    .arg(dir.path().join("admin"))
    .arg("--bootstrap-token")
    .arg(format!("sc={}", token_file.display()))
    .args(["--duration", "60"]);
    let (_guard, lines) = spawn(&mut orch);
    let api = line_matching(&lines, Duration::from_secs(20), |l| {
        l.strip_prefix("orchestrator: api ")
            .map(|r| r.split(' ').next().unwrap().to_string())
    })
    .unwrap();
    // `node join` with `token` as `id`, asking for `role` if given: (the CLI's answer,
    // the node's TLS dir).
    let join_with = |token: &str, id: &str, role: Option<&str>| {
        let d = dir.path().join(id);
        let mut args = vec![
            "--server", &api, "node", "join", "--token", token, "--id", id,
        ];
        if let Some(role) = role {
            args.extend(["--role", role]);
        }
        args.extend(["--tls-dir", d.to_str().unwrap()]);
        let r = cli(&args);
        (r, d)
    };
    let join = |id: &str, role: &str| join_with(&token, id, Some(role));
    // Two SC nodes with the one token, as a StatefulSet's pods do.
    for id in ["sc-0", "sc-1"] {
        let ((ok, _, err), d) = join(id, "sc");
        assert!(ok, "{id}: {err}");
        let tls = NodeTls::from_dir(&d).unwrap();
        assert_eq!(tls.identity(), &Identity::new(Role::Sc, id).unwrap());
    }
    // The token is the SC role's: asking for another role still yields an SC
    // certificate (the role is the token's), which FM would refuse as PP.
    let ((ok, _, err), d) = join("pp-9", "pp");
    assert!(ok, "{err}");
    assert_eq!(NodeTls::from_dir(&d).unwrap().identity().role, Role::Sc);
    // A token of the right form the orchestrator was not given is refused.
    let other = format!("sfj_{}", "a5".repeat(16));
    let (r, _) = join_with(&other, "sc-2", None);
    assert!(!r.0 && r.2.contains("unknown"), "{}", r.2);
}

fn rustls_pemfile_certs(pem: &str) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    rustls_pemfile::certs(&mut pem.as_bytes())
        .map(Result::unwrap)
        .collect()
}

#[test]
fn a_node_needs_a_certificate_or_an_explicit_insecure() {
    // An SC node that dials an FM nobody serves; what it says on stderr, as it refuses.
    let refusal = |tls_dir: Option<&std::path::Path>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_starfabric"));
        cmd.args([
            "sc",
            "--fm",
            "127.0.0.1:9",
            "--id",
            "sc-1",
            "--duration",
            "1",
        ]);
        if let Some(d) = tls_dir {
            cmd.arg("--tls-dir").arg(d);
        }
        let out = cmd
            .env_remove("STARFABRIC_INSECURE")
            .env_remove("STARFABRIC_TLS_DIR")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = refusal(None);
    assert!(
        err.contains("--tls-dir") && err.contains("--insecure"),
        "{err}"
    );
    // A directory holding another node's certificate is refused too.
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::generate().unwrap();
    Bundle::issue(&ca, &Identity::new(Role::Pp, "pp-1").unwrap(), HOUR)
        .unwrap()
        .write_dir(dir.path())
        .unwrap();
    let err = refusal(Some(dir.path()));
    assert!(err.contains("pp/pp-1") && err.contains("sc/sc-1"), "{err}");
}
