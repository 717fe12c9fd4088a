//! The problem generator of paper 002 §III-C with Table I's ranges.
//!
//! An instance: the number of SFCs, a system arrival rate split over them by a
//! Dirichlet(α = 5) draw, then µVNFs generated one by one: each goes to an SFC that
//! has none yet, else to a random SFC; its dummy-loop count is drawn at most so high
//! that it could carry its SFC's rate pinned to a core; it is put on a random core
//! that can take its load, or, if none can, its loop count is lowered until it fits
//! the least loaded core; if even zero loops do not fit, generation stops. That
//! hidden assignment ([`Generated::gen`], the paper's *GEN*) proves each instance
//! feasible (Eq. 1 holds) while keeping it tight.
//!
//! Training and evaluation never share an instance: a [`Seed`] is made only by
//! [`Seed::train`] or [`Seed::test`], which map indices into disjoint halves of u64
//! (the top bit is the split), so no index of one can name an instance of the other.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::problem::{Assignment, Problem, Sfc, Vnf, PAPER_CLOCK_HZ};
use crate::CoresError;

/// Which stream an instance comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Split {
    Train,
    Test,
}

const SPLIT_BIT: u64 = 1 << 63;

/// A generator seed bound to its split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Seed(u64);

impl Seed {
    /// The `i`-th training instance (top bit clear).
    pub fn train(i: u64) -> Seed {
        Seed(i & !SPLIT_BIT)
    }
    /// The `i`-th held-out instance (top bit set): never equal to a training seed.
    pub fn test(i: u64) -> Seed {
        Seed(i | SPLIT_BIT)
    }
    pub fn split(self) -> Split {
        if self.0 & SPLIT_BIT == 0 {
            Split::Train
        } else {
            Split::Test
        }
    }
    pub fn value(self) -> u64 {
        self.0
    }
}

/// Table I and the cost calibration of §III-C.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenSpec {
    /// #SFCs, inclusive range.
    pub sfcs: (usize, usize),
    /// Most µVNFs per SFC.
    pub max_vnfs_per_sfc: usize,
    /// Total #µVNFs, inclusive range (generation may stop earlier when no core fits).
    pub total_vnfs: (usize, usize),
    /// Most dummy loops of a µVNF.
    pub max_loops: u32,
    /// Cost in cycles at 0 loops and at `max_loops` (§III-C: 80 to 8027 cycles); in
    /// between the cost is linear in the loop count.
    pub cost_range: (f64, f64),
    /// Per-SFC arrival rate, Mpps (Table I: 0.02 to 2.5).
    pub sfc_rate: (f64, f64),
    /// System arrival rate, Mpps, drawn uniformly (§III-C: "values up to 2.5 Mpps").
    pub system_rate: (f64, f64),
    /// Dirichlet concentration of the rate split.
    pub alpha: f64,
    pub clock_hz: f64,
}

impl Default for GenSpec {
    fn default() -> Self {
        GenSpec {
            sfcs: (1, 8),
            max_vnfs_per_sfc: 8,
            total_vnfs: (4, 16),
            max_loops: 130,
            cost_range: (80.0, 8027.0),
            sfc_rate: (0.02, 2.5),
            system_rate: (1.0, 2.5),
            alpha: 5.0,
            clock_hz: PAPER_CLOCK_HZ,
        }
    }
}

/// Table I's core counts.
pub const TABLE_I_CORES: [usize; 4] = [4, 8, 12, 16];

/// A generated instance with the assignment the generator built it around.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    pub problem: Problem,
    /// The paper's *GEN* placement: every core within capacity.
    pub gen: Assignment,
    /// Dummy loops of every µVNF.
    pub loops: Vec<u32>,
}

impl GenSpec {
    pub fn validate(&self) -> Result<(), CoresError> {
        let bad = |f: &str, m: String| Err(CoresError::invalid(f, m));
        if self.sfcs.0 == 0 || self.sfcs.0 > self.sfcs.1 {
            return bad("sfcs", format!("need 1 ≤ min ≤ max, got {:?}", self.sfcs));
        }
        if self.max_vnfs_per_sfc == 0 {
            return bad("max_vnfs_per_sfc", "must be ≥ 1".into());
        }
        if self.total_vnfs.0 == 0 || self.total_vnfs.0 > self.total_vnfs.1 {
            return bad(
                "total_vnfs",
                format!("need 1 ≤ min ≤ max, got {:?}", self.total_vnfs),
            );
        }
        let pos = |x: f64| x.is_finite() && x > 0.0;
        let (c0, c1) = self.cost_range;
        if !(pos(c0) && pos(c1) && c0 <= c1) {
            return bad(
                "cost_range",
                format!("need 0 < min ≤ max, got {:?}", self.cost_range),
            );
        }
        for (f, (a, b)) in [
            ("sfc_rate", self.sfc_rate),
            ("system_rate", self.system_rate),
        ] {
            if !(pos(a) && pos(b) && a <= b) {
                return bad(f, format!("need 0 < min ≤ max, got ({a}, {b})"));
            }
        }
        if !pos(self.alpha) || !pos(self.clock_hz) {
            return bad("alpha/clock_hz", "must be finite and > 0".into());
        }
        Ok(())
    }

    /// Cycles per packet of a µVNF with `loops` dummy loops.
    pub fn cost(&self, loops: u32) -> f64 {
        let (c0, c1) = self.cost_range;
        if self.max_loops == 0 {
            return c0;
        }
        c0 + (c1 - c0) * loops as f64 / self.max_loops as f64
    }

    /// Most loops whose load at `rate_pps` fits `room` cycles/s (None: not even 0).
    fn max_loops_within(&self, rate_pps: f64, room: f64) -> Option<u32> {
        if self.cost(0) * rate_pps > room {
            return None;
        }
        // Linear cost: solve, then step down past rounding.
        let (c0, c1) = self.cost_range;
        let per_loop = if self.max_loops == 0 {
            0.0
        } else {
            (c1 - c0) / self.max_loops as f64
        };
        let mut d = if per_loop <= 0.0 || rate_pps <= 0.0 {
            self.max_loops
        } else {
            (((room / rate_pps) - c0) / per_loop)
                .floor()
                .clamp(0.0, self.max_loops as f64) as u32
        };
        while d > 0 && self.cost(d) * rate_pps > room {
            d -= 1;
        }
        Some(d)
    }
}

/// A Gamma(α, 1) draw (Marsaglia–Tsang; α ≥ 1 here). Hand-written because the
/// workspace's rand is 0.8 and the rand_distr in the lock file is built for rand 0.9.
fn gamma(rng: &mut impl Rng, alpha: f64) -> f64 {
    let boost = if alpha < 1.0 {
        // Gamma(α) = Gamma(α + 1) · U^(1/α).
        rng.gen::<f64>().max(f64::MIN_POSITIVE).powf(1.0 / alpha)
    } else {
        1.0
    };
    let a = alpha.max(1.0);
    let d = a - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        // Box–Muller standard normal.
        let u1: f64 = rng.gen::<f64>().max(f64::MIN_POSITIVE);
        let u2: f64 = rng.gen();
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        let v = (1.0 + c * z).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u: f64 = rng.gen::<f64>().max(f64::MIN_POSITIVE);
        if u.ln() < 0.5 * z * z + d - d * v + d * v.ln() {
            return d * v * boost;
        }
    }
}

/// A symmetric Dirichlet(α) draw of dimension `k`.
fn dirichlet(rng: &mut impl Rng, alpha: f64, k: usize) -> Vec<f64> {
    let g: Vec<f64> = (0..k).map(|_| gamma(rng, alpha)).collect();
    let s: f64 = g.iter().sum();
    if s > 0.0 {
        g.iter().map(|x| x / s).collect()
    } else {
        vec![1.0 / k as f64; k]
    }
}

/// Generates the instance `seed` names for `cores` cores.
pub fn generate(spec: &GenSpec, cores: usize, seed: Seed) -> Result<Generated, CoresError> {
    spec.validate()?;
    if cores == 0 {
        return Err(CoresError::invalid("cores", "must be ≥ 1".into()));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed.value() ^ (cores as u64).rotate_left(32));
    let n_sfc = rng.gen_range(spec.sfcs.0..=spec.sfcs.1);
    let system = rng.gen_range(spec.system_rate.0..=spec.system_rate.1);
    let rates: Vec<f64> = dirichlet(&mut rng, spec.alpha, n_sfc)
        .into_iter()
        .map(|p| (p * system).clamp(spec.sfc_rate.0, spec.sfc_rate.1))
        .collect();
    let lo = spec.total_vnfs.0.max(n_sfc);
    let hi = spec.total_vnfs.1.min(n_sfc * spec.max_vnfs_per_sfc).max(lo);
    let target = rng.gen_range(lo..=hi);

    let cap = spec.clock_hz;
    let mut load = vec![0.0; cores];
    let mut chains: Vec<Vec<usize>> = vec![Vec::new(); n_sfc];
    let mut vnfs = Vec::new();
    let mut gen = Vec::new();
    let mut loops = Vec::new();
    while vnfs.len() < target {
        let k = match chains.iter().position(Vec::is_empty) {
            Some(k) => k,
            None => {
                let open: Vec<usize> = (0..n_sfc)
                    .filter(|&k| chains[k].len() < spec.max_vnfs_per_sfc)
                    .collect();
                if open.is_empty() {
                    break;
                }
                open[rng.gen_range(0..open.len())]
            }
        };
        let rate = rates[k] * 1e6;
        // At most what one pinned core can carry at this SFC's rate.
        let Some(d_max) = spec.max_loops_within(rate, cap) else {
            break;
        };
        let mut d = rng.gen_range(0..=d_max);
        let fits: Vec<usize> = (0..cores)
            .filter(|&m| load[m] + spec.cost(d) * rate <= cap)
            .collect();
        let m = if fits.is_empty() {
            let least = (0..cores)
                .min_by(|&a, &b| load[a].total_cmp(&load[b]))
                .unwrap_or(0);
            match spec.max_loops_within(rate, cap - load[least]) {
                Some(fit) => {
                    d = d.min(fit);
                    least
                }
                None => break,
            }
        } else {
            fits[rng.gen_range(0..fits.len())]
        };
        let cost = spec.cost(d);
        load[m] += cost * rate;
        chains[k].push(vnfs.len());
        vnfs.push(Vnf { cost_cycles: cost });
        gen.push(m);
        loops.push(d);
    }
    // SFCs that never got a µVNF (generation stopped early) do not exist.
    let sfcs = chains
        .into_iter()
        .zip(rates)
        .filter(|(c, _)| !c.is_empty())
        .map(|(vnfs, rate_mpps)| Sfc { rate_mpps, vnfs })
        .collect();
    let problem = Problem {
        cores,
        clock_hz: spec.clock_hz,
        vnfs,
        sfcs,
    };
    problem.validate()?;
    Ok(Generated {
        problem,
        gen: Assignment { cores: gen },
        loops,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn splits_are_disjoint_by_construction() {
        assert_eq!(Seed::train(5).split(), Split::Train);
        assert_eq!(Seed::test(5).split(), Split::Test);
        assert_ne!(Seed::train(5), Seed::test(5));
        // Even an index with the split bit set cannot reach the other stream.
        assert_eq!(Seed::train(u64::MAX).split(), Split::Train);
        assert_eq!(Seed::test(0).split(), Split::Test);
        let train: HashSet<u64> = (0..10_000).map(|i| Seed::train(i).value()).collect();
        assert!((0..10_000).all(|i| !train.contains(&Seed::test(i).value())));
        // And the instances differ.
        let s = GenSpec::default();
        let a = generate(&s, 8, Seed::train(3)).unwrap();
        let b = generate(&s, 8, Seed::test(3)).unwrap();
        assert_ne!(a.problem, b.problem);
    }

    #[test]
    fn same_seed_same_instance() {
        let s = GenSpec::default();
        for cores in TABLE_I_CORES {
            let a = generate(&s, cores, Seed::test(11)).unwrap();
            assert_eq!(a, generate(&s, cores, Seed::test(11)).unwrap());
            assert_ne!(
                a.problem,
                generate(&s, cores, Seed::test(12)).unwrap().problem
            );
        }
    }

    #[test]
    fn instances_respect_table_i_and_gen_is_feasible() {
        let s = GenSpec::default();
        let mut total_seen = HashSet::new();
        let mut max_load = 0.0f64;
        for cores in TABLE_I_CORES {
            for i in 0..200 {
                let g = generate(&s, cores, Seed::train(i)).unwrap();
                let p = &g.problem;
                p.validate().unwrap();
                assert_eq!(p.cores, cores);
                assert!((1..=8).contains(&p.sfcs.len()));
                assert!(p.vnfs.len() <= 16);
                total_seen.insert(p.vnfs.len());
                for sfc in &p.sfcs {
                    assert!((1..=8).contains(&sfc.vnfs.len()));
                    assert!((0.02..=2.5).contains(&sfc.rate_mpps), "{}", sfc.rate_mpps);
                    for &j in &sfc.vnfs {
                        // Each µVNF could carry its SFC pinned to a core.
                        assert!(p.vnfs[j].cost_cycles * sfc.rate_mpps * 1e6 <= p.clock_hz);
                    }
                }
                for (v, &d) in p.vnfs.iter().zip(&g.loops) {
                    assert!(d <= 130);
                    assert!((80.0..=8027.0).contains(&v.cost_cycles));
                }
                assert!(p.offered_mpps() <= 2.5 + 1e-9 * 8.0 + 0.02 * 8.0);
                // GEN satisfies Eq. 1.
                g.gen.validate(p).unwrap();
                for l in g.gen.core_loads(p) {
                    assert!(l <= p.clock_hz * (1.0 + 1e-12));
                    max_load = max_load.max(l / p.clock_hz);
                }
            }
        }
        // The ranges are actually used, not just respected.
        assert!(total_seen.contains(&16) && total_seen.iter().any(|&n| n <= 6));
        assert!(
            max_load > 0.9,
            "instances are tight: max core load {max_load}"
        );
    }

    #[test]
    fn dirichlet_sums_to_one() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for k in 1..9 {
            let p = dirichlet(&mut rng, 5.0, k);
            assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-9);
            assert!(p.iter().all(|&x| x > 0.0));
        }
        // Gamma(5) has mean 5.
        let m: f64 = (0..20_000).map(|_| gamma(&mut rng, 5.0)).sum::<f64>() / 20_000.0;
        assert!((m - 5.0).abs() < 0.1, "{m}");
    }

    #[test]
    fn bad_specs_are_refused() {
        let s = GenSpec {
            sfcs: (0, 3),
            ..GenSpec::default()
        };
        assert!(generate(&s, 4, Seed::train(0)).is_err());
        assert!(generate(&GenSpec::default(), 0, Seed::train(0)).is_err());
    }
}
