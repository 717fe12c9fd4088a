//! PrivateLink end to end on the netns testbed (docs/privatelink.md): tenant B (VPC 1,
//! VNI 101) publishes its nginx at 198.19.1.2:80 to tenant A (VPC 0, VNI 100), which
//! reaches it at the private endpoint 198.19.7.10:80 inside its own VPC. Both VPCs use
//! 198.19.1.0/24 and both hosts are 198.19.1.2, each running an nginx of its own.
//!
//! A's VNI is bound to a chain with the PrivateLink NF whose forward egress is B's host
//! on B's VNI; B's VNI to B's own SNAT chain toward the internet host, so B's probes
//! below go through a live chain and fail for the isolation's sake, not for a dead VPC.
//!
//! Needs root and the tools scripts/setup.sh installs (curl, nc, nginx); skips without
//! root as every e2e test does (`common::Lab`).

use std::net::Ipv4Addr;
use std::time::Duration;

use testbed::chains::{self, Toward};
use testbed::platform;
use testbed::services;
use testbed::topo::{addr, Node};
use testbed::Testbed;

mod common;
use common::{snat_chain, Lab};

/// The private endpoint in A's VPC (off A's client subnet, so routed to the PP node).
const ENDPOINT: Ipv4Addr = Ipv4Addr::new(198, 19, 7, 10);
/// An address of A's VPC that is no endpoint.
const NOT_ENDPOINT: Ipv4Addr = Ipv4Addr::new(198, 19, 7, 11);
/// The provider-side source address, in B's VPC: what B's nginx sees.
const SOURCE: Ipv4Addr = Ipv4Addr::new(198, 19, 9, 1);

/// Run `argv` in `n`, bounded; its output.
fn run(tb: &Testbed, n: Node, argv: &[&str]) -> testbed::cmd::Output {
    tb.exec_full(n, argv, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("run {argv:?}: {e}"))
}

/// `curl` from `n` that must succeed; the body.
fn curl_ok(tb: &Testbed, n: Node, url: &str) -> String {
    let out = run(tb, n, &["curl", "-sS", "--max-time", "5", url]);
    assert!(
        out.ok(),
        "curl {url} from {n:?}: {}: {}",
        out.status,
        out.stderr
    );
    out.stdout
}

/// A probe that must fail: a TCP connection that must not be made. One second is
/// enough: through PP a SYN is forwarded in milliseconds or never.
fn refused(tb: &Testbed, n: Node, url: &str) {
    let out = run(
        tb,
        n,
        &[
            "curl",
            "-sS",
            "--connect-timeout",
            "1",
            "--max-time",
            "2",
            url,
        ],
    );
    assert!(
        !out.ok(),
        "curl {url} from {n:?} got through: {:?}",
        out.stdout
    );
}

fn nc_refused(tb: &Testbed, n: Node, host: Ipv4Addr, port: u16) {
    let (h, p) = (host.to_string(), port.to_string());
    let out = run(tb, n, &["nc", "-z", "-w", "1", &h, &p]);
    assert!(!out.ok(), "nc {h} {p} from {n:?} connected");
}

#[test]
fn a_consumer_reaches_the_providers_nginx_through_its_endpoint_and_nothing_else() {
    let Some(lab) = Lab::new(2, 0) else { return };
    let tb = lab.tb();
    services::start_inet(tb, false).expect("internet host servers");
    let a_nginx = services::start_nginx(tb, Node::Client(0), "tenant-a", addr::CLIENT, true)
        .expect("A's nginx");
    let b_nginx = services::start_nginx(tb, Node::Client(1), "tenant-b", addr::CLIENT, true)
        .expect("B's nginx");
    let link = chains::chain(
        1,
        1,
        0,
        Toward::Vpc(1),
        &[chains::privatelink(ENDPOINT, addr::CLIENT, SOURCE)],
    )
    .expect("PrivateLink chain");
    let p = lab.start(vec![link, snat_chain(1)]);
    let (a, b) = (Node::Client(0), Node::Client(1));

    // A reaches B's nginx through the endpoint, and B sees its own address space's
    // source, never A's (which is numerically B's own address).
    let url = format!("http://{ENDPOINT}/");
    for i in 0..3 {
        let body = curl_ok(tb, a, &url);
        assert!(
            body.starts_with(&format!("tenant-b {SOURCE}:")),
            "request {i}: {body:?}"
        );
    }

    // Nothing else of B from A: another port of the endpoint, another address of A's
    // VPC, the provider-side source address, UDP to the endpoint's port.
    refused(tb, a, &format!("http://{ENDPOINT}:8080/"));
    refused(tb, a, &format!("http://{NOT_ENDPOINT}/"));
    refused(tb, a, &format!("http://{SOURCE}/"));
    nc_refused(tb, a, ENDPOINT, 22);
    // A UDP datagram to the endpoint's port (published for TCP only); nothing answers
    // UDP either way, so PP's count below is what shows it was refused.
    let udp = format!("echo probe | nc -u -w 1 {ENDPOINT} 80");
    let _ = run(tb, a, &["sh", "-c", &udp]);

    // B's chain is live (it reaches the internet host) ...
    let body = curl_ok(tb, b, &format!("http://{}/", addr::INET));
    assert!(
        body.starts_with(&format!("inet {}:", addr::pool(1))),
        "{body:?}"
    );
    // ... yet nothing of A is reachable from B: not the endpoint, not the source
    // address's ports A's flows used, and 198.19.1.2 is B's own host in B's VPC.
    refused(tb, b, &url);
    for l in b_nginx.access_log() {
        let port: u16 = l
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("access log line {l:?}"));
        nc_refused(tb, b, SOURCE, port);
    }
    assert!(curl_ok(tb, b, &format!("http://{}/", addr::CLIENT)).starts_with("tenant-b "));

    // B's nginx served exactly the three endpoint requests (plus B's own), all from the
    // provider-side source; A's nginx served nobody.
    let log = b_nginx.access_log();
    let from_link = log
        .iter()
        .filter(|l| l.starts_with(&format!("{SOURCE} ")))
        .count();
    assert_eq!(from_link, 3, "{log:?}");
    assert_eq!(log.len(), 4, "{log:?}");
    assert_eq!(a_nginx.access_log(), Vec::<String>::new());

    // PP counted the refusals under the NF's reason.
    // A's five probes are five flows the NF refused. On a loaded machine a probe's
    // first packet may outwait PP's 500 ms pending hold (counted as pending-timeout)
    // before its drop rule arrives, and curl gives up before retransmitting: so at
    // least three, not exactly five.
    let reason = "rule:privatelink-no-endpoint";
    let stats = p.pp_stats_when(|s| platform::field(s, reason).unwrap_or(0) >= 5);
    assert!(platform::field(&stats, reason).unwrap_or(0) >= 3, "{stats}");
}
