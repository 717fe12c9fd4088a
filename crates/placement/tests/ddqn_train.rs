//! Training smoke test: a tiny Alg. 1 run must give an agent that places held-out
//! workloads without a violation and clearly better than a random ranking.
//! Run in release (`cargo test --release -p placement --test ddqn_train`).

use placement::ddqn::{train, DdqnModel, TrainConfig};
use placement::sim::{run, CurrentDemand, SimOptions};
use placement::workload::{generate, test_seed, GenSpec};
use placement::{ClusterState, NodeIdx, PlaceError, Placer, Request};
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// The agent with its Q-network replaced by chance: a random node order, searched
/// for the first feasible set (Alg. 1's RandomAction()).
struct RandomRanking(rand_chacha::ChaCha8Rng);

impl Placer for RandomRanking {
    fn name(&self) -> &str {
        "random"
    }
    fn place(&mut self, s: &ClusterState, r: &Request) -> Result<Vec<NodeIdx>, PlaceError> {
        let mut order: Vec<NodeIdx> = (0..s.nodes().len()).collect();
        order.shuffle(&mut self.0);
        s.first_feasible(r, &order, 50_000)
            .ok_or_else(|| PlaceError::infeasible(&r.tenant, "no set"))
    }
}

#[test]
fn tiny_training_beats_random_ranking_without_violations() {
    let cfg = TrainConfig::tiny();
    let mut reports = Vec::new();
    let model = train(&cfg, &mut |r| reports.push(r.clone())).unwrap();
    assert_eq!(reports.len(), cfg.episodes);
    assert!(reports.iter().all(|r| r.violations == 0));
    let last = reports.last().unwrap();
    assert!(last.grad_steps > 0, "training took gradient steps");
    assert!(reports.iter().all(|r| r.loss.is_finite()));
    assert!(model.header.metrics.train_seeds.len() == cfg.episodes);

    // The saved and reloaded model is the one evaluated.
    let path = std::env::temp_dir().join(format!("ddqn-smoke-{}.safetensors", std::process::id()));
    model.save(&path).unwrap();
    let model = DdqnModel::load(&path).unwrap();
    std::fs::remove_file(&path).ok();

    let (mut ours, mut random) = (0.0, 0.0);
    for i in 0..3 {
        let w = generate(&GenSpec::standard(20), test_seed(i)).unwrap();
        let mut agent = model.placer().unwrap();
        let a = run(&w, &mut agent, &mut CurrentDemand, &SimOptions::default()).unwrap();
        assert_eq!(a.violations, 0);
        assert_eq!(a.bad_answers, 0);
        assert_eq!(a.rejected, 0);
        assert!(a.cost.is_finite() && a.cost > 0.0);
        let mut rr = RandomRanking(rand_chacha::ChaCha8Rng::seed_from_u64(i));
        let b = run(&w, &mut rr, &mut CurrentDemand, &SimOptions::default()).unwrap();
        ours += a.cost;
        random += b.cost;
    }
    assert!(
        ours < 0.9 * random,
        "trained {ours:.1} vs random ranking {random:.1}"
    );
}
