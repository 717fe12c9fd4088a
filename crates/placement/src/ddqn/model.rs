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
use learnkit::QWeights;
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
    /// How it was trained (None for a model not made by [`super::train()`]).
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
        let mut net = QNet::new(&header.hidden).map_err(|e| err(e.to_string()))?;
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

    /// The model trained by `starfabric placement train` with
    /// [`super::TrainConfig::standard`] and committed at `models/ddqn.safetensors`,
    /// compiled into the build so a node never runs without one.
    pub fn shipped() -> Result<Self, PlaceError> {
        DdqnModel::from_bytes(SHIPPED, "the shipped model (models/ddqn.safetensors)")
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

const SHIPPED: &[u8] = include_bytes!("../../models/ddqn.safetensors");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{ClusterState, Limits, Node, PlaceError, Placer, Request, Resources};

    fn model() -> DdqnModel {
        let mut net = QNet::new(&[8]).unwrap();
        net.reseed(3).unwrap();
        DdqnModel {
            header: ModelHeader {
                format: MODEL_FORMAT.into(),
                version: MODEL_VERSION,
                features: FEATURES.iter().map(|s| s.to_string()).collect(),
                hidden: vec![8],
                reward: RewardKind::Paper,
                filter: FilterParams::default(),
                train: None,
                metrics: TrainMetrics::default(),
            },
            net,
        }
    }

    fn state() -> (ClusterState, Request) {
        let nodes = (0..5)
            .map(|i| Node {
                id: format!("n{i}"),
                capacity: Resources::new(10.0 + i as f64, 8.0, 16.0),
                price: 1.0 + i as f64 * 0.1,
            })
            .collect();
        let limits = Limits::checked(0.8, 2, 3, 1).unwrap();
        let req = Request {
            tenant: "t".into(),
            demand: Resources::new(2.0, 1.0, 3.0),
        };
        (ClusterState::new(nodes, limits).unwrap(), req)
    }

    #[test]
    fn round_trip_keeps_header_and_scores() {
        let m = model();
        let dir = std::env::temp_dir().join(format!("ddqn-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.safetensors");
        m.save(&path).unwrap();
        let back = DdqnModel::load(&path).unwrap();
        assert_eq!(back.header, m.header);
        let (s, r) = state();
        let qa = m.placer().unwrap().q_values(&s, &r).unwrap();
        let qb = back.placer().unwrap().q_values(&s, &r).unwrap();
        assert_eq!(qa, qb);
        assert_eq!(qa.len(), 5);
        // The placer answers feasibly and refuses bad input without panicking.
        let mut p = back.placer().unwrap();
        let set = p.place(&s, &r).unwrap();
        assert!(s.feasible(&r, &set).is_ok());
        let bad = Request {
            tenant: "x".into(),
            demand: Resources::new(f64::NAN, 1.0, 1.0),
        };
        assert!(p.place(&s, &bad).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }

    fn model_err(r: Result<DdqnModel, PlaceError>) -> String {
        match r {
            Err(PlaceError::Model(m)) => m,
            other => panic!("expected PlaceError::Model, got {other:?}"),
        }
    }

    #[test]
    fn bad_files_are_refused_with_a_reason() {
        let e = model_err(DdqnModel::load("/nonexistent/ddqn.safetensors"));
        assert!(e.contains("/nonexistent/ddqn.safetensors"), "{e}");
        let e = model_err(DdqnModel::from_bytes(b"not a model at all", "junk"));
        assert!(e.contains("junk") && e.contains("safetensors"), "{e}");
        let good = model().to_bytes().unwrap();
        let e = model_err(DdqnModel::from_bytes(&good[..good.len() / 2], "half"));
        assert!(e.contains("half"), "{e}");

        let mut m = model();
        m.header.version = MODEL_VERSION + 1;
        let e = model_err(DdqnModel::from_bytes(&m.to_bytes().unwrap(), "future"));
        assert!(e.contains("version"), "{e}");
        let mut m = model();
        m.header.features.pop();
        let e = model_err(DdqnModel::from_bytes(&m.to_bytes().unwrap(), "layout"));
        assert!(e.contains("features"), "{e}");
        let mut m = model();
        m.header.hidden = vec![16];
        let e = model_err(DdqnModel::from_bytes(&m.to_bytes().unwrap(), "shape"));
        assert!(e.contains("shape"), "{e}");
    }
}
