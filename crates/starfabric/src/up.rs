//! `starfabric up`: a whole platform on loopback, as child processes of this one: an
//! orchestrator (embedded store), an FM, an SC group of three and a PP node listening
//! for VXLAN on a UDP port. It writes the CLI's config (API address and admin token),
//! waits until every node reports ready, and tears everything down on Ctrl-C, SIGTERM,
//! `--duration`, or when any child dies.

use std::io::{BufRead, BufReader, Write as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;

use ctl::cli::{self, ClientConfig, Output};

#[derive(Args, Debug)]
pub struct UpArgs {
    /// State directory: the orchestrator's store, the admin token, node logs.
    #[arg(long, default_value = "/var/lib/starfabric/up")]
    dir: PathBuf,
    /// REST API address (port 0: any free port; the config file records it).
    #[arg(long, default_value = "127.0.0.1:7080")]
    api: SocketAddr,
    /// Nodes' control address.
    #[arg(long, default_value = "127.0.0.1:7081")]
    control: SocketAddr,
    /// FM address.
    #[arg(long, default_value = "127.0.0.1:7000")]
    fm: SocketAddr,
    /// Where the PP node receives VXLAN.
    #[arg(long, default_value = "127.0.0.1:4789")]
    vxlan: SocketAddr,
    /// SC nodes (one group of this many replicas).
    #[arg(long, default_value_t = 3)]
    sc: usize,
    /// SC NF implementations: `builtin` or `test`.
    #[arg(long, default_value = "builtin")]
    nfs: String,
    /// Stop after this many seconds (default: until Ctrl-C / SIGTERM).
    #[arg(long)]
    duration: Option<f64>,
    /// Seconds to wait for every node to be ready.
    #[arg(long, default_value_t = 60.0)]
    ready_timeout: f64,
    /// Run the PP node in this network namespace (`ip netns exec`), e.g. the netns
    /// testbed's PP namespace; `--vxlan`, `--fm` and `--control` must then be addresses
    /// it can reach.
    #[arg(long)]
    pp_netns: Option<String>,
    #[command(flatten)]
    placement: orchestrator::placement::PlacementFlags,
    /// Plaintext plane links (lab use only). By default the orchestrator makes a CA and
    /// every node joins with a one-time token and talks mTLS (docs/security.md).
    #[arg(long, env = "STARFABRIC_INSECURE")]
    insecure: bool,
}

/// A child node: killed (by its PID) when dropped.
struct Node {
    name: String,
    child: Child,
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SIGTERM first: the nodes stop cleanly on it.
            // SAFETY: kill(2) on the PID of a child we spawned and have not reaped.
            unsafe {
                libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
            }
            let deadline = Instant::now() + Duration::from_secs(3);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Start `starfabric <args>`, send its stdout and stderr to `logs/<name>.log`, and
/// return once a stdout line starts with `ready` (handing that line back).
fn spawn(dir: &Path, name: &str, args: &[String], ready: &str) -> Result<(Node, String)> {
    spawn_in(None, dir, name, args, ready)
}

/// [`spawn`], in network namespace `netns` if given. `ip netns exec` execs the node
/// in place, so the child's PID is the node's.
fn spawn_in(
    netns: Option<&str>,
    dir: &Path,
    name: &str,
    args: &[String],
    ready: &str,
) -> Result<(Node, String)> {
    let exe = std::env::current_exe().context("finding the starfabric binary")?;
    let log_path = dir.join("logs").join(format!("{name}.log"));
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    let mut child = cmd
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log.try_clone()?))
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
    let (tx, rx) = mpsc::channel();
    let prefix = ready.to_string();
    let mut log = log;
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = writeln!(log, "{line}");
            if !sent && line.starts_with(&prefix) {
                let _ = tx.send(line);
                sent = true;
            }
        }
    });
    let mut node = Node {
        name: name.to_string(),
        child,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(line) => return Ok((node, line)),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                bail!(
                    "{name} exited before it was ready; see {}",
                    log_path.display()
                )
            }
        }
        if let Ok(Some(st)) = node.child.try_wait() {
            bail!(
                "{name} exited ({st}) before it was ready; see {}",
                log_path.display()
            );
        }
        if Instant::now() > deadline || crate::signals::stopped() {
            bail!("{name} did not get ready; see {}", log_path.display());
        }
    }
}

/// `orchestrator: api http://A control C store S` → (A, C)
fn parse_orchestrator(line: &str) -> Result<(String, String)> {
    let w: Vec<&str> = line.split_whitespace().collect();
    match w.as_slice() {
        ["orchestrator:", "api", api, "control", control, ..] => {
            Ok((api.to_string(), control.to_string()))
        }
        _ => bail!("unexpected orchestrator line {line:?}"),
    }
}

/// `fm: listening on ADDR, ...` → ADDR
fn parse_listen(line: &str) -> Result<String> {
    line.split_whitespace()
        .nth(3)
        .map(|a| a.trim_end_matches(',').to_string())
        .ok_or_else(|| anyhow!("unexpected line {line:?}"))
}

pub fn run(a: UpArgs) -> Result<()> {
    crate::signals::install()?;
    std::fs::create_dir_all(a.dir.join("logs"))
        .with_context(|| format!("creating {}", a.dir.display()))?;
    let token_file = a.dir.join("admin-token");
    let s = |x: &dyn ToString| x.to_string();
    let mut nodes: Vec<Node> = Vec::new();
    let pb = cli::spinner("starting the orchestrator");
    let (orch, line) = spawn(
        &a.dir,
        "orchestrator",
        &[
            s(&"orchestrator"),
            s(&"--api"),
            s(&a.api),
            s(&"--control"),
            s(&a.control),
            s(&"--store"),
            format!("embedded:{}", a.dir.join("orchestrator.redb").display()),
            s(&"--admin-token-file"),
            s(&token_file.display()),
            s(&"--placement"),
            s(&a.placement.algorithm.name()),
            s(&"--placement-threshold"),
            s(&a.placement.threshold),
            s(&"--shard-min"),
            s(&a.placement.g_min),
            s(&"--shard-max"),
            s(&a.placement.g_max),
            s(&"--shard-overlap"),
            s(&a.placement.overlap),
        ]
        .into_iter()
        .chain(
            a.placement
                .model
                .iter()
                .flat_map(|m| [s(&"--placement-model"), s(&m.display())]),
        )
        .chain(a.insecure.then(|| s(&"--insecure")))
        .collect::<Vec<_>>(),
        "orchestrator:",
    )?;
    nodes.push(orch);
    let (api, control) = parse_orchestrator(&line)?;
    let token = std::fs::read_to_string(&token_file)
        .with_context(|| format!("reading {}", token_file.display()))?
        .trim()
        .to_string();
    let cfg_path = cli::write_config(&ClientConfig {
        server: api.clone(),
        token: token.clone(),
        control: control.clone(),
    })?;
    let client = cli::Client::new(&cli::ClientArgs {
        server: Some(api.clone()),
        token: Some(token),
        output: Output::Table,
    })?;
    // Each node joins with its own one-time token and keeps its certificate in
    // DIR/tls/ID, renewing it through the API.
    let security = |id: &str, role: &str| -> Result<Vec<String>> {
        if a.insecure {
            return Ok(vec!["--insecure".into()]);
        }
        let t = client.api.call(
            "POST",
            "/v1/nodes/tokens",
            Some(serde_json::json!({"role": role, "ttl_s": 120})),
        )?;
        let t = t["token"].as_str().context("no join token in the answer")?;
        Ok(vec![
            "--tls-dir".into(),
            a.dir.join("tls").join(id).display().to_string(),
            "--join-token".into(),
            t.into(),
            "--orchestrator-api".into(),
            api.clone(),
        ])
    };

    pb.set_message("starting the fabric master");
    let (fm, line) = spawn(
        &a.dir,
        "fm-1",
        &[
            s(&"fm"),
            s(&"--metrics"),
            s(&"127.0.0.1:0"),
            s(&"--listen"),
            s(&a.fm),
            s(&"--id"),
            s(&"fm-1"),
            s(&"--orchestrator"),
            control.clone(),
        ]
        .into_iter()
        .chain(security("fm-1", "fm")?)
        .collect::<Vec<_>>(),
        "fm:",
    )?;
    nodes.push(fm);
    let fm_addr = parse_listen(&line)?;
    for i in 1..=a.sc {
        pb.set_message(format!("starting SC node {i} of {}", a.sc));
        let id = format!("sc-{i}");
        let (n, _) = spawn(
            &a.dir,
            &id,
            &[
                s(&"sc"),
                s(&"--metrics"),
                s(&"127.0.0.1:0"),
                s(&"--id"),
                id.clone(),
                s(&"--fm"),
                fm_addr.clone(),
                s(&"--orchestrator"),
                control.clone(),
                s(&"--nfs"),
                a.nfs.clone(),
            ]
            .into_iter()
            .chain(security(&id, "sc")?)
            .collect::<Vec<_>>(),
            "sc:",
        )?;
        nodes.push(n);
    }
    pb.set_message("starting the PP node");
    let (pp, _) = spawn_in(
        a.pp_netns.as_deref(),
        &a.dir,
        "pp-1",
        &[
            s(&"pp"),
            s(&"--metrics"),
            s(&"127.0.0.1:0"),
            s(&"--listen"),
            s(&a.vxlan),
            s(&"--id"),
            s(&"pp-1"),
            s(&"--fm"),
            fm_addr.clone(),
            s(&"--orchestrator"),
            control.clone(),
        ]
        .into_iter()
        .chain(security("pp-1", "pp")?)
        .collect::<Vec<_>>(),
        "pp:",
    )?;
    nodes.push(pp);
    pb.finish_and_clear();

    let expect = 2 + a.sc;
    cli::wait_for(
        &format!("waiting for {expect} nodes to report ready"),
        Duration::from_secs_f64(a.ready_timeout),
        || {
            if crate::signals::stopped() {
                bail!("interrupted");
            }
            for n in nodes.iter_mut() {
                if let Ok(Some(st)) = n.child.try_wait() {
                    bail!(
                        "{} exited ({st}); see {}",
                        n.name,
                        a.dir.join("logs").display()
                    );
                }
            }
            let v = client.call("GET", "/v1/status", None)?;
            Ok(
                (v["healthy"] == true && v["nodes"].as_array().is_some_and(|n| n.len() >= expect))
                    .then_some(()),
            )
        },
    )?;
    println!("starfabric is up:");
    println!("  API           {api}   (OpenAPI: {api}/openapi.json)");
    println!("  dashboard     {api}/ui   (log in with the admin token)");
    println!("  control       {control}");
    println!("  VXLAN (PP)    udp {}", a.vxlan);
    println!("  CLI config    {}   (admin token)", cfg_path.display());
    println!("  logs          {}", a.dir.join("logs").display());
    if a.insecure {
        println!("  plane links   PLAINTEXT (--insecure)");
    } else {
        // The operator's own certificate, for the tools that call FM directly
        // (`scale`, `events --fm`, `autoscale`), as kubeadm leaves an admin.conf.
        let op_dir = a.dir.join("tls").join("operator");
        let t = client.api.call(
            "POST",
            "/v1/nodes/tokens",
            Some(serde_json::json!({"role": "operator", "ttl_s": 120})),
        )?;
        let t = t["token"].as_str().context("no join token in the answer")?;
        let me = proto::tls::Identity::new(proto::tls::Role::Operator, "operator")?;
        crate::tls_args::join(&client.api, t, &me, &op_dir)
            .context("the operator's certificate")?;
        println!(
            "  plane links   mTLS; node certificates in {}",
            a.dir.join("tls").display()
        );
        println!(
            "  operator cert {}   (scale, events --fm, autoscale: --tls-dir)",
            op_dir.display()
        );
    }
    println!();
    cli::status(&client, false)?;
    println!();
    println!("try: starfabric tenant create acme --vni 100 --snat 198.18.100.1 --wait");
    // Failure tests stop one node by its PID (a process this command started).
    for n in &nodes {
        println!("up: pid {} {}", n.name, n.child.id());
    }
    // Tests and scripts wait for this line.
    println!("up: ready");
    std::io::stdout().flush()?;

    let start = Instant::now();
    let outcome = loop {
        if crate::signals::stopped() {
            break Ok(());
        }
        if a.duration
            .is_some_and(|d| start.elapsed() >= Duration::from_secs_f64(d))
        {
            break Ok(());
        }
        // An SC node that exits is a failure the platform survives (its groups are
        // repaired on the others): report it and carry on. Any other node stops all.
        if let Some(i) = nodes
            .iter_mut()
            .position(|n| n.name.starts_with("sc-") && matches!(n.child.try_wait(), Ok(Some(_))))
        {
            let n = nodes.remove(i);
            println!("up: {} exited; the platform carries on without it", n.name);
            std::io::stdout().flush()?;
            continue;
        }
        if let Some((name, st)) = nodes.iter_mut().find_map(|n| {
            n.child
                .try_wait()
                .ok()
                .flatten()
                .map(|st| (n.name.clone(), st))
        }) {
            break Err(anyhow!(
                "{name} exited ({st}); stopping everything (logs in {})",
                a.dir.join("logs").display()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    println!("up: stopping");
    // PP first, the orchestrator last.
    while let Some(n) = nodes.pop() {
        drop(n);
    }
    println!("up: stopped");
    outcome
}
