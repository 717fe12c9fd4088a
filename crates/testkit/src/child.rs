//! Processes a test starts: a guard that stops them by their own PID, bounded runs, and
//! their stdout as lines on a channel.

use std::io::{BufRead, BufReader, Read};
use std::ops::{Deref, DerefMut};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long [`ChildGuard::new`] lets a child exit on SIGTERM before killing it.
pub const GRACE: Duration = Duration::from_secs(10);

/// A started process, stopped on drop: SIGTERM to its own PID, up to a grace period for
/// it to exit, then SIGKILL; reaped either way. Derefs to the [`Child`].
pub struct ChildGuard {
    child: Child,
    grace: Duration,
}

impl ChildGuard {
    /// Guard `child` with the default grace ([`GRACE`]).
    pub fn new(child: Child) -> ChildGuard {
        ChildGuard::with_grace(child, GRACE)
    }

    /// Guard `child`; on drop it gets `grace` to exit on SIGTERM. A zero grace kills it
    /// at once (SIGKILL, no SIGTERM).
    pub fn with_grace(child: Child, grace: Duration) -> ChildGuard {
        ChildGuard { child, grace }
    }

    /// Send SIGTERM and wait up to `limit` for the child to exit: its status, or None if
    /// it is still running (it is left running; the drop kills it).
    pub fn terminate(&mut self, limit: Duration) -> Option<ExitStatus> {
        if let Ok(Some(st)) = self.child.try_wait() {
            return Some(st);
        }
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on the PID of our own child, which is not reaped yet (every
        // caller checked try_wait first), so the PID cannot have been reused.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, sig);
        }
    }
}

impl Deref for ChildGuard {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.child
    }
}

impl DerefMut for ChildGuard {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.child
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            if self.grace.is_zero() || self.terminate(self.grace).is_none() {
                let _ = self.child.kill();
            }
        }
        let _ = self.child.wait();
    }
}

/// Read `out` (a child's stdout) line by line on a thread; the lines arrive on the
/// returned channel, which disconnects at end of file.
pub fn lines(out: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

/// Take the lines of `child`'s stdout (it must have been spawned with it piped): see
/// [`lines`].
pub fn stdout_lines(child: &mut Child) -> mpsc::Receiver<String> {
    lines(child.stdout.take().expect("the child's stdout is piped"))
}

/// Receive lines until `f` returns `Some` for one (lines before it are dropped), within
/// `limit`; the error is the channel's (timed out, or the child's stdout closed).
pub fn line_matching<T>(
    rx: &mpsc::Receiver<String>,
    limit: Duration,
    mut f: impl FnMut(&str) -> Option<T>,
) -> Result<T, mpsc::RecvTimeoutError> {
    let deadline = Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if let Some(v) = f(&rx.recv_timeout(left)?) {
            return Ok(v);
        }
    }
}

/// Run `cmd` to completion (stdin closed): whether it succeeded, its stdout, its stderr.
pub fn output_of(cmd: &mut Command) -> (bool, String, String) {
    match cmd.stdin(Stdio::null()).output() {
        Ok(o) => (
            o.status.success(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        ),
        Err(e) => (false, String::new(), format!("{cmd:?}: {e}")),
    }
}

/// Run `cmd` to completion within `limit`, killing it (by PID) if it overruns: its
/// status and its stdout followed by its stderr, or what went wrong.
pub fn run_bounded(cmd: &mut Command, limit: Duration) -> Result<(ExitStatus, String), String> {
    let desc = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{desc}: {e}"))?;
    // Drained on threads: a child writing more than a pipe holds would never exit.
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut s);
            }
            String::from_utf8_lossy(&s).into_owned()
        })
    };
    let out = drain(child.stdout.take().map(|r| Box::new(r) as _));
    let err = drain(child.stderr.take().map(|r| Box::new(r) as _));
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().map_err(|e| format!("{desc}: {e}"))? {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("{desc}: timed out after {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let text = out.join().unwrap_or_default() + &err.join().unwrap_or_default();
    Ok((status, text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigterm_stops_a_child_and_drop_kills_one_that_ignores_it() {
        let mut g = ChildGuard::new(Command::new("sleep").arg("30").spawn().unwrap());
        let st = g
            .terminate(Duration::from_secs(5))
            .expect("sleep exits on SIGTERM");
        assert!(!st.success());

        let child = Command::new("sh")
            .args(["-c", "trap '' TERM; sleep 30"])
            .spawn()
            .unwrap();
        let start = Instant::now();
        drop(ChildGuard::with_grace(child, Duration::from_millis(200)));
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "killed after the grace"
        );
    }

    #[test]
    fn lines_and_bounded_runs() {
        let mut c = Command::new("sh")
            .args(["-c", "echo a; echo b=2; echo c"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let rx = stdout_lines(&mut c);
        let v = line_matching(&rx, Duration::from_secs(5), |l| {
            l.strip_prefix("b=").map(str::to_string)
        });
        assert_eq!(v.unwrap(), "2");
        c.wait().unwrap();

        let (st, out) = run_bounded(
            Command::new("sh").args(["-c", "echo x; echo y >&2"]),
            Duration::from_secs(5),
        )
        .unwrap();
        assert!(st.success());
        assert_eq!(out, "x\ny\n");
        let e =
            run_bounded(Command::new("sleep").arg("30"), Duration::from_millis(100)).unwrap_err();
        assert!(e.contains("timed out"), "{e}");
    }
}
