//! Polling with a deadline.

use std::time::{Duration, Instant};

/// How often [`wait_until`] calls its closure.
pub const POLL: Duration = Duration::from_millis(10);

/// Call `f` every 10 ms until it returns `Some`, and return that; panic with "timed out
/// waiting for `what`" once `limit` has passed. `f` runs at least once, and once more
/// after the last sleep, so a condition that holds by the deadline is seen.
pub fn wait_until<T>(limit: Duration, what: &str, f: impl FnMut() -> Option<T>) -> T {
    wait_until_every(limit, POLL, what, f)
}

/// [`wait_until`], calling `f` every `every`.
pub fn wait_until_every<T>(
    limit: Duration,
    every: Duration,
    what: &str,
    mut f: impl FnMut() -> Option<T>,
) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(every);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_the_first_some() {
        let mut n = 0;
        let v = wait_until(Duration::from_secs(5), "three calls", || {
            n += 1;
            (n == 3).then_some(n * 10)
        });
        assert_eq!(v, 30);
    }

    #[test]
    #[should_panic(expected = "timed out waiting for nothing")]
    fn panics_with_what_on_timeout() {
        wait_until_every(
            Duration::from_millis(30),
            Duration::from_millis(5),
            "nothing",
            || None::<()>,
        );
    }
}
