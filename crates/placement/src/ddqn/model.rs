//! The model file: one safetensors file holding the Q-network's weights, with a JSON
//! header in its metadata under the key `starfabric.header`: format name and version,
//! the feature layout, layer sizes, the reward and Filtering Algorithm parameters the
//! agent runs with, the training configuration (seeds included) and its metrics.
//!
//! A file is refused, with [`PlaceError::Model`] naming the reason, when it is missing,
//! not safetensors, has no or a bad header, is of another format or version, was
//! trained on another feature layout, or its weights do not fit the layer sizes.

use std::collections::HashMap;
use std::path::Path;

use candle_core::Device;
use serde::{Deserialize, Serialize};

use super::features::FEATURES;
use super::filter::{FilterParams, RewardKind};
use super::net::QNet;
use super::train::{TrainConfig, TrainMetrics};
use super::Ddqn;
use crate::problem::PlaceError;

pub const MODEL_FORMAT: &str = "starfabric-placement-ddqn";
/// Bump when the header, the feature layout's meaning or the network changes.
pub const MODEL_VERSION: u32 = 1;
const HEADER_KEY: &str = "starfabric.header";

/// Everything about a model except its weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelHeader {
    pub format: String,
    pub version: u32,
    pub features: Vec<String>,
    pub hidden: Vec<usize>,
    pub reward: RewardKind,
    pub filter: FilterParams,
    /// How it was trained (None for a model not made by [`super::train`]).
    pub train: Option<TrainConfig>,
    pub metrics: TrainMetrics,
}

/// A trained Q-network with its header.
pub struct DdqnModel {
    pub header: ModelHeader,
    pub(crate) net: QNet,
}

impl std::fmt::Debug for DdqnModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DdqnModel")
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

impl DdqnModel {
    /// The file's bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, PlaceError> {
        let header = serde_json::to_string(&self.header)
            .map_err(|e| PlaceError::Model(format!("header: {e}")))?;
        let meta = HashMap::from([(HEADER_KEY.to_string(), header)]);
        let tensors = self.net.tensors();
        safetensors::serialize(tensors, Some(meta))
            .map_err(|e| PlaceError::Model(format!("weights: {e}")))
    }

    /// Reads a model from a file's bytes; `what` names the source in errors.
    pub fn from_bytes(bytes: &[u8], what: &str) -> Result<Self, PlaceError> {
        let err = |m: String| PlaceError::Model(format!("{what}: {m}"));
        let (_, meta) = safetensors::SafeTensors::read_metadata(bytes)
            .map_err(|e| err(format!("not a safetensors model file ({e})")))?;
        let text = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get(HEADER_KEY))
            .ok_or_else(|| err(format!("no {HEADER_KEY:?} header in the metadata")))?;
        let header: ModelHeader =
            serde_json::from_str(text).map_err(|e| err(format!("bad header: {e}")))?;
        if header.format != MODEL_FORMAT {
            return Err(err(format!(
                "format {:?}, expected {MODEL_FORMAT:?}",
                header.format
            )));
        }
        if header.version != MODEL_VERSION {
            return Err(err(format!(
                "model version {}, this build reads version {MODEL_VERSION}; retrain or use a matching build",
                header.version
            )));
        }
        if header.features != FEATURES {
            return Err(err(format!(
                "trained on features {:?}, this build computes {:?}",
                header.features, FEATURES
            )));
        }
        let net = QNet::new(&header.hidden).map_err(|e| err(e.to_string()))?;
        let tensors = candle_core::safetensors::load_buffer(bytes, &Device::Cpu)
            .map_err(|e| err(format!("weights: {e}")))?;
        net.load_tensors(&tensors).map_err(|e| err(e.to_string()))?;
        Ok(DdqnModel { header, net })
    }

    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), PlaceError> {
        let path = path.as_ref();
        let bytes = self.to_bytes()?;
        // Write then rename: a reader never sees half a model.
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, &bytes)
            .and_then(|_| std::fs::rename(&tmp, path))
            .map_err(|e| PlaceError::Model(format!("{}: {e}", path.display())))
    }

    pub fn load(path: impl AsRef<Path>) -> Result<Self, PlaceError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path)
            .map_err(|e| PlaceError::Model(format!("{}: {e}", path.display())))?;
        DdqnModel::from_bytes(&bytes, &path.display().to_string())
    }

    /// A placer running this model (its own copy of the weights).
    pub fn placer(&self) -> Result<Ddqn, PlaceError> {
        Ok(Ddqn::from_net(
            self.net.duplicate()?,
            self.header.filter,
            self.header.reward,
        ))
    }

    pub fn param_count(&self) -> usize {
        self.net.param_count()
    }
}
