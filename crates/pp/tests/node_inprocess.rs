//! A whole PP node started in-process with `pp::node::start` (what `starfabric pp`
//! runs), on the UDP backend over 127.0.0.1 with ephemeral ports: a static rule
//! reflects one flow, a flow without a rule is a counted `no-rule` drop on its
//! `/metrics`, and `stop` ends the worker with its summary lines.

use std::io::Write as _;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use packet::build::{ip_frame, vxlan_wrap, L4Spec, VXLAN_V4_OVERHEAD};
use packet::rewrite::Addr;
use packet::L4;
use pipeline::VpcBinding;
use pp::node::{IoKind, PpNodeConfig};
use telemetry::scrape;

const RULES: &str = "\
# reflect 198.19.10.2:40000 -> 198.19.10.9:7 back to the client
match 100 udp 198.19.10.2:40000 > 198.19.10.9:7
rule decap; set-src 198.19.10.9:7; set-dst 198.19.10.2:40000; encap 127.0.0.1 vni 100 dmac 02:c1:00:00:00:02; out 0
";

fn datagram(sport: u16) -> Vec<u8> {
    let inner = ip_frame(
        Addr::V4([198, 19, 10, 2]),
        Addr::V4([198, 19, 10, 9]),
        L4Spec::Udp { sport, dport: 7 },
        b"ping",
    );
    vxlan_wrap([127, 0, 0, 1], [127, 0, 0, 1], 1, 100, &inner)[VXLAN_V4_OVERHEAD - 8..].to_vec()
}

fn drops(addr: std::net::SocketAddr, reason: &str) -> f64 {
    let body = scrape::get(addr, "/metrics").expect("scrape").body;
    scrape::value(
        &scrape::parse(&body),
        "starfabric_pp_drops_total",
        &[("reason", reason)],
    )
    .unwrap_or(0.0)
}

/// The UDP backend on 127.0.0.1 with ephemeral ports, `rules`, all output to
/// `listener`, VNI 100 bound to tenant 1, and `/metrics` on a free port.
fn node_config(rules: &tempfile::NamedTempFile, listener: &UdpSocket) -> PpNodeConfig {
    PpNodeConfig {
        listen: SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0),
        io: IoKind::Udp,
        rules: Some(rules.path().to_path_buf()),
        peer_port: Some(listener.local_addr().unwrap().port()),
        vpcs: vec![(
            100,
            VpcBinding {
                tenant: 1,
                chain: 1,
            },
        )],
        metrics: Some("127.0.0.1:0".parse().unwrap()),
        ..PpNodeConfig::default()
    }
}

/// A node of `workers` workers started in-process on the static rules (which reflect
/// to a listener of the test's): the rules file, the listener, the node's lines.
fn start_reflector(
    workers: usize,
) -> (
    tempfile::NamedTempFile,
    UdpSocket,
    Arc<Mutex<Vec<String>>>,
    pp::node::PpHandle,
) {
    let mut rules = tempfile::NamedTempFile::new().unwrap();
    rules.write_all(RULES.as_bytes()).unwrap();
    let listener = UdpSocket::bind("127.0.0.1:0").unwrap();
    listener
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let l = lines.clone();
    let cfg = PpNodeConfig {
        workers,
        lines: telemetry::Lines::new(move |s: &str| l.lock().unwrap().push(s.to_string())),
        ..node_config(&rules, &listener)
    };
    let node = pp::node::start(cfg, Arc::new(AtomicBool::new(false)))
        .expect("node starts")
        .expect("not stopped");
    (rules, listener, lines, node)
}

#[test]
fn a_pp_node_starts_in_process_forwards_by_its_rules_and_stops() {
    let (_rules, listener, lines, node) = start_reflector(1);
    let addr = node.local_addr();
    assert_ne!(addr.port(), 0);
    assert!(
        lines.lock().unwrap()[0].starts_with(&format!("pp: listening on {addr}, 1 static rules")),
        "{:?}",
        lines.lock().unwrap()
    );
    let client = UdpSocket::bind("127.0.0.1:0").unwrap();

    client.send_to(&datagram(40000), addr).unwrap();
    let mut buf = [0u8; 2048];
    let (n, _) = listener
        .recv_from(&mut buf)
        .expect("the reflected datagram");
    let inner = &buf[8..n];
    let p = packet::parse_frame(inner).expect("reflected frame parses");
    assert!(
        matches!(
            p.ip().map(|ip| ip.l4),
            Some(L4::Udp {
                sport: 7,
                dport: 40000,
                ..
            })
        ),
        "ports swapped by the rule: {p:?}"
    );

    // A flow with no rule: a `no-rule` drop, counted where operators look.
    let metrics = node.metrics_addr().expect("metrics endpoint");
    client.send_to(&datagram(40001), addr).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while drops(metrics, "no-rule") < 1.0 {
        assert!(Instant::now() < deadline, "no-rule drop not counted in 5 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        listener.recv_from(&mut buf).is_err(),
        "nothing forwarded for a flow with no rule"
    );

    assert!(!node.is_finished());
    node.stop().expect("clean stop");
    let lines = lines.lock().unwrap();
    assert_eq!(lines.last().map(String::as_str), Some("pp: stopped"));
    assert!(
        lines
            .iter()
            .any(|l| l.contains("rx=2") && l.contains("no-rule=1")),
        "{lines:?}"
    );
}

fn rate_gauge(addr: std::net::SocketAddr, name: &str) -> Option<f64> {
    let body = scrape::get(addr, "/metrics").expect("scrape").body;
    scrape::value(
        &scrape::parse(&body),
        name,
        &[("tenant", "1"), ("kind", "packets")],
    )
}

/// A node on `rules` (the text of a rules file) with the fixed rate `rate`
/// (`TENANT:KIND=MIN/BASE/BURST`), as [`node_config`] otherwise; the rules file and the
/// listener live as long as the node needs them.
fn start_rated(
    rules: &str,
    rate: &str,
) -> (pp::node::PpHandle, tempfile::NamedTempFile, UdpSocket) {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    file.write_all(rules.as_bytes()).unwrap();
    let listener = UdpSocket::bind("127.0.0.1:0").unwrap();
    let (t, limits) = pp::rates::parse_rate_flag(rate).unwrap();
    let cfg = PpNodeConfig {
        rates: [(t, limits)].into_iter().collect(),
        lines: telemetry::Lines::new(|_: &str| {}),
        ..node_config(&file, &listener)
    };
    let node = pp::node::start(cfg, Arc::new(AtomicBool::new(false)))
        .expect("node starts")
        .expect("not stopped");
    (node, file, listener)
}

/// Paper 000 §7.2 at a node: tenant 1's fixed packet rate (base 200/s, burst 400/s, no
/// credit at start) holds a 2,000-packet burst of its one flow to what its token bucket
/// and allowance admit; the rest is dropped as `rate-limited-packets`, counted per
/// tenant, and the tenant's state and credit are on `/metrics`.
#[test]
fn a_tenants_packet_rate_is_enforced_and_exported() {
    let (node, _rules, _listener) = start_rated(RULES, "1:packets=0/200/400");
    let (addr, metrics) = (node.local_addr(), node.metrics_addr().unwrap());
    let client = UdpSocket::bind("127.0.0.1:0").unwrap();
    let t0 = Instant::now();
    for _ in 0..2000 {
        client.send_to(&datagram(40000), addr).unwrap();
    }
    let sent_for = t0.elapsed().as_secs_f64();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut limited = 0.0;
    while Instant::now() < deadline {
        limited = drops(metrics, "rate-limited-packets");
        let refused = rate_gauge(metrics, "starfabric_pp_tenant_rate_limited_total");
        if limited > 0.0 && refused == Some(limited) {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // At most the bucket's depth plus the allowance over the send time (base 200/s
    // rising to at most the 400/s burst) got through. (Counted as sent by PP: the
    // socket may have lost some of the 2,000 before PP read them.)
    let body = scrape::get(metrics, "/metrics").unwrap().body;
    let s = scrape::parse(&body);
    let admitted = scrape::value(&s, "starfabric_pp_tx_packets_total", &[]).unwrap();
    let rx = scrape::value(&s, "starfabric_pp_rx_packets_total", &[]).unwrap();
    assert_eq!(
        admitted + limited,
        rx,
        "every packet forwarded or rate-limited"
    );
    assert!(
        admitted <= 50.0 + 400.0 * (sent_for + 0.2),
        "admitted {admitted} of {rx} in {sent_for:.3} s"
    );
    assert!(admitted >= 1.0, "the first packets fit the bucket");
    assert_eq!(
        rate_gauge(metrics, "starfabric_pp_tenant_rate_limited_total"),
        Some(limited),
        "every rate-limited drop is counted for the tenant"
    );
    let state = rate_gauge(metrics, "starfabric_pp_tenant_rate_state").expect("state gauge");
    assert!((0.0..=2.0).contains(&state), "state {state}");
    assert!(rate_gauge(metrics, "starfabric_pp_tenant_rate_credit").is_some());
    node.stop().expect("clean stop");
}

/// `police CLASS` at a node meters a rule's packets against tenant CLASS's packet rate
/// (paper 000 §7.2, through the node's real rate manager and policer). Here the rule
/// polices as class 2 while its VNI belongs to tenant 1, which has no rates of its
/// own: the burst is held to class 2's bucket and allowance, the drops are counted as
/// `rate-limited-packets` and under tenant 2 on `/metrics`, and a rule of the same
/// tenant without `police` loses nothing.
#[test]
fn a_police_rule_meters_its_packets_against_its_class_rate() {
    const POLICED: &str = "\
match 100 udp 198.19.10.2:40000 > 198.19.10.9:7
rule decap; set-src 198.19.10.9:7; set-dst 198.19.10.2:40000; encap 127.0.0.1 vni 100 dmac 02:c1:00:00:00:02; police 2; out 0
match 100 udp 198.19.10.2:40001 > 198.19.10.9:7
rule decap; set-src 198.19.10.9:7; set-dst 198.19.10.2:40001; encap 127.0.0.1 vni 100 dmac 02:c1:00:00:00:02; out 0
";
    let (node, _rules, _listener) = start_rated(POLICED, "2:packets=0/200/400");
    let (addr, metrics) = (node.local_addr(), node.metrics_addr().unwrap());
    let client = UdpSocket::bind("127.0.0.1:0").unwrap();
    let counters = || {
        let body = scrape::get(metrics, "/metrics").unwrap().body;
        let s = scrape::parse(&body);
        let v = |n: &str| scrape::value(&s, n, &[]).unwrap_or(0.0);
        (
            v("starfabric_pp_rx_packets_total"),
            v("starfabric_pp_tx_packets_total"),
        )
    };
    let settled = |want_rx: f64| {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let (rx, tx) = counters();
            let limited = drops(metrics, "rate-limited-packets");
            if (rx >= want_rx && tx + limited == rx) || Instant::now() > deadline {
                return (rx, tx, limited);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let t0 = Instant::now();
    for _ in 0..2000 {
        client.send_to(&datagram(40000), addr).unwrap();
    }
    let sent_for = t0.elapsed().as_secs_f64();
    let (rx, tx, limited) = settled(1.0);
    assert_eq!(tx + limited, rx, "every packet forwarded or rate-limited");
    assert!(limited > 0.0, "the police rule dropped nothing of {rx}");
    assert!(
        tx <= 50.0 + 400.0 * (sent_for + 0.2),
        "admitted {tx} of {rx} in {sent_for:.3} s"
    );
    assert!(tx >= 1.0, "the first packets fit the bucket");
    // Class 2 carries the drops; tenant 1, whose VNI it is, is not rate-managed.
    let limited_for = |tenant: &str| {
        let body = scrape::get(metrics, "/metrics").unwrap().body;
        scrape::value(
            &scrape::parse(&body),
            "starfabric_pp_tenant_rate_limited_total",
            &[("tenant", tenant), ("kind", "packets")],
        )
    };
    assert_eq!(limited_for("2"), Some(limited));
    assert_eq!(limited_for("1"), None);
    // The same tenant's rule without `police`: nothing more is dropped.
    for i in 0..200 {
        client.send_to(&datagram(40001), addr).unwrap();
        if i % 20 == 19 {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let (rx2, tx2, limited2) = settled(rx + 1.0);
    assert_eq!(
        limited2, limited,
        "an unpoliced rule's packets were rate-limited"
    );
    assert_eq!(
        tx2 - tx,
        rx2 - rx,
        "every unpoliced packet PP read was forwarded"
    );
    assert!(rx2 > rx, "PP read none of the unpoliced packets");
    node.stop().expect("clean stop");
}

#[test]
fn an_active_interval_longer_than_the_cap_is_refused() {
    let cfg = PpNodeConfig {
        listen: SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0),
        io: IoKind::Udp,
        active_interval: pp::node::MAX_ACTIVE_INTERVAL + Duration::from_secs(1),
        ..PpNodeConfig::default()
    };
    let err = match pp::node::start(cfg, Arc::new(AtomicBool::new(false))) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a PP node started with an active interval past the cap"),
    };
    assert!(
        err.contains("--active-interval") && err.contains("30 s"),
        "{err}"
    );
}

/// Two workers on the UDP backend share the port with SO_REUSEPORT, which spreads
/// senders by their 4-tuple: the static rules are every worker's (each reflects its
/// share of the flow), drops are summed, and the final stats line counts each
/// worker's share.
#[test]
fn two_workers_share_the_port_and_both_take_traffic_by_the_same_rules() {
    let (_rules, listener, lines, node) = start_reflector(2);
    let addr = node.local_addr();
    {
        let first = &lines.lock().unwrap()[0];
        assert!(first.contains("2 SO_REUSEPORT sockets"), "{first}");
        assert!(first.contains("2 workers of 32768 flows each"), "{first}");
    }
    // 32 senders, each its own source port: the kernel's hash puts some on each socket.
    const SENDERS: usize = 32;
    let clients: Vec<UdpSocket> = (0..SENDERS)
        .map(|_| UdpSocket::bind("127.0.0.1:0").unwrap())
        .collect();
    let mut buf = [0u8; 2048];
    for c in &clients {
        c.send_to(&datagram(40000), addr).unwrap();
        listener
            .recv_from(&mut buf)
            .expect("reflected by whichever worker took it");
        // A flow with no rule: a `no-rule` drop on whichever worker.
        c.send_to(&datagram(40001), addr).unwrap();
    }
    let metrics = node.metrics_addr().expect("metrics endpoint");
    let deadline = Instant::now() + Duration::from_secs(5);
    while drops(metrics, "no-rule") < SENDERS as f64 {
        assert!(
            Instant::now() < deadline,
            "{} no-rule drops on /metrics, not {SENDERS}",
            drops(metrics, "no-rule")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    node.stop().expect("clean stop");
    let lines = lines.lock().unwrap();
    let last = lines
        .iter()
        .rev()
        .find(|l| l.starts_with("pp: t="))
        .expect("a final stats line");
    assert!(last.contains(&format!("rx={} ", 2 * SENDERS)), "{last}");
    assert!(last.contains(&format!("no-rule={SENDERS}")), "{last}");
    let per: Vec<u64> = last
        .split_whitespace()
        .find_map(|w| w.strip_prefix("rx_per_worker="))
        .expect("rx_per_worker")
        .split('/')
        .map(|n| n.parse().unwrap())
        .collect();
    assert_eq!(per.len(), 2, "{last}");
    assert_eq!(per.iter().sum::<u64>(), 2 * SENDERS as u64, "{last}");
    assert!(
        per.iter().all(|n| *n > 0),
        "both workers took traffic: {last}"
    );
}

/// A worker count the node cannot run is a configuration error, never a panic.
#[test]
fn zero_workers_and_offload_with_several_are_config_errors() {
    let rules = tempfile::NamedTempFile::new().unwrap();
    let listener = UdpSocket::bind("127.0.0.1:0").unwrap();
    let start = |cfg: PpNodeConfig| match pp::node::start(cfg, Arc::new(AtomicBool::new(false))) {
        Err(pp::node::PpNodeError::Config(why)) => why,
        Err(e) => panic!("not a config error: {e}"),
        Ok(_) => panic!("started"),
    };
    let why = start(PpNodeConfig {
        workers: 0,
        ..node_config(&rules, &listener)
    });
    assert!(why.contains("--workers 0"), "{why}");
    let mut cfg = PpNodeConfig {
        workers: 2,
        ..node_config(&rules, &listener)
    };
    cfg.offload.offload = true;
    let why = start(cfg);
    assert!(why.contains("--offload"), "{why}");
}
