//! The master's event log and load report: what `Events`, `RecordEvent` and `Load`
//! answer, and the small helpers the rest of the master records events with.

use proto::v1;
use serde_json::{json, Value};

use super::Master;
use crate::events::EventKind;

impl Master {
    pub(super) fn event(&mut self, kind: EventKind, message: String, detail: Value) {
        self.events.record(kind, message, detail);
    }

    /// An event from outside FM (`RecordEvent`).
    pub(crate) fn record_external(&mut self, req: v1::RecordEventRequest) -> Result<u64, String> {
        let kind =
            EventKind::parse(&req.kind).ok_or_else(|| format!("unknown kind {:?}", req.kind))?;
        if !kind.recordable() {
            return Err(format!(
                "kind {kind} is FM's own; it cannot be recorded from outside"
            ));
        }
        let detail = if req.detail_json.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&req.detail_json).map_err(|e| format!("detail_json: {e}"))?
        };
        Ok(self.events.record(kind, req.message, detail))
    }

    /// Requests dispatched per serving group (cumulative) and live nodes' heartbeat load.
    pub(crate) fn load_reply(&self, now_ms: u64) -> v1::LoadReply {
        let groups = self
            .map
            .to_proto()
            .partitions
            .into_iter()
            .map(|p| v1::GroupLoad {
                tenant: p.tenant,
                chain: p.chain,
                group: p.group,
                hash_lo: p.hash_lo,
                hash_hi: p.hash_hi,
                requests: self.group_load.get(&p.group).copied().unwrap_or(0),
            })
            .collect();
        let nodes = [v1::Role::Pp, v1::Role::Sc]
            .into_iter()
            .flat_map(|role| self.members.live(role))
            .map(|m| v1::NodeLoad {
                node_id: m.info.id.clone(),
                role: m.info.role,
                load: m.info.load,
            })
            .collect();
        v1::LoadReply {
            fm_ms: now_ms,
            groups,
            nodes,
        }
    }

    /// Group `gid`'s replicas, head first, for event details.
    pub(super) fn replica_ids(&self, gid: u64) -> Vec<String> {
        self.map
            .group(gid)
            .map(|g| g.group.replicas.iter().map(|r| r.node_id.clone()).collect())
            .unwrap_or_default()
    }

    pub(super) fn group_event(&mut self, kind: EventKind, gid: u64, message: String, extra: Value) {
        let (tenant, chain, lo, hi) = self
            .map
            .group(gid)
            .map(|g| {
                (
                    g.partition.tenant,
                    g.partition.chain,
                    g.partition.hash_lo,
                    g.partition.hash_hi,
                )
            })
            .unwrap_or_default();
        let mut detail = json!({
            "group": gid,
            "tenant": tenant,
            "chain": chain,
            "hash_lo": lo,
            "hash_hi": hi,
            "replicas": self.replica_ids(gid),
        });
        if let (Some(d), Value::Object(x)) = (detail.as_object_mut(), extra) {
            d.extend(x);
        }
        self.event(kind, message, detail);
    }
}
