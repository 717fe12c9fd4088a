//! End to end in one process: a PP pipeline on its in-memory ring, the FM client, an FM,
//! and one SC group of three replicas, all speaking real gRPC on 127.0.0.1.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{nf_part, wait, Cluster};
use packet::build::{tcp_v4, vxlan_wrap};
use packet::tcp_flags::SYN;
use pipeline::{
    format_actions, FlowKey, ManualClock, MemRing, Pipeline, PipelineConfig, VecSource, VpcBinding,
    Worker,
};
use pp::FmClient;
use proto::ChainDef;
use testkit::rig::node;

const VNI: u32 = 100;

/// FW → SNAT → LB of the SC crate's deterministic test NFs.
fn test_chain() -> ChainDef {
    chain(serde_json::json!([
        {"kind": "test-fw", "deny_dports": [23]},
        {"kind": "test-snat", "addrs": ["198.19.255.1"], "ports": [20000, 29999]},
        {"kind": "test-lb", "vip": "198.19.0.100", "port": 80,
         "backend": "198.19.1.7", "backend_port": 8080}
    ]))
}

/// FW → SNAT → LB of the built-in NFs (nfs crate).
fn builtin_chain() -> ChainDef {
    chain(serde_json::json!([
        {"kind": "fw", "tenants": [{"tenant": 1, "default_action": "allow", "rules": [
            {"name": "no-telnet", "action": "deny", "proto": "tcp", "dport": 23}
        ]}]},
        {"kind": "snat", "pools": [{"addresses": ["198.19.255.1"],
                                    "ports": {"lo": 20000, "hi": 29999}}]},
        {"kind": "lb", "services": [{"vip": "198.19.0.100", "port": 80, "protocol": "tcp",
            "backends": [{"addr": "198.19.1.7", "port": 8080}]}]}
    ]))
}

fn chain(nfs: serde_json::Value) -> ChainDef {
    serde_json::from_value(serde_json::json!({
        "tenant": 1, "chain": 1,
        "nfs": nfs,
        "forward": {"decap": true, "encap": {"dst": "198.18.0.9", "vni": 200}, "output": 1},
        "reverse": {"decap": true, "encap": {"dst": "198.18.0.50", "vni": 100}, "output": 1}
    }))
    .unwrap()
}

/// The client, and the VIP the test chains' LB serves.
const CLIENT: [u8; 4] = [198, 18, 10, 2];
const VIP: [u8; 4] = [198, 19, 0, 100];

/// A TCP packet of client port `sport` to the VIP (or to `dport`), carrying `seq` in its
/// payload so the test can tell the packets apart after every rewrite.
fn packet(sport: u16, dport: u16, seq: u8) -> Vec<u8> {
    let inner = tcp_v4(CLIENT, sport, VIP, dport, SYN, 1, &[seq; 16]);
    vxlan_wrap([198, 18, 0, 50], [198, 18, 0, 1], 51000, VNI, &inner)
}

fn key(sport: u16, dport: u16) -> FlowKey {
    format!("{VNI} tcp 198.18.10.2:{sport} > 198.19.0.100:{dport}")
        .parse()
        .unwrap()
}

struct Pp {
    client: FmClient,
    worker: Worker<MemRing<VecSource>>,
    doorbell: std::sync::Arc<pp::Doorbell>,
}

fn pp_node(cluster: &Cluster, id: &str) -> Pp {
    let (client, mut links) = FmClient::start(cluster.pp_config(id)).unwrap();
    let link = links.remove(0);
    let mut p = Pipeline::new(PipelineConfig::new(node()), link.source).unwrap();
    p.bind_vpc(
        VNI,
        VpcBinding {
            tenant: 1,
            chain: 1,
        },
    );
    let mut io = MemRing::new(VecSource::default(), 64);
    io.sink.capture = true;
    let worker = Worker::new(p, io, 64, Box::new(ManualClock::default()));
    wait(Duration::from_secs(5), "PP session", || {
        client.connected().then_some(())
    });
    Pp {
        client,
        worker,
        doorbell: link.doorbell,
    }
}

impl Pp {
    /// Service the pipeline until `n` more held packets were released.
    fn await_release(&mut self, n: u64) {
        let target = self.worker.pipeline.stats().pending_released + n;
        wait(Duration::from_secs(10), "the rule", || {
            let _ = self.doorbell.wait_ring(Duration::from_millis(10));
            self.worker.run_once().unwrap();
            (self.worker.pipeline.stats().pending_released >= target).then_some(())
        });
    }
}

#[test]
fn first_packet_misses_rule_returns_held_packets_release_in_order_then_hit() {
    scenario(test_chain(), true);
}

#[test]
fn builtin_fw_snat_lb_chain_comes_back_as_one_composed_rule() {
    scenario(builtin_chain(), false);
}

fn scenario(chain: ChainDef, test_nfs: bool) {
    let cluster = Cluster::start(vec![chain], 3, Arc::new(sc::testing::TestNfs));
    let map = cluster.wait_groups(1, 3);
    assert_eq!(map.partitions.len(), 1);
    let mut pp = pp_node(&cluster, "pp-1");

    // Three packets of a new flow: the first misses, all three are held, one request.
    for s in 0..3 {
        pp.worker.io.source.push(packet(40000, 80, s), 0);
    }
    pp.worker.run_once().unwrap();
    let st = pp.worker.pipeline.stats();
    assert_eq!((st.misses, st.hits, st.rule_requests), (3, 0, 1));
    assert_eq!(pp.worker.pipeline.pending().held(), 3);
    assert!(pp.worker.io.sink.captured.is_empty());

    // The rule comes back through FM from the group's tail; the held packets leave in
    // arrival order, rewritten by the one composed rule.
    pp.await_release(3);
    let out: Vec<u8> = pp
        .worker
        .io
        .sink
        .captured
        .iter()
        .map(|(port, f)| {
            assert_eq!(*port, 1);
            *f.last().unwrap()
        })
        .collect();
    assert_eq!(out, [0, 1, 2]);

    // FW → SNAT → LB came back as one composed rule per direction.
    let (actions, _, _) = pp.worker.pipeline.lookup_rule(&key(40000, 80)).unwrap();
    let text = format_actions(&actions);
    let port: u16 = text
        .strip_prefix("decap; set-src 198.19.255.1:")
        .and_then(|r| r.split(';').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("unexpected forward rule: {text}"));
    assert!((20000..=29999).contains(&port));
    assert_eq!(
        text,
        format!(
            "decap; set-src 198.19.255.1:{port}; set-dst 198.19.1.7:8080; \
             encap 198.18.0.9 vni 200; out 1"
        )
    );
    // The reverse rule came along: the backend's reply to the SNAT address.
    let rkey: FlowKey = format!("200 tcp 198.19.1.7:8080 > 198.19.255.1:{port}")
        .parse()
        .unwrap();
    let (ractions, _, _) = pp.worker.pipeline.lookup_rule(&rkey).unwrap();
    assert_eq!(
        format_actions(&ractions),
        "decap; set-src 198.19.0.100:80; set-dst 198.18.10.2:40000; \
         encap 198.18.0.50 vni 100; out 1"
    );

    // Later packets hit: no miss, no request.
    pp.worker.io.sink.captured.clear();
    for s in 3..6 {
        pp.worker.io.source.push(packet(40000, 80, s), 0);
    }
    pp.worker.run_once().unwrap();
    let st = pp.worker.pipeline.stats();
    assert_eq!((st.misses, st.hits, st.rule_requests), (3, 6, 1));
    assert_eq!(pp.worker.io.sink.captured.len(), 3);

    // A denied port gets a drop rule, from the firewall at the head of the chain.
    pp.worker.io.source.push(packet(40001, 23, 9), 0);
    pp.worker.run_once().unwrap();
    wait(Duration::from_secs(10), "the drop rule", || {
        let _ = pp.doorbell.wait_ring(Duration::from_millis(10));
        pp.worker.run_once().unwrap();
        pp.worker.pipeline.lookup_rule(&key(40001, 23))
    });
    let (actions, _, _) = pp.worker.pipeline.lookup_rule(&key(40001, 23)).unwrap();
    let text = format_actions(&actions);
    assert!(text.starts_with("drop "), "{text}");

    // Another PP node asks for the same flow (say traffic was rebalanced to it): FM
    // answers from its rule cache, and SC sees nothing.
    let before = cluster.stats();
    let mut pp2 = pp_node(&cluster, "pp-2");
    pp2.worker.io.source.push(packet(40000, 80, 7), 0);
    pp2.worker.run_once().unwrap();
    pp2.await_release(1);
    let after = cluster.stats();
    assert_eq!(after.cache.hits, before.cache.hits + 1);
    assert_eq!(after.submitted, before.submitted);
    assert_eq!(
        pp2.worker.pipeline.lookup_rule(&key(40000, 80)).unwrap().0,
        actions_of(&pp, 40000, 80)
    );
    assert_eq!(
        pp.client
            .stats()
            .bad_replies
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );

    // Every replica applied the same ops and holds the same state.
    // (Timer ops keep arriving, so look until all three are at the same point.)
    let states = wait(Duration::from_secs(10), "replicas in step", || {
        let states: Vec<_> = cluster
            .scs
            .iter()
            .map(|s| cluster.group_status(s.addr(), true).remove(0))
            .collect();
        states
            .iter()
            .all(|s| s.applied == states[0].applied)
            .then_some(states)
    });
    assert!(states[0].applied >= 2);
    assert!(states.iter().all(|s| s.snapshot == states[0].snapshot));
    if test_nfs {
        // One SNAT mapping: the flow's (the denied flow stopped at the firewall).
        let snat = nf_part(&states[0].snapshot, 1);
        assert_eq!(
            sc::testing::TestSnat::decode_snapshot(&snat).unwrap().len(),
            1
        );
    }
}

fn actions_of(pp: &Pp, sport: u16, dport: u16) -> pipeline::Actions {
    pp.worker
        .pipeline
        .lookup_rule(&key(sport, dport))
        .unwrap()
        .0
}

/// The orchestrator's path: FM starts with no chains; `set_desired` adds one (groups
/// form), the flow's rule is listed by `flows`, and removing the chain dissolves its
/// group and forgets its cached rules.
#[test]
fn desired_chains_come_and_go_and_flows_lists_the_cache() {
    let cluster = Cluster::start(vec![], 3, Arc::new(sc::testing::TestNfs));
    wait(Duration::from_secs(5), "SC nodes", || {
        let m = cluster.rt.block_on(cluster.fm.members()).unwrap();
        (m.members.iter().filter(|m| m.alive).count() == 3).then_some(())
    });
    assert!(cluster.map().groups.is_empty());
    let cfg = test_chain().to_proto().unwrap();
    let change = cluster
        .rt
        .block_on(cluster.fm.set_desired(vec![cfg.clone()], vec![], vec![]))
        .unwrap();
    assert_eq!(
        change,
        fm::DesiredChange {
            added: 1,
            changed: 0,
            removed: 0
        }
    );
    let map = cluster.wait_groups(1, 3);
    assert_eq!(
        (map.partitions[0].hash_lo, map.partitions[0].hash_hi),
        (0, u64::MAX)
    );
    // The same desired state again changes nothing.
    let again = cluster
        .rt
        .block_on(cluster.fm.set_desired(vec![cfg], vec![], vec![]))
        .unwrap();
    assert_eq!(again, fm::DesiredChange::default());

    let mut pp = pp_node(&cluster, "pp-1");
    pp.worker.io.source.push(packet(40001, 80, 0), 0);
    pp.worker.run_once().unwrap();
    pp.await_release(1);
    let flows = |tenant: u32| {
        cluster
            .rt
            .block_on(cluster.fm.flows(proto::v1::FlowsRequest {
                tenant,
                all_tenants: false,
                limit: 10,
            }))
            .unwrap()
    };
    let listed = flows(1);
    assert_eq!(listed.matched, 1);
    let rule = listed.flows[0].rule.as_ref().unwrap();
    assert_eq!(
        proto::key_of(rule.key.as_ref()).unwrap(),
        key(40001, 80),
        "the cached rule is the flow's"
    );
    assert_eq!(flows(2).matched, 0, "another tenant sees none of it");

    let gone = cluster
        .rt
        .block_on(cluster.fm.set_desired(vec![], vec![], vec![]))
        .unwrap();
    assert_eq!(gone.removed, 1);
    assert!(cluster.map().groups.is_empty());
    assert_eq!(flows(1).matched, 0);
    // The PP node is told: the flow's rule (and any companion) leaves its table, so its
    // next packet asks again instead of running a rule of a chain that is gone.
    assert!(pp.worker.pipeline.lookup_rule(&key(40001, 80)).is_some());
    wait(Duration::from_secs(5), "the revocation at PP", || {
        let _ = pp.doorbell.wait_ring(Duration::from_millis(10));
        pp.worker.run_once().unwrap();
        pp.worker
            .pipeline
            .lookup_rule(&key(40001, 80))
            .is_none()
            .then_some(())
    });
    assert!(pp.worker.pipeline.stats().rules_revoked >= 1);
    assert!(
        pp.client
            .stats()
            .revoked
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
}
