//! Network namespaces for tests: `ip` commands, namespaces and veth pairs under a
//! caller-given name prefix, and a guard that deletes the namespaces it created (with
//! every device in them) on drop. Tests address their links in 198.18.0.0/15.
//!
//! Namespaces are created directly with their devices; the host's own links and routes
//! are never touched.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::child::run_bounded;

/// How long one `ip` command may take.
pub const IP_LIMIT: Duration = Duration::from_secs(10);

static SEQ: AtomicUsize = AtomicUsize::new(0);

/// Run `ip <args>` (within [`IP_LIMIT`]); its output. Panics with the command and its
/// output if it fails.
pub fn ip(args: &[&str]) -> String {
    match run_bounded(Command::new("ip").args(args), IP_LIMIT) {
        Ok((st, out)) if st.success() => out,
        Ok((st, out)) => panic!("ip {}: {st}: {out}", args.join(" ")),
        Err(e) => panic!("{e}"),
    }
}

/// Run `argv` inside namespace `ns` (`ip netns exec`); its output. Panics on failure.
pub fn ns_exec(ns: &str, argv: &[&str]) -> String {
    let mut args = vec!["netns", "exec", ns];
    args.extend_from_slice(argv);
    ip(&args)
}

/// Are we root (namespaces, veth, XDP need it)?
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// True when root. Otherwise prints `SKIP: <what> needs root` and returns false (the
/// test returns early), except under CI (`CI` set), which runs as root: there a missing
/// root is a failure.
pub fn root_or_skip(what: &str) -> bool {
    if is_root() {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{what} needs root, and CI runs as root"
    );
    eprintln!("SKIP: {what} needs root");
    false
}

/// A fresh name prefix for one test's namespaces: `<tag>-<pid>-<n>-`, unique within the
/// process and, by the PID, among processes.
pub fn unique_prefix(tag: &str) -> String {
    format!(
        "{tag}-{}-{}-",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    )
}

/// Namespaces a test created, named `<prefix><name>`; deleted on drop (which destroys
/// their devices), also when the test panics. Only namespaces this guard created are
/// deleted.
pub struct Netns {
    prefix: String,
    created: Vec<String>,
}

impl Netns {
    /// A guard for namespaces named `<prefix><name>`.
    pub fn new(prefix: impl Into<String>) -> Netns {
        Netns {
            prefix: prefix.into(),
            created: Vec::new(),
        }
    }

    /// A guard with a [`unique_prefix`] of `tag`.
    pub fn unique(tag: &str) -> Netns {
        Netns::new(unique_prefix(tag))
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Create namespace `<prefix><name>` with its loopback up; its full name. One of
    /// the same name left by an earlier run that died with the same PID is deleted
    /// first.
    pub fn add(&mut self, name: &str) -> String {
        let ns = format!("{}{name}", self.prefix);
        if Path::new("/run/netns").join(&ns).exists() {
            ip(&["netns", "del", &ns]);
        }
        ip(&["netns", "add", &ns]);
        self.created.push(ns.clone());
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        ns
    }

    /// Namespaces `a` and `b` ([`Netns::add`]) joined by a veth pair, `a_dev` in `a`
    /// and `b_dev` in `b` (both down); their full names.
    pub fn add_pair(&mut self, a: &str, a_dev: &str, b: &str, b_dev: &str) -> (String, String) {
        let (a, b) = (self.add(a), self.add(b));
        veth(&a, a_dev, &b, b_dev);
        (a, b)
    }

    /// The namespaces created so far, in order.
    pub fn names(&self) -> &[String] {
        &self.created
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for ns in &self.created {
            let _ = run_bounded(Command::new("ip").args(["netns", "del", ns]), IP_LIMIT);
        }
        if std::thread::panicking() {
            return;
        }
        for ns in &self.created {
            assert!(
                !Path::new("/run/netns").join(ns).exists(),
                "namespace {ns} left behind"
            );
        }
    }
}

/// A veth pair: `a_dev` in namespace `a_ns`, its peer `b_dev` in `b_ns`; both down.
pub fn veth(a_ns: &str, a_dev: &str, b_ns: &str, b_dev: &str) {
    ip(&[
        "-n", a_ns, "link", "add", a_dev, "type", "veth", "peer", "name", b_dev, "netns", b_ns,
    ]);
}

/// Move the calling thread into namespace `ns` (setns(2) affects this thread only).
pub fn enter(ns: &str) {
    let path = Path::new("/run/netns").join(ns);
    let f = File::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    // SAFETY: a valid namespace fd; setns changes only this thread's network namespace.
    let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(
        r,
        0,
        "setns {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
}

/// Run `f` on a short-lived thread inside namespace `ns`, e.g. to bind a socket there
/// (a socket keeps the namespace it was made in).
pub fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let ns = ns.to_string();
    std::thread::spawn(move || {
        enter(&ns);
        f()
    })
    .join()
    .expect("thread in namespace")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_and_a_veth_are_deleted_with_the_guard() {
        if !root_or_skip("the netns guard test") {
            return;
        }
        let mut g = Netns::unique("sfkit");
        let (a, b) = g.add_pair("a", "ka", "b", "kb");
        ip(&["-n", &a, "addr", "add", "198.18.251.1/24", "dev", "ka"]);
        assert!(ip(&["-n", &b, "-o", "link"]).contains("kb"));
        let addr = in_ns(&a, || {
            std::net::UdpSocket::bind("198.18.251.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
        });
        assert_eq!(addr.ip().to_string(), "198.18.251.1");
        drop(g);
        assert!(!Path::new("/run/netns").join(&a).exists());
        assert!(!Path::new("/run/netns").join(&b).exists());
    }
}
