use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use redb::backends::InMemoryBackend;
use redb::{Database, ReadableTable, TableDefinition, WriteTransaction};
use tracing::{debug, info};

use crate::{
    validate_key, validate_prefix, validate_txn, Compare, Store, StoreError, TxnOp, Versioned,
};

/// Key -> record: `mod_rev` (8 bytes LE), `create_rev` (8 bytes LE), value.
const KV: TableDefinition<&str, &[u8]> = TableDefinition::new("kv");
/// Store metadata: the revision counter and the record format.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const META_REVISION: &str = "revision";
const META_FORMAT: &str = "format";
const FORMAT: u64 = 1;
const HEADER: usize = 16;

/// The embedded backend: one redb database.
///
/// redb is synchronous and a commit fsyncs, so every operation runs on tokio's
/// blocking pool (`spawn_blocking`) rather than behind an async mutex on a worker
/// thread: a slow disk then stalls only that call. No lock of our own is needed:
/// redb runs one write transaction at a time (`begin_write` waits for the
/// previous one) and lets readers see consistent snapshots meanwhile, which is
/// exactly what compare-then-write in `txn` needs. Methods must be called from
/// within a tokio runtime.
#[derive(Clone)]
pub struct EmbeddedStore {
    db: Arc<Database>,
    location: Arc<str>,
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedStore")
            .field("location", &self.location)
            .finish()
    }
}

impl EmbeddedStore {
    /// Opens (or creates) the store file at `path`, creating its parent
    /// directory. Blocks briefly: call it at startup. A file can be open in
    /// one `EmbeddedStore` at a time (redb locks it).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let path: PathBuf = path.as_ref().to_path_buf();
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| {
                StoreError::Io(format!("creating directory {}: {e}", parent.display()))
            })?;
        }
        let db = Database::create(&path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => {
                StoreError::Io(format!("{} is already open", path.display()))
            }
            other => map_redb(format!("opening {}", path.display()), other),
        })?;
        let store = Self::init(db, path.display().to_string())?;
        info!(path = %path.display(), "embedded store opened");
        Ok(store)
    }

    /// A store that lives in memory only, for tests and throwaway runs.
    pub fn in_memory() -> Result<Self, StoreError> {
        let db = Database::builder()
            .create_with_backend(InMemoryBackend::new())
            .map_err(|e| map_redb("creating in-memory database", e))?;
        Self::init(db, "memory".to_string())
    }

    /// Creates the tables (so reads never meet a missing table) and checks the
    /// record format of an existing file.
    fn init(db: Database, location: String) -> Result<Self, StoreError> {
        let txn = db.begin_write().map_err(|e| map_redb("begin write", e))?;
        {
            txn.open_table(KV)
                .map_err(|e| map_redb("open kv table", e))?;
            let mut meta = txn
                .open_table(META)
                .map_err(|e| map_redb("open meta table", e))?;
            let format = meta
                .get(META_FORMAT)
                .map_err(|e| map_redb("read format", e))?
                .map(|g| g.value());
            match format {
                None => {
                    meta.insert(META_FORMAT, FORMAT)
                        .map_err(|e| map_redb("write format", e))?;
                }
                Some(FORMAT) => {}
                Some(other) => {
                    return Err(StoreError::Corrupt(format!(
                        "{location}: record format {other}, this build reads {FORMAT}"
                    )))
                }
            }
        }
        txn.commit().map_err(|e| map_redb("commit", e))?;
        Ok(Self {
            db: Arc::new(db),
            location: location.into(),
        })
    }

    async fn blocking<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Database) -> Result<T, StoreError> + Send + 'static,
    {
        let db = Arc::clone(&self.db);
        tokio::task::spawn_blocking(move || f(&db))
            .await
            .map_err(|e| StoreError::Io(format!("embedded store task failed: {e}")))?
    }
}

fn map_redb(what: impl std::fmt::Display, e: impl Into<redb::Error>) -> StoreError {
    match e.into() {
        redb::Error::Corrupted(msg) => StoreError::Corrupt(format!("{what}: {msg}")),
        redb::Error::Io(io) => StoreError::Io(format!("{what}: {io}")),
        other => StoreError::Io(format!("{what}: {other}")),
    }
}

fn encode(mod_rev: u64, create_rev: u64, value: &[u8]) -> Vec<u8> {
    let mut rec = Vec::with_capacity(HEADER + value.len());
    rec.extend_from_slice(&mod_rev.to_le_bytes());
    rec.extend_from_slice(&create_rev.to_le_bytes());
    rec.extend_from_slice(value);
    rec
}

fn decode(key: &str, rec: &[u8]) -> Result<Versioned, StoreError> {
    let (Some(mod_rev), Some(create_rev)) = (rec.get(0..8), rec.get(8..HEADER)) else {
        return Err(StoreError::Corrupt(format!(
            "record of key {key:?} is {} bytes, shorter than its header",
            rec.len()
        )));
    };
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
    Ok(Versioned {
        mod_rev: word(mod_rev),
        create_rev: word(create_rev),
        value: rec[HEADER..].to_vec(),
    })
}

fn read_revision(txn: &WriteTransaction) -> Result<u64, StoreError> {
    let meta = txn
        .open_table(META)
        .map_err(|e| map_redb("open meta table", e))?;
    revision_of(&meta)
}

/// The store's revision as the meta table holds it (0 before the first write); for write
/// and read transactions alike.
fn revision_of(meta: &impl ReadableTable<&'static str, u64>) -> Result<u64, StoreError> {
    Ok(meta
        .get(META_REVISION)
        .map_err(|e| map_redb("read revision", e))?
        .map(|g| g.value())
        .unwrap_or(0))
}

fn write_revision(txn: &WriteTransaction, rev: u64) -> Result<(), StoreError> {
    let mut meta = txn
        .open_table(META)
        .map_err(|e| map_redb("open meta table", e))?;
    meta.insert(META_REVISION, rev)
        .map_err(|e| map_redb("write revision", e))?;
    Ok(())
}

fn get_in(txn: &WriteTransaction, key: &str) -> Result<Option<Versioned>, StoreError> {
    let kv = txn
        .open_table(KV)
        .map_err(|e| map_redb("open kv table", e))?;
    let got = kv.get(key).map_err(|e| map_redb("get", e))?;
    got.map(|g| decode(key, g.value())).transpose()
}

/// Applies `ops` at revision `rev` inside `txn`; returns whether anything changed.
fn apply_ops(txn: &WriteTransaction, ops: &[TxnOp], rev: u64) -> Result<bool, StoreError> {
    let mut kv = txn
        .open_table(KV)
        .map_err(|e| map_redb("open kv table", e))?;
    let mut changed = false;
    for op in ops {
        match op {
            TxnOp::Put(key, value) => {
                let create_rev = match kv.get(key.as_str()).map_err(|e| map_redb("get", e))? {
                    Some(g) => decode(key, g.value())?.create_rev,
                    None => rev,
                };
                kv.insert(key.as_str(), encode(rev, create_rev, value).as_slice())
                    .map_err(|e| map_redb("insert", e))?;
                changed = true;
            }
            TxnOp::Delete(key) => {
                if kv
                    .remove(key.as_str())
                    .map_err(|e| map_redb("remove", e))?
                    .is_some()
                {
                    changed = true;
                }
            }
        }
    }
    Ok(changed)
}

/// The one write path: check `compares`, apply `ops` at the next revision.
/// Returns the revision in force afterwards and whether anything changed.
fn write(db: &Database, compares: &[Compare], ops: &[TxnOp]) -> Result<(u64, bool), StoreError> {
    let txn = db.begin_write().map_err(|e| map_redb("begin write", e))?;
    match stage(&txn, compares, ops) {
        Ok(Staged::Changed(next)) => {
            txn.commit().map_err(|e| map_redb("commit", e))?;
            Ok((next, true))
        }
        Ok(Staged::Unchanged(current)) => {
            txn.abort().map_err(|e| map_redb("abort", e))?;
            Ok((current, false))
        }
        Err(e) => {
            // The conflict or failure is what the caller needs; a failing abort
            // of a transaction that wrote nothing durable adds nothing to it.
            let _ = txn.abort();
            Err(e)
        }
    }
}

enum Staged {
    Changed(u64),
    Unchanged(u64),
}

fn stage(
    txn: &WriteTransaction,
    compares: &[Compare],
    ops: &[TxnOp],
) -> Result<Staged, StoreError> {
    for c in compares {
        if !c.holds(get_in(txn, c.key())?.as_ref()) {
            return Err(StoreError::Conflict {
                key: c.key().to_string(),
            });
        }
    }
    let current = read_revision(txn)?;
    let next = current
        .checked_add(1)
        .ok_or_else(|| StoreError::Corrupt("revision counter overflow".into()))?;
    if apply_ops(txn, ops, next)? {
        write_revision(txn, next)?;
        Ok(Staged::Changed(next))
    } else {
        Ok(Staged::Unchanged(current))
    }
}

#[async_trait]
impl Store for EmbeddedStore {
    async fn get(&self, key: &str) -> Result<Option<Versioned>, StoreError> {
        validate_key(key)?;
        let key = key.to_string();
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(|e| map_redb("begin read", e))?;
            let kv = txn
                .open_table(KV)
                .map_err(|e| map_redb("open kv table", e))?;
            let got = kv.get(key.as_str()).map_err(|e| map_redb("get", e))?;
            got.map(|g| decode(&key, g.value())).transpose()
        })
        .await
    }

    async fn put(&self, key: &str, value: Vec<u8>) -> Result<u64, StoreError> {
        validate_key(key)?;
        let ops = vec![TxnOp::Put(key.to_string(), value)];
        let (rev, _) = self.blocking(move |db| write(db, &[], &ops)).await?;
        debug!(key, rev, "put");
        Ok(rev)
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        validate_key(key)?;
        let ops = vec![TxnOp::Delete(key.to_string())];
        let (_, existed) = self.blocking(move |db| write(db, &[], &ops)).await?;
        Ok(existed)
    }

    async fn list(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Versioned)>, StoreError> {
        validate_prefix(prefix)?;
        let prefix = prefix.to_string();
        let start_after = start_after.map(str::to_string);
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(|e| map_redb("begin read", e))?;
            let kv = txn
                .open_table(KV)
                .map_err(|e| map_redb("open kv table", e))?;
            let lower: Bound<&str> = match start_after.as_deref() {
                Some(after) if after >= prefix.as_str() => Bound::Excluded(after),
                _ => Bound::Included(prefix.as_str()),
            };
            let range = kv
                .range::<&str>((lower, Bound::Unbounded))
                .map_err(|e| map_redb("range", e))?;
            let mut out = Vec::new();
            for item in range {
                let (k, v) = item.map_err(|e| map_redb("range", e))?;
                let key = k.value();
                // Keys are sorted, so the first one without the prefix ends it.
                if !key.starts_with(prefix.as_str()) {
                    break;
                }
                out.push((key.to_string(), decode(key, v.value())?));
                if limit != 0 && out.len() == limit {
                    break;
                }
            }
            Ok(out)
        })
        .await
    }

    async fn txn(&self, compares: Vec<Compare>, ops: Vec<TxnOp>) -> Result<u64, StoreError> {
        validate_txn(&compares, &ops)?;
        let (rev, _) = self.blocking(move |db| write(db, &compares, &ops)).await?;
        Ok(rev)
    }

    async fn revision(&self) -> Result<u64, StoreError> {
        self.blocking(|db| {
            let txn = db.begin_read().map_err(|e| map_redb("begin read", e))?;
            let meta = txn
                .open_table(META)
                .map_err(|e| map_redb("open meta table", e))?;
            revision_of(&meta)
        })
        .await
    }

    fn backend(&self) -> &'static str {
        "embedded"
    }
}
