//! The CFS digital twin of paper 002 §IV-E: given a problem and an assignment, the
//! throughput and latency each SFC gets.
//!
//! The paper's model: µVNF j on core m gets the time slice
//! t_{j,m} = T · l(j,m) / Σ_i x_{i,m} l(i,m) of every scheduling period T (rate-cost
//! proportional weights, NFVnice), and processes s_j = γ · t_{j,m} · c(m) / c(j)
//! packets in it. This module computes that, and the parts the paper leaves to the
//! system (our readings, in docs/cores.md):
//! - CFS is work-conserving: a µVNF that needs less than its weighted share yields,
//!   and the rest goes to the others in proportion to their weights (weighted
//!   water-filling). Under [`Scheduler::Cfs`] every weight is 1; under
//!   [`Scheduler::RateCost`] the weight is the offered load λ·c(j), which with
//!   every µVNF hungry gives the paper's t_{j,m} exactly.
//! - γ (lost to context switches) applies to cores shared by ≥ 2 µVNFs; a pinned
//!   µVNF does not switch.
//! - Backpressure (NFVnice): an SFC runs at the rate of its bottleneck µVNF and its
//!   upstream µVNFs drop early, so every µVNF of the chain processes only that rate,
//!   and the cycles saved go to the other µVNFs on their cores. The bottleneck stays
//!   backlogged (hungry). Without backpressure each µVNF processes what reaches it
//!   and drops what it cannot, after upstream µVNFs spent cycles on those packets.
//! - Both are fixed points over the SFC rates, found by damped iteration.
//! - Latency per packet = Σ over the chain of processing time c(j)/c(m), the wait
//!   while other µVNFs on the core run (each runs ≤ its slice; a packet arriving at a
//!   random time waits on average Σ_{i≠j} u_i·t_i/2, u_i the share of the core i
//!   uses), and queueing: M/D/1 on the µVNF's share when it keeps up, a full queue
//!   (`queue_packets` / service rate) when it is the bottleneck or drops.

use serde::{Deserialize, Serialize};

use crate::problem::{Assignment, Problem};
use crate::CoresError;

/// How a core's time is split among its runnable µVNFs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scheduler {
    /// Plain CFS: equal weights.
    Cfs,
    /// NFVnice's rate-cost proportional fairness: weight = arrival rate × cost.
    RateCost,
}

/// The twin's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TwinParams {
    /// T: CFS scheduling latency, seconds (Table III: 1 ms).
    pub period_s: f64,
    /// γ ∈ (0, 1]: the share of a shared core left after context switches.
    pub gamma: f64,
    pub scheduler: Scheduler,
    pub backpressure: bool,
    /// A µVNF's input queue, packets: the backlog a saturated µVNF holds.
    pub queue_packets: f64,
}

impl Default for TwinParams {
    /// The paper's evaluation setting: RC + BP, T = 1 ms.
    fn default() -> Self {
        TwinParams {
            period_s: 1e-3,
            gamma: 0.95,
            scheduler: Scheduler::RateCost,
            backpressure: true,
            queue_packets: 1024.0,
        }
    }
}

impl TwinParams {
    pub fn validate(&self) -> Result<(), CoresError> {
        if !(self.period_s.is_finite() && self.period_s > 0.0) {
            return Err(CoresError::invalid(
                "period_s",
                "must be finite and > 0".into(),
            ));
        }
        if !(self.gamma > 0.0 && self.gamma <= 1.0) {
            return Err(CoresError::invalid("gamma", "must be in (0, 1]".into()));
        }
        if !(self.queue_packets.is_finite() && self.queue_packets >= 1.0) {
            return Err(CoresError::invalid("queue_packets", "must be ≥ 1".into()));
        }
        Ok(())
    }
}

/// What the twin predicts for one assignment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Delivered rate of every SFC, Mpps.
    pub sfc_mpps: Vec<f64>,
    /// Mean latency of a delivered packet of every SFC, seconds.
    pub sfc_latency_s: Vec<f64>,
    /// Share of its core's time each µVNF uses (Σ per core ≤ 1).
    pub vnf_share: Vec<f64>,
    /// Packets per second each µVNF processes.
    pub vnf_pps: Vec<f64>,
    /// π_j: each µVNF's payoff, its SFC's delivered / offered rate.
    pub payoff: Vec<f64>,
    /// Requested cycles / cycles of every core (> 1: overloaded).
    pub core_load: Vec<f64>,
    /// Σ SFC rates, Mpps.
    pub throughput_mpps: f64,
    /// Mean latency over delivered packets, seconds.
    pub latency_s: f64,
}

const ITERATIONS: usize = 200;

/// Weighted max-min share of `cap` among demands (water-filling): nobody gets more
/// than it asks; the rest is split by weight.
fn water_fill(cap: f64, demand: &[f64], weight: &[f64], out: &mut [f64]) {
    let total: f64 = demand.iter().sum();
    if total <= cap {
        out.copy_from_slice(demand);
        return;
    }
    let mut order: Vec<usize> = (0..demand.len()).collect();
    // Fill in order of demand per weight: the first to be satisfied come first.
    let key = |i: usize| {
        if weight[i] > 0.0 {
            demand[i] / weight[i]
        } else if demand[i] > 0.0 {
            f64::INFINITY
        } else {
            0.0
        }
    };
    order.sort_by(|&a, &b| key(a).total_cmp(&key(b)));
    let mut left = cap;
    let mut wsum: f64 = weight.iter().sum();
    for (n, &i) in order.iter().enumerate() {
        let fair = if wsum > 0.0 {
            left * weight[i] / wsum
        } else {
            // Zero weights everywhere: split evenly among the rest.
            left / (order.len() - n) as f64
        };
        let a = demand[i].min(fair).max(0.0);
        out[i] = a;
        left = (left - a).max(0.0);
        wsum -= weight[i];
    }
}

struct Core {
    members: Vec<usize>,
    cap: f64,
}

/// Predicts per-SFC throughput and latency of `a` on `p`.
pub fn evaluate(
    p: &Problem,
    a: &Assignment,
    params: &TwinParams,
) -> Result<Prediction, CoresError> {
    p.validate()?;
    a.validate(p)?;
    params.validate()?;
    Ok(evaluate_unchecked(p, a, params))
}

/// [`evaluate`] for inputs already validated (the training loop's hot path).
pub(crate) fn evaluate_unchecked(p: &Problem, a: &Assignment, params: &TwinParams) -> Prediction {
    let n = p.vnfs.len();
    let sfc_of = p.sfc_of();
    let lambda: Vec<f64> = p.sfcs.iter().map(|s| s.rate_mpps * 1e6).collect();
    let cost: Vec<f64> = p.vnfs.iter().map(|v| v.cost_cycles).collect();
    let offered: Vec<f64> = (0..n).map(|j| lambda[sfc_of[j]] * cost[j]).collect();
    let mut cores: Vec<Core> = (0..p.cores)
        .map(|_| Core {
            members: Vec::new(),
            cap: p.clock_hz,
        })
        .collect();
    for (j, &m) in a.cores.iter().enumerate() {
        cores[m].members.push(j);
    }
    for c in &mut cores {
        if c.members.len() > 1 {
            c.cap *= params.gamma;
        }
    }
    let weight: Vec<f64> = match params.scheduler {
        Scheduler::Cfs => vec![1.0; n],
        Scheduler::RateCost => offered.clone(),
    };
    let core_of = &a.cores;

    // Allocation of cycles/s on every core for the given demands.
    let allocate = |demand: &[f64], alloc: &mut [f64]| {
        let mut d = Vec::new();
        let mut w = Vec::new();
        let mut o = Vec::new();
        for c in &cores {
            d.clear();
            w.clear();
            d.extend(c.members.iter().map(|&j| demand[j]));
            w.extend(c.members.iter().map(|&j| weight[j]));
            o.clear();
            o.resize(d.len(), 0.0);
            water_fill(c.cap, &d, &w, &mut o);
            for (&j, &x) in c.members.iter().zip(&o) {
                alloc[j] = x;
            }
        }
    };
    // What j could get if it were backlogged (asking for the whole core), the others
    // asking `demand`: its service rate, which its queue sees.
    let hungry = |j: usize, demand: &[f64]| -> f64 {
        let c = &cores[core_of[j]];
        let d: Vec<f64> = c
            .members
            .iter()
            .map(|&i| if i == j { c.cap } else { demand[i] })
            .collect();
        let w: Vec<f64> = c.members.iter().map(|&i| weight[i]).collect();
        let mut o = vec![0.0; d.len()];
        water_fill(c.cap, &d, &w, &mut o);
        c.members.iter().position(|&i| i == j).map_or(0.0, |k| o[k])
    };

    let mut alloc = vec![0.0; n];
    let mut rate_in = vec![0.0; n]; // packets/s reaching each µVNF
    let mut done = vec![0.0; n]; // packets/s each µVNF processes
    let mut sfc_rate = lambda.clone();
    let mut bottleneck = vec![false; n];
    let mut cap_pps = vec![f64::INFINITY; n]; // service rate when backlogged
    if params.backpressure {
        let mut demand = vec![0.0; n];
        for it in 0..ITERATIONS {
            for j in 0..n {
                demand[j] = sfc_rate[sfc_of[j]] * cost[j];
            }
            let mut next = lambda.clone();
            for j in 0..n {
                cap_pps[j] = hungry(j, &demand) / cost[j];
                let k = sfc_of[j];
                next[k] = next[k].min(cap_pps[j]);
            }
            let mut delta = 0.0f64;
            for (x, nx) in sfc_rate.iter_mut().zip(&next) {
                // Damped: the map is decreasing in the other SFCs' rates.
                let v = if it == 0 { *nx } else { 0.5 * (*x + nx) };
                delta = delta.max((v - *x).abs() / x.max(1.0));
                *x = v;
            }
            if delta < 1e-10 {
                break;
            }
        }
        for j in 0..n {
            let k = sfc_of[j];
            rate_in[j] = sfc_rate[k];
            done[j] = sfc_rate[k];
            demand[j] = sfc_rate[k] * cost[j];
            bottleneck[j] = lambda[k] > 0.0
                && cap_pps[j] <= sfc_rate[k] * (1.0 + 1e-6)
                && sfc_rate[k] < lambda[k] * (1.0 - 1e-9);
        }
        allocate(&demand, &mut alloc);
        // The bottleneck is backlogged: it keeps its whole share.
        for j in 0..n {
            if bottleneck[j] {
                alloc[j] = alloc[j].max(cap_pps[j].min(lambda[sfc_of[j]]) * cost[j]);
            }
        }
    } else {
        for j in 0..n {
            rate_in[j] = lambda[sfc_of[j]];
        }
        let mut demand = vec![0.0; n];
        for it in 0..ITERATIONS {
            for j in 0..n {
                demand[j] = rate_in[j] * cost[j];
            }
            allocate(&demand, &mut alloc);
            for j in 0..n {
                done[j] = if cost[j] > 0.0 {
                    alloc[j] / cost[j]
                } else {
                    rate_in[j]
                };
            }
            let mut delta = 0.0f64;
            for s in &p.sfcs {
                let mut up = lambda[sfc_of[s.vnfs[0]]];
                for &j in &s.vnfs {
                    let v = if it == 0 { up } else { 0.5 * (rate_in[j] + up) };
                    delta = delta.max((v - rate_in[j]).abs() / rate_in[j].max(1.0));
                    rate_in[j] = v;
                    up = done[j].min(v);
                }
            }
            if delta < 1e-10 {
                break;
            }
        }
        for j in 0..n {
            demand[j] = rate_in[j] * cost[j];
        }
        allocate(&demand, &mut alloc);
        for j in 0..n {
            done[j] = (alloc[j] / cost[j]).min(rate_in[j]);
            cap_pps[j] = hungry(j, &demand) / cost[j];
            bottleneck[j] = done[j] < rate_in[j] * (1.0 - 1e-9);
        }
        for (k, s) in p.sfcs.iter().enumerate() {
            sfc_rate[k] = s.vnfs.last().map_or(0.0, |&j| done[j]);
        }
    }

    // Latency.
    let weight_sum: Vec<f64> = cores
        .iter()
        .map(|c| c.members.iter().map(|&j| weight[j]).sum())
        .collect();
    let slice = |j: usize| -> f64 {
        let ws = weight_sum[core_of[j]];
        if ws > 0.0 {
            params.period_s * weight[j] / ws
        } else {
            params.period_s
        }
    };
    let mut vnf_latency = vec![0.0; n];
    let mut vnf_share = vec![0.0; n];
    for j in 0..n {
        let c = &cores[core_of[j]];
        vnf_share[j] = alloc[j] / p.clock_hz;
        let service = cost[j] / p.clock_hz;
        let wait: f64 = c
            .members
            .iter()
            .filter(|&&i| i != j)
            .map(|&i| (alloc[i] / p.clock_hz) * slice(i) / 2.0)
            .sum();
        let mu = cap_pps[j].max(1e-9);
        let queue = if bottleneck[j] {
            params.queue_packets / mu
        } else {
            let rho = (rate_in[j] / mu).min(1.0);
            let full = params.queue_packets / mu;
            if rho >= 1.0 {
                full
            } else {
                (rho / (2.0 * mu * (1.0 - rho))).min(full)
            }
        };
        vnf_latency[j] = service + wait + queue;
    }
    let sfc_latency_s: Vec<f64> = p
        .sfcs
        .iter()
        .map(|s| s.vnfs.iter().map(|&j| vnf_latency[j]).sum())
        .collect();
    let sfc_mpps: Vec<f64> = sfc_rate.iter().map(|r| r / 1e6).collect();
    let throughput_mpps: f64 = sfc_mpps.iter().sum();
    let latency_s = if throughput_mpps > 0.0 {
        sfc_mpps
            .iter()
            .zip(&sfc_latency_s)
            .map(|(x, l)| x * l)
            .sum::<f64>()
            / throughput_mpps
    } else {
        sfc_latency_s.iter().sum::<f64>() / sfc_latency_s.len().max(1) as f64
    };
    let payoff = (0..n)
        .map(|j| {
            let k = sfc_of[j];
            if lambda[k] > 0.0 {
                (sfc_rate[k] / lambda[k]).clamp(0.0, 1.0)
            } else {
                1.0
            }
        })
        .collect();
    let core_load = a
        .core_loads(p)
        .into_iter()
        .map(|l| l / p.clock_hz)
        .collect();
    Prediction {
        sfc_mpps,
        sfc_latency_s,
        vnf_share,
        vnf_pps: done,
        payoff,
        core_load,
        throughput_mpps,
        latency_s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::{Sfc, Vnf};

    const CLOCK: f64 = 2.2e9;

    fn problem(cores: usize, costs: &[f64], chains: &[(f64, Vec<usize>)]) -> Problem {
        Problem {
            cores,
            clock_hz: CLOCK,
            vnfs: costs.iter().map(|&c| Vnf { cost_cycles: c }).collect(),
            sfcs: chains
                .iter()
                .map(|(r, v)| Sfc {
                    rate_mpps: *r,
                    vnfs: v.clone(),
                })
                .collect(),
        }
    }

    fn eval(p: &Problem, cores: &[usize], params: &TwinParams) -> Prediction {
        evaluate(
            p,
            &Assignment {
                cores: cores.to_vec(),
            },
            params,
        )
        .unwrap()
    }

    #[test]
    fn water_fill_respects_demand_capacity_and_weights() {
        let mut o = vec![0.0; 3];
        water_fill(10.0, &[2.0, 8.0, 8.0], &[1.0, 1.0, 1.0], &mut o);
        assert_eq!(o, vec![2.0, 4.0, 4.0]);
        water_fill(10.0, &[20.0, 20.0, 1.0], &[3.0, 1.0, 1.0], &mut o);
        assert!((o[2] - 1.0).abs() < 1e-12);
        assert!((o[0] - 6.75).abs() < 1e-12 && (o[1] - 2.25).abs() < 1e-12);
        water_fill(10.0, &[1.0, 2.0, 3.0], &[0.0, 1.0, 1.0], &mut o);
        assert_eq!(o, vec![1.0, 2.0, 3.0]);
    }

    #[test]
    fn co_locating_two_heavy_vnfs_lowers_throughput() {
        // Two SFCs of one heavy µVNF each, 0.6 of a core apiece.
        let c = 0.6 * CLOCK / 1e6;
        let p = problem(2, &[c, c], &[(1.0, vec![0]), (1.0, vec![1])]);
        let params = TwinParams::default();
        let spread = eval(&p, &[0, 1], &params);
        let packed = eval(&p, &[0, 0], &params);
        assert!((spread.throughput_mpps - 2.0).abs() < 1e-6, "{spread:?}");
        assert!(
            packed.throughput_mpps < spread.throughput_mpps * 0.9,
            "{packed:?}"
        );
        // γ·clock / (2 × 0.6 clock) of each SFC gets through.
        let expect = 2.0 * params.gamma / 1.2;
        assert!((packed.throughput_mpps - expect).abs() < 1e-6, "{packed:?}");
        assert!(packed.latency_s > spread.latency_s);
        assert!(packed.core_load[0] > 1.0 && packed.core_load[1] == 0.0);
    }

    #[test]
    fn shares_never_exceed_a_core() {
        let p = problem(
            2,
            &[3000.0, 500.0, 900.0, 4000.0, 100.0],
            &[(0.9, vec![0, 1, 2]), (0.7, vec![3, 4])],
        );
        for sched in [Scheduler::Cfs, Scheduler::RateCost] {
            for bp in [false, true] {
                let params = TwinParams {
                    scheduler: sched,
                    backpressure: bp,
                    ..TwinParams::default()
                };
                for asg in [[0, 0, 0, 0, 0], [0, 1, 0, 1, 0], [1, 1, 0, 0, 1]] {
                    let r = eval(&p, &asg, &params);
                    let mut per = [0.0; 2];
                    for (j, &m) in asg.iter().enumerate() {
                        per[m] += r.vnf_share[j];
                        assert!(
                            r.vnf_pps[j] <= p.sfcs[p.sfc_of()[j]].rate_mpps * 1e6 * (1.0 + 1e-9)
                        );
                    }
                    assert!(
                        per.iter().all(|&s| s <= 1.0 + 1e-9),
                        "{sched:?} {bp} {asg:?} {per:?}"
                    );
                    assert!(r
                        .sfc_mpps
                        .iter()
                        .zip(&p.sfcs)
                        .all(|(x, s)| *x <= s.rate_mpps + 1e-9));
                    assert!(r.latency_s.is_finite() && r.latency_s > 0.0);
                }
            }
        }
    }

    #[test]
    fn backpressure_caps_an_sfc_at_its_bottleneck_and_frees_upstream_cycles() {
        // SFC 0: a cheap µVNF on core 0, then an expensive one pinned to core 1 that
        // can do 0.5 Mpps. SFC 1 shares core 0 with the cheap one and is heavy.
        let c_bottleneck = CLOCK / 0.5e6;
        let p = problem(
            2,
            &[1500.0, c_bottleneck, 1500.0],
            &[(1.0, vec![0, 1]), (1.0, vec![2])],
        );
        let bp = eval(&p, &[0, 1, 0], &TwinParams::default());
        assert!((bp.sfc_mpps[0] - 0.5).abs() < 1e-6, "{bp:?}");
        // The upstream µVNF processes only what the bottleneck can take.
        assert!((bp.vnf_pps[0] - 0.5e6).abs() < 1.0);
        let nobp = eval(
            &p,
            &[0, 1, 0],
            &TwinParams {
                backpressure: false,
                ..TwinParams::default()
            },
        );
        assert!((nobp.sfc_mpps[0] - 0.5).abs() < 1e-6, "{nobp:?}");
        assert!(
            nobp.vnf_pps[0] > 0.5e6 * 1.1,
            "without BP upstream works for drops"
        );
        // The cycles BP saves on core 0 go to SFC 1.
        assert!(
            bp.sfc_mpps[1] > nobp.sfc_mpps[1] * 1.05,
            "{} vs {}",
            bp.sfc_mpps[1],
            nobp.sfc_mpps[1]
        );
        // The backlogged bottleneck adds a full queue to the SFC's latency.
        assert!(bp.sfc_latency_s[0] > 1024.0 / 0.5e6);
    }

    #[test]
    fn rate_cost_beats_plain_cfs_on_unequal_loads() {
        // A heavy and a light µVNF share a core that is overloaded: CFS's equal split
        // starves the heavy one (NFVnice §2).
        let p = problem(1, &[3000.0, 300.0], &[(0.6, vec![0]), (1.0, vec![1])]);
        let rc = eval(&p, &[0, 0], &TwinParams::default());
        let cfs = eval(
            &p,
            &[0, 0],
            &TwinParams {
                scheduler: Scheduler::Cfs,
                ..TwinParams::default()
            },
        );
        // Under RC both SFCs get the same fraction of their rate.
        assert!((rc.payoff[0] - rc.payoff[1]).abs() < 1e-9);
        assert!(cfs.payoff[0] < cfs.payoff[1]);
        assert!(rc.payoff[0] > cfs.payoff[0]);
    }

    #[test]
    fn an_underloaded_assignment_delivers_everything() {
        let p = problem(
            3,
            &[800.0, 1200.0, 400.0, 2000.0],
            &[(0.5, vec![0, 1]), (0.3, vec![2, 3])],
        );
        let r = eval(&p, &[0, 1, 0, 2], &TwinParams::default());
        assert!((r.throughput_mpps - 0.8).abs() < 1e-9);
        assert!(r.payoff.iter().all(|&x| (x - 1.0).abs() < 1e-9));
        // Sharing a core costs waiting time: the pinned µVNF 3 waits for nobody.
        let pinned = eval(&p, &[0, 1, 2, 2], &TwinParams::default());
        assert!(pinned.sfc_latency_s[0] < r.sfc_latency_s[0]);
    }

    #[test]
    fn a_pinned_vnf_that_keeps_up_does_not_queue() {
        // 1 Mpps at 1100 cycles: half a core, alone. Processing 0.5 µs, M/D/1 at
        // ρ = 0.5 on a 2 Mpps server: 0.5 / (2 · 2e6 · 0.5) = 0.25 µs.
        let p = problem(1, &[1100.0], &[(1.0, vec![0])]);
        let r = eval(&p, &[0], &TwinParams::default());
        assert!((r.latency_s - 0.75e-6).abs() < 1e-9, "{}", r.latency_s);
        // At ρ = 0.99 the queue grows but stays far from a full one.
        let p = problem(1, &[2178.0], &[(1.0, vec![0])]);
        let r = eval(&p, &[0], &TwinParams::default());
        assert!(r.latency_s < 1e-4 && r.latency_s > 3e-5, "{}", r.latency_s);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let p = problem(1, &[100.0], &[(1.0, vec![0])]);
        assert!(evaluate(&p, &Assignment { cores: vec![1] }, &TwinParams::default()).is_err());
        let bad = TwinParams {
            gamma: 0.0,
            ..TwinParams::default()
        };
        assert!(evaluate(&p, &Assignment { cores: vec![0] }, &bad).is_err());
    }
}
