//! `starfabric demo`.

use anyhow::Result;
use clap::Args;

#[derive(Args)]
pub struct DemoArgs {}

pub fn run(_a: DemoArgs) -> Result<()> {
    anyhow::bail!("not yet")
}
