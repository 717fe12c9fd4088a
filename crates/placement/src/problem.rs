//! The placement problem of paper 000 App. A.1 (Eq. 1–6), its checker, and the online
//! state every algorithm places into.
//!
//! Notation follows Table 2: a node is an ECS `e` with capacities (B_e, C_e, M_e) and a
//! price k_e; a tenant request `i` asks for (b^i, c^i, m^i) spread evenly over G^i
//! nodes; U is the utilisation threshold of Eq. 2–4 (the paper's UB_e = U·B_e, and so
//! on); G_min ≤ G^i ≤ G_max is Eq. 5; two tenants share at most O nodes (Eq. 6).

use std::collections::{HashMap, HashSet};
use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Index of a node in an [`Instance`] or [`ClusterState`].
pub type NodeIdx = usize;

/// Tolerance for capacity comparisons: shares are sums of divisions.
const EPS: f64 = 1e-9;

/// One of the three resource dimensions of Eq. 2–4.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Resource {
    Bandwidth,
    Cpu,
    Memory,
}

impl Resource {
    pub const ALL: [Resource; 3] = [Resource::Bandwidth, Resource::Cpu, Resource::Memory];
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Resource::Bandwidth => "bandwidth",
            Resource::Cpu => "cpu",
            Resource::Memory => "memory",
        })
    }
}

/// Bandwidth (Gbit/s), CPU (cores) and memory (GiB): a capacity, a demand or a load.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Resources {
    pub bw: f64,
    pub cpu: f64,
    pub mem: f64,
}

impl Resources {
    pub const ZERO: Resources = Resources {
        bw: 0.0,
        cpu: 0.0,
        mem: 0.0,
    };

    pub const fn new(bw: f64, cpu: f64, mem: f64) -> Self {
        Resources { bw, cpu, mem }
    }

    pub fn get(&self, r: Resource) -> f64 {
        match r {
            Resource::Bandwidth => self.bw,
            Resource::Cpu => self.cpu,
            Resource::Memory => self.mem,
        }
    }

    pub fn scale(self, f: f64) -> Self {
        Resources::new(self.bw * f, self.cpu * f, self.mem * f)
    }

    pub fn plus(self, o: Resources) -> Self {
        Resources::new(self.bw + o.bw, self.cpu + o.cpu, self.mem + o.mem)
    }

    /// Subtraction clamped at zero: releasing a share never leaves a negative load
    /// from rounding.
    pub fn saturating_sub(self, o: Resources) -> Self {
        Resources::new(
            (self.bw - o.bw).max(0.0),
            (self.cpu - o.cpu).max(0.0),
            (self.mem - o.mem).max(0.0),
        )
    }

    /// Component-wise maximum.
    pub fn max(self, o: Resources) -> Self {
        Resources::new(self.bw.max(o.bw), self.cpu.max(o.cpu), self.mem.max(o.mem))
    }

    /// `self ≤ cap` in every dimension, with a rounding tolerance.
    pub fn fits_in(&self, cap: &Resources) -> bool {
        Resource::ALL
            .iter()
            .all(|&r| self.get(r) <= cap.get(r) * (1.0 + EPS) + EPS)
    }

    /// Each dimension of `self` as a fraction of `cap` (0 where the capacity is 0).
    pub fn ratio(&self, cap: &Resources) -> [f64; 3] {
        Resource::ALL.map(|r| {
            let c = cap.get(r);
            if c > 0.0 {
                self.get(r) / c
            } else {
                0.0
            }
        })
    }

    /// Checks that every component is finite and ≥ 0; names `field` otherwise.
    pub fn validate(&self, field: &str) -> Result<(), PlaceError> {
        for r in Resource::ALL {
            let v = self.get(r);
            if !v.is_finite() || v < 0.0 {
                return Err(PlaceError::invalid(
                    format!("{field}.{}", short(r)),
                    format!("must be a finite number ≥ 0, got {v}"),
                ));
            }
        }
        Ok(())
    }
}

fn short(r: Resource) -> &'static str {
    match r {
        Resource::Bandwidth => "bw",
        Resource::Cpu => "cpu",
        Resource::Memory => "mem",
    }
}

/// An ECS: capacity (B_e, C_e, M_e) and price k_e.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    pub id: String,
    pub capacity: Resources,
    pub price: f64,
}

/// A tenant's request: demand (b^i, c^i, m^i), spread evenly over its G^i nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub tenant: String,
    pub demand: Resources,
}

/// U, G_min, G_max and O.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "RawLimits")]
pub struct Limits {
    /// U: the fraction of each capacity that reservations may fill (Eq. 2–4).
    pub threshold: f64,
    /// G_min (Eq. 5).
    pub g_min: usize,
    /// G_max (Eq. 5).
    pub g_max: usize,
    /// O: most nodes two tenants may share (Eq. 6).
    pub overlap: usize,
}

/// Limits as they arrive on the wire: signed, so a negative O or G is named in the
/// error instead of failing as "expected usize".
#[derive(Deserialize)]
struct RawLimits {
    threshold: f64,
    g_min: i64,
    g_max: i64,
    overlap: i64,
}

impl TryFrom<RawLimits> for Limits {
    type Error = PlaceError;
    fn try_from(r: RawLimits) -> Result<Self, PlaceError> {
        Limits::checked(r.threshold, r.g_min, r.g_max, r.overlap)
    }
}

/// `U = 0.8, G in [2, 3], O = 1`, as messages name the limits.
impl fmt::Display for Limits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "U = {}, G in [{}, {}], O = {}",
            self.threshold, self.g_min, self.g_max, self.overlap
        )
    }
}

impl Limits {
    /// Limits from signed inputs (an API body, a workload file), each field checked.
    pub fn checked(
        threshold: f64,
        g_min: i64,
        g_max: i64,
        overlap: i64,
    ) -> Result<Self, PlaceError> {
        if !threshold.is_finite() || threshold <= 0.0 || threshold > 1.0 {
            return Err(PlaceError::invalid(
                "threshold",
                format!("U must be in (0, 1], got {threshold}"),
            ));
        }
        if g_min < 1 {
            return Err(PlaceError::invalid(
                "g_min",
                format!("G_min must be ≥ 1, got {g_min}"),
            ));
        }
        if g_max < g_min {
            return Err(PlaceError::invalid(
                "g_max",
                format!("G_max ({g_max}) must be ≥ G_min ({g_min})"),
            ));
        }
        if overlap < 0 {
            return Err(PlaceError::invalid(
                "overlap",
                format!("O must be ≥ 0, got {overlap}"),
            ));
        }
        Ok(Limits {
            threshold,
            g_min: g_min as usize,
            g_max: g_max as usize,
            overlap: overlap as usize,
        })
    }

    pub fn validate(&self) -> Result<(), PlaceError> {
        Limits::checked(
            self.threshold,
            self.g_min as i64,
            self.g_max as i64,
            self.overlap as i64,
        )
        .map(|_| ())
    }
}

/// An offline instance: every request placed at once (Eq. 1–6 as written).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Instance {
    pub nodes: Vec<Node>,
    pub requests: Vec<Request>,
    pub limits: Limits,
}

impl Instance {
    /// Field-level validation: everything that makes the instance malformed, as
    /// opposed to merely infeasible.
    pub fn validate(&self) -> Result<(), PlaceError> {
        self.limits.validate()?;
        validate_nodes(&self.nodes, &self.limits)?;
        let mut seen = HashSet::new();
        for (i, r) in self.requests.iter().enumerate() {
            unique_id(
                &mut seen,
                &r.tenant,
                format!("requests[{i}].tenant"),
                || format!("tenant {:?} is requested twice", r.tenant),
            )?;
            r.demand.validate(&format!("requests[{i}].demand"))?;
        }
        Ok(())
    }
}

/// Each `(field, value)` must lie in [0, 1].
pub(crate) fn check_unit_interval(fields: &[(&str, f64)]) -> Result<(), PlaceError> {
    for &(field, v) in fields {
        if !(0.0..=1.0).contains(&v) {
            return Err(PlaceError::invalid(
                field,
                format!("must be in [0, 1], got {v}"),
            ));
        }
    }
    Ok(())
}

/// Record `id` in `seen`. An empty id, or one `seen` already holds (`duplicate` says
/// how), is invalid at `field`.
pub(crate) fn unique_id<'a>(
    seen: &mut HashSet<&'a str>,
    id: &'a str,
    field: String,
    duplicate: impl FnOnce() -> String,
) -> Result<(), PlaceError> {
    if id.is_empty() {
        return Err(PlaceError::invalid(field, "must not be empty"));
    }
    if !seen.insert(id) {
        return Err(PlaceError::invalid(field, duplicate()));
    }
    Ok(())
}

pub(crate) fn validate_nodes(nodes: &[Node], limits: &Limits) -> Result<(), PlaceError> {
    let mut seen = HashSet::new();
    for (i, n) in nodes.iter().enumerate() {
        unique_id(&mut seen, &n.id, format!("nodes[{i}].id"), || {
            format!("node {:?} is listed twice", n.id)
        })?;
        n.capacity.validate(&format!("nodes[{i}].capacity"))?;
        if !n.price.is_finite() || n.price < 0.0 {
            return Err(PlaceError::invalid(
                format!("nodes[{i}].price"),
                format!("must be a finite number ≥ 0, got {}", n.price),
            ));
        }
    }
    if nodes.len() < limits.g_min {
        return Err(PlaceError::Infeasible {
            tenant: None,
            reason: format!(
                "{} nodes cannot give any tenant G_min = {} nodes",
                nodes.len(),
                limits.g_min
            ),
        });
    }
    Ok(())
}

/// An offline answer: `sets[i]` are the nodes of `requests[i]`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Placement {
    pub sets: Vec<Vec<NodeIdx>>,
}

/// One broken constraint, named by the paper's equation.
#[derive(Debug, Clone, PartialEq, Error, Serialize, Deserialize)]
pub enum Violation {
    #[error("Eq. 2-4: node {node:?} {resource} reserved {load:.4} > U·capacity {limit:.4}")]
    Capacity {
        node: String,
        resource: Resource,
        load: f64,
        limit: f64,
    },
    #[error("Eq. 5: tenant {tenant:?} has {g} nodes, outside [{g_min}, {g_max}]")]
    GroupSize {
        tenant: String,
        g: usize,
        g_min: usize,
        g_max: usize,
    },
    #[error("Eq. 6: tenants {a:?} and {b:?} share {shared} nodes > O = {max}")]
    Overlap {
        a: String,
        b: String,
        shared: usize,
        max: usize,
    },
    #[error("tenant {tenant:?} names node index {index}, which does not exist")]
    UnknownNode { tenant: String, index: NodeIdx },
    #[error("tenant {tenant:?} lists node {node:?} twice")]
    DuplicateNode { tenant: String, node: String },
    #[error("tenant {tenant:?} is placed on node {node:?}, which is down")]
    NodeDown { tenant: String, node: String },
    #[error("tenant {tenant:?} has no placement")]
    Unplaced { tenant: String },
}

/// Checks `p` against Eq. 2–6 for `inst`; every violation is returned, named.
pub fn check(inst: &Instance, p: &Placement) -> Vec<Violation> {
    let mut v = Vec::new();
    let n = inst.nodes.len();
    let mut load = vec![Resources::ZERO; n];
    let mut clean: Vec<Vec<NodeIdx>> = Vec::with_capacity(inst.requests.len());
    for (i, r) in inst.requests.iter().enumerate() {
        let Some(set) = p.sets.get(i) else {
            v.push(Violation::Unplaced {
                tenant: r.tenant.clone(),
            });
            clean.push(Vec::new());
            continue;
        };
        let mut s: Vec<NodeIdx> = Vec::with_capacity(set.len());
        for &e in set {
            if e >= n {
                v.push(Violation::UnknownNode {
                    tenant: r.tenant.clone(),
                    index: e,
                });
            } else if s.contains(&e) {
                v.push(Violation::DuplicateNode {
                    tenant: r.tenant.clone(),
                    node: inst.nodes[e].id.clone(),
                });
            } else {
                s.push(e);
            }
        }
        let g = s.len();
        if g < inst.limits.g_min || g > inst.limits.g_max {
            v.push(Violation::GroupSize {
                tenant: r.tenant.clone(),
                g,
                g_min: inst.limits.g_min,
                g_max: inst.limits.g_max,
            });
        }
        if g > 0 {
            let share = r.demand.scale(1.0 / g as f64);
            for &e in &s {
                load[e] = load[e].plus(share);
            }
        }
        s.sort_unstable();
        clean.push(s);
    }
    for (e, node) in inst.nodes.iter().enumerate() {
        let cap = node.capacity.scale(inst.limits.threshold);
        for r in Resource::ALL {
            if load[e].get(r) > cap.get(r) * (1.0 + EPS) + EPS {
                v.push(Violation::Capacity {
                    node: node.id.clone(),
                    resource: r,
                    load: load[e].get(r),
                    limit: cap.get(r),
                });
            }
        }
    }
    for i in 0..clean.len() {
        for j in i + 1..clean.len() {
            let shared = sorted_intersection(&clean[i], &clean[j]);
            if shared > inst.limits.overlap {
                v.push(Violation::Overlap {
                    a: inst.requests[i].tenant.clone(),
                    b: inst.requests[j].tenant.clone(),
                    shared,
                    max: inst.limits.overlap,
                });
            }
        }
    }
    v
}

fn sorted_intersection(a: &[NodeIdx], b: &[NodeIdx]) -> usize {
    let (mut i, mut j, mut n) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                n += 1;
                i += 1;
                j += 1;
            }
        }
    }
    n
}

/// Eq. 1: the summed price of every node some request uses.
pub fn cost(inst: &Instance, p: &Placement) -> f64 {
    let mut used = vec![false; inst.nodes.len()];
    for set in &p.sets {
        for &e in set {
            if e < used.len() {
                used[e] = true;
            }
        }
    }
    inst.nodes
        .iter()
        .zip(used)
        .filter(|(_, u)| *u)
        .map(|(n, _)| n.price)
        .sum()
}

/// Why a placement could not be made or was refused.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PlaceError {
    /// Malformed input; `field` names it (the API answers 422).
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
    /// Well-formed but no placement satisfies Eq. 2–6.
    #[error("infeasible{}: {reason}", tenant.as_ref().map(|t| format!(" for tenant {t:?}")).unwrap_or_default())]
    Infeasible {
        tenant: Option<String>,
        reason: String,
    },
    /// A proposed set breaks a constraint.
    #[error("{0}")]
    Violates(Violation),
    #[error("tenant {0:?} is not placed")]
    UnknownTenant(String),
    #[error("tenant {0:?} is already placed")]
    AlreadyPlaced(String),
    /// A learned model could not be loaded or used.
    #[error("model: {0}")]
    Model(String),
}

impl PlaceError {
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        PlaceError::Invalid {
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub fn infeasible(tenant: &str, reason: impl Into<String>) -> Self {
        PlaceError::Infeasible {
            tenant: Some(tenant.to_string()),
            reason: reason.into(),
        }
    }
}

/// A tenant as placed: the reservation it holds and where.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Placed {
    pub tenant: String,
    /// What is reserved: the whole request, split evenly over `nodes`.
    pub demand: Resources,
    /// Sorted node indices.
    pub nodes: Vec<NodeIdx>,
}

impl Placed {
    pub fn share(&self) -> Resources {
        self.demand.scale(1.0 / self.nodes.len().max(1) as f64)
    }
}

/// The online state of App. A.2: the nodes, what each has reserved, and where every
/// placed tenant sits. Every mutation keeps Eq. 2–6 true for the tenants it admits;
/// only [`ClusterState::set_demand`] (a tenant's traffic grew) can push a node over U,
/// and [`ClusterState::overloaded`] then says which.
#[derive(Debug, Clone)]
pub struct ClusterState {
    nodes: Vec<Node>,
    limits: Limits,
    up: Vec<bool>,
    used: Vec<Resources>,
    /// Tenant slots on each node.
    on_node: Vec<Vec<usize>>,
    slots: Vec<Option<Placed>>,
    by_name: HashMap<String, usize>,
    free_slots: Vec<usize>,
}

impl ClusterState {
    pub fn new(nodes: Vec<Node>, limits: Limits) -> Result<Self, PlaceError> {
        limits.validate()?;
        validate_nodes(&nodes, &limits)?;
        let n = nodes.len();
        Ok(ClusterState {
            nodes,
            limits,
            up: vec![true; n],
            used: vec![Resources::ZERO; n],
            on_node: vec![Vec::new(); n],
            slots: Vec::new(),
            by_name: HashMap::new(),
            free_slots: Vec::new(),
        })
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    pub fn node_index(&self, id: &str) -> Option<NodeIdx> {
        self.nodes.iter().position(|n| n.id == id)
    }

    pub fn is_up(&self, e: NodeIdx) -> bool {
        self.up[e]
    }

    /// Marks a node down (failed) or up. A down node takes no new tenant; tenants on
    /// it stay recorded until they are re-placed (see [`ClusterState::tenants_on`]).
    pub fn set_up(&mut self, e: NodeIdx, up: bool) {
        self.up[e] = up;
    }

    /// Reserved load on node `e`.
    pub fn used(&self, e: NodeIdx) -> Resources {
        self.used[e]
    }

    /// U·capacity of node `e`: what reservations may fill.
    pub fn limit(&self, e: NodeIdx) -> Resources {
        self.nodes[e].capacity.scale(self.limits.threshold)
    }

    /// What node `e` can still take before U.
    pub fn free(&self, e: NodeIdx) -> Resources {
        self.limit(e).saturating_sub(self.used[e])
    }

    /// Reserved load as fractions of capacity (UB_e, UC_e, UM_e of the reward).
    pub fn utilisation(&self, e: NodeIdx) -> [f64; 3] {
        self.used[e].ratio(&self.nodes[e].capacity)
    }

    /// Whether node `e` hosts a tenant (y_e = 1).
    pub fn in_use(&self, e: NodeIdx) -> bool {
        !self.on_node[e].is_empty()
    }

    /// Eq. 1 over the current state: the summed price of nodes in use.
    pub fn cost(&self) -> f64 {
        (0..self.nodes.len())
            .filter(|&e| self.in_use(e))
            .map(|e| self.nodes[e].price)
            .sum()
    }

    pub fn placed(&self, tenant: &str) -> Option<&Placed> {
        self.by_name
            .get(tenant)
            .and_then(|&s| self.slots[s].as_ref())
    }

    /// Every placed tenant, in no particular order.
    pub fn tenants(&self) -> impl Iterator<Item = &Placed> {
        self.slots.iter().flatten()
    }

    pub fn tenant_count(&self) -> usize {
        self.by_name.len()
    }

    /// Names of the tenants with a shard on node `e`.
    pub fn tenants_on(&self, e: NodeIdx) -> Vec<&str> {
        self.on_node[e]
            .iter()
            .filter_map(|&s| self.slots[s].as_ref().map(|p| p.tenant.as_str()))
            .collect()
    }

    /// Whether node `e` can take `share` more without passing U.
    pub fn fits(&self, e: NodeIdx, share: &Resources) -> bool {
        self.up[e] && self.used[e].plus(*share).fits_in(&self.limit(e))
    }

    /// Checks a proposed set for `req` against Eq. 2–6 and node health, as if `req`'s
    /// tenant were not placed (so a re-placement can be checked before the release).
    pub fn feasible(&self, req: &Request, set: &[NodeIdx]) -> Result<(), Violation> {
        let g = set.len();
        if g < self.limits.g_min || g > self.limits.g_max {
            return Err(Violation::GroupSize {
                tenant: req.tenant.clone(),
                g,
                g_min: self.limits.g_min,
                g_max: self.limits.g_max,
            });
        }
        let own = self.by_name.get(&req.tenant).copied();
        let share = req.demand.scale(1.0 / g as f64);
        for (k, &e) in set.iter().enumerate() {
            if e >= self.nodes.len() {
                return Err(Violation::UnknownNode {
                    tenant: req.tenant.clone(),
                    index: e,
                });
            }
            if set[..k].contains(&e) {
                return Err(Violation::DuplicateNode {
                    tenant: req.tenant.clone(),
                    node: self.nodes[e].id.clone(),
                });
            }
            if !self.up[e] {
                return Err(Violation::NodeDown {
                    tenant: req.tenant.clone(),
                    node: self.nodes[e].id.clone(),
                });
            }
            // Without the tenant's own current share, if it is placed here.
            let mut used = self.used[e];
            if let Some(s) = own {
                if self.on_node[e].contains(&s) {
                    if let Some(p) = &self.slots[s] {
                        used = used.saturating_sub(p.share());
                    }
                }
            }
            let after = used.plus(share);
            let limit = self.limit(e);
            if !after.fits_in(&limit) {
                let r = Resource::ALL
                    .into_iter()
                    .find(|&r| after.get(r) > limit.get(r) * (1.0 + EPS) + EPS)
                    .unwrap_or(Resource::Bandwidth);
                return Err(Violation::Capacity {
                    node: self.nodes[e].id.clone(),
                    resource: r,
                    load: after.get(r),
                    limit: limit.get(r),
                });
            }
        }
        if let Some((other, shared)) = self.worst_overlap(set, own) {
            if shared > self.limits.overlap {
                return Err(Violation::Overlap {
                    a: req.tenant.clone(),
                    b: other,
                    shared,
                    max: self.limits.overlap,
                });
            }
        }
        Ok(())
    }

    /// The placed tenant (other than `skip`) sharing the most nodes with `set`.
    fn worst_overlap(&self, set: &[NodeIdx], skip: Option<usize>) -> Option<(String, usize)> {
        let mut count: HashMap<usize, usize> = HashMap::new();
        for &e in set {
            for &s in &self.on_node[e] {
                if Some(s) != skip {
                    *count.entry(s).or_default() += 1;
                }
            }
        }
        count
            .into_iter()
            .max_by_key(|&(s, c)| (c, std::cmp::Reverse(s)))
            .and_then(|(s, c)| self.slots[s].as_ref().map(|p| (p.tenant.clone(), c)))
    }

    /// How many nodes `set` shares with each placed tenant that shares any, by slot.
    /// Used by searches that extend a set node by node.
    pub fn overlap_counts(&self, set: &[NodeIdx]) -> HashMap<usize, usize> {
        let mut count: HashMap<usize, usize> = HashMap::new();
        for &e in set {
            for &s in &self.on_node[e] {
                *count.entry(s).or_default() += 1;
            }
        }
        count
    }

    /// Admits `req` on `set` after checking Eq. 2–6. A tenant already placed is
    /// refused: release it first (or use [`ClusterState::replace`]).
    pub fn commit(&mut self, req: &Request, set: &[NodeIdx]) -> Result<(), PlaceError> {
        if self.by_name.contains_key(&req.tenant) {
            return Err(PlaceError::AlreadyPlaced(req.tenant.clone()));
        }
        req.demand.validate("demand")?;
        self.feasible(req, set).map_err(PlaceError::Violates)?;
        let mut nodes = set.to_vec();
        nodes.sort_unstable();
        let placed = Placed {
            tenant: req.tenant.clone(),
            demand: req.demand,
            nodes,
        };
        self.insert(placed);
        Ok(())
    }

    /// Records `placed` (nodes sorted, already checked by the caller) in a free slot.
    fn insert(&mut self, placed: Placed) {
        let share = placed.share();
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        for &e in &placed.nodes {
            self.used[e] = self.used[e].plus(share);
            self.on_node[e].push(slot);
        }
        self.by_name.insert(placed.tenant.clone(), slot);
        self.slots[slot] = Some(placed);
    }

    /// Loads a placement made earlier (kept in the orchestrator's store) without checking
    /// it: the nodes' capacities or health may have changed since, and the caller wants
    /// to see what breaks ([`ClusterState::violations`]) rather than lose the record.
    /// Only structural errors are refused: unknown or repeated nodes, an empty set.
    pub fn restore(&mut self, placed: Placed) -> Result<(), PlaceError> {
        if self.by_name.contains_key(&placed.tenant) {
            return Err(PlaceError::AlreadyPlaced(placed.tenant));
        }
        placed.demand.validate("demand")?;
        if placed.nodes.is_empty() {
            return Err(PlaceError::invalid(
                "nodes",
                "a placement needs at least one node",
            ));
        }
        let mut nodes = placed.nodes.clone();
        nodes.sort_unstable();
        for (k, &e) in nodes.iter().enumerate() {
            if e >= self.nodes.len() {
                return Err(PlaceError::Violates(Violation::UnknownNode {
                    tenant: placed.tenant.clone(),
                    index: e,
                }));
            }
            if k > 0 && nodes[k - 1] == e {
                return Err(PlaceError::Violates(Violation::DuplicateNode {
                    tenant: placed.tenant.clone(),
                    node: self.nodes[e].id.clone(),
                }));
            }
        }
        self.insert(Placed { nodes, ..placed });
        Ok(())
    }

    /// A repaired set for a placed tenant that lost nodes (down, or gone): every node
    /// of `keep` stays, and nodes from `order` are added until the set has `want`
    /// nodes (clamped to G_min..=G_max), trying smaller sets down to G_min when `want`
    /// cannot be met. Only the lost shards move: a survivor is never swapped out.
    /// `None` when no feasible repair exists within `budget` search steps.
    pub fn repair(
        &self,
        req: &Request,
        keep: &[NodeIdx],
        want: usize,
        order: &[NodeIdx],
        budget: usize,
    ) -> Option<Vec<NodeIdx>> {
        let lo = self.limits.g_min.max(keep.len());
        let hi = want.clamp(lo, self.limits.g_max.max(lo));
        let mut steps = 0usize;
        for g in (lo..=hi).rev() {
            let extra: Vec<NodeIdx> = order
                .iter()
                .copied()
                .filter(|e| *e < self.nodes.len() && !keep.contains(e) && self.up[*e])
                .collect();
            let mut set = keep.to_vec();
            if self.repair_dfs(req, &extra, 0, g, &mut set, &mut steps, budget) {
                return Some(set);
            }
        }
        None
    }

    #[allow(clippy::too_many_arguments)]
    fn repair_dfs(
        &self,
        req: &Request,
        extra: &[NodeIdx],
        from: usize,
        g: usize,
        set: &mut Vec<NodeIdx>,
        steps: &mut usize,
        budget: usize,
    ) -> bool {
        if set.len() == g {
            return self.feasible(req, set).is_ok();
        }
        for i in from..extra.len() {
            if extra.len() - i < g - set.len() {
                return false;
            }
            *steps += 1;
            if *steps > budget {
                return false;
            }
            set.push(extra[i]);
            if self.repair_dfs(req, extra, i + 1, g, set, steps, budget) {
                return true;
            }
            set.pop();
        }
        false
    }

    /// Moves a placed tenant to `set` (and possibly a new demand), or changes nothing
    /// if the new set breaks a constraint.
    pub fn replace(&mut self, req: &Request, set: &[NodeIdx]) -> Result<(), PlaceError> {
        if !self.by_name.contains_key(&req.tenant) {
            return Err(PlaceError::UnknownTenant(req.tenant.clone()));
        }
        req.demand.validate("demand")?;
        self.feasible(req, set).map_err(PlaceError::Violates)?;
        self.release(&req.tenant);
        self.commit(req, set)
    }

    /// Removes a tenant; returns what it held.
    pub fn release(&mut self, tenant: &str) -> Option<Placed> {
        let slot = self.by_name.remove(tenant)?;
        let placed = self.slots[slot].take()?;
        let share = placed.share();
        for &e in &placed.nodes {
            self.used[e] = self.used[e].saturating_sub(share);
            self.on_node[e].retain(|&s| s != slot);
            if self.on_node[e].is_empty() {
                // No drift from rounding on an empty node.
                self.used[e] = Resources::ZERO;
            }
        }
        self.free_slots.push(slot);
        Some(placed)
    }

    /// Changes a placed tenant's reservation in place (its traffic changed). This may
    /// push its nodes over U; [`ClusterState::overloaded`] then lists them.
    pub fn set_demand(&mut self, tenant: &str, demand: Resources) -> Result<(), PlaceError> {
        demand.validate("demand")?;
        let slot = *self
            .by_name
            .get(tenant)
            .ok_or_else(|| PlaceError::UnknownTenant(tenant.to_string()))?;
        let Some(p) = self.slots[slot].as_mut() else {
            return Err(PlaceError::UnknownTenant(tenant.to_string()));
        };
        let old = p.share();
        p.demand = demand;
        let new = p.share();
        for &e in &p.nodes {
            self.used[e] = self.used[e].saturating_sub(old).plus(new);
        }
        Ok(())
    }

    /// Nodes whose reservations exceed U in some dimension.
    pub fn overloaded(&self) -> Vec<NodeIdx> {
        (0..self.nodes.len())
            .filter(|&e| !self.used[e].fits_in(&self.limit(e)))
            .collect()
    }

    /// The state as an offline instance and placement, for [`check`].
    pub fn snapshot(&self) -> (Instance, Placement) {
        let mut requests = Vec::new();
        let mut sets = Vec::new();
        let mut placed: Vec<&Placed> = self.tenants().collect();
        placed.sort_by(|a, b| a.tenant.cmp(&b.tenant));
        for p in placed {
            requests.push(Request {
                tenant: p.tenant.clone(),
                demand: p.demand,
            });
            sets.push(p.nodes.clone());
        }
        (
            Instance {
                nodes: self.nodes.clone(),
                requests,
                limits: self.limits,
            },
            Placement { sets },
        )
    }

    /// Every constraint the current state breaks (overload after [`set_demand`],
    /// tenants on down nodes included).
    ///
    /// [`set_demand`]: ClusterState::set_demand
    pub fn violations(&self) -> Vec<Violation> {
        let (inst, p) = self.snapshot();
        let mut v = check(&inst, &p);
        for t in self.tenants() {
            for &e in &t.nodes {
                if !self.up[e] {
                    v.push(Violation::NodeDown {
                        tenant: t.tenant.clone(),
                        node: self.nodes[e].id.clone(),
                    });
                }
            }
        }
        v
    }

    /// The first feasible set for `req` that takes nodes in the order of `order`
    /// (a depth-first search over combinations, trying G = G_min first), visiting at
    /// most `budget` partial sets. First Fit passes index order, Best Fit the order of
    /// tightest fit, the Filtering Algorithm its top-k.
    pub fn first_feasible(
        &self,
        req: &Request,
        order: &[NodeIdx],
        budget: usize,
    ) -> Option<Vec<NodeIdx>> {
        let mut steps = 0usize;
        for g in self.limits.g_min..=self.limits.g_max {
            let share = req.demand.scale(1.0 / g as f64);
            let cands: Vec<NodeIdx> = order
                .iter()
                .copied()
                .filter(|&e| e < self.nodes.len() && self.fits(e, &share))
                .collect();
            if cands.len() < g {
                continue;
            }
            let mut set = Vec::with_capacity(g);
            let mut counts: HashMap<usize, usize> = HashMap::new();
            if self.dfs(&cands, 0, g, &mut set, &mut counts, &mut steps, budget) {
                return Some(set);
            }
            if steps >= budget {
                return None;
            }
        }
        None
    }

    #[allow(clippy::too_many_arguments)]
    fn dfs(
        &self,
        cands: &[NodeIdx],
        from: usize,
        g: usize,
        set: &mut Vec<NodeIdx>,
        counts: &mut HashMap<usize, usize>,
        steps: &mut usize,
        budget: usize,
    ) -> bool {
        if set.len() == g {
            return true;
        }
        for i in from..cands.len() {
            if cands.len() - i < g - set.len() {
                return false;
            }
            *steps += 1;
            if *steps > budget {
                return false;
            }
            let e = cands[i];
            let ok = self.on_node[e]
                .iter()
                .all(|s| counts.get(s).copied().unwrap_or(0) < self.limits.overlap);
            if !ok {
                continue;
            }
            for &s in &self.on_node[e] {
                *counts.entry(s).or_default() += 1;
            }
            set.push(e);
            if self.dfs(cands, i + 1, g, set, counts, steps, budget) {
                return true;
            }
            set.pop();
            for &s in &self.on_node[e] {
                if let Some(c) = counts.get_mut(&s) {
                    *c -= 1;
                }
            }
        }
        false
    }
}

/// An algorithm that chooses a tenant's nodes, one request at a time (App. A.2's
/// sequential decision). The answer must pass [`ClusterState::feasible`]; callers
/// check it anyway and fall back (the orchestrator to Best Fit).
pub trait Placer {
    /// Short name used in benches and events (`ff`, `bf`, `ddqn`, ...).
    fn name(&self) -> &str;
    /// Nodes for `req`, which is not placed in `state`.
    fn place(&mut self, state: &ClusterState, req: &Request) -> Result<Vec<NodeIdx>, PlaceError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, c: f64, price: f64) -> Node {
        Node {
            id: id.into(),
            capacity: Resources::new(c, c, c),
            price,
        }
    }

    fn req(t: &str, d: f64) -> Request {
        Request {
            tenant: t.into(),
            demand: Resources::new(d, d, d),
        }
    }

    fn limits(g_min: usize, g_max: usize, o: usize) -> Limits {
        Limits {
            threshold: 0.8,
            g_min,
            g_max,
            overlap: o,
        }
    }

    #[test]
    fn checker_names_each_equation() {
        let inst = Instance {
            nodes: vec![
                node("a", 10.0, 1.0),
                node("b", 10.0, 1.0),
                node("c", 10.0, 1.0),
            ],
            requests: vec![req("t1", 20.0), req("t2", 1.0), req("t3", 1.0)],
            limits: limits(2, 2, 1),
        };
        // t1 puts 10 on a and b: over U·10 = 8 in three dimensions each.
        // t2 and t3 both on {a, b}: overlap 2 > 1 with each other and with t1.
        // t3 also lists a node that does not exist.
        let p = Placement {
            sets: vec![vec![0, 1], vec![0, 1], vec![0, 1, 7]],
        };
        let v = check(&inst, &p);
        assert!(v
            .iter()
            .any(|x| matches!(x, Violation::Capacity { node, .. } if node == "a")));
        assert!(v
            .iter()
            .any(|x| matches!(x, Violation::Overlap { shared: 2, .. })));
        assert!(v
            .iter()
            .any(|x| matches!(x, Violation::UnknownNode { index: 7, .. })));
        assert!(!v.iter().any(|x| matches!(x, Violation::GroupSize { .. })));
        let ok = Placement {
            sets: vec![vec![0, 1], vec![1, 2], vec![0, 2]],
        };
        let inst2 = Instance {
            requests: vec![req("t1", 2.0), req("t2", 1.0), req("t3", 1.0)],
            ..inst
        };
        assert_eq!(check(&inst2, &ok), vec![]);
        assert_eq!(cost(&inst2, &ok), 3.0);
    }

    #[test]
    fn bad_limits_name_the_field() {
        let e = Limits::checked(0.8, 3, 2, 1).unwrap_err();
        assert!(
            matches!(&e, PlaceError::Invalid { field, .. } if field == "g_max"),
            "{e}"
        );
        let e = Limits::checked(0.8, 1, 2, -1).unwrap_err();
        assert!(
            matches!(&e, PlaceError::Invalid { field, .. } if field == "overlap"),
            "{e}"
        );
        let e =
            serde_json::from_str::<Limits>(r#"{"threshold":0.8,"g_min":1,"g_max":2,"overlap":-1}"#)
                .unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        let e = Resources::new(1.0, -1.0, 0.0)
            .validate("demand")
            .unwrap_err();
        assert!(e.to_string().contains("demand.cpu"), "{e}");
    }

    #[test]
    fn state_keeps_constraints_and_search_respects_overlap() {
        let nodes = (0..4).map(|i| node(&format!("n{i}"), 10.0, 1.0)).collect();
        let mut s = ClusterState::new(nodes, limits(2, 2, 1)).unwrap();
        let order: Vec<NodeIdx> = (0..4).collect();
        let a = s.first_feasible(&req("a", 2.0), &order, 1000).unwrap();
        assert_eq!(a, vec![0, 1]);
        s.commit(&req("a", 2.0), &a).unwrap();
        // {0,1} is taken by a with O = 1: b may share one node only.
        let b = s.first_feasible(&req("b", 2.0), &order, 1000).unwrap();
        assert_eq!(b, vec![0, 2]);
        s.commit(&req("b", 2.0), &b).unwrap();
        assert!(matches!(
            s.commit(&req("c", 2.0), &[0, 1]),
            Err(PlaceError::Violates(Violation::Overlap { .. }))
        ));
        // Capacity: 8 per node at U = 0.8; a and b put 1 + 1 on node 0.
        assert!(matches!(
            s.commit(&req("c", 14.0), &[0, 3]),
            Err(PlaceError::Violates(Violation::Capacity { .. }))
        ));
        assert_eq!(s.cost(), 3.0);
        assert!(s.violations().is_empty());
        s.set_demand("a", Resources::new(16.0, 1.0, 1.0)).unwrap();
        assert_eq!(s.overloaded(), vec![0]);
        s.release("a").unwrap();
        assert!(s.overloaded().is_empty());
        assert_eq!(s.used(1), Resources::ZERO);
        assert_eq!(s.cost(), 2.0);
        s.set_up(2, false);
        assert_eq!(s.violations().len(), 1);
    }

    #[test]
    fn repair_keeps_survivors_and_restore_takes_old_records() {
        let nodes = (0..5).map(|i| node(&format!("n{i}"), 10.0, 1.0)).collect();
        let mut s = ClusterState::new(nodes, limits(3, 3, 2)).unwrap();
        s.restore(Placed {
            tenant: "a".into(),
            demand: Resources::new(3.0, 3.0, 3.0),
            nodes: vec![2, 0, 1],
        })
        .unwrap();
        s.commit(&req("b", 3.0), &[0, 1, 3]).unwrap();
        assert_eq!(s.placed("a").unwrap().nodes, vec![0, 1, 2]);
        // Node 1 fails: a keeps 0 and 2, b keeps 0 and 3.
        s.set_up(1, false);
        let order: Vec<NodeIdx> = (0..5).collect();
        let a = s.release("a").unwrap();
        let ra = Request {
            tenant: "a".into(),
            demand: a.demand,
        };
        let set = s.repair(&ra, &[0, 2], 3, &order, 1000).unwrap();
        assert!(
            set.contains(&0) && set.contains(&2) && !set.contains(&1),
            "{set:?}"
        );
        s.commit(&ra, &set).unwrap();
        let b = s.release("b").unwrap();
        let rb = Request {
            tenant: "b".into(),
            demand: b.demand,
        };
        let set = s.repair(&rb, &[0, 3], 3, &order, 1000).unwrap();
        assert!(set.contains(&0) && set.contains(&3), "{set:?}");
        s.commit(&rb, &set).unwrap();
        assert!(s.violations().is_empty(), "{:?}", s.violations());
        assert!(matches!(
            s.restore(Placed {
                tenant: "c".into(),
                demand: Resources::ZERO,
                nodes: vec![0, 0]
            }),
            Err(PlaceError::Violates(Violation::DuplicateNode { .. }))
        ));
    }
}
