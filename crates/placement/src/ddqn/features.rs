//! The per-node input of the shared Q-network: node `e`'s slice of the paper's state
//! ⟨B, C, M, b, c, m⟩ plus what a flat MLP would learn from node identity and from
//! seeing the whole state at once.
//!
//! Every feature is scale-free (a fraction, a flag, or a ratio to a pool-wide
//! reference), so one network serves pools of 4 or 1,000 nodes with any node sizes.

use crate::problem::{ClusterState, NodeIdx, Request, Resource, Resources};

/// Names of the features, in input order. Stored in the model header: a model is
/// refused by a build whose layout differs.
pub const FEATURES: [&str; 29] = [
    // The paper's B_e, C_e, M_e: what node e has left below U, as a fraction of U·cap.
    "free_bw_frac",
    "free_cpu_frac",
    "free_mem_frac",
    // The same in absolute terms, over the pool's largest U·capacity.
    "free_bw",
    "free_cpu",
    "free_mem",
    // The paper's b, c, m: the request (its reservation), over the same reference.
    "req_bw",
    "req_cpu",
    "req_mem",
    // How much of e's room one share would take at G_min (clipped to 2).
    "take_bw",
    "take_cpu",
    "take_mem",
    // Whether one share fits at G_min and at G_max.
    "fits_gmin",
    "fits_gmax",
    // Node identity, as a flat MLP would learn it per input slot.
    "cap_bw",
    "cap_cpu",
    "cap_mem",
    "price",
    "price_per_cap",
    "in_use",
    "tenants",
    // Water level (busiest dimension over U) now and after a G_min share.
    "level_now",
    "level_after",
    // Pooled summaries of the whole state.
    "pool_in_use",
    "pool_util_bw",
    "pool_util_cpu",
    "pool_util_mem",
    "pool_room",
    "pool_size",
];

/// Number of inputs per node.
pub const N_FEATURES: usize = FEATURES.len();

/// Pool-wide references, computed once per pool (they depend on the nodes only).
#[derive(Debug, Clone)]
pub struct PoolRef {
    /// Largest U·capacity per dimension.
    pub cap: [f64; 3],
    pub max_price: f64,
    /// Price over mean normalised capacity, per node (Best Fit's key for new nodes).
    pub ppc: Vec<f64>,
    pub max_ppc: f64,
}

impl PoolRef {
    pub fn new(state: &ClusterState) -> Self {
        let nodes = state.nodes();
        let u = state.limits().threshold;
        let mut cap = [0.0f64; 3];
        for n in nodes {
            for (i, r) in Resource::ALL.iter().enumerate() {
                cap[i] = cap[i].max(n.capacity.get(*r) * u);
            }
        }
        let max_price = nodes.iter().map(|n| n.price).fold(0.0, f64::max);
        let ppc: Vec<f64> = nodes
            .iter()
            .map(|n| {
                let norm: f64 = Resource::ALL
                    .iter()
                    .enumerate()
                    .map(|(i, r)| {
                        if cap[i] > 0.0 {
                            n.capacity.get(*r) * u / cap[i]
                        } else {
                            0.0
                        }
                    })
                    .sum::<f64>()
                    / 3.0;
                if norm > 0.0 {
                    n.price / norm
                } else {
                    0.0
                }
            })
            .collect();
        let max_ppc = ppc.iter().copied().fold(0.0, f64::max);
        PoolRef {
            cap,
            max_price,
            ppc,
            max_ppc,
        }
    }

    /// Whether this reference was computed for `state`'s pool (same node count).
    pub fn matches(&self, state: &ClusterState) -> bool {
        self.ppc.len() == state.nodes().len()
    }
}

fn div(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

fn arr(r: Resources) -> [f64; 3] {
    [r.bw, r.cpu, r.mem]
}

/// Fills `out` (resized to `nodes.len() × N_FEATURES`, row-major) with the features
/// of every node in `nodes` for `req`.
pub fn node_features(
    state: &ClusterState,
    pool: &PoolRef,
    req: &Request,
    nodes: &[NodeIdx],
    out: &mut Vec<f32>,
) {
    let n_all = state.nodes().len();
    let lim = state.limits();
    let g_min = lim.g_min as f64;
    let g_max = lim.g_max as f64;
    let d = arr(req.demand);
    // Pooled summaries.
    let mut in_use = 0usize;
    let mut util = [0.0f64; 3];
    let mut room = 0.0f64;
    for e in 0..n_all {
        if state.in_use(e) {
            in_use += 1;
            let used = arr(state.used(e));
            let l = arr(state.limit(e));
            for i in 0..3 {
                util[i] += div(used[i], l[i]);
            }
            if state.is_up(e) {
                room += state.free(e).bw;
            }
        }
    }
    for u in &mut util {
        *u = div(*u, in_use as f64);
    }
    let pool_in_use = div(in_use as f64, n_all as f64);
    // Room on used nodes measured in requests of this size, log-compressed.
    let pool_room = ((div(room, d[0].max(1e-6))).ln_1p() / 5.0).min(2.0);
    let pool_size = (n_all as f64).ln() / 7.0;

    out.clear();
    out.reserve(nodes.len() * N_FEATURES);
    for &e in nodes {
        let node = &state.nodes()[e];
        let l = arr(state.limit(e));
        let used = arr(state.used(e));
        let free = arr(state.free(e));
        let cap = arr(node.capacity);
        let mut f = [0.0f64; N_FEATURES];
        let mut level_now = 0.0f64;
        let mut level_after = 0.0f64;
        let mut fits_min = true;
        let mut fits_max = true;
        for i in 0..3 {
            f[i] = div(free[i], l[i]);
            f[3 + i] = div(free[i], pool.cap[i]);
            f[6 + i] = div(d[i], pool.cap[i]).min(4.0);
            let take = if d[i] > 0.0 {
                div(d[i] / g_min, free[i]).min(2.0)
            } else {
                0.0
            };
            // A node with no room in a dimension the request needs: fully taken.
            f[9 + i] = if free[i] <= 0.0 && d[i] > 0.0 {
                2.0
            } else {
                take
            };
            f[14 + i] = div(cap[i], pool.cap[i] / lim.threshold);
            level_now = level_now.max(div(used[i], l[i]));
            level_after = level_after.max(div(used[i] + d[i] / g_min, l[i]));
            fits_min &= d[i] / g_min <= free[i] * (1.0 + 1e-9) + 1e-9;
            fits_max &= d[i] / g_max <= free[i] * (1.0 + 1e-9) + 1e-9;
        }
        let up = state.is_up(e);
        f[12] = (fits_min && up) as u8 as f64;
        f[13] = (fits_max && up) as u8 as f64;
        f[17] = div(node.price, pool.max_price);
        f[18] = div(pool.ppc[e], pool.max_ppc);
        f[19] = state.in_use(e) as u8 as f64;
        f[20] = (state.tenants_on(e).len() as f64 / 10.0).min(3.0);
        f[21] = level_now.min(2.0);
        f[22] = level_after.min(2.0);
        f[23] = pool_in_use;
        f[24] = util[0];
        f[25] = util[1];
        f[26] = util[2];
        f[27] = pool_room;
        f[28] = pool_size;
        out.extend(f.iter().map(|&x| x as f32));
    }
}
