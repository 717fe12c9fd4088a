//! The liveness lane: one UDP beacon per heartbeat period, sent by a thread of its own
//! on each node and read by a thread of its own at FM.
//!
//! The session stream's control lane only orders messages inside one process: once a
//! heartbeat is in the HTTP/2 stream it waits behind the data frames ahead of it, for
//! the stream's flow-control window, and for the runtimes that drive the connection
//! on both ends. Under a flood those runtimes are busy with exactly the work that
//! filled the queues, and a live node went silent for 30–500 ms (docs/setup-path.md).
//! A beacon shares none of that: no queue, no window, no runtime. Corosync and the
//! like give their heartbeat thread a real-time priority for the same reason, which
//! the sender asks for too (best effort).
//!
//! A beacon says "this session's node is alive", so it carries the session's token,
//! a random number FM hands out in the registration ack; FM ignores (and counts)
//! beacons with a token it does not know. A node whose runtime has stopped making
//! progress (the caller's [`Pulse`] is older than `hang_after`) stops sending, so a hung
//! node is still found dead, only later than a crashed or cut-off one.
//!
//! Why not a library: the datagram is 24 bytes of fixed layout; a wire crate would add
//! a dependency for two functions.

use std::io;
use std::net::{SocketAddr, ToSocketAddrs, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use tracing::{debug, info, warn};

/// Bytes in a beacon: magic (4), version (2), reserved (2), token (8), seq (8), all
/// big-endian.
pub const BEACON_LEN: usize = 24;
const MAGIC: u32 = 0x5346_4c56; // "SFLV"
const VERSION: u16 = 1;

/// One liveness datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beacon {
    /// The session's token from [`crate::v1::RegisterAck::liveness_token`].
    pub token: u64,
    /// Counts up from 1 per session; FM does not need it, but a capture reads better.
    pub seq: u64,
}

/// Why a datagram is not a beacon.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BeaconError {
    #[error("liveness datagram of {0} bytes, want {BEACON_LEN}")]
    Length(usize),
    #[error("not a liveness beacon (magic {0:#010x})")]
    Magic(u32),
    #[error("liveness beacon version {0}, this build speaks {VERSION}")]
    Version(u16),
}

impl Beacon {
    pub fn encode(&self) -> [u8; BEACON_LEN] {
        let mut b = [0u8; BEACON_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&VERSION.to_be_bytes());
        b[8..16].copy_from_slice(&self.token.to_be_bytes());
        b[16..24].copy_from_slice(&self.seq.to_be_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Beacon, BeaconError> {
        let b: &[u8; BEACON_LEN] = b.try_into().map_err(|_| BeaconError::Length(b.len()))?;
        let word = |r: std::ops::Range<usize>| {
            let mut x = [0u8; 8];
            x[8 - r.len()..].copy_from_slice(&b[r]);
            u64::from_be_bytes(x)
        };
        let magic = word(0..4) as u32;
        if magic != MAGIC {
            return Err(BeaconError::Magic(magic));
        }
        let version = word(4..6) as u16;
        if version != VERSION {
            return Err(BeaconError::Version(version));
        }
        Ok(Beacon {
            token: word(8..16),
            seq: word(16..24),
        })
    }
}

/// Where a node sends its beacons: FM's host as the node reaches it (`fm` is the
/// `host:port` or URI it connected to), on the UDP port FM announced.
pub fn target(fm: &str, port: u16) -> Option<SocketAddr> {
    let rest = fm
        .strip_prefix("http://")
        .or_else(|| fm.strip_prefix("https://"))
        .unwrap_or(fm);
    let authority = rest.split('/').next()?;
    let host = match authority.rsplit_once(':') {
        Some((h, p)) if p.parse::<u16>().is_ok() => h,
        _ => authority,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (host, port).to_socket_addrs().ok()?.next()
}

/// Proof that the node's own runtime still makes progress: a task of the node's
/// [`Pulse::beat`]s every period, and the beacon thread stops speaking for a node whose
/// pulse is older than `hang_after`.
#[derive(Debug, Clone)]
pub struct Pulse {
    epoch: Instant,
    last_ms: Arc<AtomicU64>,
}

impl Default for Pulse {
    fn default() -> Self {
        Pulse::new()
    }
}

impl Pulse {
    pub fn new() -> Pulse {
        Pulse {
            epoch: Instant::now(),
            last_ms: Arc::new(AtomicU64::new(0)),
        }
    }

    pub fn beat(&self) {
        self.last_ms
            .fetch_max(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Time since the last beat (since creation, if none).
    pub fn age(&self) -> Duration {
        let now = self.epoch.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last_ms.load(Ordering::Relaxed)))
    }
}

/// Counters of a [`LivenessSender`].
#[derive(Debug, Default)]
pub struct SenderStats {
    pub sent: AtomicU64,
    /// Periods the node's pulse was too old to vouch for it.
    pub withheld: AtomicU64,
    pub send_errors: AtomicU64,
}

/// The node's beacon thread for one session; it stops when dropped.
#[derive(Debug)]
pub struct LivenessSender {
    stop: Arc<AtomicBool>,
    pub stats: Arc<SenderStats>,
}

impl LivenessSender {
    /// Send a beacon for `token` to `target` every `period` while `pulse` is younger
    /// than `hang_after`.
    pub fn start(
        target: SocketAddr,
        token: u64,
        period: Duration,
        pulse: Pulse,
        hang_after: Duration,
    ) -> io::Result<LivenessSender> {
        let bind: SocketAddr = if target.is_ipv4() {
            ([0, 0, 0, 0], 0).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
        };
        let sock = UdpSocket::bind(bind)?;
        sock.connect(target)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(SenderStats::default());
        let (s, st) = (stop.clone(), stats.clone());
        let period = period.max(Duration::from_millis(1));
        std::thread::Builder::new()
            .name("liveness-tx".into())
            .spawn(move || {
                realtime_priority();
                let mut seq = 0u64;
                let mut next = Instant::now();
                while !s.load(Ordering::Relaxed) {
                    if pulse.age() <= hang_after {
                        seq += 1;
                        match sock.send(&Beacon { token, seq }.encode()) {
                            Ok(_) => st.sent.fetch_add(1, Ordering::Relaxed),
                            Err(e) => {
                                debug!(error = %e, %target, "liveness beacon not sent");
                                st.send_errors.fetch_add(1, Ordering::Relaxed)
                            }
                        };
                    } else {
                        if st.withheld.fetch_add(1, Ordering::Relaxed) == 0 {
                            warn!(
                                age_ms = pulse.age().as_millis() as u64,
                                "node runtime stalled; liveness beacons withheld"
                            );
                        }
                    }
                    // Deadline-paced, so a late wake-up does not push every later beacon.
                    next += period;
                    let now = Instant::now();
                    if next <= now {
                        next = now;
                    } else {
                        std::thread::sleep(next - now);
                    }
                }
            })?;
        info!(%target, period_ms = period.as_millis() as u64, "liveness beacons started");
        Ok(LivenessSender { stop, stats })
    }
}

impl Drop for LivenessSender {
    fn drop(&mut self) {
        // Not joined: the thread notices within one period, and a drop inside an async
        // task must not block it for that long.
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Start a session's beacons when FM's registration ack offers the lane; None (and a
/// warning when the lane was offered) otherwise, and the session's heartbeats alone
/// keep the node alive at FM. `fm` is the address the node reached FM on; `period` its
/// heartbeat period; `pulse` is beaten by the task that sends those heartbeats.
pub fn for_session(
    fm: &str,
    ack: &crate::v1::RegisterAck,
    period: Duration,
    pulse: &Pulse,
) -> Option<LivenessSender> {
    if ack.liveness_port == 0 || ack.liveness_token == 0 {
        return None;
    }
    let port = u16::try_from(ack.liveness_port).ok()?;
    let Some(target) = target(fm, port) else {
        warn!(%fm, port, "cannot resolve FM for liveness beacons; heartbeats only");
        return None;
    };
    // A runtime stalled this long is hung, not busy: stop vouching for it.
    let hang_after = (period * 20).max(Duration::from_secs(1));
    match LivenessSender::start(
        target,
        ack.liveness_token,
        period,
        pulse.clone(),
        hang_after,
    ) {
        Ok(s) => Some(s),
        Err(e) => {
            warn!(error = %e, %target, "no liveness beacons; heartbeats only");
            None
        }
    }
}

/// Ask for SCHED_FIFO at the lowest real-time priority for the calling thread. It only
/// sleeps and sends 24 bytes, so it cannot starve anything; without the privilege it
/// stays a normal thread (its wake-ups are still favoured by the fair scheduler).
pub fn realtime_priority() {
    let param = libc::sched_param { sched_priority: 1 };
    // SAFETY: pthread_self() is the calling thread's valid handle and `param` is a fully
    // initialised sched_param that outlives the call.
    let rc = unsafe { libc::pthread_setschedparam(libc::pthread_self(), libc::SCHED_FIFO, &param) };
    if rc != 0 {
        debug!(errno = rc, "no real-time priority for the liveness thread");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_beacon_round_trips_and_bad_datagrams_are_named() {
        let b = Beacon {
            token: 0xdead_beef_0123_4567,
            seq: 42,
        };
        assert_eq!(Beacon::decode(&b.encode()), Ok(b));
        assert_eq!(Beacon::decode(&[0; 5]), Err(BeaconError::Length(5)));
        let mut x = b.encode();
        x[0] ^= 1;
        assert!(matches!(Beacon::decode(&x), Err(BeaconError::Magic(_))));
        let mut x = b.encode();
        x[5] = 9;
        assert_eq!(Beacon::decode(&x), Err(BeaconError::Version(9)));
    }

    #[test]
    fn the_target_is_fm_host_on_the_announced_port() {
        let t = |s| target(s, 9000);
        assert_eq!(t("127.0.0.1:7000"), Some("127.0.0.1:9000".parse().unwrap()));
        assert_eq!(
            t("http://127.0.0.1:7000"),
            Some("127.0.0.1:9000".parse().unwrap())
        );
        assert_eq!(t("[::1]:7000"), Some("[::1]:9000".parse().unwrap()));
        assert_eq!(t("127.0.0.1"), Some("127.0.0.1:9000".parse().unwrap()));
    }

    #[test]
    fn beacons_flow_while_the_pulse_is_fresh_and_stop_when_it_is_stale() {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        rx.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let pulse = Pulse::new();
        pulse.beat();
        let tx = LivenessSender::start(
            rx.local_addr().unwrap(),
            7,
            Duration::from_millis(2),
            pulse.clone(),
            Duration::from_millis(200),
        )
        .unwrap();
        let mut buf = [0u8; 64];
        let mut seqs = Vec::new();
        for _ in 0..3 {
            let n = rx.recv(&mut buf).unwrap();
            let b = Beacon::decode(&buf[..n]).unwrap();
            assert_eq!(b.token, 7);
            seqs.push(b.seq);
        }
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
        // No more beats: once the pulse is older than hang_after the sender withholds.
        let until = |what: &str, f: &dyn Fn() -> bool| {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !f() {
                assert!(Instant::now() < deadline, "{what} never happened");
                std::thread::sleep(Duration::from_millis(2));
            }
        };
        until("withholding", &|| {
            tx.stats.withheld.load(Ordering::Relaxed) > 0
        });
        let sent = tx.stats.sent.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(30));
        assert_eq!(tx.stats.sent.load(Ordering::Relaxed), sent);
        // A beat brings it back.
        pulse.beat();
        until("resuming", &|| tx.stats.sent.load(Ordering::Relaxed) > sent);
    }
}
