//! What the platform hands an NF besides the packet: time and randomness, both supplied
//! by the request so that every replica of an SC group computes the same answer.

/// SplitMix64: tiny, fast, and identical everywhere. Seeded per request from the group's
/// sequence number, so a replica replaying the request draws the same numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DetRng(u64);

impl DetRng {
    pub fn new(seed: u64) -> Self {
        DetRng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0), by multiply-shift.
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// Serpens `trigger(table, key)` (paper 004 Fig. 8): an NF asks the platform for an
/// `update` of one entry of one of its shared-write tables, on demand (a NAT that ran out
/// of ports), rather than waiting for its timer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trigger {
    pub table: String,
    pub key: u64,
}

/// Environment of one NF invocation.
#[derive(Debug)]
pub struct NfEnv {
    /// Milliseconds on the group's clock, stamped into the request by the head replica.
    pub now_ms: u64,
    pub rng: DetRng,
    /// Updates asked for during this invocation ([`NfEnv::trigger`]); the chain takes
    /// them and the platform answers each with the NF's `update` after the op.
    pub(crate) triggers: Vec<Trigger>,
}

impl NfEnv {
    pub fn new(now_ms: u64, seed: u64) -> Self {
        NfEnv {
            now_ms,
            rng: DetRng::new(seed),
            triggers: Vec::new(),
        }
    }

    /// Ask for `NetworkFunction::update(table, key)` once the current op is done
    /// (Serpens `trigger`). Non-blocking: the handler goes on at once and sees the
    /// update's effect from its next invocation.
    pub fn trigger(&mut self, table: &str, key: u64) {
        self.triggers.push(Trigger {
            table: table.to_string(),
            key,
        });
    }
}
