//! The conformance suite and persistence checks on the redb backend.

use std::sync::Arc;

use store::{conformance, Compare, EmbeddedStore, Store, StoreError, TxnOp};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_on_a_redb_file() {
    let dir = tempfile::tempdir().unwrap();
    // A parent directory that does not exist yet: open creates it.
    let store = EmbeddedStore::open(dir.path().join("state/store.redb")).unwrap();
    assert_eq!(store.backend(), "embedded");
    conformance::run_all(Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_in_memory() {
    conformance::run_all(Arc::new(EmbeddedStore::in_memory().unwrap())).await;
}

#[tokio::test]
async fn data_and_revisions_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.redb");
    let (r1, r2, rev) = {
        let s = EmbeddedStore::open(&path).unwrap();
        let r1 = s.put("tenants/acme", b"{\"id\":1}".to_vec()).await.unwrap();
        let r2 = s
            .txn(
                vec![Compare::Absent("vpcs/acme/v1".into())],
                vec![
                    TxnOp::Put("vpcs/acme/v1".into(), b"{}".to_vec()),
                    TxnOp::Put("tenants/acme".into(), b"{\"id\":2}".to_vec()),
                ],
            )
            .await
            .unwrap();
        (r1, r2, s.revision().await.unwrap())
    };
    // redb locks the file while open: the first store must be gone for this to work.
    let s = EmbeddedStore::open(&path).unwrap();
    assert_eq!(s.revision().await.unwrap(), rev);
    let t = s.get("tenants/acme").await.unwrap().unwrap();
    assert_eq!(t.value, b"{\"id\":2}".to_vec());
    assert_eq!((t.mod_rev, t.create_rev), (r2, r1));
    let listed = s.list("vpcs/", None, 0).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].0, "vpcs/acme/v1");
    // Revisions continue from where they were, not from 0.
    let r3 = s.put("tenants/other", vec![]).await.unwrap();
    assert_eq!(r3, rev + 1);
    // And the create-if-absent guard still sees the old key.
    let again = s
        .txn(
            vec![Compare::Absent("vpcs/acme/v1".into())],
            vec![TxnOp::Put("vpcs/acme/v1".into(), vec![])],
        )
        .await;
    assert_eq!(
        again,
        Err(StoreError::Conflict {
            key: "vpcs/acme/v1".into()
        })
    );
}

#[tokio::test]
async fn second_open_of_the_same_file_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.redb");
    let _first = EmbeddedStore::open(&path).unwrap();
    match EmbeddedStore::open(&path) {
        Err(StoreError::Io(msg)) => assert!(msg.contains("already open"), "{msg}"),
        other => panic!("second open: {other:?}"),
    }
}

#[tokio::test]
async fn a_file_that_is_not_a_store_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("garbage.redb");
    std::fs::write(&path, vec![0x5a; 8192]).unwrap();
    let err = EmbeddedStore::open(&path).unwrap_err();
    assert!(
        matches!(err, StoreError::Corrupt(_) | StoreError::Io(_)),
        "{err:?}"
    );
}
