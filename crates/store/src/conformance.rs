//! The behaviour every [`Store`] backend must have, as named checks.
//!
//! Run them all with [`run_all`] (panics with every failure listed) or get the
//! per-check outcome from [`run_checks`]. Each check writes only under
//! `conformance/<check name>/`, and expects nothing to be there beforehand: give
//! it a fresh store, or a fresh etcd namespace.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::{Compare, Store, StoreError, TxnOp, Versioned};

/// What a check returns: `Err` says what went wrong.
pub type CheckResult = Result<(), String>;
pub type CheckFuture = Pin<Box<dyn Future<Output = CheckResult> + Send>>;
pub type CheckFn = fn(Arc<dyn Store>) -> CheckFuture;

/// Every check, by name, in the order [`run_all`] runs them.
pub const CHECKS: &[(&str, CheckFn)] = &[
    ("get-missing", |s| Box::pin(get_missing(s))),
    ("put-get-roundtrip", |s| Box::pin(put_get_roundtrip(s))),
    ("revisions-monotonic", |s| Box::pin(revisions_monotonic(s))),
    ("overwrite-mod-rev", |s| Box::pin(overwrite_mod_rev(s))),
    ("delete-existed", |s| Box::pin(delete_existed(s))),
    ("list-prefix-isolation", |s| {
        Box::pin(list_prefix_isolation(s))
    }),
    ("list-ordering", |s| Box::pin(list_ordering(s))),
    ("pagination", |s| Box::pin(pagination(s))),
    ("txn-all-or-nothing", |s| Box::pin(txn_all_or_nothing(s))),
    ("txn-create-if-absent", |s| {
        Box::pin(txn_create_if_absent(s))
    }),
    ("txn-cas-mod-rev", |s| Box::pin(txn_cas_mod_rev(s))),
    ("binary-values", |s| Box::pin(binary_values(s))),
    ("concurrent-create", |s| Box::pin(concurrent_create(s))),
    ("invalid-key", |s| Box::pin(invalid_key(s))),
];

/// Runs every check and returns each one's outcome. A check that panics counts
/// as failed.
pub async fn run_checks(store: Arc<dyn Store>) -> Vec<(&'static str, CheckResult)> {
    let mut out = Vec::with_capacity(CHECKS.len());
    for (name, check) in CHECKS {
        let started = std::time::Instant::now();
        // Spawned, so a panicking check is reported instead of ending the run.
        let result = match tokio::spawn(check(Arc::clone(&store))).await {
            Ok(r) => r,
            Err(e) => Err(format!("check panicked: {e}")),
        };
        tracing::info!(
            check = name,
            backend = store.backend(),
            ok = result.is_ok(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "conformance check"
        );
        out.push((*name, result));
    }
    out
}

/// Runs every check; panics listing all that failed.
pub async fn run_all(store: Arc<dyn Store>) {
    let backend = store.backend();
    match store.list(ROOT, None, 1).await {
        Ok(found) if found.is_empty() => {}
        Ok(found) => panic!(
            "conformance needs a store with nothing under {ROOT:?}, found {:?}",
            found[0].0
        ),
        Err(e) => panic!("conformance: listing {ROOT:?} on {backend}: {e}"),
    }
    let failures: Vec<String> = run_checks(store)
        .await
        .into_iter()
        .filter_map(|(name, r)| r.err().map(|e| format!("  {name}: {e}")))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} conformance checks failed on the {backend} store:\n{}",
        failures.len(),
        CHECKS.len(),
        failures.join("\n")
    );
}

const ROOT: &str = "conformance/";

fn key(check: &str, rest: &str) -> String {
    format!("{ROOT}{check}/{rest}")
}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

macro_rules! ensure_eq {
    ($left:expr, $right:expr, $what:expr) => {{
        let (l, r) = (&$left, &$right);
        if l != r {
            return Err(format!("{}: got {:?}, want {:?}", $what, l, r));
        }
    }};
}

/// Adds what was being done to a store error.
trait Ctx<T> {
    fn ctx(self, what: &str) -> Result<T, String>;
}

impl<T> Ctx<T> for Result<T, StoreError> {
    fn ctx(self, what: &str) -> Result<T, String> {
        self.map_err(|e| format!("{what}: unexpected error: {e}"))
    }
}

async fn must_get(s: &dyn Store, k: &str) -> Result<Versioned, String> {
    s.get(k)
        .await
        .ctx(&format!("get {k}"))?
        .ok_or_else(|| format!("get {k}: missing, want present"))
}

fn expect_conflict(r: Result<u64, StoreError>, want_key: &str, what: &str) -> CheckResult {
    match r {
        Err(StoreError::Conflict { key }) if key == want_key => Ok(()),
        Err(StoreError::Conflict { key }) => Err(format!(
            "{what}: conflict names key {key:?}, want {want_key:?}"
        )),
        Err(e) => Err(format!(
            "{what}: got error {e}, want a conflict on {want_key:?}"
        )),
        Ok(rev) => Err(format!(
            "{what}: succeeded at revision {rev}, want a conflict on {want_key:?}"
        )),
    }
}

fn names(items: &[(String, Versioned)]) -> Vec<&str> {
    items.iter().map(|(k, _)| k.as_str()).collect()
}

async fn get_missing(s: Arc<dyn Store>) -> CheckResult {
    let k = key("get-missing", "never-written");
    ensure_eq!(
        s.get(&k).await.ctx("get")?,
        None,
        "get of a never-written key"
    );
    let listed = s.list(&key("get-missing", ""), None, 0).await.ctx("list")?;
    ensure!(
        listed.is_empty(),
        "list of an empty prefix returned {:?}",
        names(&listed)
    );
    Ok(())
}

async fn put_get_roundtrip(s: Arc<dyn Store>) -> CheckResult {
    let k = key("put-get-roundtrip", "tenant");
    let value = br#"{"name":"acme","vpcs":[1,2]}"#.to_vec();
    let rev = s.put(&k, value.clone()).await.ctx("put")?;
    ensure!(rev > 0, "put returned revision 0");
    let got = must_get(&*s, &k).await?;
    ensure_eq!(got.value, value, "value read back");
    ensure_eq!(got.mod_rev, rev, "mod_rev vs the put's revision");
    ensure_eq!(got.create_rev, rev, "create_rev of a new key");
    Ok(())
}

async fn revisions_monotonic(s: Arc<dyn Store>) -> CheckResult {
    let mut last = s.revision().await.ctx("revision")?;
    for i in 0..5 {
        let k = key("revisions-monotonic", &format!("k{}", i % 2));
        let rev = s.put(&k, vec![i]).await.ctx("put")?;
        ensure!(
            rev > last,
            "put #{i} returned revision {rev}, not above {last}"
        );
        let now = s.revision().await.ctx("revision")?;
        ensure!(now >= rev, "revision() {now} is below the last put's {rev}");
        last = now;
    }
    let before = s.revision().await.ctx("revision")?;
    ensure!(
        s.delete(&key("revisions-monotonic", "k0"))
            .await
            .ctx("delete")?,
        "delete of a written key said it did not exist"
    );
    let after = s.revision().await.ctx("revision")?;
    ensure!(
        after > before,
        "delete did not bump the revision ({before} -> {after})"
    );
    let rev = s
        .txn(
            vec![],
            vec![TxnOp::Put(key("revisions-monotonic", "k2"), vec![9])],
        )
        .await
        .ctx("txn")?;
    ensure!(
        rev > after,
        "txn returned revision {rev}, not above {after}"
    );
    Ok(())
}

async fn overwrite_mod_rev(s: Arc<dyn Store>) -> CheckResult {
    let k = key("overwrite-mod-rev", "vpc");
    let r1 = s.put(&k, b"v1".to_vec()).await.ctx("put 1")?;
    let r2 = s.put(&k, b"v2".to_vec()).await.ctx("put 2")?;
    ensure!(r2 > r1, "overwrite returned revision {r2}, not above {r1}");
    let got = must_get(&*s, &k).await?;
    ensure_eq!(got.value, b"v2".to_vec(), "value after overwrite");
    ensure_eq!(got.mod_rev, r2, "mod_rev after overwrite");
    ensure_eq!(got.create_rev, r1, "create_rev after overwrite");
    // Same value again is still a write.
    let r3 = s.put(&k, b"v2".to_vec()).await.ctx("put 3")?;
    ensure!(
        r3 > r2,
        "rewrite of the same value returned {r3}, not above {r2}"
    );
    ensure_eq!(
        must_get(&*s, &k).await?.mod_rev,
        r3,
        "mod_rev after same-value put"
    );
    Ok(())
}

async fn delete_existed(s: Arc<dyn Store>) -> CheckResult {
    let k = key("delete-existed", "nf");
    let r1 = s.put(&k, b"x".to_vec()).await.ctx("put")?;
    ensure!(
        s.delete(&k).await.ctx("delete")?,
        "delete of an existing key returned false"
    );
    ensure_eq!(s.get(&k).await.ctx("get")?, None, "get after delete");
    let rev = s.revision().await.ctx("revision")?;
    ensure!(
        !s.delete(&k).await.ctx("delete again")?,
        "second delete returned true"
    );
    ensure!(
        !s.delete(&key("delete-existed", "never"))
            .await
            .ctx("delete never-written")?,
        "delete of a never-written key returned true"
    );
    ensure_eq!(
        s.revision().await.ctx("revision")?,
        rev,
        "revision after deletes of absent keys (they change nothing)"
    );
    let r2 = s.put(&k, b"y".to_vec()).await.ctx("re-create")?;
    let got = must_get(&*s, &k).await?;
    ensure!(
        r2 > r1,
        "re-create revision {r2} not above first create {r1}"
    );
    ensure_eq!(got.create_rev, r2, "create_rev of a re-created key");
    Ok(())
}

/// The list checks store each key's name below the check's `root` as its value.
fn ensure_value_is_name(root: &str, k: &str, v: &Versioned, what: String) -> CheckResult {
    ensure_eq!(
        v.value,
        k.strip_prefix(root).unwrap_or(k).as_bytes().to_vec(),
        what
    );
    Ok(())
}

async fn list_prefix_isolation(s: Arc<dyn Store>) -> CheckResult {
    let p = |rest: &str| key("list-prefix-isolation", rest);
    for k in ["t/1/a", "t/1/b", "t/10/a", "t/1", "t/2/x", "t/0/z"] {
        s.put(&p(k), k.as_bytes().to_vec()).await.ctx("put")?;
    }
    let got = s.list(&p("t/1/"), None, 0).await.ctx("list t/1/")?;
    ensure_eq!(names(&got), vec![p("t/1/a"), p("t/1/b")], "list t/1/");
    for (k, v) in &got {
        ensure_value_is_name(&p(""), k, v, format!("value of {k}"))?;
    }
    let got = s.list(&p("t/10/"), None, 0).await.ctx("list t/10/")?;
    ensure_eq!(names(&got), vec![p("t/10/a")], "list t/10/");
    // A prefix is a byte prefix, not a path component.
    let got = s.list(&p("t/1"), None, 0).await.ctx("list t/1")?;
    ensure_eq!(
        names(&got),
        vec![p("t/1"), p("t/1/a"), p("t/1/b"), p("t/10/a")],
        "list t/1"
    );
    let got = s.list(&p("t/3"), None, 0).await.ctx("list t/3")?;
    ensure!(got.is_empty(), "list t/3 returned {:?}", names(&got));
    Ok(())
}

async fn list_ordering(s: Arc<dyn Store>) -> CheckResult {
    let p = |rest: &str| key("list-ordering", rest);
    // Inserted out of order; byte order puts 'B' before 'a', "a" before "a/"
    // before "a0", and multi-byte UTF-8 after ASCII.
    let keys = ["a0", "zz", "a/", "\u{e4}", "B", "a", "a/b", "Z", "~"];
    let mut revs = Vec::new();
    for k in keys {
        revs.push((p(k), s.put(&p(k), k.as_bytes().to_vec()).await.ctx("put")?));
    }
    let mut want: Vec<String> = keys.iter().map(|k| p(k)).collect();
    want.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    let got = s.list(&p(""), None, 0).await.ctx("list")?;
    ensure_eq!(
        names(&got),
        want.iter().map(String::as_str).collect::<Vec<_>>(),
        "list order"
    );
    for (k, v) in &got {
        let rev = revs.iter().find(|(rk, _)| rk == k).map(|(_, r)| *r);
        ensure_eq!(Some(v.mod_rev), rev, format!("listed mod_rev of {k}"));
        ensure_value_is_name(&p(""), k, v, format!("listed value of {k}"))?;
    }
    Ok(())
}

async fn pagination(s: Arc<dyn Store>) -> CheckResult {
    const N: usize = 250;
    const PAGE: usize = 7;
    let prefix = key("pagination", "items/");
    let all: Vec<String> = (0..N).map(|i| format!("{prefix}{i:04}")).collect();
    // Written in batches (fewer commits keeps the suite fast on fsyncing
    // backends), in a scrambled order so storage order cannot fake key order.
    let mut order: Vec<usize> = (0..N).collect();
    order.sort_by_key(|i| (i * 97) % N);
    for chunk in order.chunks(50) {
        let ops = chunk
            .iter()
            .map(|&i| TxnOp::Put(all[i].clone(), i.to_string().into_bytes()))
            .collect();
        s.txn(vec![], ops).await.ctx("batch put")?;
    }
    // Neighbours that must not leak into the pages.
    s.put(&key("pagination", "items"), b"x".to_vec())
        .await
        .ctx("put")?;
    s.put(&key("pagination", "items0"), b"x".to_vec())
        .await
        .ctx("put")?;

    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    let mut pages = 0;
    loop {
        let page = s
            .list(&prefix, after.as_deref(), PAGE)
            .await
            .ctx("list page")?;
        ensure!(
            page.len() <= PAGE,
            "page of {} items with limit {PAGE}",
            page.len()
        );
        pages += 1;
        ensure!(
            pages <= N / PAGE + 2,
            "pagination did not end after {pages} pages"
        );
        let Some((last, _)) = page.last() else { break };
        after = Some(last.clone());
        for (k, v) in &page {
            let i = all.iter().position(|a| a == k);
            ensure!(i.is_some(), "page has foreign key {k:?}");
            ensure_eq!(
                v.value,
                i.unwrap_or(0).to_string().into_bytes(),
                format!("value of {k}")
            );
        }
        let short = page.len() < PAGE;
        seen.extend(page.into_iter().map(|(k, _)| k));
        if short {
            break;
        }
    }
    ensure_eq!(seen.len(), N, "keys walked");
    ensure!(seen == all, "walk is not every key once, in order");

    let everything = s.list(&prefix, None, 0).await.ctx("list all")?;
    ensure_eq!(everything.len(), N, "limit 0 lists everything");
    // Listing after `start` (which needs not be an existing key) with `limit`.
    let after = |start: String, limit: usize, what: &'static str| {
        let s = s.clone();
        let prefix = prefix.clone();
        async move { s.list(&prefix, Some(&start), limit).await.ctx(what) }
    };
    let mid = after(format!("{prefix}0099x"), 2, "list after a missing key").await?;
    ensure_eq!(
        names(&mid),
        vec![all[100].as_str(), all[101].as_str()],
        "page after 0099x"
    );
    let before = after(
        key("pagination", "a"),
        1,
        "list after a key before the prefix",
    )
    .await?;
    ensure_eq!(
        names(&before),
        vec![all[0].as_str()],
        "start_after before the prefix"
    );
    let past = after(key("pagination", "items~"), 0, "list past the prefix").await?;
    ensure!(
        past.is_empty(),
        "start_after past the prefix returned {:?}",
        names(&past)
    );
    Ok(())
}

async fn txn_all_or_nothing(s: Arc<dyn Store>) -> CheckResult {
    let p = |rest: &str| key("txn-all-or-nothing", rest);
    let r1 = s.put(&p("k1"), b"one".to_vec()).await.ctx("put k1")?;
    s.put(&p("k2"), b"two".to_vec()).await.ctx("put k2")?;
    let k1 = must_get(&*s, &p("k1")).await?;
    let k2 = must_get(&*s, &p("k2")).await?;
    let rev = s.revision().await.ctx("revision")?;

    // The same ops, first under compares that fail, then under compares that hold.
    let ops = || {
        vec![
            TxnOp::Put(p("k1"), b"changed".to_vec()),
            TxnOp::Put(p("k3"), b"new".to_vec()),
            TxnOp::Delete(p("k2")),
        ]
    };
    // The first compare holds, the second does not.
    let r = s
        .txn(
            vec![Compare::ModRev(p("k1"), r1), Compare::Absent(p("k2"))],
            ops(),
        )
        .await;
    expect_conflict(r, &p("k2"), "txn with a failing second compare")?;
    ensure_eq!(must_get(&*s, &p("k1")).await?, k1, "k1 after a failed txn");
    ensure_eq!(must_get(&*s, &p("k2")).await?, k2, "k2 after a failed txn");
    ensure_eq!(
        s.get(&p("k3")).await.ctx("get k3")?,
        None,
        "k3 after a failed txn"
    );
    ensure_eq!(
        s.revision().await.ctx("revision")?,
        rev,
        "revision after a failed txn"
    );

    // Several failing compares: the first one is named.
    let r = s
        .txn(
            vec![
                Compare::Present(p("nope")),
                Compare::Absent(p("k1")),
                Compare::ModRev(p("k2"), 0),
            ],
            vec![TxnOp::Delete(p("k1"))],
        )
        .await;
    expect_conflict(r, &p("nope"), "txn with three failing compares")?;

    // All hold: every op applies, at one new revision.
    let r = s
        .txn(
            vec![Compare::ModRev(p("k1"), r1), Compare::Present(p("k2"))],
            ops(),
        )
        .await
        .ctx("txn whose compares hold")?;
    ensure!(r > rev, "txn revision {r} not above {rev}");
    let k1 = must_get(&*s, &p("k1")).await?;
    ensure_eq!(k1.value, b"changed".to_vec(), "k1 after txn");
    ensure_eq!(k1.mod_rev, r, "k1 mod_rev after txn");
    ensure_eq!(k1.create_rev, r1, "k1 create_rev after txn");
    let k3 = must_get(&*s, &p("k3")).await?;
    ensure_eq!(
        (k3.mod_rev, k3.create_rev),
        (r, r),
        "k3 revisions after txn"
    );
    ensure_eq!(
        s.get(&p("k2")).await.ctx("get k2")?,
        None,
        "k2 after txn deleted it"
    );
    Ok(())
}

async fn txn_create_if_absent(s: Arc<dyn Store>) -> CheckResult {
    let k = key("txn-create-if-absent", "tenant");
    let create = |v: &[u8]| {
        (
            vec![Compare::Absent(k.clone())],
            vec![TxnOp::Put(k.clone(), v.to_vec())],
        )
    };
    let (c, o) = create(b"first");
    let rev = s.txn(c, o).await.ctx("first create")?;
    let (c, o) = create(b"second");
    expect_conflict(s.txn(c, o).await, &k, "second create")?;
    let got = must_get(&*s, &k).await?;
    ensure_eq!(
        got.value,
        b"first".to_vec(),
        "value after the second create"
    );
    ensure_eq!(got.mod_rev, rev, "mod_rev after the second create");
    // ModRev 0 means "absent" too.
    let r = s
        .txn(
            vec![Compare::ModRev(k.clone(), 0)],
            vec![TxnOp::Delete(k.clone())],
        )
        .await;
    expect_conflict(r, &k, "ModRev 0 on a present key")?;
    Ok(())
}

async fn txn_cas_mod_rev(s: Arc<dyn Store>) -> CheckResult {
    let k = key("txn-cas-mod-rev", "chain");
    s.put(&k, b"v1".to_vec()).await.ctx("put")?;
    let seen = must_get(&*s, &k).await?.mod_rev;
    let cas = |rev: u64, v: &[u8]| {
        (
            vec![Compare::ModRev(k.clone(), rev)],
            vec![TxnOp::Put(k.clone(), v.to_vec())],
        )
    };
    let (c, o) = cas(seen, b"v2");
    let r2 = s.txn(c, o).await.ctx("CAS with the current mod_rev")?;
    // A second writer that read the same revision must lose.
    let (c, o) = cas(seen, b"stale");
    expect_conflict(s.txn(c, o).await, &k, "CAS with a stale mod_rev")?;
    let got = must_get(&*s, &k).await?;
    ensure_eq!(got.value, b"v2".to_vec(), "value after the stale CAS");
    ensure_eq!(got.mod_rev, r2, "mod_rev after the stale CAS");
    let (c, o) = cas(u64::MAX, b"huge");
    expect_conflict(s.txn(c, o).await, &k, "CAS with an impossible revision")?;
    let missing = key("txn-cas-mod-rev", "missing");
    let r = s
        .txn(
            vec![Compare::Present(missing.clone())],
            vec![TxnOp::Put(missing.clone(), vec![])],
        )
        .await;
    expect_conflict(r, &missing, "Present on a missing key")?;
    ensure_eq!(
        s.get(&missing).await.ctx("get")?,
        None,
        "missing key after failed Present"
    );
    Ok(())
}

async fn binary_values(s: Arc<dyn Store>) -> CheckResult {
    let all_bytes: Vec<u8> = (0..=255u8).chain((0..=255u8).rev()).collect();
    let zeros = vec![0u8; 64 * 1024];
    let cases: [(&str, Vec<u8>); 4] = [
        ("all-bytes", all_bytes),
        ("zeros", zeros),
        ("empty", Vec::new()),
        ("invalid-utf8", vec![0xff, 0xfe, 0x00, 0xc3, 0x28]),
    ];
    for (name, value) in cases {
        let k = key("binary-values", name);
        s.put(&k, value.clone()).await.ctx(&format!("put {name}"))?;
        let got = must_get(&*s, &k).await?;
        ensure!(
            got.value == value,
            "{name}: read back {} bytes, wrote {} (contents differ)",
            got.value.len(),
            value.len()
        );
    }
    Ok(())
}

async fn concurrent_create(s: Arc<dyn Store>) -> CheckResult {
    const TASKS: usize = 8;
    let k = key("concurrent-create", "instance");
    let barrier = Arc::new(tokio::sync::Barrier::new(TASKS));
    let mut handles = Vec::new();
    for i in 0..TASKS {
        let (s, k, barrier) = (Arc::clone(&s), k.clone(), Arc::clone(&barrier));
        handles.push(tokio::spawn(async move {
            barrier.wait().await;
            let r = s
                .txn(
                    vec![Compare::Absent(k.clone())],
                    vec![TxnOp::Put(k, format!("task-{i}").into_bytes())],
                )
                .await;
            (i, r)
        }));
    }
    let mut winners = Vec::new();
    for h in handles {
        let (i, r) = h.await.map_err(|e| format!("task failed: {e}"))?;
        match r {
            Ok(rev) => winners.push((i, rev)),
            Err(StoreError::Conflict { key }) if key == k => {}
            Err(e) => {
                return Err(format!(
                    "task {i}: got {e}, want success or conflict on {k:?}"
                ))
            }
        }
    }
    ensure!(
        winners.len() == 1,
        "{} of {TASKS} creates won: {winners:?}",
        winners.len()
    );
    let (i, rev) = winners[0];
    let got = must_get(&*s, &k).await?;
    ensure_eq!(
        got.value,
        format!("task-{i}").into_bytes(),
        "stored value vs the winner"
    );
    ensure_eq!(got.mod_rev, rev, "mod_rev vs the winner's revision");
    Ok(())
}

async fn invalid_key(s: Arc<dyn Store>) -> CheckResult {
    fn is_invalid<T: std::fmt::Debug>(r: Result<T, StoreError>, what: &str) -> CheckResult {
        match r {
            Err(StoreError::InvalidKey(_)) => Ok(()),
            other => Err(format!("{what}: got {other:?}, want InvalidKey")),
        }
    }
    let rev = s.revision().await.ctx("revision")?;
    is_invalid(s.get("").await, "get \"\"")?;
    is_invalid(s.put("", b"x".to_vec()).await, "put \"\"")?;
    is_invalid(s.delete("").await, "delete \"\"")?;
    is_invalid(
        s.put("conformance/invalid-key/nul\0", vec![]).await,
        "put with NUL",
    )?;
    is_invalid(
        s.put(&"k".repeat(crate::MAX_KEY_LEN + 1), vec![]).await,
        "put of an over-long key",
    )?;
    let ok = key("invalid-key", "ok");
    is_invalid(
        s.txn(
            vec![Compare::Absent(String::new())],
            vec![TxnOp::Put(ok.clone(), vec![])],
        )
        .await,
        "txn with an empty compare key",
    )?;
    is_invalid(
        s.txn(
            vec![],
            vec![TxnOp::Put(ok.clone(), vec![]), TxnOp::Delete(String::new())],
        )
        .await,
        "txn with an empty op key",
    )?;
    is_invalid(
        s.txn(
            vec![],
            vec![
                TxnOp::Put(ok.clone(), vec![1]),
                TxnOp::Put(ok.clone(), vec![2]),
            ],
        )
        .await,
        "txn writing one key twice",
    )?;
    ensure_eq!(s.get(&ok).await.ctx("get")?, None, "key of a refused txn");
    ensure_eq!(
        s.revision().await.ctx("revision")?,
        rev,
        "revision after refused writes"
    );
    Ok(())
}
