//! End to end with real tools: each test builds its own netns testbed (crates/testbed),
//! starts starfabric in it from an FM configuration file (FM and three SC nodes in the
//! control namespace, a PP node in the PP namespace), and drives real traffic through it
//! with curl, iperf3, nginx, wrk, nc and the STUN client and server.
//!
//! Every test's namespaces carry a prefix of its own (`sft-<pid>-<n>-`); the `Lab` guard
//! deletes them and the processes in them when the test ends, passes or panics, and then
//! asserts none is left. Namespaces of earlier runs that died without cleaning up
//! (SIGKILL) are swept at the start.
//!
//! Needs root and the tools scripts/setup.sh installs. Without root the tests skip with
//! a message, except under CI (the `CI` variable set), where that is a failure: CI runs
//! as root, so a skip there would hide that nothing ran.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use nfs::fw::{AclAction, AclProto};
use testbed::chains::{self, Toward};
use testbed::cleanup::namespaces_with_prefix;
use testbed::measure;
use testbed::platform::{self, Platform, PlatformSpec};
use testbed::services::{self, Nginx};
use testbed::topo::{addr, Node};
use testbed::{Resources, Testbed, TopologySpec};

mod common;
use common::{snat_chain, Lab, BIN, ROOT, RUN};

/// `curl` from VPC `j`'s client, bounded; its stdout (the body) or a panic.
fn curl(tb: &Testbed, j: usize, url: &str) -> String {
    let out = tb
        .exec_full(
            Node::Client(j),
            &["curl", "-sS", "--max-time", "5", url],
            Duration::from_secs(10),
        )
        .expect("run curl");
    assert!(
        out.ok(),
        "curl {url} from c{j}: {}: {}",
        out.status,
        out.stderr
    );
    out.stdout
}

/// `<name> <addr>:<port>` from an nginx body.
fn peer(body: &str) -> (String, Ipv4Addr, u16) {
    let mut w = body.split_whitespace();
    let name = w.next().unwrap_or_default().to_string();
    let (a, p) = w
        .next()
        .and_then(|s| s.split_once(':'))
        .unwrap_or_else(|| panic!("unexpected body {body:?}"));
    (name, a.parse().unwrap(), p.parse().unwrap())
}

#[test]
fn curl_through_snat_reaches_the_internet_from_the_pool_address() {
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    let inet = services::start_inet(tb, false).unwrap();
    let p = lab.start(vec![snat_chain(0)]);
    let url = format!("http://{}/", addr::INET);
    for i in 0..5 {
        let body = curl(tb, 0, &url);
        let (name, src, port) = peer(&body);
        assert_eq!(name, "inet", "request {i}: {body}");
        assert_eq!(
            src,
            addr::pool(0),
            "request {i}: the server sees the pool address"
        );
        assert!(
            port >= 1024,
            "request {i}: port {port} from the pool's range"
        );
    }
    // The server's own log agrees: every request came from the pool address.
    let log = inet.nginx.access_log();
    assert_eq!(log.len(), 5, "{log:?}");
    for l in &log {
        assert!(l.starts_with(&format!("{} ", addr::pool(0))), "{l}");
        assert!(!l.contains(&addr::CLIENT.to_string()), "{l}");
    }
    // The PP node asked for a rule per connection (its stats line comes every second).
    let stats = p.pp_stats_when(|s| platform::field(s, "misses").unwrap_or(0) >= 5);
    assert!(
        platform::field(&stats, "misses").unwrap_or(0) >= 5,
        "{stats}"
    );
    assert!(platform::field(&stats, "hits").unwrap_or(0) > 0, "{stats}");
}

/// The AF_XDP backend is what the PP node takes by default on the testbed (its veth runs
/// the XDP program natively, its socket in copy mode), and the same traffic still works:
/// the stats line shows the frames went through the AF_XDP rings.
#[test]
fn pp_takes_af_xdp_by_default_on_the_testbed() {
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    services::start_inet(tb, false).unwrap();
    let p = lab.start(vec![snat_chain(0)]);
    let line = p.pp_listening();
    assert_eq!(p.pp_io(), Some("afxdp"), "{line}");
    assert!(
        line.contains("native XDP on up0, copy mode, tx gso (pfifo qdisc)"),
        "{line}"
    );
    // The outer MACs it writes are the veth's and the router's (resolved, not made up).
    let pp_mac = tb
        .exec_full(
            Node::Pp,
            &["cat", "/sys/class/net/up0/address"],
            Duration::from_secs(5),
        )
        .unwrap()
        .stdout;
    assert!(
        line.contains(&format!("node mac {}", pp_mac.trim())),
        "{line}"
    );
    let body = curl(tb, 0, &format!("http://{}/", addr::INET));
    assert_eq!(peer(&body).1, addr::pool(0), "{body}");
    let stats = p.pp_stats_when(|s| platform::field(s, "completed").unwrap_or(0) > 0);
    assert!(stats.contains(" io: afxdp "), "{stats}");
    assert!(
        platform::field(&stats, "completed").unwrap_or(0) > 0,
        "{stats}"
    );
    assert_eq!(platform::field(&stats, "tx_dropped"), Some(0), "{stats}");
}

/// `rx_per_worker=a/b/..` of a PP stats line.
fn rx_per_worker(stats: &str) -> Vec<u64> {
    stats
        .split_whitespace()
        .find_map(|w| w.strip_prefix("rx_per_worker="))
        .map(|v| v.split('/').filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_default()
}

/// Two PP workers on AF_XDP over a 2-queue veth (docs/pp-pipeline.md, "Workers"):
/// worker i on queue i, the router's veth end spreading flows over the queues by hash.
/// Many new connections through SNAT all succeed, both workers receive traffic (the
/// stats line and `/metrics` agree), and the reply directions that land on the other
/// worker than their flow's first packet are answered by FM's rule cache.
#[test]
fn two_workers_on_two_queues_share_the_traffic_and_every_connection_succeeds() {
    let Some(lab) = Lab::queues(1, 0, 2) else {
        return;
    };
    let tb = lab.tb();
    // Worker counts the node cannot run are configuration errors, with --io auto too
    // (no fallback to the UDP socket for a count that can never work on AF_XDP).
    let listen = format!("{}:4789", addr::PP);
    for (args, why) in [
        (
            ["--workers", "3", "--io", "auto"],
            "--workers 3 is more than the 2 receive queues of up0",
        ),
        (
            ["--workers", "0", "--io", "udp"],
            "--workers 0 is not in 1..=64",
        ),
    ] {
        let mut argv = vec![BIN, "pp", "--listen", &listen, "--duration", "1"];
        argv.extend(args);
        let out = tb
            .exec_full(Node::Pp, &argv, Duration::from_secs(10))
            .unwrap();
        assert!(!out.ok(), "{args:?} ran: {}", out.stdout);
        assert!(out.stderr.contains(why), "{args:?}: {}", out.stderr);
    }
    // `--workers auto` (the default) takes a worker per CPU, no more than up0's queues.
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let out = tb
        .exec_full(
            Node::Pp,
            &[
                BIN,
                "pp",
                "--listen",
                &listen,
                "--io",
                "afxdp",
                "--duration",
                "1",
            ],
            Duration::from_secs(10),
        )
        .unwrap();
    let want = format!(", {} workers of ", cpus.min(2));
    assert!(
        out.ok()
            && (out.stdout.contains(&want) || (cpus == 1 && !out.stdout.contains("workers of"))),
        "{want}: {} {}",
        out.stdout,
        out.stderr
    );
    services::start_inet(tb, false).unwrap();
    let p = lab.start_with(
        vec![snat_chain(0)],
        &["--workers", "2", "--io", "afxdp", "--metrics", PP_HTTP],
    );
    let line = p.pp_listening();
    assert_eq!(p.pp_io(), Some("afxdp"), "{line}");
    assert!(line.contains(", 2 queues"), "{line}");
    assert!(line.contains(", 2 workers of "), "{line}");
    let url = format!("http://{}/", addr::INET);
    for i in 0..20 {
        let body = curl(tb, 0, &url);
        assert_eq!(peer(&body).1, addr::pool(0), "request {i}: {body}");
    }
    // Every request on a new connection: hundreds of flows, each hashed to a queue.
    let r = measure::wrk(tb, Node::Client(0), &url, 3, 8, true).unwrap();
    println!("wrk: {r:?}");
    assert!(r.requests >= 100, "{r:?}; pp: {}", p.pp_stats());
    assert_eq!(r.socket_errors, 0, "{r:?}; pp: {}", p.pp_stats());
    assert_eq!(r.non_2xx, 0, "{r:?}");
    let stats = p.pp_stats_when(|s| {
        let w = rx_per_worker(s);
        w.len() == 2 && w.iter().all(|n| *n > 100)
    });
    println!("{stats}");
    let w = rx_per_worker(&stats);
    assert_eq!(w.len(), 2, "{stats}");
    assert!(w.iter().all(|n| *n > 100), "both workers receive: {stats}");
    assert_eq!(
        platform::field(&stats, "rx"),
        Some(w.iter().sum()),
        "rx is the workers' sum: {stats}"
    );
    assert!(stats.contains("workers=2 "), "{stats}");
    // Cross-worker replies: a reply direction on the other worker asks FM, whose
    // cache answers it (one worker would have installed it with the forward rule).
    let fm = p.fm_status();
    println!("{fm}");
    assert!(
        platform::field(&fm, "cache_hits").unwrap_or(0) > 0,
        "{fm}; pp: {stats}"
    );
    let metrics = pp_http(tb, "GET", "/metrics", None);
    for wk in 0..2 {
        let name = format!("starfabric_pp_worker_rx_packets_total{{worker=\"{wk}\"}} ");
        let v: u64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix(&name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /metrics"));
        assert!(v > 0, "{name}{v}");
    }
}

/// The UDP-socket backend, the fallback, still carries the same traffic when asked for.
#[test]
fn curl_and_iperf3_through_snat_on_the_udp_socket_backend() {
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    services::start_inet(tb, false).unwrap();
    let p = lab.start_with(vec![snat_chain(0)], &["--io", "udp"]);
    assert_eq!(p.pp_io(), Some("udp"), "{}", p.pp_listening());
    // Its GSO sends go out behind a pfifo the node put on the veth (no qdisc of its own).
    assert!(
        p.pp_listening().contains("io udp (pfifo qdisc)"),
        "{}",
        p.pp_listening()
    );
    for i in 0..3 {
        let body = curl(tb, 0, &format!("http://{}/", addr::INET));
        assert_eq!(peer(&body).1, addr::pool(0), "request {i}: {body}");
    }
    let gbps = measure::tcp_gbps(tb, Node::Client(0), addr::INET, 2)
        .unwrap_or_else(|e| panic!("iperf3: {e}; pp: {}", p.pp_stats()));
    assert!(gbps > 0.0);
    let stats = p.pp_stats_when(|s| platform::field(s, "misses").unwrap_or(0) >= 3);
    assert!(stats.contains(" io: rx="), "{stats}");
    assert!(
        platform::field(&stats, "misses").unwrap_or(0) >= 3,
        "{stats}"
    );
    // A TCP flow's output is runs of same-size datagrams to one VTEP: the backend sends
    // them as UDP GSO messages, and the kernel takes them all.
    assert!(
        platform::field(&stats, "gso_sends").unwrap_or(0) > 0,
        "{stats}"
    );
    assert_eq!(platform::field(&stats, "gso_fallbacks"), Some(0), "{stats}");
    // What the device dropped after a send was taken is counted too (it may be 0 here).
    assert!(
        platform::field(&stats, "netns_udp_sndbuf_errors").is_some(),
        "{stats}"
    );
    // The worker's real-time governor (`--worker-rt`, on by default) reports itself.
    assert!(
        platform::field(&stats, "rt_entered").is_some() && stats.contains(" rt: workers_rt="),
        "{stats}"
    );
}

/// The XDP fast path on the real interface: a long iperf3 TCP flow becomes an elephant,
/// its rules move into the driver (the stats line counts packets the fast path forwarded
/// and folded back), the transfer completes, and once idle the flows go back to userspace
/// (expired), where new traffic still works.
#[test]
fn a_long_tcp_flow_moves_to_the_xdp_fast_path_and_back_when_idle() {
    // One queue whatever the suite's `--workers`: the fast path runs with one worker,
    // and AF_XDP with one worker refuses a veth of more queues.
    let Some(lab) = Lab::queues(1, 0, 1) else {
        return;
    };
    let tb = lab.tb();
    services::start_inet(tb, false).unwrap();
    let p = lab.start_with(
        vec![snat_chain(0)],
        &[
            "--offload",
            "--offload-packets",
            "200",
            "--offload-idle-ms",
            "500",
        ],
    );
    let line = p.pp_listening();
    assert!(line.contains("XDP fast path on"), "{line}");
    let gbps = measure::tcp_gbps(tb, Node::Client(0), addr::INET, 3)
        .unwrap_or_else(|e| panic!("iperf3: {e}; pp: {}", p.pp_stats()));
    println!("iperf3 through SNAT with the fast path: {gbps:.3} Gbit/s");
    assert!(gbps > 0.0);
    let stats = p.pp_stats_when(|s| {
        platform::field(s, "expired").unwrap_or(0) >= 1 && platform::field(s, "active") == Some(0)
    });
    println!("{stats}");
    let f = |k: &str| platform::field(&stats, k).unwrap_or(0);
    assert!(f("offloaded") >= 1, "no flow was offloaded: {stats}");
    assert!(f("fastpath") > 0, "the driver forwarded nothing: {stats}");
    assert!(f("elephants") >= f("offloaded"), "{stats}");
    assert!(f("expired") >= 1, "no offloaded flow went back: {stats}");
    assert_eq!(f("active"), 0, "{stats}");
    assert_eq!(f("map_errors") + f("errors"), 0, "{stats}");
    // What the driver transmitted reached the router: XDP_TX frames were not lost on the
    // way (the router's side of the link got at least everything both paths sent).
    let router_rx = tb.dev_counter(Node::Router, "dpp", "rx_packets").unwrap();
    let ethtool = |n: Node, dev: &str| {
        tb.exec_full(n, &["ethtool", "-S", dev], Duration::from_secs(5))
            .map(|o| o.stdout)
            .unwrap_or_default()
    };
    assert!(
        router_rx >= f("fastpath") + f("tx"),
        "router got {router_rx} frames, PP sent {} from XDP and {} from userspace: {stats}\n\
         PP up0: {}\nrouter dpp: {}",
        f("fastpath"),
        f("tx"),
        ethtool(Node::Pp, "up0"),
        ethtool(Node::Router, "dpp"),
    );
    // Back on the userspace path, the same tenant's new flows still work.
    let body = curl(tb, 0, &format!("http://{}/", addr::INET));
    assert_eq!(peer(&body).1, addr::pool(0), "{body}");
}

/// `bench e2e`'s per-core rate against the PP node: the live-frames sender in the router
/// namespace, the NF pinned to one CPU, the sink on the router's side. Traffic gets
/// through, and every setting it made is undone: the router's side passes everything
/// again, up0's NAPI is back in softirq, the PP node may run on every CPU again, and
/// curl still works.
#[test]
fn the_per_core_udp_rate_goes_through_the_pp_node_and_every_setting_is_undone() {
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    services::start_inet(tb, false).unwrap();
    let p = lab.start(vec![snat_chain(0)]);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The ladder pins and renices the thread that reads its counters (this one) for the
    // run; both come back.
    let thread_sched = || {
        let st = std::fs::read_to_string("/proc/thread-self/status").unwrap();
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        let cpus = st
            .lines()
            .find(|l| l.starts_with("Cpus_allowed_list:"))
            .map(str::to_string);
        // Field 19, nice, counted after the command's closing parenthesis.
        let rest = &stat[stat.rfind(')').unwrap() + 1..];
        (cpus, rest.split_whitespace().nth(16).map(str::to_string))
    };
    let sched_before = thread_sched();
    let r = measure::udp64_core_pps(
        tb,
        Path::new(BIN),
        0,
        8,
        &[p.pp.pid],
        Duration::from_millis(700),
        0.3,
    );
    if cpus < 2 {
        assert!(r.is_err(), "one CPU cannot host a sender and an NF");
        return;
    }
    assert_eq!(
        thread_sched(),
        sched_before,
        "the reading thread's CPUs and nice"
    );
    let r = r.unwrap_or_else(|e| panic!("udp64_core_pps: {e}; pp: {}", p.pp_stats()));
    println!("per-core rate: {r:?}; pp: {}", p.pp_stats());
    assert!(r.pps > 1000.0, "{r:?}");
    assert!(r.offered_pps >= r.pps * 0.99, "{r:?}");
    // The lowest load is well within any NF's reach: forwarded in full, in at least one
    // of its tries (the bracket's first step and the pairs' peak steps ask for the same
    // rate). The first try also warms the node's rings and pages: on a busy 2-CPU VM it
    // once lost 10% of its frames to an empty fill ring (`xsk_fill_empty`) while the
    // pairs' three tries at the same rate forwarded 96–100%.
    let [o, _] = r.steps[0];
    let low = r.ladder[0].asked;
    let best = r
        .ladder
        .iter()
        .filter(|s| s.asked == low && s.offered > 0.0)
        .map(|s| s.forwarded / s.offered)
        .fold(0.0, f64::max);
    assert!(best >= 0.9 && o > 25_000.0, "{r:?}");
    assert!(
        r.overload_pps.is_some(),
        "the unpaced load was tried: {r:?}"
    );
    // The ladder ends with 2 x the peak load, the pairs of (peak, 2 x peak), then
    // unpaced; both overload figures are there.
    use testbed::ladder::{Phase, PAIRS};
    let phases: Vec<_> = r.ladder.iter().map(|s| s.phase).collect();
    let mut tail = vec![Phase::Overload];
    tail.extend([Phase::PairPeak, Phase::PairOverload].repeat(PAIRS));
    tail.push(Phase::Unpaced);
    assert_eq!(&phases[phases.len() - tail.len()..], tail, "{r:?}");
    assert!(r.overload_keep.is_some_and(|k| k > 0.0), "{r:?}");
    assert!(r.overload_keep_paired.is_some_and(|k| k > 0.0), "{r:?}");
    // The NF's scheduling was sampled in every step.
    assert!(r.ladder.iter().all(|s| s.rt_share.is_some()), "{r:?}");
    assert_ne!(r.nf_cpu, r.gen_cpu);
    let xdp = tb
        .exec(
            Node::Router,
            &["ip", "-d", "link", "show", "dpp"],
            Duration::from_secs(5),
        )
        .unwrap();
    assert!(xdp.contains("name xdp_pass"), "the router's side: {xdp}");
    let threaded = tb
        .exec(
            Node::Pp,
            &["cat", "/sys/class/net/up0/threaded"],
            Duration::from_secs(5),
        )
        .unwrap();
    assert_eq!(threaded.trim(), "0");
    let pid = p.pp.pid.to_string();
    let aff = testbed::cmd::run(&["taskset", "-p", "-c", &pid], Duration::from_secs(5)).unwrap();
    // "pid N's current affinity list: 0,1" (or "0-3"): every CPU again.
    let list = aff.rsplit(':').next().unwrap_or_default().trim();
    let allowed: Vec<usize> = list
        .split(',')
        .flat_map(|r| match r.split_once('-') {
            Some((a, b)) => (a.parse().unwrap()..=b.parse().unwrap()).collect::<Vec<usize>>(),
            None => vec![r.parse().unwrap()],
        })
        .collect();
    assert_eq!(allowed, (0..cpus).collect::<Vec<_>>(), "{aff}");
    // A new flow after the overload steps. The ladder held the PP worker at real-time
    // priority on one CPU and the sender on the other for ~10 s, with the file's other
    // tests beside it, so the planes' control threads were starved for that long. The
    // node must set up new flows again within three tries of 5 s. One try failed once
    // in 24 local runs and once in CI (stop 70: every SYN of curl's first 5 s missed and
    // timed out at PP, `pending-timeout`, with the FM session up); the cause was not
    // found, so each failed try keeps every plane's log lines, and they are printed if
    // all three fail.
    let log_lines = |f: &Path, n: usize| {
        // Newest first: the status lines' last few, and every other line (warnings).
        let log = std::fs::read_to_string(f).unwrap_or_default();
        let mut status = 0;
        (log.lines().rev())
            .filter(|l| {
                let s = l.starts_with("pp: t=") || l.starts_with("fm: t=");
                status += usize::from(s);
                !s || status <= 3
            })
            .take(n)
            .collect::<Vec<_>>()
            .join("\n")
    };
    let mut failures = Vec::new();
    let out = loop {
        let out = tb
            .exec_full(
                Node::Client(0),
                &[
                    "curl",
                    "-sS",
                    "--max-time",
                    "5",
                    &format!("http://{}/", addr::INET),
                ],
                Duration::from_secs(10),
            )
            .expect("run curl");
        if out.ok() {
            break out;
        }
        let scs: Vec<String> = (p.scs.iter().enumerate())
            .map(|(i, s)| format!("sc-{i} log, newest first:\n{}", log_lines(&s.log, 15)))
            .collect();
        failures.push(format!(
            "try {}: {}: {}; pp log, newest first:\n{}\nfm log, newest first:\n{}\n{}",
            failures.len() + 1,
            out.status,
            out.stderr,
            log_lines(&p.pp.log, 20),
            log_lines(&p.fm.log, 30),
            scs.join("\n")
        ));
        assert!(
            failures.len() < 3,
            "no new flow after the ladder in three tries:\n{}",
            failures.join("\n\n")
        );
    };
    if !failures.is_empty() {
        println!(
            "a new flow after the ladder needed {} tries:",
            failures.len() + 1
        );
        println!("{}", failures.join("\n\n"));
    }
    assert_eq!(peer(&out.stdout).1, addr::pool(0), "{}", out.stdout);
}

#[test]
fn iperf3_tcp_through_snat_for_5_seconds() {
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    services::start_inet(tb, false).unwrap();
    let p = lab.start(vec![snat_chain(0)]);
    // An iperf3 error (connection refused, reset, no data) is an Err here.
    let gbps = measure::tcp_gbps(tb, Node::Client(0), addr::INET, 5)
        .unwrap_or_else(|e| panic!("iperf3: {e}; pp: {}", p.pp_stats()));
    println!(
        "iperf3 through starfabric SNAT: {gbps:.3} Gbit/s; {}",
        p.pp_stats()
    );
    assert!(gbps > 0.0, "no throughput");
    // Every datagram the PP node handed to its socket was taken by the kernel.
    let stats = p.pp_stats();
    assert_eq!(platform::field(&stats, "tx_errors"), Some(0), "{stats}");
    // On the default backend (AF_XDP, copy mode) the flow's segments left in UDP GSO
    // runs through the packet socket, none refused.
    let stats = p.pp_stats_when(|s| platform::field(s, "gso_segments").unwrap_or(0) > 0);
    assert!(stats.contains(" io: afxdp "), "{stats}");
    let (sends, segments) = (
        platform::field(&stats, "gso_sends").unwrap_or(0),
        platform::field(&stats, "gso_segments").unwrap_or(0),
    );
    assert!(sends > 0 && segments >= 2 * sends, "{stats}");
    assert_eq!(platform::field(&stats, "gso_fallbacks"), Some(0), "{stats}");
}

/// The unpaced flows of `bench scaling` are read where they arrive: the iperf3 server's
/// own 100 ms intervals, fetched by the client (`throughput_dip` is computed from them).
#[test]
fn unpaced_iperf3_reports_the_receivers_intervals_beside_the_senders() {
    use testbed::elastic::{self, Iperf, IperfSpec};
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    services::start_inet(tb, false).unwrap();
    services::start_iperf3_unpaced(tb).unwrap();
    let p = lab.start(vec![snat_chain(0)]);
    let iperf = Iperf::start(
        tb,
        &IperfSpec {
            unpaced_streams: 1,
            ..IperfSpec::new(3)
        },
    )
    .unwrap();
    let r = iperf
        .wait(tb)
        .unwrap_or_else(|e| panic!("iperf3: {e}; pp: {}", p.pp_stats()));
    let u = r.unpaced.expect("the unpaced run's report");
    assert!(u.error.is_none(), "{u:?}");
    // The paced run's server reports text, so it has no receiver's view.
    assert!(r.receiver_timeline.is_empty(), "{:?}", r.receiver_timeline);
    // 3 s in intervals of about 100 ms on both sides, in order. A starved iperf3 (the
    // other testbed tests run beside this one) reports late: CI read 27 intervals with
    // one of 300 ms, and a server that drained until 3.2 s in 33. So the count is
    // bounded by the span, and the span by the run plus its drain.
    for tl in [&u.timeline, &u.receiver_timeline] {
        let end = tl.last().map_or(0.0, |l| l.0);
        assert!((2.9..4.0).contains(&end), "{tl:?}");
        assert!(
            tl.len() >= 15 && tl.len() as f64 <= end / 0.1 + 2.0,
            "{tl:?}"
        );
        assert!(tl.windows(2).all(|w| w[1].0 > w[0].0), "{tl:?}");
    }
    // Megabits in all, so a short or stretched interval weighs what it lasted.
    let total = |tl: &[(f64, f64)]| {
        let (mut prev, mut mbit) = (0.0, 0.0);
        for &(end, mbps) in tl {
            mbit += mbps * (end - prev);
            prev = end;
        }
        mbit
    };
    let (sent, got) = (total(&u.timeline), total(&u.receiver_timeline));
    println!("unpaced iperf3: sender {sent:.0} Mbit, receiver {got:.0} Mbit");
    // What arrived is what was sent, give or take what was in flight at the ends.
    assert!(got > 0.0 && (got / sent - 1.0).abs() < 0.1, "{sent} {got}");
    let f = elastic::dip_floor(&u.receiver_timeline, 0.0, 1000.0, 1000.0, 2900.0)
        .expect("a window fits in 3 s");
    // Ordered statistics of the windows; not a floor on their values: with the other
    // testbed tests running beside this one, a starved flow's intervals may carry
    // nothing (CI once read a median of 0 at 453 Mbit/s), and speed is the bench's job.
    assert!(
        f.windows >= 9
            && 0.0 <= f.min
            && f.min <= f.p10
            && f.p10 <= f.median
            && f.median.is_finite()
            && f.interval_cv.is_finite()
            && f.interval_cv >= 0.0,
        "{f:?}"
    );
}

/// Requests per backend name, from nginx bodies.
fn shares(bodies: &[String]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for b in bodies {
        *m.entry(peer(b).0).or_insert(0) += 1;
    }
    m
}

#[test]
fn lb_spreads_new_connections_over_nginx_backends_and_keeps_a_connection_on_one() {
    const K: usize = 3;
    let Some(lab) = Lab::new(1, K) else { return };
    let tb = lab.tb();
    let backends: Vec<Nginx> = services::start_backends(tb).unwrap();
    let chain = chains::chain(1, 1, 0, Toward::Services, &[chains::lb(K)]).unwrap();
    let p = lab.start(vec![chain]);
    let url = format!("http://{}/", addr::VIP);

    // New connections: wrk with `Connection: close`, each request a new flow for the LB.
    let r = measure::wrk(tb, Node::Client(0), &url, 2, 8, true).unwrap();
    let n: usize = backends.iter().map(|b| b.access_log().len()).sum();
    println!("wrk: {r:?}; access log lines {n}; {}", p.pp_stats());
    assert!(n >= 150, "too few requests to judge the spread: {n}");
    assert!(r.non_2xx == 0, "{r:?}");
    // Each backend's share is Binomial(n, 1/K) for a uniform hash; allow 6 standard
    // deviations either side (a false failure about once in 10^8 runs).
    let (mean, sd) = (
        n as f64 / K as f64,
        (n as f64 * (1.0 / K as f64) * (1.0 - 1.0 / K as f64)).sqrt(),
    );
    for b in &backends {
        let c = b.access_log().len() as f64;
        assert!(
            (c - mean).abs() <= 6.0 * sd,
            "{}: {c} of {n} requests (expected {mean:.0} ± {:.0})",
            b.name,
            6.0 * sd
        );
        // The LB rewrites the destination only: backends see the client itself.
        assert!(
            b.access_log()
                .iter()
                .all(|l| l.starts_with(&format!("{} ", addr::CLIENT))),
            "{}",
            b.name
        );
    }

    // One keep-alive connection: curl fetches 20 URLs over one connection, so every
    // answer must come from the same backend, to the same client port.
    let urls: Vec<String> = (0..20)
        .map(|i| format!("http://{}/?i={i}", addr::VIP))
        .collect();
    let mut argv = vec!["curl", "-sS", "--max-time", "10"];
    argv.extend(urls.iter().map(String::as_str));
    let out = tb
        .exec(Node::Client(0), &argv, Duration::from_secs(15))
        .unwrap();
    let bodies: Vec<String> = out.lines().map(str::to_string).collect();
    assert_eq!(bodies.len(), 20, "{out}");
    let first = peer(&bodies[0]);
    for b in &bodies {
        assert_eq!(peer(b), first, "a keep-alive connection moved: {bodies:?}");
    }
    // And a curl loop of new connections reaches more than one backend.
    let loop_bodies: Vec<String> = (0..12).map(|_| curl(tb, 0, &url)).collect();
    assert!(shares(&loop_bodies).len() > 1, "{loop_bodies:?}");
}

/// Count TCP packets to `port` arriving at the internet host (nft counter).
fn count_port(tb: &Testbed, port: u16) {
    testbed::cmd::nft(
        &tb.ns(Node::Inet),
        &format!(
            "table inet sfcount {{\n counter p{port} {{ }}\n chain input {{ type filter hook input priority -10; policy accept; tcp dport {port} counter name \"p{port}\"; }}\n}}\n"
        ),
    )
    .unwrap();
}

fn counted(tb: &Testbed, port: u16) -> u64 {
    let out = tb
        .exec(
            Node::Inet,
            &[
                "nft",
                "-j",
                "list",
                "counter",
                "inet",
                "sfcount",
                &format!("p{port}"),
            ],
            Duration::from_secs(5),
        )
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["nftables"]
        .as_array()
        .and_then(|a| a.iter().find_map(|o| o["counter"]["packets"].as_u64()))
        .unwrap()
}

/// `nc -z` from VPC 0's client to the internet host's `port`: did it connect?
fn nc_connects(tb: &Testbed, port: u16) -> bool {
    tb.exec_full(
        Node::Client(0),
        &[
            "nc",
            "-z",
            "-w",
            "2",
            &addr::INET.to_string(),
            &port.to_string(),
        ],
        Duration::from_secs(10),
    )
    .unwrap()
    .ok()
}

/// An nc listener on the internet host's `port` (it accepts, so an allowed connect
/// succeeds).
fn nc_listen(tb: &Testbed, port: u16) {
    let p = tb
        .spawn(
            Node::Inet,
            &format!("nc listen {port}"),
            &["nc", "-l", "-k", &addr::INET.to_string(), &port.to_string()],
        )
        .unwrap();
    testbed::cmd::wait_for("nc listening", Duration::from_secs(5), || {
        let ss = tb.exec(Node::Inet, &["ss", "-Hltn"], Duration::from_secs(5))?;
        Ok(ss.contains(&format!(":{port} ")).then_some(()))
    })
    .unwrap_or_else(|e| panic!("{e}: {:?}", std::fs::read_to_string(&p.log)));
}

/// FW rules of the firewall tests: TCP 80 and 8081 allowed, TCP 8080 denied, the rest
/// denied by default.
fn fw_rules(tenant: u32) -> nfs::NfConfig {
    chains::fw(
        tenant,
        vec![
            chains::acl(AclAction::Allow, AclProto::Tcp, 80),
            chains::acl(AclAction::Deny, AclProto::Tcp, 8080),
            chains::acl(AclAction::Allow, AclProto::Tcp, 8081),
        ],
        AclAction::Deny,
    )
}

#[test]
fn firewall_allows_and_denies_and_replies_of_allowed_flows_come_back() {
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    services::start_inet(tb, false).unwrap();
    for port in [8080, 8081, 8082] {
        nc_listen(tb, port);
        count_port(tb, port);
    }
    let chain = chains::chain(1, 1, 0, Toward::Internet, &[fw_rules(1)]).unwrap();
    let p = lab.start(vec![chain]);

    // Allowed: the request arrives, and the reply comes back through the reverse rule.
    // Without NAT the server sees the client's own address.
    let (name, src, _) = peer(&curl(tb, 0, &format!("http://{}/", addr::INET)));
    assert_eq!((name.as_str(), src), ("inet", addr::CLIENT));
    assert!(nc_connects(tb, 8081), "allowed TCP 8081 did not connect");
    assert!(counted(tb, 8081) >= 1);
    // Denied by a rule and by the default: not a single packet reaches the server.
    assert!(!nc_connects(tb, 8080), "denied TCP 8080 connected");
    assert!(!nc_connects(tb, 8082), "TCP 8082 (default deny) connected");
    assert_eq!(counted(tb, 8080), 0, "a denied SYN reached the server");
    assert_eq!(counted(tb, 8082), 0, "a denied SYN reached the server");
    let stats = p.pp_stats_when(|s| s.contains("rule:acl-deny="));
    assert!(stats.contains("rule:acl-deny="), "{stats}");
}

#[test]
fn fw_then_snat_chain() {
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    let inet = services::start_inet(tb, false).unwrap();
    nc_listen(tb, 8080);
    count_port(tb, 8080);
    let chain = chains::chain(1, 1, 0, Toward::Internet, &[fw_rules(1), chains::snat(0)]).unwrap();
    let p = lab.start(vec![chain]);

    // Allowed by the firewall, then translated: the server sees the pool address.
    let (name, src, _) = peer(&curl(tb, 0, &format!("http://{}/", addr::INET)));
    assert_eq!((name.as_str(), src), ("inet", addr::pool(0)));
    assert!(inet.nginx.access_log()[0].starts_with(&format!("{} ", addr::pool(0))));
    // Denied before SNAT ever sees it.
    assert!(!nc_connects(tb, 8080));
    assert_eq!(counted(tb, 8080), 0);
    let stats = p.pp_stats_when(|s| s.contains("rule:acl-deny="));
    assert!(stats.contains("rule:acl-deny="), "{stats}");
    assert!(!stats.contains("snat-"), "SNAT refused something: {stats}");
}

#[test]
fn two_tenants_with_overlapping_addresses_are_kept_apart_by_vni() {
    let Some(lab) = Lab::new(2, 0) else { return };
    let tb = lab.tb();
    let inet = services::start_inet(tb, false).unwrap();
    let _p = lab.start(vec![snat_chain(0), snat_chain(1)]);
    let url = format!("http://{}/", addr::INET);
    // Both clients are 198.19.1.2 and use the very same source port: the inner 5-tuples
    // are identical, only the VNI differs.
    for round in 0..3 {
        let port = (40000 + round).to_string();
        let run = |j: usize| {
            let tb = lab.tb();
            let url = url.clone();
            let port = port.clone();
            move || {
                tb.exec_full(
                    Node::Client(j),
                    &[
                        "curl",
                        "-sS",
                        "--max-time",
                        "5",
                        "--local-port",
                        &port,
                        &url,
                    ],
                    Duration::from_secs(10),
                )
                .unwrap()
            }
        };
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(run(0));
            let b = s.spawn(run(1));
            (a.join().unwrap(), b.join().unwrap())
        });
        assert!(a.ok() && b.ok(), "{a:?} {b:?}");
        let (pa, pb) = (peer(&a.stdout), peer(&b.stdout));
        assert_eq!(pa.1, addr::pool(0), "tenant 1 leaves from its own pool");
        assert_eq!(pb.1, addr::pool(1), "tenant 2 leaves from its own pool");
    }
    let log = inet.nginx.access_log();
    assert_eq!(log.len(), 6, "{log:?}");
    for pool in [addr::pool(0), addr::pool(1)] {
        assert_eq!(
            log.iter()
                .filter(|l| l.starts_with(&format!("{pool} ")))
                .count(),
            3,
            "{log:?}"
        );
    }
}

#[test]
fn stun_classifies_the_snat_mapping_as_endpoint_independent() {
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    services::start_inet(tb, true).unwrap();
    let p = lab.start(vec![snat_chain(0)]);
    // The client exits with a bit mask of what it found, so its status is not 0 on
    // success; judge by what it prints.
    let out = tb
        .exec_full(
            Node::Client(0),
            &["stun", &addr::INET.to_string(), "-v"],
            Duration::from_secs(30),
        )
        .unwrap();
    let text = format!("{}{}", out.stdout, out.stderr);
    let primary = text
        .lines()
        .find(|l| l.starts_with("Primary:"))
        .unwrap_or_else(|| panic!("no classification: {text}; pp: {}", p.pp_stats()));
    println!("stun: {primary}");
    assert!(
        text.contains("is nat  = 1"),
        "the client must see a NAT: {text}"
    );
    assert!(
        text.contains("mapped IP same = 1"),
        "the same mapping toward both server addresses: {text}"
    );
    assert!(
        primary.contains("Independent Mapping"),
        "not endpoint-independent: {primary}"
    );
}

#[test]
fn a_panic_mid_test_leaves_no_namespace_and_no_process() {
    if !testbed::is_root() {
        if std::env::var_os("CI").is_some() {
            panic!("the e2e tests need root (network namespaces); CI runs as root");
        }
        println!("SKIP: needs root");
        return;
    }
    let prefix = format!(
        "{ROOT}{}-{}-",
        std::process::id(),
        RUN.fetch_add(1, Ordering::Relaxed)
    );
    let (tx, rx) = std::sync::mpsc::channel();
    let p = prefix.clone();
    // A thread that builds a testbed, starts servers in it, and panics while they run.
    let outcome = std::thread::spawn(move || {
        let res = Resources::new(&p);
        let tb = Testbed::build(TopologySpec::new(&p).backends(1), res).unwrap();
        let inet = services::start_inet(&tb, false).unwrap();
        let backends = services::start_backends(&tb).unwrap();
        tx.send((inet.nginx.proc.pid, backends[0].proc.pid, tb.nodes().len()))
            .unwrap();
        panic!("deliberate panic with the testbed up");
    })
    .join();
    assert!(outcome.is_err(), "the thread was meant to panic");
    let (nginx, backend, nodes) = rx.recv().unwrap();
    assert!(nodes >= 8);
    // Unwinding dropped the guard: no namespace, no process is left.
    assert_eq!(namespaces_with_prefix(&prefix), Vec::<String>::new());
    for pid in [nginx, backend] {
        assert_eq!(
            testbed::cleanup::start_time(pid),
            None,
            "process {pid} survived the panic"
        );
    }
}

/// `make demo` end to end, shortened: the testbed, `starfabric up` with the PP node in
/// its namespace, two tenants made through the CLI, traffic with live stats, teardown.
/// The demo itself fails when SNAT, the firewall or the load balancer misbehave.
#[test]
fn demo_runs_its_tenants_through_the_cli_and_leaves_nothing_behind() {
    if !testbed::is_root() {
        assert!(std::env::var_os("CI").is_none(), "CI runs as root");
        println!("SKIP: the demo needs root");
        return;
    }
    let out = std::process::Command::new(BIN)
        .args(["demo", "--secs", "3"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run the demo");
    let text = String::from_utf8_lossy(&out.stdout);
    println!("{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the demo failed");
    for needle in [
        "chain acme/main is served",
        "chain globex/main is served",
        "the server saw us as `inet 198.18.201.1:",
        "denied by acme's firewall",
        "answered by `backend-",
        "every namespace, veth, VXLAN device and process of the demo is gone",
    ] {
        assert!(text.contains(needle), "demo output lacks {needle:?}");
    }
    assert!(namespaces_with_prefix("sfdemo-").is_empty());
}

/// A UDP server on the internet host: answers every datagram with the `addr:port` it
/// came from. Bounded: it exits after 120 s.
const UDP_PEER_SERVER: &str = r#"
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
s.settimeout(0.5)
end = time.time() + 120
while time.time() < end:
    try:
        d, a = s.recvfrom(2048)
    except socket.timeout:
        continue
    s.sendto(("%s:%d" % a).encode(), a)
"#;

/// A UDP client with a fixed source port: prints the server's answer (at most 5 tries).
const UDP_PEER_CLIENT: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[3])))
s.settimeout(1.0)
for _ in range(5):
    s.sendto(b"hi", (sys.argv[1], int(sys.argv[2])))
    try:
        d, _ = s.recvfrom(2048)
        print(d.decode())
        sys.exit(0)
    except socket.timeout:
        pass
sys.exit("no answer")
"#;

/// What the internet host saw as the source of a datagram from VPC 0's client port
/// `sport` to its port `dport`.
fn udp_seen_as(tb: &Testbed, sport: u16, dport: u16) -> (Ipv4Addr, u16) {
    let out = tb
        .exec_full(
            Node::Client(0),
            &[
                "python3",
                "-c",
                UDP_PEER_CLIENT,
                &addr::INET.to_string(),
                &dport.to_string(),
                &sport.to_string(),
            ],
            Duration::from_secs(15),
        )
        .expect("run the UDP client");
    assert!(
        out.ok(),
        "UDP {sport} → {dport}: {}: {}",
        out.status,
        out.stderr
    );
    let (a, p) = out
        .stdout
        .trim()
        .split_once(':')
        .unwrap_or_else(|| panic!("unexpected answer {:?}", out.stdout));
    (a.parse().unwrap(), p.parse().unwrap())
}

/// The sum over SC nodes of metric `name` (no labels).
fn sc_metric(tb: &Testbed, p: &Platform, nodes: usize, name: &str) -> Vec<f64> {
    (0..nodes)
        .map(|i| {
            let body = tb
                .exec(
                    Node::Ctl,
                    &[
                        "curl",
                        "-sS",
                        "--max-time",
                        "2",
                        &format!("http://{}/metrics", p.sc_metrics(i)),
                    ],
                    Duration::from_secs(5),
                )
                .unwrap_or_default();
            body.lines()
                .find_map(|l| {
                    l.strip_prefix(name)
                        .and_then(|r| r.strip_prefix(' '))
                        .and_then(|v| v.trim().parse().ok())
                })
                .unwrap_or(f64::NAN)
        })
        .collect()
}

/// A TCP server on the internet host: answers every read on a connection with the
/// `addr:port` the connection came from. Bounded: it exits after 120 s.
const TCP_PEER_SERVER: &str = r#"
import socket, sys, threading, time
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(8)
s.settimeout(0.5)
end = time.time() + 120
def serve(c, a):
    c.settimeout(60)
    try:
        while c.recv(2048):
            c.sendall(("%s:%d" % a).encode())
    except OSError:
        pass
    c.close()
while time.time() < end:
    try:
        c, a = s.accept()
    except socket.timeout:
        continue
    threading.Thread(target=serve, args=(c, a), daemon=True).start()
"#;

/// A TCP client with a fixed source port that holds one connection: it prints the
/// server's answer to a first message (`first ADDR:PORT`), waits until the file argv[4]
/// exists (at most 60 s), then sends a second message on the same connection and prints
/// that answer (`second ADDR:PORT`), or `second: no answer` after 5 s.
const TCP_HOLD_CLIENT: &str = r#"
import os, socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.bind(("0.0.0.0", int(sys.argv[3])))
s.settimeout(5.0)
s.connect((sys.argv[1], int(sys.argv[2])))
s.sendall(b"one")
print("first", s.recv(2048).decode(), flush=True)
end = time.time() + 60
while not os.path.exists(sys.argv[4]):
    if time.time() > end:
        sys.exit("never told to go on")
    time.sleep(0.05)
s.sendall(b"two")
try:
    print("second", s.recv(2048).decode(), flush=True)
except socket.timeout:
    print("second: no answer", flush=True)
    sys.exit(1)
"#;

/// The PP node's HTTP endpoint (metrics and `/trace`), on its namespace's loopback.
const PP_HTTP: &str = "127.0.0.1:9464";

/// `curl` in the PP namespace against its HTTP endpoint: the body (`-X METHOD`, `-d`
/// body when given).
fn pp_http(tb: &Testbed, method: &str, path: &str, body: Option<&str>) -> String {
    let url = format!("http://{PP_HTTP}{path}");
    let mut argv = vec!["curl", "-sS", "--max-time", "8", "-X", method, &url];
    if let Some(b) = body {
        argv.extend(["-H", "content-type: application/json", "-d", b]);
    }
    tb.exec(Node::Pp, &argv, Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// Take the PP node's trace records into `taken` until `done` holds for all taken so
/// far (at most 15 s).
fn trace_until(
    tb: &Testbed,
    what: &str,
    taken: &mut Vec<serde_json::Value>,
    done: impl Fn(&[serde_json::Value]) -> bool,
) {
    testbed::cmd::wait_for(what, Duration::from_secs(15), || {
        let page: serde_json::Value =
            serde_json::from_str(&pp_http(tb, "GET", "/trace?wait_ms=500", None))
                .map_err(|e| testbed::Error::Setup(format!("trace reply: {e}")))?;
        if let Some(r) = page["records"].as_array() {
            taken.extend(r.iter().cloned());
        }
        Ok(done(taken).then_some(()))
    })
    .unwrap_or_else(|e| panic!("{e}: {taken:#?}"));
}

/// The first trace record of `kind` whose flow is `flow` and that `more` accepts.
fn record<'a>(
    records: &'a [serde_json::Value],
    kind: &str,
    flow: &str,
    more: impl Fn(&serde_json::Value) -> bool,
) -> Option<&'a serde_json::Value> {
    records
        .iter()
        .find(|r| r["kind"] == kind && r["flow"] == flow && more(r))
}

/// Serpens §III-B on real processes: SC nodes run with `--idle-ms`, so an idle FW → SNAT
/// chain parks every replica (no busy worker on any node: zero instances) with its
/// tables in the node's state manager. Two pieces of state must survive that:
///
/// - The FW's conntrack entry. A TCP connection opened before the chain went to zero
///   sends its next segment (ACK, no SYN) after PP and FM have lost its rules; the
///   segment misses at PP, FM has no cached rule, and the woken chain decides it. The
///   FW passes it only because conntrack knows the connection: the control, an ACK of a
///   connection that was never opened, is dropped by the FW as `tcp-not-syn`.
/// - SNAT's mapping. The next new flow from a client socket that had a flow before the
///   chain went to zero wakes the chain and gets the same external address and port (an
///   endpoint-independent mapping).
///
/// (Conntrack entries expiring while parked: `cargo test -p itests --test cross_plane sc_workers::`.)
#[test]
fn an_idle_chain_scales_to_zero_and_wakes_with_its_snat_mapping_and_conntrack() {
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    services::start_inet(tb, false).unwrap();
    for port in [9998u16, 9999] {
        tb.spawn(
            Node::Inet,
            &format!("udp peer {port}"),
            &[
                "python3",
                "-c",
                UDP_PEER_SERVER,
                &addr::INET.to_string(),
                &port.to_string(),
            ],
        )
        .unwrap();
    }
    tb.spawn(
        Node::Inet,
        "tcp peer 9997",
        &[
            "python3",
            "-c",
            TCP_PEER_SERVER,
            &addr::INET.to_string(),
            "9997",
        ],
    )
    .unwrap();
    let fw = chains::fw(
        1,
        vec![
            chains::acl(AclAction::Allow, AclProto::Udp, 9998),
            chains::acl(AclAction::Allow, AclProto::Udp, 9999),
            chains::acl(AclAction::Allow, AclProto::Tcp, 9997),
        ],
        AclAction::Deny,
    );
    let chain = chains::chain(1, 1, 0, Toward::Internet, &[fw, chains::snat(0)]).unwrap();
    let mut spec = PlatformSpec::new(vec![chain], vec![(testbed::topo::vni::tenant(0), 1, 1)]);
    spec.sc_args = ["--idle-ms", "300", "--workers", "2"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    spec.sc_metrics = true;
    // Small rule tables, so the TCP connection's rules leave PP (a 4-flow table evicts
    // them once other flows arrive) and FM (a one-rule cache) the way a full table loses
    // them under load. Its next segment then has to be decided by SC again.
    spec.flows = 4;
    spec.fm_cache_capacity = Some(1);
    spec.pp_args = ["--metrics", PP_HTTP]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let nodes = spec.sc_nodes;
    let p = lab.start_spec(&spec);

    // The servers listen before the first packet.
    testbed::cmd::wait_for(
        "UDP and TCP peers listening",
        Duration::from_secs(5),
        || {
            let ss = tb.exec(Node::Inet, &["ss", "-Hlutn"], Duration::from_secs(5))?;
            Ok(
                (ss.contains(":9998 ") && ss.contains(":9999 ") && ss.contains(":9997 "))
                    .then_some(()),
            )
        },
    )
    .unwrap();
    // Each node's workers run with the CLI's default scheduler slice, unless the
    // kernel refused it and the node counted that (docs/workers.md).
    let slices = sc_metric(
        tb,
        &p,
        nodes,
        "starfabric_sc_worker_slice_seconds{worker=\"0\"}",
    );
    let refused = sc_metric(tb, &p, nodes, "starfabric_sc_worker_os_errors_total");
    for (s, r) in slices.iter().zip(&refused) {
        assert!(
            (s - 0.0002).abs() < 1e-9 || (*s == 0.0 && *r >= 1.0),
            "worker slice {s} s with {r} refusals"
        );
    }
    let at_zero = || {
        testbed::cmd::wait_for("every SC replica parked", Duration::from_secs(15), || {
            let parked = sc_metric(tb, &p, nodes, "starfabric_sc_replicas_parked");
            let busy = sc_metric(tb, &p, nodes, "starfabric_sc_workers_busy");
            Ok((parked.iter().all(|&v| v >= 1.0) && busy.iter().all(|&v| v == 0.0)).then_some(()))
        })
        .unwrap();
    };
    let wakes = || -> f64 {
        sc_metric(tb, &p, nodes, "starfabric_sc_replica_wakes_total")
            .iter()
            .sum()
    };

    // A TCP connection, opened through FW (conntrack entry) and SNAT, then held open.
    let go = tb.path("tcp-go");
    let go_s = go.display().to_string();
    let client = tb
        .spawn(
            Node::Client(0),
            "tcp hold client",
            &[
                "python3",
                "-c",
                TCP_HOLD_CLIENT,
                &addr::INET.to_string(),
                "9997",
                "40100",
                &go_s,
            ],
        )
        .unwrap();
    let first_tcp = tb
        .wait_log(&client, "first ", Duration::from_secs(15))
        .unwrap_or_else(|e| panic!("{e}; pp: {}", p.pp_stats()));
    let first_tcp = first_tcp.trim_start_matches("first ").trim().to_string();
    assert!(
        first_tcp.starts_with(&format!("{}:", addr::pool(0))),
        "the TCP connection is not translated: {first_tcp}"
    );

    // UDP flows: the first is the mapping checked later; all of them push the TCP
    // connection's two rules out of PP's 4-flow table and FM's one-rule cache.
    let first = udp_seen_as(tb, 40000, 9999);
    assert_eq!(first.0, addr::pool(0), "not translated: {first:?}");
    for sport in 40010..40014 {
        udp_seen_as(tb, sport, 9999);
    }

    // The held connection's next segment. A trace on the PP node shows how it went.
    let armed = pp_http(
        tb,
        "POST",
        "/trace",
        Some(r#"{"tenant": 1, "match": "tcp and port 9997", "count": 64}"#),
    );
    assert!(armed.contains("\"id\""), "trace not armed: {armed}");

    // Zero instances: every node has parked replicas and no busy worker, and no wake
    // came between two such readings. A late flow event from PP (its activity and
    // counter reports) can wake a replica just after a first reading; the segment
    // would then meet an awake replica and wake none.
    let wakes_before = loop {
        at_zero();
        let w = wakes();
        at_zero();
        if wakes() == w {
            break w;
        }
    };
    std::fs::write(&go, b"go").unwrap();
    let second_tcp = tb
        .wait_log(&client, "second", Duration::from_secs(15))
        .unwrap_or_else(|e| panic!("{e}; pp: {}", p.pp_stats()));
    assert_eq!(
        second_tcp.trim_start_matches("second ").trim(),
        first_tcp,
        "the held TCP connection did not survive zero instances: {second_tcp}; pp: {}",
        p.pp_stats()
    );
    // PP's flow events (the client's FIN, activity) wake a parked replica too, so this
    // alone does not show the segment reached SC; the trace below does.
    let wakes_tcp = wakes();
    assert!(
        wakes_tcp > wakes_before,
        "no replica woke for the held connection ({wakes_before} → {wakes_tcp})"
    );
    // The segment was a miss at PP, without SYN, and the woken chain decided to pass it
    // (FM's cache, which would say "FM rule cache", had nothing).
    let held = format!(
        "{} tcp {}:40100 > {}:9997",
        testbed::topo::vni::tenant(0),
        addr::CLIENT,
        addr::INET
    );
    let miss = |r: &serde_json::Value| {
        let flags = r["tcp_flags"].as_u64().unwrap_or(0);
        r["lookup"] == "miss" && flags & 0x02 == 0 && flags & 0x10 != 0
    };
    let mut records = Vec::new();
    trace_until(
        tb,
        "the held connection's miss and decision",
        &mut records,
        |rs| {
            record(rs, "packet", &held, miss).is_some_and(|m| {
                record(rs, "decision", &held, |d| d["for_seq"] == m["seq"]).is_some()
            })
        },
    );
    let m = record(&records, "packet", &held, miss).unwrap();
    let d = record(&records, "decision", &held, |d| d["for_seq"] == m["seq"]).unwrap();
    assert_eq!(m["request_sent"], true, "{m:#}");
    assert_eq!(d["ok"], true, "{d:#}");
    assert!(
        d["decided_by"]
            .as_str()
            .is_some_and(|s| s.starts_with("SC group ")),
        "not decided by SC: {d:#}"
    );
    let rule = d["rule"].as_str().unwrap_or_default();
    assert!(
        rule.contains(&format!("set-src {}", addr::pool(0))) && !rule.contains("drop"),
        "not passed through SNAT: {d:#}"
    );

    // The control: an ACK of a connection that was never opened, from the same client
    // to the same server port. Without a conntrack entry the FW drops it.
    let stray = tb
        .exec_full(
            Node::Client(0),
            &[
                "hping3",
                "-c",
                "1",
                "-A",
                "-k",
                "-s",
                "40101",
                "-p",
                "9997",
                &addr::INET.to_string(),
            ],
            Duration::from_secs(10),
        )
        .expect("run hping3");
    assert!(
        stray.stdout.contains("HPING") || stray.stderr.contains("HPING"),
        "hping3 did not run: {stray:?}"
    );
    let stray_flow = format!(
        "{} tcp {}:40101 > {}:9997",
        testbed::topo::vni::tenant(0),
        addr::CLIENT,
        addr::INET
    );
    trace_until(tb, "the stray ACK's decision", &mut records, |rs| {
        record(rs, "decision", &stray_flow, |_| true).is_some()
    });
    let d = record(&records, "decision", &stray_flow, |_| true).unwrap();
    assert_eq!(
        d["rule"].as_str().map(|r| r.contains("drop tcp-not-syn")),
        Some(true),
        "the FW let an unknown connection's ACK through: {d:#}"
    );
    let stats = p.pp_stats_when(|s| platform::field(s, "rule:tcp-not-syn").unwrap_or(0) >= 1);
    assert!(
        platform::field(&stats, "rule:tcp-not-syn").unwrap_or(0) >= 1,
        "{stats}"
    );

    // Back to zero, then a new UDP flow (another destination port, so the PP node and
    // FM have no rule for it) from the first UDP socket: the chain wakes, and SNAT's
    // mapping is the same.
    at_zero();
    let wakes_zero = wakes();
    let second = udp_seen_as(tb, 40000, 9998);
    assert_eq!(
        second, first,
        "the SNAT mapping did not survive zero instances"
    );
    let wakes_after = wakes();
    assert!(
        wakes_after > wakes_zero,
        "no replica woke for the new flow ({wakes_zero} → {wakes_after})"
    );
    // Another client socket gets another mapping: the kept one is that socket's.
    let other = udp_seen_as(tb, 40001, 9998);
    assert_ne!(other.1, first.1, "two sockets share one external port");
}

/// A measurement, not run by default (`--ignored`): 64-byte UDP (trafgen, 64 flows)
/// and TCP (iperf3) end to end through SNAT on AF_XDP, one worker on a 1-queue veth
/// against two on a 2-queue veth. On a 2-core machine the sender, the kernel's veth
/// path and the workers share the cores, so the figure bounds nothing about more cores.
#[test]
#[ignore]
fn udp64_and_tcp_through_one_and_two_workers() {
    for workers in [1usize, 2] {
        let Some(lab) = Lab::queues(1, 0, workers) else {
            return;
        };
        let tb = lab.tb();
        services::start_inet(tb, false).unwrap();
        let w = workers.to_string();
        let p = lab.start_with(vec![snat_chain(0)], &["--workers", &w, "--io", "afxdp"]);
        let udp = measure::udp64_pps(tb, 0, 64, Duration::from_secs(1), 3.0)
            .unwrap_or_else(|e| panic!("udp64: {e}; pp: {}", p.pp_stats()));
        let tcp = measure::tcp_gbps(tb, Node::Client(0), addr::INET, 3)
            .unwrap_or_else(|e| panic!("iperf3: {e}; pp: {}", p.pp_stats()));
        let stats = p.pp_stats();
        println!(
            "workers={workers}: udp64 {:.0} pps arrived of {:.0} offered; tcp {tcp:.2} Gbit/s; {stats}",
            udp.pps, udp.offered_pps
        );
        assert!(udp.pps > 1000.0 && tcp > 0.0, "{udp:?} {tcp}");
        if workers > 1 {
            assert!(rx_per_worker(&stats).iter().all(|n| *n > 0), "{stats}");
        }
    }
}
