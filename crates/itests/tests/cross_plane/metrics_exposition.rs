//! The `/metrics` expositions of all three node kinds (PP, FM, SC) from populated
//! snapshots, and the Grafana dashboard against them.
use std::sync::{Arc, Mutex};

use fm::metrics::{fm_exporter, FmSnapshot};
use pipeline::{DropReason, Pipeline};
use pipeline::{PipelineConfig, RuleSource, VpcBinding};
use pp::metrics::{pp_exporter, PpSnapshot};
use pp::UdpVxlanStats;
use sc::metrics::{sc_exporter, ScSnapshot};
use telemetry::scrape;
use testkit::rig::node;

fn pipeline() -> Pipeline {
    let mut cfg = PipelineConfig::new(node());
    cfg.flow_capacity = 1024;
    let mut p = Pipeline::new(cfg, RuleSource::None).unwrap();
    p.bind_vpc(
        100,
        VpcBinding {
            tenant: 7,
            chain: 1,
        },
    );
    p
}

/// Expositions of all three node kinds from populated snapshots.
fn expositions() -> Vec<Vec<scrape::Sample>> {
    let mut snap = PpSnapshot::of(&pipeline(), Some(UdpVxlanStats::default()));
    snap.stats.setup_latency.observe_us(3_000);
    snap.stats.misses = 4;
    let pp = pp_exporter(Arc::new(Mutex::new(snap)), None);

    let mut f = FmSnapshot {
        live_pp: 1,
        live_sc: 3,
        groups: 1,
        ..FmSnapshot::default()
    };
    f.stats.pp_requests = 5;
    f.down_full = [0, 0, 2];
    f.metrics.tenant_requests = vec![(7, 5)];
    f.metrics.request_latency.observe_us(800);
    let fm = fm_exporter(Arc::new(Mutex::new(f)));

    let g = sc::GroupMetrics {
        state: proto::v1::GroupState {
            group: 3,
            epoch: 2,
            position: 2,
            length: 3,
            ..Default::default()
        },
        stats: sc::ReplicaStats {
            requests_applied: 9,
            ..Default::default()
        },
        tenant: 7,
        chain: 1,
        parked: true,
        worker: None,
    };
    let sc = sc_exporter(Arc::new(Mutex::new(ScSnapshot {
        groups: vec![g.clone(), g],
        ..ScSnapshot::default()
    })));
    [pp, fm, sc]
        .iter()
        .map(|e| scrape::parse(&e.encode().unwrap()))
        .collect()
}

#[test]
fn snapshots_render_the_named_series() {
    let all = expositions();
    let (pp, fm, sc) = (&all[0], &all[1], &all[2]);
    let v = |s: &[scrape::Sample], n: &str, l: &[(&str, &str)]| scrape::value(s, n, l);
    assert_eq!(v(pp, "starfabric_pp_misses_total", &[]), Some(4.0));
    for r in DropReason::FIXED {
        assert_eq!(
            v(pp, "starfabric_pp_drops_total", &[("reason", r.name())]),
            Some(0.0),
            "{r:?}"
        );
    }
    // (series, labels, value) each exposition must hold.
    type Want = (&'static str, &'static [(&'static str, &'static str)], f64);
    let pp_wants: &[Want] = &[
        (
            "starfabric_pp_tenant_packets_total",
            &[("tenant", "7")],
            0.0,
        ),
        ("starfabric_pp_flow_table_capacity", &[], 1024.0),
        (
            "starfabric_pp_rule_setup_seconds_bucket",
            &[("le", "0.0025")],
            0.0,
        ),
        (
            "starfabric_pp_rule_setup_seconds_bucket",
            &[("le", "0.005")],
            1.0,
        ),
        ("starfabric_pp_fm_connected", &[], 0.0),
    ];
    let fm_wants: &[Want] = &[
        (
            "starfabric_fm_tenant_requests_total",
            &[("tenant", "7")],
            5.0,
        ),
        ("starfabric_fm_live_nodes", &[("role", "sc")], 3.0),
        ("starfabric_fm_request_seconds_count", &[], 1.0),
        (
            "starfabric_fm_down_queue_full_total",
            &[("kind", "submits")],
            2.0,
        ),
    ];
    let sc_wants: &[Want] = &[
        (
            "starfabric_sc_replica_role",
            &[("group", "3"), ("role", "tail")],
            1.0,
        ),
        (
            "starfabric_sc_group_requests_applied_total",
            &[("position", "2")],
            9.0,
        ),
        // Two groups of tenant 7 on this node are summed.
        (
            "starfabric_sc_requests_applied_total",
            &[("tenant", "7")],
            18.0,
        ),
        // Both parked: the chain runs no replica here.
        (
            "starfabric_sc_chain_replicas_running",
            &[("tenant", "7"), ("chain", "1")],
            0.0,
        ),
        ("starfabric_sc_replica_parked", &[("group", "3")], 1.0),
        ("starfabric_sc_replica_wake_seconds_count", &[], 0.0),
    ];
    for (samples, wants) in [(pp, pp_wants), (fm, fm_wants), (sc, sc_wants)] {
        for &(name, labels, want) in wants {
            assert_eq!(v(samples, name, labels), Some(want), "{name} {labels:?}");
        }
    }
}

/// Every metric a dashboard expression names is a series some node exports.
#[test]
fn dashboard_queries_only_exported_metrics() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/grafana/starfabric.json"
    );
    let d: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(d["schemaVersion"].as_u64().unwrap() >= 36);
    assert_eq!(d["__inputs"][0]["name"], "DS_PROMETHEUS");
    let have: std::collections::BTreeSet<String> = expositions()
        .into_iter()
        .flatten()
        .map(|s| s.name)
        .collect();
    let mut exprs = 0;
    for p in d["panels"].as_array().unwrap() {
        assert_eq!(p["datasource"]["uid"], "${DS_PROMETHEUS}", "{}", p["title"]);
        let targets = p["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{}", p["title"]);
        for t in targets {
            let expr = t["expr"].as_str().unwrap();
            exprs += 1;
            let names: Vec<&str> = expr
                .match_indices("starfabric_")
                .map(|(i, _)| {
                    let tail = &expr[i..];
                    let end = tail
                        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .unwrap_or(tail.len());
                    &tail[..end]
                })
                .collect();
            assert!(!names.is_empty(), "{expr}");
            for n in names {
                assert!(have.contains(n), "{expr}: {n} is not exported");
            }
        }
    }
    assert!(exprs >= 16);
}
