//! Running commands with a time bound, inside or outside a namespace.
//!
//! Every command the testbed runs goes through [`run`], which kills the command (by its
//! PID, through its `Child` handle) when it overruns, so a hung tool cannot hang a test.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// The usual bound of a configuration command (`ip`, `nft`, `sysctl`, `ethtool`).
pub const CONFIG_LIMIT: Duration = Duration::from_secs(15);

/// What a finished command left.
#[derive(Debug)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn ok(&self) -> bool {
        self.status.success()
    }
}

/// Where `tool` lives: PATH, then the sbin directories a non-login root shell may lack.
pub fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"])
        .filter(|d| !d.is_empty())
        .map(|d| PathBuf::from(d).join(tool))
        .find(|p| p.is_file());
    found
}

fn describe(argv: &[&str]) -> String {
    argv.join(" ")
}

/// Run `argv` to completion within `limit`, with `input` on its stdin, and return what
/// it printed whatever its exit status. The output is drained by threads while it runs,
/// so a chatty tool (iperf3 -J) cannot block on a full pipe.
pub fn run_full(argv: &[&str], input: Option<&str>, limit: Duration) -> Result<Output> {
    let desc = describe(argv);
    let (prog, args) = argv.split_first().expect("a command");
    let prog = which(prog).unwrap_or_else(|| PathBuf::from(prog));
    let mut child = Command::new(prog)
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| Error::io(format!("spawn `{desc}`"), e))?;
    if let Some(text) = input {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("piped stdin");
        // A command that exits early closes its stdin; its status tells what went wrong.
        let _ = stdin.write_all(text.as_bytes());
    }
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let mut buf = Vec::new();
                let _ = r.read_to_end(&mut buf);
                s = String::from_utf8_lossy(&buf).into_owned();
            }
            s
        })
    };
    let out_t = drain(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err_t = drain(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child
            .try_wait()
            .map_err(|e| Error::io(format!("wait `{desc}`"), e))?
        {
            break st;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::Timeout {
                what: desc,
                secs: limit.as_secs_f64(),
            });
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    Ok(Output {
        status,
        stdout: out_t.join().unwrap_or_default(),
        stderr: err_t.join().unwrap_or_default(),
    })
}

/// Run `argv` within `limit`; fail unless it exits 0. Returns its stdout.
pub fn run(argv: &[&str], limit: Duration) -> Result<String> {
    run_input(argv, None, limit)
}

/// [`run`] with `input` on stdin.
pub fn run_input(argv: &[&str], input: Option<&str>, limit: Duration) -> Result<String> {
    let out = run_full(argv, input, limit)?;
    if !out.ok() {
        return Err(Error::Command {
            cmd: describe(argv),
            msg: format!("{}: {}{}", out.status, out.stderr.trim(), out.stdout.trim()),
        });
    }
    Ok(out.stdout)
}

/// `ip <args>`.
pub fn ip(args: &[&str]) -> Result<String> {
    let mut v = vec!["ip"];
    v.extend_from_slice(args);
    run(&v, CONFIG_LIMIT)
}

/// `ip -n <ns> -batch -` with `script` (one `ip` command per line, without `ip`): one
/// process for a namespace's whole configuration rather than one per command.
pub fn ip_batch(ns: &str, script: &str) -> Result<()> {
    run_input(&["ip", "-n", ns, "-batch", "-"], Some(script), CONFIG_LIMIT).map(drop)
}

/// The argv that runs `argv` inside namespace `ns`.
pub fn ns_argv<'a>(ns: &'a str, argv: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["ip", "netns", "exec", ns];
    v.extend_from_slice(argv);
    v
}

/// Run `argv` inside namespace `ns` within `limit`; fail unless it exits 0.
pub fn in_ns(ns: &str, argv: &[&str], limit: Duration) -> Result<String> {
    run(&ns_argv(ns, argv), limit)
}

/// Run `argv` inside `ns` within `limit`, returning its output whatever the status.
pub fn in_ns_full(ns: &str, argv: &[&str], limit: Duration) -> Result<Output> {
    run_full(&ns_argv(ns, argv), None, limit)
}

/// `nft -f -` inside `ns` with `ruleset`.
pub fn nft(ns: &str, ruleset: &str) -> Result<()> {
    run_input(
        &ns_argv(ns, &["nft", "-f", "-"]),
        Some(ruleset),
        CONFIG_LIMIT,
    )
    .map(drop)
}

/// Poll `f` every 20 ms until it returns `Some`, or fail after `limit`.
pub fn wait_for<T>(
    what: &str,
    limit: Duration,
    mut f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let start = Instant::now();
    loop {
        if crate::interrupted() {
            return Err(Error::Interrupted);
        }
        if let Some(v) = f()? {
            return Ok(v);
        }
        if start.elapsed() >= limit {
            return Err(Error::Timeout {
                what: what.to_string(),
                secs: limit.as_secs_f64(),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sleep `d`, waking early (with an error) when a signal asked the run to stop.
pub fn sleep(d: Duration) -> Result<()> {
    let end = Instant::now() + d;
    while Instant::now() < end {
        if crate::interrupted() {
            return Err(Error::Interrupted);
        }
        std::thread::sleep((end - Instant::now()).min(Duration::from_millis(20)));
    }
    Ok(())
}
