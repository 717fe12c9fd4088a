//! `starfabric`: one binary, a subcommand per role.

use anyhow::Result;
use clap::{Parser, Subcommand};

/// mimalloc instead of glibc malloc: the control planes build and drop many small
/// protobuf messages per flow, where glibc's allocator cost a third of the CPU of
/// `bench setup`. The packet path does not allocate.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod bench;
mod bench_e2e;
mod bench_setup;
mod demo;
mod fm_cmd;
mod pp_cmd;
mod sc_cmd;
mod testbed_cmd;

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
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: bench::BenchCmd,
    },
    /// Walk through the pipeline: a miss, the rule, the release, hits; then benchmark.
    Demo(demo::DemoArgs),
    /// Run a PP node.
    Pp(pp_cmd::PpArgs),
    /// Run a fabric master.
    Fm(fm_cmd::FmArgs),
    /// Run an SC node.
    Sc(sc_cmd::ScArgs),
    /// The netns testbed: `up`, `down`, `status`.
    #[command(subcommand)]
    Testbed(testbed_cmd::TestbedCmd),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
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
        Cmd::Bench { what } => bench::run(what),
        Cmd::Demo(a) => demo::run(a),
        Cmd::Pp(a) => pp_cmd::run(a),
        Cmd::Fm(a) => fm_cmd::run(a),
        Cmd::Sc(a) => sc_cmd::run(a),
        Cmd::Testbed(c) => testbed_cmd::run(c),
    }
}
