use std::future::Future;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, CompareOp, ConnectOptions, GetOptions, KeyValue, KvClient, SortOrder, SortTarget, Txn,
    TxnOpResponse,
};
use tracing::{debug, info, warn};

use crate::{
    validate_key, validate_prefix, validate_txn, Compare, Store, StoreError, TxnOp, Versioned,
};

/// Timeouts of an [`EtcdStore`].
#[derive(Debug, Clone)]
pub struct EtcdOptions {
    /// How long `connect` waits for a first answer from the cluster.
    pub connect_timeout: Duration,
    /// Bound on every later request, so a dead cluster yields `Unavailable`
    /// instead of a hang.
    pub request_timeout: Duration,
}

impl Default for EtcdOptions {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
        }
    }
}

/// The etcd v3 backend. Every key lives under a namespace prefix, so several
/// deployments or test runs can share one cluster. Revisions are etcd's own:
/// cluster-wide, so writes in other namespaces bump them too (they stay
/// monotonic, which is all the [`Store`] contract promises).
#[derive(Clone)]
pub struct EtcdStore {
    kv: KvClient,
    namespace: String,
    endpoints: String,
    request_timeout: Duration,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.endpoints)
            .field("namespace", &self.namespace)
            .finish()
    }
}

impl EtcdStore {
    /// Connects to `endpoints` (`http://host:port` or `host:port`) with default
    /// timeouts. `prefix` is the namespace; a `/` is appended if it does not end
    /// in one, so namespaces `a` and `ab` cannot see each other's keys.
    pub async fn connect(endpoints: &[String], prefix: &str) -> Result<Self, StoreError> {
        Self::connect_with(endpoints, prefix, EtcdOptions::default()).await
    }

    pub async fn connect_with(
        endpoints: &[String],
        prefix: &str,
        options: EtcdOptions,
    ) -> Result<Self, StoreError> {
        if endpoints.is_empty() {
            return Err(StoreError::Unavailable("no etcd endpoints given".into()));
        }
        let mut namespace = prefix.to_string();
        if !namespace.is_empty() {
            validate_key(&namespace)?;
            if !namespace.ends_with('/') {
                namespace.push('/');
            }
        }
        let joined = endpoints.join(",");
        let connect_opts = ConnectOptions::new()
            .with_connect_timeout(options.connect_timeout)
            .with_timeout(options.request_timeout);
        // The client connects lazily and its balanced channel waits for a ready
        // endpoint without a deadline, so the probe below carries the bound.
        let probe = async {
            let client = Client::connect(endpoints, Some(connect_opts)).await?;
            let mut kv = client.kv_client();
            kv.get(
                probe_key(&namespace),
                Some(GetOptions::new().with_count_only()),
            )
            .await?;
            Ok::<_, etcd_client::Error>(kv)
        };
        let kv = match tokio::time::timeout(options.connect_timeout, probe).await {
            Ok(Ok(kv)) => kv,
            Ok(Err(e)) => return Err(map_etcd(&joined, "connect", e)),
            Err(_) => {
                return Err(StoreError::Unavailable(format!(
                    "etcd at {joined}: no answer within {:?}",
                    options.connect_timeout
                )))
            }
        };
        info!(endpoints = %joined, namespace = %namespace, "etcd store connected");
        Ok(Self {
            kv,
            namespace,
            endpoints: joined,
            request_timeout: options.request_timeout,
        })
    }

    /// The namespace every key is stored under.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn full_key(&self, key: &str) -> Vec<u8> {
        let mut full = Vec::with_capacity(self.namespace.len() + key.len());
        full.extend_from_slice(self.namespace.as_bytes());
        full.extend_from_slice(key.as_bytes());
        full
    }

    fn user_key(&self, full: &[u8]) -> Result<String, StoreError> {
        let rest = full
            .strip_prefix(self.namespace.as_bytes())
            .ok_or_else(|| {
                StoreError::Corrupt(format!(
                    "etcd returned key {:?} outside namespace {:?}",
                    String::from_utf8_lossy(full),
                    self.namespace
                ))
            })?;
        String::from_utf8(rest.to_vec()).map_err(|_| {
            StoreError::Corrupt(format!(
                "etcd key {:?} is not UTF-8",
                String::from_utf8_lossy(full)
            ))
        })
    }

    /// Runs one request under the request timeout, mapping failures.
    async fn call<T>(
        &self,
        what: &str,
        fut: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(self.request_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(map_etcd(&self.endpoints, what, e)),
            Err(_) => Err(StoreError::Unavailable(format!(
                "etcd at {}: {what} got no answer within {:?}",
                self.endpoints, self.request_timeout
            ))),
        }
    }
}

fn map_etcd(endpoints: &str, what: &str, e: etcd_client::Error) -> StoreError {
    use etcd_client::Error as E;
    use tonic::Code;
    match e {
        E::TransportError(t) => {
            StoreError::Unavailable(format!("etcd at {endpoints}: {what}: {t}"))
        }
        E::GRpcStatus(s) => match s.code() {
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Aborted => {
                StoreError::Unavailable(format!("etcd at {endpoints}: {what}: {}", s.message()))
            }
            Code::InvalidArgument
            | Code::ResourceExhausted
            | Code::OutOfRange
            | Code::FailedPrecondition => {
                StoreError::Rejected(format!("etcd at {endpoints}: {what}: {}", s.message()))
            }
            // tonic reports a broken or refused connection as Unknown.
            Code::Unknown if is_transport(&s) => {
                StoreError::Unavailable(format!("etcd at {endpoints}: {what}: {}", s.message()))
            }
            code => StoreError::Io(format!(
                "etcd at {endpoints}: {what}: {code:?}: {}",
                s.message()
            )),
        },
        E::InvalidArgs(m) | E::EndpointError(m) => {
            StoreError::Unavailable(format!("etcd at {endpoints}: {what}: {m}"))
        }
        E::InvalidUri(u) => {
            StoreError::Unavailable(format!("etcd at {endpoints}: {what}: bad endpoint: {u}"))
        }
        E::IoError(io) => StoreError::Io(format!("etcd at {endpoints}: {what}: {io}")),
        other => StoreError::Io(format!("etcd at {endpoints}: {what}: {other}")),
    }
}

/// A key to read only for the response header (etcd refuses an empty key).
fn probe_key(namespace: &str) -> Vec<u8> {
    if namespace.is_empty() {
        vec![0]
    } else {
        namespace.as_bytes().to_vec()
    }
}

fn is_transport(s: &tonic::Status) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(s);
    while let Some(e) = source {
        if e.is::<tonic::transport::Error>() {
            return true;
        }
        source = e.source();
    }
    s.message().contains("transport error")
}

fn revision_of(rev: i64) -> Result<u64, StoreError> {
    u64::try_from(rev).map_err(|_| StoreError::Corrupt(format!("etcd sent revision {rev}")))
}

fn header_revision(header: Option<&etcd_client::ResponseHeader>) -> Result<u64, StoreError> {
    let header =
        header.ok_or_else(|| StoreError::Corrupt("etcd response without a header".into()))?;
    revision_of(header.revision())
}

fn versioned(kv: &KeyValue) -> Result<Versioned, StoreError> {
    Ok(Versioned {
        value: kv.value().to_vec(),
        mod_rev: revision_of(kv.mod_revision())?,
        create_rev: revision_of(kv.create_revision())?,
    })
}

/// The smallest key greater than every key starting with `prefix`; empty means
/// "no upper bound", which etcd spells as `\0`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[async_trait]
impl Store for EtcdStore {
    async fn get(&self, key: &str) -> Result<Option<Versioned>, StoreError> {
        validate_key(key)?;
        let mut kv = self.kv.clone();
        let resp = self.call("get", kv.get(self.full_key(key), None)).await?;
        resp.kvs().first().map(versioned).transpose()
    }

    async fn put(&self, key: &str, value: Vec<u8>) -> Result<u64, StoreError> {
        validate_key(key)?;
        let mut kv = self.kv.clone();
        let resp = self
            .call("put", kv.put(self.full_key(key), value, None))
            .await?;
        let rev = header_revision(resp.header())?;
        debug!(key, rev, "put");
        Ok(rev)
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        validate_key(key)?;
        let mut kv = self.kv.clone();
        let resp = self
            .call("delete", kv.delete(self.full_key(key), None))
            .await?;
        Ok(resp.deleted() > 0)
    }

    async fn list(
        &self,
        prefix: &str,
        start_after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, Versioned)>, StoreError> {
        validate_prefix(prefix)?;
        let lower = self.full_key(prefix);
        let end = prefix_end(&lower);
        let mut start = lower;
        if let Some(after) = start_after {
            // `after` + NUL is the least key strictly greater than `after`.
            let mut from = self.full_key(after);
            from.push(0);
            if from > start {
                start = from;
            }
        }
        if end != [0] && start >= end {
            return Ok(Vec::new());
        }
        if start.is_empty() {
            // etcd refuses an empty key; NUL is the least non-empty one.
            start.push(0);
        }
        let opts = GetOptions::new()
            .with_range(end)
            .with_sort(SortTarget::Key, SortOrder::Ascend)
            .with_limit(i64::try_from(limit).unwrap_or(i64::MAX));
        let mut kv = self.kv.clone();
        let resp = self.call("list", kv.get(start, Some(opts))).await?;
        resp.kvs()
            .iter()
            .map(|kv| Ok((self.user_key(kv.key())?, versioned(kv)?)))
            .collect()
    }

    async fn txn(&self, compares: Vec<Compare>, ops: Vec<TxnOp>) -> Result<u64, StoreError> {
        validate_txn(&compares, &ops)?;
        let mut when = Vec::with_capacity(compares.len());
        // On failure the same txn reads every compared key, at the revision the
        // compares saw, so the first failing compare can be named exactly.
        let mut or_else = Vec::with_capacity(compares.len());
        for c in &compares {
            let key = self.full_key(c.key());
            when.push(match c {
                // A key that does not exist has create_revision 0.
                Compare::Absent(_) => {
                    etcd_client::Compare::create_revision(key.clone(), CompareOp::Equal, 0)
                }
                Compare::Present(_) => {
                    etcd_client::Compare::create_revision(key.clone(), CompareOp::Greater, 0)
                }
                Compare::ModRev(k, rev) => match i64::try_from(*rev) {
                    Ok(rev) => {
                        etcd_client::Compare::mod_revision(key.clone(), CompareOp::Equal, rev)
                    }
                    // etcd revisions are i64: no key can have this one.
                    Err(_) => return Err(StoreError::Conflict { key: k.clone() }),
                },
            });
            or_else.push(etcd_client::TxnOp::get(key, None));
        }
        let then: Vec<etcd_client::TxnOp> = ops
            .iter()
            .map(|op| match op {
                TxnOp::Put(k, v) => etcd_client::TxnOp::put(self.full_key(k), v.clone(), None),
                TxnOp::Delete(k) => etcd_client::TxnOp::delete(self.full_key(k), None),
            })
            .collect();
        let request = Txn::new().when(when).and_then(then).or_else(or_else);
        let mut kv = self.kv.clone();
        let resp = self.call("txn", kv.txn(request)).await?;
        if resp.succeeded() {
            return header_revision(resp.header());
        }
        let responses = resp.op_responses();
        for (i, c) in compares.iter().enumerate() {
            let current = match responses.get(i) {
                Some(TxnOpResponse::Get(get)) => get.kvs().first().map(versioned).transpose()?,
                _ => {
                    return Err(StoreError::Corrupt(format!(
                        "etcd txn failure response {i} is not the expected range"
                    )))
                }
            };
            if !c.holds(current.as_ref()) {
                return Err(StoreError::Conflict {
                    key: c.key().to_string(),
                });
            }
        }
        // etcd said a compare failed, but every one holds on the state it read in
        // the same txn: should not happen; report the first key rather than lie
        // about success.
        warn!(
            ?compares,
            "etcd txn failed but no compare fails on its read-back"
        );
        Err(StoreError::Conflict {
            key: compares
                .first()
                .map(|c| c.key().to_string())
                .unwrap_or_default(),
        })
    }

    async fn revision(&self) -> Result<u64, StoreError> {
        let mut kv = self.kv.clone();
        let resp = self
            .call(
                "revision",
                kv.get(
                    probe_key(&self.namespace),
                    Some(GetOptions::new().with_count_only()),
                ),
            )
            .await?;
        header_revision(resp.header())
    }

    fn backend(&self) -> &'static str {
        "etcd"
    }
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn prefix_end_increments_last_byte_below_ff() {
        assert_eq!(prefix_end(b"t/1/"), b"t/10".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }
}
