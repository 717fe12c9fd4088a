//! The Q-network: one MLP shared by every node, scoring a node from its feature row
//! (see [`super::features`]). Q(S, e) = mlp(φ(S, e)).

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, VarBuilder, VarMap};

use super::features::N_FEATURES;
use crate::problem::PlaceError;

pub(crate) fn model_err(what: &str, e: impl std::fmt::Display) -> PlaceError {
    PlaceError::Model(format!("{what}: {e}"))
}

/// A ReLU MLP `N_FEATURES → hidden… → 1` whose weights live in a [`VarMap`] (so an
/// optimiser can train them and the model file can store them by name).
pub struct QNet {
    pub(crate) vars: VarMap,
    layers: Vec<Linear>,
    pub(crate) hidden: Vec<usize>,
}

impl QNet {
    /// A freshly initialised network (candle's default Kaiming-uniform init; the
    /// initial values come from candle's own generator, so two networks differ).
    pub fn new(hidden: &[usize]) -> Result<Self, PlaceError> {
        if hidden.is_empty() || hidden.iter().any(|&h| h == 0 || h > 4096) {
            return Err(PlaceError::invalid(
                "hidden",
                format!("hidden layer sizes must be 1..=4096, at least one layer; got {hidden:?}"),
            ));
        }
        let vars = VarMap::new();
        let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
        let mut layers = Vec::new();
        let mut d_in = N_FEATURES;
        for (i, &h) in hidden.iter().enumerate() {
            layers.push(linear(d_in, h, vb.pp(format!("l{i}"))).map_err(|e| model_err("init", e))?);
            d_in = h;
        }
        layers.push(
            linear(d_in, 1, vb.pp(format!("l{}", hidden.len())))
                .map_err(|e| model_err("init", e))?,
        );
        Ok(QNet {
            vars,
            layers,
            hidden: hidden.to_vec(),
        })
    }

    /// Q-values of a `rows × N_FEATURES` batch, shape `[rows]`.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        let last = self.layers.len() - 1;
        for (i, l) in self.layers.iter().enumerate() {
            h = l.forward(&h)?;
            if i < last {
                h = h.relu()?;
            }
        }
        h.squeeze(1)
    }

    /// Q-values of row-major features (`rows × N_FEATURES`).
    pub fn score(&self, feats: &[f32]) -> Result<Vec<f32>, PlaceError> {
        let rows = feats.len() / N_FEATURES;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let x = Tensor::from_slice(feats, (rows, N_FEATURES), &Device::Cpu)
            .map_err(|e| model_err("input", e))?;
        let q = self.forward(&x).map_err(|e| model_err("forward", e))?;
        q.to_vec1::<f32>().map_err(|e| model_err("forward", e))
    }

    /// Named weights (copies), for the model file and for the target network.
    pub fn tensors(&self) -> HashMap<String, Tensor> {
        let data = self.vars.data().lock().unwrap_or_else(|p| p.into_inner());
        data.iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
            .collect()
    }

    /// Overwrites every weight from `src` (names and shapes must match).
    pub fn load_tensors(&self, src: &HashMap<String, Tensor>) -> Result<(), PlaceError> {
        let data = self.vars.data().lock().unwrap_or_else(|p| p.into_inner());
        if data.len() != src.len() {
            return Err(PlaceError::Model(format!(
                "the weights hold {} tensors, the network needs {}",
                src.len(),
                data.len()
            )));
        }
        for (name, var) in data.iter() {
            let t = src
                .get(name)
                .ok_or_else(|| PlaceError::Model(format!("weight {name:?} is missing")))?;
            if t.dims() != var.dims() {
                return Err(PlaceError::Model(format!(
                    "weight {name:?} has shape {:?}, the network needs {:?}",
                    t.dims(),
                    var.dims()
                )));
            }
            let t = t
                .to_dtype(DType::F32)
                .and_then(|t| t.copy())
                .map_err(|e| model_err(name, e))?;
            var.set(&t).map_err(|e| model_err(name, e))?;
        }
        Ok(())
    }

    /// A copy with its own weights (the target network θ').
    pub fn duplicate(&self) -> Result<QNet, PlaceError> {
        let n = QNet::new(&self.hidden)?;
        n.load_tensors(&self.tensors())?;
        Ok(n)
    }

    /// Re-initialises every weight uniformly in ±1/√fan_in (candle's own default
    /// scheme) from a seeded generator, so a training run is reproducible.
    pub fn reseed(&self, seed: u64) -> Result<(), PlaceError> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let mut names: Vec<(String, Vec<usize>)> = self
            .tensors()
            .into_iter()
            .map(|(k, t)| (k, t.dims().to_vec()))
            .collect();
        names.sort();
        let mut fresh = HashMap::new();
        for (name, dims) in names {
            let fan_in = if name.ends_with("weight") {
                dims.get(1).copied().unwrap_or(1)
            } else {
                // A bias takes the fan-in of its layer's weight.
                let w = name.replace("bias", "weight");
                self.tensors()
                    .get(&w)
                    .and_then(|t| t.dims().get(1).copied())
                    .unwrap_or(1)
            };
            let bound = 1.0 / (fan_in.max(1) as f32).sqrt();
            let n: usize = dims.iter().product();
            let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-bound..bound)).collect();
            let t = Tensor::from_vec(v, dims.as_slice(), &Device::Cpu)
                .map_err(|e| model_err("init", e))?;
            fresh.insert(name, t);
        }
        self.load_tensors(&fresh)
    }

    pub fn param_count(&self) -> usize {
        self.tensors().values().map(|t| t.elem_count()).sum()
    }
}
