//! The Q-network: one MLP shared by every node, scoring a node from its feature row
//! (see [`super::features`]). Q(S, e) = mlp(φ(S, e)).

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, VarBuilder, VarMap};
use learnkit::QWeights;

use super::features::N_FEATURES;
use crate::problem::PlaceError;

pub(crate) fn model_err(what: &str, e: impl std::fmt::Display) -> PlaceError {
    PlaceError::Model(format!("{what}: {e}"))
}

impl From<learnkit::WeightError> for PlaceError {
    fn from(e: learnkit::WeightError) -> Self {
        PlaceError::Model(e.0)
    }
}

/// One layer for the plain forward pass: weight transposed (`in × out`), bias.
type PlainLayer = (Vec<f32>, Vec<f32>);

/// A ReLU MLP `N_FEATURES → hidden… → 1` whose weights live in a [`VarMap`] (so an
/// optimiser can train them and the model file can store them by name).
pub struct QNet {
    pub(crate) vars: VarMap,
    layers: Vec<Linear>,
    pub(crate) hidden: Vec<usize>,
    /// The same weights as plain row-major arrays, for decisions: a 1,000-row
    /// forward pass through candle costs milliseconds in tensor setup and thread
    /// hand-offs on a loaded 2-core machine; this loop costs a fraction of one.
    /// Rebuilt lazily after the weights change (see [`QNet::invalidate`]).
    plain: Option<Vec<PlainLayer>>,
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
            plain: None,
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

    /// The weights changed (a training step): the plain copy is stale.
    pub fn invalidate(&mut self) {
        self.plain = None;
    }

    /// Each layer as (weight transposed to `in × out`, bias, out): the forward loop
    /// then runs axpy over outputs, which the compiler vectorises (a dot product per
    /// output would be a sequential float reduction).
    fn plain_layers(&mut self) -> Result<&[PlainLayer], PlaceError> {
        if self.plain.is_none() {
            let mut v = Vec::with_capacity(self.layers.len());
            for l in &self.layers {
                let w = l
                    .weight()
                    .t()
                    .and_then(|t| t.contiguous())
                    .and_then(|t| t.flatten_all())
                    .and_then(|t| t.to_vec1::<f32>())
                    .map_err(|e| model_err("weights", e))?;
                let out = l.weight().dims().first().copied().unwrap_or(0);
                let b = match l.bias() {
                    Some(b) => b.to_vec1::<f32>().map_err(|e| model_err("weights", e))?,
                    None => vec![0.0; out],
                };
                v.push((w, b));
            }
            self.plain = Some(v);
        }
        Ok(self.plain.as_deref().unwrap_or(&[]))
    }

    /// Q-values of row-major features (`rows × N_FEATURES`), computed without
    /// candle from the same weights (equal to [`QNet::score`] up to rounding).
    pub fn score_fast(&mut self, feats: &[f32]) -> Result<Vec<f32>, PlaceError> {
        let rows = feats.len() / N_FEATURES;
        let layers = self.plain_layers()?;
        let last = layers.len().saturating_sub(1);
        let mut out = Vec::with_capacity(rows);
        let mut a: Vec<f32> = Vec::new();
        let mut b: Vec<f32> = Vec::new();
        for x in feats.chunks_exact(N_FEATURES) {
            a.clear();
            a.extend_from_slice(x);
            for (li, (wt, bias)) in layers.iter().enumerate() {
                let d_out = bias.len();
                b.clear();
                b.extend_from_slice(bias);
                for (i, &ai) in a.iter().enumerate() {
                    // ReLU leaves many zeros: skipping them is exact.
                    if ai == 0.0 {
                        continue;
                    }
                    let col = &wt[i * d_out..(i + 1) * d_out];
                    for (bo, wo) in b.iter_mut().zip(col) {
                        *bo += wo * ai;
                    }
                }
                if li < last {
                    for v in b.iter_mut() {
                        *v = v.max(0.0);
                    }
                }
                std::mem::swap(&mut a, &mut b);
            }
            out.push(a.first().copied().unwrap_or(0.0));
        }
        Ok(out)
    }

    /// Q-values of row-major features (`rows × N_FEATURES`), through candle.
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

    /// A copy with its own weights (the target network θ').
    pub fn duplicate(&self) -> Result<QNet, PlaceError> {
        let mut n = QNet::new(&self.hidden)?;
        n.load_tensors(&self.tensors())?;
        Ok(n)
    }
}

/// Copying, loading and seeding the weights: shared with cores' learned assigner.
impl learnkit::QWeights for QNet {
    type Error = PlaceError;

    fn vars(&self) -> &VarMap {
        &self.vars
    }

    fn weights_changed(&mut self) {
        self.invalidate();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_forward_matches_candle() {
        let mut net = QNet::new(&[16, 8]).unwrap();
        net.reseed(5).unwrap();
        let feats: Vec<f32> = (0..7 * N_FEATURES)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        let a = net.score(&feats).unwrap();
        let b = net.score_fast(&feats).unwrap();
        assert_eq!(a.len(), 7);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-4, "{a:?} vs {b:?}");
        }
        // New weights invalidate the plain copy.
        net.reseed(6).unwrap();
        let c = net.score_fast(&feats).unwrap();
        let d = net.score(&feats).unwrap();
        assert_ne!(b, c);
        for (x, y) in c.iter().zip(&d) {
            assert!((x - y).abs() < 1e-4);
        }
    }
}
