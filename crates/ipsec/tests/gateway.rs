//! The gateway end to end in memory: two gateways facing each other (A is starfabric's
//! side, B plays the remote site), VPC frames in, ESP between them, VPC frames out; and
//! every drop reason.

use std::net::Ipv4Addr;

use ipsec::esp::{self, EspDrop};
use ipsec::{Dir, Gateway, GatewayConfig, Job, Outcome, Prefix, SaConfig, TunnelConfig};
use packet::build::{tcp_v4, udp_v4, vxlan_wrap};

const SLOT: usize = 2048;
const HEADROOM: usize = 256;
const VNI: u32 = 100;
const A_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 2);
const B_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 20, 2);
const VTEP: Ipv4Addr = Ipv4Addr::new(198, 18, 10, 2);
const VM: [u8; 4] = [198, 19, 1, 2];
const REMOTE_HOST: [u8; 4] = [198, 18, 170, 10];
const VM_MAC: [u8; 6] = [2, 0x5f, 1, 0, 0, 2];

fn keymat(b: u8) -> Vec<u8> {
    vec![b; 20]
}

fn sa(spi: u32, k: u8) -> SaConfig {
    SaConfig {
        spi,
        keymat: keymat(k),
    }
}

/// A's tunnel: out with `out`, in with `ins`.
fn tunnel(
    out: SaConfig,
    ins: Vec<SaConfig>,
    peer: Ipv4Addr,
    local: &str,
    remote: &str,
) -> TunnelConfig {
    TunnelConfig {
        name: "acme/site".into(),
        tenant: 7,
        vni: VNI,
        peer,
        local_prefixes: vec![local.parse().unwrap()],
        remote_prefixes: vec![remote.parse().unwrap()],
        vtep: VTEP,
        vm_mac: VM_MAC,
        outbound: out,
        inbound: ins,
        esn: false,
        replay_window: 64,
    }
}

/// A (VPC 198.19.1.0/24) and B (remote 198.18.170.0/24) with SPIs 0x100 (A→B) and
/// 0x200 (B→A).
/// A's end: its VPC 198.19.1.0/24 toward the site's 198.18.170.0/24 behind B.
fn a_side(out: SaConfig, ins: Vec<SaConfig>) -> TunnelConfig {
    tunnel(out, ins, B_IP, "198.19.1.0/24", "198.18.170.0/24")
}

/// B's end, the mirror of [`a_side`].
fn b_side(out: SaConfig, ins: Vec<SaConfig>) -> TunnelConfig {
    tunnel(out, ins, A_IP, "198.18.170.0/24", "198.19.1.0/24")
}

fn pair() -> (Gateway, Gateway) {
    let mut a = Gateway::new(GatewayConfig::new(
        A_IP,
        [2, 0, 0, 0, 1, 1],
        [2, 0, 0, 0, 1, 2],
    ));
    let mut b = Gateway::new(GatewayConfig::new(
        B_IP,
        [2, 0, 0, 0, 2, 1],
        [2, 0, 0, 0, 2, 2],
    ));
    a.apply(&[a_side(sa(0x100, 1), vec![sa(0x200, 2)])], 0)
        .unwrap();
    b.apply(&[b_side(sa(0x200, 2), vec![sa(0x100, 1)])], 0)
        .unwrap();
    (a, b)
}

/// Frames in slots of a region, as a backend would hold them.
struct Burst {
    region: Vec<u8>,
    jobs: Vec<Job>,
}

impl Burst {
    fn new() -> Self {
        Burst {
            region: Vec::new(),
            jobs: Vec::new(),
        }
    }

    fn push(&mut self, frame: &[u8], dir: Dir) {
        let slot = self.region.len();
        self.region.resize(slot + SLOT, 0);
        let start = slot + HEADROOM;
        self.region[start..start + frame.len()].copy_from_slice(frame);
        self.jobs.push(Job {
            slot,
            cap: SLOT,
            start,
            len: frame.len(),
            dir,
            outcome: Outcome::Pending,
        });
    }

    /// A VPC frame (VXLAN) into tunnel `t` of `g`.
    fn vpc(&mut self, g: &Gateway, inner_ip: &[u8]) {
        let mut inner = vec![0u8; 14];
        inner[..6].copy_from_slice(&[2, 0x5f, 1, 0, 0, 1]);
        inner[6..12].copy_from_slice(&VM_MAC);
        inner[12] = 0x08;
        inner.extend_from_slice(&inner_ip[14..]);
        let f = vxlan_wrap(VTEP.octets(), A_IP.octets(), 50000, VNI, &inner);
        let src = Ipv4Addr::new(inner[26], inner[27], inner[28], inner[29]);
        let dst = Ipv4Addr::new(inner[30], inner[31], inner[32], inner[33]);
        let t = g.outbound_tunnel(VNI, src, dst).expect("a tunnel matches");
        let total = u16::from_be_bytes([inner[16], inner[17]]);
        self.push(
            &f,
            Dir::Out {
                tunnel: t,
                ip_off: 64,
                ip_end: 64 + total,
            },
        );
    }

    fn run(&mut self, g: &mut Gateway, now: u32) {
        g.process(&mut self.region, &mut self.jobs, now);
    }

    /// The frames sent, in order; drops as their reason.
    fn out(&self) -> Vec<Result<Vec<u8>, EspDrop>> {
        self.jobs
            .iter()
            .map(|j| match j.outcome {
                Outcome::Tx { start, len, .. } => Ok(self.region[start..start + len].to_vec()),
                Outcome::Drop(r) => Err(r),
                Outcome::Pending => panic!("job left pending"),
            })
            .collect()
    }
}

/// The inner IP packet of an Ethernet frame built by packet::build (IP at 14).
fn ip_of(f: &[u8]) -> &[u8] {
    &f[14..]
}

#[test]
fn vpc_to_remote_and_back_through_two_gateways() {
    let (mut a, mut b) = pair();
    let req = udp_v4(VM, 40000, REMOTE_HOST, 53, b"query");
    let mut burst = Burst::new();
    for _ in 0..3 {
        burst.vpc(&a, &req);
    }
    burst.run(&mut a, 1);
    let sent: Vec<Vec<u8>> = burst.out().into_iter().map(Result::unwrap).collect();
    // ESP to B from A, sequence numbers 1, 2, 3.
    for (i, f) in sent.iter().enumerate() {
        let e = esp::parse(f).unwrap();
        assert_eq!(
            (e.src, e.dst, e.spi, e.seq_lo),
            (A_IP, B_IP, 0x100, i as u32 + 1)
        );
        assert_eq!(&f[..6], &[2, 0, 0, 0, 1, 2], "to the underlay next hop");
    }
    // B opens them and delivers into "its VPC" (here: VXLAN to the same VTEP).
    let mut burst = Burst::new();
    for f in &sent {
        burst.push(f, Dir::In);
    }
    burst.run(&mut b, 1);
    for f in burst.out() {
        let f = f.unwrap();
        let p = packet::parse_frame(&f).unwrap();
        assert_eq!(p.vxlan.unwrap().vni, VNI);
        let inner = p.vxlan_inner(&f).unwrap();
        assert_eq!(&inner[..6], &VM_MAC);
        assert_eq!(&inner[14..], ip_of(&req));
    }
    // The answer, B → A, comes out of A as VXLAN toward the VPC's host.
    let resp = udp_v4(REMOTE_HOST, 53, VM, 40000, b"answer");
    let esp_frame = seal_at_b(&mut b, &resp, 1, 2).remove(0);
    let mut burst = Burst::new();
    burst.push(&esp_frame, Dir::In);
    burst.run(&mut a, 2);
    let f = burst.out().remove(0).unwrap();
    let p = packet::parse_frame(&f).unwrap();
    assert_eq!(p.vxlan.unwrap().vni, VNI);
    assert_eq!(
        &f[30..34],
        &VTEP.octets(),
        "outer destination: the VPC's VTEP"
    );
    assert_eq!(&f[26..30], &A_IP.octets());
    let inner = p.vxlan_inner(&f).unwrap();
    assert_eq!(&inner[..6], &VM_MAC);
    assert_eq!(&inner[6..12], &ipsec::GATEWAY_MAC);
    assert_eq!(&inner[14..], ip_of(&resp));
    let s = a.tunnels();
    assert_eq!(s[0].outbound.packets, 3);
    assert_eq!(s[0].inbound[0].1.packets, 1);
}

#[test]
fn spd_picks_the_tunnel_by_prefix_and_ignores_other_traffic() {
    let (a, _) = pair();
    assert!(a.has_vni(VNI));
    assert!(!a.has_vni(101));
    let vm = Ipv4Addr::from(VM);
    assert!(a
        .outbound_tunnel(VNI, vm, Ipv4Addr::new(198, 18, 170, 99))
        .is_some());
    assert!(a
        .outbound_tunnel(VNI, vm, Ipv4Addr::new(198, 18, 171, 1))
        .is_none());
    assert!(a
        .outbound_tunnel(101, vm, Ipv4Addr::new(198, 18, 170, 1))
        .is_none());
    // Not from the local selector.
    assert!(a
        .outbound_tunnel(
            VNI,
            Ipv4Addr::new(198, 19, 2, 2),
            Ipv4Addr::new(198, 18, 170, 1)
        )
        .is_none());
}

fn sealed_by_b(b: &mut Gateway, n: usize) -> Vec<Vec<u8>> {
    let resp = udp_v4(REMOTE_HOST, 53, VM, 40000, b"answer");
    seal_at_b(b, &resp, n, 0)
}

/// `n` copies of the IP packet of `frame` (an Ethernet frame from the site's side) as B
/// seals them toward A, at time `now`.
fn seal_at_b(b: &mut Gateway, frame: &[u8], n: usize, now: u32) -> Vec<Vec<u8>> {
    seal_burst_at_b(b, frame, n, now)
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

/// The same, each packet's outcome: the frame sent, or its drop reason.
fn seal_burst_at_b(
    b: &mut Gateway,
    frame: &[u8],
    n: usize,
    now: u32,
) -> Vec<Result<Vec<u8>, EspDrop>> {
    let ip = ip_of(frame);
    let mut inner = vec![0u8; 14];
    inner[12] = 0x08;
    inner.extend_from_slice(ip);
    let f = vxlan_wrap(VTEP.octets(), B_IP.octets(), 1, VNI, &inner);
    let (src, dst) = (
        Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]),
        Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]),
    );
    let t = b.outbound_tunnel(VNI, src, dst).unwrap();
    let mut burst = Burst::new();
    for _ in 0..n {
        burst.push(
            &f,
            Dir::Out {
                tunnel: t,
                ip_off: 64,
                ip_end: 64 + ip.len() as u16,
            },
        );
    }
    burst.run(b, now);
    burst.out()
}

fn open_at_a(a: &mut Gateway, frames: &[Vec<u8>], now: u32) -> Vec<Result<Vec<u8>, EspDrop>> {
    let mut burst = Burst::new();
    for f in frames {
        burst.push(f, Dir::In);
    }
    burst.run(a, now);
    burst.out()
}

#[test]
fn replayed_packets_are_dropped_and_counted_even_within_one_burst() {
    let (mut a, mut b) = pair();
    let f = sealed_by_b(&mut b, 3);
    let r = open_at_a(&mut a, &[f[0].clone(), f[0].clone(), f[2].clone()], 0);
    assert!(r[0].is_ok());
    assert_eq!(r[1], Err(EspDrop::Replay));
    assert!(r[2].is_ok());
    // Later: a copy of 3 again, and 2 (out of order, in the window) once.
    let r = open_at_a(&mut a, &[f[2].clone(), f[1].clone(), f[1].clone()], 0);
    assert_eq!(r[0], Err(EspDrop::Replay));
    assert!(r[1].is_ok());
    assert_eq!(r[2], Err(EspDrop::Replay));
    assert_eq!(a.stats().dropped(EspDrop::Replay), 3);
    assert_eq!(a.stats().in_packets, 3);
}

#[test]
fn too_old_packets_left_of_the_window_are_dropped() {
    let (mut a, mut b) = pair();
    let f = sealed_by_b(&mut b, 70);
    // 70 arrives first; the window (64) then reaches down to 7.
    assert!(open_at_a(&mut a, &f[69..70], 0)[0].is_ok());
    assert!(open_at_a(&mut a, &f[6..7], 0)[0].is_ok());
    assert_eq!(open_at_a(&mut a, &f[5..6], 0)[0], Err(EspDrop::Replay));
}

#[test]
fn a_wrong_key_fails_authentication_and_does_not_move_the_window() {
    let (mut a, _) = pair();
    // B with the right SPI but the wrong key.
    let mut bad = Gateway::new(GatewayConfig::new(B_IP, [2; 6], [3; 6]));
    bad.apply(&[b_side(sa(0x200, 9), vec![sa(0x100, 1)])], 0)
        .unwrap();
    let forged = sealed_by_b(&mut bad, 5);
    let r = open_at_a(&mut a, &forged, 0);
    assert!(r.iter().all(|x| *x == Err(EspDrop::Auth)));
    assert_eq!(a.stats().dropped(EspDrop::Auth), 5);
    // The genuine packets with those sequence numbers still pass.
    let (_, mut b) = pair();
    let good = sealed_by_b(&mut b, 5);
    assert!(open_at_a(&mut a, &good, 0).iter().all(|x| x.is_ok()));
}

#[test]
fn unknown_spi_and_truncated_packets_are_dropped() {
    let (mut a, mut b) = pair();
    let f = sealed_by_b(&mut b, 1).remove(0);
    let mut unknown = f.clone();
    unknown[34..38].copy_from_slice(&0x999u32.to_be_bytes());
    let mut short_ip = f.clone();
    short_ip[16..18].copy_from_slice(&40u16.to_be_bytes());
    let cut = f[..f.len() - 30].to_vec();
    let tiny = f[..30].to_vec();
    let r = open_at_a(&mut a, &[unknown, short_ip, cut, tiny], 0);
    assert_eq!(r[0], Err(EspDrop::UnknownSpi));
    assert_eq!(r[1], Err(EspDrop::Truncated));
    assert_eq!(r[2], Err(EspDrop::Truncated));
    assert_eq!(r[3], Err(EspDrop::Truncated));
    assert_eq!(a.stats().dropped(EspDrop::UnknownSpi), 1);
    assert_eq!(a.stats().dropped(EspDrop::Truncated), 3);
}

#[test]
fn inner_packets_outside_the_selectors_are_dropped() {
    let (mut a, _) = pair();
    // B's tunnel selector allows 198.18.0.0/16 as source: wider than A's.
    let mut b = Gateway::new(GatewayConfig::new(B_IP, [2; 6], [3; 6]));
    b.apply(
        &[tunnel(
            sa(0x200, 2),
            vec![sa(0x100, 1)],
            A_IP,
            "198.18.0.0/16",
            "198.19.1.0/24",
        )],
        0,
    )
    .unwrap();
    let spoof = udp_v4([198, 18, 99, 1], 53, VM, 40000, b"spoofed");
    let esp_frame = seal_at_b(&mut b, &spoof, 1, 0).remove(0);
    assert_eq!(open_at_a(&mut a, &[esp_frame], 0)[0], Err(EspDrop::Policy));
}

#[test]
fn too_big_with_df_is_answered_with_icmp_fragmentation_needed() {
    let (mut a, _) = pair();
    // A TCP segment from the VM with `len` bytes of payload (40 bytes of headers).
    let segment = |len: usize| {
        tcp_v4(
            VM,
            40000,
            REMOTE_HOST,
            80,
            packet::tcp_flags::ACK,
            1,
            &vec![7u8; len],
        )
    };
    // 1450 bytes of IP with DF (TCP sets it): 1450 + 58 > 1500.
    let mut seg = segment(1410);
    seg[14 + 6] |= 0x40;
    let c = packet::csum::checksum(0, &{
        let mut h = seg[14..34].to_vec();
        h[10] = 0;
        h[11] = 0;
        h
    });
    seg[24..26].copy_from_slice(&c.to_be_bytes());
    assert_eq!(seg.len() - 14, 1450);
    let mut burst = Burst::new();
    burst.vpc(&a, &seg);
    burst.run(&mut a, 0);
    let f = burst.out().remove(0).unwrap();
    let p = packet::parse_frame(&f).unwrap();
    assert_eq!(p.vxlan.unwrap().vni, VNI);
    assert_eq!(&f[30..34], &VTEP.octets());
    let inner = p.vxlan_inner(&f).unwrap();
    assert_eq!(&inner[..6], &VM_MAC, "back to the sender's MAC");
    let ip = &inner[14..];
    assert_eq!(ip[9], 1, "ICMP");
    assert_eq!(&ip[16..20], &VM);
    assert_eq!(packet::csum::checksum(0, &ip[..20]), 0);
    let icmp = &ip[20..];
    assert_eq!((icmp[0], icmp[1]), (3, 4));
    assert_eq!(u16::from_be_bytes([icmp[6], icmp[7]]), 1446);
    assert_eq!(packet::csum::checksum(0, icmp), 0);
    // The quote: the original IP header and 8 bytes.
    assert_eq!(&icmp[8..], &seg[14..14 + 28]);
    assert_eq!(a.stats().icmp_too_big, 1);
    // Without DF: dropped and counted.
    let mut seg2 = seg.clone();
    seg2[14 + 6] &= !0x40;
    let mut burst = Burst::new();
    burst.vpc(&a, &seg2);
    burst.run(&mut a, 0);
    assert_eq!(burst.out()[0], Err(EspDrop::TooBig));
    // 1446 bytes fit exactly: a 1500-byte ESP packet.
    let fits = segment(1406);
    let mut burst = Burst::new();
    burst.vpc(&a, &fits);
    burst.run(&mut a, 0);
    assert_eq!(burst.out()[0].as_ref().unwrap().len(), 14 + 1500);
}

#[test]
fn rekey_keeps_the_old_inbound_sa_for_the_grace_period_then_drops_it() {
    let (mut a, mut b) = pair();
    let old = sealed_by_b(&mut b, 2);
    assert!(open_at_a(&mut a, &old[..1], 1000).iter().all(|r| r.is_ok()));
    // Make before break: A gets a new inbound SA (0x201) and a new outbound one (0x101);
    // 0x200 is no longer configured.
    a.apply(&[a_side(sa(0x101, 11), vec![sa(0x201, 12)])], 1000)
        .unwrap();
    let s = a.tunnels();
    assert_eq!(s[0].outbound_spi, 0x101);
    assert_eq!(s[0].outbound_seq, 0, "a new outbound SA starts at 1");
    assert_eq!(s[0].inbound.len(), 2);
    assert!(
        s[0].inbound.iter().any(|x| x.0 == 0x200 && x.2),
        "old SA retiring"
    );
    // Packets the peer sealed with the old SA before it switched still arrive.
    assert!(open_at_a(&mut a, &old[1..2], 1000 + 29_000)[0].is_ok());
    // The peer switches to 0x201.
    b.apply(&[b_side(sa(0x201, 12), vec![sa(0x101, 11)])], 1000)
        .unwrap();
    let new = sealed_by_b(&mut b, 1);
    assert_eq!(esp::parse(&new[0]).unwrap().spi, 0x201);
    assert!(open_at_a(&mut a, &new, 1000 + 29_000)[0].is_ok());
    // After the grace period the old SPI is unknown.
    let (_, mut b_old) = pair();
    let late = sealed_by_b(&mut b_old, 3);
    assert_eq!(
        open_at_a(&mut a, &late[2..], 1000 + 30_001)[0],
        Err(EspDrop::UnknownSpi)
    );
    assert_eq!(a.tunnels()[0].inbound.len(), 1);
}

#[test]
fn reapplying_the_same_configuration_keeps_sequence_numbers_and_windows() {
    let (mut a, mut b) = pair();
    let req = udp_v4(VM, 40000, REMOTE_HOST, 53, b"q");
    let mut burst = Burst::new();
    burst.vpc(&a, &req);
    burst.run(&mut a, 0);
    let f = sealed_by_b(&mut b, 1);
    assert!(open_at_a(&mut a, &f, 0)[0].is_ok());
    a.apply(&[a_side(sa(0x100, 1), vec![sa(0x200, 2)])], 5)
        .unwrap();
    assert_eq!(a.tunnels()[0].outbound_seq, 1);
    assert_eq!(open_at_a(&mut a, &f, 5)[0], Err(EspDrop::Replay));
}

#[test]
fn bad_configurations_are_refused_whole() {
    let mut a = Gateway::new(GatewayConfig::new(A_IP, [2; 6], [3; 6]));
    let good = a_side(sa(0x100, 1), vec![sa(0x200, 2)]);
    let mut short_key = good.clone();
    short_key.outbound.keymat = vec![1; 16];
    assert!(a.apply(&[short_key], 0).is_err());
    let mut reserved = good.clone();
    reserved.inbound[0].spi = 7;
    assert!(a.apply(&[reserved], 0).is_err());
    let mut dup = good.clone();
    dup.name = "acme/other".into();
    assert!(a.apply(&[good.clone(), dup], 0).is_err());
    assert!(a.is_empty());
    assert!(a.apply(&[good], 0).is_ok());
    assert!(!a.is_empty());
}

#[test]
fn sequence_numbers_run_out_without_esn() {
    let (mut a, _) = pair();
    a.set_outbound_seq_for_test(0, u64::from(u32::MAX) - 1);
    let req = udp_v4(VM, 40000, REMOTE_HOST, 53, b"q");
    let mut burst = Burst::new();
    burst.vpc(&a, &req);
    burst.vpc(&a, &req);
    burst.run(&mut a, 0);
    let r = burst.out();
    assert_eq!(esp::parse(r[0].as_ref().unwrap()).unwrap().seq_lo, u32::MAX);
    assert_eq!(r[1], Err(EspDrop::SeqExhausted));
}

#[test]
fn prefixes_parse_and_match() {
    let p: Prefix = "198.19.1.0/24".parse().unwrap();
    assert!(p.contains(Ipv4Addr::new(198, 19, 1, 255)));
    assert!(!p.contains(Ipv4Addr::new(198, 19, 2, 0)));
    assert!("198.19.1.1/24".parse::<Prefix>().is_err());
    assert!("198.19.1.0/33".parse::<Prefix>().is_err());
    assert!(p.overlaps(&"198.19.0.0/16".parse().unwrap()));
    assert!(!p.overlaps(&"198.19.2.0/24".parse().unwrap()));
    assert!("0.0.0.0/0"
        .parse::<Prefix>()
        .unwrap()
        .contains(Ipv4Addr::new(1, 2, 3, 4)));
}

/// The ESP sequence number of an outbound frame.
fn esp_seq(f: &[u8]) -> u32 {
    esp::parse(f).unwrap().seq_lo
}

/// B's end on a node of two workers: a gateway each, sharing the node's `SeqSpace`.
fn b_workers(seqs: &std::sync::Arc<ipsec::SeqSpace>) -> (Gateway, Gateway) {
    let mk = || {
        let mut g = Gateway::with_seq_space(
            GatewayConfig::new(B_IP, [2, 0, 0, 0, 2, 1], [2, 0, 0, 0, 2, 2]),
            seqs.clone(),
        );
        g.apply(&[b_side(sa(0x200, 2), vec![sa(0x100, 1)])], 0)
            .unwrap();
        g
    };
    (mk(), mk())
}

/// An SA's packets leave from whichever worker their flow arrives on: with the node's
/// `SeqSpace` the two workers' gateways never send one sequence number twice, so the
/// peer takes every packet; without it (the control) the second worker repeats the
/// first one's numbers and the peer drops them as replays.
#[test]
fn workers_sharing_a_seq_space_never_repeat_a_sequence_number() {
    let (mut a, _) = pair();
    let seqs = ipsec::SeqSpace::new();
    let (mut b1, mut b2) = b_workers(&seqs);
    assert_eq!(seqs.len(), 1, "one SA, one counter for both workers");
    let mut sent = sealed_by_b(&mut b1, 3);
    sent.extend(sealed_by_b(&mut b2, 3));
    sent.extend(sealed_by_b(&mut b1, 2));
    let mut numbers: Vec<u32> = sent.iter().map(|f| esp_seq(f)).collect();
    numbers.sort_unstable();
    assert_eq!(numbers, (1..=8).collect::<Vec<u32>>());
    assert!(open_at_a(&mut a, &sent, 0).iter().all(Result::is_ok));
    assert_eq!(a.stats().dropped(EspDrop::Replay), 0);
    assert_eq!(b1.tunnels()[0].outbound_seq, 8);
    assert_eq!(b2.tunnels()[0].outbound_seq, 8);

    // A rekeyed outbound SA (new SPI and key, applied at both workers) starts at 1; the
    // old SA's counter is forgotten once no gateway holds it.
    let rekeyed = [b_side(sa(0x201, 3), vec![sa(0x100, 1)])];
    b1.apply(&rekeyed, 0).unwrap();
    assert_eq!(seqs.len(), 2, "b2 still holds the old SA");
    b2.apply(&rekeyed, 0).unwrap();
    assert_eq!(seqs.len(), 1);
    let f = sealed_by_b(&mut b2, 1);
    assert_eq!(esp_seq(&f[0]), 1);
    assert_eq!(esp::parse(&f[0]).unwrap().spi, 0x201);

    // The control: two gateways with counters of their own.
    let (mut a, mut c1) = pair();
    let (_, mut c2) = pair();
    let mut sent = sealed_by_b(&mut c1, 2);
    sent.extend(sealed_by_b(&mut c2, 2));
    let r = open_at_a(&mut a, &sent, 0);
    assert_eq!(r.iter().filter(|x| **x == Err(EspDrop::Replay)).count(), 2);
}

/// Exhaustion is judged on the shared counter: once one worker used the last number,
/// the other's next packet is refused too.
#[test]
fn a_shared_counter_runs_out_for_every_worker_at_once() {
    let seqs = ipsec::SeqSpace::new();
    let (mut b1, mut b2) = b_workers(&seqs);
    b1.set_outbound_seq_for_test(0, u64::from(u32::MAX) - 1);
    assert_eq!(
        sealed_by_b(&mut b2, 1).len(),
        1,
        "the last number is still free"
    );
    let resp = udp_v4(REMOTE_HOST, 53, VM, 40000, b"answer");
    assert_eq!(
        seal_burst_at_b(&mut b1, &resp, 1, 0),
        vec![Err(EspDrop::SeqExhausted)]
    );
}
