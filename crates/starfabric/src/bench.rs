//! `starfabric bench`.

use anyhow::Result;
use clap::Subcommand;

#[derive(Subcommand)]
pub enum BenchCmd {}

pub fn run(_c: BenchCmd) -> Result<()> {
    anyhow::bail!("not yet")
}
