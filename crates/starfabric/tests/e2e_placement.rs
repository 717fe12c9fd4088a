//! Shuffle-sharded placement end to end (docs/placement.md): `starfabric up` with five
//! SC nodes and the PP node in the testbed's PP namespace, three tenants made through
//! the CLI, each with SNAT toward the internet host. Their shard sets must satisfy
//! Eq. 5–6 (three SC nodes each, no two tenants sharing more than two), real TCP from
//! each tenant's client must flow, and when an SC node is killed only the shards on that
//! node move: tenants without a shard there keep their sets, the others keep their
//! surviving nodes, and traffic flows again for all three.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use testbed::services;
use testbed::topo::{addr, mac, vni, Node};

use common::{Lab, BIN};

const TENANTS: usize = 3;

struct Cli<'a> {
    lab: &'a Lab,
    config: String,
}

impl Cli<'_> {
    fn run(&self, args: &[&str]) -> String {
        let env = format!("STARFABRIC_CONFIG={}", self.config);
        let mut argv = vec!["env", &env, BIN];
        argv.extend_from_slice(args);
        let out = self
            .lab
            .tb()
            .exec(Node::Ctl, &argv, Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("starfabric {}: {e}", args.join(" ")));
        println!("$ starfabric {}\n{out}", args.join(" "));
        out
    }

    fn placement(&self) -> Value {
        serde_json::from_str(&self.run(&["placement", "show", "-o", "json"])).unwrap()
    }
}

fn sets(v: &Value) -> BTreeMap<String, Vec<String>> {
    v["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["tenant"].as_str().unwrap().to_string(),
                t["sc_nodes"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|n| n.as_str().unwrap().to_string())
                    .collect(),
            )
        })
        .collect()
}

fn check_constraints(v: &Value) {
    let s = sets(v);
    assert_eq!(s.len(), TENANTS, "{v}");
    for (t, nodes) in &s {
        assert_eq!(nodes.len(), 3, "tenant {t}: G = 3, got {nodes:?}");
    }
    let all: Vec<&Vec<String>> = s.values().collect();
    for i in 0..all.len() {
        for j in i + 1..all.len() {
            let shared = all[i].iter().filter(|n| all[j].contains(n)).count();
            assert!(shared <= 2, "O = 2 broken: {s:?}");
        }
    }
    assert_eq!(v["violations"], serde_json::json!([]), "{v}");
}

/// The client of tenant `j` reaches the internet host through its SNAT pool address.
fn curl_ok(lab: &Lab, j: usize) {
    let url = format!("http://{}/", addr::INET);
    let seen = testbed::cmd::wait_for(
        &format!("tenant {j}'s HTTP request"),
        Duration::from_secs(30),
        || {
            let out = lab.tb().exec_full(
                Node::Client(j),
                &["curl", "-sS", "--max-time", "2", &url],
                Duration::from_secs(5),
            )?;
            Ok(out.ok().then(|| out.stdout.trim().to_string()))
        },
    )
    .unwrap();
    let pool = addr::pool(j).to_string();
    assert!(
        seen.starts_with(&format!("inet {pool}:")),
        "tenant {j}: the internet host saw {seen:?}, not {pool}"
    );
}

#[test]
fn three_tenants_get_shard_sets_and_an_sc_failure_moves_only_its_shards() {
    let Some(lab) = Lab::new(TENANTS, 0) else {
        return;
    };
    let tb = lab.tb();
    let _inet = services::start_inet(tb, false).unwrap();
    let config = tb.path("cli.json").display().to_string();
    let up = tb
        .spawn_up(
            Path::new(BIN),
            Path::new(&config),
            &tb.path("up"),
            &[
                "--sc",
                "5",
                "--shard-min",
                "3",
                "--shard-max",
                "3",
                "--shard-overlap",
                "2",
            ],
        )
        .unwrap();
    tb.wait_log(&up, "up: ready", Duration::from_secs(120))
        .unwrap();
    let cli = Cli { lab: &lab, config };
    let to_inet = format!("{}:{}@{}", addr::IGW, vni::INTERNET, mac::IGW);
    for j in 0..TENANTS {
        let t = format!("t{j}");
        let v = vni::tenant(j).to_string();
        let pool = addr::pool(j).to_string();
        let back = format!(
            "{}:{}@{}",
            addr::client_underlay(j),
            vni::tenant(j),
            mac::client(j)
        );
        cli.run(&["tenant", "create", &t, "--demand", "bw=1,cpu=0.5,mem=1"]);
        cli.run(&["vpc", "create", "main", "--tenant", &t, "--vni", &v]);
        cli.run(&[
            "nf", "create", "snat", "out", "--tenant", &t, "--pool", &pool,
        ]);
        cli.run(&[
            "chain", "create", "main", "--tenant", &t, "--vpc", "main", "--nfs", "out", "--egress",
            &to_inet, "--return", &back, "--wait",
        ]);
    }
    let before = testbed::cmd::wait_for("three placements", Duration::from_secs(20), || {
        let v = cli.placement();
        Ok((sets(&v).values().filter(|s| !s.is_empty()).count() == TENANTS).then_some(v))
    })
    .unwrap();
    check_constraints(&before);
    println!("{}", cli.run(&["placement", "show"]));
    for j in 0..TENANTS {
        curl_ok(&lab, j);
    }

    // Kill the SC node most tenants share (a process `up` started for this test).
    let before_sets = sets(&before);
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    for s in before_sets.values() {
        for n in s {
            *count.entry(n.as_str()).or_default() += 1;
        }
    }
    // A node some tenants use and some do not, so both halves of "only its shards
    // move" are tested; the most shared node if every used node is in every set.
    let victim = count
        .iter()
        .filter(|(_, c)| **c < TENANTS)
        .max_by_key(|(n, c)| (**c, std::cmp::Reverse(**n)))
        .or_else(|| {
            count
                .iter()
                .max_by_key(|(n, c)| (**c, std::cmp::Reverse(**n)))
        })
        .map(|(n, _)| n.to_string())
        .unwrap();
    let log = std::fs::read_to_string(&up.log).unwrap();
    let pid: i32 = log
        .lines()
        .find_map(|l| l.strip_prefix(&format!("up: pid {victim} ")))
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no `up: pid {victim}` line in {}", up.log.display()));
    println!(
        "killing {victim} (pid {pid}), on {} tenants' sets",
        count[victim.as_str()]
    );
    // SAFETY: kill(2) on the PID of an SC node `starfabric up` started for this test.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    let after = testbed::cmd::wait_for("repaired placements", Duration::from_secs(30), || {
        let v = cli.placement();
        let s = sets(&v);
        Ok((s.values().all(|n| !n.contains(&victim) && n.len() == 3)).then_some(v))
    })
    .unwrap();
    check_constraints(&after);
    let after_sets = sets(&after);
    for (t, old) in &before_sets {
        let new = &after_sets[t];
        if old.contains(&victim) {
            for n in old.iter().filter(|n| **n != victim) {
                assert!(
                    new.contains(n),
                    "{t}: survivor {n} moved ({old:?} -> {new:?})"
                );
            }
        } else {
            assert_eq!(old, new, "{t} had no shard on {victim} and must not move");
        }
    }
    println!("{}", cli.run(&["placement", "show"]));
    for j in 0..TENANTS {
        curl_ok(&lab, j);
    }
}
