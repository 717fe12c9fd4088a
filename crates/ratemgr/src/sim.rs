//! A deterministic fluid simulator of one node: each tick every tenant offers
//! `demand·dt` ops and `min(demand, allowance)·dt` are admitted, then the manager
//! ticks. For tests and benches.

use serde::{Deserialize, Serialize};

use crate::{CreditState, RateConfig, RateError, RateManager, TenantRates, TenantUsage};

/// One tenant in one tick.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SimTenant {
    pub tenant: u32,
    pub offered_rate: f64,
    pub admitted_rate: f64,
    /// The allowance the tick ran with.
    pub allowance: f64,
    /// State and credit after the tick.
    pub state: CreditState,
    pub credit: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TickRecord {
    /// End of the tick, seconds.
    pub t: f64,
    /// Whether the node was abundant in this tick.
    pub abundant: bool,
    pub tenants: Vec<SimTenant>,
}

/// Runs `seconds` of ticks of `cfg.tick_ms`. `demand(tenant, t)` is the offered rate
/// in ops/s at the start of the tick (NaN, negative or infinite count as 0 / huge).
pub fn simulate(
    cfg: RateConfig,
    tenants: &[(u32, TenantRates)],
    demand: impl Fn(u32, f64) -> f64,
    seconds: f64,
) -> Result<Vec<TickRecord>, RateError> {
    let mut mgr = RateManager::new(cfg)?;
    for &(id, r) in tenants {
        mgr.set(id, r)?;
    }
    let dt = cfg.tick_ms as f64 / 1000.0;
    let ticks = if seconds.is_finite() && seconds > 0.0 {
        (seconds / dt).round() as u64
    } else {
        0
    };
    let count = |rate: f64| -> u64 {
        if rate.is_nan() || rate <= 0.0 {
            0
        } else {
            (rate * dt).round().min(1e18) as u64
        }
    };
    // A tick admits whole packets: the fraction of the allowance it could not grant
    // carries to the next tick, as a token bucket's does. Rounding each tick on its own
    // would bias admission (212.5 packets a tick admitted as 213, every tick).
    let mut carry = vec![0.0f64; tenants.len()];
    let mut out = Vec::with_capacity(ticks as usize);
    for k in 0..ticks {
        let t0 = k as f64 * dt;
        let mut usage = Vec::with_capacity(tenants.len());
        let mut rows = Vec::with_capacity(tenants.len());
        for (i, &(id, _)) in tenants.iter().enumerate() {
            let allowance = mgr.allowance(id).unwrap_or(0.0);
            let offered = count(demand(id, t0));
            let budget = if allowance > 0.0 {
                let exact = (allowance * dt + carry[i]).min(1e18);
                let whole = exact.floor();
                carry[i] = exact - whole;
                whole as u64
            } else {
                carry[i] = 0.0;
                0
            };
            let admitted = offered.min(budget);
            usage.push(TenantUsage {
                tenant: id,
                offered,
                admitted,
            });
            rows.push((id, offered, admitted, allowance));
        }
        mgr.tick(cfg.tick_ms, &usage, 0);
        let tenants = rows
            .into_iter()
            .map(|(id, o, a, allowance)| {
                let st = mgr.get(id).expect("simulated tenants stay managed");
                SimTenant {
                    tenant: id,
                    offered_rate: o as f64 / dt,
                    admitted_rate: a as f64 / dt,
                    allowance,
                    state: st.state,
                    credit: st.credit,
                }
            })
            .collect();
        out.push(TickRecord {
            t: t0 + dt,
            abundant: mgr.abundant(),
            tenants,
        });
    }
    Ok(out)
}
