//! `starfabric trace` on the netns testbed: a bad match expression is refused before
//! anything is armed; a trace armed through the CLI on the PP node's HTTP endpoint sees
//! curl's connection to the internet host's nginx through SNAT (a miss, FM's decision,
//! then hits), and tshark reads its pcapng file: VXLAN outer frames and the inner TCP.
//!
//! Needs root and scripts/setup.sh's tools (tshark too); skips without root outside CI.

use std::process::Command;
use std::time::{Duration, Instant};

use testbed::cmd;
use testbed::services;
use testbed::topo::{addr, vni, Node};

mod common;
use common::{snat_chain, Lab, BIN};

/// The PP node's HTTP endpoint, on its namespace's loopback.
const PP_HTTP: &str = "127.0.0.1:9464";

#[test]
fn trace_shows_miss_decision_and_hits_and_writes_pcapng_tshark_reads() {
    let Some(lab) = Lab::new(1, 0) else { return };
    let tb = lab.tb();
    let t0 = Instant::now();
    services::start_inet(tb, false).unwrap();
    let p = lab.start_with(vec![snat_chain(0)], &["--metrics", PP_HTTP]);

    // A filter that does not parse: a clear error, a non-zero exit, nothing armed.
    let bad = tb
        .exec_full(
            Node::Pp,
            &[
                BIN,
                "trace",
                "--tenant",
                "1",
                "--match",
                "tcp and prot 80",
                "--node",
                PP_HTTP,
            ],
            Duration::from_secs(10),
        )
        .unwrap();
    assert!(!bad.ok(), "a bad filter must fail: {}", bad.stdout);
    assert!(
        bad.stderr
            .contains("bad match expression at column 9: unknown primitive `prot`"),
        "{}",
        bad.stderr
    );
    let armed = tb
        .exec_full(
            Node::Pp,
            &[
                "curl",
                "-sS",
                "--max-time",
                "5",
                &format!("http://{PP_HTTP}/trace"),
            ],
            Duration::from_secs(10),
        )
        .unwrap();
    assert!(armed.stdout.contains("no trace armed"), "{}", armed.stdout);

    // Arm through the CLI: tenant 1's TCP port 80, eight packets, into a pcapng file.
    let pcap = tb.path("trace.pcapng");
    let pcap_s = pcap.display().to_string();
    let cli = tb
        .spawn(
            Node::Pp,
            "starfabric trace",
            &[
                BIN,
                "trace",
                "--tenant",
                "1",
                "--match",
                "tcp and port 80",
                "--count",
                "8",
                "--pcap",
                &pcap_s,
                "--node",
                PP_HTTP,
                "--timeout",
                "15",
            ],
        )
        .unwrap();
    tb.wait_log(&cli, "tracing 8 packets", Duration::from_secs(10))
        .unwrap();
    // Real traffic: two short HTTP connections through SNAT to nginx.
    let url = format!("http://{}/", addr::INET);
    for _ in 0..2 {
        let out = tb
            .exec_full(
                Node::Client(0),
                &["curl", "-sS", "--max-time", "5", &url],
                Duration::from_secs(10),
            )
            .unwrap();
        assert!(out.ok(), "curl: {} {}", out.stdout, out.stderr);
    }
    cmd::wait_for(
        "starfabric trace to finish",
        Duration::from_secs(15),
        || Ok((!tb.res.child_running(cli.pid)).then_some(())),
    )
    .unwrap_or_else(|e| panic!("{e}; pp: {}", p.pp_stats()));
    let text = std::fs::read_to_string(&cli.log).unwrap();
    println!("{text}");
    assert!(
        text.contains("wrote "),
        "the CLI did not finish cleanly:\n{text}"
    );

    // A miss that asked FM, FM's decision (SNAT's rule), then hits.
    let miss = text
        .find("lookup:   miss  rule request sent to FM")
        .unwrap_or_else(|| panic!("no miss:\n{text}"));
    let decision = text
        .find("FM decision")
        .unwrap_or_else(|| panic!("no FM decision:\n{text}"));
    let hit = text
        .find("lookup:   hit  flow entry")
        .unwrap_or_else(|| panic!("no hit:\n{text}"));
    assert!(miss < decision && decision < hit, "{text}");
    assert!(text.contains("verdict:  held until FM answers"), "{text}");
    // FM names who decided: the SC group holding the flow's partition.
    assert!(text.contains("  by:       SC group "), "{text}");
    assert!(
        text.contains(&format!("set-src {}", addr::pool(0))),
        "{text}"
    );
    assert!(text.contains("[SYN]"), "{text}");
    assert!(text.contains("verdict:  tx "), "{text}");
    let packets = text
        .lines()
        .filter(|l| l.starts_with("Packet ") && !l.contains("FM decision"))
        .count();
    assert_eq!(packets, 8, "{text}");

    // tshark reads the file: VXLAN outer frames on the tenant's VNI carrying TCP to
    // port 80, and the inner frames' TCP on their own interface.
    let out = Command::new("tshark")
        .args(["-r", &pcap_s, "-T", "fields", "-E", "separator=|"])
        .args([
            "-e",
            "frame.interface_name",
            "-e",
            "vxlan.vni",
            "-e",
            "tcp.dstport",
        ])
        .output()
        .expect("run tshark (scripts/setup.sh installs it)");
    let fields = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "tshark: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{fields}");
    let tenant_vni = vni::tenant(0).to_string();
    let outer_vxlan_tcp = fields
        .lines()
        .filter(|l| l.starts_with(&format!("outer|{tenant_vni}|80")))
        .count();
    let inner_tcp = fields.lines().filter(|l| *l == "inner||80").count();
    assert!(
        outer_vxlan_tcp >= 1,
        "no VXLAN outer frame with TCP/80:\n{fields}"
    );
    assert!(inner_tcp >= 1, "no inner TCP/80 frame:\n{fields}");
    assert!(fields.lines().any(|l| l.starts_with("out|")), "{fields}");
    // Each packet block carries its stage summary as a comment.
    let v = Command::new("tshark")
        .args(["-r", &pcap_s, "-V", "-c", "3"])
        .output()
        .unwrap();
    let verbose = String::from_utf8_lossy(&v.stdout);
    assert!(
        verbose.contains(&format!(
            "pkt 1 tenant 1 vni {tenant_vni}: miss, rule request sent -> held"
        )),
        "{verbose}"
    );
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
}
