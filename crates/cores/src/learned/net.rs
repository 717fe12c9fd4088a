//! Fig. 3's network in candle, with Table II's sizes.
//!
//! - Multi-head attention: 3 heads of dimension 4. The query is the current µVNF's
//!   row, keys and values are all µVNFs' rows (padding masked out); each head is a
//!   scaled dot-product attention; the heads' outputs are concatenated (12) and go
//!   through a dense layer of 16 with ReLU (the learnable non-linearity).
//! - The action summary (2 numbers per core) is concatenated with that, then two
//!   dense layers of 48 (ReLU).
//! - Dueling head (§IV-D): Q(s, m) = V(s) + A(s, m) − mean_m A(s, m).

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{linear, Linear, VarBuilder, VarMap};

use super::{Batch, ModelError, VNF_FEATURES};
use crate::CoresError;

pub const HEADS: usize = 3;
pub const HEAD_DIM: usize = 4;
pub const ATT_DENSE: usize = 16;
pub const HIDDEN: [usize; 2] = [48, 48];

pub(crate) fn net_err(what: &str, e: impl std::fmt::Display) -> CoresError {
    CoresError::Model(ModelError::Net(format!("{what}: {e}")))
}

impl From<learnkit::WeightError> for CoresError {
    fn from(e: learnkit::WeightError) -> Self {
        CoresError::Model(ModelError::Net(e.0))
    }
}

/// One Q-network for one core count.
pub struct QNet {
    pub(crate) vars: VarMap,
    pub cores: usize,
    pub max_vnfs: usize,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    att: Linear,
    fc1: Linear,
    fc2: Linear,
    value: Linear,
    adv: Linear,
}

impl QNet {
    pub fn new(cores: usize, max_vnfs: usize) -> Result<Self, CoresError> {
        if cores == 0 || cores > 1024 || max_vnfs == 0 || max_vnfs > 4096 {
            return Err(CoresError::invalid(
                "net",
                format!("need 1..=1024 cores and 1..=4096 µVNFs, got {cores} / {max_vnfs}"),
            ));
        }
        let vars = VarMap::new();
        let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
        let l =
            |i: usize, o: usize, n: &str| linear(i, o, vb.pp(n)).map_err(|e| net_err("init", e));
        let hd = HEADS * HEAD_DIM;
        Ok(QNet {
            wq: l(VNF_FEATURES, hd, "wq")?,
            wk: l(VNF_FEATURES, hd, "wk")?,
            wv: l(VNF_FEATURES, hd, "wv")?,
            att: l(hd, ATT_DENSE, "att")?,
            fc1: l(2 * cores + ATT_DENSE, HIDDEN[0], "fc1")?,
            fc2: l(HIDDEN[0], HIDDEN[1], "fc2")?,
            value: l(HIDDEN[1], 1, "value")?,
            adv: l(HIDDEN[1], cores, "adv")?,
            vars,
            cores,
            max_vnfs,
        })
    }

    /// Q-values, shape (B, |M|), from summary (B, 2|M|), all (B, N, 4), mask (B, N)
    /// and current (B, 4).
    pub fn forward(
        &self,
        summary: &Tensor,
        all: &Tensor,
        mask: &Tensor,
        current: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let (b, n, _) = all.dims3()?;
        let q = self.wq.forward(current)?.reshape((b, HEADS, HEAD_DIM, 1))?;
        let k = self
            .wk
            .forward(all)?
            .reshape((b, n, HEADS, HEAD_DIM))?
            .transpose(1, 2)?
            .contiguous()?;
        let v = self
            .wv
            .forward(all)?
            .reshape((b, n, HEADS, HEAD_DIM))?
            .transpose(1, 2)?
            .contiguous()?;
        let scale = 1.0 / (HEAD_DIM as f64).sqrt();
        let scores = (k.matmul(&q)?.squeeze(3)? * scale)?; // (B, H, N)
                                                           // Padding gets −1e9: exp() makes it 0 in the softmax.
        let pad = ((mask.ones_like()? - mask)? * -1e9)?.unsqueeze(1)?;
        let scores = scores.broadcast_add(&pad)?;
        let w = candle_nn::ops::softmax_last_dim(&scores)?.unsqueeze(2)?; // (B, H, 1, N)
        let heads = w.matmul(&v)?.reshape((b, HEADS * HEAD_DIM))?;
        let h = self.att.forward(&heads)?.relu()?;
        let x = Tensor::cat(&[summary, &h], 1)?;
        let x = self.fc1.forward(&x)?.relu()?;
        let x = self.fc2.forward(&x)?.relu()?;
        let val = self.value.forward(&x)?; // (B, 1)
        let adv = self.adv.forward(&x)?; // (B, M)
        let adv = adv.broadcast_sub(&adv.mean_keepdim(D::Minus1)?)?;
        adv.broadcast_add(&val)
    }

    /// Q-values of a batch, row-major (rows × |M|).
    pub fn q_values(&self, b: &Batch) -> Result<Vec<f32>, CoresError> {
        if b.rows == 0 {
            return Ok(Vec::new());
        }
        let [s, a, m, c] = b
            .tensors(self.cores, self.max_vnfs)
            .map_err(|e| net_err("input", e))?;
        self.forward(&s, &a, &m, &c)
            .and_then(|q| q.flatten_all())
            .and_then(|q| q.to_vec1::<f32>())
            .map_err(|e| net_err("forward", e))
    }
}

/// Copying, loading and seeding the weights: shared with placement's DDQN.
impl learnkit::QWeights for QNet {
    type Error = CoresError;

    fn vars(&self) -> &VarMap {
        &self.vars
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{generate, GenSpec, Seed};
    use crate::learned::Game;
    use learnkit::QWeights;

    #[test]
    fn q_values_are_permutation_invariant_and_ignore_padding() {
        let mut net = QNet::new(4, 16).unwrap();
        net.reseed(7).unwrap();
        let g = generate(&GenSpec::default(), 4, Seed::train(1)).unwrap();
        let p = g.problem;
        let game = Game::new(&p);
        let mut a = Batch::default();
        game.features(0, 16, &mut a);
        let qa = net.q_values(&a).unwrap();
        assert_eq!(qa.len(), 4);
        assert!(qa.iter().all(|q| q.is_finite()));
        // The same µVNF rows in another order (and padding garbage) give the same Q.
        let mut b = a.clone();
        let n = p.vnfs.len();
        let mut rows: Vec<Vec<f32>> = b.all.chunks(4).map(|c| c.to_vec()).collect();
        rows[..n].reverse();
        for r in rows.iter_mut().skip(n) {
            r.copy_from_slice(&[9.0, 9.0, 9.0, 9.0]);
        }
        b.all = rows.concat();
        let qb = net.q_values(&b).unwrap();
        for (x, y) in qa.iter().zip(&qb) {
            assert!((x - y).abs() < 1e-5, "{qa:?} vs {qb:?}");
        }
        // A different summary changes the answer.
        let mut c = a.clone();
        c.summary[0] = 3.0;
        assert_ne!(net.q_values(&c).unwrap(), qa);
        // Reseeding reproduces.
        let mut again = QNet::new(4, 16).unwrap();
        again.reseed(7).unwrap();
        assert_eq!(again.q_values(&a).unwrap(), qa);
    }
}
