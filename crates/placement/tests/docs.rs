//! The example in docs/placement.md is a valid workload that replays cleanly.

use placement::heuristics::BestFit;
use placement::sim::{run, CurrentDemand, SimOptions};
use placement::workload::Workload;
use testkit::docs::first_json_block;

const DOC: &str = include_str!("../../../docs/placement.md");

#[test]
fn the_documented_workload_parses_and_replays() {
    let json = first_json_block(DOC, "docs/placement.md");
    let w = Workload::from_json(json).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(w.nodes.len(), 3);
    assert_eq!(w.tenants.len(), 3);
    let rep = run(
        &w,
        &mut BestFit::default(),
        &mut CurrentDemand,
        &SimOptions::default(),
    )
    .unwrap();
    assert_eq!(rep.violations, 0);
    assert_eq!(rep.rejected, 0);
    assert!(rep.node_cost > 0.0);
    // And it survives a round trip through the writer.
    assert_eq!(Workload::from_json(&w.to_json()).unwrap(), w);
}
