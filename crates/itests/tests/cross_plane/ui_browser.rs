//! The dashboard (`/ui`) in a real browser, over a real platform: Debian's chromium,
//! headless, driven over WebDriver (chromedriver) by fantoccini, against an orchestrator
//! on a real etcd, an FM node, six SC nodes (builtin NFs) and two PP nodes (UDP
//! backend), all started in-process with their planes' start functions and registered
//! with the orchestrator as they would be in production. Two tenants are made through
//! the REST API; VXLAN traffic of tenant acme runs through both PP nodes; each tenant's
//! chain is scaled out through FM's gRPC API. Every event, partition, node and counter
//! the pages show comes from those planes.
//!
//! Checks: without a token, the login page; a bad token, the login page with an error;
//! tenant A's token shows A's tenant, chain, SC group and FM events and none of B's, and
//! B's pages are refused; the admin token shows both, the node tables and FM's vIP
//! table answer; htmx refreshes the live fragments; logging out ends the session.
//!
//! The PP nodes run the UDP backend, which cannot join a vIP group (that needs AF_XDP on
//! a veth), so FM's vIP table is empty here; its rendering with entries is a unit test
//! in `orchestrator::ui`, and vIP moves under traffic are `e2e_pp_cluster`'s.
//!
//! `SF_UI_SCREENSHOTS=1` writes the screenshots to docs/img/ (otherwise to a temp dir).

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, UdpSocket};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use packet::build::{udp_v4, vxlan_wrap, VXLAN_V4_OVERHEAD};
use proto::v1;
use serde_json::{json, Value};

const ADMIN: &str = "sfa_dashboard_test";
/// Every browser step and wait is bounded by this.
const STEP: Duration = Duration::from_secs(20);
/// The platform's start-up and each FM scale-out are bounded by this.
const SETUP: Duration = Duration::from_secs(60);
/// Acme's VXLAN traffic never runs longer than this, whatever the test does.
const TRAFFIC_LIMIT: Duration = Duration::from_secs(180);

fn wait<T>(limit: Duration, what: &str, f: impl FnMut() -> Option<T>) -> T {
    testkit::wait_until_every(limit, Duration::from_millis(50), what, f)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// chromedriver, and the chromium it starts, stopped when dropped (also on a failed
/// assertion): chromedriver by its PID through [`testkit::ChildGuard`], then any
/// browser process still running with this test's own user-data dir, by its PID.
struct Browser {
    driver: Option<testkit::ChildGuard>,
    profile: tempfile::TempDir,
    port: u16,
}

impl Browser {
    fn start() -> Browser {
        for bin in ["/usr/bin/chromedriver", "/usr/bin/chromium"] {
            assert!(
                std::path::Path::new(bin).exists(),
                "{bin} is missing: run scripts/setup.sh (it installs Debian's chromium and chromium-driver)"
            );
        }
        let profile = tempfile::tempdir().unwrap();
        let port = free_port();
        let log = profile.path().join("chromedriver.log");
        let child = Command::new("/usr/bin/chromedriver")
            .arg(format!("--port={port}"))
            .arg(format!("--log-path={}", log.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let guard = testkit::ChildGuard::with_grace(child, Duration::from_secs(2));
        testkit::wait_until(STEP, "chromedriver listening", || {
            std::net::TcpStream::connect(("127.0.0.1", port)).ok()
        });
        Browser {
            driver: Some(guard),
            profile,
            port,
        }
    }

    async fn session(&self) -> Client {
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": "/usr/bin/chromium",
                "args": [
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--no-first-run",
                    "--window-size=1400,1250",
                    format!("--user-data-dir={}", self.profile.path().join("profile").display()),
                ],
            }),
        );
        let mut builder =
            ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new());
        builder.capabilities(caps);
        let url = format!("http://127.0.0.1:{}", self.port);
        tokio::time::timeout(STEP, builder.connect(&url))
            .await
            .expect("WebDriver session within 20 s")
            .expect("WebDriver session")
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // chromedriver first (SIGTERM, then SIGKILL after 2 s), then any browser process
        // it left that runs with our profile directory.
        drop(self.driver.take());
        let marker = self.profile.path().display().to_string();
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return;
        };
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&marker) {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        }
    }
}

fn call(base: &str, token: &str, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let r = orchestrator::client::Client::new(base, Some(token))
        .exchange(method, path, body)
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    (r.status, r.body)
}

fn put(base: &str, path: &str, body: Value) -> Value {
    let (s, v) = call(base, ADMIN, "PUT", path, Some(body));
    assert_eq!(s, 201, "PUT {path}: {v}");
    v
}

/// Tenant `name` with one VPC, one NF and one chain; its id.
#[allow(clippy::too_many_arguments)]
fn make_tenant(
    base: &str,
    name: &str,
    vni: u32,
    cidr: &str,
    nf: &str,
    nf_body: Value,
    chain: &str,
    egress_vni: u32,
) -> u32 {
    let t = put(base, &format!("/v1/tenants/{name}"), json!({}));
    put(
        base,
        &format!("/v1/tenants/{name}/vpcs/{name}-vpc"),
        json!({"vni": vni, "cidrs": [cidr]}),
    );
    put(base, &format!("/v1/tenants/{name}/nfs/{nf}"), nf_body);
    put(
        base,
        &format!("/v1/tenants/{name}/chains/{chain}"),
        json!({"vpc": format!("{name}-vpc"), "nfs": [nf],
            "forward": loopback_egress(egress_vni), "reverse": loopback_egress(vni)}),
    );
    t["id"].as_u64().unwrap() as u32
}

/// Chain egress in both directions: VXLAN to 127.0.0.1 (the PP nodes send everything to
/// the test's sink port), so no frame leaves loopback.
fn loopback_egress(vni: u32) -> Value {
    json!({"decap": true, "encap": {"dst": "127.0.0.1", "vni": vni}})
}

/// The planes, each started the way its `starfabric` subcommand starts it, and stopped
/// (in reverse order) when dropped, also on a failed assertion.
struct Platform {
    pps: Vec<pp::node::PpHandle>,
    scs: Vec<sc::process::ScProcess>,
    fm: Option<fm::node::FmNode>,
    stop: Arc<AtomicBool>,
    /// Where PP's output goes (read by nobody; kept so the port stays bound).
    _sink: UdpSocket,
}

impl Platform {
    /// Every plane on mTLS with certificates from `ca`, the orchestrator's CA.
    fn start(control: &str, ca: &proto::tls::Ca, n_sc: usize, n_pp: usize) -> Platform {
        let local: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let sink = UdpSocket::bind("127.0.0.1:0").unwrap();
        let mut fm_cfg = fm::FmFile::parse("{}").unwrap().to_config("fm-1").unwrap();
        fm_cfg.tls = Some(node_tls(ca, proto::tls::Role::Fm, "fm-1"));
        let fm = fm::node::start(fm::node::FmNodeConfig {
            fm: fm_cfg,
            listen: local,
            orchestrator: Some(control.to_string()),
            advertise: None,
            metrics: None,
            stats_interval: None,
            lines: telemetry::Lines::default(),
            threads: 2,
        })
        .expect("FM node starts");
        let scs = (1..=n_sc)
            .map(|i| {
                sc::process::start(
                    sc::process::ScProcessConfig {
                        id: format!("sc-{i}"),
                        fm: None,
                        orchestrator: Some(control.to_string()),
                        listen: local,
                        advertise: None,
                        factory: Arc::new(sc::BuiltinNfs),
                        timer_period: Duration::from_millis(200),
                        metrics: None,
                        capacity: None,
                        lines: telemetry::Lines::default(),
                        workers: Some(2),
                        worker_cpus: Some(sc::workers::rotated(&sc::workers::allowed_cpus(), i)),
                        worker_slice: Some(sc::workers::DEFAULT_WORKER_SLICE),
                        idle: None,
                        queue_limit: None,
                        lag_limit: None,
                        assigner: None,
                        assigner_model: None,
                        assign_period: None,
                        tls: Some(node_tls(ca, proto::tls::Role::Sc, &format!("sc-{i}"))),
                        spare_chains: 1,
                    },
                    stop.clone(),
                )
                .expect("SC node starts")
                .expect("SC node not stopped")
            })
            .collect();
        let pps = (1..=n_pp)
            .map(|i| {
                pp::node::start(
                    pp::node::PpNodeConfig {
                        listen: SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0),
                        io: pp::node::IoKind::Udp,
                        id: Some(format!("pp-{i}")),
                        orchestrator: Some(control.to_string()),
                        peer_port: Some(sink.local_addr().unwrap().port()),
                        tls: Some(node_tls(ca, proto::tls::Role::Pp, &format!("pp-{i}"))),
                        ..pp::node::PpNodeConfig::default()
                    },
                    stop.clone(),
                )
                .expect("PP node starts")
                .expect("PP node not stopped")
            })
            .collect();
        Platform {
            pps,
            scs,
            fm: Some(fm),
            stop,
            _sink: sink,
        }
    }
}

impl Drop for Platform {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for p in self.pps.drain(..) {
            let _ = p.stop();
        }
        for s in self.scs.drain(..) {
            s.stop();
        }
        if let Some(fm) = self.fm.take() {
            fm.stop();
        }
    }
}

/// One VXLAN datagram (VXLAN header and inner frame) of acme's VPC: UDP from
/// 198.18.10.2:`sport` to 198.18.30.1:53.
fn acme_datagram(vni: u32, sport: u16) -> Vec<u8> {
    let inner = udp_v4([198, 18, 10, 2], sport, [198, 18, 30, 1], 53, &[0u8; 200]);
    vxlan_wrap([127, 0, 0, 1], [127, 0, 0, 1], 1, vni, &inner)[VXLAN_V4_OVERHEAD - 8..].to_vec()
}

/// Acme's traffic: 8 flows to each PP node, about 400 datagrams/s per node, until
/// `stop` or [`TRAFFIC_LIMIT`].
fn acme_traffic(
    to: Vec<SocketAddrV4>,
    vni: u32,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        let frames: Vec<Vec<u8>> = (0..8).map(|i| acme_datagram(vni, 41000 + i)).collect();
        let t0 = Instant::now();
        let mut sent = 0u64;
        while !stop.load(Ordering::Relaxed) && t0.elapsed() < TRAFFIC_LIMIT {
            for f in &frames {
                for a in &to {
                    if sock.send_to(f, a).is_ok() {
                        sent += 1;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        sent
    })
}

/// Node `id`'s TLS state as `role`, issued by `ca`.
fn node_tls(ca: &proto::tls::Ca, role: proto::tls::Role, id: &str) -> Arc<proto::tls::NodeTls> {
    let ident = proto::tls::Identity::new(role, id).unwrap();
    let b = proto::tls::Bundle::issue(ca, &ident, Duration::from_secs(3600)).unwrap();
    proto::tls::NodeTls::new(&b).unwrap()
}

/// Scale tenant `tenant`'s chain `chain` out through FM's gRPC API (what `starfabric
/// scale out` calls, as `operator`); the new group's id. FM refuses a scale-out (failed
/// precondition) until the orchestrator's new, wider shard set has reached it: retried
/// for [`STEP`].
fn scale_out(
    rt: &tokio::runtime::Runtime,
    operator: &Arc<proto::tls::NodeTls>,
    fm: SocketAddr,
    tenant: u32,
    chain: u32,
) -> u64 {
    let r = rt.block_on(async move {
        let ch = proto::connect(&fm.to_string(), Some(operator), proto::tls::Role::Fm)
            .await
            .expect("FM's gRPC");
        let mut c = v1::fabric_master_client::FabricMasterClient::new(ch);
        let deadline = Instant::now() + STEP;
        loop {
            let req = v1::ScaleOutRequest {
                tenant,
                chain,
                group: None,
                ..Default::default()
            };
            match tokio::time::timeout(SETUP, c.scale_out(req))
                .await
                .expect("scale-out answered within 60 s")
            {
                Ok(r) => break r.into_inner(),
                Err(e)
                    if e.code() == tonic::Code::FailedPrecondition && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(200)).await
                }
                Err(e) => panic!("scale-out of tenant {tenant}: {e}"),
            }
        }
    });
    assert!(r.aborted.is_empty(), "scale-out aborted: {}", r.aborted);
    r.to_group
}

async fn text(c: &Client) -> String {
    elem_text(c, "body").await
}

/// The text of the element `css`, retried while the page is loading (bounded by
/// [`STEP`]).
async fn elem_text(c: &Client, css: &str) -> String {
    let deadline = Instant::now() + STEP;
    loop {
        let r = tokio::time::timeout(STEP, async {
            c.find(Locator::Css(css)).await?.text().await
        })
        .await
        .unwrap_or_else(|_| panic!("{css} within 20 s"));
        match r {
            Ok(t) => return t,
            Err(e) if Instant::now() >= deadline => panic!("{css}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

async fn goto(c: &Client, url: &str) -> String {
    tokio::time::timeout(STEP, c.goto(url))
        .await
        .unwrap_or_else(|_| panic!("{url} within 20 s"))
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    text(c).await
}

/// Poll the page text until `ok` holds (bounded by [`STEP`]).
async fn wait_text(c: &Client, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + STEP;
    loop {
        let t = text(c).await;
        if ok(&t) {
            return t;
        }
        assert!(Instant::now() < deadline, "{what}: page text was:\n{t}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Click the element with id `id`.
async fn click(c: &Client, id: &str) {
    c.find(Locator::Id(id))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

async fn login(c: &Client, base: &str, token: &str, expect: &str) -> String {
    goto(c, &format!("{base}/ui")).await;
    let field = c.find(Locator::Id("token")).await.expect("token field");
    field.send_keys(token).await.unwrap();
    click(c, "login").await;
    wait_text(c, "the page after logging in", |t| t.contains(expect)).await
}

async fn screenshot(c: &Client, dir: &std::path::Path, name: &str) {
    let png = tokio::time::timeout(STEP, c.screenshot())
        .await
        .expect("screenshot within 20 s")
        .expect("screenshot");
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    std::fs::write(dir.join(name), png).unwrap();
}

/// `GET path` as `token`, asserting 200.
fn get(base: &str, token: &str, path: &str) -> Value {
    let (s, v) = call(base, token, "GET", path, None);
    assert_eq!(s, 200, "GET {path}: {v}");
    v
}

/// The partitions of `tenant`'s chains, as the admin sees them.
fn partitions_of(base: &str, tenant: &str) -> Vec<Value> {
    get(base, ADMIN, "/v1/partitions")
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["tenant"] == tenant)
        .cloned()
        .collect()
}

#[test]
fn dashboard_over_a_real_platform_in_headless_chromium() {
    let etcd = store::testing::EtcdServer::start();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store: Arc<dyn store::Store> = Arc::new(
        rt.block_on(store::EtcdStore::connect(
            &etcd.endpoints(),
            "/starfabric-ui-test/",
        ))
        .unwrap(),
    );
    let mut cfg = orchestrator::OrchestratorConfig::new(ADMIN);
    cfg.report_interval = Duration::from_millis(200);
    cfg.security = orchestrator::control::Security::Tls {
        cert_ttl: Duration::from_secs(3600),
    };
    let orch = rt
        .block_on(orchestrator::start(
            cfg,
            store,
            "127.0.0.1:0".parse().unwrap(),
            "127.0.0.1:0".parse().unwrap(),
        ))
        .unwrap();
    let base = format!("http://{}", orch.api_addr);

    // Two tenants through the REST API, and a token for acme.
    let acme = make_tenant(
        &base,
        "acme",
        100,
        "198.18.10.0/24",
        "acme-nat",
        json!({"kind": "snat", "config": {"pools": [{"addresses": ["198.18.100.1"], "ports": {"lo": 1024, "hi": 65535}}]}}),
        "acme-egress",
        300,
    );
    let globex = make_tenant(
        &base,
        "globex",
        200,
        "198.18.20.0/24",
        "globex-lb",
        json!({"kind": "lb", "config": {"services": [{"vip": "198.19.0.100", "port": 80, "protocol": "tcp",
            "backends": [{"addr": "198.19.1.7", "port": 8080}]}]}}),
        "globex-web",
        400,
    );
    let (s, tok) = call(&base, ADMIN, "POST", "/v1/tenants/acme/tokens", None);
    assert_eq!(s, 201, "{tok}");
    let acme_token = tok["token"].as_str().unwrap().to_string();

    // The planes, registered with the orchestrator, which directs FM to serve both chains
    // and binds the tenants' VNIs on the PP nodes.
    let ca = orch
        .shared
        .cfg
        .pki
        .as_ref()
        .expect("the orchestrator's CA")
        .ca();
    let operator = node_tls(ca, proto::tls::Role::Operator, "ui-test");
    let platform = Platform::start(&orch.control_addr.to_string(), ca, 6, 2);
    let fm_addr = platform.fm.as_ref().unwrap().addr();
    wait(SETUP, "9 nodes up and both chains' groups reported", || {
        let st = get(&base, ADMIN, "/v1/status");
        let parts = get(&base, ADMIN, "/v1/partitions");
        (st["nodes_up"] == 9 && parts.as_array().is_some_and(|p| p.len() == 2)).then_some(())
    });
    let acme_chain = get(&base, ADMIN, "/v1/tenants/acme/chains/acme-egress")["id"]
        .as_u64()
        .unwrap() as u32;
    let globex_chain = get(&base, ADMIN, "/v1/tenants/globex/chains/globex-web")["id"]
        .as_u64()
        .unwrap() as u32;

    // Acme's traffic through both PP nodes: each flow's first packet goes to SC through
    // FM, the rest hit the rule SC decided.
    let traffic_stop = Arc::new(AtomicBool::new(false));
    let traffic = acme_traffic(
        platform.pps.iter().map(|p| p.local_addr()).collect(),
        100,
        traffic_stop.clone(),
    );
    let stats = wait(
        SETUP,
        "acme's flows set up on both PP nodes, decided by SC, and hitting",
        || {
            let s = get(&base, ADMIN, "/v1/tenants/acme/stats");
            (s["flows_set_up"].as_u64() >= Some(16)
                && s["packets"].as_u64() > Some(64)
                && s["nodes"].as_u64() >= Some(2)
                && s["rule_requests"].as_u64() >= Some(16)
                // The 8 flows are the same on both nodes: FM's rule cache answers the
                // second node's requests, so SC decides each flow once.
                && s["requests_applied"].as_u64() >= Some(8))
            .then_some(s)
        },
    );
    // What the nodes report: their bound addresses and their load.
    wait(
        STEP,
        "both PP nodes report the packets they receive",
        || {
            let nodes = get(&base, ADMIN, "/v1/nodes");
            let pps: Vec<&Value> = nodes
                .as_array()?
                .iter()
                .filter(|n| n["role"] == "pp")
                .collect();
            (pps.len() == 2 && pps.iter().all(|n| n["packets_per_s"].as_f64() > Some(0.0)))
                .then_some(())
        },
    );
    let nodes = get(&base, ADMIN, "/v1/nodes");
    for n in nodes.as_array().unwrap() {
        let addr = n["addr"].as_str().unwrap_or_default();
        assert!(
            !addr.is_empty() && !addr.ends_with(":0"),
            "a node registered an address nobody can reach: {n}"
        );
    }
    assert!(stats["bytes"].as_u64() > Some(64 * 200), "{stats}");

    // Each tenant's chain scales out once through FM: real scale events about each. A
    // second group of 3 needs 3 more SC nodes in the tenant's shard set: the operator
    // widens the sets to all 6 nodes (G = 6, O = 6) through the API first.
    let (s, v) = call(
        &base,
        ADMIN,
        "PUT",
        "/v1/placement/limits",
        Some(json!({"threshold": 0.8, "g_min": 6, "g_max": 6, "overlap": 6})),
    );
    assert_eq!(s, 200, "{v}");
    wait(
        SETUP,
        "both tenants' shard sets widened to 6 SC nodes",
        || {
            let view = get(&base, ADMIN, "/v1/placement");
            let sets = view["tenants"].as_array()?.clone();
            (sets.len() == 2
                && sets
                    .iter()
                    .all(|t| t["sc_nodes"].as_array().is_some_and(|n| n.len() == 6)))
            .then_some(())
        },
    );
    let acme_before = partitions_of(&base, "acme");
    let acme_group = scale_out(&rt, &operator, fm_addr, acme, acme_chain);
    let globex_group = scale_out(&rt, &operator, fm_addr, globex, globex_chain);
    assert_ne!(acme_group, globex_group);
    wait(STEP, "both scale-outs in the reported partitions", || {
        let a = partitions_of(&base, "acme");
        let g = partitions_of(&base, "globex");
        (a.iter().any(|p| p["group"] == acme_group) && g.iter().any(|p| p["group"] == globex_group))
            .then_some(())
    });
    let acme_parts = partitions_of(&base, "acme");
    assert_eq!(acme_parts.len(), acme_before.len() + 1, "{acme_parts:?}");
    // A replica of acme's new group, as its tenant page must name it.
    let acme_replica = acme_parts
        .iter()
        .find(|p| p["group"] == acme_group)
        .and_then(|p| p["replicas"][0].as_str())
        .unwrap()
        .to_string();
    let globex_replicas: Vec<String> = partitions_of(&base, "globex")
        .iter()
        .flat_map(|p| p["replicas"].as_array().cloned().unwrap_or_default())
        .filter_map(|r| r.as_str().map(str::to_string))
        .collect();
    let (s, _) = call(&base, &acme_token, "GET", "/v1/tenants/globex", None);
    assert_eq!(s, 403);

    let keep = std::env::var_os("SF_UI_SCREENSHOTS").is_some_and(|v| v == "1");
    let tmp = tempfile::tempdir().unwrap();
    let shots: PathBuf = if keep {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/img")
    } else {
        tmp.path().to_path_buf()
    };
    std::fs::create_dir_all(&shots).unwrap();

    let browser = Browser::start();
    rt.block_on(async {
        let c = browser.session().await;

        // ---- no token: the login page, everywhere
        let t = goto(&c, &format!("{base}/ui")).await;
        assert!(t.contains("Log in") && t.contains("Token"), "{t}");
        assert!(!t.contains("acme") && !t.contains("globex"), "{t}");
        for path in [
            "/ui/tenants",
            "/ui/tenants/acme",
            "/ui/fragments/rates",
            "/ui/events",
        ] {
            let t = goto(&c, &format!("{base}{path}")).await;
            assert!(t.contains("Log in") && !t.contains("acme"), "{path}: {t}");
        }
        screenshot(&c, &shots, "dashboard-login.png").await;

        // ---- a bad token: the login page again, with an error
        let t = login(&c, &base, "sft_not_a_real_token", "Unknown or revoked").await;
        assert!(t.contains("Unknown or revoked token"), "{t}");

        // ---- tenant acme: its own data only
        let t = login(&c, &base, &acme_token, "Log out").await;
        assert!(t.contains("tenant acme"), "{t}");
        let t = wait_text(&c, "acme's SC groups on the overview", |t| {
            t.contains("acme/acme-egress")
        })
        .await;
        assert!(!t.contains("globex"), "overview shows globex to acme:\n{t}");
        assert!(
            !t.contains("pp-1") && !t.contains("fm-1") && !t.contains("127.0.0.1"),
            "node details shown to a tenant:\n{t}"
        );
        let t = goto(&c, &format!("{base}/ui/tenants")).await;
        assert!(
            t.contains("acme") && t.contains("acme-egress") && t.contains("acme-nat"),
            "{t}"
        );
        assert!(
            !t.contains("globex"),
            "tenants page shows globex to acme:\n{t}"
        );
        let t = goto(&c, &format!("{base}/ui/tenants/acme")).await;
        assert!(
            t.contains("acme-egress") && t.contains(&acme_replica),
            "acme's page lacks its new group's head {acme_replica}:\n{t}"
        );
        let t = goto(&c, &format!("{base}/ui/rates")).await;
        assert!(t.contains("acme") && t.contains("Mbit/s"), "{t}");
        assert!(
            !t.contains("globex"),
            "rates page shows globex to acme:\n{t}"
        );
        // After a refresh or two, acme's rate from both PP nodes' counters.
        let deadline = Instant::now() + STEP;
        loop {
            let t = elem_text(&c, "#rate-table").await;
            assert!(!t.contains("globex"), "{t}");
            if t.lines().any(|l| l.starts_with("acme") && !l.contains('–')) {
                break;
            }
            assert!(Instant::now() < deadline, "no rate for acme:\n{t}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        screenshot(&c, &shots, "dashboard-tenant.png").await;
        // FM's own log: acme's scale-out, and nothing about globex or the nodes.
        let deadline = Instant::now() + STEP;
        let t = loop {
            let t = goto(&c, &format!("{base}/ui/events")).await;
            if t.contains("sc_scale_out_done") {
                break t;
            }
            assert!(
                Instant::now() < deadline,
                "no scale-out in acme's events:\n{t}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        assert!(
            t.contains(&format!("group {acme_group}"))
                && !t.contains(&format!("group {globex_group}")),
            "acme's own FM events:\n{t}"
        );
        for other in ["globex", "pp_node_joined", "sc_node_joined", "fm-1", "pp-1"] {
            assert!(
                !t.contains(other),
                "events page shows {other:?} to acme:\n{t}"
            );
        }
        // B's URLs are refused, and so is anything about B through the fragments.
        for path in ["/ui/tenants/globex", "/ui/tenants/nobody"] {
            let t = goto(&c, &format!("{base}{path}")).await;
            assert!(
                t.contains("403 Forbidden") && t.contains("cannot access tenant"),
                "{path}: {t}"
            );
        }
        for path in [
            "/ui/fragments/topology",
            "/ui/fragments/rates",
            "/ui/fragments/events",
        ] {
            let t = goto(&c, &format!("{base}{path}")).await;
            assert!(!t.contains("globex"), "{path} shows globex to acme:\n{t}");
        }
        // The session cookie is HttpOnly: scripts cannot read the token.
        let cookie = c.execute("return document.cookie", vec![]).await.unwrap();
        assert!(
            !cookie.as_str().unwrap_or_default().contains("sft_"),
            "{cookie}"
        );
        let htmx = c.execute("return typeof htmx", vec![]).await.unwrap();
        assert_eq!(htmx, json!("undefined"), "a fragment is not a page");
        goto(&c, &format!("{base}/ui")).await;
        let htmx = c.execute("return typeof htmx", vec![]).await.unwrap();
        assert_eq!(htmx, json!("object"), "htmx loaded from /ui/static");

        // ---- log out: the login page, and the pages are closed again
        click(&c, "logout").await;
        wait_text(&c, "the login page after logging out", |t| {
            t.contains("Log in")
        })
        .await;
        let t = goto(&c, &format!("{base}/ui/tenants")).await;
        assert!(t.contains("Log in") && !t.contains("acme-egress"), "{t}");

        // ---- admin: everything
        let t = login(&c, &base, ADMIN, "Log out").await;
        assert!(t.contains("admin"), "{t}");
        let t = wait_text(&c, "both tenants' groups and every node", |t| {
            t.contains("acme/acme-egress")
                && t.contains("globex/globex-web")
                && t.contains("pp-2")
                && t.contains("sc-6")
        })
        .await;
        assert!(t.contains("fm-1"), "{t}");
        // FM answered the vIP-table query (empty: UDP-backend PP nodes join no vIP group).
        assert!(!t.contains("vIP table of"), "FM's vIP table failed:\n{t}");
        for r in &globex_replicas {
            assert!(t.contains(r.as_str()), "globex's replica {r} missing:\n{t}");
        }
        // htmx swaps the topology fragment in place: mark the element, wait for a swap.
        c.execute(
            "document.querySelector('#topology table').id = 'stale'",
            vec![],
        )
        .await
        .unwrap();
        wait_text(&c, "a topology refresh", |_| true).await;
        let deadline = Instant::now() + STEP;
        while c.find(Locator::Id("stale")).await.is_ok() {
            assert!(
                Instant::now() < deadline,
                "the topology fragment never refreshed"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        screenshot(&c, &shots, "dashboard-admin.png").await;
        let t = goto(&c, &format!("{base}/ui/tenants")).await;
        assert!(t.contains("acme-egress") && t.contains("globex-web"), "{t}");
        let t = goto(&c, &format!("{base}/ui/tenants/globex")).await;
        assert!(t.contains("globex-web") && t.contains("globex-lb"), "{t}");
        goto(&c, &format!("{base}/ui/events")).await;
        let t = wait_text(&c, "placement events", |t| t.contains("placement_written")).await;
        for all in [
            format!("group {acme_group}"),
            format!("group {globex_group}"),
            "pp_node_joined".to_string(),
            "sc_node_joined".to_string(),
            "sc_group_created".to_string(),
        ] {
            assert!(t.contains(&all), "the admin's events lack {all:?}:\n{t}");
        }
        screenshot(&c, &shots, "dashboard-events.png").await;
        let t = goto(&c, &format!("{base}/ui/trace")).await;
        assert!(t.contains("starfabric trace"), "{t}");

        let _ = tokio::time::timeout(STEP, c.close()).await;
    });
    drop(browser);
    traffic_stop.store(true, Ordering::Relaxed);
    let sent = traffic.join().unwrap();
    assert!(sent > 0);
    drop(platform);
    drop(orch);
}
