//! The per-op side: workers admit through local token buckets; the tick thread
//! collects their counters and publishes allowances through atomics.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, RwLock};

use crate::{RateManager, TenantUsage, TokenBucket};

/// How often a worker flushes its counters and re-reads the allowance at the latest.
const REFRESH_US: u64 = 1000;

/// A tenant's shared atomics.
#[derive(Debug, Default)]
struct Slot {
    offered: AtomicU64,
    admitted: AtomicU64,
    refused_total: AtomicU64,
    /// Per-worker allowance, f64 bits.
    per_worker: AtomicU64,
    /// Cleared when the tenant loses its rates (workers then treat it as unlimited).
    managed: AtomicBool,
}

#[derive(Debug)]
struct Shared {
    workers: usize,
    bucket_ms: f64,
    table: RwLock<HashMap<u32, Arc<Slot>>>,
    unmanaged: AtomicU64,
    /// Bumped after every publish.
    generation: AtomicU64,
}

/// The node-wide limiter, shared between the tick thread and the workers.
#[derive(Debug, Clone)]
pub struct Limiter {
    shared: Arc<Shared>,
}

impl Limiter {
    /// `workers` (at least 1) is how many [`WorkerLimiter`]s will split each allowance;
    /// `bucket_ms` is the bucket depth in ms of allowance (20 if not finite and > 0).
    pub fn new(workers: usize, bucket_ms: f64) -> Self {
        let bucket_ms = if bucket_ms.is_finite() && bucket_ms > 0.0 {
            bucket_ms
        } else {
            20.0
        };
        Limiter {
            shared: Arc::new(Shared {
                workers: workers.max(1),
                bucket_ms,
                table: RwLock::new(HashMap::new()),
                unmanaged: AtomicU64::new(0),
                generation: AtomicU64::new(0),
            }),
        }
    }

    /// A per-thread handle.
    pub fn worker(&self) -> WorkerLimiter {
        WorkerLimiter {
            shared: Arc::clone(&self.shared),
            local: HashMap::default(),
        }
    }

    /// Called every tick by the owner thread: swaps out each tenant's counters, ticks
    /// `mgr` and publishes each tenant's allowance (divided by the worker count);
    /// tenants removed from `mgr` become unlimited.
    pub fn tick(&self, mgr: &mut RateManager, dt_ms: u64) {
        let usage: Vec<TenantUsage> = {
            let table = self.shared.table.read().unwrap_or_else(|e| e.into_inner());
            table
                .iter()
                .map(|(&tenant, s)| TenantUsage {
                    tenant,
                    offered: s.offered.swap(0, Relaxed),
                    admitted: s.admitted.swap(0, Relaxed),
                })
                .collect()
        };
        let unmanaged = self.shared.unmanaged.swap(0, Relaxed);
        mgr.tick(dt_ms, &usage, unmanaged);
        self.publish(mgr);
    }

    /// Publish `mgr`'s tenants and allowances to the workers now, without a tick: call
    /// it after `set`/`remove`, so new rates hold from the next op rather than from the
    /// next tick (until then a new tenant would be admitted as unmanaged).
    pub fn publish(&self, mgr: &RateManager) {
        let status = mgr.status();
        let mut table = self.shared.table.write().unwrap_or_else(|e| e.into_inner());
        table.retain(|tenant, slot| {
            let keep = mgr.allowance(*tenant).is_some();
            if !keep {
                slot.managed.store(false, Relaxed);
            }
            keep
        });
        let workers = self.shared.workers as f64;
        for st in status {
            let slot = table.entry(st.tenant).or_default();
            slot.per_worker
                .store((st.allowance / workers).to_bits(), Relaxed);
            slot.refused_total.store(st.refused_total, Relaxed);
            slot.managed.store(true, Relaxed);
        }
        drop(table);
        self.shared.generation.fetch_add(1, Relaxed);
    }

    /// Ops refused for a managed tenant so far (as of the last tick); 0 for others.
    pub fn refused_total(&self, tenant: u32) -> u64 {
        let table = self.shared.table.read().unwrap_or_else(|e| e.into_inner());
        table
            .get(&tenant)
            .map_or(0, |s| s.refused_total.load(Relaxed))
    }
}

/// A cheap hasher for tenant ids (multiplicative; ids are not attacker-chosen keys of
/// an unbounded map here: one entry per tenant a worker has seen).
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(5) ^ b as u64).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.0 = (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

struct Local {
    /// `None` = unmanaged (unlimited).
    slot: Option<Arc<Slot>>,
    bucket: TokenBucket,
    generation: u64,
    checked_us: u64,
    offered: u64,
    admitted: u64,
}

/// One worker thread's limiter: per-tenant local buckets and counters.
pub struct WorkerLimiter {
    shared: Arc<Shared>,
    local: HashMap<u32, Local, BuildHasherDefault<IdHasher>>,
}

impl WorkerLimiter {
    /// `true` = admit. A tenant with no rates is admitted (counted as unmanaged).
    pub fn admit(&mut self, tenant: u32, now_us: u64) -> bool {
        let generation = self.shared.generation.load(Relaxed);
        let shared = &self.shared;
        let l = self.local.entry(tenant).or_insert_with(|| Local {
            slot: None,
            bucket: TokenBucket::new(0.0, 0.0, now_us),
            generation: generation.wrapping_sub(1),
            checked_us: now_us,
            offered: 0,
            admitted: 0,
        });
        if l.generation != generation || now_us.saturating_sub(l.checked_us) >= REFRESH_US {
            refresh(shared, tenant, l, generation, now_us);
        }
        l.offered += 1;
        let ok = l.slot.is_none() || l.bucket.try_take(1.0, now_us);
        l.admitted += ok as u64;
        ok
    }

    /// Pushes this worker's pending counters to the shared ones (also done at least
    /// every ~1 ms of `now_us` while ops arrive).
    pub fn flush(&mut self) {
        for l in self.local.values_mut() {
            flush(&self.shared, l);
        }
    }
}

fn flush(shared: &Shared, l: &mut Local) {
    match &l.slot {
        Some(s) if s.managed.load(Relaxed) => {
            s.offered.fetch_add(l.offered, Relaxed);
            s.admitted.fetch_add(l.admitted, Relaxed);
        }
        _ => {
            if l.admitted > 0 {
                shared.unmanaged.fetch_add(l.admitted, Relaxed);
            }
        }
    }
    l.offered = 0;
    l.admitted = 0;
}

fn refresh(shared: &Shared, tenant: u32, l: &mut Local, generation: u64, now_us: u64) {
    flush(shared, l);
    l.checked_us = now_us;
    if l.generation == generation {
        return;
    }
    l.generation = generation;
    if !l.slot.as_ref().is_some_and(|s| s.managed.load(Relaxed)) {
        // The table only changes on a tick: look it up once per generation.
        let table = shared.table.read().unwrap_or_else(|e| e.into_inner());
        l.slot = table.get(&tenant).cloned();
        drop(table);
        if l.slot.is_some() {
            // Start from a full bucket at the current allowance.
            l.bucket = TokenBucket::new(0.0, 0.0, now_us);
        }
    }
    if let Some(s) = &l.slot {
        let rate = f64::from_bits(s.per_worker.load(Relaxed));
        let depth = (rate * shared.bucket_ms / 1000.0).max(1.0);
        if rate != l.bucket.rate() || depth != l.bucket.depth() {
            let fresh = l.bucket.depth() == 0.0;
            l.bucket.set_rate(rate, depth, now_us);
            if fresh {
                l.bucket = TokenBucket::new(rate, depth, now_us);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RateConfig, TenantRates};

    fn mgr_with(tenant: u32, base: f64) -> RateManager {
        let mut m = RateManager::new(RateConfig {
            capacity: 10_000.0,
            ..RateConfig::default()
        })
        .unwrap();
        let r = TenantRates::new(0.0, base, base, 0.0);
        m.set(tenant, r).unwrap();
        m
    }

    #[test]
    fn two_workers_admit_about_the_allowance() {
        let mut m = mgr_with(5, 4000.0);
        let lim = Limiter::new(2, 20.0);
        lim.tick(&mut m, 0);
        let allowance = m.allowance(5).unwrap();
        assert!((allowance - 4000.0).abs() < 1e-6);
        let (mut w1, mut w2) = (lim.worker(), lim.worker());
        let secs = 2u64;
        let mut n = 0u64;
        for step in 0..secs * 100_000 {
            let now = step * 10;
            n += w1.admit(5, now) as u64 + w2.admit(5, now + 3) as u64;
        }
        let want = allowance * secs as f64;
        assert!((n as f64 - want).abs() <= 0.03 * want, "{n} vs {want}");
        w1.flush();
        w2.flush();
        lim.tick(&mut m, secs * 1000);
        let st = m.get(5).unwrap();
        assert!(
            (st.admitted_rate * secs as f64 - n as f64).abs() < 1.0,
            "{st:?}"
        );
        assert!((st.offered_rate - 200_000.0).abs() < 1.0, "{st:?}");
        let refused = secs * 200_000 - n;
        assert_eq!(lim.refused_total(5), refused);
        assert_eq!(st.refused_total, refused);
    }

    #[test]
    fn unmanaged_and_removed_tenants_are_unlimited() {
        let mut m = mgr_with(1, 100.0);
        let lim = Limiter::new(1, 20.0);
        let mut w = lim.worker();
        // Before the first tick nothing is managed.
        assert!((0..1000).all(|_| w.admit(1, 0)));
        lim.tick(&mut m, 100);
        // Now tenant 1 is limited to its bucket depth at once; tenant 9 is not.
        let got = (0..1000).filter(|_| w.admit(1, 10)).count();
        assert!(got <= 2, "{got}");
        assert!((0..1000).all(|_| w.admit(9, 10)));
        w.flush();
        assert!(m.remove(1));
        lim.tick(&mut m, 100);
        assert!((0..1000).all(|_| w.admit(1, 20)));
        assert_eq!(lim.refused_total(1), 0);
    }

    #[test]
    fn handles_are_thread_safe() {
        fn send<T: Send>() {}
        fn sync<T: Send + Sync>() {}
        sync::<Limiter>();
        send::<WorkerLimiter>();
    }
}
