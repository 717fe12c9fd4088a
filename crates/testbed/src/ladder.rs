//! The offered-load ladder of the per-core rate ([`crate::measure::udp64_core_pps`]):
//! which load to offer next, given what the NF did with the loads before. No I/O, so
//! the search itself is tested on a model NF.
//!
//! 1. **Bracket**: double from [`LADDER_START`] until a load is *not kept* (forwarded
//!    < [`KEEP`] × offered) or [`LADDER_MAX`] is reached.
//! 2. **Bisect** between the last kept load and the first one that was not, for
//!    [`BISECT_STEPS`] steps: the bracket shrinks to 1/16 of itself, so the peak load is
//!    known within about 6 % of it.
//! 3. **Overload**: offer 2 × the highest kept load (the peak offered load). What the NF
//!    forwards there over its peak forwarded rate is `overload_keep`.
//! 4. **Pairs**: [`PAIRS`] times, the peak offered load again and then 2 × it, back to
//!    back. `overload_keep_paired` is the median over the pairs of what the NF forwarded
//!    at 2 × over what it forwarded at the peak load just before. Step 3's figure divides
//!    one sample by the *highest* of a dozen: on a shared machine, where one step's rate
//!    moves by ±10 % with the neighbours, that maximum sits above what the NF sustains,
//!    and a flat NF reads 0.7–0.9. Both are reported; the pairs are the estimate, the
//!    single step the figure the goal was first written against.
//! 5. **Unpaced**: the sender as fast as its CPU goes.
//!
//! At most `log2(LADDER_MAX / LADDER_START) + 1` = 8 bracket steps, 4 bisection steps,
//! one 2×, 2 × [`PAIRS`] paired and one unpaced step: 20 steps, each `settle + secs` of
//! sending.

/// The first load, packets/s: within any NF's reach.
pub const LADDER_START: u64 = 50_000;
/// The highest load the bracket phase doubles up to (the live-frames sender does about
/// 6-7 Mpps on one core here; above that it is the sender that saturates).
pub const LADDER_MAX: u64 = 6_400_000;
/// A load is kept when the NF forwarded at least this fraction of what was offered
/// (RFC 2544 asks for zero loss; on a shared 2-CPU VM a few percent of loss comes and
/// goes with the neighbours, so the threshold is explicit and loose).
pub const KEEP: f64 = 0.9;
/// Bisection steps after the bracket: the bracket [lo, 2·lo] shrinks to lo/16.
pub const BISECT_STEPS: usize = 4;
/// The overload step offers this multiple of the peak offered load.
pub const OVERLOAD_FACTOR: u64 = 2;
/// Peak-load / overload pairs after the overload step (their median is
/// `overload_keep_paired`).
pub const PAIRS: usize = 3;

/// What a step is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Bracket,
    Bisect,
    /// [`OVERLOAD_FACTOR`] × the peak offered load.
    Overload,
    /// The peak offered load again, first of a pair.
    PairPeak,
    /// [`OVERLOAD_FACTOR`] × the peak offered load, right after a [`Phase::PairPeak`].
    PairOverload,
    /// 0: the sender unpaced.
    Unpaced,
}

/// One load tried.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Step {
    pub phase: Phase,
    /// The rate the sender was asked for, packets/s (0: unpaced).
    pub asked: u64,
    /// What reached the NF's receive ring (taken or refused because it was full).
    pub offered: f64,
    /// What the NF forwarded to the sink.
    pub forwarded: f64,
    /// The share of the step's window in which one of the NF's threads ran real-time
    /// (`SCHED_FIFO`; PP's `--worker-rt` governor), sampled every 20 ms. `None` when
    /// not sampled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rt_share: Option<f64>,
}

impl Step {
    /// Forwarded at least [`KEEP`] of what was offered.
    pub fn kept(&self) -> bool {
        self.forwarded >= KEEP * self.offered
    }
}

/// The search; feed it each step's result with [`Ladder::record`] and ask
/// [`Ladder::next`] for the next load until it says `None`.
#[derive(Debug, Clone, Default)]
pub struct Ladder {
    pub steps: Vec<Step>,
    /// Highest asked load that was kept, and lowest that was not.
    lo: Option<u64>,
    hi: Option<u64>,
    bisected: usize,
    overload_done: bool,
    /// Paired steps done.
    paired: usize,
    unpaced_done: bool,
}

impl Ladder {
    pub fn new() -> Self {
        Ladder::default()
    }

    /// The next load to offer and why, or `None` when the search is over.
    pub fn next(&self) -> Option<(Phase, u64)> {
        let last = self.steps.last();
        let bracketing = self.hi.is_none()
            && self.bisected == 0
            && last.is_none_or(|s| s.phase == Phase::Bracket);
        if bracketing {
            let asked = match last {
                None => LADDER_START,
                Some(s) => s.asked * 2,
            };
            // The sender could not offer what it was asked (it, not the NF, is the
            // limit): doubling further measures the sender.
            let sender_capped = last.is_some_and(|s| s.offered < 0.5 * s.asked as f64);
            if asked <= LADDER_MAX && !sender_capped {
                return Some((Phase::Bracket, asked));
            }
        }
        if let (Some(lo), Some(hi)) = (self.lo, self.hi) {
            if self.bisected < BISECT_STEPS && hi > lo + 1 {
                return Some((Phase::Bisect, lo + (hi - lo) / 2));
            }
        }
        // Nothing kept at all (even the first load overwhelmed the NF): overload
        // relative to the first load.
        let peak = self.lo.unwrap_or(LADDER_START);
        if !self.overload_done {
            return Some((Phase::Overload, peak * OVERLOAD_FACTOR));
        }
        if self.paired < 2 * PAIRS {
            return Some(if self.paired % 2 == 0 {
                (Phase::PairPeak, peak)
            } else {
                (Phase::PairOverload, peak * OVERLOAD_FACTOR)
            });
        }
        if !self.unpaced_done {
            return Some((Phase::Unpaced, 0));
        }
        None
    }

    /// The result of offering `asked` (as [`Ladder::next`] said) for `phase`.
    pub fn record(&mut self, phase: Phase, asked: u64, offered: f64, forwarded: f64) {
        let s = Step {
            phase,
            asked,
            offered,
            forwarded,
            rt_share: None,
        };
        match phase {
            Phase::Bracket | Phase::Bisect => {
                if phase == Phase::Bisect {
                    self.bisected += 1;
                }
                if s.kept() {
                    self.lo = Some(self.lo.map_or(asked, |l| l.max(asked)));
                } else {
                    self.hi = Some(self.hi.map_or(asked, |h| h.min(asked)));
                }
            }
            Phase::Overload => self.overload_done = true,
            Phase::PairPeak | Phase::PairOverload => self.paired += 1,
            Phase::Unpaced => self.unpaced_done = true,
        }
        self.steps.push(s);
    }

    /// What [`Step::rt_share`] was for the step just recorded.
    pub fn note_rt_share(&mut self, share: f64) {
        if let Some(s) = self.steps.last_mut() {
            s.rt_share = Some(share);
        }
    }

    /// The highest forwarded rate of the bracket and bisection steps (RFC 2889's
    /// maximum forwarding rate) and that step.
    pub fn peak(&self) -> Option<Step> {
        self.steps
            .iter()
            .filter(|s| matches!(s.phase, Phase::Bracket | Phase::Bisect))
            .copied()
            .max_by(|a, b| a.forwarded.total_cmp(&b.forwarded))
    }

    /// The highest kept load, asked packets/s: the peak offered load.
    pub fn peak_load(&self) -> Option<u64> {
        self.lo
    }

    /// The overload step.
    pub fn overload(&self) -> Option<Step> {
        self.steps
            .iter()
            .copied()
            .find(|s| s.phase == Phase::Overload)
    }

    /// The unpaced step.
    pub fn unpaced(&self) -> Option<Step> {
        self.steps
            .iter()
            .copied()
            .find(|s| s.phase == Phase::Unpaced)
    }

    /// Forwarded at [`OVERLOAD_FACTOR`] × the peak offered load over the peak forwarded
    /// rate: 1.0 for an NF that holds its peak under overload, far less for one that
    /// livelocks.
    pub fn overload_keep(&self) -> Option<f64> {
        let peak = self.peak()?.forwarded;
        let over = self.overload()?.forwarded;
        (peak > 0.0).then(|| over / peak)
    }

    /// The median over the [`PAIRS`] pairs of forwarded at [`OVERLOAD_FACTOR`] × the
    /// peak offered load over forwarded at the peak offered load just before: what the
    /// NF keeps under overload, each sample against a neighbour in time rather than the
    /// run's maximum. `None` until a pair is complete.
    pub fn overload_keep_paired(&self) -> Option<f64> {
        let ratios: Vec<f64> = self
            .steps
            .windows(2)
            .filter(|w| w[0].phase == Phase::PairPeak && w[1].phase == Phase::PairOverload)
            .filter(|w| w[0].forwarded > 0.0)
            .map(|w| w[1].forwarded / w[0].forwarded)
            .collect();
        median(ratios)
    }
}

/// The median of the finite values, or None if there are none (the mean of the two
/// middle values for an even count). The benches' paired ratios all take it.
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An NF with capacity `cap` that, past it, forwards `collapse(offered)`; the sender
    /// reaches at most `sender` packets/s.
    fn run(cap: f64, sender: f64, collapse: impl Fn(f64) -> f64) -> Ladder {
        let mut l = Ladder::new();
        let mut n = 0;
        while let Some((phase, asked)) = l.next() {
            n += 1;
            assert!(n <= 20, "the ladder is bounded: {:?}", l.steps);
            let offered = if asked == 0 {
                sender
            } else {
                (asked as f64).min(sender)
            };
            let fwd = if offered <= cap {
                offered
            } else {
                collapse(offered)
            };
            l.record(phase, asked, offered, fwd);
        }
        l
    }

    #[test]
    fn bisection_finds_the_peak_within_the_bracket_over_16() {
        let l = run(300_000.0, 7e6, |_| 300_000.0);
        let phases: Vec<Phase> = l.steps.iter().map(|s| s.phase).collect();
        // 50k..400k doubling (400k is the first not kept), 4 bisections, 2x, unpaced.
        assert_eq!(
            &l.steps.iter().map(|s| s.asked).take(4).collect::<Vec<_>>(),
            &[50_000, 100_000, 200_000, 400_000]
        );
        assert_eq!(
            phases.iter().filter(|p| **p == Phase::Bisect).count(),
            BISECT_STEPS
        );
        // A load is kept up to cap / KEEP (333k: 300k forwarded is 90 % of it); the
        // bracket [200k, 400k] shrinks to 200k / 16 = 12.5k.
        let peak = l.peak_load().unwrap();
        let top = (300_000.0 / KEEP) as u64;
        assert!(
            (top - 200_000 / 16..=top).contains(&peak),
            "peak load {peak}"
        );
        // Asked twice the peak load; a flat NF keeps all of its peak.
        let o = l.overload().unwrap();
        assert_eq!(o.asked, 2 * peak);
        assert_eq!(l.overload_keep(), Some(1.0));
        // Then the pairs: peak load, 2 × it, three times, before the unpaced step.
        let pairs: Vec<(Phase, u64)> = l
            .steps
            .iter()
            .filter(|s| matches!(s.phase, Phase::PairPeak | Phase::PairOverload))
            .map(|s| (s.phase, s.asked))
            .collect();
        assert_eq!(
            pairs,
            [(Phase::PairPeak, peak), (Phase::PairOverload, 2 * peak)].repeat(PAIRS)
        );
        assert_eq!(l.overload_keep_paired(), Some(1.0));
        assert_eq!(l.unpaced().unwrap().asked, 0);
        assert_eq!(l.next(), None);
    }

    #[test]
    fn a_livelocking_nf_keeps_little_at_twice_its_peak() {
        // Past capacity, every extra packet costs the NF two forwarded ones.
        let cap = 250_000.0;
        let l = run(cap, 7e6, |o| (cap - 2.0 * (o - cap)).max(10_000.0));
        let keep = l.overload_keep().unwrap();
        assert!(keep < 0.2, "keep {keep}: {:?}", l.steps);
        let paired = l.overload_keep_paired().unwrap();
        assert!(paired < 0.2, "paired {paired}");
        assert!(l.peak().unwrap().forwarded >= cap * 0.9);
    }

    #[test]
    fn the_sender_not_the_nf_ends_the_bracket() {
        // An NF faster than the sender: the bracket stops where the sender does.
        let l = run(1e9, 900_000.0, |o| o);
        let bracket: Vec<u64> = l
            .steps
            .iter()
            .filter(|s| s.phase == Phase::Bracket)
            .map(|s| s.asked)
            .collect();
        assert_eq!(
            bracket,
            [50_000, 100_000, 200_000, 400_000, 800_000, 1_600_000, 3_200_000]
        );
        assert!(l.steps.iter().all(|s| s.phase != Phase::Bisect));
        assert_eq!(l.peak().unwrap().forwarded, 900_000.0);
    }

    #[test]
    fn the_paired_keep_is_a_median_of_neighbours_not_a_ratio_to_the_maximum() {
        // A flat NF at 500k whose rate moves with the neighbours: one bracket step read
        // 600k. The single step divides by that outlier; the pairs do not.
        let mut l = Ladder::new();
        let noisy = [
            1.0, 1.0, 1.0, 1.0, 1.0, 1.2, 0.95, 0.9, 1.0, 0.98, 1.0, 1.05, 0.92, 1.0,
        ];
        let mut i = 0;
        while let Some((phase, asked)) = l.next() {
            let offered = if asked == 0 { 7e6 } else { asked as f64 };
            let k = noisy.get(i).copied().unwrap_or(1.0);
            l.record(phase, asked, offered, offered.min(500_000.0) * k);
            i += 1;
        }
        let single = l.overload_keep().unwrap();
        let paired = l.overload_keep_paired().unwrap();
        assert!(single < 0.9, "single {single}: {:?}", l.steps);
        assert!(paired >= 0.9, "paired {paired}: {:?}", l.steps);
        // The median of the three pairs, computed by hand from the steps.
        let steps = &l.steps;
        let mut r: Vec<f64> = (0..steps.len() - 1)
            .filter(|&j| steps[j].phase == Phase::PairPeak)
            .map(|j| steps[j + 1].forwarded / steps[j].forwarded)
            .collect();
        assert_eq!(r.len(), PAIRS);
        r.sort_by(f64::total_cmp);
        assert_eq!(paired, r[1]);
    }

    #[test]
    fn nothing_kept_still_ends_with_an_overload_and_an_unpaced_step() {
        let l = run(1_000.0, 7e6, |_| 500.0);
        assert_eq!(l.peak_load(), None);
        // Bisection needs a kept load below the first not kept one: none.
        assert!(l.steps.iter().all(|s| s.phase != Phase::Bisect));
        assert_eq!(l.overload().unwrap().asked, 2 * LADDER_START);
        assert!(l.unpaced().is_some());
    }

    #[test]
    fn the_median_skips_what_is_not_finite_and_means_the_middle_pair() {
        assert_eq!(median(vec![3.0, f64::NAN, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, f64::INFINITY, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(vec![f64::NAN]), None);
        assert_eq!(median(Vec::new()), None);
    }
}
