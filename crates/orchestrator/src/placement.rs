//! Where tenants' shards go: the orchestrator's side of paper 000 §7.1 and App. A.
//!
//! Every tenant gets a *shard set*: G_min..G_max SC nodes, no two tenants sharing more
//! than O of them, and no node reserved past U of its capacity (Eq. 2–6). FM forms,
//! repairs and scales the tenant's SC groups only inside its set (`Directive.shards`),
//! so a poison request from one tenant can take down at most its own nodes, and any
//! other tenant keeps at least G − O nodes it does not share with it.
//!
//! The decisions come from the `placement` crate: the DDQN agent with the Filtering
//! Algorithm when a model is loaded, checked against Eq. 2–6, and Best Fit when the
//! model is missing or its answer fails the checker. The engine is level-triggered like
//! the rest of the orchestrator: it re-derives from the store and the live nodes,
//! places tenants that have no set, repairs sets that lost a node (only the lost shards
//! move: the survivors stay), forgets deleted tenants, and writes what changed in one
//! transaction. When no feasible answer exists it keeps the previous set and says why.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use ::placement::heuristics::{best_fit_order, BestFit, FirstFit};
use ::placement::{ClusterState, Limits, NodeIdx, Placed, Placer, Request, Resources};
use proto::v1;
use tracing::{debug, info, warn};

use crate::control::Shared;
use crate::desired::Snapshot;
use crate::error::ApiError;
use crate::model::*;

/// Which algorithm places new tenants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// The DDQN agent of App. A.2 (falls back to Best Fit).
    Ddqn,
    BestFit,
    FirstFit,
}

impl Algorithm {
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Ddqn => "ddqn",
            Algorithm::BestFit => "bf",
            Algorithm::FirstFit => "ff",
        }
    }
}

impl FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ddqn" => Ok(Algorithm::Ddqn),
            "bf" | "best-fit" => Ok(Algorithm::BestFit),
            "ff" | "first-fit" => Ok(Algorithm::FirstFit),
            _ => Err(format!("unknown placement algorithm {s:?} (ddqn, bf, ff)")),
        }
    }
}

/// The placement engine's settings.
#[derive(Debug, Clone)]
pub struct PlacementConfig {
    pub algorithm: Algorithm,
    /// A DDQN model file; `None`: the model shipped with the `placement` crate.
    pub model: Option<PathBuf>,
    /// U, G_min, G_max, O until an operator sets others through the API.
    pub limits: Limits,
    /// A tenant that states no demand reserves this.
    pub default_demand: Resources,
    /// An SC node that states no capacity offers this, at this price.
    pub default_capacity: Resources,
    pub default_price: f64,
    /// Search steps a repair or fallback may take.
    pub search_budget: usize,
    /// k of Zeta §VI-A: most PP clusters one tenant's VPCs are mapped to.
    pub clusters_per_tenant: usize,
    /// B(c) contribution of a PP node that states no bandwidth, Gbit/s.
    pub default_pp_bw: f64,
}

impl Default for PlacementConfig {
    fn default() -> Self {
        PlacementConfig {
            algorithm: Algorithm::Ddqn,
            model: None,
            // G = 3: an SC group is 3 replicas, all inside the set. O = 2: two tenants
            // always differ in at least one node.
            limits: Limits {
                threshold: 0.8,
                g_min: 3,
                g_max: 3,
                overlap: 2,
            },
            default_demand: Resources::new(1.0, 0.5, 1.0),
            default_capacity: Resources::new(10.0, 2.0, 4.0),
            default_price: 1.0,
            search_budget: 100_000,
            clusters_per_tenant: 2,
            default_pp_bw: 10.0,
        }
    }
}

/// An SC node as the engine sees it.
#[derive(Debug, Clone)]
struct ScNode {
    id: String,
    up: bool,
    capacity: Resources,
    price: f64,
}

/// The engine: its model, counters and last error. One per orchestrator, behind a
/// lock, so the API's limit changes and the reconcile task never interleave.
pub struct Engine {
    cfg: PlacementConfig,
    agent: Option<::placement::ddqn::Ddqn>,
    model: String,
    decisions: u64,
    fallbacks: u64,
    last_error: Option<String>,
}

/// What one pass decided.
#[derive(Debug, Default)]
struct Plan {
    put: Vec<TenantPlacement>,
    delete: Vec<String>,
    error: Option<String>,
}

impl Engine {
    pub fn new(cfg: PlacementConfig) -> Self {
        let (agent, model) = load_agent(&cfg);
        Engine {
            cfg,
            agent,
            model,
            decisions: 0,
            fallbacks: 0,
            last_error: None,
        }
    }

    pub fn config(&self) -> &PlacementConfig {
        &self.cfg
    }

    /// The limits in force: the operator's, else the configured ones.
    async fn limits(&self, shared: &Shared) -> Result<Limits, ApiError> {
        match shared.desired.placement_limits().await? {
            Some(l) => limits_from(&l),
            None => Ok(self.cfg.limits),
        }
    }

    fn sc_nodes(&self, shared: &Shared) -> Vec<ScNode> {
        let mut v: Vec<ScNode> = shared
            .node_list()
            .into_iter()
            .filter(|n| n.role() == v1::Role::Sc)
            .map(|n| {
                let c = n.hello.capacity.unwrap_or_default();
                let d = self.cfg.default_capacity;
                let pick = |x: f64, dflt: f64| if x > 0.0 { x } else { dflt };
                ScNode {
                    id: n.info().id,
                    up: n.up,
                    capacity: Resources::new(
                        pick(c.bw_gbps, d.bw),
                        pick(c.cpu, d.cpu),
                        pick(c.mem_gib, d.mem),
                    ),
                    price: pick(c.price, self.cfg.default_price),
                }
            })
            .collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// One reconcile pass: place, repair, forget; write what changed. Returns whether
    /// anything was written.
    pub async fn reconcile(&mut self, shared: &Shared) -> Result<bool, ApiError> {
        let snap = shared.desired.snapshot().await?;
        let limits = self.limits(shared).await?;
        let sc = self.sc_nodes(shared);
        let clusters =
            self.plan_clusters(&snap, &shared.pp_cluster_capacity(self.cfg.default_pp_bw));
        let plan = self.plan(&snap, &sc, limits, false);
        if plan.error != self.last_error {
            if let Some(e) = &plan.error {
                warn!(error = %e, "placement");
                shared.events.push(
                    "placement_failed",
                    None,
                    format!("placement: {e}"),
                    serde_json::json!({ "error": e }),
                );
            }
            self.last_error = plan.error.clone();
        }
        for c in &clusters {
            info!(tenant = %c.tenant, vpcs = ?c.vpcs, "VPC to PP cluster mapping written");
        }
        if plan.put.is_empty() && plan.delete.is_empty() && clusters.is_empty() {
            return Ok(false);
        }
        for p in &plan.put {
            info!(
                tenant = %p.tenant,
                sc_nodes = ?p.sc_nodes,
                algorithm = %p.algorithm,
                error = p.error.as_deref().unwrap_or(""),
                "tenant placement written"
            );
        }
        shared
            .desired
            .write_placement_records(&plan.put, &plan.delete, None, &clusters)
            .await?;
        for p in &plan.put {
            let message = match &p.error {
                None => format!(
                    "{} placed on {} ({})",
                    p.tenant,
                    p.sc_nodes.join(", "),
                    p.algorithm
                ),
                Some(e) => format!("{} kept on {}: {e}", p.tenant, p.sc_nodes.join(", ")),
            };
            shared.events.push(
                "placement_written",
                Some(&p.tenant),
                message,
                serde_json::to_value(p).unwrap_or_default(),
            );
        }
        for t in &plan.delete {
            shared.events.push(
                "placement_deleted",
                Some(t),
                format!("{t}'s shard set forgotten"),
                serde_json::json!({ "tenant": t }),
            );
        }
        for c in &clusters {
            shared.events.push(
                "vpc_clusters_written",
                Some(&c.tenant),
                format!(
                    "{}'s VPCs mapped to PP clusters: {}",
                    c.tenant,
                    c.vpcs
                        .iter()
                        .map(|(v, cl)| format!("{v} -> {cl}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                serde_json::to_value(c).unwrap_or_default(),
            );
        }
        Ok(true)
    }

    /// `PUT /v1/placement/limits`: take new limits if every tenant can be placed under
    /// them (a tenant whose set still fits keeps it); otherwise change nothing.
    pub async fn set_limits(
        &mut self,
        shared: &Shared,
        l: PlacementLimits,
    ) -> Result<PlacementView, ApiError> {
        let limits = limits_from(&l)?;
        let snap = shared.desired.snapshot().await?;
        let sc = self.sc_nodes(shared);
        let plan = self.plan(&snap, &sc, limits, true);
        if let Some(e) = plan.error {
            return Err(ApiError::conflict(format!(
                "no placement satisfies the new limits, so they were not applied: {e}"
            )));
        }
        let detail = serde_json::to_value(l).unwrap_or_default();
        shared
            .desired
            .write_placements(&plan.put, &plan.delete, Some(l))
            .await?;
        info!(
            ?limits,
            changed = plan.put.len(),
            "placement limits changed"
        );
        shared.events.push(
            "placement_limits_changed",
            None,
            format!(
                "placement limits changed; {} tenants placed anew",
                plan.put.len()
            ),
            detail,
        );
        shared.bump();
        let snap = shared.desired.snapshot().await?;
        Ok(self.view_of(&snap, &sc, limits))
    }

    /// Everything `starfabric placement show` prints.
    pub async fn view(&self, shared: &Shared) -> Result<PlacementView, ApiError> {
        let snap = shared.desired.snapshot().await?;
        let limits = self.limits(shared).await?;
        let sc = self.sc_nodes(shared);
        Ok(self.view_of(&snap, &sc, limits))
    }

    /// Maps every VPC without a (live) PP cluster: Zeta §VI-A's tenant constraint (at
    /// most k clusters per tenant) with the `placement::rgcm` incremental rule, which
    /// never moves a mapped VPC. A tenant whose cluster the operator named keeps all its
    /// VPCs there. A VPC's demand f(v) is its tenant's bandwidth split over its VPCs.
    fn plan_clusters(&mut self, snap: &Snapshot, clusters: &[(String, f64)]) -> Vec<VpcClusters> {
        use ::placement::rgcm;
        if clusters.is_empty() {
            return Vec::new();
        }
        let live = |c: &str| clusters.iter().any(|(n, _)| n == c);
        let records: HashMap<&str, &VpcClusters> = snap
            .vpc_clusters
            .iter()
            .map(|r| (r.tenant.as_str(), r))
            .collect();
        let mut tenants: Vec<&Tenant> = snap.tenants.iter().collect();
        tenants.sort_by(|a, b| a.name.cmp(&b.name));
        let vpcs_of =
            |t: &str| -> Vec<&Vpc> { snap.vpcs.iter().filter(|v| v.tenant == t).collect() };
        let demand_of = |t: &Tenant| {
            t.demand
                .map(|d| d.bw_gbps)
                .unwrap_or(self.cfg.default_demand.bw)
        };
        let inst = rgcm::GcmInstance {
            clusters: clusters
                .iter()
                .map(|(id, cap)| rgcm::GcmCluster {
                    id: id.clone(),
                    capacity: cap.max(1e-9),
                })
                .collect(),
            tenants: tenants
                .iter()
                .map(|t| {
                    let vs = vpcs_of(&t.name);
                    let f = demand_of(t) / vs.len().max(1) as f64;
                    rgcm::GcmTenant {
                        id: t.name.clone(),
                        vpcs: vs
                            .iter()
                            .map(|v| rgcm::GcmVpc {
                                id: v.name.clone(),
                                demand: f,
                            })
                            .collect(),
                    }
                })
                .collect(),
            k: self.cfg.clusters_per_tenant.max(1),
        };
        let mut current: Vec<rgcm::VpcPlacement> = Vec::new();
        for t in &tenants {
            if let Some(r) = records.get(t.name.as_str()) {
                for v in vpcs_of(&t.name) {
                    if let Some(c) = r.vpcs.get(&v.name).filter(|c| live(c)) {
                        current.push(rgcm::VpcPlacement {
                            tenant: t.name.clone(),
                            vpc: v.name.clone(),
                            cluster: c.clone(),
                        });
                    }
                }
            }
        }
        let mut out = Vec::new();
        for t in &tenants {
            let vs = vpcs_of(&t.name);
            let old = records.get(t.name.as_str());
            let mut map: BTreeMap<String, String> = BTreeMap::new();
            for v in &vs {
                if let Some(c) = old.and_then(|r| r.vpcs.get(&v.name)).filter(|c| live(c)) {
                    map.insert(v.name.clone(), c.clone());
                }
            }
            if map.len() < vs.len() {
                if t.pinned_cluster {
                    for v in &vs {
                        map.entry(v.name.clone())
                            .or_insert_with(|| t.pp_cluster.clone());
                    }
                } else {
                    match rgcm::place_tenant(&inst, &current, &t.name) {
                        Ok((placed, m)) => {
                            debug!(tenant = %t.name, lambda = m.lambda_after, "RGCM mapped VPCs");
                            for p in placed {
                                map.insert(p.vpc.clone(), p.cluster.clone());
                                current.push(p);
                            }
                        }
                        Err(e) => {
                            warn!(tenant = %t.name, error = %e, "RGCM could not map the tenant's VPCs");
                            continue;
                        }
                    }
                }
            }
            let changed = old.map(|r| r.vpcs != map).unwrap_or(!map.is_empty());
            if changed {
                out.push(VpcClusters {
                    tenant: t.name.clone(),
                    vpcs: map,
                });
            }
        }
        out
    }

    fn state_for(sc: &[ScNode], limits: Limits) -> Result<ClusterState, String> {
        let nodes = sc
            .iter()
            .map(|n| ::placement::Node {
                id: n.id.clone(),
                capacity: n.capacity,
                price: n.price,
            })
            .collect();
        ClusterState::new(nodes, limits).map_err(|e| e.to_string())
    }

    /// The decision pass. `strict` (a limits change): every kept set must pass Eq. 2–6
    /// under `limits` given the ones before it, else the tenant is placed anew; any
    /// tenant left unplaced makes the plan an error. Otherwise kept sets are restored
    /// as they are (a node's capacity report changing moves nobody) and only lost
    /// nodes are repaired.
    fn plan(&mut self, snap: &Snapshot, sc: &[ScNode], limits: Limits, strict: bool) -> Plan {
        let mut plan = Plan::default();
        let records: HashMap<&str, &TenantPlacement> = snap
            .placements
            .iter()
            .map(|p| (p.tenant.as_str(), p))
            .collect();
        plan.delete = snap
            .placements
            .iter()
            .filter(|p| snap.tenant(&p.tenant).is_none())
            .map(|p| p.tenant.clone())
            .collect();
        let up = sc.iter().filter(|n| n.up).count();
        if up < limits.g_min {
            plan.error = Some(format!(
                "{up} SC nodes are up and G_min is {}: tenants are not placed until more \
                 register (FM uses any SC node meanwhile)",
                limits.g_min
            ));
            return plan;
        }
        let mut state = match Self::state_for(sc, limits) {
            Ok(s) => s,
            Err(e) => {
                plan.error = Some(e);
                return plan;
            }
        };
        let idx: HashMap<&str, NodeIdx> = sc
            .iter()
            .enumerate()
            .map(|(i, n)| (n.id.as_str(), i))
            .collect();
        let mut tenants: Vec<&Tenant> = snap.tenants.iter().collect();
        tenants.sort_by(|a, b| a.name.cmp(&b.name));
        let mut lost = Vec::new();
        let mut fresh = Vec::new();
        for t in &tenants {
            let Some(rec) = records.get(t.name.as_str()) else {
                fresh.push(*t);
                continue;
            };
            let known: Vec<NodeIdx> = rec
                .sc_nodes
                .iter()
                .filter_map(|n| idx.get(n.as_str()).copied())
                .collect();
            let all_up = known.len() == rec.sc_nodes.len() && known.iter().all(|&e| sc[e].up);
            let req = Request {
                tenant: t.name.clone(),
                demand: rec.demand.to_resources(),
            };
            if strict {
                if all_up && state.commit(&req, &known).is_ok() {
                    continue;
                }
                fresh.push(*t);
            } else if all_up && !known.is_empty() {
                if let Err(e) = state.restore(Placed {
                    tenant: t.name.clone(),
                    demand: req.demand,
                    nodes: known,
                }) {
                    warn!(tenant = %t.name, error = %e, "placement record not restorable");
                    fresh.push(*t);
                }
            } else {
                lost.push((*rec, known));
            }
        }
        // Down nodes take nothing new; records on them were held back above.
        for (e, n) in sc.iter().enumerate() {
            state.set_up(e, n.up);
        }
        let mut errors = Vec::new();
        for (rec, known) in lost {
            let keep: Vec<NodeIdx> = known.iter().copied().filter(|&e| sc[e].up).collect();
            let req = Request {
                tenant: rec.tenant.clone(),
                demand: rec.demand.to_resources(),
            };
            let order = self.order(&state, &req);
            let gone: Vec<&str> = rec
                .sc_nodes
                .iter()
                .filter(|n| idx.get(n.as_str()).is_none_or(|&e| !sc[e].up))
                .map(String::as_str)
                .collect();
            match state.repair(
                &req,
                &keep,
                rec.sc_nodes.len(),
                &order,
                self.cfg.search_budget,
            ) {
                Some(set) if state.commit(&req, &set).is_ok() => {
                    let added = set.iter().filter(|e| !keep.contains(e)).count();
                    let base = rec.algorithm.split('+').next().unwrap_or("bf");
                    info!(tenant = %rec.tenant, lost = ?gone, added, "shard set repaired");
                    plan.put.push(TenantPlacement {
                        tenant: rec.tenant.clone(),
                        sc_nodes: ids(sc, &set),
                        demand: rec.demand,
                        algorithm: format!("{base}+repair"),
                        moves: rec.moves + added as u64,
                        error: None,
                    });
                }
                _ => {
                    let why = format!(
                        "SC nodes {gone:?} are down and no node can replace them within U = {}, \
                         G = {}..{}, O = {}: the set is kept and FM runs its groups degraded",
                        limits.threshold, limits.g_min, limits.g_max, limits.overlap
                    );
                    errors.push(format!("{}: {why}", rec.tenant));
                    // Keep its surviving nodes counted so nobody else takes their room.
                    let _ = state.restore(Placed {
                        tenant: rec.tenant.clone(),
                        demand: req.demand,
                        nodes: if keep.is_empty() { known.clone() } else { keep },
                    });
                    if rec.error.as_deref() != Some(why.as_str()) {
                        plan.put.push(TenantPlacement {
                            error: Some(why),
                            ..(*rec).clone()
                        });
                    }
                }
            }
        }
        for t in fresh {
            let old = records.get(t.name.as_str());
            let demand = old
                .map(|r| r.demand.to_resources())
                .or(t.demand.map(Demand::to_resources))
                .unwrap_or(self.cfg.default_demand);
            let req = Request {
                tenant: t.name.clone(),
                demand,
            };
            match self.decide(&state, &req) {
                Ok((set, algorithm)) => {
                    if let Err(e) = state.commit(&req, &set) {
                        errors.push(format!("{}: {e}", t.name));
                        continue;
                    }
                    let rec = TenantPlacement {
                        tenant: t.name.clone(),
                        sc_nodes: ids(sc, &set),
                        demand: Demand::from_resources(demand),
                        algorithm: algorithm.to_string(),
                        moves: old.map(|r| r.moves).unwrap_or(0),
                        error: None,
                    };
                    if old.map(|o| o.sc_nodes != rec.sc_nodes).unwrap_or(true) {
                        plan.put.push(rec);
                    }
                }
                Err(e) => errors.push(format!("{}: {e}", t.name)),
            }
        }
        if !errors.is_empty() {
            plan.error = Some(errors.join("; "));
        }
        plan
    }

    /// Nodes in the order the configured algorithm ranks them for `req`: the agent's
    /// Q-values when it has a ranking, Best Fit's order otherwise.
    fn order(&mut self, state: &ClusterState, req: &Request) -> Vec<NodeIdx> {
        if let Some(q) = self
            .agent
            .as_mut()
            .and_then(|a| a.q_values(state, req).ok())
        {
            let mut idx: Vec<NodeIdx> = (0..q.len()).collect();
            idx.sort_by(|&a, &b| q[b].total_cmp(&q[a]).then(a.cmp(&b)));
            return idx;
        }
        best_fit_order(state, req)
    }

    /// One decision: the configured algorithm, checked against Eq. 2–6, with Best Fit
    /// behind the learned agent.
    fn decide(
        &mut self,
        state: &ClusterState,
        req: &Request,
    ) -> Result<(Vec<NodeIdx>, &'static str), ::placement::PlaceError> {
        self.decisions += 1;
        match self.cfg.algorithm {
            Algorithm::FirstFit => FirstFit::default().place(state, req).map(|s| (s, "ff")),
            Algorithm::BestFit => BestFit::default().place(state, req).map(|s| (s, "bf")),
            Algorithm::Ddqn => {
                if let Some(agent) = self.agent.as_mut() {
                    match agent.place(state, req) {
                        Ok(set) => match state.feasible(req, &set) {
                            Ok(()) => return Ok((set, "ddqn")),
                            Err(v) => {
                                warn!(tenant = %req.tenant, violation = %v, "the DDQN answer fails the checker; Best Fit instead")
                            }
                        },
                        Err(e) => {
                            debug!(tenant = %req.tenant, error = %e, "the DDQN agent found no set; Best Fit instead")
                        }
                    }
                }
                self.fallbacks += 1;
                BestFit::default().place(state, req).map(|s| (s, "bf"))
            }
        }
    }

    fn view_of(&self, snap: &Snapshot, sc: &[ScNode], limits: Limits) -> PlacementView {
        let idx: HashMap<&str, NodeIdx> = sc
            .iter()
            .enumerate()
            .map(|(i, n)| (n.id.as_str(), i))
            .collect();
        let mut reserved = vec![Resources::ZERO; sc.len()];
        let mut on: Vec<Vec<String>> = vec![Vec::new(); sc.len()];
        let mut tenants = Vec::new();
        let mut violations = Vec::new();
        let mut placed: Vec<&TenantPlacement> = snap
            .placements
            .iter()
            .filter(|p| snap.tenant(&p.tenant).is_some())
            .collect();
        placed.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        for p in &placed {
            let share = p
                .demand
                .to_resources()
                .scale(1.0 / p.sc_nodes.len().max(1) as f64);
            for n in &p.sc_nodes {
                match idx.get(n.as_str()) {
                    Some(&e) => {
                        reserved[e] = reserved[e].plus(share);
                        on[e].push(p.tenant.clone());
                        if !sc[e].up {
                            violations.push(format!(
                                "tenant {:?} is placed on SC node {n:?}, which is down",
                                p.tenant
                            ));
                        }
                    }
                    None => violations.push(format!(
                        "tenant {:?} is placed on SC node {n:?}, which is not registered",
                        p.tenant
                    )),
                }
            }
        }
        for (e, n) in sc.iter().enumerate() {
            let limit = n.capacity.scale(limits.threshold);
            if !reserved[e].fits_in(&limit) {
                violations.push(format!(
                    "SC node {:?} has {:?} reserved, over U x capacity {:?}",
                    n.id, reserved[e], limit
                ));
            }
        }
        let names: Vec<String> = placed.iter().map(|p| p.tenant.clone()).collect();
        let mut shared = vec![vec![0usize; names.len()]; names.len()];
        for i in 0..placed.len() {
            for j in 0..placed.len() {
                shared[i][j] = placed[i]
                    .sc_nodes
                    .iter()
                    .filter(|n| placed[j].sc_nodes.contains(n))
                    .count();
                if i < j && shared[i][j] > limits.overlap {
                    violations.push(format!(
                        "tenants {:?} and {:?} share {} SC nodes > O = {}",
                        names[i], names[j], shared[i][j], limits.overlap
                    ));
                }
            }
            let g = placed[i].sc_nodes.len();
            if g < limits.g_min || g > limits.g_max {
                violations.push(format!(
                    "tenant {:?} has {g} SC nodes, outside G = {}..{}",
                    names[i], limits.g_min, limits.g_max
                ));
            }
        }
        let by_name: BTreeMap<&str, &&TenantPlacement> =
            placed.iter().map(|p| (p.tenant.as_str(), p)).collect();
        for t in &snap.tenants {
            let vpcs: Vec<VpcPlacement> = snap
                .vpcs
                .iter()
                .filter(|v| v.tenant == t.name)
                .map(|v| VpcPlacement {
                    vpc: v.name.clone(),
                    vni: v.vni,
                    pp_cluster: vpc_cluster(snap, t, &v.name),
                })
                .collect();
            let mut clusters: Vec<String> = vpcs.iter().map(|v| v.pp_cluster.clone()).collect();
            if clusters.is_empty() {
                clusters.push(t.pp_cluster.clone());
            }
            clusters.sort();
            clusters.dedup();
            let rec = by_name.get(t.name.as_str());
            tenants.push(TenantPlacementView {
                tenant: t.name.clone(),
                id: t.id,
                sc_nodes: rec.map(|r| r.sc_nodes.clone()).unwrap_or_default(),
                pp_clusters: clusters,
                vpcs,
                demand: rec.map(|r| r.demand).unwrap_or(
                    t.demand
                        .unwrap_or(Demand::from_resources(self.cfg.default_demand)),
                ),
                algorithm: rec.map(|r| r.algorithm.clone()).unwrap_or_default(),
                moves: rec.map(|r| r.moves).unwrap_or(0),
                error: match rec {
                    Some(r) => r.error.clone(),
                    None => Some("not placed yet".into()),
                },
            });
        }
        tenants.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        PlacementView {
            limits: PlacementLimits {
                threshold: limits.threshold,
                g_min: limits.g_min as i64,
                g_max: limits.g_max as i64,
                overlap: limits.overlap as i64,
            },
            algorithm: match self.cfg.algorithm {
                Algorithm::Ddqn => "ddqn (Best Fit fallback)".into(),
                a => a.name().into(),
            },
            model: self.model.clone(),
            nodes: sc
                .iter()
                .enumerate()
                .map(|(e, n)| PlacementNode {
                    id: n.id.clone(),
                    up: n.up,
                    capacity: Demand::from_resources(n.capacity),
                    price: n.price,
                    reserved: Demand::from_resources(reserved[e]),
                    tenants: on[e].clone(),
                })
                .collect(),
            tenants,
            overlap: OverlapMatrix {
                tenants: names,
                shared,
            },
            violations,
            decisions: self.decisions,
            fallbacks: self.fallbacks,
            last_error: self.last_error.clone(),
        }
    }
}

fn ids(sc: &[ScNode], set: &[NodeIdx]) -> Vec<String> {
    let mut v: Vec<String> = set.iter().map(|&e| sc[e].id.clone()).collect();
    v.sort();
    v
}

/// API limits to the crate's, each bad field named (422).
pub fn limits_from(l: &PlacementLimits) -> Result<Limits, ApiError> {
    Limits::checked(l.threshold, l.g_min, l.g_max, l.overlap).map_err(|e| match e {
        ::placement::PlaceError::Invalid { field, reason } => ApiError::invalid(&field, reason),
        other => ApiError::invalid("limits", other.to_string()),
    })
}

/// The learned agent, or why there is none (then Best Fit places every tenant).
fn load_agent(cfg: &PlacementConfig) -> (Option<::placement::ddqn::Ddqn>, String) {
    use ::placement::ddqn::DdqnModel;
    if cfg.algorithm != Algorithm::Ddqn {
        return (None, format!("none ({} configured)", cfg.algorithm.name()));
    }
    let (model, what) = match &cfg.model {
        Some(p) => (DdqnModel::load(p), p.display().to_string()),
        None => (DdqnModel::shipped(), "shipped".to_string()),
    };
    match model.and_then(|m| {
        let params = m.param_count();
        m.placer().map(|p| (p, params))
    }) {
        Ok((p, params)) => {
            info!(model = %what, params, "DDQN placement model loaded");
            (Some(p), format!("{what} ({params} parameters)"))
        }
        Err(e) => {
            warn!(model = %what, error = %e, "no DDQN model: Best Fit places every tenant");
            (None, format!("none: {e}; Best Fit places every tenant"))
        }
    }
}

/// The PP cluster carrying VPC `vpc` of tenant `t`: its RGCM mapping, else the
/// tenant's cluster (a VPC not mapped yet, or a record from before the mapping).
pub fn vpc_cluster(snap: &Snapshot, t: &Tenant, vpc: &str) -> String {
    snap.vpc_clusters
        .iter()
        .find(|r| r.tenant == t.name)
        .and_then(|r| r.vpcs.get(vpc).cloned())
        .unwrap_or_else(|| t.pp_cluster.clone())
}

/// The shard sets FM gets: tenant number → SC node ids.
pub fn shards(snap: &Snapshot) -> Vec<v1::TenantShards> {
    let mut v: Vec<v1::TenantShards> = snap
        .placements
        .iter()
        .filter_map(|p| {
            let t = snap.tenant(&p.tenant)?;
            (!p.sc_nodes.is_empty()).then(|| v1::TenantShards {
                tenant: t.id,
                sc_nodes: p.sc_nodes.clone(),
            })
        })
        .collect();
    v.sort_by_key(|s| s.tenant);
    v
}

/// The reconcile task: a pass whenever the generation moves, and every `period` (SC
/// nodes coming and going do not move the generation).
pub async fn run(shared: Arc<Shared>, period: Duration) {
    let mut gen = shared.subscribe();
    loop {
        {
            let mut engine = shared.placement.lock().await;
            match engine.reconcile(&shared).await {
                Ok(true) => shared.bump(),
                Ok(false) => {}
                Err(e) => warn!(error = %e, "placement pass failed"),
            }
        }
        tokio::select! {
            r = gen.changed() => if r.is_err() { return },
            _ = tokio::time::sleep(period) => {}
        }
    }
}

/// Where tenants' shards go (docs/placement.md).
#[derive(clap::Args, Debug, Clone)]
pub struct PlacementFlags {
    /// Placement algorithm: `ddqn` (the learned agent, Best Fit behind it), `bf`, `ff`.
    #[arg(long = "placement", default_value = "ddqn")]
    pub algorithm: Algorithm,
    /// DDQN model file (default: the model shipped with this build).
    #[arg(long = "placement-model")]
    pub model: Option<PathBuf>,
    /// U: the fraction of an SC node's capacity reservations may fill.
    #[arg(long = "placement-threshold", default_value_t = 0.8)]
    pub threshold: f64,
    /// G_min: fewest SC nodes per tenant (at least the group size, 3).
    #[arg(long = "shard-min", default_value_t = 3, allow_hyphen_values = true)]
    pub g_min: i64,
    /// G_max: most SC nodes per tenant.
    #[arg(long = "shard-max", default_value_t = 3, allow_hyphen_values = true)]
    pub g_max: i64,
    /// O: most SC nodes two tenants may share.
    #[arg(
        long = "shard-overlap",
        default_value_t = 2,
        allow_hyphen_values = true
    )]
    pub overlap: i64,
}

impl PlacementFlags {
    pub fn config(&self) -> Result<PlacementConfig, String> {
        let limits =
            ::placement::Limits::checked(self.threshold, self.g_min, self.g_max, self.overlap)
                .map_err(|e| format!("placement limits: {e}"))?;
        if let Some(m) = &self.model {
            if !m.is_file() {
                return Err(format!("--placement-model {}: no such file", m.display()));
            }
        }
        Ok(PlacementConfig {
            algorithm: self.algorithm,
            model: self.model.clone(),
            limits,
            ..Default::default()
        })
    }
}
