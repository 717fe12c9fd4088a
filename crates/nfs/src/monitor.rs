//! Traffic monitor: packet and byte counters per tenant and per source host.
//!
//! The counters are Serpens' textbook multi-writer state (Table III, "host statistics"):
//! every partition counts on its own, so the tables are shared-write with *replicated*
//! consistency. They are platform tables ([`nf::StateTables`]): the monitor only adds to
//! them (S6's untethered `inc`) and reads them, and the platform splits (the new part
//! starts from zero), merges (by sum) and snapshots them. The true total is the sum over
//! parts (eventual consistency). Addition commutes, so replicas and parts agree whatever
//! order counts arrive in.
//!
//! SC sees only a flow's first packet: there the monitor counts a *flow*. Packets and
//! bytes are counted by PP on the flow's rules (`Action::Count`, every packet the rule
//! matches, the held first packet included) and reported back as deltas
//! ([`FlowEvent::Counters`], docs/metrics.md "Monitor counters"), which SC applies as an
//! op of the group's log, so every replica adds the same deltas. The host is the rule
//! key's source: the client for the forward rule, the server for the reply rule.

use std::net::IpAddr;

use nf::{
    Consistency, Decision, FirstPacket, FlowEvent, NetworkFunction, NfEnv, NfError, StateTables,
    TableSpec, TrafficCount, TrafficReport,
};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MonitorConfig {
    /// Hosts counted one by one; traffic of further hosts still counts for its tenant and
    /// in [`Monitor::overflow`]. Bounds memory against a spoofed-source flood.
    #[serde(default = "default_max_hosts")]
    pub max_hosts: usize,
}

fn default_max_hosts() -> usize {
    65_536
}

impl Default for MonitorConfig {
    fn default() -> Self {
        MonitorConfig {
            max_hosts: default_max_hosts(),
        }
    }
}

/// Packets, bytes and flows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub packets: u64,
    pub bytes: u64,
    /// Flows whose first packet the monitor saw. Absent in snapshots of older nodes.
    #[serde(default)]
    pub flows: u64,
}

impl Counters {
    fn traffic(&self) -> TrafficCount {
        TrafficCount {
            packets: self.packets,
            bytes: self.bytes,
            flows: self.flows,
        }
    }
}

/// The host table's key: a host of a tenant, or None for the spill row that counts the
/// hosts beyond `max_hosts`.
type HostKey = Option<(u32, IpAddr)>;

const TENANTS: &str = "tenant-counters";
const HOSTS: &str = "host-counters";

fn lanes(v: &[u64]) -> Counters {
    let at = |i: usize| v.get(i).copied().unwrap_or(0);
    Counters {
        packets: at(0),
        bytes: at(1),
        flows: at(2),
    }
}

/// Its state is two platform tables of counters ([`StateTables`], S6 multi-writer
/// objects): the platform snapshots, splits (the new part from zero) and merges (by sum)
/// them, and folds the untethered adds.
pub struct Monitor {
    state: StateTables,
}

impl Monitor {
    pub fn new(cfg: MonitorConfig) -> Result<Self, NfError> {
        if cfg.max_hosts == 0 {
            return Err(NfError::Config(
                "monitor: max_hosts must be at least 1".into(),
            ));
        }
        let mut state = StateTables::create(&Self::specs())?;
        state.set_capacity(HOSTS, cfg.max_hosts, Some(&None::<(u32, IpAddr)>))?;
        Ok(Monitor { state })
    }

    fn specs() -> Vec<TableSpec> {
        vec![
            TableSpec::shared_write(TENANTS, Consistency::Replicated),
            TableSpec::shared_write(HOSTS, Consistency::Replicated),
        ]
    }

    /// Add packets and bytes reported later (PP's rule counters, as
    /// [`FlowEvent::Counters`], or another replica's tally).
    pub fn record(&mut self, tenant: u32, host: IpAddr, packets: u64, bytes: u64) {
        self.count(tenant, host, packets, bytes, 0);
    }

    fn count(&mut self, tenant: u32, host: IpAddr, packets: u64, bytes: u64, flows: u64) {
        let add = [packets, bytes, flows];
        // Both tables are declared here with three lanes; a full host table spills.
        let done = (self.state.add(TENANTS, &tenant, &add))
            .and_then(|()| self.state.add(HOSTS, &Some((tenant, host)), &add));
        if let Err(e) = done {
            tracing::warn!(error = %e, "monitor: a count was refused");
        }
    }

    pub fn tenant(&self, tenant: u32) -> Counters {
        self.state
            .counter(TENANTS, &tenant)
            .map(|v| lanes(&v))
            .unwrap_or_default()
    }

    pub fn host(&self, tenant: u32, host: IpAddr) -> Counters {
        self.state
            .counter(HOSTS, &Some((tenant, host)))
            .map(|v| lanes(&v))
            .unwrap_or_default()
    }

    /// Every tenant's counters, by tenant id.
    pub fn tenants(&self) -> Vec<(u32, Counters)> {
        let mut out: Vec<(u32, Counters)> = (self.state.counters::<u32>(TENANTS))
            .unwrap_or_default()
            .into_iter()
            .map(|(t, v)| (t, lanes(&v)))
            .collect();
        out.sort_by_key(|(t, _)| *t);
        out
    }

    /// Every counted host, by tenant and address.
    fn all_hosts(&self) -> Vec<(u32, IpAddr, Counters)> {
        let mut out: Vec<_> = (self.state.counters::<HostKey>(HOSTS))
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(k, v)| k.map(|(t, a)| (t, a, lanes(&v))))
            .collect();
        out.sort_by_key(|(t, a, _)| (*t, *a));
        out
    }

    /// Every counted host of a tenant, by address.
    pub fn hosts(&self, tenant: u32) -> Vec<(IpAddr, Counters)> {
        let all = self.all_hosts().into_iter();
        all.filter(|(t, _, _)| *t == tenant)
            .map(|(_, a, c)| (a, c))
            .collect()
    }

    /// Traffic of hosts beyond `max_hosts`.
    pub fn overflow(&self) -> Counters {
        self.state
            .counter(HOSTS, &None::<(u32, IpAddr)>)
            .map(|v| lanes(&v))
            .unwrap_or_default()
    }
}

impl NetworkFunction for Monitor {
    fn kind(&self) -> &str {
        "monitor"
    }

    fn tables(&self) -> Vec<TableSpec> {
        Self::specs()
    }

    nf::platform_state!(self.state);

    /// A flow, not a packet: the first packet also runs through the flow's counted rule
    /// at PP once the rule is installed, and arrives with PP's counters.
    fn first_packet(&mut self, pkt: &FirstPacket, _env: &mut NfEnv) -> Result<Decision, NfError> {
        self.count(pkt.tenant, pkt.key.src(), 0, 0, 1);
        Ok(Decision::pass())
    }

    /// Its packets and bytes are PP's counters of the flows' rules.
    fn counts_traffic(&self) -> bool {
        true
    }

    fn on_event(&mut self, ev: &FlowEvent, _env: &mut NfEnv) {
        if let FlowEvent::Counters {
            key,
            tenant,
            packets,
            bytes,
        } = ev
        {
            if *packets != 0 || *bytes != 0 {
                self.record(*tenant, key.src(), *packets, *bytes);
            }
        }
    }

    fn traffic(&self) -> Option<TrafficReport> {
        Some(TrafficReport {
            tenants: (self.tenants().into_iter())
                .map(|(t, c)| (t, c.traffic()))
                .collect(),
            hosts: (self.all_hosts().into_iter())
                .map(|(t, a, c)| (t, a, c.traffic()))
                .collect(),
            overflow: self.overflow().traffic(),
        })
    }
}
