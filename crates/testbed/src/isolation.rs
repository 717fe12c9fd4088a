//! Tenant isolation at the PP node (paper 000 §7.2, Fig. 10) on the netns testbed: a
//! tenant flooding new flows must not hurt another tenant's connection setup, is held
//! to its burst rate while it has credit and to its base rate after, and spare setup
//! capacity is shared fairly among tenants that want more (work conservation).
//!
//! Three VPCs, each with a SNAT chain toward nginx on the internet host: A (VPC 0,
//! tenant 1), B (VPC 1, tenant 2), C (VPC 2, tenant 3). The PP node runs with
//! `--setup-capacity` and a `--tenant-rate TENANT:requests=0/BASE/BURST[/DEBT]` per
//! tenant, and serves `/metrics` on 127.0.0.1 of its namespace, which a thread inside
//! that namespace scrapes every [`IsolationSpec::sample_ms`] (state, credit, allowance,
//! offered and admitted new flows/s of each tenant, as the rate manager's last tick saw
//! them).
//!
//! - Phase 0 (baseline): B alone makes paced real TCP connections ([`ConnLoop`]) for
//!   [`IsolationSpec::baseline_secs`]: B's p99 setup time and failures.
//! - A stays quiet a few more seconds, earning credit (it earns `base` per second from
//!   the PP node's start, capped at 10 s × base).
//! - Phase 1 (flood): hping3 sends SYNs from A's client at `flood_factor × base` per
//!   second (every SYN has a new source port, so each is a new flow at PP) while B
//!   repeats its paced load. The flood lasts until A's credit has been spent (≤ 1% of
//!   base, after it entered S_burst) for [`IsolationSpec::after_credit_secs`], at most
//!   [`IsolationSpec::flood_max_secs`]. Gives B's failures and p99 against the
//!   baseline, and A's admitted rate while in S_burst ÷ burst, and after ÷ base.
//! - Phase 2 (fairness, work conservation): a fresh platform with a debt allowance for
//!   every tenant (so an over-base tenant may keep borrowing spare capacity after its
//!   credit is spent); A and B both flood at `flood_factor × base`, C stays idle. Jain's
//!   index over A's and B's admitted rates, and utilisation = Σ admitted of all tenants
//!   ÷ setup capacity, averaged after a warm-up.
//!
//! Everything runs in the testbed's namespaces (198.18.0.0/15); hping3 is bounded in
//! count (`-c`) and time (stopped by its PID), and the testbed's [`crate::Resources`]
//! kill it on any failure.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{SocketAddr, SocketAddrV4};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use telemetry::scrape::{self, Sample};
use tracing::info;

use crate::chains::{self, Toward};
use crate::elastic::{
    enter_netns, p99_setup_us, setup_quantile_us, ConnLoop, ConnSample, LoadSpec, Outcome,
};
use crate::platform::{self, Platform, PlatformSpec};
use crate::services::{self, HTTP_PORT};
use crate::topo::{addr, vni, Node, Proc, Testbed};
use crate::{cmd, Error, Result};

/// Where the PP node serves `/metrics`, inside its namespace.
pub const METRICS_ADDR: SocketAddrV4 = SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 9464);

/// Tenant ids: A (the aggressor) on VPC 0, B (the victim) on VPC 1, C (idle) on VPC 2.
pub const TENANT_A: u32 = 1;
pub const TENANT_B: u32 = 2;
pub const TENANT_C: u32 = 3;

/// The scenario's parameters (all in the report). Read from JSON, a missing field takes
/// its value from [`IsolationSpec::new`] (`bench isolation --workload FILE`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct IsolationSpec {
    /// `--setup-capacity`: new flows/s the PP node shares out.
    pub setup_capacity: f64,
    /// Every tenant's guaranteed new flows/s (phase 2: capacity / 3).
    pub base: f64,
    /// Every tenant's burst new flows/s.
    pub burst: f64,
    /// Phase 2's debt allowance (ops); phase 1 runs without debt, so A's rate after its
    /// credit is spent is its base.
    pub debt: f64,
    /// Floods are `flood_factor × base` SYNs per second.
    pub flood_factor: f64,
    /// hping3 processes per flood, each sending its share (one hping3 paced with
    /// `-i u100` reaches only ~4000 SYN/s here: its sleeps overshoot).
    pub flood_procs: usize,
    /// B's paced new TCP connections per second.
    pub victim_rate: f64,
    pub victim_workers: usize,
    pub baseline_secs: f64,
    /// A's quiet time after the baseline, before the flood.
    pub quiet_secs: f64,
    /// Phase 1 ends this long after A's credit was spent ...
    pub after_credit_secs: f64,
    /// ... or after this long in any case.
    pub flood_max_secs: f64,
    /// Phase 2: samples in the first `fair_warmup_secs` are not averaged.
    pub fair_warmup_secs: f64,
    pub fair_secs: f64,
    /// Metrics scrape period.
    pub sample_ms: u64,
}

impl IsolationSpec {
    /// The bench's parameters: capacity 3000 new flows/s, base 1000 and burst 2000 for
    /// each tenant, floods at 10 × base, B at 50 connections/s.
    pub fn new() -> Self {
        IsolationSpec {
            setup_capacity: 3000.0,
            base: 1000.0,
            burst: 2000.0,
            debt: 10_000.0,
            flood_factor: 10.0,
            flood_procs: 2,
            victim_rate: 50.0,
            victim_workers: 10,
            baseline_secs: 5.0,
            quiet_secs: 3.0,
            after_credit_secs: 3.0,
            flood_max_secs: 25.0,
            fair_warmup_secs: 2.0,
            fair_secs: 6.0,
            sample_ms: 100,
        }
    }

    /// The rates flag of `tenant` (`debt` 0: none).
    fn rate_flag(&self, tenant: u32, debt: f64) -> String {
        if debt > 0.0 {
            format!("{tenant}:requests=0/{}/{}/{debt}", self.base, self.burst)
        } else {
            format!("{tenant}:requests=0/{}/{}", self.base, self.burst)
        }
    }

    fn flood_pps(&self) -> f64 {
        self.flood_factor * self.base
    }

    /// Every value in range, so a scenario never starts with one it cannot run: rates
    /// positive and bounded (the floods are real hping3 processes), burst at least base,
    /// every phase bounded in time. The error names the field.
    pub fn check(&self) -> std::result::Result<(), String> {
        let rate = |name: &str, v: f64, max: f64| -> std::result::Result<(), String> {
            if v.is_finite() && v > 0.0 && v <= max {
                Ok(())
            } else {
                Err(format!("{name} must be in (0, {max}], got {v}"))
            }
        };
        let count = |name: &str, v: u64, lo: u64, hi: u64| -> std::result::Result<(), String> {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(format!("{name} must be {lo}..={hi}, got {v}"))
            }
        };
        let secs = |name: &str, v: f64, min: f64| -> std::result::Result<(), String> {
            if v.is_finite() && v >= min && v <= 600.0 {
                Ok(())
            } else {
                Err(format!("{name} must be in [{min}, 600] seconds, got {v}"))
            }
        };
        rate("setup_capacity", self.setup_capacity, 1e7)?;
        rate("base", self.base, 1e6)?;
        rate("burst", self.burst, 1e6)?;
        if self.burst < self.base {
            return Err(format!(
                "burst ({}) must be at least base ({})",
                self.burst, self.base
            ));
        }
        if !(self.debt.is_finite() && (0.0..=1e9).contains(&self.debt)) {
            return Err(format!("debt must be in [0, 1e9], got {}", self.debt));
        }
        rate("flood_factor", self.flood_factor, 1000.0)?;
        rate("victim_rate", self.victim_rate, 10_000.0)?;
        count("flood_procs", self.flood_procs as u64, 1, 16)?;
        count("victim_workers", self.victim_workers as u64, 1, 256)?;
        secs("baseline_secs", self.baseline_secs, 0.5)?;
        secs("quiet_secs", self.quiet_secs, 0.0)?;
        secs("after_credit_secs", self.after_credit_secs, 0.0)?;
        secs("flood_max_secs", self.flood_max_secs, 0.5)?;
        secs("fair_warmup_secs", self.fair_warmup_secs, 0.0)?;
        secs("fair_secs", self.fair_secs, 0.5)?;
        count("sample_ms", self.sample_ms, 10, 10_000)?;
        Ok(())
    }
}

impl Default for IsolationSpec {
    fn default() -> Self {
        Self::new()
    }
}

/// One tenant's rate-manager state at one scrape (kind `requests`: new flows).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RatePoint {
    /// `flood` (phases 0 and 1, one platform) or `fair` (phase 2, another).
    pub run: String,
    /// ms since that run's platform was up.
    pub t_ms: u64,
    pub tenant: u32,
    /// `min`, `base` or `burst`.
    pub state: String,
    pub credit: f64,
    pub allowance: f64,
    pub offered: f64,
    pub admitted: f64,
    /// `starfabric_pp_tenant_rate_limited_total` (new flows refused so far).
    pub limited_total: f64,
    /// `starfabric_pp_tenant_flows_setup_total` (flows set up so far).
    pub flows_setup_total: f64,
}

/// What [`run`] measured; field names are the documented JSON interface of `starfabric
/// bench isolation`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IsolationReport {
    pub params: IsolationSpec,
    /// B's connections that failed during the flood (never established or no answer).
    pub victim_failed: usize,
    pub victim_connections_flood: usize,
    pub victim_failed_baseline: usize,
    pub victim_connections_baseline: usize,
    pub victim_p99_us_baseline: Option<u64>,
    pub victim_p99_us_flood: Option<u64>,
    /// p99 during the flood ÷ p99 of the baseline.
    pub victim_p99_ratio: Option<f64>,
    /// B's median setup time in the baseline and during the flood, and their ratio:
    /// beside the p99 (the goal's figure, the ~3rd slowest of a baseline's ~250
    /// connections), whether the flood moves B's whole distribution or only its tail.
    #[serde(default)]
    pub victim_p50_us_baseline: Option<u64>,
    #[serde(default)]
    pub victim_p50_us_flood: Option<u64>,
    #[serde(default)]
    pub victim_p50_ratio: Option<f64>,
    /// B's p99 while A was in S_burst (A at up to `burst` new flows/s), and after A's
    /// credit ran out (A held to `base`).
    pub victim_p99_us_flood_burst: Option<u64>,
    pub victim_p99_us_flood_after: Option<u64>,
    /// B's slowest established connection during the flood.
    pub victim_max_setup_us_flood: u64,
    /// B's ten slowest established connections of the baseline and of the flood, the
    /// slowest first, each at its start on the clock of `series`: whether the tail is a
    /// few stalls that hit several connections at once, or scattered single waits.
    #[serde(default)]
    pub victim_slowest_baseline: Vec<SlowSetup>,
    #[serde(default)]
    pub victim_slowest_flood: Vec<SlowSetup>,
    /// B's new flows refused at PP during phase 1 (should be 0).
    pub victim_rate_limited: f64,
    /// A's new flows refused at PP during phase 1.
    pub aggressor_rate_limited: f64,
    /// `starfabric_pp_drops_total{reason="rate-limited"}` at the end of phase 1.
    pub rate_limited_drops: f64,
    /// A's offered SYNs/s (mean over the flood's samples), as PP counted them.
    pub aggressor_offered_rate: f64,
    pub flood_secs: f64,
    /// How long A was in S_burst during the flood: from its first S_burst sample to the
    /// first sample with its credit spent (≤ 1% of base). Later S_burst samples are
    /// flickers: a tick admitted a little under base earns a few ops of credit, which
    /// the next tick spends (A stays held at base; they count as "after").
    pub aggressor_burst_secs: f64,
    /// Mean admitted rate of A over its S_burst samples ÷ burst.
    pub aggressor_rate_vs_burst: Option<f64>,
    /// The largest single sample of the same.
    pub aggressor_rate_vs_burst_max: Option<f64>,
    /// Mean admitted rate of A after it left S_burst (credit spent) ÷ base.
    pub aggressor_rate_after_credit_vs_base: Option<f64>,
    pub aggressor_rate_after_credit_vs_base_max: Option<f64>,
    /// Phase 2: Jain's index over A's and B's mean admitted rates.
    pub jain: f64,
    /// Phase 2: Σ mean admitted rate of all tenants ÷ setup capacity.
    pub utilisation: f64,
    /// Phase 2: mean admitted new flows/s by tenant.
    pub fair_admitted: BTreeMap<u32, f64>,
    /// Phase 2: flows actually set up per second by tenant (counter deltas), next to
    /// what the rate manager admitted.
    pub fair_setup_rate: BTreeMap<u32, f64>,
    /// Scrapes that failed (each is a missing sample).
    pub scrape_errors: u64,
    /// Every sample of every tenant, both runs.
    pub series: Vec<RatePoint>,
}

/// One of B's slow connection setups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlowSetup {
    /// When the connection started, in ms since the run's platform started (the clock
    /// of [`RatePoint::t_ms`]).
    pub t_ms: u64,
    pub setup_us: u64,
}

/// The `n` slowest established connections of `v`, the slowest first; `offset_ms` puts
/// their starts on the run's clock.
pub fn slowest(v: &[ConnSample], offset_ms: u64, n: usize) -> Vec<SlowSetup> {
    let mut s: Vec<SlowSetup> = v
        .iter()
        .filter(|c| !matches!(c.outcome, Outcome::Failed(_)))
        .map(|c| SlowSetup {
            t_ms: offset_ms + c.start_us / 1000,
            setup_us: c.setup_us,
        })
        .collect();
    s.sort_unstable_by(|a, b| b.setup_us.cmp(&a.setup_us).then(a.t_ms.cmp(&b.t_ms)));
    s.truncate(n);
    s
}

/// A thread in the PP namespace scraping `/metrics` every `period`.
struct Scraper {
    stop: Arc<AtomicBool>,
    points: Arc<Mutex<Vec<RatePoint>>>,
    drops: Arc<Mutex<f64>>,
    handle: Option<JoinHandle<u64>>,
}

impl Scraper {
    fn start(tb: &Testbed, run: &str, period: Duration, t0: Instant) -> Result<Scraper> {
        let ns_path = Path::new("/run/netns").join(tb.ns(Node::Pp));
        let stop = Arc::new(AtomicBool::new(false));
        let points = Arc::new(Mutex::new(Vec::new()));
        let drops = Arc::new(Mutex::new(0.0));
        let (s, p, d, run) = (stop.clone(), points.clone(), drops.clone(), run.to_string());
        let handle = std::thread::Builder::new()
            .name("iso-scrape".into())
            .spawn(move || {
                if enter_netns(&ns_path).is_err() {
                    return u64::MAX;
                }
                let mut errors = 0u64;
                let mut next = Instant::now();
                while !s.load(Ordering::Relaxed) && !crate::interrupted() {
                    let t_ms = t0.elapsed().as_millis() as u64;
                    match scrape::get(SocketAddr::V4(METRICS_ADDR), "/metrics") {
                        Ok(r) if r.status == 200 => {
                            let samples = scrape::parse(&r.body);
                            let pts = rate_points(&samples, &run, t_ms);
                            lock(&p).extend(pts);
                            if let Some(v) = scrape::value(
                                &samples,
                                "starfabric_pp_drops_total",
                                &[("reason", "rate-limited")],
                            ) {
                                *lock(&d) = v;
                            }
                        }
                        _ => errors += 1,
                    }
                    next += period;
                    let now = Instant::now();
                    if next > now {
                        std::thread::sleep(next - now);
                    } else {
                        next = now;
                    }
                }
                errors
            })
            .map_err(|e| Error::io("spawn the metrics scraper", e))?;
        Ok(Scraper {
            stop,
            points,
            drops,
            handle: Some(handle),
        })
    }

    /// The latest sample of `tenant`.
    fn latest(&self, tenant: u32) -> Option<RatePoint> {
        lock(&self.points)
            .iter()
            .rev()
            .find(|p| p.tenant == tenant)
            .cloned()
    }

    fn finish(mut self) -> Result<(Vec<RatePoint>, f64, u64)> {
        self.stop.store(true, Ordering::Relaxed);
        let errors = self
            .handle
            .take()
            .map(|h| h.join().unwrap_or(u64::MAX))
            .unwrap_or(0);
        if errors == u64::MAX {
            return Err(Error::Setup(
                "the metrics scraper could not enter the PP namespace".into(),
            ));
        }
        let pts = std::mem::take(&mut *lock(&self.points));
        let drops = *lock(&self.drops);
        Ok((pts, drops, errors))
    }
}

impl Drop for Scraper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The `requests` rate points of every tenant in a scrape.
pub fn rate_points(samples: &[Sample], run: &str, t_ms: u64) -> Vec<RatePoint> {
    let mut out = Vec::new();
    for s in samples
        .iter()
        .filter(|s| s.name == "starfabric_pp_tenant_rate_state")
        .filter(|s| s.label("kind") == Some("requests"))
    {
        let Some(tenant) = s.label("tenant").and_then(|t| t.parse::<u32>().ok()) else {
            continue;
        };
        let t = tenant.to_string();
        let get = |name: &str| {
            scrape::value(samples, name, &[("tenant", &t), ("kind", "requests")]).unwrap_or(0.0)
        };
        out.push(RatePoint {
            run: run.to_string(),
            t_ms,
            tenant,
            state: match s.value as i64 {
                0 => "min",
                1 => "base",
                _ => "burst",
            }
            .to_string(),
            credit: get("starfabric_pp_tenant_rate_credit"),
            allowance: get("starfabric_pp_tenant_rate_allowance"),
            offered: get("starfabric_pp_tenant_rate_offered"),
            admitted: get("starfabric_pp_tenant_rate_admitted"),
            limited_total: get("starfabric_pp_tenant_rate_limited_total"),
            flows_setup_total: scrape::value(
                samples,
                "starfabric_pp_tenant_flows_setup_total",
                &[("tenant", &t)],
            )
            .unwrap_or(0.0),
        });
    }
    out
}

/// Jain's fairness index of `x`: (Σx)² / (n·Σx²), 1 when all are equal.
pub fn jain(x: &[f64]) -> f64 {
    let s: f64 = x.iter().sum();
    let q: f64 = x.iter().map(|v| v * v).sum();
    if x.is_empty() || q <= 0.0 {
        return 0.0;
    }
    s * s / (x.len() as f64 * q)
}

fn mean(v: impl Iterator<Item = f64>) -> Option<f64> {
    let (n, s) = v.fold((0usize, 0.0), |(n, s), x| (n + 1, s + x));
    (n > 0).then(|| s / n as f64)
}

/// A SYN flood from VPC `j`'s client toward nginx on the internet host at `pps` in
/// all from `procs` hping3 processes, each for at most `max_secs` (its count bound);
/// stop them with [`Testbed::stop`].
fn start_flood(tb: &Testbed, j: usize, pps: f64, procs: usize, max_secs: f64) -> Result<Vec<Proc>> {
    let procs = procs.max(1);
    let each = pps / procs as f64;
    let interval_us = (1e6 / each).round().max(1.0) as u64;
    let count = (each * max_secs).ceil() as u64;
    let (iv, count, port, dst) = (
        format!("u{interval_us}"),
        count.to_string(),
        HTTP_PORT.to_string(),
        addr::INET.to_string(),
    );
    info!(j, pps, procs, interval_us, "hping3 SYN flood");
    (0..procs)
        .map(|k| {
            tb.spawn(
                Node::Client(j),
                &format!("hping3 c{j} {k}"),
                &[
                    "hping3", "-q", "-S", "-p", &port, "-i", &iv, "-c", &count, &dst,
                ],
            )
        })
        .collect()
}

fn start_platform(tb: &Testbed, bin: &Path, s: &IsolationSpec, debt: f64) -> Result<Platform> {
    let chains = (0..3)
        .map(|j| chains::chain(j as u32 + 1, 1, j, Toward::Internet, &[chains::snat(j)]))
        .collect::<Result<Vec<_>>>()?;
    let vpcs = (0..3).map(|j| (vni::tenant(j), j as u32 + 1, 1)).collect();
    let metrics = METRICS_ADDR.to_string();
    let cap = s.setup_capacity.to_string();
    let flags: Vec<String> = [TENANT_A, TENANT_B, TENANT_C]
        .iter()
        .map(|t| s.rate_flag(*t, debt))
        .collect();
    let mut args = vec!["--metrics", &metrics, "--setup-capacity", &cap];
    for f in &flags {
        args.extend(["--tenant-rate", f.as_str()]);
    }
    let spec = PlatformSpec::new(chains, vpcs).pp_args(&args);
    platform::start_starfabric(tb, bin, &spec)
}

fn victim_load(s: &IsolationSpec, limit: f64) -> LoadSpec {
    LoadSpec {
        client: 1,
        rate: s.victim_rate,
        workers: s.victim_workers,
        limit: Duration::from_secs_f64(limit + 10.0),
        ..LoadSpec::new()
    }
}

fn failed(v: &[ConnSample]) -> usize {
    v.iter()
        .filter(|c| !matches!(c.outcome, Outcome::Ok))
        .count()
}

/// Run the scenario on `tb` (at least 3 VPCs) with the `starfabric` binary `bin`.
pub fn run(tb: &Testbed, bin: &Path, s: &IsolationSpec) -> Result<IsolationReport> {
    if tb.spec.tenants < 3 {
        return Err(Error::Setup("the isolation scenario needs 3 VPCs".into()));
    }
    s.check()
        .map_err(|e| Error::Setup(format!("isolation parameters: {e}")))?;
    if cmd::which("hping3").is_none() {
        return Err(Error::MissingTool("hping3".into()));
    }
    services::start_inet(tb, false)?;
    let period = Duration::from_millis(s.sample_ms.max(20));

    // ---- phases 0 and 1: no debt ----
    let p = start_platform(tb, bin, s, 0.0)?;
    let t0 = Instant::now();
    let scraper = Scraper::start(tb, "flood", period, t0)?;
    info!("phase 0: B alone");
    let lp = ConnLoop::start(tb, &victim_load(s, s.baseline_secs))?;
    let baseline_offset_ms = lp.t0().duration_since(t0).as_millis() as u64;
    cmd::sleep(Duration::from_secs_f64(s.baseline_secs))?;
    let baseline = lp.stop()?;
    cmd::sleep(Duration::from_secs_f64(s.quiet_secs))?;
    let before = (scraper.latest(TENANT_A), scraper.latest(TENANT_B));

    info!("phase 1: A floods, B paced");
    let flood_start_ms = t0.elapsed().as_millis() as u64;
    let flood = start_flood(tb, 0, s.flood_pps(), s.flood_procs, s.flood_max_secs + 5.0)?;
    let lp = ConnLoop::start(tb, &victim_load(s, s.flood_max_secs))?;
    let lp_offset_ms = lp.t0().duration_since(t0).as_millis() as u64;
    let fs = Instant::now();
    let mut seen_burst = false;
    let mut spent: Option<Instant> = None;
    while fs.elapsed().as_secs_f64() < s.flood_max_secs {
        cmd::sleep(period)?;
        if let Some(f) = flood.iter().find(|f| !tb.running(f)) {
            return Err(Error::Setup(format!(
                "hping3 exited: {}",
                crate::topo::tail(&std::fs::read_to_string(&f.log).unwrap_or_default(), 10)
            )));
        }
        let Some(a) = scraper.latest(TENANT_A) else {
            continue;
        };
        seen_burst |= a.state == "burst";
        if seen_burst && spent.is_none() && a.credit <= 0.01 * s.base {
            spent = Some(Instant::now());
        }
        if spent.is_some_and(|t| t.elapsed().as_secs_f64() >= s.after_credit_secs) {
            break;
        }
    }
    let victim = lp.stop()?;
    let flood_secs = fs.elapsed().as_secs_f64();
    let flood_end_ms = t0.elapsed().as_millis() as u64;
    for f in &flood {
        tb.stop(f);
    }
    cmd::sleep(period * 2)?;
    let (mut series, drops, mut scrape_errors) = scraper.finish()?;
    p.stop(tb);

    let a_flood: Vec<&RatePoint> = series
        .iter()
        .filter(|p| p.tenant == TENANT_A && p.t_ms >= flood_start_ms && p.t_ms <= flood_end_ms)
        .collect();
    let first_burst_ms = a_flood
        .iter()
        .filter(|p| p.state == "burst")
        .map(|p| p.t_ms)
        .min();
    // Credit spent: the first sample after the burst began with credit ≤ 1% of base.
    let spent_ms = first_burst_ms.and_then(|f| {
        a_flood
            .iter()
            .find(|p| p.t_ms > f && p.credit <= 0.01 * s.base)
            .map(|p| p.t_ms)
    });
    let burst_end = spent_ms.unwrap_or(u64::MAX);
    // The first sample after the flood started may still show the quiet tick.
    let a_burst: Vec<f64> = a_flood
        .iter()
        .filter(|p| p.state == "burst" && p.offered > s.base && p.t_ms < burst_end)
        .map(|p| p.admitted)
        .collect();
    let a_after: Vec<f64> = match spent_ms {
        Some(l) => a_flood
            .iter()
            .filter(|p| p.t_ms > l)
            .map(|p| p.admitted)
            .collect(),
        None => Vec::new(),
    };
    // B's windows, in its loop's clock.
    let to_lp = |ms: u64| ms.saturating_sub(lp_offset_ms) * 1000;
    let (b0, b1) = (
        to_lp(first_burst_ms.unwrap_or(flood_start_ms)),
        to_lp(burst_end.min(flood_end_ms)),
    );
    let victim_p99_us_flood_burst = p99_setup_us(&victim, b0, b1);
    let victim_p99_us_flood_after = spent_ms.and_then(|_| p99_setup_us(&victim, b1, u64::MAX));
    let victim_max_setup_us_flood = victim
        .iter()
        .filter(|c| !matches!(c.outcome, Outcome::Failed(_)))
        .map(|c| c.setup_us)
        .max()
        .unwrap_or(0);
    let limited_at = |tenant: u32, from: &Option<RatePoint>| {
        let end = series
            .iter()
            .rev()
            .find(|p| p.tenant == tenant)
            .map_or(0.0, |p| p.limited_total);
        end - from.as_ref().map_or(0.0, |p| p.limited_total)
    };
    let victim_rate_limited = limited_at(TENANT_B, &before.1);
    let aggressor_rate_limited = limited_at(TENANT_A, &before.0);
    let p99_base = p99_setup_us(&baseline, 0, u64::MAX);
    let p99_flood = p99_setup_us(&victim, 0, u64::MAX);
    // A setup time during the flood over the same figure of the baseline (none without
    // both, or over a zero).
    let flood_over_baseline = |b: Option<u64>, f: Option<u64>| match (b, f) {
        (Some(b), Some(f)) if b > 0 => Some(f as f64 / b as f64),
        _ => None,
    };
    let p50_base = setup_quantile_us(&baseline, 0, u64::MAX, 0.5);
    let p50_flood = setup_quantile_us(&victim, 0, u64::MAX, 0.5);
    let max = |v: &[f64]| {
        v.iter()
            .cloned()
            .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))))
    };
    let aggressor_offered_rate = mean(a_flood.iter().map(|p| p.offered)).unwrap_or(0.0);
    drop(a_flood);

    // ---- phase 2: debt allowed; A and B flood, C idle ----
    info!("phase 2: A and B flood, C idle");
    let p = start_platform(tb, bin, s, s.debt)?;
    let t0 = Instant::now();
    let scraper = Scraper::start(tb, "fair", period, t0)?;
    let total = s.fair_warmup_secs + s.fair_secs;
    let mut floods = start_flood(tb, 0, s.flood_pps(), s.flood_procs, total + 5.0)?;
    floods.extend(start_flood(
        tb,
        1,
        s.flood_pps(),
        s.flood_procs,
        total + 5.0,
    )?);
    let from_ms = t0.elapsed().as_millis() as u64 + (s.fair_warmup_secs * 1000.0) as u64;
    cmd::sleep(Duration::from_secs_f64(total))?;
    let to_ms = t0.elapsed().as_millis() as u64;
    for f in &floods {
        if !tb.running(f) {
            return Err(Error::Setup("hping3 exited during phase 2".into()));
        }
        tb.stop(f);
    }
    let (fair, _, e2) = scraper.finish()?;
    p.stop(tb);
    scrape_errors += e2;
    let window = |t: u32| {
        fair.iter()
            .filter(move |p| p.tenant == t && p.t_ms >= from_ms && p.t_ms <= to_ms)
    };
    let mut fair_admitted = BTreeMap::new();
    let mut fair_setup_rate = BTreeMap::new();
    for t in [TENANT_A, TENANT_B, TENANT_C] {
        fair_admitted.insert(t, mean(window(t).map(|p| p.admitted)).unwrap_or(0.0));
        let w: Vec<&RatePoint> = window(t).collect();
        let rate = match (w.first(), w.last()) {
            (Some(a), Some(b)) if b.t_ms > a.t_ms => {
                (b.flows_setup_total - a.flows_setup_total) * 1000.0 / (b.t_ms - a.t_ms) as f64
            }
            _ => 0.0,
        };
        fair_setup_rate.insert(t, rate);
    }
    let jain = jain(&[fair_admitted[&TENANT_A], fair_admitted[&TENANT_B]]);
    let utilisation = fair_admitted.values().sum::<f64>() / s.setup_capacity;
    series.extend(fair);

    let report = IsolationReport {
        params: s.clone(),
        victim_failed: failed(&victim),
        victim_connections_flood: victim.len(),
        victim_failed_baseline: failed(&baseline),
        victim_connections_baseline: baseline.len(),
        victim_p99_us_baseline: p99_base,
        victim_p99_us_flood: p99_flood,
        victim_p99_ratio: flood_over_baseline(p99_base, p99_flood),
        victim_p50_us_baseline: p50_base,
        victim_p50_us_flood: p50_flood,
        victim_p50_ratio: flood_over_baseline(p50_base, p50_flood),
        victim_p99_us_flood_burst,
        victim_p99_us_flood_after,
        victim_max_setup_us_flood,
        victim_slowest_baseline: slowest(&baseline, baseline_offset_ms, 10),
        victim_slowest_flood: slowest(&victim, lp_offset_ms, 10),
        victim_rate_limited,
        aggressor_rate_limited,
        rate_limited_drops: drops,
        aggressor_offered_rate,
        flood_secs,
        aggressor_burst_secs: match (first_burst_ms, spent_ms) {
            (Some(a), Some(b)) => (b - a) as f64 / 1000.0,
            (Some(a), None) => (flood_end_ms - a) as f64 / 1000.0,
            _ => 0.0,
        },
        aggressor_rate_vs_burst: mean(a_burst.iter().cloned()).map(|m| m / s.burst),
        aggressor_rate_vs_burst_max: max(&a_burst).map(|m| m / s.burst),
        aggressor_rate_after_credit_vs_base: mean(a_after.iter().cloned()).map(|m| m / s.base),
        aggressor_rate_after_credit_vs_base_max: max(&a_after).map(|m| m / s.base),
        jain,
        utilisation,
        fair_admitted,
        fair_setup_rate,
        scrape_errors,
        series,
    };
    info!(
        victim_failed = report.victim_failed,
        ratio = ?report.victim_p99_ratio,
        jain = report.jain,
        utilisation = report.utilisation,
        "isolation scenario done"
    );
    Ok(report)
}

/// Paper 000 Fig. 10 for this run: for tenants A and B of phases 0–1, the admitted (and
/// offered) new flows/s with base and burst marked, the credit, and the state; then
/// phase 2's admitted rates of A, B and C against the capacity.
///
/// Hand-written SVG, like `bench scaling`'s: a dozen polylines with axes and labels need
/// no plotting crate (and none is in the dependency tree).
pub fn svg(r: &IsolationReport) -> String {
    let (w, ph, left, top, gap) = (760.0, 150.0, 70.0, 40.0, 40.0);
    let panels = 4.0;
    let height = top + panels * (ph + gap) + 20.0;
    let width = left + w + 150.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let p = &r.params;
    let _ = writeln!(
        s,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{left}" y="18" font-size="13">Isolation at the PP node: capacity {} new flows/s, base {} / burst {} each, floods at {}× base; victim p99 ratio {}, failed {}; Jain {:.3}, utilisation {:.2}</text>"#,
        p.setup_capacity,
        p.base,
        p.burst,
        p.flood_factor,
        r.victim_p99_ratio
            .map_or("n/a".into(), |v| format!("{v:.2}")),
        r.victim_failed,
        r.jain,
        r.utilisation
    );
    let colour = |t: u32| match t {
        TENANT_A => "#d62728",
        TENANT_B => "#1f77b4",
        _ => "#2ca02c",
    };
    let name = |t: u32| match t {
        TENANT_A => "A",
        TENANT_B => "B",
        _ => "C",
    };
    struct Line<'a> {
        tenant: u32,
        dash: bool,
        f: &'a dyn Fn(&RatePoint) -> f64,
        label: String,
    }
    let mut panel = |i: usize,
                     title: &str,
                     run: &str,
                     ymax: f64,
                     lines: &[Line],
                     marks: &[(f64, &str)]| {
        let y0 = top + i as f64 * (ph + gap);
        let pts: Vec<&RatePoint> = r.series.iter().filter(|q| q.run == run).collect();
        let tmax = pts.iter().map(|q| q.t_ms).max().unwrap_or(1).max(1) as f64;
        let ymax = if ymax > 0.0 { ymax } else { 1.0 };
        let x = |t: u64| left + w * t as f64 / tmax;
        let y = |v: f64| y0 + ph - ph * (v / ymax).clamp(-0.05, 1.05);
        let _ = writeln!(
            s,
            r##"<rect x="{left}" y="{y0}" width="{w}" height="{ph}" fill="none" stroke="#999"/><text x="{left}" y="{}" font-size="12">{title}</text>"##,
            y0 - 6.0
        );
        for k in 0..=4 {
            let v = ymax * k as f64 / 4.0;
            let _ = writeln!(
                s,
                r##"<text x="{}" y="{:.1}" text-anchor="end" fill="#555">{v:.0}</text><line x1="{left}" x2="{}" y1="{:.1}" y2="{:.1}" stroke="#eee"/>"##,
                left - 4.0,
                y(v) + 4.0,
                left + w,
                y(v),
                y(v)
            );
        }
        for k in 0..=5 {
            let t = tmax * k as f64 / 5.0;
            let _ = writeln!(
                s,
                r##"<text x="{:.1}" y="{}" text-anchor="middle" fill="#555">{:.1} s</text>"##,
                x(t as u64),
                y0 + ph + 13.0,
                t / 1000.0
            );
        }
        for (v, label) in marks {
            let _ = writeln!(
                s,
                r##"<line x1="{left}" x2="{}" y1="{:.1}" y2="{:.1}" stroke="#888" stroke-dasharray="2,3"/><text x="{}" y="{:.1}" fill="#888">{label}</text>"##,
                left + w,
                y(*v),
                y(*v),
                left + w + 4.0,
                y(*v) + 4.0
            );
        }
        for (k, l) in lines.iter().enumerate() {
            let poly: Vec<String> = pts
                .iter()
                .filter(|q| q.tenant == l.tenant)
                .map(|q| format!("{:.1},{:.1}", x(q.t_ms), y((l.f)(q))))
                .collect();
            let dash = if l.dash {
                r#" stroke-dasharray="4,3""#
            } else {
                ""
            };
            let _ = writeln!(
                s,
                r##"<polyline fill="none" stroke="{}" stroke-width="1.3"{dash} points="{}"/><text x="{}" y="{}" fill="{}">{}</text>"##,
                colour(l.tenant),
                poly.join(" "),
                left + w + 4.0,
                y0 + 60.0 + 13.0 * k as f64,
                colour(l.tenant),
                l.label
            );
        }
    };
    let admitted = |q: &RatePoint| q.admitted;
    let offered = |q: &RatePoint| q.offered;
    let credit = |q: &RatePoint| q.credit;
    let state = |q: &RatePoint| match q.state.as_str() {
        "min" => 0.0,
        "base" => 1.0,
        _ => 2.0,
    };
    let rate_max = p.burst * 1.25;
    let line = |tenant, dash, f, what: &str| Line {
        tenant,
        dash,
        f,
        label: format!("{} {what}", name(tenant)),
    };
    panel(
        0,
        "Phases 0–1: admitted new flows/s (dashed: offered, off the scale during the flood)",
        "flood",
        rate_max,
        &[
            line(TENANT_A, false, &admitted, "admitted"),
            line(TENANT_B, false, &admitted, "admitted"),
            line(TENANT_A, true, &offered, "offered"),
        ],
        &[(p.base, "base"), (p.burst, "burst")],
    );
    let cmax = r
        .series
        .iter()
        .filter(|q| q.run == "flood")
        .map(|q| q.credit)
        .fold(0.0f64, f64::max);
    panel(
        1,
        "Phases 0–1: credit (new flows)",
        "flood",
        cmax * 1.1,
        &[
            line(TENANT_A, false, &credit, "credit"),
            line(TENANT_B, false, &credit, "credit"),
        ],
        &[],
    );
    panel(
        2,
        "Phases 0–1: state (0 S_min, 1 S_base, 2 S_burst)",
        "flood",
        2.2,
        &[
            line(TENANT_A, false, &state, "state"),
            line(TENANT_B, true, &state, "state"),
        ],
        &[],
    );
    panel(
        3,
        "Phase 2: A and B flood, C idle; admitted new flows/s",
        "fair",
        p.setup_capacity * 1.1,
        &[
            line(TENANT_A, false, &admitted, "admitted"),
            line(TENANT_B, false, &admitted, "admitted"),
            line(TENANT_C, false, &admitted, "admitted"),
        ],
        &[(p.base, "base"), (p.setup_capacity, "capacity")],
    );
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slowest_setups_are_the_established_ones_slowest_first_on_the_run_clock() {
        let c = |start_us, setup_us, outcome| ConnSample {
            start_us,
            setup_us,
            end_us: start_us + setup_us,
            local_port: 1,
            external: None,
            outcome,
        };
        let v = vec![
            c(1_000, 300, Outcome::Ok),
            c(2_000, 9_000, Outcome::Failed("timeout".into())),
            c(3_000, 700, Outcome::Ok),
            c(4_000, 500, Outcome::Ok),
            c(5_000, 700, Outcome::Ok),
        ];
        let s = slowest(&v, 100, 3);
        let got: Vec<(u64, u64)> = s.iter().map(|x| (x.t_ms, x.setup_us)).collect();
        assert_eq!(got, vec![(103, 700), (105, 700), (104, 500)]);
        assert!(slowest(&[], 0, 10).is_empty());
    }

    #[test]
    fn jain_is_one_when_equal_and_half_when_one_takes_all() {
        assert!((jain(&[5.0, 5.0]) - 1.0).abs() < 1e-9);
        assert!((jain(&[10.0, 0.0]) - 0.5).abs() < 1e-9);
        assert_eq!(jain(&[]), 0.0);
    }

    #[test]
    fn rate_points_from_a_scrape() {
        let text = "starfabric_pp_tenant_rate_state{tenant=\"1\",kind=\"requests\"} 2\n\
                    starfabric_pp_tenant_rate_state{tenant=\"1\",kind=\"packets\"} 1\n\
                    starfabric_pp_tenant_rate_credit{tenant=\"1\",kind=\"requests\"} 4500.5\n\
                    starfabric_pp_tenant_rate_admitted{tenant=\"1\",kind=\"requests\"} 1990\n\
                    starfabric_pp_tenant_rate_offered{tenant=\"1\",kind=\"requests\"} 9000\n\
                    starfabric_pp_tenant_rate_limited_total{tenant=\"1\",kind=\"requests\"} 70\n\
                    starfabric_pp_tenant_flows_setup_total{tenant=\"1\"} 1234\n";
        let p = rate_points(&scrape::parse(text), "flood", 100);
        assert_eq!(p.len(), 1);
        let p = &p[0];
        assert_eq!((p.tenant, p.state.as_str(), p.t_ms), (1, "burst", 100));
        assert_eq!((p.credit, p.admitted, p.offered), (4500.5, 1990.0, 9000.0));
        assert_eq!((p.limited_total, p.flows_setup_total), (70.0, 1234.0));
    }

    #[test]
    fn the_plot_is_an_svg_with_a_line_per_series() {
        let mut series = Vec::new();
        for (run, t) in [("flood", TENANT_A), ("flood", TENANT_B), ("fair", TENANT_C)] {
            for k in 0..5 {
                series.push(RatePoint {
                    run: run.into(),
                    t_ms: k * 100,
                    tenant: t,
                    state: "burst".into(),
                    credit: 100.0,
                    allowance: 0.0,
                    offered: 10.0,
                    admitted: 5.0,
                    limited_total: 0.0,
                    flows_setup_total: 0.0,
                });
            }
        }
        let r = IsolationReport {
            params: IsolationSpec::new(),
            victim_failed: 0,
            victim_connections_flood: 0,
            victim_failed_baseline: 0,
            victim_connections_baseline: 0,
            victim_p99_us_baseline: None,
            victim_p99_us_flood: None,
            victim_p99_ratio: None,
            victim_p50_us_baseline: None,
            victim_p50_us_flood: None,
            victim_p50_ratio: None,
            victim_p99_us_flood_burst: None,
            victim_p99_us_flood_after: None,
            victim_max_setup_us_flood: 0,
            victim_slowest_baseline: Vec::new(),
            victim_slowest_flood: Vec::new(),
            victim_rate_limited: 0.0,
            aggressor_rate_limited: 0.0,
            rate_limited_drops: 0.0,
            aggressor_offered_rate: 0.0,
            flood_secs: 0.0,
            aggressor_burst_secs: 0.0,
            aggressor_rate_vs_burst: None,
            aggressor_rate_vs_burst_max: None,
            aggressor_rate_after_credit_vs_base: None,
            aggressor_rate_after_credit_vs_base_max: None,
            jain: 1.0,
            utilisation: 1.0,
            fair_admitted: BTreeMap::new(),
            fair_setup_rate: BTreeMap::new(),
            scrape_errors: 0,
            series,
        };
        let svg = svg(&r);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 10);
    }
}
