//! The example in docs/cores.md is a valid workload every assigner runs in the twin.

use cores::assign::{baselines, Assigner};
use cores::bench::{run, BenchOptions};
use cores::{evaluate, Sfc2cpuModel, TwinParams, Workload};
use testkit::docs::first_json_block;

const DOC: &str = include_str!("../../../docs/cores.md");

#[test]
fn the_documented_workload_parses_and_runs() {
    let json = first_json_block(DOC, "docs/cores.md");
    let w = Workload::from_json(json).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(w.problems.len(), 1);
    let p = &w.problems[0];
    assert_eq!((p.cores, p.vnfs.len(), p.sfcs.len()), (4, 3, 2));
    let model = Sfc2cpuModel::shipped().unwrap();
    let mut all: Vec<Box<dyn Assigner>> = baselines();
    all.push(Box::new(model.assigner()));
    for a in &all {
        let r = evaluate(p, &a.assign(p).unwrap(), &TwinParams::default()).unwrap();
        assert!(r.throughput_mpps > 0.0 && r.throughput_mpps <= p.offered_mpps() + 1e-9);
    }
    let opts = BenchOptions {
        workload: Some(w.clone()),
        ..BenchOptions::default()
    };
    let learned = model.assigner();
    let rep = run(&opts, Some(&learned), &mut |_| {}).unwrap();
    assert_eq!(rep.settings.len(), 1);
    assert!(rep.settings[0].s2c_vs_rr.is_some());
    assert_eq!(Workload::from_json(&w.to_json()).unwrap(), w);
}
