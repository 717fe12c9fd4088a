//! RGCM against LP-GCM, the exact MILP and the greedy rule on seeded random instances.
//!
//! `cargo run --release -p placement --example zeta_eval [instances] [draws]`
//!
//! Per size: mean λ̃, RGCM λ (mean over draws), greedy λ, MILP λ (where the MILP is
//! small enough), mean RGCM/MILP, how often Theorems 4 and 5 held, how often a tenant
//! ended up on more than k clusters, and solve times.

use std::time::Instant;

use placement::rgcm::{
    greedy, random_instance, round, solve_lp, solve_milp, MilpOptions, RgcmOptions,
};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let instances: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(10);
    let draws: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(50);
    // (clusters, tenants, max VPCs per tenant, k, heterogeneous, MILP?)
    let sizes = [
        (10, 1, 8, 1, false, false),
        (20, 2, 8, 1, false, false),
        (3, 4, 3, 1, false, true),
        (4, 6, 3, 2, false, true),
        (4, 8, 4, 2, true, true),
        (5, 10, 4, 2, false, true),
        (10, 50, 5, 3, false, false),
        (20, 200, 5, 4, true, false),
    ];
    println!(
        "| n | d | |V| avg | k | het | λ̃ | RGCM λ | greedy λ | MILP λ (opt/all) | RGCM/MILP | greedy/MILP | Thm4 ok | Thm5 ok | >k tenants | LP ms | MILP ms |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (n, d, v, k, het, milp) in sizes {
        let (mut lp_sum, mut r_sum, mut g_sum, mut m_sum) = (0.0, 0.0, 0.0, 0.0);
        let (mut ratio, mut gratio, mut m_count, mut m_opt) = (0.0, 0.0, 0, 0);
        let (mut t4, mut t5, mut over_k, mut total) = (0, 0, 0, 0);
        let (mut lp_ms, mut milp_ms, mut vpcs) = (0.0, 0.0, 0);
        for seed in 0..instances {
            // Demands scaled so the expected total is 60% of capacity (λ̃ ≈ 0.6, the
            // paper's example).
            let max_demand = 0.6 * n as f64 * 100.0 * 4.0 / (d as f64 * (v as f64 + 1.0));
            let inst = random_instance(seed, n, d, v, max_demand, k, het);
            vpcs += inst.vpc_count();
            let t = Instant::now();
            let lp = solve_lp(&inst).expect("LP");
            lp_ms += t.elapsed().as_secs_f64() * 1e3;
            lp_sum += lp.lambda;
            let g = greedy(&inst).expect("greedy");
            g_sum += g.lambda;
            let mut r_inst = 0.0;
            for s in 0..draws {
                let r = round(&inst, &lp, &RgcmOptions::seeded(s)).expect("round");
                r_inst += r.lambda;
                total += 1;
                t4 += r.bounds.tenant_bound_ok as usize;
                t5 += r.bounds.lambda_bound_ok as usize;
                over_k += r.tenant_clusters.iter().any(|c| c.len() > k) as usize;
            }
            r_inst /= draws as f64;
            r_sum += r_inst;
            if milp {
                let t = Instant::now();
                let m = solve_milp(
                    &inst,
                    &MilpOptions {
                        time_limit_s: Some(20.0),
                        mip_gap: Some(0.005),
                        ..Default::default()
                    },
                )
                .expect("MILP");
                milp_ms += t.elapsed().as_secs_f64() * 1e3;
                m_sum += m.lambda;
                m_count += 1;
                m_opt += m.optimal as usize;
                ratio += r_inst / m.lambda;
                gratio += g.lambda / m.lambda;
            }
        }
        let nf = instances as f64;
        let mf = m_count.max(1) as f64;
        let milp_cols = if m_count > 0 {
            format!(
                "{:.3} ({m_opt}/{m_count}) | {:.3} | {:.3}",
                m_sum / mf,
                ratio / mf,
                gratio / mf
            )
        } else {
            "– | – | –".into()
        };
        println!(
            "| {n} | {d} | {:.1} | {k} | {het} | {:.3} | {:.3} | {:.3} | {milp_cols} | {:.1}% | {:.1}% | {:.1}% | {:.1} | {} |",
            vpcs as f64 / nf,
            lp_sum / nf,
            r_sum / nf,
            g_sum / nf,
            100.0 * t4 as f64 / total as f64,
            100.0 * t5 as f64 / total as f64,
            100.0 * over_k as f64 / total as f64,
            lp_ms / nf,
            if m_count > 0 {
                format!("{:.0}", milp_ms / mf)
            } else {
                "–".into()
            },
        );
    }
}
