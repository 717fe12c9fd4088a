//! A real Linux VXLAN round trip through `starfabric pp`.
//!
//! Three network namespaces of this test's own (names carry the PID): `pp` runs
//! `starfabric pp` on 198.18.0.1:4789 behind a bridge; `a` (198.18.0.2) and `b`
//! (198.18.0.3) each have a Linux VXLAN device `vx100` (VNI 100, remote 198.18.0.1), with
//! tenant addresses 198.19.10.2 (a) and 198.19.10.9 (b). Two static rules make the PP
//! node a NAT in between, as a load balancer would be:
//!
//! ```text
//! a 198.19.10.2:40000 → VIP 198.19.10.100:7   PP: SNAT 198.19.10.50:50000, DNAT 198.19.10.9:7, encap to b
//! b 198.19.10.9:7 → 198.19.10.50:50000       PP: SNAT 198.19.10.100:7, DNAT 198.19.10.2:40000, encap to a
//! ```
//!
//! A UDP socket in `a` sends datagrams to the VIP, an echo socket in `b` answers, and `a`
//! must get every payload back from the VIP. Both directions cross the real kernel stack
//! at both ends: the VXLAN devices take the PP node's encapsulation, and UDP sockets
//! only receive datagrams whose IP and UDP checksums verify, so this checks the
//! pipeline's incremental checksum updates against Linux, and `UdpVxlanIo`'s
//! header synthesis and sendmmsg against a real VXLAN peer.
//!
//! Why two client namespaces rather than one that the PP node reflects to: Linux drops a
//! VXLAN frame whose inner source MAC is the receiving device's own MAC (the loop check
//! in `vxlan_set_mac`), and a reflected frame keeps the sender's inner source MAC; the
//! pipeline has no inner source MAC rewrite yet.
//!
//! `ethtool -K vx100 tx off` makes the kernel finish inner checksums before encap;
//! otherwise it hands CHECKSUM_PARTIAL packets to the device and the far end sees bad
//! checksums.
//!
//! Needs root, iproute2 and ethtool; skips with a message otherwise.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use testkit::child::{run_bounded, stdout_lines};
use testkit::netns::{in_ns, ip, is_root, ns_exec, veth, Netns};
use testkit::ChildGuard;

const A_MAC: &str = "02:0a:00:00:00:02";
const B_MAC: &str = "02:0b:00:00:00:09";
const CLIENT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(198, 19, 10, 2), 40000);
const VIP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(198, 19, 10, 100), 7);
const SNAT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(198, 19, 10, 50), 50000);
const SERVER: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(198, 19, 10, 9), 7);
const ROUNDS: usize = 40;

fn prerequisites() -> Result<(), String> {
    if !is_root() {
        return Err("not root".into());
    }
    for (tool, arg) in [("ip", "-V"), ("ethtool", "--version")] {
        match run_bounded(Command::new(tool).arg(arg), Duration::from_secs(5)) {
            Ok((st, _)) if st.success() => {}
            _ => {
                return Err(format!(
                    "`{tool}` not available (scripts/setup.sh installs it)"
                ))
            }
        }
    }
    Ok(())
}

/// Everything the test created; deleted on drop, also when the test panics: first the
/// processes (killed by PID), then the namespaces (with the devices in them).
struct Lab {
    /// Processes this test started.
    children: Vec<ChildGuard>,
    ns: Netns,
    files: Vec<PathBuf>,
}

impl Drop for Lab {
    fn drop(&mut self) {
        for f in &self.files {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// A UDP socket bound to `addr` inside namespace `ns`. A socket keeps the namespace it
/// was made in, so a short-lived thread switches namespace, binds, and hands it back.
fn socket_in(ns: &str, addr: SocketAddrV4) -> UdpSocket {
    let name = ns.to_string();
    in_ns(ns, move || {
        UdpSocket::bind(addr).unwrap_or_else(|e| panic!("bind {addr} in {name}: {e}"))
    })
}

/// `InCsumErrors` and `InErrors` of a namespace's UDP counters.
fn udp_errors(ns: &str) -> (u64, u64) {
    let snmp = ns_exec(ns, &["cat", "/proc/net/snmp"]);
    let rows: Vec<Vec<&str>> = snmp
        .lines()
        .filter(|l| l.starts_with("Udp:"))
        .map(|l| l.split_whitespace().collect())
        .collect();
    let (names, values) = (&rows[0], &rows[1]);
    let get = |k: &str| {
        names
            .iter()
            .position(|n| *n == k)
            .and_then(|i| values[i].parse().ok())
            .unwrap_or(0)
    };
    (get("InCsumErrors"), get("InErrors"))
}

#[test]
fn vxlan_nat_round_trip_through_linux() {
    if let Err(why) = prerequisites() {
        println!("SKIP netns_vxlan: {why}: needs root, iproute2 and ethtool");
        return;
    }
    let pid = std::process::id();
    let mut lab = Lab {
        children: Vec::new(),
        ns: Netns::unique("sf"),
        files: Vec::new(),
    };
    let pp = lab.ns.add("pp");
    let a = lab.ns.add("a");
    let b = lab.ns.add("b");

    // Underlay: a bridge in the PP namespace, a veth to each client. Devices are created
    // directly inside the namespaces; the host's own links and routes are never touched.
    ip(&["-n", &pp, "link", "add", "br0", "type", "bridge"]);
    ip(&["-n", &pp, "addr", "add", "198.18.0.1/24", "dev", "br0"]);
    ip(&["-n", &pp, "link", "set", "br0", "up"]);
    for (ns, tag, underlay, vx_mac, tenant, peer, peer_mac) in [
        (
            &a,
            "a",
            "198.18.0.2/24",
            A_MAC,
            "198.19.10.2/24",
            "198.19.10.100",
            "02:00:00:00:10:64",
        ),
        (
            &b,
            "b",
            "198.18.0.3/24",
            B_MAC,
            "198.19.10.9/24",
            "198.19.10.50",
            "02:00:00:00:10:32",
        ),
    ] {
        let (cl, pl) = (format!("sf{tag}{pid}"), format!("sfp{tag}{pid}"));
        veth(ns, &cl, &pp, &pl);
        ip(&["-n", &pp, "link", "set", &pl, "master", "br0", "up"]);
        ip(&["-n", ns, "addr", "add", underlay, "dev", &cl]);
        ip(&["-n", ns, "link", "set", &cl, "up"]);
        // `remote` makes the all-zeros FDB entry: every inner frame goes to the PP node.
        ip(&[
            "-n",
            ns,
            "link",
            "add",
            "vx100",
            "address",
            vx_mac,
            "type",
            "vxlan",
            "id",
            "100",
            "remote",
            "198.18.0.1",
            "dstport",
            "4789",
            "dev",
            &cl,
        ]);
        ns_exec(ns, &["ethtool", "-K", "vx100", "tx", "off"]);
        ip(&["-n", ns, "addr", "add", tenant, "dev", "vx100"]);
        ip(&["-n", ns, "link", "set", "vx100", "up"]);
        // The tenant peer lives behind the PP node; any MAC will do, the PP node rewrites
        // the inner destination MAC to the far device's.
        ip(&[
            "-n",
            ns,
            "neigh",
            "add",
            peer,
            "lladdr",
            peer_mac,
            "dev",
            "vx100",
            "nud",
            "permanent",
        ]);
    }

    let rules = std::env::temp_dir().join(format!("sf-netns-vxlan-{pid}.rules"));
    lab.files.push(rules.clone());
    std::fs::write(
        &rules,
        format!(
            "# a → VIP: SNAT + DNAT to the server in b\n\
             match 100 udp {CLIENT} > {VIP}\n\
             rule decap; set-src {SNAT}; set-dst {SERVER}; encap 198.18.0.3 vni 100 dmac {B_MAC}; count; out 0\n\
             # the server's answer: back to a, from the VIP\n\
             match 100 udp {SERVER} > {SNAT}\n\
             rule decap; set-src {VIP}; set-dst {CLIENT}; encap 198.18.0.2 vni 100 dmac {A_MAC}; count; out 0\n"
        ),
    )
    .unwrap();

    // The PP node. `ip netns exec` execs the binary, so the child's PID is starfabric's.
    let mut child = Command::new("ip")
        .args(["netns", "exec", &pp, env!("CARGO_BIN_EXE_starfabric"), "pp"])
        .args(["--listen", "198.18.0.1:4789", "--node-ip", "198.18.0.1"])
        .arg("--rules")
        .arg(&rules)
        .args(["--duration", "60", "--stats-interval", "1"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn starfabric pp");
    let lines = stdout_lines(&mut child);
    lab.children
        .push(ChildGuard::with_grace(child, Duration::ZERO));
    let first = lines
        .recv_timeout(Duration::from_secs(10))
        .expect("starfabric pp did not start within 10 s");
    assert!(
        first.starts_with("pp: listening on 198.18.0.1:4789, 2 static rules"),
        "{first}"
    );

    // The server in b echoes whatever it gets, and reports who sent it.
    let server = socket_in(&b, SERVER);
    server
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (seen_tx, seen) = mpsc::channel();
    let server_thread = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            let deadline = Instant::now() + Duration::from_secs(60);
            while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                if let Ok((n, from)) = server.recv_from(&mut buf) {
                    let _ = seen_tx.send(from);
                    let _ = server.send_to(&buf[..n], from);
                }
            }
        })
    };

    let client = socket_in(&a, CLIENT);
    // Generous: replies take well under a millisecond, but CI machines get loaded.
    client
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let payload = |i: usize| -> Vec<u8> {
        // Odd and even lengths up to what a 1450-byte vx100 MTU carries in one datagram.
        let len = 1 + (i * 331) % 1400;
        (0..len).map(|j| (i * 7 + j) as u8).collect()
    };
    let mut buf = [0u8; 2048];
    for i in 0..ROUNDS {
        let p = payload(i);
        // The first round may wait on ARP in the underlay; allow it a few tries.
        let tries = if i == 0 { 5 } else { 1 };
        let mut got = None;
        for _ in 0..tries {
            client.send_to(&p, VIP).unwrap();
            if let Ok((n, from)) = client.recv_from(&mut buf) {
                got = Some((buf[..n].to_vec(), from));
                break;
            }
        }
        let Some((reply, from)) = got else {
            let (a_csum, a_err) = udp_errors(&a);
            let (b_csum, b_err) = udp_errors(&b);
            panic!(
                "round {i}: no reply (len {}); UDP InCsumErrors/InErrors a={a_csum}/{a_err} b={b_csum}/{b_err}; pp: {:?}",
                p.len(),
                lines.try_iter().collect::<Vec<_>>()
            );
        };
        assert_eq!(
            from,
            std::net::SocketAddr::V4(VIP),
            "round {i}: reply comes from the VIP"
        );
        assert_eq!(reply, p, "round {i}: payload");
    }
    stop.store(true, Ordering::Relaxed);
    server_thread.join().unwrap();

    // The server saw the SNAT address, never the client's own.
    let sources: Vec<_> = seen.try_iter().collect();
    assert!(sources.len() >= ROUNDS);
    assert!(
        sources.iter().all(|s| *s == std::net::SocketAddr::V4(SNAT)),
        "{sources:?}"
    );
    assert_eq!(udp_errors(&a).0, 0, "checksum errors in a");
    assert_eq!(udp_errors(&b).0, 0, "checksum errors in b");

    // SIGTERM stops the node cleanly, with a last stats line.
    let status = lab.children[0]
        .terminate(Duration::from_secs(5))
        .expect("starfabric pp ignored SIGTERM for 5 s");
    assert!(status.success(), "starfabric pp exited with {status}");
    let out: Vec<String> = lines.iter().collect();
    assert_eq!(
        out.last().map(String::as_str),
        Some("pp: stopped"),
        "{out:?}"
    );
    let last = &out[out.len() - 2];
    println!("{last}");
    let field = |k: &str| -> u64 {
        last.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {k} in {last:?}"))
    };
    assert!(field("hits=") >= 2 * ROUNDS as u64, "{last}");
    assert!(field("tx=") >= 2 * ROUNDS as u64, "{last}");
    assert_eq!(field("tx_dropped="), 0, "{last}");
    assert_eq!(field("tx_errors="), 0, "{last}");
}
