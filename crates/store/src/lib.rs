//! The orchestrator's desired-state store.
//!
//! Tenants, VPCs, NF instances and chains are kept as opaque values (JSON, by
//! convention) under `/`-separated string keys. One object-safe async trait,
//! [`Store`], has two backends with the same semantics:
//!
//! - [`EmbeddedStore`]: a single redb file (or memory), for one-node setups and tests.
//! - [`EtcdStore`]: an etcd v3 cluster, every key under a namespace prefix.
//!
//! Both give every successful write a store-wide, monotonic revision, and every
//! value its `mod_rev` (revision of its last write) and `create_rev` (revision
//! that created it), so callers can do compare-and-swap with [`Store::txn`].
//! [`conformance`] holds the checks both backends pass; `testing` (feature
//! `testing`) starts a real etcd server for tests.

mod embedded;
mod error;
mod etcd;

pub mod conformance;
pub mod staged;
#[cfg(feature = "testing")]
pub mod testing;

pub use embedded::EmbeddedStore;
pub use error::StoreError;
pub use etcd::{EtcdOptions, EtcdStore};
pub use staged::Staged;

/// Open the store a spec names: `embedded:PATH` (a redb file) or
/// `etcd:URL[,URL...]` (keys under `etcd_prefix`).
pub async fn open(spec: &str, etcd_prefix: &str) -> Result<std::sync::Arc<dyn Store>, StoreError> {
    if let Some(path) = spec.strip_prefix("embedded:") {
        if path.is_empty() {
            return Err(StoreError::Io(
                "--store embedded: needs a file path, e.g. embedded:/var/lib/starfabric/o.redb"
                    .into(),
            ));
        }
        let s = EmbeddedStore::open(path)
            .map_err(|e| StoreError::Io(format!("opening {path}: {e}")))?;
        Ok(std::sync::Arc::new(s))
    } else if let Some(eps) = spec.strip_prefix("etcd:") {
        let endpoints: Vec<String> = eps
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        if endpoints.is_empty() {
            return Err(StoreError::Io(
                "--store etcd: needs at least one endpoint, e.g. etcd:http://127.0.0.1:2379".into(),
            ));
        }
        let s = EtcdStore::connect(&endpoints, etcd_prefix)
            .await
            .map_err(|e| {
                StoreError::Unavailable(format!(
                    "connecting to etcd at {}: {e}",
                    endpoints.join(",")
                ))
            })?;
        Ok(std::sync::Arc::new(s))
    } else {
        Err(StoreError::Io(format!(
            "--store must be embedded:PATH or etcd:URL[,URL...], got {spec:?}"
        )))
    }
}

use async_trait::async_trait;

/// A value with the revisions that describe its history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    pub value: Vec<u8>,
    /// Revision of the write that last changed this key.
    pub mod_rev: u64,
    /// Revision of the write that created this key (since it last did not exist).
    pub create_rev: u64,
}

/// A condition of a [`Store::txn`]; every one must hold for the ops to apply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compare {
    /// The key does not exist.
    Absent(String),
    /// The key's `mod_rev` equals the given revision. An absent key counts as
    /// `mod_rev` 0 (as in etcd), so `ModRev(k, 0)` is the same as `Absent(k)`.
    ModRev(String, u64),
    /// The key exists.
    Present(String),
}

impl Compare {
    pub fn key(&self) -> &str {
        match self {
            Compare::Absent(k) | Compare::ModRev(k, _) | Compare::Present(k) => k,
        }
    }

    /// Whether the compare holds for a key whose current state is `current`.
    pub(crate) fn holds(&self, current: Option<&Versioned>) -> bool {
        match self {
            Compare::Absent(_) => current.is_none(),
            Compare::Present(_) => current.is_some(),
            Compare::ModRev(_, rev) => current.map_or(0, |v| v.mod_rev) == *rev,
        }
    }
}

/// A write of a [`Store::txn`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnOp {
    Put(String, Vec<u8>),
    Delete(String),
}

impl TxnOp {
    pub fn key(&self) -> &str {
        match self {
            TxnOp::Put(k, _) | TxnOp::Delete(k) => k,
        }
    }
}

/// The desired-state store. Object-safe: share it as `Arc<dyn Store>`.
///
/// Revisions are store-wide and start above 0; each successful write that changes
/// something (a put, a delete of an existing key, a txn with such ops) gets a new
/// revision greater than every earlier one. Writes that change nothing (deleting
/// an absent key, a txn whose ops change nothing) do not bump the revision.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    async fn get(&self, key: &str) -> Result<Option<Versioned>, StoreError>;

    /// Creates or overwrites `key`; returns the revision of this write.
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<u64, StoreError>;

    /// Removes `key`; returns whether it existed.
    async fn delete(&self, key: &str) -> Result<bool, StoreError>;

    /// Keys starting with `prefix` (plain byte prefix: `t/1` also matches `t/10`,
    /// so end directory-like prefixes with `/`), in byte order, strictly after
    /// `start_after` if given, at most `limit` of them (0 = no limit).
    async fn list(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Versioned)>, StoreError>;

    /// Atomic: if every compare holds, apply every op and return the new
    /// revision (the current one if the ops changed nothing); otherwise apply
    /// nothing and return [`StoreError::Conflict`] naming the first compare that
    /// failed. A key may appear in at most one op.
    async fn txn(&self, compares: Vec<Compare>, ops: Vec<TxnOp>) -> Result<u64, StoreError>;

    /// Current store revision (monotonic).
    async fn revision(&self) -> Result<u64, StoreError>;

    /// `"embedded"` or `"etcd"`.
    fn backend(&self) -> &'static str;
}

/// Longest key accepted. Keys are paths like `tenants/t1/vpcs/v1`; a much longer
/// one is a bug, and etcd would refuse big requests anyway.
pub const MAX_KEY_LEN: usize = 4096;

/// Keys must be non-empty, at most [`MAX_KEY_LEN`] bytes and free of control
/// characters (they end up in logs and error messages).
pub(crate) fn validate_key(key: &str) -> Result<(), StoreError> {
    if key.is_empty() {
        return Err(StoreError::InvalidKey("empty key".into()));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(StoreError::InvalidKey(format!(
            "key of {} bytes is longer than {MAX_KEY_LEN}",
            key.len()
        )));
    }
    if key.chars().any(char::is_control) {
        return Err(StoreError::InvalidKey(format!(
            "key {key:?} contains a control character"
        )));
    }
    Ok(())
}

/// List prefixes may be empty (everything) but otherwise follow the key rules.
pub(crate) fn validate_prefix(prefix: &str) -> Result<(), StoreError> {
    if prefix.is_empty() {
        Ok(())
    } else {
        validate_key(prefix)
    }
}

pub(crate) fn validate_txn(compares: &[Compare], ops: &[TxnOp]) -> Result<(), StoreError> {
    for c in compares {
        validate_key(c.key())?;
    }
    let mut seen = std::collections::HashSet::with_capacity(ops.len());
    for op in ops {
        validate_key(op.key())?;
        // etcd refuses a txn that writes one key twice; refusing it everywhere
        // keeps the backends alike and the outcome unambiguous.
        if !seen.insert(op.key()) {
            return Err(StoreError::InvalidKey(format!(
                "key {:?} appears in more than one op of a txn",
                op.key()
            )));
        }
    }
    Ok(())
}
