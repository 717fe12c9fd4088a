//! `--pack-cpus`, which every plane's node command takes (docs/corepack.md).

use anyhow::{Context, Result};
use clap::Args;
use corepack::{CorePacker, PackSpec};

#[derive(Args, Debug, Clone)]
pub struct PackArgs {
    /// Pack the node's control threads onto the fewest of its CPUs that keep up:
    /// `auto` (the process's CPUs, lowest first), `off`, or a list in the order to use
    /// them (`0,1`, `2-3`). At low load a setup's thread hand-offs then stay on one
    /// CPU; the packer spreads them again as soon as the CPUs it uses are full. Data-path
    /// workers and threads pinned from outside (taskset) are never moved.
    #[arg(long, env = "STARFABRIC_PACK_CPUS", default_value = "off", value_parser = parse_spec)]
    pub pack_cpus: PackSpec,
}

fn parse_spec(s: &str) -> Result<PackSpec, String> {
    s.parse()
}

impl PackArgs {
    /// The running packer (None for `off`); stops when dropped.
    pub fn start(&self) -> Result<Option<CorePacker>> {
        self.pack_cpus.start().context("--pack-cpus")
    }
}
