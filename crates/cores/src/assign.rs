//! The assigners: one trait, the paper's three baselines (§V) and a random one.
//!
//! Every assigner visits µVNFs in the problem's order (their deployment order)
//! unless its rule sorts them.
//! - RR: µVNF i goes to core i mod |M|.
//! - LLF: each µVNF goes to the core with the least load l so far.
//! - FFD: µVNFs by load, largest first, each to the first core it fits on
//!   (Eq. 1: load ≤ c(m)); one that fits nowhere goes to the least loaded core.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::problem::{Assignment, Problem};
use crate::CoresError;

pub trait Assigner {
    fn name(&self) -> &'static str;
    fn assign(&self, p: &Problem) -> Result<Assignment, CoresError>;
}

#[derive(Debug, Clone, Copy, Default)]
pub struct RoundRobin;

#[derive(Debug, Clone, Copy, Default)]
pub struct LeastLoadedFirst;

#[derive(Debug, Clone, Copy, Default)]
pub struct FirstFitDecreasing;

/// Uniformly random cores: the floor a learned assigner must clear.
#[derive(Debug, Clone, Copy)]
pub struct RandomAssigner {
    pub seed: u64,
}

impl Assigner for RoundRobin {
    fn name(&self) -> &'static str {
        "rr"
    }
    fn assign(&self, p: &Problem) -> Result<Assignment, CoresError> {
        p.validate()?;
        Ok(Assignment {
            cores: (0..p.vnfs.len()).map(|j| j % p.cores).collect(),
        })
    }
}

fn least_loaded(load: &[f64]) -> usize {
    (0..load.len())
        .min_by(|&a, &b| load[a].total_cmp(&load[b]))
        .unwrap_or(0)
}

impl Assigner for LeastLoadedFirst {
    fn name(&self) -> &'static str {
        "llf"
    }
    fn assign(&self, p: &Problem) -> Result<Assignment, CoresError> {
        p.validate()?;
        let mut load = vec![0.0; p.cores];
        let cores = p
            .loads()
            .into_iter()
            .map(|l| {
                let m = least_loaded(&load);
                load[m] += l;
                m
            })
            .collect();
        Ok(Assignment { cores })
    }
}

impl Assigner for FirstFitDecreasing {
    fn name(&self) -> &'static str {
        "ffd"
    }
    fn assign(&self, p: &Problem) -> Result<Assignment, CoresError> {
        p.validate()?;
        let loads = p.loads();
        let mut order: Vec<usize> = (0..loads.len()).collect();
        order.sort_by(|&a, &b| loads[b].total_cmp(&loads[a]).then(a.cmp(&b)));
        let mut load = vec![0.0; p.cores];
        let mut cores = vec![0; loads.len()];
        for j in order {
            let m = (0..p.cores)
                .find(|&m| load[m] + loads[j] <= p.clock_hz)
                .unwrap_or_else(|| least_loaded(&load));
            load[m] += loads[j];
            cores[j] = m;
        }
        Ok(Assignment { cores })
    }
}

impl Assigner for RandomAssigner {
    fn name(&self) -> &'static str {
        "random"
    }
    fn assign(&self, p: &Problem) -> Result<Assignment, CoresError> {
        p.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        Ok(Assignment {
            cores: (0..p.vnfs.len())
                .map(|_| rng.gen_range(0..p.cores))
                .collect(),
        })
    }
}

/// The three baselines, in the bench's order.
pub fn baselines() -> Vec<Box<dyn Assigner>> {
    vec![
        Box::new(RoundRobin),
        Box::new(LeastLoadedFirst),
        Box::new(FirstFitDecreasing),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Sfc, Vnf};

    fn p() -> Problem {
        // Loads (Gcycles/s): 0.2, 1.6, 0.4, 1.2, 0.3 on 3 cores of 2.2.
        Problem {
            cores: 3,
            clock_hz: 2.2e9,
            vnfs: [200.0, 1600.0, 400.0, 1200.0, 300.0]
                .iter()
                .map(|&c| Vnf { cost_cycles: c })
                .collect(),
            sfcs: vec![
                Sfc {
                    rate_mpps: 1.0,
                    vnfs: vec![0, 1, 2],
                },
                Sfc {
                    rate_mpps: 1.0,
                    vnfs: vec![3, 4],
                },
            ],
        }
    }

    #[test]
    fn baselines_follow_their_rules() {
        let p = p();
        assert_eq!(RoundRobin.assign(&p).unwrap().cores, vec![0, 1, 2, 0, 1]);
        // LLF: 0→c0 (0.2), 1→c1 (1.6), 2→c2 (0.4), 3→c0 (1.4), 4→c2 (0.7).
        assert_eq!(
            LeastLoadedFirst.assign(&p).unwrap().cores,
            vec![0, 1, 2, 0, 2]
        );
        // FFD: 1 (1.6)→c0, 3 (1.2)→c1, 2 (0.4)→c0 (2.0), 4 (0.3)→c1, 0 (0.2)→c0 (2.2).
        let f = FirstFitDecreasing.assign(&p).unwrap();
        assert_eq!(f.cores, vec![0, 0, 0, 1, 1]);
        assert!(f.core_loads(&p).iter().all(|&l| l <= p.clock_hz));
        let r = RandomAssigner { seed: 1 }.assign(&p).unwrap();
        r.validate(&p).unwrap();
    }

    #[test]
    fn ffd_overflows_to_the_least_loaded_core() {
        let mut p = p();
        p.cores = 1;
        let f = FirstFitDecreasing.assign(&p).unwrap();
        assert_eq!(f.cores, vec![0; 5]);
        p.cores = 0;
        assert!(FirstFitDecreasing.assign(&p).is_err());
        assert!(RoundRobin.assign(&p).is_err());
    }
}
