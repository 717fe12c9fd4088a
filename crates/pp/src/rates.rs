//! Per-tenant rate management at a PP node (paper 000 §7.2, DESIGN.md "Rate
//! management"): two credit-based rate managers, one for new flows (rule requests, the
//! paper's Mrps) and one for packets, each with a token bucket per tenant that a
//! [`PpPolicer`] consults from the worker.
//!
//! The node thread owns [`RateLimits`]: it applies the orchestrator's rates, ticks the
//! managers every `tick_ms` (the tick moves credits and states and sets each tenant's
//! allowance from the node's remaining capacity) and reports each tenant's state.
//! Workers only touch their [`ratemgr::WorkerLimiter`]s: no lock on the packet path.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use pipeline::{Pipeline, Policer};
use proto::v1;
use ratemgr::{Limiter, RateConfig, RateError, RateManager, TenantRates, WorkerLimiter};

/// The node's capacity per kind of op, the base of "remaining capacity" (Fig. 6b).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateCapacity {
    /// New flows (rule requests) per second the node's setup path sustains.
    pub requests: f64,
    /// Packets per second the node forwards.
    pub packets: f64,
}

impl Default for RateCapacity {
    fn default() -> Self {
        RateCapacity {
            requests: 50_000.0,
            packets: 1_000_000.0,
        }
    }
}

/// One tenant's rates of both kinds; `None`: that kind is not managed for it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TenantRateLimits {
    pub requests: Option<TenantRates>,
    pub packets: Option<TenantRates>,
}

impl TenantRateLimits {
    pub fn from_proto(r: &v1::TenantRate) -> TenantRateLimits {
        let spec = |s: &Option<v1::RateSpec>| {
            s.as_ref()
                .map(|s| TenantRates::new(s.min, s.base, s.burst, s.debt))
        };
        TenantRateLimits {
            requests: spec(&r.requests),
            packets: spec(&r.packets),
        }
    }
}

struct Kind {
    name: &'static str,
    mgr: RateManager,
    limiter: Limiter,
}

/// The new-flow buckets' depth: one tick of allowance. New flows arrive in bursts
/// (connection pools opening together, SYN retransmissions in step) and a worker that
/// was off its CPU for a while reads them in one batch, at one timestamp. With the
/// packet kind's 20 ms depth, a tenant far below its allowance was refused whenever a
/// stall of a few tens of ms bunched its SYNs (e2e_isolation: the victim at 50 flows/s
/// against a 200/s base lost about one SYN in three runs on a loaded 2-core machine, and
/// each refused SYN costs it Linux's 1 s retransmission). A tenant is still held to its
/// allowance over time; only what it may take at once after being idle grows, to the
/// one tick of allowance the manager sets at a time.
const REQUEST_BUCKET_MS: f64 = 100.0;

impl Kind {
    fn new(
        name: &'static str,
        capacity: f64,
        workers: usize,
        bucket_ms: f64,
    ) -> Result<Kind, RateError> {
        let cfg = RateConfig {
            capacity,
            bucket_ms,
            ..RateConfig::default()
        };
        let limiter = Limiter::new(workers, cfg.bucket_ms);
        Ok(Kind {
            name,
            mgr: RateManager::new(cfg)?,
            limiter,
        })
    }

    /// Make the managed set exactly `want`; a tenant whose rates are refused keeps its
    /// old ones (and the error is returned).
    fn apply(&mut self, want: &BTreeMap<u32, TenantRates>) -> Vec<String> {
        let mut errors = Vec::new();
        let have: BTreeSet<u32> = self.mgr.status().iter().map(|s| s.tenant).collect();
        for t in have.iter().filter(|t| !want.contains_key(t)) {
            self.mgr.remove(*t);
        }
        for (t, r) in want {
            if let Err(e) = self.mgr.set(*t, *r) {
                errors.push(format!("tenant {t} {} rates: {e}", self.name));
            }
        }
        errors
    }

    fn status(&self, out: &mut Vec<v1::TenantRateStatus>) {
        for s in self.mgr.status() {
            out.push(v1::TenantRateStatus {
                tenant: s.tenant,
                kind: self.name.to_string(),
                state: s.state.as_str().to_string(),
                credit: s.credit,
                allowance: s.allowance,
                offered_rate: s.offered_rate,
                admitted_rate: s.admitted_rate,
                refused: self.limiter.refused_total(s.tenant),
            });
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RatesError {
    #[error(transparent)]
    Rate(#[from] RateError),
    #[error("{0}")]
    Refused(String),
}

/// Both rate managers of a PP node.
pub struct RateLimits {
    requests: Kind,
    packets: Kind,
    tick: Duration,
    last_tick: Instant,
    /// The rates last applied, per tenant (static ones merged in).
    current: BTreeMap<u32, TenantRateLimits>,
    /// Fixed rates from the command line: they win over the orchestrator's.
    fixed: BTreeMap<u32, TenantRateLimits>,
}

impl RateLimits {
    pub fn new(
        capacity: RateCapacity,
        workers: usize,
        fixed: BTreeMap<u32, TenantRateLimits>,
    ) -> Result<RateLimits, RatesError> {
        let tick = Duration::from_millis(RateConfig::default().tick_ms.max(1));
        let mut r = RateLimits {
            requests: Kind::new("requests", capacity.requests, workers, REQUEST_BUCKET_MS)?,
            packets: Kind::new(
                "packets",
                capacity.packets,
                workers,
                RateConfig::default().bucket_ms,
            )?,
            tick,
            last_tick: Instant::now(),
            current: BTreeMap::new(),
            fixed,
        };
        let errors = r.set_all(&BTreeMap::new());
        if let Some(e) = errors.first() {
            return Err(RatesError::Refused(e.clone()));
        }
        Ok(r)
    }

    /// A worker's hook: give it to the worker's pipeline with `set_policer`.
    pub fn policer(&self) -> PpPolicer {
        PpPolicer {
            requests: self.requests.limiter.worker(),
            packets: self.packets.limiter.worker(),
        }
    }

    /// Take the orchestrator's rates (a complete set: tenants not in it lose theirs)
    /// and mark the tenants with packet rates as policed in `pipeline`. Returns the
    /// rates refused, which change nothing.
    pub fn apply(&mut self, rates: &[v1::TenantRate], pipeline: &mut Pipeline) -> Vec<String> {
        let want: BTreeMap<u32, TenantRateLimits> = rates
            .iter()
            .map(|r| (r.tenant, TenantRateLimits::from_proto(r)))
            .collect();
        let before: BTreeSet<u32> = self.policed().collect();
        let errors = self.set_all(&want);
        let after: BTreeSet<u32> = self.policed().collect();
        for t in before.difference(&after) {
            pipeline.set_tenant_policed(*t, false);
        }
        for t in &after {
            pipeline.set_tenant_policed(*t, true);
        }
        errors
    }

    /// Mark the tenants with packet rates (the fixed ones at start) in `pipeline`.
    pub fn mark_policed(&self, pipeline: &mut Pipeline) {
        for t in self.policed() {
            pipeline.set_tenant_policed(t, true);
        }
    }

    /// The tenants with packet rates: the ones every worker's pipeline marks policed.
    pub fn policed_tenants(&self) -> BTreeSet<u32> {
        self.policed().collect()
    }

    /// How often a tick runs; workers other than the node thread's flush their
    /// policers this often.
    pub fn tick_period(&self) -> Duration {
        self.tick
    }

    fn policed(&self) -> impl Iterator<Item = u32> + '_ {
        self.current
            .iter()
            .filter(|(_, l)| l.packets.is_some())
            .map(|(t, _)| *t)
    }

    fn set_all(&mut self, want: &BTreeMap<u32, TenantRateLimits>) -> Vec<String> {
        let mut merged = want.clone();
        merged.extend(self.fixed.iter().map(|(t, l)| (*t, *l)));
        let pick = |f: fn(&TenantRateLimits) -> Option<TenantRates>| {
            merged
                .iter()
                .filter_map(|(t, l)| f(l).map(|r| (*t, r)))
                .collect::<BTreeMap<_, _>>()
        };
        let mut errors = self.requests.apply(&pick(|l| l.requests));
        errors.extend(self.packets.apply(&pick(|l| l.packets)));
        self.requests.limiter.publish(&self.requests.mgr);
        self.packets.limiter.publish(&self.packets.mgr);
        self.current = merged;
        errors
    }

    /// Whether a tick is due: flush the workers' policers, then [`RateLimits::tick`].
    pub fn due(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.last_tick) >= self.tick
    }

    /// Move credits, states and allowances when a tick is due.
    pub fn tick(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.last_tick);
        if dt < self.tick {
            return;
        }
        self.last_tick = now;
        let dt_ms = dt.as_millis() as u64;
        self.requests.limiter.tick(&mut self.requests.mgr, dt_ms);
        self.packets.limiter.tick(&mut self.packets.mgr, dt_ms);
    }

    /// Every managed tenant's state, both kinds, for the node report and `/metrics`.
    pub fn status(&self) -> Vec<v1::TenantRateStatus> {
        let mut out = Vec::new();
        self.requests.status(&mut out);
        self.packets.status(&mut out);
        out
    }
}

/// A worker's view of the node's rate managers.
pub struct PpPolicer {
    requests: WorkerLimiter,
    packets: WorkerLimiter,
}

/// Microseconds from the pipeline's wrapping millisecond clock. The token buckets only
/// look at differences; a wrap (every 49 days) costs one refill period.
fn us(now_ms: u32) -> u64 {
    u64::from(now_ms) * 1000
}

impl Policer for PpPolicer {
    /// `police CLASS` meters against tenant CLASS's packet rate.
    fn admit(&mut self, class: u16, _bytes: u32, now_ms: u32) -> bool {
        self.packets.admit(u32::from(class), us(now_ms))
    }

    fn admit_packet(&mut self, tenant: u32, _bytes: u32, now_ms: u32) -> bool {
        self.packets.admit(tenant, us(now_ms))
    }

    fn admit_request(&mut self, tenant: u32, now_us: u64) -> bool {
        self.requests.admit(tenant, now_us)
    }

    fn flush(&mut self) {
        self.requests.flush();
        self.packets.flush();
    }
}

/// Parse `TENANT:KIND=MIN/BASE/BURST[/DEBT]` (KIND `requests` or `packets`), the
/// command line's fixed rates.
pub fn parse_rate_flag(s: &str) -> Result<(u32, TenantRateLimits), String> {
    let (t, rest) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: want TENANT:requests=MIN/BASE/BURST[/DEBT]"))?;
    let tenant: u32 = t
        .parse()
        .map_err(|_| format!("{s:?}: tenant {t:?} is not a number"))?;
    let mut l = TenantRateLimits::default();
    for part in rest.split(',') {
        let (kind, nums) = part
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: {part:?} wants KIND=MIN/BASE/BURST[/DEBT]"))?;
        let v: Vec<f64> = nums
            .split('/')
            .map(|n| {
                n.parse::<f64>()
                    .map_err(|_| format!("{s:?}: {n:?} is not a number"))
            })
            .collect::<Result<_, _>>()?;
        let r = match v[..] {
            [min, base, burst] => TenantRates::new(min, base, burst, 0.0),
            [min, base, burst, debt] => TenantRates::new(min, base, burst, debt),
            _ => return Err(format!("{s:?}: {part:?} wants 3 or 4 numbers")),
        };
        r.validate().map_err(|e| format!("{s:?}: {e}"))?;
        match kind {
            "requests" => l.requests = Some(r),
            "packets" => l.packets = Some(r),
            k => return Err(format!("{s:?}: kind {k:?} is not requests or packets")),
        }
    }
    Ok((tenant, l))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_flags_parse_and_refuse_bad_rates() {
        let (t, l) = parse_rate_flag("7:requests=0/1000/3000,packets=0/1e5/2e5/5e4").unwrap();
        assert_eq!(t, 7);
        assert_eq!(l.requests.unwrap().burst, 3000.0);
        assert_eq!(l.packets.unwrap().debt, 5e4);
        for bad in [
            "7",
            "x:requests=0/1/2",
            "7:requests=0/10/5",
            "7:requests=-1/10/20",
            "7:bytes=0/1/2",
            "7:requests=1/2",
        ] {
            assert!(parse_rate_flag(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn the_orchestrators_set_replaces_the_last_and_fixed_rates_win() {
        let (t, fixed) = parse_rate_flag("9:requests=0/100/200").unwrap();
        let mut r =
            RateLimits::new(RateCapacity::default(), 1, BTreeMap::from([(t, fixed)])).unwrap();
        let spec = |base: f64| v1::RateSpec {
            min: 0.0,
            base,
            burst: base * 2.0,
            debt: 0.0,
        };
        let mut p = Pipeline::new(
            pipeline::PipelineConfig::new(pipeline::NodeAddr {
                ip: std::net::Ipv4Addr::new(198, 18, 0, 1),
                mac: [2, 0, 0, 0, 0, 1],
                gw_mac: [2, 0, 0, 0, 0, 2],
            }),
            pipeline::RuleSource::None,
        )
        .unwrap();
        let set = [
            v1::TenantRate {
                tenant: 1,
                requests: Some(spec(1000.0)),
                packets: Some(spec(1e5)),
            },
            v1::TenantRate {
                tenant: 9,
                requests: Some(spec(5.0)),
                packets: None,
            },
        ];
        assert!(r.apply(&set, &mut p).is_empty());
        let st = r.status();
        let find = |t: u32, k: &str| st.iter().find(|s| s.tenant == t && s.kind == k).cloned();
        assert!(find(1, "requests").is_some() && find(1, "packets").is_some());
        // Tenant 9's fixed rates win over the orchestrator's 5/s.
        assert_eq!(find(9, "requests").map(|s| s.state), Some("base".into()));
        assert!(find(9, "packets").is_none());
        // A refused rate changes nothing and is reported.
        let bad = [v1::TenantRate {
            tenant: 1,
            requests: Some(v1::RateSpec {
                min: 0.0,
                base: 10.0,
                burst: 1.0,
                debt: 0.0,
            }),
            packets: None,
        }];
        let errors = r.apply(&bad, &mut p);
        assert_eq!(errors.len(), 1, "{errors:?}");
        // The next complete set without tenant 1 removes it.
        assert!(r.apply(&[], &mut p).is_empty());
        assert!(r.status().iter().all(|s| s.tenant == 9));
    }

    #[test]
    fn a_bunch_of_new_flows_under_the_allowance_passes_and_a_flood_is_held() {
        // 200 new flows/s: a tick (100 ms) of depth is 20 flows at once.
        let (t, fixed) = parse_rate_flag("3:requests=0/200/200").unwrap();
        let r = RateLimits::new(RateCapacity::default(), 1, BTreeMap::from([(t, fixed)])).unwrap();
        let allowance = r.status()[0].allowance;
        assert!((allowance - 200.0).abs() < 1e-6, "allowance {allowance}");
        let mut pol = r.policer();
        let now = 5_000_000;
        // Twelve SYNs read in one batch (a worker back on its CPU after 60 ms): the
        // packet kind's 20 ms depth would have refused all but 4.
        let bunch = (0..12).filter(|_| pol.admit_request(t, now)).count();
        assert_eq!(bunch, 12);
        // A flood at one instant gets the rest of the bucket and no more...
        let flood = (0..1000).filter(|_| pol.admit_request(t, now)).count();
        assert_eq!(flood, 20 - 12);
        // ...and then the allowance: 200/s over the next second, ±1 for rounding.
        let mut admitted = 0;
        for ms in 1..=1000u64 {
            admitted += (0..50)
                .filter(|_| pol.admit_request(t, now + ms * 1000))
                .count();
        }
        assert!(
            (199..=201).contains(&admitted),
            "admitted {admitted} in 1 s"
        );
    }
}
