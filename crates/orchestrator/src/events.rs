//! Events for `GET /v1/events` and the dashboard: the orchestrator's own ring of recent
//! placement decisions, merged with FM's event log (scales, node joins and deaths, vIP
//! moves, and the autoscaler's decisions, which it records in FM's log).
//!
//! A tenant token sees only the events that name its tenant; node and vIP events are
//! the operator's.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use proto::v1;
use serde_json::Value;

use crate::auth::Principal;
use crate::control::Shared;
use crate::desired::Snapshot;
use crate::model::{Event, EventsView};

/// How many of its own events the orchestrator keeps.
pub const RING_CAPACITY: usize = 1000;

/// A bounded ring of the orchestrator's own events (oldest dropped first).
#[derive(Debug, Default)]
pub struct EventRing {
    inner: Mutex<(u64, VecDeque<Event>)>,
}

impl EventRing {
    /// Append an event about `tenant` (a tenant name; `None`: the operator's).
    pub fn push(&self, kind: &str, tenant: Option<&str>, message: String, detail: Value) {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.0 += 1;
        let seq = g.0;
        if g.1.len() >= RING_CAPACITY {
            g.1.pop_front();
        }
        g.1.push_back(Event {
            source: "orchestrator".into(),
            seq,
            unix_ms: unix_ms(),
            kind: kind.into(),
            tenant: tenant.map(str::to_string),
            message,
            detail,
        });
    }

    /// The newest `limit` events, oldest first.
    pub fn recent(&self, limit: usize) -> Vec<Event> {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let skip = g.1.len().saturating_sub(limit);
        g.1.iter().skip(skip).cloned().collect()
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The tenant an FM event is about: its detail's `tenant` (a data-plane tenant number,
/// or a name), resolved against the desired state.
pub fn fm_event_tenant(detail: &Value, snap: &Snapshot) -> Option<String> {
    match detail.get("tenant")? {
        Value::Number(n) => {
            let id = u32::try_from(n.as_u64()?).ok()?;
            snap.tenant_by_id(id).map(|t| t.name.clone())
        }
        Value::String(s) => snap.tenant(s).map(|t| t.name.clone()),
        _ => None,
    }
}

/// Only what `p` may see: everything for the admin; for a tenant, its own events, with
/// an FM's node id replaced by `fm` (which nodes exist is the operator's).
pub fn visible(p: &Principal, events: Vec<Event>) -> Vec<Event> {
    match p.tenant() {
        None => events,
        Some(own) => events
            .into_iter()
            .filter(|e| e.tenant.as_deref() == Some(own))
            .map(|mut e| {
                if e.source != "orchestrator" {
                    e.source = "fm".into();
                }
                e
            })
            .collect(),
    }
}

/// The newest `limit` events of the orchestrator and of every FM that is up, newest
/// first, filtered for `p`. An FM that does not answer is named in `errors`.
pub async fn collect(st: &Shared, p: &Principal, limit: usize) -> EventsView {
    let mut items = st.events.recent(limit);
    let mut errors = Vec::new();
    let snap = st.snapshot().await.ok();
    let fms: Vec<(String, String)> = st
        .node_list()
        .into_iter()
        .filter(|n| n.up && n.role() == v1::Role::Fm)
        .map(|n| (n.info().id, n.info().addr))
        .collect();
    for (id, addr) in fms {
        match tokio::time::timeout(Duration::from_secs(2), fm_tail(st, &addr, limit)).await {
            Ok(Ok(evs)) => items.extend(evs.into_iter().map(|e| {
                let detail: Value = serde_json::from_str(&e.detail_json).unwrap_or(Value::Null);
                Event {
                    source: id.clone(),
                    seq: e.seq,
                    unix_ms: e.unix_ms,
                    tenant: snap.as_deref().and_then(|s| fm_event_tenant(&detail, s)),
                    kind: e.kind,
                    message: e.message,
                    detail,
                }
            })),
            Ok(Err(e)) => errors.push(format!("FM {id} ({addr}): {e}")),
            Err(_) => errors.push(format!("FM {id} ({addr}): no answer within 2 s")),
        }
    }
    let mut items = visible(p, items);
    items.sort_by(|a, b| (b.unix_ms, &b.source, b.seq).cmp(&(a.unix_ms, &a.source, a.seq)));
    items.truncate(limit);
    if p.tenant().is_some() {
        // Which FMs exist is the operator's business.
        errors = errors
            .iter()
            .map(|_| "an FM did not answer".into())
            .collect();
        errors.dedup();
    }
    EventsView { items, errors }
}

/// FM's newest `limit` events: ask where its log ends, then for the tail.
async fn fm_tail(st: &Shared, addr: &str, limit: usize) -> Result<Vec<v1::FmEvent>, String> {
    let mut c = st.fm_client(addr).await?;
    // A since_seq past the end answers nothing, with next_seq = where the log ends.
    let head = c
        .events(v1::EventsRequest {
            since_seq: u64::MAX,
            limit: 1,
        })
        .await
        .map_err(|s| s.message().to_string())?
        .into_inner();
    let since = head
        .next_seq
        .saturating_sub(limit as u64)
        .max(head.oldest_seq);
    let r = c
        .events(v1::EventsRequest {
            since_seq: since,
            limit: limit as u32,
        })
        .await
        .map_err(|s| s.message().to_string())?
        .into_inner();
    Ok(r.events)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Tenant;

    fn ev(tenant: Option<&str>) -> Event {
        Event {
            source: "fm-1".into(),
            seq: 1,
            unix_ms: 0,
            kind: "sc_scale_out_done".into(),
            tenant: tenant.map(str::to_string),
            message: String::new(),
            detail: Value::Null,
        }
    }

    #[test]
    fn a_tenant_sees_only_events_naming_it() {
        let all = vec![ev(Some("acme")), ev(Some("globex")), ev(None)];
        let acme = visible(&Principal::Tenant("acme".into()), all.clone());
        assert_eq!(acme.len(), 1);
        assert_eq!(acme[0].tenant.as_deref(), Some("acme"));
        assert_eq!(acme[0].source, "fm", "FM node ids are the operator's");
        assert_eq!(visible(&Principal::Admin, all).len(), 3);
    }

    #[test]
    fn fm_event_tenant_resolves_numbers_and_names() {
        let snap = Snapshot {
            tenants: vec![Tenant::test("acme", 1), Tenant::test("globex", 2)],
            ..Default::default()
        };
        let d = |v: Value| fm_event_tenant(&v, &snap);
        assert_eq!(
            d(serde_json::json!({"tenant": 2})).as_deref(),
            Some("globex")
        );
        assert_eq!(
            d(serde_json::json!({"tenant": "acme"})).as_deref(),
            Some("acme")
        );
        assert_eq!(d(serde_json::json!({"tenant": 9})), None);
        assert_eq!(d(serde_json::json!({"node": "pp-1"})), None);
    }

    #[test]
    fn the_ring_is_bounded_and_keeps_the_newest() {
        let r = EventRing::default();
        for i in 0..RING_CAPACITY + 5 {
            r.push("placement", None, format!("{i}"), Value::Null);
        }
        let all = r.recent(usize::MAX);
        assert_eq!(all.len(), RING_CAPACITY);
        assert_eq!(
            all.last().unwrap().message,
            format!("{}", RING_CAPACITY + 4)
        );
        assert_eq!(r.recent(2).len(), 2);
    }
}
