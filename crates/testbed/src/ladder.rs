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
//! 4. **Unpaced**: the sender as fast as its CPU goes.
//!
//! At most `log2(LADDER_MAX / LADDER_START) + 1` = 8 bracket steps, 4 bisection steps,
//! one 2× and one unpaced step: 14 steps, each `settle + secs` of sending.

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

/// What a step is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Bracket,
    Bisect,
    /// [`OVERLOAD_FACTOR`] × the peak offered load.
    Overload,
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
        if !self.overload_done {
            // Nothing kept at all (even the first load overwhelmed the NF): overload
            // relative to the first load.
            let peak = self.lo.unwrap_or(LADDER_START);
            return Some((Phase::Overload, peak * OVERLOAD_FACTOR));
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
            Phase::Unpaced => self.unpaced_done = true,
        }
        self.steps.push(s);
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
            assert!(n <= 14, "the ladder is bounded: {:?}", l.steps);
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
    fn nothing_kept_still_ends_with_an_overload_and_an_unpaced_step() {
        let l = run(1_000.0, 7e6, |_| 500.0);
        assert_eq!(l.peak_load(), None);
        // Bisection needs a kept load below the first not kept one: none.
        assert!(l.steps.iter().all(|s| s.phase != Phase::Bisect));
        assert_eq!(l.overload().unwrap().asked, 2 * LADDER_START);
        assert!(l.unpaced().is_some());
    }
}
