//! The autoscaler (issue 6, DESIGN.md "Orchestrator"): scale SC groups and PP nodes out
//! or in when their utilisation crosses high and low water marks.
//!
//! - [`Policy`] is pure: fed one sample of a target's units' utilisations at a time
//!   (with the time, so tests use a fake clock), it answers a [`Decision`]. It acts only
//!   after `sustain` consecutive samples beyond a mark, waits `cooldown` after any action
//!   (or refusal) before the next, and keeps the unit count within `min..=max`.
//! - [`Autoscaler`] is the driver: every interval it samples FM's `Load` (cumulative
//!   requests dispatched per SC group, and each live node's last heartbeat), turns the
//!   counters into rates over the interval, asks one policy per target (each watched
//!   tenant chain, and the PP tier), records every decision and refusal in FM's event log
//!   (`RecordEvent`), and acts through an [`Actuator`].
//!
//! Utilisation of an SC group is its request rate ÷ a configured per-group capacity
//! (requests/s). Utilisation of a PP node is a pluggable [`PpMetric`] of its heartbeat
//! load ÷ a per-node capacity in the metric's unit. docs/autoscaler.md has the rules,
//! flags and events.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use proto::tls::NodeTls;

use proto::v1::{self, fabric_master_client::FabricMasterClient};
use serde_json::{json, Value};
use thiserror::Error;
use tonic::transport::Channel;
use tracing::{info, warn};

mod policy;
mod pp;
mod sc;

pub use policy::{Action, Aggregate, Decision, Policy, PolicyConfig, Reason, WaterMarks};
pub use pp::{PpConfig, PpMetric, PpNodeProvider};
pub use sc::{FmActuator, ScConfig};

use policy::policy_json;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AutoscaleError {
    #[error("configuration: {0}")]
    Config(String),
    /// FM could not be reached or failed the call.
    #[error("FM: {0}")]
    Rpc(String),
    /// FM refused to start the scale (no spare nodes, nothing to merge, one under way).
    #[error("FM refused: {0}")]
    Refused(String),
    /// The scale started but was aborted before fin; dispatch is as before.
    #[error("aborted: {0}")]
    Aborted(String),
    #[error("no PP node provider configured")]
    NoPpProvider,
    /// The PP node provider failed.
    #[error("PP node provider: {0}")]
    Provider(String),
}

/// What a policy scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// The SC groups of a tenant's chain.
    Sc { tenant: u32, chain: u32 },
    /// The PP nodes.
    Pp,
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Sc { tenant, chain } => write!(f, "sc tenant {tenant} chain {chain}"),
            Target::Pp => f.write_str("pp"),
        }
    }
}

impl Target {
    fn to_json(self) -> Value {
        match self {
            Target::Sc { tenant, chain } => json!({"tier": "sc", "tenant": tenant, "chain": chain}),
            Target::Pp => json!({"tier": "pp"}),
        }
    }
}

#[derive(Debug, Clone)]
pub struct AutoscaleConfig {
    pub interval: Duration,
    pub sc: Option<ScConfig>,
    pub pp: Option<PpConfig>,
}

impl AutoscaleConfig {
    pub fn validate(&self) -> Result<(), AutoscaleError> {
        if self.interval.is_zero() {
            return Err(AutoscaleError::Config("interval must be positive".into()));
        }
        if self.sc.is_none() && self.pp.is_none() {
            return Err(AutoscaleError::Config(
                "nothing to scale: configure SC, PP or both".into(),
            ));
        }
        if let Some(sc) = &self.sc {
            sc.policy.validate()?;
            if !(sc.capacity_rps > 0.0 && sc.capacity_rps.is_finite()) {
                return Err(AutoscaleError::Config(
                    "SC capacity must be positive".into(),
                ));
            }
        }
        if let Some(pp) = &self.pp {
            pp.policy.validate()?;
            if pp.policy.min == 0 {
                return Err(AutoscaleError::Config(
                    "PP needs at least one node (min 1): only SC chains scale to zero".into(),
                ));
            }
            if !(pp.capacity > 0.0 && pp.capacity.is_finite()) {
                return Err(AutoscaleError::Config(
                    "PP capacity must be positive".into(),
                ));
            }
        }
        Ok(())
    }
}

/// Where samples come from (FM's `Load`).
#[tonic::async_trait]
pub trait LoadSource: Send {
    async fn sample(&mut self) -> Result<v1::LoadReply, AutoscaleError>;
}

/// What carries out a decision. The answer is a one-line summary for the log.
#[tonic::async_trait]
pub trait Actuator: Send + Sync {
    /// Split a partition of the chain: `group`'s (the driver passes the busiest by
    /// rate), or FM's choice.
    async fn sc_scale_out(
        &self,
        tenant: u32,
        chain: u32,
        group: Option<u64>,
    ) -> Result<String, AutoscaleError>;
    /// Merge a partition of the chain (FM retires the newest) into its neighbour.
    async fn sc_scale_in(&self, tenant: u32, chain: u32) -> Result<String, AutoscaleError>;
    /// Take the chain (at one group) to zero running instances: its replicas park in
    /// their SC nodes' state managers, and the next request wakes them. The default
    /// relies on the nodes' own idle parking (`starfabric sc --idle-ms`): the chain is
    /// idle, so they park it within that time. docs/autoscaler.md.
    async fn sc_scale_to_zero(&self, tenant: u32, chain: u32) -> Result<String, AutoscaleError> {
        Ok(format!(
            "tenant {tenant} chain {chain}: its SC nodes park the idle group after their \
             --idle-ms"
        ))
    }
    /// Start one more PP node. Without a node provider the default says so, and the
    /// driver records that as an `autoscale_failed` event.
    async fn pp_scale_out(&self) -> Result<String, AutoscaleError> {
        Err(AutoscaleError::NoPpProvider)
    }
    async fn pp_scale_in(&self) -> Result<String, AutoscaleError> {
        Err(AutoscaleError::NoPpProvider)
    }
    /// FM's Multi IPs Mapping Table, for the Multi IPs Scheduler.
    async fn vip_map(&self) -> Result<v1::VipMapReply, AutoscaleError> {
        Err(AutoscaleError::Config("no vIP table here".into()))
    }
    /// Move vIP `vip` to node `to` (Zeta §VI-B step 1).
    async fn vip_move(
        &self,
        _vip: u32,
        _to: &str,
        _reason: &str,
    ) -> Result<String, AutoscaleError> {
        Err(AutoscaleError::Config("no vIP table here".into()))
    }
}

/// Where decisions are recorded (FM's event log).
#[tonic::async_trait]
pub trait EventSink: Send {
    async fn record(&mut self, kind: &str, message: &str, detail: Value);
}

/// Lazy: an FM that is down at start (or restarts) is retried on every call rather
/// than failing the autoscaler.
async fn connect(
    fm: &str,
    tls: Option<&Arc<NodeTls>>,
) -> Result<FabricMasterClient<Channel>, AutoscaleError> {
    crate::fm_link::lazy(fm, tls).map_err(AutoscaleError::Config)
}

/// FM's `Load` as a [`LoadSource`].
#[derive(Clone)]
pub struct FmLoad {
    client: FabricMasterClient<Channel>,
}

impl FmLoad {
    pub async fn new(fm: &str, tls: Option<&Arc<NodeTls>>) -> Result<Self, AutoscaleError> {
        Ok(FmLoad {
            client: connect(fm, tls).await?,
        })
    }
}

#[tonic::async_trait]
impl LoadSource for FmLoad {
    async fn sample(&mut self) -> Result<v1::LoadReply, AutoscaleError> {
        let call = self.client.load(v1::LoadRequest {});
        match tokio::time::timeout(Duration::from_secs(5), call).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(AutoscaleError::Rpc(format!(
                "{:?}: {}",
                s.code(),
                s.message()
            ))),
            Err(_) => Err(AutoscaleError::Rpc("Load: no answer within 5 s".into())),
        }
    }
}

/// FM's `RecordEvent` as an [`EventSink`]. A failed record is logged, never fatal: the
/// autoscaler keeps scaling while FM is briefly away.
#[derive(Clone)]
pub struct FmEvents {
    client: FabricMasterClient<Channel>,
}

impl FmEvents {
    pub async fn new(fm: &str, tls: Option<&Arc<NodeTls>>) -> Result<Self, AutoscaleError> {
        Ok(FmEvents {
            client: connect(fm, tls).await?,
        })
    }
}

#[tonic::async_trait]
impl EventSink for FmEvents {
    async fn record(&mut self, kind: &str, message: &str, detail: Value) {
        let req = v1::RecordEventRequest {
            kind: kind.to_string(),
            message: message.to_string(),
            detail_json: detail.to_string(),
        };
        match tokio::time::timeout(Duration::from_secs(5), self.client.record_event(req)).await {
            Ok(Ok(_)) => {}
            Ok(Err(s)) => warn!(kind, error = %s.message(), "FM did not record the event"),
            Err(_) => warn!(kind, "FM did not record the event within 5 s"),
        }
    }
}

/// What one target's policy said in one step, and what came of it.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRecord {
    pub target: Target,
    pub decision: Decision,
    /// For `Act`: the actuator's summary or error.
    pub result: Option<Result<String, AutoscaleError>>,
}

/// One target's part of a sample.
struct Input {
    target: Target,
    /// Per unit; None: no rate this sample.
    utils: Option<Vec<f64>>,
    /// SC: the group with the highest rate, the one to split.
    busiest: Option<u64>,
    /// The rates or values behind `utils`, for the event.
    detail: Value,
}

impl Input {
    fn no_rate(target: Target) -> Input {
        Input {
            target,
            utils: None,
            busiest: None,
            detail: Value::Null,
        }
    }
}

/// The previous sample's counters, to take rates from.
struct Prev {
    fm_ms: u64,
    requests: HashMap<u64, u64>,
}

pub struct Autoscaler<S, A, E> {
    cfg: AutoscaleConfig,
    source: S,
    actuator: A,
    sink: E,
    policies: BTreeMap<Target, Policy>,
    prev: Option<Prev>,
    samples: u64,
    /// When the Multi IPs Scheduler last acted (driver clock, ms).
    last_vip_action: Option<u64>,
}

impl<S: LoadSource, A: Actuator, E: EventSink> Autoscaler<S, A, E> {
    pub fn new(
        cfg: AutoscaleConfig,
        source: S,
        actuator: A,
        sink: E,
    ) -> Result<Self, AutoscaleError> {
        cfg.validate()?;
        Ok(Autoscaler {
            cfg,
            source,
            actuator,
            sink,
            policies: BTreeMap::new(),
            prev: None,
            samples: 0,
            last_vip_action: None,
        })
    }

    fn policy(&mut self, t: Target) -> Option<&mut Policy> {
        let cfg = match t {
            Target::Sc { .. } => self.cfg.sc.as_ref()?.policy.clone(),
            Target::Pp => self.cfg.pp.as_ref()?.policy.clone(),
        };
        // Validated in `new`, so this cannot fail.
        let p = Policy::new(cfg).ok()?;
        Some(self.policies.entry(t).or_insert(p))
    }

    /// The per-target inputs of one sample: (target, per-unit utilisation, and for SC
    /// the busiest group by rate). A chain with a group not in the previous sample (just
    /// formed or split), or right after FM restarted, has no rate: None.
    fn inputs(&mut self, load: &v1::LoadReply) -> Vec<Input> {
        let mut out = Vec::new();
        if let Some(sc) = &self.cfg.sc {
            // A restarted FM's clock and counters start over: no rate across that.
            let prev = self.prev.as_ref().filter(|p| p.fm_ms < load.fm_ms);
            sc::inputs(sc, prev, load, &mut out);
        }
        if let Some(pp) = &self.cfg.pp {
            out.push(pp::input(pp, load));
        }
        self.prev = Some(Prev {
            fm_ms: load.fm_ms,
            requests: load.groups.iter().map(|g| (g.group, g.requests)).collect(),
        });
        out
    }
    /// Take one sample at `now_ms` (the driver's clock), decide, record and act.
    pub async fn step(&mut self, now_ms: u64) -> Vec<StepRecord> {
        let load = match self.source.sample().await {
            Ok(l) => l,
            Err(e) => {
                // Rates need two consecutive samples; start over once FM answers.
                warn!(error = %e, "no load sample");
                self.prev = None;
                return Vec::new();
            }
        };
        self.samples += 1;
        let sample = self.samples;
        let mut records = Vec::new();
        for Input {
            target,
            utils,
            busiest,
            detail: inputs,
        } in self.inputs(&load)
        {
            let Some(p) = self.policy(target) else {
                continue;
            };
            let Some(utils) = utils else {
                p.reset_streak();
                continue;
            };
            let decision = p.observe(now_ms, sample, &utils);
            let (action, reason, acted) = match &decision {
                Decision::None => continue,
                Decision::Act(a, r) => (*a, r.clone(), true),
                Decision::Refused(a, r) => (*a, r.clone(), false),
            };
            let mut detail = json!({
                "target": target.to_json(),
                "action": action.as_str(),
                "sample": reason.sample,
                "samples": reason.samples,
                "utilisation": (reason.utilisation * 1000.0).round() / 1000.0,
                "mark": reason.mark,
                "units": reason.units,
                "inputs": inputs,
            });
            if let (Target::Sc { .. }, Action::ScaleOut, Some(g)) = (target, action, busiest) {
                detail["group"] = json!(g);
            }
            let message = format!("{target}: {} ({})", action.as_str(), reason.text);
            if !acted {
                info!(%target, %message, "autoscale refused");
                self.sink
                    .record("autoscale_refused", &message, detail)
                    .await;
                records.push(StepRecord {
                    target,
                    decision,
                    result: None,
                });
                continue;
            }
            info!(%target, %message, "autoscale decision");
            self.sink
                .record("autoscale_decision", &message, detail.clone())
                .await;
            let result = match (target, action) {
                (Target::Sc { tenant, chain }, Action::ScaleOut) => {
                    self.actuator.sc_scale_out(tenant, chain, busiest).await
                }
                (Target::Sc { tenant, chain }, Action::ScaleIn) => {
                    self.actuator.sc_scale_in(tenant, chain).await
                }
                (Target::Sc { tenant, chain }, Action::ScaleToZero) => {
                    self.actuator.sc_scale_to_zero(tenant, chain).await
                }
                // The PP tier keeps at least one node (validated).
                (Target::Pp, Action::ScaleToZero) => {
                    Err(AutoscaleError::Config("PP cannot scale to zero".into()))
                }
                (Target::Pp, Action::ScaleOut) => self.actuator.pp_scale_out().await,
                (Target::Pp, Action::ScaleIn) => self.actuator.pp_scale_in().await,
            };
            match &result {
                Ok(summary) => info!(%target, %summary, "autoscale action done"),
                Err(e) => {
                    warn!(%target, error = %e, "autoscale action failed");
                    detail["error"] = json!(e.to_string());
                    self.sink
                        .record(
                            "autoscale_failed",
                            &format!("{target}: {} failed: {e}", action.as_str()),
                            detail,
                        )
                        .await;
                }
            }
            records.push(StepRecord {
                target,
                decision,
                result: Some(result),
            });
        }
        let pp_acted = records
            .iter()
            .any(|r| r.target == Target::Pp && r.result.is_some());
        if let Some(pp) = self.cfg.pp.clone().filter(|p| p.multi_ip) {
            if !pp_acted {
                self.multi_ip_step(now_ms, &load, &pp).await;
            }
        }
        records
    }

    /// Sample every interval until `stop` resolves, handing every decision to `report`;
    /// records `autoscale_started` and `autoscale_stopped`. A scale blocks the loop until
    /// FM answers (fin or abort): the next sample then sees the new map.
    pub async fn run(
        mut self,
        stop: impl std::future::Future<Output = ()>,
        mut report: impl FnMut(&StepRecord),
    ) {
        let started = json!({
            "interval_ms": self.cfg.interval.as_millis() as u64,
            "sc": self.cfg.sc.as_ref().map(|s| json!({
                "capacity_rps": s.capacity_rps,
                "chains": s.chains,
                "policy": policy_json(&s.policy),
            })),
            "pp": self.cfg.pp.as_ref().map(|p| json!({
                "capacity": p.capacity,
                "metric": p.metric.name(),
                "policy": policy_json(&p.policy),
            })),
        });
        self.sink
            .record("autoscale_started", "autoscaler started", started)
            .await;
        let t0 = tokio::time::Instant::now();
        let mut tick = tokio::time::interval(self.cfg.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = &mut stop => break,
                _ = tick.tick() => {
                    let now_ms = t0.elapsed().as_millis() as u64;
                    for r in self.step(now_ms).await {
                        report(&r);
                    }
                }
            }
        }
        self.sink
            .record(
                "autoscale_stopped",
                "autoscaler stopped",
                json!({"samples": self.samples}),
            )
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::policy::tests::cfg;
    use super::*;
    use std::sync::{Arc, Mutex};

    struct Script(Vec<v1::LoadReply>);

    #[tonic::async_trait]
    impl LoadSource for Script {
        async fn sample(&mut self) -> Result<v1::LoadReply, AutoscaleError> {
            if self.0.is_empty() {
                return Err(AutoscaleError::Rpc("script over".into()));
            }
            Ok(self.0.remove(0))
        }
    }

    #[derive(Default, Clone)]
    struct Calls(Arc<Mutex<Vec<String>>>);

    #[tonic::async_trait]
    impl Actuator for Calls {
        async fn sc_scale_out(
            &self,
            t: u32,
            c: u32,
            g: Option<u64>,
        ) -> Result<String, AutoscaleError> {
            self.0.lock().unwrap().push(format!("out {t}/{c} {g:?}"));
            Ok("ok".into())
        }
        async fn sc_scale_in(&self, t: u32, c: u32) -> Result<String, AutoscaleError> {
            self.0.lock().unwrap().push(format!("in {t}/{c}"));
            Err(AutoscaleError::Refused("nothing to merge".into()))
        }
        async fn sc_scale_to_zero(&self, t: u32, c: u32) -> Result<String, AutoscaleError> {
            self.0.lock().unwrap().push(format!("zero {t}/{c}"));
            Ok("parked".into())
        }
    }

    #[derive(Default, Clone)]
    struct Sink(Arc<Mutex<Vec<(String, String, Value)>>>);

    #[tonic::async_trait]
    impl EventSink for Sink {
        async fn record(&mut self, kind: &str, message: &str, detail: Value) {
            self.0
                .lock()
                .unwrap()
                .push((kind.into(), message.into(), detail));
        }
    }

    /// The kinds of the recorded events, in order, one space apart.
    fn kinds(ev: &[(String, String, Value)]) -> String {
        let kinds: Vec<&str> = ev.iter().map(|e| e.0.as_str()).collect();
        kinds.join(" ")
    }

    fn load(fm_ms: u64, groups: &[(u64, u64)], pp_rps: &[f64]) -> v1::LoadReply {
        v1::LoadReply {
            fm_ms,
            groups: groups
                .iter()
                .map(|&(group, requests)| v1::GroupLoad {
                    tenant: 1,
                    chain: 1,
                    group,
                    hash_lo: 0,
                    hash_hi: 0,
                    requests,
                })
                .collect(),
            nodes: pp_rps
                .iter()
                .enumerate()
                .map(|(i, r)| v1::NodeLoad {
                    node_id: format!("pp-{i}"),
                    role: v1::Role::Pp as i32,
                    load: Some(v1::Load {
                        requests_per_s: *r,
                        ..Default::default()
                    }),
                })
                .collect(),
        }
    }

    fn driver_cfg() -> AutoscaleConfig {
        let policy = PolicyConfig {
            sustain: 2,
            cooldown: Duration::from_secs(5),
            max: 2,
            ..cfg()
        };
        AutoscaleConfig {
            interval: Duration::from_secs(1),
            sc: Some(ScConfig {
                policy: policy.clone(),
                capacity_rps: 100.0,
                chains: vec![],
            }),
            pp: Some(PpConfig {
                policy: PolicyConfig {
                    out_on: Aggregate::Mean,
                    ..policy
                },
                capacity: 1000.0,
                metric: PpMetric::RequestsPerS,
                multi_ip: false,
            }),
        }
    }

    /// A vIP table of two PP nodes (`pp-0` owns vIPs 0..6, `pp-1` 6..8) that applies
    /// the moves it is asked for.
    #[derive(Clone)]
    struct Vips(Arc<Mutex<Vec<String>>>, Arc<Mutex<Vec<String>>>);

    #[tonic::async_trait]
    impl Actuator for Vips {
        async fn sc_scale_out(
            &self,
            _: u32,
            _: u32,
            _: Option<u64>,
        ) -> Result<String, AutoscaleError> {
            Ok("ok".into())
        }
        async fn sc_scale_in(&self, _: u32, _: u32) -> Result<String, AutoscaleError> {
            Ok("ok".into())
        }
        async fn pp_scale_out(&self) -> Result<String, AutoscaleError> {
            self.1.lock().unwrap().push("grow".into());
            Ok("started pp-2".into())
        }
        async fn vip_map(&self) -> Result<v1::VipMapReply, AutoscaleError> {
            let owners = self.0.lock().unwrap().clone();
            Ok(v1::VipMapReply {
                vips: owners
                    .iter()
                    .enumerate()
                    .map(|(i, n)| v1::VipOwner {
                        vip: Some(v1::Vip {
                            index: i as u32,
                            ..Default::default()
                        }),
                        node: n.clone(),
                    })
                    .collect(),
                nodes: vec!["pp-0".into(), "pp-1".into()],
                ..Default::default()
            })
        }
        async fn vip_move(&self, vip: u32, to: &str, _: &str) -> Result<String, AutoscaleError> {
            self.0.lock().unwrap()[vip as usize] = to.to_string();
            self.1.lock().unwrap().push(format!("move {vip} {to}"));
            Ok("moved".into())
        }
    }

    #[tokio::test]
    async fn the_multi_ips_scheduler_sheds_vips_from_a_hot_node_then_grows_the_cluster() {
        let owners: Vec<String> = (0..8)
            .map(|i| if i < 6 { "pp-0" } else { "pp-1" }.to_string())
            .collect();
        let acts = Vips(Arc::new(Mutex::new(owners)), Arc::default());
        let mut cfg = driver_cfg();
        cfg.sc = None;
        if let Some(pp) = cfg.pp.as_mut() {
            pp.multi_ip = true;
            pp.policy.sustain = 10; // keep the water-mark policy out of this test
        }
        // pp-0 at 0.9 of capacity (6 vIPs), pp-1 at 0.1: vIPs move from pp-0 to pp-1
        // until neither is over 0.8. Then both run hot: step 2 grows the cluster.
        let script = vec![
            load(1000, &[], &[900.0, 100.0]),
            load(20_000, &[], &[950.0, 950.0]),
        ];
        let sink = Sink::default();
        let mut a = Autoscaler::new(cfg, Script(script), acts.clone(), sink.clone()).unwrap();
        a.step(1000).await;
        let calls = acts.1.lock().unwrap().clone();
        assert!(
            !calls.is_empty()
                && calls
                    .iter()
                    .all(|c| c.starts_with("move ") && c.ends_with(" pp-1")),
            "{calls:?}"
        );
        let owners = acts.0.lock().unwrap().clone();
        let on0 = owners.iter().filter(|o| *o == "pp-0").count();
        // 150 per vIP on pp-0: one move leaves 750 (< 800) there and 250 on pp-1.
        assert_eq!(on0, 5, "{owners:?}");
        let ev = sink.0.lock().unwrap().clone();
        assert!(ev.iter().any(|e| e.0 == "multiip_vip_move"), "{ev:?}");
        a.step(20_000).await;
        let calls = acts.1.lock().unwrap().clone();
        assert_eq!(calls.last().map(String::as_str), Some("grow"), "{calls:?}");
        assert!(sink.0.lock().unwrap().iter().any(|e| e.0 == "multiip_grow"));
    }

    #[tokio::test]
    async fn the_driver_takes_rates_from_counters_acts_on_the_busiest_group_and_records_why() {
        // Group 1 gets 150 requests/s (1.5 of capacity), then is split into 1 and 2.
        let script = vec![
            load(1000, &[(1, 0)], &[10.0]),
            load(2000, &[(1, 150)], &[10.0]),
            load(3000, &[(1, 300)], &[10.0]),
            // The split: group 2 is new and has no rate yet; the chain sits out.
            load(4000, &[(1, 380), (2, 0)], &[10.0]),
            load(5000, &[(1, 460), (2, 70)], &[2000.0]),
            load(6000, &[(1, 540), (2, 140)], &[2000.0]),
        ];
        let (calls, sink) = (Calls::default(), Sink::default());
        let mut a =
            Autoscaler::new(driver_cfg(), Script(script), calls.clone(), sink.clone()).unwrap();
        let mut recs = Vec::new();
        for i in 0..7 {
            recs.extend(a.step(1000 * i).await);
        }
        assert_eq!(
            *calls.0.lock().unwrap(),
            vec!["out 1/1 Some(1)".to_string()]
        );
        let ev = sink.0.lock().unwrap().clone();
        // SC: out after 2 samples at 1.5. PP: mean 2.0 over 2 samples, out, but no
        // provider: a decision, then a failure event.
        assert_eq!(
            kinds(&ev),
            "autoscale_decision autoscale_decision autoscale_failed"
        );
        let (_, msg, d) = &ev[0];
        assert!(msg.contains("sc tenant 1 chain 1: scale_out"), "{msg}");
        assert_eq!(d["target"]["tenant"], 1);
        assert_eq!(d["group"], 1);
        assert_eq!(d["utilisation"], 1.5);
        assert_eq!(
            d["sample"], 3,
            "samples 2 and 3 had rates (the first has none)"
        );
        assert_eq!(d["inputs"]["groups"][0]["requests_per_s"], 150.0);
        assert_eq!(ev[1].2["target"]["tier"], "pp");
        assert!(
            ev[2].1.contains("no PP node provider configured"),
            "{}",
            ev[2].1
        );
        assert!(
            recs.iter()
                .any(|r| r.target == Target::Pp
                    && r.result == Some(Err(AutoscaleError::NoPpProvider)))
        );
        // The step after the script ran out: no sample, nothing decided, no panic.
        assert!(a.step(10_000).await.is_empty());
    }

    #[tokio::test]
    async fn an_idle_chain_at_min_zero_goes_to_zero_once_and_a_request_brings_it_back() {
        let mut cfg = driver_cfg();
        cfg.pp = None;
        if let Some(sc) = cfg.sc.as_mut() {
            sc.policy.min = 0;
            sc.policy.cooldown = Duration::ZERO;
        }
        let script = vec![
            load(0, &[(1, 10)], &[]),
            load(1000, &[(1, 10)], &[]),
            load(2000, &[(1, 10)], &[]),
            load(3000, &[(1, 10)], &[]),
            load(4000, &[(1, 10)], &[]),
            // A request: the nodes woke the group; idle again, it goes to zero again.
            load(5000, &[(1, 11)], &[]),
            load(6000, &[(1, 11)], &[]),
            load(7000, &[(1, 11)], &[]),
        ];
        let (calls, sink) = (Calls::default(), Sink::default());
        let mut a = Autoscaler::new(cfg, Script(script), calls.clone(), sink.clone()).unwrap();
        for i in 0..8 {
            a.step(1000 * i).await;
        }
        assert_eq!(*calls.0.lock().unwrap(), vec!["zero 1/1", "zero 1/1"]);
        let ev = sink.0.lock().unwrap().clone();
        assert_eq!(kinds(&ev), "autoscale_decision autoscale_decision");
        assert_eq!(ev[0].2["action"], "scale_to_zero");
        assert_eq!(ev[0].2["units"], 1);
    }

    #[test]
    fn pp_cannot_go_to_zero_nodes() {
        let mut cfg = driver_cfg();
        if let Some(pp) = cfg.pp.as_mut() {
            pp.policy.min = 0;
        }
        assert!(matches!(cfg.validate(), Err(AutoscaleError::Config(_))));
    }

    #[tokio::test]
    async fn the_driver_records_refusals_and_failed_actions() {
        let mut cfg = driver_cfg();
        cfg.pp = None;
        let script = vec![
            // Two groups both hot, at max 2: refused.
            load(0, &[(1, 0), (2, 0)], &[]),
            load(1000, &[(1, 100), (2, 100)], &[]),
            load(2000, &[(1, 200), (2, 200)], &[]),
            // Idle: in (the actuator fails it) after the 5 s cooldown from t = 2 s.
            load(3000, &[(1, 200), (2, 200)], &[]),
            load(4000, &[(1, 200), (2, 200)], &[]),
            load(5000, &[(1, 200), (2, 200)], &[]),
            load(6000, &[(1, 200), (2, 200)], &[]),
            load(7000, &[(1, 200), (2, 200)], &[]),
        ];
        let (calls, sink) = (Calls::default(), Sink::default());
        let mut a = Autoscaler::new(cfg, Script(script), calls.clone(), sink.clone()).unwrap();
        for i in 0..8 {
            a.step(1000 * i).await;
        }
        let ev = sink.0.lock().unwrap().clone();
        assert_eq!(
            kinds(&ev),
            "autoscale_refused autoscale_decision autoscale_failed"
        );
        assert!(ev[0].1.contains("maximum of 2"), "{}", ev[0].1);
        assert_eq!(ev[1].2["action"], "scale_in");
        assert!(ev[2].2["error"]
            .as_str()
            .unwrap()
            .contains("nothing to merge"));
        assert_eq!(*calls.0.lock().unwrap(), vec!["in 1/1".to_string()]);
    }

    #[tokio::test]
    async fn a_restarted_fm_is_no_rate_and_unwatched_chains_are_ignored() {
        let mut cfg = driver_cfg();
        cfg.pp = None;
        if let Some(sc) = cfg.sc.as_mut() {
            sc.chains = vec![(2, 1)];
        }
        let script = vec![
            load(5000, &[(1, 0)], &[]),
            load(6000, &[(1, 1000)], &[]),
            load(7000, &[(1, 2000)], &[]),
            load(8000, &[(1, 3000)], &[]),
        ];
        let (calls, sink) = (Calls::default(), Sink::default());
        let mut a =
            Autoscaler::new(cfg.clone(), Script(script), calls.clone(), sink.clone()).unwrap();
        for i in 0..4 {
            a.step(1000 * i).await;
        }
        assert!(
            calls.0.lock().unwrap().is_empty(),
            "chain 1/1 is not watched"
        );
        if let Some(sc) = cfg.sc.as_mut() {
            sc.chains = vec![];
        }
        // FM restarted between the second and third sample (its clock went back).
        let script = vec![
            load(5000, &[(1, 0)], &[]),
            load(6000, &[(1, 1000)], &[]),
            load(100, &[(1, 10)], &[]),
            load(1100, &[(1, 1010)], &[]),
        ];
        let mut a = Autoscaler::new(cfg, Script(script), calls.clone(), sink.clone()).unwrap();
        let mut recs = Vec::new();
        for i in 0..4 {
            recs.extend(a.step(1000 * i).await);
        }
        // Rates at samples 2 and 4 only: the sample after the restart has none, which
        // breaks the streak, so two samples over the mark were never consecutive.
        assert!(recs.is_empty(), "{recs:?}");
    }
}
