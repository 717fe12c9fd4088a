//! A pipeline worker's doorbell: the FM client rings it when FM's replies for that
//! worker arrive, so an idle worker wakes for them at once instead of at its next poll
//! timeout.
//!
//! It is an eventfd, so that a worker waits on its packet socket and its doorbell in one
//! `poll(2)` (the AF_XDP and UDP backends do: [`wait`]). Before it, an idle PP node's
//! worker slept in `poll` on its socket alone with a 1 ms timeout, and a reply that came
//! back while it slept waited for that timeout: on the idle netns testbed a TCP SYN
//! spent about 2.3 ms in the PP node, FM and SC, of which ~0.45 ms between FM's reply
//! reaching the node and the SYN leaving it (docs/setup-path.md, "An idle worker
//! wakes for its replies").
//!
//! One `write(2)` per burst of replies, not per reply: `rung` stays set until the
//! worker answers, and later rings before that are free.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// See the module doc.
#[derive(Debug)]
pub struct Doorbell {
    fd: OwnedFd,
    rung: AtomicBool,
}

impl Doorbell {
    pub fn new() -> io::Result<Doorbell> {
        // SAFETY: eventfd(2) with constant flags; it returns a new fd or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Doorbell {
            // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            rung: AtomicBool::new(false),
        })
    }

    /// Ring for replies already handed over (call after queueing them).
    pub fn ring(&self) {
        // AcqRel: the worker's `answer` reads this value, so the replies queued before
        // the ring are visible to it after its answer.
        if !self.rung.swap(true, Ordering::AcqRel) {
            let one: u64 = 1;
            // SAFETY: writes the 8 bytes of a live u64 to our own eventfd. It cannot
            // block (EFD_NONBLOCK); the only failure, a counter at its maximum, still
            // leaves the fd readable, which is all a ring needs.
            let _ = unsafe {
                libc::write(
                    self.fd.as_raw_fd(),
                    (&one as *const u64).cast::<libc::c_void>(),
                    8,
                )
            };
        }
    }

    /// Clear a ring, before taking the replies it announced: a reply queued after this
    /// rings again.
    pub fn answer(&self) {
        self.rung.swap(false, Ordering::AcqRel);
        // Drain even when the flag was already clear: a ring that set the flag before
        // an answer may write after it, and a write left unread would keep the fd
        // readable with the flag clear, so that every wait returned at once until the
        // next ring.
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from our own non-blocking eventfd;
        // EAGAIN (nothing to read) is harmless.
        let _ = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                (&mut v as *mut u64).cast::<libc::c_void>(),
                8,
            )
        };
    }

    /// The eventfd, readable while the bell is rung.
    pub fn fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Wait up to `timeout` for a ring (for a worker with no socket to wait on). Returns
    /// whether it rang; a ring is answered here.
    pub fn wait_ring(&self, timeout: Duration) -> io::Result<bool> {
        let rang = wait(None, Some(self), timeout)?.1;
        Ok(rang)
    }
}

/// Wait up to `timeout` until `sock` is readable or `bell` rings, whichever first; a ring
/// is answered. Returns (socket readable, bell rang). A signal (EINTR) returns (false,
/// false), so that the caller's loop looks at its stop flag.
pub fn wait(
    sock: Option<RawFd>,
    bell: Option<&Doorbell>,
    timeout: Duration,
) -> io::Result<(bool, bool)> {
    let mut pfds = [libc::pollfd {
        fd: -1,
        events: libc::POLLIN,
        revents: 0,
    }; 2];
    // poll(2) ignores entries with a negative fd.
    pfds[0].fd = sock.unwrap_or(-1);
    pfds[1].fd = bell.map_or(-1, Doorbell::fd);
    let ts = libc::timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // ppoll rather than poll: the timeout is in ns, and callers wait for sub-ms
    // deadlines. SAFETY: two valid pollfds and a timespec that live for the call; no
    // signal mask.
    let r = unsafe { libc::ppoll(pfds.as_mut_ptr(), 2, &ts, std::ptr::null()) };
    if r < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::EINTR) {
            Ok((false, false))
        } else {
            Err(e)
        };
    }
    let readable = |p: &libc::pollfd| p.fd >= 0 && p.revents & libc::POLLIN != 0;
    let rang = readable(&pfds[1]);
    if rang {
        if let Some(b) = bell {
            b.answer();
        }
    }
    Ok((readable(&pfds[0]), rang))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn a_ring_wakes_a_waiter_and_is_answered_once() {
        let bell = Arc::new(Doorbell::new().unwrap());
        // Nothing rung: the wait times out.
        assert!(!bell.wait_ring(Duration::from_millis(5)).unwrap());
        // Two rings before an answer are one wake-up, and the second writes nothing.
        bell.ring();
        bell.ring();
        assert!(bell.wait_ring(Duration::ZERO).unwrap());
        assert!(
            !bell.wait_ring(Duration::ZERO).unwrap(),
            "answered rings stay quiet"
        );
        // A ring from another thread wakes a waiter long before its timeout.
        let b = bell.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            b.ring();
        });
        let start = Instant::now();
        assert!(bell.wait_ring(Duration::from_secs(10)).unwrap());
        assert!(start.elapsed() < Duration::from_secs(5));
        t.join().unwrap();
    }

    #[test]
    fn a_write_that_lands_after_its_answer_is_drained_by_the_next_wait() {
        // The race's outcome: a ring set the flag, the worker answered (clearing it),
        // then the ring's write landed. The fd is readable with the flag clear.
        let bell = Doorbell::new().unwrap();
        let one: u64 = 1;
        // SAFETY: 8 bytes of a live u64 to the bell's own eventfd.
        let n = unsafe { libc::write(bell.fd(), (&one as *const u64).cast(), 8) };
        assert_eq!(n, 8);
        // One spurious wake-up, then quiet: the fd must not stay readable.
        assert!(bell.wait_ring(Duration::ZERO).unwrap());
        assert!(!bell.wait_ring(Duration::from_millis(2)).unwrap());
        // And the next ring still wakes.
        bell.ring();
        assert!(bell.wait_ring(Duration::ZERO).unwrap());
    }

    #[test]
    fn a_socket_and_a_bell_are_waited_on_together() {
        let bell = Doorbell::new().unwrap();
        let a = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let b = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        // Neither: timeout.
        assert_eq!(
            wait(Some(a.as_raw_fd()), Some(&bell), Duration::from_millis(2)).unwrap(),
            (false, false)
        );
        // Only the bell.
        bell.ring();
        assert_eq!(
            wait(Some(a.as_raw_fd()), Some(&bell), Duration::from_secs(5)).unwrap(),
            (false, true)
        );
        // Only the socket (the bell was answered by the last wait).
        b.send_to(b"x", a.local_addr().unwrap()).unwrap();
        assert_eq!(
            wait(Some(a.as_raw_fd()), Some(&bell), Duration::from_secs(5)).unwrap(),
            (true, false)
        );
        // No bell at all: the socket alone, as before doorbells.
        assert_eq!(
            wait(Some(a.as_raw_fd()), None, Duration::from_secs(5)).unwrap(),
            (true, false)
        );
    }
}
