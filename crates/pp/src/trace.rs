//! `starfabric trace` on the PP node: its HTTP endpoint (beside `/metrics`) arms a
//! trace in the worker's pipeline and hands out the records as JSON.
//!
//! - `POST /trace` with `{"tenant": T, "vni": V, "match": "tcp and port 80", "count": N,
//!   "snaplen": S}` (all but `count` optional): the filter is parsed here, so a bad one
//!   gets `400 {"error": ...}` and nothing is armed. Answers `{"id": ID}`. A new trace
//!   replaces the one before.
//! - `GET /trace?wait_ms=M`: the records since the last call (waiting up to `M` ms for
//!   the first), `{"id", "records": [...], "lost", "tested", "done"}`; frames are
//!   base64. `done` once the worker disarmed the trace (count used up, no FM decision
//!   awaited) and every record was taken.
//! - `DELETE /trace`: disarm.
//!
//! The worker thread owns the pipeline: the handlers leave a command in
//! [`TraceControl`], which the worker loop picks up between batches ([`TraceControl::poll`],
//! one relaxed atomic load when nothing changed).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{RawQuery, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use base64::Engine as _;
use crossbeam_channel::Receiver;
use pipeline::{
    Lookup, Pipeline, TraceCounters, TraceFilter, TraceRecord, Tracer, DEFAULT_SNAPLEN,
};
use serde_json::{json, Value};

/// Records a trace buffers between the worker and the reader; more are lost (counted).
pub const TRACE_RING: usize = 4096;
/// The largest snap length a trace may ask for (a frame slot).
pub const MAX_SNAPLEN: usize = pipeline::MAX_FRAME;
/// Longest `wait_ms` honoured.
const MAX_WAIT: Duration = Duration::from_secs(5);

enum Cmd {
    Arm(Tracer),
    Disarm,
}

struct Session {
    id: u64,
    rx: Receiver<TraceRecord>,
    counters: Arc<TraceCounters>,
}

/// Shared between the HTTP handlers and the worker loop.
#[derive(Default)]
pub struct TraceControl {
    changed: AtomicBool,
    cmd: Mutex<Option<Cmd>>,
    session: Mutex<Option<Arc<Session>>>,
    next_id: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl TraceControl {
    /// From the worker loop, between batches: apply a new arm/disarm command.
    #[inline]
    pub fn poll(&self, p: &mut Pipeline) {
        self.poll_with(p, |_| {});
    }

    /// [`TraceControl::poll`] for a node with several workers: `others` is shown the
    /// trace armed (or `None`: disarmed) to hand each other worker a
    /// [`pipeline::Tracer::fork`] of it.
    pub fn poll_with(&self, p: &mut Pipeline, others: impl FnOnce(Option<&pipeline::Tracer>)) {
        if !self.changed.load(Ordering::Relaxed) {
            return;
        }
        self.changed.store(false, Ordering::Relaxed);
        match lock(&self.cmd).take() {
            Some(Cmd::Arm(t)) => {
                others(Some(&t));
                p.set_tracer(Some(t))
            }
            Some(Cmd::Disarm) => {
                others(None);
                p.set_tracer(None)
            }
            None => {}
        }
    }

    /// Arm a trace: a parsed filter, `count` packets. Returns its id.
    pub fn arm(&self, filter: TraceFilter, count: u64, snaplen: usize) -> u64 {
        let (tx, rx) = crossbeam_channel::bounded(TRACE_RING);
        let counters = Arc::new(TraceCounters::default());
        let t = Tracer::new(filter, count, snaplen, tx, counters.clone());
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        *lock(&self.session) = Some(Arc::new(Session { id, rx, counters }));
        *lock(&self.cmd) = Some(Cmd::Arm(t));
        self.changed.store(true, Ordering::Release);
        id
    }

    pub fn disarm(&self) {
        *lock(&self.cmd) = Some(Cmd::Disarm);
        self.changed.store(true, Ordering::Release);
    }

    /// The HTTP routes (`/trace`), to serve beside `/metrics`.
    pub fn routes(self: &Arc<Self>) -> Router {
        Router::new()
            .route(
                "/trace",
                get(get_trace).post(post_trace).delete(delete_trace),
            )
            .with_state(self.clone())
    }
}

fn json_response(code: StatusCode, v: Value) -> Response {
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

fn bad(msg: impl Into<String>) -> Response {
    json_response(StatusCode::BAD_REQUEST, json!({ "error": msg.into() }))
}

/// Parse an arm request's body into (filter, count, snaplen).
pub fn parse_arm(body: &str) -> Result<(TraceFilter, u64, usize), String> {
    let v: Value = serde_json::from_str(body).map_err(|e| format!("body is not JSON: {e}"))?;
    let num = |k: &str| -> Result<Option<u64>, String> {
        match v.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_u64()
                .map(Some)
                .ok_or_else(|| format!("`{k}` must be a non-negative integer")),
        }
    };
    let tenant = num("tenant")?
        .map(|t| u32::try_from(t).map_err(|_| "`tenant` is over 32 bits".to_string()))
        .transpose()?;
    let vni = num("vni")?
        .map(|t| {
            u32::try_from(t)
                .ok()
                .filter(|v| *v < 1 << 24)
                .ok_or_else(|| "`vni` is over 24 bits".to_string())
        })
        .transpose()?;
    let count = num("count")?.ok_or("`count` is required")?;
    if count == 0 {
        return Err("`count` must be at least 1".into());
    }
    let snaplen = num("snaplen")?.map_or(DEFAULT_SNAPLEN, |s| s as usize);
    if snaplen == 0 || snaplen > MAX_SNAPLEN {
        return Err(format!("`snaplen` must be in 1..={MAX_SNAPLEN}"));
    }
    let expr = match v.get("match") {
        None | Some(Value::Null) => "",
        Some(Value::String(s)) => s.as_str(),
        Some(_) => return Err("`match` must be a string".into()),
    };
    let filter = TraceFilter::new(tenant, vni, expr).map_err(|e| e.to_string())?;
    Ok((filter, count, snaplen))
}

async fn post_trace(State(c): State<Arc<TraceControl>>, body: String) -> Response {
    match parse_arm(&body) {
        Ok((f, count, snaplen)) => {
            let id = c.arm(f, count, snaplen);
            tracing::info!(id, count, "trace armed");
            json_response(StatusCode::OK, json!({ "id": id }))
        }
        Err(e) => bad(e),
    }
}

async fn delete_trace(State(c): State<Arc<TraceControl>>) -> Response {
    c.disarm();
    json_response(StatusCode::OK, json!({ "disarmed": true }))
}

async fn get_trace(State(c): State<Arc<TraceControl>>, RawQuery(q): RawQuery) -> Response {
    let wait = q
        .as_deref()
        .unwrap_or("")
        .split('&')
        .find_map(|kv| kv.strip_prefix("wait_ms="))
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(Duration::ZERO, |ms| Duration::from_millis(ms).min(MAX_WAIT));
    let Some(s) = lock(&c.session).clone() else {
        return json_response(StatusCode::NOT_FOUND, json!({ "error": "no trace armed" }));
    };
    let deadline = Instant::now() + wait;
    let mut records = Vec::new();
    let done = loop {
        let mut disconnected = false;
        loop {
            match s.rx.try_recv() {
                Ok(r) => records.push(record_json(&r)),
                Err(crossbeam_channel::TryRecvError::Empty) => break,
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    disconnected = true;
                    break;
                }
            }
        }
        if disconnected || !records.is_empty() || Instant::now() >= deadline {
            break disconnected;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    json_response(
        StatusCode::OK,
        json!({
            "id": s.id,
            "records": records,
            "lost": s.counters.lost.load(Ordering::Relaxed),
            "tested": s.counters.tested.load(Ordering::Relaxed),
            "done": done,
        }),
    )
}

fn b64(b: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(b)
}

/// A record as the JSON `GET /trace` serves (and `starfabric trace` reads).
pub fn record_json(r: &TraceRecord) -> Value {
    match r {
        TraceRecord::Packet(p) => {
            let (lookup, entry, expired, request) = match p.lookup {
                Lookup::NotReached => ("not-reached", None, false, false),
                Lookup::Hit { entry } => ("hit", Some(entry), false, false),
                Lookup::Miss { expired, request } => ("miss", None, expired, request),
            };
            json!({
                "kind": "packet",
                "seq": p.seq,
                "ts_us": p.ts_us,
                "worker": p.worker,
                "tenant": p.tenant,
                "vni": p.vni,
                "released": p.released,
                "flow": p.key.map(|k| k.to_string()),
                "tcp_flags": p.tcp_flags,
                "parse": p.parse,
                "lookup": lookup,
                "entry": entry,
                "expired": expired,
                "request_sent": request,
                "actions": p.actions,
                "verdict": p.verdict,
                "drop_reason": p.drop_reason,
                "offloaded": p.offloaded,
                "outer": b64(&p.outer),
                "outer_len": p.outer_len,
                "inner": b64(&p.inner),
                "inner_len": p.inner_len,
                "out": b64(&p.out),
                "out_len": p.out_len,
            })
        }
        TraceRecord::Decision(d) => {
            let (ok, rule, error) = match &d.result {
                Ok(a) => (true, Some(a.as_str()), None),
                Err(e) => (false, None, Some(e.as_str())),
            };
            json!({
                "kind": "decision",
                "ts_us": d.ts_us,
                "worker": d.worker,
                "for_seq": d.for_seq,
                "flow": d.key.to_string(),
                "ok": ok,
                "rule": rule,
                "error": error,
                "also": d.also,
                "installed": d.installed,
                "decided_by": d.decided_by,
                "after_us": d.after_us,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arm_requests_are_checked_before_anything_is_armed() {
        let (f, n, s) = parse_arm(r#"{"tenant": 1, "match": "tcp port 80", "count": 5}"#).unwrap();
        assert_eq!((f.tenant, f.vni, n, s), (Some(1), None, 5, DEFAULT_SNAPLEN));
        for (body, msg) in [
            (
                r#"{"tenant": 1, "match": "tcp prot 80", "count": 5}"#,
                "bad match expression at column 5",
            ),
            (r#"{"tenant": 1}"#, "`count` is required"),
            (r#"{"count": 0}"#, "at least 1"),
            (r#"{"vni": 16777216, "count": 1}"#, "24 bits"),
            (r#"{"count": 1, "snaplen": 0}"#, "snaplen"),
            ("tenant=1", "not JSON"),
        ] {
            let e = parse_arm(body).expect_err(body);
            assert!(e.contains(msg), "{body}: {e}");
        }
    }
}
