//! FM's event log: what changed in the platform and why, for operators
//! (`starfabric events`) and for tests that check what the autoscaler did.
//!
//! FM is where every scaling step, node death and repair is decided, so it keeps the log
//! itself; others (the autoscaler) append to it over `RecordEvent`, which puts their
//! decisions in one order with the scales they cause. The log is a bounded ring
//! (oldest events go first) with sequence numbers that only grow, so a poller asks for
//! "everything from `next_seq`" and can tell when it fell behind the ring
//! (`oldest_seq` > what it asked for). Optionally every event is also appended to a file
//! as one JSON line, which outlives the ring and the process.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use proto::v1;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::{info, warn};

use crate::FmError;

/// Events kept in memory by default.
pub const DEFAULT_CAPACITY: usize = 10_000;

/// What happened. The wire carries the snake_case name (`as_str`), so a newer FM's kinds
/// still show in an older CLI; add variants at will.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// st sent: a scale-out started.
    ScScaleOutStart,
    /// The scale-out finished: dispatch switched and the delta merged.
    ScScaleOutDone,
    ScScaleInStart,
    ScScaleInDone,
    /// A scale gave up before fin; dispatch is as it was.
    ScaleAborted,
    /// FM refused to start a scale (no spare nodes, nothing to merge, one under way).
    ScaleRefused,
    ScNodeJoined,
    ScNodeDead,
    /// FM formed an SC group for a chain.
    ScGroupCreated,
    /// A group lost a replica and FM re-linked it (with a spare, if one was live).
    ScGroupRepaired,
    /// A group lost its last live replica; it waits for that node to come back.
    ScGroupStalled,
    PpNodeJoined,
    PpNodeDead,
    /// A virtual IP moved between PP nodes.
    VipMoved,
    /// FM withdrew the fabric routes to a PP node that left, failed or drains; the
    /// flows get routes to live nodes on their next packet (docs/fabric.md).
    FabricRoutesWithdrawn,
    /// The autoscaler decided to scale (which target, which sample, which mark).
    AutoscaleDecision,
    /// The water marks said to scale but a bound (min/max) or the projection forbade it.
    AutoscaleRefused,
    /// The autoscaler's action failed (FM refused, no PP node provider, an RPC error).
    AutoscaleFailed,
    /// An autoscaler started or stopped watching.
    AutoscaleStarted,
    AutoscaleStopped,
}

impl EventKind {
    pub const ALL: &'static [EventKind] = &[
        EventKind::ScScaleOutStart,
        EventKind::ScScaleOutDone,
        EventKind::ScScaleInStart,
        EventKind::ScScaleInDone,
        EventKind::ScaleAborted,
        EventKind::ScaleRefused,
        EventKind::ScNodeJoined,
        EventKind::ScNodeDead,
        EventKind::ScGroupCreated,
        EventKind::ScGroupRepaired,
        EventKind::ScGroupStalled,
        EventKind::PpNodeJoined,
        EventKind::PpNodeDead,
        EventKind::VipMoved,
        EventKind::FabricRoutesWithdrawn,
        EventKind::AutoscaleDecision,
        EventKind::AutoscaleRefused,
        EventKind::AutoscaleFailed,
        EventKind::AutoscaleStarted,
        EventKind::AutoscaleStopped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::ScScaleOutStart => "sc_scale_out_start",
            EventKind::ScScaleOutDone => "sc_scale_out_done",
            EventKind::ScScaleInStart => "sc_scale_in_start",
            EventKind::ScScaleInDone => "sc_scale_in_done",
            EventKind::ScaleAborted => "scale_aborted",
            EventKind::ScaleRefused => "scale_refused",
            EventKind::ScNodeJoined => "sc_node_joined",
            EventKind::ScNodeDead => "sc_node_dead",
            EventKind::ScGroupCreated => "sc_group_created",
            EventKind::ScGroupRepaired => "sc_group_repaired",
            EventKind::ScGroupStalled => "sc_group_stalled",
            EventKind::PpNodeJoined => "pp_node_joined",
            EventKind::PpNodeDead => "pp_node_dead",
            EventKind::VipMoved => "vip_moved",
            EventKind::FabricRoutesWithdrawn => "fabric_routes_withdrawn",
            EventKind::AutoscaleDecision => "autoscale_decision",
            EventKind::AutoscaleRefused => "autoscale_refused",
            EventKind::AutoscaleFailed => "autoscale_failed",
            EventKind::AutoscaleStarted => "autoscale_started",
            EventKind::AutoscaleStopped => "autoscale_stopped",
        }
    }

    pub fn parse(s: &str) -> Option<EventKind> {
        EventKind::ALL.iter().copied().find(|k| k.as_str() == s)
    }

    /// Kinds others may append with `RecordEvent`. FM's own kinds are FM's word on what
    /// it did; a client must not be able to forge a "scale done".
    pub fn recordable(self) -> bool {
        matches!(
            self,
            EventKind::AutoscaleDecision
                | EventKind::AutoscaleRefused
                | EventKind::AutoscaleFailed
                | EventKind::AutoscaleStarted
                | EventKind::AutoscaleStopped
                | EventKind::VipMoved
        )
    }
}

impl std::fmt::Display for EventKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub seq: u64,
    pub unix_ms: u64,
    pub kind: EventKind,
    pub message: String,
    /// A JSON object (or null) with the event's fields.
    pub detail: Value,
}

impl Event {
    pub fn to_proto(&self) -> v1::FmEvent {
        v1::FmEvent {
            seq: self.seq,
            unix_ms: self.unix_ms,
            kind: self.kind.as_str().to_string(),
            message: self.message.clone(),
            detail_json: if self.detail.is_null() {
                String::new()
            } else {
                self.detail.to_string()
            },
        }
    }
}

pub fn unix_ms_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// The ring, and the optional JSON-lines file.
#[derive(Debug)]
pub struct EventLog {
    ring: VecDeque<Event>,
    capacity: usize,
    next_seq: u64,
    file: Option<File>,
    /// Writes to the file that failed (the ring still has the events).
    pub file_errors: u64,
}

impl Default for EventLog {
    fn default() -> Self {
        EventLog::new(DEFAULT_CAPACITY)
    }
}

impl EventLog {
    pub fn new(capacity: usize) -> Self {
        EventLog {
            ring: VecDeque::with_capacity(capacity.clamp(1, 1024)),
            capacity: capacity.max(1),
            next_seq: 1,
            file: None,
            file_errors: 0,
        }
    }

    /// Also append every event to `path` (created if missing; never truncated, so the
    /// file keeps the history of earlier FM runs too).
    pub fn with_file(capacity: usize, path: &Path) -> Result<Self, FmError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| FmError::Io(format!("event log {}: {e}", path.display())))?;
        let mut log = EventLog::new(capacity);
        log.file = Some(file);
        Ok(log)
    }

    /// The sequence number the next event gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The oldest event kept (`next_seq` when the log is empty).
    pub fn oldest_seq(&self) -> u64 {
        self.ring.front().map_or(self.next_seq, |e| e.seq)
    }

    pub fn len(&self) -> usize {
        self.ring.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ring.is_empty()
    }

    /// Append an event now; returns its sequence number.
    pub fn record(&mut self, kind: EventKind, message: impl Into<String>, detail: Value) -> u64 {
        self.record_at(unix_ms_now(), kind, message.into(), detail)
    }

    pub fn record_at(
        &mut self,
        unix_ms: u64,
        kind: EventKind,
        message: String,
        detail: Value,
    ) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        info!(seq, kind = kind.as_str(), %message, %detail, "event");
        let e = Event {
            seq,
            unix_ms,
            kind,
            message,
            detail,
        };
        if let Some(f) = self.file.as_mut() {
            // One write per line, so a reader tailing the file never sees half an event.
            let line = serde_json::to_string(&e).map(|mut s| {
                s.push('\n');
                s
            });
            let r = match line {
                Ok(l) => f.write_all(l.as_bytes()),
                Err(err) => Err(std::io::Error::other(err)),
            };
            if let Err(err) = r {
                if self.file_errors == 0 {
                    warn!(error = %err, "cannot append to the event log file; keeping events in memory only");
                }
                self.file_errors += 1;
            }
        }
        if self.ring.len() == self.capacity {
            self.ring.pop_front();
        }
        self.ring.push_back(e);
        seq
    }

    /// Up to `limit` events with `seq >= since`, oldest first, and the `since` to ask
    /// with next.
    pub fn since(&self, since: u64, limit: usize) -> (Vec<Event>, u64) {
        let oldest = self.oldest_seq();
        // Sequence numbers in the ring are contiguous, so the start is an index.
        let skip = since.saturating_sub(oldest) as usize;
        let events: Vec<Event> = self.ring.iter().skip(skip).take(limit).cloned().collect();
        let next = events
            .last()
            .map_or_else(|| since.max(oldest).min(self.next_seq), |e| e.seq + 1);
        (events, next)
    }

    pub fn reply(&self, req: &v1::EventsRequest) -> v1::EventsReply {
        let limit = if req.limit == 0 {
            1000
        } else {
            req.limit as usize
        };
        let (events, next_seq) = self.since(req.since_seq, limit);
        v1::EventsReply {
            events: events.iter().map(Event::to_proto).collect(),
            next_seq,
            oldest_seq: self.oldest_seq(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn kinds_round_trip_through_their_names_and_serde_agrees() {
        for k in EventKind::ALL {
            assert_eq!(EventKind::parse(k.as_str()), Some(*k));
            assert_eq!(
                serde_json::to_value(k).unwrap(),
                Value::String(k.as_str().into())
            );
        }
        assert_eq!(EventKind::parse("nope"), None);
        assert!(EventKind::AutoscaleDecision.recordable());
        assert!(!EventKind::ScScaleOutDone.recordable());
    }

    #[test]
    fn sequence_numbers_grow_and_since_pages_through() {
        let mut log = EventLog::new(100);
        assert_eq!(log.since(0, 10), (vec![], 1));
        for i in 0..5 {
            let s = log.record(EventKind::ScNodeJoined, format!("n{i}"), json!({"i": i}));
            assert_eq!(s, i + 1);
        }
        let (e, next) = log.since(0, 2);
        assert_eq!(e.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(next, 3);
        let (e, next) = log.since(next, 10);
        assert_eq!(e.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![3, 4, 5]);
        assert_eq!(next, 6);
        // Nothing new: the same next, so a poller keeps asking from there.
        assert_eq!(log.since(6, 10), (vec![], 6));
        // Asking past the end does not skip the next event.
        assert_eq!(log.since(60, 10).1, 6);
        assert_eq!(e[0].message, "n2");
        assert_eq!(e[0].detail["i"], 2);
    }

    #[test]
    fn the_ring_wraps_and_says_what_it_lost() {
        let mut log = EventLog::new(3);
        for _ in 0..7 {
            log.record(EventKind::ScNodeDead, "x", Value::Null);
        }
        assert_eq!(log.len(), 3);
        assert_eq!(log.oldest_seq(), 5);
        let r = log.reply(&v1::EventsRequest {
            since_seq: 2,
            limit: 0,
        });
        assert_eq!(r.oldest_seq, 5, "seq 2..4 fell out of the ring");
        assert_eq!(
            r.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![5, 6, 7]
        );
        assert_eq!(r.next_seq, 8);
        assert_eq!(r.events[0].kind, "sc_node_dead");
        assert_eq!(r.events[0].detail_json, "", "null detail is sent empty");
    }

    #[test]
    fn the_file_gets_one_json_line_per_event_and_is_appended_to() {
        let dir = std::env::temp_dir().join(format!("fm-events-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("events.jsonl");
        let _ = std::fs::remove_file(&path);
        {
            let mut log = EventLog::with_file(2, &path).unwrap();
            log.record(
                EventKind::ScScaleOutStart,
                "a",
                json!({"from_group": 1, "to_group": 2}),
            );
            log.record(EventKind::ScScaleOutDone, "b", Value::Null);
            log.record(EventKind::ScaleAborted, "c", Value::Null);
        }
        {
            // A restarted FM appends after what the last one wrote.
            let mut log = EventLog::with_file(2, &path).unwrap();
            log.record(EventKind::PpNodeJoined, "d", Value::Null);
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<Event> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert_eq!(lines[0].kind, EventKind::ScScaleOutStart);
        assert_eq!(lines[0].detail["to_group"], 2);
        assert_eq!(lines[2].seq, 3);
        assert_eq!((lines[3].seq, lines[3].kind), (1, EventKind::PpNodeJoined));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_unwritable_file_is_an_error_at_start() {
        let r = EventLog::with_file(10, Path::new("/nonexistent-dir/x/events.jsonl"));
        assert!(matches!(r, Err(FmError::Io(_))), "{r:?}");
    }
}
