//! Plane security with the in-process harness (docs/security.md): FM, four SC nodes and
//! a PP client all on mTLS with the cluster's test CA.
//!
//! - Revocation: an SC replica revoked mid-stream is cut off at FM and repaired around
//!   like a dead one (the spare joins by snapshot); its reconnects are refused and
//!   counted (`revoked`); no committed SNAT mapping is lost or handed out twice.
//! - Rotation: FM's certificate is replaced while the PP session is up and flows are
//!   being set up; the session is not re-opened and every flow is answered.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{chain, flow, mapping, nf_part, pp_session, wait, Cluster};
use pipeline::{FlowKey, RuleSource};
use pp::FmClientConfig;
use proto::tls::{Bundle, Ca, NodeTls, Refusal, Role};
use proto::v1;
use sc::testing::TestSnat;

const ADDRS: [&str; 2] = ["198.19.255.1", "198.19.255.2"];
const PORTS: (u16, u16) = (1024, 65535);
const HOUR: Duration = Duration::from_secs(3600);

fn tls(ca: &Ca, role: Role, id: &str) -> Arc<NodeTls> {
    NodeTls::new(&Bundle::issue(ca, &proto::tls::Identity::new(role, id).unwrap(), HOUR).unwrap())
        .unwrap()
}

struct Tls<'a> {
    ca: &'a Ca,
    fm: Arc<NodeTls>,
    /// FM's role, for the test's own state queries to SC nodes.
    probe: Arc<NodeTls>,
}

/// The harness's mTLS cluster (a CA of its own, FM `fm-1`, SC nodes `sc-0`..`sc-3`).
fn cluster() -> Cluster {
    let cfg = fm::FmConfig {
        chains: vec![chain(
            serde_json::json!([{"kind": "test-snat", "addrs": ADDRS,
                                               "ports": [PORTS.0, PORTS.1]}]),
        )],
        ..fm::FmConfig::default()
    };
    Cluster::start_with(cfg, 4, Arc::new(sc::testing::TestNfs))
}

/// The cluster's CA, FM's TLS state and a probe identity.
fn tls_of(cluster: &Cluster) -> Tls<'_> {
    let ca = cluster.pki.as_ref().expect("an mTLS cluster").ca();
    Tls {
        ca,
        fm: cluster.fm_tls.clone().expect("FM on mTLS"),
        probe: tls(ca, Role::Fm, "fm-probe"),
    }
}

/// Every flow of `range` answered with a mapping (error replies are asked again, as a
/// PP node's next packet would).
fn answered(source: &RuleSource, range: std::ops::Range<u32>) -> HashMap<FlowKey, (IpAddr, u16)> {
    let RuleSource::Channel { requests, replies } = source else {
        unreachable!()
    };
    let index: HashMap<FlowKey, u32> = range.clone().map(|i| (flow(i).key, i)).collect();
    for i in range.clone() {
        requests.send(flow(i)).unwrap();
    }
    let mut got = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut asked = Instant::now();
    while got.len() < index.len() {
        assert!(
            Instant::now() < deadline,
            "{} of {} answered",
            got.len(),
            index.len()
        );
        if let Ok(r) = replies.recv_timeout(Duration::from_millis(100)) {
            match (mapping(&r), index.get(&r.key)) {
                (Some(m), Some(_)) => {
                    got.insert(r.key, m);
                }
                (None, Some(i)) if !r.revoke => requests.send(flow(*i)).unwrap(),
                _ => {}
            }
        }
        if asked.elapsed() > Duration::from_secs(2) {
            for (k, i) in &index {
                if !got.contains_key(k) {
                    requests.send(flow(*i)).unwrap();
                }
            }
            asked = Instant::now();
        }
    }
    got
}

/// SC node `addr`'s group states, asked over mTLS with an FM-role certificate.
fn group_status(
    c: &Cluster,
    t: &Tls,
    addr: SocketAddr,
    snapshots: bool,
) -> Option<Vec<v1::GroupState>> {
    c.rt.block_on(async {
        let ch = proto::connect(&addr.to_string(), Some(&t.probe), Role::Sc)
            .await
            .ok()?;
        let mut s = v1::service_computation_client::ServiceComputationClient::new(ch)
            .max_decoding_message_size(proto::MAX_MESSAGE);
        let req = v1::GroupStatusRequest {
            snapshots,
            ..Default::default()
        };
        Some(s.group_status(req).await.ok()?.into_inner().groups)
    })
}

#[test]
fn a_revoked_sc_replica_is_repaired_around_and_no_state_is_lost() {
    let mut cluster = cluster();
    let t = tls_of(&cluster);
    let (group, order, spare) = cluster.group_and_spare();
    let victim = order[1].clone();
    let mut cfg = FmClientConfig::new(&cluster.fm_addr(), "pp-1");
    cfg.tls = Some(tls(t.ca, Role::Pp, "pp-1"));
    cfg.forget_after = Duration::from_secs(30);
    let (client, link) = pp_session(cfg);

    let before = answered(&link.source, 0..2000);
    // What the orchestrator's directive does at FM: refuse and cut the node.
    t.fm.revoke(&victim);
    let during = answered(&link.source, 2000..4000);

    let repaired = wait(Duration::from_secs(20), "group repair", || {
        let g = cluster.map().groups.first()?.clone();
        let ids: Vec<String> = g.replicas.iter().map(|r| r.node_id.clone()).collect();
        (ids.len() == 3 && !ids.contains(&victim) && ids.contains(&spare)).then_some(g)
    });
    assert!(repaired.epoch > group.epoch);
    // The revoked node keeps trying (it does not know); FM refuses it at the handshake.
    wait(
        Duration::from_secs(20),
        "a revoked reconnect refused",
        || (t.fm.refusals().get(Refusal::Revoked) > 0).then_some(()),
    );

    let all: HashMap<FlowKey, (IpAddr, u16)> = before.into_iter().chain(during).collect();
    let unique: HashSet<(IpAddr, u16)> = all.values().copied().collect();
    assert_eq!(
        unique.len(),
        all.len(),
        "an external port was handed out twice"
    );

    // The replicas now in the group hold identical state with every committed mapping.
    let addrs: Vec<SocketAddr> = cluster
        .scs
        .iter()
        .filter(|s| s.node_id() != victim)
        .map(|s| s.addr())
        .collect();
    let states = wait(Duration::from_secs(60), "replicas in step", || {
        let st: Vec<v1::GroupState> = addrs
            .iter()
            .map(|a| group_status(&cluster, &t, *a, true).and_then(|g| g.into_iter().next()))
            .collect::<Option<_>>()?;
        let ok = st.len() == 3
            && st
                .iter()
                .all(|s| s.applied == st[0].applied && s.initialized && s.unacked == 0);
        if !ok {
            std::thread::sleep(Duration::from_millis(200));
        }
        ok.then_some(st)
    });
    for s in &states {
        assert_eq!(s.snapshot, states[0].snapshot, "replicas disagree");
    }
    let snap = TestSnat::decode_snapshot(&nf_part(&states[0].snapshot, 0)).unwrap();
    let ports = u32::from(PORTS.1 - PORTS.0) + 1;
    for (k, m) in &all {
        let slot = *snap
            .get(k.as_bytes())
            .unwrap_or_else(|| panic!("committed mapping of {k} missing"));
        let addr: IpAddr = ADDRS[(slot / ports) as usize].parse().unwrap();
        assert_eq!((addr, PORTS.0 + (slot % ports) as u16), *m);
    }
    drop(client);
    cluster.scs.clear();
}

#[test]
fn rotating_fms_certificate_under_traffic_keeps_the_session() {
    let cluster = cluster();
    let t = tls_of(&cluster);
    cluster.wait_groups(1, 3);
    let mut cfg = FmClientConfig::new(&cluster.fm_addr(), "pp-1");
    cfg.tls = Some(tls(t.ca, Role::Pp, "pp-1"));
    let (client, link) = pp_session(cfg);
    let sessions = || {
        client
            .stats()
            .sessions
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    let opened = sessions();
    assert_eq!(opened, 1);
    let first = answered(&link.source, 0..1000);

    let old = t.fm.cert_pem();
    let renewed = Bundle::issue(t.ca, t.fm.identity(), HOUR).unwrap();
    t.fm.rotate(&renewed.cert_pem, &renewed.key_pem).unwrap();
    assert_ne!(t.fm.cert_pem(), old);

    let second = answered(&link.source, 1000..2000);
    assert_eq!((first.len(), second.len()), (1000, 1000));
    assert!(client.connected());
    // The PP's session was never re-opened: it carried on across the rotation.
    assert_eq!(
        sessions(),
        opened,
        "the session was re-opened across the rotation"
    );
    assert_eq!(
        client
            .stats()
            .session_errors
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    // And a new node connects fine against the renewed certificate.
    let mut cfg = FmClientConfig::new(&cluster.fm_addr(), "pp-2");
    cfg.tls = Some(tls(t.ca, Role::Pp, "pp-2"));
    let (late, _) = pp_session(cfg);
    assert!(late.connected());
    assert_eq!(t.fm.refusals().get(Refusal::Handshake), 0);
}
