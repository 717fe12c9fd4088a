//! Load balancer under arbitrary input: no panics, and the pinning invariant holds.

use std::net::IpAddr;

use nf::{FirstPacket, FlowEvent, NetworkFunction, NfEnv, SplitHalf, Verdict};
use nfs::lb::{BackendConfig, BackendState, LbConfig, LbProtocol, LoadBalancer, ServiceConfig};
use pipeline::{FlowKey, PacketMeta};
use proptest::prelude::*;

fn config(states: &[u8]) -> LbConfig {
    let backends = states
        .iter()
        .enumerate()
        .map(|(i, s)| BackendConfig {
            state: match s % 3 {
                0 => BackendState::Active,
                1 => BackendState::Draining,
                _ => BackendState::Down,
            },
            ..BackendConfig::new(IpAddr::from([198, 19, 1, i as u8 + 1]), 8080, 1 + i as u32)
        })
        .collect();
    LbConfig {
        services: vec![ServiceConfig {
            vip: IpAddr::from([198, 19, 0, 100]),
            port: 80,
            protocol: LbProtocol::Tcp,
            backends,
        }],
        table_size: 251,
        ..LbConfig::default()
    }
}

/// Mostly flows to the VIP (so state builds up), some arbitrary keys.
fn key_strategy() -> impl Strategy<Value = FlowKey> {
    prop_oneof![
        (any::<u16>(), any::<u8>()).prop_map(|(port, host)| {
            FlowKey::new(
                100,
                6,
                IpAddr::from([198, 18, 0, host]),
                port,
                IpAddr::from([198, 19, 0, 100]),
                80,
            )
        }),
        prop::array::uniform32(any::<u8>()).prop_flat_map(|a| {
            prop::array::uniform8(any::<u8>()).prop_map(move |b| {
                let mut k = [0u8; 40];
                k[..32].copy_from_slice(&a);
                k[32..].copy_from_slice(&b);
                FlowKey::from_bytes(k)
            })
        }),
    ]
}

#[derive(Debug, Clone)]
enum Op {
    First(FlowKey, u8, bool),
    Closing(FlowKey),
    Expired(FlowKey),
    Timer,
    Update(Vec<u8>),
    SplitMerge(u64, u64),
    Restore(Vec<u8>),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (key_strategy(), any::<u8>(), any::<bool>()).prop_map(|(k, f, e)| Op::First(k, f, e)),
        1 => key_strategy().prop_map(Op::Closing),
        1 => key_strategy().prop_map(Op::Expired),
        1 => Just(Op::Timer),
        1 => prop::collection::vec(any::<u8>(), 0..6).prop_map(Op::Update),
        1 => (any::<u64>(), any::<u64>()).prop_map(|(a, b)| Op::SplitMerge(a, b)),
        1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(Op::Restore),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn arbitrary_operations_never_panic_and_pins_hold(
        ops in prop::collection::vec((op_strategy(), 0u64..1_000_000), 1..120)
    ) {
        let mut lb = LoadBalancer::new(config(&[0, 0, 1])).unwrap();
        let mut now = 0u64;
        for (op, dt) in ops {
            now = now.saturating_add(dt);
            let mut env = NfEnv::new(now, 0);
            match op {
                Op::First(key, flags, icmp_error) => {
                    let pinned = lb.flow_backend(&key);
                    let p = FirstPacket {
                        key,
                        flow: key,
                        tenant: 1,
                        meta: PacketMeta { len: 60, tcp_flags: flags, icmp_error, ingress_port: 0 },
                    };
                    let d = lb.first_packet(&p, &mut env).unwrap();
                    if let Some(b) = pinned {
                        // A pinned flow keeps its backend.
                        prop_assert_eq!(d.verdict, Verdict::pass());
                        prop_assert_eq!(d.forward.dst.addr, Some(b.addr));
                        prop_assert_eq!(d.forward.dst.port, Some(b.port));
                    }
                }
                Op::Closing(key) => lb.on_event(&FlowEvent::TcpClosing { key }, &mut env),
                Op::Expired(key) => lb.on_event(&FlowEvent::Expired { key }, &mut env),
                Op::Timer => {
                    lb.on_timer(&mut env);
                }
                Op::Update(states) => {
                    lb.update(config(&states)).unwrap();
                }
                Op::SplitMerge(a, b) => {
                    let before = lb.snapshot().unwrap();
                    let part = lb.split(&SplitHalf { moved_lo: a.min(b), moved_hi: a.max(b) }).unwrap();
                    lb.merge(&part).unwrap();
                    prop_assert_eq!(lb.snapshot().unwrap(), before);
                }
                Op::Restore(bytes) => {
                    let before = lb.snapshot().unwrap();
                    prop_assert!(lb.restore(&bytes).is_err());
                    prop_assert!(lb.merge(&bytes).is_err());
                    prop_assert_eq!(lb.snapshot().unwrap(), before);
                }
            }
        }
    }
}
