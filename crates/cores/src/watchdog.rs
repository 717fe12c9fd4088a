//! The fallback of paper 002 §III-A: after a learned assignment is applied the node
//! feeds this watchdog throughput samples; when they fall more than `tolerance` (5 %)
//! below the throughput RR gave before the switch, it says to revert to RR, once,
//! with the reason for the node's event log. No clock, no I/O: the caller samples.

use std::collections::VecDeque;

use crate::CoresError;

/// When to revert.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WatchdogConfig {
    /// Largest accepted relative regression (paper: 5 %).
    pub tolerance: f64,
    /// Samples averaged before judging: one noisy sample must not revert.
    pub window: usize,
}

impl Default for WatchdogConfig {
    fn default() -> Self {
        WatchdogConfig {
            tolerance: 0.05,
            window: 5,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum WatchdogVerdict {
    /// Fewer than `window` samples since the learned assignment was applied.
    Warming,
    /// The learned assignment holds.
    Keep,
    /// Revert to RR now (returned once; later samples get `Reverted`).
    RevertToRr { reason: String },
    /// Already reverted; nothing more to do.
    Reverted,
}

#[derive(Debug, Clone)]
pub struct Watchdog {
    rr_throughput: f64,
    cfg: WatchdogConfig,
    recent: VecDeque<f64>,
    reverted: bool,
    ignored: u64,
}

impl Watchdog {
    /// `rr_throughput`: what RR achieved before the learned assignment (any unit,
    /// the same as the samples').
    pub fn new(rr_throughput: f64, cfg: WatchdogConfig) -> Result<Self, CoresError> {
        if !(rr_throughput.is_finite() && rr_throughput >= 0.0) {
            return Err(CoresError::invalid(
                "rr_throughput",
                format!("must be finite and ≥ 0, got {rr_throughput}"),
            ));
        }
        if !(0.0..1.0).contains(&cfg.tolerance) || cfg.window == 0 {
            return Err(CoresError::invalid(
                "watchdog",
                format!("need tolerance in [0, 1) and window ≥ 1, got {cfg:?}"),
            ));
        }
        Ok(Watchdog {
            rr_throughput,
            cfg,
            recent: VecDeque::with_capacity(cfg.window),
            reverted: false,
            ignored: 0,
        })
    }

    /// One throughput sample of the learned assignment.
    pub fn observe(&mut self, throughput: f64) -> WatchdogVerdict {
        if self.reverted {
            return WatchdogVerdict::Reverted;
        }
        if !(throughput.is_finite() && throughput >= 0.0) {
            // A broken sample says nothing about the assignment.
            self.ignored += 1;
            return if self.recent.len() < self.cfg.window {
                WatchdogVerdict::Warming
            } else {
                WatchdogVerdict::Keep
            };
        }
        if self.recent.len() == self.cfg.window {
            self.recent.pop_front();
        }
        self.recent.push_back(throughput);
        if self.recent.len() < self.cfg.window {
            return WatchdogVerdict::Warming;
        }
        let mean = self.recent.iter().sum::<f64>() / self.recent.len() as f64;
        let floor = self.rr_throughput * (1.0 - self.cfg.tolerance);
        if mean < floor {
            self.reverted = true;
            let drop = if self.rr_throughput > 0.0 {
                100.0 * (1.0 - mean / self.rr_throughput)
            } else {
                0.0
            };
            return WatchdogVerdict::RevertToRr {
                reason: format!(
                    "learned assignment: mean throughput {mean:.4} over the last {} samples is {drop:.1}% below RR's {:.4} (tolerance {:.1}%)",
                    self.cfg.window,
                    self.rr_throughput,
                    100.0 * self.cfg.tolerance
                ),
            };
        }
        WatchdogVerdict::Keep
    }

    pub fn reverted(&self) -> bool {
        self.reverted
    }

    /// Non-finite or negative samples skipped.
    pub fn ignored(&self) -> u64 {
        self.ignored
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wd() -> Watchdog {
        Watchdog::new(100.0, WatchdogConfig::default()).unwrap()
    }

    #[test]
    fn keeps_a_learned_assignment_within_tolerance() {
        let mut w = wd();
        for _ in 0..4 {
            assert_eq!(w.observe(96.0), WatchdogVerdict::Warming);
        }
        for _ in 0..50 {
            assert_eq!(w.observe(96.0), WatchdogVerdict::Keep);
        }
        assert!(!w.reverted());
    }

    #[test]
    fn reverts_once_on_a_regression_over_five_percent() {
        let mut w = wd();
        for _ in 0..5 {
            w.observe(110.0);
        }
        // One bad sample in the window is not enough...
        assert_eq!(w.observe(80.0), WatchdogVerdict::Keep);
        // ...a sustained 7 % drop is.
        let mut verdict = WatchdogVerdict::Keep;
        for _ in 0..5 {
            verdict = w.observe(93.0);
            if verdict != WatchdogVerdict::Keep {
                break;
            }
        }
        match verdict {
            WatchdogVerdict::RevertToRr { reason } => {
                // The window still held the dip when it tipped under 95.
                assert!(reason.contains("below RR's 100.0000"), "{reason}");
            }
            other => panic!("expected a revert, got {other:?}"),
        }
        assert!(w.reverted());
        assert_eq!(w.observe(200.0), WatchdogVerdict::Reverted);
    }

    #[test]
    fn broken_samples_are_ignored_and_bad_config_refused() {
        let mut w = wd();
        for _ in 0..10 {
            assert_eq!(w.observe(f64::NAN), WatchdogVerdict::Warming);
        }
        assert_eq!(w.ignored(), 10);
        assert!(Watchdog::new(f64::NAN, WatchdogConfig::default()).is_err());
        let cfg = WatchdogConfig {
            tolerance: 1.5,
            window: 1,
        };
        assert!(Watchdog::new(1.0, cfg).is_err());
    }
}
