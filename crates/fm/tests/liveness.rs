//! The liveness lane end to end against a real FM on loopback: a PP node whose session
//! stream carries nothing after its registration (as when its runtime, or FM's, is
//! buried under a flood) stays alive on its UDP beacons alone, and is declared dead
//! once they stop. Beacons with a token FM did not hand out keep nobody alive.
//!
//! FM and the sessions run mTLS with a test CA, as production does (docs/security.md).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use fm::{FmConfig, FmHandle};
use proto::liveness::{Beacon, LivenessSender, Pulse};
use proto::tls::{Bundle, Ca, Identity, NodeTls, Role};
use proto::v1::fabric_master_client::FabricMasterClient;
use proto::v1::{self, pp_down, pp_up};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

struct Session {
    ack: v1::RegisterAck,
    /// Kept open and silent: dropping it would end the session at once.
    _up: mpsc::UnboundedSender<v1::PpUp>,
    _down: tonic::Streaming<v1::PpDown>,
}

/// Node `id`'s TLS state as `role`, from the tests' one CA.
fn node_tls(role: Role, id: &str) -> Arc<NodeTls> {
    static CA: OnceLock<Ca> = OnceLock::new();
    let ca = CA.get_or_init(|| Ca::generate().unwrap());
    let ident = Identity::new(role, id).unwrap();
    NodeTls::new(&Bundle::issue(ca, &ident, Duration::from_secs(3600)).unwrap()).unwrap()
}

async fn fm() -> FmHandle {
    let cfg = FmConfig {
        pp_heartbeat: Duration::from_millis(10),
        miss_limit: 3,
        tls: Some(node_tls(Role::Fm, "fm-1")),
        ..FmConfig::default()
    };
    fm::start(cfg, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

async fn open(fm: &FmHandle, id: &str) -> Session {
    let tls = node_tls(Role::Pp, id);
    let ch = proto::connect(&fm.addr().to_string(), Some(&tls), Role::Fm)
        .await
        .unwrap();
    let mut client = FabricMasterClient::new(ch);
    let (up, rx) = mpsc::unbounded_channel();
    up.send(v1::PpUp {
        msg: Some(pp_up::Msg::Register(v1::NodeInfo {
            id: id.into(),
            role: v1::Role::Pp as i32,
            proto_version: proto::PROTO_VERSION,
            ..Default::default()
        })),
    })
    .unwrap();
    let mut down = client
        .pp_session(UnboundedReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let Some(v1::PpDown {
        msg: Some(pp_down::Msg::Registered(ack)),
    }) = down.message().await.unwrap()
    else {
        panic!("no registration ack");
    };
    Session {
        ack,
        _up: up,
        _down: down,
    }
}

async fn alive(fm: &FmHandle, id: &str) -> bool {
    fm.members()
        .await
        .unwrap()
        .members
        .iter()
        .any(|m| m.alive && m.node.as_ref().is_some_and(|n| n.id == id))
}

async fn wait_dead(fm: &FmHandle, id: &str) -> bool {
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        if !alive(fm, id).await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beacons_alone_keep_a_silent_session_alive_and_their_end_is_its_death() {
    let fm = fm().await;
    let s = open(&fm, "pp-a").await;
    assert_ne!(s.ack.liveness_port, 0, "FM offers a liveness lane");
    assert_ne!(s.ack.liveness_token, 0);
    let target = format!("127.0.0.1:{}", s.ack.liveness_port)
        .parse()
        .unwrap();
    let pulse = Pulse::new();
    pulse.beat();
    let beacons = LivenessSender::start(
        target,
        s.ack.liveness_token,
        Duration::from_millis(10),
        pulse,
        Duration::from_secs(60),
    )
    .unwrap();
    // No heartbeat on the stream for 20 times the 30 ms limit.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(alive(&fm, "pp-a").await, "beacons keep the node alive");
    let counted = fm.liveness_counters().beacons.load(Ordering::Relaxed);
    assert!(counted >= 10, "{counted} beacons counted");
    drop(beacons);
    assert!(
        wait_dead(&fm, "pp-a").await,
        "silence after the beacons is death"
    );
    fm.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_beacon_with_a_foreign_token_is_counted_and_keeps_nobody_alive() {
    let fm = fm().await;
    let s = open(&fm, "pp-b").await;
    let target = format!("127.0.0.1:{}", s.ack.liveness_port);
    let forged = Beacon {
        token: s.ack.liveness_token.wrapping_add(1),
        seq: 1,
    };
    // Forged beacons and garbage flow until the node is found dead.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let (st, sn) = (stop.clone(), sent.clone());
    let forger = std::thread::spawn(move || {
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        while !st.load(Ordering::Relaxed) {
            sock.send_to(&forged.encode(), &target).unwrap();
            sock.send_to(b"not a beacon", &target).unwrap();
            sn.fetch_add(2, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(2));
        }
    });
    assert!(
        wait_dead(&fm, "pp-b").await,
        "forged beacons kept the node alive"
    );
    let sent_at_death = sent.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    forger.join().unwrap();
    assert!(sent_at_death > 0);
    let until = Instant::now() + Duration::from_secs(5);
    while fm.liveness_counters().rejected.load(Ordering::Relaxed) == 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rejected = fm.liveness_counters().rejected.load(Ordering::Relaxed);
    assert!(rejected > 0, "rejected {rejected}");
    assert!(rejected <= sent.load(Ordering::Relaxed));
    assert_eq!(fm.liveness_counters().beacons.load(Ordering::Relaxed), 0);
    fm.stop();
}
