//! Every node's `/metrics`, scraped from the real binaries on loopback: `starfabric fm`,
//! three `starfabric sc --nfs test` (one SC group) and `starfabric pp --fm` on a UDP
//! VXLAN socket. Tenant 1's VXLAN frames miss, go PP → FM → SC → FM → PP, and leave
//! re-encapsulated toward a socket of the test's; then the five endpoints must show it:
//! PP misses, tenant packets, rule setup latency, FM requests, SC applied requests.
//!
//! A malformed frame must show up as a PP drop with its reason, and every metric the
//! Grafana dashboard in `deploy/` queries must be among the scraped series.
//!
//! Every node gets `--duration` as a backstop, and the guard kills them by PID.

use std::collections::BTreeSet;
use std::net::{SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use packet::build::{tcp_v4, vxlan_wrap, VXLAN_V4_OVERHEAD};
use packet::tcp_flags::SYN;
use telemetry::scrape::{self, Sample};
use testkit::child::{line_matching, stdout_lines};
use testkit::{wait_until_every, ChildGuard};

const VNI: u32 = 100;
const TENANT: &str = "1";
/// Seconds every node runs at most, should the test die without its guard running.
const BACKSTOP: &str = "90";

/// Processes this test started, killed by PID on drop, and files it wrote.
#[derive(Default)]
struct Guard {
    children: Vec<ChildGuard>,
    files: Vec<PathBuf>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.children.clear();
        for f in &self.files {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// A started node: its stdout lines arrive on `lines`.
struct Node {
    name: String,
    lines: mpsc::Receiver<String>,
}

impl Node {
    /// Wait for a stdout line starting with `prefix`; returns the rest of it.
    fn line(&self, prefix: &str) -> String {
        line_matching(&self.lines, Duration::from_secs(20), |l| {
            l.strip_prefix(prefix).map(str::to_string)
        })
        .unwrap_or_else(|e| panic!("{}: no line {prefix:?}: {e}", self.name))
    }

    /// The address of its `metrics: listening on http://ADDR/metrics` line.
    fn metrics_addr(&self) -> SocketAddr {
        let url = self.line("metrics: listening on ");
        url.strip_prefix("http://")
            .and_then(|u| u.strip_suffix("/metrics"))
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("{}: bad metrics line {url:?}", self.name))
    }
}

fn start(g: &mut Guard, name: &str, args: &[&str]) -> Node {
    let mut child = Command::new(env!("CARGO_BIN_EXE_starfabric"))
        .args(args)
        .args(["--duration", BACKSTOP])
        .env("STARFABRIC_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let lines = stdout_lines(&mut child);
    g.children
        .push(ChildGuard::with_grace(child, Duration::ZERO));
    Node {
        name: name.to_string(),
        lines,
    }
}

fn scrape_all(addr: SocketAddr) -> Vec<Sample> {
    let r = scrape::get(addr, "/metrics").unwrap_or_else(|e| panic!("GET {addr}: {e}"));
    assert_eq!(r.status, 200, "{addr}: {}", r.body);
    assert_eq!(r.content_type.as_deref(), Some(telemetry::CONTENT_TYPE));
    scrape::parse(&r.body)
}

fn val(s: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    scrape::value(s, name, labels).unwrap_or_else(|| panic!("no series {name}{labels:?}"))
}

/// Scrape `addr` until `ok` holds (10 s at most); returns that scrape.
fn scrape_until(addr: SocketAddr, what: &str, ok: impl Fn(&[Sample]) -> bool) -> Vec<Sample> {
    wait_until_every(
        Duration::from_secs(10),
        Duration::from_millis(50),
        what,
        || {
            let s = scrape_all(addr);
            ok(&s).then_some(s)
        },
    )
}

/// The client, and the VIP the chain's LB serves.
const CLIENT: [u8; 4] = [198, 18, 10, 2];
const VIP: [u8; 4] = [198, 19, 0, 100];

/// The VXLAN datagram (from the VXLAN header on) of tenant 1's TCP packet from client
/// port `sport` to the chain's VIP.
fn datagram(sport: u16, seq: u8) -> Vec<u8> {
    let inner = tcp_v4(CLIENT, sport, VIP, 80, SYN, 1, &[seq; 16]);
    vxlan_wrap([127, 0, 0, 1], [127, 0, 0, 1], 1, VNI, &inner)[VXLAN_V4_OVERHEAD - 8..].to_vec()
}

/// Every `starfabric_*` metric name a dashboard expression refers to.
fn dashboard_metrics() -> BTreeSet<String> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/grafana/starfabric.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut names = BTreeSet::new();
    for p in v["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap();
            let mut rest = expr;
            while let Some(i) = rest.find("starfabric_") {
                let tail = &rest[i..];
                let end = tail
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(tail.len());
                names.insert(tail[..end].to_string());
                rest = &tail[end..];
            }
        }
    }
    names
}

#[test]
fn every_node_serves_metrics_for_real_traffic() {
    let mut g = Guard::default();
    // The planes talk mTLS, as in production: a test CA and a certificate per node.
    let tls = tempfile::tempdir().unwrap();
    let ca = proto::tls::Ca::generate().unwrap();
    let dir = |role, id: &str| {
        let d = tls.path().join(id);
        let ident = proto::tls::Identity::new(role, id).unwrap();
        proto::tls::Bundle::issue(&ca, &ident, Duration::from_secs(3600))
            .unwrap()
            .write_dir(&d)
            .unwrap();
        d.display().to_string()
    };
    let fm_dir = dir(proto::tls::Role::Fm, "fm-1");
    let pp_dir = dir(proto::tls::Role::Pp, "pp-1");
    let cfg = std::env::temp_dir().join(format!("sf-metrics-e2e-{}.json", std::process::id()));
    // The test NFs: FW → SNAT → LB; forward traffic is re-encapsulated to 127.0.0.1
    // (the test's listener, through --peer-port): loopback only.
    std::fs::write(
        &cfg,
        // Heartbeats slow enough that a loaded machine does not get an SC node declared
        // dead mid-test (a repair would refill the group with a fresh replica).
        serde_json::json!({"heartbeat_ms": 200, "miss_limit": 10, "chains": [{
            "tenant": 1, "chain": 1,
            "nfs": [
                {"kind": "test-fw", "deny_dports": [23]},
                {"kind": "test-snat", "addrs": ["198.19.255.1"], "ports": [20000, 29999]},
                {"kind": "test-lb", "vip": "198.19.0.100", "port": 80,
                 "backend": "198.19.1.7", "backend_port": 8080}
            ],
            "forward": {"decap": true, "encap": {"dst": "127.0.0.1", "vni": 200}, "output": 1},
            "reverse": {"decap": true, "encap": {"dst": "127.0.0.1", "vni": 100}, "output": 1}
        }]})
        .to_string(),
    )
    .unwrap();
    g.files.push(cfg.clone());

    let fm = start(
        &mut g,
        "fm",
        &[
            "fm",
            "--listen",
            "127.0.0.1:0",
            "--config",
            cfg.to_str().unwrap(),
            "--metrics",
            "127.0.0.1:0",
            "--tls-dir",
            &fm_dir,
        ],
    );
    let fm_addr = fm
        .line("fm: listening on ")
        .split(',')
        .next()
        .unwrap()
        .to_string();
    let fm_metrics = fm.metrics_addr();

    let mut sc_metrics = Vec::new();
    for i in 0..3 {
        let id = format!("sc-{i}");
        let sc_dir = dir(proto::tls::Role::Sc, &id);
        // sc-0 packs its control threads (docs/corepack.md); the others do not.
        let pack = if i == 0 { "auto" } else { "off" };
        let n = start(
            &mut g,
            &id,
            &[
                "sc",
                "--fm",
                &fm_addr,
                "--id",
                &id,
                "--nfs",
                "test",
                "--metrics",
                "127.0.0.1:0",
                "--tls-dir",
                &sc_dir,
                "--pack-cpus",
                pack,
            ],
        );
        n.line("sc: node ");
        sc_metrics.push(n.metrics_addr());
    }
    scrape_until(fm_metrics, "an SC group", |s| {
        scrape::value(s, "starfabric_fm_sc_groups", &[]) == Some(1.0)
    });

    let listener = UdpSocket::bind("127.0.0.1:0").unwrap();
    listener
        .set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let peer_port = listener.local_addr().unwrap().port().to_string();
    let pp = start(
        &mut g,
        "pp",
        &[
            "pp",
            "--listen",
            "127.0.0.1:0",
            "--node-ip",
            "127.0.0.1",
            "--fm",
            &fm_addr,
            "--vpc",
            "100=1:1",
            "--peer-port",
            &peer_port,
            "--metrics",
            "127.0.0.1:0",
            "--id",
            "pp-1",
            "--tls-dir",
            &pp_dir,
        ],
    );
    let pp_addr: SocketAddr = pp
        .line("pp: listening on ")
        .split(',')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let pp_metrics = pp.metrics_addr();
    let h = scrape::get(pp_metrics, "/healthz").unwrap();
    assert_eq!((h.status, h.body.as_str()), (200, "ok"));
    scrape_until(pp_metrics, "the PP's FM session", |s| {
        scrape::value(s, "starfabric_pp_fm_connected", &[]) == Some(1.0)
    });

    // Three flows of two packets each: the first packet of each misses and is held,
    // the second is held behind it or hits.
    let client = UdpSocket::bind("127.0.0.1:0").unwrap();
    let flows = [41000u16, 41001, 41002];
    let mut sent = 0u64;
    for seq in 0..2u8 {
        for &sport in &flows {
            client.send_to(&datagram(sport, seq), pp_addr).unwrap();
            sent += 1;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut got = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut buf = [0u8; 2048];
    while got < sent && Instant::now() < deadline {
        if listener.recv(&mut buf).is_ok() {
            got += 1;
        }
    }
    assert_eq!(got, sent, "every frame came out re-encapsulated");

    // PP: published every 100 ms, so wait for the snapshot that has everything.
    let p = scrape_until(pp_metrics, "PP counters", |s| {
        scrape::value(s, "starfabric_pp_tx_packets_total", &[]) == Some(sent as f64)
    });
    assert_eq!(val(&p, "starfabric_pp_rx_packets_total", &[]), sent as f64);
    assert!(val(&p, "starfabric_pp_misses_total", &[]) >= flows.len() as f64);
    assert!(val(&p, "starfabric_pp_rule_requests_total", &[]) >= flows.len() as f64);
    assert!(val(&p, "starfabric_pp_rule_replies_total", &[]) >= flows.len() as f64);
    assert_eq!(
        val(
            &p,
            "starfabric_pp_tenant_packets_total",
            &[("tenant", TENANT)]
        ),
        sent as f64,
        "tenant 1's packets are the frames sent"
    );
    assert!(
        val(
            &p,
            "starfabric_pp_tenant_bytes_total",
            &[("tenant", TENANT)]
        ) > 0.0
    );
    assert_eq!(
        val(
            &p,
            "starfabric_pp_tenant_flows_setup_total",
            &[("tenant", TENANT)]
        ),
        flows.len() as f64
    );
    assert_eq!(
        val(&p, "starfabric_pp_rule_setup_seconds_count", &[]),
        flows.len() as f64
    );
    assert_eq!(
        val(
            &p,
            "starfabric_pp_rule_setup_seconds_bucket",
            &[("le", "+Inf")]
        ),
        flows.len() as f64
    );
    assert!(val(&p, "starfabric_pp_rule_setup_seconds_sum", &[]) > 0.0);
    // Forward rules plus their reverse companions.
    assert_eq!(
        val(&p, "starfabric_pp_flow_table_entries", &[]),
        2.0 * flows.len() as f64
    );
    assert_eq!(val(&p, "starfabric_pp_flow_table_capacity", &[]), 65536.0);
    assert_eq!(
        val(&p, "starfabric_pp_drops_total", &[("reason", "truncated")]),
        0.0
    );

    // FM.
    let f = scrape_all(fm_metrics);
    assert!(val(&f, "starfabric_fm_requests_total", &[]) >= flows.len() as f64);
    // Every node that joined had a valid certificate of its role: nothing refused.
    for r in ["no_cert", "expired", "unknown_ca", "wrong_role", "revoked"] {
        assert_eq!(
            val(&f, "starfabric_fm_tls_refused_total", &[("reason", r)]),
            0.0
        );
    }
    assert!(
        val(
            &f,
            "starfabric_fm_tenant_requests_total",
            &[("tenant", TENANT)]
        ) >= flows.len() as f64
    );
    assert!(val(&f, "starfabric_fm_submitted_total", &[]) >= flows.len() as f64);
    assert!(val(&f, "starfabric_fm_sc_replies_total", &[]) >= flows.len() as f64);
    assert!(val(&f, "starfabric_fm_request_seconds_count", &[]) >= flows.len() as f64);
    assert_eq!(val(&f, "starfabric_fm_live_nodes", &[("role", "sc")]), 3.0);
    assert_eq!(val(&f, "starfabric_fm_live_nodes", &[("role", "pp")]), 1.0);
    assert_eq!(val(&f, "starfabric_fm_sc_groups", &[]), 1.0);
    assert!(val(&f, "starfabric_fm_cache_entries", &[]) >= flows.len() as f64);

    // SC: every replica applies every request before the tail answers, so each has
    // applied all of them; one head, one middle, one tail. Unless FM repaired the group
    // meanwhile: a replica added then starts from a snapshot with fresh counters.
    let repaired = val(&f, "starfabric_fm_reconfigurations_total", &[]) > 0.0;
    let mut roles = Vec::new();
    let mut scs = Vec::new();
    let mut most = 0.0f64;
    for &a in &sc_metrics {
        let s = scrape_all(a);
        let applied = val(
            &s,
            "starfabric_sc_requests_applied_total",
            &[("tenant", TENANT)],
        );
        assert!(repaired || applied >= flows.len() as f64, "{a}: {applied}");
        most = most.max(applied);
        assert!(repaired || val(&s, "starfabric_sc_group_ops_applied_total", &[]) >= 1.0);
        assert_eq!(val(&s, "starfabric_sc_groups", &[]), 1.0);
        for r in ["head", "middle", "tail"] {
            if scrape::value(&s, "starfabric_sc_replica_role", &[("role", r)]) == Some(1.0) {
                roles.push(r);
            }
        }
        scs.push(s);
    }
    assert!(most >= flows.len() as f64, "some replica applied them all");
    // The packing node shows its packer; the others show none.
    let cpus = corepack::allowed_cpus().len() as f64;
    assert_eq!(val(&scs[0], "starfabric_sc_pack_cpus", &[]), cpus);
    let active = val(&scs[0], "starfabric_sc_pack_active_cpus", &[]);
    assert!((1.0..=cpus).contains(&active), "{active} of {cpus}");
    assert!(val(&scs[0], "starfabric_sc_pack_managed_threads", &[]) >= 1.0);
    assert_eq!(
        val(&scs[0], "starfabric_sc_pack_affinity_errors_total", &[]),
        0.0
    );
    for s in &scs[1..] {
        assert_eq!(scrape::value(s, "starfabric_sc_pack_cpus", &[]), None);
    }
    roles.sort_unstable();
    assert_eq!(roles, ["head", "middle", "tail"]);

    // A malformed frame: a VXLAN header and an inner Ethernet header announcing IPv4,
    // then 6 bytes of it.
    let mut bad = datagram(41000, 9);
    bad.truncate(8 + 14 + 6);
    client.send_to(&bad, pp_addr).unwrap();
    let p = scrape_until(pp_metrics, "the truncated drop", |s| {
        scrape::value(s, "starfabric_pp_drops_total", &[("reason", "truncated")]) == Some(1.0)
    });
    assert_eq!(
        val(&p, "starfabric_pp_rx_packets_total", &[]),
        sent as f64 + 1.0
    );
    // Dropped before its tenant is known: no tenant is charged.
    assert_eq!(
        val(
            &p,
            "starfabric_pp_tenant_drops_total",
            &[("tenant", TENANT)]
        ),
        0.0
    );

    // The dashboard queries only series these nodes export.
    let mut have: BTreeSet<&str> = BTreeSet::new();
    for s in [&p, &f].into_iter().chain(scs.iter()) {
        have.extend(s.iter().map(|x| x.name.as_str()));
    }
    let want = dashboard_metrics();
    assert!(want.len() >= 10, "the dashboard queries {want:?}");
    let missing: Vec<&String> = want.iter().filter(|n| !have.contains(n.as_str())).collect();
    assert!(
        missing.is_empty(),
        "dashboard metrics not exported: {missing:?}"
    );
}
