//! Load balancer: DNAT decisions, per-flow stickiness across table changes, draining and
//! down backends, timers, snapshot/restore, split/merge, configuration errors.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

use nf::{
    Chain, ChainSpec, Decision, Egress, FirstPacket, FlowEvent, NetworkFunction, NfEnv, NfError,
    Rewrite, SplitHalf, Verdict,
};
use nfs::lb::{
    BackendConfig, BackendId, BackendState, LbConfig, LbProtocol, LoadBalancer, NonVipAction,
    ServiceConfig,
};
use pipeline::{FlowKey, PacketMeta};

const VIP: &str = "198.19.0.100";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn be(i: usize) -> BackendId {
    BackendId::new(IpAddr::from([198, 19, 1, i as u8 + 1]), 8080)
}

fn service(n: usize, weight: impl Fn(usize) -> u32) -> ServiceConfig {
    ServiceConfig {
        vip: ip(VIP),
        port: 80,
        protocol: LbProtocol::Tcp,
        backends: (0..n)
            .map(|i| BackendConfig::new(be(i).addr, be(i).port, weight(i)))
            .collect(),
    }
}

fn config(n: usize) -> LbConfig {
    LbConfig {
        services: vec![service(n, |_| 1)],
        seed: 17,
        ..LbConfig::default()
    }
}

fn meta(flags: u8) -> PacketMeta {
    PacketMeta::new(60, flags)
}

fn pkt(key: FlowKey) -> FirstPacket {
    FirstPacket::new(key, 1, meta(0x02))
}

/// Client flow number `i` to the VIP (clients in 198.18.0.0/15).
fn flow(i: u32) -> FlowKey {
    format!(
        "100 tcp 198.18.{}.{}:{} > {VIP}:80",
        (i >> 8) & 0xff,
        i & 0xff,
        10_000 + (i >> 16)
    )
    .parse()
    .unwrap()
}

fn env(now_ms: u64) -> NfEnv {
    NfEnv::new(now_ms, 0)
}

fn backend_of(d: &Decision) -> BackendId {
    assert_eq!(d.verdict, Verdict::pass(), "{d:?}");
    BackendId::new(d.forward.dst.addr.unwrap(), d.forward.dst.port.unwrap())
}

fn decide(lb: &mut LoadBalancer, k: FlowKey) -> Decision {
    lb.first_packet(&pkt(k), &mut env(1_000)).unwrap()
}

#[test]
fn vip_flow_is_dnat_to_a_backend_with_reverse_snat() {
    let mut lb = LoadBalancer::new(config(4)).unwrap();
    let d = decide(&mut lb, flow(1));
    let b = backend_of(&d);
    assert!((0..4).map(be).any(|x| x == b));
    assert_eq!(d.forward, Rewrite::dst(b.addr, b.port));
    assert_eq!(d.reverse, Rewrite::src(ip(VIP), 80));
    assert_eq!(d.idle_timeout, Some(Duration::from_secs(900)));
    assert_eq!(lb.flow_backend(&flow(1)), Some(b));
    // Same answer on a re-request.
    assert_eq!(decide(&mut lb, flow(1)), d);
    assert_eq!(lb.flow_count(), 1);
}

#[test]
fn tables_are_declared_honestly() {
    let lb = LoadBalancer::new(config(2)).unwrap();
    let t = lb.tables();
    assert_eq!(t.len(), 2);
    assert_eq!(t[0], nf::TableSpec::shared_read("services"));
    assert_eq!(t[1], nf::TableSpec::per_flow("conntrack"));
    for s in t {
        s.validate().unwrap();
    }
}

#[test]
fn non_vip_passes_or_drops_as_configured() {
    let mut lb = LoadBalancer::new(config(2)).unwrap();
    let other: FlowKey = "100 tcp 198.18.0.1:1000 > 198.19.9.9:80".parse().unwrap();
    let wrong_port: FlowKey = format!("100 tcp 198.18.0.1:1000 > {VIP}:81")
        .parse()
        .unwrap();
    let wrong_proto: FlowKey = format!("100 udp 198.18.0.1:1000 > {VIP}:80")
        .parse()
        .unwrap();
    for k in [other, wrong_port, wrong_proto] {
        assert_eq!(decide(&mut lb, k), Decision::pass(), "{k}");
    }
    assert_eq!(lb.flow_count(), 0);
    let mut cfg = config(2);
    cfg.non_vip = NonVipAction::Drop;
    let mut lb = LoadBalancer::new(cfg).unwrap();
    assert_eq!(decide(&mut lb, other), Decision::drop("lb-not-vip"));
}

#[test]
fn no_active_backend_drops() {
    let mut cfg = config(0);
    let mut lb = LoadBalancer::new(cfg.clone()).unwrap();
    let no_backend = Decision {
        idle_timeout: Some(Duration::from_secs(10)),
        ..Decision::drop("lb-no-backend")
    };
    assert_eq!(decide(&mut lb, flow(1)), no_backend);
    cfg.services[0] = service(3, |_| 1);
    cfg.services[0].backends[0].state = BackendState::Draining;
    cfg.services[0].backends[1].state = BackendState::Down;
    cfg.services[0].backends[2].weight = 0;
    lb.update(cfg).unwrap();
    assert_eq!(decide(&mut lb, flow(1)), no_backend);
    assert_eq!(lb.flow_count(), 0);
}

#[test]
fn known_flows_keep_their_backend_when_the_table_changes() {
    let mut lb = LoadBalancer::new(config(5)).unwrap();
    let before: Vec<BackendId> = (0..3000)
        .map(|i| backend_of(&decide(&mut lb, flow(i))))
        .collect();
    // Add backends and reweight: the table changes a lot, pinned flows do not.
    let mut cfg = config(8);
    cfg.services[0] = service(8, |i| 1 + i as u32);
    assert!(lb.update(cfg).unwrap().is_empty());
    for (i, b) in before.iter().enumerate() {
        assert_eq!(backend_of(&decide(&mut lb, flow(i as u32))), *b);
    }
}

#[test]
fn removing_a_backend_moves_only_its_flows() {
    const FLOWS: u32 = 20_000;
    let n = 10;
    let mut lb = LoadBalancer::new(config(n)).unwrap();
    let before: Vec<BackendId> = (0..FLOWS)
        .map(|i| backend_of(&decide(&mut lb, flow(i))))
        .collect();
    let gone = be(3);
    let mut cfg = config(n);
    cfg.services[0].backends.retain(|b| b.id() != gone);
    let dropped = lb.update(cfg.clone()).unwrap();
    // Exactly the removed backend's flows are forgotten, reported sorted.
    let mut expect: Vec<FlowKey> = (0..FLOWS)
        .filter(|&i| before[i as usize] == gone)
        .map(flow)
        .collect();
    expect.sort_by_key(|k| *k.as_bytes());
    assert_eq!(dropped, expect);
    assert!(!dropped.is_empty());
    for i in 0..FLOWS {
        let b = backend_of(&decide(&mut lb, flow(i)));
        if before[i as usize] == gone {
            assert_ne!(b, gone);
        } else {
            assert_eq!(b, before[i as usize], "flow {i} moved");
        }
    }
    // Table level: where would *new* flows of the other backends go now? Maglev moves a
    // little more than the minimum; measure it on fresh state.
    let mut fresh = LoadBalancer::new(cfg).unwrap();
    let moved = (0..FLOWS)
        .filter(|&i| before[i as usize] != gone)
        .filter(|&i| backend_of(&decide(&mut fresh, flow(i))) != before[i as usize])
        .count();
    let frac = moved as f64 / FLOWS as f64;
    println!(
        "table-level disruption of other backends' flows after removing 1 of {n}: {:.3}%",
        frac * 100.0
    );
    assert!(frac < 0.015);
}

#[test]
fn draining_keeps_flows_but_takes_no_new_ones() {
    let mut lb = LoadBalancer::new(config(4)).unwrap();
    let before: Vec<BackendId> = (0..4000)
        .map(|i| backend_of(&decide(&mut lb, flow(i))))
        .collect();
    let mut cfg = config(4);
    cfg.services[0].backends[2].state = BackendState::Draining;
    assert!(lb.update(cfg).unwrap().is_empty());
    let mut on_drained = 0;
    for (i, b) in before.iter().enumerate() {
        assert_eq!(backend_of(&decide(&mut lb, flow(i as u32))), *b);
        on_drained += usize::from(*b == be(2));
    }
    assert!(on_drained > 500);
    for i in 10_000..14_000 {
        assert_ne!(backend_of(&decide(&mut lb, flow(i))), be(2));
    }
    assert!(!lb
        .table(ip(VIP), 80, LbProtocol::Tcp)
        .unwrap()
        .backends()
        .contains(&be(2)));
}

#[test]
fn down_backend_flows_are_rebalanced() {
    let mut lb = LoadBalancer::new(config(4)).unwrap();
    let before: Vec<BackendId> = (0..2000)
        .map(|i| backend_of(&decide(&mut lb, flow(i))))
        .collect();
    let mut cfg = config(4);
    cfg.services[0].backends[1].state = BackendState::Down;
    let dropped = lb.update(cfg).unwrap();
    assert_eq!(
        dropped.len(),
        before.iter().filter(|b| **b == be(1)).count()
    );
    for (i, b) in before.iter().enumerate() {
        let now = backend_of(&decide(&mut lb, flow(i as u32)));
        if *b == be(1) {
            assert_ne!(now, be(1));
        } else {
            assert_eq!(now, *b);
        }
    }
    // Removing the whole service forgets its flows; they are then non-VIP traffic.
    let dropped = lb.update(LbConfig::default()).unwrap();
    assert_eq!(dropped.len(), 2000);
    assert_eq!(decide(&mut lb, flow(0)), Decision::pass());
}

#[test]
fn flow_shares_follow_weights() {
    let mut cfg = config(3);
    cfg.services[0] = service(3, |i| 1 + i as u32);
    let mut lb = LoadBalancer::new(cfg).unwrap();
    let mut n: HashMap<BackendId, u32> = HashMap::new();
    const FLOWS: u32 = 60_000;
    for i in 0..FLOWS {
        *n.entry(backend_of(&decide(&mut lb, flow(i)))).or_default() += 1;
    }
    for i in 0..3 {
        let got = n[&be(i)] as f64 / FLOWS as f64;
        let want = (1 + i) as f64 / 6.0;
        // Binomial noise at 60k flows is ~0.2%; allow 1 percentage point.
        assert!(
            (got - want).abs() < 0.01,
            "backend {i}: {got:.4} vs {want:.4}"
        );
    }
}

#[test]
fn reply_direction_first_packet_of_a_known_flow() {
    let mut lb = LoadBalancer::new(config(3)).unwrap();
    let b = backend_of(&decide(&mut lb, flow(7)));
    // The reply as it leaves the backend: backend → client.
    let reply = Rewrite::dst(b.addr, b.port).apply(&flow(7)).reversed();
    let d = decide(&mut lb, reply);
    assert_eq!(d.forward, Rewrite::src(ip(VIP), 80));
    assert_eq!(d.reverse, Rewrite::dst(b.addr, b.port));
    assert_eq!(lb.flow_count(), 1);
}

#[test]
fn unrelated_icmp_error_to_a_vip_is_dropped_without_state() {
    let mut lb = LoadBalancer::new(config(3)).unwrap();
    let mut p = pkt(flow(9));
    p.meta.icmp_error = true;
    let d = lb.first_packet(&p, &mut env(0)).unwrap();
    assert_eq!(d.verdict, Verdict::drop("lb-icmp-unrelated"));
    assert_eq!(lb.flow_count(), 0);
}

#[test]
fn idle_and_closing_timeouts() {
    let mut lb = LoadBalancer::new(config(3)).unwrap();
    lb.first_packet(&pkt(flow(1)), &mut env(0)).unwrap();
    lb.first_packet(&pkt(flow(2)), &mut env(0)).unwrap();
    let udp: FlowKey = format!("100 udp 198.18.0.1:5353 > {VIP}:53")
        .parse()
        .unwrap();
    let mut cfg = config(3);
    let mut s = service(2, |_| 1);
    s.port = 53;
    s.protocol = LbProtocol::Udp;
    cfg.services.push(s);
    lb.update(cfg).unwrap();
    let d = lb.first_packet(&pkt(udp), &mut env(0)).unwrap();
    assert_eq!(d.idle_timeout, Some(Duration::from_secs(300)));
    lb.on_event(&FlowEvent::TcpClosing { key: flow(2) }, &mut env(10_000));
    // Expiry of PP's rules alone does not forget the flow.
    lb.on_event(&FlowEvent::Expired { key: flow(1) }, &mut env(10_000));
    assert_eq!(lb.on_timer(&mut env(129_999)), vec![]);
    assert_eq!(lb.on_timer(&mut env(130_000)), vec![flow(2)]);
    assert_eq!(lb.on_timer(&mut env(299_999)), vec![]);
    assert_eq!(lb.on_timer(&mut env(300_000)), vec![udp]);
    assert_eq!(lb.on_timer(&mut env(899_999)), vec![]);
    assert_eq!(lb.on_timer(&mut env(900_000)), vec![flow(1)]);
    assert_eq!(lb.flow_count(), 0);
}

#[test]
fn re_request_refreshes_the_deadline() {
    let mut lb = LoadBalancer::new(config(3)).unwrap();
    lb.first_packet(&pkt(flow(1)), &mut env(0)).unwrap();
    lb.first_packet(&pkt(flow(1)), &mut env(500_000)).unwrap();
    assert!(lb.on_timer(&mut env(900_000)).is_empty());
    assert_eq!(lb.on_timer(&mut env(1_400_000)), vec![flow(1)]);
}

#[test]
fn snapshot_restore_round_trip() {
    let mut lb = LoadBalancer::new(config(5)).unwrap();
    let before: Vec<BackendId> = (0..500)
        .map(|i| backend_of(&decide(&mut lb, flow(i))))
        .collect();
    let snap = lb.snapshot().unwrap();
    // Restore into an instance built from a different configuration: the snapshot's
    // configuration and flows replace it.
    let mut other = LoadBalancer::new(config(2)).unwrap();
    other.restore(&snap).unwrap();
    assert_eq!(other.config(), lb.config());
    assert_eq!(other.snapshot().unwrap(), snap);
    for (i, b) in before.iter().enumerate() {
        assert_eq!(other.flow_backend(&flow(i as u32)), Some(*b));
    }
    // Snapshots are canonical: same state, same bytes, on every replica.
    let mut twin = LoadBalancer::new(config(5)).unwrap();
    for i in (0..500).rev() {
        decide(&mut twin, flow(i));
    }
    assert_eq!(twin.snapshot().unwrap(), snap);
}

#[test]
fn split_and_merge_move_flows_by_key_hash() {
    let mut lb = LoadBalancer::new(config(5)).unwrap();
    let before: Vec<BackendId> = (0..2000)
        .map(|i| backend_of(&decide(&mut lb, flow(i))))
        .collect();
    let half = SplitHalf {
        moved_lo: 1 << 63,
        moved_hi: u64::MAX,
    };
    let part = lb.split(&half).unwrap();
    let moved: Vec<u32> = (0..2000).filter(|&i| half.moves(&flow(i))).collect();
    assert!(moved.len() > 800 && moved.len() < 1200, "{}", moved.len());
    assert_eq!(lb.flow_count(), 2000 - moved.len());
    // The new owner starts from the same configuration and takes the part in.
    let mut newer = LoadBalancer::new(config(5)).unwrap();
    newer.merge(&part).unwrap();
    assert_eq!(newer.flow_count(), moved.len());
    // Change the table on both sides: each keeps its own flows' backends.
    let cfg = LbConfig {
        services: vec![service(9, |i| 1 + (i % 3) as u32)],
        ..config(5)
    };
    lb.update(cfg.clone()).unwrap();
    newer.update(cfg).unwrap();
    for i in 0..2000u32 {
        let owner = if half.moves(&flow(i)) {
            &mut newer
        } else {
            &mut lb
        };
        assert_eq!(owner.flow_backend(&flow(i)), Some(before[i as usize]));
        assert_eq!(backend_of(&decide(owner, flow(i))), before[i as usize]);
    }
    // Scale-in: merge back.
    let all = newer
        .split(&SplitHalf {
            moved_lo: 0,
            moved_hi: u64::MAX,
        })
        .unwrap();
    assert_eq!(newer.flow_count(), 0);
    lb.merge(&all).unwrap();
    assert_eq!(lb.flow_count(), 2000);
}

#[test]
fn bad_snapshots_are_errors_not_panics() {
    let mut lb = LoadBalancer::new(config(2)).unwrap();
    decide(&mut lb, flow(1));
    let good = lb.snapshot().unwrap();
    for bad in [
        &b""[..],
        b"{}",
        b"\xff\xfe",
        br#"{"version":2,"config":{},"flows":[]}"#,
        br#"{"version":1,"config":{},"flows":[{"key":"zz","backend":{"addr":"1.2.3.4","port":1},"deadline_ms":0,"closing":false}]}"#,
    ] {
        assert!(matches!(lb.restore(bad), Err(NfError::Snapshot(_))), "{bad:?}");
        assert!(matches!(lb.merge(bad), Err(NfError::Snapshot(_))), "{bad:?}");
    }
    // A configuration that does not compile is refused by restore (merge keeps ours).
    let bad_cfg = br#"{"version":1,"config":{"table_size":10},"flows":[]}"#;
    assert!(matches!(lb.restore(bad_cfg), Err(NfError::Snapshot(m)) if m.contains("not prime")));
    for cut in 0..good.len() {
        assert!(lb.restore(&good[..cut]).is_err());
    }
    // Failed restores left the state alone.
    assert_eq!(lb.snapshot().unwrap(), good);
}

fn config_error(cfg: LbConfig) -> String {
    match LoadBalancer::new(cfg) {
        Err(NfError::Config(m)) => m,
        Err(e) => panic!("wrong error kind: {e}"),
        Ok(_) => panic!("accepted"),
    }
}

#[test]
fn bad_configurations_are_clear_config_errors() {
    let m = config_error(LbConfig {
        table_size: 65_536,
        ..config(2)
    });
    assert!(m.contains("65536 is not prime"), "{m}");

    let mut c = config(2);
    let dup = c.services[0].backends[0].clone();
    c.services[0].backends.push(dup);
    let m = config_error(c);
    assert!(m.contains("198.19.1.1:8080 is listed twice"), "{m}");

    let mut c = config(2);
    c.services[0].backends[0].addr = ip("2001:2::1");
    let m = config_error(c);
    assert!(m.contains("address family"), "{m}");

    let mut c = config(2);
    let dup = c.services[0].clone();
    c.services.push(dup);
    let m = config_error(c);
    assert!(m.contains("198.19.0.100:80/tcp is defined twice"), "{m}");

    let mut c = config(2);
    c.timeouts.udp_s = 0;
    let m = config_error(c);
    assert!(m.contains("timeouts.udp_s"), "{m}");

    let mut c = config(2);
    c.services[0].port = 0;
    assert!(config_error(c).contains("port 0"));

    // JSON: typos in field names are caught, not ignored.
    let e = LbConfig::from_json(r#"{"services":[],"tabel_size":7}"#).unwrap_err();
    assert!(
        matches!(&e, NfError::Config(m) if m.contains("tabel_size")),
        "{e}"
    );
    let e =
        LbConfig::from_json(r#"{"services":[{"vip":"198.19.0.1","port":80,"protocol":"sctp"}]}"#)
            .unwrap_err();
    assert!(
        matches!(&e, NfError::Config(m) if m.contains("sctp")),
        "{e}"
    );

    // A failed update leaves the running configuration alone.
    let mut lb = LoadBalancer::new(config(2)).unwrap();
    assert!(lb
        .update(LbConfig {
            table_size: 4,
            ..config(3)
        })
        .is_err());
    assert_eq!(lb.config(), &config(2));
}

#[test]
fn builds_from_json_through_nfconfig() {
    let json = r#"{
        "kind": "lb",
        "table_size": 251,
        "seed": 5,
        "services": [{
            "vip": "198.19.0.100", "port": 80, "protocol": "tcp",
            "backends": [
                {"addr": "198.19.1.1", "port": 8080, "weight": 2},
                {"addr": "198.19.1.2", "port": 8080, "state": "draining"},
                {"addr": "198.19.1.3", "port": 8080, "weight": 1, "state": "down"}
            ]
        }]
    }"#;
    let cfg: nfs::NfConfig = serde_json::from_str(json).unwrap();
    let mut nf = nfs::build(&cfg).unwrap();
    assert_eq!(nf.kind(), "lb");
    let d = nf.first_packet(&pkt(flow(1)), &mut env(0)).unwrap();
    assert_eq!(backend_of(&d), be(0));
}

#[test]
fn deterministic_across_replicas() {
    let mut a = LoadBalancer::new(config(7)).unwrap();
    let mut b = LoadBalancer::new(config(7)).unwrap();
    for i in 0..1000 {
        assert_eq!(decide(&mut a, flow(i)), decide(&mut b, flow(i)));
    }
    // A different seed places flows differently.
    let mut c = LoadBalancer::new(LbConfig {
        seed: 18,
        ..config(7)
    })
    .unwrap();
    let differ = (0..1000)
        .filter(|&i| decide(&mut a, flow(i)) != decide(&mut c, flow(i)))
        .count();
    assert!(differ > 500, "{differ}");
}

#[test]
fn composes_in_a_chain_behind_a_firewall() {
    let fw = nfs::fw::Firewall::new(nfs::fw::FwConfig {
        default_action: nfs::fw::AclAction::Allow,
        ..Default::default()
    })
    .unwrap();
    let lb = LoadBalancer::new(config(3)).unwrap();
    let mut chain = Chain::new(
        vec![Box::new(fw), Box::new(lb)],
        ChainSpec::seq(2),
        Egress::LOCAL,
        Egress::LOCAL,
    )
    .unwrap();
    let r = chain.decide(&pkt(flow(3)), &mut env(0)).unwrap();
    assert_eq!(r.path_names(), ["fw", "lb"]);
    let text = pipeline::format_actions(&r.forward.actions);
    assert!(text.starts_with("set-dst 198.19.1."), "{text}");
    // TCP SYN: the firewall gives PP's rule its established timeout (7440 s, which it
    // cannot lengthen later), so the LB's 900 s is the shorter one.
    assert_eq!(r.forward.idle_timeout, Some(Duration::from_secs(900)));
    let rev = r.reverse.unwrap();
    assert_eq!(
        pipeline::format_actions(&rev.actions),
        format!("set-src {VIP}:80; out 0")
    );
}

#[test]
fn shared_reply_key_resolves_alike_on_every_replica() {
    // Two VIPs share one backend; one client port reaches both. Their replies look the
    // same (backend → client), so the reply direction can name only one of them.
    let mut cfg = config(1);
    let mut s2 = service(1, |_| 1);
    s2.vip = ip("198.19.0.101");
    cfg.services.push(s2);
    let f1 = flow(1);
    let f2: FlowKey = "100 tcp 198.18.0.1:10000 > 198.19.0.101:80"
        .parse()
        .unwrap();
    let b = be(0);
    let reply = Rewrite::dst(b.addr, b.port).apply(&f1).reversed();
    assert_eq!(reply, Rewrite::dst(b.addr, b.port).apply(&f2).reversed());
    let mut a = LoadBalancer::new(cfg.clone()).unwrap();
    let mut z = LoadBalancer::new(cfg.clone()).unwrap();
    decide(&mut a, f1);
    decide(&mut a, f2);
    decide(&mut z, f2);
    decide(&mut z, f1);
    let (da, dz) = (decide(&mut a, reply), decide(&mut z, reply));
    assert_eq!(da, dz);
    assert_eq!(
        da.forward,
        Rewrite::src(ip(VIP), 80),
        "the smaller forward key wins"
    );
    // Forgetting the other flow leaves the winner's reply index alone.
    let mut first_only = cfg.clone();
    first_only.services.pop();
    assert_eq!(a.update(first_only).unwrap(), vec![f2]);
    assert_eq!(decide(&mut a, reply).forward, Rewrite::src(ip(VIP), 80));
    // Forgetting the winner hands the reply key to the other flow.
    let mut second_only = cfg;
    second_only.services.remove(0);
    assert_eq!(z.update(second_only).unwrap(), vec![f1]);
    assert_eq!(
        decide(&mut z, reply).forward,
        Rewrite::src(ip("198.19.0.101"), 80)
    );
}

#[test]
fn placement_is_pinned_across_releases() {
    // Flow → backend must not change between releases: replicas of an SC group may run
    // different releases during an upgrade, and a new table would move unpinned flows.
    let mut lb = LoadBalancer::new(config(5)).unwrap();
    let got: String = (0..24)
        .map(|i| {
            let b = backend_of(&decide(&mut lb, flow(i)));
            match b.addr {
                IpAddr::V4(a) => char::from(b'0' + a.octets()[3]),
                IpAddr::V6(_) => '?',
            }
        })
        .collect();
    assert_eq!(got, GOLDEN_PLACEMENT);
}

/// Last octet of the backend (198.19.1.1–5) of flows 0..24 under `config(5)`, seed 17.
const GOLDEN_PLACEMENT: &str = "252413121321443512522132";

/// A version-1 JSON snapshot, as builds before the platform tables wrote it, of flows
/// pinned by `lb`.
fn legacy_snapshot(lb: &LoadBalancer, keys: &[FlowKey], deadline_ms: u64) -> Vec<u8> {
    let hex = |k: &FlowKey| {
        k.as_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    let flows: Vec<serde_json::Value> = keys
        .iter()
        .map(|k| {
            let b = lb.flow_backend(k).expect("pinned");
            serde_json::json!({"key": hex(k), "backend": b, "deadline_ms": deadline_ms, "closing": false})
        })
        .collect();
    let snap = serde_json::json!({"version": 1, "config": lb.config(), "flows": flows});
    serde_json::to_vec(&snap).expect("json")
}

#[test]
fn state_from_an_older_build_is_taken_in_by_restore_merge_and_the_prepared_merge() {
    let mut old = LoadBalancer::new(config(5)).unwrap();
    let keys: Vec<FlowKey> = (0..50).map(flow).collect();
    for k in &keys {
        decide(&mut old, *k);
    }
    let legacy = legacy_snapshot(&old, &keys, 900_000);
    let mut restored = LoadBalancer::new(config(2)).unwrap();
    restored.restore(&legacy).unwrap();
    assert_eq!(restored.config(), old.config());
    let mut merged = LoadBalancer::new(config(5)).unwrap();
    merged.merge(&legacy).unwrap();
    let mut prepared = LoadBalancer::new(config(5)).unwrap();
    let part = prepared.merge_decoder()(&legacy).unwrap();
    prepared.check_prepared(&part).unwrap();
    prepared.merge_prepared(part).unwrap();
    for lb in [&restored, &merged, &prepared] {
        assert_eq!(lb.flow_count(), 50);
        for k in &keys {
            assert_eq!(lb.flow_backend(k), old.flow_backend(k));
        }
    }
    assert_eq!(merged.snapshot().unwrap(), prepared.snapshot().unwrap());
    // The deadlines came along: the platform's timer forgets them all at once.
    assert_eq!(merged.on_timer(&mut env(900_000)).len(), 50);
    assert_eq!(merged.flow_count(), 0);
}
