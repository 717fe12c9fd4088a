//! When a packet worker runs `SCHED_FIFO` (`starfabric pp --worker-rt`): only while the
//! kernel is dropping frames for it, i.e. while it is overloaded.
//!
//! A worker that outranks the kernel's receive thread cannot be starved by it (receive
//! livelock; `docs/afxdp.md`, "Overload"). Always outranking everything costs the rest
//! of the machine, though: measured, an always-`SCHED_FIFO` AF_XDP worker made
//! `bench e2e`'s new connections/s 27 % slower, its wakeups preempting the FM, SC and
//! application processes the connections also need. So the worker checks the kernel's
//! drop counter for its port every [`WINDOW`]: a window with drops makes it
//! `SCHED_FIFO`; [`HOLD`] without any make it ordinary again. Under sustained overload
//! that costs a window or two of ordinary scheduling per `HOLD` (under 1 %), which is
//! what it takes to see whether the overload is over.

use std::time::{Duration, Instant};

/// How often the drop counter is read (one `getsockopt`).
pub const WINDOW: Duration = Duration::from_millis(20);
/// How long without drops before the worker is ordinary again. A `SCHED_FIFO` AF_XDP
/// worker that keeps up sees no drops at all, so under sustained overload it goes back
/// to ordinary once per `HOLD`, and livelocks for a window or two until the drops
/// bring it back; 5 s makes that well under 1 % of the time.
pub const HOLD: Duration = Duration::from_secs(5);

/// What the worker should run as after a window.
pub fn decide(rt: bool, dropped_in_window: u64, quiet_for: Duration) -> bool {
    if dropped_in_window > 0 {
        true
    } else if rt {
        quiet_for < HOLD
    } else {
        false
    }
}

/// What a worker's governor has done, for the stats line and `/metrics`: whether it is
/// `SCHED_FIFO` now, how often it became so, and for how long in all.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RtStats {
    pub rt: bool,
    pub entered: u64,
    pub rt_time: Duration,
    /// A switch was refused, so the governor stopped.
    pub disabled: bool,
}

impl RtStats {
    /// Several workers' governors as one: how many are `SCHED_FIFO` now, switches and
    /// time summed.
    pub fn sum<'a>(all: impl IntoIterator<Item = &'a RtStats>) -> (usize, RtStats) {
        all.into_iter()
            .fold((0, RtStats::default()), |(n, mut acc), s| {
                acc.entered += s.entered;
                acc.rt_time += s.rt_time;
                acc.disabled |= s.disabled;
                (n + usize::from(s.rt), acc)
            })
    }
}

/// The per-worker state.
pub struct RtGovernor {
    priority: i32,
    rt: bool,
    next: Instant,
    last_drops: Option<u64>,
    last_drop_at: Instant,
    /// Switches into `SCHED_FIFO`, for the log and tests.
    pub entered: u64,
    /// Since when the worker is `SCHED_FIFO` (while it is), and its earlier spells.
    rt_since: Option<Instant>,
    rt_before: Duration,
    /// `SCHED_FIFO` from the start, never ordinary again (`--worker-rt-always`).
    always: bool,
    /// A switch was refused: the governor stops trying (and warning).
    disabled: bool,
}

impl RtGovernor {
    pub fn new(priority: i32, now: Instant) -> Self {
        RtGovernor {
            priority,
            rt: false,
            next: now + WINDOW,
            last_drops: None,
            last_drop_at: now,
            entered: 0,
            rt_since: None,
            rt_before: Duration::ZERO,
            always: false,
            disabled: false,
        }
    }

    /// What the governor has done so far.
    pub fn stats(&self, now: Instant) -> RtStats {
        RtStats {
            rt: self.rt,
            entered: self.entered,
            rt_time: self.rt_before + self.rt_since.map_or(Duration::ZERO, |t| now - t),
            disabled: self.disabled,
        }
    }

    /// `SCHED_FIFO` now and for good: no drop counter is read.
    pub fn always(priority: i32, now: Instant) -> Self {
        let mut g = RtGovernor::new(priority, now);
        g.always = true;
        if set_sched(true, priority) {
            g.rt = true;
            g.entered = 1;
            g.rt_since = Some(now);
        }
        g
    }

    /// Call once per loop iteration; `drops` reads the kernel's drop counter for the
    /// worker's port (called once per window only).
    pub fn tick(&mut self, now: Instant, drops: impl FnOnce() -> Option<u64>) {
        if self.always || self.disabled || now < self.next {
            return;
        }
        self.next = now + WINDOW;
        let Some(d) = drops() else { return };
        let delta = self.last_drops.map_or(0, |l| d.saturating_sub(l));
        self.last_drops = Some(d);
        if delta > 0 {
            self.last_drop_at = now;
        }
        let want = decide(self.rt, delta, now - self.last_drop_at);
        if want == self.rt {
            return;
        }
        if set_sched(want, self.priority) {
            self.rt = want;
            if want {
                self.entered += 1;
                self.rt_since = Some(now);
            } else if let Some(t) = self.rt_since.take() {
                self.rt_before += now - t;
            }
            tracing::debug!(rt = want, dropped = delta, "PP worker scheduling");
        } else {
            // Not allowed here (no CAP_SYS_NICE, or a cgroup without real-time
            // runtime): asking again every window would only repeat the warning.
            self.disabled = true;
        }
    }
}

/// Make the calling thread `SCHED_FIFO` at `priority`, or `SCHED_OTHER` again. A
/// failure (no CAP_SYS_NICE) is logged once per call and leaves the thread as it was.
fn set_sched(rt: bool, priority: i32) -> bool {
    let (policy, prio) = if rt {
        (libc::SCHED_FIFO, priority)
    } else {
        (libc::SCHED_OTHER, 0)
    };
    let param = libc::sched_param {
        sched_priority: prio,
    };
    // SAFETY: pid 0 is the calling thread; `param` lives for the call.
    let r = unsafe { libc::sched_setscheduler(0, policy, &param) };
    if r != 0 {
        let e = std::io::Error::last_os_error();
        tracing::warn!(rt, priority, error = %e, "cannot change the PP worker's scheduling");
        return false;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_make_the_worker_rt_and_a_quiet_hold_makes_it_ordinary() {
        assert!(!decide(false, 0, Duration::ZERO), "no drops: ordinary");
        assert!(decide(false, 1, Duration::ZERO), "drops: RT");
        assert!(
            decide(true, 0, HOLD / 2),
            "quiet, but not for long: stays RT"
        );
        assert!(!decide(true, 0, HOLD), "quiet for the hold: ordinary");
        assert!(decide(true, 5, HOLD * 3), "drops again: RT");
    }

    #[test]
    fn rt_time_counts_every_spell_and_sums_over_workers() {
        let t0 = Instant::now();
        let mut g = RtGovernor::new(0, t0);
        assert_eq!(g.stats(t0), RtStats::default());
        // One closed spell of 2 s and an open one since t0 + 5 s.
        g.rt_before = Duration::from_secs(2);
        g.rt_since = Some(t0 + Duration::from_secs(5));
        g.rt = true;
        g.entered = 2;
        let s = g.stats(t0 + Duration::from_secs(6));
        assert_eq!(s.rt_time, Duration::from_secs(3));
        assert!(s.rt && s.entered == 2);
        let other = RtStats {
            rt: false,
            entered: 1,
            rt_time: Duration::from_millis(500),
            disabled: true,
        };
        let (now_rt, sum) = RtStats::sum(&[s, other]);
        assert_eq!(now_rt, 1);
        assert_eq!(sum.entered, 3);
        assert_eq!(sum.rt_time, Duration::from_millis(3500));
        assert!(sum.disabled, "one refused switch shows");
    }

    #[test]
    fn the_counter_is_read_once_per_window_and_its_first_value_is_a_baseline() {
        let t0 = Instant::now();
        // Priority 0 is not valid for SCHED_FIFO, so nothing changes the test thread's
        // scheduling: the switch fails (logged) and the governor stays ordinary.
        let mut g = RtGovernor::new(0, t0);
        let mut reads = 0;
        g.tick(t0, || {
            reads += 1;
            Some(100)
        });
        assert_eq!(reads, 0, "not before the first window");
        g.tick(t0 + WINDOW, || {
            reads += 1;
            Some(100)
        });
        g.tick(t0 + WINDOW + WINDOW / 2, || {
            reads += 1;
            Some(200)
        });
        assert_eq!(reads, 1, "once per window");
        // The first reading is the baseline, not a burst of drops.
        assert_eq!(g.last_drop_at, t0);
        g.tick(t0 + WINDOW * 3, || Some(150));
        assert_eq!(g.last_drop_at, t0 + WINDOW * 3, "drops seen");
        assert!(
            !g.rt && g.entered == 0,
            "the switch failed, so still ordinary"
        );
        // And it does not ask again: no more reads, however many drops come.
        let mut more = 0;
        g.tick(t0 + WINDOW * 5, || {
            more += 1;
            Some(10_000)
        });
        assert_eq!(more, 0, "a refused switch disables the governor");
    }
}
