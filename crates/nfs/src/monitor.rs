//! Traffic monitor: packet and byte counters per tenant and per source host.
//!
//! The counters are Serpens' textbook multi-writer state (Table III, "host statistics"):
//! every partition counts on its own, so the tables are shared-write with *replicated*
//! consistency. A split hands the new part zeroed counters, a merge adds, and the true
//! total is the sum over parts (eventual consistency). Addition commutes, so replicas and
//! parts agree whatever order counts arrive in.
//!
//! SC sees only a flow's first packet: there the monitor counts a *flow*. Packets and
//! bytes are counted by PP on the flow's rules (`Action::Count`, every packet the rule
//! matches, the held first packet included) and reported back as deltas
//! ([`FlowEvent::Counters`], docs/metrics.md "Monitor counters"), which SC applies as an
//! op of the group's log, so every replica adds the same deltas. The host is the rule
//! key's source: the client for the forward rule, the server for the reply rule.

use std::collections::BTreeMap;
use std::net::IpAddr;

use nf::{
    Consistency, Decision, FirstPacket, FlowEvent, NetworkFunction, NfEnv, NfError, SplitHalf,
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
    fn add(&mut self, packets: u64, bytes: u64, flows: u64) {
        self.packets = self.packets.saturating_add(packets);
        self.bytes = self.bytes.saturating_add(bytes);
        self.flows = self.flows.saturating_add(flows);
    }

    fn add_all(&mut self, o: &Counters) {
        self.add(o.packets, o.bytes, o.flows);
    }

    fn traffic(&self) -> TrafficCount {
        TrafficCount {
            packets: self.packets,
            bytes: self.bytes,
            flows: self.flows,
        }
    }
}

/// All counters of one part. Ordered maps, so snapshots are byte-identical across
/// replicas that counted the same things.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Counts {
    tenants: BTreeMap<u32, Counters>,
    hosts: BTreeMap<u32, BTreeMap<IpAddr, Counters>>,
    overflow: Counters,
}

pub struct Monitor {
    cfg: MonitorConfig,
    counts: Counts,
    hosts: usize,
}

impl Monitor {
    pub fn new(cfg: MonitorConfig) -> Result<Self, NfError> {
        if cfg.max_hosts == 0 {
            return Err(NfError::Config(
                "monitor: max_hosts must be at least 1".into(),
            ));
        }
        Ok(Monitor {
            cfg,
            counts: Counts::default(),
            hosts: 0,
        })
    }

    /// Add packets and bytes reported later (PP's rule counters, as
    /// [`FlowEvent::Counters`], or another replica's tally).
    pub fn record(&mut self, tenant: u32, host: IpAddr, packets: u64, bytes: u64) {
        self.count(tenant, host, packets, bytes, 0);
    }

    fn count(&mut self, tenant: u32, host: IpAddr, packets: u64, bytes: u64, flows: u64) {
        self.counts
            .tenants
            .entry(tenant)
            .or_default()
            .add(packets, bytes, flows);
        let per_tenant = self.counts.hosts.entry(tenant).or_default();
        if let Some(c) = per_tenant.get_mut(&host) {
            c.add(packets, bytes, flows);
        } else if self.hosts < self.cfg.max_hosts {
            let mut c = Counters::default();
            c.add(packets, bytes, flows);
            per_tenant.insert(host, c);
            self.hosts += 1;
        } else {
            self.counts.overflow.add(packets, bytes, flows);
        }
        if per_tenant.is_empty() {
            self.counts.hosts.remove(&tenant);
        }
    }

    pub fn tenant(&self, tenant: u32) -> Counters {
        self.counts
            .tenants
            .get(&tenant)
            .copied()
            .unwrap_or_default()
    }

    pub fn host(&self, tenant: u32, host: IpAddr) -> Counters {
        self.counts
            .hosts
            .get(&tenant)
            .and_then(|h| h.get(&host))
            .copied()
            .unwrap_or_default()
    }

    /// Every tenant's counters, by tenant id.
    pub fn tenants(&self) -> Vec<(u32, Counters)> {
        self.counts.tenants.iter().map(|(t, c)| (*t, *c)).collect()
    }

    /// Every counted host of a tenant, by address.
    pub fn hosts(&self, tenant: u32) -> Vec<(IpAddr, Counters)> {
        self.counts
            .hosts
            .get(&tenant)
            .map(|h| h.iter().map(|(a, c)| (*a, *c)).collect())
            .unwrap_or_default()
    }

    /// Traffic of hosts beyond `max_hosts`.
    pub fn overflow(&self) -> Counters {
        self.counts.overflow
    }

    fn encode(c: &Counts) -> Result<Vec<u8>, NfError> {
        serde_json::to_vec(c).map_err(|e| NfError::Snapshot(format!("monitor: {e}")))
    }

    fn decode(b: &[u8]) -> Result<Counts, NfError> {
        serde_json::from_slice(b).map_err(|e| NfError::Snapshot(format!("monitor: {e}")))
    }

    fn count_hosts(c: &Counts) -> usize {
        c.hosts.values().map(BTreeMap::len).sum()
    }
}

impl NetworkFunction for Monitor {
    fn kind(&self) -> &str {
        "monitor"
    }

    fn tables(&self) -> Vec<TableSpec> {
        vec![
            TableSpec::shared_write("tenant-counters", Consistency::Replicated),
            TableSpec::shared_write("host-counters", Consistency::Replicated),
        ]
    }

    /// A flow, not a packet: the first packet also runs through the flow's counted rule
    /// at PP once the rule is installed, and arrives with PP's counters.
    fn first_packet(&mut self, pkt: &FirstPacket, _env: &mut NfEnv) -> Result<Decision, NfError> {
        self.count(pkt.tenant, pkt.key.src(), 0, 0, 1);
        Ok(Decision::pass())
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
            tenants: self
                .counts
                .tenants
                .iter()
                .map(|(t, c)| (*t, c.traffic()))
                .collect(),
            hosts: self
                .counts
                .hosts
                .iter()
                .flat_map(|(t, h)| h.iter().map(move |(a, c)| (*t, *a, c.traffic())))
                .collect(),
            overflow: self.counts.overflow.traffic(),
        })
    }

    fn snapshot(&self) -> Result<Vec<u8>, NfError> {
        Self::encode(&self.counts)
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), NfError> {
        let c = Self::decode(snapshot)?;
        self.hosts = Self::count_hosts(&c);
        self.counts = c;
        Ok(())
    }

    /// This part keeps its counts; the new part starts from zero and counts on its own.
    fn split(&mut self, _half: &SplitHalf) -> Result<Vec<u8>, NfError> {
        Self::encode(&Counts::default())
    }

    /// Sum, host by host; hosts beyond `max_hosts` fold into the overflow counters.
    fn merge(&mut self, part: &[u8]) -> Result<(), NfError> {
        let other = Self::decode(part)?;
        // Tenant totals already include their hosts' traffic, so hosts are added without
        // touching the totals again.
        for (t, c) in &other.tenants {
            self.counts.tenants.entry(*t).or_default().add_all(c);
        }
        for (t, hosts) in other.hosts {
            let mine = self.counts.hosts.entry(t).or_default();
            for (h, c) in hosts {
                if let Some(m) = mine.get_mut(&h) {
                    m.add_all(&c);
                } else if self.hosts < self.cfg.max_hosts {
                    mine.insert(h, c);
                    self.hosts += 1;
                } else {
                    self.counts.overflow.add_all(&c);
                }
            }
            if mine.is_empty() {
                self.counts.hosts.remove(&t);
            }
        }
        self.counts.overflow.add_all(&other.overflow);
        Ok(())
    }

    /// Counters only: no decision depends on per-flow state.
    fn flow_hashes(&self) -> Option<Vec<u64>> {
        Some(Vec::new())
    }
}
