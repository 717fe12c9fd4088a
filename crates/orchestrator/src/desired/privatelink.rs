//! PrivateLink's desired state (docs/privatelink.md). A provider tenant publishes a
//! service of one of its VPCs to named consumer tenants (an *endpoint service*, with
//! its allow-list: AWS endpoint services' "allowed principals"); a consumer makes a
//! private *endpoint* for it, an address on one of its own VNIs; a consumer's
//! `privatelink` NF names its endpoints, and the orchestrator resolves them into the
//! NF's data-plane configuration (`nfs::privatelink`), checking the allow-list again.
//!
//! Refusals: malformed input 422; an endpoint on a VNI the tenant does not own 403; a
//! service not published to the tenant 403 (also when it does not exist, so a consumer
//! cannot probe which services a provider has); an endpoint address already in use on
//! its VNI (another endpoint's, or a VIP or pool address of the tenant's NFs) 409.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};
use store::{Compare, TxnOp};
use utoipa::ToSchema;

use super::{check_name, encode, put_kind, Desired, Paging, Put, Revised};
use crate::error::ApiError;
use crate::model::{NfInstance, NfKind, Page, Vpc, MAX_VNI};

/// Transport protocol of a published service.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum EndpointProtocol {
    #[default]
    Tcp,
    Udp,
}

/// PUT /v1/tenants/{tenant}/endpoint-services/{name}: a provider publishes a service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EndpointServiceSpec {
    /// The provider's VPC the service is in.
    pub vpc: String,
    /// The service's address in that VPC.
    pub vip: String,
    pub port: u16,
    #[serde(default)]
    pub protocol: EndpointProtocol,
    /// Addresses of the provider's VPC that consumers' flows arrive from (the platform
    /// translates consumers' sources into them, so the provider never sees a consumer's
    /// address and its replies come back to the platform).
    pub source_addresses: Vec<String>,
    /// Tenants that may make endpoints for the service; empty: nobody yet.
    #[serde(default)]
    pub allowed_tenants: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EndpointService {
    pub tenant: String,
    pub name: String,
    pub vpc: String,
    /// The VPC's VNI when the service was written.
    pub vni: u32,
    pub vip: String,
    pub port: u16,
    pub protocol: EndpointProtocol,
    pub source_addresses: Vec<String>,
    pub allowed_tenants: Vec<String>,
    #[serde(default)]
    pub revision: u64,
}

/// Another tenant's endpoint service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ServiceRef {
    pub tenant: String,
    pub name: String,
}

/// PUT /v1/tenants/{tenant}/privatelink-endpoints/{name}: a consumer's endpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PrivateLinkEndpointSpec {
    /// VNI of the consumer's VPC the endpoint address is in: one of the tenant's own.
    pub vni: u32,
    pub address: String,
    /// The endpoint's port; absent: the service's.
    #[serde(default)]
    pub port: Option<u16>,
    pub service: ServiceRef,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PrivateLinkEndpoint {
    pub tenant: String,
    pub name: String,
    /// The consumer's VPC that owns `vni`.
    pub vpc: String,
    pub vni: u32,
    pub address: String,
    pub port: u16,
    pub service: ServiceRef,
    #[serde(default)]
    pub revision: u64,
}

impl Revised for EndpointService {
    fn set_revision(&mut self, r: u64) {
        self.revision = r;
    }
}
impl Revised for PrivateLinkEndpoint {
    fn set_revision(&mut self, r: u64) {
        self.revision = r;
    }
}

fn parse_addr(field: &str, s: &str) -> Result<IpAddr, ApiError> {
    let a: IpAddr = s
        .parse()
        .map_err(|_| ApiError::invalid(field, format!("{field}: {s:?} is not an IP address")))?;
    if a.is_unspecified() || a.is_multicast() || a.is_loopback() {
        return Err(ApiError::invalid(
            field,
            format!("{field}: {a} is not a unicast address"),
        ));
    }
    Ok(a)
}

/// Whether `a` is inside prefix `p` (`198.19.0.0/16`); prefixes were checked on write.
fn in_prefix(a: IpAddr, p: &str) -> bool {
    let Some((net, len)) = p.split_once('/') else {
        return false;
    };
    let (Ok(net), Ok(len)) = (net.parse::<IpAddr>(), len.parse::<u32>()) else {
        return false;
    };
    let bits = |x: IpAddr| match x {
        IpAddr::V4(v) => (u128::from(u32::from(v)) << 96, true),
        IpAddr::V6(v) => (u128::from(v), false),
    };
    let ((a, av4), (n, nv4)) = (bits(a), bits(net));
    if av4 != nv4 {
        return false;
    }
    // IPv4 sits in the top 32 bits, so a prefix length counts from the top either way.
    let mask = if len == 0 {
        0
    } else {
        u128::MAX << (128 - len.min(128))
    };
    a & mask == n & mask
}

/// An address must lie in the VPC's prefixes when it declares any.
fn in_vpc(field: &str, a: IpAddr, vpc: &Vpc) -> Result<(), ApiError> {
    if vpc.cidrs.is_empty() || vpc.cidrs.iter().any(|c| in_prefix(a, c)) {
        return Ok(());
    }
    Err(ApiError::invalid(
        field,
        format!(
            "{field}: {a} is outside VPC {:?} ({})",
            vpc.name,
            vpc.cidrs.join(", ")
        ),
    ))
}

/// The addresses a tenant's NF configurations claim: LB VIPs and SNAT pool addresses.
fn nf_addresses(nf: &NfInstance) -> Vec<String> {
    let c = &nf.config;
    let strs = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|x| x.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut out = Vec::new();
    for s in c["services"].as_array().into_iter().flatten() {
        out.extend(s["vip"].as_str().map(str::to_string));
    }
    for p in c["pools"].as_array().into_iter().flatten() {
        out.extend(strs(&p["addresses"]));
    }
    out
}

fn addr_key(vni: u32, a: IpAddr) -> String {
    format!("privatelink-addrs/{vni:08}/{a}")
}

fn not_published(tenant: &str, s: &ServiceRef) -> ApiError {
    ApiError::forbidden(format!(
        "endpoint service {:?} of tenant {:?} is not published to tenant {tenant:?}: \
         its provider must list {tenant:?} in allowed_tenants",
        s.name, s.tenant
    ))
    .at("service")
}

impl Desired {
    // ------------------------------------------------------------------ endpoint services

    pub async fn endpoint_service(
        &self,
        tenant: &str,
        name: &str,
    ) -> Result<EndpointService, ApiError> {
        self.tenant_item("endpoint-services", "endpoint service", tenant, name)
            .await
    }

    pub async fn endpoint_services(
        &self,
        tenant: &str,
        page: Paging<'_>,
    ) -> Result<Page<EndpointService>, ApiError> {
        self.tenant_items("endpoint-services", tenant, page).await
    }

    pub async fn put_endpoint_service(
        &self,
        tenant: &str,
        name: &str,
        spec: EndpointServiceSpec,
    ) -> Result<(EndpointService, Put), ApiError> {
        check_name("endpoint service", name)?;
        check_name("vpc", &spec.vpc)?;
        let vip = parse_addr("vip", &spec.vip)?;
        if spec.port == 0 {
            return Err(ApiError::invalid("port", "port must be 1 to 65535"));
        }
        if spec.source_addresses.is_empty() {
            return Err(ApiError::invalid(
                "source_addresses",
                "at least one address of the provider's VPC is needed as consumers' source",
            ));
        }
        let mut sources = Vec::new();
        for s in &spec.source_addresses {
            let a = parse_addr("source_addresses", s)?;
            if a.is_ipv4() != vip.is_ipv4() || a == vip || sources.contains(&a) {
                return Err(ApiError::invalid(
                    "source_addresses",
                    format!(
                        "source_addresses: {a} must be of the VIP's family, not the VIP, \
                         and listed once"
                    ),
                ));
            }
            sources.push(a);
        }
        for t in &spec.allowed_tenants {
            check_name("allowed_tenants", t)?;
        }
        let (tkey, _, trev) = self.tenant_for_update(tenant).await?;
        let vkey = format!("vpcs/{tenant}/{}", spec.vpc);
        let (vpc, vrev) = self.read::<Vpc>(&vkey).await?.ok_or_else(|| {
            ApiError::invalid(
                "vpc",
                format!("VPC {:?} of tenant {tenant:?} does not exist", spec.vpc),
            )
        })?;
        in_vpc("vip", vip, &vpc)?;
        for a in &sources {
            in_vpc("source_addresses", *a, &vpc)?;
        }
        let svc = EndpointService {
            tenant: tenant.into(),
            name: name.into(),
            vpc: spec.vpc.clone(),
            vni: vpc.vni,
            vip: vip.to_string(),
            port: spec.port,
            protocol: spec.protocol,
            source_addresses: sources.iter().map(IpAddr::to_string).collect(),
            allowed_tenants: spec.allowed_tenants.clone(),
            revision: 0,
        };
        // Taking a consumer off the list while it has endpoints would leave them
        // running: refused, as deleting a VPC a chain uses is.
        let users = self.endpoints_of(tenant, name).await?;
        if let Some(e) = users
            .iter()
            .find(|e| !svc.allowed_tenants.contains(&e.tenant))
        {
            return Err(ApiError::conflict(format!(
                "tenant {:?} has endpoint {:?} for this service: it must delete it before \
                 it leaves allowed_tenants",
                e.tenant, e.name
            ))
            .at("allowed_tenants"));
        }
        let key = format!("endpoint-services/{tenant}/{name}");
        let current = self.read::<EndpointService>(&key).await?;
        let mut compares = vec![Compare::ModRev(tkey, trev), Compare::ModRev(vkey, vrev)];
        let put = match put_kind(&key, &svc, &current, &mut compares) {
            Ok(p) => p,
            Err(rev) => return Ok((svc.at(rev), Put::Unchanged)),
        };
        let rev = self
            .store
            .txn(compares, vec![TxnOp::Put(key, encode(&svc))])
            .await?;
        Ok((svc.at(rev), put))
    }

    pub async fn delete_endpoint_service(&self, tenant: &str, name: &str) -> Result<(), ApiError> {
        let s = self.endpoint_service(tenant, name).await?;
        if let Some(e) = self.endpoints_of(tenant, name).await?.first() {
            return Err(ApiError::conflict(format!(
                "endpoint service {name:?} is used by endpoint {:?} of tenant {:?}",
                e.name, e.tenant
            )));
        }
        let key = format!("endpoint-services/{tenant}/{name}");
        self.store
            .txn(
                vec![Compare::ModRev(key.clone(), s.revision)],
                vec![TxnOp::Delete(key)],
            )
            .await?;
        Ok(())
    }

    /// Every tenant's endpoints for service `name` of `tenant`.
    async fn endpoints_of(
        &self,
        tenant: &str,
        name: &str,
    ) -> Result<Vec<PrivateLinkEndpoint>, ApiError> {
        let all: Vec<PrivateLinkEndpoint> = self.all("privatelink-endpoints/").await?;
        Ok(all
            .into_iter()
            .filter(|e| e.service.tenant == tenant && e.service.name == name)
            .collect())
    }

    // ------------------------------------------------------------------ endpoints

    pub async fn privatelink_endpoint(
        &self,
        tenant: &str,
        name: &str,
    ) -> Result<PrivateLinkEndpoint, ApiError> {
        self.tenant_item(
            "privatelink-endpoints",
            "PrivateLink endpoint",
            tenant,
            name,
        )
        .await
    }

    pub async fn privatelink_endpoints(
        &self,
        tenant: &str,
        page: Paging<'_>,
    ) -> Result<Page<PrivateLinkEndpoint>, ApiError> {
        self.tenant_items("privatelink-endpoints", tenant, page)
            .await
    }

    pub async fn put_privatelink_endpoint(
        &self,
        tenant: &str,
        name: &str,
        spec: PrivateLinkEndpointSpec,
    ) -> Result<(PrivateLinkEndpoint, Put), ApiError> {
        check_name("endpoint", name)?;
        let address = parse_addr("address", &spec.address)?;
        if spec.vni == 0 || spec.vni > MAX_VNI {
            return Err(ApiError::invalid(
                "vni",
                format!("vni must be 1 to {MAX_VNI} (24 bits), got {}", spec.vni),
            ));
        }
        if spec.port == Some(0) {
            return Err(ApiError::invalid("port", "port must be 1 to 65535"));
        }
        check_name("service.tenant", &spec.service.tenant)?;
        check_name("service.name", &spec.service.name)?;
        let (tkey, _, trev) = self.tenant_for_update(tenant).await?;

        // The VNI must be one of the tenant's own VPCs'.
        let vni_key = format!("vnis/{:08}", spec.vni);
        let (vpc_name, vnirev) = match self.store.get(&vni_key).await? {
            Some(v) => {
                let owner = String::from_utf8_lossy(&v.value).to_string();
                match owner.split_once('/') {
                    Some((t, vpc)) if t == tenant => (vpc.to_string(), v.mod_rev),
                    _ => return Err(not_owned(tenant, spec.vni)),
                }
            }
            None => return Err(not_owned(tenant, spec.vni)),
        };
        let vkey = format!("vpcs/{tenant}/{vpc_name}");
        let (vpc, vrev) = self
            .read::<Vpc>(&vkey)
            .await?
            .ok_or_else(|| not_owned(tenant, spec.vni))?;

        // The provider must have published the service to this tenant.
        let skey = format!(
            "endpoint-services/{}/{}",
            spec.service.tenant, spec.service.name
        );
        let (svc, srev) = match self.read::<EndpointService>(&skey).await? {
            Some((s, r)) if s.allowed_tenants.iter().any(|t| t == tenant) => (s, r),
            _ => return Err(not_published(tenant, &spec.service)),
        };
        let svc_vip: IpAddr = svc
            .vip
            .parse()
            .map_err(|_| ApiError::internal(format!("stored VIP {:?} does not parse", svc.vip)))?;
        if svc_vip.is_ipv4() != address.is_ipv4() {
            return Err(ApiError::invalid(
                "address",
                format!("address {address} is of another family than the service's {svc_vip}"),
            ));
        }
        in_vpc("address", address, &vpc)?;

        // The address must not be in use on the VNI: by another endpoint (its claim key)
        // or as a VIP or pool address of the tenant's NFs.
        let claim = addr_key(spec.vni, address);
        let owner = format!("{tenant}/{name}");
        if let Some(c) = self.store.get(&claim).await? {
            if c.value != owner.as_bytes() {
                return Err(ApiError::conflict(format!(
                    "address {address} on vni {} is already endpoint {:?}",
                    spec.vni,
                    String::from_utf8_lossy(&c.value)
                ))
                .at("address"));
            }
        }
        let nfs: Vec<NfInstance> = self.all(&format!("nfs/{tenant}/")).await?;
        for nf in &nfs {
            let used = nf_addresses(nf)
                .iter()
                .any(|a| a.parse::<IpAddr>().ok() == Some(address));
            if used {
                return Err(ApiError::conflict(format!(
                    "address {address} is in use by NF {:?} of tenant {tenant:?}",
                    nf.name
                ))
                .at("address"));
            }
        }

        let ep = PrivateLinkEndpoint {
            tenant: tenant.into(),
            name: name.into(),
            vpc: vpc_name,
            vni: spec.vni,
            address: address.to_string(),
            port: spec.port.unwrap_or(svc.port),
            service: spec.service.clone(),
            revision: 0,
        };
        let key = format!("privatelink-endpoints/{tenant}/{name}");
        let current = self.read::<PrivateLinkEndpoint>(&key).await?;
        let mut compares = vec![
            Compare::ModRev(tkey, trev),
            Compare::ModRev(vni_key, vnirev),
            Compare::ModRev(vkey, vrev),
            Compare::ModRev(skey, srev),
        ];
        let mut ops = Vec::new();
        let put = match put_kind(&key, &ep, &current, &mut compares) {
            Ok(p) => p,
            Err(rev) => return Ok((ep.at(rev), Put::Unchanged)),
        };
        if let Some((old, _)) = &current {
            if let Ok(a) = old.address.parse::<IpAddr>() {
                if (old.vni, a) != (ep.vni, address) {
                    ops.push(TxnOp::Delete(addr_key(old.vni, a)));
                }
            }
        }
        let moved = current
            .as_ref()
            .is_none_or(|(o, _)| (o.vni, o.address.as_str()) != (ep.vni, ep.address.as_str()));
        if moved {
            compares.push(Compare::Absent(claim.clone()));
        }
        ops.push(TxnOp::Put(claim.clone(), owner.into_bytes()));
        ops.push(TxnOp::Put(key, encode(&ep)));
        let rev = self.store.txn(compares, ops).await.map_err(|e| match e {
            store::StoreError::Conflict { key } if key == claim => ApiError::conflict(format!(
                "address {address} on vni {} was just taken by another endpoint",
                spec.vni
            ))
            .at("address"),
            e => e.into(),
        })?;
        Ok((ep.at(rev), put))
    }

    pub async fn delete_privatelink_endpoint(
        &self,
        tenant: &str,
        name: &str,
    ) -> Result<(), ApiError> {
        let e = self.privatelink_endpoint(tenant, name).await?;
        let nfs: Vec<NfInstance> = self.all(&format!("nfs/{tenant}/")).await?;
        if let Some(nf) = nfs.iter().find(|n| uses_endpoint(n, &e)) {
            return Err(ApiError::conflict(format!(
                "endpoint {name:?} is served by NF {:?}: remove it there first",
                nf.name
            )));
        }
        let key = format!("privatelink-endpoints/{tenant}/{name}");
        let mut ops = vec![TxnOp::Delete(key.clone())];
        if let Ok(a) = e.address.parse::<IpAddr>() {
            ops.push(TxnOp::Delete(addr_key(e.vni, a)));
        }
        self.store
            .txn(vec![Compare::ModRev(key, e.revision)], ops)
            .await?;
        Ok(())
    }

    /// A VPC an endpoint service is in, or an endpoint's VNI belongs to, is in use: 409.
    pub(super) async fn check_vpc_unused_by_privatelink(&self, vpc: &Vpc) -> Result<(), ApiError> {
        let t = &vpc.tenant;
        let services: Vec<EndpointService> = self.all(&format!("endpoint-services/{t}/")).await?;
        if let Some(s) = services.iter().find(|s| s.vpc == vpc.name) {
            return Err(ApiError::conflict(format!(
                "VPC {:?} is used by endpoint service {:?}: delete it first",
                vpc.name, s.name
            )));
        }
        let eps: Vec<PrivateLinkEndpoint> =
            self.all(&format!("privatelink-endpoints/{t}/")).await?;
        if let Some(e) = eps.iter().find(|e| e.vni == vpc.vni) {
            return Err(ApiError::conflict(format!(
                "VPC {:?} is used by PrivateLink endpoint {:?}: delete it first",
                vpc.name, e.name
            )));
        }
        Ok(())
    }

    /// The data-plane configuration of a consumer's `privatelink` NF whose API
    /// configuration is `{"endpoints": [names of the tenant's endpoints]}` (and
    /// optionally the SNAT's `timeouts`): every endpoint resolved to its service, whose
    /// provider must still list the tenant. One NF serves the endpoints of one provider
    /// VPC, since its chain leaves toward that VPC's host.
    pub async fn privatelink_nf_config(
        &self,
        tenant: &str,
        config: &serde_json::Value,
    ) -> Result<serde_json::Value, ApiError> {
        let bad = |m: &str| ApiError::invalid("config", format!("privatelink configuration: {m}"));
        let obj = config
            .as_object()
            .ok_or_else(|| bad("must be a JSON object"))?;
        if let Some(k) = obj.keys().find(|k| *k != "endpoints" && *k != "timeouts") {
            return Err(bad(&format!(
                "unknown field {k:?}: give \"endpoints\" (names of this tenant's \
                 PrivateLink endpoints) and optionally \"timeouts\""
            )));
        }
        let names: Vec<&str> = obj
            .get("endpoints")
            .and_then(|v| v.as_array())
            .map(|a| a.iter().map(|x| x.as_str()).collect::<Option<Vec<_>>>())
            .unwrap_or(None)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| bad("\"endpoints\" must be a non-empty list of endpoint names"))?;
        let mut endpoints = Vec::new();
        let mut sources: Vec<String> = Vec::new();
        let mut provider_vni = None;
        for n in names {
            let key = format!("privatelink-endpoints/{tenant}/{n}");
            let (e, _) = self
                .read::<PrivateLinkEndpoint>(&key)
                .await?
                .ok_or_else(|| {
                    bad(&format!(
                        "endpoint {n:?} of tenant {tenant:?} does not exist"
                    ))
                })?;
            let skey = format!("endpoint-services/{}/{}", e.service.tenant, e.service.name);
            let s = match self.read::<EndpointService>(&skey).await? {
                Some((s, _)) if s.allowed_tenants.iter().any(|t| t == tenant) => s,
                _ => return Err(not_published(tenant, &e.service)),
            };
            if *provider_vni.get_or_insert(s.vni) != s.vni {
                return Err(bad(
                    "the endpoints' services are in different provider VPCs; one NF \
                     (and its chain) serves one provider VPC",
                ));
            }
            for a in &s.source_addresses {
                if !sources.contains(a) {
                    sources.push(a.clone());
                }
            }
            endpoints.push(serde_json::json!({
                "address": e.address, "port": e.port, "protocol": s.protocol,
                "service_addr": s.vip, "service_port": s.port,
            }));
        }
        let mut out = serde_json::json!({
            "endpoints": endpoints,
            "source": {"addresses": sources},
        });
        if let Some(t) = obj.get("timeouts") {
            out["timeouts"] = t.clone();
        }
        Ok(out)
    }
}

fn not_owned(tenant: &str, vni: u32) -> ApiError {
    ApiError::forbidden(format!(
        "vni {vni} is not the VNI of a VPC of tenant {tenant:?}"
    ))
    .at("vni")
}

impl Desired {
    /// The provider VNIs the tenant's `privatelink` NFs among `nfs` deliver to: the
    /// VPCs of the services (still published to the tenant) their endpoints reach.
    pub(super) async fn privatelink_provider_vnis(
        &self,
        tenant: &str,
        nfs: &[NfInstance],
    ) -> Result<Vec<u32>, ApiError> {
        let links: Vec<&NfInstance> = nfs
            .iter()
            .filter(|n| n.kind == NfKind::PrivateLink)
            .collect();
        if links.is_empty() {
            return Ok(Vec::new());
        }
        let eps: Vec<PrivateLinkEndpoint> = self
            .all(&format!("privatelink-endpoints/{tenant}/"))
            .await?;
        let mut vnis = Vec::new();
        for e in eps
            .iter()
            .filter(|e| links.iter().any(|n| uses_endpoint(n, e)))
        {
            let skey = format!("endpoint-services/{}/{}", e.service.tenant, e.service.name);
            if let Some((s, _)) = self.read::<EndpointService>(&skey).await? {
                if s.allowed_tenants.iter().any(|t| t == tenant) {
                    vnis.push(s.vni);
                }
            }
        }
        Ok(vnis)
    }
}

/// Whether a stored (resolved) `privatelink` NF serves endpoint `e`.
fn uses_endpoint(nf: &NfInstance, e: &PrivateLinkEndpoint) -> bool {
    nf.config["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|x| x["address"].as_str() == Some(e.address.as_str()) && x["port"] == e.port)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_contain_what_they_should() {
        let a = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(in_prefix(a("198.19.7.10"), "198.19.0.0/16"));
        assert!(!in_prefix(a("198.20.7.10"), "198.19.0.0/16"));
        assert!(in_prefix(a("198.19.7.10"), "0.0.0.0/0"));
        assert!(in_prefix(a("198.19.7.10"), "198.19.7.10/32"));
        assert!(!in_prefix(a("198.19.7.11"), "198.19.7.10/32"));
        assert!(!in_prefix(a("2001:db8::1"), "198.19.0.0/16"));
        assert!(in_prefix(a("2001:db8::1"), "2001:db8::/32"));
    }
}
