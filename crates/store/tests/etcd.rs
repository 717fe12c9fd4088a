//! The conformance suite on a real etcd server (Debian's etcd-server, started
//! by `store::testing`), and what happens when etcd is not there.

use std::sync::Arc;
use std::time::{Duration, Instant};

use store::testing::EtcdServer;
use store::{conformance, EtcdOptions, EtcdStore, Store, StoreError};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_on_etcd_and_namespaces_are_isolated() {
    // Missing /usr/bin/etcd panics here, telling to run scripts/setup.sh.
    let etcd = EtcdServer::start();
    let store = EtcdStore::connect(&etcd.endpoints(), "/starfabric-test/run1")
        .await
        .unwrap_or_else(|e| panic!("connect: {e}\netcd log:\n{}", etcd.log_tail()));
    assert_eq!(store.backend(), "etcd");
    assert_eq!(store.namespace(), "/starfabric-test/run1/");
    conformance::run_all(Arc::new(store.clone())).await;

    // A second namespace whose name extends the first one's sees none of its
    // keys, and its writes do not show in the first.
    let other = EtcdStore::connect(&etcd.endpoints(), "/starfabric-test/run10")
        .await
        .unwrap();
    assert!(other.list("", None, 0).await.unwrap().is_empty());
    other.put("conformance/x", b"other".to_vec()).await.unwrap();
    assert_eq!(other.list("", None, 0).await.unwrap().len(), 1);
    assert!(store.get("x").await.unwrap().is_none());
    let mine = store.list("", None, 0).await.unwrap();
    assert!(
        mine.iter().all(|(k, _)| k.starts_with("conformance/")),
        "foreign key in namespace"
    );
    assert!(!mine
        .iter()
        .any(|(k, v)| k == "conformance/x" && v.value == b"other"));
    // Revisions are cluster-wide: the other namespace's write moved it.
    let rev = store.revision().await.unwrap();
    let r = other.put("y", vec![]).await.unwrap();
    assert!(r > rev && store.revision().await.unwrap() == r);

    // Over etcd's limits: a clear Rejected error, nothing written.
    let ops = (0..129)
        .map(|i| store::TxnOp::Put(format!("many/{i}"), vec![]))
        .collect();
    let r = store.txn(vec![], ops).await;
    assert!(matches!(r, Err(StoreError::Rejected(_))), "{r:?}");
    let r = store.put("big", vec![7; 2 * 1024 * 1024]).await;
    assert!(matches!(r, Err(StoreError::Rejected(_))), "{r:?}");
    assert!(store.list("many/", None, 0).await.unwrap().is_empty());
    assert!(store.get("big").await.unwrap().is_none());

    // The same cluster seen without a namespace has the prefixed keys.
    let raw = EtcdStore::connect(&etcd.endpoints(), "").await.unwrap();
    let run1 = raw.list("/starfabric-test/run1/", None, 0).await.unwrap();
    assert_eq!(run1.len(), mine.len());
}

#[tokio::test]
async fn nothing_listening_is_unavailable_quickly() {
    // Bind, read the port, release it: nothing listens there afterwards.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let endpoint = format!("http://127.0.0.1:{port}");
    let opts = EtcdOptions {
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(2),
    };
    let started = Instant::now();
    let r = tokio::time::timeout(
        Duration::from_secs(15),
        EtcdStore::connect_with(std::slice::from_ref(&endpoint), "ns", opts),
    )
    .await
    .expect("connect hung past 15 s");
    match r {
        Err(StoreError::Unavailable(msg)) => {
            assert!(msg.contains(&endpoint), "message lacks the endpoint: {msg}")
        }
        other => panic!("connect to a dead port: {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn requests_after_etcd_dies_are_unavailable_not_hangs() {
    let mut etcd = EtcdServer::start();
    let opts = EtcdOptions {
        connect_timeout: Duration::from_secs(5),
        request_timeout: Duration::from_secs(2),
    };
    let store = EtcdStore::connect_with(&etcd.endpoints(), "dies", opts)
        .await
        .unwrap();
    store.put("k", b"v".to_vec()).await.unwrap();
    etcd.stop();
    let started = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(15), store.get("k"))
        .await
        .expect("get hung past 15 s");
    assert!(matches!(r, Err(StoreError::Unavailable(_))), "{r:?}");
    let r = tokio::time::timeout(Duration::from_secs(15), store.put("k", vec![]))
        .await
        .expect("put hung past 15 s");
    assert!(matches!(r, Err(StoreError::Unavailable(_))), "{r:?}");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn launcher_kills_etcd_on_drop() {
    let etcd = EtcdServer::start();
    let pid = etcd.pid();
    let proc_dir = std::path::PathBuf::from(format!("/proc/{pid}"));
    assert!(proc_dir.exists());
    let data = etcd.data_dir();
    assert!(data.exists());
    drop(etcd);
    // Reaped by Drop, so the PID is gone (not a zombie), and the data dir too.
    assert!(
        !proc_dir.exists(),
        "etcd pid {pid} still present after drop"
    );
    assert!(!data.exists());
}

#[test]
fn launcher_kills_etcd_when_the_test_panics() {
    let pid = std::sync::atomic::AtomicU32::new(0);
    let unwound = std::panic::catch_unwind(|| {
        let etcd = EtcdServer::start();
        pid.store(etcd.pid(), std::sync::atomic::Ordering::SeqCst);
        panic!("test body fails while etcd runs");
    });
    assert!(unwound.is_err());
    let pid = pid.load(std::sync::atomic::Ordering::SeqCst);
    assert_ne!(pid, 0, "etcd never started");
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "etcd pid {pid} survived the panic"
    );
}
