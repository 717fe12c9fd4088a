//! The standard token bucket (STB in the paper).

/// A token bucket: refills at `rate` ops/s up to `depth` ops; time is passed in (µs).
/// Starts full. NaN or negative rates and depths count as 0.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenBucket {
    rate: f64,
    depth: f64,
    tokens: f64,
    last_us: u64,
}

fn sane(x: f64) -> f64 {
    if x.is_nan() || x < 0.0 {
        0.0
    } else {
        x
    }
}

impl TokenBucket {
    pub fn new(rate: f64, depth: f64, now_us: u64) -> Self {
        let depth = sane(depth);
        TokenBucket {
            rate: sane(rate),
            depth,
            tokens: depth,
            last_us: now_us,
        }
    }

    fn refill(&mut self, now_us: u64) {
        // A clock going backwards is ignored (no refill, no rewind).
        if now_us > self.last_us {
            let dt = (now_us - self.last_us) as f64 / 1e6;
            self.tokens = (self.tokens + self.rate * dt).min(self.depth);
            self.last_us = now_us;
        }
    }

    /// Changes rate and depth; tokens earned so far at the old rate are kept (up to
    /// the new depth).
    pub fn set_rate(&mut self, rate: f64, depth: f64, now_us: u64) {
        self.refill(now_us);
        self.rate = sane(rate);
        self.depth = sane(depth);
        self.tokens = self.tokens.min(self.depth);
    }

    /// Takes `cost` tokens if available.
    pub fn try_take(&mut self, cost: f64, now_us: u64) -> bool {
        self.refill(now_us);
        if self.tokens >= cost {
            self.tokens -= cost;
            true
        } else {
            false
        }
    }

    pub fn rate(&self) -> f64 {
        self.rate
    }

    pub fn depth(&self) -> f64 {
        self.depth
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_rate_over_time_and_depth_at_once() {
        let (rate, depth) = (1000.0, 20.0);
        let mut b = TokenBucket::new(rate, depth, 0);
        let burst = (0..1000).filter(|_| b.try_take(1.0, 0)).count();
        assert_eq!(burst as f64, depth);
        let mut n = 0usize;
        let secs = 10u64;
        for step in 1..=secs * 100_000 {
            if b.try_take(1.0, step * 10) {
                n += 1;
            }
        }
        let want = rate * secs as f64;
        assert!((n as f64 - want).abs() <= 0.02 * want, "{n} vs {want}");
    }

    #[test]
    fn set_rate_applies_and_clamps() {
        let mut b = TokenBucket::new(100.0, 50.0, 0);
        b.set_rate(10.0, 5.0, 0);
        let burst = (0..100).filter(|_| b.try_take(1.0, 0)).count();
        assert_eq!(burst, 5);
        // one second at 10/s, depth 5
        let n = (0..100).filter(|_| b.try_take(1.0, 1_000_000)).count();
        assert_eq!(n, 5);
        let mut z = TokenBucket::new(f64::NAN, -3.0, 0);
        assert!(!z.try_take(1.0, 5_000_000));
        assert!(!b.try_take(1.0, 10)); // clock went backwards: nothing new
    }
}
