//! The assignment problem of paper 002 §II-C: µVNFs with a cost per packet, chained
//! into SFCs that each have an arrival rate, and the cores they share. An
//! [`Assignment`] gives every µVNF one core (Eq. 2–3); Eq. 1's load of µVNF j is
//! l(j) = λ_k · c(j) cycles/s, λ_k the rate of j's SFC.
//!
//! The JSON forms ([`Problem`], [`Workload`]) are documented in `docs/cores.md`;
//! everything read from outside goes through [`Problem::validate`].

use serde::{Deserialize, Serialize};

use crate::CoresError;

/// Current workload file version.
pub const WORKLOAD_VERSION: u32 = 1;

/// The paper's testbed clock (AMD EPYC 7301, 2.2 GHz): its costs are in its cycles.
pub const PAPER_CLOCK_HZ: f64 = 2.2e9;

/// One µVNF: what one packet costs it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Vnf {
    /// c(j): cycles per packet (at the problem's `clock_hz`; with `clock_hz` = 1e9 a
    /// cycle is a nanosecond).
    pub cost_cycles: f64,
}

/// One SFC: an ordered chain of µVNFs (indices into [`Problem::vnfs`]) and the rate
/// packets arrive at its head.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sfc {
    /// λ_k in millions of packets per second.
    pub rate_mpps: f64,
    pub vnfs: Vec<usize>,
}

/// One problem instance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Problem {
    /// |M|: cores the µVNFs may use, all alike.
    pub cores: usize,
    /// c(m): cycles per second of every core.
    #[serde(default = "default_clock")]
    pub clock_hz: f64,
    pub vnfs: Vec<Vnf>,
    pub sfcs: Vec<Sfc>,
}

fn default_clock() -> f64 {
    PAPER_CLOCK_HZ
}

/// Core index per µVNF: `cores[j]` = m with x_{m,j} = 1.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    pub cores: Vec<usize>,
}

/// A workload file: problem instances, each run by every algorithm.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub version: u32,
    #[serde(default)]
    pub name: String,
    pub problems: Vec<Problem>,
}

/// Upper bound on cores, µVNFs and SFCs a file may ask for: far above Table I, low
/// enough that a typo cannot make the twin allocate gigabytes.
pub const MAX_CORES: usize = 4096;
pub const MAX_VNFS: usize = 65_536;

impl Problem {
    /// Checks everything the twin and the assigners rely on; the message names the
    /// offending field.
    pub fn validate(&self) -> Result<(), CoresError> {
        let bad = |f: &str, m: String| Err(CoresError::invalid(f, m));
        if self.cores == 0 {
            return bad(
                "cores",
                "must be ≥ 1 (zero cores cannot run anything)".into(),
            );
        }
        if self.cores > MAX_CORES {
            return bad("cores", format!("{} is more than {MAX_CORES}", self.cores));
        }
        if !(self.clock_hz.is_finite() && self.clock_hz > 0.0) {
            return bad(
                "clock_hz",
                format!("must be finite and > 0, got {}", self.clock_hz),
            );
        }
        if self.vnfs.is_empty() {
            return bad("vnfs", "no µVNFs".into());
        }
        if self.vnfs.len() > MAX_VNFS {
            return bad(
                "vnfs",
                format!("{} µVNFs is more than {MAX_VNFS}", self.vnfs.len()),
            );
        }
        for (j, v) in self.vnfs.iter().enumerate() {
            if !(v.cost_cycles.is_finite() && v.cost_cycles > 0.0) {
                return bad(
                    &format!("vnfs[{j}].cost_cycles"),
                    format!("must be finite and > 0, got {}", v.cost_cycles),
                );
            }
        }
        if self.sfcs.is_empty() {
            return bad("sfcs", "no SFCs".into());
        }
        // Each µVNF has the arrival rate of its SFC (§IV-C's VNF representation), so
        // it must be in exactly one.
        let mut owner: Vec<Option<usize>> = vec![None; self.vnfs.len()];
        for (k, s) in self.sfcs.iter().enumerate() {
            if !(s.rate_mpps.is_finite() && s.rate_mpps >= 0.0) {
                return bad(
                    &format!("sfcs[{k}].rate_mpps"),
                    format!("must be finite and ≥ 0, got {}", s.rate_mpps),
                );
            }
            if s.vnfs.is_empty() {
                return bad(&format!("sfcs[{k}].vnfs"), "an SFC needs ≥ 1 µVNF".into());
            }
            for &j in &s.vnfs {
                let Some(o) = owner.get_mut(j) else {
                    return bad(
                        &format!("sfcs[{k}].vnfs"),
                        format!(
                            "µVNF index {j} is out of range (there are {} µVNFs)",
                            self.vnfs.len()
                        ),
                    );
                };
                if let Some(prev) = o {
                    return bad(
                        &format!("sfcs[{k}].vnfs"),
                        format!(
                            "µVNF {j} is already in SFC {prev}; each µVNF is in exactly one SFC"
                        ),
                    );
                }
                *o = Some(k);
            }
        }
        if let Some(j) = owner.iter().position(Option::is_none) {
            return bad("vnfs", format!("µVNF {j} is in no SFC"));
        }
        Ok(())
    }

    /// SFC index of every µVNF (valid problems only).
    pub fn sfc_of(&self) -> Vec<usize> {
        let mut o = vec![0; self.vnfs.len()];
        for (k, s) in self.sfcs.iter().enumerate() {
            for &j in &s.vnfs {
                if let Some(x) = o.get_mut(j) {
                    *x = k;
                }
            }
        }
        o
    }

    /// λ of every µVNF, packets per second: its SFC's offered rate.
    pub fn vnf_rates_pps(&self) -> Vec<f64> {
        let sfc = self.sfc_of();
        sfc.iter()
            .map(|&k| self.sfcs.get(k).map_or(0.0, |s| s.rate_mpps * 1e6))
            .collect()
    }

    /// l(j): offered load of every µVNF, cycles per second.
    pub fn loads(&self) -> Vec<f64> {
        self.vnf_rates_pps()
            .iter()
            .zip(&self.vnfs)
            .map(|(r, v)| r * v.cost_cycles)
            .collect()
    }

    /// Offered system rate, Mpps.
    pub fn offered_mpps(&self) -> f64 {
        self.sfcs.iter().map(|s| s.rate_mpps).sum()
    }

    /// Reads and validates one problem's JSON.
    pub fn from_json(text: &str) -> Result<Self, CoresError> {
        let p: Problem = serde_json::from_str(text)
            .map_err(|e| CoresError::invalid("problem", e.to_string()))?;
        p.validate()?;
        Ok(p)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

impl Assignment {
    /// Checks the assignment against its problem (Eq. 2–3: one core in range per µVNF).
    pub fn validate(&self, p: &Problem) -> Result<(), CoresError> {
        if self.cores.len() != p.vnfs.len() {
            return Err(CoresError::invalid(
                "assignment",
                format!("{} cores for {} µVNFs", self.cores.len(), p.vnfs.len()),
            ));
        }
        if let Some((j, m)) = self.cores.iter().enumerate().find(|(_, &m)| m >= p.cores) {
            return Err(CoresError::invalid(
                "assignment",
                format!("µVNF {j} is on core {m}, the problem has {} cores", p.cores),
            ));
        }
        Ok(())
    }

    /// Σ l(j) per core (cycles/s), the left side of Eq. 1.
    pub fn core_loads(&self, p: &Problem) -> Vec<f64> {
        let mut out = vec![0.0; p.cores];
        for (&m, l) in self.cores.iter().zip(p.loads()) {
            if let Some(x) = out.get_mut(m) {
                *x += l;
            }
        }
        out
    }
}

impl Workload {
    /// Parses and validates a workload file's text.
    pub fn from_json(text: &str) -> Result<Self, CoresError> {
        let w: Workload = serde_json::from_str(text)
            .map_err(|e| CoresError::invalid("workload", e.to_string()))?;
        if w.version != WORKLOAD_VERSION {
            return Err(CoresError::invalid(
                "version",
                format!(
                    "workload version {}, this build reads version {WORKLOAD_VERSION}",
                    w.version
                ),
            ));
        }
        if w.problems.is_empty() {
            return Err(CoresError::invalid("problems", "no problems".into()));
        }
        for (i, p) in w.problems.iter().enumerate() {
            p.validate().map_err(|e| match e {
                CoresError::Invalid { field, reason } => CoresError::Invalid {
                    field: format!("problems[{i}].{field}"),
                    reason,
                },
                other => other,
            })?;
        }
        Ok(w)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Problem {
        Problem {
            cores: 2,
            clock_hz: PAPER_CLOCK_HZ,
            vnfs: vec![
                Vnf { cost_cycles: 100.0 },
                Vnf { cost_cycles: 200.0 },
                Vnf { cost_cycles: 300.0 },
            ],
            sfcs: vec![
                Sfc {
                    rate_mpps: 1.0,
                    vnfs: vec![0, 1],
                },
                Sfc {
                    rate_mpps: 0.5,
                    vnfs: vec![2],
                },
            ],
        }
    }

    fn field_of(e: CoresError) -> String {
        match e {
            CoresError::Invalid { field, reason } => format!("{field}: {reason}"),
            other => panic!("expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn loads_follow_rates_and_costs() {
        let p = small();
        p.validate().unwrap();
        assert_eq!(p.loads(), vec![1e8, 2e8, 1.5e8]);
        let a = Assignment {
            cores: vec![0, 1, 0],
        };
        a.validate(&p).unwrap();
        assert_eq!(a.core_loads(&p), vec![2.5e8, 2e8]);
        assert!(Assignment {
            cores: vec![0, 2, 0]
        }
        .validate(&p)
        .is_err());
        assert!(Assignment { cores: vec![0] }.validate(&p).is_err());
    }

    #[test]
    fn bad_problems_are_refused_with_the_field() {
        let mut p = small();
        p.cores = 0;
        assert!(field_of(p.validate().unwrap_err()).starts_with("cores"));
        // What breaks `small()`, and what the error's field says ("": only that it fails).
        type Case = (fn(&mut Problem), &'static str);
        let cases: &[Case] = &[
            (|p| p.sfcs[1].vnfs.clear(), "sfcs[1].vnfs"),
            (|p| p.sfcs[1].vnfs = vec![7], "out of range"),
            (|p| p.vnfs[2].cost_cycles = f64::NAN, "vnfs[2].cost_cycles"),
            (|p| p.vnfs[0].cost_cycles = -1.0, ""),
            (|p| p.sfcs[0].rate_mpps = f64::INFINITY, "rate_mpps"),
            (|p| p.sfcs[0].rate_mpps = -0.1, ""),
            (|p| p.sfcs[1].vnfs = vec![1], "already in SFC 0"),
            (|p| drop(p.sfcs.pop()), "in no SFC"),
            (|p| p.sfcs.clear(), ""),
        ];
        for (i, (break_it, want)) in cases.iter().enumerate() {
            let mut p = small();
            break_it(&mut p);
            let err = p.validate().expect_err(&format!("case {i}"));
            if !want.is_empty() {
                assert!(field_of(err).contains(want), "case {i}");
            }
        }
    }

    #[test]
    fn workload_json_round_trips_and_refuses_bad_files() {
        let w = Workload {
            version: WORKLOAD_VERSION,
            name: "t".into(),
            problems: vec![small()],
        };
        assert_eq!(Workload::from_json(&w.to_json()).unwrap(), w);
        assert!(Workload::from_json("{").is_err());
        assert!(Workload::from_json(r#"{"version":1,"problems":[]}"#).is_err());
        let mut bad = w.clone();
        bad.version = 9;
        assert!(field_of(Workload::from_json(&bad.to_json()).unwrap_err()).contains("version"));
        let mut bad = w;
        bad.problems[0].cores = 0;
        let e = field_of(Workload::from_json(&bad.to_json()).unwrap_err());
        assert!(e.starts_with("problems[0].cores"), "{e}");
        // Unknown fields are typos, not extensions.
        assert!(Problem::from_json(
            r#"{"cores":1,"vnfs":[{"cost_cycles":1}],"sfcs":[{"rate_mpps":1,"vnfs":[0]}],"x":1}"#
        )
        .is_err());
        // clock_hz defaults to the paper's testbed.
        let p = Problem::from_json(
            r#"{"cores":1,"vnfs":[{"cost_cycles":1}],"sfcs":[{"rate_mpps":1,"vnfs":[0]}]}"#,
        )
        .unwrap();
        assert_eq!(p.clock_hz, PAPER_CLOCK_HZ);
    }
}
