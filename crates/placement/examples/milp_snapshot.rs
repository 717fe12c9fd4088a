//! Solves one snapshot of a generated workload with the MILP and prints the result
//! next to the heuristics': `cargo run --release -p placement --example milp_snapshot
//! -- [nodes] [tenants] [seed] [time limit s] [step]`.

use std::time::Duration;

use placement::heuristics::{best_fit, first_fit, first_fit_decreasing};
use placement::milp::{solve, MilpOptions};
use placement::workload::{generate, snapshot_instance, GenSpec};
use placement::{check, cost};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arg = |i: usize, d: f64| -> f64 {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(d)
    };
    let (nodes, tenants) = (arg(1, 12.0) as usize, arg(2, 20.0) as usize);
    let (seed, limit, step) = (arg(3, 1.0) as u64, arg(4, 60.0), arg(5, 0.0) as usize);
    let mut spec = GenSpec::standard(nodes);
    spec.initial_tenants = tenants + tenants / 2;
    let w = generate(&spec, seed)?;
    let inst = snapshot_instance(&w, step, nodes, tenants)?;
    println!(
        "{} nodes, {} tenants, {}",
        inst.nodes.len(),
        inst.requests.len(),
        inst.limits
    );
    for (name, p) in [
        ("ff", first_fit(&inst)),
        ("bf", best_fit(&inst)),
        ("ffd", first_fit_decreasing(&inst)),
    ] {
        match p {
            Ok(p) => println!("{name:>5}: cost {:.2}", cost(&inst, &p)),
            Err(e) => println!("{name:>5}: {e}"),
        }
    }
    let r = solve(
        &inst,
        &MilpOptions {
            time_limit: Duration::from_secs_f64(limit),
            ..MilpOptions::default()
        },
    )?;
    assert!(check(&inst, &r.placement).is_empty());
    println!(
        " milp: cost {:.2}, bound {:.4}, gap {:.2}%, {:?}, {:.2} s",
        r.cost,
        r.lower_bound,
        100.0 * r.gap,
        r.status,
        r.elapsed.as_secs_f64()
    );
    Ok(())
}
