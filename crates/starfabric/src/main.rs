//! `starfabric`: one binary, a subcommand per role.

use anyhow::Result;
use clap::{Parser, Subcommand};

/// mimalloc instead of glibc malloc: the control planes build and drop many small
/// protobuf messages per flow, where glibc's allocator cost a third of the CPU of
/// `bench setup`. The packet path does not allocate.
///
/// Built with `no_thp`: mimalloc otherwise madvises its arenas for transparent huge
/// pages, and on a host with THP in `madvise` mode every first touch of a fresh 2 MiB
/// region then faults in (and zeroes, and may compact for) a whole huge page. That was
/// 45% of all CPU of `bench setup --nfs builtin` (docs/setup-path.md).
#[cfg(not(feature = "alloc-count"))]
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The same allocator, counted per thread (`--features alloc-count`; `bench setup`
/// then reports allocations per flow).
#[cfg(feature = "alloc-count")]
#[global_allocator]
static ALLOC: alloc_count::Counting = alloc_count::Counting;

#[cfg(feature = "alloc-count")]
mod alloc_count;
mod autoscale_cmd;
mod fm_cmd;
mod orchestrator_cmd;
mod pack_args;
mod pp_cmd;
mod sc_cmd;
mod signals;
mod tls_args;
mod up;

#[derive(Parser)]
#[command(
    name = "starfabric",
    version,
    about = "Elastic multi-tenant network functions"
)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax), e.g. `info` or `pipeline=debug`.
    #[arg(long, global = true, env = "STARFABRIC_LOG", default_value = "warn")]
    log: String,
    /// Log as JSON lines.
    #[arg(long, global = true)]
    log_json: bool,
    /// Parse the command line, then exit without running anything (0: it parses). The
    /// Kubernetes manifests' command lines are checked with it (scripts/k8s-check.py).
    #[arg(long, global = true, hide = true)]
    check_args: bool,
    #[command(flatten)]
    client: ctl::cli::ClientArgs,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Benchmarks.
    #[cfg(feature = "lab")]
    Bench {
        #[command(subcommand)]
        what: lab::bench::BenchCmd,
    },
    /// The platform on the netns testbed with real traffic (`--pipeline`: the offline
    /// walk-through of the PP pipeline).
    #[cfg(feature = "lab")]
    Demo(lab::demo::DemoArgs),
    /// Run a PP node.
    Pp(pp_cmd::PpArgs),
    /// Run a fabric master.
    Fm(fm_cmd::FmArgs),
    /// Run an SC node.
    Sc(sc_cmd::ScArgs),
    /// Run the orchestrator: the REST API and the nodes' control service.
    Orchestrator(orchestrator_cmd::OrchestratorArgs),
    /// Run a whole platform on loopback: orchestrator, FM, an SC group of 3, a PP node.
    Up(up::UpArgs),
    /// Tenants: create (optionally with a VPC and SNAT in one go), list, get, delete.
    #[command(subcommand)]
    Tenant(ctl::cli::TenantCmd),
    /// A tenant's VPCs (VNIs).
    #[command(subcommand)]
    Vpc(ctl::cli::VpcCmd),
    /// A tenant's NF instances: `nf create snat|lb|fw|monitor|from-file`.
    #[command(subcommand)]
    Nf(ctl::cli::NfCmd),
    /// A tenant's chains of NFs.
    #[command(subcommand)]
    Chain(ctl::cli::ChainCmd),
    /// Create a tenant-scoped API token.
    Token {
        #[arg(long)]
        tenant: String,
    },
    /// Node identities (docs/security.md): `node token create --role sc`, `node revoke ID`.
    #[command(subcommand)]
    Node(NodeCmd),
    /// The platform's nodes and their health.
    Status {
        /// Wait (with a spinner) until every node is up and ready.
        #[arg(long)]
        wait: bool,
    },
    /// A tenant's flows, from FM's rule cache.
    Flows {
        #[arg(long)]
        tenant: String,
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// Per-tenant counters from the nodes' reports.
    Stats {
        #[arg(long)]
        tenant: Option<String>,
        /// Refresh every this many seconds.
        #[arg(long)]
        watch: Option<f64>,
        /// With --watch: stop after this many refreshes.
        #[arg(long)]
        count: Option<u64>,
        /// The tenant's monitor NF counters instead (needs --tenant): every packet and
        /// byte of its flows, in total and per source host (docs/metrics.md).
        #[arg(long, requires = "tenant")]
        monitor: bool,
        /// With --monitor: how many hosts to show, by bytes.
        #[arg(long, default_value_t = 10, requires = "monitor")]
        top: u32,
        /// JSON output (the same as `-o json`).
        #[arg(long)]
        json: bool,
    },
    /// SC scaling against a running FM: `sc-out`, `sc-in`, `map` (docs/scaling.md).
    #[command(subcommand)]
    Scale(ctl::scale::ScaleCmd),
    /// FM's event log: scales, refusals, node deaths, repairs, autoscaler decisions.
    Events(ctl::events::EventsArgs),
    /// Scale SC groups (and PP nodes) between utilisation water marks (docs/autoscaler.md).
    Autoscale(orchestrator::autoscaler::AutoscaleFlags),
    /// The netns testbed: `up`, `down`, `status`.
    #[cfg(feature = "lab")]
    #[command(subcommand)]
    Testbed(lab::testbed_cmd::TestbedCmd),
    /// Tenants' shard sets and placement limits (docs/placement.md).
    #[command(subcommand)]
    Placement(ctl::placement::PlacementCmd),
    /// Trace packets through PP nodes' pipelines, stage by stage, optionally into a
    /// pcapng file (docs/trace.md).
    Trace(ctl::trace::TraceArgs),
}

#[derive(Subcommand)]
enum NodeCmd {
    /// Join tokens.
    #[command(subcommand)]
    Token(NodeTokenCmd),
    /// Revoke a node's certificate: its sessions are cut and it cannot reconnect.
    Revoke { id: String },
    /// Join with a one-time token and keep the certificate in a directory, without
    /// starting a node: an operator's certificate for `scale`, `events --fm` and
    /// `autoscale` (`--tls-dir`), or a node's made ahead of its start.
    Join {
        /// The token (`starfabric node token create --role operator`).
        #[arg(long, env = "STARFABRIC_JOIN_TOKEN", hide_env_values = true)]
        token: String,
        /// The name the certificate carries (1-64 of [A-Za-z0-9._:-]).
        #[arg(long)]
        id: String,
        /// The role the token was made for.
        #[arg(long, default_value = "operator")]
        role: proto::tls::Role,
        /// Where to write `ca.pem`, `node.pem` and `node.key`.
        #[arg(long)]
        tls_dir: std::path::PathBuf,
        /// The orchestrator's REST API (default: --server or the CLI config's). Joining
        /// needs no admin token.
        #[arg(long, env = "STARFABRIC_ORCHESTRATOR_API")]
        orchestrator_api: Option<String>,
    },
}

#[derive(Subcommand)]
enum NodeTokenCmd {
    /// A one-time token a node joins with (`--join-token`), or an operator with `node join`.
    Create {
        /// The role the holder gets: pp, fm, sc or operator.
        #[arg(long)]
        role: String,
        /// How long the token stays usable, e.g. `90s`, `10m`, `2h`.
        #[arg(long, default_value = "10m", value_parser = parse_ttl)]
        ttl: u64,
    },
}

/// `90s`, `10m`, `2h`, `1d` or plain seconds → seconds.
fn parse_ttl(s: &str) -> Result<u64, String> {
    let (n, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{s:?}: expected e.g. 90s, 10m, 2h"))?;
    let mult = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return Err(format!("{s:?}: unit is s, m, h or d")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too long"))
}

fn node(c: &ctl::cli::Client, cmd: NodeCmd) -> Result<()> {
    let r = match cmd {
        NodeCmd::Token(NodeTokenCmd::Create { role, ttl }) => c.api.call(
            "POST",
            "/v1/nodes/tokens",
            Some(serde_json::json!({"role": role, "ttl_s": ttl})),
        )?,
        NodeCmd::Revoke { id } => c
            .api
            .call("POST", &format!("/v1/nodes/{id}/revoke"), None)?,
        NodeCmd::Join { .. } => unreachable!("joined in main, without an admin token"),
    };
    match (&c.output, r["token"].as_str()) {
        (ctl::cli::Output::Table, Some(t)) => println!("{t}"),
        (ctl::cli::Output::Table, None) => {
            println!("revoked {}", r["revoked"].as_str().unwrap_or(""))
        }
        _ => println!("{}", serde_json::to_string_pretty(&r)?),
    }
    Ok(())
}

/// An error is the operator's to read: its message and causes on one line, never a
/// stack trace (returning it from `main` prints anyhow's `Debug`, which carries a
/// backtrace whenever `RUST_BACKTRACE` is set in the environment).
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    #[cfg(feature = "alloc-count")]
    let _ = lab::bench_setup::ALLOC_SNAPSHOT.set(alloc_count::snapshot);
    let cli = Cli::parse();
    if cli.check_args {
        println!("starfabric: the command line parses");
        return Ok(());
    }
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)?;
    let sub = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if cli.log_json {
        sub.json().init();
    } else {
        sub.init();
    }
    match cli.cmd {
        #[cfg(feature = "lab")]
        Cmd::Bench { what } => lab::bench::run(what),
        #[cfg(feature = "lab")]
        Cmd::Demo(a) => lab::demo::run(a),
        Cmd::Pp(a) => pp_cmd::run(a),
        Cmd::Fm(a) => fm_cmd::run(a),
        Cmd::Sc(a) => sc_cmd::run(a),
        Cmd::Orchestrator(a) => orchestrator_cmd::run(a),
        Cmd::Up(a) => up::run(a),
        Cmd::Tenant(c) => ctl::cli::tenant(&ctl::cli::Client::new(&cli.client)?, c),
        Cmd::Vpc(c) => ctl::cli::vpc(&ctl::cli::Client::new(&cli.client)?, c),
        Cmd::Nf(c) => ctl::cli::nf(&ctl::cli::Client::new(&cli.client)?, c),
        Cmd::Chain(c) => ctl::cli::chain(&ctl::cli::Client::new(&cli.client)?, c),
        Cmd::Token { tenant } => {
            ctl::cli::token_create(&ctl::cli::Client::new(&cli.client)?, &tenant)
        }
        Cmd::Node(NodeCmd::Join {
            token,
            id,
            role,
            tls_dir,
            orchestrator_api,
        }) => {
            let api = orchestrator_api
                .or(cli.client.server.clone())
                .or_else(|| {
                    orchestrator::client::Client::from_config(None, Some(""))
                        .ok()
                        .map(|c| c.server().to_string())
                })
                .ok_or_else(|| anyhow::anyhow!("no orchestrator: pass --orchestrator-api URL"))?;
            let me = proto::tls::Identity::new(role, id)?;
            let got = tls_args::join(
                &orchestrator::client::Client::new(&api, None),
                &token,
                &me,
                &tls_dir,
            )?;
            println!("{got}: certificate written to {}", tls_dir.display());
            Ok(())
        }
        Cmd::Node(cmd) => node(&ctl::cli::Client::new(&cli.client)?, cmd),
        Cmd::Status { wait } => ctl::cli::status(&ctl::cli::Client::new(&cli.client)?, wait),
        Cmd::Flows { tenant, limit } => {
            ctl::cli::flows(&ctl::cli::Client::new(&cli.client)?, &tenant, limit)
        }
        Cmd::Stats {
            tenant,
            watch,
            count,
            monitor,
            top,
            json,
        } => {
            let mut c = ctl::cli::Client::new(&cli.client)?;
            if json {
                c.output = ctl::cli::Output::Json;
            }
            match (monitor, tenant.as_deref()) {
                (true, Some(t)) => ctl::cli::monitor_stats(&c, t, top, watch, count),
                _ => ctl::cli::stats(&c, tenant.as_deref(), watch, count),
            }
        }
        Cmd::Scale(c) => ctl::scale::run(c, cli.client.output),
        Cmd::Events(a) => ctl::events::run(a, cli.client.output),
        Cmd::Autoscale(a) => autoscale_cmd::run(a),
        #[cfg(feature = "lab")]
        Cmd::Testbed(c) => lab::testbed_cmd::run(c),
        Cmd::Placement(c) => ctl::placement::run(|| ctl::cli::Client::new(&cli.client), c),
        Cmd::Trace(a) => {
            ctl::trace::run(a, || ctl::cli::Client::new(&cli.client), cli.client.output)
        }
    }
}
