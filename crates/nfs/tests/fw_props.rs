//! Firewall under arbitrary input: no panics; conntrack answers are stable.

use nf::{FirstPacket, FlowEvent, NetworkFunction, NfEnv, SplitHalf, Verdict};
use nfs::fw::{Firewall, FwConfig};
use pipeline::{FlowKey, PacketMeta};
use proptest::prelude::*;

mod fw_util;

fn config() -> FwConfig {
    fw_util::outbound_only("2001:2::/32")
}

fn key_strategy() -> impl Strategy<Value = FlowKey> {
    prop_oneof![
        (
            any::<u16>(),
            any::<u8>(),
            prop::sample::select(vec![1u8, 6, 17, 58, 47]),
            any::<bool>()
        )
            .prop_map(|(port, host, proto, reply)| {
                let k = FlowKey::new(
                    1,
                    proto,
                    [198, 18, 0, host].into(),
                    port,
                    [198, 19, 0, 1].into(),
                    443,
                );
                if reply {
                    k.reversed()
                } else {
                    k
                }
            }),
        prop::collection::vec(any::<u8>(), 40).prop_map(|v| {
            let mut k = [0u8; 40];
            k.copy_from_slice(&v);
            FlowKey::from_bytes(k)
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn arbitrary_operations_never_panic(
        ops in prop::collection::vec(
            (0u8..6, key_strategy(), any::<u8>(), any::<bool>(), 0u64..200_000, any::<u64>()),
            1..150,
        )
    ) {
        let mut fw = Firewall::new(config()).unwrap();
        let mut now = 0u64;
        for (kind, key, flags, icmp_error, dt, x) in ops {
            now = now.saturating_add(dt);
            let mut env = NfEnv::new(now, 0);
            match kind {
                0 | 1 => {
                    let known = fw.conn_state(&key).is_some();
                    let p = FirstPacket {
                        key,
                        flow: key,
                        tenant: (x % 2) as u32 + 1,
                        meta: PacketMeta { len: 60, tcp_flags: flags, icmp_error, ingress_port: 0 },
                    };
                    let d = fw.first_packet(&p, &mut env).unwrap();
                    prop_assert!(d.forward.is_empty() && d.reverse.is_empty());
                    prop_assert!(d.idle_timeout.is_some());
                    if let Verdict::Pass { .. } = d.verdict {
                        // Whatever passes is tracked afterwards.
                        prop_assert!(fw.conn_state(&key).is_some());
                    } else if !known {
                        prop_assert!(fw.conn_state(&key).is_none());
                    }
                }
                2 => fw.on_event(&FlowEvent::TcpClosing { key }, &mut env),
                3 => { fw.on_timer(&mut env); }
                4 => {
                    let before = fw.snapshot().unwrap();
                    let part = fw.split(&SplitHalf { moved_lo: x / 2, moved_hi: x }).unwrap();
                    fw.merge(&part).unwrap();
                    prop_assert_eq!(fw.snapshot().unwrap(), before);
                }
                _ => {
                    let junk: Vec<u8> = x.to_le_bytes().iter().cycle().take(flags as usize).copied().collect();
                    prop_assert!(fw.restore(&junk).is_err());
                }
            }
        }
    }
}
