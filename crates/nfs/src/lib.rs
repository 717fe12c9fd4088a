//! The built-in NFs: SNAT, L4 load balancer (Maglev), stateful firewall, monitor,
//! PrivateLink, and the per-host connection limiter that `docs/nf-api.md` writes step by
//! step.
//!
//! They are written against the public `nf` API only, exactly as a tenant's NF would be,
//! and built from serde configuration by [`build`].

mod codec;
pub mod connlimit;
pub mod fw;
pub mod lb;
pub mod monitor;
pub mod privatelink;
mod reply_index;
pub mod snat;

use nf::{NetworkFunction, NfError};
use serde::{Deserialize, Serialize};

/// Configuration of one NF instance, as the orchestrator stores it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum NfConfig {
    Snat(snat::SnatConfig),
    Lb(lb::LbConfig),
    Fw(fw::FwConfig),
    Monitor(monitor::MonitorConfig),
    /// A per-host connection limiter, the NF `docs/nf-api.md` walks through writing.
    ConnLimit(connlimit::ConnLimitConfig),
    /// A consumer VPC's private endpoints to a provider tenant's service
    /// (`docs/privatelink.md`).
    PrivateLink(privatelink::PrivateLinkConfig),
}

/// Build an NF instance (with empty state) from its configuration.
pub fn build(cfg: &NfConfig) -> Result<Box<dyn NetworkFunction>, NfError> {
    Ok(match cfg {
        NfConfig::Snat(c) => Box::new(snat::Snat::new(c.clone())?),
        NfConfig::Lb(c) => Box::new(lb::LoadBalancer::new(c.clone())?),
        NfConfig::Fw(c) => Box::new(fw::Firewall::new(c.clone())?),
        NfConfig::Monitor(c) => Box::new(monitor::Monitor::new(c.clone())?),
        NfConfig::ConnLimit(c) => Box::new(connlimit::ConnLimit::new(c)?),
        NfConfig::PrivateLink(c) => Box::new(privatelink::PrivateLink::new(c.clone())?),
    })
}

/// What a chain of these NFs should be partitioned by (`nf::PartitionBy`): the first
/// non-default answer of its NFs, if every NF keeps its state in platform tables (which
/// split by it); else the flow hash, which every NF can split by. The orchestrator and
/// the testbed write it into the chain's configuration, so FM and SC agree.
pub fn chain_partition(configs: &[NfConfig]) -> Result<nf::PartitionBy, NfError> {
    let nfs = configs.iter().map(build).collect::<Result<Vec<_>, _>>()?;
    let by = (nfs.iter())
        .map(|n| n.partition_by())
        .find(|p| !p.is_flow())
        .unwrap_or_default();
    if nfs.iter().any(|n| n.state().is_none()) {
        return Ok(nf::PartitionBy::Flow);
    }
    Ok(by)
}
