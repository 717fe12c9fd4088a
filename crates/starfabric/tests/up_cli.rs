//! `starfabric up` and the CLI, as an operator uses them: start the platform, then run
//! CLI verbs with no server or token flags (they come from the config file `up`
//! writes), create a tenant with SNAT, see every node healthy, send a VXLAN packet of
//! the tenant's through the PP node, and scrape every node's `/metrics`.
//!
//! Everything runs on loopback with ports the kernel picks. `up` runs in its own state
//! directory and config file (a temp dir), and is stopped by PID (SIGTERM), which tears
//! its children down; the test checks they are gone.

use std::io::{Read, Write};
use std::net::{TcpStream, UdpSocket};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use testkit::child::stdout_lines;
use testkit::ChildGuard;

const BIN: &str = env!("CARGO_BIN_EXE_starfabric");

fn cli(cfg: &Path, args: &[&str]) -> (bool, String, String) {
    testkit::child::output_of(
        Command::new(BIN)
            .args(args)
            .env("STARFABRIC_CONFIG", cfg)
            .env_remove("STARFABRIC_SERVER")
            .env_remove("STARFABRIC_TOKEN"),
    )
}

fn cli_json(cfg: &Path, args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.extend(["-o", "json"]);
    let (ok, out, err) = cli(cfg, &a);
    assert!(ok, "starfabric {args:?} failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {out}"))
}

/// GET a URL with a plain HTTP/1.0 request: the body.
fn http_get(url: &str) -> String {
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest.split_once('/').unwrap();
    let mut s = TcpStream::connect(host).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(
        head.starts_with("HTTP/1.") && head.contains(" 200 "),
        "{url}: {head}"
    );
    body.to_string()
}

/// The value of the first series named exactly `name` with a label set containing
/// every one of `labels` (e.g. `tenant="1"`).
fn metric(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (n, lab) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            (n == name && labels.iter().all(|x| lab.split(',').any(|p| p == *x)))
                .then(|| value.parse().ok())
                .flatten()
        })
        .next()
}

/// A VXLAN (VNI `vni`) UDP datagram's payload: Ethernet + IPv4 + UDP to 198.19.200.1:53.
fn vxlan_payload(vni: u32) -> Vec<u8> {
    let inner = packet::build::udp_v4([198, 19, 0, 10], 40000, [198, 19, 200, 1], 53, b"hello");
    let full = packet::build::vxlan_wrap([127, 0, 0, 1], [127, 0, 0, 1], 50000, vni, &inner);
    // The socket adds Ethernet/IP/UDP; VXLAN header + inner frame is the payload.
    full[14 + 20 + 8..].to_vec()
}

#[test]
fn up_then_cli_creates_a_snat_tenant_sees_healthy_nodes_and_metrics_scrape() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.json");
    // Stopped by PID on drop: SIGTERM, 10 s to tear its children down, then SIGKILL.
    let mut up = ChildGuard::new(
        Command::new(BIN)
            .args(["up", "--dir"])
            .arg(dir.path().join("state"))
            .args([
                "--api",
                "127.0.0.1:0",
                "--control",
                "127.0.0.1:0",
                "--fm",
                "127.0.0.1:0",
                "--vxlan",
                "127.0.0.1:0",
                "--duration",
                "120",
            ])
            .env("STARFABRIC_CONFIG", &cfg)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let rx = stdout_lines(&mut up);
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut seen = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(l) if l == "up: ready" => break,
            Ok(l) => seen.push(l),
            Err(_) => {
                assert!(up.try_wait().unwrap().is_none(), "up exited: {seen:#?}");
                assert!(Instant::now() < deadline, "up never got ready: {seen:#?}");
            }
        }
    }

    // The CLI finds the orchestrator and the admin token by itself.
    let (ok, out, err) = cli(
        &cfg,
        &[
            "tenant",
            "create",
            "acme",
            "--vni",
            "100",
            "--snat",
            "198.18.100.1",
            "--wait",
        ],
    );
    assert!(ok, "tenant create: {err}");
    assert!(out.contains("chain acme/main is served"), "{out}");
    // Bad input changes nothing (one API transaction per verb): a VNI already taken,
    // and one out of range, leave no tenant without its VPC behind.
    for (args, needle) in [
        (
            ["tenant", "create", "acme2", "--vni", "100"],
            "already used",
        ),
        (
            ["tenant", "create", "bad", "--vni", "99999999"],
            "vni must be",
        ),
    ] {
        let (ok, out, err) = cli(&cfg, &args);
        assert!(!ok, "{args:?} succeeded: {out}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(
            !out.contains("applied") && !out.contains("created"),
            "{args:?}: {out}"
        );
    }
    let tenants = cli_json(&cfg, &["tenant", "list"]);
    assert_eq!(tenants.as_array().map(Vec::len), Some(1), "{tenants:#}");
    assert_eq!(tenants[0]["name"], "acme");
    let acme_id = tenants[0]["id"].as_u64().unwrap();
    let nfs = cli_json(&cfg, &["nf", "list", "--tenant", "acme"]);
    assert_eq!(nfs[0]["kind"], "snat");
    assert_eq!(nfs[0]["config"]["pools"][0]["addresses"][0], "198.18.100.1");

    // status: every node up and ready, and its table names them all.
    let st = cli_json(&cfg, &["status", "--wait"]);
    assert_eq!(st["healthy"], true, "{st:#}");
    let nodes = st["nodes"].as_array().unwrap();
    let roles: Vec<&str> = nodes.iter().map(|n| n["role"].as_str().unwrap()).collect();
    assert_eq!(roles.iter().filter(|r| **r == "sc").count(), 3, "{roles:?}");
    assert!(roles.contains(&"pp") && roles.contains(&"fm"), "{roles:?}");
    assert!(
        nodes
            .iter()
            .all(|n| n["status"] == "up" && n["ready"] == true),
        "{st:#}"
    );
    let (ok, table, _) = cli(&cfg, &["status"]);
    assert!(
        ok && table.contains("HEALTHY") && table.contains("pp-1") && table.contains("sc-3"),
        "{table}"
    );
    let parts = cli_json(&cfg, &["tenant", "get", "acme"]);
    assert_eq!(parts["pp_cluster"], "default");

    // `up` leaves an operator certificate: with it, the tools that call FM directly
    // (mTLS, operator services) get FM's answers.
    let op = dir.path().join("state").join("tls").join("operator");
    let fm = nodes.iter().find(|n| n["role"] == "fm").unwrap();
    let fm = fm["addr"].as_str().unwrap();
    let op = op.display().to_string();
    let (ok, out, err) = cli(
        &cfg,
        &["scale", "map", "--fm", fm, "--tls-dir", &op, "-o", "json"],
    );
    assert!(ok, "scale map with the operator certificate: {err}");
    let map: Value = serde_json::from_str(&out).unwrap();
    assert!(
        !map["partitions"].as_array().unwrap().is_empty(),
        "acme's chain has a partition: {out}"
    );

    // A packet of the tenant's VPC through the PP node: it misses, FM asks the SC
    // group, and the flow's SNAT rule shows up in `flows`.
    let pp = nodes.iter().find(|n| n["role"] == "pp").unwrap();
    let pp_addr: std::net::SocketAddr = pp["addr"].as_str().unwrap().parse().unwrap();
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut sent_first = 0u64;
    let flows = (0..100)
        .find_map(|_| {
            sock.send_to(&vxlan_payload(100), pp_addr).unwrap();
            sent_first += 1;
            std::thread::sleep(Duration::from_millis(100));
            let f = cli_json(&cfg, &["flows", "--tenant", "acme"]);
            f["items"].as_array().filter(|a| !a.is_empty()).cloned()
        })
        .expect("the flow's rule never reached FM's cache");
    assert!(
        flows[0]["key"]
            .as_str()
            .unwrap()
            .contains("198.19.0.10:40000"),
        "{flows:?}"
    );
    assert!(
        flows[0]["actions"]
            .as_str()
            .unwrap()
            .contains("set-src 198.18.100.1:"),
        "{flows:?}"
    );

    // Every node serves Prometheus text at the URL it registered.
    let mut scraped = 0;
    for n in nodes {
        let url = n["metrics_url"].as_str().unwrap();
        assert!(!url.is_empty(), "{} registered no metrics URL", n["id"]);
        let text = http_get(url);
        match n["role"].as_str().unwrap() {
            "pp" => {
                assert!(
                    metric(&text, "starfabric_pp_rx_packets_total", &[]).unwrap_or(0.0) >= 1.0,
                    "{text}"
                );
                assert!(metric(&text, "starfabric_pp_misses_total", &[]).unwrap_or(0.0) >= 1.0);
                assert!(
                    metric(&text, "starfabric_pp_rule_setup_seconds_count", &[]).unwrap_or(0.0)
                        >= 1.0
                );
                assert!(
                    metric(&text, "starfabric_pp_flow_table_entries", &[]).unwrap_or(0.0) >= 1.0
                );
                let t = format!("tenant=\"{acme_id}\"");
                assert!(
                    metric(&text, "starfabric_pp_tenant_packets_total", &[&t]).unwrap_or(0.0)
                        >= 1.0,
                    "{text}"
                );
            }
            "fm" => {
                assert!(
                    metric(&text, "starfabric_fm_requests_total", &[]).unwrap_or(0.0) >= 1.0,
                    "{text}"
                );
            }
            "sc" => assert!(text.contains("starfabric_sc_"), "{text}"),
            r => panic!("unexpected role {r}"),
        }
        scraped += 1;
    }
    assert_eq!(scraped, 5);

    // Per-tenant counters reach `stats` through the nodes' reports.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = cli_json(&cfg, &["stats", "--tenant", "acme"]);
        if s[0]["packets"].as_u64().unwrap_or(0) >= 1
            && s[0]["rule_requests"].as_u64().unwrap_or(0) >= 1
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "stats never counted the packet: {s}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // Rates (paper 000 §7.2) through the CLI: set and read back; bad input is refused
    // whole (the API's 422) and changes nothing; `stats` shows each PP node's credit
    // state for the tenant.
    let (ok, out, err) = cli(
        &cfg,
        &[
            "tenant",
            "rates",
            "acme",
            "--requests",
            "100/1000/3000",
            "--packets",
            "0/50000/100000/20000",
        ],
    );
    assert!(ok, "tenant rates: {err}");
    assert!(
        out.contains("requests: min 100") && out.contains("burst 3000"),
        "{out}"
    );
    let set = cli_json(&cfg, &["tenant", "rates", "acme"]);
    assert_eq!(set["rates"]["requests"]["base"], 1000.0, "{set:#}");
    assert_eq!(set["rates"]["packets"]["debt"], 20000.0, "{set:#}");
    for (arg, needle) in [
        ("--requests=100/1000/500", "burst < base"),
        (
            "--requests=-1/1000/3000",
            "`min` must be finite and non-negative",
        ),
        ("--packets=1/2", "MIN/BASE/BURST"),
    ] {
        let a = ["tenant", "rates", "acme", arg];
        let (ok, out, err) = cli(&cfg, &a);
        assert!(!ok, "{a:?} succeeded: {out}");
        assert!(err.contains(needle), "{a:?}: {err}");
    }
    let after = cli_json(&cfg, &["tenant", "rates", "acme"]);
    assert_eq!(
        after["rates"], set["rates"],
        "refused rates changed something"
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (ok, table, err) = cli(&cfg, &["stats", "--tenant", "acme"]);
        assert!(ok, "stats: {err}");
        let row = table
            .lines()
            .find(|l| l.starts_with("acme") && l.contains("pp-1") && l.contains("requests"));
        if table.contains("STATE") && table.contains("CREDIT") && row.is_some() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "stats never showed the tenant's rate state: {table}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let (ok, out, _) = cli(&cfg, &["tenant", "rates", "acme", "--clear"]);
    assert!(ok && out.contains("rates cleared"), "{out}");

    // The monitor sees traffic: with a monitor in the chain, `stats --monitor` counts
    // every packet of the flow (PP's rule counters, reported each second), not one per
    // flow.
    let (ok, _, err) = cli(
        &cfg,
        &["nf", "create", "monitor", "mon", "--tenant", "acme"],
    );
    assert!(ok, "nf create monitor: {err}");
    let (ok, _, err) = cli(
        &cfg,
        &[
            "chain", "create", "main", "--tenant", "acme", "--vpc", "main", "--nfs", "mon,snat",
            "--wait",
        ],
    );
    assert!(ok, "chain create: {err}");
    let monitor = |cfg: &Path| {
        let (ok, out, err) = cli(
            cfg,
            &[
                "stats",
                "--tenant",
                "acme",
                "--monitor",
                "--top",
                "5",
                "--json",
            ],
        );
        assert!(ok, "stats --monitor: {err}");
        serde_json::from_str::<Value>(&out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
    };
    // The rebuilt chain's first flow: until the monitor has seen it, packets may still
    // meet the old chain's rule at PP.
    let mut sent_before = 0u64;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        sock.send_to(&vxlan_payload(100), pp_addr).unwrap();
        sent_before += 1;
        std::thread::sleep(Duration::from_millis(200));
        if monitor(&cfg)["total"]["flows"].as_u64().unwrap_or(0) >= 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the monitor never saw the flow");
    }
    const K: u64 = 40;
    for _ in 0..K {
        sock.send_to(&vxlan_payload(100), pp_addr).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let m = loop {
        let m = monitor(&cfg);
        if m["total"]["packets"].as_u64().unwrap_or(0) > K {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "the monitor counted fewer packets than the {K} sent: {m:#}"
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    let total = &m["total"];
    // Never more than were sent: the old chain's rule reports its last counts when the
    // rebuild revokes it, and they count for the tenant's chain too.
    assert!(
        total["packets"].as_u64().unwrap() <= K + sent_before + sent_first,
        "{m:#}"
    );
    assert_eq!(total["flows"], 1, "one flow, many packets: {m:#}");
    assert!(
        total["bytes"].as_u64().unwrap() >= total["packets"].as_u64().unwrap() * 5,
        "{m:#}"
    );
    assert_eq!(m["hosts"][0]["host"], "198.19.0.10", "{m:#}");
    assert_eq!(m["groups"], m["groups_read"], "{m:#}");
    // A tenant sees only its own counters.
    let (ok, _, err) = cli(&cfg, &["tenant", "create", "other"]);
    assert!(ok, "tenant create other: {err}");
    let tok = cli_json(&cfg, &["token", "--tenant", "other"]);
    let token = tok["token"].as_str().unwrap().to_string();
    let out = Command::new(BIN)
        .args(["stats", "--tenant", "acme", "--monitor", "--json"])
        .env("STARFABRIC_CONFIG", &cfg)
        .env("STARFABRIC_TOKEN", &token)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "another tenant's token read acme's counters"
    );
    assert!(
        err.contains("403") || err.contains("cannot access"),
        "{err}"
    );

    // Ctrl-C equivalent: everything stops.
    drop(up);
}

/// `starfabric orchestrator --autoscale "FLAGS"` runs the autoscaler as a task of the
/// orchestrator (here against an FM that is not there: it samples, gets no answer, and
/// decides nothing), stops it with the orchestrator, and refuses bad flags before it
/// starts.
#[test]
fn the_orchestrator_runs_the_autoscaler_and_refuses_bad_autoscale_flags() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("embedded:{}", dir.path().join("o.redb").display());
    let token = dir.path().join("token").display().to_string();
    let run = |autoscale: &str| {
        Command::new(BIN)
            .args([
                "orchestrator",
                "--api",
                "127.0.0.1:0",
                "--control",
                "127.0.0.1:0",
                "--store",
                &store,
                "--admin-token-file",
                &token,
                "--duration",
                "2",
                "--autoscale",
                autoscale,
            ])
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    let out = run("--fm 127.0.0.1:9 --sc-capacity-rps 10 --interval 0.2");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("autoscale: watching FM at 127.0.0.1:9: sc 10 req/s per group"),
        "{stdout}"
    );
    assert!(stdout.contains("autoscale: stopped"), "{stdout}");
    assert!(stdout.contains("orchestrator: stopped"), "{stdout}");
    for bad in [
        "--fm 127.0.0.1:9 --sc-capacity-rps ten",
        "--fm 127.0.0.1:9 --pp-capacity 100 --pp-pool /nonexistent/pool.json",
        "--fm 127.0.0.1:9",
    ] {
        let out = run(bad);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad}");
        assert!(
            stderr.contains("autoscale") || stderr.contains("pool"),
            "{bad}: {stderr}"
        );
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("orchestrator: api"),
            "{bad}: started anyway"
        );
    }
}

/// An operator's error is one line with its causes, even with `RUST_BACKTRACE` set in
/// the environment: no stack trace.
#[test]
fn a_cli_error_is_one_line_without_a_stack_trace() {
    let dir = tempfile::tempdir().unwrap();
    for bt in ["0", "1", "full"] {
        let out = Command::new(BIN)
            // Nothing listens on port 9 (discard): the connection is refused.
            .args(["--server", "http://127.0.0.1:9", "--token", "sfa_unused"])
            .args(["tenant", "list"])
            .env("STARFABRIC_CONFIG", dir.path().join("config"))
            .env_remove("STARFABRIC_SERVER")
            .env_remove("STARFABRIC_TOKEN")
            .env("RUST_BACKTRACE", bt)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "RUST_BACKTRACE={bt}: {err}");
        assert!(lines[0].starts_with("Error: "), "{err}");
        assert!(!err.contains("backtrace"), "RUST_BACKTRACE={bt}: {err}");
    }
}
