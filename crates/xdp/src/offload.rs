//! The offload policy: which flows run in the XDP fast path, and for how long.
//!
//! The userspace pipeline detects elephants with Zeta's single read/write window count
//! (`pipeline::ElephantPolicy`, paper 003 §IV-C/D) and queues each once. [`Offloader`]
//! takes them, compiles each flow's installed rule with [`XdpRule::from_rule`] and puts
//! it in the program's `offloaded_rules` map, where the driver then runs it. The program
//! itself does one lookup and one in-place write per packet (counters and last-seen
//! time); everything else happens here, off the packet path:
//!
//! - **Folding.** Every sweep reads each offloaded rule's counters and adds what is new
//!   to the flow's rule, tenant and pipeline counters (`Pipeline::fold_fastpath`), so
//!   stats add up wherever the packets went. A flow the driver saw since the last sweep
//!   also has its userspace idle clock refreshed, so its entry does not age out while
//!   userspace sees none of its packets.
//! - **Expiry.** A rule idle (no hit in the driver) for [`OffloadPolicy::idle`] leaves
//!   the map; its last counters are folded and the flow goes back to the userspace path,
//!   where it can become an elephant again.
//! - **Following the rule.** When userspace replaces an offloaded flow's rule (an update
//!   from FM) or its entry goes (removed, expired, evicted), the table queues an
//!   `OffloadEvent`; the next poll reinstalls the new rule or removes the old one, folding
//!   the counters either way.
//!
//! The map stays a cache of the flow table: a key is in the map only while the flow table
//! has the same rule for it, marked offloaded.

use std::collections::HashMap;
use std::time::Duration;

use pipeline::{FlowKey, OffloadEvent, Pipeline};

use crate::{XdpCounters, XdpError, XdpProgram, XdpRule, MAX_OFFLOADED_RULES};

/// How the fast path is managed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffloadPolicy {
    /// An offloaded rule with no hit in the driver for this long goes back to userspace.
    pub idle: Duration,
    /// How often offloaded rules' counters are read, folded and checked for idleness.
    pub sweep_interval: Duration,
    /// Most rules offloaded at once (at most the map's capacity).
    pub max_rules: usize,
}

impl Default for OffloadPolicy {
    fn default() -> Self {
        OffloadPolicy {
            idle: Duration::from_secs(2),
            sweep_interval: Duration::from_millis(100),
            max_rules: MAX_OFFLOADED_RULES as usize,
        }
    }
}

/// Counters of an [`Offloader`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OffloadStats {
    /// Rules put in the map (first install or re-offload after an idle period).
    pub offloaded: u64,
    /// Elephants whose rule the driver cannot run (policing, no decap, ...); they stay
    /// on the userspace path.
    pub not_offloadable: u64,
    /// Elephants not offloaded because `max_rules` rules already were.
    pub full: u64,
    /// Map updates the kernel refused.
    pub map_errors: u64,
    /// Rules taken back after being idle.
    pub expired: u64,
    /// Rules taken back because the flow's entry left the userspace table.
    pub removed: u64,
    /// Offloaded rules replaced after userspace's rule changed.
    pub replaced: u64,
    /// Rules in the map now.
    pub active: u64,
}

#[derive(Debug, Clone, Copy)]
struct Tracked {
    /// Counters already folded into the pipeline.
    folded: (u64, u64),
    /// When the rule went in (for a rule that never gets a hit).
    installed: Duration,
}

/// Moves elephant flows into the XDP fast path and back. See the module documentation.
#[derive(Debug)]
pub struct Offloader {
    policy: OffloadPolicy,
    flows: HashMap<FlowKey, Tracked>,
    next_sweep: Duration,
    stats: OffloadStats,
}

/// CLOCK_MONOTONIC now: the clock `bpf_ktime_get_ns` reads, which stamps the program's
/// last-seen times. `std::time::Instant` uses the same clock but does not expose it.
pub fn monotonic_now() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux,
    // so the call cannot fail (and on failure `ts` stays zero, which only delays expiry).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

impl Offloader {
    pub fn new(policy: OffloadPolicy) -> Self {
        let mut policy = policy;
        policy.max_rules = policy.max_rules.min(MAX_OFFLOADED_RULES as usize);
        Offloader {
            policy,
            flows: HashMap::new(),
            next_sweep: Duration::ZERO,
            stats: OffloadStats::default(),
        }
    }

    pub fn policy(&self) -> &OffloadPolicy {
        &self.policy
    }

    pub fn stats(&self) -> OffloadStats {
        OffloadStats {
            active: self.flows.len() as u64,
            ..self.stats
        }
    }

    /// Whether `key`'s rule is in the fast path.
    pub fn is_offloaded(&self, key: &FlowKey) -> bool {
        self.flows.contains_key(key)
    }

    /// Take the pipeline's new elephants and rule changes, and sweep when one is due.
    /// `now_ms` is the pipeline's clock, `mono` CLOCK_MONOTONIC ([`monotonic_now`]).
    /// Call it from the worker's loop, between batches.
    pub fn poll(
        &mut self,
        prog: &mut XdpProgram,
        p: &mut Pipeline,
        now_ms: u32,
        mono: Duration,
    ) -> Result<(), XdpError> {
        for ev in p.take_offload_events() {
            self.follow(prog, p, ev, mono)?;
        }
        for key in p.take_elephants() {
            self.offload(prog, p, &key, mono)?;
        }
        if mono >= self.next_sweep {
            self.next_sweep = mono + self.policy.sweep_interval;
            self.sweep(prog, p, now_ms, mono)?;
        }
        Ok(())
    }

    fn offload(
        &mut self,
        prog: &mut XdpProgram,
        p: &mut Pipeline,
        key: &FlowKey,
        mono: Duration,
    ) -> Result<(), XdpError> {
        if self.flows.contains_key(key) {
            return Ok(());
        }
        let Some(rule) = p.rule_of(key) else {
            return Ok(()); // gone since it was queued
        };
        if self.flows.len() >= self.policy.max_rules {
            self.stats.full += 1;
            // Unmarked, so it is offered again once a later window finds it heavy.
            p.unmark_offloaded(key);
            return Ok(());
        }
        let xr = match XdpRule::from_rule(&rule) {
            Ok(r) => r,
            Err(why) => {
                // Stays marked: the rule will not become offloadable by waiting.
                self.stats.not_offloadable += 1;
                tracing::debug!(%key, %why, "elephant stays on the userspace path");
                return Ok(());
            }
        };
        match prog.install_rule(key, &xr) {
            Ok(_) => {
                self.flows.insert(
                    *key,
                    Tracked {
                        folded: (0, 0),
                        installed: mono,
                    },
                );
                self.stats.offloaded += 1;
                Ok(())
            }
            Err(e @ XdpError::Map { .. }) => {
                self.stats.map_errors += 1;
                p.unmark_offloaded(key);
                tracing::warn!(%key, error = %e, "offloading a rule failed; it stays in userspace");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Add what the driver counted since the last fold; returns whether it saw the flow.
    fn fold(
        p: &mut Pipeline,
        key: &FlowKey,
        t: &mut Tracked,
        c: &XdpCounters,
        now_ms: Option<u32>,
    ) -> bool {
        let dp = c.packets.saturating_sub(t.folded.0);
        let db = c.bytes.saturating_sub(t.folded.1);
        t.folded = (c.packets, c.bytes);
        if dp == 0 && db == 0 {
            return false;
        }
        p.fold_fastpath(key, dp, db, now_ms);
        true
    }

    fn follow(
        &mut self,
        prog: &mut XdpProgram,
        p: &mut Pipeline,
        ev: OffloadEvent,
        mono: Duration,
    ) -> Result<(), XdpError> {
        match ev {
            OffloadEvent::Gone(key) => {
                let Some(mut t) = self.flows.remove(&key) else {
                    return Ok(());
                };
                if let Some(c) = prog.remove_rule(&key)? {
                    // The entry is gone: the tenant and pipeline counters take the rest.
                    Self::fold(p, &key, &mut t, &c, None);
                }
                self.stats.removed += 1;
            }
            OffloadEvent::Replaced(key) => {
                let Some(mut t) = self.flows.remove(&key) else {
                    // Marked but refused or queued: offer the new rule afresh.
                    p.unmark_offloaded(&key);
                    return Ok(());
                };
                // Remove, then install: the old counters are final and belong to the old
                // rule (whose userspace counters the replace reset; they go to the new
                // one's, as everything the flow did is the flow's).
                if let Some(c) = prog.remove_rule(&key)? {
                    Self::fold(p, &key, &mut t, &c, None);
                }
                self.stats.replaced += 1;
                // The table kept the mark; `offload` keeps it, or drops it when the map
                // is full or refuses.
                self.offload(prog, p, &key, mono)?;
            }
        }
        Ok(())
    }

    /// Fold every offloaded rule's new counters and take back the idle ones.
    pub fn sweep(
        &mut self,
        prog: &mut XdpProgram,
        p: &mut Pipeline,
        now_ms: u32,
        mono: Duration,
    ) -> Result<(), XdpError> {
        let mut idle = Vec::new();
        for (key, t) in self.flows.iter_mut() {
            let Some(c) = prog.rule_counters(key)? else {
                // Not in the map (removed behind our back): forget it.
                idle.push(*key);
                continue;
            };
            Self::fold(p, key, t, &c, Some(now_ms));
            let last = c.last_seen.unwrap_or(t.installed).max(t.installed);
            if mono.saturating_sub(last) >= self.policy.idle {
                idle.push(*key);
            }
        }
        for key in idle {
            self.take_back(prog, p, &key, now_ms)?;
            self.stats.expired += 1;
        }
        Ok(())
    }

    fn take_back(
        &mut self,
        prog: &mut XdpProgram,
        p: &mut Pipeline,
        key: &FlowKey,
        now_ms: u32,
    ) -> Result<(), XdpError> {
        let Some(mut t) = self.flows.remove(key) else {
            return Ok(());
        };
        if let Some(c) = prog.remove_rule(key)? {
            Self::fold(p, key, &mut t, &c, Some(now_ms));
        }
        p.unmark_offloaded(key);
        Ok(())
    }

    /// Take every rule back to userspace, folding its counters (shutdown, or turning the
    /// fast path off).
    pub fn flush(
        &mut self,
        prog: &mut XdpProgram,
        p: &mut Pipeline,
        now_ms: u32,
    ) -> Result<(), XdpError> {
        let keys: Vec<FlowKey> = self.flows.keys().copied().collect();
        for k in keys {
            self.take_back(prog, p, &k, now_ms)?;
        }
        Ok(())
    }
}
