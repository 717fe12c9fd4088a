//! Desired state: tenants, VPCs, NF instances and chains in the [`store::Store`], with
//! every check that keeps them consistent.
//!
//! Each write is one store transaction whose compares pin what the checks read, so a
//! request either applies whole or leaves the state exactly as it was, also against
//! a concurrent writer (another request, or another orchestrator on the same etcd).
//!
//! Key layout (under the store's own prefix):
//!
//! ```text
//! tenants/{tenant}                  Tenant
//! tenant-ids/{id:010}               tenant name (ids are unique)
//! vpcs/{tenant}/{vpc}               Vpc
//! vnis/{vni:08}                     "{tenant}/{vpc}" (VNIs are unique across tenants)
//! nfs/{tenant}/{nf}                 NfInstance
//! chains/{tenant}/{chain}           Chain
//! chain-ids/{tenant}/{id:010}       chain name
//! vpc-chain/{tenant}/{vpc}          chain name (a VPC binds one chain)
//! tokens/{sha256(token)}            TokenRecord
//! meta/next-tenant-id               counter
//! ```

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use store::{Compare, Store, TxnOp, Versioned};

use crate::error::ApiError;
use crate::model::*;

pub mod privatelink;

/// Longest object name (a DNS label).
const MAX_NAME: usize = 63;
/// Retries of a transaction that lost a race on a counter.
const TXN_RETRIES: usize = 8;
/// Items of one POST /v1/apply at most (one store txn; etcd caps a txn's ops).
pub const MAX_APPLY_ITEMS: usize = 32;

/// Object names are DNS labels: lower-case letters, digits and `-`, 1..=63 characters,
/// starting and ending with a letter or digit. They appear in URLs and store keys.
/// A demand's parts are finite and ≥ 0; a bad one is named (`demand.bw_gbps`).
pub fn check_demand(field: &str, d: &Demand) -> Result<(), ApiError> {
    for (k, v) in [
        ("bw_gbps", d.bw_gbps),
        ("cpu", d.cpu),
        ("mem_gib", d.mem_gib),
    ] {
        if !v.is_finite() || v < 0.0 {
            return Err(ApiError::invalid(
                &format!("{field}.{k}"),
                format!("{field}.{k} must be a finite number >= 0, got {v}"),
            ));
        }
    }
    Ok(())
}

/// Rates at PP: each kind must pass the rate manager's own check (finite, >= 0,
/// min <= base <= burst, base > 0).
pub fn check_rates(r: &TenantRatesSpec) -> Result<(), ApiError> {
    for (kind, spec) in [("requests", r.requests), ("packets", r.packets)] {
        let Some(s) = spec else { continue };
        ratemgr::TenantRates::new(s.min, s.base, s.burst, s.debt)
            .validate()
            .map_err(|e| ApiError::invalid(kind, format!("{kind}: {e}")))?;
    }
    Ok(())
}

pub fn check_name(field: &str, s: &str) -> Result<(), ApiError> {
    let ok = !s.is_empty()
        && s.len() <= MAX_NAME
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid(
            field,
            format!(
                "{field} {s:?} is not a valid name: use 1 to {MAX_NAME} lower-case letters, \
                 digits and '-', starting and ending with a letter or digit"
            ),
        ))
    }
}

fn check_prefix(field: &str, s: &str) -> Result<(), ApiError> {
    let bad = || {
        ApiError::invalid(
            field,
            format!("{field}: {s:?} is not an address prefix like 198.19.0.0/16 or 2001:db8::/32"),
        )
    };
    let (addr, len) = s.split_once('/').ok_or_else(bad)?;
    let addr: IpAddr = addr.parse().map_err(|_| bad())?;
    let len: u8 = len.parse().map_err(|_| bad())?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    if len > max {
        return Err(bad());
    }
    Ok(())
}

/// The uniqueness index of inbound SPIs (PP finds an inbound SA by SPI alone).
fn spi_key(spi: u32) -> String {
    format!("ipsec-spis/{spi:08x}")
}

/// An IPsec tunnel's fields, each refused with 422 naming it.
pub fn check_ipsec(s: &IpsecTunnelSpec) -> Result<(), ApiError> {
    if s.vni == 0 || s.vni > MAX_VNI {
        return Err(ApiError::invalid(
            "vni",
            format!("vni must be 1 to {MAX_VNI} (24 bits), got {}", s.vni),
        ));
    }
    let v4 = |field: &str, a: &str| -> Result<std::net::Ipv4Addr, ApiError> {
        match a.parse::<std::net::Ipv4Addr>() {
            Ok(ip) if !ip.is_unspecified() && !ip.is_broadcast() && !ip.is_multicast() => Ok(ip),
            _ => Err(ApiError::invalid(
                field,
                format!("{field} must be a unicast IPv4 address, got {a:?}"),
            )),
        }
    };
    v4("peer", &s.peer)?;
    v4("vtep", &s.vtep)?;
    proto::parse_mac(&s.vm_mac).map_err(|_| {
        ApiError::invalid(
            "vm_mac",
            format!("vm_mac must be aa:bb:cc:dd:ee:ff, got {:?}", s.vm_mac),
        )
    })?;
    if s.remote_prefixes.is_empty() || s.remote_prefixes.len() > 16 {
        return Err(ApiError::invalid(
            "remote_prefixes",
            "remote_prefixes must name 1 to 16 IPv4 prefixes",
        ));
    }
    if s.local_prefixes.len() > 16 {
        return Err(ApiError::invalid(
            "local_prefixes",
            "at most 16 local prefixes",
        ));
    }
    for (field, list) in [
        ("local_prefixes", &s.local_prefixes),
        ("remote_prefixes", &s.remote_prefixes),
    ] {
        for p in list {
            p.parse::<ipsec::Prefix>()
                .map_err(|e| ApiError::invalid(field, e))?;
        }
    }
    if !(ipsec::replay::MIN_WINDOW..=ipsec::replay::MAX_WINDOW).contains(&s.replay_window) {
        return Err(ApiError::invalid(
            "replay_window",
            format!(
                "replay_window must be {} to {} packets, got {}",
                ipsec::replay::MIN_WINDOW,
                ipsec::replay::MAX_WINDOW,
                s.replay_window
            ),
        ));
    }
    if s.inbound.is_empty() || s.inbound.len() > 2 {
        return Err(ApiError::invalid(
            "inbound",
            "inbound must hold one SA, or two while a rekey is under way",
        ));
    }
    if s.inbound.len() == 2 && s.inbound[0].spi == s.inbound[1].spi {
        return Err(ApiError::invalid(
            "inbound",
            "the two inbound SAs have the same SPI",
        ));
    }
    for (field, sa) in
        std::iter::once(("outbound", &s.outbound)).chain(s.inbound.iter().map(|sa| ("inbound", sa)))
    {
        if sa.spi < 256 {
            return Err(ApiError::invalid(
                field,
                format!(
                    "SPI {} is reserved (RFC 4303 §2.1): use 256 or more",
                    sa.spi
                ),
            ));
        }
        keymat(&sa.key).map_err(|e| ApiError::invalid(field, e))?;
    }
    Ok(())
}

/// The KEYMAT bytes of an SA's hex key, checked to be an AES-GCM key and salt.
pub fn keymat(key: &str) -> Result<Vec<u8>, String> {
    let h = key.strip_prefix("0x").unwrap_or(key);
    let b = hex::decode(h).map_err(|_| {
        "key must be hex digits (RFC 4106 KEYMAT: key then 4-byte salt)".to_string()
    })?;
    ipsec::SaKey::new(&b).map_err(|e| e.to_string())?;
    Ok(b)
}

/// A tenant token as stored: only its hash is kept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenRecord {
    pub id: String,
    pub tenant: String,
}

/// Everything desired, read at one store revision: what reconciliation works from.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub revision: u64,
    pub tenants: Vec<Tenant>,
    pub vpcs: Vec<Vpc>,
    pub nfs: Vec<NfInstance>,
    pub chains: Vec<Chain>,
    /// Tenants' shard sets (the placement engine's output).
    pub placements: Vec<TenantPlacement>,
    /// Tenants' VPC → PP cluster mappings (the same).
    pub vpc_clusters: Vec<VpcClusters>,
    /// IPsec tunnels (docs/ipsec.md).
    pub ipsec: Vec<IpsecTunnel>,
}

impl Snapshot {
    pub fn tenant(&self, name: &str) -> Option<&Tenant> {
        self.tenants.iter().find(|t| t.name == name)
    }

    pub fn tenant_by_id(&self, id: u32) -> Option<&Tenant> {
        self.tenants.iter().find(|t| t.id == id)
    }
}

/// A list request: at most `limit` items after `after`.
#[derive(Debug, Clone, Copy)]
pub struct Paging<'a> {
    pub after: Option<&'a str>,
    pub limit: usize,
}

/// Desired-state operations over a store.
#[derive(Clone)]
pub struct Desired {
    store: Arc<dyn Store>,
}

fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    // Serializing our own plain structs cannot fail.
    serde_json::to_vec(v).unwrap_or_default()
}

fn decode<T: DeserializeOwned>(key: &str, v: &Versioned) -> Result<T, ApiError> {
    serde_json::from_slice(&v.value)
        .map_err(|e| ApiError::internal(format!("stored {key} does not decode: {e}")))
}

/// Set the read-only `revision` field of a decoded resource.
trait Revised: Sized {
    fn set_revision(&mut self, r: u64);

    /// This resource as the store holds it at revision `r` (0: as a PUT spells it).
    fn at(mut self, r: u64) -> Self {
        self.set_revision(r);
        self
    }
}
macro_rules! revised {
    ($($t:ty),*) => {$(impl Revised for $t { fn set_revision(&mut self, r: u64) { self.revision = r; } })*};
}
revised!(Tenant, Vpc, NfInstance, Chain);
impl Revised for IpsecTunnel {
    fn set_revision(&mut self, r: u64) {
        self.revision = r;
    }
}
// Placement records carry no revision of their own: the engine rewrites them whole.
impl Revised for TenantPlacement {
    fn set_revision(&mut self, _: u64) {}
}
impl Revised for VpcClusters {
    fn set_revision(&mut self, _: u64) {}
}
impl Revised for PlacementLimits {
    fn set_revision(&mut self, _: u64) {}
}

/// How a PUT of `new` over `current` (the object at `key` and its revision) goes: the
/// kind of put, with the compare that guards it pushed onto `compares`; or `Err(rev)`
/// when `new` is what the store already holds at `rev` (answer `Put::Unchanged`).
fn put_kind<T: Revised + Clone + PartialEq>(
    key: &str,
    new: &T,
    current: &Option<(T, u64)>,
    compares: &mut Vec<Compare>,
) -> Result<Put, u64> {
    match current {
        Some((old, rev)) if old.clone().at(0) == *new => Err(*rev),
        Some((_, rev)) => {
            compares.push(Compare::ModRev(key.to_string(), *rev));
            Ok(Put::Updated)
        }
        None => {
            compares.push(Compare::Absent(key.to_string()));
            Ok(Put::Created)
        }
    }
}

/// Whether a PUT created the object or replaced (or kept) it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Put {
    Created,
    Updated,
    Unchanged,
}

impl Desired {
    pub fn new(store: Arc<dyn Store>) -> Self {
        Desired { store }
    }

    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    async fn read<T: DeserializeOwned + Revised>(
        &self,
        key: &str,
    ) -> Result<Option<(T, u64)>, ApiError> {
        match self.store.get(key).await? {
            Some(v) => {
                let mut t: T = decode(key, &v)?;
                t.set_revision(v.mod_rev);
                Ok(Some((t, v.mod_rev)))
            }
            None => Ok(None),
        }
    }

    /// Item `name` of a tenant under `{kind}/{tenant}/`; `what` names the kind in the
    /// error. The tenant is checked first, so a missing tenant is reported as such.
    async fn tenant_item<T: DeserializeOwned + Revised>(
        &self,
        kind: &str,
        what: &str,
        tenant: &str,
        name: &str,
    ) -> Result<T, ApiError> {
        self.tenant(tenant).await?;
        self.read::<T>(&format!("{kind}/{tenant}/{name}"))
            .await?
            .map(|(v, _)| v)
            .ok_or_else(|| {
                ApiError::not_found(format!(
                    "{what} {name:?} of tenant {tenant:?} does not exist"
                ))
            })
    }

    /// A page of a tenant's items under `{kind}/{tenant}/`.
    async fn tenant_items<T: DeserializeOwned + Revised>(
        &self,
        kind: &str,
        tenant: &str,
        page: Paging<'_>,
    ) -> Result<Page<T>, ApiError> {
        self.tenant(tenant).await?;
        self.list_of(&format!("{kind}/{tenant}/"), page).await
    }

    /// The tenant an update of one of its items depends on: its key, value and revision
    /// (the update's transaction compares it).
    async fn tenant_for_update(&self, tenant: &str) -> Result<(String, Tenant, u64), ApiError> {
        let tkey = format!("tenants/{tenant}");
        let (t, trev) = self
            .read::<Tenant>(&tkey)
            .await?
            .ok_or_else(|| ApiError::not_found(format!("tenant {tenant:?} does not exist")))?;
        Ok((tkey, t, trev))
    }

    async fn list_of<T: DeserializeOwned + Revised>(
        &self,
        prefix: &str,
        page: Paging<'_>,
    ) -> Result<Page<T>, ApiError> {
        let after = page.after.map(|a| format!("{prefix}{a}"));
        // One more than asked tells whether a next page exists.
        let rows = self
            .store
            .list(prefix, after.as_deref(), page.limit + 1)
            .await?;
        let more = rows.len() > page.limit;
        let mut items = Vec::with_capacity(rows.len().min(page.limit));
        let mut last = None;
        for (k, v) in rows.into_iter().take(page.limit) {
            let mut t: T = decode(&k, &v)?;
            t.set_revision(v.mod_rev);
            last = Some(k[prefix.len()..].to_string());
            items.push(t);
        }
        Ok(Page {
            items,
            next: if more { last } else { None },
        })
    }

    async fn all<T: DeserializeOwned + Revised>(&self, prefix: &str) -> Result<Vec<T>, ApiError> {
        let rows = self.store.list(prefix, None, 0).await?;
        rows.into_iter()
            .map(|(k, v)| {
                let mut t: T = decode(&k, &v)?;
                t.set_revision(v.mod_rev);
                Ok(t)
            })
            .collect()
    }

    // ------------------------------------------------------------------ tenants

    pub async fn tenant(&self, name: &str) -> Result<Tenant, ApiError> {
        self.read::<Tenant>(&format!("tenants/{name}"))
            .await?
            .map(|(t, _)| t)
            .ok_or_else(|| ApiError::not_found(format!("tenant {name:?} does not exist")))
    }

    pub async fn tenants(&self, page: Paging<'_>) -> Result<Page<Tenant>, ApiError> {
        self.list_of("tenants/", page).await
    }

    /// Write `items` in order as one store txn, or nothing. Each item is checked by the
    /// code of its own PUT, run against a staged view of the store
    /// ([`store::Staged`]) in which the items before it are already written; the
    /// first refused item fails the whole request, its error naming `items[i]`. If
    /// the store changed under what was read, the whole request runs again.
    pub async fn apply(
        &self,
        items: &[ApplyItem],
        clusters: &[String],
    ) -> Result<ApplyResult, ApiError> {
        if items.is_empty() {
            return Err(ApiError::invalid("items", "nothing to apply"));
        }
        if items.len() > MAX_APPLY_ITEMS {
            return Err(ApiError::invalid(
                "items",
                format!(
                    "at most {MAX_APPLY_ITEMS} items in one apply, got {}",
                    items.len()
                ),
            ));
        }
        for _ in 0..TXN_RETRIES {
            let staged = Arc::new(store::Staged::new(self.store.clone()).await?);
            let view = Desired::new(staged.clone());
            let mut applied = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let put = match item {
                    ApplyItem::Tenant { name, spec } => view
                        .put_tenant(name, spec.clone(), clusters)
                        .await
                        .map(|r| r.1),
                    ApplyItem::Vpc { tenant, name, spec } => {
                        view.put_vpc(tenant, name, spec.clone()).await.map(|r| r.1)
                    }
                    ApplyItem::Nf { tenant, name, spec } => {
                        view.put_nf(tenant, name, spec.clone()).await.map(|r| r.1)
                    }
                    ApplyItem::Chain { tenant, name, spec } => view
                        .put_chain(tenant, name, spec.clone())
                        .await
                        .map(|r| r.1),
                }
                .map_err(|e| e.within(&format!("items[{i}]"), &item.path()))?;
                applied.push(AppliedItem {
                    object: item.path(),
                    result: match put {
                        Put::Created => "created",
                        Put::Updated => "updated",
                        Put::Unchanged => "unchanged",
                    }
                    .into(),
                });
            }
            drop(view);
            let Ok(staged) = Arc::try_unwrap(staged) else {
                return Err(ApiError::internal("staged store still shared after apply"));
            };
            match staged.commit().await {
                Ok(revision) => {
                    return Ok(ApplyResult {
                        revision,
                        items: applied,
                    })
                }
                Err(store::StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::conflict(
            "the objects kept changing under this apply; retry",
        ))
    }

    /// Create or update a tenant. `clusters` are the PP clusters known now, for
    /// placing a new tenant that names none.
    pub async fn put_tenant(
        &self,
        name: &str,
        spec: TenantSpec,
        clusters: &[String],
    ) -> Result<(Tenant, Put), ApiError> {
        check_name("tenant", name)?;
        if let Some(c) = &spec.pp_cluster {
            check_name("pp_cluster", c)?;
        }
        if let Some(d) = &spec.demand {
            check_demand("demand", d)?;
        }
        for k in spec.labels.keys() {
            if k.is_empty() || k.len() > 63 {
                return Err(ApiError::invalid(
                    "labels",
                    format!("label key {k:?} must be 1 to 63 characters"),
                ));
            }
        }
        let key = format!("tenants/{name}");
        for _ in 0..TXN_RETRIES {
            let current = self.read::<Tenant>(&key).await?;
            let (tenant, compares, mut ops, put) = match current {
                Some((old, rev)) => {
                    let t = Tenant {
                        name: name.to_string(),
                        id: old.id,
                        pp_cluster: spec.pp_cluster.clone().unwrap_or(old.pp_cluster.clone()),
                        labels: spec.labels.clone(),
                        demand: spec.demand.or(old.demand),
                        pinned_cluster: old.pinned_cluster || spec.pp_cluster.is_some(),
                        rates: old.rates,
                        revision: 0,
                    };
                    if old.at(0) == t {
                        return Ok((t.at(rev), Put::Unchanged));
                    }
                    (
                        t,
                        vec![Compare::ModRev(key.clone(), rev)],
                        vec![],
                        Put::Updated,
                    )
                }
                None => {
                    let ctr = self.store.get("meta/next-tenant-id").await?;
                    let (next, ctr_rev) = match &ctr {
                        Some(v) => (
                            std::str::from_utf8(&v.value)
                                .ok()
                                .and_then(|s| s.parse::<u32>().ok())
                                .ok_or_else(|| {
                                    ApiError::internal("meta/next-tenant-id is not a number")
                                })?,
                            v.mod_rev,
                        ),
                        None => (1, 0),
                    };
                    if next == u32::MAX {
                        return Err(ApiError::conflict("tenant ids are exhausted"));
                    }
                    let cluster = match &spec.pp_cluster {
                        Some(c) => c.clone(),
                        None => self.least_loaded_cluster(clusters).await?,
                    };
                    let t = Tenant {
                        name: name.to_string(),
                        id: next,
                        pp_cluster: cluster,
                        labels: spec.labels.clone(),
                        demand: spec.demand,
                        pinned_cluster: spec.pp_cluster.is_some(),
                        rates: None,
                        revision: 0,
                    };
                    let id_key = format!("tenant-ids/{next:010}");
                    (
                        t,
                        vec![
                            Compare::Absent(key.clone()),
                            Compare::ModRev("meta/next-tenant-id".into(), ctr_rev),
                            Compare::Absent(id_key.clone()),
                        ],
                        vec![
                            TxnOp::Put(
                                "meta/next-tenant-id".into(),
                                (next + 1).to_string().into_bytes(),
                            ),
                            TxnOp::Put(id_key, name.as_bytes().to_vec()),
                        ],
                        Put::Created,
                    )
                }
            };
            ops.push(TxnOp::Put(key.clone(), encode(&tenant)));
            match self.store.txn(compares, ops).await {
                Ok(rev) => return Ok((tenant.at(rev), put)),
                Err(store::StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::conflict(format!(
            "tenant {name:?} kept changing under this request; retry"
        )))
    }

    /// Set (or with `None` clear) a tenant's rates at PP. Refused rates (422) change
    /// nothing.
    pub async fn set_tenant_rates(
        &self,
        name: &str,
        rates: Option<TenantRatesSpec>,
    ) -> Result<(Tenant, Put), ApiError> {
        if let Some(r) = &rates {
            check_rates(r)?;
        }
        let key = format!("tenants/{name}");
        for _ in 0..TXN_RETRIES {
            let Some((old, rev)) = self.read::<Tenant>(&key).await? else {
                return Err(ApiError::not_found(format!("no tenant {name:?}")));
            };
            // An empty spec is no rates.
            let rates = rates.filter(|r| r.requests.is_some() || r.packets.is_some());
            if old.rates == rates {
                return Ok((old.at(rev), Put::Unchanged));
            }
            let t = Tenant {
                rates,
                revision: 0,
                ..old
            };
            match self
                .store
                .txn(
                    vec![Compare::ModRev(key.clone(), rev)],
                    vec![TxnOp::Put(key.clone(), encode(&t))],
                )
                .await
            {
                Ok(rev) => return Ok((t.at(rev), Put::Updated)),
                Err(store::StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::conflict(format!(
            "tenant {name:?} kept changing under this request; retry"
        )))
    }

    // -------------------------------------------------------------- placement

    /// Every tenant's placement record.
    pub async fn placements(&self) -> Result<Vec<TenantPlacement>, ApiError> {
        self.all("placements/").await
    }

    /// The placement limits an operator set (`PUT /v1/placement/limits`), if any.
    pub async fn placement_limits(&self) -> Result<Option<PlacementLimits>, ApiError> {
        Ok(self
            .read::<PlacementLimits>("meta/placement-limits")
            .await?
            .map(|(l, _)| l))
    }

    /// Writes changed placement records, deletes those of gone tenants, and (if given)
    /// the limits, in one transaction.
    pub async fn write_placements(
        &self,
        put: &[TenantPlacement],
        delete: &[String],
        limits: Option<PlacementLimits>,
    ) -> Result<(), ApiError> {
        self.write_placement_records(put, delete, limits, &[]).await
    }

    /// [`Desired::write_placements`] plus VPC → PP cluster mappings, in one
    /// transaction.
    pub async fn write_placement_records(
        &self,
        put: &[TenantPlacement],
        delete: &[String],
        limits: Option<PlacementLimits>,
        clusters: &[VpcClusters],
    ) -> Result<(), ApiError> {
        let mut ops = Vec::new();
        for c in clusters {
            ops.push(TxnOp::Put(format!("vpc-clusters/{}", c.tenant), encode(c)));
        }
        for p in put {
            ops.push(TxnOp::Put(format!("placements/{}", p.tenant), encode(p)));
        }
        for t in delete {
            ops.push(TxnOp::Delete(format!("placements/{t}")));
            ops.push(TxnOp::Delete(format!("vpc-clusters/{t}")));
        }
        if let Some(l) = limits {
            ops.push(TxnOp::Put("meta/placement-limits".into(), encode(&l)));
        }
        if ops.is_empty() {
            return Ok(());
        }
        self.store.txn(vec![], ops).await?;
        Ok(())
    }

    async fn least_loaded_cluster(&self, clusters: &[String]) -> Result<String, ApiError> {
        if clusters.is_empty() {
            return Ok("default".into());
        }
        let tenants: Vec<Tenant> = self.all("tenants/").await?;
        let mut load: BTreeMap<&str, usize> = clusters.iter().map(|c| (c.as_str(), 0)).collect();
        for t in &tenants {
            if let Some(n) = load.get_mut(t.pp_cluster.as_str()) {
                *n += 1;
            }
        }
        Ok(load
            .into_iter()
            .min_by_key(|(c, n)| (*n, *c))
            .map(|(c, _)| c.to_string())
            .unwrap_or_else(|| "default".into()))
    }

    /// Delete a tenant; with `cascade`, its VPCs, NFs, chains and tokens too, in the
    /// same transaction. Without, a tenant that still has objects is refused.
    pub async fn delete_tenant(&self, name: &str, cascade: bool) -> Result<(), ApiError> {
        let key = format!("tenants/{name}");
        let (t, rev) = self
            .read::<Tenant>(&key)
            .await?
            .ok_or_else(|| ApiError::not_found(format!("tenant {name:?} does not exist")))?;
        let vpcs: Vec<Vpc> = self.all(&format!("vpcs/{name}/")).await?;
        let nfs: Vec<NfInstance> = self.all(&format!("nfs/{name}/")).await?;
        let chains: Vec<Chain> = self.all(&format!("chains/{name}/")).await?;
        if !cascade && (!vpcs.is_empty() || !nfs.is_empty() || !chains.is_empty()) {
            return Err(ApiError::conflict(format!(
                "tenant {name:?} still has {} VPCs, {} NFs and {} chains: delete them first, \
                 or delete with ?cascade=true",
                vpcs.len(),
                nfs.len(),
                chains.len()
            )));
        }
        let mut compares = vec![Compare::ModRev(key.clone(), rev)];
        let mut ops = vec![
            TxnOp::Delete(key),
            TxnOp::Delete(format!("tenant-ids/{:010}", t.id)),
        ];
        for v in &vpcs {
            compares.push(Compare::ModRev(
                format!("vpcs/{name}/{}", v.name),
                v.revision,
            ));
            ops.push(TxnOp::Delete(format!("vpcs/{name}/{}", v.name)));
            ops.push(TxnOp::Delete(format!("vnis/{:08}", v.vni)));
            ops.push(TxnOp::Delete(format!("vpc-chain/{name}/{}", v.name)));
        }
        for n in &nfs {
            ops.push(TxnOp::Delete(format!("nfs/{name}/{}", n.name)));
        }
        for c in &chains {
            ops.push(TxnOp::Delete(format!("chains/{name}/{}", c.name)));
            ops.push(TxnOp::Delete(format!("chain-ids/{name}/{:010}", c.id)));
        }
        let tunnels: Vec<IpsecTunnel> = self.all(&format!("ipsec/{name}/")).await?;
        for t in &tunnels {
            ops.push(TxnOp::Delete(format!("ipsec/{name}/{}", t.name)));
            for sa in &t.spec.inbound {
                ops.push(TxnOp::Delete(spi_key(sa.spi)));
            }
        }
        for (k, _) in self.store.list("tokens/", None, 0).await? {
            if let Some(v) = self.store.get(&k).await? {
                let r: TokenRecord = decode(&k, &v)?;
                if r.tenant == name {
                    ops.push(TxnOp::Delete(k));
                }
            }
        }
        self.store.txn(compares, ops).await?;
        Ok(())
    }

    // ------------------------------------------------------------------ VPCs

    pub async fn vpc(&self, tenant: &str, name: &str) -> Result<Vpc, ApiError> {
        self.tenant_item("vpcs", "VPC", tenant, name).await
    }

    pub async fn vpcs(&self, tenant: &str, page: Paging<'_>) -> Result<Page<Vpc>, ApiError> {
        self.tenant_items("vpcs", tenant, page).await
    }

    pub async fn put_vpc(
        &self,
        tenant: &str,
        name: &str,
        spec: VpcSpec,
    ) -> Result<(Vpc, Put), ApiError> {
        check_name("vpc", name)?;
        if spec.vni == 0 || spec.vni > MAX_VNI {
            return Err(ApiError::invalid(
                "vni",
                format!("vni must be 1 to {MAX_VNI} (24 bits), got {}", spec.vni),
            ));
        }
        for c in &spec.cidrs {
            check_prefix("cidrs", c)?;
        }
        let (tkey, _, trev) = self.tenant_for_update(tenant).await?;
        let key = format!("vpcs/{tenant}/{name}");
        let vni_key = format!("vnis/{:08}", spec.vni);
        let owner = format!("{tenant}/{name}");
        let vpc = Vpc {
            tenant: tenant.to_string(),
            name: name.to_string(),
            vni: spec.vni,
            cidrs: spec.cidrs.clone(),
            revision: 0,
        };
        if let Some(v) = self.store.get(&vni_key).await? {
            if v.value != owner.as_bytes() {
                let other = String::from_utf8_lossy(&v.value).to_string();
                let (ot, ov) = other.split_once('/').unwrap_or((&other, ""));
                return Err(ApiError::conflict(format!(
                    "vni {} is already used by VPC {ov:?} of tenant {ot:?}",
                    spec.vni
                ))
                .at("vni"));
            }
        }
        let current = self.read::<Vpc>(&key).await?;
        if current.as_ref().is_none_or(|(o, _)| o.vni != vpc.vni) {
            // A VNI another tenant's chain already sends into would hand this VPC that
            // tenant's frames (the other half of `egress_vni`).
            let chains: Vec<Chain> = self.all("chains/").await?;
            let sends_here =
                |e: &proto::EgressDef| e.encap.as_ref().is_some_and(|x| x.vni == spec.vni);
            if chains
                .iter()
                .any(|c| c.tenant != tenant && (sends_here(&c.forward) || sends_here(&c.reverse)))
            {
                return Err(ApiError::conflict(format!(
                    "vni {} is the egress of another tenant's chain",
                    spec.vni
                ))
                .at("vni"));
            }
        }
        let mut compares = vec![Compare::ModRev(tkey, trev)];
        let mut ops = Vec::new();
        let put = match put_kind(&key, &vpc, &current, &mut compares) {
            Ok(p) => p,
            Err(rev) => return Ok((vpc.at(rev), Put::Unchanged)),
        };
        if let Some((old, _)) = current.as_ref().filter(|(o, _)| o.vni != vpc.vni) {
            ops.push(TxnOp::Delete(format!("vnis/{:08}", old.vni)));
        }
        if current.as_ref().is_none_or(|(o, _)| o.vni != vpc.vni) {
            compares.push(Compare::Absent(vni_key.clone()));
            ops.push(TxnOp::Put(vni_key, owner.into_bytes()));
        }
        ops.push(TxnOp::Put(key, encode(&vpc)));
        let rev = self.store.txn(compares, ops).await.map_err(|e| match e {
            store::StoreError::Conflict { key } if key.starts_with("vnis/") => {
                ApiError::conflict(format!("vni {} was just taken by another VPC", spec.vni))
                    .at("vni")
            }
            e => e.into(),
        })?;
        Ok((vpc.at(rev), put))
    }

    pub async fn delete_vpc(&self, tenant: &str, name: &str) -> Result<(), ApiError> {
        let v = self.vpc(tenant, name).await?;
        self.check_vpc_unused_by_privatelink(&v).await?;
        let bind = format!("vpc-chain/{tenant}/{name}");
        if let Some(c) = self.store.get(&bind).await? {
            return Err(ApiError::conflict(format!(
                "VPC {name:?} is used by chain {:?}: delete the chain first",
                String::from_utf8_lossy(&c.value)
            )));
        }
        self.store
            .txn(
                vec![
                    Compare::ModRev(format!("vpcs/{tenant}/{name}"), v.revision),
                    Compare::Absent(bind),
                ],
                vec![
                    TxnOp::Delete(format!("vpcs/{tenant}/{name}")),
                    TxnOp::Delete(format!("vnis/{:08}", v.vni)),
                ],
            )
            .await?;
        Ok(())
    }

    // ------------------------------------------------------------------ NFs

    pub async fn nf(&self, tenant: &str, name: &str) -> Result<NfInstance, ApiError> {
        self.tenant_item("nfs", "NF", tenant, name).await
    }

    pub async fn nfs(&self, tenant: &str, page: Paging<'_>) -> Result<Page<NfInstance>, ApiError> {
        self.tenant_items("nfs", tenant, page).await
    }

    pub async fn put_nf(
        &self,
        tenant: &str,
        name: &str,
        spec: NfSpec,
    ) -> Result<(NfInstance, Put), ApiError> {
        check_name("nf", name)?;
        let (tkey, t, trev) = self.tenant_for_update(tenant).await?;
        // A PrivateLink NF names endpoints; what is stored is their resolution.
        let spec = match spec.kind {
            NfKind::PrivateLink => NfSpec {
                config: self.privatelink_nf_config(tenant, &spec.config).await?,
                ..spec
            },
            _ => spec,
        };
        // Building the NF is the validation: exactly what SC will do with it.
        let built = nf_config(t.id, spec.kind, &spec.config)?;
        nfs::build(&built).map_err(|e| {
            ApiError::invalid("config", format!("{} configuration: {e}", spec.kind.name()))
        })?;
        let key = format!("nfs/{tenant}/{name}");
        let nf = NfInstance {
            tenant: tenant.to_string(),
            name: name.to_string(),
            kind: spec.kind,
            config: spec.config,
            revision: 0,
        };
        let current = self.read::<NfInstance>(&key).await?;
        let mut compares = vec![Compare::ModRev(tkey, trev)];
        let put = match put_kind(&key, &nf, &current, &mut compares) {
            Ok(p) => p,
            Err(rev) => return Ok((nf.at(rev), Put::Unchanged)),
        };
        let rev = self
            .store
            .txn(compares, vec![TxnOp::Put(key, encode(&nf))])
            .await?;
        Ok((nf.at(rev), put))
    }

    pub async fn delete_nf(&self, tenant: &str, name: &str) -> Result<(), ApiError> {
        let nf = self.nf(tenant, name).await?;
        let chains: Vec<Chain> = self.all(&format!("chains/{tenant}/")).await?;
        if let Some(c) = chains.iter().find(|c| c.nfs.iter().any(|n| n == name)) {
            return Err(ApiError::conflict(format!(
                "NF {name:?} is used by chain {:?}: remove it from the chain first",
                c.name
            )));
        }
        self.store
            .txn(
                vec![Compare::ModRev(format!("nfs/{tenant}/{name}"), nf.revision)],
                vec![TxnOp::Delete(format!("nfs/{tenant}/{name}"))],
            )
            .await?;
        Ok(())
    }

    // ------------------------------------------------------------------ chains

    pub async fn chain(&self, tenant: &str, name: &str) -> Result<Chain, ApiError> {
        self.tenant_item("chains", "chain", tenant, name).await
    }

    pub async fn chains(&self, tenant: &str, page: Paging<'_>) -> Result<Page<Chain>, ApiError> {
        self.tenant_items("chains", tenant, page).await
    }

    pub async fn put_chain(
        &self,
        tenant: &str,
        name: &str,
        spec: ChainSpec,
    ) -> Result<(Chain, Put), ApiError> {
        check_name("chain", name)?;
        let (tkey, t, trev) = self.tenant_for_update(tenant).await?;
        check_name("vpc", &spec.vpc)?;
        if spec.nfs.is_empty() {
            return Err(ApiError::invalid("nfs", "a chain needs at least one NF"));
        }
        let vkey = format!("vpcs/{tenant}/{}", spec.vpc);
        let vrev = self
            .store
            .get(&vkey)
            .await?
            .map(|v| v.mod_rev)
            .ok_or_else(|| {
                ApiError::invalid(
                    "vpc",
                    format!("VPC {:?} of tenant {tenant:?} does not exist", spec.vpc),
                )
            })?;
        let mut compares = vec![Compare::ModRev(tkey, trev), Compare::ModRev(vkey, vrev)];
        let mut nf_objs = Vec::new();
        for n in &spec.nfs {
            let k = format!("nfs/{tenant}/{n}");
            let (nf, rev) = self.read::<NfInstance>(&k).await?.ok_or_else(|| {
                ApiError::invalid(
                    "nfs",
                    format!("NF {n:?} of tenant {tenant:?} does not exist"),
                )
            })?;
            compares.push(Compare::ModRev(k, rev));
            nf_objs.push(nf);
        }
        for (field, egress) in [("forward", &spec.forward), ("reverse", &spec.reverse)] {
            if let Some(encap) = &egress.encap {
                compares.push(self.egress_vni(tenant, &nf_objs, encap.vni, field).await?);
            }
        }
        let key = format!("chains/{tenant}/{name}");
        let bind = format!("vpc-chain/{tenant}/{}", spec.vpc);
        let bound = self.store.get(&bind).await?;
        if let Some(b) = &bound {
            if b.value != name.as_bytes() {
                return Err(ApiError::conflict(format!(
                    "VPC {:?} is already bound to chain {:?}; a VPC carries one chain",
                    spec.vpc,
                    String::from_utf8_lossy(&b.value)
                ))
                .at("vpc"));
            }
        }
        for _ in 0..TXN_RETRIES {
            let current = self.read::<Chain>(&key).await?;
            let mut cmp = compares.clone();
            let mut ops = Vec::new();
            let (id, put) = match &current {
                Some((old, rev)) => {
                    cmp.push(Compare::ModRev(key.clone(), *rev));
                    if old.vpc != spec.vpc {
                        ops.push(TxnOp::Delete(format!("vpc-chain/{tenant}/{}", old.vpc)));
                    }
                    (old.id, Put::Updated)
                }
                None => {
                    cmp.push(Compare::Absent(key.clone()));
                    let used = self
                        .store
                        .list(&format!("chain-ids/{tenant}/"), None, 0)
                        .await?;
                    let id = used
                        .iter()
                        .filter_map(|(k, _)| k.rsplit('/').next()?.parse::<u32>().ok())
                        .max()
                        .unwrap_or(0)
                        + 1;
                    let id_key = format!("chain-ids/{tenant}/{id:010}");
                    cmp.push(Compare::Absent(id_key.clone()));
                    ops.push(TxnOp::Put(id_key, name.as_bytes().to_vec()));
                    (id, Put::Created)
                }
            };
            let chain = Chain {
                tenant: tenant.to_string(),
                name: name.to_string(),
                id,
                vpc: spec.vpc.clone(),
                nfs: spec.nfs.clone(),
                spec: spec.spec.clone(),
                forward: spec.forward.clone(),
                reverse: spec.reverse.clone(),
                revision: 0,
            };
            // The whole chain as SC will build it: NF indices, egress, VNIs, MACs.
            chain_def(&t, &chain, &nf_objs)?;
            if let Some((old, rev)) = &current {
                if old.clone().at(0) == chain {
                    return Ok((chain.at(*rev), Put::Unchanged));
                }
            }
            if current.as_ref().is_none_or(|(o, _)| o.vpc != spec.vpc) {
                cmp.push(Compare::Absent(bind.clone()));
            }
            ops.push(TxnOp::Put(bind.clone(), name.as_bytes().to_vec()));
            ops.push(TxnOp::Put(key.clone(), encode(&chain)));
            match self.store.txn(cmp, ops).await {
                Ok(rev) => return Ok((chain.at(rev), put)),
                Err(store::StoreError::Conflict { key: k }) if k.starts_with("chain-ids/") => {
                    continue
                }
                Err(store::StoreError::Conflict { key: k }) if k == bind => {
                    return Err(ApiError::conflict(format!(
                        "VPC {:?} was just bound to another chain",
                        spec.vpc
                    ))
                    .at("vpc"))
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ApiError::conflict(format!(
            "chain {name:?} kept changing under this request; retry"
        )))
    }

    /// Where a chain may re-encapsulate its frames: into one of its tenant's own VPCs,
    /// into a VNI no VPC has (a provider network, such as the internet gateway's), or
    /// into another tenant's VPC only as the provider side of a PrivateLink service its
    /// NFs reach. Anything else would let a tenant write frames into another tenant's
    /// VPC: 403, without naming the owner. The returned compare keeps the answer true
    /// when the chain is written.
    async fn egress_vni(
        &self,
        tenant: &str,
        nfs: &[NfInstance],
        vni: u32,
        field: &str,
    ) -> Result<Compare, ApiError> {
        let key = format!("vnis/{vni:08}");
        let Some(v) = self.store.get(&key).await? else {
            return Ok(Compare::Absent(key));
        };
        let owner = String::from_utf8_lossy(&v.value);
        let owner_tenant = owner.split_once('/').map_or(owner.as_ref(), |x| x.0);
        if owner_tenant != tenant
            && !self
                .privatelink_provider_vnis(tenant, nfs)
                .await?
                .contains(&vni)
        {
            return Err(ApiError::forbidden(format!(
                "{field}.encap.vni {vni} is another tenant's VPC: a chain re-encapsulates \
                 only into its tenant's own VPCs, a provider network, or the VPC of a \
                 PrivateLink service its NFs reach"
            ))
            .at(field));
        }
        Ok(Compare::ModRev(key, v.mod_rev))
    }

    pub async fn delete_chain(&self, tenant: &str, name: &str) -> Result<(), ApiError> {
        let c = self.chain(tenant, name).await?;
        self.store
            .txn(
                vec![Compare::ModRev(
                    format!("chains/{tenant}/{name}"),
                    c.revision,
                )],
                vec![
                    TxnOp::Delete(format!("chains/{tenant}/{name}")),
                    TxnOp::Delete(format!("chain-ids/{tenant}/{:010}", c.id)),
                    TxnOp::Delete(format!("vpc-chain/{tenant}/{}", c.vpc)),
                ],
            )
            .await?;
        Ok(())
    }

    // ------------------------------------------------------------------ tokens

    pub async fn create_token(&self, tenant: &str) -> Result<Token, ApiError> {
        self.tenant(tenant).await?;
        let secret: [u8; 24] = rand::random();
        let token = format!("sft_{}", hex::encode(secret));
        let id = hex::encode(&crate::auth::token_hash(&token)[..6]);
        let rec = TokenRecord {
            id: id.clone(),
            tenant: tenant.to_string(),
        };
        let key = format!("tokens/{}", hex::encode(crate::auth::token_hash(&token)));
        self.store
            .txn(
                vec![
                    Compare::Present(format!("tenants/{tenant}")),
                    Compare::Absent(key.clone()),
                ],
                vec![TxnOp::Put(key, encode(&rec))],
            )
            .await?;
        Ok(Token {
            id,
            tenant: tenant.to_string(),
            token: Some(token),
        })
    }

    pub async fn tokens(&self, tenant: &str) -> Result<Vec<Token>, ApiError> {
        self.tenant(tenant).await?;
        let mut out = Vec::new();
        for (k, v) in self.store.list("tokens/", None, 0).await? {
            let r: TokenRecord = decode(&k, &v)?;
            if r.tenant == tenant {
                out.push(Token {
                    id: r.id,
                    tenant: r.tenant,
                    token: None,
                });
            }
        }
        Ok(out)
    }

    pub async fn delete_token(&self, tenant: &str, id: &str) -> Result<(), ApiError> {
        for (k, v) in self.store.list("tokens/", None, 0).await? {
            let r: TokenRecord = decode(&k, &v)?;
            if r.tenant == tenant && r.id == id {
                self.store.delete(&k).await?;
                return Ok(());
            }
        }
        Err(ApiError::not_found(format!(
            "tenant {tenant:?} has no token {id:?}"
        )))
    }

    /// The tenant a token belongs to, if it is a live tenant token.
    pub async fn token_tenant(&self, token: &str) -> Result<Option<String>, ApiError> {
        let key = format!("tokens/{}", hex::encode(crate::auth::token_hash(token)));
        match self.store.get(&key).await? {
            Some(v) => Ok(Some(decode::<TokenRecord>(&key, &v)?.tenant)),
            None => Ok(None),
        }
    }

    // ------------------------------------------------------------------ IPsec tunnels

    pub async fn ipsec_tunnel(&self, tenant: &str, name: &str) -> Result<IpsecTunnel, ApiError> {
        self.tenant_item("ipsec", "IPsec tunnel", tenant, name)
            .await
    }

    pub async fn ipsec_tunnels(
        &self,
        tenant: &str,
        page: Paging<'_>,
    ) -> Result<Page<IpsecTunnel>, ApiError> {
        self.tenant_items("ipsec", tenant, page).await
    }

    /// Create or replace a tunnel. 422 for a malformed field, 403 when the VNI is not one
    /// of the tenant's VPCs, 409 when an inbound SPI is another tunnel's.
    pub async fn put_ipsec_tunnel(
        &self,
        tenant: &str,
        name: &str,
        spec: IpsecTunnelSpec,
    ) -> Result<(IpsecTunnel, Put), ApiError> {
        check_name("tunnel", name)?;
        check_ipsec(&spec)?;
        let (tkey, _, trev) = self.tenant_for_update(tenant).await?;
        let vni_key = format!("vnis/{:08}", spec.vni);
        let not_owned = || {
            ApiError::forbidden(format!(
                "vni {} is not a VPC of tenant {tenant:?}: a tunnel joins one of the tenant's own VPCs",
                spec.vni
            ))
            .at("vni")
        };
        let vni_rev = match self.store.get(&vni_key).await? {
            Some(v)
                if String::from_utf8_lossy(&v.value)
                    .split_once('/')
                    .map(|x| x.0)
                    == Some(tenant) =>
            {
                v.mod_rev
            }
            _ => return Err(not_owned()),
        };
        let key = format!("ipsec/{tenant}/{name}");
        let owner = format!("{tenant}/{name}");
        let tunnel = IpsecTunnel {
            tenant: tenant.to_string(),
            name: name.to_string(),
            spec: spec.clone(),
            revision: 0,
        };
        let current = self.read::<IpsecTunnel>(&key).await?;
        let mut compares = vec![
            Compare::ModRev(tkey, trev),
            Compare::ModRev(vni_key, vni_rev),
        ];
        let mut ops = Vec::new();
        let put = match put_kind(&key, &tunnel, &current, &mut compares) {
            Ok(p) => p,
            Err(rev) => return Ok((tunnel.at(rev), Put::Unchanged)),
        };
        if let Some((old, _)) = &current {
            for sa in &old.spec.inbound {
                if !spec.inbound.iter().any(|n| n.spi == sa.spi) {
                    ops.push(TxnOp::Delete(spi_key(sa.spi)));
                }
            }
        }
        for sa in &spec.inbound {
            let k = spi_key(sa.spi);
            match self.store.get(&k).await? {
                Some(v) if v.value == owner.as_bytes() => {
                    compares.push(Compare::ModRev(k, v.mod_rev));
                }
                Some(v) => {
                    let other = String::from_utf8_lossy(&v.value).to_string();
                    let (ot, on) = other.split_once('/').unwrap_or((&other, ""));
                    return Err(ApiError::conflict(format!(
                        "inbound SPI {:#x} is already used by IPsec tunnel {on:?} of tenant {ot:?}",
                        sa.spi
                    ))
                    .at("inbound"));
                }
                None => {
                    compares.push(Compare::Absent(k.clone()));
                    ops.push(TxnOp::Put(k, owner.clone().into_bytes()));
                }
            }
        }
        ops.push(TxnOp::Put(key, encode(&tunnel)));
        let rev = self.store.txn(compares, ops).await.map_err(|e| match e {
            store::StoreError::Conflict { key } if key.starts_with("ipsec-spis/") => {
                ApiError::conflict("an inbound SPI was just taken by another tunnel").at("inbound")
            }
            e => e.into(),
        })?;
        Ok((tunnel.at(rev), put))
    }

    pub async fn delete_ipsec_tunnel(&self, tenant: &str, name: &str) -> Result<(), ApiError> {
        let t = self.ipsec_tunnel(tenant, name).await?;
        let mut ops = vec![TxnOp::Delete(format!("ipsec/{tenant}/{name}"))];
        ops.extend(
            t.spec
                .inbound
                .iter()
                .map(|sa| TxnOp::Delete(spi_key(sa.spi))),
        );
        self.store
            .txn(
                vec![Compare::ModRev(
                    format!("ipsec/{tenant}/{name}"),
                    t.revision,
                )],
                ops,
            )
            .await?;
        Ok(())
    }

    // ------------------------------------------------------------------ snapshot

    pub async fn snapshot(&self) -> Result<Snapshot, ApiError> {
        let revision = self.store.revision().await?;
        Ok(Snapshot {
            revision,
            tenants: self.all("tenants/").await?,
            vpcs: self.all("vpcs/").await?,
            nfs: self.all("nfs/").await?,
            chains: self.all("chains/").await?,
            placements: self.all("placements/").await?,
            vpc_clusters: self.all("vpc-clusters/").await?,
            ipsec: self.all("ipsec/").await?,
        })
    }
}

/// The `nfs::NfConfig` JSON an NF instance of tenant `tenant_id` becomes. The API's FW
/// configuration is the tenant's own ACL; the built-in FW is multi-tenant, so the ACL is
/// filed under the tenant's number here (a tenant can never write another's ACL).
pub fn nf_config(
    tenant_id: u32,
    kind: NfKind,
    config: &serde_json::Value,
) -> Result<nfs::NfConfig, ApiError> {
    let obj = config
        .as_object()
        .ok_or_else(|| ApiError::invalid("config", "config must be a JSON object"))?;
    if obj.contains_key("kind") {
        return Err(ApiError::invalid(
            "config",
            "config must not contain \"kind\"; give the kind next to config",
        ));
    }
    let mut full = serde_json::Map::new();
    full.insert("kind".into(), kind.name().into());
    match kind {
        NfKind::Fw => {
            let mut acl = obj.clone();
            let timeouts = acl.remove("timeouts");
            if acl.contains_key("tenant") || acl.contains_key("tenants") {
                return Err(ApiError::invalid(
                    "config",
                    "an fw config is the tenant's own ACL: give \"rules\" and \
                     \"default_action\", not \"tenant\"/\"tenants\"",
                ));
            }
            acl.insert("tenant".into(), tenant_id.into());
            full.insert("tenants".into(), serde_json::Value::Array(vec![acl.into()]));
            full.insert("default_action".into(), "deny".into());
            if let Some(t) = timeouts {
                full.insert("timeouts".into(), t);
            }
        }
        _ => full.extend(obj.clone()),
    }
    serde_json::from_value(serde_json::Value::Object(full))
        .map_err(|e| ApiError::invalid("config", format!("{} configuration: {e}", kind.name())))
}

/// The chain as FM and SC take it.
pub fn chain_def(
    t: &Tenant,
    c: &Chain,
    nfs_in_order: &[NfInstance],
) -> Result<proto::ChainDef, ApiError> {
    let configs = (nfs_in_order.iter())
        .map(|n| nf_config(t.id, n.kind, &n.config))
        .collect::<Result<Vec<_>, _>>()?;
    let nfs = (configs.iter())
        .map(|cfg| serde_json::to_value(cfg).map_err(|e| ApiError::internal(e.to_string())))
        .collect::<Result<Vec<_>, _>>()?;
    // What the chain's NFs need it partitioned by (the SNAT: by inside host).
    let partition = nfs::chain_partition(&configs)
        .map_err(|e| ApiError::invalid("nfs", format!("chain {:?}: {e}", c.name)))?;
    let def = proto::ChainDef {
        tenant: t.id,
        chain: c.id,
        nfs,
        spec: c.spec.clone(),
        forward: c.forward.clone(),
        reverse: c.reverse.clone(),
        partition,
    };
    def.to_proto()
        .map_err(|e| ApiError::invalid("spec", format!("chain {:?}: {e}", c.name)))?;
    Ok(def)
}

/// Every chain of a snapshot as FM takes it; chains whose parts went missing are
/// skipped (the API refuses to create such a state, but another writer might).
pub fn chain_defs(s: &Snapshot) -> Vec<proto::ChainDef> {
    let nfs: HashMap<(&str, &str), &NfInstance> = s
        .nfs
        .iter()
        .map(|n| ((n.tenant.as_str(), n.name.as_str()), n))
        .collect();
    let mut out = Vec::new();
    for c in &s.chains {
        let Some(t) = s.tenant(&c.tenant) else {
            continue;
        };
        let parts: Option<Vec<NfInstance>> = c
            .nfs
            .iter()
            .map(|n| {
                nfs.get(&(c.tenant.as_str(), n.as_str()))
                    .map(|x| (*x).clone())
            })
            .collect();
        let Some(parts) = parts else {
            tracing::warn!(tenant = %c.tenant, chain = %c.name, "chain names a missing NF; not served");
            continue;
        };
        match chain_def(t, c, &parts) {
            Ok(d) => out.push(d),
            Err(e) => {
                tracing::warn!(tenant = %c.tenant, chain = %c.name, error = %e, "chain does not build; not served")
            }
        }
    }
    out
}
