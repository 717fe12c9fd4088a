//! Spare NF chains, built ahead: Serpens' NF Manager (paper 004 §III-A).
//!
//! Serpens starts an instance in 34 µs (Table IV) because the NF is deployed before
//! anything asks for it: its logic is already loaded, and a start only maps it into a
//! pre-started process. Here the worker is pre-started ([`crate::workers`]), and the
//! part that was left on a start's path was building the replica's NF chain: parsing
//! each NF's configuration and making its tables, 45–90 µs for the built-in
//! FW → SNAT → LB on this project's 2-core VM (docs/workers.md).
//!
//! [`SpareChains`] keeps, for each chain configuration the node has started a replica
//! of, up to `per_chain` chains built from it and never used. A start takes one
//! ([`SpareChains::take`]); once the start is placed on its worker, a background thread
//! builds the next. The build costs what the start would have spent building in place,
//! off the start's path: a chain is built once per start either way, plus one spare
//! per configuration.
//!
//! The builder runs at the normal priority. Under `SCHED_IDLE` it never took CPU from
//! anything, but it also fell behind starts made back to back, and only 137 of 192
//! one-at-a-time starts found a spare, against 185–192 of 192 at normal priority
//! (docs/workers.md, "Spare chains").
//!
//! A spare is the same chain a start would build: [`ChainFactory`] builds are a pure
//! function of the configuration (every replica of a group must build the same chain),
//! and a chain's clock starts at its first input, not at its build. The first start of
//! a configuration on a node, and every start while the spares are used up (a burst of
//! starts of one chain), still build in place.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, TryLockError};

use nf::Chain;
use proto::{v1, ChainParts};
use tracing::{debug, warn};

use crate::ChainFactory;

/// Most chain configurations a node keeps spares for; the least recently started goes
/// first. A node hosts a few chains, not hundreds, and this bounds the memory held by
/// spares of chains it no longer hosts.
pub const MAX_CHAINS: usize = 64;

/// Counters of [`SpareChains`].
#[derive(Debug, Default)]
pub struct SpareCounters {
    /// Starts that took a spare chain.
    pub hits: AtomicU64,
    /// Starts that built their chain in place: no spare was ready (the first start of a
    /// configuration, or a burst that used them up), or spares are off.
    pub misses: AtomicU64,
    /// Of the misses: the configuration's spare was still being built (the starts came
    /// faster than the builds), and the builder had the shelf at that instant.
    pub misses_building: AtomicU64,
    pub misses_contended: AtomicU64,
    /// Spare chains built in the background.
    pub built: AtomicU64,
    /// Configurations FM deployed here before any start of them.
    pub deployed: AtomicU64,
    /// Background builds that failed (the start builds in place and reports the error).
    pub failed: AtomicU64,
}

struct Entry {
    config: v1::ChainConfig,
    spares: Vec<Chain>,
    /// A build for this configuration is queued or running.
    refilling: bool,
    /// The configuration does not build; starts build in place and report why.
    broken: bool,
    /// When a start last asked for it (the shelf's tick).
    used: u64,
}

#[derive(Default)]
struct Shelf {
    entries: Vec<Entry>,
    tick: u64,
}

impl Shelf {
    fn find(&mut self, config: &v1::ChainConfig) -> Option<&mut Entry> {
        self.entries.iter_mut().find(|e| e.config == *config)
    }
}

/// See the module documentation.
pub struct SpareChains {
    node_id: String,
    per_chain: usize,
    factory: Arc<dyn ChainFactory>,
    /// Taken by starts with `try_lock` only: a start never waits for the builder, which
    /// may be preempted while it holds the lock.
    shelf: Arc<Mutex<Shelf>>,
    /// To the builder thread, started at the first configuration that needs it.
    builder: Mutex<Option<mpsc::Sender<v1::ChainConfig>>>,
    /// Set by [`SpareChains::shutdown`]: no builder starts again.
    closed: Arc<std::sync::atomic::AtomicBool>,
    pub counters: Arc<SpareCounters>,
}

impl SpareChains {
    /// Up to `per_chain` spares per configuration; 0 turns spares off.
    pub fn new(node_id: &str, per_chain: usize, factory: Arc<dyn ChainFactory>) -> Self {
        SpareChains {
            node_id: node_id.to_string(),
            per_chain,
            factory,
            shelf: Arc::new(Mutex::new(Shelf::default())),
            builder: Mutex::new(None),
            closed: Arc::new(std::sync::atomic::AtomicBool::new(false)),
            counters: Arc::new(SpareCounters::default()),
        }
    }

    /// A spare chain built from `config`, if one is ready, and the request to build the
    /// configuration's next spare in the background. The request goes out when the
    /// [`Refill`] is dropped: keep it until the start is placed, so the build does not
    /// compete with the start it replaces.
    pub fn take(&self, config: &v1::ChainConfig) -> (Option<Chain>, Refill<'_>) {
        let none = self.no_refill();
        if self.per_chain == 0 {
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
            return (None, none);
        }
        let mut shelf = match self.shelf.try_lock() {
            Ok(s) => s,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => {
                // The builder is putting a spare on the shelf: build in place.
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                self.counters
                    .misses_contended
                    .fetch_add(1, Ordering::Relaxed);
                return (None, none);
            }
        };
        shelf.tick += 1;
        let tick = shelf.tick;
        let mut evicted = None;
        // One compare pass per start: the entry's index, or a new entry at the end.
        let i = match shelf.entries.iter().position(|e| e.config == *config) {
            Some(i) => i,
            None => {
                if shelf.entries.len() >= MAX_CHAINS {
                    let oldest = (0..shelf.entries.len())
                        .min_by_key(|&i| shelf.entries[i].used)
                        .unwrap_or(0);
                    evicted = Some(shelf.entries.swap_remove(oldest));
                }
                shelf.entries.push(Entry {
                    config: config.clone(),
                    spares: Vec::new(),
                    refilling: false,
                    broken: false,
                    used: tick,
                });
                shelf.entries.len() - 1
            }
        };
        let per_chain = self.per_chain;
        let e = &mut shelf.entries[i];
        e.used = tick;
        let chain = e.spares.pop();
        let building = chain.is_none() && e.refilling;
        let ask = !e.refilling && !e.broken && e.spares.len() < per_chain;
        if ask {
            e.refilling = true;
        }
        drop(shelf);
        // A chain's tables are freed outside the lock.
        drop(evicted);
        let c = &self.counters;
        if chain.is_some() { &c.hits } else { &c.misses }.fetch_add(1, Ordering::Relaxed);
        if building {
            c.misses_building.fetch_add(1, Ordering::Relaxed);
        }
        let refill = Refill {
            spares: self,
            config: ask.then(|| config.clone()),
        };
        (chain, refill)
    }

    /// FM says the node may host `config`'s groups: build its spares now, before any
    /// start asks (Serpens deploys an NF before it starts an instance). A configuration
    /// already on the shelf is left as it is, and a deploy never pushes another
    /// configuration off a full shelf: only starts do.
    pub fn deploy(&self, config: &v1::ChainConfig) {
        if self.per_chain == 0 {
            return;
        }
        let ask = {
            let mut shelf = crate::node::lock(&self.shelf);
            if shelf.find(config).is_some() || shelf.entries.len() >= MAX_CHAINS {
                false
            } else {
                shelf.tick += 1;
                let used = shelf.tick;
                shelf.entries.push(Entry {
                    config: config.clone(),
                    spares: Vec::new(),
                    refilling: true,
                    broken: false,
                    used,
                });
                true
            }
        };
        if ask {
            self.counters.deployed.fetch_add(1, Ordering::Relaxed);
            drop(Refill {
                spares: self,
                config: Some(config.clone()),
            });
        }
    }

    /// A [`Refill`] that asks for nothing.
    pub fn no_refill(&self) -> Refill<'_> {
        Refill {
            spares: self,
            config: None,
        }
    }

    /// Spare chains ready now, over every configuration.
    pub fn ready(&self) -> usize {
        crate::node::lock(&self.shelf)
            .entries
            .iter()
            .map(|e| e.spares.len())
            .sum()
    }

    /// Stop the builder thread (it finishes the build it is on) and free the spares.
    pub fn shutdown(&self) {
        self.closed.store(true, Ordering::Relaxed);
        crate::node::lock(&self.builder).take();
        let entries = std::mem::take(&mut crate::node::lock(&self.shelf).entries);
        drop(entries);
    }

    fn ask_build(&self, config: v1::ChainConfig) -> bool {
        let mut builder = crate::node::lock(&self.builder);
        if self.closed.load(Ordering::Relaxed) {
            return false;
        }
        if builder.is_none() {
            let (tx, rx) = mpsc::channel();
            let shelf = self.shelf.clone();
            let factory = self.factory.clone();
            let counters = self.counters.clone();
            let per_chain = self.per_chain;
            let closed = self.closed.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("sc-spares-{}", self.node_id))
                .spawn(move || builder_loop(rx, shelf, factory, counters, per_chain, closed));
            match spawned {
                Ok(_) => *builder = Some(tx),
                Err(e) => {
                    warn!(error = %e, "cannot start the spare-chain builder; every start builds its chain");
                    return false;
                }
            }
        }
        builder.as_ref().is_some_and(|tx| tx.send(config).is_ok())
    }
}

/// A request to build a configuration's next spare, sent when dropped
/// ([`SpareChains::take`]).
#[must_use = "the build is asked for when this is dropped"]
pub struct Refill<'a> {
    spares: &'a SpareChains,
    config: Option<v1::ChainConfig>,
}

impl Drop for Refill<'_> {
    fn drop(&mut self) {
        let Some(config) = self.config.take() else {
            return;
        };
        if !self.spares.ask_build(config.clone()) {
            if let Some(e) = crate::node::lock(&self.spares.shelf).find(&config) {
                e.refilling = false;
            }
        }
    }
}

fn builder_loop(
    rx: mpsc::Receiver<v1::ChainConfig>,
    shelf: Arc<Mutex<Shelf>>,
    factory: Arc<dyn ChainFactory>,
    counters: Arc<SpareCounters>,
    per_chain: usize,
    closed: Arc<std::sync::atomic::AtomicBool>,
) {
    while let Ok(config) = rx.recv() {
        loop {
            // Stopped: drop what is still queued.
            if closed.load(Ordering::Relaxed) {
                return;
            }
            let built = ChainParts::try_from(&config)
                .map_err(|e| e.to_string())
                .and_then(|parts| factory.build(&parts).map_err(|e| e.to_string()));
            let ok = built.is_ok();
            let (more, unused) = {
                let mut s = crate::node::lock(&shelf);
                if closed.load(Ordering::Relaxed) {
                    // Stopped while building: `shutdown` emptied the shelf, or is about
                    // to; the chain goes with it, uncounted.
                    s.entries.clear();
                    return;
                }
                match (s.find(&config), built) {
                    // Evicted meanwhile.
                    (None, built) => (false, built.ok()),
                    (Some(e), Ok(chain)) => {
                        e.spares.push(chain);
                        e.refilling = e.spares.len() < per_chain;
                        (e.refilling, None)
                    }
                    (Some(e), Err(err)) => {
                        debug!(error = %err, tenant = config.tenant, chain = config.chain, "no spare chain: the configuration does not build");
                        e.refilling = false;
                        e.broken = true;
                        (false, None)
                    }
                }
            };
            // Counted once the shelf is free again, so a reader that sees the count can
            // take the spare; an evicted configuration's chain is freed unlocked.
            drop(unused);
            if ok {
                &counters.built
            } else {
                &counters.failed
            }
            .fetch_add(1, Ordering::Relaxed);
            if !more {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::TestNfs;
    use std::time::{Duration, Instant};

    fn config(port_hi: u16) -> v1::ChainConfig {
        let nf = serde_json::json!({
            "kind": "test-snat", "addrs": ["198.19.255.1"], "ports": [1024, port_hi]
        });
        let def: proto::ChainDef = serde_json::from_value(serde_json::json!({
            "tenant": 1, "chain": 1,
            "nfs": [nf],
            "forward": {"decap": true, "encap": {"dst": "198.18.0.9", "vni": 200}},
            "reverse": {"decap": true, "encap": {"dst": "198.18.0.50", "vni": 100}}
        }))
        .unwrap();
        def.to_proto().unwrap()
    }

    fn wait_ready(s: &SpareChains, n: usize) {
        let t = Instant::now();
        while s.ready() < n {
            assert!(t.elapsed() < Duration::from_secs(10), "no spare built");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_start_takes_the_spare_its_predecessor_left() {
        let s = SpareChains::new("n", 1, Arc::new(TestNfs));
        let c = config(1100);
        assert!(
            s.take(&c).0.is_none(),
            "nothing is built before the first start"
        );
        wait_ready(&s, 1);
        let chain = s.take(&c).0.expect("a spare after the first start");
        assert_eq!(chain.nfs().len(), 1);
        wait_ready(&s, 1);
        // Another configuration has spares of its own.
        assert!(s.take(&config(1200)).0.is_none());
        // (Its spare built, so the builder is off the shelf when `c` is taken.)
        wait_ready(&s, 2);
        assert!(s.take(&c).0.is_some());
        let k = &s.counters;
        assert_eq!(k.hits.load(Ordering::Relaxed), 2);
        assert_eq!(k.misses.load(Ordering::Relaxed), 2);
        s.shutdown();
        assert_eq!(s.ready(), 0);
        // A start racing the node's stop builds in place; nothing starts the builder again.
        let built = k.built.load(Ordering::Relaxed);
        assert!(s.take(&c).0.is_none());
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!((s.ready(), k.built.load(Ordering::Relaxed)), (0, built));
    }

    #[test]
    fn a_deployed_chain_has_its_spare_before_the_first_start() {
        let s = SpareChains::new("n", 1, Arc::new(TestNfs));
        let c = config(1100);
        s.deploy(&c);
        wait_ready(&s, 1);
        // Deployed again: nothing more is built.
        s.deploy(&c);
        assert!(s.take(&c).0.is_some());
        wait_ready(&s, 1);
        let k = &s.counters;
        assert_eq!(k.deployed.load(Ordering::Relaxed), 1);
        assert_eq!(k.built.load(Ordering::Relaxed), 2);
        assert_eq!(k.hits.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn off_means_every_start_builds() {
        let s = SpareChains::new("n", 0, Arc::new(TestNfs));
        let c = config(1100);
        for _ in 0..3 {
            assert!(s.take(&c).0.is_none());
        }
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(s.ready(), 0);
        assert_eq!(s.counters.built.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_configuration_that_does_not_build_is_not_retried() {
        let s = SpareChains::new("n", 1, Arc::new(TestNfs));
        // An empty port range: the factory refuses it.
        let c = config(1000);
        assert!(s.take(&c).0.is_none());
        let t = Instant::now();
        while s.counters.failed.load(Ordering::Relaxed) == 0 {
            assert!(t.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(s.take(&c).0.is_none());
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(s.counters.failed.load(Ordering::Relaxed), 1);
        assert_eq!(s.ready(), 0);
    }

    #[test]
    fn the_least_recently_started_configuration_goes_first() {
        let s = SpareChains::new("n", 1, Arc::new(TestNfs));
        for i in 0..=MAX_CHAINS as u16 {
            // One at a time: a start that finds the builder on the shelf builds in place
            // and leaves the shelf as it was.
            drop(s.take(&config(1100 + i)));
            let t = Instant::now();
            while s.counters.built.load(Ordering::Relaxed) < u64::from(i) + 1 {
                assert!(t.elapsed() < Duration::from_secs(10), "no spare built");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let shelf = crate::node::lock(&s.shelf);
        assert_eq!(shelf.entries.len(), MAX_CHAINS);
        let has = |c: v1::ChainConfig| shelf.entries.iter().any(|e| e.config == c);
        assert!(!has(config(1100)));
        assert!(has(config(1100 + MAX_CHAINS as u16)));
    }
}
