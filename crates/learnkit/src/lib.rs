//! The parts of a Q-network's life that do not depend on its shape, shared by the
//! workspace's two learned agents: `cores` (sfc2cpu's core assigner) and `placement`
//! (the DDQN placer). Neither depends on the other, and both keep their weights in a
//! candle [`VarMap`], so the weight handling is written once here.
//!
//! Errors are plain messages: each agent wraps them in its own error type.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;

/// Why weights could not be loaded or made: a message, which each agent wraps in its
/// own error type (`From<WeightError>`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct WeightError(pub String);

/// A network whose weights live in a candle [`VarMap`]: copying, loading and seeding
/// them does not depend on the network's shape, so both agents' `QNet`s get it here.
pub trait QWeights {
    /// The agent's error type, which takes a [`WeightError`].
    type Error: From<WeightError>;

    /// Where the weights live.
    fn vars(&self) -> &VarMap;

    /// The weights were overwritten (a network keeping a derived copy drops it here).
    fn weights_changed(&mut self) {}

    /// Named weights (copies), for a model file or a target network.
    fn tensors(&self) -> HashMap<String, Tensor> {
        let data = self.vars().data().lock().unwrap_or_else(|p| p.into_inner());
        data.iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().clone()))
            .collect()
    }

    /// Overwrites every weight from `src`; names and shapes must match.
    fn load_tensors(&mut self, src: &HashMap<String, Tensor>) -> Result<(), Self::Error> {
        load(self.vars(), src)?;
        self.weights_changed();
        Ok(())
    }

    /// Re-initialises every weight uniformly in ±1/√fan_in (candle's own default
    /// scheme) from a generator seeded with `seed`, so a training run is reproducible.
    fn reseed(&mut self, seed: u64) -> Result<(), Self::Error> {
        let fresh = uniform_init(&self.tensors(), seed)?;
        tracing::debug!(seed, tensors = fresh.len(), "weights re-initialised");
        self.load_tensors(&fresh)
    }

    /// How many numbers the weights hold.
    fn param_count(&self) -> usize {
        self.tensors().values().map(|t| t.elem_count()).sum()
    }
}

fn load(vars: &VarMap, src: &HashMap<String, Tensor>) -> Result<(), WeightError> {
    let data = vars.data().lock().unwrap_or_else(|p| p.into_inner());
    if data.len() != src.len() {
        return Err(WeightError(format!(
            "the weights hold {} tensors, the network needs {}",
            src.len(),
            data.len()
        )));
    }
    for (name, var) in data.iter() {
        let t = src
            .get(name)
            .ok_or_else(|| WeightError(format!("weight {name:?} is missing")))?;
        if t.dims() != var.dims() {
            return Err(WeightError(format!(
                "weight {name:?} has shape {:?}, the network needs {:?}",
                t.dims(),
                var.dims()
            )));
        }
        let t = t
            .to_dtype(DType::F32)
            .and_then(|t| t.copy())
            .map_err(|e| WeightError(format!("{name}: {e}")))?;
        var.set(&t)
            .map_err(|e| WeightError(format!("{name}: {e}")))?;
    }
    Ok(())
}

/// Fresh weights of the names and shapes of `current`, uniform in ±1/√fan_in. A bias
/// takes the fan-in of its layer's weight (the name with `bias` for `weight`); names
/// are drawn in sorted order, so the seed alone fixes the result.
fn uniform_init(
    current: &HashMap<String, Tensor>,
    seed: u64,
) -> Result<HashMap<String, Tensor>, WeightError> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut names: Vec<&String> = current.keys().collect();
    names.sort();
    let mut fresh = HashMap::new();
    for name in names {
        let dims = current[name].dims().to_vec();
        let w = name.replace("bias", "weight");
        let fan_in = current
            .get(&w)
            .and_then(|t| t.dims().get(1).copied())
            .unwrap_or(1);
        let bound = 1.0 / (fan_in.max(1) as f32).sqrt();
        let n: usize = dims.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-bound..bound)).collect();
        let t = Tensor::from_vec(v, dims.as_slice(), &Device::Cpu)
            .map_err(|e| WeightError(format!("init: {e}")))?;
        fresh.insert(name.clone(), t);
    }
    Ok(fresh)
}

/// The mean loss over the first and over the last fifth of a training run's `losses`
/// (a fifth is at least one value; the mean of none is 0): how far training went.
pub fn fifth_means(losses: &[f64]) -> (f64, f64) {
    let fifth = (losses.len() / 5).max(1);
    let mean = |s: &[f64]| {
        if s.is_empty() {
            0.0
        } else {
            s.iter().sum::<f64>() / s.len() as f64
        }
    };
    (
        mean(&losses[..fifth.min(losses.len())]),
        mean(&losses[losses.len().saturating_sub(fifth)..]),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifth_means_of_short_and_long_runs() {
        assert_eq!(fifth_means(&[]), (0.0, 0.0));
        assert_eq!(fifth_means(&[2.0]), (2.0, 2.0));
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(fifth_means(&ten), (1.5, 9.5));
    }
}
