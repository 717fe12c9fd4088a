//! The REST API over real HTTP, against both store backends (redb, and a real etcd).
//!
//! Every bad request must get a 4xx whose JSON names what is wrong, and must leave the
//! state exactly as it was: the store revision (`/v1/status`) does not move.

use std::sync::Arc;

use orchestrator::client::Reply;
use serde_json::{json, Value};

const ADMIN: &str = "sfa_test_admin_token";

struct Api {
    base: String,
    _rt: tokio::runtime::Runtime,
    _orch: orchestrator::OrchestratorHandle,
}

/// Checks of the API's error shape.
trait ErrorShape {
    fn message(&self) -> String;
}

impl ErrorShape for Reply {
    /// The error message, asserting the error shape.
    fn message(&self) -> String {
        let e = &self.body["error"];
        assert_eq!(
            e["status"].as_u64(),
            Some(u64::from(self.status)),
            "{}",
            self.body
        );
        assert!(e["code"].is_string(), "{}", self.body);
        e["message"].as_str().unwrap_or_default().to_string()
    }
}

impl Api {
    /// `store` is made on the API's runtime: an etcd client's connection tasks live on
    /// the runtime it was created on.
    fn start(store: impl FnOnce(&tokio::runtime::Runtime) -> Arc<dyn store::Store>) -> Api {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let store = store(&rt);
        let orch = rt
            .block_on(orchestrator::start(
                orchestrator::OrchestratorConfig::new(ADMIN),
                store,
                "127.0.0.1:0".parse().unwrap(),
                "127.0.0.1:0".parse().unwrap(),
            ))
            .unwrap();
        Api {
            base: format!("http://{}", orch.api_addr),
            _rt: rt,
            _orch: orch,
        }
    }

    fn call(&self, method: &str, path: &str, token: Option<&str>, body: Option<&str>) -> Reply {
        orchestrator::client::Client::new(&self.base, token)
            .exchange_raw(method, path, body)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    fn admin(&self, method: &str, path: &str, body: Option<Value>) -> Reply {
        self.call(
            method,
            path,
            Some(ADMIN),
            body.map(|b| b.to_string()).as_deref(),
        )
    }

    fn revision(&self) -> u64 {
        let r = self.admin("GET", "/v1/status", None);
        assert_eq!(r.status, 200);
        r.body["store_revision"].as_u64().unwrap()
    }

    /// Bad `PUT`s to `path`, each `(body, status, needle)` as in [`Api::refused`].
    fn refused_puts(&self, path: &str, cases: &[(&str, u16, &str)]) {
        for &(body, status, needle) in cases {
            self.refused("PUT", path, ADMIN, Some(body), status, needle);
        }
    }

    /// A bad request: its status, a message containing `needle`, and no state change.
    fn refused(
        &self,
        method: &str,
        path: &str,
        token: &str,
        body: Option<&str>,
        status: u16,
        needle: &str,
    ) {
        let before = self.revision();
        let r = self.call(method, path, Some(token), body);
        assert_eq!(r.status, status, "{method} {path} {body:?}: {}", r.body);
        let m = r.message();
        assert!(
            m.contains(needle),
            "{method} {path}: message {m:?} should mention {needle:?}"
        );
        assert_eq!(self.revision(), before, "{method} {path} changed the state");
    }
}

fn snat(addr: &str) -> Value {
    json!({"kind": "snat", "config": {"pools": [{"addresses": [addr], "ports": {"lo": 1024, "hi": 65535}}]}})
}

fn suite(api: &Api) {
    // ---- authentication
    let r = api.call("GET", "/v1/tenants", None, None);
    assert_eq!(r.status, 401);
    assert!(r.message().contains("Bearer"));
    assert_eq!(
        api.call("GET", "/v1/tenants", Some("nope"), None).status,
        401
    );

    // ---- tenants: create, idempotent PUT, update
    let r = api.admin("PUT", "/v1/tenants/acme", Some(json!({})));
    assert_eq!(r.status, 201, "{}", r.body);
    let acme_id = r.body["id"].as_u64().unwrap();
    assert_eq!(r.body["pp_cluster"], "default");
    let rev = api.revision();
    let again = api.admin("PUT", "/v1/tenants/acme", Some(json!({})));
    assert_eq!(again.status, 200);
    assert_eq!(again.body["id"].as_u64(), Some(acme_id));
    assert_eq!(api.revision(), rev, "an identical PUT writes nothing");
    let r = api.admin(
        "PUT",
        "/v1/tenants/acme",
        Some(json!({"labels": {"tier": "gold"}})),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.body["labels"]["tier"], "gold");
    assert_eq!(r.body["id"].as_u64(), Some(acme_id), "the id never changes");
    let r = api.admin(
        "PUT",
        "/v1/tenants/globex",
        Some(json!({"pp_cluster": "east"})),
    );
    assert_eq!(r.status, 201);
    assert_ne!(r.body["id"].as_u64(), Some(acme_id));
    assert_eq!(r.body["pp_cluster"], "east");

    // ---- tenants: bad input
    api.refused_puts(
        "/v1/tenants/x1",
        &[
            (r#"{"pp_cluster": 5}"#, 400, "pp_cluster"),
            (r#"{"pp_clustr": "a"}"#, 400, "unknown field"),
            ("{not json", 400, "not JSON"),
        ],
    );
    api.refused(
        "PUT",
        "/v1/tenants/Bad_Name",
        ADMIN,
        Some("{}"),
        422,
        "not a valid name",
    );
    api.refused("GET", "/v1/tenants/nobody", ADMIN, None, 404, "\"nobody\"");
    api.refused("GET", "/v1/tenants?limit=0", ADMIN, None, 400, "limit");
    api.refused("GET", "/v1/tenants?limit=abc", ADMIN, None, 400, "limit");
    api.refused("GET", "/v1/tenants?color=red", ADMIN, None, 400, "color");
    api.refused("GET", "/v1/nothing-here", ADMIN, None, 404, "openapi");

    // ---- rates (paper 000 §7.2): set, read back, refuse bad ones unchanged, clear
    let rates = json!({"requests": {"min": 100.0, "base": 1000.0, "burst": 3000.0},
                       "packets": {"base": 1e5, "burst": 2e5, "debt": 5e4}});
    let r = api.admin("PUT", "/v1/tenants/acme/rates", Some(rates.clone()));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["rates"]["requests"]["burst"], 3000.0);
    assert_eq!(r.body["rates"]["packets"]["min"], 0.0, "min defaults to 0");
    let r = api.admin("GET", "/v1/tenants/acme", None);
    assert_eq!(r.body["rates"]["packets"]["debt"], 5e4);
    for (body, status, says) in [
        (r#"{"requests": {"base": -1, "burst": 5}}"#, 422, "requests"),
        (r#"{"requests": {"base": 10, "burst": 5}}"#, 422, "burst"),
        (
            r#"{"packets": {"min": 20, "base": 10, "burst": 50}}"#,
            422,
            "min",
        ),
        (r#"{"packets": {"base": 0, "burst": 0}}"#, 422, "base"),
        (r#"{"requests": {"base": 10}}"#, 400, "burst"),
        (
            r#"{"bytes": {"base": 10, "burst": 20}}"#,
            400,
            "unknown field",
        ),
    ] {
        api.refused(
            "PUT",
            "/v1/tenants/acme/rates",
            ADMIN,
            Some(body),
            status,
            says,
        );
    }
    let r = api.admin("GET", "/v1/tenants/acme/rates", None);
    assert_eq!(r.status, 200);
    assert_eq!(
        r.body["rates"],
        rates_after_defaults(&rates),
        "refused PUTs changed nothing"
    );
    api.refused(
        "PUT",
        "/v1/tenants/nobody/rates",
        ADMIN,
        Some(r#"{}"#),
        404,
        "nobody",
    );
    assert_eq!(
        api.admin("DELETE", "/v1/tenants/acme/rates", None).status,
        204
    );
    let r = api.admin("GET", "/v1/tenants/acme", None);
    assert!(r.body.get("rates").is_none(), "{}", r.body);

    // ---- pagination walks every tenant exactly once
    for i in 0..5 {
        assert_eq!(
            api.admin("PUT", &format!("/v1/tenants/t{i}"), Some(json!({})))
                .status,
            201
        );
    }
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let path = match &after {
            Some(a) => format!("/v1/tenants?limit=2&after={a}"),
            None => "/v1/tenants?limit=2".to_string(),
        };
        let r = api.admin("GET", &path, None);
        assert_eq!(r.status, 200);
        let items = r.body["items"].as_array().unwrap();
        assert!(items.len() <= 2);
        seen.extend(
            items
                .iter()
                .map(|t| t["name"].as_str().unwrap().to_string()),
        );
        match r.body["next"].as_str() {
            Some(n) => after = Some(n.to_string()),
            None => break,
        }
    }
    assert_eq!(seen, ["acme", "globex", "t0", "t1", "t2", "t3", "t4"]);

    // ---- VPCs
    let r = api.admin(
        "PUT",
        "/v1/tenants/acme/vpcs/main",
        Some(json!({"vni": 100, "cidrs": ["198.19.0.0/16"]})),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(
        api.admin(
            "PUT",
            "/v1/tenants/acme/vpcs/main",
            Some(json!({"vni": 100, "cidrs": ["198.19.0.0/16"]}))
        )
        .status,
        200
    );
    api.refused_puts(
        "/v1/tenants/acme/vpcs/v2",
        &[
            ("{}", 400, "missing field `vni`"),
            (r#"{"vni": "100"}"#, 400, "vni"),
            (r#"{"vni": -1}"#, 400, "vni"),
            (r#"{"vni": 0}"#, 422, "vni must be 1 to 16777215"),
            (r#"{"vni": 16777216}"#, 422, "24 bits"),
            (
                r#"{"vni": 7, "cidrs": ["10.0.0.0/33"]}"#,
                422,
                "10.0.0.0/33",
            ),
        ],
    );
    api.refused(
        "PUT",
        "/v1/tenants/nobody/vpcs/v2",
        ADMIN,
        Some(r#"{"vni": 7}"#),
        404,
        "tenant \"nobody\" does not exist",
    );
    // A VNI in use by another tenant's VPC.
    api.refused(
        "PUT",
        "/v1/tenants/globex/vpcs/main",
        ADMIN,
        Some(r#"{"vni": 100}"#),
        409,
        "vni 100 is already used by VPC \"main\" of tenant \"acme\"",
    );
    let r = api.admin("GET", "/v1/tenants/globex/vpcs", None);
    assert_eq!(r.body["items"].as_array().unwrap().len(), 0);
    assert_eq!(
        api.admin(
            "PUT",
            "/v1/tenants/globex/vpcs/main",
            Some(json!({"vni": 200}))
        )
        .status,
        201
    );

    // ---- NFs
    let r = api.admin(
        "PUT",
        "/v1/tenants/acme/nfs/nat",
        Some(snat("198.18.100.1")),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.body["kind"], "snat");
    let fw = json!({"kind": "fw", "config": {"default_action": "allow",
        "rules": [{"name": "no-telnet", "action": "deny", "proto": "tcp", "dport": 23}]}});
    assert_eq!(
        api.admin("PUT", "/v1/tenants/acme/nfs/fw", Some(fw)).status,
        201
    );
    let lb = json!({"kind": "lb", "config": {"services": [{"vip": "198.19.0.100", "port": 80, "protocol": "tcp",
        "backends": [{"addr": "198.19.1.7", "port": 8080}]}]}});
    assert_eq!(
        api.admin("PUT", "/v1/tenants/acme/nfs/web", Some(lb))
            .status,
        201
    );
    assert_eq!(
        api.admin(
            "PUT",
            "/v1/tenants/acme/nfs/mon",
            Some(json!({"kind": "monitor"}))
        )
        .status,
        201
    );
    let r = api.admin(
        "PUT",
        "/v1/tenants/acme/nfs/limit",
        Some(json!({"kind": "connlimit", "config": {"limit": 64}})),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.body["kind"], "connlimit");
    api.refused_puts(
        "/v1/tenants/acme/nfs/x",
        &[
            (r#"{"kind": "vpn"}"#, 400, "unknown variant `vpn`"),
            (r#"{"config": {}}"#, 400, "missing field `kind`"),
            (r#"{"kind": "snat", "config": {"pools": [{"addresses": ["198.18.100.1"], "ports": {"lo": 2000, "hi": 1000}}]}}"#, 422, "snat configuration"),
            (r#"{"kind": "snat", "config": {"pools": [{"addresses": ["not-an-ip"]}]}}"#, 422, "snat configuration"),
            (r#"{"kind": "fw", "config": {"tenant": 2, "rules": []}}"#, 422, "own ACL"),
            (r#"{"kind": "monitor", "config": []}"#, 422, "JSON object"),
            (r#"{"kind": "connlimit", "config": {"limit": 0}}"#, 422, "connlimit configuration"),
            (r#"{"kind": "connlimit", "config": {"limit": 2, "burst": 1}}"#, 422, "connlimit configuration"),
        ],
    );

    // ---- chains
    let chain = json!({"vpc": "main", "nfs": ["fw", "nat"],
        "forward": {"decap": true, "encap": {"dst": "198.18.0.9", "vni": 300}},
        "reverse": {"decap": true, "encap": {"dst": "198.18.0.50", "vni": 100}}});
    let r = api.admin("PUT", "/v1/tenants/acme/chains/egress", Some(chain.clone()));
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.body["id"], 1);
    assert_eq!(
        api.admin("PUT", "/v1/tenants/acme/chains/egress", Some(chain.clone()))
            .status,
        200
    );
    api.refused_puts(
        "/v1/tenants/acme/chains/c2",
        &[
            (
                r#"{"vpc": "main", "nfs": ["nat"]}"#,
                409,
                "already bound to chain \"egress\"",
            ),
            (r#"{"vpc": "nope", "nfs": ["nat"]}"#, 422, "VPC \"nope\""),
            (r#"{"vpc": "main", "nfs": ["ghost"]}"#, 422, "NF \"ghost\""),
            (r#"{"vpc": "main", "nfs": []}"#, 422, "at least one NF"),
        ],
    );
    api.refused(
        "PUT",
        "/v1/tenants/acme/chains/egress",
        ADMIN,
        Some(&json!({"vpc": "main", "nfs": ["fw", "nat"], "spec": [0, 5]}).to_string()),
        422,
        "chain \"egress\"",
    );
    api.refused("PUT", "/v1/tenants/acme/chains/egress", ADMIN,
        Some(&json!({"vpc": "main", "nfs": ["nat"], "forward": {"encap": {"dst": "198.18.0.9", "vni": 99999999}}}).to_string()), 422, "VNI");
    // Objects in use cannot go.
    api.refused(
        "DELETE",
        "/v1/tenants/acme/nfs/nat",
        ADMIN,
        None,
        409,
        "used by chain \"egress\"",
    );
    api.refused(
        "DELETE",
        "/v1/tenants/acme/vpcs/main",
        ADMIN,
        None,
        409,
        "used by chain \"egress\"",
    );
    api.refused("DELETE", "/v1/tenants/acme", ADMIN, None, 409, "cascade");
    let r = api.admin("GET", "/v1/tenants/acme/chains", None);
    assert_eq!(r.body["items"][0]["nfs"], json!(["fw", "nat"]));

    // ---- tenant tokens
    let r = api.admin("POST", "/v1/tenants/acme/tokens", None);
    assert_eq!(r.status, 201);
    let tok = r.body["token"].as_str().unwrap().to_string();
    let tid = r.body["id"].as_str().unwrap().to_string();
    let listed = api.admin("GET", "/v1/tenants/acme/tokens", None);
    assert_eq!(listed.body[0]["id"], tid.as_str());
    assert!(
        listed.body[0].get("token").is_none(),
        "a token is shown only once"
    );
    // Its own tenant: fine.
    assert_eq!(
        api.call("GET", "/v1/tenants/acme", Some(&tok), None).status,
        200
    );
    assert_eq!(
        api.call("GET", "/v1/tenants/acme/vpcs", Some(&tok), None)
            .status,
        200
    );
    let r = api.call(
        "PUT",
        "/v1/tenants/acme/vpcs/side",
        Some(&tok),
        Some(r#"{"vni": 101}"#),
    );
    assert_eq!(r.status, 201);
    // Its list of tenants is itself.
    let r = api.call("GET", "/v1/tenants", Some(&tok), None);
    let names: Vec<&str> = r.body["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["acme"]);
    // Anything of another tenant, or the operator's: refused, and nothing changes.
    api.refused(
        "GET",
        "/v1/tenants/globex",
        &tok,
        None,
        403,
        "cannot access tenant \"globex\"",
    );
    let nf = snat("198.18.100.9").to_string();
    for (method, path, body) in [
        ("GET", "/v1/tenants/globex/vpcs", None),
        (
            "PUT",
            "/v1/tenants/globex/vpcs/evil",
            Some(r#"{"vni": 555}"#),
        ),
        ("DELETE", "/v1/tenants/globex/vpcs/main", None),
        ("PUT", "/v1/tenants/globex/nfs/n", Some(nf.as_str())),
        ("POST", "/v1/tenants/globex/tokens", None),
        ("GET", "/v1/tenants/globex/stats", None),
    ] {
        api.refused(method, path, &tok, body, 403, "\"globex\"");
    }
    api.refused(
        "PUT",
        "/v1/tenants/newco",
        &tok,
        Some("{}"),
        403,
        "admin token",
    );
    api.refused("DELETE", "/v1/tenants/acme", &tok, None, 403, "admin token");
    api.refused("GET", "/v1/nodes", &tok, None, 403, "admin token");
    let r = api.call("GET", "/v1/stats", Some(&tok), None);
    assert_eq!(r.body.as_array().unwrap().len(), 1);
    assert_eq!(r.body[0]["tenant"], "acme");
    let st = api.call("GET", "/v1/status", Some(&tok), None);
    assert_eq!(st.body["tenants"], 1);
    assert!(st.body["nodes"].as_array().unwrap().is_empty());
    // Revoked: unauthorized from then on.
    assert_eq!(
        api.admin("DELETE", &format!("/v1/tenants/acme/tokens/{tid}"), None)
            .status,
        204
    );
    assert_eq!(
        api.call("GET", "/v1/tenants/acme", Some(&tok), None).status,
        401
    );

    // ---- deletes, and a freed VNI can be taken again
    assert_eq!(
        api.admin("DELETE", "/v1/tenants/acme/chains/egress", None)
            .status,
        204
    );
    assert_eq!(
        api.admin("DELETE", "/v1/tenants/acme/nfs/mon", None).status,
        204
    );
    api.refused(
        "DELETE",
        "/v1/tenants/acme/nfs/mon",
        ADMIN,
        None,
        404,
        "\"mon\"",
    );
    assert_eq!(
        api.admin("DELETE", "/v1/tenants/acme?cascade=true", None)
            .status,
        204
    );
    assert_eq!(api.admin("GET", "/v1/tenants/acme", None).status, 404);
    assert_eq!(
        api.admin(
            "PUT",
            "/v1/tenants/globex/vpcs/second",
            Some(json!({"vni": 100}))
        )
        .status,
        201
    );
    // The deleted tenant's id is not reused.
    let r = api.admin("PUT", "/v1/tenants/acme", Some(json!({})));
    assert_ne!(r.body["id"].as_u64(), Some(acme_id));

    // ---- apply: several objects in one store transaction, or none
    let bundle = |t: &str, vni: u64| {
        json!({"items": [
            {"kind": "tenant", "name": t, "spec": {}},
            {"kind": "vpc", "tenant": t, "name": "main", "spec": {"vni": vni}},
            {"kind": "nf", "tenant": t, "name": "snat", "spec": snat("198.18.77.1")},
            {"kind": "chain", "tenant": t, "name": "main", "spec": {"vpc": "main", "nfs": ["snat"]}},
        ]})
    };
    let before = api.revision();
    let r = api.admin("POST", "/v1/apply", Some(bundle("bundle", 3000)));
    assert_eq!(r.status, 200, "{}", r.body);
    let results: Vec<&str> = r.body["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["result"].as_str().unwrap())
        .collect();
    assert_eq!(results, ["created"; 4]);
    assert_eq!(r.body["items"][3]["object"], "chain/bundle/main");
    // One transaction: one revision for all four objects.
    let rev = r.body["revision"].as_u64().unwrap();
    assert!(rev > before);
    for path in ["vpcs/main", "nfs/snat", "chains/main"] {
        let o = api.admin("GET", &format!("/v1/tenants/bundle/{path}"), None);
        assert_eq!(o.status, 200, "{path}: {}", o.body);
        assert_eq!(o.body["revision"].as_u64(), Some(rev), "{path}");
    }
    // Again: nothing changes.
    let r = api.admin("POST", "/v1/apply", Some(bundle("bundle", 3000)));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body["items"]
        .as_array()
        .unwrap()
        .iter()
        .all(|i| i["result"] == "unchanged"));
    assert_eq!(api.revision(), rev);
    // A VNI already taken, or out of range, refuses the whole request: no tenant
    // without its VPC is left behind (the store revision does not move).
    let taken = bundle("bundle2", 3000).to_string();
    api.refused(
        "POST",
        "/v1/apply",
        ADMIN,
        Some(&taken),
        409,
        "vni 3000 is already used",
    );
    let huge = bundle("bundle2", 99_999_999).to_string();
    api.refused(
        "POST",
        "/v1/apply",
        ADMIN,
        Some(&huge),
        422,
        "vpc/bundle2/main",
    );
    let r = api.call("POST", "/v1/apply", Some(ADMIN), Some(&huge));
    assert_eq!(r.body["error"]["field"], "items[1].vni", "{}", r.body);
    assert_eq!(api.admin("GET", "/v1/tenants/bundle2", None).status, 404);
    // Items apply in order: a chain before its NF is refused, and so is everything.
    let backwards = json!({"items": [
        {"kind": "tenant", "name": "bundle3", "spec": {}},
        {"kind": "vpc", "tenant": "bundle3", "name": "main", "spec": {"vni": 3003}},
        {"kind": "chain", "tenant": "bundle3", "name": "main", "spec": {"vpc": "main", "nfs": ["snat"]}},
        {"kind": "nf", "tenant": "bundle3", "name": "snat", "spec": snat("198.18.77.3")},
    ]})
    .to_string();
    api.refused(
        "POST",
        "/v1/apply",
        ADMIN,
        Some(&backwards),
        422,
        "chain/bundle3/main",
    );
    assert_eq!(api.admin("GET", "/v1/tenants/bundle3", None).status, 404);
    // Empty, malformed, unknown kinds.
    api.refused(
        "POST",
        "/v1/apply",
        ADMIN,
        Some(r#"{"items": []}"#),
        422,
        "nothing to apply",
    );
    api.refused(
        "POST",
        "/v1/apply",
        ADMIN,
        Some(r#"{"items": [{"kind": "router", "name": "x"}]}"#),
        400,
        "router",
    );
    api.refused(
        "POST",
        "/v1/apply",
        ADMIN,
        Some(r#"{"items": [{"kind": "tenant", "name": "x", "spec": {}, "extra": 1}]}"#),
        400,
        "extra",
    );
    // A tenant token may apply its own objects, never a tenant nor another's objects.
    let tok = api.admin("POST", "/v1/tenants/bundle/tokens", None).body["token"]
        .as_str()
        .unwrap()
        .to_string();
    let own = json!({"items": [{"kind": "vpc", "tenant": "bundle", "name": "side", "spec": {"vni": 3010}}]});
    let r = api.call("POST", "/v1/apply", Some(&tok), Some(&own.to_string()));
    assert_eq!(r.status, 200, "{}", r.body);
    let other = json!({"items": [
        {"kind": "vpc", "tenant": "bundle", "name": "side2", "spec": {"vni": 3011}},
        {"kind": "vpc", "tenant": "acme", "name": "x", "spec": {"vni": 3012}},
    ]})
    .to_string();
    api.refused("POST", "/v1/apply", &tok, Some(&other), 403, "");
    let tenant_item = bundle("bundle4", 3020).to_string();
    api.refused("POST", "/v1/apply", &tok, Some(&tenant_item), 403, "");
    assert_eq!(
        api.admin("GET", "/v1/tenants/bundle/vpcs/side2", None)
            .status,
        404
    );

    // ---- events: the admin's, a tenant token's (only its tenant's), bad limits
    let r = api.admin("GET", "/v1/events?limit=5", None);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body["items"].as_array().is_some_and(|i| i.len() <= 5));
    let r = api.call("GET", "/v1/events", Some(&tok), None);
    assert_eq!(r.status, 200, "{}", r.body);
    for e in r.body["items"].as_array().unwrap() {
        assert_eq!(
            e["tenant"], "bundle",
            "a tenant sees only its own events: {e}"
        );
    }
    assert_eq!(api.call("GET", "/v1/events", None, None).status, 401);
    api.refused("GET", "/v1/events?limit=0", ADMIN, None, 400, "limit");
    api.refused("GET", "/v1/events?since=3", ADMIN, None, 400, "since");

    // ---- the dashboard: the login page without a token, HTML, no external scripts
    let r = orchestrator::client::Client::new(&api.base, None)
        .exchange_raw("GET", "/ui", None)
        .unwrap();
    assert_eq!(r.status, 401);
    let page = r.body.as_str().unwrap_or_default();
    assert!(page.contains("Log in") && !page.contains("http"), "{page}");

    ipsec_suite(api);
    egress_suite(api);

    // ---- the OpenAPI document covers the resources
    let r = api.call("GET", "/openapi.json", None, None);
    assert_eq!(r.status, 200);
    let paths = r.body["paths"].as_object().unwrap();
    for p in [
        "/v1/tenants",
        "/v1/tenants/{tenant}",
        "/v1/tenants/{tenant}/vpcs/{name}",
        "/v1/tenants/{tenant}/nfs/{name}",
        "/v1/tenants/{tenant}/chains/{name}",
        "/v1/tenants/{tenant}/tokens",
        "/v1/nodes",
        "/v1/partitions",
        "/v1/status",
        "/v1/tenants/{tenant}/flows",
        "/v1/tenants/{tenant}/stats",
        "/v1/tenants/{tenant}/rates",
        "/v1/apply",
        "/v1/events",
        "/v1/tenants/{tenant}/ipsec",
        "/v1/tenants/{tenant}/ipsec/{name}",
    ] {
        assert!(paths.contains_key(p), "openapi lacks {p}");
    }
    assert!(r.body["components"]["schemas"]["VpcSpec"]["required"]
        .as_array()
        .unwrap()
        .contains(&json!("vni")));
    assert!(r.body["components"]["securitySchemes"]["bearer"].is_object());
}

/// IPsec tunnels (docs/ipsec.md): created, read back without keys, rekeyed, and every
/// bad input refused without a state change: 422 for malformed fields, 403 for a VNI
/// the tenant does not own (with the admin token too), 409 for an inbound SPI in use.
fn ipsec_suite(api: &Api) {
    for (t, v, vni) in [("acme", "vpn", 4100), ("globex", "gvpn", 4101)] {
        let r = api.admin(
            "PUT",
            &format!("/v1/tenants/{t}/vpcs/{v}"),
            Some(json!({"vni": vni})),
        );
        assert_eq!(r.status, 201, "{}", r.body);
    }
    let key1 = "000102030405060708090a0b0c0d0e0f10111213";
    let key2 = format!("0x{}", "ab".repeat(36));
    let tunnel = |vni: u32, out: u32, ins: &[u32]| {
        json!({
            "vni": vni,
            "peer": "198.18.20.2",
            "local_prefixes": ["198.19.1.0/24"],
            "remote_prefixes": ["198.18.170.0/24"],
            "vtep": "198.18.10.2",
            "vm_mac": "02:5f:01:00:00:02",
            "outbound": {"spi": out, "key": key1},
            "inbound": ins.iter().map(|s| json!({"spi": s, "key": key2})).collect::<Vec<_>>(),
        })
    };
    let path = "/v1/tenants/acme/ipsec/site";
    let r = api.admin("PUT", path, Some(tunnel(4100, 0x1000, &[0x2000])));
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.body["outbound"], json!({"spi": 0x1000, "key_bits": 128}));
    assert_eq!(r.body["inbound"][0]["key_bits"], 256);
    assert_eq!(r.body["replay_window"], 64);
    assert!(
        !r.body.to_string().contains("0102030405"),
        "no key in a reply"
    );
    let rev = api.revision();
    assert_eq!(
        api.admin("PUT", path, Some(tunnel(4100, 0x1000, &[0x2000])))
            .status,
        200
    );
    assert_eq!(api.revision(), rev, "an identical PUT writes nothing");
    let r = api.admin("GET", path, None);
    assert_eq!(r.status, 200);
    assert!(!r.body.to_string().contains("abab"), "no key in a read");
    // A rekey: new inbound beside the old one, new outbound.
    let r = api.admin("PUT", path, Some(tunnel(4100, 0x1001, &[0x2001, 0x2000])));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["outbound"]["spi"], 0x1001);
    let r = api.admin("GET", "/v1/tenants/acme/ipsec", None);
    assert_eq!(r.body["items"].as_array().unwrap().len(), 1);

    let body = |v: Value| v.to_string();
    let with = |f: &dyn Fn(&mut Value)| {
        let mut v = tunnel(4100, 0x1002, &[0x2002]);
        f(&mut v);
        body(v)
    };
    let cases: Vec<(String, u16, &str)> = vec![
        (
            with(&|v| v["outbound"]["key"] = json!("0011")),
            422,
            "20 bytes",
        ),
        (
            with(&|v| v["outbound"]["key"] = json!("zz".repeat(20))),
            422,
            "hex",
        ),
        (
            with(&|v| v["inbound"][0]["spi"] = json!(255)),
            422,
            "reserved",
        ),
        (with(&|v| v["inbound"] = json!([])), 422, "inbound"),
        (with(&|v| v["peer"] = json!("198.18.20")), 422, "peer"),
        (with(&|v| v["vtep"] = json!("0.0.0.0")), 422, "vtep"),
        (with(&|v| v["vm_mac"] = json!("02:5f")), 422, "vm_mac"),
        (
            with(&|v| v["remote_prefixes"] = json!([])),
            422,
            "remote_prefixes",
        ),
        (
            with(&|v| v["remote_prefixes"] = json!(["198.18.170.1/24"])),
            422,
            "host bits",
        ),
        (
            with(&|v| v["local_prefixes"] = json!(["198.19.1.0/40"])),
            422,
            "0..=32",
        ),
        (
            with(&|v| v["replay_window"] = json!(32)),
            422,
            "replay_window",
        ),
        (with(&|v| v["vni"] = json!(0)), 422, "vni"),
        (with(&|v| v["bogus"] = json!(1)), 400, "unknown field"),
        (with(&|v| v["inbound"][0]["spi"] = json!("x")), 400, "spi"),
        // Another tenant's VNI, and a VNI nobody has: 403.
        (
            with(&|v| v["vni"] = json!(4101)),
            403,
            "not a VPC of tenant",
        ),
        (
            with(&|v| v["vni"] = json!(4999)),
            403,
            "not a VPC of tenant",
        ),
    ];
    for (b, status, needle) in &cases {
        api.refused(
            "PUT",
            "/v1/tenants/acme/ipsec/other",
            ADMIN,
            Some(b),
            *status,
            needle,
        );
    }
    // An inbound SPI another tunnel (another tenant's too) uses: 409.
    api.refused(
        "PUT",
        "/v1/tenants/globex/ipsec/g",
        ADMIN,
        Some(&body(tunnel(4101, 0x3000, &[0x2001]))),
        409,
        "already used",
    );
    // A tenant token: its own tunnels yes, another tenant's VNI or tenant no.
    let tok = api.admin("POST", "/v1/tenants/globex/tokens", None).body["token"]
        .as_str()
        .unwrap()
        .to_string();
    let own = body(tunnel(4101, 0x3000, &[0x3001]));
    let r = api.call("PUT", "/v1/tenants/globex/ipsec/g", Some(&tok), Some(&own));
    assert_eq!(r.status, 201, "{}", r.body);
    api.refused(
        "PUT",
        "/v1/tenants/globex/ipsec/h",
        &tok,
        Some(&body(tunnel(4100, 0x3002, &[0x3003]))),
        403,
        "not a VPC of tenant",
    );
    api.refused(
        "PUT",
        "/v1/tenants/acme/ipsec/h",
        &tok,
        Some(&own),
        403,
        "globex",
    );
    api.refused("GET", path, &tok, None, 403, "globex");
    // Deleting frees the SPIs.
    assert_eq!(
        api.admin("DELETE", "/v1/tenants/globex/ipsec/g", None)
            .status,
        204
    );
    let r = api.admin(
        "PUT",
        "/v1/tenants/globex/ipsec/g",
        Some(tunnel(4101, 0x3000, &[0x3001])),
    );
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(
        api.admin("DELETE", "/v1/tenants/globex/ipsec/g", None)
            .status,
        204
    );
    assert_eq!(api.admin("DELETE", path, None).status, 204);
    api.refused("GET", path, ADMIN, None, 404, "does not exist");
    for (t, v) in [("acme", "vpn"), ("globex", "gvpn")] {
        assert_eq!(
            api.admin("DELETE", &format!("/v1/tenants/{t}/vpcs/{v}"), None)
                .status,
            204
        );
    }
}

/// A RateSpec body as the API stores it: `min` and `debt` default to 0.
/// A chain re-encapsulates only into its tenant's own VPCs or a VNI no VPC has; a VPC
/// cannot take a VNI another tenant's chain sends into.
fn egress_suite(api: &Api) {
    let put = |path: &str, body: Value| {
        let r = api.admin("PUT", path, Some(body));
        assert_eq!(r.status, 201, "{path}: {}", r.body);
    };
    put("/v1/tenants/acme/vpcs/edge", json!({"vni": 4200}));
    put("/v1/tenants/globex/vpcs/edge", json!({"vni": 4201}));
    put("/v1/tenants/globex/nfs/gnat", snat("198.19.200.1"));
    let chain = |fwd: u32, rev: u32| {
        json!({"vpc": "edge", "nfs": ["gnat"],
               "forward": {"decap": true, "encap": {"dst": "198.18.0.9", "vni": fwd}},
               "reverse": {"decap": true, "encap": {"dst": "198.18.0.50", "vni": rev}}})
        .to_string()
    };
    let path = "/v1/tenants/globex/chains/out";
    // Into acme's VPC, either way: refused, and acme is not named.
    for body in [chain(4200, 4201), chain(4300, 4200)] {
        api.refused("PUT", path, ADMIN, Some(&body), 403, "another tenant's VPC");
        assert!(!api
            .call("PUT", path, Some(ADMIN), Some(&body))
            .message()
            .contains("acme"));
    }
    // Its own VPC back, a VNI no VPC has forward: accepted.
    let r = api.call("PUT", path, Some(ADMIN), Some(&chain(4300, 4201)));
    assert_eq!(r.status, 201, "{}", r.body);
    // Now no other tenant's VPC may take VNI 4300; globex's own may.
    api.refused(
        "PUT",
        "/v1/tenants/acme/vpcs/late",
        ADMIN,
        Some(&json!({"vni": 4300}).to_string()),
        409,
        "egress of another tenant's chain",
    );
    put("/v1/tenants/globex/vpcs/gw", json!({"vni": 4300}));
    for p in [
        "/v1/tenants/globex/chains/out",
        "/v1/tenants/globex/nfs/gnat",
        "/v1/tenants/globex/vpcs/gw",
        "/v1/tenants/globex/vpcs/edge",
        "/v1/tenants/acme/vpcs/edge",
    ] {
        let r = api.call("DELETE", p, Some(ADMIN), None);
        assert_eq!(r.status, 204, "{p}: {}", r.body);
    }
}

fn rates_after_defaults(v: &serde_json::Value) -> serde_json::Value {
    let mut v = v.clone();
    for kind in ["requests", "packets"] {
        for k in ["min", "debt"] {
            if v[kind][k].is_null() {
                v[kind][k] = json!(0.0);
            }
        }
    }
    v
}

#[test]
fn api_on_the_embedded_store() {
    let api = Api::start(|_| Arc::new(store::EmbeddedStore::in_memory().unwrap()));
    suite(&api);
}

#[test]
fn api_on_a_real_etcd() {
    let etcd = store::testing::EtcdServer::start();
    let api = Api::start(|rt| {
        Arc::new(
            rt.block_on(store::EtcdStore::connect(
                &etcd.endpoints(),
                "/starfabric-api-test/",
            ))
            .unwrap(),
        )
    });
    suite(&api);
}
