//! The receiver's anti-replay window (RFC 4303 §3.4.3), with extended sequence numbers
//! inferred as RFC 4303 Appendix A2 says.
//!
//! The window is a ring of bits, one per sequence number in `[top - size + 1, top]`
//! (RFC 6479's layout: the bit of sequence number `s` is bit `s mod size`), so sliding
//! it forward clears the words it passes instead of shifting the whole bitmap.
//!
//! The check is split in two, as §3.4.3 orders it: [`ReplayWindow::check`] before the
//! ICV is verified (a duplicate or too-old packet costs no decryption), and
//! [`ReplayWindow::accept`] after, so a forged packet can never move the window.

/// The smallest and largest window the gateway takes, in packets.
pub const MIN_WINDOW: u32 = 64;
pub const MAX_WINDOW: u32 = 4096;

/// Why a sequence number is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayError {
    /// Already received within the window.
    Duplicate,
    /// Left of the window (or zero, which no sender ever sends).
    TooOld,
}

#[derive(Debug, Clone)]
pub struct ReplayWindow {
    /// Bits, a multiple of 64.
    size: u32,
    /// The highest sequence number authenticated so far (full 64 bits); 0: none yet.
    top: u64,
    bits: Vec<u64>,
}

impl ReplayWindow {
    /// A window of `size` packets, rounded up to a multiple of 64 and clamped to
    /// [`MIN_WINDOW`]..=[`MAX_WINDOW`].
    pub fn new(size: u32) -> Self {
        let size = size.clamp(MIN_WINDOW, MAX_WINDOW).div_ceil(64) * 64;
        ReplayWindow {
            size,
            top: 0,
            bits: vec![0; (size / 64) as usize],
        }
    }

    pub fn size(&self) -> u32 {
        self.size
    }

    /// The highest sequence number accepted so far.
    pub fn top(&self) -> u64 {
        self.top
    }

    /// The full sequence number a packet carrying `seq_lo` stands for. Without ESN that
    /// is `seq_lo`; with ESN the high half is inferred from the window (Appendix A2.2):
    /// the candidate in the window's subspace, or the next subspace when `seq_lo` is
    /// left of the window's bottom there. `None`: the inference lands before sequence
    /// number 0 (necessarily too old).
    pub fn infer(&self, seq_lo: u32, esn: bool) -> Option<u64> {
        if !esn {
            return Some(u64::from(seq_lo));
        }
        let w = u64::from(self.size);
        let tl = self.top as u32;
        let th = self.top >> 32;
        let bl = tl.wrapping_sub(self.size - 1);
        let hi = if u64::from(tl) >= w - 1 {
            // Case A: the window lies within one subspace.
            if seq_lo >= bl {
                th
            } else {
                th + 1
            }
        } else if seq_lo >= bl {
            // Case B: the window spans two subspaces; seq_lo is in the lower one.
            th.checked_sub(1)?
        } else {
            th
        };
        Some((hi << 32) | u64::from(seq_lo))
    }

    #[inline]
    fn bit(&self, seq: u64) -> (usize, u64) {
        let i = seq % u64::from(self.size);
        ((i / 64) as usize, 1u64 << (i % 64))
    }

    /// Whether `seq` (full) may be accepted: new, or in the window and not seen.
    pub fn check(&self, seq: u64) -> Result<(), ReplayError> {
        if seq == 0 {
            return Err(ReplayError::TooOld);
        }
        if seq > self.top {
            return Ok(());
        }
        if self.top - seq >= u64::from(self.size) {
            return Err(ReplayError::TooOld);
        }
        let (w, m) = self.bit(seq);
        if self.bits[w] & m != 0 {
            Err(ReplayError::Duplicate)
        } else {
            Ok(())
        }
    }

    /// Record `seq` (full) as received, after its ICV verified. Checks again, so a
    /// duplicate that raced in between (two copies in one batch) is refused here.
    pub fn accept(&mut self, seq: u64) -> Result<(), ReplayError> {
        self.check(seq)?;
        if seq > self.top {
            let ahead = seq - self.top;
            if ahead >= u64::from(self.size) {
                self.bits.fill(0);
            } else {
                // Clear the bits of the numbers the window slides over, a word at a time
                // where whole words pass.
                let mut s = self.top + 1;
                while s < seq {
                    let (w, m) = self.bit(s);
                    if m == 1 && seq - s >= 64 {
                        self.bits[w] = 0;
                        s += 64;
                    } else {
                        self.bits[w] &= !m;
                        s += 1;
                    }
                }
            }
            self.top = seq;
        }
        let (w, m) = self.bit(seq);
        self.bits[w] |= m;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acc(w: &mut ReplayWindow, s: u64) -> Result<(), ReplayError> {
        w.check(s)?;
        w.accept(s)
    }

    #[test]
    fn in_order_then_duplicates() {
        let mut w = ReplayWindow::new(64);
        for s in 1..=200 {
            assert_eq!(acc(&mut w, s), Ok(()), "{s}");
        }
        assert_eq!(w.check(200), Err(ReplayError::Duplicate));
        assert_eq!(w.check(137), Err(ReplayError::Duplicate));
        // 200 - 64 = 136 is the first number left of the window.
        assert_eq!(w.check(136), Err(ReplayError::TooOld));
        assert_eq!(w.check(0), Err(ReplayError::TooOld));
        assert_eq!(w.check(201), Ok(()));
    }

    #[test]
    fn out_of_order_within_the_window_is_accepted_once() {
        let mut w = ReplayWindow::new(64);
        assert_eq!(acc(&mut w, 100), Ok(()));
        // The window's left edge: 100 - 63 = 37 is in it, 36 is not.
        assert_eq!(acc(&mut w, 37), Ok(()));
        assert_eq!(acc(&mut w, 37), Err(ReplayError::Duplicate));
        assert_eq!(acc(&mut w, 36), Err(ReplayError::TooOld));
        for s in 38..100 {
            assert_eq!(acc(&mut w, s), Ok(()), "{s}");
        }
        assert_eq!(acc(&mut w, 99), Err(ReplayError::Duplicate));
    }

    #[test]
    fn a_jump_past_the_window_clears_it() {
        let mut w = ReplayWindow::new(128);
        for s in 1..=128 {
            acc(&mut w, s).unwrap();
        }
        assert_eq!(acc(&mut w, 128 + 1000), Ok(()));
        // Numbers just left of the new top were never received: accepted once.
        assert_eq!(acc(&mut w, 1128 - 127), Ok(()));
        assert_eq!(acc(&mut w, 1128 - 127), Err(ReplayError::Duplicate));
        assert_eq!(acc(&mut w, 1128 - 128), Err(ReplayError::TooOld));
    }

    #[test]
    fn sliding_by_less_than_a_window_clears_exactly_the_passed_bits() {
        for size in [64, 128, 1024] {
            let mut w = ReplayWindow::new(size);
            let mut seen = std::collections::BTreeSet::new();
            // A deterministic mix of jumps and stragglers.
            let mut top = 0u64;
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            for _ in 0..20_000 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let s = if x % 3 == 0 {
                    top + 1 + x % (u64::from(size) + 10)
                } else {
                    top.saturating_sub(x % (u64::from(size) + 10))
                };
                let want = if s == 0 || (top >= u64::from(size) && s <= top - u64::from(size)) {
                    Err(ReplayError::TooOld)
                } else if seen.contains(&s) {
                    Err(ReplayError::Duplicate)
                } else {
                    Ok(())
                };
                assert_eq!(acc(&mut w, s), want, "size {size} seq {s} top {top}");
                if want.is_ok() {
                    seen.insert(s);
                    top = top.max(s);
                }
            }
        }
    }

    #[test]
    fn a_failed_check_is_not_recorded() {
        let mut w = ReplayWindow::new(64);
        acc(&mut w, 10).unwrap();
        // check alone (the ICV then failed) leaves 11 free.
        assert_eq!(w.check(11), Ok(()));
        assert_eq!(w.top(), 10);
        assert_eq!(acc(&mut w, 11), Ok(()));
    }

    #[test]
    fn window_sizes_are_rounded_and_clamped() {
        assert_eq!(ReplayWindow::new(0).size(), 64);
        assert_eq!(ReplayWindow::new(65).size(), 128);
        assert_eq!(ReplayWindow::new(1 << 20).size(), MAX_WINDOW);
    }

    #[test]
    fn esn_infers_the_high_half_across_the_32_bit_boundary() {
        let mut w = ReplayWindow::new(64);
        // Case A, top deep in subspace 0.
        acc(&mut w, 0xffff_fff0).unwrap();
        assert_eq!(w.infer(0xffff_fff5, true), Some(0xffff_fff5));
        // A low number is the next subspace.
        assert_eq!(w.infer(3, true), Some((1 << 32) | 3));
        acc(&mut w, (1 << 32) | 3).unwrap();
        // Case B: the window spans both subspaces now.
        assert_eq!(w.infer(0xffff_fff8, true), Some(0xffff_fff8));
        assert_eq!(w.check(0xffff_fff8), Ok(()));
        assert_eq!(w.check(0xffff_fff0), Err(ReplayError::Duplicate));
        assert_eq!(w.infer(2, true), Some((1 << 32) | 2));
        // Without ESN the same low number means itself (and is too old).
        assert_eq!(w.infer(2, false), Some(2));
        assert_eq!(w.check(2), Err(ReplayError::TooOld));
        // Before anything: subspace 0, and a number that would be before 0 is None.
        let w = ReplayWindow::new(64);
        assert_eq!(w.infer(5, true), Some(5));
        assert_eq!(w.infer(0xffff_ffff, true), None);
    }
}
