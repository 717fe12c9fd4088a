//! Load generator for a PP node: sends tenant VXLAN datagrams as fast as one core can,
//! through `UdpVxlanIo` itself (prebuilt frames, `sendmmsg` batches of 64).
//!
//! ```text
//! vxlan_blast <pp-addr:port> <seconds> [inner-src-ip:port] [inner-dst-ip:port] [vni] [payload-len]
//! ```
//!
//! Defaults: inner 198.19.10.2:40000 → 198.19.10.100:7, VNI 100, 18-byte payload (a
//! 60-byte inner frame). Only for addresses of test namespaces or loopback.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::time::{Duration, Instant};

use packet::build::{udp_v4, vxlan_wrap};
use pipeline::{Desc, PacketIo, Verdict, FRAME_SIZE};
use pp::{UdpVxlanConfig, UdpVxlanIo, MAX_IO_BATCH};

fn arg<T: std::str::FromStr>(args: &[String], i: usize, default: &str) -> T {
    let s = args.get(i).map(String::as_str).unwrap_or(default);
    s.parse()
        .unwrap_or_else(|_| panic!("argument {i}: cannot parse {s:?}"))
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 2 {
        eprintln!(
            "usage: vxlan_blast <pp-addr:port> <seconds> [src:port] [dst:port] [vni] [payload-len]"
        );
        std::process::exit(2);
    }
    let to: SocketAddrV4 = arg(&args, 0, "");
    let secs: f64 = arg(&args, 1, "");
    let src: SocketAddrV4 = arg(&args, 2, "198.19.10.2:40000");
    let dst: SocketAddrV4 = arg(&args, 3, "198.19.10.100:7");
    let vni: u32 = arg(&args, 4, "100");
    let len: usize = arg(&args, 5, "18");

    let mut cfg = UdpVxlanConfig::new(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0));
    cfg.peer_port = Some(to.port());
    let mut io = UdpVxlanIo::bind(cfg).expect("socket");

    let inner = udp_v4(
        src.ip().octets(),
        src.port(),
        dst.ip().octets(),
        dst.port(),
        &vec![0x5a; len],
    );
    let frame = vxlan_wrap([0, 0, 0, 0], to.ip().octets(), 50000, vni, &inner);
    let mut region = vec![0u8; MAX_IO_BATCH * FRAME_SIZE];
    let descs: Vec<Desc> = (0..MAX_IO_BATCH)
        .map(|i| {
            let base = i * FRAME_SIZE;
            region[base..base + frame.len()].copy_from_slice(&frame);
            let mut d = Desc::new(base, 0, frame.len(), FRAME_SIZE, 0);
            d.verdict = Verdict::Tx(0);
            d
        })
        .collect();

    let start = Instant::now();
    let until = start + Duration::from_secs_f64(secs);
    while Instant::now() < until {
        io.tx_from(&region, &descs).expect("send");
    }
    let s = io.stats();
    let t = start.elapsed().as_secs_f64();
    println!(
        "vxlan_blast: {:.2}s sent={} ({:.0} pps) dropped={} errors={} datagram={}B",
        t,
        s.tx_packets,
        s.tx_packets as f64 / t,
        s.tx_dropped,
        s.tx_errors,
        frame.len() - 42
    );
}
