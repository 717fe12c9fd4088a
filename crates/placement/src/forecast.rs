//! Per-tenant demand forecasting for reservations: Holt–Winters (level, trend and a
//! multiplicative daily season of the workload's `period`) on each of bandwidth, CPU
//! and memory, used as a [`Reserve`]: a tenant reserves
//! max(current, (1 + z·σ) · peak forecast over the next H steps), so a placement made
//! at night still holds in the morning.
//!
//! A new tenant has no history. Its seasonal indices start from a fleet-level profile
//! (every tenant's observed demand over its own level, by time of day, smoothed over
//! all tenants seen so far), so a night-time arrival inherits the fleet's morning
//! rise; its own indices then move away from the fleet's as it is observed.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::problem::{check_unit_interval, PlaceError, Resources};
use crate::sim::Reserve;

/// Parameters of the forecaster.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ForecastConfig {
    /// Steps per season (the workload's `period`).
    pub period: usize,
    /// H: steps ahead the reservation covers.
    pub horizon: usize,
    /// Smoothing of the level.
    pub alpha: f64,
    /// Smoothing of the trend.
    pub beta: f64,
    /// Smoothing of a tenant's own seasonal indices.
    pub gamma: f64,
    /// Smoothing of the fleet profile, per observation.
    pub fleet_rate: f64,
    /// z: residual standard deviations (relative) added to the peak.
    pub margin: f64,
    /// The reservation never exceeds current × this (a noisy trend extrapolated over
    /// H steps must not reserve a whole node).
    pub max_growth: f64,
}

impl ForecastConfig {
    pub fn for_period(period: usize) -> Self {
        ForecastConfig {
            period,
            horizon: 4,
            alpha: 0.5,
            beta: 0.2,
            gamma: 0.3,
            fleet_rate: 0.02,
            margin: 1.0,
            max_growth: 2.0,
        }
    }

    pub fn validate(&self) -> Result<(), PlaceError> {
        if self.period == 0 {
            return Err(PlaceError::invalid("period", "must be ≥ 1"));
        }
        check_unit_interval(&[
            ("alpha", self.alpha),
            ("beta", self.beta),
            ("gamma", self.gamma),
            ("fleet_rate", self.fleet_rate),
        ])?;
        if !self.margin.is_finite() || self.margin < 0.0 {
            return Err(PlaceError::invalid(
                "margin",
                format!("must be ≥ 0, got {}", self.margin),
            ));
        }
        if !self.max_growth.is_finite() || self.max_growth < 1.0 {
            return Err(PlaceError::invalid(
                "max_growth",
                format!("must be ≥ 1, got {}", self.max_growth),
            ));
        }
        Ok(())
    }
}

/// Smallest demand treated as nonzero in ratios.
const TINY: f64 = 1e-6;

/// One Holt–Winters series with multiplicative seasonality, indexed by absolute step.
#[derive(Debug, Clone)]
pub struct Series {
    level: f64,
    trend: f64,
    season: Vec<f64>,
    /// EMA of the squared relative one-step error.
    err2: f64,
    n: usize,
}

impl Series {
    /// Starts a series at step `t` with value `y`, seasonal indices from `prior`.
    pub fn start(t: usize, y: f64, prior: &[f64]) -> Self {
        let m = prior.len().max(1);
        let s = prior.get(t % m).copied().unwrap_or(1.0).max(TINY);
        Series {
            level: y / s,
            trend: 0.0,
            season: if prior.is_empty() {
                vec![1.0]
            } else {
                prior.to_vec()
            },
            err2: 0.0,
            n: 1,
        }
    }

    /// Holt–Winters update with the observation `y` at step `t`; returns y/level
    /// (the observed seasonal ratio) for the fleet profile.
    pub fn update(&mut self, t: usize, y: f64, cfg: &ForecastConfig) -> f64 {
        let m = self.season.len();
        let i = t % m;
        let s = self.season[i].max(TINY);
        let pred = ((self.level + self.trend) * s).max(0.0);
        let rel = (y - pred) / pred.max(y).max(TINY);
        self.err2 = if self.n == 1 {
            rel * rel
        } else {
            0.9 * self.err2 + 0.1 * rel * rel
        };
        let prev = self.level;
        self.level = (cfg.alpha * (y / s) + (1.0 - cfg.alpha) * (self.level + self.trend)).max(0.0);
        self.trend = cfg.beta * (self.level - prev) + (1.0 - cfg.beta) * self.trend;
        let ratio = if self.level > TINY {
            y / self.level
        } else {
            1.0
        };
        self.season[i] = cfg.gamma * ratio + (1.0 - cfg.gamma) * s;
        self.n += 1;
        ratio
    }

    /// Forecast of step `t + h`, made at step `t`.
    pub fn forecast(&self, t: usize, h: usize) -> f64 {
        let m = self.season.len();
        ((self.level + h as f64 * self.trend) * self.season[(t + h) % m]).max(0.0)
    }

    /// Relative residual standard deviation.
    pub fn sigma(&self) -> f64 {
        self.err2.sqrt()
    }
}

#[derive(Debug, Clone)]
struct TenantModel {
    dims: [Series; 3],
}

/// The Holt–Winters reserver.
#[derive(Debug, Clone)]
pub struct HoltWinters {
    cfg: ForecastConfig,
    tenants: HashMap<String, TenantModel>,
    /// Fleet seasonal profile per dimension (mean 1).
    fleet: [Vec<f64>; 3],
}

impl HoltWinters {
    pub fn new(cfg: ForecastConfig) -> Result<Self, PlaceError> {
        cfg.validate()?;
        let flat = vec![1.0; cfg.period];
        Ok(HoltWinters {
            cfg,
            tenants: HashMap::new(),
            fleet: [flat.clone(), flat.clone(), flat],
        })
    }

    /// Default parameters for a workload's period.
    pub fn for_period(period: usize) -> Result<Self, PlaceError> {
        HoltWinters::new(ForecastConfig::for_period(period))
    }

    pub fn config(&self) -> &ForecastConfig {
        &self.cfg
    }

    /// The fleet profile of a dimension (0 = bandwidth, 1 = CPU, 2 = memory).
    pub fn fleet_profile(&self, dim: usize) -> &[f64] {
        &self.fleet[dim.min(2)]
    }

    /// Peak forecast over steps t+1..=t+H per dimension, with the residual margin;
    /// `None` for a tenant never observed.
    pub fn forecast_peak(&self, t: usize, tenant: &str) -> Option<Resources> {
        let m = self.tenants.get(tenant)?;
        let mut out = [0.0f64; 3];
        for (d, s) in m.dims.iter().enumerate() {
            let peak = (1..=self.cfg.horizon.max(1))
                .map(|h| s.forecast(t, h))
                .fold(0.0, f64::max);
            out[d] = peak * (1.0 + self.cfg.margin * s.sigma());
        }
        Some(Resources::new(out[0], out[1], out[2]))
    }

    fn renormalise(v: &mut [f64]) {
        let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
        if mean > TINY {
            for x in v.iter_mut() {
                *x /= mean;
            }
        }
    }
}

fn dims(r: Resources) -> [f64; 3] {
    [r.bw, r.cpu, r.mem]
}

impl Reserve for HoltWinters {
    fn name(&self) -> &str {
        "holt-winters"
    }

    fn observe(&mut self, t: usize, demand: &[(&str, Resources)]) {
        let m = self.cfg.period;
        for &(name, d) in demand {
            let y = dims(d);
            if !y.iter().all(|v| v.is_finite() && *v >= 0.0) {
                // Bad input is not learned from; the emulator validates demand anyway.
                continue;
            }
            match self.tenants.get_mut(name) {
                Some(tm) => {
                    for (k, (series, &yk)) in tm.dims.iter_mut().zip(&y).enumerate() {
                        let ratio = series.update(t, yk, &self.cfg);
                        // Only tenants with a level (not ~0 demand) shape the fleet.
                        if series.level > TINY && ratio.is_finite() {
                            let f = &mut self.fleet[k][t % m];
                            *f = (1.0 - self.cfg.fleet_rate) * *f
                                + self.cfg.fleet_rate * ratio.min(10.0);
                        }
                    }
                }
                None => {
                    let tm = TenantModel {
                        dims: [0, 1, 2].map(|k| Series::start(t, y[k], &self.fleet[k])),
                    };
                    self.tenants.insert(name.to_string(), tm);
                }
            }
        }
        for f in &mut self.fleet {
            HoltWinters::renormalise(f);
        }
    }

    fn reserve(&mut self, t: usize, tenant: &str, current: Resources) -> Resources {
        let Some(peak) = self.forecast_peak(t, tenant) else {
            return current;
        };
        let cap = current.scale(self.cfg.max_growth);
        let r = Resources::new(
            peak.bw.min(cap.bw),
            peak.cpu.min(cap.cpu),
            peak.mem.min(cap.mem),
        );
        let r = r.max(current);
        if r.validate("reservation").is_err() {
            return current;
        }
        r
    }

    fn forget(&mut self, tenant: &str) {
        self.tenants.remove(tenant);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seasonal(t: usize, m: usize) -> f64 {
        let x = t as f64 / m as f64 * std::f64::consts::TAU;
        (10.0 + 0.05 * t as f64) * (1.0 + 0.5 * x.sin())
    }

    #[test]
    fn holt_winters_recovers_a_clean_seasonal_series() {
        let m = 24;
        let mut cfg = ForecastConfig::for_period(m);
        // A low α keeps the season out of the level (a high α chases every step and
        // the indices never converge from a flat start).
        cfg.alpha = 0.1;
        cfg.beta = 0.01;
        cfg.gamma = 0.3;
        // Streaming start: no first season to initialise from, flat indices.
        let mut s = Series::start(0, seasonal(0, m), &vec![1.0; m]);
        for t in 1..12 * m {
            s.update(t, seasonal(t, m), &cfg);
        }
        let t = 12 * m - 1;
        for h in 1..=4 {
            let f = s.forecast(t, h);
            let y = seasonal(t + h, m);
            assert!((f - y).abs() < 0.05 * y, "h={h}: forecast {f}, actual {y}");
        }
        // A flat model (no season) would be off by far more at the peak.
        assert!(s.sigma() < 0.05, "residual sigma {}", s.sigma());
    }

    #[test]
    fn reservation_is_at_least_current_and_covers_a_rise() {
        let m = 24;
        let mut hw = HoltWinters::for_period(m).unwrap();
        // Train the fleet on many tenants sharing one phase.
        let names: Vec<String> = (0..50).map(|i| format!("old{i}")).collect();
        for t in 0..4 * m {
            let obs: Vec<(&str, Resources)> = names
                .iter()
                .map(|n| {
                    let v = seasonal(t, m);
                    (n.as_str(), Resources::new(v, v, v))
                })
                .collect();
            hw.observe(t, &obs);
        }
        // A newcomer arriving at the trough (t ≡ 3m/4): it inherits the fleet's rise.
        let t = 4 * m + 3 * m / 4;
        let v = seasonal(t, m);
        hw.observe(t, &[("new", Resources::new(v, v, v))]);
        let r = hw.reserve(t, "new", Resources::new(v, v, v));
        assert!(r.bw >= v && r.cpu >= v && r.mem >= v);
        assert!(
            r.bw > 1.1 * v,
            "the morning rise is reserved: {} vs {v}",
            r.bw
        );
        // Never below current, even when the forecast falls (at the peak).
        let tp = 5 * m + m / 4;
        let cur = Resources::new(100.0, 100.0, 100.0);
        let r = hw.reserve(tp, "new", cur);
        assert!(r.bw >= 100.0 && r.cpu >= 100.0 && r.mem >= 100.0);
        // Unknown tenants reserve their current demand.
        assert_eq!(hw.reserve(tp, "nobody", cur), cur);
        // Bad config is refused with the field named.
        let mut bad = ForecastConfig::for_period(m);
        bad.alpha = 2.0;
        assert!(HoltWinters::new(bad)
            .unwrap_err()
            .to_string()
            .contains("alpha"));
    }
}
