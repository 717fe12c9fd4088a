//! The gateway's own cost on one core, in memory (no I/O), for `bench e2e`'s
//! `ipsec_core_gbps` and `crates/ipsec/tests/throughput.rs`.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use packet::build::{udp_v4, vxlan_wrap};

use crate::{Dir, Gateway, GatewayConfig, Job, Outcome, SaConfig, TunnelConfig};

const BURST: usize = 64;
const SLOT: usize = 2048;

fn gw(ip: Ipv4Addr, peer: Ipv4Addr, out: u32, inn: u32, keymat_len: usize) -> Gateway {
    let mut g = Gateway::new(GatewayConfig::new(ip, [2; 6], [3; 6]));
    g.apply(
        &[TunnelConfig {
            name: "t/x".into(),
            tenant: 1,
            vni: 100,
            peer,
            local_prefixes: vec![],
            remote_prefixes: vec!["0.0.0.0/0".parse().unwrap()],
            vtep: Ipv4Addr::new(198, 18, 10, 2),
            vm_mac: [2, 5, 5, 5, 5, 5],
            outbound: SaConfig {
                spi: out,
                keymat: vec![7; keymat_len],
            },
            inbound: vec![SaConfig {
                spi: inn,
                keymat: vec![7; keymat_len],
            }],
            esn: false,
            replay_window: 1024,
        }],
        0,
    )
    .unwrap();
    g
}

/// Seal and open Gbit/s (inner bytes) on one core for `secs` each way, with AES-128
/// (`keymat_len` 20) or AES-256 (36): bursts of 64 VXLAN frames of 1400-byte IPv4
/// packets through [`Gateway::process`], as the PP pipeline calls it.
pub fn seal_open_gbps(keymat_len: usize, secs: f64) -> (f64, f64) {
    let a_ip = Ipv4Addr::new(198, 18, 1, 2);
    let b_ip = Ipv4Addr::new(198, 18, 20, 2);
    let mut a = gw(a_ip, b_ip, 0x100, 0x200, keymat_len);
    let mut b = gw(b_ip, a_ip, 0x200, 0x100, keymat_len);
    let inner = udp_v4(
        [198, 19, 1, 2],
        1000,
        [198, 18, 170, 10],
        2000,
        &[0x5a; 1372],
    );
    let mut eth = vec![0u8; 14];
    eth[12] = 0x08;
    eth.extend_from_slice(&inner[14..]);
    let frame = vxlan_wrap([198, 18, 10, 2], a_ip.octets(), 1, 100, &eth);
    let ip_len = (inner.len() - 14) as u16;
    let mut region = vec![0u8; BURST * SLOT];
    let mut jobs: Vec<Job> = (0..BURST)
        .map(|i| Job {
            slot: i * SLOT,
            cap: SLOT,
            start: i * SLOT + 256,
            len: frame.len(),
            dir: Dir::Out {
                tunnel: 0,
                ip_off: 64,
                ip_end: 64 + ip_len,
            },
            outcome: Outcome::Pending,
        })
        .collect();
    let (mut seal_t, mut open_t, mut packets) = (Duration::ZERO, Duration::ZERO, 0u64);
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs_f64(secs) {
        for (i, j) in jobs.iter_mut().enumerate() {
            region[i * SLOT + 256..i * SLOT + 256 + frame.len()].copy_from_slice(&frame);
            j.start = i * SLOT + 256;
            j.len = frame.len();
            j.dir = Dir::Out {
                tunnel: 0,
                ip_off: 64,
                ip_end: 64 + ip_len,
            };
        }
        let t = Instant::now();
        a.process(&mut region, &mut jobs, 0);
        seal_t += t.elapsed();
        for j in jobs.iter_mut() {
            let Outcome::Tx { start, len, .. } = j.outcome else {
                panic!("{:?}", j.outcome)
            };
            j.start = start;
            j.len = len;
            j.dir = Dir::In;
        }
        let t = Instant::now();
        b.process(&mut region, &mut jobs, 0);
        open_t += t.elapsed();
        if !jobs.iter().all(|j| matches!(j.outcome, Outcome::Tx { .. })) {
            return (0.0, 0.0);
        }
        packets += BURST as u64;
    }
    let bits = packets as f64 * f64::from(ip_len) * 8.0;
    (
        bits / seal_t.as_secs_f64() / 1e9,
        bits / open_t.as_secs_f64() / 1e9,
    )
}
