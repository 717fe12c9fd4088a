//! The REST API (axum) and its OpenAPI document (utoipa), served at `/openapi.json`.
//!
//! Conventions, the way Kubernetes-style APIs behave:
//! - `PUT` creates or replaces and is idempotent: the same body twice gives the same
//!   object (201 the first time, 200 after) and no second change.
//! - Lists take `?limit=` (1..=1000, default 100) and `?after=` (the `next` of the
//!   previous page).
//! - Errors are JSON `{"error": {"status", "code", "message", "field"}}`: 400 for a body
//!   or query that does not parse, 422 for content that is not acceptable, 404 for an
//!   unknown object, 409 for a conflict (a VNI in use, an object still referenced), 401
//!   without a valid token, 403 for a tenant token reaching outside its tenant.

use crate::pki::{Issued, JoinRequest, JoinToken, JoinTokenRequest, RenewRequest, Revoked};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use proto::v1;
use serde::de::DeserializeOwned;
use utoipa::OpenApi;

use crate::auth::{authenticate, Principal};
use crate::control::Shared;
use crate::desired::privatelink::{
    EndpointProtocol, EndpointService, EndpointServiceSpec, PrivateLinkEndpoint,
    PrivateLinkEndpointSpec, ServiceRef,
};
use crate::desired::{Paging, Put};
use crate::error::ApiError;
use crate::model::*;

type AppState = Arc<Shared>;

/// A JSON body whose rejection is an [`ApiError`] naming what is wrong.
pub struct Body<T>(pub T);

#[axum::async_trait]
impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(Body(v)),
            Err(JsonRejection::JsonDataError(e)) => {
                // The inner serde error carries the field path and the expectation.
                let detail = std::error::Error::source(&e)
                    .map(|s| s.to_string())
                    .unwrap_or_else(|| e.body_text());
                Err(ApiError::invalid_json(format!(
                    "invalid request body: {detail}"
                )))
            }
            Err(JsonRejection::JsonSyntaxError(e)) => {
                let detail = std::error::Error::source(&e)
                    .map(|s| s.to_string())
                    .unwrap_or_else(|| e.body_text());
                Err(ApiError::invalid_json(format!(
                    "request body is not JSON: {detail}"
                )))
            }
            Err(JsonRejection::MissingJsonContentType(_)) => Err(ApiError::invalid_json(
                "send the body as JSON with Content-Type: application/json",
            )),
            Err(e) => Err(ApiError::invalid_json(e.body_text())),
        }
    }
}

#[axum::async_trait]
impl FromRequestParts<AppState> for Principal {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, st: &AppState) -> Result<Self, ApiError> {
        let header = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .ok_or_else(|| {
                ApiError::unauthorized(
                    "missing token: send Authorization: Bearer <token> \
                     (`starfabric up` writes the admin token to the CLI's config)",
                )
            })?;
        let token = header
            .to_str()
            .ok()
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| ApiError::unauthorized("Authorization must be `Bearer <token>`"))?;
        authenticate(token, &st.cfg.admin_token, &st.desired)
            .await?
            .ok_or_else(|| ApiError::unauthorized("unknown or revoked token"))
    }
}

/// Query parameters, parsed by hand so that a bad one gets a message naming it.
struct Params(HashMap<String, String>);

impl Params {
    fn only(self, allowed: &[&str]) -> Result<Self, ApiError> {
        for k in self.0.keys() {
            if !allowed.contains(&k.as_str()) {
                return Err(ApiError::bad_query(
                    k,
                    format!(
                        "unknown query parameter {k:?} (allowed: {})",
                        if allowed.is_empty() {
                            "none".to_string()
                        } else {
                            allowed.join(", ")
                        }
                    ),
                ));
            }
        }
        Ok(self)
    }

    /// Query parameter `name`, a count from 1 to 1000; `default` when absent.
    fn count(&self, name: &str, default: usize) -> Result<usize, ApiError> {
        match self.0.get(name) {
            None => Ok(default),
            Some(s) => match s.parse::<usize>() {
                Ok(n) if (1..=1000).contains(&n) => Ok(n),
                _ => Err(ApiError::bad_query(
                    name,
                    format!("{name} must be a number from 1 to 1000, got {s:?}"),
                )),
            },
        }
    }

    fn paging(&self) -> Result<Paging<'_>, ApiError> {
        let limit = self.count("limit", 100)?;
        Ok(Paging {
            after: self.0.get("after").map(String::as_str),
            limit,
        })
    }

    fn flag(&self, name: &str) -> Result<bool, ApiError> {
        match self.0.get(name).map(String::as_str) {
            None | Some("false") | Some("0") => Ok(false),
            Some("true") | Some("1") | Some("") => Ok(true),
            Some(v) => Err(ApiError::bad_query(
                name,
                format!("{name} must be true or false, got {v:?}"),
            )),
        }
    }
}

#[axum::async_trait]
impl<S: Send + Sync> FromRequestParts<S> for Params {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Query(q) = Query::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::bad_query("", e.body_text()))?;
        Ok(Params(q))
    }
}

fn put_response<T: serde::Serialize>(v: T, put: Put) -> Response {
    let status = if put == Put::Created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    (status, Json(v)).into_response()
}

// ---------------------------------------------------------------------- tenants

#[utoipa::path(get, path = "/v1/tenants", tag = "tenants",
    params(("limit" = Option<u32>, Query, description = "1..=1000, default 100"),
           ("after" = Option<String>, Query, description = "`next` of the previous page")),
    responses((status = 200, body = Page<Tenant>), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody)))]
async fn list_tenants(
    State(st): State<AppState>,
    p: Principal,
    q: Params,
) -> Result<Json<Page<Tenant>>, ApiError> {
    let q = q.only(&["limit", "after"])?;
    let paging = q.paging()?;
    match p.tenant() {
        None => Ok(Json(st.desired.tenants(paging).await?)),
        // A tenant token sees exactly its own tenant.
        Some(t) => {
            let own = st.desired.tenant(t).await?;
            let items = if paging.after.is_none_or(|a| a < t) {
                vec![own]
            } else {
                vec![]
            };
            Ok(Json(Page { items, next: None }))
        }
    }
}

#[utoipa::path(get, path = "/v1/tenants/{tenant}", tag = "tenants",
    params(("tenant" = String, Path)),
    responses((status = 200, body = Tenant), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn get_tenant(
    State(st): State<AppState>,
    p: Principal,
    Path(tenant): Path<String>,
) -> Result<Json<Tenant>, ApiError> {
    p.check_tenant(&tenant)?;
    Ok(Json(st.desired.tenant(&tenant).await?))
}

#[utoipa::path(put, path = "/v1/tenants/{tenant}", tag = "tenants",
    params(("tenant" = String, Path, description = "DNS label")),
    request_body = TenantSpec,
    responses((status = 201, body = Tenant, description = "created"), (status = 200, body = Tenant, description = "updated or unchanged"),
              (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn put_tenant(
    State(st): State<AppState>,
    p: Principal,
    Path(tenant): Path<String>,
    Body(spec): Body<TenantSpec>,
) -> Result<Response, ApiError> {
    p.require_admin("creating or changing a tenant")?;
    let (t, put) = st
        .desired
        .put_tenant(&tenant, spec, &st.pp_clusters())
        .await?;
    if put != Put::Unchanged {
        tracing::info!(tenant = %t.name, id = t.id, pp_cluster = %t.pp_cluster, ?put, "tenant written");
        st.bump();
    }
    Ok(put_response(t, put))
}

#[utoipa::path(post, path = "/v1/apply", tag = "tenants",
    request_body = ApplyRequest,
    responses((status = 200, body = ApplyResult, description = "every item written, in one store transaction"),
              (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody), (status = 422, body = ErrorBody, description = "an item was refused (`field` says which, as `items[i]...`); nothing was written")))]
async fn apply(
    State(st): State<AppState>,
    p: Principal,
    Body(req): Body<ApplyRequest>,
) -> Result<Json<ApplyResult>, ApiError> {
    // Every item's permission before anything is read.
    for (i, item) in req.items.iter().enumerate() {
        match item {
            ApplyItem::Tenant { .. } => p.require_admin("creating or changing a tenant"),
            ApplyItem::Vpc { tenant, .. }
            | ApplyItem::Nf { tenant, .. }
            | ApplyItem::Chain { tenant, .. } => p.check_tenant(tenant),
        }
        .map_err(|e| e.within(&format!("items[{i}]"), &item.path()))?;
    }
    let r = st.desired.apply(&req.items, &st.pp_clusters()).await?;
    if r.items.iter().any(|i| i.result != "unchanged") {
        tracing::info!(
            revision = r.revision,
            items = r.items.len(),
            "objects applied"
        );
        st.bump();
    }
    Ok(Json(r))
}

#[utoipa::path(get, path = "/v1/tenants/{tenant}/rates", tag = "tenants",
    params(("tenant" = String, Path)),
    responses((status = 200, body = TenantRatesView), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn get_tenant_rates(
    State(st): State<AppState>,
    p: Principal,
    Path(tenant): Path<String>,
) -> Result<Json<TenantRatesView>, ApiError> {
    p.check_tenant(&tenant)?;
    let t = st.desired.tenant(&tenant).await?;
    Ok(Json(rates_view(&st, t)))
}

fn rates_view(st: &Shared, t: Tenant) -> TenantRatesView {
    TenantRatesView {
        status: rate_status(st, t.id),
        tenant: t.name,
        id: t.id,
        rates: t.rates.unwrap_or_default(),
    }
}

/// Each PP node's rate state for tenant `id`, from the nodes' latest reports.
fn rate_status(st: &Shared, id: u32) -> Vec<RateStatus> {
    let mut out = Vec::new();
    for n in st.node_list() {
        let Some(r) = &n.report else { continue };
        out.extend(
            r.rates
                .iter()
                .filter(|s| s.tenant == id)
                .map(|s| RateStatus {
                    node: n.info().id,
                    kind: s.kind.clone(),
                    state: s.state.clone(),
                    credit: s.credit,
                    allowance: s.allowance,
                    offered_rate: s.offered_rate,
                    admitted_rate: s.admitted_rate,
                    refused: s.refused,
                }),
        );
    }
    out.sort_by(|a, b| (&a.node, &a.kind).cmp(&(&b.node, &b.kind)));
    out
}

#[utoipa::path(put, path = "/v1/tenants/{tenant}/rates", tag = "tenants",
    params(("tenant" = String, Path)),
    request_body = TenantRatesSpec,
    responses((status = 200, body = TenantRatesView, description = "set or unchanged"),
              (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn put_tenant_rates(
    State(st): State<AppState>,
    p: Principal,
    Path(tenant): Path<String>,
    Body(spec): Body<TenantRatesSpec>,
) -> Result<Json<TenantRatesView>, ApiError> {
    p.require_admin("setting a tenant's rates")?;
    let (t, put) = st.desired.set_tenant_rates(&tenant, Some(spec)).await?;
    if put != Put::Unchanged {
        tracing::info!(tenant = %t.name, rates = ?t.rates, "tenant rates written");
        st.bump();
    }
    Ok(Json(rates_view(&st, t)))
}

#[utoipa::path(delete, path = "/v1/tenants/{tenant}/rates", tag = "tenants",
    params(("tenant" = String, Path)),
    responses((status = 204), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn delete_tenant_rates(
    State(st): State<AppState>,
    p: Principal,
    Path(tenant): Path<String>,
) -> Result<StatusCode, ApiError> {
    p.require_admin("clearing a tenant's rates")?;
    let (_, put) = st.desired.set_tenant_rates(&tenant, None).await?;
    if put != Put::Unchanged {
        st.bump();
    }
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(delete, path = "/v1/tenants/{tenant}", tag = "tenants",
    params(("tenant" = String, Path), ("cascade" = Option<bool>, Query, description = "also delete its VPCs, NFs, chains and tokens")),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
async fn delete_tenant(
    State(st): State<AppState>,
    p: Principal,
    Path(tenant): Path<String>,
    q: Params,
) -> Result<StatusCode, ApiError> {
    p.require_admin("deleting a tenant")?;
    let q = q.only(&["cascade"])?;
    st.desired
        .delete_tenant(&tenant, q.flag("cascade")?)
        .await?;
    tracing::info!(%tenant, "tenant deleted");
    st.bump();
    Ok(StatusCode::NO_CONTENT)
}

// ---------------------------------------------------------------------- VPCs, NFs, chains

macro_rules! tenant_object_api {
    ($what:literal, $path_list:literal, $path_one:literal, $ty:ty, $spec:ty,
     $list:ident, $get:ident, $put:ident, $delete:ident,
     $dlist:ident, $dget:ident, $dput:ident, $ddelete:ident) => {
        #[utoipa::path(get, path = $path_list, tag = $what,
            params(("tenant" = String, Path),
                   ("limit" = Option<u32>, Query, description = "1..=1000, default 100"),
                   ("after" = Option<String>, Query)),
            responses((status = 200, body = Page<$ty>), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
        async fn $list(
            State(st): State<AppState>,
            p: Principal,
            Path(tenant): Path<String>,
            q: Params,
        ) -> Result<Json<Page<$ty>>, ApiError> {
            p.check_tenant(&tenant)?;
            let q = q.only(&["limit", "after"])?;
            Ok(Json(st.desired.$dlist(&tenant, q.paging()?).await?))
        }

        #[utoipa::path(get, path = $path_one, tag = $what,
            params(("tenant" = String, Path), ("name" = String, Path)),
            responses((status = 200, body = $ty), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
        async fn $get(
            State(st): State<AppState>,
            p: Principal,
            Path((tenant, name)): Path<(String, String)>,
        ) -> Result<Json<$ty>, ApiError> {
            p.check_tenant(&tenant)?;
            Ok(Json(st.desired.$dget(&tenant, &name).await?))
        }

        #[utoipa::path(put, path = $path_one, tag = $what,
            params(("tenant" = String, Path), ("name" = String, Path, description = "DNS label")),
            request_body = $spec,
            responses((status = 201, body = $ty, description = "created"), (status = 200, body = $ty, description = "updated or unchanged"),
                      (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
                      (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
        async fn $put(
            State(st): State<AppState>,
            p: Principal,
            Path((tenant, name)): Path<(String, String)>,
            Body(spec): Body<$spec>,
        ) -> Result<Response, ApiError> {
            p.check_tenant(&tenant)?;
            let (v, put) = st.desired.$dput(&tenant, &name, spec).await?;
            if put != Put::Unchanged {
                tracing::info!(%tenant, %name, kind = $what, ?put, "object written");
                st.bump();
            }
            Ok(put_response(v, put))
        }

        #[utoipa::path(delete, path = $path_one, tag = $what,
            params(("tenant" = String, Path), ("name" = String, Path)),
            responses((status = 204), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
        async fn $delete(
            State(st): State<AppState>,
            p: Principal,
            Path((tenant, name)): Path<(String, String)>,
        ) -> Result<StatusCode, ApiError> {
            p.check_tenant(&tenant)?;
            st.desired.$ddelete(&tenant, &name).await?;
            tracing::info!(%tenant, %name, kind = $what, "object deleted");
            st.bump();
            Ok(StatusCode::NO_CONTENT)
        }
    };
}

tenant_object_api!(
    "vpcs",
    "/v1/tenants/{tenant}/vpcs",
    "/v1/tenants/{tenant}/vpcs/{name}",
    Vpc,
    VpcSpec,
    list_vpcs,
    get_vpc,
    put_vpc,
    delete_vpc,
    vpcs,
    vpc,
    put_vpc,
    delete_vpc
);
tenant_object_api!(
    "nfs",
    "/v1/tenants/{tenant}/nfs",
    "/v1/tenants/{tenant}/nfs/{name}",
    NfInstance,
    NfSpec,
    list_nfs,
    get_nf,
    put_nf,
    delete_nf,
    nfs,
    nf,
    put_nf,
    delete_nf
);
tenant_object_api!(
    "chains",
    "/v1/tenants/{tenant}/chains",
    "/v1/tenants/{tenant}/chains/{name}",
    Chain,
    ChainSpec,
    list_chains,
    get_chain,
    put_chain,
    delete_chain,
    chains,
    chain,
    put_chain,
    delete_chain
);
tenant_object_api!(
    "privatelink",
    "/v1/tenants/{tenant}/endpoint-services",
    "/v1/tenants/{tenant}/endpoint-services/{name}",
    EndpointService,
    EndpointServiceSpec,
    list_endpoint_services,
    get_endpoint_service,
    put_endpoint_service,
    delete_endpoint_service,
    endpoint_services,
    endpoint_service,
    put_endpoint_service,
    delete_endpoint_service
);
tenant_object_api!(
    "privatelink",
    "/v1/tenants/{tenant}/privatelink-endpoints",
    "/v1/tenants/{tenant}/privatelink-endpoints/{name}",
    PrivateLinkEndpoint,
    PrivateLinkEndpointSpec,
    list_privatelink_endpoints,
    get_privatelink_endpoint,
    put_privatelink_endpoint,
    delete_privatelink_endpoint,
    privatelink_endpoints,
    privatelink_endpoint,
    put_privatelink_endpoint,
    delete_privatelink_endpoint
);

// ---------------------------------------------------------------------- IPsec tunnels

/// What reads show of a tunnel: no key, and each PP node's counters.
fn ipsec_view(st: &Shared, t: IpsecTunnel) -> IpsecTunnelView {
    let bits = |sa: &IpsecSaSpec| IpsecSaView {
        spi: sa.spi,
        key_bits: crate::desired::keymat(&sa.key)
            .map(|k| ((k.len() - 4) * 8) as u16)
            .unwrap_or(0),
    };
    let full = format!("{}/{}", t.tenant, t.name);
    let mut status = Vec::new();
    for n in st.node_list() {
        let Some(r) = &n.report else { continue };
        for x in r.ipsec.iter().filter(|x| x.name == full) {
            status.push(IpsecNodeStatus {
                node: n.info().id,
                outbound_spi: x.outbound_spi,
                outbound_seq: x.outbound_seq,
                outbound_packets: x.outbound_packets,
                outbound_bytes: x.outbound_bytes,
                inbound: x
                    .inbound
                    .iter()
                    .map(|i| IpsecSaStatus {
                        spi: i.spi,
                        packets: i.packets,
                        bytes: i.bytes,
                        retiring: i.retiring,
                    })
                    .collect(),
                drops: x.drops,
            });
        }
    }
    status.sort_by(|a, b| a.node.cmp(&b.node));
    let s = t.spec;
    IpsecTunnelView {
        tenant: t.tenant,
        name: t.name,
        vni: s.vni,
        peer: s.peer,
        local_prefixes: s.local_prefixes,
        remote_prefixes: s.remote_prefixes,
        vtep: s.vtep,
        vm_mac: s.vm_mac,
        outbound: bits(&s.outbound),
        inbound: s.inbound.iter().map(bits).collect(),
        esn: s.esn,
        replay_window: s.replay_window,
        status,
        revision: t.revision,
    }
}

#[utoipa::path(get, path = "/v1/tenants/{tenant}/ipsec", tag = "ipsec",
    params(("tenant" = String, Path),
           ("limit" = Option<u32>, Query, description = "1..=1000, default 100"),
           ("after" = Option<String>, Query)),
    responses((status = 200, body = Page<IpsecTunnelView>), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn list_ipsec(
    State(st): State<AppState>,
    p: Principal,
    Path(tenant): Path<String>,
    q: Params,
) -> Result<Json<Page<IpsecTunnelView>>, ApiError> {
    p.check_tenant(&tenant)?;
    let q = q.only(&["limit", "after"])?;
    let page = st.desired.ipsec_tunnels(&tenant, q.paging()?).await?;
    Ok(Json(Page {
        items: page.items.into_iter().map(|t| ipsec_view(&st, t)).collect(),
        next: page.next,
    }))
}

#[utoipa::path(get, path = "/v1/tenants/{tenant}/ipsec/{name}", tag = "ipsec",
    params(("tenant" = String, Path), ("name" = String, Path)),
    responses((status = 200, body = IpsecTunnelView), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn get_ipsec(
    State(st): State<AppState>,
    p: Principal,
    Path((tenant, name)): Path<(String, String)>,
) -> Result<Json<IpsecTunnelView>, ApiError> {
    p.check_tenant(&tenant)?;
    let t = st.desired.ipsec_tunnel(&tenant, &name).await?;
    Ok(Json(ipsec_view(&st, t)))
}

#[utoipa::path(put, path = "/v1/tenants/{tenant}/ipsec/{name}", tag = "ipsec",
    params(("tenant" = String, Path), ("name" = String, Path, description = "DNS label")),
    request_body = IpsecTunnelSpec,
    responses((status = 201, body = IpsecTunnelView, description = "created"), (status = 200, body = IpsecTunnelView, description = "updated (a rekey) or unchanged"),
              (status = 400, body = ErrorBody), (status = 403, body = ErrorBody, description = "the VNI is not one of the tenant's VPCs"),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody, description = "an inbound SPI is another tunnel's"),
              (status = 422, body = ErrorBody)))]
async fn put_ipsec(
    State(st): State<AppState>,
    p: Principal,
    Path((tenant, name)): Path<(String, String)>,
    Body(spec): Body<IpsecTunnelSpec>,
) -> Result<Response, ApiError> {
    p.check_tenant(&tenant)?;
    let (t, put) = st.desired.put_ipsec_tunnel(&tenant, &name, spec).await?;
    if put != Put::Unchanged {
        tracing::info!(%tenant, %name, outbound_spi = t.spec.outbound.spi, ?put, "IPsec tunnel written");
        st.bump();
    }
    Ok(put_response(ipsec_view(&st, t), put))
}

#[utoipa::path(delete, path = "/v1/tenants/{tenant}/ipsec/{name}", tag = "ipsec",
    params(("tenant" = String, Path), ("name" = String, Path)),
    responses((status = 204), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn delete_ipsec(
    State(st): State<AppState>,
    p: Principal,
    Path((tenant, name)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    p.check_tenant(&tenant)?;
    st.desired.delete_ipsec_tunnel(&tenant, &name).await?;
    tracing::info!(%tenant, %name, "IPsec tunnel deleted");
    st.bump();
    Ok(StatusCode::NO_CONTENT)
}

// ---------------------------------------------------------------------- tokens

#[utoipa::path(post, path = "/v1/tenants/{tenant}/tokens", tag = "tokens",
    params(("tenant" = String, Path)),
    responses((status = 201, body = Token, description = "the token is shown only here"), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn create_token(
    State(st): State<AppState>,
    p: Principal,
    Path(tenant): Path<String>,
) -> Result<Response, ApiError> {
    p.check_tenant(&tenant)?;
    let t = st.desired.create_token(&tenant).await?;
    tracing::info!(%tenant, id = %t.id, "tenant token created");
    Ok((StatusCode::CREATED, Json(t)).into_response())
}

#[utoipa::path(get, path = "/v1/tenants/{tenant}/tokens", tag = "tokens",
    params(("tenant" = String, Path)),
    responses((status = 200, body = Vec<Token>), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn list_tokens(
    State(st): State<AppState>,
    p: Principal,
    Path(tenant): Path<String>,
) -> Result<Json<Vec<Token>>, ApiError> {
    p.check_tenant(&tenant)?;
    Ok(Json(st.desired.tokens(&tenant).await?))
}

#[utoipa::path(delete, path = "/v1/tenants/{tenant}/tokens/{id}", tag = "tokens",
    params(("tenant" = String, Path), ("id" = String, Path)),
    responses((status = 204), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn delete_token(
    State(st): State<AppState>,
    p: Principal,
    Path((tenant, id)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    p.check_tenant(&tenant)?;
    st.desired.delete_token(&tenant, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

// ---------------------------------------------------------------------- placement

#[utoipa::path(get, path = "/v1/placement", tag = "placement",
    responses((status = 200, body = PlacementView), (status = 403, body = ErrorBody)))]
async fn get_placement(
    State(st): State<AppState>,
    p: Principal,
) -> Result<Json<PlacementView>, ApiError> {
    p.require_admin("reading the placement")?;
    let engine = st.placement.lock().await;
    Ok(Json(engine.view(&st).await?))
}

#[utoipa::path(put, path = "/v1/placement/limits", tag = "placement",
    request_body = PlacementLimits,
    responses((status = 200, body = PlacementView, description = "applied; tenants whose sets broke them were placed anew"),
              (status = 409, body = ErrorBody, description = "no placement satisfies them: nothing changed"),
              (status = 422, body = ErrorBody, description = "a field is out of range")))]
async fn put_placement_limits(
    State(st): State<AppState>,
    p: Principal,
    Body(limits): Body<PlacementLimits>,
) -> Result<Json<PlacementView>, ApiError> {
    p.require_admin("changing placement limits")?;
    let mut engine = st.placement.lock().await;
    Ok(Json(engine.set_limits(&st, limits).await?))
}

// ---------------------------------------------------------------------- observed state

#[utoipa::path(get, path = "/v1/nodes", tag = "nodes",
    responses((status = 200, body = Vec<Node>), (status = 403, body = ErrorBody)))]
async fn list_nodes(State(st): State<AppState>, p: Principal) -> Result<Json<Vec<Node>>, ApiError> {
    p.require_admin("listing nodes")?;
    let now = Instant::now();
    Ok(Json(st.node_list().iter().map(|n| n.to_api(now)).collect()))
}

#[utoipa::path(get, path = "/v1/nodes/{id}", tag = "nodes",
    params(("id" = String, Path)),
    responses((status = 200, body = Node), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn get_node(
    State(st): State<AppState>,
    p: Principal,
    Path(id): Path<String>,
) -> Result<Json<Node>, ApiError> {
    p.require_admin("reading a node")?;
    st.node_list()
        .iter()
        .find(|n| n.info().id == id)
        .map(|n| Json(n.to_api(Instant::now())))
        .ok_or_else(|| ApiError::not_found(format!("node {id:?} has never registered")))
}

#[utoipa::path(get, path = "/v1/partitions", tag = "nodes",
    responses((status = 200, body = Vec<Partition>)))]
async fn list_partitions(
    State(st): State<AppState>,
    p: Principal,
) -> Result<Json<Vec<Partition>>, ApiError> {
    Ok(Json(partitions(&st, &p).await?))
}

/// The partitions FMs report, those of tenants `p` may see.
pub(crate) async fn partitions(st: &Shared, p: &Principal) -> Result<Vec<Partition>, ApiError> {
    let snap = st.snapshot().await?;
    let mut out = Vec::new();
    for n in st.node_list() {
        if !n.up || n.role() != v1::Role::Fm {
            continue;
        }
        let Some(map) = n.report.as_ref().and_then(|r| r.partitions.as_ref()) else {
            continue;
        };
        for part in &map.partitions {
            let Some(t) = snap.tenant_by_id(part.tenant) else {
                continue;
            };
            if p.check_tenant(&t.name).is_err() {
                continue;
            }
            let chain = snap
                .chains
                .iter()
                .find(|c| c.tenant == t.name && c.id == part.chain)
                .map_or_else(|| format!("#{}", part.chain), |c| c.name.clone());
            let g = map.groups.iter().find(|g| g.id == part.group);
            out.push(Partition {
                tenant: t.name.clone(),
                chain,
                hash_lo: format!("{:016x}", part.hash_lo),
                hash_hi: format!("{:016x}", part.hash_hi),
                group: part.group,
                epoch: g.map_or(0, |g| g.epoch),
                replicas: g
                    .map(|g| g.replicas.iter().map(|r| r.node_id.clone()).collect())
                    .unwrap_or_default(),
                fm: n.info().id,
            });
        }
    }
    Ok(out)
}

pub(crate) fn tenant_stats(
    st: &Shared,
    snap: &crate::desired::Snapshot,
    tenant: &Tenant,
) -> TenantStats {
    let mut s = TenantStats {
        tenant: tenant.name.clone(),
        id: tenant.id,
        ..Default::default()
    };
    for n in st.node_list() {
        let Some(r) = &n.report else { continue };
        let Some(c) = r.tenants.iter().find(|c| c.tenant == tenant.id) else {
            continue;
        };
        s.nodes += 1;
        match n.role() {
            v1::Role::Pp => {
                s.packets += c.packets;
                s.bytes += c.bytes;
                s.drops += c.drops;
                s.flows_set_up += c.flows;
            }
            v1::Role::Fm => s.rule_requests += c.flows,
            v1::Role::Sc => s.requests_applied += c.flows,
            _ => {}
        }
    }
    let _ = snap;
    s.rates = rate_status(st, tenant.id);
    s
}

#[utoipa::path(get, path = "/v1/tenants/{tenant}/stats", tag = "stats",
    params(("tenant" = String, Path)),
    responses((status = 200, body = TenantStats), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn get_tenant_stats(
    State(st): State<AppState>,
    p: Principal,
    Path(tenant): Path<String>,
) -> Result<Json<TenantStats>, ApiError> {
    p.check_tenant(&tenant)?;
    let t = st.desired.tenant(&tenant).await?;
    let snap = st.snapshot().await?;
    Ok(Json(tenant_stats(&st, &snap, &t)))
}

#[utoipa::path(get, path = "/v1/stats", tag = "stats",
    responses((status = 200, body = Vec<TenantStats>, description = "every tenant the token can see")))]
async fn list_stats(
    State(st): State<AppState>,
    p: Principal,
) -> Result<Json<Vec<TenantStats>>, ApiError> {
    let snap = st.desired.snapshot().await?;
    Ok(Json(
        snap.tenants
            .iter()
            .filter(|t| p.check_tenant(&t.name).is_ok())
            .map(|t| tenant_stats(&st, &snap, t))
            .collect(),
    ))
}

#[utoipa::path(get, path = "/v1/tenants/{tenant}/monitor", tag = "stats",
    params(("tenant" = String, Path), ("top" = Option<u32>, Query, description = "hosts shown, by bytes: 1..=1000, default 10")),
    responses((status = 200, body = TenantMonitor), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn get_tenant_monitor(
    State(st): State<AppState>,
    p: Principal,
    Path(tenant): Path<String>,
    q: Params,
) -> Result<Json<TenantMonitor>, ApiError> {
    p.check_tenant(&tenant)?;
    let q = q.only(&["top"])?;
    let top = q.count("top", 10)?;
    let t = st.desired.tenant(&tenant).await?;
    let fms = st.fm_addrs();
    if fms.is_empty() {
        return Err(ApiError::unavailable("no fabric master is up"));
    }
    let mut sum = nf::TrafficReport::default();
    let mut out = TenantMonitor {
        tenant: t.name.clone(),
        id: t.id,
        ..Default::default()
    };
    for addr in fms {
        let reply = async {
            let mut c = st.fm_client(&addr).await?;
            c.traffic(v1::TrafficRequest { tenant: t.id })
                .await
                .map(|r| r.into_inner())
                .map_err(|e| e.message().to_string())
        };
        let reply = tokio::time::timeout(std::time::Duration::from_secs(10), reply)
            .await
            .map_err(|_| ApiError::unavailable(format!("fabric master {addr} did not answer")))?
            .map_err(|e| ApiError::unavailable(format!("fabric master {addr}: {e}")))?;
        out.groups += reply.groups;
        out.groups_read += reply.groups_read;
        out.errors.extend(reply.errors);
        if let Some(r) = &reply.report {
            let r = proto::traffic_from(r)
                .map_err(|e| ApiError::unavailable(format!("fabric master {addr}: {e}")))?;
            sum.add(&r);
        }
    }
    let count = |c: &nf::TrafficCount| TrafficCount {
        packets: c.packets,
        bytes: c.bytes,
        flows: c.flows,
    };
    // FM answers for this tenant only; the filter keeps it so whatever FM does.
    if let Some((_, c)) = sum.tenants.iter().find(|(id, _)| *id == t.id) {
        out.total = count(c);
    }
    let mut hosts: Vec<_> = sum.hosts.iter().filter(|(id, _, _)| *id == t.id).collect();
    out.hosts_total = hosts.len() as u64;
    hosts.sort_by(|a, b| b.2.bytes.cmp(&a.2.bytes).then(a.1.cmp(&b.1)));
    out.hosts = hosts
        .into_iter()
        .take(top)
        .map(|(_, h, c)| HostTraffic {
            host: h.to_string(),
            packets: c.packets,
            bytes: c.bytes,
            flows: c.flows,
        })
        .collect();
    out.overflow = count(&sum.overflow);
    Ok(Json(out))
}

#[utoipa::path(get, path = "/v1/tenants/{tenant}/flows", tag = "stats",
    params(("tenant" = String, Path), ("limit" = Option<u32>, Query, description = "1..=1000, default 100")),
    responses((status = 200, body = Page<Flow>), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn list_flows(
    State(st): State<AppState>,
    p: Principal,
    Path(tenant): Path<String>,
    q: Params,
) -> Result<Json<Page<Flow>>, ApiError> {
    p.check_tenant(&tenant)?;
    let q = q.only(&["limit"])?;
    let limit = q.paging()?.limit;
    let t = st.desired.tenant(&tenant).await?;
    let snap = st.snapshot().await?;
    let fms = st.fm_addrs();
    if fms.is_empty() {
        return Err(ApiError::unavailable("no fabric master is up"));
    }
    let mut items = Vec::new();
    let mut matched = 0;
    for addr in fms {
        let reply = async {
            let mut c = st.fm_client(&addr).await?;
            c.flows(v1::FlowsRequest {
                tenant: t.id,
                all_tenants: false,
                limit: limit as u32,
            })
            .await
            .map(|r| r.into_inner())
            .map_err(|e| e.to_string())
        };
        let reply = tokio::time::timeout(std::time::Duration::from_secs(5), reply)
            .await
            .map_err(|_| ApiError::unavailable(format!("fabric master {addr} did not answer")))?
            .map_err(|e| ApiError::unavailable(format!("fabric master {addr}: {e}")))?;
        matched += reply.matched;
        for f in reply.flows {
            let chain = snap
                .chains
                .iter()
                .find(|c| c.tenant == t.name && c.id == f.chain)
                .map_or_else(|| format!("#{}", f.chain), |c| c.name.clone());
            let show = |r: &v1::Rule| -> Option<(String, String)> {
                let rule = pipeline::Rule::try_from(r).ok()?;
                Some((
                    rule.key.to_string(),
                    pipeline::format_actions(&rule.actions),
                ))
            };
            let Some((key, actions)) = f.rule.as_ref().and_then(show) else {
                continue;
            };
            let rev = f.also.first().and_then(show);
            items.push(Flow {
                chain,
                key,
                actions,
                reverse_key: rev.as_ref().map(|r| r.0.clone()),
                reverse_actions: rev.map(|r| r.1),
                expires_in_ms: f.expires_in_ms,
            });
        }
    }
    items.sort_by(|a, b| a.key.cmp(&b.key));
    items.truncate(limit);
    let next = (matched as usize > items.len())
        .then(|| format!("{} more", matched as usize - items.len()));
    Ok(Json(Page { items, next }))
}

#[utoipa::path(get, path = "/v1/status", tag = "nodes",
    responses((status = 200, body = Status)))]
async fn status(State(st): State<AppState>, p: Principal) -> Result<Json<Status>, ApiError> {
    let snap = st.desired.snapshot().await?;
    let now = Instant::now();
    let nodes: Vec<Node> = st.node_list().iter().map(|n| n.to_api(now)).collect();
    let up = nodes.iter().filter(|n| n.status == "up").count() as u64;
    let healthy = !nodes.is_empty() && nodes.iter().all(|n| n.status == "up" && n.ready);
    let visible = |t: &str| p.check_tenant(t).is_ok();
    Ok(Json(Status {
        orchestrator: st.cfg.id.clone(),
        version: env!("CARGO_PKG_VERSION").into(),
        store: st.desired.store().backend().into(),
        store_revision: snap.revision,
        tenants: snap.tenants.iter().filter(|t| visible(&t.name)).count() as u64,
        chains: snap.chains.iter().filter(|c| visible(&c.tenant)).count() as u64,
        nodes_up: up,
        nodes_down: nodes.len() as u64 - up,
        healthy,
        // Node details are the operator's; a tenant sees only the summary.
        nodes: if p.tenant().is_none() {
            nodes
        } else {
            Vec::new()
        },
    }))
}

#[utoipa::path(get, path = "/v1/events", tag = "nodes",
    params(("limit" = Option<u32>, Query, description = "1..=1000, default 100")),
    responses((status = 200, body = EventsView, description = "newest first: the orchestrator's placement decisions and every FM's event log (scales, nodes, vIPs, the autoscaler); a tenant token sees only the events about its tenant")))]
async fn list_events(
    State(st): State<AppState>,
    p: Principal,
    q: Params,
) -> Result<Json<EventsView>, ApiError> {
    let q = q.only(&["limit"])?;
    let limit = q.paging()?.limit;
    Ok(Json(crate::events::collect(&st, &p, limit).await))
}

// ---------------------------------------------------------------------- plane security

fn pki(st: &Shared) -> Result<&crate::pki::Pki, ApiError> {
    st.cfg.pki.as_deref().ok_or_else(|| {
        ApiError::unavailable("the planes run --insecure: no CA, no join tokens, no certificates")
    })
}

#[utoipa::path(post, path = "/v1/nodes/tokens", tag = "security", request_body = JoinTokenRequest,
    responses((status = 201, body = JoinToken), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 422, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn create_join_token(
    State(st): State<AppState>,
    p: Principal,
    Body(req): Body<JoinTokenRequest>,
) -> Result<Response, ApiError> {
    p.require_admin("creating a node join token")?;
    let ttl = std::time::Duration::from_secs(req.ttl_s.unwrap_or(600));
    let t = pki(&st)?.create_token(&req.role, ttl).await?;
    Ok((StatusCode::CREATED, Json(t)).into_response())
}

#[utoipa::path(post, path = "/v1/nodes/join", tag = "security", request_body = JoinRequest,
    security(()),
    responses((status = 200, body = Issued), (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn join_node(
    State(st): State<AppState>,
    Body(req): Body<JoinRequest>,
) -> Result<Json<Issued>, ApiError> {
    Ok(Json(pki(&st)?.join(&req.token, &req.id, &req.csr).await?))
}

#[utoipa::path(post, path = "/v1/nodes/renew", tag = "security", request_body = RenewRequest,
    security(()),
    responses((status = 200, body = Issued), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)))]
async fn renew_node(
    State(st): State<AppState>,
    Body(req): Body<RenewRequest>,
) -> Result<Json<Issued>, ApiError> {
    Ok(Json(pki(&st)?.renew(&req.cert, &req.csr).await?))
}

#[utoipa::path(post, path = "/v1/nodes/{id}/revoke", tag = "security",
    params(("id" = String, Path)),
    responses((status = 200, body = Revoked), (status = 403, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn revoke_node(
    State(st): State<AppState>,
    p: Principal,
    Path(id): Path<String>,
) -> Result<Json<Revoked>, ApiError> {
    p.require_admin("revoking a node")?;
    st.revoke(&id).await?;
    Ok(Json(Revoked { revoked: id }))
}

async fn healthz() -> &'static str {
    "ok"
}

#[derive(OpenApi)]
#[openapi(
    info(title = "starfabric orchestrator API", version = "1",
         description = "Tenants, VPCs, NF instances and chains (desired state), and the nodes, partitions, flows and counters that serve them. Authenticate with `Authorization: Bearer <token>`: the admin token, or a tenant token confined to its tenant."),
    paths(apply, list_tenants, get_tenant, put_tenant, delete_tenant,
          get_tenant_rates, put_tenant_rates, delete_tenant_rates,
          list_vpcs, get_vpc, put_vpc, delete_vpc,
          list_nfs, get_nf, put_nf, delete_nf,
          list_chains, get_chain, put_chain, delete_chain,
          list_endpoint_services, get_endpoint_service, put_endpoint_service, delete_endpoint_service,
          list_privatelink_endpoints, get_privatelink_endpoint, put_privatelink_endpoint, delete_privatelink_endpoint,
          list_ipsec, get_ipsec, put_ipsec, delete_ipsec,
          create_token, list_tokens, delete_token,
          list_nodes, get_node, list_partitions, status,
          get_tenant_stats, list_stats, list_flows, get_tenant_monitor, list_events, get_placement, put_placement_limits,
          create_join_token, join_node, renew_node, revoke_node),
    components(schemas(Tenant, TenantSpec, Vpc, VpcSpec, NfKind, NfInstance, NfSpec, Chain, ChainSpec,
                       Node, Partition, Flow, Event, EventsView, TenantStats, TenantMonitor, TrafficCount, HostTraffic, Token, Status, ErrorBody, ErrorDetail,
                       Demand, TenantPlacement, PlacementLimits, PlacementNode, TenantPlacementView,
                       VpcPlacement, PlacementView, OverlapMatrix, VpcClusters,
                       RateSpec, TenantRatesSpec, TenantRatesView, RateStatus,
                       IpsecTunnelSpec, IpsecSaSpec, IpsecTunnelView, IpsecSaView, IpsecNodeStatus, IpsecSaStatus,
                       ApplyRequest, ApplyItem, ApplyResult, AppliedItem,
                       JoinTokenRequest, JoinToken, JoinRequest, RenewRequest, Issued, Revoked,
                       EndpointService, EndpointServiceSpec, EndpointProtocol, ServiceRef,
                       PrivateLinkEndpoint, PrivateLinkEndpointSpec)),
    modifiers(&BearerAuth),
    security(("bearer" = []))
)]
pub struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let c = openapi.components.get_or_insert_with(Default::default);
        c.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::not_found(format!("no such endpoint: {uri} (see /openapi.json)"))
}

/// The API router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/openapi.json", get(openapi))
        .route("/healthz", get(healthz))
        .route("/v1/status", get(status))
        .route("/v1/placement", get(get_placement))
        .route(
            "/v1/placement/limits",
            axum::routing::put(put_placement_limits),
        )
        .route("/v1/nodes", get(list_nodes))
        .route("/v1/nodes/:id", get(get_node))
        .route("/v1/nodes/tokens", axum::routing::post(create_join_token))
        .route("/v1/nodes/join", axum::routing::post(join_node))
        .route("/v1/nodes/renew", axum::routing::post(renew_node))
        .route("/v1/nodes/:id/revoke", axum::routing::post(revoke_node))
        .route("/v1/partitions", get(list_partitions))
        .route("/v1/stats", get(list_stats))
        .route("/v1/events", get(list_events))
        .route("/v1/apply", axum::routing::post(apply))
        .route("/v1/tenants", get(list_tenants))
        .route(
            "/v1/tenants/:tenant",
            get(get_tenant).put(put_tenant).delete(delete_tenant),
        )
        .route(
            "/v1/tenants/:tenant/rates",
            get(get_tenant_rates)
                .put(put_tenant_rates)
                .delete(delete_tenant_rates),
        )
        .route("/v1/tenants/:tenant/vpcs", get(list_vpcs))
        .route(
            "/v1/tenants/:tenant/vpcs/:name",
            get(get_vpc).put(put_vpc).delete(delete_vpc),
        )
        .route("/v1/tenants/:tenant/nfs", get(list_nfs))
        .route(
            "/v1/tenants/:tenant/nfs/:name",
            get(get_nf).put(put_nf).delete(delete_nf),
        )
        .route("/v1/tenants/:tenant/chains", get(list_chains))
        .route(
            "/v1/tenants/:tenant/chains/:name",
            get(get_chain).put(put_chain).delete(delete_chain),
        )
        .route("/v1/tenants/:tenant/ipsec", get(list_ipsec))
        .route(
            "/v1/tenants/:tenant/ipsec/:name",
            get(get_ipsec).put(put_ipsec).delete(delete_ipsec),
        )
        .route(
            "/v1/tenants/:tenant/endpoint-services",
            get(list_endpoint_services),
        )
        .route(
            "/v1/tenants/:tenant/endpoint-services/:name",
            get(get_endpoint_service)
                .put(put_endpoint_service)
                .delete(delete_endpoint_service),
        )
        .route(
            "/v1/tenants/:tenant/privatelink-endpoints",
            get(list_privatelink_endpoints),
        )
        .route(
            "/v1/tenants/:tenant/privatelink-endpoints/:name",
            get(get_privatelink_endpoint)
                .put(put_privatelink_endpoint)
                .delete(delete_privatelink_endpoint),
        )
        .route(
            "/v1/tenants/:tenant/tokens",
            get(list_tokens).post(create_token),
        )
        .route(
            "/v1/tenants/:tenant/tokens/:id",
            axum::routing::delete(delete_token),
        )
        .route("/v1/tenants/:tenant/stats", get(get_tenant_stats))
        .route("/v1/tenants/:tenant/flows", get(list_flows))
        .route("/v1/tenants/:tenant/monitor", get(get_tenant_monitor))
        .fallback(not_found)
        .with_state(state.clone())
        .merge(crate::ui::router(state))
}
