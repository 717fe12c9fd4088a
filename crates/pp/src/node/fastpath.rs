//! The XDP fast path (`starfabric pp --offload`): the XDP fast path's policy, run from the PP node's loop.
//!
//! The pipeline detects elephants (Zeta's one read/write window count); between batches
//! [`FastPath::poll`] hands them to `xdp::Offloader`, which installs their rules in the
//! XDP program attached to the node's interface, folds the driver's counters back into
//! the flows' stats, takes idle flows back to userspace, and follows rule updates and
//! FM revocations into the map. See docs/xdp.md.

use std::time::{Duration, Instant};

use pipeline::{ElephantPolicy, Pipeline};
use xdp::{monotonic_now, OffloadPolicy, OffloadStats, Offloader, XdpProgram};

/// The fast path's settings.
#[derive(Debug, Clone)]
pub struct OffloadConfig {
    /// Run elephant flows' rules in the XDP program on the node's interface. Needs the
    /// program attached, which the AF_XDP backend does.
    pub offload: bool,
    /// Elephant detection window (ms).
    pub offload_window_ms: u32,
    /// Bytes within one window that make a flow an elephant.
    pub offload_bytes: u64,
    /// Packets within one window that make a flow an elephant.
    pub offload_packets: u32,
    /// An offloaded flow idle this long (ms) in the driver goes back to userspace.
    pub offload_idle_ms: u64,
}

impl Default for OffloadConfig {
    fn default() -> Self {
        OffloadConfig {
            offload: false,
            offload_window_ms: 100,
            offload_bytes: 125_000,
            offload_packets: 1_000,
            offload_idle_ms: 2_000,
        }
    }
}

impl OffloadConfig {
    /// The pipeline's elephant detection, when offload is on.
    pub fn elephant(&self) -> Option<ElephantPolicy> {
        self.offload.then_some(ElephantPolicy {
            window_ms: self.offload_window_ms.max(1),
            bytes: self.offload_bytes.max(1),
            packets: self.offload_packets.max(1),
        })
    }

    fn policy(&self) -> OffloadPolicy {
        OffloadPolicy {
            idle: Duration::from_millis(self.offload_idle_ms.max(1)),
            ..OffloadPolicy::default()
        }
    }
}

/// The fast path of one PP worker.
#[derive(Debug)]
pub struct FastPath {
    off: Offloader,
    errors: u64,
    next_warn: Instant,
}

impl FastPath {
    pub fn new(args: &OffloadConfig) -> Self {
        FastPath {
            off: Offloader::new(args.policy()),
            errors: 0,
            next_warn: Instant::now(),
        }
    }

    /// Take new elephants and rule changes; sweep when due. Map errors are counted and
    /// logged (at most once a second): the flows stay on the userspace path.
    pub fn poll(&mut self, prog: &mut XdpProgram, p: &mut Pipeline, now_ms: u32) {
        if let Err(e) = self.off.poll(prog, p, now_ms, monotonic_now()) {
            self.errors += 1;
            let now = Instant::now();
            if now >= self.next_warn {
                self.next_warn = now + Duration::from_secs(1);
                tracing::warn!(error = %e, errors = self.errors, "XDP fast path");
            }
        }
    }

    /// Take every flow back to userspace, folding its counters (at shutdown).
    pub fn flush(&mut self, prog: &mut XdpProgram, p: &mut Pipeline, now_ms: u32) {
        if let Err(e) = self.off.flush(prog, p, now_ms) {
            tracing::warn!(error = %e, "XDP fast path flush");
        }
    }

    pub fn stats(&self) -> OffloadStats {
        self.off.stats()
    }

    /// ` xdp: offloaded=.. active=.. expired=..`, for the PP stats line.
    pub fn summary(&self) -> String {
        let o = self.stats();
        format!(
            " xdp: offloaded={} active={} expired={} removed={} replaced={} not_offloadable={} full={} map_errors={} errors={}",
            o.offloaded,
            o.active,
            o.expired,
            o.removed,
            o.replaced,
            o.not_offloadable,
            o.full,
            o.map_errors,
            self.errors
        )
    }
}
