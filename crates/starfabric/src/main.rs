//! `starfabric`: one binary, a subcommand per role.

use anyhow::Result;
use clap::{Parser, Subcommand};

mod bench;
mod demo;
mod pp_cmd;

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
    }
}
