//! Training smoke test: a short run of the sfc2cpu training (4 cores) must give a
//! policy that, on held-out instances in the twin, delivers more than a random
//! assigner and more than RR. Runs in seconds in release (`make test`).

use cores::assign::{Assigner, RandomAssigner, RoundRobin};
use cores::generate::{generate, GenSpec, Seed};
use cores::learned::{train, Sfc2cpuModel, TrainConfig};
use cores::twin::{evaluate, TwinParams};

fn total(a: &dyn Assigner, n: u64) -> f64 {
    (0..n)
        .map(|i| {
            let p = generate(&GenSpec::default(), 4, Seed::test(i))
                .unwrap()
                .problem;
            let asg = a.assign(&p).unwrap();
            evaluate(&p, &asg, &TwinParams::default())
                .unwrap()
                .throughput_mpps
        })
        .sum()
}

#[test]
fn short_training_beats_random_and_rr_on_held_out_instances() {
    let cfg = TrainConfig::tiny();
    let mut rounds = 0;
    let mut last_loss = f64::NAN;
    let model = train(&cfg, &mut |r| {
        rounds += 1;
        if r.grad_steps > 0 {
            last_loss = r.loss;
        }
    })
    .unwrap();
    assert_eq!(rounds, cfg.rounds);
    assert!(last_loss.is_finite());
    let m = &model.header.metrics[&4];
    assert!(m.grad_steps > 0 && m.valid_ratio > 0.0 && m.valid_ratio <= 1.0);

    // The file written and read back is the one evaluated.
    let path = std::env::temp_dir().join(format!("s2c-smoke-{}.safetensors", std::process::id()));
    model.save(&path).unwrap();
    let model = Sfc2cpuModel::load(&path).unwrap();
    std::fs::remove_file(&path).ok();

    let n = 40;
    // Plain argmax: the network's own choices, without the tie rule's help.
    let learned = total(&model.assigner().with_tie_tolerance(0.0), n);
    let random = total(&RandomAssigner { seed: 9 }, n);
    let rr = total(&RoundRobin, n);
    assert!(
        learned > 1.05 * random,
        "learned {learned:.3} vs random {random:.3}"
    );
    assert!(learned > rr, "learned {learned:.3} vs rr {rr:.3}");
}
