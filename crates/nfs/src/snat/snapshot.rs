//! Snapshots of a partition's state: the serialized form and its checked decoding.

use std::net::IpAddr;

use ::nf::{NfError, Rewrite};
use pipeline::FlowKey;
use serde::{Deserialize, Serialize};

use super::config::Plan;
use super::table::{
    ExternalEndpoint, FlowEntry, FlowState, Mapping, MappingKey, Pairing, SnatStats, State,
    FULL_WEIGHT,
};

const SNAPSHOT_VERSION: u32 = 1;

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Snapshot {
    version: u32,
    port_pool: Vec<FreePorts>,
    mappings: Vec<MappingSnap>,
    pairings: Vec<PairingSnap>,
    flows: Vec<FlowSnap>,
    stats: SnatStats,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FreePorts {
    addr: IpAddr,
    proto: u8,
    /// Inclusive ranges.
    free: Vec<[u16; 2]>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct MappingSnap {
    external: ExternalEndpoint,
    key: MappingKey,
    weight: u64,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PairingSnap {
    vni: u32,
    internal: IpAddr,
    external: IpAddr,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FlowSnap {
    /// `FlowKey`'s text form in JSON, its bytes in the binary form.
    key: SnapKey,
    own: ExternalEndpoint,
    peer: Option<ExternalEndpoint>,
    forward: Rewrite,
    reverse: Rewrite,
    state: FlowState,
    deadline_ms: u64,
}

/// A flow key in a snapshot: text in JSON (as older builds wrote it), bytes in binary.
#[derive(Debug)]
struct SnapKey(FlowKey);

impl Serialize for SnapKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            s.collect_str(&self.0)
        } else {
            crate::codec::serialize_key_bytes(&self.0, s)
        }
    }
}

impl<'de> Deserialize<'de> for SnapKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let t = String::deserialize(d)?;
            t.parse()
                .map(SnapKey)
                .map_err(|e| serde::de::Error::custom(format!("flow key {t:?}: {e}")))
        } else {
            crate::codec::deserialize_key_bytes(d).map(SnapKey)
        }
    }
}

pub(super) fn snap_err(m: String) -> NfError {
    NfError::Snapshot(format!("snat: {m}"))
}

impl State {
    /// Sorted, so replicas holding the same state produce the same bytes.
    pub(super) fn to_snapshot(&self) -> Snapshot {
        let mut port_pool: Vec<FreePorts> = self
            .ports
            .sets
            .iter()
            .filter(|(_, s)| s.free > 0)
            .map(|(&(addr, proto), s)| FreePorts {
                addr,
                proto,
                free: s.ranges(),
            })
            .collect();
        port_pool.sort_by_key(|f| (f.addr, f.proto));
        let mut mappings: Vec<MappingSnap> = self
            .mappings
            .iter()
            .map(|(e, m)| MappingSnap {
                external: *e,
                key: m.key,
                weight: m.weight,
            })
            .collect();
        mappings.sort_by_key(|m| m.external);
        let mut pairings: Vec<PairingSnap> = self
            .pairings
            .iter()
            .map(|(&(vni, internal), p)| PairingSnap {
                vni,
                internal,
                external: p.external,
            })
            .collect();
        pairings.sort_by_key(|p| (p.vni, p.internal));
        let mut flows: Vec<(&FlowKey, &FlowEntry)> = self.flows.iter().collect();
        flows.sort_by_key(|(k, _)| *k.as_bytes());
        let flows = flows
            .into_iter()
            .map(|(k, f)| FlowSnap {
                key: SnapKey(*k),
                own: f.own,
                peer: f.peer,
                forward: f.forward,
                reverse: f.reverse,
                state: f.state,
                deadline_ms: f.deadline_ms,
            })
            .collect();
        Snapshot {
            version: SNAPSHOT_VERSION,
            port_pool,
            mappings,
            pairings,
            flows,
            stats: self.stats,
        }
    }

    pub(super) fn encode(&self) -> Result<Vec<u8>, NfError> {
        crate::codec::encode(&self.to_snapshot()).map_err(snap_err)
    }

    /// Build and check a state from a snapshot: every port is free or mapped, never both,
    /// and everything lies inside this NF's configured pools.
    pub(super) fn decode(plan: &Plan, bytes: &[u8]) -> Result<State, NfError> {
        let s: Snapshot = crate::codec::decode(bytes).map_err(snap_err)?;
        if s.version != SNAPSHOT_VERSION {
            return Err(snap_err(format!(
                "snapshot version {} (expected {SNAPSHOT_VERSION})",
                s.version
            )));
        }
        let mut st = State::new(plan.empty_pool());
        for fp in &s.port_pool {
            let set = st.ports.sets.get_mut(&(fp.addr, fp.proto)).ok_or_else(|| {
                snap_err(format!(
                    "free ports for {} proto {}, which is not in the pool",
                    fp.addr, fp.proto
                ))
            })?;
            for &[lo, hi] in &fp.free {
                if lo > hi || lo < set.lo || hi > set.hi {
                    return Err(snap_err(format!(
                        "free range {lo}..={hi} of {} is outside {}..={}",
                        fp.addr, set.lo, set.hi
                    )));
                }
                for p in lo..=hi {
                    if !set.put(p) {
                        return Err(snap_err(format!(
                            "port {p} of {} listed free twice",
                            fp.addr
                        )));
                    }
                }
            }
        }
        for m in &s.mappings {
            let e = m.external;
            let Some(set) = st.ports.sets.get(&(e.addr, e.proto)) else {
                return Err(snap_err(format!(
                    "mapping on {e:?}, which is not in the pool"
                )));
            };
            if set.index(e.port).is_none() {
                return Err(snap_err(format!("mapping on {e:?} outside the port range")));
            }
            if set.is_free(e.port) {
                return Err(snap_err(format!("port of {e:?} is both free and mapped")));
            }
            if m.weight > FULL_WEIGHT {
                return Err(snap_err(format!("mapping {e:?} weighs more than a whole")));
            }
            let prev = st.mappings.insert(
                e,
                Mapping {
                    key: m.key,
                    flows: 0,
                    weight: m.weight,
                },
            );
            if prev.is_some() {
                return Err(snap_err(format!("two mappings on {e:?}")));
            }
        }
        for f in &s.flows {
            let key = f.key.0;
            for e in std::iter::once(&f.own).chain(f.peer.iter()) {
                if !st.mappings.contains_key(e) {
                    return Err(snap_err(format!("flow {key} uses missing mapping {e:?}")));
                }
            }
            if st.flows.contains_key(&key) {
                return Err(snap_err(format!("flow {key} listed twice")));
            }
            st.insert_flow(
                key,
                FlowEntry {
                    own: f.own,
                    peer: f.peer,
                    forward: f.forward,
                    reverse: f.reverse,
                    state: f.state,
                    deadline_ms: f.deadline_ms,
                },
            );
        }
        for p in &s.pairings {
            if !plan.is_pool_addr(p.external) {
                return Err(snap_err(format!(
                    "{} paired with {}, which is not a pool address",
                    p.internal, p.external
                )));
            }
            st.pairings.insert(
                (p.vni, p.internal),
                Pairing {
                    external: p.external,
                    mappings: 0,
                },
            );
        }
        st.recount_pairings();
        st.reindex_internal();
        st.stats = s.stats;
        // A whole mapping without flows should have been freed; finish the job.
        let idle: Vec<ExternalEndpoint> = st
            .mappings
            .iter()
            .filter(|(_, m)| m.flows == 0 && m.weight >= FULL_WEIGHT)
            .map(|(e, _)| *e)
            .collect();
        for e in idle {
            st.free_mapping(&e);
        }
        Ok(st)
    }
}
