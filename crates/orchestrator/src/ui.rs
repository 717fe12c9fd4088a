//! The web dashboard at `/ui`: server-rendered HTML (maud, which escapes every
//! interpolated string) refreshed in place by htmx, vendored and served from
//! `/ui/static/htmx.min.js`. No page loads anything from anywhere else.
//!
//! Authentication is the REST API's: the login form takes an API token (the admin
//! token or a tenant token), checks it with [`crate::auth::authenticate`] and keeps it
//! in an `HttpOnly`, `SameSite=Strict` cookie scoped to `/ui`. Every page and fragment
//! checks the cookie's token again, exactly as a REST request's bearer token is
//! checked, so a revoked token ends the session at the next refresh.
//!
//! What a tenant sees (filtered here, on the server): its own tenant, VPCs, NFs,
//! chains, counters, rates, partitions (SC groups and their replicas, as
//! `/v1/partitions` shows it) and the events about it. Node tables, FM and PP node
//! details and vIPs are the operator's: a tenant sees only the count of nodes up and
//! down per role, as `/v1/status` gives it. See docs/dashboard.md.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Form, Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use maud::{html, Markup, PreEscaped, DOCTYPE};
use proto::v1;
use serde::Deserialize;

use crate::auth::{authenticate, Principal};
use crate::control::{NodeEntry, Shared};
use crate::desired::Snapshot;
use crate::error::ApiError;
use crate::model::{Event, Partition, Tenant, TenantStats};

/// The session cookie: the API token itself (HttpOnly, SameSite=Strict, path `/ui`).
pub const COOKIE: &str = "sf_ui_token";
const HTMX: &str = include_str!("../static/htmx.min.js");
/// How often the live fragments refresh.
const REFRESH: &str = "every 2s";
const EVENTS_SHOWN: usize = 100;
const CSP: &str = "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; \
                   frame-ancestors 'none'; form-action 'self'; base-uri 'none'";

const CSS: &str = r#"
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f4f6fa}
header{background:#1d2b4a;color:#fff;padding:.6em 1.2em;display:flex;gap:1.2em;align-items:center}
header a{color:#cfe0ff;text-decoration:none}header a.on{color:#fff;font-weight:600;border-bottom:2px solid #7fb0ff}
header .who{margin-left:auto;opacity:.9}header form{display:inline}
header button{background:none;border:1px solid #7fb0ff;color:#fff;border-radius:4px;cursor:pointer;padding:.15em .6em}
main{padding:1em 1.4em}h1{font-size:1.35em;margin:.2em 0 .6em}h2{font-size:1.1em;margin:1.2em 0 .4em}
table{border-collapse:collapse;background:#fff;margin:.3em 0 1em;min-width:30em}
th,td{border:1px solid #d5dbe6;padding:.25em .6em;text-align:left;vertical-align:top}th{background:#e8edf6}
td.n{text-align:right;font-variant-numeric:tabular-nums}
.up{color:#17733a;font-weight:600}.down{color:#b3261e;font-weight:600}
.cards{display:flex;gap:.8em;flex-wrap:wrap}.card{background:#fff;border:1px solid #d5dbe6;border-radius:6px;padding:.5em 1em;min-width:8em}
.card b{display:block;font-size:1.4em}.muted{color:#667}.err{color:#b3261e}
.login{max-width:28em;margin:4em auto;background:#fff;border:1px solid #d5dbe6;border-radius:8px;padding:1.5em 2em}
.login input{width:100%;box-sizing:border-box;padding:.45em;margin:.4em 0 .8em;font-family:monospace}
.login button{padding:.4em 1.2em}code,pre{background:#eef1f6;padding:.1em .3em;border-radius:3px}pre{padding:.6em}
"#;

/// The dashboard's state: the orchestrator's, and the last counter samples that rates
/// are differenced from.
struct Ui {
    st: Arc<Shared>,
    rates: Mutex<RateSampler>,
}

type UiState = Arc<Ui>;

/// The dashboard's routes, merged into the API router.
pub fn router(st: Arc<Shared>) -> Router {
    let ui = Arc::new(Ui {
        st,
        rates: Mutex::new(RateSampler::default()),
    });
    Router::new()
        .route("/ui", get(overview))
        .route("/ui/", get(overview))
        .route("/ui/login", get(login_form).post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/tenants", get(tenants_page))
        .route("/ui/tenants/:tenant", get(tenant_page))
        .route("/ui/rates", get(rates_page))
        .route("/ui/events", get(events_page))
        .route("/ui/trace", get(trace_page))
        .route("/ui/fragments/topology", get(topology_fragment))
        .route("/ui/fragments/rates", get(rates_fragment))
        .route("/ui/fragments/events", get(events_fragment))
        .route("/ui/static/htmx.min.js", get(htmx))
        .with_state(ui)
}

// ---------------------------------------------------------------------- responses

fn html_response(status: StatusCode, m: Markup) -> Response {
    (
        status,
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        m.into_string(),
    )
        .into_response()
}

async fn htmx() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "public, max-age=86400"),
        ],
        HTMX,
    )
        .into_response()
}

fn set_cookie(value: &str, max_age: Option<u64>) -> HeaderValue {
    let age = max_age.map_or(String::new(), |a| format!("; Max-Age={a}"));
    HeaderValue::from_str(&format!(
        "{COOKIE}={value}; Path=/ui; HttpOnly; SameSite=Strict{age}"
    ))
    .unwrap_or_else(|_| HeaderValue::from_static("sf_ui_token=; Path=/ui; Max-Age=0"))
}

fn redirect_home(cookie: Option<HeaderValue>) -> Response {
    let mut r = (
        StatusCode::SEE_OTHER,
        [
            (header::LOCATION, HeaderValue::from_static("/ui")),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
        ],
    )
        .into_response();
    if let Some(c) = cookie {
        r.headers_mut().insert(header::SET_COOKIE, c);
    }
    r
}

// ---------------------------------------------------------------------- sessions

/// The token in the request's session cookie.
pub fn cookie_token(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.trim())
        .filter(|v| !v.is_empty())
}

/// A token can go into the cookie as it is: the platform's tokens are `sfa_`/`sft_`
/// and hex; anything else is refused rather than quoted.
pub fn cookie_safe(token: &str) -> bool {
    !token.is_empty()
        && token.len() <= 256
        && token
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Who the request's session acts as, or the response to send instead: the login page
/// (401) without a valid token, with `HX-Redirect` for an htmx fragment request so the
/// browser goes to the login page instead of swapping it in.
async fn session(ui: &Ui, headers: &HeaderMap) -> Result<Principal, Response> {
    let fragment = headers.contains_key("hx-request");
    let (error, clear) = match cookie_token(headers) {
        None => (None, false),
        Some(t) => match authenticate(t, &ui.st.cfg.admin_token, &ui.st.desired).await {
            Ok(Some(p)) => return Ok(p),
            Ok(None) => (
                Some("Your token is no longer valid (revoked, or its tenant deleted)."),
                true,
            ),
            Err(e) => return Err(error_page(None, &e)),
        },
    };
    let mut r = html_response(StatusCode::UNAUTHORIZED, login_page(error));
    if clear {
        r.headers_mut()
            .insert(header::SET_COOKIE, set_cookie("", Some(0)));
    }
    if fragment {
        r.headers_mut()
            .insert("hx-redirect", HeaderValue::from_static("/ui"));
    }
    Err(r)
}

#[derive(Deserialize)]
struct LoginForm {
    #[serde(default)]
    token: String,
}

async fn login_form(State(ui): State<UiState>, headers: HeaderMap) -> Response {
    match session(&ui, &headers).await {
        Ok(_) => redirect_home(None),
        Err(r) => r,
    }
}

/// A form POST from another site's page (login CSRF): its `Origin` names another host
/// than the one it was sent to. Browsers send `Origin` on every form POST.
pub fn cross_site(headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let origin_host = origin.split_once("://").map_or("", |(_, h)| h);
    origin == "null" || origin_host != host
}

fn refuse_cross_site() -> Response {
    error_page(
        None,
        &ApiError::forbidden("a form from another site cannot log in or out here"),
    )
}

async fn login(
    State(ui): State<UiState>,
    headers: HeaderMap,
    Form(f): Form<LoginForm>,
) -> Response {
    if cross_site(&headers) {
        return refuse_cross_site();
    }
    let token = f.token.trim();
    if token.is_empty() {
        return html_response(StatusCode::UNAUTHORIZED, login_page(Some("Enter a token.")));
    }
    let who = if cookie_safe(token) {
        match authenticate(token, &ui.st.cfg.admin_token, &ui.st.desired).await {
            Ok(p) => p,
            Err(e) => return error_page(None, &e),
        }
    } else {
        None
    };
    match who {
        Some(p) => {
            tracing::info!(principal = ?p, "dashboard login");
            redirect_home(Some(set_cookie(token, None)))
        }
        None => html_response(
            StatusCode::UNAUTHORIZED,
            login_page(Some("Unknown or revoked token.")),
        ),
    }
}

async fn logout(headers: HeaderMap) -> Response {
    if cross_site(&headers) {
        return refuse_cross_site();
    }
    redirect_home(Some(set_cookie("", Some(0))))
}

// ---------------------------------------------------------------------- layout

fn layout(title: &str, p: Option<&Principal>, active: &str, body: Markup) -> Markup {
    const NAV: [(&str, &str, &str); 5] = [
        ("overview", "/ui", "Overview"),
        ("tenants", "/ui/tenants", "Tenants"),
        ("rates", "/ui/rates", "Rates"),
        ("events", "/ui/events", "Events"),
        ("trace", "/ui/trace", "Trace"),
    ];
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · starfabric" }
                script src="/ui/static/htmx.min.js" {}
                style { (PreEscaped(CSS)) }
            }
            body {
                header {
                    strong { "starfabric" }
                    @if let Some(p) = p {
                        nav {
                            @for (key, href, label) in NAV {
                                a href=(href) class=(if key == active { "on" } else { "" }) { (label) } " "
                            }
                        }
                        span.who #who {
                            @match p {
                                Principal::Admin => { "admin" }
                                Principal::Tenant(t) => { "tenant " strong { (t) } }
                            }
                            " "
                            form method="post" action="/ui/logout" {
                                button type="submit" #logout { "Log out" }
                            }
                        }
                    }
                }
                main { (body) }
            }
        }
    }
}

/// The login page, with `error` above the form.
pub fn login_page(error: Option<&str>) -> Markup {
    layout(
        "Log in",
        None,
        "",
        html! {
            div.login {
                h1 { "Log in" }
                p.muted {
                    "Paste an API token: the admin token (" code { "starfabric up" }
                    " writes it to the CLI's config) or a tenant token ("
                    code { "starfabric token --tenant TENANT" } ")."
                }
                @if let Some(e) = error { p.err #login-error { (e) } }
                form method="post" action="/ui/login" {
                    label for="token" { "Token" }
                    input #token type="password" name="token" autocomplete="off" autofocus;
                    button #login type="submit" { "Log in" }
                }
            }
        },
    )
}

fn error_page(p: Option<&Principal>, e: &ApiError) -> Response {
    let title = e.status.canonical_reason().unwrap_or("Error");
    html_response(
        e.status,
        layout(
            title,
            p,
            "",
            html! {
                h1 { (e.status.as_u16()) " " (title) }
                p.err #error { (e.message) }
                p { a href="/ui" { "Back to the overview" } }
            },
        ),
    )
}

/// A page for a logged-in principal, or the login page / an error page.
macro_rules! page {
    ($ui:expr, $headers:expr, |$p:ident| $body:expr) => {{
        let $p = match session(&$ui, &$headers).await {
            Ok(p) => p,
            Err(r) => return r,
        };
        match $body {
            Ok(r) => r,
            Err(e) => error_page(Some(&$p), &e),
        }
    }};
}

// ---------------------------------------------------------------------- what a principal sees

/// The tenants `p` may see.
pub fn visible_tenants<'a>(p: &Principal, snap: &'a Snapshot) -> Vec<&'a Tenant> {
    snap.tenants
        .iter()
        .filter(|t| p.check_tenant(&t.name).is_ok())
        .collect()
}

/// What of the node table a principal sees: the admin every node, a tenant nothing
/// (it gets `role_counts` instead).
pub fn visible_nodes(p: &Principal, nodes: Vec<NodeEntry>) -> Vec<NodeEntry> {
    if p.tenant().is_none() {
        nodes
    } else {
        Vec::new()
    }
}

fn role_name(n: &NodeEntry) -> &'static str {
    match n.role() {
        v1::Role::Pp => "pp",
        v1::Role::Fm => "fm",
        v1::Role::Sc => "sc",
        v1::Role::Unspecified => "unknown",
    }
}

/// Nodes up and down per role.
fn role_counts(nodes: &[NodeEntry]) -> BTreeMap<&'static str, (u32, u32)> {
    let mut m: BTreeMap<&'static str, (u32, u32)> = BTreeMap::new();
    for n in nodes {
        let e = m.entry(role_name(n)).or_default();
        if n.up {
            e.0 += 1;
        } else {
            e.1 += 1;
        }
    }
    m
}

// ---------------------------------------------------------------------- overview and topology

async fn overview(State(ui): State<UiState>, headers: HeaderMap) -> Response {
    page!(ui, headers, |p| {
        async {
        let snap = ui.st.snapshot().await?;
        let tenants = visible_tenants(&p, &snap);
        let chains = snap
            .chains
            .iter()
            .filter(|c| p.check_tenant(&c.tenant).is_ok())
            .count();
        let nodes = ui.st.node_list();
        let up = nodes.iter().filter(|n| n.up).count();
        let topo = topology(&ui, &p).await?;
        Ok::<_, ApiError>(html_response(
            StatusCode::OK,
            layout(
                "Overview",
                Some(&p),
                "overview",
                html! {
                    h1 { "Overview" }
                    div.cards {
                        div.card { b #tenant-count { (tenants.len()) } "tenants" }
                        div.card { b { (chains) } "chains" }
                        div.card { b { (up) } "nodes up" }
                        div.card { b { (nodes.len() - up) } "nodes down" }
                        div.card { b { (ui.st.desired.store().backend()) } "store, revision " (snap.revision) }
                    }
                    div #topology hx-get="/ui/fragments/topology" hx-trigger=(REFRESH) hx-swap="innerHTML" {
                        (topo)
                    }
                },
            ),
        ))
    }
    .await
    })
}

async fn topology_fragment(State(ui): State<UiState>, headers: HeaderMap) -> Response {
    page!(ui, headers, |p| async {
        Ok::<_, ApiError>(html_response(StatusCode::OK, topology(&ui, &p).await?))
    }
    .await)
}

/// vIP owners from every FM that is up (admin only).
async fn vip_maps(st: &Shared) -> Vec<(String, Result<v1::VipMapReply, String>)> {
    let mut out = Vec::new();
    for n in st
        .node_list()
        .into_iter()
        .filter(|n| n.up && n.role() == v1::Role::Fm)
    {
        let addr = n.info().addr;
        let ask = async {
            let mut c = st.fm_client(&addr).await?;
            c.vip_map(v1::VipMapRequest {})
                .await
                .map(|r| r.into_inner())
                .map_err(|s| s.message().to_string())
        };
        let r = tokio::time::timeout(Duration::from_secs(1), ask)
            .await
            .unwrap_or_else(|_| Err("no answer within 1 s".into()));
        out.push((n.info().id, r));
    }
    out
}

async fn topology(ui: &Ui, p: &Principal) -> Result<Markup, ApiError> {
    let parts = crate::api::partitions(&ui.st, p).await?;
    let all = ui.st.node_list();
    let counts = role_counts(&all);
    let nodes = visible_nodes(p, all);
    let vips = if p.tenant().is_none() {
        vip_maps(&ui.st).await
    } else {
        Vec::new()
    };
    let snap = ui.st.snapshot().await?;
    Ok(render_topology(p, &snap, &nodes, &counts, &parts, &vips))
}

fn status_cell(n: &NodeEntry) -> Markup {
    html! {
        td class=(if n.up { "up" } else { "down" }) {
            (if n.up { "up" } else { "down" })
            @if n.up && !n.report.as_ref().is_some_and(|r| r.ready) { " (not ready)" }
        }
    }
}

fn render_topology(
    p: &Principal,
    snap: &Snapshot,
    nodes: &[NodeEntry],
    counts: &BTreeMap<&'static str, (u32, u32)>,
    parts: &[Partition],
    vips: &[(String, Result<v1::VipMapReply, String>)],
) -> Markup {
    let mut groups: BTreeMap<u64, Vec<&Partition>> = BTreeMap::new();
    for part in parts {
        groups.entry(part.group).or_default().push(part);
    }
    let of_role = |r: v1::Role| nodes.iter().filter(move |n| n.role() == r);
    // The vIPs each PP node owns, from FM's table (what it registered with otherwise).
    let mut owned: HashMap<&str, Vec<&str>> = HashMap::new();
    for o in vips
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok())
        .flat_map(|m| &m.vips)
    {
        if let Some(v) = &o.vip {
            owned
                .entry(o.node.as_str())
                .or_default()
                .push(v.ip.as_str());
        }
    }
    let vips_of = |n: &NodeEntry| -> String {
        let id = n.info().id;
        match owned.get(id.as_str()) {
            Some(v) => v.join(", "),
            None => n
                .info()
                .owned_vips
                .iter()
                .map(|v| v.ip.clone())
                .collect::<Vec<_>>()
                .join(", "),
        }
    };
    let mut clusters: BTreeMap<String, Vec<&NodeEntry>> = BTreeMap::new();
    for n in of_role(v1::Role::Pp) {
        clusters.entry(n.hello.cluster.clone()).or_default().push(n);
    }
    html! {
        @if p.tenant().is_some() {
            h2 { "Platform" }
            p.muted { "Node details are the operator's; a tenant sees how many are up." }
            table #role-counts {
                tr { th { "role" } th { "up" } th { "down" } }
                @for (role, (up, down)) in counts {
                    tr { td { (role) } td.n { (up) } td.n { (down) } }
                }
            }
            h2 { "Your VPCs' PP clusters" }
            table {
                tr { th { "tenant" } th { "VPC" } th { "VNI" } th { "PP cluster" } }
                @for v in snap.vpcs.iter().filter(|v| p.check_tenant(&v.tenant).is_ok()) {
                    @if let Some(t) = snap.tenant(&v.tenant) {
                        tr {
                            td { (v.tenant) } td { (v.name) } td.n { (v.vni) }
                            td { (crate::placement::vpc_cluster(snap, t, &v.name)) }
                        }
                    }
                }
            }
        } @else {
            h2 { "PP clusters" }
            @if clusters.is_empty() { p.muted { "No PP node has registered." } }
            @for (cluster, members) in &clusters {
                h3 { "cluster " (cluster) }
                table.pp {
                    tr { th { "PP node" } th { "address" } th { "status" } th { "packets/s" } th { "requests/s" } th { "flows" } th { "vIPs" } }
                    @for n in members {
                        @let load = n.report.as_ref().and_then(|r| r.load).unwrap_or_default();
                        tr {
                            td { (n.info().id) } td { (n.info().addr) } (status_cell(n))
                            td.n { (format!("{:.0}", load.packets_per_s)) }
                            td.n { (format!("{:.0}", load.requests_per_s)) }
                            td.n { (load.flows) }
                            td { (vips_of(n)) }
                        }
                    }
                }
            }
            @for (fm, r) in vips {
                @match r {
                    Ok(m) if !m.vips.is_empty() => {
                        h3 { "vIP table (from " (fm) ", epoch " (m.epoch) ", " (m.moves) " moves)" }
                        table.vips {
                            tr { th { "vIP" } th { "address" } th { "owner" } }
                            @for o in &m.vips {
                                tr {
                                    td.n { (o.vip.as_ref().map_or(0, |v| v.index)) }
                                    td { (o.vip.as_ref().map_or("", |v| v.ip.as_str())) }
                                    td { @if o.node.is_empty() { span.down { "none" } } @else { (o.node) } }
                                }
                            }
                        }
                    }
                    Ok(_) => {}
                    Err(e) => { p.err { "vIP table of " (fm) ": " (e) } }
                }
            }
            h2 { "FM" }
            table.fm {
                tr { th { "FM node" } th { "address" } th { "status" } th { "detail" } }
                @for n in of_role(v1::Role::Fm) {
                    tr { td { (n.info().id) } td { (n.info().addr) } (status_cell(n)) td { (n.report.as_ref().map_or("", |r| r.detail.as_str())) } }
                }
            }
            h2 { "SC nodes" }
            table.sc {
                tr { th { "SC node" } th { "address" } th { "status" } th { "replicas" } th { "requests applied" } th { "requests/s (tail)" } }
                @for n in of_role(v1::Role::Sc) {
                    @let load = n.report.as_ref().and_then(|r| r.load).unwrap_or_default();
                    @let applied = n.report.as_ref().and_then(|r| r.counters.get("requests_applied").copied()).unwrap_or(0);
                    tr {
                        td { (n.info().id) } td { (n.info().addr) } (status_cell(n))
                        td.n { (load.groups) } td.n { (applied) }
                        td.n { (format!("{:.0}", load.requests_per_s)) }
                    }
                }
            }
        }
        h2 { "SC groups" }
        @if groups.is_empty() { p.muted #no-groups { "No partitions reported yet (FM reports them once a chain's group is formed)." } }
        @else {
            table #groups {
                tr { th { "group" } th { "epoch" } th { "replicas (head first)" } th { "partitions" } }
                @for (g, ps) in &groups {
                    tr {
                        td.n { (g) }
                        td.n { (ps[0].epoch) }
                        td { (ps[0].replicas.join(" → ")) }
                        td {
                            @for part in ps {
                                div { (part.tenant) "/" (part.chain) " " code { (part.hash_lo) "–" (part.hash_hi) } }
                            }
                        }
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------- tenants

async fn tenants_page(State(ui): State<UiState>, headers: HeaderMap) -> Response {
    page!(ui, headers, |p| {
        async {
        let snap = ui.st.snapshot().await?;
        Ok::<_, ApiError>(html_response(
            StatusCode::OK,
            layout(
                "Tenants",
                Some(&p),
                "tenants",
                html! { h1 { "Tenants and chains" } (render_tenants(&snap, &visible_tenants(&p, &snap))) },
            ),
        ))
    }
    .await
    })
}

/// The tenants table: each tenant's VPCs, NFs and chains.
pub fn render_tenants(snap: &Snapshot, tenants: &[&Tenant]) -> Markup {
    html! {
        @if tenants.is_empty() { p.muted { "No tenants." } }
        table #tenants {
            tr { th { "tenant" } th { "id" } th { "PP cluster" } th { "labels" } th { "VPCs" } th { "NFs" } th { "chains" } }
            @for t in tenants {
                tr.tenant {
                    td { a href=(format!("/ui/tenants/{}", t.name)) { (t.name) } }
                    td.n { (t.id) }
                    td { (t.pp_cluster) }
                    td { @for (k, v) in &t.labels { div { (k) "=" (v) } } }
                    td { @for v in snap.vpcs.iter().filter(|v| v.tenant == t.name) { div { (v.name) " (VNI " (v.vni) ")" } } }
                    td { @for n in snap.nfs.iter().filter(|n| n.tenant == t.name) { div { (n.name) " (" (n.kind.name()) ")" } } }
                    td { @for c in snap.chains.iter().filter(|c| c.tenant == t.name) { div.chain { strong { (c.name) } ": " (c.nfs.join(" → ")) " on " (c.vpc) } } }
                }
            }
        }
    }
}

async fn tenant_page(
    State(ui): State<UiState>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
) -> Response {
    page!(ui, headers, |p| {
        async {
        // The REST API's check, before anything about the tenant is read.
        p.check_tenant(&tenant)?;
        let t = ui.st.desired.tenant(&tenant).await?;
        let snap = ui.st.snapshot().await?;
        let stats = crate::api::tenant_stats(&ui.st, &snap, &t);
        let parts: Vec<Partition> = crate::api::partitions(&ui.st, &p)
            .await?
            .into_iter()
            .filter(|x| x.tenant == t.name)
            .collect();
        Ok::<_, ApiError>(html_response(
            StatusCode::OK,
            layout(
                &t.name,
                Some(&p),
                "tenants",
                html! {
                    h1 { "Tenant " span #tenant-name { (t.name) } }
                    (render_tenants(&snap, &[&t]))
                    h2 { "Counters" }
                    (render_counters(&[stats]))
                    h2 { "Partitions" }
                    table {
                        tr { th { "chain" } th { "hash range" } th { "group" } th { "epoch" } th { "replicas" } }
                        @for x in &parts {
                            tr { td { (x.chain) } td { code { (x.hash_lo) "–" (x.hash_hi) } } td.n { (x.group) } td.n { (x.epoch) } td { (x.replicas.join(" → ")) } }
                        }
                    }
                    p { a href="/ui/rates" { "Live rates" } " · " a href="/ui/events" { "Events" } }
                },
            ),
        ))
    }
    .await
    })
}

fn render_counters(stats: &[TenantStats]) -> Markup {
    html! {
        table.counters {
            tr { th { "tenant" } th { "packets" } th { "bytes" } th { "drops" } th { "flows set up (PP)" } th { "rule requests (FM)" } th { "applied (SC)" } }
            @for s in stats {
                tr { td { (s.tenant) } td.n { (s.packets) } td.n { (s.bytes) } td.n { (s.drops) } td.n { (s.flows_set_up) } td.n { (s.rule_requests) } td.n { (s.requests_applied) } }
            }
        }
    }
}

// ---------------------------------------------------------------------- rates

/// Counters a rate is differenced from: packets, bytes, drops, flows set up at PP,
/// rule requests at FM, requests applied at SC.
type Counters = [u64; 6];

fn counters(s: &TenantStats) -> Counters {
    [
        s.packets,
        s.bytes,
        s.drops,
        s.flows_set_up,
        s.rule_requests,
        s.requests_applied,
    ]
}

/// Per tenant, its latest sample and the one before (at least [`RateSampler::MIN_GAP`]
/// apart): rates are their difference over the time between them. Shared by every
/// viewer, so two browsers refreshing do not shorten each other's interval.
#[derive(Default)]
pub struct RateSampler {
    samples: HashMap<u32, (Sample, Option<Sample>)>,
}

/// Counters and when they were read.
type Sample = (Instant, Counters);

impl RateSampler {
    pub const MIN_GAP: Duration = Duration::from_millis(900);

    /// Record `c` for tenant `id` at `now` (if the last sample is old enough) and give
    /// the per-second rates, once there are two samples. A counter that went down (a
    /// node restarted) counts as 0.
    pub fn observe(&mut self, id: u32, now: Instant, c: Counters) -> Option<[f64; 6]> {
        let e = self.samples.entry(id).or_insert(((now, c), None));
        if now.duration_since(e.0 .0) >= Self::MIN_GAP {
            e.1 = Some(e.0);
            e.0 = (now, c);
        }
        let (t1, c1) = e.0;
        let (t0, c0) = e.1?;
        let dt = t1.duration_since(t0).as_secs_f64();
        if dt <= 0.0 {
            return None;
        }
        let mut r = [0.0; 6];
        for i in 0..6 {
            r[i] = c1[i].saturating_sub(c0[i]) as f64 / dt;
        }
        Some(r)
    }

    /// Forget tenants not in `live`.
    pub fn retain(&mut self, live: &[u32]) {
        self.samples.retain(|id, _| live.contains(id));
    }
}

async fn rates_page(State(ui): State<UiState>, headers: HeaderMap) -> Response {
    page!(ui, headers, |p| {
        async {
        let body = rates(&ui, &p).await?;
        Ok::<_, ApiError>(html_response(
            StatusCode::OK,
            layout(
                "Rates",
                Some(&p),
                "rates",
                html! {
                    h1 { "Live rates" }
                    p.muted { "Per second, from the nodes' counters sampled about every 2 s (the first sample shows no rate yet)." }
                    div #rates hx-get="/ui/fragments/rates" hx-trigger=(REFRESH) hx-swap="innerHTML" { (body) }
                },
            ),
        ))
    }
    .await
    })
}

async fn rates_fragment(State(ui): State<UiState>, headers: HeaderMap) -> Response {
    page!(ui, headers, |p| async {
        Ok::<_, ApiError>(html_response(StatusCode::OK, rates(&ui, &p).await?))
    }
    .await)
}

async fn rates(ui: &Ui, p: &Principal) -> Result<Markup, ApiError> {
    let snap = ui.st.snapshot().await?;
    let now = Instant::now();
    let stats: Vec<TenantStats> = visible_tenants(p, &snap)
        .into_iter()
        .map(|t| crate::api::tenant_stats(&ui.st, &snap, t))
        .collect();
    let rows: Vec<(TenantStats, Option<[f64; 6]>)> = {
        let mut s = ui.rates.lock().unwrap_or_else(|e| e.into_inner());
        s.retain(&snap.tenants.iter().map(|t| t.id).collect::<Vec<_>>());
        stats
            .into_iter()
            .map(|st| {
                let r = s.observe(st.id, now, counters(&st));
                (st, r)
            })
            .collect()
    };
    let f = |r: &Option<[f64; 6]>, i: usize, scale: f64| {
        r.map_or("–".to_string(), |r| format!("{:.1}", r[i] * scale))
    };
    Ok(html! {
        table #rate-table {
            tr { th { "tenant" } th { "packets/s" } th { "Mbit/s" } th { "drops/s" } th { "new flows/s (PP)" } th { "setups/s (FM rule requests)" } th { "applied/s (SC)" } }
            @for (s, r) in &rows {
                tr { td { (s.tenant) } td.n { (f(r, 0, 1.0)) } td.n { (f(r, 1, 8e-6)) } td.n { (f(r, 2, 1.0)) } td.n { (f(r, 3, 1.0)) } td.n { (f(r, 4, 1.0)) } td.n { (f(r, 5, 1.0)) } }
            }
        }
        h2 { "Totals" }
        (render_counters(&rows.iter().map(|(s, _)| s.clone()).collect::<Vec<_>>()))
        @let limited: Vec<_> = rows.iter().flat_map(|(s, _)| s.rates.iter().map(move |r| (s.tenant.as_str(), r))).collect();
        @if !limited.is_empty() {
            h2 { "Rate management (paper 000 §7.2)" }
            table {
                tr { th { "tenant" } th { "PP node" } th { "kind" } th { "state" } th { "offered/s" } th { "admitted/s" } th { "refused" } }
                @for (t, r) in &limited {
                    tr { td { (t) } td { (r.node) } td { (r.kind) } td { (r.state) } td.n { (format!("{:.1}", r.offered_rate)) } td.n { (format!("{:.1}", r.admitted_rate)) } td.n { (r.refused) } }
                }
            }
        }
    })
}

// ---------------------------------------------------------------------- events

async fn events_page(State(ui): State<UiState>, headers: HeaderMap) -> Response {
    page!(ui, headers, |p| {
        async {
        let v = crate::events::collect(&ui.st, &p, EVENTS_SHOWN).await;
        Ok::<_, ApiError>(html_response(
            StatusCode::OK,
            layout(
                "Events",
                Some(&p),
                "events",
                html! {
                    h1 { "Autoscaler and placement events" }
                    p.muted { "Newest first: the orchestrator's placement decisions and FM's event log (scales, node joins and deaths, vIP moves, the autoscaler's decisions). Also " code { "GET /v1/events" } " and " code { "starfabric events" } "." }
                    div #events hx-get="/ui/fragments/events" hx-trigger=(REFRESH) hx-swap="innerHTML" { (render_events(&v.items, &v.errors)) }
                },
            ),
        ))
    }
    .await
    })
}

async fn events_fragment(State(ui): State<UiState>, headers: HeaderMap) -> Response {
    page!(ui, headers, |p| async {
        let v = crate::events::collect(&ui.st, &p, EVENTS_SHOWN).await;
        Ok::<_, ApiError>(html_response(
            StatusCode::OK,
            render_events(&v.items, &v.errors),
        ))
    }
    .await)
}

/// The events table.
pub fn render_events(items: &[Event], errors: &[String]) -> Markup {
    html! {
        @for e in errors { p.err { (e) } }
        @if items.is_empty() { p.muted #no-events { "No events yet." } }
        @else {
            table #event-table {
                tr { th { "time (UTC)" } th { "source" } th { "kind" } th { "tenant" } th { "message" } }
                @for e in items {
                    tr {
                        td { (utc(e.unix_ms)) } td { (e.source) " #" (e.seq) } td { code { (e.kind) } }
                        td { (e.tenant.as_deref().unwrap_or("")) } td { (e.message) }
                    }
                }
            }
        }
    }
}

/// `YYYY-MM-DD HH:MM:SS.mmm` of a Unix time in ms (proleptic Gregorian, UTC).
pub fn utc(unix_ms: u64) -> String {
    // The API's RFC 3339 time, made easier to read in a table: a space for the `T`, no `Z`.
    let mut s = proto::json::utc(unix_ms).replacen('T', " ", 1);
    s.pop();
    s
}

// ---------------------------------------------------------------------- trace

async fn trace_page(State(ui): State<UiState>, headers: HeaderMap) -> Response {
    page!(ui, headers, |p| {
        async {
        let tenant = p.tenant().unwrap_or("TENANT").to_string();
        Ok::<_, ApiError>(html_response(
            StatusCode::OK,
            layout(
                "Trace",
                Some(&p),
                "trace",
                html! {
                    h1 { "Trace" }
                    p {
                        "Packet and flow traces come from the CLI: run "
                        code { "starfabric trace" } " against this orchestrator with the same token you logged in with ("
                        code { "starfabric trace --help" } " lists its options). The orchestrator serves no trace endpoint yet, so this page only shows how; once the API has one, its results will appear here."
                    }
                    pre { "starfabric trace --help\nstarfabric flows --tenant " (tenant) "   # the flows the fabric master holds now\nstarfabric events --fm HOST:PORT --follow" }
                    p.muted { "Your tenant's current flows are also in " code { "GET /v1/tenants/" (tenant) "/flows" } "." }
                },
            ),
        ))
    }
    .await
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Chain, NfInstance, NfKind, Vpc};

    fn snap() -> Snapshot {
        let mut acme = Tenant::test("acme", 1);
        acme.labels
            .insert("note".into(), "<script>alert(1)</script>".into());
        Snapshot {
            tenants: vec![acme, Tenant::test("globex", 2)],
            vpcs: vec![Vpc {
                tenant: "acme".into(),
                name: "prod".into(),
                vni: 100,
                cidrs: vec![],
                revision: 0,
            }],
            nfs: vec![NfInstance {
                tenant: "globex".into(),
                name: "lb1".into(),
                kind: NfKind::Lb,
                config: serde_json::json!({}),
                revision: 0,
            }],
            chains: vec![Chain {
                tenant: "globex".into(),
                name: "web".into(),
                id: 1,
                vpc: "edge".into(),
                nfs: vec!["lb1".into()],
                spec: None,
                forward: Default::default(),
                reverse: Default::default(),
                revision: 0,
            }],
            ..Default::default()
        }
    }

    #[test]
    fn every_string_is_escaped() {
        let s = snap();
        let out = render_tenants(&s, &s.tenants.iter().collect::<Vec<_>>()).into_string();
        assert!(
            out.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
            "{out}"
        );
        assert!(!out.contains("<script>"), "{out}");
        let e = Event {
            source: "fm-1".into(),
            seq: 7,
            unix_ms: 0,
            kind: "k\"><b>".into(),
            tenant: Some("acme".into()),
            message: "<img src=x onerror=alert(1)>".into(),
            detail: serde_json::Value::Null,
        };
        let out = render_events(&[e], &["<i>err</i>".into()]).into_string();
        assert!(!out.contains("<img") && !out.contains("<i>") && !out.contains("<b>"));
        assert!(out.contains("&lt;img src=x onerror=alert(1)&gt;"), "{out}");
        let out = login_page(Some("<x>")).into_string();
        assert!(out.contains("&lt;x&gt;") && !out.contains("<x>"));
    }

    #[test]
    fn a_tenant_sees_only_its_own_tenant_and_no_nodes() {
        let s = snap();
        let acme = Principal::Tenant("acme".into());
        let seen = visible_tenants(&acme, &s);
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].name, "acme");
        let out = render_tenants(&s, &seen).into_string();
        assert!(out.contains("acme") && out.contains("prod"));
        assert!(!out.contains("globex") && !out.contains("web") && !out.contains("lb1"));
        assert_eq!(visible_tenants(&Principal::Admin, &s).len(), 2);
        let nobody = Principal::Tenant("initech".into());
        assert!(visible_tenants(&nobody, &s).is_empty());

        let node = NodeEntry {
            hello: v1::NodeHello::default(),
            session: 1,
            up: true,
            last_report: Instant::now(),
            report: None,
            desired_version: 0,
        };
        assert!(visible_nodes(&acme, vec![node.clone()]).is_empty());
        assert_eq!(visible_nodes(&Principal::Admin, vec![node]).len(), 1);
    }

    #[test]
    fn topology_for_a_tenant_has_no_node_details() {
        let s = snap();
        let acme = Principal::Tenant("acme".into());
        let mut counts = BTreeMap::new();
        counts.insert("pp", (2, 0));
        let vips = vec![("fm-1".to_string(), Ok(v1::VipMapReply::default()))];
        let out = render_topology(&acme, &s, &[], &counts, &[], &vips).into_string();
        assert!(out.contains("role-counts") && out.contains("prod"));
        assert!(!out.contains("vIP table") && !out.contains("FM node"));
    }

    #[test]
    fn topology_for_the_admin_has_the_vip_table() {
        let s = snap();
        let vip = |index: u32, node: &str| v1::VipOwner {
            vip: Some(v1::Vip {
                index,
                ip: format!("198.18.0.{}", 100 + index),
                mac: vec![2, 0, 0, 0, 0, index as u8],
            }),
            node: node.into(),
        };
        let map = v1::VipMapReply {
            epoch: 3,
            vips: vec![vip(0, "pp-1"), vip(1, "pp-2"), vip(2, "")],
            nodes: vec!["pp-1".into(), "pp-2".into()],
            draining: vec![],
            moves: 2,
        };
        let vips = vec![
            ("fm-1".to_string(), Ok(map)),
            ("fm-2".to_string(), Err("unavailable".to_string())),
        ];
        let out =
            render_topology(&Principal::Admin, &s, &[], &BTreeMap::new(), &[], &vips).into_string();
        assert!(
            out.contains("vIP table (from fm-1, epoch 3, 2 moves)"),
            "{out}"
        );
        for ip in ["198.18.0.100", "198.18.0.101", "198.18.0.102"] {
            assert!(out.contains(ip), "{ip}: {out}");
        }
        assert!(out.contains("<span class=\"down\">none</span>"), "{out}");
        assert!(out.contains("vIP table of fm-2: unavailable"), "{out}");
    }

    #[test]
    fn session_cookie() {
        let mut h = HeaderMap::new();
        assert_eq!(cookie_token(&h), None);
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("a=b; sf_ui_token=sft_00ff ; c=d"),
        );
        assert_eq!(cookie_token(&h), Some("sft_00ff"));
        assert!(cookie_safe("sfa_0123abcd") && cookie_safe("sft_x-y"));
        assert!(!cookie_safe("a;b") && !cookie_safe("a b") && !cookie_safe(""));
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8080"));
        assert!(!cross_site(&h), "no Origin: a non-browser client");
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://127.0.0.1:8080"),
        );
        assert!(!cross_site(&h));
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("https://evil.example"),
        );
        assert!(cross_site(&h));
        h.insert(header::ORIGIN, HeaderValue::from_static("null"));
        assert!(cross_site(&h));
        let c = set_cookie("sft_1", None);
        let c = c.to_str().unwrap();
        assert!(c.contains("HttpOnly") && c.contains("SameSite=Strict") && c.contains("Path=/ui"));
    }

    #[test]
    fn rates_come_from_successive_samples() {
        let mut s = RateSampler::default();
        let t0 = Instant::now();
        assert_eq!(s.observe(1, t0, [0; 6]), None);
        let r = s
            .observe(1, t0 + Duration::from_secs(2), [200, 0, 0, 10, 0, 0])
            .unwrap();
        assert_eq!(r[0], 100.0);
        assert_eq!(r[3], 5.0);
        // Too soon for a new sample: the same rates.
        let again = s
            .observe(1, t0 + Duration::from_millis(2100), [999, 0, 0, 0, 0, 0])
            .unwrap();
        assert_eq!(again[0], 100.0);
        // A counter that went down (node restart) is 0, not negative.
        let r = s
            .observe(1, t0 + Duration::from_secs(4), [50, 0, 0, 10, 0, 0])
            .unwrap();
        assert_eq!(r[0], 0.0);
        s.retain(&[]);
        assert_eq!(s.observe(1, t0, [0; 6]), None);
    }

    #[test]
    fn utc_formats_unix_ms() {
        assert_eq!(utc(0), "1970-01-01 00:00:00.000");
        assert_eq!(utc(1_709_251_199_123), "2024-02-29 23:59:59.123");
    }
}
