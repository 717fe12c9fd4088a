//! Placement workloads: tenants arriving and leaving over time with changing demand,
//! on a pool of nodes of several sizes and prices. The JSON form is documented in
//! `docs/placement.md`; [`generate`] makes seeded synthetic ones.
//!
//! Training and evaluation never share a seed: [`train_seed`] and [`test_seed`] map
//! an index into two disjoint ranges.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::problem::{Instance, Limits, Node, PlaceError, Request, Resources};

/// Current workload file version.
pub const WORKLOAD_VERSION: u32 = 1;

/// One tenant's life: it arrives at step `arrive`, leaves before step `depart`, and
/// `demand[k]` is its demand at step `arrive + k`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TenantTrace {
    pub tenant: String,
    pub arrive: usize,
    pub depart: usize,
    pub demand: Vec<Resources>,
}

impl TenantTrace {
    /// Demand at absolute step `t`, if the tenant is present then.
    pub fn at(&self, t: usize) -> Option<Resources> {
        if t < self.arrive || t >= self.depart {
            return None;
        }
        self.demand.get(t - self.arrive).copied()
    }
}

/// A whole workload: the node pool, the limits, and every tenant's trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub version: u32,
    #[serde(default)]
    pub name: String,
    pub limits: Limits,
    pub nodes: Vec<Node>,
    /// Number of time steps simulated.
    pub steps: usize,
    /// Steps per day, for daily seasonality (forecasters read it).
    #[serde(default = "default_period")]
    pub period: usize,
    /// Price units charged per tenant moved between node sets.
    #[serde(default = "default_migration_cost")]
    pub migration_cost: f64,
    /// A node whose busiest dimension is reserved below this fraction of capacity is
    /// drained (its tenants re-placed elsewhere) when that frees it: App. A.2's
    /// scale-down event. 0 turns consolidation off.
    #[serde(default = "default_lower")]
    pub lower_threshold: f64,
    pub tenants: Vec<TenantTrace>,
}

fn default_period() -> usize {
    96
}
fn default_migration_cost() -> f64 {
    0.05
}
fn default_lower() -> f64 {
    0.15
}

impl Workload {
    /// Parses and validates a workload file's text.
    pub fn from_json(text: &str) -> Result<Self, PlaceError> {
        let w: Workload = serde_json::from_str(text)
            .map_err(|e| PlaceError::invalid("workload", e.to_string()))?;
        w.validate()?;
        Ok(w)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a workload always serializes")
    }

    /// Field-level checks, naming the field.
    pub fn validate(&self) -> Result<(), PlaceError> {
        if self.version != WORKLOAD_VERSION {
            return Err(PlaceError::invalid(
                "version",
                format!(
                    "this build reads version {WORKLOAD_VERSION}, got {}",
                    self.version
                ),
            ));
        }
        self.limits.validate()?;
        crate::problem::validate_nodes(&self.nodes, &self.limits)?;
        if self.steps == 0 {
            return Err(PlaceError::invalid("steps", "must be ≥ 1"));
        }
        if self.period == 0 {
            return Err(PlaceError::invalid("period", "must be ≥ 1"));
        }
        if !self.migration_cost.is_finite() || self.migration_cost < 0.0 {
            return Err(PlaceError::invalid(
                "migration_cost",
                format!("must be a finite number ≥ 0, got {}", self.migration_cost),
            ));
        }
        if !(0.0..1.0).contains(&self.lower_threshold) {
            return Err(PlaceError::invalid(
                "lower_threshold",
                format!("must be in [0, 1), got {}", self.lower_threshold),
            ));
        }
        if self.lower_threshold >= self.limits.threshold {
            return Err(PlaceError::invalid(
                "lower_threshold",
                format!(
                    "must be below the threshold U = {}, got {}",
                    self.limits.threshold, self.lower_threshold
                ),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, t) in self.tenants.iter().enumerate() {
            let f = |x: &str| format!("tenants[{i}].{x}");
            if t.tenant.is_empty() {
                return Err(PlaceError::invalid(f("tenant"), "must not be empty"));
            }
            if !seen.insert(t.tenant.as_str()) {
                return Err(PlaceError::invalid(
                    f("tenant"),
                    format!("tenant {:?} appears twice", t.tenant),
                ));
            }
            if t.depart <= t.arrive {
                return Err(PlaceError::invalid(
                    f("depart"),
                    format!("must be after arrive ({}), got {}", t.arrive, t.depart),
                ));
            }
            if t.demand.len() != t.depart - t.arrive {
                return Err(PlaceError::invalid(
                    f("demand"),
                    format!(
                        "needs one entry per step present ({}), got {}",
                        t.depart - t.arrive,
                        t.demand.len()
                    ),
                ));
            }
            for (k, d) in t.demand.iter().enumerate() {
                d.validate(&format!("tenants[{i}].demand[{k}]"))?;
            }
        }
        Ok(())
    }

    /// Tenants arriving at step `t`, in file order.
    pub fn arrivals(&self, t: usize) -> impl Iterator<Item = &TenantTrace> {
        self.tenants.iter().filter(move |x| x.arrive == t)
    }
}

/// A small offline [`Instance`] cut out of `w` at step `t`: the first `max_nodes`
/// nodes, and the first `max_tenants` tenants present at `t` (in file order) with
/// their demand at `t`. Benches use it to compare online algorithms with the MILP,
/// which only takes small instances.
pub fn snapshot_instance(
    w: &Workload,
    t: usize,
    max_nodes: usize,
    max_tenants: usize,
) -> Result<Instance, PlaceError> {
    if t >= w.steps {
        return Err(PlaceError::invalid(
            "t",
            format!("step {t} is past the workload's {} steps", w.steps),
        ));
    }
    let requests = w
        .tenants
        .iter()
        .filter_map(|tr| {
            tr.at(t).map(|demand| Request {
                tenant: tr.tenant.clone(),
                demand,
            })
        })
        .take(max_tenants)
        .collect();
    let inst = Instance {
        nodes: w.nodes.iter().take(max_nodes).cloned().collect(),
        requests,
        limits: w.limits,
    };
    inst.validate()?;
    Ok(inst)
}

/// A node size offered by the generator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeType {
    pub name: String,
    pub capacity: Resources,
    pub price: f64,
}

/// Parameters of the synthetic generator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenSpec {
    pub nodes: usize,
    pub node_types: Vec<NodeType>,
    pub limits: Limits,
    pub steps: usize,
    pub period: usize,
    /// Mean tenant arrivals per step (Poisson).
    pub arrival_rate: f64,
    /// Tenants present at step 0.
    pub initial_tenants: usize,
    /// Mean lifetime in steps (geometric).
    pub mean_lifetime: f64,
    /// Log-normal median and sigma of a tenant's base bandwidth (Gbit/s).
    pub bw_median: f64,
    pub bw_sigma: f64,
    /// Peak-to-mean swing of the diurnal cycle, 0..1.
    pub diurnal_amplitude: f64,
    /// Multiplicative per-step noise (sigma of a log-normal around 1).
    pub noise: f64,
    pub migration_cost: f64,
    pub lower_threshold: f64,
}

impl GenSpec {
    /// The default evaluation workload: a day in 96 steps of 15 minutes, three node
    /// sizes with economies of scale, heavy-tailed tenants.
    pub fn standard(nodes: usize) -> Self {
        GenSpec {
            nodes,
            node_types: vec![
                NodeType {
                    name: "small".into(),
                    capacity: Resources::new(10.0, 8.0, 16.0),
                    price: 1.0,
                },
                NodeType {
                    name: "medium".into(),
                    capacity: Resources::new(25.0, 16.0, 64.0),
                    price: 2.2,
                },
                NodeType {
                    name: "large".into(),
                    capacity: Resources::new(40.0, 32.0, 128.0),
                    price: 3.6,
                },
            ],
            limits: Limits {
                threshold: 0.8,
                g_min: 2,
                g_max: 4,
                overlap: 2,
            },
            steps: 96,
            period: 96,
            arrival_rate: nodes as f64 / 24.0,
            initial_tenants: nodes,
            mean_lifetime: 60.0,
            bw_median: 1.5,
            bw_sigma: 0.9,
            diurnal_amplitude: 0.6,
            noise: 0.08,
            migration_cost: 0.05,
            lower_threshold: 0.15,
        }
    }
}

/// Seed of the `i`-th training workload.
pub fn train_seed(i: u64) -> u64 {
    i & ((1 << 40) - 1)
}

/// Seed of the `i`-th evaluation workload; never equal to a [`train_seed`].
pub fn test_seed(i: u64) -> u64 {
    (1 << 40) | (i & ((1 << 40) - 1))
}

/// NF profiles: how a tenant's bandwidth translates into CPU and memory. A VPN is
/// compute-bound, NAT and LB are bandwidth- and memory-bound (paper 000 §7.1).
const PROFILES: [(&str, f64, f64); 4] = [
    // (name, cores per Gbit/s, GiB per Gbit/s)
    ("nat", 0.35, 2.0),
    ("lb", 0.30, 1.5),
    ("fw", 0.45, 1.0),
    ("vpn", 1.10, 0.6),
];

/// A seeded synthetic workload.
pub fn generate(spec: &GenSpec, seed: u64) -> Result<Workload, PlaceError> {
    spec.limits.validate()?;
    if spec.node_types.is_empty() {
        return Err(PlaceError::invalid("node_types", "must not be empty"));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let nodes: Vec<Node> = (0..spec.nodes)
        .map(|i| {
            let t = &spec.node_types[rng.gen_range(0..spec.node_types.len())];
            Node {
                id: format!("{}-{i}", t.name),
                capacity: t.capacity,
                price: t.price,
            }
        })
        .collect();
    let mut tenants = Vec::new();
    let mut next = 0usize;
    let mut add = |rng: &mut ChaCha8Rng, arrive: usize| {
        let life = geometric(rng, spec.mean_lifetime).max(1);
        let depart = (arrive + life).min(spec.steps);
        if depart <= arrive {
            return;
        }
        let bw = spec.bw_median * (spec.bw_sigma * normal(rng)).exp();
        let (_, cpu_per, mem_per) = PROFILES[rng.gen_range(0..PROFILES.len())];
        // Each tenant's day peaks at its own hour (time zones, business vs. home).
        let phase = rng.gen_range(0.0..1.0);
        let demand = (arrive..depart)
            .map(|t| {
                let day = (t as f64 / spec.period as f64 + phase) * std::f64::consts::TAU;
                let diurnal = 1.0 + spec.diurnal_amplitude * day.sin();
                let noise = (spec.noise * normal(rng)).exp();
                let b = (bw * diurnal * noise).max(0.0);
                Resources::new(b, b * cpu_per, 0.5 + b * mem_per)
            })
            .collect();
        tenants.push(TenantTrace {
            tenant: format!("t{next}"),
            arrive,
            depart,
            demand,
        });
        next += 1;
    };
    for _ in 0..spec.initial_tenants {
        add(&mut rng, 0);
    }
    for t in 1..spec.steps {
        for _ in 0..poisson(&mut rng, spec.arrival_rate) {
            add(&mut rng, t);
        }
    }
    let w = Workload {
        version: WORKLOAD_VERSION,
        name: format!("generated seed={seed}"),
        limits: spec.limits,
        nodes,
        steps: spec.steps,
        period: spec.period,
        migration_cost: spec.migration_cost,
        lower_threshold: spec.lower_threshold,
        tenants,
    };
    w.validate()?;
    Ok(w)
}

fn normal(rng: &mut ChaCha8Rng) -> f64 {
    // Box–Muller: rand_distr would be one more crate for two lines.
    let u1: f64 = rng.gen_range(f64::EPSILON..1.0);
    let u2: f64 = rng.gen();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

fn geometric(rng: &mut ChaCha8Rng, mean: f64) -> usize {
    let p = 1.0 / mean.max(1.0);
    let u: f64 = rng.gen_range(f64::EPSILON..1.0);
    (u.ln() / (1.0 - p).ln()).ceil() as usize
}

fn poisson(rng: &mut ChaCha8Rng, lambda: f64) -> usize {
    // Knuth's method; lambda here is at most a few dozen.
    let l = (-lambda).exp();
    let (mut k, mut p) = (0usize, 1.0f64);
    loop {
        p *= rng.gen::<f64>();
        if p <= l {
            return k;
        }
        k += 1;
        if k > 10_000 {
            return k;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_are_disjoint_and_generation_is_deterministic() {
        assert_ne!(train_seed(5), test_seed(5));
        assert!(test_seed(0) > train_seed(u64::MAX));
        let spec = GenSpec::standard(30);
        let a = generate(&spec, 7).unwrap();
        let b = generate(&spec, 7).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, generate(&spec, 8).unwrap());
        assert!(a.tenants.len() > 30);
        let back = Workload::from_json(&a.to_json()).unwrap();
        assert_eq!(a, back);
    }

    #[test]
    fn demand_is_heavy_tailed_and_diurnal() {
        let w = generate(&GenSpec::standard(100), 1).unwrap();
        let mut bws: Vec<f64> = w.tenants.iter().map(|t| t.demand[0].bw).collect();
        bws.sort_by(f64::total_cmp);
        let median = bws[bws.len() / 2];
        let p99 = bws[bws.len() * 99 / 100];
        assert!(p99 > 4.0 * median, "median {median}, p99 {p99}");
        let long = w.tenants.iter().find(|t| t.demand.len() >= 60).unwrap();
        let (lo, hi) = long
            .demand
            .iter()
            .fold((f64::MAX, 0.0f64), |(l, h), d| (l.min(d.bw), h.max(d.bw)));
        assert!(
            hi > 2.0 * lo,
            "a long-lived tenant's day swings: {lo}..{hi}"
        );
    }

    #[test]
    fn snapshots_take_present_tenants_at_their_demand() {
        let w = generate(&GenSpec::standard(20), 4).unwrap();
        let t = 30;
        let inst = snapshot_instance(&w, t, 6, 5).unwrap();
        assert_eq!(inst.nodes, w.nodes[..6].to_vec());
        assert_eq!(inst.limits, w.limits);
        let present: Vec<&TenantTrace> = w.tenants.iter().filter(|x| x.at(t).is_some()).collect();
        assert!(
            present.len() > 5,
            "the test needs more tenants than it keeps"
        );
        assert_eq!(inst.requests.len(), 5);
        for (r, tr) in inst.requests.iter().zip(&present) {
            assert_eq!(r.tenant, tr.tenant);
            assert_eq!(Some(r.demand), tr.at(t));
        }
        let e = snapshot_instance(&w, w.steps, 6, 5).unwrap_err();
        assert!(
            matches!(&e, PlaceError::Invalid { field, .. } if field == "t"),
            "{e}"
        );
        // Fewer nodes than G_min: no tenant could be placed.
        assert!(matches!(
            snapshot_instance(&w, t, 1, 5),
            Err(PlaceError::Infeasible { .. })
        ));
    }

    #[test]
    fn bad_workloads_name_the_field() {
        let mut w = generate(&GenSpec::standard(10), 1).unwrap();
        w.tenants[0].demand[0].bw = -1.0;
        let e = Workload::from_json(&w.to_json()).unwrap_err();
        assert!(e.to_string().contains("tenants[0].demand[0].bw"), "{e}");
        let text = generate(&GenSpec::standard(10), 1)
            .unwrap()
            .to_json()
            .replace("\"g_min\":2", "\"g_min\":5");
        let e = Workload::from_json(&text).unwrap_err();
        assert!(e.to_string().contains("g_max"), "{e}");
    }
}
