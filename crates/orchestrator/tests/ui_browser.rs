//! The dashboard (`/ui`) in a real browser: Debian's chromium, headless, driven over
//! WebDriver (chromedriver) by fantoccini, against an orchestrator on a real etcd with
//! two tenants made through the REST API and a few registered nodes.
//!
//! Checks: without a token, the login page; a bad token, the login page with an error;
//! tenant A's token shows A's tenant, chain and SC groups and none of B's, and B's
//! pages are refused; the admin token shows both and the node tables; htmx refreshes
//! the live fragments; logging out ends the session.
//!
//! `SF_UI_SCREENSHOTS=1` writes the screenshots to docs/img/ (otherwise to a temp dir).

mod common;

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{agent, node_info};
use fantoccini::{Client, ClientBuilder, Locator};
use orchestrator::agent::{Agent, ReportFn};
use proto::v1;
use serde_json::{json, Value};

const ADMIN: &str = common::ADMIN;
/// Every browser step and wait is bounded by this.
const STEP: Duration = Duration::from_secs(20);

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
fn make_tenant(base: &str, name: &str, vni: u32, nf: &str, nf_body: Value, chain: &str) -> u32 {
    let t = put(base, &format!("/v1/tenants/{name}"), json!({}));
    put(
        base,
        &format!("/v1/tenants/{name}/vpcs/{name}-vpc"),
        json!({"vni": vni, "cidrs": ["10.0.0.0/24"]}),
    );
    put(base, &format!("/v1/tenants/{name}/nfs/{nf}"), nf_body);
    put(
        base,
        &format!("/v1/tenants/{name}/chains/{chain}"),
        json!({"vpc": format!("{name}-vpc"), "nfs": [nf]}),
    );
    t["id"].as_u64().unwrap() as u32
}

/// A stand-in for FM's admin gRPC: an event log (events about each tenant and about a
/// node) and a vIP table; every other RPC is unimplemented.
struct FakeFm {
    events: Vec<v1::FmEvent>,
}

type NoStream<T> = tokio_stream::wrappers::UnboundedReceiverStream<Result<T, tonic::Status>>;

// tonic's trait methods return this very Result.
#[allow(clippy::result_large_err)]
fn unimplemented<T>() -> Result<tonic::Response<T>, tonic::Status> {
    Err(tonic::Status::unimplemented("not in the test's FM"))
}

#[tonic::async_trait]
impl v1::fabric_master_server::FabricMaster for FakeFm {
    type PpSessionStream = NoStream<v1::PpDown>;
    type ScSessionStream = NoStream<v1::ScDown>;

    async fn pp_session(
        &self,
        _: tonic::Request<tonic::Streaming<v1::PpUp>>,
    ) -> Result<tonic::Response<Self::PpSessionStream>, tonic::Status> {
        unimplemented()
    }
    async fn sc_session(
        &self,
        _: tonic::Request<tonic::Streaming<v1::ScUp>>,
    ) -> Result<tonic::Response<Self::ScSessionStream>, tonic::Status> {
        unimplemented()
    }
    async fn members(
        &self,
        _: tonic::Request<v1::MembersRequest>,
    ) -> Result<tonic::Response<v1::MembershipView>, tonic::Status> {
        unimplemented()
    }
    async fn traffic(
        &self,
        _: tonic::Request<v1::TrafficRequest>,
    ) -> Result<tonic::Response<v1::TrafficReply>, tonic::Status> {
        unimplemented()
    }
    async fn get_partition_map(
        &self,
        _: tonic::Request<v1::PartitionMapRequest>,
    ) -> Result<tonic::Response<v1::PartitionMap>, tonic::Status> {
        unimplemented()
    }
    async fn flows(
        &self,
        _: tonic::Request<v1::FlowsRequest>,
    ) -> Result<tonic::Response<v1::FlowsReply>, tonic::Status> {
        unimplemented()
    }
    async fn scale_out(
        &self,
        _: tonic::Request<v1::ScaleOutRequest>,
    ) -> Result<tonic::Response<v1::ScaleReply>, tonic::Status> {
        unimplemented()
    }
    async fn scale_in(
        &self,
        _: tonic::Request<v1::ScaleInRequest>,
    ) -> Result<tonic::Response<v1::ScaleReply>, tonic::Status> {
        unimplemented()
    }
    /// FM's semantics: from `since_seq` on, `next_seq` where the answer ends.
    async fn events(
        &self,
        req: tonic::Request<v1::EventsRequest>,
    ) -> Result<tonic::Response<v1::EventsReply>, tonic::Status> {
        let r = req.into_inner();
        let end = self.events.len() as u64 + 1;
        let events: Vec<v1::FmEvent> = self
            .events
            .iter()
            .filter(|e| e.seq >= r.since_seq)
            .take(r.limit.max(1) as usize)
            .cloned()
            .collect();
        let next_seq = events
            .last()
            .map_or(r.since_seq.clamp(1, end), |e| e.seq + 1);
        Ok(tonic::Response::new(v1::EventsReply {
            events,
            next_seq,
            oldest_seq: 1,
        }))
    }
    async fn record_event(
        &self,
        _: tonic::Request<v1::RecordEventRequest>,
    ) -> Result<tonic::Response<v1::RecordEventReply>, tonic::Status> {
        unimplemented()
    }
    async fn load(
        &self,
        _: tonic::Request<v1::LoadRequest>,
    ) -> Result<tonic::Response<v1::LoadReply>, tonic::Status> {
        unimplemented()
    }
    async fn vip_map(
        &self,
        _: tonic::Request<v1::VipMapRequest>,
    ) -> Result<tonic::Response<v1::VipMapReply>, tonic::Status> {
        let vip = |index: u32, node: &str| v1::VipOwner {
            vip: Some(v1::Vip {
                index,
                ip: format!("198.18.0.{}", 100 + index),
                mac: vec![2, 0, 0, 0, 0, index as u8],
            }),
            node: node.into(),
        };
        Ok(tonic::Response::new(v1::VipMapReply {
            epoch: 3,
            vips: vec![
                vip(0, "pp-1"),
                vip(1, "pp-2"),
                vip(2, "pp-1"),
                vip(3, "pp-2"),
            ],
            nodes: vec!["pp-1".into(), "pp-2".into()],
            draining: vec![],
            moves: 2,
        }))
    }
    async fn pp_drain(
        &self,
        _: tonic::Request<v1::PpDrainRequest>,
    ) -> Result<tonic::Response<v1::VipMapReply>, tonic::Status> {
        unimplemented()
    }
    async fn vip_move(
        &self,
        _: tonic::Request<v1::VipMoveRequest>,
    ) -> Result<tonic::Response<v1::VipMapReply>, tonic::Status> {
        unimplemented()
    }
}

/// Start the fake FM on loopback (on the current runtime); its address.
async fn fake_fm(acme: u32, globex: u32) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let ev = |seq: u64, kind: &str, message: &str, detail: Value| v1::FmEvent {
        seq,
        unix_ms: now - 60_000 + seq * 1000,
        kind: kind.into(),
        message: message.into(),
        detail_json: detail.to_string(),
    };
    let events = vec![
        ev(
            1,
            "pp_node_joined",
            "PP node pp-2 joined",
            json!({"node": "pp-2"}),
        ),
        ev(
            2,
            "autoscale_decision",
            "scale out tenant 1 chain 1: utilisation 0.91 > 0.80",
            json!({"tier": "sc", "tenant": acme, "chain": 1, "action": "out"}),
        ),
        ev(
            3,
            "sc_scale_out_done",
            "acme-egress scaled out to group 3 in 41 ms",
            json!({"tenant": acme, "chain": 1, "from": 1, "to": 3}),
        ),
        ev(
            4,
            "sc_scale_out_done",
            "globex-web scaled out to group 4 in 38 ms",
            json!({"tenant": globex, "chain": 1, "from": 2, "to": 4}),
        ),
        ev(
            5,
            "vip_moved",
            "vIP 2 moved pp-2 -> pp-1 (rebalance)",
            json!({"epoch": 3}),
        ),
    ];
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let incoming = proto::incoming(listener).unwrap();
    tokio::spawn(
        proto::server()
            .add_service(v1::fabric_master_server::FabricMasterServer::new(FakeFm {
                events,
            }))
            .serve_with_incoming(incoming),
    );
    addr
}

fn hello(id: &str, role: v1::Role, addr: &str, cluster: &str) -> v1::NodeHello {
    v1::NodeHello {
        node: Some(node_info(id, role, addr)),
        cluster: cluster.into(),
        version: "test".into(),
        ..Default::default()
    }
}

/// Registered nodes: one FM reporting both tenants' partitions, two PP nodes whose
/// tenant counters grow with time, three SC nodes.
fn nodes(control: &str, fm_addr: &str, acme: u32, globex: u32) -> Vec<Agent> {
    let started = Instant::now();
    let group = |id: u64, order: [&str; 3]| v1::ScGroup {
        id,
        epoch: 1,
        replicas: order
            .iter()
            .map(|n| v1::Replica {
                node_id: n.to_string(),
                addr: String::new(),
            })
            .collect(),
    };
    let map = v1::PartitionMap {
        version: 1,
        partitions: vec![
            v1::Partition {
                tenant: acme,
                chain: 1,
                hash_lo: 0,
                hash_hi: u64::MAX,
                group: 1,
            },
            v1::Partition {
                tenant: globex,
                chain: 1,
                hash_lo: 0,
                hash_hi: u64::MAX,
                group: 2,
            },
        ],
        groups: vec![
            group(1, ["sc-1", "sc-2", "sc-3"]),
            group(2, ["sc-3", "sc-1", "sc-2"]),
        ],
    };
    let fm: ReportFn = Arc::new(move || v1::NodeReport {
        ready: true,
        detail: "2 groups".into(),
        partitions: Some(map.clone()),
        ..Default::default()
    });
    let mut out = vec![agent(control, hello("fm-1", v1::Role::Fm, fm_addr, ""), fm)];
    for (i, id) in ["pp-1", "pp-2"].into_iter().enumerate() {
        let k = i as u64 + 1;
        let pp: ReportFn = Arc::new(move || {
            let ms = started.elapsed().as_millis() as u64;
            let counters = |tenant: u32, pps: u64| v1::TenantCounters {
                tenant,
                packets: ms * pps / 1000,
                bytes: ms * pps,
                drops: 0,
                flows: ms * pps / 100_000,
            };
            v1::NodeReport {
                ready: true,
                load: Some(v1::Load {
                    packets_per_s: (3000 * k) as f64,
                    requests_per_s: (20 * k) as f64,
                    flows: 100 * k,
                    groups: 0,
                }),
                tenants: vec![counters(acme, 2000 * k), counters(globex, 1000 * k)],
                ..Default::default()
            }
        });
        out.push(agent(
            control,
            hello(
                id,
                v1::Role::Pp,
                &format!("127.0.0.1:{}", 7000 + k),
                "default",
            ),
            pp,
        ));
    }
    for i in 1..=3 {
        out.push(agent(
            control,
            hello(
                &format!("sc-{i}"),
                v1::Role::Sc,
                &format!("127.0.0.1:{}", 7100 + i),
                "",
            ),
            common::ready(),
        ));
    }
    out
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

async fn login(c: &Client, base: &str, token: &str, expect: &str) -> String {
    goto(c, &format!("{base}/ui")).await;
    let field = c.find(Locator::Id("token")).await.expect("token field");
    field.send_keys(token).await.unwrap();
    c.find(Locator::Id("login"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
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

#[test]
fn dashboard_in_headless_chromium() {
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
        "acme-nat",
        json!({"kind": "snat", "config": {"pools": [{"addresses": ["198.18.100.1"], "ports": {"lo": 1024, "hi": 65535}}]}}),
        "acme-egress",
    );
    let globex = make_tenant(
        &base,
        "globex",
        200,
        "globex-lb",
        json!({"kind": "lb", "config": {"services": [{"vip": "198.19.0.100", "port": 80, "protocol": "tcp",
            "backends": [{"addr": "198.19.1.7", "port": 8080}]}]}}),
        "globex-web",
    );
    let (s, tok) = call(&base, ADMIN, "POST", "/v1/tenants/acme/tokens", None);
    assert_eq!(s, 201, "{tok}");
    let acme_token = tok["token"].as_str().unwrap().to_string();
    let fm_addr = rt.block_on(fake_fm(acme, globex));
    let _nodes = nodes(&orch.control_addr.to_string(), &fm_addr, acme, globex);
    common::wait(STEP, "6 nodes up and partitions reported", || {
        let (_, st) = call(&base, ADMIN, "GET", "/v1/status", None);
        let (_, parts) = call(&base, ADMIN, "GET", "/v1/partitions", None);
        (st["nodes_up"] == 6 && parts.as_array().is_some_and(|p| p.len() == 2)).then_some(())
    });
    // The REST API's own answer to the same token, for comparison.
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
        let t = wait_text(&c, "acme's SC group on the overview", |t| {
            t.contains("acme/acme-egress")
        })
        .await;
        assert!(!t.contains("globex"), "overview shows globex to acme:\n{t}");
        assert!(
            !t.contains("pp-1") && !t.contains("fm-1") && !t.contains("198.18.0.10"),
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
        assert!(t.contains("acme-egress") && t.contains("sc-1"), "{t}");
        let t = goto(&c, &format!("{base}/ui/rates")).await;
        assert!(t.contains("acme") && t.contains("Mbit/s"), "{t}");
        assert!(
            !t.contains("globex"),
            "rates page shows globex to acme:\n{t}"
        );
        // After a refresh or two, real rates (acme's PP counters grow 6000 packets/s).
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
        let t = goto(&c, &format!("{base}/ui/events")).await;
        assert!(
            t.contains("acme-egress scaled out") && t.contains("scale out tenant 1"),
            "acme's own FM events:\n{t}"
        );
        for other in ["globex", "pp_node_joined", "vip_moved", "fm-1"] {
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
        c.find(Locator::Id("logout"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        wait_text(&c, "the login page after logging out", |t| {
            t.contains("Log in")
        })
        .await;
        let t = goto(&c, &format!("{base}/ui/tenants")).await;
        assert!(t.contains("Log in") && !t.contains("acme-egress"), "{t}");

        // ---- admin: everything
        let t = login(&c, &base, ADMIN, "Log out").await;
        assert!(t.contains("admin"), "{t}");
        let t = wait_text(&c, "both tenants' groups and the nodes", |t| {
            t.contains("acme/acme-egress")
                && t.contains("globex/globex-web")
                && t.contains("pp-2")
                && t.contains("sc-3")
                && t.contains("198.18.0.103")
        })
        .await;
        assert!(t.contains("fm-1"), "{t}");
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
            "acme-egress scaled out",
            "globex-web scaled out",
            "pp_node_joined",
            "vip_moved",
        ] {
            assert!(t.contains(all), "the admin's events lack {all:?}:\n{t}");
        }
        screenshot(&c, &shots, "dashboard-events.png").await;
        let t = goto(&c, &format!("{base}/ui/trace")).await;
        assert!(t.contains("starfabric trace"), "{t}");

        let _ = tokio::time::timeout(STEP, c.close()).await;
    });
    drop(browser);
    drop(orch);
}
