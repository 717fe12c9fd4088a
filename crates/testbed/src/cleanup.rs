//! What a run created, and deleting it again: on drop, on a panic (drop runs while
//! unwinding), on SIGINT/SIGTERM/SIGHUP, or from a state file (`testbed down`).
//!
//! Three kinds of things are created: network namespaces (deleting one destroys every
//! device in it, so veth pairs and VXLAN devices go with it; no device is ever created in
//! the host namespace), processes (killed by PID: SIGINT, then SIGKILL after a grace
//! period), and files (temporary directories with configurations and logs).
//!
//! Processes are ended in two passes. First the ones the run started, by the PIDs it
//! recorded (with their start times, so a recycled PID is never hit), each with the
//! process group it leads (the testbed starts every process in a group of its own). Then any process
//! still inside one of the run's own namespaces, by the PIDs `ip netns pids` lists: those
//! can only be children of what the run started (nginx workers whose master was
//! SIGKILLed, say), and a namespace is not freed while a process holds it.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use crate::cmd;
use crate::{Error, Result};

/// How long a process gets between SIGINT and SIGKILL.
const GRACE: Duration = Duration::from_secs(3);
/// What asks a process to stop. SIGINT, not SIGTERM: every tool here exits cleanly on
/// it (nginx's fast shutdown, iperf3, starfabric), and trafgen ignores SIGTERM.
const STOP_SIGNAL: libc::c_int = libc::SIGINT;

/// A process the run started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcRecord {
    pub pid: i32,
    /// `/proc/<pid>/stat` field 22: tells a recycled PID from ours.
    pub start_time: u64,
    /// What it is (`nginx b0`, `starfabric pp`), for logs.
    pub what: String,
}

/// Everything a run created: what `testbed up` writes to its state file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The namespace name prefix of the run.
    pub prefix: String,
    pub namespaces: Vec<String>,
    pub processes: Vec<ProcRecord>,
    /// Files and directories to remove.
    pub paths: Vec<PathBuf>,
}

struct Inner {
    rec: Record,
    /// Child handles of the processes this process started, to reap them.
    children: Vec<Child>,
    state_file: Option<PathBuf>,
    cleaned: bool,
}

/// The cleanup guard of one run. Deletes everything on [`Resources::cleanup`] or drop.
pub struct Resources {
    inner: Mutex<Inner>,
}

static STOP: AtomicBool = AtomicBool::new(false);
static LIVE: Mutex<Vec<Weak<Resources>>> = Mutex::new(Vec::new());
static HANDLERS: Once = Once::new();

/// Has a SIGINT/SIGTERM/SIGHUP asked the run to stop?
pub fn interrupted() -> bool {
    STOP.load(Ordering::Relaxed)
}

extern "C" fn on_signal(_: libc::c_int) {
    // Only an atomic store: anything else is not async-signal-safe. The watcher thread
    // does the cleanup.
    STOP.store(true, Ordering::Relaxed);
}

/// Install SIGINT/SIGTERM/SIGHUP handlers that clean up every live [`Resources`] of this
/// process and exit with status 130. Idempotent.
pub fn install_signal_cleanup() -> Result<()> {
    let mut res = Ok(());
    HANDLERS.call_once(|| {
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            let handler = on_signal as extern "C" fn(libc::c_int);
            // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
            let prev = unsafe { libc::signal(sig, handler as libc::sighandler_t) };
            if prev == libc::SIG_ERR {
                res = Err(Error::io(
                    format!("install a handler for signal {sig}"),
                    std::io::Error::last_os_error(),
                ));
                return;
            }
        }
        std::thread::Builder::new()
            .name("testbed-signal".into())
            .spawn(|| loop {
                if interrupted() {
                    eprintln!("testbed: signal received: deleting what this run created");
                    let live: Vec<_> = LIVE.lock().map(|l| l.clone()).unwrap_or_default();
                    for r in live.iter().filter_map(Weak::upgrade) {
                        r.cleanup();
                    }
                    std::process::exit(130);
                }
                std::thread::sleep(Duration::from_millis(50));
            })
            .map(drop)
            .unwrap_or_else(|e| res = Err(Error::io("spawn the signal watcher", e)));
    });
    res
}

impl Resources {
    /// A guard for a run whose namespaces start with `prefix`.
    pub fn new(prefix: &str) -> Arc<Resources> {
        Self::create(prefix, None)
    }

    /// A guard that also keeps `state_file` up to date with everything it records, so a
    /// later process (`testbed down`) can delete it.
    pub fn with_state_file(prefix: &str, state_file: PathBuf) -> Arc<Resources> {
        Self::create(prefix, Some(state_file))
    }

    fn create(prefix: &str, state_file: Option<PathBuf>) -> Arc<Resources> {
        let r = Arc::new(Resources {
            inner: Mutex::new(Inner {
                rec: Record {
                    prefix: prefix.to_string(),
                    ..Record::default()
                },
                children: Vec::new(),
                state_file,
                cleaned: false,
            }),
        });
        if let Ok(mut live) = LIVE.lock() {
            live.retain(|w| w.strong_count() > 0);
            live.push(Arc::downgrade(&r));
        }
        r
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves a consistent record: keep cleaning up.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Create namespace `name` (with `lo` up) and record it.
    pub fn add_namespace(&self, name: &str) -> Result<()> {
        let mut g = self.lock();
        if g.cleaned {
            return Err(Error::Interrupted);
        }
        // Someone else's (an earlier `testbed up`): not ours to record, or to delete.
        if Path::new("/run/netns").join(name).exists() {
            return Err(Error::Setup(format!(
                "namespace {name} already exists (a run with this prefix is up: `starfabric testbed down`)"
            )));
        }
        // Recorded before it exists: a failure half-way still gets it deleted.
        g.rec.namespaces.push(name.to_string());
        save(&g);
        cmd::ip(&["netns", "add", name])?;
        cmd::ip(&["-n", name, "link", "set", "lo", "up"])?;
        Ok(())
    }

    /// Record a process this run started; it is killed at cleanup.
    pub fn add_child(&self, child: Child, what: &str) -> Result<i32> {
        let pid = child.id() as i32;
        let mut g = self.lock();
        g.rec.processes.push(ProcRecord {
            pid,
            start_time: start_time(pid).unwrap_or(0),
            what: what.to_string(),
        });
        g.children.push(child);
        save(&g);
        if g.cleaned {
            drop(g);
            terminate(&[pid]);
            return Err(Error::Interrupted);
        }
        Ok(pid)
    }

    /// Record a file or directory to remove at cleanup.
    pub fn add_path(&self, p: &Path) {
        let mut g = self.lock();
        g.rec.paths.push(p.to_path_buf());
        save(&g);
    }

    /// A copy of what has been recorded.
    pub fn record(&self) -> Record {
        self.lock().rec.clone()
    }

    /// Has this process started `pid` and is it still running?
    pub fn child_running(&self, pid: i32) -> bool {
        let mut g = self.lock();
        g.children
            .iter_mut()
            .find(|c| c.id() as i32 == pid)
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Stop one process this run started (SIGINT, then SIGKILL), e.g. to restart the
    /// platform in the same topology.
    pub fn stop_child(&self, pid: i32) {
        let child = {
            let mut g = self.lock();
            g.rec.processes.retain(|p| p.pid != pid);
            let i = g.children.iter().position(|c| c.id() as i32 == pid);
            let c = i.map(|i| g.children.remove(i));
            save(&g);
            c
        };
        if let Some(mut c) = child {
            signal(pid, STOP_SIGNAL);
            let end = Instant::now() + GRACE;
            while Instant::now() < end && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(10));
            }
            if matches!(c.try_wait(), Ok(None)) {
                signal(pid, libc::SIGKILL);
            }
            let _ = c.wait();
            // The leader is gone; helpers of its group that outlived it get the same.
            // SAFETY: kill(2) on the process group this run created for the process.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
            }
        }
    }

    /// Kill one process this run started with SIGKILL and no grace period: a crash, as
    /// the elasticity tests inject it (a process asked to stop would say goodbye to its
    /// peers, and the point is that it does not). Reaps it and forgets it.
    pub fn kill_child(&self, pid: i32) -> Result<()> {
        let child = {
            let mut g = self.lock();
            let i = g.children.iter().position(|c| c.id() as i32 == pid);
            let c = i.map(|i| g.children.remove(i));
            g.rec.processes.retain(|p| p.pid != pid);
            save(&g);
            c
        };
        let Some(mut c) = child else {
            return Err(Error::Setup(format!(
                "pid {pid} is not a process of this run"
            )));
        };
        signal(pid, libc::SIGKILL);
        let _ = c.wait();
        // SAFETY: kill(2) on the process group this run created for the process.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
        info!(pid, "killed (SIGKILL)");
        Ok(())
    }

    /// Leave everything in place (after `testbed up`): the state file stays for `down`.
    pub fn keep(&self) {
        let mut g = self.lock();
        g.cleaned = true;
        // The Child handles are dropped without killing: the processes live on.
        g.children.clear();
    }

    /// Delete everything recorded. Idempotent; never panics.
    pub fn cleanup(&self) {
        let mut g = self.lock();
        if g.cleaned {
            return;
        }
        g.cleaned = true;
        let pids: Vec<i32> = g.children.iter().map(|c| c.id() as i32).collect();
        for p in &pids {
            signal(*p, STOP_SIGNAL);
        }
        let end = Instant::now() + GRACE;
        loop {
            let mut alive = 0;
            for c in g.children.iter_mut() {
                if matches!(c.try_wait(), Ok(None)) {
                    alive += 1;
                }
            }
            if alive == 0 || Instant::now() >= end {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        for c in g.children.iter_mut() {
            if matches!(c.try_wait(), Ok(None)) {
                warn!(pid = c.id(), "ignored SIGINT; SIGKILL");
                signal(c.id() as i32, libc::SIGKILL);
            }
            let _ = c.wait();
        }
        g.children.clear();
        // Processes recorded by a state file of another process, not our children.
        let rec = g.rec.clone();
        remove_recorded(&rec, &pids);
        if let Some(f) = g.state_file.take() {
            let _ = std::fs::remove_file(&f);
        }
        info!(prefix = %rec.prefix, namespaces = rec.namespaces.len(), "testbed cleaned up");
    }
}

impl Drop for Resources {
    fn drop(&mut self) {
        self.cleanup();
    }
}

fn save(g: &Inner) {
    let Some(path) = &g.state_file else { return };
    if g.cleaned {
        return;
    }
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_string_pretty(&g.rec).unwrap_or_default();
    // Written whole and renamed, so `down` never reads half a file.
    if let Err(e) = std::fs::write(&tmp, text).and_then(|_| std::fs::rename(&tmp, path)) {
        warn!(path = %path.display(), "cannot write the state file: {e}");
    }
}

/// Delete what a state file of an earlier `testbed up` recorded.
pub fn cleanup_record(rec: &Record) {
    remove_recorded(rec, &[]);
}

/// Terminate the recorded processes but `skip` (still the same process: same start
/// time, not a reused pid), then delete the recorded namespaces and paths.
fn remove_recorded(rec: &Record, skip: &[i32]) {
    let pids: Vec<i32> = rec
        .processes
        .iter()
        .filter(|p| !skip.contains(&p.pid))
        .filter(|p| start_time(p.pid) == Some(p.start_time))
        .map(|p| p.pid)
        .collect();
    terminate(&pids);
    delete_namespaces(&rec.namespaces);
    remove_paths(&rec.paths);
}

/// `/proc/<pid>/stat` field 22 (start time in clock ticks since boot); None when the
/// process is gone or a zombie.
pub fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: split after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    if fields.first() == Some(&"Z") {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// `/proc/<pid>/stat` field 5: the process group.
fn pgrp(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(2)?.parse().ok()
}

/// Send `sig` to `pid`, and to its whole process group when it leads one: the testbed
/// starts every process as the leader of a group of its own, so its helpers (trafgen's
/// sender processes, nginx's workers) go with it.
fn signal(pid: i32, sig: libc::c_int) {
    if pid <= 0 {
        return;
    }
    let target = if pgrp(pid) == Some(pid) { -pid } else { pid };
    // SAFETY: kill(2) on a positive PID (or the group it leads) that the caller recorded:
    // a process this run started, or one inside this run's namespaces. No memory is
    // involved.
    unsafe {
        libc::kill(target, sig);
    }
}

/// SIGINT `pids`, wait up to the grace period, SIGKILL what is left. For processes that
/// are not our children (a zombie is reaped by its parent; we only wait for it to go).
fn terminate(pids: &[i32]) {
    if pids.is_empty() {
        return;
    }
    for p in pids {
        signal(*p, STOP_SIGNAL);
    }
    let end = Instant::now() + GRACE;
    while Instant::now() < end && pids.iter().any(|p| start_time(*p).is_some()) {
        std::thread::sleep(Duration::from_millis(10));
    }
    for p in pids.iter().filter(|p| start_time(**p).is_some()) {
        warn!(pid = p, "ignored SIGINT; SIGKILL");
        signal(*p, libc::SIGKILL);
    }
}

/// PIDs of the processes inside namespace `ns`.
fn netns_pids(ns: &str) -> Vec<i32> {
    cmd::ip(&["netns", "pids", ns])
        .map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn delete_namespaces(names: &[String]) {
    let mut stray = Vec::new();
    for ns in names {
        if Path::new("/run/netns").join(ns).exists() {
            stray.extend(netns_pids(ns));
        }
    }
    if !stray.is_empty() {
        debug!(?stray, "processes left inside the run's namespaces");
        terminate(&stray);
    }
    for ns in names {
        if Path::new("/run/netns").join(ns).exists() {
            if let Err(e) = cmd::ip(&["netns", "del", ns]) {
                warn!(%ns, "cannot delete namespace: {e}");
            }
        }
    }
}

fn remove_paths(paths: &[PathBuf]) {
    for p in paths {
        let r = if p.is_dir() {
            std::fs::remove_dir_all(p)
        } else {
            std::fs::remove_file(p)
        };
        if let Err(e) = r {
            if e.kind() != std::io::ErrorKind::NotFound {
                warn!(path = %p.display(), "cannot remove: {e}");
            }
        }
    }
}

/// Namespaces named `<root><pid>-...` whose process `<pid>` is gone: left by a run that
/// was SIGKILLed, when no cleanup could run. Deletes them and returns their names.
/// Namespaces of live processes (a concurrent test binary) are left alone.
pub fn sweep_stale(root: &str) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/run/netns") else {
        return Vec::new();
    };
    let stale: Vec<String> = dir
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| {
            n.strip_prefix(root)
                .and_then(|rest| rest.split('-').next())
                .and_then(|pid| pid.parse::<i32>().ok())
                .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
        })
        .collect();
    if !stale.is_empty() {
        warn!(?stale, "deleting namespaces of dead runs");
        delete_namespaces(&stale);
    }
    stale
}

/// Names in `ip netns list` that start with `prefix`.
pub fn namespaces_with_prefix(prefix: &str) -> Vec<String> {
    std::fs::read_dir("/run/netns")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with(prefix))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_of_self_is_stable_and_of_a_dead_pid_is_none() {
        let me = std::process::id() as i32;
        let a = start_time(me).expect("own start time");
        assert_eq!(start_time(me), Some(a));
        // PIDs are at most 2^22 on Linux.
        assert_eq!(start_time(i32::MAX), None);
    }

    #[test]
    fn record_round_trips_through_json() {
        let r = Record {
            prefix: "sftb-".into(),
            namespaces: vec!["sftb-pp".into()],
            processes: vec![ProcRecord {
                pid: 42,
                start_time: 7,
                what: "nginx".into(),
            }],
            paths: vec!["/tmp/x".into()],
        };
        let back: Record = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
    }
}
