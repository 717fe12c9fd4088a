//! The netns lab every end-to-end test file shares: a testbed with a per-test prefix
//! that deletes itself (and every process in it) when the test ends, passes or panics,
//! and asserts afterwards that nothing of it is left.

// Each test binary that includes this module uses a different part of it.
#![allow(dead_code)]

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use proto::ChainDef;
use testbed::chains::{self, Toward};
use testbed::cleanup::namespaces_with_prefix;
use testbed::elastic::{EventReport, ScenarioReport};
use testbed::platform::{self, Platform, PlatformSpec};
use testbed::services;
use testbed::topo::vni;
use testbed::{Resources, Testbed, TopologySpec};

pub const BIN: &str = env!("CARGO_BIN_EXE_starfabric");
pub const ROOT: &str = "sft-";
pub static RUN: AtomicUsize = AtomicUsize::new(0);

/// VPC `j`'s chain: one SNAT NF toward the internet host (tenant j+1, chain 1).
pub fn snat_chain(j: usize) -> ChainDef {
    chains::chain(j as u32 + 1, 1, j, Toward::Internet, &[chains::snat(j)]).expect("SNAT chain")
}

/// `--workers N` of `SF_E2E_PP_ARGS` (1 without): the PP veth gets that many queues,
/// so the suite runs again on a multi-worker PP node on AF_XDP.
pub fn suite_workers() -> usize {
    let extra = std::env::var("SF_E2E_PP_ARGS").unwrap_or_default();
    let mut w = extra.split_whitespace();
    while let Some(a) = w.next() {
        if let Some(n) = a.strip_prefix("--workers=") {
            return n.parse().unwrap_or(1);
        }
        if a == "--workers" {
            return w.next().and_then(|n| n.parse().ok()).unwrap_or(1);
        }
    }
    1
}

/// A test's testbed; deletes it on drop and checks nothing is left.
pub struct Lab {
    tb: Option<Testbed>,
    res: Arc<Resources>,
    prefix: String,
}

impl Lab {
    /// A topology with `tenants` VPCs and `backends` nginx backends, or None (skip) when
    /// not root outside CI.
    pub fn new(tenants: usize, backends: usize) -> Option<Lab> {
        Lab::with_topology(tenants, backends, |t| t)
    }

    /// A PP cluster (docs/pp-cluster.md): `pp_nodes` PP node namespaces behind the
    /// router's ECMP route over the vIPs.
    pub fn cluster(tenants: usize, backends: usize, pp_nodes: usize) -> Option<Lab> {
        Lab::with_topology(tenants, backends, |t| t.pp_cluster(pp_nodes))
    }

    /// One PP node whose underlay veth has `queues` receive queues (for `--workers`).
    pub fn queues(tenants: usize, backends: usize, queues: usize) -> Option<Lab> {
        Lab::with_topology(tenants, backends, |t| t.pp_queues(queues))
    }

    fn with_topology(
        tenants: usize,
        backends: usize,
        more: impl FnOnce(TopologySpec) -> TopologySpec,
    ) -> Option<Lab> {
        if !testbed::is_root() {
            if std::env::var_os("CI").is_some() {
                panic!("the e2e tests need root (network namespaces); CI runs as root");
            }
            println!("SKIP: the e2e tests need root (network namespaces, veth, nftables)");
            return None;
        }
        testbed::check_prerequisites().expect("prerequisites (run scripts/setup.sh)");
        testbed::install_signal_cleanup().expect("signal handlers");
        testbed::sweep_stale(ROOT);
        let prefix = format!(
            "{ROOT}{}-{}-",
            std::process::id(),
            RUN.fetch_add(1, Ordering::Relaxed)
        );
        let res = Resources::new(&prefix);
        let tb = Testbed::build(
            more(
                TopologySpec::new(&prefix)
                    .tenants(tenants)
                    .backends(backends)
                    .pp_queues(suite_workers()),
            ),
            res.clone(),
        )
        .expect("build the testbed");
        Some(Lab {
            tb: Some(tb),
            res,
            prefix,
        })
    }

    pub fn tb(&self) -> &Testbed {
        self.tb.as_ref().unwrap()
    }

    /// starfabric with `chains`, chain `i` serving VPC `i` (tenant i+1, chain 1), on the
    /// PP node's default I/O backend (AF_XDP on its veth).
    pub fn start(&self, chains: Vec<ChainDef>) -> Platform {
        self.start_with(chains, &[])
    }

    /// The same with more `starfabric pp` arguments. `SF_E2E_PP_ARGS` (whitespace
    /// separated) is the arguments of every test that names none of its own, so the
    /// whole suite can run again with another configuration, e.g. the XDP fast path on
    /// (`make test` does). A test that names its own keeps exactly those.
    pub fn start_with(&self, chains: Vec<ChainDef>, pp_args: &[&str]) -> Platform {
        let vpcs = chains
            .iter()
            .enumerate()
            .map(|(j, c)| (vni::tenant(j), c.tenant, c.chain))
            .collect();
        let extra = std::env::var("SF_E2E_PP_ARGS").unwrap_or_default();
        let args: Vec<&str> = if pp_args.is_empty() {
            extra.split_whitespace().collect()
        } else {
            pp_args.to_vec()
        };
        let spec = PlatformSpec::new(chains, vpcs).pp_args(&args);
        self.start_spec(&spec)
    }

    /// The internet host's servers up, and starfabric with one VPC whose chain is SNAT
    /// toward them ([`snat_chain`]), with `more` said about the platform (SC nodes, PP
    /// nodes, a standby FM).
    pub fn start_snat_inet(&self, more: impl FnOnce(&mut PlatformSpec)) -> Platform {
        services::start_inet(self.tb(), false).expect("internet host servers");
        let mut spec = PlatformSpec::new(vec![snat_chain(0)], vec![(vni::tenant(0), 1, 1)]);
        more(&mut spec);
        self.start_spec(&spec)
    }

    /// starfabric exactly as `spec` says (e.g. more SC nodes, as spares).
    pub fn start_spec(&self, spec: &PlatformSpec) -> Platform {
        platform::start_starfabric(self.tb(), Path::new(BIN), spec).expect("start starfabric")
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        drop(self.tb.take());
        self.res.cleanup();
        let left = namespaces_with_prefix(&self.prefix);
        if !left.is_empty() && !std::thread::panicking() {
            panic!("namespaces survived the cleanup: {left:?}");
        }
        let host_links = testbed::cmd::ip(&["-o", "link"]).unwrap_or_default();
        assert!(
            !host_links.contains(&self.prefix),
            "a device of this run is in the host namespace"
        );
    }
}

/// No connection failed or was reset, and the iperf3 flows ran through.
pub fn assert_survived(r: &ScenarioReport, min_connections: usize) {
    assert!(
        r.connections >= min_connections,
        "{} connections",
        r.connections
    );
    assert_eq!(r.failed_connections, 0, "failed: {:#?}", r.failures);
    assert_eq!(r.reset_connections, 0, "reset: {:#?}", r.failures);
    assert_eq!(r.duplicate_mappings, 0);
    assert!(r.iperf.error.is_none(), "iperf3: {:?}", r.iperf.error);
    assert_eq!(r.iperf.streams, 2);
    assert!(
        r.iperf.mean_mbps > 1.0,
        "iperf3 {} Mbit/s",
        r.iperf.mean_mbps
    );
    assert!(
        r.iperf.max_stall_s <= 1.0,
        "an iperf3 stream stalled {:.1} s",
        r.iperf.max_stall_s
    );
    assert!(r.iperf_covered_events);
}

/// A scenario's connection counts: `name: N connections, failed F, reset R, duplicate
/// mappings D`.
pub fn scenario_counts(r: &ScenarioReport) -> String {
    format!(
        "{}: {} connections, failed {}, reset {}, duplicate mappings {}",
        r.name, r.connections, r.failed_connections, r.reset_connections, r.duplicate_mappings,
    )
}

/// An event's timing and connections: `name at T ms for D ms: N connections, F failed`.
pub fn event_counts(e: &EventReport) -> String {
    format!(
        "{} at {} ms for {} ms: {} connections, {} failed",
        e.name,
        e.start_ms,
        e.end_ms - e.start_ms,
        e.connections,
        e.failed_connections,
    )
}
