//! The conformance checks can fail: each deliberately broken store below must
//! be caught by the check named for its fault (and a faithful wrapper by none).

use std::collections::BTreeSet;
use std::sync::Arc;

use async_trait::async_trait;
use store::{conformance, Compare, EmbeddedStore, Store, StoreError, TxnOp, Versioned};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    None,
    GetMissingIsEmpty,
    PutStoresReversed,
    RevisionStuck,
    ModRevIsCreateRev,
    DeleteAlwaysTrue,
    ListTrimsSlash,
    ListReversed,
    ListIgnoresStartAfter,
    TxnIgnoresCompares,
    ConflictNamesLastKey,
    ValueDropsTrailingZeros,
    EmptyKeyRenamed,
    TxnIgnoresAbsent,
}

struct Faulty {
    inner: EmbeddedStore,
    fault: Fault,
}

#[async_trait]
impl Store for Faulty {
    async fn get(&self, key: &str) -> Result<Option<Versioned>, StoreError> {
        let key = self.rename(key);
        let mut got = self.inner.get(&key).await?;
        if let Some(v) = got.as_mut() {
            match self.fault {
                Fault::ModRevIsCreateRev => v.mod_rev = v.create_rev,
                Fault::ValueDropsTrailingZeros => {
                    while v.value.last() == Some(&0) {
                        v.value.pop();
                    }
                }
                _ => {}
            }
        } else if self.fault == Fault::GetMissingIsEmpty {
            return Ok(Some(Versioned {
                value: vec![],
                mod_rev: 0,
                create_rev: 0,
            }));
        }
        Ok(got)
    }

    async fn put(&self, key: &str, mut value: Vec<u8>) -> Result<u64, StoreError> {
        if self.fault == Fault::PutStoresReversed {
            value.reverse();
        }
        self.inner.put(&self.rename(key), value).await
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let existed = self.inner.delete(&self.rename(key)).await?;
        Ok(existed || self.fault == Fault::DeleteAlwaysTrue)
    }

    async fn list(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Versioned)>, StoreError> {
        let prefix = match self.fault {
            Fault::ListTrimsSlash => prefix.trim_end_matches('/'),
            _ => prefix,
        };
        let start_after = match self.fault {
            Fault::ListIgnoresStartAfter => None,
            _ => start_after,
        };
        let mut items = self.inner.list(prefix, start_after, limit).await?;
        if self.fault == Fault::ListReversed {
            items.reverse();
        }
        Ok(items)
    }

    async fn txn(&self, compares: Vec<Compare>, ops: Vec<TxnOp>) -> Result<u64, StoreError> {
        let compares = match self.fault {
            Fault::TxnIgnoresCompares => vec![],
            Fault::TxnIgnoresAbsent => compares
                .into_iter()
                .filter(|c| !matches!(c, Compare::Absent(_)))
                .collect(),
            _ => compares,
        };
        let last = compares.last().map(|c| c.key().to_string());
        match self.inner.txn(compares, ops).await {
            Err(StoreError::Conflict { .. }) if self.fault == Fault::ConflictNamesLastKey => {
                Err(StoreError::Conflict {
                    key: last.unwrap_or_default(),
                })
            }
            r => r,
        }
    }

    async fn revision(&self) -> Result<u64, StoreError> {
        if self.fault == Fault::RevisionStuck {
            return Ok(1);
        }
        self.inner.revision().await
    }

    fn backend(&self) -> &'static str {
        "faulty"
    }
}

impl Faulty {
    fn rename(&self, key: &str) -> String {
        if self.fault == Fault::EmptyKeyRenamed && key.is_empty() {
            "empty".to_string()
        } else {
            key.to_string()
        }
    }
}

async fn failing_checks(fault: Fault) -> BTreeSet<&'static str> {
    let store = Faulty {
        inner: EmbeddedStore::in_memory().unwrap(),
        fault,
    };
    conformance::run_checks(Arc::new(store))
        .await
        .into_iter()
        .filter(|(_, r)| r.is_err())
        .map(|(name, _)| name)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_check_catches_its_fault() {
    let cases: &[(Fault, &str)] = &[
        (Fault::GetMissingIsEmpty, "get-missing"),
        (Fault::PutStoresReversed, "put-get-roundtrip"),
        (Fault::RevisionStuck, "revisions-monotonic"),
        (Fault::ModRevIsCreateRev, "overwrite-mod-rev"),
        (Fault::DeleteAlwaysTrue, "delete-existed"),
        (Fault::ListTrimsSlash, "list-prefix-isolation"),
        (Fault::ListReversed, "list-ordering"),
        (Fault::ListIgnoresStartAfter, "pagination"),
        (Fault::TxnIgnoresCompares, "txn-all-or-nothing"),
        (Fault::ConflictNamesLastKey, "txn-all-or-nothing"),
        (Fault::TxnIgnoresAbsent, "txn-create-if-absent"),
        (Fault::TxnIgnoresCompares, "txn-cas-mod-rev"),
        (Fault::ValueDropsTrailingZeros, "binary-values"),
        (Fault::TxnIgnoresAbsent, "concurrent-create"),
        (Fault::EmptyKeyRenamed, "invalid-key"),
    ];
    let mut covered = BTreeSet::new();
    let mut missed = Vec::new();
    for &(fault, check) in cases {
        let failing = failing_checks(fault).await;
        if failing.contains(check) {
            covered.insert(check);
        } else {
            missed.push(format!(
                "{fault:?} not caught by {check} (failing: {failing:?})"
            ));
        }
    }
    assert!(missed.is_empty(), "{}", missed.join("\n"));
    let all: BTreeSet<&str> = conformance::CHECKS.iter().map(|(n, _)| *n).collect();
    assert_eq!(covered, all, "some check has no fault shown to trip it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_faithful_wrapper_passes_every_check() {
    let failing = failing_checks(Fault::None).await;
    assert!(failing.is_empty(), "{failing:?}");
}

#[tokio::test]
#[should_panic(expected = "conformance checks failed on the faulty store")]
async fn run_all_panics_on_a_broken_store() {
    let store = Faulty {
        inner: EmbeddedStore::in_memory().unwrap(),
        fault: Fault::ListReversed,
    };
    conformance::run_all(Arc::new(store)).await;
}
