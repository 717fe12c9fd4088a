//! The model file: one safetensors file holding a Q-network per core count (tensor
//! names prefixed `c<cores>.`), with a JSON header in its metadata under
//! `starfabric.header`: format and version, the input layout, the architecture, the
//! core counts, the most µVNFs, and how it was trained.
//!
//! A file is refused with a typed [`ModelError`] when it is missing, not safetensors,
//! has no or a bad header, is of another format or version, was trained on another
//! input layout or architecture, or its weights do not fit.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::Device;
use learnkit::QWeights;
use serde::{Deserialize, Serialize};

use super::net::{QNet, ATT_DENSE, HEADS, HEAD_DIM, HIDDEN};
use super::train::{TrainConfig, TrainMetrics};
use super::{LearnedAssigner, ModelError, FEATURES};
use crate::CoresError;

pub const MODEL_FORMAT: &str = "starfabric-cores-sfc2cpu";
/// Bump when the header, the inputs' meaning or the network changes.
pub const MODEL_VERSION: u32 = 1;
const HEADER_KEY: &str = "starfabric.header";

/// The architecture, stored to refuse a file built for another one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetInfo {
    pub heads: usize,
    pub head_dim: usize,
    pub att_dense: usize,
    pub hidden: Vec<usize>,
    pub dueling: bool,
}

impl NetInfo {
    pub fn this_build() -> Self {
        NetInfo {
            heads: HEADS,
            head_dim: HEAD_DIM,
            att_dense: ATT_DENSE,
            hidden: HIDDEN.to_vec(),
            dueling: true,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelHeader {
    pub format: String,
    pub version: u32,
    pub features: Vec<String>,
    pub net: NetInfo,
    /// Core counts with a network.
    pub cores: Vec<usize>,
    /// Most µVNFs a problem may have.
    pub max_vnfs: usize,
    pub train: Option<TrainConfig>,
    /// Per core count.
    pub metrics: BTreeMap<usize, TrainMetrics>,
}

/// Trained networks with their header.
pub struct Sfc2cpuModel {
    pub header: ModelHeader,
    pub(crate) nets: BTreeMap<usize, QNet>,
}

impl std::fmt::Debug for Sfc2cpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sfc2cpuModel")
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

fn prefix(cores: usize) -> String {
    format!("c{cores}.")
}

impl Sfc2cpuModel {
    pub fn to_bytes(&self) -> Result<Vec<u8>, CoresError> {
        let corrupt = |m: String| {
            CoresError::Model(ModelError::Corrupt {
                source_name: "(writing)".into(),
                reason: m,
            })
        };
        let header = serde_json::to_string(&self.header).map_err(|e| corrupt(e.to_string()))?;
        let meta = HashMap::from([(HEADER_KEY.to_string(), header)]);
        let mut all = HashMap::new();
        for (&c, net) in &self.nets {
            for (k, t) in net.tensors() {
                all.insert(format!("{}{k}", prefix(c)), t);
            }
        }
        safetensors::serialize(all, Some(meta)).map_err(|e| corrupt(e.to_string()))
    }

    /// Reads a model from a file's bytes; `what` names the source in errors.
    pub fn from_bytes(bytes: &[u8], what: &str) -> Result<Self, ModelError> {
        let corrupt = |m: String| ModelError::Corrupt {
            source_name: what.to_string(),
            reason: m,
        };
        let (_, meta) = safetensors::SafeTensors::read_metadata(bytes)
            .map_err(|e| corrupt(format!("not a safetensors model file ({e})")))?;
        let text = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get(HEADER_KEY))
            .ok_or_else(|| corrupt(format!("no {HEADER_KEY:?} header in the metadata")))?;
        // Format and version first, so a future header layout still says "version".
        let probe: serde_json::Value =
            serde_json::from_str(text).map_err(|e| corrupt(format!("bad header: {e}")))?;
        let format = probe.get("format").and_then(|v| v.as_str()).unwrap_or("");
        if format != MODEL_FORMAT {
            return Err(ModelError::Format {
                source_name: what.to_string(),
                found: format.to_string(),
            });
        }
        let version = probe.get("version").and_then(|v| v.as_u64()).unwrap_or(0);
        if version != u64::from(MODEL_VERSION) {
            return Err(ModelError::Version {
                source_name: what.to_string(),
                found: u32::try_from(version).unwrap_or(u32::MAX),
                expected: MODEL_VERSION,
            });
        }
        let header: ModelHeader =
            serde_json::from_str(text).map_err(|e| corrupt(format!("bad header: {e}")))?;
        if header.features != FEATURES {
            return Err(corrupt(format!(
                "trained on inputs {:?}, this build computes {:?}",
                header.features, FEATURES
            )));
        }
        if header.net != NetInfo::this_build() {
            return Err(corrupt(format!(
                "network {:?}, this build runs {:?}",
                header.net,
                NetInfo::this_build()
            )));
        }
        if header.cores.is_empty() || header.max_vnfs == 0 {
            return Err(corrupt("no core counts or max_vnfs = 0".into()));
        }
        let tensors = candle_core::safetensors::load_buffer(bytes, &Device::Cpu)
            .map_err(|e| corrupt(format!("weights: {e}")))?;
        let mut nets = BTreeMap::new();
        for &c in &header.cores {
            let p = prefix(c);
            let mine: HashMap<String, _> = tensors
                .iter()
                .filter_map(|(k, t)| k.strip_prefix(&p).map(|s| (s.to_string(), t.clone())))
                .collect();
            let mut net = QNet::new(c, header.max_vnfs).map_err(|e| corrupt(e.to_string()))?;
            net.load_tensors(&mine)
                .map_err(|e| corrupt(format!("{c} cores: {e}")))?;
            nets.insert(c, net);
        }
        Ok(Sfc2cpuModel { header, nets })
    }

    pub fn save(&self, path: impl AsRef<Path>) -> Result<(), CoresError> {
        let path = path.as_ref();
        let bytes = self.to_bytes()?;
        // Write then rename: a reader never sees half a model.
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, &bytes)
            .and_then(|_| std::fs::rename(&tmp, path))
            .map_err(|e| {
                CoresError::Model(ModelError::Missing {
                    path: path.display().to_string(),
                    reason: e.to_string(),
                })
            })
    }

    pub fn load(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| ModelError::Missing {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        Sfc2cpuModel::from_bytes(&bytes, &path.display().to_string())
    }

    /// An assigner running (a copy of) these networks.
    pub fn assigner(&self) -> LearnedAssigner {
        let nets = self
            .nets
            .iter()
            .filter_map(|(&c, n)| {
                let mut copy = QNet::new(c, self.header.max_vnfs).ok()?;
                copy.load_tensors(&n.tensors()).ok()?;
                Some((c, copy))
            })
            .collect();
        LearnedAssigner::new(nets, self.header.max_vnfs)
    }

    pub fn param_count(&self) -> usize {
        self.nets.values().map(QNet::param_count).sum()
    }

    /// Seeded, untrained networks for `cores`: what training starts from, and a
    /// stand-in for tests that need a model but not a good one.
    pub fn untrained(cores: &[usize], max_vnfs: usize, seed: u64) -> Result<Self, CoresError> {
        let mut nets = BTreeMap::new();
        for &c in cores {
            let mut n = QNet::new(c, max_vnfs)?;
            n.reseed(seed ^ c as u64)?;
            nets.insert(c, n);
        }
        Ok(Sfc2cpuModel {
            header: ModelHeader {
                format: MODEL_FORMAT.into(),
                version: MODEL_VERSION,
                features: FEATURES.iter().map(|s| s.to_string()).collect(),
                net: NetInfo::this_build(),
                cores: cores.to_vec(),
                max_vnfs,
                train: None,
                metrics: BTreeMap::new(),
            },
            nets,
        })
    }

    /// The model trained with [`super::TrainConfig::standard`] and committed at
    /// `models/sfc2cpu-v1.safetensors`, compiled into the build so the node always
    /// has one (a `--model` file can replace it).
    pub fn shipped() -> Result<Self, ModelError> {
        Sfc2cpuModel::from_bytes(SHIPPED, "the shipped model (models/sfc2cpu-v1.safetensors)")
    }
}

const SHIPPED: &[u8] = include_bytes!("../../models/sfc2cpu-v1.safetensors");

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assign::Assigner;
    use crate::generate::{generate, GenSpec, Seed};

    fn untrained(cores: &[usize]) -> Sfc2cpuModel {
        Sfc2cpuModel::untrained(cores, 16, 1).unwrap()
    }

    #[test]
    fn the_shipped_model_loads_and_covers_table_i() {
        let m = Sfc2cpuModel::shipped().unwrap();
        for c in crate::generate::TABLE_I_CORES {
            assert!(m.header.cores.contains(&c), "{:?}", m.header.cores);
        }
        assert!(m.header.max_vnfs >= 16);
        assert!(m.header.train.is_some());
    }

    #[test]
    fn round_trip_keeps_header_and_decisions() {
        let m = untrained(&[4, 8]);
        let dir = std::env::temp_dir().join(format!("cores-model-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.safetensors");
        m.save(&path).unwrap();
        let back = Sfc2cpuModel::load(&path).unwrap();
        assert_eq!(back.header, m.header);
        for cores in [4, 8] {
            let p = generate(&GenSpec::default(), cores, Seed::test(2))
                .unwrap()
                .problem;
            let a = m.assigner().assign(&p).unwrap();
            assert_eq!(a, back.assigner().assign(&p).unwrap());
            a.validate(&p).unwrap();
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn load_or_fallback_gives_rr_and_the_reason_on_a_bad_file() {
        let (a, why) = crate::learned::load_or_fallback(Path::new("/nonexistent/s2c.safetensors"));
        assert_eq!(a.name(), "rr");
        let why = why.unwrap();
        assert!(
            why.contains("using RR") && why.contains("/nonexistent/s2c.safetensors"),
            "{why}"
        );
        let dir = std::env::temp_dir().join(format!("cores-fallback-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let junk = dir.join("junk.safetensors");
        std::fs::write(&junk, b"garbage").unwrap();
        let (a, why) = crate::learned::load_or_fallback(&junk);
        assert_eq!(a.name(), "rr");
        assert!(why.unwrap().contains("corrupt"));
        let good = dir.join("good.safetensors");
        untrained(&[4]).save(&good).unwrap();
        let (a, why) = crate::learned::load_or_fallback(&good);
        assert_eq!(a.name(), "s2c");
        assert!(why.is_none());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn bad_files_are_typed_errors() {
        assert!(matches!(
            Sfc2cpuModel::load("/nonexistent/s2c.safetensors"),
            Err(ModelError::Missing { .. })
        ));
        assert!(matches!(
            Sfc2cpuModel::from_bytes(b"not a model", "junk"),
            Err(ModelError::Corrupt { .. })
        ));
        let good = untrained(&[4]).to_bytes().unwrap();
        assert!(matches!(
            Sfc2cpuModel::from_bytes(&good[..good.len() / 2], "half"),
            Err(ModelError::Corrupt { .. })
        ));
        let mut m = untrained(&[4]);
        m.header.version = MODEL_VERSION + 1;
        let e = Sfc2cpuModel::from_bytes(&m.to_bytes().unwrap(), "future").unwrap_err();
        assert!(matches!(e, ModelError::Version { found, .. } if found == MODEL_VERSION + 1));
        assert!(e.to_string().contains("version"));
        let mut m = untrained(&[4]);
        m.header.format = "other".into();
        assert!(matches!(
            Sfc2cpuModel::from_bytes(&m.to_bytes().unwrap(), "fmt"),
            Err(ModelError::Format { .. })
        ));
        let mut m = untrained(&[4]);
        m.header.features.pop();
        assert!(matches!(
            Sfc2cpuModel::from_bytes(&m.to_bytes().unwrap(), "layout"),
            Err(ModelError::Corrupt { .. })
        ));
        // The header claims a core count whose weights are not in the file.
        let mut m = untrained(&[4]);
        m.header.cores = vec![4, 8];
        let e = Sfc2cpuModel::from_bytes(&m.to_bytes().unwrap(), "shape").unwrap_err();
        assert!(e.to_string().contains("8 cores"), "{e}");
    }

    #[test]
    fn the_assigner_refuses_what_it_was_not_trained_for() {
        let a = untrained(&[4]).assigner();
        let mut p = generate(&GenSpec::default(), 4, Seed::test(1))
            .unwrap()
            .problem;
        p.cores = 6;
        assert!(matches!(
            a.assign(&p),
            Err(CoresError::NoNetForCores { cores: 6, .. })
        ));
        p.cores = 4;
        while p.vnfs.len() <= 16 {
            p.vnfs.push(crate::problem::Vnf { cost_cycles: 100.0 });
            let j = p.vnfs.len() - 1;
            p.sfcs[0].vnfs.push(j);
        }
        let e = a.assign(&p).unwrap_err();
        assert!(matches!(e, CoresError::TooManyVnfs { max: 16, .. }), "{e}");
        assert!(e.to_string().contains("trained for at most 16"));
    }
}
