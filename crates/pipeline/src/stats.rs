//! Per-worker counters. Plain integers: each worker owns its own, and a snapshot is
//! copied out between batches.

use ipsec::EspDrop;
use packet::ParseError;

/// Why the pipeline dropped a packet. Every drop is counted under one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// A header was cut short.
    Truncated,
    /// A header field was invalid.
    BadHeader,
    /// An IPv6 packet carried an IPv4-mapped address.
    V4Mapped,
    /// Not IPv4/IPv6 (ARP, other EtherTypes): the host stack's business, not PP's.
    NotIp,
    /// A later IP fragment: no ports to match on.
    Fragment,
    /// The VNI is bound to no tenant.
    UnknownVni,
    /// Missed, and this worker has no rule source.
    NoRule,
    /// The rule said drop; the reason is the rule's.
    Rule(u8),
    /// The `police` action's per-tenant rate manager refused the packet (paper 000 §7.2).
    Police,
    /// A new flow over its tenant's rule-request rate (paper 000 §7.2): its first
    /// packet is dropped without a rule request.
    RateLimited,
    /// The flow's pending queue was full while its rule was outstanding.
    PendingFlowFull,
    /// The global pending budget was exhausted.
    PendingGlobalFull,
    /// The rule did not arrive within the pending timeout.
    PendingTimeout,
    /// The rule source answered with an error.
    RuleError,
    /// The rewrite did not fit the packet (address family).
    RewriteFailed,
    /// Not enough headroom to push an encap header.
    NoHeadroom,
    /// The IPsec gateway refused an ESP packet or a packet for a tunnel
    /// (docs/ipsec.md): `esp-<reason>`.
    Esp(EspDrop),
}

impl DropReason {
    pub const FIXED: [DropReason; 24] = [
        DropReason::Truncated,
        DropReason::BadHeader,
        DropReason::V4Mapped,
        DropReason::NotIp,
        DropReason::Fragment,
        DropReason::UnknownVni,
        DropReason::NoRule,
        DropReason::Police,
        DropReason::RateLimited,
        DropReason::PendingFlowFull,
        DropReason::PendingGlobalFull,
        DropReason::PendingTimeout,
        DropReason::RuleError,
        DropReason::RewriteFailed,
        DropReason::NoHeadroom,
        DropReason::Esp(EspDrop::Truncated),
        DropReason::Esp(EspDrop::UnknownSpi),
        DropReason::Esp(EspDrop::Replay),
        DropReason::Esp(EspDrop::Auth),
        DropReason::Esp(EspDrop::BadTrailer),
        DropReason::Esp(EspDrop::Policy),
        DropReason::Esp(EspDrop::TooBig),
        DropReason::Esp(EspDrop::SeqExhausted),
        DropReason::Esp(EspDrop::Fragment),
    ];

    /// Stable name for counters and the golden corpus (`rule:<name>` for rule drops is
    /// built by the caller, which knows the rule's reason table).
    pub fn name(&self) -> &'static str {
        match self {
            DropReason::Truncated => "truncated",
            DropReason::BadHeader => "bad-header",
            DropReason::V4Mapped => "v4-mapped",
            DropReason::NotIp => "not-ip",
            DropReason::Fragment => "fragment",
            DropReason::UnknownVni => "unknown-vni",
            DropReason::NoRule => "no-rule",
            DropReason::Rule(_) => "rule",
            // Both are traffic over a tenant's rate; the suffix says which rate.
            DropReason::Police => "rate-limited-packets",
            DropReason::RateLimited => "rate-limited",
            DropReason::PendingFlowFull => "pending-flow-full",
            DropReason::PendingGlobalFull => "pending-global-full",
            DropReason::PendingTimeout => "pending-timeout",
            DropReason::RuleError => "rule-error",
            DropReason::RewriteFailed => "rewrite-failed",
            DropReason::NoHeadroom => "no-headroom",
            DropReason::Esp(e) => e.name(),
        }
    }

    fn slot(&self) -> usize {
        match self {
            DropReason::Rule(_) => usize::MAX,
            d => DropReason::FIXED.iter().position(|x| x == d).unwrap_or(0),
        }
    }
}

impl From<ParseError> for DropReason {
    fn from(e: ParseError) -> Self {
        match e {
            ParseError::Truncated(_) => DropReason::Truncated,
            ParseError::BadHeader { .. } => DropReason::BadHeader,
            ParseError::V4MappedAddress => DropReason::V4Mapped,
        }
    }
}

/// Counters of one worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    /// Drops by fixed reason, indexed like [`DropReason::FIXED`].
    pub drops: [u64; DropReason::FIXED.len()],
    /// Drops by rule reason, indexed like `RuleContext::reasons`.
    pub rule_drops: Vec<u64>,
    pub rule_requests: u64,
    /// Requests that found the request channel full (retried by the next packet).
    pub request_channel_full: u64,
    pub rules_installed: u64,
    pub rules_replaced: u64,
    /// Installed rules removed because FM withdrew them.
    pub rules_revoked: u64,
    pub rule_compile_errors: u64,
    /// Packets released from pending queues after their rule arrived.
    pub pending_released: u64,
    /// The fabric's first packet through FM (docs/fabric.md). At the ingress node:
    /// flows whose first packet FM carried to the next-hop node, so it was not released
    /// here. At the next-hop node: packets FM handed over, run through this pipeline.
    pub fabric_first_via_fm: u64,
    pub fabric_injected: u64,
    pub evicted_table_full: u64,
    pub expired: u64,
    pub offload_marked: u64,
    /// Flows that crossed the elephant threshold and were handed to the fast path.
    pub elephants: u64,
    /// Packets and bytes the fast path handled for this pipeline's flows, folded back
    /// into the rules' and tenants' counters.
    pub fastpath_packets: u64,
    pub fastpath_bytes: u64,
    /// Flow notices queued for SC; dropped because the queue was full; not reported
    /// because the flow's VNI has no tenant binding any more.
    pub notices: u64,
    pub notices_dropped: u64,
    pub notices_unbound: u64,
    /// Counter reports queued for SC (the monitor NF's packet and byte counts).
    pub counter_reports: u64,
    /// Last counts of rules that left the table, dropped because the report queue was
    /// full (the only counts the report path loses).
    pub counter_reports_dropped: u64,
    /// Report passes paused by a full queue (they resume with the counters intact).
    pub counter_report_queue_full: u64,
    /// Rule setup latency: from a flow's first packet being held to its rule being
    /// installed (one observation per flow set up through the miss path).
    pub setup_latency: LatencyHistogram,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            rx_packets: 0,
            rx_bytes: 0,
            tx_packets: 0,
            tx_bytes: 0,
            hits: 0,
            misses: 0,
            drops: [0; DropReason::FIXED.len()],
            rule_drops: vec![0; 256],
            rule_requests: 0,
            request_channel_full: 0,
            rules_installed: 0,
            rules_replaced: 0,
            rules_revoked: 0,
            rule_compile_errors: 0,
            pending_released: 0,
            fabric_first_via_fm: 0,
            fabric_injected: 0,
            evicted_table_full: 0,
            expired: 0,
            offload_marked: 0,
            elephants: 0,
            fastpath_packets: 0,
            fastpath_bytes: 0,
            notices: 0,
            notices_dropped: 0,
            notices_unbound: 0,
            counter_reports: 0,
            counter_reports_dropped: 0,
            counter_report_queue_full: 0,
            setup_latency: LatencyHistogram::default(),
        }
    }
}

impl Stats {
    #[inline]
    pub fn drop(&mut self, r: DropReason) {
        match r {
            DropReason::Rule(i) => self.rule_drops[i as usize] += 1,
            d => self.drops[d.slot()] += 1,
        }
    }

    pub fn dropped(&self, r: DropReason) -> u64 {
        match r {
            DropReason::Rule(i) => self.rule_drops[i as usize],
            d => self.drops[d.slot()],
        }
    }

    pub fn total_drops(&self) -> u64 {
        self.drops.iter().sum::<u64>() + self.rule_drops.iter().sum::<u64>()
    }

    /// Fold another worker's counters into these.
    pub fn merge(&mut self, o: &Stats) {
        self.rx_packets += o.rx_packets;
        self.rx_bytes += o.rx_bytes;
        self.tx_packets += o.tx_packets;
        self.tx_bytes += o.tx_bytes;
        self.hits += o.hits;
        self.misses += o.misses;
        for (a, b) in self.drops.iter_mut().zip(o.drops.iter()) {
            *a += b;
        }
        for (a, b) in self.rule_drops.iter_mut().zip(o.rule_drops.iter()) {
            *a += b;
        }
        self.rule_requests += o.rule_requests;
        self.request_channel_full += o.request_channel_full;
        self.rules_installed += o.rules_installed;
        self.rules_replaced += o.rules_replaced;
        self.rules_revoked += o.rules_revoked;
        self.rule_compile_errors += o.rule_compile_errors;
        self.pending_released += o.pending_released;
        self.fabric_first_via_fm += o.fabric_first_via_fm;
        self.fabric_injected += o.fabric_injected;
        self.evicted_table_full += o.evicted_table_full;
        self.expired += o.expired;
        self.offload_marked += o.offload_marked;
        self.elephants += o.elephants;
        self.notices += o.notices;
        self.notices_dropped += o.notices_dropped;
        self.notices_unbound += o.notices_unbound;
        self.fastpath_packets += o.fastpath_packets;
        self.fastpath_bytes += o.fastpath_bytes;
        self.setup_latency.merge(&o.setup_latency);
    }
}

/// Upper bounds (inclusive, µs) of [`LatencyHistogram`]'s buckets: 1-2.5-5 steps from
/// 50 µs to 5 s. Fixed, so observing is a short scan of a constant table and merging or
/// exporting needs no agreement between workers.
pub const LATENCY_BOUNDS_US: [u64; 16] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 5_000_000,
];

/// A fixed-bucket latency histogram in plain integers (one owner, no atomics), exported
/// as a Prometheus histogram from snapshots. `counts[i]` holds observations in
/// `(LATENCY_BOUNDS_US[i-1], LATENCY_BOUNDS_US[i]]`; the last slot is the overflow
/// (`+Inf`) bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LatencyHistogram {
    pub counts: [u64; LATENCY_BOUNDS_US.len() + 1],
    pub sum_us: u64,
    pub count: u64,
}

impl LatencyHistogram {
    /// Index of the bucket `us` falls in.
    #[inline]
    pub fn bucket(us: u64) -> usize {
        LATENCY_BOUNDS_US
            .iter()
            .position(|&b| us <= b)
            .unwrap_or(LATENCY_BOUNDS_US.len())
    }

    #[inline]
    pub fn observe_us(&mut self, us: u64) {
        self.counts[Self::bucket(us)] += 1;
        self.sum_us = self.sum_us.saturating_add(us);
        self.count += 1;
    }

    pub fn merge(&mut self, o: &LatencyHistogram) {
        for (a, b) in self.counts.iter_mut().zip(o.counts.iter()) {
            *a += b;
        }
        self.sum_us = self.sum_us.saturating_add(o.sum_us);
        self.count += o.count;
    }

    /// Buckets as (upper bound in seconds, count in that bucket alone), ending with the
    /// `+Inf` bucket: the shape exposition encoders take.
    pub fn buckets_seconds(&self) -> Vec<(f64, u64)> {
        LATENCY_BOUNDS_US
            .iter()
            .map(|&b| b as f64 / 1e6)
            .chain(std::iter::once(f64::INFINITY))
            .zip(self.counts.iter().copied())
            .collect()
    }

    pub fn sum_seconds(&self) -> f64 {
        self.sum_us as f64 / 1e6
    }
}

/// Counters of one tenant on one worker (see `Pipeline::tenants`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TenantCounters {
    /// Packets received on the tenant's VNIs that parsed far enough to have a flow key.
    pub packets: u64,
    /// Their bytes, as received (outer headers included).
    pub bytes: u64,
    /// Drops of the tenant's packets, any reason.
    pub drops: u64,
    /// Flows whose rule came back and released held packets.
    pub flows_setup: u64,
}

impl TenantCounters {
    pub fn merge(&mut self, o: &TenantCounters) {
        self.packets += o.packets;
        self.bytes += o.bytes;
        self.drops += o.drops;
        self.flows_setup += o.flows_setup;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_buckets_are_inclusive_upper_bounds() {
        assert_eq!(LatencyHistogram::bucket(0), 0);
        assert_eq!(LatencyHistogram::bucket(50), 0);
        assert_eq!(LatencyHistogram::bucket(51), 1);
        // 3 ms lies in (2.5 ms, 5 ms].
        assert_eq!(LATENCY_BOUNDS_US[LatencyHistogram::bucket(3_000)], 5_000);
        assert_eq!(LatencyHistogram::bucket(5_000_000), 15);
        assert_eq!(LatencyHistogram::bucket(5_000_001), 16);
        let mut h = LatencyHistogram::default();
        for us in [40, 3_000, 3_000, 9_999_999] {
            h.observe_us(us);
        }
        assert_eq!(h.count, 4);
        assert_eq!(h.sum_us, 40 + 6_000 + 9_999_999);
        let b = h.buckets_seconds();
        assert_eq!(b.len(), 17);
        assert_eq!(b[0], (50e-6, 1));
        assert_eq!(b[6], (5e-3, 2));
        assert_eq!(b[16], (f64::INFINITY, 1));
        assert_eq!(b.iter().map(|x| x.1).sum::<u64>(), h.count);
        let mut m = h;
        m.merge(&h);
        assert_eq!((m.count, m.counts[6]), (8, 4));
    }
}
