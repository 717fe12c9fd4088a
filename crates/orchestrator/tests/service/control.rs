//! Reconciliation over real gRPC: node agents register, report and receive directives
//! that follow the desired state written through the REST API; silent nodes go down.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use orchestrator::agent::Agent;
use proto::v1;
use serde_json::{json, Value};

use crate::common;
use common::{http, node_info, put_created, ready, wait, Orch};

fn agent(
    orch: &Orch,
    id: &str,
    role: v1::Role,
    addr: &str,
    cluster: &str,
    report: orchestrator::agent::ReportFn,
) -> Agent {
    orch.agent(
        v1::NodeHello {
            node: Some(node_info(id, role, addr)),
            cluster: cluster.into(),
            metrics_url: format!("http://{addr}/metrics"),
            version: "test".into(),
            capacity: None,
        },
        report,
    )
}

fn latest(a: &Agent) -> Option<v1::Directive> {
    a.directives().borrow().clone()
}

#[test]
fn directives_follow_desired_state_and_silent_nodes_go_down() {
    let orch = Orch::start(|_| {});
    let base = orch.base.clone();

    let mut fm = agent(&orch, "fm-1", v1::Role::Fm, "127.0.0.1:7000", "", ready());
    let packets = Arc::new(AtomicU64::new(0));
    let p2 = packets.clone();
    let mut pp = agent(
        &orch,
        "pp-1",
        v1::Role::Pp,
        "127.0.0.1:4789",
        "",
        Arc::new(move || v1::NodeReport {
            ready: true,
            tenants: vec![v1::TenantCounters {
                tenant: 1,
                packets: p2.load(Ordering::Relaxed),
                bytes: 700,
                drops: 1,
                flows: 2,
            }],
            rates: vec![v1::TenantRateStatus {
                tenant: 1,
                kind: "requests".into(),
                state: "burst".into(),
                credit: 1234.0,
                allowance: 3000.0,
                offered_rate: 9000.0,
                admitted_rate: 2990.0,
                refused: 77,
            }],
            ..Default::default()
        }),
    );
    let _sc = agent(&orch, "sc-1", v1::Role::Sc, "127.0.0.1:7100", "", ready());

    // Every node learns the FM; the FM serves nothing yet.
    let d = wait(Duration::from_secs(10), "PP directive with the FM", || {
        latest(&pp).filter(|d| d.fm_addrs == ["127.0.0.1:7000"])
    });
    assert!(d.vpcs.is_empty());
    assert!(wait(Duration::from_secs(5), "FM directive", || latest(&fm))
        .chains
        .is_empty());

    // Nodes are listed up, with their PP cluster defaulted.
    let nodes = wait(Duration::from_secs(5), "3 ready nodes", || {
        let (_, v) = http(&base, "GET", "/v1/nodes", None);
        let n = v.as_array()?.clone();
        (n.len() == 3 && n.iter().all(|x| x["status"] == "up" && x["ready"] == true)).then_some(n)
    });
    let ppn = nodes.iter().find(|n| n["id"] == "pp-1").unwrap();
    assert_eq!(ppn["cluster"], "default");
    assert_eq!(ppn["role"], "pp");

    // A tenant with SNAT on VNI 100 reaches FM (the chain) and PP (the binding).
    for (path, body) in [
        ("/v1/tenants/acme", json!({})),
        ("/v1/tenants/acme/vpcs/main", json!({"vni": 100})),
        (
            "/v1/tenants/acme/nfs/nat",
            json!({"kind": "snat", "config": {"pools": [{"addresses": ["198.18.100.1"]}]}}),
        ),
        // A second tenant on another PP cluster: its VPC must not reach pp-1.
        ("/v1/tenants/east", json!({"pp_cluster": "east"})),
        ("/v1/tenants/east/vpcs/main", json!({"vni": 900})),
        (
            "/v1/tenants/east/nfs/nat",
            json!({"kind": "snat", "config": {"pools": [{"addresses": ["198.18.100.2"]}]}}),
        ),
        (
            "/v1/tenants/east/chains/out",
            json!({"vpc": "main", "nfs": ["nat"]}),
        ),
    ] {
        put_created(&base, path, body);
    }
    // VPC without a chain: not bound yet.
    std::thread::sleep(Duration::from_millis(300));
    assert!(latest(&pp).unwrap().vpcs.is_empty());
    let (s, c) = http(
        &base,
        "PUT",
        "/v1/tenants/acme/chains/out",
        Some(json!({"vpc": "main", "nfs": ["nat"],
        "forward": {"decap": true, "encap": {"dst": "198.18.0.9", "vni": 300}}})),
    );
    assert_eq!(s, 201, "{c}");
    let d = wait(Duration::from_secs(5), "the binding at PP", || {
        latest(&pp).filter(|d| !d.vpcs.is_empty())
    });
    assert_eq!(
        d.vpcs,
        [v1::VpcBinding {
            vni: 100,
            tenant: 1,
            chain: 1
        }]
    );
    let f = wait(Duration::from_secs(5), "both chains at FM", || {
        latest(&fm).filter(|d| d.chains.len() == 2)
    });
    let acme = f.chains.iter().find(|c| c.tenant == 1).unwrap();
    assert_eq!(acme.chain, 1);
    let nf: Value = serde_json::from_str(&acme.nfs[0]).unwrap();
    assert_eq!(nf["kind"], "snat");
    assert_eq!(nf["pools"][0]["addresses"][0], "198.18.100.1");
    assert_eq!(f.partitions.len(), 2);
    assert!(f
        .partitions
        .iter()
        .all(|p| p.hash_lo == 0 && p.hash_hi == u64::MAX));
    // Directive versions only grow; the node reports what it applied.
    let v = latest(&pp).unwrap().version;
    pp.set_applied(v);
    wait(Duration::from_secs(5), "applied version reported", || {
        let (_, n) = http(&base, "GET", "/v1/nodes/pp-1", None);
        (n["applied_version"].as_u64() == Some(v) && n["desired_version"].as_u64() == Some(v))
            .then_some(())
    });

    // Rates reach the PP nodes the tenant is bound on, and only those tenants'.
    for t in ["acme", "east"] {
        let (s, b) = http(
            &base,
            "PUT",
            &format!("/v1/tenants/{t}/rates"),
            Some(json!({"requests": {"base": 1000.0, "burst": 3000.0}})),
        );
        assert_eq!(s, 200, "{b}");
    }
    let d = wait(Duration::from_secs(5), "the rates at PP", || {
        latest(&pp).filter(|d| !d.rates.is_empty())
    });
    assert_eq!(
        d.rates.len(),
        1,
        "east's VPC is on another cluster: {:?}",
        d.rates
    );
    assert_eq!(d.rates[0].tenant, 1);
    let r = d.rates[0].requests.unwrap();
    assert_eq!((r.min, r.base, r.burst, r.debt), (0.0, 1000.0, 3000.0, 0.0));
    assert!(d.rates[0].packets.is_none());
    // The node's reported credit state shows in the tenant's stats and rates.
    wait(Duration::from_secs(5), "rate state in stats", || {
        let (_, s) = http(&base, "GET", "/v1/tenants/acme/stats", None);
        (s["rates"][0]["state"] == "burst"
            && s["rates"][0]["node"] == "pp-1"
            && s["rates"][0]["refused"] == 77)
            .then_some(())
    });
    let (_, r) = http(&base, "GET", "/v1/tenants/acme/rates", None);
    assert_eq!(r["status"][0]["credit"], 1234.0, "{r}");
    assert_eq!(r["rates"]["requests"]["burst"], 3000.0);
    let v = latest(&pp).unwrap().version;
    pp.set_applied(v);

    // Reported counters add up per tenant.
    packets.store(7, Ordering::Relaxed);
    wait(Duration::from_secs(5), "tenant stats", || {
        let (_, s) = http(&base, "GET", "/v1/tenants/acme/stats", None);
        (s["packets"] == 7 && s["bytes"] == 700 && s["drops"] == 1 && s["flows_set_up"] == 2)
            .then_some(())
    });

    // Deleting the chain unbinds the VNI at PP and removes it from FM.
    assert_eq!(
        http(&base, "DELETE", "/v1/tenants/acme/chains/out", None).0,
        204
    );
    wait(Duration::from_secs(5), "unbinding", || {
        latest(&pp).filter(|d| d.vpcs.is_empty())
    });
    wait(Duration::from_secs(5), "FM chain removal", || {
        latest(&fm).filter(|d| d.chains.len() == 1)
    });

    // A node that goes silent is marked down; the FM going away reaches PP.
    fm.stop();
    wait(Duration::from_secs(5), "FM marked down", || {
        let (_, n) = http(&base, "GET", "/v1/nodes/fm-1", None);
        (n["status"] == "down").then_some(())
    });
    wait(Duration::from_secs(5), "PP told the FM is gone", || {
        latest(&pp).filter(|d| d.fm_addrs.is_empty())
    });
    let (_, st) = http(&base, "GET", "/v1/status", None);
    assert_eq!(st["nodes_down"], 1);
    assert_eq!(st["healthy"], false);
    pp.stop();
}

/// A node whose session stays open but whose reports stop (a hung process) is marked
/// down after `miss_limit` report periods.
#[test]
fn a_node_that_stops_reporting_is_marked_down() {
    let orch = Orch::start(|_| {});
    let (base, control) = (orch.base.clone(), orch.control.clone());
    // The clock starts before the hello is sent: the orchestrator stamps the node's last
    // report when it reads the hello, which is after this instant, so "down" can't come
    // sooner than three periods after it. (Started after the session opened, as it was,
    // the hello's own delay came off the measured time and the bound failed by 1 ms.)
    let t0 = Instant::now();
    // Hello, then silence, with the stream held open.
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(v1::NodeUp {
        msg: Some(v1::node_up::Msg::Hello(v1::NodeHello {
            node: Some(node_info("sc-hung", v1::Role::Sc, "127.0.0.1:1")),
            ..Default::default()
        })),
    })
    .unwrap();
    let tls = orch.node_tls(proto::tls::Role::Sc, "sc-hung");
    let _stream = orch.rt.block_on(async {
        let ch = proto::connect(&control, tls.as_ref(), proto::tls::Role::Orchestrator)
            .await
            .unwrap();
        let mut c = v1::control_client::ControlClient::new(ch);
        c.node_session(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner()
    });
    wait(Duration::from_secs(5), "registered", || {
        let (s, _) = http(&base, "GET", "/v1/nodes/sc-hung", None);
        (s == 200).then_some(())
    });
    wait(Duration::from_secs(5), "marked down", || {
        let (_, n) = http(&base, "GET", "/v1/nodes/sc-hung", None);
        (n["status"] == "down").then_some(())
    });
    // Not before three silent periods.
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t0.elapsed()
    );
    drop(tx);
}
