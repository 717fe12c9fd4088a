//! Validating the twin against the node (issue 17): Spearman's ρ between the twin's
//! and the measured throughput of the assigners, and scaling a generated instance to
//! what this machine's workers can run (few cores, costs in µs a test worker burns).
//! The measurement itself belongs to the SC node's worker pool.

use crate::problem::{Problem, Sfc, Vnf};
use crate::CoresError;

/// Average ranks (1-based), ties sharing the mean of their positions.
fn ranks(x: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[a].total_cmp(&x[b]));
    let mut r = vec![0.0; x.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && x[idx[j + 1]] == x[idx[i]] {
            j += 1;
        }
        let mean = (i + j) as f64 / 2.0 + 1.0;
        for &k in &idx[i..=j] {
            r[k] = mean;
        }
        i = j + 1;
    }
    r
}

/// Spearman's rank correlation: Pearson's r of the ranks (ties averaged). NaN when
/// it is undefined: lengths differ, fewer than 2 values, a NaN value, or one side
/// constant.
pub fn spearman(a: &[f64], b: &[f64]) -> f64 {
    if a.len() != b.len() || a.len() < 2 || a.iter().chain(b).any(|v| v.is_nan()) {
        return f64::NAN;
    }
    let (ra, rb) = (ranks(a), ranks(b));
    let n = ra.len() as f64;
    let (ma, mb) = (ra.iter().sum::<f64>() / n, rb.iter().sum::<f64>() / n);
    let mut cov = 0.0;
    let mut va = 0.0;
    let mut vb = 0.0;
    for (x, y) in ra.iter().zip(&rb) {
        cov += (x - ma) * (y - mb);
        va += (x - ma) * (x - ma);
        vb += (y - mb) * (y - mb);
    }
    if va == 0.0 || vb == 0.0 {
        return f64::NAN;
    }
    cov / (va * vb).sqrt()
}

/// What "this machine" can run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MachineTarget {
    pub cores: usize,
    /// Requests per second over all SFCs together.
    pub system_rps: f64,
}

impl Default for MachineTarget {
    fn default() -> Self {
        MachineTarget {
            cores: 2,
            system_rps: 20_000.0,
        }
    }
}

/// The instance on `t.cores` cores at `t.system_rps`, with the same chains, the same
/// split of rates over SFCs, the same cost ratios, and the same offered load per core
/// (Σ l / (|M|·c(m))) as the original. Costs come out in nanoseconds (`clock_hz` =
/// 1e9): a worker burns `cost_cycles / 1000` µs per request.
pub fn scale_to_machine(p: &Problem, t: MachineTarget) -> Result<Problem, CoresError> {
    p.validate()?;
    if t.cores == 0 || !(t.system_rps.is_finite() && t.system_rps > 0.0) {
        return Err(CoresError::invalid(
            "machine",
            format!("need ≥ 1 core and a finite rate > 0, got {t:?}"),
        ));
    }
    let offered = p.offered_mpps();
    if offered <= 0.0 {
        return Err(CoresError::invalid("sfcs", "no SFC has a rate".into()));
    }
    let per_core = p.loads().iter().sum::<f64>() / (p.cores as f64 * p.clock_hz);
    let rate_scale = t.system_rps / (offered * 1e6);
    let sfcs: Vec<Sfc> = p
        .sfcs
        .iter()
        .map(|s| Sfc {
            rate_mpps: s.rate_mpps * rate_scale,
            vnfs: s.vnfs.clone(),
        })
        .collect();
    let clock = 1e9;
    let mut q = Problem {
        cores: t.cores,
        clock_hz: clock,
        vnfs: p.vnfs.clone(),
        sfcs,
    };
    let load_now: f64 = q.loads().iter().sum();
    let cost_scale = per_core * t.cores as f64 * clock / load_now;
    q.vnfs = p
        .vnfs
        .iter()
        .map(|v| Vnf {
            cost_cycles: v.cost_cycles * cost_scale,
        })
        .collect();
    q.validate()?;
    Ok(q)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::{generate, GenSpec, Seed};

    #[test]
    fn spearman_matches_hand_computed_values() {
        assert!((spearman(&[1.0, 2.0, 3.0], &[10.0, 20.0, 30.0]) - 1.0).abs() < 1e-12);
        assert!((spearman(&[1.0, 2.0, 3.0], &[3.0, 2.0, 1.0]) + 1.0).abs() < 1e-12);
        // Monotone but not linear: still 1.
        assert!((spearman(&[1.0, 2.0, 3.0, 4.0], &[1.0, 8.0, 27.0, 1000.0]) - 1.0).abs() < 1e-12);
        // d = (0, -1, 1, 0): 1 − 6·2/(4·15) = 0.8.
        assert!((spearman(&[1.0, 2.0, 3.0, 4.0], &[1.0, 3.0, 2.0, 4.0]) - 0.8).abs() < 1e-12);
        // Ties: ranks (1.5, 1.5, 3) against (1, 2, 3): r = 0.866…
        let r = spearman(&[5.0, 5.0, 7.0], &[1.0, 2.0, 3.0]);
        assert!((r - 3f64.sqrt() / 2.0).abs() < 1e-12, "{r}");
        assert!(spearman(&[1.0], &[1.0]).is_nan());
        assert!(spearman(&[1.0, 1.0], &[1.0, 2.0]).is_nan());
        assert!(spearman(&[1.0, 2.0], &[1.0]).is_nan());
        assert!(spearman(&[1.0, f64::NAN], &[1.0, 2.0]).is_nan());
    }

    #[test]
    fn scaling_keeps_load_per_core_and_rate_split() {
        let g = generate(&GenSpec::default(), 8, Seed::test(4)).unwrap();
        let p = &g.problem;
        let t = MachineTarget::default();
        let q = scale_to_machine(p, t).unwrap();
        assert_eq!(q.cores, 2);
        assert_eq!(q.vnfs.len(), p.vnfs.len());
        assert!((q.offered_mpps() * 1e6 - t.system_rps).abs() < 1e-6);
        let per = |x: &Problem| x.loads().iter().sum::<f64>() / (x.cores as f64 * x.clock_hz);
        assert!((per(p) - per(&q)).abs() < 1e-9);
        for (a, b) in p.sfcs.iter().zip(&q.sfcs) {
            assert!(
                (a.rate_mpps / p.offered_mpps() - b.rate_mpps / q.offered_mpps()).abs() < 1e-12
            );
        }
        let ratio = q.vnfs[0].cost_cycles / p.vnfs[0].cost_cycles;
        for (a, b) in p.vnfs.iter().zip(&q.vnfs) {
            assert!((b.cost_cycles / a.cost_cycles - ratio).abs() < 1e-9 * ratio);
        }
        assert!(scale_to_machine(
            p,
            MachineTarget {
                cores: 0,
                system_rps: 1.0
            }
        )
        .is_err());
    }
}
