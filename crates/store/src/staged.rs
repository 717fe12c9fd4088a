//! [`Staged`]: several writers' worth of reads and writes, committed as one
//! [`Store::txn`] or not at all.
//!
//! The orchestrator validates each object in code that reads the store and writes it
//! through its own compare-and-swap txn. To make a request that creates several objects
//! (a tenant, its VPC, an NF and a chain) all-or-nothing without writing that
//! validation twice, it runs the same code against a `Staged` view of the store:
//!
//! - Reads go to the base store the first time a key is seen, and each one is
//!   remembered as a compare (`ModRev` of what was read, or `Absent`).
//! - Writes (puts, deletes, txns) stay here, and later reads see them. A staged txn's
//!   compares are checked against this view, as the base store would check them.
//! - [`Staged::commit`] sends every remembered compare and every staged write to the
//!   base store as one txn. If anything read has changed since, nothing is written and
//!   the caller gets [`StoreError::Conflict`]; it may run the whole request again.
//!
//! A list is checked only for the keys it returned: a key created under the prefix by
//! someone else between the list and the commit is not a conflict. The orchestrator's
//! uniqueness rules (VNIs, tenant ids, chain bindings) are point reads, which are
//! checked.
//!
//! Revisions handed out before the commit are provisional: they order the staged
//! writes among themselves and above everything read, and are replaced by the
//! commit's revision.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use crate::{validate_key, validate_prefix, Compare, Store, StoreError, TxnOp, Versioned};

#[derive(Debug, Default)]
struct Overlay {
    /// What the staged writes made of each key; `None`: deleted.
    writes: BTreeMap<String, Option<Versioned>>,
    /// The first observation of each key read from the base store.
    reads: BTreeMap<String, Compare>,
    /// The next provisional revision.
    next_rev: u64,
}

/// A staged view of a base store. See the module docs.
pub struct Staged {
    base: Arc<dyn Store>,
    overlay: Mutex<Overlay>,
}

impl Staged {
    /// Stage on top of `base`, whose current revision numbers the provisional ones.
    pub async fn new(base: Arc<dyn Store>) -> Result<Staged, StoreError> {
        let rev = base.revision().await?;
        Ok(Staged {
            base,
            overlay: Mutex::new(Overlay {
                next_rev: rev + 1,
                ..Overlay::default()
            }),
        })
    }

    fn overlay(&self) -> std::sync::MutexGuard<'_, Overlay> {
        self.overlay.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What the staged writes are, in key order (for logging and tests).
    pub fn writes(&self) -> Vec<TxnOp> {
        self.overlay()
            .writes
            .iter()
            .map(|(k, v)| match v {
                Some(v) => TxnOp::Put(k.clone(), v.value.clone()),
                None => TxnOp::Delete(k.clone()),
            })
            .collect()
    }

    /// Write everything staged in one base txn, guarded by everything read. Returns
    /// the commit's revision.
    pub async fn commit(self) -> Result<u64, StoreError> {
        let o = self.overlay.into_inner().unwrap_or_else(|e| e.into_inner());
        let compares = o.reads.into_values().collect();
        let ops = o
            .writes
            .into_iter()
            .map(|(k, v)| match v {
                Some(v) => TxnOp::Put(k, v.value),
                None => TxnOp::Delete(k),
            })
            .collect();
        self.base.txn(compares, ops).await
    }

    /// The staged view of `key`, reading (and remembering) the base store once.
    async fn view(&self, key: &str) -> Result<Option<Versioned>, StoreError> {
        {
            let o = self.overlay();
            if let Some(w) = o.writes.get(key) {
                return Ok(w.clone());
            }
        }
        let v = self.base.get(key).await?;
        self.remember(key, v.as_ref());
        Ok(v)
    }

    fn remember(&self, key: &str, v: Option<&Versioned>) {
        self.overlay()
            .reads
            .entry(key.to_string())
            .or_insert_with(|| match v {
                Some(v) => Compare::ModRev(key.to_string(), v.mod_rev),
                None => Compare::Absent(key.to_string()),
            });
    }

    /// Stage `ops` at one provisional revision (the caller has checked them).
    fn stage(&self, ops: Vec<(TxnOp, Option<Versioned>)>) -> u64 {
        let mut o = self.overlay();
        let rev = o.next_rev;
        o.next_rev += 1;
        for (op, before) in ops {
            match op {
                TxnOp::Put(k, value) => {
                    let create_rev = before.map_or(rev, |b| b.create_rev);
                    o.writes.insert(
                        k,
                        Some(Versioned {
                            value,
                            mod_rev: rev,
                            create_rev,
                        }),
                    );
                }
                TxnOp::Delete(k) => {
                    o.writes.insert(k, None);
                }
            }
        }
        rev
    }
}

#[async_trait]
impl Store for Staged {
    async fn get(&self, key: &str) -> Result<Option<Versioned>, StoreError> {
        validate_key(key)?;
        self.view(key).await
    }

    async fn put(&self, key: &str, value: Vec<u8>) -> Result<u64, StoreError> {
        validate_key(key)?;
        let before = self.view(key).await?;
        Ok(self.stage(vec![(TxnOp::Put(key.to_string(), value), before)]))
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        validate_key(key)?;
        let before = self.view(key).await?;
        let existed = before.is_some();
        if existed {
            self.stage(vec![(TxnOp::Delete(key.to_string()), before)]);
        }
        Ok(existed)
    }

    async fn list(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Versioned)>, StoreError> {
        validate_prefix(prefix)?;
        // The whole prefix from the base: a staged delete could otherwise leave a page
        // short of `limit` while more keys follow.
        let base = self.base.list(prefix, start_after, 0).await?;
        let mut merged: BTreeMap<String, Versioned> = BTreeMap::new();
        for (k, v) in base {
            self.remember(&k, Some(&v));
            merged.insert(k, v);
        }
        {
            let o = self.overlay();
            for (k, w) in o.writes.range(prefix.to_string()..) {
                if !k.starts_with(prefix) {
                    break;
                }
                if start_after.is_some_and(|a| k.as_str() <= a) {
                    continue;
                }
                match w {
                    Some(v) => merged.insert(k.clone(), v.clone()),
                    None => merged.remove(k),
                };
            }
        }
        let n = if limit == 0 { usize::MAX } else { limit };
        Ok(merged.into_iter().take(n).collect())
    }

    async fn txn(&self, compares: Vec<Compare>, ops: Vec<TxnOp>) -> Result<u64, StoreError> {
        let mut seen = std::collections::HashSet::new();
        for op in &ops {
            validate_key(op.key())?;
            if !seen.insert(op.key().to_string()) {
                return Err(StoreError::InvalidKey(format!(
                    "key {:?} written twice in one txn",
                    op.key()
                )));
            }
        }
        for c in &compares {
            validate_key(c.key())?;
            let v = self.view(c.key()).await?;
            if !c.holds(v.as_ref()) {
                return Err(StoreError::Conflict {
                    key: c.key().to_string(),
                });
            }
        }
        let mut staged = Vec::with_capacity(ops.len());
        for op in ops {
            let before = self.view(op.key()).await?;
            staged.push((op, before));
        }
        Ok(self.stage(staged))
    }

    async fn revision(&self) -> Result<u64, StoreError> {
        Ok(self.overlay().next_rev - 1)
    }

    fn backend(&self) -> &'static str {
        self.base.backend()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EmbeddedStore;

    fn base() -> Arc<dyn Store> {
        Arc::new(EmbeddedStore::in_memory().unwrap())
    }

    fn block<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn nothing_reaches_the_base_before_the_commit_and_everything_after() {
        block(async {
            let b = base();
            b.put("t/old", b"1".to_vec()).await.unwrap();
            let s = Staged::new(b.clone()).await.unwrap();
            s.put("t/a", b"a".to_vec()).await.unwrap();
            assert!(s.delete("t/old").await.unwrap());
            s.txn(
                vec![Compare::Absent("t/b".into())],
                vec![TxnOp::Put("t/b".into(), b"b".to_vec())],
            )
            .await
            .unwrap();
            // The staged view sees its writes; the base none of them.
            let keys: Vec<String> = s
                .list("t/", None, 0)
                .await
                .unwrap()
                .into_iter()
                .map(|(k, _)| k)
                .collect();
            assert_eq!(keys, ["t/a", "t/b"]);
            assert!(b.get("t/a").await.unwrap().is_none());
            assert!(b.get("t/old").await.unwrap().is_some());
            // A staged txn's compares hold against the staged view.
            let e = s
                .txn(vec![Compare::Absent("t/a".into())], vec![])
                .await
                .unwrap_err();
            assert!(e.is_conflict());
            s.commit().await.unwrap();
            assert_eq!(b.get("t/a").await.unwrap().unwrap().value, b"a");
            assert_eq!(b.get("t/b").await.unwrap().unwrap().value, b"b");
            assert!(b.get("t/old").await.unwrap().is_none());
        });
    }

    #[test]
    fn a_change_to_anything_read_fails_the_commit_and_writes_nothing() {
        block(async {
            let b = base();
            b.put("meta/next", b"1".to_vec()).await.unwrap();
            let s = Staged::new(b.clone()).await.unwrap();
            let seen = s.get("meta/next").await.unwrap().unwrap();
            assert!(s.get("vnis/100").await.unwrap().is_none());
            s.put("t/x", seen.value.clone()).await.unwrap();
            // Someone else takes the VNI in between.
            b.put("vnis/100", b"other".to_vec()).await.unwrap();
            let e = s.commit().await.unwrap_err();
            assert_eq!(
                e,
                StoreError::Conflict {
                    key: "vnis/100".into()
                }
            );
            assert!(b.get("t/x").await.unwrap().is_none());
        });
    }

    #[test]
    fn a_dropped_stage_writes_nothing() {
        block(async {
            let b = base();
            let rev = b.revision().await.unwrap();
            {
                let s = Staged::new(b.clone()).await.unwrap();
                s.put("t/a", b"a".to_vec()).await.unwrap();
                assert!(s.revision().await.unwrap() > rev);
            }
            assert_eq!(b.revision().await.unwrap(), rev);
            assert!(b.list("t/", None, 0).await.unwrap().is_empty());
        });
    }

    #[test]
    fn paging_over_a_staged_list_skips_deleted_keys_and_honours_start_after() {
        block(async {
            let b = base();
            for k in ["p/1", "p/2", "p/3", "p/4"] {
                b.put(k, b"v".to_vec()).await.unwrap();
            }
            let s = Staged::new(b).await.unwrap();
            s.delete("p/2").await.unwrap();
            s.put("p/25", b"n".to_vec()).await.unwrap();
            let page = |after: Option<&'static str>| {
                let s = &s;
                async move {
                    s.list("p/", after, 2)
                        .await
                        .unwrap()
                        .into_iter()
                        .map(|(k, _)| k)
                        .collect::<Vec<_>>()
                }
            };
            assert_eq!(page(None).await, ["p/1", "p/25"]);
            assert_eq!(page(Some("p/25")).await, ["p/3", "p/4"]);
        });
    }
}
