//! Process signals: SIGINT and SIGTERM set one flag that every long-running subcommand
//! polls. The planes themselves know nothing of signals; their handles have a `stop`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

static STOP: OnceLock<Arc<AtomicBool>> = OnceLock::new();

extern "C" fn on_signal(_: libc::c_int) {
    // Only an atomic load and store: anything else is not async-signal-safe.
    if let Some(f) = STOP.get() {
        f.store(true, Ordering::Relaxed);
    }
}

/// Route SIGINT and SIGTERM to the returned flag (the same one on every call), which
/// the planes' start functions take as their stop flag.
pub fn install() -> Result<Arc<AtomicBool>> {
    let flag = STOP.get_or_init(Default::default).clone();
    for sig in [libc::SIGINT, libc::SIGTERM] {
        let handler = on_signal as extern "C" fn(libc::c_int);
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe; glibc's
        // signal() installs it with SA_RESTART semantics, and a poll(2) it interrupts
        // returns EINTR, which the I/O backends treat as "no packets".
        let prev = unsafe { libc::signal(sig, handler as libc::sighandler_t) };
        if prev == libc::SIG_ERR {
            bail!(
                "cannot install a handler for signal {sig}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    Ok(flag)
}

/// Whether SIGINT or SIGTERM arrived.
pub fn stopped() -> bool {
    STOP.get().is_some_and(|f| f.load(Ordering::Relaxed))
}

/// Block until a signal, `duration` (if any) has passed, or `done()` says so; call
/// `every` each `interval` (if any) on the way.
pub fn wait(
    duration: Option<Duration>,
    interval: Option<Duration>,
    mut done: impl FnMut() -> bool,
    mut every: impl FnMut(),
) {
    let start = Instant::now();
    let mut next = interval.map(|i| start + i);
    while !stopped() && !done() {
        let now = Instant::now();
        if duration.is_some_and(|d| now >= start + d) {
            break;
        }
        if let (Some(t), Some(i)) = (next, interval) {
            if now >= t {
                every();
                next = Some(t + i);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Block until a signal or `secs` (if any) have passed.
pub fn wait_secs(secs: Option<f64>) {
    wait(secs.map(Duration::from_secs_f64), None, || false, || {});
}
