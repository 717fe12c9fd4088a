//! Building a chain instance from the configuration FM pushes.

use nf::{Chain, NetworkFunction};
use proto::ChainParts;

use crate::ScError;

/// Builds the NF instances of a chain (with empty state). Every replica of a group
/// builds the same chain from the same configuration, so a factory must be
/// deterministic too: a pure function of the configuration, reading no clock, file or
/// random source. A node may build a chain ahead of the start that uses it
/// ([`crate::spares`]).
pub trait ChainFactory: Send + Sync + 'static {
    fn build_nf(&self, config: &str) -> Result<Box<dyn NetworkFunction>, ScError>;

    fn build(&self, parts: &ChainParts) -> Result<Chain, ScError> {
        let nfs = parts
            .nfs
            .iter()
            .map(|c| self.build_nf(c))
            .collect::<Result<Vec<_>, _>>()?;
        let mut chain = Chain::new(nfs, parts.spec.clone(), parts.forward, parts.reverse)
            .map_err(|e| ScError::Chain(e.to_string()))?;
        chain
            .set_partition(parts.partition)
            .map_err(|e| ScError::Chain(e.to_string()))?;
        Ok(chain)
    }
}

/// The built-in NFs of the `nfs` crate, configured by `nfs::NfConfig` JSON.
#[derive(Debug, Default, Clone, Copy)]
pub struct BuiltinNfs;

impl ChainFactory for BuiltinNfs {
    fn build_nf(&self, config: &str) -> Result<Box<dyn NetworkFunction>, ScError> {
        let cfg: nfs::NfConfig =
            serde_json::from_str(config).map_err(|e| ScError::Chain(format!("{config}: {e}")))?;
        nfs::build(&cfg).map_err(|e| ScError::Chain(e.to_string()))
    }
}
