//! How many CPUs the control threads may use: the decision alone, without clocks or
//! I/O, so that it can be tested sample by sample.

use std::time::Duration;

/// The thresholds of [`PackPolicy`]. Busy is measured in CPUs (1.0 = one CPU fully
/// busy), over the CPUs the control threads may use now, all processes counted.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyConfig {
    /// Grow when the active CPUs are at least this busy, each on average.
    pub grow_busy: f64,
    /// ... for this many samples in a row (one sample: a load step, not a blip).
    pub grow_samples: u32,
    /// Try one CPU fewer when the active CPUs are at most this busy, each on average
    /// (the threads then share fewer CPUs, and hand-offs between them stop crossing
    /// CPUs, which is the point: measured, it costs less than it did spread out).
    pub shrink_busy: f64,
    /// ... for this long without a break.
    pub shrink_after: Duration,
    /// A shrink that has to be undone within this long was a failed try: the next try
    /// waits for the backoff, which doubles with each failure.
    pub probe_window: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            grow_busy: 0.9,
            grow_samples: 2,
            shrink_busy: 0.75,
            shrink_after: Duration::from_secs(1),
            probe_window: Duration::from_secs(2),
            backoff_min: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
        }
    }
}

/// What a sample changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// One more CPU; `failed_probe`: it undid a shrink within the probe window.
    Grow { to: usize, failed_probe: bool },
    /// One CPU fewer.
    Shrink { to: usize },
}

/// The number of CPUs (`1..=n`, the first `k` of the process's list) the control
/// threads may use. Starts with all of them. Grows at once when the active CPUs are
/// full; shrinks one CPU at a time when they have had room for a while, and backs off
/// (doubling, up to `backoff_max`) each time a shrink had to be undone, so a steady
/// load that does not fit fewer CPUs is tried rarely.
#[derive(Clone, Debug)]
pub struct PackPolicy {
    cfg: PolicyConfig,
    n: usize,
    k: usize,
    hot: u32,
    cool_since: Option<Duration>,
    last_shrink: Option<Duration>,
    backoff: Duration,
    next_try: Duration,
}

impl PackPolicy {
    /// `n` ≥ 1 CPUs; with one there is nothing to decide.
    pub fn new(n: usize, cfg: PolicyConfig) -> Self {
        let backoff = cfg.backoff_min;
        PackPolicy {
            cfg,
            n: n.max(1),
            k: n.max(1),
            hot: 0,
            cool_since: None,
            last_shrink: None,
            backoff,
            next_try: Duration::ZERO,
        }
    }

    /// CPUs the control threads may use now.
    pub fn active(&self) -> usize {
        self.k
    }

    /// CPUs there are.
    pub fn cpus(&self) -> usize {
        self.n
    }

    /// The wait before the next shrink may be tried after a failed one.
    pub fn backoff(&self) -> Duration {
        self.backoff
    }

    /// One sample: `now` from any fixed origin, `busy` the CPUs' busy time over the
    /// last interval, summed over the active CPUs (so in `0..=active()`).
    pub fn step(&mut self, now: Duration, busy: f64) -> Option<Change> {
        let busy = if busy.is_finite() { busy.max(0.0) } else { 0.0 };
        let k = self.k as f64;
        if let Some(at) = self.last_shrink {
            if now.saturating_sub(at) > self.cfg.probe_window {
                // The last shrink held: the load fits, so a later try starts afresh.
                self.last_shrink = None;
                self.backoff = self.cfg.backoff_min;
            }
        }
        if busy >= self.cfg.grow_busy * k {
            self.hot += 1;
        } else {
            self.hot = 0;
        }
        if self.hot >= self.cfg.grow_samples && self.k < self.n {
            self.k += 1;
            self.hot = 0;
            self.cool_since = None;
            let failed_probe = self.last_shrink.take().is_some();
            if failed_probe {
                self.next_try = now + self.backoff;
                self.backoff = (self.backoff * 2).min(self.cfg.backoff_max);
            }
            return Some(Change::Grow {
                to: self.k,
                failed_probe,
            });
        }
        if self.k > 1 && busy <= self.cfg.shrink_busy * k {
            let since = *self.cool_since.get_or_insert(now);
            if now.saturating_sub(since) >= self.cfg.shrink_after && now >= self.next_try {
                self.k -= 1;
                self.hot = 0;
                self.cool_since = None;
                self.last_shrink = Some(now);
                return Some(Change::Shrink { to: self.k });
            }
        } else {
            self.cool_since = None;
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    /// Steps a policy every 50 ms from `from` for `len`, at `busy`; the changes seen.
    fn run(p: &mut PackPolicy, from: u64, len: u64, busy: f64) -> Vec<Change> {
        (0..len / 50)
            .filter_map(|i| p.step(ms(from + i * 50), busy))
            .collect()
    }

    #[test]
    fn an_idle_process_packs_down_to_one_cpu_a_cpu_at_a_time() {
        let mut p = PackPolicy::new(4, PolicyConfig::default());
        assert_eq!(p.active(), 4);
        let c = run(&mut p, 0, 10_000, 0.1);
        assert_eq!(
            c,
            vec![
                Change::Shrink { to: 3 },
                Change::Shrink { to: 2 },
                Change::Shrink { to: 1 }
            ]
        );
        assert_eq!(p.active(), 1);
    }

    #[test]
    fn a_full_cpu_grows_after_two_samples_and_not_after_one() {
        let mut p = PackPolicy::new(2, PolicyConfig::default());
        run(&mut p, 0, 2_000, 0.2);
        assert_eq!(p.active(), 1);
        assert_eq!(p.step(ms(5_000), 0.95), None, "one hot sample is a blip");
        assert_eq!(p.step(ms(5_050), 0.3), None);
        assert_eq!(p.step(ms(5_100), 0.95), None);
        assert_eq!(
            p.step(ms(5_150), 1.0),
            Some(Change::Grow {
                to: 2,
                failed_probe: false
            }),
            "the shrink was long ago: not a failed probe"
        );
        assert_eq!(p.active(), 2);
    }

    #[test]
    fn a_load_that_does_not_fit_one_cpu_is_tried_with_a_doubling_backoff() {
        // Spread, the load reads 1.3 CPUs (under 0.75 × 2, so a shrink is tried);
        // packed it fills the one CPU (≥ 0.9), so each try is undone.
        let mut p = PackPolicy::new(2, PolicyConfig::default());
        let mut t = 0;
        let mut tries = Vec::new();
        while t < 120_000 {
            let busy = if p.active() == 1 { 1.0 } else { 1.3 };
            match p.step(ms(t), busy) {
                Some(Change::Shrink { .. }) => tries.push(t),
                Some(Change::Grow { failed_probe, .. }) => assert!(failed_probe),
                None => {}
            }
            t += 50;
        }
        // The gaps between tries grow: 1 s of cool, then the backoff (1, 2, 4, ... s).
        let gaps: Vec<u64> = tries.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.len() >= 4, "tries at {tries:?}");
        assert!(gaps.windows(2).all(|g| g[1] >= g[0]), "gaps {gaps:?}");
        assert!(gaps.last().unwrap() >= &16_000, "gaps {gaps:?}");
        assert!(p.backoff() <= PolicyConfig::default().backoff_max);
    }

    #[test]
    fn a_shrink_that_holds_resets_the_backoff() {
        let mut p = PackPolicy::new(2, PolicyConfig::default());
        // Two failed tries.
        let mut t = 0;
        let mut failures = 0;
        while failures < 2 {
            // One CPU busy: room spread over two (≤ 0.75 × 2), full on one (≥ 0.9).
            if let Some(Change::Grow { failed_probe, .. }) = p.step(ms(t), 1.0) {
                assert!(failed_probe);
                failures += 1;
            }
            t += 50;
        }
        assert_eq!(p.backoff(), ms(4_000));
        // Then a load that fits: the next try holds past the probe window.
        let c = run(&mut p, t, 20_000, 0.3);
        assert_eq!(c, vec![Change::Shrink { to: 1 }]);
        assert_eq!(p.backoff(), PolicyConfig::default().backoff_min);
    }

    #[test]
    fn one_cpu_has_nothing_to_decide() {
        let mut p = PackPolicy::new(1, PolicyConfig::default());
        assert!(run(&mut p, 0, 5_000, 0.0).is_empty());
        assert!(run(&mut p, 5_000, 5_000, 1.0).is_empty());
        assert_eq!(p.active(), 1);
        assert_eq!(PackPolicy::new(0, PolicyConfig::default()).cpus(), 1);
    }

    #[test]
    fn a_load_between_the_marks_changes_nothing() {
        // 0.8 per CPU: above the shrink mark, below the grow mark.
        let mut p = PackPolicy::new(2, PolicyConfig::default());
        assert!(run(&mut p, 0, 30_000, 1.6).is_empty());
    }

    proptest! {
        /// Whatever the samples (NaN and negatives included), the active count stays
        /// in 1..=n and moves by one at a time, the way each change says.
        #[test]
        fn the_active_count_stays_in_range_and_moves_by_one(
            n in 1usize..17,
            samples in proptest::collection::vec(prop_oneof![Just(f64::NAN), -1.0f64..20.0], 1..400),
        ) {
            let mut p = PackPolicy::new(n, PolicyConfig::default());
            for (i, b) in samples.into_iter().enumerate() {
                let before = p.active();
                match p.step(ms(i as u64 * 50), b) {
                    Some(Change::Grow { to, .. }) => prop_assert_eq!(to, before + 1),
                    Some(Change::Shrink { to }) => prop_assert_eq!(to + 1, before),
                    None => prop_assert_eq!(p.active(), before),
                }
                prop_assert!((1..=n).contains(&p.active()));
            }
        }
    }
}
