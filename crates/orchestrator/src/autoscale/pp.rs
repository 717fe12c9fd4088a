//! The PP tier: the load metric, its configuration and node provider, the tier's input,
//! and the Multi IPs Scheduler driver.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use proto::v1;
use serde_json::json;
use tracing::{debug, info, warn};

use super::{Actuator, Autoscaler, EventSink, Input, LoadSource, PolicyConfig, Target};

/// A PP node's load figure the utilisation is computed from: pluggable, because what
/// limits a PP node depends on how it runs (requests to FM, packets, bytes).
#[derive(Clone)]
pub enum PpMetric {
    /// The heartbeat's `packets_per_s` (packets the node received): the load the
    /// underlay spreads over the nodes, and what a new node takes a share of.
    PacketsPerS,
    /// The heartbeat's `requests_per_s` (rule requests the node sent FM).
    RequestsPerS,
    /// Any other function of the heartbeat load, with a name for the events.
    Custom(&'static str, Arc<dyn Fn(&v1::Load) -> f64 + Send + Sync>),
}

impl PpMetric {
    pub fn name(&self) -> &'static str {
        match self {
            PpMetric::PacketsPerS => "packets_per_s",
            PpMetric::RequestsPerS => "requests_per_s",
            PpMetric::Custom(name, _) => name,
        }
    }

    pub fn value(&self, load: &v1::Load) -> f64 {
        match self {
            PpMetric::PacketsPerS => load.packets_per_s,
            PpMetric::RequestsPerS => load.requests_per_s,
            PpMetric::Custom(_, f) => f(load),
        }
    }
}

impl fmt::Debug for PpMetric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone)]
pub struct PpConfig {
    pub policy: PolicyConfig,
    /// The metric's value one PP node carries at utilisation 1.0.
    pub capacity: f64,
    pub metric: PpMetric,
    /// Run Zeta's Multi IPs Scheduler (§VI-B) every sample: vIPs move off a node above
    /// the high mark to lighter nodes of its cluster, and a cluster that cannot shed
    /// its overload that way grows by a node.
    pub multi_ip: bool,
}

/// Starts and stops PP nodes (local processes: [`crate::provider::LocalPpProvider`];
/// Kubernetes): the hook [`FmActuator`](super::FmActuator) calls for PP decisions.
#[tonic::async_trait]
pub trait PpNodeProvider: Send + Sync {
    /// Start a PP node; answers what it started.
    async fn add_pp_node(&self) -> Result<String, String>;
    /// Stop a PP node (the provider picks which); answers what it stopped.
    async fn remove_pp_node(&self) -> Result<String, String>;
}

/// The PP tier's input of a sample: every PP node's metric over its capacity.
pub(super) fn input(pp: &PpConfig, load: &v1::LoadReply) -> Input {
    let nodes: Vec<(&str, f64)> = load
        .nodes
        .iter()
        .filter(|n| n.role == v1::Role::Pp as i32)
        .map(|n| {
            let v = n.load.as_ref().map_or(0.0, |l| pp.metric.value(l));
            (n.node_id.as_str(), v)
        })
        .collect();
    let utils = nodes.iter().map(|n| n.1 / pp.capacity).collect();
    let detail = json!({
        "capacity": pp.capacity,
        "metric": pp.metric.name(),
        "nodes": nodes.iter().map(|(id, v)| json!({"node": id, "value": v})).collect::<Vec<_>>(),
    });
    Input {
        target: Target::Pp,
        utils: Some(utils),
        busiest: None,
        detail,
    }
}

impl<S: LoadSource, A: Actuator, E: EventSink> Autoscaler<S, A, E> {
    /// Zeta §VI-B: plan with `placement::multiip::schedule` over FM's vIP table and the
    /// PP nodes' loads, then apply it: vIP moves through FM (gainer first), a cluster
    /// that must grow through the PP node provider. FM serves one PP cluster, so a
    /// planned move of a node between clusters is recorded as refused. Every action is
    /// an event (`multiip_*`); after one the scheduler waits out the PP cooldown, so it
    /// judges the next plan on loads measured after the move.
    pub(super) async fn multi_ip_step(&mut self, now_ms: u64, load: &v1::LoadReply, pp: &PpConfig) {
        use ::placement::multiip::{
            schedule, Action as MipAction, MipCluster, MipNode, MipVip, SchedulerConfig,
        };
        if self
            .last_vip_action
            .is_some_and(|t| now_ms.saturating_sub(t) < pp.policy.cooldown.as_millis() as u64)
        {
            return;
        }
        let map = match self.actuator.vip_map().await {
            Ok(m) => m,
            Err(e) => {
                debug!(error = %e, "no vIP table: the Multi IPs Scheduler has nothing to move");
                return;
            }
        };
        let value: HashMap<&str, f64> = load
            .nodes
            .iter()
            .filter(|n| n.role == v1::Role::Pp as i32)
            .map(|n| {
                (
                    n.node_id.as_str(),
                    n.load.as_ref().map_or(0.0, |l| pp.metric.value(l)),
                )
            })
            .collect();
        let nodes: Vec<MipNode> = map
            .nodes
            .iter()
            .map(|n| MipNode {
                id: n.clone(),
                load: value.get(n.as_str()).copied().unwrap_or(0.0),
                capacity: pp.capacity,
                vips: map
                    .vips
                    .iter()
                    .filter(|o| &o.node == n)
                    .filter_map(|o| o.vip.as_ref())
                    .map(|v| MipVip {
                        id: v.index.to_string(),
                        load: None,
                    })
                    .collect(),
                draining: map.draining.contains(n),
            })
            .collect();
        if nodes.is_empty() {
            return;
        }
        let clusters = [MipCluster {
            id: "pp".into(),
            nodes,
        }];
        let cfg = SchedulerConfig {
            high_water: pp.policy.marks.high.clamp(f64::MIN_POSITIVE, 1.0),
            can_start_nodes: true,
            new_node_capacity: Some(pp.capacity),
            max_actions: 16,
        };
        let plan = match schedule(&clusters, &cfg) {
            Ok(p) => p,
            Err(e) => {
                warn!(error = %e, "Multi IPs Scheduler input refused");
                return;
            }
        };
        let mut acted = false;
        for step in plan.steps {
            let detail = json!({
                "action": serde_json::to_value(&step.action).unwrap_or_default(),
                "max_utilisation": step.max_utilisation,
                "before": plan.max_utilisation_before,
                "after": plan.max_utilisation_after,
            });
            match &step.action {
                MipAction::MoveVip { vip, to, .. } => {
                    let Ok(index) = vip.parse::<u32>() else {
                        continue;
                    };
                    acted = true;
                    match self.actuator.vip_move(index, to, &step.reason).await {
                        Ok(summary) => {
                            info!(%summary, reason = %step.reason, "Multi IPs Scheduler moved a vIP");
                            self.sink
                                .record("multiip_vip_move", &step.reason, detail)
                                .await;
                        }
                        Err(e) => {
                            warn!(error = %e, "Multi IPs Scheduler vIP move failed");
                            self.sink
                                .record("multiip_failed", &format!("{}: {e}", step.reason), detail)
                                .await;
                            break;
                        }
                    }
                }
                MipAction::GrowCluster { .. } => {
                    acted = true;
                    self.sink
                        .record("multiip_grow", &step.reason, detail.clone())
                        .await;
                    if let Err(e) = self.actuator.pp_scale_out().await {
                        self.sink
                            .record("multiip_failed", &format!("{}: {e}", step.reason), detail)
                            .await;
                    }
                }
                MipAction::MoveNode { .. } => {
                    self.sink
                        .record(
                            "multiip_refused",
                            &format!(
                                "{} (refused: this FM serves one PP cluster; nodes do not move between clusters)",
                                step.reason
                            ),
                            detail,
                        )
                        .await;
                }
            }
        }
        if acted {
            self.last_vip_action = Some(now_ms);
        }
    }
}
