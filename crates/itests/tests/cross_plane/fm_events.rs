//! FM's event log and load report through a real FM, six SC nodes and a PP session over
//! gRPC: the events FM records for a scale-out, a refused scale-out, a replica death and
//! a scale-in, in that order and with their groups; `RecordEvent` accepting the
//! autoscaler's kinds and refusing FM's own; the JSON-lines file; and `Load` counting the
//! requests dispatched per group.

use crate::common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use common::{pp_session, snat_chain, wait, Cluster};
use fm::ScaleRequest;
use pipeline::RuleSource;
use proto::v1;
use serde_json::Value;

/// Ask for flows `range` (new ones, so each goes to SC) and wait for every answer.
fn ask(source: &RuleSource, range: std::ops::Range<u32>) {
    for r in common::ask(source, range) {
        assert!(r.result.is_ok(), "{:?}", r.result);
    }
}

fn kinds(events: &[v1::FmEvent]) -> Vec<&str> {
    events.iter().map(|e| e.kind.as_str()).collect()
}

fn detail(e: &v1::FmEvent) -> Value {
    serde_json::from_str(&e.detail_json).unwrap_or(Value::Null)
}

#[test]
fn fm_records_scales_refusals_deaths_and_repairs_and_reports_load_per_group() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("events.jsonl");
    let cfg = fm::FmConfig {
        chains: vec![snat_chain(&["198.19.255.1"])],
        events_file: Some(file.clone()),
        ..fm::FmConfig::default()
    };
    let mut cluster = Cluster::start_with(cfg, 6, Arc::new(sc::testing::TestNfs));
    let map0 = cluster.wait_groups(1, 3);
    let g1 = map0.groups[0].id;
    let (client, link) = pp_session(cluster.pp_config("pp-ev"));

    ask(&link.source, 0..300);
    let load = cluster.rt.block_on(cluster.fm.load()).unwrap();
    assert_eq!(load.groups.len(), 1, "{load:?}");
    assert_eq!(load.groups[0].group, g1);
    // At least once each (a request FM re-submits to a slow group counts again).
    assert!(
        load.groups[0].requests >= 300,
        "every new flow was dispatched to the one group: {load:?}"
    );
    let before = load.groups[0].requests;
    let pp: Vec<&v1::NodeLoad> = load
        .nodes
        .iter()
        .filter(|n| n.role == v1::Role::Pp as i32)
        .collect();
    assert_eq!(pp.len(), 1, "the PP session is a live node: {load:?}");
    assert_eq!(
        load.nodes
            .iter()
            .filter(|n| n.role == v1::Role::Sc as i32)
            .count(),
        6
    );

    let out = common::scale_out(&cluster.rt, &cluster.fm);
    let g2 = out.to_group;
    // No spare nodes are left: refused, and the refusal is an event too.
    let refused = cluster.rt.block_on(cluster.fm.scale(ScaleRequest::Out {
        tenant: 1,
        chain: 1,
        group: None,
        migration: None,
    }));
    assert!(refused.is_err());

    // Requests now split between the halves; both counters move.
    ask(&link.source, 300..700);
    let load2 = cluster.rt.block_on(cluster.fm.load()).unwrap();
    let req = |g: u64| {
        load2
            .groups
            .iter()
            .find(|x| x.group == g)
            .map(|x| x.requests)
    };
    let (r1, r2) = (req(g1).unwrap(), req(g2).unwrap());
    assert!(r1 > before && r2 > 0, "g1 {r1}, g2 {r2}");
    assert!(r1 - before + r2 >= 400, "the 400 new flows were dispatched");
    assert!(load2.fm_ms > load.fm_ms);

    // Kill a replica of the new group: dead, then repaired. No node is outside both
    // groups, so FM borrows one of the old group's (the fewest groups hosted).
    let old_group = map0
        .groups
        .iter()
        .flat_map(|g| g.replicas.iter())
        .map(|r| r.node_id.clone())
        .collect::<HashSet<_>>();
    let i = cluster
        .scs
        .iter()
        .position(|s| !old_group.contains(s.node_id()))
        .unwrap();
    let dead = cluster.scs[i].node_id().to_string();
    cluster.scs.remove(i).kill();
    wait(Duration::from_secs(5), "the repair", || {
        let m = cluster.map();
        m.groups
            .iter()
            .find(|g| g.id == g2)
            .filter(|g| g.replicas.len() == 3 && g.replicas.iter().all(|r| r.node_id != dead))
            .map(|_| ())
    });

    let inn = cluster
        .rt
        .block_on(cluster.fm.scale(ScaleRequest::In {
            tenant: 1,
            chain: 1,
            group: Some(g2),
        }))
        .unwrap();
    assert_eq!(inn.aborted, None);

    let all = cluster.rt.block_on(cluster.fm.events(0, 0)).unwrap();
    let ks = kinds(&all.events);
    println!("{ks:?}");
    assert_eq!(all.oldest_seq, 1);
    assert_eq!(all.next_seq, all.events.len() as u64 + 1);
    for (i, e) in all.events.iter().enumerate() {
        assert_eq!(e.seq, i as u64 + 1, "contiguous sequence numbers");
        assert!(e.unix_ms > 1_600_000_000_000, "a wall-clock time");
    }
    assert_eq!(ks.iter().filter(|k| **k == "sc_node_joined").count(), 6);
    assert_eq!(ks.iter().filter(|k| **k == "pp_node_joined").count(), 1);
    // The scale story, in order (other events may come between).
    let order = [
        "sc_group_created",
        "sc_scale_out_start",
        "sc_scale_out_done",
        "scale_refused",
        "sc_node_dead",
        "sc_group_repaired",
        "sc_scale_in_start",
        "sc_scale_in_done",
    ];
    let mut at = 0;
    for want in order {
        let found = ks[at..].iter().position(|k| *k == want);
        assert!(found.is_some(), "{want} after position {at}: {ks:?}");
        at += found.unwrap() + 1;
    }
    let find = |k: &str| all.events.iter().find(|e| e.kind == k).unwrap();
    let done = detail(find("sc_scale_out_done"));
    assert_eq!(done["from_group"], g1);
    assert_eq!(done["to_group"], g2);
    assert_eq!(done["moved_lo"].as_u64(), Some(out.moved_lo));
    assert!(done["st_to_fin_us"].as_u64().unwrap() > 0);
    assert_eq!(detail(find("sc_scale_in_done"))["from_group"], g2);
    let r = detail(find("scale_refused"));
    assert!(
        r["reason"]
            .as_str()
            .unwrap()
            .contains("needs 3 live SC nodes"),
        "{r}"
    );
    assert_eq!(detail(find("sc_node_dead"))["node"], dead.as_str());
    let rep = detail(find("sc_group_repaired"));
    assert_eq!(rep["group"], g2);
    assert_eq!(rep["dead"], dead.as_str());
    let added = rep["added"].as_str().unwrap_or_default().to_string();
    assert!(
        old_group.contains(&added),
        "a node of the old group was added: {rep}"
    );
    assert_eq!(rep["replicas"].as_array().unwrap().len(), 3);

    // since/limit over gRPC, and RecordEvent.
    cluster.rt.block_on(async {
        let mut c = cluster.fm_operator(&cluster.fm_addr()).await;
        let page = c
            .events(v1::EventsRequest {
                since_seq: 3,
                limit: 2,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            page.events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![3, 4]
        );
        assert_eq!(page.next_seq, 5);
        let seq = c
            .record_event(v1::RecordEventRequest {
                kind: "autoscale_decision".into(),
                message: "scale out".into(),
                detail_json: r#"{"utilisation": 1.5}"#.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .seq;
        assert_eq!(seq, all.next_seq);
        for (kind, detail) in [
            ("sc_scale_out_done", ""),
            ("no_such_kind", ""),
            ("autoscale_decision", "{not json"),
        ] {
            let e = c
                .record_event(v1::RecordEventRequest {
                    kind: kind.into(),
                    message: String::new(),
                    detail_json: detail.into(),
                })
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{kind}: {e}");
        }
        let tail = c
            .events(v1::EventsRequest {
                since_seq: seq,
                limit: 0,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(kinds(&tail.events), vec!["autoscale_decision"]);
        assert_eq!(detail(&tail.events[0])["utilisation"], 1.5);
    });

    // The file has every event, in order, as JSON lines.
    let lines: Vec<fm::Event> = std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), all.events.len() + 1);
    assert_eq!(lines.last().unwrap().kind, fm::EventKind::AutoscaleDecision);
    drop(client);
}
