//! The fabric masters a PP or SC node may talk to, and which one it is on (FM failover,
//! docs/planes.md "FM failover").
//!
//! A node is given a list (`--fm a:7000,b:7001`, or the orchestrator directive's
//! `fm_addrs`) and keeps one session to one FM at a time. The policy:
//! - it starts on the first address;
//! - a session that *broke* is retried once on the same address: the FM may be alive
//!   and have dropped only this session (it judged the node dead, say), and hopping to
//!   another FM while the first still serves the node's peers is what splits the
//!   platform in two;
//! - a *failed connect* moves on to the next address at once (round robin), since
//!   that FM is down or unreachable from here;
//! - only after every address failed in a row does the caller wait its reconnect
//!   back-off, so a node whose FM died reaches the standby without waiting a period per
//!   dead address.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum FmAddrsError {
    #[error("no FM address given")]
    Empty,
    #[error("bad FM address {0:?}: expected host:port")]
    Bad(String),
}

/// What the caller does after a failure: try again at once (another address), or wait
/// the reconnect back-off first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    Now,
    AfterBackoff,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FmAddrs {
    addrs: Vec<String>,
    cur: usize,
    /// Connects that failed in a row, over all addresses.
    failed: usize,
}

impl FmAddrs {
    /// Parse `host:port[,host:port...]` (spaces around commas allowed).
    pub fn parse(list: &str) -> Result<FmAddrs, FmAddrsError> {
        let addrs: Vec<String> = list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        Self::new(addrs)
    }

    /// From a list of addresses (the directive's `fm_addrs`); duplicates are dropped,
    /// order is kept.
    pub fn new(list: Vec<String>) -> Result<FmAddrs, FmAddrsError> {
        let mut addrs: Vec<String> = Vec::with_capacity(list.len());
        for a in list {
            let a = a.trim().to_string();
            let host_port = a
                .strip_prefix("http://")
                .or_else(|| a.strip_prefix("https://"))
                .unwrap_or(&a);
            let ok = host_port
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
            if !ok {
                return Err(FmAddrsError::Bad(a));
            }
            if !addrs.contains(&a) {
                addrs.push(a);
            }
        }
        if addrs.is_empty() {
            return Err(FmAddrsError::Empty);
        }
        Ok(FmAddrs {
            addrs,
            cur: 0,
            failed: 0,
        })
    }

    /// The address to use now.
    pub fn current(&self) -> &str {
        &self.addrs[self.cur]
    }

    pub fn all(&self) -> &[String] {
        &self.addrs
    }

    /// A session opened on the current address.
    pub fn connected(&mut self) {
        self.failed = 0;
    }

    /// The session on the current address broke after it had opened: stay, and retry
    /// it after the back-off.
    pub fn session_broke(&mut self) -> Next {
        self.failed = 0;
        Next::AfterBackoff
    }

    /// Connecting to (or registering with) the current address failed: move on.
    pub fn connect_failed(&mut self) -> Next {
        self.failed += 1;
        self.cur = (self.cur + 1) % self.addrs.len();
        if self.failed >= self.addrs.len() {
            self.failed = 0;
            Next::AfterBackoff
        } else {
            Next::Now
        }
    }
}

impl std::fmt::Display for FmAddrs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.addrs.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_one_or_many() {
        let one = FmAddrs::parse("127.0.0.1:7000").unwrap();
        assert_eq!(one.all(), ["127.0.0.1:7000"]);
        let two = FmAddrs::parse("198.18.4.2:7000, 198.18.4.2:7001,").unwrap();
        assert_eq!(two.all(), ["198.18.4.2:7000", "198.18.4.2:7001"]);
        assert_eq!(two.current(), "198.18.4.2:7000");
        assert_eq!(two.to_string(), "198.18.4.2:7000,198.18.4.2:7001");
        let dup = FmAddrs::parse("a:1,b:2,a:1").unwrap();
        assert_eq!(dup.all(), ["a:1", "b:2"]);
        assert!(FmAddrs::parse("http://fm:7000").is_ok());
        assert_eq!(FmAddrs::parse(""), Err(FmAddrsError::Empty));
        assert_eq!(FmAddrs::parse(" , "), Err(FmAddrsError::Empty));
        assert!(matches!(FmAddrs::parse("fm"), Err(FmAddrsError::Bad(_))));
        assert!(matches!(
            FmAddrs::parse("a:1,b:99999"),
            Err(FmAddrsError::Bad(_))
        ));
        assert!(FmAddrs::new(vec![]).is_err());
    }

    #[test]
    fn failed_connects_rotate_and_back_off_after_a_round() {
        let mut a = FmAddrs::parse("a:1,b:2,c:3").unwrap();
        assert_eq!(a.connect_failed(), Next::Now);
        assert_eq!(a.current(), "b:2");
        assert_eq!(a.connect_failed(), Next::Now);
        assert_eq!(a.current(), "c:3");
        // Every address failed once: wait before going round again.
        assert_eq!(a.connect_failed(), Next::AfterBackoff);
        assert_eq!(a.current(), "a:1");
        assert_eq!(a.connect_failed(), Next::Now);
        a.connected();
        assert_eq!(a.current(), "b:2");
        // The count starts over after a session opened.
        assert_eq!(a.connect_failed(), Next::Now);
        assert_eq!(a.current(), "c:3");
    }

    #[test]
    fn a_broken_session_retries_the_same_fm_first() {
        let mut a = FmAddrs::parse("a:1,b:2").unwrap();
        a.connected();
        assert_eq!(a.session_broke(), Next::AfterBackoff);
        assert_eq!(a.current(), "a:1");
        // That FM is gone: the next connect fails, and the node moves on at once.
        assert_eq!(a.connect_failed(), Next::Now);
        assert_eq!(a.current(), "b:2");
        a.connected();
        // The standby dies too: back to the first (round robin).
        a.session_broke();
        assert_eq!(a.connect_failed(), Next::Now);
        assert_eq!(a.current(), "a:1");
    }

    #[test]
    fn a_single_address_always_backs_off() {
        let mut a = FmAddrs::parse("a:1").unwrap();
        assert_eq!(a.connect_failed(), Next::AfterBackoff);
        assert_eq!(a.current(), "a:1");
        assert_eq!(a.session_broke(), Next::AfterBackoff);
    }
}
