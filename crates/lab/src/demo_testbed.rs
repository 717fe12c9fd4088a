//! `starfabric demo` (`make demo`): the whole platform carrying real traffic.
//!
//! 1. builds the netns testbed (two tenant VPCs with the same private addresses, an
//!    underlay router, the PP namespace, an internet host, nginx backends);
//! 2. runs `starfabric up` with the PP node in the PP namespace;
//! 3. creates two tenants through the CLI, printing every command: `acme` gets a
//!    firewall then SNAT toward the internet, `globex` a load balancer over the nginx
//!    backends;
//! 4. drives real traffic (iperf3 and curl for acme, wrk for globex) for a bounded
//!    time while it prints each tenant's live rates from the orchestrator;
//! 5. shows what came out, and tears everything down, also on failure or Ctrl-C.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use testbed::cleanup::namespaces_with_prefix;
use testbed::measure;
use testbed::services::{self, Nginx};
use testbed::topo::{addr, mac, vni, Node};
use testbed::{Resources, Testbed, TopologySpec};

/// Namespace prefix of the demo (short: veth names are at most 15 characters).
const PREFIX: &str = "sfdemo-";

fn banner(n: u32, title: &str) {
    println!("\n\x1b[1m== {n}. {title}\x1b[0m");
}

fn say(s: &str) {
    println!("   {s}");
}

/// The demo's view of the platform: the `starfabric` binary and the CLI config `up`
/// wrote, both used from the control namespace where the API listens.
struct Cli<'a> {
    tb: &'a Testbed,
    exe: PathBuf,
    config: PathBuf,
}

impl Cli<'_> {
    fn argv<'b>(&'b self, args: &[&'b str]) -> Vec<String> {
        let mut v = vec![
            "env".to_string(),
            format!("STARFABRIC_CONFIG={}", self.config.display()),
            self.exe.display().to_string(),
        ];
        v.extend(args.iter().map(|s| s.to_string()));
        v
    }

    /// Run `starfabric <args>` in the control namespace, printing the command and its
    /// output as a person would see them.
    fn show(&self, args: &[&str]) -> Result<()> {
        println!("\n   \x1b[36m$ starfabric {}\x1b[0m", args.join(" "));
        let argv = self.argv(args);
        let st = Command::new("ip")
            .args(["netns", "exec", &self.tb.ns(Node::Ctl)])
            .args(&argv)
            .status()
            .context("running the CLI")?;
        if !st.success() {
            bail!("`starfabric {}` failed ({st})", args.join(" "));
        }
        Ok(())
    }

    /// `starfabric <args> -o json`, parsed.
    fn json(&self, args: &[&str]) -> Result<Value> {
        let mut a: Vec<&str> = args.to_vec();
        a.extend(["-o", "json"]);
        let argv = self.argv(&a);
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let out = self.tb.exec(Node::Ctl, &argv, Duration::from_secs(10))?;
        serde_json::from_str(&out).with_context(|| format!("parsing {out:?}"))
    }
}

#[derive(Default, Clone, Copy)]
struct Counters {
    packets: u64,
    bytes: u64,
    drops: u64,
    flows: u64,
}

fn counters(v: &Value, tenant: &str) -> Counters {
    let t = v
        .as_array()
        .and_then(|a| a.iter().find(|t| t["tenant"] == tenant));
    let f = |k: &str| t.and_then(|t| t[k].as_u64()).unwrap_or(0);
    Counters {
        packets: f("packets"),
        bytes: f("bytes"),
        drops: f("drops"),
        flows: f("flows_set_up"),
    }
}

fn si(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.2}G", x / 1e9),
        x if x >= 1e6 => format!("{:.1}M", x / 1e6),
        x if x >= 1e3 => format!("{:.1}k", x / 1e3),
        x => format!("{x:.0}"),
    }
}

/// `curl` from VPC `j`'s client with a time bound: Ok(body) or Err(curl's complaint).
fn curl(tb: &Testbed, j: usize, url: &str, secs: u32) -> Result<String, String> {
    let t = secs.to_string();
    let out = tb
        .exec_full(
            Node::Client(j),
            &["curl", "-sS", "--max-time", &t, url],
            Duration::from_secs(u64::from(secs) + 5),
        )
        .map_err(|e| e.to_string())?;
    if out.ok() {
        Ok(out.stdout.trim().to_string())
    } else {
        Err(out.stderr.trim().to_string())
    }
}

pub fn run(secs: u32) -> Result<()> {
    if secs == 0 || secs > 600 {
        bail!("--secs must be 1..=600");
    }
    testbed::install_signal_cleanup()?;
    testbed::check_prerequisites().map_err(|e| {
        anyhow!("{e} (the demo builds network namespaces: run it as root after scripts/setup.sh)")
    })?;
    testbed::sweep_stale(PREFIX);
    let res = Resources::new(PREFIX);
    let outcome = demo(&res, secs);
    // Everything the demo started or created is deleted here, whatever happened.
    banner(6, "Tearing down");
    res.cleanup();
    let left = namespaces_with_prefix(PREFIX);
    if left.is_empty() {
        say("every namespace, veth, VXLAN device and process of the demo is gone");
    } else {
        say(&format!("left behind (bug): {left:?}"));
    }
    outcome
}

fn demo(res: &std::sync::Arc<Resources>, secs: u32) -> Result<()> {
    println!(
        "\x1b[1mstarfabric demo\x1b[0m: two tenants on one shared platform, real Linux traffic."
    );
    println!(
        "Everything runs in network namespaces this demo creates (addresses in 198.18.0.0/15)"
    );
    println!("and deletes at the end.");

    banner(1, "Building the testbed");
    let tb = Testbed::build(
        TopologySpec::new(PREFIX).tenants(2).backends(3),
        res.clone(),
    )?;
    say(&format!(
        "tenant VPCs: acme = VNI {} and globex = VNI {}; both use {} (overlapping on purpose),",
        vni::tenant(0),
        vni::tenant(1),
        addr::TENANT_NET
    ));
    say(&format!(
        "  each client host's Linux VXLAN device points at the PP node {}",
        addr::PP
    ));
    say(&format!(
        "internet host {} (nginx, iperf3) behind an internet gateway (VNI {})",
        addr::INET,
        vni::INTERNET
    ));
    say(&format!(
        "3 nginx backends {}..{} behind a service gateway (VNI {})",
        addr::backend(0),
        addr::backend(2),
        vni::SERVICES
    ));
    let _inet = services::start_inet(&tb, false)?;
    let backends: Vec<Nginx> = services::start_backends(&tb)?;

    banner(2, "Starting the platform: starfabric up");
    let exe = std::env::current_exe()?;
    let config = tb.path("cli.json");
    say(&format!(
        "$ starfabric up --api {}:{} --fm {}:{} --vxlan {}:4789 --pp-netns {}",
        addr::CTL,
        addr::API_PORT,
        addr::CTL,
        addr::FM_PORT,
        addr::PP,
        tb.ns(Node::Pp)
    ));
    say("  orchestrator (embedded store) + fabric master + an SC group of 3 in the control");
    say("  namespace; the PP node in the PP namespace");
    let up = tb.spawn_up(&exe, &config, &tb.path("up"), &[])?;
    tb.wait_log(&up, "up: ready", Duration::from_secs(90))
        .with_context(|| format!("starfabric up did not get ready; see {}", up.log.display()))?;
    let cli = Cli {
        tb: &tb,
        exe: exe.clone(),
        config,
    };
    cli.show(&["status"])?;

    banner(3, "Creating two tenants through the CLI");
    let to_client = |j: usize| {
        format!(
            "{}:{}@{}",
            addr::client_underlay(j),
            vni::tenant(j),
            mac::client(j)
        )
    };
    let to_inet = format!("{}:{}@{}", addr::IGW, vni::INTERNET, mac::IGW);
    // Tenant `j`'s chain `main` on its VPC `main`: these NFs, out to `egress`, replies
    // back to its client; the CLI waits until an SC group serves it.
    let chain_main = |tenant: &str, j: usize, nfs: &str, egress: &str| {
        cli.show(&[
            "chain",
            "create",
            "main",
            "--tenant",
            tenant,
            "--vpc",
            "main",
            "--nfs",
            nfs,
            "--egress",
            egress,
            "--return",
            &to_client(j),
            "--wait",
        ])
    };
    let to_svc = format!("{}:{}@{}", addr::SVC, vni::SERVICES, mac::SVC);
    let pool = addr::pool(0).to_string();
    say("acme: a stateful firewall (HTTP and iperf3 allowed, the rest denied), then SNAT");
    cli.show(&["tenant", "create", "acme"])?;
    let vni0 = vni::tenant(0).to_string();
    cli.show(&["vpc", "create", "main", "--tenant", "acme", "--vni", &vni0])?;
    cli.show(&[
        "nf", "create", "fw", "edge", "--tenant", "acme", "--allow", "tcp:80", "--allow",
        "tcp:5201",
    ])?;
    cli.show(&[
        "nf", "create", "snat", "out", "--tenant", "acme", "--pool", &pool,
    ])?;
    chain_main("acme", 0, "edge,out", &to_inet)?;
    say("globex: a Maglev load balancer, VIP 198.19.2.100:80 over the three nginx backends");
    cli.show(&["tenant", "create", "globex"])?;
    let vni1 = vni::tenant(1).to_string();
    cli.show(&[
        "vpc", "create", "main", "--tenant", "globex", "--vni", &vni1,
    ])?;
    let vip = format!("{}:80/tcp", addr::VIP);
    let bk: Vec<String> = (0..3).map(|k| format!("{}:80", addr::backend(k))).collect();
    cli.show(&[
        "nf",
        "create",
        "lb",
        "web",
        "--tenant",
        "globex",
        "--vip",
        &vip,
        "--backend",
        &bk[0],
        "--backend",
        &bk[1],
        "--backend",
        &bk[2],
    ])?;
    chain_main("globex", 1, "web", &to_svc)?;

    banner(4, "First packets");
    let inet_url = format!("http://{}/", addr::INET);
    // The PP node learns its VPC bindings from the orchestrator a moment after the
    // chain exists; the first tries may find no binding yet.
    let first =
        testbed::cmd::wait_for("acme's first HTTP request", Duration::from_secs(20), || {
            Ok(curl(&tb, 0, &inet_url, 2).ok())
        })?;
    say(&format!(
        "acme client -> {inet_url}: the server saw us as `{first}` (the SNAT pool address {pool})"
    ));
    if !first.starts_with(&format!("inet {pool}:")) {
        bail!("the internet host saw {first:?}, not the SNAT pool address {pool}");
    }
    match curl(&tb, 0, &format!("http://{}:8080/", addr::INET), 2) {
        Ok(b) => bail!("acme -> tcp/8080 should be denied by the firewall but got {b:?}"),
        Err(e) => say(&format!(
            "acme -> tcp/8080: denied by acme's firewall, nothing comes back ({e})"
        )),
    }
    let vip_url = format!("http://{}/", addr::VIP);
    let b = testbed::cmd::wait_for(
        "globex's first HTTP request",
        Duration::from_secs(20),
        || Ok(curl(&tb, 1, &vip_url, 2).ok()),
    )?;
    say(&format!(
        "globex client -> VIP {vip_url}: answered by `{b}`"
    ));
    if !b.starts_with("backend-") {
        bail!("the VIP answered {b:?}, not an nginx backend");
    }

    banner(
        5,
        &format!("Real traffic for {secs} s, live per-tenant rates"),
    );
    let s = secs.to_string();
    let inet_ip = addr::INET.to_string();
    let iperf = tb.spawn(
        Node::Client(0),
        "demo iperf3",
        &["iperf3", "-c", &inet_ip, "-t", &s, "-b", "300M", "-J"],
    )?;
    say(&format!(
        "acme:   iperf3 TCP to {inet_ip} (300 Mbit/s offered), through FW then SNAT"
    ));
    let d = format!("{secs}s");
    let wrk = tb.spawn(
        Node::Client(1),
        "demo wrk",
        &[
            "wrk",
            "-t",
            "1",
            "-c",
            "8",
            "-d",
            &d,
            "--timeout",
            "2s",
            "-H",
            "Connection: close",
            &vip_url,
        ],
    )?;
    say("globex: wrk, 8 connections, a new TCP connection per request, to the VIP");
    println!();
    println!(
        "   {:>5}  {:<7} {:>10} {:>11} {:>9} {:>7}   {:<7} {:>10} {:>11} {:>9} {:>7}",
        "t",
        "tenant",
        "pkt/s",
        "bit/s",
        "flows",
        "drops",
        "tenant",
        "pkt/s",
        "bit/s",
        "flows",
        "drops"
    );
    let start = Instant::now();
    let mut prev = (Counters::default(), Counters::default(), start);
    let mut first_sample = true;
    while start.elapsed() < Duration::from_secs(u64::from(secs) + 1) {
        if testbed::cleanup::interrupted() {
            bail!("interrupted");
        }
        std::thread::sleep(Duration::from_secs(1));
        let v = match cli.json(&["stats"]) {
            Ok(v) => v,
            Err(e) => {
                say(&format!("(stats unavailable: {e})"));
                continue;
            }
        };
        let now = Instant::now();
        let (a, g) = (counters(&v, "acme"), counters(&v, "globex"));
        let dt = now.duration_since(prev.2).as_secs_f64().max(1e-3);
        if !first_sample {
            let row = |c: Counters, p: Counters| {
                (
                    si(c.packets.saturating_sub(p.packets) as f64 / dt),
                    si(c.bytes.saturating_sub(p.bytes) as f64 * 8.0 / dt),
                    c.flows,
                    c.drops,
                )
            };
            let (ap, ab, af, ad) = row(a, prev.0);
            let (gp, gb, gf, gd) = row(g, prev.1);
            println!(
                "   {:>4}s  {:<7} {:>10} {:>11} {:>9} {:>7}   {:<7} {:>10} {:>11} {:>9} {:>7}",
                start.elapsed().as_secs(),
                "acme",
                ap,
                ab,
                af,
                ad,
                "globex",
                gp,
                gb,
                gf,
                gd
            );
        }
        first_sample = false;
        prev = (a, g, now);
    }
    let wrk_out = wait_exit(res, &wrk, Duration::from_secs(30));
    let iperf_out = wait_exit(res, &iperf, Duration::from_secs(30));
    println!();
    match measure::parse_iperf3(&iperf_out) {
        Ok(bps) => say(&format!(
            "acme iperf3: {:.0} Mbit/s received by the internet host",
            bps / 1e6
        )),
        Err(e) => say(&format!(
            "acme iperf3: no result ({e}); log {}",
            iperf.log.display()
        )),
    }
    match measure::parse_wrk(&wrk_out) {
        Ok(r) => say(&format!(
            "globex wrk: {} requests, {:.0}/s, {} non-2xx, {} socket errors",
            r.requests,
            r.ok_per_sec(),
            r.non_2xx,
            r.socket_errors
        )),
        Err(e) => say(&format!(
            "globex wrk: no result ({e}); log {}",
            wrk.log.display()
        )),
    }
    let shares: Vec<String> = backends
        .iter()
        .enumerate()
        .map(|(k, n)| format!("backend-{k} {}", n.access_log().len()))
        .collect();
    say(&format!(
        "requests served per nginx backend: {}",
        shares.join(", ")
    ));
    if backends.iter().any(|n| n.access_log().is_empty()) {
        bail!("a backend served nothing: {}", shares.join(", "));
    }
    cli.show(&["flows", "--tenant", "acme", "--limit", "4"])?;
    cli.show(&["stats"])?;
    Ok(())
}

/// Wait for `p` (a bounded command) to exit and return its log.
fn wait_exit(res: &Resources, p: &testbed::topo::Proc, limit: Duration) -> String {
    let deadline = Instant::now() + limit;
    while res.child_running(p.pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    std::fs::read_to_string(&p.log).unwrap_or_default()
}
