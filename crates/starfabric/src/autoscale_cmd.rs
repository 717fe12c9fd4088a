//! `starfabric autoscale --fm HOST:PORT --sc-capacity-rps N [...]`: scale SC groups
//! (and PP nodes, with `--pp-capacity` and a node pool) between water marks until
//! SIGINT/SIGTERM (`orchestrator::autoscaler`). Decisions are printed a line each and
//! recorded in FM's event log (`starfabric events`).

use std::time::{Duration, Instant};

use anyhow::Result;
use orchestrator::autoscaler::{serve, AutoscaleFlags};

pub fn run(a: AutoscaleFlags) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    crate::signals::install()?;
    let start = Instant::now();
    let duration = a.duration.map(Duration::from_secs_f64);
    let stop = async move {
        while !crate::signals::stopped() && duration.is_none_or(|d| start.elapsed() < d) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let lines = telemetry::Lines::stdout();
    rt.block_on(serve(a, None, stop, |l| lines.say(l)))?;
    println!("autoscale: stopped");
    Ok(())
}
