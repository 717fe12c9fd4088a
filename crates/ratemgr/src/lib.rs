//! Credit-based local rate management of a PP node (CyberStar §7.2, Fig. 6): decides,
//! every tick, how many ops per second each tenant may use so that a heavy tenant
//! cannot starve the others (isolation) while idle capacity is still lent out (work
//! conservation), and enforces that with token buckets on the packet workers.
//!
//! A PP node runs two independent instances: rule requests per tenant (new flows/s)
//! and packets through the `police CLASS` action. One op is one request or one
//! packet; the crate does not care which. It is I/O-free: no clocks, no threads, time
//! is passed in.
//!
//! - [`RateManager`] (owner/tick thread): per tenant rates `min ≤ base ≤ burst`, an
//!   optional `debt`, a credit and a state in {[`CreditState::Min`],
//!   [`CreditState::Base`], [`CreditState::Burst`]}. Each [`RateManager::tick`] takes
//!   the ops offered (true demand, refused included) and admitted in the last tick,
//!   updates credits and states, and recomputes every tenant's allowance.
//! - [`Limiter`] / [`WorkerLimiter`]: the per-op side. Workers count and admit ops
//!   through a local [`TokenBucket`] per tenant running at `allowance / workers`;
//!   [`Limiter::tick`] collects the counters, ticks the manager and publishes the new
//!   allowances through atomics (no lock on the per-op path).
//! - [`sim`]: a deterministic fluid simulator of one node, for tests and benches.
//!
//! # The mechanism
//!
//! Each tick of `dt` seconds a tenant has offered rate `a` and admitted rate `x`; it is
//! *heavy* when `a > base`, *light* otherwise. The node (capacity `C`) is *abundant*
//! when the remaining resource `R ≥ abundant_fraction·C`, else *intense*, where
//! `R = C − unmanaged − Σ min(a_i, base_i)`: the capacity that no tenant currently
//! claims under its subscription, i.e. what can be lent. (Counting all admitted ops
//! instead would make every work-conserving burst declare the node intense and end
//! itself the next tick, so borrowing would oscillate.)
//!
//! - **Credit**: `credit += (base − x)·dt`, clamped to `[floor, base·credit_cap_secs]`;
//!   `floor = −debt` when `debt > 0` and the node is abundant, else
//!   `min(0, credit)`: debt is only entered while abundant, and is never forgiven.
//!   What a tick spends below the floor is not forgiven either: it is *owed* (at most
//!   `base·credit_cap_secs`) and repaid from the next earnings before credit grows.
//!   Data paths admit whole packets, so the tick that exhausts a burst's credit can
//!   admit up to a packet more than the credit paid for; clamped and forgotten, that
//!   packet recurred at every exhaustion and a low-rate tenant got well above its base
//!   with no credit earned (a property test's find: base 1 packet/s, 12 admitted in 8 s).
//! - **Transitions** (Fig. 6b), with "credit available" meaning `credit > 0` or
//!   (`debt > 0`, abundant and `credit > −debt`):
//!   - `Base`: heavy ∧ credit available → `Burst`; light ∧ abundant → `Min`.
//!   - `Min`: light ∧ `a > g_min` → `Base` (a yield is a loan: the tenant reclaims its
//!     base whatever the node's load; the paper conditions it on "adequate" resources,
//!     which would let a flood keep a light tenant below its subscription); heavy ∧
//!     abundant ∧ credit available → `Burst`; heavy otherwise → `Base`.
//!   - `Burst`: light ∧ intense → `Min`; light → `Base`; heavy ∧ credit exhausted →
//!     `Min` (Fig. 10: once the credit runs out the rate falls back to base).
//! - **Guarantee / cap**: `Base`: base / base. `Burst`: base / burst, but no more
//!   above base than the credit (plus usable debt) pays for in one tick, so a burst
//!   never overspends. `Min`: `g_min = clamp(1.25·a, min, base)` / base.
//! - **Allocation**: if `Σ guarantee > C` guarantees are scaled down proportionally (a
//!   warning is logged once per episode). `spare = C − unmanaged − Σ guarantee` is
//!   water-filled, weighted by base, among tenants whose demand and cap exceed their
//!   guarantee, each up to `min(cap, 1.1·a + 1)`; what is left after every demand is met
//!   is shared the same way up to caps. `allowance = guarantee + share`, so
//!   `Σ allowance ≤ C` always. A guarantee is reserved even when unused; a light
//!   tenant's unused base is lent only after it yields (enters `Min`).
//!
//! See `docs/rate.md` for the full discussion.

mod bucket;
mod limiter;
mod manager;
pub mod sim;

pub use bucket::TokenBucket;
pub use limiter::{Limiter, WorkerLimiter};
pub use manager::RateManager;

use serde::{Deserialize, Serialize};

/// Errors of rate configuration.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RateError {
    #[error("rate field `{field}` must be finite and non-negative, got {value}")]
    InvalidField { field: &'static str, value: f64 },
    #[error("min > base ({min} > {base})")]
    MinAboveBase { min: f64, base: f64 },
    #[error("burst < base ({burst} < {base})")]
    BurstBelowBase { burst: f64, base: f64 },
    #[error("base must be > 0")]
    ZeroBase,
    #[error("capacity must be finite and > 0, got {0}")]
    InvalidCapacity(f64),
    #[error("config field `{field}` is invalid: {value}")]
    InvalidConfig { field: &'static str, value: f64 },
}

/// A tenant's subscription, in ops per second (`debt` in ops).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TenantRates {
    /// Floor of the tenant's reservation while it yields (`S_min`).
    pub min: f64,
    /// Subscribed rate: the reservation in `S_base` and `S_burst`.
    pub base: f64,
    /// Cap while spending credit (`S_burst`).
    pub burst: f64,
    /// Largest negative credit allowed (0 = no debt).
    pub debt: f64,
}

impl TenantRates {
    /// Rates per second, in the order the CLI and the API write them.
    pub const fn new(min: f64, base: f64, burst: f64, debt: f64) -> TenantRates {
        TenantRates {
            min,
            base,
            burst,
            debt,
        }
    }

    /// Checks `0 ≤ min ≤ base ≤ burst`, `base > 0`, `debt ≥ 0`, all finite.
    pub fn validate(&self) -> Result<(), RateError> {
        for (field, value) in [
            ("min", self.min),
            ("base", self.base),
            ("burst", self.burst),
            ("debt", self.debt),
        ] {
            if !value.is_finite() || value < 0.0 {
                return Err(RateError::InvalidField { field, value });
            }
        }
        if self.base == 0.0 {
            return Err(RateError::ZeroBase);
        }
        if self.min > self.base {
            return Err(RateError::MinAboveBase {
                min: self.min,
                base: self.base,
            });
        }
        if self.burst < self.base {
            return Err(RateError::BurstBelowBase {
                burst: self.burst,
                base: self.base,
            });
        }
        Ok(())
    }
}

/// A tenant's rate-control level (Fig. 6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CreditState {
    Min,
    Base,
    Burst,
}

impl CreditState {
    pub fn as_str(self) -> &'static str {
        match self {
            CreditState::Min => "min",
            CreditState::Base => "base",
            CreditState::Burst => "burst",
        }
    }
}

impl std::fmt::Display for CreditState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Node-level parameters of a [`RateManager`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RateConfig {
    /// Node capacity, ops/s.
    pub capacity: f64,
    /// Nominal tick period (what the owner thread should pass as `dt_ms`).
    pub tick_ms: u64,
    /// The node is abundant while the remaining resource is at least this share of
    /// the capacity.
    pub abundant_fraction: f64,
    /// Credit is capped at `base · credit_cap_secs`.
    pub credit_cap_secs: f64,
    /// Token bucket depth, in ms of allowance.
    pub bucket_ms: f64,
}

impl Default for RateConfig {
    fn default() -> Self {
        RateConfig {
            capacity: 100_000.0,
            tick_ms: 100,
            abundant_fraction: 0.1,
            credit_cap_secs: 10.0,
            bucket_ms: 20.0,
        }
    }
}

impl RateConfig {
    pub fn validate(&self) -> Result<(), RateError> {
        if !self.capacity.is_finite() || self.capacity <= 0.0 {
            return Err(RateError::InvalidCapacity(self.capacity));
        }
        let bad = |field, value: f64| Err(RateError::InvalidConfig { field, value });
        if self.tick_ms == 0 {
            return bad("tick_ms", 0.0);
        }
        if !(0.0..=1.0).contains(&self.abundant_fraction) {
            return bad("abundant_fraction", self.abundant_fraction);
        }
        if !self.credit_cap_secs.is_finite() || self.credit_cap_secs < 0.0 {
            return bad("credit_cap_secs", self.credit_cap_secs);
        }
        if !self.bucket_ms.is_finite() || self.bucket_ms <= 0.0 {
            return bad("bucket_ms", self.bucket_ms);
        }
        Ok(())
    }
}

/// One tenant's op counts over the last tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantUsage {
    pub tenant: u32,
    /// Ops that arrived, refused ones included.
    pub offered: u64,
    pub admitted: u64,
}

/// A tenant's rate state, as [`RateManager::status`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TenantRateStatus {
    pub tenant: u32,
    pub rates: TenantRates,
    pub state: CreditState,
    pub credit: f64,
    /// Ops/s the tenant may use until the next tick.
    pub allowance: f64,
    pub offered_rate: f64,
    pub admitted_rate: f64,
    pub refused_total: u64,
}

/// Jain's fairness index `(Σx)² / (n·Σx²)`: 1.0 when all equal (and for an empty or
/// all-zero input), `1/n` when one takes everything.
pub fn jain(xs: &[f64]) -> f64 {
    let sum: f64 = xs.iter().sum();
    let sq: f64 = xs.iter().map(|x| x * x).sum();
    if xs.is_empty() || sq == 0.0 || !sq.is_finite() {
        return 1.0;
    }
    sum * sum / (xs.len() as f64 * sq)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(min: f64, base: f64, burst: f64, debt: f64) -> TenantRates {
        TenantRates::new(min, base, burst, debt)
    }

    #[test]
    fn validate_names_the_problem() {
        assert!(r(0.0, 10.0, 10.0, 0.0).validate().is_ok());
        match r(0.0, 10.0, 20.0, -1.0).validate() {
            Err(RateError::InvalidField { field, .. }) => assert_eq!(field, "debt"),
            other => panic!("{other:?}"),
        }
        match r(f64::NAN, 10.0, 20.0, 0.0).validate() {
            Err(RateError::InvalidField { field, .. }) => assert_eq!(field, "min"),
            other => panic!("{other:?}"),
        }
        let e = r(0.0, 10.0, 5.0, 0.0).validate().unwrap_err();
        assert!(e.to_string().contains("burst < base"), "{e}");
        assert!(matches!(
            r(11.0, 10.0, 20.0, 0.0).validate(),
            Err(RateError::MinAboveBase { .. })
        ));
        assert_eq!(r(0.0, 0.0, 0.0, 0.0).validate(), Err(RateError::ZeroBase));
        assert!(matches!(
            r(0.0, 10.0, f64::INFINITY, 0.0).validate(),
            Err(RateError::InvalidField { field: "burst", .. })
        ));
    }

    #[test]
    fn state_names() {
        for (s, n) in [
            (CreditState::Min, "min"),
            (CreditState::Base, "base"),
            (CreditState::Burst, "burst"),
        ] {
            assert_eq!(s.to_string(), n);
            assert_eq!(s.as_str(), n);
        }
    }

    #[test]
    fn config_validation() {
        assert!(RateConfig::default().validate().is_ok());
        for cap in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let cfg = RateConfig {
                capacity: cap,
                ..RateConfig::default()
            };
            assert!(RateManager::new(cfg).is_err(), "{cap}");
        }
        let cfg = RateConfig {
            abundant_fraction: 2.0,
            ..RateConfig::default()
        };
        assert!(cfg.validate().is_err());
    }

    #[test]
    fn jain_index() {
        assert_eq!(jain(&[]), 1.0);
        assert_eq!(jain(&[0.0, 0.0]), 1.0);
        assert!((jain(&[3.0, 3.0, 3.0]) - 1.0).abs() < 1e-12);
        assert!((jain(&[1.0, 0.0, 0.0, 0.0]) - 0.25).abs() < 1e-12);
    }
}
