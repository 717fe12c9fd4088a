//! The SC tier: its configuration, the per-chain inputs taken from FM's request
//! counters, and the actuator that scales through FM.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use proto::tls::NodeTls;
use proto::v1::{self, fabric_master_client::FabricMasterClient};
use serde_json::json;
use tonic::transport::Channel;

use super::{connect, Actuator, AutoscaleError, Input, PolicyConfig, PpNodeProvider, Prev, Target};

#[derive(Debug, Clone)]
pub struct ScConfig {
    pub policy: PolicyConfig,
    /// Requests per second one SC group serves at utilisation 1.0.
    pub capacity_rps: f64,
    /// The chains to watch, (tenant, chain); empty: every chain FM serves.
    pub chains: Vec<(u32, u32)>,
}

/// The SC part of a sample: one input per watched chain, with no rate where `prev` (the
/// previous sample, None after a restart of FM) lacks one of the chain's groups.
pub(super) fn inputs(
    sc: &ScConfig,
    prev: Option<&Prev>,
    load: &v1::LoadReply,
    out: &mut Vec<Input>,
) {
    let mut chains: BTreeMap<(u32, u32), Vec<&v1::GroupLoad>> = BTreeMap::new();
    for g in &load.groups {
        chains.entry((g.tenant, g.chain)).or_default().push(g);
    }
    for &tc in &sc.chains {
        chains.entry(tc).or_default();
    }
    for ((tenant, chain), groups) in chains {
        if !sc.chains.is_empty() && !sc.chains.contains(&(tenant, chain)) {
            continue;
        }
        let target = Target::Sc { tenant, chain };
        let Some(prev) = prev else {
            out.push(Input::no_rate(target));
            continue;
        };
        let dt = (load.fm_ms - prev.fm_ms) as f64 / 1e3;
        let rates: Option<Vec<(u64, f64)>> = groups
            .iter()
            .map(|g| {
                let before = *prev.requests.get(&g.group)?;
                Some((g.group, g.requests.saturating_sub(before) as f64 / dt))
            })
            .collect();
        let Some(rates) = rates else {
            out.push(Input::no_rate(target));
            continue;
        };
        let busiest = rates.iter().max_by(|a, b| a.1.total_cmp(&b.1)).map(|r| r.0);
        let utils = rates.iter().map(|r| r.1 / sc.capacity_rps).collect();
        let detail = json!({
            "capacity_rps": sc.capacity_rps,
            "groups": rates.iter().map(|(g, r)| json!({
                "group": g, "requests_per_s": (r * 10.0).round() / 10.0,
            })).collect::<Vec<_>>(),
        });
        out.push(Input {
            target,
            utils: Some(utils),
            busiest,
            detail,
        });
    }
}

/// SC scaling through FM's `ScaleOut`/`ScaleIn`; PP through a [`PpNodeProvider`] if one
/// is given.
#[derive(Clone)]
pub struct FmActuator {
    client: FabricMasterClient<Channel>,
    pp: Option<Arc<dyn PpNodeProvider>>,
    /// Longest a scale may take (FM answers at fin or abort).
    pub timeout: Duration,
}

impl FmActuator {
    pub async fn new(
        fm: &str,
        tls: Option<&Arc<NodeTls>>,
        pp: Option<Arc<dyn PpNodeProvider>>,
    ) -> Result<Self, AutoscaleError> {
        Ok(FmActuator {
            client: connect(fm, tls).await?,
            pp,
            timeout: Duration::from_secs(60),
        })
    }

    async fn scale(
        &self,
        out: bool,
        tenant: u32,
        chain: u32,
        group: Option<u64>,
    ) -> Result<String, AutoscaleError> {
        let mut c = self.client.clone();
        let call = async move {
            if out {
                c.scale_out(v1::ScaleOutRequest {
                    tenant,
                    chain,
                    group,
                    ..Default::default()
                })
                .await
            } else {
                c.scale_in(v1::ScaleInRequest {
                    tenant,
                    chain,
                    group,
                })
                .await
            }
        };
        let r = tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| AutoscaleError::Rpc(format!("no answer within {:?}", self.timeout)))?;
        let r = match r {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                return Err(AutoscaleError::Refused(s.message().to_string()))
            }
            Err(s) => {
                return Err(AutoscaleError::Rpc(format!(
                    "{:?}: {}",
                    s.code(),
                    s.message()
                )))
            }
        };
        if !r.aborted.is_empty() {
            return Err(AutoscaleError::Aborted(r.aborted));
        }
        Ok(format!(
            "scale {}: group {} -> group {}, st->fin {:.1} ms",
            r.scale_id,
            r.from_group,
            r.to_group,
            r.st_to_fin_us as f64 / 1e3
        ))
    }
}

#[tonic::async_trait]
impl Actuator for FmActuator {
    async fn sc_scale_out(
        &self,
        tenant: u32,
        chain: u32,
        group: Option<u64>,
    ) -> Result<String, AutoscaleError> {
        self.scale(true, tenant, chain, group).await
    }

    async fn sc_scale_in(&self, tenant: u32, chain: u32) -> Result<String, AutoscaleError> {
        self.scale(false, tenant, chain, None).await
    }

    async fn pp_scale_out(&self) -> Result<String, AutoscaleError> {
        match &self.pp {
            Some(p) => p.add_pp_node().await.map_err(AutoscaleError::Provider),
            None => Err(AutoscaleError::NoPpProvider),
        }
    }

    async fn pp_scale_in(&self) -> Result<String, AutoscaleError> {
        match &self.pp {
            Some(p) => p.remove_pp_node().await.map_err(AutoscaleError::Provider),
            None => Err(AutoscaleError::NoPpProvider),
        }
    }

    async fn vip_map(&self) -> Result<v1::VipMapReply, AutoscaleError> {
        let mut c = self.client.clone();
        c.vip_map(v1::VipMapRequest {})
            .await
            .map(|r| r.into_inner())
            .map_err(|s| AutoscaleError::Rpc(format!("{:?}: {}", s.code(), s.message())))
    }

    async fn vip_move(&self, vip: u32, to: &str, reason: &str) -> Result<String, AutoscaleError> {
        let mut c = self.client.clone();
        match c
            .vip_move(v1::VipMoveRequest {
                vip,
                to: to.to_string(),
                reason: reason.to_string(),
            })
            .await
        {
            Ok(r) => Ok(format!(
                "vIP {vip} -> {to}, table epoch {}",
                r.into_inner().epoch
            )),
            Err(s) if s.code() == tonic::Code::FailedPrecondition => {
                Err(AutoscaleError::Refused(s.message().to_string()))
            }
            Err(s) => Err(AutoscaleError::Rpc(format!(
                "{:?}: {}",
                s.code(),
                s.message()
            ))),
        }
    }
}
