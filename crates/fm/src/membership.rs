//! Membership: the PP and SC nodes FM knows, and whether they are alive.
//!
//! Nodes register on their session stream and then send a heartbeat every
//! `heartbeat_ms`. A node is dead when its session ends or when it has been silent for
//! `miss_limit` periods; FM then repairs the SC groups it was in. Because every node
//! talks only to FM, no PP node ever learns of SC membership and vice versa (§5.1).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use proto::v1;

#[derive(Debug, Clone)]
pub struct MemberEntry {
    pub info: v1::NodeInfo,
    pub session: u64,
    /// When FM last heard anything from the node (ms on FM's clock). Written by the
    /// session's reader task as messages arrive, not by the master task, so a backlog in
    /// the master never makes a live node look silent.
    pub seen: Arc<AtomicU64>,
    pub alive: bool,
}

impl MemberEntry {
    pub fn last_seen_ms(&self) -> u64 {
        self.seen.load(Ordering::Relaxed)
    }
}

#[derive(Debug, Default)]
pub struct Membership {
    nodes: BTreeMap<String, MemberEntry>,
    pub version: u64,
}

impl Membership {
    /// Register (or re-register) a node on `session`. Returns the session it replaces,
    /// if the node was still registered alive on another one.
    pub fn register(
        &mut self,
        info: v1::NodeInfo,
        session: u64,
        seen: Arc<AtomicU64>,
        now_ms: u64,
    ) -> Option<u64> {
        seen.fetch_max(now_ms, Ordering::Relaxed);
        self.version += 1;
        let old = self
            .nodes
            .get(&info.id)
            .filter(|e| e.alive && e.session != session)
            .map(|e| e.session);
        self.nodes.insert(
            info.id.clone(),
            MemberEntry {
                info,
                session,
                seen,
                alive: true,
            },
        );
        old
    }

    /// A heartbeat's load report (its arrival time is already in `seen`).
    pub fn heartbeat(&mut self, id: &str, session: u64, load: Option<v1::Load>) {
        if let Some(e) = self.nodes.get_mut(id) {
            if e.session == session && e.alive && load.is_some() {
                e.info.load = load;
            }
        }
    }

    /// Mark a node dead if `session` is still its session. Returns whether it was alive.
    pub fn mark_dead(&mut self, id: &str, session: u64) -> bool {
        match self.nodes.get_mut(id) {
            Some(e) if e.alive && e.session == session => {
                e.alive = false;
                self.version += 1;
                true
            }
            _ => false,
        }
    }

    /// Live nodes silent for longer than their role's limit, `limit_ms(role)`:
    /// (id, session).
    pub fn silent(&self, now_ms: u64, limit_ms: impl Fn(i32) -> u64) -> Vec<(String, u64)> {
        self.nodes
            .values()
            .filter(|e| e.alive && now_ms.saturating_sub(e.last_seen_ms()) > limit_ms(e.info.role))
            .map(|e| (e.info.id.clone(), e.session))
            .collect()
    }

    pub fn get(&self, id: &str) -> Option<&MemberEntry> {
        self.nodes.get(id)
    }

    /// Live nodes of `role`, by id.
    pub fn live(&self, role: v1::Role) -> impl Iterator<Item = &MemberEntry> {
        self.nodes
            .values()
            .filter(move |e| e.alive && e.info.role == role as i32)
    }

    pub fn view(&self, now_ms: u64) -> v1::MembershipView {
        v1::MembershipView {
            version: self.version,
            members: self
                .nodes
                .values()
                .map(|e| v1::Member {
                    node: Some(e.info.clone()),
                    alive: e.alive,
                    silent_ms: now_ms.saturating_sub(e.last_seen_ms()),
                })
                .collect(),
        }
    }
}
