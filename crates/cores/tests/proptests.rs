//! No panic on any problem: the twin, every assigner and the parsers answer arbitrary
//! (valid or invalid) input with a result or an error.

use cores::assign::{baselines, Assigner};
use cores::learned::Sfc2cpuModel;
use cores::problem::{Assignment, Problem, Sfc, Vnf, Workload};
use cores::twin::{evaluate, Scheduler, TwinParams};
use proptest::prelude::*;

/// A valid problem: `n` µVNFs cut into chains in order.
fn problem() -> impl Strategy<Value = Problem> {
    (1usize..6, 1usize..20).prop_flat_map(|(cores, n)| {
        (
            Just(cores),
            prop::collection::vec(1e-3f64..1e6, n),
            prop::collection::vec(any::<bool>(), n),
            prop::collection::vec(0.0f64..30.0, n),
        )
            .prop_map(|(cores, costs, cuts, rates)| {
                let mut sfcs = Vec::new();
                let mut cur = Vec::new();
                for (j, &cut) in cuts.iter().enumerate() {
                    cur.push(j);
                    if cut || j + 1 == cuts.len() {
                        sfcs.push(Sfc {
                            rate_mpps: rates[j],
                            vnfs: std::mem::take(&mut cur),
                        });
                    }
                }
                Problem {
                    cores,
                    clock_hz: 2.2e9,
                    vnfs: costs.into_iter().map(|c| Vnf { cost_cycles: c }).collect(),
                    sfcs,
                }
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn twin_and_assigners_never_panic(p in problem(), seed in any::<u64>(), bp in any::<bool>(), cfs in any::<bool>()) {
        p.validate().unwrap();
        let params = TwinParams {
            backpressure: bp,
            scheduler: if cfs { Scheduler::Cfs } else { Scheduler::RateCost },
            ..TwinParams::default()
        };
        let model = Sfc2cpuModel::untrained(&[p.cores], 16, seed).unwrap();
        let learned = model.assigner();
        let mut all: Vec<Box<dyn Assigner>> = baselines();
        all.push(Box::new(cores::RandomAssigner { seed }));
        for a in &all {
            let asg = a.assign(&p).unwrap();
            let r = evaluate(&p, &asg, &params).unwrap();
            prop_assert!(r.throughput_mpps.is_finite());
            prop_assert!(r.throughput_mpps <= p.offered_mpps() * (1.0 + 1e-9) + 1e-12);
            prop_assert!(r.latency_s.is_finite() && r.latency_s >= 0.0);
            let mut per = vec![0.0; p.cores];
            for (j, &m) in asg.cores.iter().enumerate() {
                per[m] += r.vnf_share[j];
            }
            prop_assert!(per.iter().all(|&s| s <= 1.0 + 1e-9), "{:?}", per);
        }
        // The learned assigner answers or refuses (more than 16 µVNFs), never panics.
        match learned.assign(&p) {
            Ok(a) => prop_assert!(a.validate(&p).is_ok()),
            Err(e) => prop_assert!(p.vnfs.len() > 16, "{}", e),
        }
    }

    #[test]
    fn parsers_never_panic(text in ".{0,200}") {
        let _ = Problem::from_json(&text);
        let _ = Workload::from_json(&text);
        let _ = Sfc2cpuModel::from_bytes(text.as_bytes(), "fuzz");
    }

    #[test]
    fn bad_assignments_are_errors(p in problem(), extra in 0usize..3) {
        let a = Assignment { cores: vec![p.cores + extra; p.vnfs.len()] };
        prop_assert!(evaluate(&p, &a, &TwinParams::default()).is_err());
    }
}
