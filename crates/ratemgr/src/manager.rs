//! The credit state machine and the allocation of one node.

use std::collections::{BTreeMap, HashMap};

use crate::{CreditState, RateConfig, RateError, TenantRateStatus, TenantRates, TenantUsage};

/// Credits at or below this many seconds of base are treated as none, so float noise
/// does not flip a tenant into `Burst`.
const CREDIT_EPS_SECS: f64 = 1e-6;
/// A `Min` tenant's reservation is this multiple of its demand (clamped to
/// `[min, base]`).
const MIN_HEADROOM: f64 = 1.25;

#[derive(Debug, Clone)]
struct Tenant {
    rates: TenantRates,
    state: CreditState,
    credit: f64,
    /// Spending below the credit's floor, repaid from earnings before credit grows
    /// (see the crate docs); never negative, at most the credit cap.
    owed: f64,
    /// Unscaled guarantee of the current allocation (what `g_min` compares against).
    guarantee: f64,
    allowance: f64,
    offered_rate: f64,
    admitted_rate: f64,
    refused_total: u64,
}

impl Tenant {
    fn new(rates: TenantRates) -> Self {
        Tenant {
            rates,
            state: CreditState::Base,
            credit: 0.0,
            owed: 0.0,
            guarantee: rates.base,
            allowance: rates.base,
            offered_rate: 0.0,
            admitted_rate: 0.0,
            refused_total: 0,
        }
    }

    /// `(guarantee, cap)` for the next tick of `tick_s` seconds. In `Burst` the cap
    /// also stops at what the credit (and usable debt) can pay for in one tick, so a
    /// burst never overspends its credit.
    fn guarantee_and_cap(&self, tick_s: f64, abundant: bool) -> (f64, f64) {
        let r = &self.rates;
        match self.state {
            CreditState::Base => (r.base, r.base),
            CreditState::Burst => {
                let debt = if r.debt > 0.0 && abundant {
                    r.debt
                } else {
                    0.0
                };
                let payable = fin((self.credit + debt).max(0.0) / tick_s);
                (r.base, r.burst.min(r.base + payable))
            }
            CreditState::Min => {
                let g = (MIN_HEADROOM * self.offered_rate).clamp(r.min, r.base);
                (g, r.base)
            }
        }
    }

    fn credit_cap(&self, cfg: &RateConfig) -> f64 {
        self.rates.base * cfg.credit_cap_secs
    }
}

/// The per-node rate manager: credits, states and allowances of the managed tenants.
#[derive(Debug, Clone)]
pub struct RateManager {
    cfg: RateConfig,
    tenants: BTreeMap<u32, Tenant>,
    unmanaged_rate: f64,
    abundant: bool,
    remaining: f64,
    oversubscribed: bool,
}

impl RateManager {
    pub fn new(cfg: RateConfig) -> Result<Self, RateError> {
        cfg.validate()?;
        Ok(RateManager {
            cfg,
            tenants: BTreeMap::new(),
            unmanaged_rate: 0.0,
            abundant: true,
            remaining: cfg.capacity,
            oversubscribed: false,
        })
    }

    pub fn config(&self) -> &RateConfig {
        &self.cfg
    }

    /// Sets or changes a tenant's rates. A new tenant starts in `Base` with credit 0;
    /// an existing one keeps state and credit (clamped to the new bounds).
    pub fn set(&mut self, tenant: u32, rates: TenantRates) -> Result<(), RateError> {
        rates.validate()?;
        let cap = rates.base * self.cfg.credit_cap_secs;
        self.tenants
            .entry(tenant)
            .and_modify(|t| {
                t.rates = rates;
                t.credit = t.credit.clamp(-rates.debt, cap);
                t.owed = t.owed.min(cap);
            })
            .or_insert_with(|| Tenant::new(rates));
        self.allocate();
        Ok(())
    }

    /// Stops managing a tenant (it becomes unlimited). Returns whether it was managed.
    pub fn remove(&mut self, tenant: u32) -> bool {
        let had = self.tenants.remove(&tenant).is_some();
        if had {
            self.allocate();
        }
        had
    }

    pub fn set_capacity(&mut self, capacity: f64) -> Result<(), RateError> {
        if !capacity.is_finite() || capacity <= 0.0 {
            return Err(RateError::InvalidCapacity(capacity));
        }
        self.cfg.capacity = capacity;
        self.allocate();
        Ok(())
    }

    /// Whether the last tick found the node abundant.
    pub fn abundant(&self) -> bool {
        self.abundant
    }

    /// The remaining (lendable) resource of the last tick, ops/s.
    pub fn remaining(&self) -> f64 {
        self.remaining
    }

    /// Advances credits and states by one tick of `dt_ms` with the counts of that tick
    /// and recomputes the allowances. `unmanaged` are ops admitted for tenants without
    /// rates; usage of unknown tenants counts as unmanaged, duplicate entries add up.
    /// A zero `dt_ms` only records refusals.
    pub fn tick(&mut self, dt_ms: u64, usage: &[TenantUsage], unmanaged: u64) {
        let mut counts: HashMap<u32, (f64, f64)> = HashMap::with_capacity(usage.len());
        let mut unmanaged = unmanaged as f64;
        for u in usage {
            if let Some(t) = self.tenants.get_mut(&u.tenant) {
                t.refused_total = t
                    .refused_total
                    .saturating_add(u.offered.saturating_sub(u.admitted));
                let c = counts.entry(u.tenant).or_default();
                // Admitted ops were offered too, whatever the counter says.
                c.0 += u.offered.max(u.admitted) as f64;
                c.1 += u.admitted as f64;
            } else {
                unmanaged += u.admitted as f64;
            }
        }
        if dt_ms == 0 {
            return;
        }
        let dt = dt_ms as f64 / 1000.0;
        let cfg = self.cfg;
        self.unmanaged_rate = unmanaged / dt;
        for (id, t) in self.tenants.iter_mut() {
            let (o, a) = counts.get(id).copied().unwrap_or_default();
            t.offered_rate = o / dt;
            t.admitted_rate = a / dt;
        }
        let claimed: f64 = self
            .tenants
            .values()
            .map(|t| t.offered_rate.min(t.rates.base))
            .sum();
        let c = cfg.capacity;
        self.remaining = c - self.unmanaged_rate - claimed;
        let abundant = self.remaining >= cfg.abundant_fraction * c;
        self.abundant = abundant;
        for t in self.tenants.values_mut() {
            step(t, &cfg, dt, abundant);
        }
        self.allocate();
    }

    /// Ops/s the tenant may use until the next tick; `None` = no rates (unlimited).
    pub fn allowance(&self, tenant: u32) -> Option<f64> {
        self.tenants.get(&tenant).map(|t| t.allowance)
    }

    pub fn get(&self, tenant: u32) -> Option<TenantRateStatus> {
        self.tenants.get(&tenant).map(|t| status(tenant, t))
    }

    /// Every managed tenant, sorted by tenant.
    pub fn status(&self) -> Vec<TenantRateStatus> {
        self.tenants.iter().map(|(&id, t)| status(id, t)).collect()
    }

    fn allocate(&mut self) {
        let c = self.cfg.capacity;
        let tick_s = self.cfg.tick_ms as f64 / 1000.0;
        let u = fin(self.unmanaged_rate);
        let mut gc: Vec<(f64, f64)> = self
            .tenants
            .values()
            .map(|t| t.guarantee_and_cap(tick_s, self.abundant))
            .collect();
        for (t, &(g, _)) in self.tenants.values_mut().zip(&gc) {
            t.guarantee = g;
        }
        let sum_g: f64 = gc.iter().map(|x| x.0).sum();
        if sum_g > c {
            if !self.oversubscribed {
                tracing::warn!(
                    guarantees = sum_g,
                    capacity = c,
                    "rate guarantees exceed node capacity; scaling them down"
                );
                self.oversubscribed = true;
            }
            let scale = fin(c / sum_g);
            for x in gc.iter_mut() {
                x.0 = fin(x.0 * scale);
            }
        } else {
            self.oversubscribed = false;
        }
        let sum_g: f64 = gc.iter().map(|x| x.0).sum();
        let mut spare = fin(c - u - sum_g).max(0.0);
        let mut alloc: Vec<f64> = gc.iter().map(|x| x.0).collect();
        // Phase 1: to tenants whose demand exceeds their guarantee, up to demand+10%.
        let items: Vec<(f64, f64)> = self
            .tenants
            .values()
            .zip(&gc)
            .map(|(t, &(g, cap))| {
                let d = t.offered_rate;
                let h = if cap > g && d > g {
                    (cap.min(d * 1.1 + 1.0) - g).max(0.0)
                } else {
                    0.0
                };
                (t.rates.base, h)
            })
            .collect();
        for (a, s) in alloc.iter_mut().zip(water_fill(spare, &items)) {
            *a += s;
            spare -= s;
        }
        // Phase 2: what is left, up to caps, so growth is not throttled by lag.
        let items: Vec<(f64, f64)> = self
            .tenants
            .values()
            .zip(gc.iter().zip(&alloc))
            .map(|(t, (&(_, cap), &a))| (t.rates.base, (cap - a).max(0.0)))
            .collect();
        for (a, s) in alloc.iter_mut().zip(water_fill(spare.max(0.0), &items)) {
            *a += s;
        }
        for (t, a) in self.tenants.values_mut().zip(alloc) {
            t.allowance = fin(a).max(0.0);
        }
    }
}

fn fin(x: f64) -> f64 {
    if x.is_finite() {
        x
    } else {
        0.0
    }
}

fn status(tenant: u32, t: &Tenant) -> TenantRateStatus {
    TenantRateStatus {
        tenant,
        rates: t.rates,
        state: t.state,
        credit: t.credit,
        allowance: t.allowance,
        offered_rate: t.offered_rate,
        admitted_rate: t.admitted_rate,
        refused_total: t.refused_total,
    }
}

/// One tick of a tenant's credit and state (Fig. 6b).
fn step(t: &mut Tenant, cfg: &RateConfig, dt: f64, abundant: bool) {
    let r = t.rates;
    let floor = if r.debt > 0.0 && abundant {
        -r.debt
    } else {
        t.credit.min(0.0)
    };
    let ceil = t.credit_cap(cfg);
    let earned = (r.base - t.admitted_rate) * dt;
    if !earned.is_nan() {
        let repaid = if earned > 0.0 {
            t.owed.min(earned)
        } else {
            0.0
        };
        t.owed -= repaid;
        let next = t.credit + earned - repaid;
        if next < floor {
            t.owed = (t.owed + (floor - next)).min(ceil);
        }
        t.credit = next.clamp(floor, ceil);
    }
    let eps = r.base * CREDIT_EPS_SECS;
    let heavy = t.offered_rate > r.base;
    let has_credit = t.credit > eps || (r.debt > 0.0 && abundant && t.credit > -r.debt + eps);
    use CreditState::*;
    t.state = match t.state {
        Base if heavy && has_credit => Burst,
        Base if !heavy && abundant => Min,
        Base => Base,
        Min if !heavy && t.offered_rate > t.guarantee => Base,
        Min if heavy && abundant && has_credit => Burst,
        Min if heavy => Base,
        Min => Min,
        Burst if !heavy && !abundant => Min,
        Burst if !heavy => Base,
        Burst if !has_credit => Min,
        Burst => Burst,
    };
}

/// Weighted water-filling: splits `spare` among items `(weight, headroom)` in
/// proportion to weight, none above its headroom.
fn water_fill(spare: f64, items: &[(f64, f64)]) -> Vec<f64> {
    let mut out = vec![0.0; items.len()];
    let mut idx: Vec<usize> = (0..items.len())
        .filter(|&i| items[i].0 > 0.0 && items[i].1 > 0.0)
        .collect();
    idx.sort_by(|&a, &b| (items[a].1 / items[a].0).total_cmp(&(items[b].1 / items[b].0)));
    let mut left = spare;
    let mut wsum: f64 = idx.iter().map(|&i| items[i].0).sum();
    for (k, &i) in idx.iter().enumerate() {
        if left <= 0.0 || wsum <= 0.0 {
            break;
        }
        let level = left / wsum;
        let (w, h) = items[i];
        if h / w <= level {
            out[i] = h;
            left -= h;
            wsum -= w;
        } else {
            for &j in &idx[k..] {
                out[j] = items[j].0 * level;
            }
            break;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A manager of `capacity` ops/s, defaults otherwise.
    fn manager(capacity: f64) -> RateManager {
        RateManager::new(RateConfig {
            capacity,
            ..RateConfig::default()
        })
        .unwrap()
    }

    fn rates(min: f64, base: f64, burst: f64, debt: f64) -> TenantRates {
        TenantRates::new(min, base, burst, debt)
    }

    #[test]
    fn water_fill_respects_weights_and_headroom() {
        let s = water_fill(90.0, &[(1.0, 100.0), (2.0, 100.0)]);
        assert!(
            (s[0] - 30.0).abs() < 1e-9 && (s[1] - 60.0).abs() < 1e-9,
            "{s:?}"
        );
        let s = water_fill(90.0, &[(1.0, 10.0), (1.0, 100.0), (0.0, 5.0)]);
        assert!(
            (s[0] - 10.0).abs() < 1e-9 && (s[1] - 80.0).abs() < 1e-9,
            "{s:?}"
        );
        assert_eq!(s[2], 0.0);
        let s = water_fill(10.0, &[(1.0, 2.0), (1.0, 3.0)]);
        assert_eq!(s, vec![2.0, 3.0]);
    }

    #[test]
    fn set_rejects_and_changes_nothing() {
        let mut m = RateManager::new(RateConfig::default()).unwrap();
        m.set(1, rates(0.0, 100.0, 200.0, 0.0)).unwrap();
        let before = m.status();
        for bad in [
            rates(-1.0, 100.0, 200.0, 0.0),
            rates(0.0, f64::NAN, 200.0, 0.0),
            rates(0.0, 100.0, 50.0, 0.0),
            rates(150.0, 100.0, 200.0, 0.0),
        ] {
            assert!(m.set(1, bad).is_err());
            assert!(m.set(2, bad).is_err());
            assert_eq!(m.status(), before);
            assert_eq!(m.allowance(2), None);
        }
        assert!(m.remove(1));
        assert!(!m.remove(1));
        assert_eq!(m.allowance(1), None);
    }

    #[test]
    fn new_tenant_starts_in_base_with_zero_credit() {
        let mut m = RateManager::new(RateConfig::default()).unwrap();
        m.set(7, rates(10.0, 1000.0, 2000.0, 0.0)).unwrap();
        let s = m.get(7).unwrap();
        assert_eq!((s.state, s.credit), (CreditState::Base, 0.0));
        assert!(s.allowance >= 1000.0);
    }

    #[test]
    fn oversubscribed_guarantees_scale_down() {
        let mut m = manager(1000.0);
        m.set(1, rates(0.0, 1000.0, 1000.0, 0.0)).unwrap();
        m.set(2, rates(0.0, 1000.0, 1000.0, 0.0)).unwrap();
        let total: f64 = m.status().iter().map(|s| s.allowance).sum();
        assert!((total - 1000.0).abs() < 1e-6, "{total}");
        m.set_capacity(4000.0).unwrap();
        assert_eq!(m.allowance(1), Some(1000.0));
        assert!(m.set_capacity(f64::NAN).is_err());
    }

    #[test]
    fn light_tenant_yields_then_reclaims_base_under_a_flood() {
        let mut m = manager(1000.0);
        m.set(1, rates(10.0, 400.0, 400.0, 0.0)).unwrap();
        m.set(2, rates(0.0, 600.0, 1000.0, 0.0)).unwrap();
        let u = |t, o, a| TenantUsage {
            tenant: t,
            offered: o,
            admitted: a,
        };
        // tenant 1 light at 100/s on an abundant node -> Min
        m.tick(1000, &[u(1, 100, 100), u(2, 300, 300)], 0);
        assert_eq!(m.get(1).unwrap().state, CreditState::Min);
        // Its reservation shrank to 1.25·a; it may still use idle capacity up to base.
        assert!(m.allowance(1).unwrap() <= 400.0 + 1e-9);
        // node turns intense (tenant 2 floods, unmanaged traffic too); tenant 1 ramps
        // past its yield-time guarantee: it must get back to Base.
        m.tick(1000, &[u(1, 300, 125), u(2, 9000, 600)], 300);
        assert!(!m.abundant());
        assert_eq!(m.get(1).unwrap().state, CreditState::Base);
        assert!(m.allowance(1).unwrap() >= 400.0 - 1e-9);
    }
}
