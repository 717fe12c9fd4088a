//! FM's end of the liveness lane ([`proto::liveness`]): a thread of its own reads the
//! nodes' UDP beacons and stamps each one's session as heard, in the same `seen` clock
//! the session readers stamp. Neither the master task's queue nor the runtime that
//! drives the session streams stands between a live node and that stamp.

use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proto::liveness::Beacon;
use tracing::{debug, info, warn};

/// Counters of the lane, exported as `starfabric_fm_liveness_*`.
#[derive(Debug, Default)]
pub struct LivenessCounters {
    /// Beacons that stamped a session.
    pub beacons: AtomicU64,
    /// Datagrams that were no beacon, or carried a token of no open session.
    pub rejected: AtomicU64,
}

/// Open sessions by token.
#[derive(Debug)]
pub(crate) struct LivenessRegistry {
    sessions: Mutex<HashMap<u64, Arc<AtomicU64>>>,
    /// FM's clock epoch: a stamp here means what a session reader's stamp means.
    start: Instant,
    pub(crate) counters: LivenessCounters,
}

impl LivenessRegistry {
    pub(crate) fn new(start: Instant) -> Self {
        LivenessRegistry {
            sessions: Mutex::new(HashMap::new()),
            start,
            counters: LivenessCounters::default(),
        }
    }

    /// A new session's token; its beacons stamp `seen` until [`Self::remove`].
    pub(crate) fn add(&self, seen: Arc<AtomicU64>) -> u64 {
        let mut m = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            // Zero means "no token" on the wire; a collision is astronomically rare but
            // would let one node vouch for another, so it is ruled out.
            let t: u64 = rand::random();
            if t != 0 && !m.contains_key(&t) {
                m.insert(t, seen);
                return t;
            }
        }
    }

    pub(crate) fn remove(&self, token: u64) {
        self.sessions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&token);
    }

    /// Take one datagram. Returns whether it stamped a session.
    pub(crate) fn on_datagram(&self, data: &[u8]) -> bool {
        let seen = Beacon::decode(data).ok().and_then(|b| {
            self.sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&b.token)
                .cloned()
        });
        match seen {
            Some(seen) => {
                seen.fetch_max(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
                self.counters.beacons.fetch_add(1, Ordering::Relaxed);
                true
            }
            None => {
                self.counters.rejected.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }
}

/// The reading thread; it ends when FM stops.
pub(crate) struct LivenessListener {
    pub(crate) port: u16,
}

impl LivenessListener {
    /// Bind UDP on FM's gRPC address (same port when free, else any) and read there
    /// until `stopped`.
    pub(crate) fn start(
        grpc: SocketAddr,
        registry: Arc<LivenessRegistry>,
        stopped: Arc<AtomicBool>,
    ) -> std::io::Result<LivenessListener> {
        let sock = UdpSocket::bind(grpc).or_else(|e| {
            debug!(error = %e, %grpc, "liveness port taken; using any");
            UdpSocket::bind(SocketAddr::new(grpc.ip(), 0))
        })?;
        // The stop flag is polled between reads.
        sock.set_read_timeout(Some(Duration::from_millis(100)))?;
        let port = sock.local_addr()?.port();
        std::thread::Builder::new()
            .name("fm-liveness".into())
            .spawn(move || {
                proto::liveness::realtime_priority();
                let mut buf = [0u8; 64];
                while !stopped.load(Ordering::Relaxed) {
                    match sock.recv(&mut buf) {
                        Ok(n) => {
                            registry.on_datagram(&buf[..n]);
                        }
                        Err(e)
                            if matches!(
                                e.kind(),
                                std::io::ErrorKind::WouldBlock
                                    | std::io::ErrorKind::TimedOut
                                    | std::io::ErrorKind::Interrupted
                            ) => {}
                        Err(e) => {
                            // A connected sender's ICMP error can surface here on some
                            // stacks; it is no reason to stop listening.
                            debug!(error = %e, "liveness read failed");
                        }
                    }
                }
            })?;
        info!(port, "liveness lane listening");
        Ok(LivenessListener { port })
    }
}

/// Start the lane, or say why FM runs without one (nodes then rely on heartbeats).
pub(crate) fn start_or_warn(
    grpc: SocketAddr,
    registry: Arc<LivenessRegistry>,
    stopped: Arc<AtomicBool>,
) -> u16 {
    match LivenessListener::start(grpc, registry, stopped) {
        Ok(l) => l.port,
        Err(e) => {
            warn!(error = %e, "no liveness lane; nodes are judged by their heartbeats alone");
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_beacon_stamps_only_its_own_open_session() {
        let start = Instant::now() - Duration::from_secs(5);
        let reg = LivenessRegistry::new(start);
        let (a, b) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let ta = reg.add(a.clone());
        let tb = reg.add(b.clone());
        assert_ne!(ta, tb);
        assert!(reg.on_datagram(&Beacon { token: ta, seq: 1 }.encode()));
        assert!(a.load(Ordering::Relaxed) >= 5000);
        assert_eq!(b.load(Ordering::Relaxed), 0);
        // Unknown token, a closed session, garbage: counted, nothing stamped.
        assert!(!reg.on_datagram(
            &Beacon {
                token: ta ^ tb ^ 1,
                seq: 1
            }
            .encode()
        ));
        reg.remove(tb);
        assert!(!reg.on_datagram(&Beacon { token: tb, seq: 2 }.encode()));
        assert!(!reg.on_datagram(b"hello"));
        assert_eq!(b.load(Ordering::Relaxed), 0);
        assert_eq!(reg.counters.beacons.load(Ordering::Relaxed), 1);
        assert_eq!(reg.counters.rejected.load(Ordering::Relaxed), 3);
    }
}
