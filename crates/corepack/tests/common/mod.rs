//! What both test binaries read: a thread's mask as the kernel reports it, and a
//! bounded wait.

use std::time::{Duration, Instant};

/// The CPUs thread `tid` of this process may run on (`/proc`'s `Cpus_allowed_list`).
pub fn affinity(tid: i32) -> Vec<usize> {
    let text = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("Cpus_allowed_list:"))
        .unwrap();
    let mut out = Vec::new();
    for part in line["Cpus_allowed_list:".len()..].trim().split(',') {
        match part.split_once('-') {
            Some((a, b)) => out.extend(a.parse::<usize>().unwrap()..=b.parse().unwrap()),
            None => out.push(part.parse().unwrap()),
        }
    }
    out
}

/// Poll `ok` every 5 ms; fail the test after 10 s.
pub fn wait_for(what: &str, ok: impl Fn() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
