//! PrivateLink through the REST API over real HTTP (docs/privatelink.md): a provider
//! publishes a service with an allow-list, a consumer makes an endpoint in its own
//! VPC and a `privatelink` NF naming it, which the orchestrator resolves. Every refusal
//! leaves the store revision where it was.

use crate::common;

use common::{Orch, ADMIN};
use orchestrator::client::Reply;
use serde_json::{json, Value};

/// An orchestrator with an in-memory store, called over its REST API.
struct Api {
    orch: Orch,
}

impl Api {
    fn start() -> Api {
        Api {
            orch: Orch::start(|_| {}),
        }
    }

    fn call(&self, token: &str, method: &str, path: &str, body: Option<Value>) -> Reply {
        orchestrator::client::Client::new(&self.orch.base, Some(token))
            .exchange_raw(method, path, body.map(|b| b.to_string()).as_deref())
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    fn admin(&self, method: &str, path: &str, body: Option<Value>) -> Reply {
        self.call(ADMIN, method, path, body)
    }

    fn ok(&self, method: &str, path: &str, body: Value, status: u16) -> Value {
        let r = self.admin(method, path, Some(body));
        assert_eq!(r.status, status, "{method} {path}: {}", r.body);
        r.body
    }

    fn revision(&self) -> u64 {
        self.admin("GET", "/v1/status", None).body["store_revision"]
            .as_u64()
            .unwrap()
    }

    /// A refused request: its status, a message with `needle`, and no state change.
    fn refused(
        &self,
        token: &str,
        method: &str,
        path: &str,
        body: Value,
        status: u16,
        needle: &str,
    ) {
        let before = self.revision();
        let r = self.call(token, method, path, Some(body.clone()));
        assert_eq!(r.status, status, "{method} {path} {body}: {}", r.body);
        let m = r.body["error"]["message"].as_str().unwrap_or_default();
        assert!(m.contains(needle), "{m:?} should mention {needle:?}");
        assert_eq!(
            self.revision(),
            before,
            "{method} {path} {body} changed the state"
        );
    }
}

const SVC: &str = "/v1/tenants/bravo/endpoint-services/web";
const EP: &str = "/v1/tenants/alpha/privatelink-endpoints/web";

fn service(allowed: &[&str]) -> Value {
    json!({"vpc": "main", "vip": "198.19.1.2", "port": 80,
           "source_addresses": ["198.19.9.1"], "allowed_tenants": allowed})
}

fn endpoint(vni: u32, address: &str) -> Value {
    json!({"vni": vni, "address": address, "service": {"tenant": "bravo", "name": "web"}})
}

#[test]
fn privatelink_objects_are_checked_resolved_and_refused_with_the_right_status() {
    let api = Api::start();
    // Two tenants whose VPCs use the same prefix.
    for (t, vni) in [("alpha", 100), ("bravo", 101)] {
        api.ok("PUT", &format!("/v1/tenants/{t}"), json!({}), 201);
        api.ok(
            "PUT",
            &format!("/v1/tenants/{t}/vpcs/main"),
            json!({"vni": vni, "cidrs": ["198.19.0.0/16"]}),
            201,
        );
    }
    let alpha = api.admin("POST", "/v1/tenants/alpha/tokens", None).body["token"]
        .as_str()
        .unwrap()
        .to_string();

    // ---- the provider publishes, to nobody yet; bad services are 422 (400 for JSON
    // of the wrong shape, as everywhere in this API).
    let bad_services = [
        (json!({"vip": "nope"}), 422, "not an IP address"),
        (json!({"vip": "0.0.0.0"}), 422, "unicast"),
        (json!({"port": 0}), 422, "port"),
        (json!({"source_addresses": []}), 422, "at least one"),
        (
            json!({"source_addresses": ["198.19.1.2"]}),
            422,
            "not the VIP",
        ),
        (json!({"vip": "198.20.1.2"}), 422, "outside VPC"),
        (json!({"vpc": "other"}), 422, "does not exist"),
        (
            json!({"allowed_tenants": ["Not_A_Name"]}),
            422,
            "not a valid name",
        ),
        (json!({"colour": "red"}), 400, "unknown field"),
    ];
    for (edit, status, needle) in bad_services {
        let mut body = service(&[]);
        for (k, v) in edit.as_object().unwrap() {
            body[k] = v.clone();
        }
        api.refused(ADMIN, "PUT", SVC, body, status, needle);
    }
    let s = api.ok("PUT", SVC, service(&[]), 201);
    assert_eq!(s["vni"], 101);

    // ---- not published to the consumer: 403, also for a service that does not exist.
    api.refused(
        &alpha,
        "PUT",
        EP,
        endpoint(100, "198.19.7.10"),
        403,
        "not published",
    );
    let mut ghost = endpoint(100, "198.19.7.10");
    ghost["service"]["name"] = json!("ghost");
    api.refused(&alpha, "PUT", EP, ghost, 403, "not published");
    // The consumer cannot read or write the provider's objects.
    api.refused(&alpha, "PUT", SVC, service(&["alpha"]), 403, "");
    api.ok("PUT", SVC, service(&["alpha"]), 200);

    // ---- a VNI the consumer does not own: 403 (another tenant's, or nobody's).
    api.refused(
        &alpha,
        "PUT",
        EP,
        endpoint(101, "198.19.7.10"),
        403,
        "not the VNI",
    );
    api.refused(
        &alpha,
        "PUT",
        EP,
        endpoint(4242, "198.19.7.10"),
        403,
        "not the VNI",
    );

    // ---- malformed endpoints: 422 (400 for the wrong JSON shape).
    let mut zero_port = endpoint(100, "198.19.7.10");
    zero_port["port"] = json!(0);
    for (body, status, needle) in [
        (endpoint(100, "198.19.7"), 422, "not an IP address"),
        (endpoint(0, "198.19.7.10"), 422, "vni must be"),
        (zero_port, 422, "port"),
        (endpoint(100, "198.20.7.10"), 422, "outside VPC"),
        (endpoint(100, "2001:db8::1"), 422, "family"),
        (
            json!({"vni": 100, "address": "198.19.7.10"}),
            400,
            "service",
        ),
    ] {
        api.refused(&alpha, "PUT", EP, body, status, needle);
    }

    // ---- the endpoint, by the consumer's own token.
    let r = api.call(&alpha, "PUT", EP, Some(endpoint(100, "198.19.7.10")));
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(
        (r.body["vpc"].as_str(), r.body["port"].as_u64()),
        (Some("main"), Some(80))
    );

    // ---- overlap with an address in use on the VNI: 409 — another endpoint's, or a
    // pool address of the tenant's NFs.
    let other = "/v1/tenants/alpha/privatelink-endpoints/web2";
    api.refused(
        &alpha,
        "PUT",
        other,
        endpoint(100, "198.19.7.10"),
        409,
        "already endpoint",
    );
    api.ok(
        "PUT",
        "/v1/tenants/alpha/nfs/nat",
        json!({"kind": "snat", "config": {"pools": [{"addresses": ["198.19.7.20"]}]}}),
        201,
    );
    api.refused(
        &alpha,
        "PUT",
        other,
        endpoint(100, "198.19.7.20"),
        409,
        "in use by NF",
    );
    // The same address in the provider's VPC is the provider's business.
    api.ok(
        "PUT",
        "/v1/tenants/bravo/endpoint-services/web2",
        json!({
        "vpc": "main", "vip": "198.19.7.10", "port": 80,
        "source_addresses": ["198.19.9.2"], "allowed_tenants": ["alpha"]}),
        201,
    );

    // ---- the consumer's NF names the endpoint and is stored resolved.
    let bad_nfs = [
        (json!({"endpoints": []}), "non-empty"),
        (json!({"endpoints": ["nope"]}), "does not exist"),
        (
            json!({"endpoints": ["web"], "source": {"addresses": ["198.19.9.9"]}}),
            "unknown field",
        ),
    ];
    for (config, needle) in bad_nfs {
        let body = json!({"kind": "privatelink", "config": config});
        api.refused(
            &alpha,
            "PUT",
            "/v1/tenants/alpha/nfs/link",
            body,
            422,
            needle,
        );
    }
    let nf = api.ok(
        "PUT",
        "/v1/tenants/alpha/nfs/link",
        json!({"kind": "privatelink", "config": {"endpoints": ["web"]}}),
        201,
    );
    let c = &nf["config"];
    assert_eq!(c["endpoints"][0]["address"], "198.19.7.10");
    assert_eq!(c["endpoints"][0]["service_addr"], "198.19.1.2");
    assert_eq!(c["endpoints"][0]["service_port"], 80);
    assert_eq!(c["source"]["addresses"], json!(["198.19.9.1"]));
    // It builds into a chain toward the provider VPC's host on its VNI.
    api.ok(
        "PUT",
        "/v1/tenants/alpha/chains/link",
        json!({"vpc": "main", "nfs": ["link"],
               "forward": {"decap": true, "encap": {"dst": "198.18.11.2", "vni": 101}},
               "reverse": {"decap": true, "encap": {"dst": "198.18.10.2", "vni": 100}}}),
        201,
    );

    // ---- what is in use cannot be pulled away: 409.
    api.refused(ADMIN, "PUT", SVC, service(&[]), 409, "allowed_tenants");
    api.refused(ADMIN, "DELETE", SVC, json!(null), 409, "used by endpoint");
    api.refused(&alpha, "DELETE", EP, json!(null), 409, "served by NF");
    api.refused(
        ADMIN,
        "DELETE",
        "/v1/tenants/bravo/vpcs/main",
        json!(null),
        409,
        "endpoint service",
    );

    // ---- released in order, the address is free again.
    for p in ["chains/link", "nfs/link", "privatelink-endpoints/web"] {
        let r = api.call(&alpha, "DELETE", &format!("/v1/tenants/alpha/{p}"), None);
        assert_eq!(r.status, 204, "{p}: {}", r.body);
    }
    let r = api.call(&alpha, "PUT", other, Some(endpoint(100, "198.19.7.10")));
    assert_eq!(r.status, 201, "{}", r.body);
    api.refused(
        ADMIN,
        "DELETE",
        "/v1/tenants/alpha/vpcs/main",
        json!(null),
        409,
        "PrivateLink endpoint",
    );
    let listed = api.call(
        &alpha,
        "GET",
        "/v1/tenants/alpha/privatelink-endpoints",
        None,
    );
    assert_eq!(
        listed.body["items"].as_array().map(Vec::len),
        Some(1),
        "{}",
        listed.body
    );

    // ---- the OpenAPI document describes the new paths.
    let doc = api.admin("GET", "/openapi.json", None).body;
    for p in [
        "/v1/tenants/{tenant}/endpoint-services/{name}",
        "/v1/tenants/{tenant}/privatelink-endpoints/{name}",
    ] {
        assert!(doc["paths"][p]["put"].is_object(), "{p} missing");
    }
}
