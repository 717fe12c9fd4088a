//! Zeta (paper 003) §VI-A: the gateway cluster mapping (GCM) problem and RGCM, its
//! rounding-based approximation.
//!
//! Notation follows the paper: clusters `c` with forwarding capacity B(c), tenants `t`
//! (d of them) each with VPCs `v` of traffic demand f(v), and the tenant constraint k
//! (a tenant's VPCs go to at most k clusters). GCM (Eq. 1) maps every VPC to exactly
//! one cluster and minimises the load-balancing factor λ = max_c load(c) / B(c).
//!
//! What is here:
//! - [`solve_lp`]: LP-GCM, the relaxation of Eq. 1 (x, y ∈ [0, 1]) → x̃, ỹ, λ̃.
//! - [`round`] / [`rgcm`]: Alg. 1's randomised rounding, seeded, with the check of
//!   Theorems 4 and 5 ([`TheoremBounds`]).
//! - [`solve_milp`]: the exact GCM (binary x, y) for small instances.
//! - [`map_vpcs`] / [`place_tenant`]: the incremental rule the orchestrator uses when a
//!   tenant (or a tenant's new VPC) arrives, with at most k clusters per tenant, hard.
//! - [`greedy`]: that rule applied to every tenant in turn; a baseline, and the MILP's
//!   warm start.
//!
//! A remark that shapes how the results read: LP-GCM is weak. Spreading every VPC over
//! all clusters in proportion to capacity (x̃_v^c = ỹ_t^c = B(c)/ΣB) satisfies every
//! constraint with Σ_c ỹ_t^c = 1 ≤ k, so λ̃ = Σf / ΣB for every instance, whatever k is.
//! The LP is a lower bound that ignores the tenant constraint and the indivisibility
//! of VPCs; which optimal vertex the simplex returns decides how good the rounding is.

use std::collections::{HashMap, HashSet};

use good_lp::{
    constraint, microlp, variable, Expression, ProblemVariables, ResolutionError, Solution,
    SolutionStatus, SolverModel, Variable, WithInitialSolution, WithMipGap, WithTimeLimit,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use tracing::debug;

use crate::problem::{unique_id, PlaceError};

/// Tolerance for comparing loads and LP values (the LP solver works to ~1e-9).
const EPS: f64 = 1e-7;

/// LP values below this count as zero: simplex leaves noise of order 1e-12.
const LP_ZERO: f64 = 1e-9;

/// A gateway (PP) cluster and its forwarding capacity B(c).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GcmCluster {
    pub id: String,
    /// B(c), in the same unit as the VPC demands (Gbit/s, packets/s…). Must be > 0.
    pub capacity: f64,
}

/// A VPC and its traffic demand f(v).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GcmVpc {
    /// Unique within its tenant (the orchestrator's VPC names are per tenant).
    pub id: String,
    pub demand: f64,
}

/// A tenant and its VPC set V_t.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GcmTenant {
    pub id: String,
    /// May be empty: a tenant without VPCs takes part in nothing and is mapped to no
    /// cluster (the orchestrator creates tenants before their VPCs).
    #[serde(default)]
    pub vpcs: Vec<GcmVpc>,
}

/// One GCM instance: C, T (with the V_t) and k.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "RawGcmInstance")]
pub struct GcmInstance {
    pub clusters: Vec<GcmCluster>,
    pub tenants: Vec<GcmTenant>,
    /// The tenant constraint: most clusters one tenant's VPCs may be mapped to.
    pub k: usize,
}

/// The instance as it arrives on the wire: k signed, so `-1` is named in the error
/// instead of failing as "expected usize", and the whole instance is validated.
#[derive(Deserialize)]
struct RawGcmInstance {
    clusters: Vec<GcmCluster>,
    #[serde(default)]
    tenants: Vec<GcmTenant>,
    k: i64,
}

impl TryFrom<RawGcmInstance> for GcmInstance {
    type Error = PlaceError;
    fn try_from(r: RawGcmInstance) -> Result<Self, PlaceError> {
        if r.k < 1 {
            return Err(PlaceError::invalid(
                "k",
                format!("the tenant constraint k must be ≥ 1, got {}", r.k),
            ));
        }
        let inst = GcmInstance {
            clusters: r.clusters,
            tenants: r.tenants,
            k: r.k as usize,
        };
        inst.validate()?;
        Ok(inst)
    }
}

impl GcmInstance {
    /// Checks every field; the error names the first bad one (`clusters[2].capacity`,
    /// `tenants[0].vpcs[3].demand`, `k`…). Demand beyond total capacity is not an
    /// error: GCM's λ may exceed 1, and the result reports it.
    pub fn validate(&self) -> Result<(), PlaceError> {
        if self.k == 0 {
            return Err(PlaceError::invalid(
                "k",
                "the tenant constraint k must be ≥ 1, got 0",
            ));
        }
        if self.clusters.is_empty() {
            return Err(PlaceError::invalid(
                "clusters",
                "there must be at least one",
            ));
        }
        validate_clusters(&self.clusters)?;
        let mut tenant_ids = HashSet::new();
        for (ti, t) in self.tenants.iter().enumerate() {
            unique_id(&mut tenant_ids, &t.id, format!("tenants[{ti}].id"), || {
                format!("duplicate tenant id {:?}", t.id)
            })?;
            validate_vpcs(&t.vpcs, &format!("tenants[{ti}].vpcs"))?;
        }
        Ok(())
    }

    /// d as the theorems use it: the tenants that have VPCs (only they are rounded).
    pub fn d(&self) -> usize {
        self.tenants.iter().filter(|t| !t.vpcs.is_empty()).count()
    }

    /// |V|.
    pub fn vpc_count(&self) -> usize {
        self.tenants.iter().map(|t| t.vpcs.len()).sum()
    }

    /// max_v f(v) (0 with no VPCs).
    pub fn max_demand(&self) -> f64 {
        self.tenants
            .iter()
            .flat_map(|t| t.vpcs.iter().map(|v| v.demand))
            .fold(0.0, f64::max)
    }

    /// Σ_v f(v).
    pub fn total_demand(&self) -> f64 {
        self.tenants
            .iter()
            .flat_map(|t| t.vpcs.iter().map(|v| v.demand))
            .sum()
    }

    /// min_c B(c): what the Theorem 5 check uses when capacities differ.
    pub fn min_capacity(&self) -> f64 {
        self.clusters
            .iter()
            .map(|c| c.capacity)
            .fold(f64::INFINITY, f64::min)
    }

    fn cluster_index(&self, id: &str) -> Option<usize> {
        self.clusters.iter().position(|c| c.id == id)
    }
}

fn validate_clusters(clusters: &[GcmCluster]) -> Result<(), PlaceError> {
    let mut ids = HashSet::new();
    for (ci, c) in clusters.iter().enumerate() {
        unique_id(&mut ids, &c.id, format!("clusters[{ci}].id"), || {
            format!("duplicate cluster id {:?}", c.id)
        })?;
        if !c.capacity.is_finite() || c.capacity <= 0.0 {
            return Err(PlaceError::invalid(
                format!("clusters[{ci}].capacity"),
                format!("B(c) must be a finite number > 0, got {}", c.capacity),
            ));
        }
    }
    Ok(())
}

fn validate_vpcs(vpcs: &[GcmVpc], field: &str) -> Result<(), PlaceError> {
    let mut ids = HashSet::new();
    for (vi, v) in vpcs.iter().enumerate() {
        unique_id(&mut ids, &v.id, format!("{field}[{vi}].id"), || {
            format!("duplicate VPC id {:?} in one tenant", v.id)
        })?;
        if !v.demand.is_finite() || v.demand < 0.0 {
            return Err(PlaceError::invalid(
                format!("{field}[{vi}].demand"),
                format!("f(v) must be a finite number ≥ 0, got {}", v.demand),
            ));
        }
    }
    Ok(())
}

/// A VPC → cluster mapping by index: `assign[t][v]` is the cluster of tenant t's v-th
/// VPC. One index per VPC, so "exactly one cluster per VPC" holds by construction once
/// [`check_mapping`] has checked the shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GcmMapping {
    pub assign: Vec<Vec<usize>>,
}

/// One VPC's cluster, by name: the form the orchestrator stores and sends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VpcPlacement {
    pub tenant: String,
    pub vpc: String,
    pub cluster: String,
}

impl GcmMapping {
    /// The mapping by name, in tenant then VPC order.
    pub fn named(&self, inst: &GcmInstance) -> Result<Vec<VpcPlacement>, PlaceError> {
        check_mapping(inst, self)?;
        Ok(inst
            .tenants
            .iter()
            .zip(&self.assign)
            .flat_map(|(t, a)| {
                t.vpcs.iter().zip(a).map(|(v, &c)| VpcPlacement {
                    tenant: t.id.clone(),
                    vpc: v.id.clone(),
                    cluster: inst.clusters[c].id.clone(),
                })
            })
            .collect())
    }

    /// A mapping from named placements: every VPC of `inst` must appear exactly once,
    /// and nothing else may appear. This is the "each VPC maps to exactly one cluster"
    /// check for a mapping that came from outside.
    pub fn from_named(inst: &GcmInstance, placed: &[VpcPlacement]) -> Result<Self, PlaceError> {
        inst.validate()?;
        let mut assign: Vec<Vec<Option<usize>>> = inst
            .tenants
            .iter()
            .map(|t| vec![None; t.vpcs.len()])
            .collect();
        let index = vpc_index(inst);
        for (i, p) in placed.iter().enumerate() {
            let (t, v) = placed_vpc(&index, "placements", i, p)?;
            let c = placed_cluster(inst, "placements", i, p)?;
            if let Some(prev) = assign[t][v] {
                return Err(PlaceError::invalid(
                    format!("placements[{i}]"),
                    format!(
                        "VPC {:?} of tenant {:?} is mapped twice (to {:?} and {:?})",
                        p.vpc, p.tenant, inst.clusters[prev].id, p.cluster
                    ),
                ));
            }
            assign[t][v] = Some(c);
        }
        let mut out = Vec::with_capacity(assign.len());
        for (t, a) in assign.into_iter().enumerate() {
            let mut row = Vec::with_capacity(a.len());
            for (v, c) in a.into_iter().enumerate() {
                row.push(c.ok_or_else(|| {
                    PlaceError::invalid(
                        "placements",
                        format!(
                            "VPC {:?} of tenant {:?} is mapped to no cluster",
                            inst.tenants[t].vpcs[v].id, inst.tenants[t].id
                        ),
                    )
                })?);
            }
            out.push(row);
        }
        Ok(GcmMapping { assign: out })
    }
}

fn vpc_index(inst: &GcmInstance) -> HashMap<(&str, &str), (usize, usize)> {
    let mut index = HashMap::new();
    for (t, tenant) in inst.tenants.iter().enumerate() {
        for (v, vpc) in tenant.vpcs.iter().enumerate() {
            index.insert((tenant.id.as_str(), vpc.id.as_str()), (t, v));
        }
    }
    index
}

/// The (tenant, VPC) indices of placement `p`, the `i`th of the input `list`.
fn placed_vpc(
    index: &HashMap<(&str, &str), (usize, usize)>,
    list: &str,
    i: usize,
    p: &VpcPlacement,
) -> Result<(usize, usize), PlaceError> {
    index
        .get(&(p.tenant.as_str(), p.vpc.as_str()))
        .copied()
        .ok_or_else(|| {
            PlaceError::invalid(
                format!("{list}[{i}]"),
                format!("tenant {:?} has no VPC {:?}", p.tenant, p.vpc),
            )
        })
}

/// The index of the cluster placement `p`, the `i`th of the input `list`, names.
fn placed_cluster(
    inst: &GcmInstance,
    list: &str,
    i: usize,
    p: &VpcPlacement,
) -> Result<usize, PlaceError> {
    inst.cluster_index(&p.cluster).ok_or_else(|| {
        PlaceError::invalid(
            format!("{list}[{i}].cluster"),
            format!("no cluster {:?}", p.cluster),
        )
    })
}

/// Checks that `m` maps each VPC of `inst` to exactly one existing cluster: one row
/// per tenant, one entry per VPC, every entry a cluster index.
pub fn check_mapping(inst: &GcmInstance, m: &GcmMapping) -> Result<(), PlaceError> {
    if m.assign.len() != inst.tenants.len() {
        return Err(PlaceError::invalid(
            "mapping.assign",
            format!("{} rows for {} tenants", m.assign.len(), inst.tenants.len()),
        ));
    }
    for (t, (row, tenant)) in m.assign.iter().zip(&inst.tenants).enumerate() {
        if row.len() != tenant.vpcs.len() {
            return Err(PlaceError::invalid(
                format!("mapping.assign[{t}]"),
                format!(
                    "{} entries for the {} VPCs of tenant {:?}",
                    row.len(),
                    tenant.vpcs.len(),
                    tenant.id
                ),
            ));
        }
        if let Some((v, &c)) = row
            .iter()
            .enumerate()
            .find(|(_, &c)| c >= inst.clusters.len())
        {
            return Err(PlaceError::invalid(
                format!("mapping.assign[{t}][{v}]"),
                format!(
                    "cluster {c} does not exist ({} clusters)",
                    inst.clusters.len()
                ),
            ));
        }
    }
    Ok(())
}

/// Σ f(v) mapped to each cluster.
pub fn cluster_loads(inst: &GcmInstance, m: &GcmMapping) -> Result<Vec<f64>, PlaceError> {
    check_mapping(inst, m)?;
    let mut loads = vec![0.0; inst.clusters.len()];
    for (row, tenant) in m.assign.iter().zip(&inst.tenants) {
        for (&c, v) in row.iter().zip(&tenant.vpcs) {
            loads[c] += v.demand;
        }
    }
    Ok(loads)
}

/// λ of any mapping: max_c load(c) / B(c).
pub fn load_factor(inst: &GcmInstance, m: &GcmMapping) -> Result<f64, PlaceError> {
    let loads = cluster_loads(inst, m)?;
    Ok(lambda_of(&inst.clusters, &loads))
}

fn lambda_of(clusters: &[GcmCluster], loads: &[f64]) -> f64 {
    clusters
        .iter()
        .zip(loads)
        .map(|(c, l)| l / c.capacity)
        .fold(0.0, f64::max)
}

/// The distinct clusters each tenant's VPCs use, sorted.
pub fn tenant_clusters(inst: &GcmInstance, m: &GcmMapping) -> Result<Vec<Vec<usize>>, PlaceError> {
    check_mapping(inst, m)?;
    Ok(m.assign.iter().map(|row| distinct(row)).collect())
}

fn distinct(row: &[usize]) -> Vec<usize> {
    let mut cs = row.to_vec();
    cs.sort_unstable();
    cs.dedup();
    cs
}

/// LP-GCM's optimal fractional solution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LpGcm {
    /// λ̃: a lower bound on every mapping's λ (it equals Σf/ΣB, see the module doc).
    pub lambda: f64,
    /// x̃ as `x[t][v][c]`.
    pub x: Vec<Vec<Vec<f64>>>,
    /// ỹ as `y[t][c]`, as the solver returned it (any value from max_v x̃ to 1 is
    /// optimal too).
    pub y: Vec<Vec<f64>>,
}

impl LpGcm {
    /// ỹ lowered to max_{v∈V_t} x̃_v^c. This is still an optimal LP solution (x ≤ y
    /// holds, Σ_c ỹ only shrinks, λ̃ is unchanged), and it stops Alg. 1 from drawing a
    /// cluster that none of the tenant's VPCs has any x̃ on: the simplex is free to
    /// leave ỹ anywhere above x̃, because nothing in the objective pushes it down.
    pub fn tightened_y(&self) -> Vec<Vec<f64>> {
        self.x
            .iter()
            .zip(&self.y)
            .map(|(xt, yt)| {
                (0..yt.len())
                    .map(|c| xt.iter().map(|xv| xv[c]).fold(0.0, f64::max))
                    .collect()
            })
            .collect()
    }
}

fn solver_error(what: &str, e: ResolutionError) -> PlaceError {
    PlaceError::Infeasible {
        tenant: None,
        reason: format!("{what}: {e}"),
    }
}

/// The model of Eq. 1 over `inst`, with x and y either continuous in [0, 1] (LP-GCM)
/// or binary (GCM). Demands and capacities are divided by max B(c): λ is a ratio, so
/// that changes nothing but keeps the simplex's numbers near 1.
struct Model {
    vars: ProblemVariables,
    lambda: Variable,
    x: Vec<Vec<Vec<Variable>>>,
    y: Vec<Vec<Variable>>,
    constraints: Vec<good_lp::Constraint>,
}

/// λ, x[t][v][c] and y[t][c]: the variables a hint sets and a solution is read by.
type Unknowns = (Variable, Vec<Vec<Vec<Variable>>>, Vec<Vec<Variable>>);

impl Model {
    /// The microlp problem of minimising λ under the model's constraints.
    fn into_microlp(self) -> (good_lp::solvers::microlp::MicroLpProblem, Unknowns) {
        let mut problem = self.vars.minimise(self.lambda).using(microlp);
        for c in self.constraints {
            problem.add_constraint(c);
        }
        (problem, (self.lambda, self.x, self.y))
    }
}

fn build(inst: &GcmInstance, binary: bool) -> Model {
    let n = inst.clusters.len();
    let scale = inst.clusters.iter().map(|c| c.capacity).fold(0.0, f64::max);
    let mut vars = ProblemVariables::new();
    let lambda = vars.add(variable().min(0.0));
    let def = || {
        if binary {
            variable().binary()
        } else {
            variable().min(0.0).max(1.0)
        }
    };
    let mut x = Vec::with_capacity(inst.tenants.len());
    let mut y = Vec::with_capacity(inst.tenants.len());
    for t in &inst.tenants {
        // A tenant without VPCs gets no variables: it constrains nothing.
        let yt: Vec<Variable> = if t.vpcs.is_empty() {
            Vec::new()
        } else {
            (0..n).map(|_| vars.add(def())).collect()
        };
        let xt: Vec<Vec<Variable>> = t
            .vpcs
            .iter()
            .map(|_| (0..n).map(|_| vars.add(def())).collect())
            .collect();
        x.push(xt);
        y.push(yt);
    }
    let mut constraints = Vec::new();
    // Σ_c x_v^c = 1: the VPC constraint.
    for xt in &x {
        for xv in xt {
            let sum: Expression = xv.iter().copied().sum();
            constraints.push(constraint!(sum == 1.0));
        }
    }
    // Σ_v x_v^c f(v) ≤ λ B(c).
    for (c, cl) in inst.clusters.iter().enumerate() {
        let mut load = Expression::from(0.0);
        for (t, tenant) in inst.tenants.iter().enumerate() {
            for (v, vpc) in tenant.vpcs.iter().enumerate() {
                if vpc.demand > 0.0 {
                    load += (vpc.demand / scale) * x[t][v][c];
                }
            }
        }
        let cap = cl.capacity / scale;
        constraints.push(constraint!(load <= cap * lambda));
    }
    // x_v^c ≤ y_t^c, and Σ_c y_t^c ≤ k: the tenant constraint.
    for (xt, yt) in x.iter().zip(&y) {
        for xv in xt {
            for (&xc, &yc) in xv.iter().zip(yt) {
                constraints.push(constraint!(xc <= yc));
            }
        }
        if !yt.is_empty() {
            let sum: Expression = yt.iter().copied().sum();
            constraints.push(constraint!(sum <= inst.k as f64));
        }
    }
    Model {
        vars,
        lambda,
        x,
        y,
        constraints,
    }
}

/// Solves LP-GCM (the relaxation of Eq. 1) with microlp.
pub fn solve_lp(inst: &GcmInstance) -> Result<LpGcm, PlaceError> {
    inst.validate()?;
    let (model, (lambda, x, y)) = build(inst, false).into_microlp();
    let sol = model.solve().map_err(|e| solver_error("LP-GCM", e))?;
    let clamp = |v: f64| {
        if v < LP_ZERO {
            0.0
        } else {
            v.min(1.0)
        }
    };
    let lp = LpGcm {
        lambda: sol.value(lambda).max(0.0),
        x: x.iter()
            .map(|xt| {
                xt.iter()
                    .map(|xv| xv.iter().map(|&v| clamp(sol.value(v))).collect())
                    .collect()
            })
            .collect(),
        y: y.iter()
            .map(|yt| {
                if yt.is_empty() {
                    vec![0.0; inst.clusters.len()]
                } else {
                    yt.iter().map(|&v| clamp(sol.value(v))).collect()
                }
            })
            .collect(),
    };
    debug!(
        clusters = inst.clusters.len(),
        vpcs = inst.vpc_count(),
        lambda = lp.lambda,
        "LP-GCM solved"
    );
    Ok(lp)
}

/// How [`round`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RgcmOptions {
    /// Seed of the ChaCha8 generator: the same seed and LP give the same mapping.
    pub seed: u64,
    /// Round with [`LpGcm::tightened_y`] instead of the solver's ỹ (default true).
    pub tighten_y: bool,
    /// Rounds of Alg. 1's "repeat until |C_t| > 0" before giving up on chance and
    /// taking the cluster with the largest ỹ. Each round succeeds with probability at
    /// least max_c ỹ ≥ 1/n (Σ_c ỹ ≥ 1 for a tenant with a VPC), so the fallback is
    /// for pathological LP output, not a case expected to happen.
    pub max_rounds: usize,
}

impl RgcmOptions {
    /// The defaults with generator seed `seed`.
    pub fn seeded(seed: u64) -> Self {
        RgcmOptions {
            seed,
            ..Default::default()
        }
    }
}

impl Default for RgcmOptions {
    fn default() -> Self {
        RgcmOptions {
            seed: 0,
            tighten_y: true,
            max_rounds: 10_000,
        }
    }
}

/// Theorems 4 and 5 evaluated on one rounded result.
///
/// Both are with-high-probability statements: each holds with probability at least
/// 1 − 1/d², which is 0 at d = 1 and 3/4 at d = 2. On few tenants a violation is
/// allowed by the theorems and is reported here, not hidden.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TheoremBounds {
    /// d: tenants with VPCs.
    pub d: usize,
    pub k: usize,
    /// 1 − 1/d² (0 for d ≤ 1): the probability the theorems promise.
    pub probability: f64,
    /// Theorem 4's factor 3 ln d / k + 3 (ln 1 = 0, so 3 at d = 1).
    pub tenant_factor: f64,
    /// (3 ln d / k + 3) · k = 3 ln d + 3k.
    pub tenant_limit: f64,
    /// max_t |C_t|: the clusters drawn for a tenant (ŷ = 1), the quantity Theorem 4
    /// bounds. The clusters its VPCs end up on are a subset.
    pub max_tenant_clusters: usize,
    pub tenant_bound_ok: bool,
    /// β = λ̃ · B_min / max f(v), Eq. 13. With heterogeneous capacities the smallest
    /// B(c) is used: each cluster's own β_c ≥ β, so the factor from β is the loosest
    /// one and holds for every cluster at once. `None` when λ̃ or max f is 0.
    pub beta: Option<f64>,
    /// Theorem 5's factor 3 ln d / β + 3.
    pub lambda_factor: Option<f64>,
    /// (3 ln d / β + 3) · λ̃.
    pub lambda_limit: Option<f64>,
    /// λ ≤ lambda_limit (when every demand is 0, λ = λ̃ = 0 and this is true).
    pub lambda_bound_ok: bool,
}

/// Evaluates Theorems 4 and 5 for a result with the given λ̃, λ and max_t |C_t|.
pub fn theorem_bounds(
    inst: &GcmInstance,
    lambda_lp: f64,
    lambda: f64,
    max_tenant_clusters: usize,
) -> TheoremBounds {
    let d = inst.d();
    let k = inst.k;
    // ln 1 = 0: with one tenant the factors are exactly 3 (and the promise is void).
    let ln_d = if d > 1 { (d as f64).ln() } else { 0.0 };
    let probability = if d > 1 {
        1.0 - 1.0 / (d as f64 * d as f64)
    } else {
        0.0
    };
    let tenant_factor = 3.0 * ln_d / k as f64 + 3.0;
    let tenant_limit = tenant_factor * k as f64;
    let max_f = inst.max_demand();
    let beta = (lambda_lp > 0.0 && max_f > 0.0).then(|| lambda_lp * inst.min_capacity() / max_f);
    let lambda_factor = beta.map(|b| 3.0 * ln_d / b + 3.0);
    let lambda_limit = lambda_factor.map(|f| f * lambda_lp);
    let lambda_bound_ok = match lambda_limit {
        Some(l) => lambda <= l * (1.0 + EPS) + EPS,
        None => lambda <= EPS,
    };
    TheoremBounds {
        d,
        k,
        probability,
        tenant_factor,
        tenant_limit,
        max_tenant_clusters,
        tenant_bound_ok: max_tenant_clusters as f64 <= tenant_limit + EPS,
        beta,
        lambda_factor,
        lambda_limit,
        lambda_bound_ok,
    }
}

/// RGCM's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RgcmResult {
    pub mapping: GcmMapping,
    /// The clusters each tenant's VPCs are on (sorted): ⊆ `drawn_clusters`.
    pub tenant_clusters: Vec<Vec<usize>>,
    /// C_t as Alg. 1 drew it (ŷ_t^c = 1), sorted.
    pub drawn_clusters: Vec<Vec<usize>>,
    /// Σ f(v) per cluster.
    pub loads: Vec<f64>,
    /// λ of the rounded mapping.
    pub lambda: f64,
    /// λ̃ of LP-GCM.
    pub lambda_lp: f64,
    /// Extra rounds of "repeat until |C_t| > 0", over all tenants.
    pub redraws: usize,
    /// Tenants whose C_t came from the max_rounds fallback (expected 0).
    pub forced_draws: usize,
    /// VPCs with x̃ = 0 on every drawn cluster, placed by the fallback rule (see
    /// [`round`]).
    pub fallback_vpcs: usize,
    pub bounds: TheoremBounds,
}

impl RgcmResult {
    /// Both theorem checks passed.
    pub fn bound_ok(&self) -> bool {
        self.bounds.tenant_bound_ok && self.bounds.lambda_bound_ok
    }
}

/// LP-GCM, then Alg. 1's rounding with `opts.seed`.
pub fn rgcm(inst: &GcmInstance, opts: &RgcmOptions) -> Result<RgcmResult, PlaceError> {
    let lp = solve_lp(inst)?;
    round(inst, &lp, opts)
}

/// Alg. 1 step 2 on a solved LP (so a bench can draw many seeds from one LP).
///
/// - Per tenant (in order): each cluster c is drawn into C_t with probability ỹ_t^c,
///   independently; the draw repeats until C_t is not empty (lines 5–10).
/// - Per VPC (in tenant order, then VPC order): one cluster of C_t is chosen with
///   probability proportional to x̃_v^c / ỹ_t^c, by a uniform ξ on
///   [0, Σ_{c∈C_t} x̃_v^c / ỹ_t^c] and the interval it falls in (lines 11–16).
/// - If x̃_v^c = 0 on every cluster of C_t (a VPC whose LP mass lies only on clusters
///   the tenant did not draw, which Alg. 1 leaves undefined), the VPC goes to the
///   cluster of C_t with the lowest (load + f(v)) / B(c), counting the VPCs placed so
///   far. It stays inside C_t so the tenant's footprint, which Theorem 4 bounds, does
///   not grow; and least-loaded because the LP gave no preference there.
pub fn round(inst: &GcmInstance, lp: &LpGcm, opts: &RgcmOptions) -> Result<RgcmResult, PlaceError> {
    inst.validate()?;
    let n = inst.clusters.len();
    let shape_ok = lp.x.len() == inst.tenants.len()
        && lp.y.len() == inst.tenants.len()
        && lp
            .x
            .iter()
            .zip(&inst.tenants)
            .all(|(xt, t)| xt.len() == t.vpcs.len() && xt.iter().all(|xv| xv.len() == n))
        && lp.y.iter().all(|yt| yt.len() == n);
    if !shape_ok {
        return Err(PlaceError::invalid(
            "lp",
            "the LP solution does not have the instance's shape",
        ));
    }
    let y = if opts.tighten_y {
        lp.tightened_y()
    } else {
        lp.y.clone()
    };
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    let mut loads = vec![0.0; n];
    let mut assign = Vec::with_capacity(inst.tenants.len());
    let mut drawn_all = Vec::with_capacity(inst.tenants.len());
    let (mut redraws, mut forced, mut fallback) = (0, 0, 0);
    for (t, tenant) in inst.tenants.iter().enumerate() {
        if tenant.vpcs.is_empty() {
            assign.push(Vec::new());
            drawn_all.push(Vec::new());
            continue;
        }
        let yt = &y[t];
        let mut drawn: Vec<usize> = Vec::new();
        for round in 0..opts.max_rounds.max(1) {
            if round > 0 {
                redraws += 1;
            }
            drawn = (0..n).filter(|&c| rng.gen::<f64>() < yt[c]).collect();
            if !drawn.is_empty() {
                break;
            }
        }
        if drawn.is_empty() {
            forced += 1;
            let best = (0..n)
                .max_by(|&a, &b| yt[a].total_cmp(&yt[b]).then(b.cmp(&a)))
                .unwrap_or(0);
            drawn.push(best);
        }
        let mut row = Vec::with_capacity(tenant.vpcs.len());
        for (v, vpc) in tenant.vpcs.iter().enumerate() {
            let weights: Vec<f64> = drawn
                .iter()
                .map(|&c| {
                    let x = lp.x[t][v][c];
                    if x > LP_ZERO && yt[c] > LP_ZERO {
                        x / yt[c]
                    } else {
                        0.0
                    }
                })
                .collect();
            let total: f64 = weights.iter().sum();
            let c = if total > 0.0 {
                let xi = rng.gen::<f64>() * total;
                let mut acc = 0.0;
                // The last cluster with weight catches ξ that rounding pushes past the
                // final interval's end.
                let mut chosen = drawn[weights.iter().rposition(|&w| w > 0.0).unwrap_or(0)];
                for (&c, &w) in drawn.iter().zip(&weights) {
                    acc += w;
                    if w > 0.0 && xi < acc {
                        chosen = c;
                        break;
                    }
                }
                chosen
            } else {
                fallback += 1;
                least_loaded(&inst.clusters, &loads, &drawn, vpc.demand)
            };
            loads[c] += vpc.demand;
            row.push(c);
        }
        assign.push(row);
        drawn_all.push(drawn);
    }
    let mapping = GcmMapping { assign };
    let lambda = lambda_of(&inst.clusters, &loads);
    let tenant_clusters: Vec<Vec<usize>> = mapping.assign.iter().map(|r| distinct(r)).collect();
    let max_drawn = drawn_all.iter().map(Vec::len).max().unwrap_or(0);
    let bounds = theorem_bounds(inst, lp.lambda, lambda, max_drawn);
    debug!(
        seed = opts.seed,
        lambda,
        lambda_lp = lp.lambda,
        redraws,
        fallback,
        "RGCM rounded"
    );
    Ok(RgcmResult {
        mapping,
        tenant_clusters,
        drawn_clusters: drawn_all,
        loads,
        lambda,
        lambda_lp: lp.lambda,
        redraws,
        forced_draws: forced,
        fallback_vpcs: fallback,
        bounds,
    })
}

/// The cluster of `among` with the lowest (load + f) / B, ties to the lower index.
fn least_loaded(clusters: &[GcmCluster], loads: &[f64], among: &[usize], f: f64) -> usize {
    among
        .iter()
        .copied()
        .min_by(|&a, &b| {
            let la = (loads[a] + f) / clusters[a].capacity;
            let lb = (loads[b] + f) / clusters[b].capacity;
            la.total_cmp(&lb).then(a.cmp(&b))
        })
        .unwrap_or(0)
}

/// How [`solve_milp`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MilpOptions {
    /// Wall-clock limit for microlp's branch and bound. microlp (through good_lp
    /// 1.15) honours it inside the simplex too; at the limit the best mapping found
    /// is returned with `optimal = false`. `None`: run to proven optimality.
    pub time_limit_s: Option<f64>,
    /// Most binary variables (n·(|V| + d)) accepted: beyond this, microlp's branch
    /// and bound on Eq. 1 (whose identical clusters make many symmetric optima) is
    /// not a tool for the job, and the call is refused instead of running for hours.
    pub max_binaries: usize,
    /// Start from [`greedy`]'s mapping (always feasible, so a time-limited run has an
    /// incumbent from the start).
    pub warm_start: bool,
    /// Relative gap at which the search may stop (`None`: prove exact optimality).
    /// LP-GCM's bound is Σf/ΣB whatever the mapping, so branch and bound prunes
    /// little and proving the last fraction of a percent is most of the time spent.
    pub mip_gap: Option<f32>,
}

impl Default for MilpOptions {
    fn default() -> Self {
        MilpOptions {
            time_limit_s: Some(10.0),
            max_binaries: 400,
            warm_start: true,
            mip_gap: None,
        }
    }
}

/// The exact GCM's answer (or the best found within the time limit).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GcmMilp {
    pub mapping: GcmMapping,
    pub tenant_clusters: Vec<Vec<usize>>,
    pub loads: Vec<f64>,
    /// λ recomputed from the mapping (not the solver's objective, which carries its
    /// tolerances).
    pub lambda: f64,
    /// Proven optimal (within `mip_gap` if one was set); false when the time limit
    /// stopped the search first.
    pub optimal: bool,
}

/// GCM (Eq. 1) solved exactly with binary x and y, for small instances.
pub fn solve_milp(inst: &GcmInstance, opts: &MilpOptions) -> Result<GcmMilp, PlaceError> {
    inst.validate()?;
    let n = inst.clusters.len();
    let binaries = n * (inst.vpc_count() + inst.d());
    if binaries > opts.max_binaries {
        return Err(PlaceError::invalid(
            "instance",
            format!(
                "{binaries} binary variables (clusters × (VPCs + tenants)) exceed the MILP's \
                 limit of {}; use RGCM for instances this size",
                opts.max_binaries
            ),
        ));
    }
    if let Some(t) = opts.time_limit_s {
        if !t.is_finite() || t < 0.0 {
            return Err(PlaceError::invalid(
                "time_limit_s",
                format!("must be a finite number ≥ 0, got {t}"),
            ));
        }
    }
    if let Some(g) = opts.mip_gap {
        if !g.is_finite() || g < 0.0 {
            return Err(PlaceError::invalid(
                "mip_gap",
                format!("must be a finite number ≥ 0, got {g}"),
            ));
        }
    }
    let start = if opts.warm_start {
        Some(greedy(inst)?)
    } else {
        None
    };
    let (mut model, (lambda, x, y)) = build(inst, true).into_microlp();
    if let Some(g) = &start {
        let mut hint = vec![(lambda, g.lambda)];
        for (t, row) in g.mapping.assign.iter().enumerate() {
            let used: HashSet<usize> = row.iter().copied().collect();
            for (c, &yv) in y[t].iter().enumerate() {
                hint.push((yv, if used.contains(&c) { 1.0 } else { 0.0 }));
            }
            for (v, &cv) in row.iter().enumerate() {
                for (c, &xv) in x[t][v].iter().enumerate() {
                    hint.push((xv, if c == cv { 1.0 } else { 0.0 }));
                }
            }
        }
        model = model.with_initial_solution(hint);
    }
    if let Some(t) = opts.time_limit_s {
        model = model.with_time_limit(t);
    }
    if let Some(g) = opts.mip_gap {
        model = model
            .with_mip_gap(g)
            .map_err(|e| PlaceError::invalid("mip_gap", format!("{e}, got {g}")))?;
    }
    let sol = model.solve().map_err(|e| solver_error("GCM MILP", e))?;
    let optimal = matches!(
        sol.status(),
        SolutionStatus::Optimal | SolutionStatus::GapLimit
    );
    let assign: Vec<Vec<usize>> = x
        .iter()
        .map(|xt| {
            xt.iter()
                .map(|xv| {
                    // The binary at 1; the largest if tolerances blur it.
                    (0..n)
                        .max_by(|&a, &b| sol.value(xv[a]).total_cmp(&sol.value(xv[b])))
                        .unwrap_or(0)
                })
                .collect()
        })
        .collect();
    let mapping = GcmMapping { assign };
    let loads = cluster_loads(inst, &mapping)?;
    let lambda = lambda_of(&inst.clusters, &loads);
    let tenant_clusters = tenant_clusters(inst, &mapping)?;
    debug!(binaries, lambda, optimal, "GCM MILP solved");
    Ok(GcmMilp {
        mapping,
        tenant_clusters,
        loads,
        lambda,
        optimal,
    })
}

/// Where [`map_vpcs`] put one tenant's VPCs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantMapping {
    /// The cluster of each VPC passed in, in the order passed.
    pub vpc_clusters: Vec<usize>,
    /// The tenant's clusters afterwards (those it already had included), sorted.
    pub clusters: Vec<usize>,
    /// Every cluster's load afterwards.
    pub loads_after: Vec<f64>,
    pub lambda_before: f64,
    pub lambda_after: f64,
}

/// The incremental rule: place `vpcs` of one tenant on top of the current `loads`,
/// using at most `k` distinct clusters counting the `already` ones the tenant uses.
///
/// Largest demand first, each VPC goes to the cluster with the lowest resulting
/// (load + f) / B(c) among: all clusters while the tenant has fewer than k, else the
/// tenant's clusters. Ties prefer a cluster the tenant already uses (so zero-demand
/// VPCs, e.g. ones whose traffic is not known yet, do not spread the tenant), then the
/// lower index. This is LPT list scheduling with an opening limit: it never moves an
/// existing VPC (moving a VPC moves its vIP group's traffic), needs no LP, and keeps
/// the tenant constraint exactly, which RGCM only keeps with high probability and
/// within a factor. With every demand equal it reduces to the orchestrator's current
/// rule ("the cluster with the fewest tenants") counted in VPCs.
///
/// If `already` holds more than k clusters (a mapping from RGCM may), the VPCs go to
/// those only.
pub fn map_vpcs(
    clusters: &[GcmCluster],
    loads: &[f64],
    already: &[usize],
    vpcs: &[GcmVpc],
    k: usize,
) -> Result<TenantMapping, PlaceError> {
    if clusters.is_empty() {
        return Err(PlaceError::invalid(
            "clusters",
            "there must be at least one",
        ));
    }
    validate_clusters(clusters)?;
    validate_vpcs(vpcs, "vpcs")?;
    if k == 0 {
        return Err(PlaceError::invalid(
            "k",
            "the tenant constraint k must be ≥ 1, got 0",
        ));
    }
    if loads.len() != clusters.len() {
        return Err(PlaceError::invalid(
            "loads",
            format!("{} loads for {} clusters", loads.len(), clusters.len()),
        ));
    }
    if let Some((i, l)) = loads
        .iter()
        .enumerate()
        .find(|(_, l)| !l.is_finite() || **l < 0.0)
    {
        return Err(PlaceError::invalid(
            format!("loads[{i}]"),
            format!("must be a finite number ≥ 0, got {l}"),
        ));
    }
    if let Some((i, c)) = already
        .iter()
        .enumerate()
        .find(|(_, &c)| c >= clusters.len())
    {
        return Err(PlaceError::invalid(
            format!("already[{i}]"),
            format!("cluster {c} does not exist ({} clusters)", clusters.len()),
        ));
    }
    let lambda_before = lambda_of(clusters, loads);
    let mut loads = loads.to_vec();
    let mut open = distinct(already);
    let mut order: Vec<usize> = (0..vpcs.len()).collect();
    order.sort_by(|&a, &b| vpcs[b].demand.total_cmp(&vpcs[a].demand).then(a.cmp(&b)));
    let mut out = vec![0; vpcs.len()];
    for v in order {
        let f = vpcs[v].demand;
        let candidates: Vec<usize> = if open.len() < k {
            (0..clusters.len()).collect()
        } else {
            open.clone()
        };
        let c = candidates
            .iter()
            .copied()
            .min_by(|&a, &b| {
                let la = (loads[a] + f) / clusters[a].capacity;
                let lb = (loads[b] + f) / clusters[b].capacity;
                // Loads equal within rounding count as a tie.
                let by_load = if (la - lb).abs() <= EPS * la.abs().max(lb.abs()).max(1.0) {
                    std::cmp::Ordering::Equal
                } else {
                    la.total_cmp(&lb)
                };
                by_load
                    .then(
                        open.binary_search(&b)
                            .is_ok()
                            .cmp(&open.binary_search(&a).is_ok()),
                    )
                    .then(a.cmp(&b))
            })
            .unwrap_or(0);
        if let Err(pos) = open.binary_search(&c) {
            open.insert(pos, c);
        }
        loads[c] += f;
        out[v] = c;
    }
    let lambda_after = lambda_of(clusters, &loads);
    Ok(TenantMapping {
        vpc_clusters: out,
        clusters: open,
        loads_after: loads,
        lambda_before,
        lambda_after,
    })
}

/// [`map_vpcs`] by name, for the orchestrator: `inst` holds every tenant (the one to
/// map included) with its VPCs and demands; `current` the VPCs already placed. Every
/// VPC of `tenant` not in `current` is placed; nothing placed moves. Covers both a new
/// tenant and a tenant adding a VPC (its clusters count toward k).
///
/// Returns the new placements and the tenant's clusters by name, with the mapping.
pub fn place_tenant(
    inst: &GcmInstance,
    current: &[VpcPlacement],
    tenant: &str,
) -> Result<(Vec<VpcPlacement>, TenantMapping), PlaceError> {
    inst.validate()?;
    let t = inst
        .tenants
        .iter()
        .position(|t| t.id == tenant)
        .ok_or_else(|| PlaceError::UnknownTenant(tenant.to_string()))?;
    let index = vpc_index(inst);
    let mut loads = vec![0.0; inst.clusters.len()];
    let mut placed_here = vec![false; inst.tenants[t].vpcs.len()];
    let mut seen = HashSet::new();
    let mut already = Vec::new();
    for (i, p) in current.iter().enumerate() {
        let (pt, pv) = placed_vpc(&index, "current", i, p)?;
        if !seen.insert((pt, pv)) {
            return Err(PlaceError::invalid(
                format!("current[{i}]"),
                format!("VPC {:?} of tenant {:?} is placed twice", p.vpc, p.tenant),
            ));
        }
        let c = placed_cluster(inst, "current", i, p)?;
        loads[c] += inst.tenants[pt].vpcs[pv].demand;
        if pt == t {
            placed_here[pv] = true;
            already.push(c);
        }
    }
    let todo: Vec<usize> = (0..placed_here.len())
        .filter(|&v| !placed_here[v])
        .collect();
    let vpcs: Vec<GcmVpc> = todo
        .iter()
        .map(|&v| inst.tenants[t].vpcs[v].clone())
        .collect();
    let m = map_vpcs(&inst.clusters, &loads, &already, &vpcs, inst.k)?;
    let placed = todo
        .iter()
        .zip(&m.vpc_clusters)
        .map(|(&v, &c)| VpcPlacement {
            tenant: tenant.to_string(),
            vpc: inst.tenants[t].vpcs[v].id.clone(),
            cluster: inst.clusters[c].id.clone(),
        })
        .collect();
    Ok((placed, m))
}

/// A whole-instance mapping from [`map_vpcs`]: tenants in descending total demand
/// (ties by order), each mapped on top of the ones before. Respects k exactly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GreedyResult {
    pub mapping: GcmMapping,
    pub tenant_clusters: Vec<Vec<usize>>,
    pub loads: Vec<f64>,
    pub lambda: f64,
}

/// [`map_vpcs`] for every tenant: a baseline for RGCM, and the MILP's warm start.
pub fn greedy(inst: &GcmInstance) -> Result<GreedyResult, PlaceError> {
    inst.validate()?;
    let mut order: Vec<usize> = (0..inst.tenants.len()).collect();
    let total = |t: usize| -> f64 { inst.tenants[t].vpcs.iter().map(|v| v.demand).sum() };
    order.sort_by(|&a, &b| total(b).total_cmp(&total(a)).then(a.cmp(&b)));
    let mut loads = vec![0.0; inst.clusters.len()];
    let mut assign: Vec<Vec<usize>> = inst.tenants.iter().map(|_| Vec::new()).collect();
    for t in order {
        let m = map_vpcs(&inst.clusters, &loads, &[], &inst.tenants[t].vpcs, inst.k)?;
        loads = m.loads_after;
        assign[t] = m.vpc_clusters;
    }
    let mapping = GcmMapping { assign };
    let tenant_clusters = tenant_clusters(inst, &mapping)?;
    let lambda = lambda_of(&inst.clusters, &loads);
    Ok(GreedyResult {
        mapping,
        tenant_clusters,
        loads,
        lambda,
    })
}

/// A seeded random GCM instance, for tests and benches: `n` clusters of capacity 100
/// (or, with `heterogeneous`, 50–150), `d` tenants with 1..=`max_vpcs` VPCs each,
/// demands uniform in (0, `max_demand`].
pub fn random_instance(
    seed: u64,
    n: usize,
    d: usize,
    max_vpcs: usize,
    max_demand: f64,
    k: usize,
    heterogeneous: bool,
) -> GcmInstance {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let clusters = (0..n.max(1))
        .map(|c| GcmCluster {
            id: format!("c{c}"),
            capacity: if heterogeneous {
                rng.gen_range(50.0..=150.0)
            } else {
                100.0
            },
        })
        .collect();
    let tenants = (0..d)
        .map(|t| GcmTenant {
            id: format!("t{t}"),
            vpcs: (0..rng.gen_range(1..=max_vpcs.max(1)))
                .map(|v| GcmVpc {
                    id: format!("v{v}"),
                    demand: max_demand * (1.0 - rng.gen::<f64>()),
                })
                .collect(),
        })
        .collect();
    GcmInstance {
        clusters,
        tenants,
        k: k.max(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inst(caps: &[f64], tenants: &[&[f64]], k: usize) -> GcmInstance {
        GcmInstance {
            clusters: caps
                .iter()
                .enumerate()
                .map(|(i, &c)| GcmCluster {
                    id: format!("c{i}"),
                    capacity: c,
                })
                .collect(),
            tenants: tenants
                .iter()
                .enumerate()
                .map(|(t, vs)| GcmTenant {
                    id: format!("t{t}"),
                    vpcs: vs
                        .iter()
                        .enumerate()
                        .map(|(v, &f)| GcmVpc {
                            id: format!("v{v}"),
                            demand: f,
                        })
                        .collect(),
                })
                .collect(),
            k,
        }
    }

    fn field(e: PlaceError) -> String {
        match e {
            PlaceError::Invalid { field, .. } => field,
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn bad_input_is_named() {
        let mut i = inst(&[10.0, 10.0], &[&[1.0, 2.0]], 1);
        i.tenants[0].vpcs[1].demand = -1.0;
        assert_eq!(
            field(i.validate().unwrap_err()),
            "tenants[0].vpcs[1].demand"
        );
        i.tenants[0].vpcs[1].demand = f64::NAN;
        assert_eq!(
            field(i.validate().unwrap_err()),
            "tenants[0].vpcs[1].demand"
        );

        let mut i = inst(&[10.0, 10.0], &[&[1.0]], 1);
        i.k = 0;
        assert_eq!(field(rgcm(&i, &RgcmOptions::default()).unwrap_err()), "k");

        let i = inst(&[], &[&[1.0]], 1);
        assert_eq!(field(solve_lp(&i).unwrap_err()), "clusters");

        let mut i = inst(&[10.0, 10.0], &[&[1.0], &[1.0]], 1);
        i.clusters[1].id = "c0".into();
        assert_eq!(field(i.validate().unwrap_err()), "clusters[1].id");
        let mut i = inst(&[10.0, 0.0], &[&[1.0]], 1);
        assert_eq!(field(i.validate().unwrap_err()), "clusters[1].capacity");
        i.clusters[1].capacity = 5.0;
        i.tenants.push(i.tenants[0].clone());
        assert_eq!(field(i.validate().unwrap_err()), "tenants[1].id");
        let mut i = inst(&[10.0], &[&[1.0, 1.0]], 1);
        i.tenants[0].vpcs[1].id = "v0".into();
        assert_eq!(field(i.validate().unwrap_err()), "tenants[0].vpcs[1].id");
        // Same VPC name in two tenants is fine: names are per tenant.
        let i = inst(&[10.0], &[&[1.0], &[1.0]], 1);
        assert!(i.validate().is_ok());
    }

    #[test]
    fn json_names_a_negative_k_and_validates() {
        let e = serde_json::from_str::<GcmInstance>(
            r#"{"clusters":[{"id":"a","capacity":1}],"tenants":[],"k":-1}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("k:"), "{e}");
        let e = serde_json::from_str::<GcmInstance>(
            r#"{"clusters":[{"id":"a","capacity":1}],"tenants":[{"id":"t","vpcs":[{"id":"v","demand":-2}]}],"k":1}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("tenants[0].vpcs[0].demand"), "{e}");
        let ok: GcmInstance = serde_json::from_str(
            r#"{"clusters":[{"id":"a","capacity":1}],"tenants":[{"id":"t"}],"k":2}"#,
        )
        .unwrap();
        assert_eq!(ok.k, 2);
    }

    #[test]
    fn overload_is_reported_not_refused() {
        // Demand 30 on capacity 10: λ = 3, no error.
        let i = inst(&[5.0, 5.0], &[&[15.0, 15.0]], 2);
        let r = rgcm(&i, &RgcmOptions::default()).unwrap();
        assert!((r.lambda_lp - 3.0).abs() < 1e-6, "{}", r.lambda_lp);
        assert!(r.lambda >= 3.0 - 1e-9);
        let m = solve_milp(&i, &MilpOptions::default()).unwrap();
        assert!((m.lambda - 3.0).abs() < 1e-9 && m.optimal);
    }

    #[test]
    fn lp_lambda_is_total_over_capacity() {
        // The module doc's remark: LP-GCM ignores k and indivisibility.
        for seed in 0..5 {
            let i = random_instance(seed, 4, 6, 3, 20.0, 1, true);
            let lp = solve_lp(&i).unwrap();
            let want = i.total_demand() / i.clusters.iter().map(|c| c.capacity).sum::<f64>();
            assert!(
                (lp.lambda - want).abs() < 1e-6 * want.max(1.0),
                "{} vs {want}",
                lp.lambda
            );
            // LP feasibility of what we round from.
            let y = lp.tightened_y();
            for (t, xt) in lp.x.iter().enumerate() {
                assert!(y[t].iter().sum::<f64>() <= i.k as f64 + 1e-6);
                for xv in xt {
                    assert!((xv.iter().sum::<f64>() - 1.0).abs() < 1e-6);
                }
            }
        }
    }

    #[test]
    fn rounding_maps_every_vpc_once_and_lp_is_a_lower_bound() {
        for (n, d, v, k) in [(3, 5, 3, 1), (5, 10, 4, 2), (8, 20, 5, 3), (4, 1, 6, 2)] {
            for seed in 0..6 {
                let i = random_instance(seed, n, d, v, 30.0, k, seed % 2 == 0);
                let lp = solve_lp(&i).unwrap();
                for s in 0..10 {
                    let r = round(&i, &lp, &RgcmOptions::seeded(s)).unwrap();
                    check_mapping(&i, &r.mapping).unwrap();
                    let named = r.mapping.named(&i).unwrap();
                    assert_eq!(named.len(), i.vpc_count());
                    // Each VPC exactly once, by name, through the external check.
                    assert_eq!(GcmMapping::from_named(&i, &named).unwrap(), r.mapping);
                    let lam = load_factor(&i, &r.mapping).unwrap();
                    assert!((lam - r.lambda).abs() < 1e-9);
                    assert!(
                        r.lambda >= r.lambda_lp - 1e-6,
                        "λ {} < λ̃ {}",
                        r.lambda,
                        r.lambda_lp
                    );
                    for (used, drawn) in r.tenant_clusters.iter().zip(&r.drawn_clusters) {
                        assert!(used.iter().all(|c| drawn.contains(c)));
                    }
                    assert_eq!(r.forced_draws, 0);
                }
            }
        }
    }

    #[test]
    fn same_seed_same_mapping() {
        let i = random_instance(7, 5, 12, 4, 30.0, 2, false);
        let opts = RgcmOptions::seeded(42);
        assert_eq!(rgcm(&i, &opts).unwrap(), rgcm(&i, &opts).unwrap());
    }

    #[test]
    fn milp_lies_between_lp_and_rounding() {
        for seed in 0..8 {
            let i = random_instance(seed, 3, 4, 3, 40.0, 1 + (seed as usize % 2), seed % 2 == 1);
            let lp = solve_lp(&i).unwrap();
            let m = solve_milp(
                &i,
                &MilpOptions {
                    time_limit_s: None,
                    ..Default::default()
                },
            )
            .unwrap();
            assert!(m.optimal);
            check_mapping(&i, &m.mapping).unwrap();
            assert!(m.tenant_clusters.iter().all(|c| c.len() <= i.k));
            assert!(
                m.lambda >= lp.lambda - 1e-6,
                "MILP {} < LP {}",
                m.lambda,
                lp.lambda
            );
            let g = greedy(&i).unwrap();
            assert!(
                m.lambda <= g.lambda + 1e-9,
                "MILP {} > greedy {}",
                m.lambda,
                g.lambda
            );
            for s in 0..20 {
                let r = round(&i, &lp, &RgcmOptions::seeded(s)).unwrap();
                // The MILP optimum is over mappings with ≤ k clusters per tenant; a
                // rounded mapping within k is one of them, so it cannot beat it.
                if r.tenant_clusters.iter().all(|c| c.len() <= i.k) {
                    assert!(
                        m.lambda <= r.lambda + 1e-9,
                        "MILP {} > RGCM {}",
                        m.lambda,
                        r.lambda
                    );
                }
            }
        }
    }

    #[test]
    fn milp_refuses_big_instances_and_bad_time_limits() {
        let i = random_instance(1, 10, 30, 5, 10.0, 2, false);
        assert_eq!(
            field(solve_milp(&i, &MilpOptions::default()).unwrap_err()),
            "instance"
        );
        let i = random_instance(1, 2, 2, 2, 10.0, 1, false);
        let o = MilpOptions {
            time_limit_s: Some(-1.0),
            ..Default::default()
        };
        assert_eq!(field(solve_milp(&i, &o).unwrap_err()), "time_limit_s");
        let o = MilpOptions {
            mip_gap: Some(f32::NAN),
            ..Default::default()
        };
        assert_eq!(field(solve_milp(&i, &o).unwrap_err()), "mip_gap");
    }

    #[test]
    fn theorem_bounds_hold_on_most_seeds() {
        // With-high-probability bounds: count, and require them to hold on nearly all
        // draws where the promise 1 − 1/d² is strong (d ≥ 10 → ≥ 99%).
        let mut total = 0;
        let mut held = 0;
        for seed in 0..6 {
            let i = random_instance(seed, 6, 12, 4, 25.0, 2, seed % 2 == 0);
            let lp = solve_lp(&i).unwrap();
            for s in 0..50 {
                let r = round(&i, &lp, &RgcmOptions::seeded(s)).unwrap();
                total += 1;
                if r.bound_ok() {
                    held += 1;
                }
            }
        }
        assert!(held as f64 >= 0.97 * total as f64, "held {held}/{total}");
    }

    #[test]
    fn theorem_5_fails_for_one_tenant_within_k() {
        // d = 1 promises nothing (1 − 1/d² = 0), and here it shows: with k = 1 every
        // mapping that keeps the tenant on one cluster has λ = n·λ̃ = 10·λ̃ > 3·λ̃.
        let i = random_instance(3, 10, 1, 8, 20.0, 1, false);
        let lp = solve_lp(&i).unwrap();
        let mut within_k = 0;
        for s in 0..40 {
            let r = round(&i, &lp, &RgcmOptions::seeded(s)).unwrap();
            assert_eq!(r.bounds.probability, 0.0);
            if r.tenant_clusters[0].len() == 1 {
                within_k += 1;
                assert!((r.lambda - 10.0 * r.lambda_lp).abs() < 1e-6);
                assert!(!r.bounds.lambda_bound_ok);
            }
        }
        assert!(within_k > 0);
    }

    #[test]
    fn theorem_bounds_for_one_tenant_and_zero_demand() {
        let i = inst(&[10.0, 10.0, 10.0], &[&[4.0, 4.0]], 1);
        let b = theorem_bounds(&i, 8.0 / 30.0, 0.8, 1);
        assert_eq!(b.d, 1);
        assert_eq!(b.probability, 0.0);
        assert_eq!(b.tenant_factor, 3.0);
        assert!(b.tenant_bound_ok);
        // β = (8/30)·10/4 = 2/3; factor 3; limit 0.8.
        assert!((b.beta.unwrap() - 2.0 / 3.0).abs() < 1e-12);
        assert!(b.lambda_bound_ok);
        let b = theorem_bounds(&i, 8.0 / 30.0, 0.81, 4);
        assert!(!b.lambda_bound_ok && !b.tenant_bound_ok);

        let z = inst(&[10.0, 10.0], &[&[0.0, 0.0], &[0.0]], 1);
        let r = rgcm(&z, &RgcmOptions::default()).unwrap();
        assert_eq!(r.lambda, 0.0);
        assert_eq!(r.bounds.beta, None);
        assert!(r.bounds.lambda_bound_ok);
        check_mapping(&z, &r.mapping).unwrap();
    }

    #[test]
    fn tenants_without_vpcs_get_nothing() {
        let i = inst(&[10.0, 10.0], &[&[], &[3.0]], 1);
        let r = rgcm(&i, &RgcmOptions::default()).unwrap();
        assert!(r.drawn_clusters[0].is_empty() && r.mapping.assign[0].is_empty());
        assert_eq!(r.bounds.d, 1);
        let m = solve_milp(&i, &MilpOptions::default()).unwrap();
        assert!((m.lambda - 0.3).abs() < 1e-9);
    }

    #[test]
    fn fallback_stays_inside_the_drawn_clusters() {
        // A hand-made LP where VPC v0's mass is on c2 only, and the tenant's ỹ on c2
        // is 0, so C_t is always {c0, c1} and v0 has no interval. (Tightening would
        // raise ỹ on c2 to 1, so it is off here.)
        let i = inst(&[10.0, 10.0, 10.0], &[&[1.0, 5.0]], 2);
        let lp = LpGcm {
            lambda: 0.2,
            x: vec![vec![vec![0.0, 0.0, 1.0], vec![1.0, 0.0, 0.0]]],
            y: vec![vec![1.0, 1.0, 0.0]],
        };
        let r = round(
            &i,
            &lp,
            &RgcmOptions {
                tighten_y: false,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(r.fallback_vpcs, 1);
        assert_eq!(r.drawn_clusters[0], vec![0, 1]);
        // v0 is placed first, on an empty c0 (tie → lower index); then v1 on c0.
        assert_eq!(r.mapping.assign[0], vec![0, 0]);
        let bad = LpGcm {
            lambda: 0.2,
            x: vec![vec![vec![0.0, 1.0]]],
            y: vec![vec![0.0, 1.0]],
        };
        assert_eq!(
            field(round(&i, &bad, &RgcmOptions::default()).unwrap_err()),
            "lp"
        );
    }

    #[test]
    fn incremental_keeps_k_and_prefers_light_clusters() {
        let cl = inst(&[10.0, 10.0, 20.0], &[], 1).clusters;
        let vpcs: Vec<GcmVpc> = [4.0, 3.0, 2.0, 1.0]
            .iter()
            .enumerate()
            .map(|(v, &f)| GcmVpc {
                id: format!("v{v}"),
                demand: f,
            })
            .collect();
        // k = 1: everything on the one cluster with the most room (c2).
        let m = map_vpcs(&cl, &[0.0, 0.0, 0.0], &[], &vpcs, 1).unwrap();
        assert_eq!(m.vpc_clusters, vec![2, 2, 2, 2]);
        assert_eq!(m.clusters, vec![2]);
        // k = 2 with c2 loaded: the two light ones.
        let m = map_vpcs(&cl, &[0.0, 0.0, 19.0], &[], &vpcs, 2).unwrap();
        assert_eq!(m.clusters, vec![0, 1]);
        assert!((m.lambda_after - 0.95).abs() < 1e-9);
        // Already on c2 with k = 1: stays on c2 however loaded.
        let m = map_vpcs(&cl, &[0.0, 0.0, 19.0], &[2], &vpcs, 1).unwrap();
        assert_eq!(m.clusters, vec![2]);
        // Bad input named.
        assert_eq!(
            field(map_vpcs(&cl, &[0.0], &[], &vpcs, 1).unwrap_err()),
            "loads"
        );
        assert_eq!(
            field(map_vpcs(&cl, &[0.0, -1.0, 0.0], &[], &vpcs, 1).unwrap_err()),
            "loads[1]"
        );
        assert_eq!(
            field(map_vpcs(&cl, &[0.0; 3], &[7], &vpcs, 1).unwrap_err()),
            "already[0]"
        );
        assert_eq!(
            field(map_vpcs(&cl, &[0.0; 3], &[], &vpcs, 0).unwrap_err()),
            "k"
        );
        // Equal (unknown) demands: fewest VPCs, like the orchestrator's current rule.
        let zero: Vec<GcmVpc> = (0..1)
            .map(|v| GcmVpc {
                id: format!("v{v}"),
                demand: 1.0,
            })
            .collect();
        let eq = inst(&[1.0, 1.0, 1.0], &[], 1).clusters;
        let m = map_vpcs(&eq, &[3.0, 1.0, 2.0], &[], &zero, 1).unwrap();
        assert_eq!(m.vpc_clusters, vec![1]);
    }

    #[test]
    fn place_tenant_by_name() {
        let i = inst(&[10.0, 10.0], &[&[6.0], &[1.0, 2.0, 3.0]], 1);
        let current = vec![
            VpcPlacement {
                tenant: "t0".into(),
                vpc: "v0".into(),
                cluster: "c0".into(),
            },
            VpcPlacement {
                tenant: "t1".into(),
                vpc: "v2".into(),
                cluster: "c0".into(),
            },
        ];
        // t1 already uses c0 and k = 1: its other VPCs join it there.
        let (placed, m) = place_tenant(&i, &current, "t1").unwrap();
        assert_eq!(placed.len(), 2);
        assert!(placed.iter().all(|p| p.cluster == "c0" && p.tenant == "t1"));
        assert_eq!(m.clusters, vec![0]);
        // A new tenant alone goes to the light cluster.
        let (placed, _) = place_tenant(&i, &current[..1], "t1").unwrap();
        assert!(placed.iter().all(|p| p.cluster == "c1"));
        assert!(matches!(
            place_tenant(&i, &current, "nobody"),
            Err(PlaceError::UnknownTenant(_))
        ));
        let mut dup = current.clone();
        dup.push(current[0].clone());
        assert_eq!(
            field(place_tenant(&i, &dup, "t1").unwrap_err()),
            "current[2]"
        );
        let mut bad = current.clone();
        bad[1].cluster = "zz".into();
        assert_eq!(
            field(place_tenant(&i, &bad, "t1").unwrap_err()),
            "current[1].cluster"
        );
    }

    #[test]
    fn from_named_rejects_missing_and_double() {
        let i = inst(&[10.0, 10.0], &[&[1.0, 1.0]], 1);
        let p = |v: &str, c: &str| VpcPlacement {
            tenant: "t0".into(),
            vpc: v.into(),
            cluster: c.into(),
        };
        assert!(GcmMapping::from_named(&i, &[p("v0", "c0"), p("v1", "c1")]).is_ok());
        assert_eq!(
            field(GcmMapping::from_named(&i, &[p("v0", "c0")]).unwrap_err()),
            "placements"
        );
        assert_eq!(
            field(GcmMapping::from_named(&i, &[p("v0", "c0"), p("v0", "c1")]).unwrap_err()),
            "placements[1]"
        );
        assert_eq!(
            field(GcmMapping::from_named(&i, &[p("v9", "c0")]).unwrap_err()),
            "placements[0]"
        );
        assert_eq!(
            field(
                check_mapping(
                    &i,
                    &GcmMapping {
                        assign: vec![vec![0, 2]]
                    }
                )
                .unwrap_err()
            ),
            "mapping.assign[0][1]"
        );
    }
}
