//! The decision logic: water marks, sustain and cooldown, turned into a [`Decision`] per
//! sample. Pure: fed the time with each sample, so tests use a fake clock.

use std::time::Duration;

use serde_json::{json, Value};

use super::AutoscaleError;

/// Utilisation thresholds (1.0 = at the configured capacity).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WaterMarks {
    pub high: f64,
    pub low: f64,
}

/// How a target's units' utilisations make its scale-out signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aggregate {
    /// The busiest unit. For SC: a partition's requests cannot move to another group
    /// until it is split, so one hot group is reason enough.
    Max,
    /// The mean. For PP: the underlay spreads flows over every node, so adding a node
    /// lowers them all.
    Mean,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PolicyConfig {
    pub marks: WaterMarks,
    /// Consecutive samples beyond a mark before acting.
    pub sustain: u32,
    /// No action within this after the last action or refusal.
    pub cooldown: Duration,
    /// Fewest and most units (SC groups of a chain, or PP nodes). `min` 0 (SC only):
    /// an idle chain at one group goes to zero running instances, its groups' state
    /// parked on their SC nodes ([`Action::ScaleToZero`], docs/autoscaler.md).
    pub min: usize,
    pub max: usize,
    pub out_on: Aggregate,
}

impl PolicyConfig {
    pub fn validate(&self) -> Result<(), AutoscaleError> {
        let WaterMarks { high, low } = self.marks;
        if !(high.is_finite() && low.is_finite() && low >= 0.0 && low < high) {
            return Err(AutoscaleError::Config(format!(
                "water marks need 0 <= low < high; got low {low}, high {high}"
            )));
        }
        if self.sustain == 0 {
            return Err(AutoscaleError::Config("sustain must be at least 1".into()));
        }
        if self.max == 0 || self.max < self.min {
            return Err(AutoscaleError::Config(format!(
                "bounds need 0 <= min <= max and max >= 1; got min {}, max {}",
                self.min, self.max
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Action {
    ScaleOut,
    ScaleIn,
    /// One group → zero running instances: the chain's groups keep their key ranges,
    /// their replicas park (Serpens' scale to zero) and the next request wakes them.
    ScaleToZero,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::ScaleOut => "scale_out",
            Action::ScaleIn => "scale_in",
            Action::ScaleToZero => "scale_to_zero",
        }
    }
}

/// Why the policy decided what it did: which samples crossed which mark.
#[derive(Debug, Clone, PartialEq)]
pub struct Reason {
    /// The sample that completed the streak (the driver's sample counter).
    pub sample: u64,
    /// Consecutive samples beyond the mark, ending at `sample`.
    pub samples: u32,
    /// The utilisation compared in `sample` (max or mean; see the text).
    pub utilisation: f64,
    /// The mark it crossed.
    pub mark: f64,
    /// Units (groups or nodes) when it decided.
    pub units: usize,
    pub text: String,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    None,
    Act(Action, Reason),
    /// The marks said to act, but a bound or the projection forbids it.
    Refused(Action, Reason),
}

/// One target's policy state.
#[derive(Debug, Clone)]
pub struct Policy {
    cfg: PolicyConfig,
    over: u32,
    under: u32,
    last_action_ms: Option<u64>,
    /// Scaled to zero and no request since.
    at_zero: bool,
}

impl Policy {
    pub fn new(cfg: PolicyConfig) -> Result<Self, AutoscaleError> {
        cfg.validate()?;
        Ok(Policy {
            cfg,
            over: 0,
            under: 0,
            last_action_ms: None,
            at_zero: false,
        })
    }

    pub fn config(&self) -> &PolicyConfig {
        &self.cfg
    }

    /// At zero running instances (scaled to zero, no request seen since).
    pub fn at_zero(&self) -> bool {
        self.at_zero
    }

    /// A sample that could not be taken breaks any streak: `sustain` means consecutive.
    pub fn reset_streak(&mut self) {
        self.over = 0;
        self.under = 0;
    }

    /// Take sample number `sample`, taken at `now_ms`: the utilisation of each unit.
    pub fn observe(&mut self, now_ms: u64, sample: u64, utils: &[f64]) -> Decision {
        let n = utils.len();
        if n == 0 {
            self.over = 0;
            self.under = 0;
            return Decision::None;
        }
        let sum: f64 = utils.iter().sum();
        let mean = sum / n as f64;
        let max = utils.iter().copied().fold(f64::MIN, f64::max);
        // Any request wakes a parked chain on its SC nodes by itself: the policy only
        // notes that it is no longer at zero.
        if self.at_zero && sum > 0.0 {
            self.at_zero = false;
            self.under = 0;
        }
        let (out_u, out_name) = match self.cfg.out_on {
            Aggregate::Max => (max, "busiest unit"),
            Aggregate::Mean => (mean, "mean"),
        };
        let WaterMarks { high, low } = self.cfg.marks;
        self.over = if out_u > high { self.over + 1 } else { 0 };
        self.under = if mean < low { self.under + 1 } else { 0 };
        // Samples taken during the cooldown still count towards a streak, so a load that
        // stays beyond a mark is acted on as soon as the cooldown ends.
        let cooling = self
            .last_action_ms
            .is_some_and(|t| now_ms < t.saturating_add(self.cfg.cooldown.as_millis() as u64));
        if cooling {
            return Decision::None;
        }
        let reason = |samples: u32, utilisation: f64, mark: f64, text: String| Reason {
            sample,
            samples,
            utilisation,
            mark,
            units: n,
            text,
        };
        if self.over >= self.cfg.sustain {
            let samples = self.over;
            self.over = 0;
            self.under = 0;
            self.last_action_ms = Some(now_ms);
            let crossed = format!(
                "{out_name} utilisation {out_u:.2} above the high mark {high:.2} for {samples} samples"
            );
            let (acted, text) = if n >= self.cfg.max {
                let max = self.cfg.max;
                (
                    false,
                    format!("{crossed}, but at the maximum of {max} units"),
                )
            } else {
                (true, format!("{crossed}; {n} -> {} units", n + 1))
            };
            return decided(acted, Action::ScaleOut, reason(samples, out_u, high, text));
        }
        if self.under >= self.cfg.sustain {
            let samples = self.under;
            self.under = 0;
            if n == 1 && self.cfg.min == 0 && !self.at_zero {
                self.over = 0;
                self.last_action_ms = Some(now_ms);
                self.at_zero = true;
                let text = format!(
                    "mean utilisation {mean:.2} below the low mark {low:.2} for {samples} \
                     samples; 1 -> 0 running instances (the group's state stays parked on \
                     its SC nodes; the next request wakes it)"
                );
                return Decision::Act(Action::ScaleToZero, reason(samples, mean, low, text));
            }
            if n <= self.cfg.min.max(1) {
                // Idle at the minimum (or already at zero) is the steady state, not
                // news: no event.
                return Decision::None;
            }
            self.over = 0;
            self.last_action_ms = Some(now_ms);
            let crossed = format!(
                "mean utilisation {mean:.2} below the low mark {low:.2} for {samples} samples"
            );
            // The load of n units on n-1: never scale in to where the next sample would
            // scale out again.
            let projected = sum / (n - 1) as f64;
            let (acted, text) = if projected >= high {
                let text = format!(
                    "{crossed}, but {} units would be at {projected:.2}, not below the \
                     high mark {high:.2}",
                    n - 1
                );
                (false, text)
            } else {
                let text = format!(
                    "{crossed}; {n} -> {} units (projected {projected:.2})",
                    n - 1
                );
                (true, text)
            };
            return decided(acted, Action::ScaleIn, reason(samples, mean, low, text));
        }
        Decision::None
    }
}

/// `Act` when the policy acts, `Refused` when a limit stops it.
fn decided(acted: bool, action: Action, reason: Reason) -> Decision {
    if acted {
        Decision::Act(action, reason)
    } else {
        Decision::Refused(action, reason)
    }
}

pub(super) fn policy_json(p: &PolicyConfig) -> Value {
    json!({
        "high": p.marks.high,
        "low": p.marks.low,
        "sustain": p.sustain,
        "cooldown_ms": p.cooldown.as_millis() as u64,
        "min": p.min,
        "max": p.max,
        "out_on": format!("{:?}", p.out_on).to_lowercase(),
    })
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(in crate::autoscale) fn cfg() -> PolicyConfig {
        PolicyConfig {
            marks: WaterMarks {
                high: 0.8,
                low: 0.3,
            },
            sustain: 3,
            cooldown: Duration::from_secs(10),
            min: 1,
            max: 3,
            out_on: Aggregate::Max,
        }
    }

    /// Feed `samples` one second apart from `t0` ms; return the decisions that are not
    /// None, with their sample numbers.
    fn feed(p: &mut Policy, t0: u64, first: u64, samples: &[&[f64]]) -> Vec<(u64, Decision)> {
        samples
            .iter()
            .enumerate()
            .filter_map(|(i, u)| {
                let s = first + i as u64;
                let d = p.observe(t0 + 1000 * i as u64, s, u);
                (d != Decision::None).then_some((s, d))
            })
            .collect()
    }

    fn action(d: &Decision) -> Option<(bool, Action)> {
        match d {
            Decision::None => None,
            Decision::Act(a, _) => Some((true, *a)),
            Decision::Refused(a, _) => Some((false, *a)),
        }
    }

    /// `feed`'s answer as (sample, (acted, action)).
    fn actions(d: &[(u64, Decision)]) -> Vec<(u64, Option<(bool, Action)>)> {
        d.iter().map(|(s, d)| (*s, action(d))).collect()
    }

    #[test]
    fn config_is_validated() {
        assert!(Policy::new(cfg()).is_ok());
        for bad in [
            PolicyConfig {
                marks: WaterMarks {
                    high: 0.3,
                    low: 0.3,
                },
                ..cfg()
            },
            PolicyConfig {
                marks: WaterMarks {
                    high: 0.8,
                    low: -0.1,
                },
                ..cfg()
            },
            PolicyConfig {
                marks: WaterMarks {
                    high: f64::NAN,
                    low: 0.1,
                },
                ..cfg()
            },
            PolicyConfig {
                sustain: 0,
                ..cfg()
            },
            PolicyConfig {
                min: 0,
                max: 0,
                ..cfg()
            },
            PolicyConfig {
                min: 3,
                max: 2,
                ..cfg()
            },
        ] {
            assert!(
                matches!(Policy::new(bad.clone()), Err(AutoscaleError::Config(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn crossing_high_for_sustain_samples_scales_out_once() {
        let mut p = Policy::new(cfg()).unwrap();
        let hot: &[f64] = &[0.9];
        let d = feed(&mut p, 0, 1, &[hot, hot, hot, hot, hot, hot]);
        assert_eq!(d.len(), 1, "{d:?}");
        let (s, Decision::Act(Action::ScaleOut, r)) = &d[0] else {
            panic!("{d:?}")
        };
        assert_eq!(*s, 3, "acts on the third sample over the mark");
        assert_eq!((r.sample, r.samples, r.units), (3, 3, 1));
        assert_eq!(r.mark, 0.8);
        assert!((r.utilisation - 0.9).abs() < 1e-9);
        assert!(r.text.contains("above the high mark"), "{}", r.text);
    }

    #[test]
    fn a_noisy_sample_that_crosses_once_does_not_act() {
        let mut p = Policy::new(cfg()).unwrap();
        let (ok, hot, cold): (&[f64], &[f64], &[f64]) = (&[0.5], &[2.0], &[0.1, 0.1]);
        // Spikes, and dips below low that never last `sustain` samples.
        let d = feed(
            &mut p,
            0,
            1,
            &[ok, hot, ok, hot, hot, ok, cold, cold, ok, hot, ok],
        );
        assert!(d.is_empty(), "{d:?}");
    }

    #[test]
    fn cooldown_prevents_flapping() {
        let mut p = Policy::new(cfg()).unwrap();
        let hot: &[f64] = &[0.9, 0.85];
        let cold: &[f64] = &[0.05, 0.05, 0.05];
        // Out at sample 3 (t = 2 s). Then the load vanishes at once: the low mark holds
        // for many samples, but nothing happens until 10 s after the action.
        let mut samples: Vec<&[f64]> = vec![hot, hot, hot];
        samples.extend(std::iter::repeat_n(cold, 12));
        let d = feed(&mut p, 0, 1, &samples);
        assert_eq!(
            actions(&d),
            vec![
                (3, Some((true, Action::ScaleOut))),
                (13, Some((true, Action::ScaleIn)))
            ],
            "in at the first sample at or after t = 2 s + 10 s"
        );
        // Samples inside the cooldown counted: it acted as soon as the cooldown ended,
        // not `sustain` samples later.
        let Decision::Act(_, r) = &d[1].1 else {
            panic!()
        };
        assert_eq!(r.samples, 10);
    }

    #[test]
    fn low_mark_scales_in_but_never_below_min_and_never_into_an_overload() {
        let mut p = Policy::new(cfg()).unwrap();
        let cold: &[f64] = &[0.1, 0.2];
        let d = feed(&mut p, 0, 1, &[cold, cold, cold]);
        assert_eq!(action(&d[0].1), Some((true, Action::ScaleIn)));
        // At the minimum: idle is the steady state, no decision and no refusal.
        let one: &[f64] = &[0.0];
        let d = feed(&mut p, 100_000, 10, &[one; 10]);
        assert!(d.is_empty(), "{d:?}");
        // Marks whose scale-in would land above the high mark: refused.
        let mut p = Policy::new(PolicyConfig {
            marks: WaterMarks {
                high: 0.5,
                low: 0.4,
            },
            ..cfg()
        })
        .unwrap();
        let two: &[f64] = &[0.35, 0.35];
        let d = feed(&mut p, 0, 1, &[two, two, two]);
        let Decision::Refused(Action::ScaleIn, r) = &d[0].1 else {
            panic!("{d:?}")
        };
        assert!(r.text.contains("would be at 0.70"), "{}", r.text);
    }

    #[test]
    fn max_is_respected_and_the_refusal_backs_off_for_a_cooldown() {
        let mut p = Policy::new(cfg()).unwrap();
        let three_hot: &[f64] = &[1.0, 0.9, 1.2];
        let d = feed(&mut p, 0, 1, &[three_hot; 15]);
        // Refused at sample 3 (t = 2 s), then again once the cooldown is over (t = 12 s).
        assert_eq!(
            actions(&d),
            vec![
                (3, Some((false, Action::ScaleOut))),
                (13, Some((false, Action::ScaleOut)))
            ]
        );
        let Decision::Refused(_, r) = &d[0].1 else {
            panic!()
        };
        assert!(r.text.contains("maximum of 3"), "{}", r.text);
        assert!((r.utilisation - 1.2).abs() < 1e-9, "the busiest group's");
    }

    #[test]
    fn mean_aggregate_ignores_one_hot_unit() {
        let mut p = Policy::new(PolicyConfig {
            out_on: Aggregate::Mean,
            ..cfg()
        })
        .unwrap();
        let skew: &[f64] = &[1.5, 0.2, 0.2];
        assert!(feed(&mut p, 0, 1, &[skew; 5]).is_empty());
        let mut p = Policy::new(PolicyConfig { max: 4, ..cfg() }).unwrap();
        assert_eq!(
            action(&feed(&mut p, 0, 1, &[skew; 5])[0].1),
            Some((true, Action::ScaleOut))
        );
    }

    #[test]
    fn min_zero_is_accepted_and_scales_an_idle_group_to_zero_once() {
        let mut p = Policy::new(PolicyConfig { min: 0, ..cfg() }).unwrap();
        let idle: &[f64] = &[0.0];
        // Sustain 3, cooldown 10 s: to zero at sample 3, then nothing while still idle.
        let d = feed(&mut p, 0, 1, &[idle; 30]);
        assert_eq!(actions(&d), vec![(3, Some((true, Action::ScaleToZero)))]);
        assert!(p.at_zero());
        let Decision::Act(_, r) = &d[0].1 else {
            panic!()
        };
        assert_eq!(r.units, 1);
        assert!(r.text.contains("1 -> 0"), "{}", r.text);
        // A request woke it: no longer at zero, and a new streak below the low mark
        // (this sample is its first) takes it to zero again.
        let d = feed(&mut p, 40_000, 31, &[&[0.05]]);
        assert!(d.is_empty());
        assert!(!p.at_zero());
        let d = feed(&mut p, 41_000, 32, &[idle; 3]);
        assert_eq!(actions(&d), vec![(33, Some((true, Action::ScaleToZero)))]);
    }

    #[test]
    fn min_zero_merges_down_to_one_group_before_zero() {
        let mut p = Policy::new(PolicyConfig {
            min: 0,
            cooldown: Duration::ZERO,
            ..cfg()
        })
        .unwrap();
        let two: &[f64] = &[0.0, 0.0];
        let one: &[f64] = &[0.0];
        let d = feed(&mut p, 0, 1, &[two; 3]);
        assert_eq!(actions(&d), vec![(3, Some((true, Action::ScaleIn)))]);
        let d = feed(&mut p, 10_000, 4, &[one; 3]);
        assert_eq!(actions(&d), vec![(6, Some((true, Action::ScaleToZero)))]);
    }

    #[test]
    fn min_one_never_scales_to_zero() {
        let mut p = Policy::new(cfg()).unwrap();
        let idle: &[f64] = &[0.0];
        assert!(feed(&mut p, 0, 1, &[idle; 30]).is_empty());
        assert!(!p.at_zero());
    }

    // ------------------------------------------------------------ the driver, with fakes
}
