//! Across the planes, in one process: a TCP handshake through a PP pipeline makes PP
//! notice `TcpEstablished` on the flow's forward rule, the FM client carries it to FM,
//! FM routes it to the SC group owning the flow, and the built-in SNAT moves the flow
//! from RFC 5382's transitory idle timeout to the established one.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{nf_part, snat_chain, wait, Cluster};
use nf::NetworkFunction;
use nfs::snat::{Snat, SnatConfig, SnatPool};
use packet::build::{tcp_v4, vxlan_wrap};
use packet::tcp_flags::{ACK, SYN};
use pipeline::{
    FlowKey, ManualClock, MemRing, NoticeKind, Pipeline, PipelineConfig, VecSource, VpcBinding,
    Worker,
};
use pp::FmClient;
use testkit::rig::node;

fn segment(flags: u8) -> Vec<u8> {
    let inner = tcp_v4([198, 18, 10, 2], 40000, [198, 19, 0, 9], 80, flags, 1, b"");
    vxlan_wrap([198, 18, 0, 50], [198, 18, 0, 1], 51000, 100, &inner)
}

fn key() -> FlowKey {
    "100 tcp 198.18.10.2:40000 > 198.19.0.9:80".parse().unwrap()
}

/// The SNAT's deadline for the flow in the group's state, read from the group's
/// snapshot on SC node `i`.
fn deadline(cluster: &Cluster, i: usize) -> Option<u64> {
    let st = cluster.group_status(cluster.scs[i].addr(), true);
    let part = nf_part(&st.first()?.snapshot, 0);
    let mut snat = Snat::new(SnatConfig::new(vec![SnatPool::new(
        vec!["198.19.255.1".parse().unwrap()],
        1024,
        65535,
    )]))
    .unwrap();
    snat.restore(&part).ok()?;
    snat.flow_deadline(&key())
}

#[test]
fn a_handshake_through_pp_moves_the_snat_mapping_to_the_established_timeout() {
    let cluster = Cluster::start(
        vec![snat_chain(&["198.19.255.1"])],
        3,
        Arc::new(sc::BuiltinNfs),
    );
    cluster.wait_groups(1, 3);
    let (client, mut links) = FmClient::start(cluster.pp_config("pp-events")).unwrap();
    let link = links.remove(0);
    let mut cfg = PipelineConfig::new(node());
    // Activity reports would refresh the deadline too; this test is about the handshake.
    cfg.notices.active_period_ms = 0;
    let mut p = Pipeline::new(cfg, link.source).unwrap();
    p.bind_vpc(
        100,
        VpcBinding {
            tenant: 1,
            chain: 1,
        },
    );
    let mut w = Worker::new(
        p,
        MemRing::new(VecSource::default(), 64),
        64,
        Box::new(ManualClock::default()),
    );
    wait(Duration::from_secs(5), "PP session", || {
        client.connected().then_some(())
    });

    // The SYN: a miss, decided by the SNAT as half-open.
    w.io.source.push(segment(SYN), 0);
    w.run_once().unwrap();
    wait(Duration::from_secs(10), "the flow's rule", || {
        let _ = link.doorbell.wait_ring(Duration::from_millis(10));
        w.run_once().unwrap();
        w.pipeline.lookup_rule(&key())
    });
    assert!(w.pipeline.take_notices().is_empty(), "a SYN is no news");
    let half_open = wait(Duration::from_secs(10), "the flow at SC", || {
        deadline(&cluster, 0)
    });

    // The opener's ACK completes the handshake: PP notices it once, on the forward key.
    w.io.source.push(segment(ACK), 0);
    w.io.source.push(segment(ACK), 0);
    w.run_once().unwrap();
    let notices = w.pipeline.take_notices();
    assert_eq!(notices.len(), 1);
    assert_eq!(
        (notices[0].kind, notices[0].key),
        (NoticeKind::TcpEstablished, key())
    );
    client.notice_sender().send(notices);

    // At SC the deadline moves from "transitory since the SYN" (240 s) to "established
    // since the event" (7440 s): later by more than 7440 s - 240 s.
    let established = wait(Duration::from_secs(10), "the event at SC", || {
        deadline(&cluster, 0).filter(|&d| d > half_open)
    });
    assert!(
        established - half_open > 7_440_000 - 240_000,
        "half-open deadline {half_open}, established {established}"
    );
    assert_eq!(
        client
            .stats()
            .notices_sent
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}
