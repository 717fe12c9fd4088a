//! `starfabric bench scaling`: every elasticity event under live traffic on the netns
//! testbed, with the driver the elasticity tests use (`testbed::elastic`), so the
//! numbers here come from tested code.
//!
//! One testbed (prefix `sfs-<pid>-`) in PP cluster mode (docs/pp-cluster.md: 3 PP node
//! namespaces behind the router's ECMP route over 8 vIPs, 2 nodes running at first),
//! one platform with 6 SC nodes, and the scenarios in a row on it:
//! - `sc_scale_out` (3 spare SC nodes become the new group), `sc_scale_in` (they are
//!   spares again), `sc_replica_failover` (the middle replica is SIGKILLed, a spare
//!   replaces it), each with p99 connection setup;
//! - `pp_scale_out` (PP node 2 starts and takes vIPs; `seconds_to_traffic`),
//!   `pp_failover` (PP node 1 is SIGKILLed; `recovery_ms` from a probe every 0.5 ms),
//!   `pp_scale_in` (PP node 0 is drained, then stopped);
//! - `pp_failover_silent` (nodes 0 and 1 run again; node 0's link goes down, so only
//!   its missing heartbeats tell FM; `recovery_ms`);
//! - `fm_failover` (the FM is SIGKILLed; the PP and SC nodes move to the standby FM,
//!   which adopts the groups; `recovery_ms`);
//! - `live_migration` (PP node 2 restarted accelerated, `--offload`; every vIP moves
//!   from plain node 1 to it and back; `migration_ms` per direction, resets, and
//!   iperf3's throughput before, during and after each move).
//!
//! Each gives failed and reset connections and a 100 ms timeline of bytes sent per
//! node; `--plot` draws the timelines as SVG. The SC scenarios also run unpaced iperf3
//! flows beside the paced ones and give `throughput_dip` (their worst 100 ms during the
//! event over their mean before it, as the receiver counted) and `p99_ratio` (new-flow
//! setup p99 during over before); docs/elastic-tests.md defines both windows. Beside
//! them, the metric's floor with no event: `sc_no_event_floor` through the platform and
//! `kernel_floor` through Linux forwarding on a testbed of its own, run first.
//! `--workload FILE` sets the load ([`ScalingWorkload`]).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use testbed::baseline::{self, KernelMode};
use testbed::chains::{self, Toward};
use testbed::elastic::{
    self, ConnLoop, DipFloor, Event, Iperf, IperfSpec, LoadSpec, ScenarioReport, ScenarioSpec,
};
use testbed::platform::{self, PlatformSpec};
use testbed::probe::ProbeSpec;
use testbed::topo::vni;
use testbed::{services, Testbed, TopologySpec};

#[derive(Args, Clone, Debug)]
pub struct ScalingBenchArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Write the per-node TX timelines as an SVG file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// New TCP connections per second during each scenario (overrides the workload's;
    /// default 100).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Seconds of load before and after each event (overrides the workload's; default 2).
    #[arg(long)]
    pub settle: Option<f64>,
    /// Only the SC scenarios (scale-out, scale-in, replica failover).
    #[arg(long)]
    pub sc_only: bool,
    /// The load, as JSON (docs/elastic-tests.md, "Scaling workload"); flags override it.
    #[arg(long)]
    pub workload: Option<PathBuf>,
    /// How the SC scale-outs move the flows' state (docs/scaling.md): `bulk`, `gradual`,
    /// or `both` (alternating, bulk first, each scale-out followed by a scale-in).
    /// Without it: FM's default, one scale-out and one scale-in.
    #[arg(long, value_parser = ["bulk", "gradual", "both"])]
    pub migration: Option<String>,
    /// With `--migration`: scale-out/scale-in pairs per mode.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub rounds: u32,
    /// More arguments for every PP node, after the platform's own (e.g.
    /// `--pp-arg=--worker-rt-always`), as in `bench e2e`. Not `--io=udp`: the PP
    /// nodes here hold vIP groups, which need the AF_XDP backend's XDP program.
    #[arg(long = "pp-arg", allow_hyphen_values = true)]
    pub pp_args: Vec<String>,
}

/// `--workload FILE`: the load every scenario runs under. Every field is optional.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScalingWorkload {
    /// New TCP connections per second (SNAT, to nginx on the internet host).
    pub rate: f64,
    /// Seconds of load before and after each event.
    pub settle: f64,
    /// Paced iperf3 streams and their rate (iperf3 `-b`), as before.
    pub paced_streams: u32,
    pub paced_bitrate: String,
    /// Unpaced iperf3 streams in the SC scenarios (0: none, and no `throughput_dip`).
    pub unpaced_streams: u32,
}

impl Default for ScalingWorkload {
    fn default() -> Self {
        ScalingWorkload {
            rate: 100.0,
            settle: 2.0,
            paced_streams: 2,
            paced_bitrate: "50M".into(),
            unpaced_streams: 1,
        }
    }
}

impl ScalingWorkload {
    pub fn load(path: &std::path::Path) -> Result<ScalingWorkload> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading workload {}", path.display()))?;
        let w: ScalingWorkload = serde_json::from_str(&text)
            .with_context(|| format!("workload {}: not a scaling workload", path.display()))?;
        w.check()
            .with_context(|| format!("workload {}", path.display()))?;
        Ok(w)
    }

    pub fn check(&self) -> Result<()> {
        ensure!(
            self.rate.is_finite() && self.rate > 0.0 && self.rate <= 5_000.0,
            "rate must be in (0, 5000] connections/s, got {}",
            self.rate
        );
        ensure!(
            self.settle.is_finite() && self.settle >= 0.5 && self.settle <= 120.0,
            "settle must be in [0.5, 120] s, got {}",
            self.settle
        );
        ensure!(
            (1..=16).contains(&self.paced_streams),
            "paced_streams must be 1..=16, got {}",
            self.paced_streams
        );
        ensure!(
            self.unpaced_streams <= 16,
            "unpaced_streams must be 0..=16, got {}",
            self.unpaced_streams
        );
        let b = self
            .paced_bitrate
            .trim_end_matches(['K', 'M', 'G', 'k', 'm', 'g']);
        ensure!(
            !b.is_empty() && b.parse::<f64>().is_ok_and(|v| v > 0.0),
            "paced_bitrate must be a positive iperf3 rate such as \"50M\", got {:?}",
            self.paced_bitrate
        );
        Ok(())
    }

    /// The file's load with the flags over it.
    pub fn from_args(a: &ScalingBenchArgs) -> Result<ScalingWorkload> {
        let mut w = match &a.workload {
            Some(p) => ScalingWorkload::load(p)?,
            None => ScalingWorkload::default(),
        };
        if let Some(r) = a.rate {
            w.rate = r;
        }
        if let Some(s) = a.settle {
            w.settle = s;
        }
        w.check().context("--rate/--settle")?;
        Ok(w)
    }
}

#[derive(Debug, Serialize)]
pub struct ScalingBench {
    pub workload: ScalingWorkload,
    /// `--pp-arg`s, if any: what every PP node ran with beyond the platform's own.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pp_args: Vec<String>,
    /// The same load with no event (a 300 ms pause where the event would be): the
    /// noise floor of `throughput_dip` on this machine.
    pub sc_no_event: ScenarioReport,
    /// `throughput_dip` over every 1 s window of `sc_no_event`'s load (its pause
    /// included): the spread of the metric through the platform with no event.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sc_no_event_floor: Option<DipFloor>,
    /// What `p99_ratio` reads with no event: `sc_no_event`'s new-flow setup p99 in the
    /// pause's window (its start to 1 s after its end) over p99 before it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sc_no_event_p99_ratio: Option<f64>,
    /// The same iperf3 flows and connection load with Linux forwarding in place of the
    /// platform (no PP, SC or FM running), and the same windows: the machine's own
    /// floor under `throughput_dip`. Absent without unpaced flows, or when the run
    /// failed (`kernel_floor_error`): a baseline does not stop the platform's bench.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel_floor: Option<KernelFloor>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel_floor_error: Option<String>,
    pub sc_scale_out: ScenarioReport,
    pub sc_scale_in: ScenarioReport,
    pub sc_replica_failover: ScenarioReport,
    /// With `--migration`: every scale-out/scale-in pair, in the order run
    /// (`sc_scale_out` and `sc_scale_in` are the first pair's).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub migration_runs: Vec<MigrationRun>,
    /// The PP and FM scenarios: absent with `--sc-only`.
    #[serde(flatten)]
    pub rest: Option<RestScenarios>,
}

/// [`ScalingBench::kernel_floor`].
#[derive(Debug, Serialize)]
pub struct KernelFloor {
    /// The unpaced flows' mean, Mbit/s, as the receiver counted it.
    pub unpaced_mbps: f64,
    pub seconds: u32,
    pub connections: usize,
    pub floor: DipFloor,
}

/// The window [`DipFloor`] slides: an event's "during" window is its own length plus
/// 1 s, so 1 s is the shortest any event has and the floor's most lenient reading.
const FLOOR_WINDOW_MS: f64 = 1000.0;

/// [`KernelFloor`]: a testbed of its own (prefix `sfk-<pid>-`, one PP namespace that
/// runs Linux forwarding, `baseline::KernelMode::Forward`), the scenarios' iperf3 flows
/// and connection load for `secs`, and [`elastic::dip_floor`] over the receiver's
/// intervals from 1 s in to 0.5 s before the end.
fn kernel_floor(w: &ScalingWorkload, secs: u32) -> Result<KernelFloor> {
    let (prefix, res) = crate::testbed_cmd::testbed_run("sfk-")?;
    let tb = Testbed::build(TopologySpec::new(&prefix).tenants(1), res.clone())?;
    let run = || -> Result<KernelFloor> {
        services::start_inet(&tb, false)?;
        services::start_iperf3_unpaced(&tb)?;
        let k = baseline::start_kernel(&tb, KernelMode::Forward)?;
        let measured = (|| -> Result<KernelFloor> {
            let iperf = Iperf::start(
                &tb,
                &IperfSpec {
                    streams: w.paced_streams,
                    bitrate: w.paced_bitrate.clone(),
                    unpaced_streams: w.unpaced_streams,
                    ..IperfSpec::new(secs)
                },
            )?;
            let conns = ConnLoop::start(
                &tb,
                &LoadSpec {
                    rate: w.rate,
                    limit: Duration::from_secs(secs.into()),
                    ..LoadSpec::new()
                },
            )?;
            let report = iperf.wait(&tb)?;
            let connections = conns.stop()?.len();
            let u = report
                .unpaced
                .context("the unpaced iperf3 run gave no report")?;
            ensure!(u.error.is_none(), "unpaced iperf3: {:?}", u.error);
            let tl = &u.receiver_timeline;
            let floor = elastic::dip_floor(
                tl,
                0.0,
                FLOOR_WINDOW_MS,
                1000.0,
                f64::from(secs) * 1000.0 - 500.0,
            )
            .context("the kernel run's receiver timeline is too short for a window")?;
            let mbps = tl.iter().map(|x| x.1).sum::<f64>() / tl.len().max(1) as f64;
            Ok(KernelFloor {
                unpaced_mbps: mbps,
                seconds: secs,
                connections,
                floor,
            })
        })();
        k.stop(&tb);
        measured
    };
    let out = run();
    drop(tb);
    res.cleanup();
    out
}

/// One scale-out with a given migration mode, and the scale-in after it (always bulk).
#[derive(Debug, Serialize)]
pub struct MigrationRun {
    pub migration: String,
    pub round: u32,
    pub sc_scale_out: ScenarioReport,
    pub sc_scale_in: ScenarioReport,
}

#[derive(Debug, Serialize)]
pub struct RestScenarios {
    pub pp_scale_out: PpScenario,
    pub pp_failover: PpScenario,
    pub pp_scale_in: PpScenario,
    pub pp_failover_silent: PpScenario,
    pub fm_failover: FmFailoverReport,
    pub live_migration: LiveMigration,
}

/// A PP cluster scenario: the report, with its event's headline number on top.
#[derive(Debug, Serialize)]
pub struct PpScenario {
    #[serde(flatten)]
    pub report: ScenarioReport,
    /// Scale-out: from starting the node to the first frame it took.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seconds_to_traffic: Option<f64>,
    /// Failover: the worst probe flow's outage (lost probes × 0.5 ms), detection
    /// included.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recovery_ms: Option<f64>,
    /// Scale-in: from the drain command until the node's traffic stopped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drained_ms: Option<u64>,
}

impl PpScenario {
    fn new(report: ScenarioReport) -> Self {
        let pp = report
            .events
            .iter()
            .find_map(|e| e.pp.clone())
            .unwrap_or_default();
        PpScenario {
            seconds_to_traffic: pp.seconds_to_traffic,
            recovery_ms: pp.recovery_ms,
            drained_ms: pp.drained_ms,
            report,
        }
    }
}

/// The FM failover scenario, with its recovery time beside the scenario's counts.
#[derive(Debug, Serialize)]
pub struct FmFailoverReport {
    /// From the kill to the standby FM having the PP node, every SC node and every
    /// group (`events[0].failover` has the details).
    pub recovery_ms: Option<u64>,
    #[serde(flatten)]
    pub scenario: ScenarioReport,
}

pub fn run(a: &ScalingBenchArgs) -> Result<ScalingBench> {
    let w = ScalingWorkload::from_args(a)?;
    // First, alone on the machine: the platform's processes are not started yet.
    let (kernel_floor, kernel_floor_error) = if w.unpaced_streams > 0 {
        match kernel_floor(&w, 12) {
            Ok(k) => (Some(k), None),
            Err(e) => {
                tracing::warn!("the kernel floor run failed: {e:#}");
                (None, Some(format!("{e:#}")))
            }
        }
    } else {
        (None, None)
    };
    let (prefix, res) = crate::testbed_cmd::testbed_run("sfs-")?;
    let tb = Testbed::build(
        TopologySpec::new(&prefix).tenants(1).pp_cluster(3),
        res.clone(),
    )?;
    services::start_inet(&tb, false)?;
    if w.unpaced_streams > 0 {
        services::start_iperf3_unpaced(&tb)?;
    }
    let chain = chains::chain(1, 1, 0, Toward::Internet, &[chains::snat(0)])?;
    let mut spec = PlatformSpec::new(vec![chain], vec![(vni::tenant(0), 1, 1)]);
    // 3 in the group, 3 spares for the scale-out's new group; after the scale-in they
    // are spares again, one of which replaces the killed replica.
    spec.sc_nodes = 6;
    spec.pp_active = 2;
    // For the last scenario: PP and SC nodes know both FMs.
    spec.standby_fm = true;
    spec.pp_args.extend(a.pp_args.iter().cloned());
    let mut p = platform::start_starfabric(&tb, &std::env::current_exe()?, &spec)?;
    let settle = Duration::from_secs_f64(w.settle);
    let probes = ProbeSpec::new();
    let scenario = |p: &mut testbed::platform::Platform, name: &str, events: Vec<Event>| {
        let probe = events
            .iter()
            .any(|e| matches!(e, Event::KillPp { .. }))
            .then_some(&probes);
        // Long enough to outlast the events: a scale here takes well under a second,
        // a repair well under one too (docs/elastic-tests.md); 2 s more for each event
        // after the first, and the pauses.
        let pauses: f64 = events
            .iter()
            .map(|e| match e {
                Event::Pause(d) => d.as_secs_f64(),
                _ => 0.0,
            })
            .sum();
        let more = 2.0 * events.len().saturating_sub(1) as f64 + pauses;
        let secs = (2.0 * w.settle + 8.0 + more).ceil() as u32;
        // Unpaced flows only where throughput is the question (the SC events' dip, a
        // live migration's before/during/after): elsewhere they would take the CPU the
        // PP scenarios' recovery times are measured on.
        let sc = name.starts_with("sc_") || name == "live_migration";
        let spec = ScenarioSpec {
            name: name.into(),
            load: LoadSpec {
                rate: w.rate,
                ..LoadSpec::new()
            },
            iperf: IperfSpec {
                streams: w.paced_streams,
                bitrate: w.paced_bitrate.clone(),
                unpaced_streams: if sc { w.unpaced_streams } else { 0 },
                ..IperfSpec::new(secs)
            },
            before: settle,
            after: settle,
            events,
        };
        elastic::run_scenario_probed(&tb, p, &spec, probe)
            .with_context(|| format!("scenario {name}"))
    };
    let sc_no_event = scenario(
        &mut p,
        "sc_no_event",
        vec![Event::Pause(Duration::from_millis(300))],
    )?;
    let sc_no_event_floor = sc_no_event.iperf.unpaced.as_ref().and_then(|u| {
        let end = sc_no_event.events.last()?.end_ms as f64 + w.settle * 1000.0;
        elastic::dip_floor(
            &u.receiver_timeline,
            sc_no_event.iperf_offset_ms,
            FLOOR_WINDOW_MS,
            1000.0,
            end,
        )
    });
    let sc_no_event_p99_ratio = match (
        sc_no_event.events.first().and_then(|e| e.p99_setup_us),
        sc_no_event.p99_setup_before_us,
    ) {
        (Some(d), Some(b)) if b > 0 => Some(d as f64 / b as f64),
        _ => None,
    };
    let modes: Vec<&str> = match a.migration.as_deref() {
        Some("both") => vec!["bulk", "gradual"],
        Some(m) => vec![m],
        None => vec![],
    };
    let mut migration_runs = Vec::new();
    for round in 0..a.rounds {
        for m in &modes {
            let out = scenario(
                &mut p,
                &format!("sc_scale_out_{m}"),
                vec![Event::ScaleOutMigrating {
                    tenant: 1,
                    chain: 1,
                    migration: m.to_string(),
                }],
            )?;
            let inn = scenario(
                &mut p,
                &format!("sc_scale_in_after_{m}"),
                vec![Event::ScaleIn {
                    tenant: 1,
                    chain: 1,
                }],
            )?;
            migration_runs.push(MigrationRun {
                migration: m.to_string(),
                round,
                sc_scale_out: out,
                sc_scale_in: inn,
            });
        }
    }
    let (sc_scale_out, sc_scale_in) = match migration_runs.first() {
        Some(r) => (r.sc_scale_out.clone(), r.sc_scale_in.clone()),
        None => (
            scenario(
                &mut p,
                "sc_scale_out",
                vec![Event::ScaleOut {
                    tenant: 1,
                    chain: 1,
                }],
            )?,
            scenario(
                &mut p,
                "sc_scale_in",
                vec![Event::ScaleIn {
                    tenant: 1,
                    chain: 1,
                }],
            )?,
        ),
    };
    let sc_replica_failover = scenario(
        &mut p,
        "sc_replica_failover",
        vec![Event::KillReplica {
            tenant: 1,
            chain: 1,
            position: 1,
        }],
    )?;
    let rest = if a.sc_only {
        None
    } else {
        Some(rest_scenarios(&tb, &mut p, &scenario, settle)?)
    };
    let out = ScalingBench {
        workload: w.clone(),
        pp_args: a.pp_args.clone(),
        sc_no_event,
        sc_no_event_floor,
        sc_no_event_p99_ratio,
        kernel_floor,
        kernel_floor_error,
        sc_scale_out,
        sc_scale_in,
        sc_replica_failover,
        migration_runs,
        rest,
    };
    p.stop(&tb);
    drop(tb);
    res.cleanup();
    if let Some(path) = &a.plot {
        std::fs::write(path, svg(&out)).with_context(|| path.display().to_string())?;
        tracing::info!(path = %path.display(), "timeline plot written");
    }
    Ok(out)
}

fn rest_scenarios(
    tb: &Testbed,
    p: &mut testbed::platform::Platform,
    scenario: &RunScenario<'_>,
    settle: Duration,
) -> Result<RestScenarios> {
    let pp_scale_out = PpScenario::new(scenario(
        p,
        "pp_scale_out",
        vec![Event::PpScaleOut { node: 2 }],
    )?);
    let pp_failover = PpScenario::new(scenario(
        p,
        "pp_failover",
        vec![Event::KillPp {
            node: 1,
            silent: false,
        }],
    )?);
    let pp_scale_in = PpScenario::new(scenario(
        p,
        "pp_scale_in",
        vec![Event::PpScaleIn { node: 0 }],
    )?);
    // Nodes 0 and 1 back (untimed), so the silent failure has survivors to move to.
    p.start_pp(tb, 0)?;
    p.start_pp(tb, 1)?;
    testbed::cmd::wait_for(
        "FM to spread the vIPs over 3 PP nodes",
        Duration::from_secs(20),
        || {
            let m = p.vip_map(tb)?;
            Ok(
                (m.all_owned() && !m.owned_by("pp-0").is_empty() && !m.owned_by("pp-1").is_empty())
                    .then_some(()),
            )
        },
    )?;
    let pp_failover_silent = PpScenario::new(scenario(
        p,
        "pp_failover_silent",
        vec![Event::KillPp {
            node: 0,
            silent: true,
        }],
    )?);
    let fm_failover = {
        let scenario = scenario(p, "fm_failover", vec![Event::FailoverFm])?;
        FmFailoverReport {
            recovery_ms: scenario
                .events
                .first()
                .and_then(|e| e.failover.as_ref())
                .map(|f| f.recovery_ms),
            scenario,
        }
    };
    let live_migration = live_migration(tb, p, scenario, settle)?;
    Ok(RestScenarios {
        pp_scale_out,
        pp_failover,
        pp_scale_in,
        pp_failover_silent,
        fm_failover,
        live_migration,
    })
}

/// Runs one scenario (a name and its events) on the platform.
type RunScenario<'a> =
    dyn Fn(&mut testbed::platform::Platform, &str, Vec<Event>) -> Result<ScenarioReport> + 'a;

/// The plain node of the live migration (AF_XDP, every packet in userspace) and the
/// accelerated one (`--offload`).
const PLAIN: usize = 1;
const ACCELERATED: usize = 2;
/// The accelerated node's arguments: elephants after 50 packets in 100 ms, so the
/// moved iperf3 flows reach the driver within the move's first milliseconds.
const ACCELERATED_ARGS: &[&str] = &["--offload", "--offload-packets", "50"];

/// Live migration (CyberStar §6.2, docs/pp-cluster.md): after the FM failover, PP
/// nodes 1 and 2 run. Node 2 is restarted accelerated, node 1 takes every vIP (untimed,
/// so the whole tenant is on the plain node), then FM moves them all to node 2 and, one
/// settle later, back.
fn live_migration(
    tb: &Testbed,
    p: &mut testbed::platform::Platform,
    scenario: &RunScenario<'_>,
    settle: Duration,
) -> Result<LiveMigration> {
    let (plain, accel) = (format!("pp-{PLAIN}"), format!("pp-{ACCELERATED}"));
    p.stop_pp(tb, ACCELERATED);
    testbed::cmd::wait_for(
        "FM to move the stopped node's vIPs",
        Duration::from_secs(20),
        || {
            let m = p.vip_map(tb)?;
            Ok((m.all_owned() && !m.nodes.contains(&accel)).then_some(()))
        },
    )?;
    p.set_pp_node_args(ACCELERATED, ACCELERATED_ARGS);
    p.start_pp(tb, ACCELERATED)?;
    testbed::cmd::wait_for(
        "FM to give the accelerated node vIPs",
        Duration::from_secs(20),
        || {
            let m = p.vip_map(tb)?;
            Ok((m.all_owned() && !m.owned_by(&accel).is_empty()).then_some(()))
        },
    )?;
    let m = p.move_vips(tb, ACCELERATED, PLAIN)?;
    ensure!(
        m.owned_by(&plain).len() == m.vips.len(),
        "{plain} should own every vIP before the migration: {m:?}"
    );
    let stats =
        |p: &testbed::platform::Platform| (p.pp_node_stats(PLAIN), p.pp_node_stats(ACCELERATED));
    let (plain0, accel0) = stats(p);
    let report = scenario(
        p,
        "live_migration",
        vec![
            Event::MigrateVips {
                from: PLAIN,
                to: ACCELERATED,
            },
            Event::Pause(settle),
            Event::MigrateVips {
                from: ACCELERATED,
                to: PLAIN,
            },
        ],
    )?;
    let (plain1, accel1) = stats(p);
    let delta = |a: &str, b: &str, k: &str| {
        platform::field(b, k).map(|v| v.saturating_sub(platform::field(a, k).unwrap_or(0)))
    };
    let direction = |i: usize| -> Result<MigrationDirection> {
        let e = report
            .events
            .get(i)
            .and_then(|e| e.pp.clone())
            .context("the live migration's event report")?;
        Ok(MigrationDirection {
            migration_ms: e.migration_ms,
            map_ms: e.map_ms,
            first_frame_ms: e.first_frame_ms,
            vips: e.to_vips_after.len(),
            throughput: e.throughput,
        })
    };
    let tcp = report.tcp_resets.unwrap_or_default();
    Ok(LiveMigration {
        plain,
        accelerated: accel,
        accelerated_args: ACCELERATED_ARGS.join(" "),
        to_accelerated: direction(0)?,
        to_plain: direction(2)?,
        resets: report.reset_connections as u64 + tcp.estab_resets,
        rsts_sent: tcp.out_rsts,
        accelerated_offloaded: delta(&accel0, &accel1, "offloaded"),
        accelerated_fastpath_packets: delta(&accel0, &accel1, "fastpath"),
        plain_drops: delta(&plain0, &plain1, "drops"),
        accelerated_drops: delta(&accel0, &accel1, "drops"),
        report,
    })
}

/// One direction of the live migration.
#[derive(Debug, Serialize)]
pub struct MigrationDirection {
    /// From the `vip-move` command to the source's last frame (or FM's answer, or the
    /// target's first frame, if later): `PpEvent::migration_ms`.
    pub migration_ms: Option<f64>,
    /// From the command to FM's answer with every vIP moved.
    pub map_ms: Option<f64>,
    /// From the command to the target's first frame.
    pub first_frame_ms: Option<f64>,
    /// vIPs the target owns afterwards.
    pub vips: usize,
    pub throughput: Option<elastic::MigrationThroughput>,
}

/// The live migration scenario: the report, with the headline numbers on top.
#[derive(Debug, Serialize)]
pub struct LiveMigration {
    pub plain: String,
    pub accelerated: String,
    /// The accelerated node's `starfabric pp` arguments beyond the plain node's.
    pub accelerated_args: String,
    pub to_accelerated: MigrationDirection,
    pub to_plain: MigrationDirection,
    /// The connection loop's reset connections plus the kernels' `EstabResets` at both
    /// ends over the events (`tcp_resets`).
    pub resets: u64,
    /// RST segments the two ends sent over the events (`tcp_resets.out_rsts`).
    pub rsts_sent: u64,
    /// Rules the accelerated node put in its driver during the scenario (its stats
    /// line's `xdp: offloaded=`), and the packets its driver forwarded (`fastpath=`).
    pub accelerated_offloaded: Option<u64>,
    pub accelerated_fastpath_packets: Option<u64>,
    /// Packets each node dropped during the scenario (stats line `drops=`; a moved
    /// flow's packets beyond the pending area's per-flow cap while its rule comes from
    /// FM count here as `pending-flow-full`).
    pub plain_drops: Option<u64>,
    pub accelerated_drops: Option<u64>,
    #[serde(flatten)]
    pub report: ScenarioReport,
}

fn ratio(x: Option<f64>) -> String {
    x.map_or("-".into(), |x| format!("{x:.2}"))
}

fn ms(us: Option<u64>) -> String {
    us.map_or("-".into(), |u| format!("{:.1}", u as f64 / 1000.0))
}

pub fn print(b: &ScalingBench) {
    let floor = |f: &DipFloor| {
        format!(
            "median {:.2}, p10 {:.2}, min {:.2} over {} windows of {:.0} ms; 100 ms intervals vary by {:.0}% (cv)",
            f.median,
            f.p10,
            f.min,
            f.windows,
            f.window_ms,
            f.interval_cv * 100.0
        )
    };
    if let Some(k) = &b.kernel_floor {
        println!(
            "throughput_dip with no event, Linux forwarding ({:.0} Mbit/s unpaced, {} connections): {}",
            k.unpaced_mbps,
            k.connections,
            floor(&k.floor)
        );
    }
    if let Some(e) = &b.kernel_floor_error {
        println!("throughput_dip with no event, Linux forwarding: not measured ({e})");
    }
    if let Some(f) = &b.sc_no_event_floor {
        println!("throughput_dip with no event, starfabric: {}", floor(f));
    }
    if let Some(r) = b.sc_no_event_p99_ratio {
        println!("p99_ratio with no event (the pause's window), starfabric: {r:.2}");
    }
    println!(
        "{:<20} {:>6} {:>6} {:>6} {:>5} {:>10} {:>10} {:>10} {:>6} {:>9} {:>8} {:>8} {:>6}",
        "scenario",
        "conns",
        "failed",
        "reset",
        "dups",
        "p99 ms",
        "p99 before",
        "p99 event",
        "p99x",
        "event ms",
        "stall s",
        "Mbit/s",
        "dip"
    );
    for r in b.runs() {
        let e = r.events.first();
        println!(
            "{:<20} {:>6} {:>6} {:>6} {:>5} {:>10} {:>10} {:>10} {:>6} {:>9} {:>8.1} {:>8.1} {:>6}",
            r.name,
            r.connections,
            r.failed_connections,
            r.reset_connections,
            r.duplicate_mappings,
            ms(r.p99_setup_us),
            ms(r.p99_setup_before_us),
            ms(r.p99_setup_during_us),
            ratio(r.p99_ratio),
            e.map_or(0, |e| e.end_ms - e.start_ms),
            r.iperf.max_stall_s,
            r.iperf.mean_mbps,
            ratio(r.throughput_dip),
        );
        if let Some(u) = &r.iperf.unpaced {
            println!(
                "    unpaced iperf3: {:.1} Mbit/s mean, {:.1} before the event, worst 100 ms during {:.1}",
                u.mean_mbps,
                r.unpaced_mbps_before.unwrap_or(0.0),
                r.unpaced_worst_mbps_during.unwrap_or(0.0)
            );
        }
        if let Some(s) = e.and_then(|e| e.scale.as_ref()) {
            println!(
                "    {} groups {} -> {}, st->fin {:.1} ms, aborted {:?}",
                s.kind,
                s.from_group,
                s.to_group,
                s.st_to_fin_us as f64 / 1000.0,
                s.aborted
            );
        }
        if let Some(rep) = e.and_then(|e| e.repair.as_ref()) {
            println!(
                "    group {}: {} killed, {:?} -> {:?} in {} ms",
                rep.group, rep.victim, rep.before, rep.after, rep.repaired_ms
            );
        }
        if let Some(f) = e.and_then(|e| e.failover.as_ref()) {
            println!(
                "    FM {} killed, {} has every node and group after {} ms ({} groups adopted)",
                f.from, f.to, f.recovery_ms, f.adopted
            );
        }
        for pp in r.events.iter().filter_map(|e| e.pp.as_ref()) {
            let mut line = format!(
                "    {}: vIPs {:?} -> {:?} ({} moved)",
                pp.node, pp.vips_before, pp.vips_after, pp.vip_moves
            );
            if let Some(s) = pp.seconds_to_traffic {
                let _ = write!(line, ", traffic after {s:.3} s");
            }
            if let Some(d) = pp.drained_ms {
                let _ = write!(line, ", drained in {d} ms");
            }
            if let (Some(to), Some(m)) = (&pp.to_node, pp.migration_ms) {
                let _ = write!(
                    line,
                    ", to {to} in {m:.1} ms (FM {:.1} ms, first frame {:.1} ms)",
                    pp.map_ms.unwrap_or(0.0),
                    pp.first_frame_ms.unwrap_or(0.0)
                );
                if let Some(t) = &pp.throughput {
                    let f = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.1}"));
                    let _ = write!(
                        line,
                        "; {} iperf3 Mbit/s before {} during {} (worst {}) after {}",
                        t.streams,
                        f(t.before_mbps),
                        f(t.during_mbps),
                        f(t.during_worst_mbps),
                        f(t.after_mbps)
                    );
                }
            }
            if let Some(rc) = pp.recovery_ms {
                let _ = write!(
                    line,
                    ", recovery {rc:.1} ms ({} of {} probe flows lost probes)",
                    pp.flows_with_loss.unwrap_or(0),
                    r.probe.as_ref().map_or(0, |p| p.flows.len())
                );
            }
            println!("{line}");
        }
    }
}

impl ScalingBench {
    fn runs(&self) -> Vec<&ScenarioReport> {
        let mut v = vec![&self.sc_no_event];
        if self.migration_runs.is_empty() {
            v.extend([&self.sc_scale_out, &self.sc_scale_in]);
        }
        for r in &self.migration_runs {
            v.extend([&r.sc_scale_out, &r.sc_scale_in]);
        }
        v.push(&self.sc_replica_failover);
        if let Some(r) = &self.rest {
            v.extend([
                &r.pp_scale_out.report,
                &r.pp_failover.report,
                &r.pp_scale_in.report,
                &r.pp_failover_silent.report,
                &r.fm_failover.scenario,
                &r.live_migration.report,
            ]);
        }
        v
    }
}

/// Small multiples: a column per scenario, a row per node, each strip scaled to its
/// own maximum (the PP node moves megabytes a second, an SC node kilobytes), with the
/// event shaded. Hand-written SVG: a few dozen polylines need no plotting crate.
fn svg(b: &ScalingBench) -> String {
    let runs = b.runs();
    let mut nodes: Vec<String> = runs
        .iter()
        .flat_map(|r| {
            r.timeline
                .iter()
                .flat_map(|p| p.tx_bytes_per_s.keys().cloned())
        })
        .collect();
    nodes.sort();
    nodes.dedup();
    let (cw, rh, left, top) = (300.0, 56.0, 70.0, 40.0);
    let width = left + cw * runs.len() as f64 + 20.0;
    let height = top + rh * nodes.len() as f64 + 40.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(
        s,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{left}" y="16" font-size="13">TX bytes/s per node, 100 ms samples (each strip scaled to its own max); shaded: the event</text>"#
    );
    for (c, r) in runs.iter().enumerate() {
        let x0 = left + cw * c as f64;
        let tmax = r.timeline.last().map_or(1, |p| p.t_ms.max(1)) as f64;
        let _ = writeln!(s, r#"<text x="{}" y="32">{}</text>"#, x0 + 4.0, r.name);
        for e in &r.events {
            let (a, z) = (
                x0 + (cw - 10.0) * e.start_ms as f64 / tmax,
                x0 + (cw - 10.0) * e.end_ms as f64 / tmax,
            );
            let _ = writeln!(
                s,
                r##"<rect x="{a:.1}" y="{top}" width="{:.1}" height="{:.1}" fill="#fdd"/>"##,
                (z - a).max(1.5),
                rh * nodes.len() as f64
            );
        }
        for (i, n) in nodes.iter().enumerate() {
            let y0 = top + rh * i as f64;
            let max = r
                .timeline
                .iter()
                .filter_map(|p| p.tx_bytes_per_s.get(n))
                .fold(0.0f64, |m, v| m.max(*v));
            let pts: Vec<String> = r
                .timeline
                .iter()
                .filter_map(|p| {
                    let v = p.tx_bytes_per_s.get(n)?;
                    let x = x0 + (cw - 10.0) * p.t_ms as f64 / tmax;
                    let y = y0 + rh - 6.0 - (rh - 14.0) * if max > 0.0 { v / max } else { 0.0 };
                    Some(format!("{x:.1},{y:.1}"))
                })
                .collect();
            let _ = writeln!(
                s,
                r##"<rect x="{x0}" y="{y0}" width="{}" height="{rh}" fill="none" stroke="#ccc"/><polyline fill="none" stroke="#1f77b4" stroke-width="1.2" points="{}"/><text x="{}" y="{}" fill="#555">max {}</text>"##,
                cw - 10.0,
                pts.join(" "),
                x0 + cw - 110.0,
                y0 + 12.0,
                human(max)
            );
            if c == 0 {
                let _ = writeln!(s, r#"<text x="8" y="{}">{n}</text>"#, y0 + rh / 2.0 + 4.0);
            }
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}">0 … {:.1} s</text>"#,
            x0 + 4.0,
            top + rh * nodes.len() as f64 + 16.0,
            tmax / 1000.0
        );
    }
    s.push_str("</svg>\n");
    s
}

fn human(bps: f64) -> String {
    if bps >= 1e6 {
        format!("{:.1} MB/s", bps / 1e6)
    } else if bps >= 1e3 {
        format!("{:.1} kB/s", bps / 1e3)
    } else {
        format!("{bps:.0} B/s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("w.json");
        std::fs::write(&p, text).unwrap();
        (d, p)
    }

    fn args(workload: Option<PathBuf>) -> ScalingBenchArgs {
        ScalingBenchArgs {
            json: false,
            plot: None,
            rate: None,
            settle: None,
            sc_only: false,
            workload,
            migration: None,
            rounds: 1,
            pp_args: Vec::new(),
        }
    }

    #[test]
    fn a_workload_file_sets_the_load_and_flags_override_it() {
        let (_d, p) = write(r#"{"rate": 250, "unpaced_streams": 2}"#);
        let w = ScalingWorkload::from_args(&args(Some(p.clone()))).unwrap();
        assert_eq!((w.rate, w.unpaced_streams, w.settle), (250.0, 2, 2.0));
        let mut a = args(Some(p));
        a.rate = Some(50.0);
        assert_eq!(ScalingWorkload::from_args(&a).unwrap().rate, 50.0);
        assert_eq!(
            ScalingWorkload::from_args(&args(None)).unwrap(),
            ScalingWorkload::default()
        );
    }

    #[test]
    fn bad_workloads_and_flags_are_clear_errors() {
        for (text, msg) in [
            (r#"{"rate": 0}"#, "rate must be"),
            (r#"{"settle": 0.1}"#, "settle must be"),
            (r#"{"paced_streams": 0}"#, "paced_streams must be"),
            (r#"{"unpaced_streams": 99}"#, "unpaced_streams must be"),
            (r#"{"paced_bitrate": "fast"}"#, "paced_bitrate must be"),
            (r#"{"rat": 10}"#, "not a scaling workload"),
            ("not json", "not a scaling workload"),
        ] {
            let (_d, p) = write(text);
            let e = ScalingWorkload::from_args(&args(Some(p))).unwrap_err();
            assert!(format!("{e:#}").contains(msg), "{text}: {e:#}");
        }
        let e = ScalingWorkload::from_args(&args(Some("/nonexistent/w.json".into()))).unwrap_err();
        assert!(format!("{e:#}").contains("reading workload"), "{e:#}");
        let mut a = args(None);
        a.rate = Some(-1.0);
        let e = ScalingWorkload::from_args(&a).unwrap_err();
        assert!(format!("{e:#}").contains("rate must be"), "{e:#}");
    }
}
