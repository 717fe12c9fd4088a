//! Shuffle-sharded placement through the real control sessions: SC nodes (six) register with
//! their capacities, tenants are created through the REST API, FM's directive carries
//! each tenant's shard set, and a node failure moves only the shards on that node.

use std::collections::BTreeMap;
use std::time::Duration;

use orchestrator::agent::Agent;
use proto::v1;
use serde_json::json;

use crate::common;
use common::{http, node_info, ready, wait, Orch};

fn agent(orch: &Orch, id: &str, role: v1::Role, capacity: Option<v1::NodeCapacity>) -> Agent {
    let addr = format!("127.0.0.1:{}", 7100 + id.len());
    orch.agent(
        v1::NodeHello {
            node: Some(node_info(id, role, &addr)),
            version: "test".into(),
            capacity,
            ..Default::default()
        },
        ready(),
    )
}

/// Tenant number → its SC nodes, from FM's latest directive.
fn shards(fm: &Agent) -> BTreeMap<u32, Vec<String>> {
    fm.directives()
        .borrow()
        .as_ref()
        .map(|d| {
            d.shards
                .iter()
                .map(|s| (s.tenant, s.sc_nodes.clone()))
                .collect()
        })
        .unwrap_or_default()
}

fn shared(a: &[String], b: &[String]) -> usize {
    a.iter().filter(|n| b.contains(n)).count()
}

#[test]
fn tenants_get_shard_sets_and_a_failure_moves_only_its_shards() {
    // Best Fit here: the decision must not depend on which model a build ships.
    let orch =
        Orch::start(|cfg| cfg.placement.algorithm = orchestrator::placement::Algorithm::BestFit);
    let base = orch.base.clone();
    let fm = agent(&orch, "fm-1", v1::Role::Fm, None);
    let mut scs: Vec<Agent> = (1..=6)
        .map(|i| {
            agent(
                &orch,
                &format!("sc-{i}"),
                v1::Role::Sc,
                Some(v1::NodeCapacity {
                    bw_gbps: 10.0,
                    cpu: 4.0,
                    mem_gib: 8.0,
                    price: 1.0,
                }),
            )
        })
        .collect();
    wait(Duration::from_secs(10), "six SC nodes up", || {
        let (_, v) = http(&base, "GET", "/v1/placement", None);
        (v["nodes"].as_array().map(|n| n.len()) == Some(6)).then_some(())
    });

    // Bad input is named and changes nothing.
    let (st, v) = http(
        &base,
        "PUT",
        "/v1/tenants/bad",
        Some(json!({"demand": {"bw_gbps": -1.0, "cpu": 1.0, "mem_gib": 1.0}})),
    );
    assert_eq!(st, 422, "{v}");
    assert_eq!(v["error"]["field"], "demand.bw_gbps", "{v}");
    for (body, field) in [
        (
            json!({"threshold": 0.8, "g_min": 4, "g_max": 3, "overlap": 2}),
            "g_max",
        ),
        (
            json!({"threshold": 0.8, "g_min": 3, "g_max": 3, "overlap": -1}),
            "overlap",
        ),
        (
            json!({"threshold": 1.5, "g_min": 3, "g_max": 3, "overlap": 2}),
            "threshold",
        ),
    ] {
        let (st, v) = http(&base, "PUT", "/v1/placement/limits", Some(body));
        assert_eq!(st, 422, "{v}");
        assert_eq!(v["error"]["field"], field, "{v}");
    }

    for (i, name) in ["acme", "globex", "initech"].iter().enumerate() {
        let (st, v) = http(
            &base,
            "PUT",
            &format!("/v1/tenants/{name}"),
            Some(json!({"demand": {"bw_gbps": 2.0 + i as f64, "cpu": 1.0, "mem_gib": 1.0}})),
        );
        assert_eq!(st, 201, "{v}");
    }
    let before = wait(Duration::from_secs(10), "three shard sets at FM", || {
        let s = shards(&fm);
        (s.len() == 3).then_some(s)
    });
    let sets: Vec<&Vec<String>> = before.values().collect();
    for s in &sets {
        assert_eq!(s.len(), 3, "G = 3: {before:?}");
    }
    for i in 0..3 {
        for j in i + 1..3 {
            assert!(shared(sets[i], sets[j]) <= 2, "O = 2: {before:?}");
        }
    }
    let (_, view) = http(&base, "GET", "/v1/placement", None);
    assert_eq!(view["violations"], json!([]), "{view}");
    assert_eq!(view["overlap"]["tenants"].as_array().unwrap().len(), 3);

    // Limits no placement can meet (G_min 7 > 6 nodes) are refused and change nothing.
    let (st, v) = http(
        &base,
        "PUT",
        "/v1/placement/limits",
        Some(json!({"threshold": 0.8, "g_min": 7, "g_max": 7, "overlap": 6})),
    );
    assert_eq!(st, 409, "{v}");
    let (_, view) = http(&base, "GET", "/v1/placement", None);
    assert_eq!(view["limits"]["g_min"], 3, "{view}");

    // The node most tenants use fails.
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    for s in before.values() {
        for n in s {
            *count.entry(n.as_str()).or_default() += 1;
        }
    }
    // A node some tenants use and some do not, so both halves of "only its shards
    // move" are tested; the most shared node if every used node is in every set.
    let (victim, _) = count
        .iter()
        .filter(|(_, c)| **c < 3)
        .max_by_key(|(n, c)| (**c, std::cmp::Reverse(**n)))
        .or_else(|| {
            count
                .iter()
                .max_by_key(|(n, c)| (**c, std::cmp::Reverse(**n)))
        })
        .unwrap();
    let victim = victim.to_string();
    let k: usize = victim.strip_prefix("sc-").unwrap().parse().unwrap();
    scs[k - 1].stop();
    println!("before {before:?}, killing {victim}");
    let after = wait(Duration::from_secs(10), "repaired shard sets", || {
        let s = shards(&fm);
        (s.len() == 3 && s.values().all(|set| !set.contains(&victim))).then_some(s)
    });
    for (t, old) in &before {
        let new = &after[t];
        if old.contains(&victim) {
            // Only the lost shard moved: the survivors are all still there.
            let kept: Vec<&String> = old.iter().filter(|n| **n != victim).collect();
            assert!(
                kept.iter().all(|n| new.contains(n)),
                "{t}: {old:?} -> {new:?}"
            );
            assert_eq!(new.len(), 3, "{t}: {new:?}");
        } else {
            assert_eq!(
                old, new,
                "tenant {t} had no shard on {victim} and must not move"
            );
        }
    }
    let sets: Vec<&Vec<String>> = after.values().collect();
    for i in 0..3 {
        for j in i + 1..3 {
            assert!(
                shared(sets[i], sets[j]) <= 2,
                "O = 2 after repair: {after:?}"
            );
        }
    }
    let (_, view) = http(&base, "GET", "/v1/placement", None);
    let moved: u64 = view["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["moves"].as_u64().unwrap())
        .sum();
    let affected = before.values().filter(|s| s.contains(&victim)).count() as u64;
    assert_eq!(
        moved, affected,
        "one shard moved per affected tenant: {view}"
    );

    // Fail the node a repaired set just gained. When keeping the survivors leaves no
    // node that respects O, the engine keeps the set and says why; nobody else moves.
    let repaired = after
        .iter()
        .find(|(t, s)| before[*t] != **s)
        .map(|(t, s)| (*t, s.clone()))
        .unwrap()
        .1;
    let gained = repaired
        .iter()
        .find(|n| !before.values().any(|s| s.contains(n)))
        .unwrap()
        .clone();
    let k: usize = gained.strip_prefix("sc-").unwrap().parse().unwrap();
    scs[k - 1].stop();
    let view = wait(Duration::from_secs(10), "the second failure judged", || {
        let (_, v) = http(&base, "GET", "/v1/placement", None);
        let node_down = v["nodes"]
            .as_array()?
            .iter()
            .any(|n| n["id"] == gained.as_str() && n["up"] == false);
        let judged = v["tenants"].as_array()?.iter().all(|x| {
            !x["sc_nodes"]
                .as_array()
                .is_some_and(|a| a.iter().any(|n| n == gained.as_str()))
                || x["error"].is_string()
        });
        (node_down && judged).then_some(v)
    });
    for x in view["tenants"].as_array().unwrap() {
        let set: Vec<String> = x["sc_nodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap().to_string())
            .collect();
        if set.contains(&gained) {
            // Kept as it was, with the reason.
            assert_eq!(set, repaired, "{view}");
            let e = x["error"].as_str().unwrap();
            assert!(e.contains("no node can replace"), "{e}");
        }
    }
    drop(fm);
    drop(orch);
}
