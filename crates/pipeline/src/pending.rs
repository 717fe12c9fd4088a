//! The miss path's holding area: packets of flows whose rule is outstanding.
//!
//! A preallocated pool of frame slots (the global cap) and, per flow, a FIFO linked
//! through the pool with its own cap. Packets are copied in, so the backend frame is
//! recycled at once; they are released in arrival order when the rule comes back, or
//! dropped and counted when it does not come back in time.

use std::collections::VecDeque;

use hashbrown::HashTable;

use crate::io::{Desc, FRAME_SIZE, HEADROOM};
use crate::key::FlowKey;
use crate::stats::DropReason;
use crate::table::age;

/// Limits of the pending area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PendingConfig {
    /// Packets held per flow.
    pub per_flow: u16,
    /// Packets held in all (the pool size).
    pub global: usize,
    /// How long a flow waits for its rule before its packets are dropped.
    pub timeout_ms: u32,
}

impl Default for PendingConfig {
    fn default() -> Self {
        PendingConfig {
            per_flow: 16,
            global: 8192,
            timeout_ms: 500,
        }
    }
}

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct PendingFlow {
    key: FlowKey,
    hash: u64,
    head: u32,
    tail: u32,
    count: u16,
    since: u32,
    /// When the first packet was held, in the pipeline's µs time: the start of the
    /// flow's rule setup latency.
    since_us: u64,
    requested: bool,
    /// The flow's first held packet went with its rule request (see
    /// [`PendingQueue::mark_head_sent`]).
    head_sent: bool,
}

/// Result of holding a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held {
    /// No request has gone out for this flow yet (first packet, or an earlier send
    /// found the channel full).
    pub needs_request: bool,
}

pub struct PendingQueue {
    cfg: PendingConfig,
    region: Vec<u8>,
    lens: Vec<u16>,
    ports: Vec<u16>,
    next: Vec<u32>,
    free: Vec<u32>,
    flows: HashTable<PendingFlow>,
    /// Flows in arrival order, for timeouts: (key, hash, since).
    order: VecDeque<(FlowKey, u64, u32)>,
    held: usize,
    /// Packets dropped by timeout, and per-flow/global overflow, kept here so the
    /// pipeline can fold them into its counters.
    pub timed_out: u64,
}

impl PendingQueue {
    pub fn new(cfg: PendingConfig) -> Self {
        let n = cfg.global;
        PendingQueue {
            cfg,
            region: vec![0u8; n * FRAME_SIZE],
            lens: vec![0; n],
            ports: vec![0; n],
            next: vec![NIL; n],
            free: (0..n as u32).rev().collect(),
            flows: HashTable::with_capacity(n),
            order: VecDeque::with_capacity(n),
            held: 0,
            timed_out: 0,
        }
    }

    pub fn config(&self) -> &PendingConfig {
        &self.cfg
    }

    /// Packets currently held.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Flows currently waiting for a rule.
    pub fn flows(&self) -> usize {
        self.flows.len()
    }

    pub fn is_pending(&self, key: &FlowKey, hash: u64) -> bool {
        self.flows.find(hash, |f| f.key == *key).is_some()
    }

    /// Copy `data` into the pool behind the flow's earlier packets. `now` (ms) drives the
    /// timeout; `now_us` only stamps a new flow for latency measurement.
    pub fn hold(
        &mut self,
        key: &FlowKey,
        hash: u64,
        data: &[u8],
        port: u16,
        now: u32,
        now_us: u64,
    ) -> Result<Held, DropReason> {
        if data.len() > FRAME_SIZE - HEADROOM {
            return Err(DropReason::BadHeader);
        }
        let existing = self.flows.find(hash, |f| f.key == *key).map(|f| f.count);
        if existing.is_some_and(|c| c >= self.cfg.per_flow) {
            return Err(DropReason::PendingFlowFull);
        }
        let slot = self.free.pop().ok_or(DropReason::PendingGlobalFull)?;
        let base = slot as usize * FRAME_SIZE + HEADROOM;
        self.region[base..base + data.len()].copy_from_slice(data);
        self.lens[slot as usize] = data.len() as u16;
        self.ports[slot as usize] = port;
        self.next[slot as usize] = NIL;
        self.held += 1;
        match self.flows.find_mut(hash, |f| f.key == *key) {
            Some(f) => {
                self.next[f.tail as usize] = slot;
                f.tail = slot;
                f.count += 1;
                Ok(Held {
                    needs_request: !f.requested,
                })
            }
            None => {
                self.flows.insert_unique(
                    hash,
                    PendingFlow {
                        key: *key,
                        hash,
                        head: slot,
                        tail: slot,
                        count: 1,
                        since: now,
                        since_us: now_us,
                        requested: false,
                        head_sent: false,
                    },
                    |f| f.hash,
                );
                self.order.push_back((*key, hash, now));
                Ok(Held {
                    needs_request: true,
                })
            }
        }
    }

    /// Record that the flow's rule request went out.
    pub fn mark_requested(&mut self, key: &FlowKey, hash: u64) {
        if let Some(f) = self.flows.find_mut(hash, |f| f.key == *key) {
            f.requested = true;
        }
    }

    /// Record that the flow's first held packet travelled with its rule request: if FM
    /// carries it to the next-hop node, the release leaves it out.
    pub fn mark_head_sent(&mut self, key: &FlowKey, hash: u64) {
        if let Some(f) = self.flows.find_mut(hash, |f| f.key == *key) {
            f.head_sent = true;
        }
    }

    /// Whether the flow's first held packet travelled with its rule request.
    pub fn head_sent(&self, key: &FlowKey, hash: u64) -> bool {
        self.flows
            .find(hash, |f| f.key == *key)
            .is_some_and(|f| f.head_sent)
    }

    /// When the flow's first held packet arrived (µs), if the flow is pending.
    pub fn held_since_us(&self, key: &FlowKey, hash: u64) -> Option<u64> {
        self.flows.find(hash, |f| f.key == *key).map(|f| f.since_us)
    }

    /// Detach a flow's held packets, in arrival order, as descriptors into
    /// [`PendingQueue::region_mut`]. The slots stay allocated until [`PendingQueue::free`].
    pub fn take(&mut self, key: &FlowKey, hash: u64, out: &mut Vec<Desc>) -> usize {
        let Ok(e) = self.flows.find_entry(hash, |f| f.key == *key) else {
            return 0;
        };
        let (f, _) = e.remove();
        let mut s = f.head;
        let mut n = 0;
        while s != NIL {
            out.push(Desc::new(
                s as usize * FRAME_SIZE,
                HEADROOM,
                self.lens[s as usize] as usize,
                FRAME_SIZE,
                self.ports[s as usize],
            ));
            n += 1;
            s = self.next[s as usize];
        }
        n
    }

    /// Return the slots of descriptors handed out by [`PendingQueue::take`].
    pub fn free(&mut self, descs: &[Desc]) {
        for d in descs {
            self.free.push(d.base / FRAME_SIZE as u32);
            self.held -= 1;
        }
    }

    pub fn region_mut(&mut self) -> &mut [u8] {
        &mut self.region
    }

    /// The pool itself, for lending it to the pipeline while held packets run.
    pub(crate) fn region_mut_vec(&mut self) -> &mut Vec<u8> {
        &mut self.region
    }

    /// Drop flows that waited longer than the timeout. Returns packets dropped; the
    /// dropped flows' keys are appended to `expired` with their packet counts, so their
    /// requests can be forgotten and the drops attributed to tenants.
    pub fn expire(&mut self, now: u32, expired: &mut Vec<(FlowKey, u16)>) -> u64 {
        let mut dropped = 0;
        while let Some(&(key, hash, since)) = self.order.front() {
            if age(now, since) <= self.cfg.timeout_ms {
                break;
            }
            self.order.pop_front();
            // The flow may have been released (and even re-pended later, with a newer
            // `since`, which has its own place in `order`).
            let Ok(e) = self
                .flows
                .find_entry(hash, |f| f.key == key && f.since == since)
            else {
                continue;
            };
            let (f, _) = e.remove();
            let mut s = f.head;
            while s != NIL {
                self.free.push(s);
                self.held -= 1;
                dropped += 1;
                s = self.next[s as usize];
            }
            expired.push((key, f.count));
        }
        self.timed_out += dropped;
        dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u16) -> FlowKey {
        FlowKey::new(
            1,
            17,
            "198.18.0.1".parse().unwrap(),
            i,
            "198.19.0.1".parse().unwrap(),
            53,
        )
    }

    #[test]
    fn holds_in_order_and_releases() {
        let mut q = PendingQueue::new(PendingConfig {
            per_flow: 4,
            global: 8,
            timeout_ms: 100,
        });
        let k = key(1);
        let h = k.hash();
        assert!(q.hold(&k, h, &[1], 0, 0, 0).unwrap().needs_request);
        q.mark_requested(&k, h);
        assert!(!q.hold(&k, h, &[2], 0, 0, 0).unwrap().needs_request);
        q.hold(&k, h, &[3], 0, 0, 0).unwrap();
        q.hold(&k, h, &[4], 0, 0, 0).unwrap();
        assert_eq!(
            q.hold(&k, h, &[5], 0, 0, 0),
            Err(DropReason::PendingFlowFull)
        );
        let mut out = Vec::new();
        assert_eq!(q.take(&k, h, &mut out), 4);
        let region = q.region_mut().to_vec();
        let got: Vec<u8> = out.iter().map(|d| d.data(&region)[0]).collect();
        assert_eq!(got, vec![1, 2, 3, 4]);
        assert_eq!(q.held(), 4);
        q.free(&out);
        assert_eq!(q.held(), 0);
    }

    #[test]
    fn global_cap_and_timeout() {
        let mut q = PendingQueue::new(PendingConfig {
            per_flow: 4,
            global: 3,
            timeout_ms: 100,
        });
        for i in 0..3 {
            let k = key(i);
            q.hold(&k, k.hash(), &[0], 0, 10, 0).unwrap();
        }
        let k = key(9);
        assert_eq!(
            q.hold(&k, k.hash(), &[0], 0, 10, 0),
            Err(DropReason::PendingGlobalFull)
        );
        let mut expired = Vec::new();
        assert_eq!(q.expire(50, &mut expired), 0);
        assert_eq!(q.expire(111, &mut expired), 3);
        assert_eq!(expired.len(), 3);
        assert_eq!(q.held(), 0);
        assert_eq!(q.flows(), 0);
        assert!(q.hold(&k, k.hash(), &[0], 0, 120, 0).is_ok());
    }
}
