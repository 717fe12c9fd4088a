//! A cluster for tests: an FM and SC nodes, all real gRPC on 127.0.0.1 with ephemeral
//! ports. FM runs on a tokio runtime of the test's; each SC node on its own runtime
//! thread ([`sc::ScProcess`]), so killing one looks like a crashed process.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fm::{FmConfig, FmHandle};
use proto::{v1, ChainDef};
use sc::{ChainFactory, ScConfig, ScProcess};

pub struct Cluster {
    pub rt: tokio::runtime::Runtime,
    pub fm: FmHandle,
    pub scs: Vec<ScProcess>,
}

pub fn local() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

impl Cluster {
    pub fn start(chains: Vec<ChainDef>, n_sc: usize, factory: Arc<dyn ChainFactory>) -> Cluster {
        Self::start_with(
            FmConfig {
                chains,
                ..FmConfig::default()
            },
            n_sc,
            factory,
        )
    }

    pub fn start_with(cfg: FmConfig, n_sc: usize, factory: Arc<dyn ChainFactory>) -> Cluster {
        // `RUST_LOG=info cargo test ...` shows FM's and SC's logs (repairs, stalls).
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let fm = rt.block_on(fm::start(cfg, local())).unwrap();
        let fm_addr = fm.addr().to_string();
        let scs = (0..n_sc)
            .map(|i| {
                ScProcess::spawn(
                    ScConfig::new(&format!("sc-{i}"), local(), &fm_addr),
                    factory.clone(),
                )
                .unwrap()
            })
            .collect();
        Cluster { rt, fm, scs }
    }

    pub fn fm_addr(&self) -> String {
        self.fm.addr().to_string()
    }

    pub fn map(&self) -> v1::PartitionMap {
        self.rt.block_on(self.fm.partition_map()).unwrap()
    }

    pub fn stats(&self) -> fm::FmStats {
        self.rt.block_on(self.fm.stats()).unwrap()
    }

    /// Wait until every chain has a group of `replicas`.
    pub fn wait_groups(&self, chains: usize, replicas: usize) -> v1::PartitionMap {
        wait(Duration::from_secs(10), "SC groups", || {
            let m = self.map();
            (m.groups.len() == chains && m.groups.iter().all(|g| g.replicas.len() == replicas))
                .then_some(m)
        })
    }

    /// Every group state of SC node `addr`, via its GroupStatus RPC.
    pub fn group_status(&self, addr: SocketAddr, snapshots: bool) -> Vec<v1::GroupState> {
        self.rt.block_on(async {
            let mut c = v1::service_computation_client::ServiceComputationClient::connect(format!(
                "http://{addr}"
            ))
            .await
            .unwrap()
            .max_decoding_message_size(proto::MAX_MESSAGE);
            c.group_status(v1::GroupStatusRequest { snapshots })
                .await
                .unwrap()
                .into_inner()
                .groups
        })
    }
}

/// Poll `f` every 10 ms until it returns Some, or fail after `limit`.
pub fn wait<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Part `i` of a chain snapshot (length-prefixed parts, one per NF).
pub fn nf_part(snap: &[u8], i: usize) -> Vec<u8> {
    let mut b = snap;
    for j in 0.. {
        let (len, rest) = b.split_first_chunk::<8>().unwrap();
        let len = u64::from_le_bytes(*len) as usize;
        if j == i {
            return rest[..len].to_vec();
        }
        b = &rest[len..];
    }
    unreachable!()
}
