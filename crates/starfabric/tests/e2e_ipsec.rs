//! The IPsec VPN end to end (docs/ipsec.md): VPC 0's host on one side, through
//! starfabric's PP node (the platform started by `starfabric up`, the tunnel and its SAs
//! set through the REST API), ESP over the underlay to a remote site whose gateway
//! terminates the tunnel: the kernel's `ip xfrm` where the kernel has ESP, else a
//! userspace ESP endpoint (scapy); the test prints which. curl both ways, iperf3, and a
//! rekey through the API under a long-lived TCP connection that must survive it.
//!
//! Needs root, like every e2e test (SKIP without, a failure under CI).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use testbed::ipsec::{self, tunnel_body as tunnel, CtlApi, RemoteSite, Sa};
use testbed::topo::{addr, vni, Node, Testbed};
use testbed::{measure, services};

use common::{Lab, BIN};

const TUNNEL: &str = "/v1/tenants/acme/ipsec/branch";

fn key(b: u8) -> String {
    [b; 20].iter().map(|x| format!("{x:02x}")).collect()
}

fn curl(tb: &Testbed, from: Node, url: &str) -> String {
    let out = tb
        .exec_full(
            from,
            &["curl", "-s", "-m", "5", url],
            Duration::from_secs(10),
        )
        .expect("curl runs");
    assert!(out.ok(), "curl {url} from {from:?}: {}", out.stderr);
    out.stdout
}

#[test]
fn ipsec_tunnel_to_a_remote_site_carries_curl_and_iperf3_both_ways_and_survives_a_rekey() {
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    let mut site = RemoteSite::build(tb, None).expect("remote site");
    println!("{}", site.summary());
    let _rh = services::start_nginx(tb, Node::RemoteHost, "remote-host", ipsec::addr::HOST, true)
        .expect("nginx on the remote host");
    let _vm = services::start_nginx(tb, Node::Client(0), "vm", addr::CLIENT, true)
        .expect("nginx on the VPC host");
    let _iperf =
        services::start_iperf3(tb, Node::RemoteHost, ipsec::addr::HOST).expect("iperf3 -s");

    // The platform, as an operator runs it; the tunnel through the API.
    let config = tb.path("cli.json");
    let up = tb
        .spawn_up(Path::new(BIN), &config, &tb.path("up"), &[])
        .expect("starfabric up");
    tb.wait_log(&up, "up: ready", Duration::from_secs(90))
        .expect("starfabric up gets ready");
    let api = CtlApi::from_config(&config).expect("the CLI configuration");
    let put = |path: &str, body: Value| api.put(tb, path, body).expect("PUT");
    let wait_applied = |spi: u32| {
        api.wait_applied(tb, TUNNEL, spi, Duration::from_secs(20))
            .expect("PP takes the SAs")
    };
    put("/v1/tenants/acme", json!({}));
    put("/v1/tenants/acme/vpcs/main", json!({"vni": vni::tenant(0)}));
    let (ours1, theirs1) = (Sa::new(0x1001, &key(0x11)), Sa::new(0x2001, &key(0x22)));
    site.install(tb, &theirs1, std::slice::from_ref(&ours1))
        .expect("remote site's SAs");
    put(TUNNEL, tunnel(&ours1, &[&theirs1]));
    wait_applied(ours1.spi);

    // curl both ways: each server sees the other side's real address (no NAT).
    let body = curl(
        tb,
        Node::Client(0),
        &format!("http://{}/", ipsec::addr::HOST),
    );
    assert!(
        body.starts_with(&format!("remote-host {}:", addr::CLIENT)),
        "{body}"
    );
    let body = curl(tb, Node::RemoteHost, &format!("http://{}/", addr::CLIENT));
    assert!(
        body.starts_with(&format!("vm {}:", ipsec::addr::HOST)),
        "{body}"
    );

    // iperf3 through the tunnel, both directions.
    let up_gbps = measure::tcp_gbps(tb, Node::Client(0), ipsec::addr::HOST, 3).expect("iperf3");
    println!("iperf3 VPC -> remote through the tunnel: {up_gbps:.3} Gbit/s");
    assert!(up_gbps > 0.0);
    let out = tb
        .exec_full(
            Node::Client(0),
            &[
                "iperf3",
                "-c",
                &ipsec::addr::HOST.to_string(),
                "-t",
                "2",
                "-R",
                "-J",
                "--connect-timeout",
                "3000",
            ],
            Duration::from_secs(20),
        )
        .expect("iperf3 -R");
    let down = measure::parse_iperf3(&out.stdout).expect("iperf3 -R result") / 1e9;
    println!("iperf3 remote -> VPC through the tunnel: {down:.3} Gbit/s");
    assert!(down > 0.0);

    // A rekey under a long-lived TCP connection (paced, so both ends keep up).
    let long = tb
        .spawn(
            Node::Client(0),
            "iperf3 long-lived",
            &[
                "iperf3",
                "-c",
                &ipsec::addr::HOST.to_string(),
                "-t",
                "9",
                "-b",
                "4M",
                "-J",
                "--connect-timeout",
                "3000",
            ],
        )
        .expect("iperf3 long-lived");
    std::thread::sleep(Duration::from_secs(3));
    let (ours2, theirs2) = (Sa::new(0x1002, &key(0x33)), Sa::new(0x2002, &key(0x44)));
    // Make before break: the remote site opens with our next SA first; then starfabric
    // seals with it and opens with both; then the remote site seals with its next SA.
    site.add_inbound(tb, &ours2)
        .expect("remote: new inbound SA");
    let rekey_at = Instant::now();
    put(TUNNEL, tunnel(&ours2, &[&theirs2, &theirs1]));
    let applied = wait_applied(ours2.spi);
    println!(
        "rekey applied at PP in {:.0} ms: {}",
        rekey_at.elapsed().as_secs_f64() * 1e3,
        applied["status"][0]
    );
    site.switch_outbound(tb, &theirs2)
        .expect("remote: new outbound SA");
    std::thread::sleep(Duration::from_secs(1));
    site.remove_inbound(tb, ours1.spi)
        .expect("remote: old inbound SA gone");
    // The old inbound SA leaves starfabric's configuration too.
    put(TUNNEL, tunnel(&ours2, &[&theirs2]));
    let deadline = Instant::now() + Duration::from_secs(20);
    while tb.running(&long) {
        assert!(Instant::now() < deadline, "iperf3 did not end");
        std::thread::sleep(Duration::from_millis(200));
    }
    let text = std::fs::read_to_string(&long.log).unwrap();
    let start = text.find('{').expect("iperf3 JSON");
    let v: Value = serde_json::from_str(&text[start..]).expect("iperf3 JSON");
    assert!(v["error"].is_null(), "the connection broke: {}", v["error"]);
    let intervals = v["intervals"].as_array().expect("intervals");
    let bytes: Vec<u64> = intervals
        .iter()
        .map(|i| i["sum"]["bytes"].as_u64().unwrap_or(0))
        .collect();
    println!("long-lived connection, bytes per second: {bytes:?}");
    assert!(bytes.len() >= 8, "{bytes:?}");
    assert!(
        bytes.iter().all(|b| *b > 0),
        "a second without data: {bytes:?}"
    );
    let received = v["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0);
    assert!(received > 0);

    // Both new SAs carried traffic; the old outbound SA is gone.
    let (_, v) = api.call(tb, "GET", TUNNEL, None).expect("GET the tunnel");
    let st = &v["status"][0];
    println!("tunnel after the rekey: {st}");
    assert_eq!(st["outbound_spi"], json!(ours2.spi));
    assert!(st["outbound_packets"].as_u64().unwrap() > 0);
    let new_in = st["inbound"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["spi"] == json!(theirs2.spi))
        .expect("the new inbound SA");
    assert!(new_in["packets"].as_u64().unwrap() > 0, "{st}");
    println!("remote site: {}", site.describe(tb));

    // Bad ESP from the remote site's address: a replay of sequence number 1 of the SA
    // in use, the same sealed with the wrong key, a truncated packet and an unknown SPI.
    // Each is dropped at PP and counted; the tunnel goes on.
    let (_, node) = api
        .call(tb, "GET", "/v1/nodes/pp-1", None)
        .expect("GET the PP node");
    let metrics_url = node["metrics_url"]
        .as_str()
        .expect("the PP node's metrics URL")
        .to_string();
    // The PP node's drop counters by reason, from its /metrics (in its namespace).
    let esp_drops = || -> std::collections::BTreeMap<String, u64> {
        let text = tb
            .exec(
                Node::Pp,
                &["curl", "-s", "-m", "5", &metrics_url],
                Duration::from_secs(10),
            )
            .expect("the PP node's /metrics");
        text.lines()
            .filter_map(|l| {
                let rest = l.strip_prefix("starfabric_pp_drops_total{reason=\"esp-")?;
                let (reason, value) = rest.split_once("\"} ")?;
                Some((reason.to_string(), value.trim().parse::<f64>().ok()? as u64))
            })
            .collect()
    };
    let tunnel_drops = || -> u64 {
        let (_, v) = api.call(tb, "GET", TUNNEL, None).expect("GET the tunnel");
        v["status"][0]["drops"].as_u64().unwrap_or(0)
    };
    let (nd0, td0) = (esp_drops(), tunnel_drops());
    let script = format!(
        r#"
from scapy.all import IP, UDP, Raw, send, conf
from scapy.layers.ipsec import ESP, SecurityAssociation
conf.verb = 0
def sa(spi, key):
    return SecurityAssociation(ESP, spi=spi, crypt_algo="AES-GCM", crypt_key=bytes.fromhex(key),
                               auth_algo="NULL", tunnel_header=IP(src="{gw}", dst="{pp}"))
inner = IP(src="{host}", dst="{vm}") / UDP(sport=9, dport=9) / Raw(b"bad")
send(sa({spi}, "{key}").encrypt(inner, seq_num=1))                  # a replay
send(sa({spi}, "{wrong}").encrypt(inner, seq_num=1000000))          # the wrong key
send(IP(src="{gw}", dst="{pp}", proto=50) / Raw(bytes(12)))         # truncated
send(sa(0x7777, "{key}").encrypt(inner, seq_num=1))                 # an unknown SPI
"#,
        spi = theirs2.spi,
        gw = ipsec::addr::GATEWAY,
        pp = addr::PP,
        host = ipsec::addr::HOST,
        vm = addr::CLIENT,
        key = theirs2.key,
        wrong = key(0x99),
    );
    tb.exec(
        Node::RemoteSite,
        &["/usr/bin/python3", "-c", &script],
        Duration::from_secs(30),
    )
    .expect("scapy sends the bad ESP packets");
    let t0 = Instant::now();
    loop {
        let (nd, td) = (esp_drops(), tunnel_drops());
        let more = |r: &str| nd.get(r).copied().unwrap_or(0) - nd0.get(r).copied().unwrap_or(0);
        // Replay and wrong key are the tunnel's; each of the four has its reason.
        if ["replay", "auth-failed", "truncated", "unknown-spi"]
            .iter()
            .all(|r| more(r) >= 1)
            && td >= td0 + 2
        {
            println!(
                "bad ESP dropped and counted: {nd:?}, tunnel drops +{}",
                td - td0
            );
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "bad ESP not counted: {nd0:?} -> {nd:?}, tunnel drops {td0} -> {td}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }

    // And the tunnel still carries new connections.
    let body = curl(
        tb,
        Node::Client(0),
        &format!("http://{}/", ipsec::addr::HOST),
    );
    assert!(body.starts_with("remote-host "), "{body}");
}
