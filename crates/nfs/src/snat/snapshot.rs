//! The SNAT's own snapshot form, from before its state moved to platform tables: still
//! written as JSON for people and tools (`Snat::snapshot_json`), and still taken by
//! `restore` and `merge` (JSON, or the binary form older builds wrote), checked and
//! loaded into the tables. The platform's own form (`SFT2`) is what `snapshot` writes.

use std::net::IpAddr;

use ::nf::{NfError, Rewrite};
use pipeline::FlowKey;
use serde::{Deserialize, Serialize};

use super::config::Plan;
use super::table::{
    ExternalEndpoint, FlowEntry, FlowRow, FlowState, MappingKey, SnatStats, State, FLOWS,
    FULL_WEIGHT, MAPPINGS, PAIRINGS, PORTS, STATS,
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

/// A platform-table snapshot, as opposed to this module's own form.
pub(super) fn is_platform(b: &[u8]) -> bool {
    b.starts_with(b"SFT")
}

impl State {
    /// The state in this module's form, sorted, so replicas holding the same state
    /// produce the same bytes.
    pub(super) fn to_snapshot(&self) -> Snapshot {
        let pools: Vec<((IpAddr, u8), &::nf::pool::UnitSet)> =
            self.tables.pools(PORTS).unwrap_or_default();
        let mut port_pool: Vec<FreePorts> = (pools.into_iter())
            .filter(|(_, s)| s.free() > 0)
            .map(|((addr, proto), s)| FreePorts {
                addr,
                proto,
                free: s.ranges(),
            })
            .collect();
        port_pool.sort_by_key(|f| (f.addr, f.proto));
        let rows: Vec<(ExternalEndpoint, MappingKey)> =
            self.tables.rows(MAPPINGS).unwrap_or_default();
        let mappings = (rows.into_iter())
            .map(|(external, key)| MappingSnap {
                external,
                key,
                weight: (self.tables.share(MAPPINGS, &external).ok().flatten())
                    .unwrap_or(FULL_WEIGHT),
            })
            .collect();
        let pairs: Vec<((u32, IpAddr), IpAddr)> = self.tables.rows(PAIRINGS).unwrap_or_default();
        let pairings = (pairs.into_iter())
            .map(|((vni, internal), external)| PairingSnap {
                vni,
                internal,
                external,
            })
            .collect();
        let rows: Vec<(FlowKey, FlowRow)> = self.tables.flows(FLOWS).unwrap_or_default();
        let flows = (rows.into_iter())
            .map(|(k, r)| (k, r.entry(&k, 0)))
            .map(|(k, f)| FlowSnap {
                deadline_ms: self
                    .tables
                    .timer(FLOWS, &k)
                    .ok()
                    .flatten()
                    .unwrap_or(u64::MAX),
                key: SnapKey(k),
                own: f.own,
                peer: f.peer,
                forward: f.forward,
                reverse: f.reverse,
                state: f.state,
            })
            .collect();
        Snapshot {
            version: SNAPSHOT_VERSION,
            port_pool,
            mappings,
            pairings,
            flows,
            stats: self.totals(),
        }
    }

    /// Build and check a state from this module's form: every port is free or mapped,
    /// never both, and everything lies inside this NF's configured pools.
    pub(super) fn decode_own(plan: &Plan, bytes: &[u8]) -> Result<State, NfError> {
        let s: Snapshot = crate::codec::decode(bytes).map_err(snap_err)?;
        if s.version != SNAPSHOT_VERSION {
            return Err(snap_err(format!(
                "snapshot version {} (expected {SNAPSHOT_VERSION})",
                s.version
            )));
        }
        let mut st = State::new(plan, false)?;
        let t = |e: ::nf::StateError| snap_err(e.to_string());
        for fp in &s.port_pool {
            let key = (fp.addr, fp.proto);
            let range = (st.tables.pool(PORTS, &key).map_err(t)?)
                .map(|p| p.range())
                .ok_or_else(|| {
                    snap_err(format!(
                        "free ports for {} proto {}, which is not in the pool",
                        fp.addr, fp.proto
                    ))
                })?;
            for &[lo, hi] in &fp.free {
                if lo > hi || lo < range.0 || hi > range.1 {
                    return Err(snap_err(format!(
                        "free range {lo}..={hi} of {} is outside {}..={}",
                        fp.addr, range.0, range.1
                    )));
                }
                for p in lo..=hi {
                    if !st.tables.pool_put(PORTS, &key, p).map_err(t)? {
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
            let Some(set) = st.tables.pool(PORTS, &(e.addr, e.proto)).map_err(t)? else {
                return Err(snap_err(format!(
                    "mapping on {e:?}, which is not in the pool"
                )));
            };
            if !set.contains(e.port) {
                return Err(snap_err(format!("mapping on {e:?} outside the port range")));
            }
            if set.is_free(e.port) {
                return Err(snap_err(format!("port of {e:?} is both free and mapped")));
            }
            if m.weight > FULL_WEIGHT || m.weight == 0 {
                return Err(snap_err(format!("mapping {e:?} weighs more than a whole")));
            }
            if st.tables.share(MAPPINGS, &e).map_err(t)?.is_some() {
                return Err(snap_err(format!("two mappings on {e:?}")));
            }
            st.tables
                .put_share(MAPPINGS, &e, &m.key, m.weight)
                .map_err(t)?;
        }
        for f in &s.flows {
            let key = f.key.0;
            for e in std::iter::once(&f.own).chain(f.peer.iter()) {
                if st.tables.share(MAPPINGS, e).map_err(t)?.is_none() {
                    return Err(snap_err(format!("flow {key} uses missing mapping {e:?}")));
                }
            }
            if st.tables.timer(FLOWS, &key).map_err(t)?.is_some() {
                return Err(snap_err(format!("flow {key} listed twice")));
            }
            let entry = FlowEntry {
                own: f.own,
                peer: f.peer,
                forward: f.forward,
                reverse: f.reverse,
                state: f.state,
                deadline_ms: f.deadline_ms,
            };
            // The row keeps what the rewrites are made from; a snapshot whose rewrites
            // say otherwise was not written by this NF.
            let row = FlowRow::of(&entry);
            if row.entry(&key, f.deadline_ms) != entry {
                return Err(snap_err(format!(
                    "flow {key}: its rewrites do not follow from its mappings"
                )));
            }
            (st.tables)
                .put_flow_timed(FLOWS, &key, &row, f.deadline_ms)
                .map_err(t)?;
        }
        for p in &s.pairings {
            if !plan.is_pool_addr(p.external) {
                return Err(snap_err(format!(
                    "{} paired with {}, which is not a pool address",
                    p.internal, p.external
                )));
            }
            (st.tables)
                .put(PAIRINGS, &(p.vni, p.internal), &p.external)
                .map_err(t)?;
        }
        st.tables.add(STATS, &(), &s.stats.lanes()).map_err(t)?;
        // Indexes, counts; a whole mapping without flows is freed (it should have been).
        st.reindex();
        Ok(st)
    }
}
