//! `starfabric pp`: run a PP node.

use anyhow::Result;
use clap::Args;

#[derive(Args)]
pub struct PpArgs {}

pub fn run(_a: PpArgs) -> Result<()> {
    anyhow::bail!("not yet")
}
