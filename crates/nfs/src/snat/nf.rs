//! The SNAT NF itself: deciding first packets, flow events, split and merge.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use ::nf::{
    Consistency, Decision, DetRng, Endpoint, FirstPacket, FlowEvent, MergeDecoder, NetworkFunction,
    NfEnv, NfError, PreparedPart, Rewrite, SplitHalf, TableSpec,
};
use hashbrown::HashMap;
use packet::proto;
use packet::tcp_flags::{ACK, FIN, RST, SYN};
use pipeline::FlowKey;
use tracing::debug;

use super::config::{MappingBehaviour, Plan, SnatConfig};
use super::reason;
use super::snapshot::snap_err;
use super::table::{
    reply_key, timer_entry, ExternalEndpoint, FlowEntry, FlowState, Mapping, MappingInfo,
    MappingKey, Pairing, SnatPart, SnatStats, State, FULL_WEIGHT,
};

/// Source NAT. See the module docs and `docs/nf-api.md`.
#[derive(Debug, Clone)]
pub struct Snat {
    pub(super) cfg: SnatConfig,
    pub(super) plan: Plan,
    pub(super) state: State,
}

impl Snat {
    /// A NAT owning its whole pool: the first (or only) partition. A partition created by
    /// scale-out must instead `restore` the part its parent split off.
    pub fn new(cfg: SnatConfig) -> Result<Self, NfError> {
        let plan = Plan::new(&cfg)?;
        let state = State::new(plan.full_pool());
        Ok(Snat { cfg, plan, state })
    }

    pub fn config(&self) -> &SnatConfig {
        &self.cfg
    }

    pub fn stats(&self) -> SnatStats {
        self.state.stats
    }

    pub fn flow_count(&self) -> usize {
        self.state.flows.len()
    }

    /// Every mapping, sorted by external endpoint.
    pub fn mappings(&self) -> Vec<MappingInfo> {
        let mut v: Vec<MappingInfo> = self
            .state
            .mappings
            .iter()
            .map(|(e, m)| MappingInfo {
                key: m.key,
                external: *e,
                flows: m.flows,
                sole_owner: m.weight >= FULL_WEIGHT,
            })
            .collect();
        v.sort_by_key(|m| m.external);
        v
    }

    /// The free ports of one pool address and protocol, ascending.
    /// The snapshot in its JSON form, for people and tools (`restore` and `merge` read
    /// it too; `snapshot` writes the compact binary form).
    pub fn snapshot_json(&self) -> Result<Vec<u8>, NfError> {
        serde_json::to_vec(&self.state.to_snapshot()).map_err(|e| snap_err(e.to_string()))
    }

    pub fn free_ports(&self, addr: IpAddr, proto: u8) -> Vec<u16> {
        self.state
            .ports
            .sets
            .get(&(addr, proto))
            .map(|s| s.free_ports().collect())
            .unwrap_or_default()
    }

    /// When the NF forgets a flow (ms on the group clock) if nothing refreshes it; the key
    /// may be either direction's.
    pub fn flow_deadline(&self, key: &FlowKey) -> Option<u64> {
        let fk = self.state.resolve(key)?;
        self.state.flows.get(&fk).map(|f| f.deadline_ms)
    }

    pub fn free_port_count(&self, addr: IpAddr, proto: u8) -> usize {
        self.state.ports.free_count(addr, proto) as usize
    }

    pub(super) fn deadline(&self, now_ms: u64, s: FlowState) -> u64 {
        now_ms.saturating_add(self.plan.timeout_ms(s))
    }

    /// The state a new flow starts in, or why it is refused.
    pub(super) fn new_flow_state(key: &FlowKey, tcp_flags: u8) -> Result<FlowState, &'static str> {
        let icmp = if key.is_v4() {
            proto::ICMP
        } else {
            proto::ICMPV6
        };
        match key.proto() {
            proto::TCP => {
                let syn = tcp_flags & SYN != 0;
                let ack = tcp_flags & ACK != 0;
                if tcp_flags & (RST | FIN) != 0 || (syn && ack) {
                    // What conntrack calls INVALID: the connection is ending, or it
                    // opened from outside; nothing should get a mapping for it.
                    Err(reason::TCP_INVALID)
                } else if syn {
                    // The handshake has only begun: transitory until PP reports it done.
                    Ok(FlowState::TcpSynSent)
                } else {
                    // A mid-stream packet of a connection whose state was lost
                    // (conntrack's loose pickup): it got through its handshake.
                    Ok(FlowState::TcpOpen)
                }
            }
            proto::UDP => Ok(FlowState::Udp),
            p if p == icmp => {
                if key.sport() == 0 && key.dport() != 0 {
                    Err(reason::ICMP_NOT_REQUEST)
                } else {
                    Ok(FlowState::Icmp)
                }
            }
            _ => Err(reason::UNSUPPORTED_PROTOCOL),
        }
    }

    pub(super) fn refuse(&mut self, why: &'static str) -> Decision {
        let s = &mut self.state.stats;
        match why {
            reason::TCP_INVALID | reason::ICMP_NOT_REQUEST => s.invalid += 1,
            reason::UNSUPPORTED_PROTOCOL => s.unsupported_protocol += 1,
            reason::EXHAUSTED => s.exhausted += 1,
            reason::ICMP_ERROR_UNKNOWN_FLOW => s.icmp_error_unknown += 1,
            _ => s.refused_inbound += 1,
        }
        Decision::drop(why)
    }

    pub(super) fn flow_decision(&self, f: &FlowEntry, reply: bool) -> Decision {
        let (forward, reverse) = if reply {
            (f.reverse, f.forward)
        } else {
            (f.forward, f.reverse)
        };
        Decision {
            forward,
            reverse,
            idle_timeout: Some(Duration::from_millis(self.plan.rule_timeout_ms(f.state))),
            ..Decision::pass()
        }
    }

    /// A request for a flow already decided, in either direction: PP (and FM's cache) lost
    /// the rule, or an ICMP error arrived about it. Answer with the same translation.
    pub(super) fn replay(&mut self, pkt: &FirstPacket, now_ms: u64) -> Option<Decision> {
        let fk = self.state.resolve(&pkt.key)?;
        let reply = fk != pkt.key;
        let f = self.state.flows.get(&fk)?;
        let mut state = f.state;
        // A fresh SYN on a closing connection reopens it (TIME_WAIT reuse), as conntrack does.
        let flags = pkt.meta.tcp_flags;
        if !reply && state == FlowState::TcpClosing && flags & SYN != 0 && flags & ACK == 0 {
            state = FlowState::TcpSynSent;
        }
        // A re-request without SYN on a half-open flow: the handshake got through.
        if state == FlowState::TcpSynSent
            && pkt.key.proto() == proto::TCP
            && flags & (SYN | FIN | RST) == 0
            && flags & ACK != 0
        {
            state = FlowState::TcpOpen;
        }
        self.state.stats.replayed += 1;
        // An ICMP error neither refreshes nor ends the flow (RFC 5508 REQ-6, RFC 4787 REQ-12).
        if !pkt.meta.icmp_error {
            let d = self.deadline(now_ms, state);
            if let Some(f) = self.state.flows.get_mut(&fk) {
                f.state = state;
            }
            self.state.set_deadline(&fk, d);
        }
        let f = self.state.flows.get(&fk)?;
        Some(self.flow_decision(f, reply))
    }

    pub(super) fn mapping_key(&self, pool: usize, key: &FlowKey) -> MappingKey {
        let dependent = self
            .plan
            .pools
            .get(pool)
            .is_some_and(|p| p.mapping == MappingBehaviour::EndpointDependent);
        MappingKey {
            vni: key.vni(),
            proto: key.proto(),
            addr: key.src(),
            port: key.sport(),
            remote: dependent.then(|| (key.dst(), key.dport())),
        }
    }

    /// The mapping of `mk`, made if needed: on the paired address while it has ports
    /// (REQ-2), else on the address with most free ports.
    pub(super) fn mapping_for(
        &mut self,
        pool: usize,
        mk: MappingKey,
        rng: &mut DetRng,
    ) -> Option<ExternalEndpoint> {
        if let Some(e) = self.state.by_internal.get(&mk) {
            self.state.stats.mappings_reused += 1;
            return Some(*e);
        }
        let p = self.plan.pools.get(pool)?;
        let ports = &self.state.ports;
        let paired = self
            .state
            .pairings
            .get(&(mk.vni, mk.addr))
            .map(|p| p.external);
        let addr = match paired {
            Some(a) if p.addrs.contains(&a) && ports.free_count(a, mk.proto) > 0 => a,
            _ => {
                let mut best: Option<(IpAddr, u32)> = None;
                for &a in &p.addrs {
                    let n = ports.free_count(a, mk.proto);
                    if n > 0 && best.is_none_or(|(_, b)| n > b) {
                        best = Some((a, n));
                    }
                }
                let (a, _) = best?;
                if paired.is_some() {
                    self.state.stats.pairing_fallbacks += 1;
                }
                a
            }
        };
        let st = &mut self.state;
        let set = st.ports.sets.get_mut(&(addr, mk.proto))?;
        let port = set.alloc(mk.port, rng, &mut st.stats)?;
        let ext = ExternalEndpoint {
            addr,
            port,
            proto: mk.proto,
        };
        st.mappings.insert(
            ext,
            Mapping {
                key: mk,
                flows: 0,
                weight: FULL_WEIGHT,
            },
        );
        st.by_internal.insert(mk, ext);
        st.pairings
            .entry((mk.vni, mk.addr))
            .or_insert(Pairing {
                external: addr,
                mappings: 0,
            })
            .mappings += 1;
        st.stats.mappings_created += 1;
        Some(ext)
    }

    pub(super) fn new_flow(&mut self, key: FlowKey, f: FlowEntry) -> Decision {
        let d = self.flow_decision(&f, false);
        self.state.insert_flow(key, f);
        self.state.stats.flows_created += 1;
        d
    }

    pub(super) fn outbound(&mut self, pkt: &FirstPacket, pool: usize, env: &mut NfEnv) -> Decision {
        let key = pkt.key;
        let state = match Self::new_flow_state(&key, pkt.meta.tcp_flags) {
            Ok(s) => s,
            Err(why) => return self.refuse(why),
        };
        let mk = self.mapping_key(pool, &key);
        let Some(own) = self.mapping_for(pool, mk, &mut env.rng) else {
            debug!(%key, "snat: pool exhausted");
            return self.refuse(reason::EXHAUSTED);
        };
        let f = FlowEntry {
            own,
            peer: None,
            forward: Rewrite::src(own.addr, own.port),
            reverse: Rewrite::dst(key.src(), key.sport()),
            state,
            deadline_ms: self.deadline(env.now_ms, state),
        };
        self.new_flow(key, f)
    }

    /// RFC 4787 REQ-9: an inside host reaching another inside host by its mapping. The
    /// destination becomes that host; the source becomes the sender's own mapping, so the
    /// receiver sees what the outside would see and replies through the NAT.
    pub(super) fn hairpin(&mut self, pkt: &FirstPacket, env: &mut NfEnv) -> Decision {
        let key = pkt.key;
        let target = ExternalEndpoint {
            addr: key.dst(),
            port: key.dport(),
            proto: key.proto(),
        };
        let Some(peer) = self.state.mappings.get(&target).map(|m| m.key) else {
            return self.refuse(reason::NO_MAPPING);
        };
        let Some(pool) = self.plan.pool_for(key.src()) else {
            return self.refuse(reason::NO_MAPPING);
        };
        let state = match Self::new_flow_state(&key, pkt.meta.tcp_flags) {
            Ok(s) => s,
            Err(why) => return self.refuse(why),
        };
        let mk = self.mapping_key(pool, &key);
        let Some(own) = self.mapping_for(pool, mk, &mut env.rng) else {
            return self.refuse(reason::EXHAUSTED);
        };
        let f = FlowEntry {
            own,
            peer: Some(target),
            forward: Rewrite {
                src: Endpoint::new(own.addr, own.port),
                dst: Endpoint::new(peer.addr, peer.port),
            },
            reverse: Rewrite {
                src: Endpoint::new(target.addr, target.port),
                dst: Endpoint::new(key.src(), key.sport()),
            },
            state,
            deadline_ms: self.deadline(env.now_ms, state),
        };
        self.state.stats.hairpinned += 1;
        self.new_flow(key, f)
    }

    pub(super) fn decide(&mut self, pkt: &FirstPacket, env: &mut NfEnv) -> Decision {
        if let Some(d) = self.replay(pkt, env.now_ms) {
            return d;
        }
        if pkt.meta.icmp_error {
            return self.refuse(reason::ICMP_ERROR_UNKNOWN_FLOW);
        }
        let (src, dst) = (pkt.key.src(), pkt.key.dst());
        if self.plan.is_pool_addr(dst) {
            if self.plan.is_inside(src) {
                return self.hairpin(pkt, env);
            }
            // Inbound unsolicited: only replies (which PP's reverse rule carries, or
            // `replay` answers) may enter. That is address-and-port-dependent filtering
            // (RFC 4787 §5), stricter than REQ-8's recommendations; it is what PP's
            // exact-match reverse rule gives, as in conntrack and VPP NAT44-ED.
            let target = ExternalEndpoint {
                addr: dst,
                port: pkt.key.dport(),
                proto: pkt.key.proto(),
            };
            return if self.state.mappings.contains_key(&target) {
                self.refuse(reason::FILTERED)
            } else {
                self.refuse(reason::NO_MAPPING)
            };
        }
        let pool = match self.plan.pool_for(src) {
            Some(p) if !self.plan.is_pool_addr(src) => p,
            _ => {
                self.state.stats.untranslated += 1;
                return Decision::pass();
            }
        };
        self.outbound(pkt, pool, env)
    }

    /// Flows whose key `half` moves go, with the mappings they use; with `pools`, half
    /// the free ports of every (address, protocol) too.
    fn split_part(&mut self, half: &SplitHalf, pools: bool) -> Result<Vec<u8>, NfError> {
        let st = &mut self.state;
        let mut moving: Vec<FlowKey> = st.flows.keys().filter(|k| half.moves(k)).copied().collect();
        moving.sort_by_key(|k| *k.as_bytes());
        let mut part = State::new(self.plan.empty_pool());
        let mut refs: HashMap<ExternalEndpoint, u32> = HashMap::new();
        let mut moved_flows = Vec::with_capacity(moving.len());
        for k in moving {
            let Some(f) = st.flows.remove(&k) else {
                continue;
            };
            st.timers.remove(&timer_entry(f.deadline_ms, &k));
            let rk = reply_key(&f.forward.apply(&k));
            if st.by_reply.get(&rk) == Some(&k) {
                st.by_reply.remove(&rk);
            }
            for e in std::iter::once(f.own).chain(f.peer) {
                *refs.entry(e).or_default() += 1;
            }
            moved_flows.push((k, f));
        }
        let mut exts: Vec<(ExternalEndpoint, u32)> = refs.into_iter().collect();
        exts.sort();
        for (e, r) in exts {
            let Some(m) = st.mappings.get_mut(&e) else {
                continue;
            };
            let copy = if m.flows > r {
                let give = m.weight / 2;
                m.weight -= give;
                m.flows -= r;
                Mapping {
                    key: m.key,
                    flows: 0,
                    weight: give,
                }
            } else {
                // Only moving flows use it: the whole mapping (and its port) goes.
                let Some(m) = st.mappings.remove(&e) else {
                    continue;
                };
                if st.by_internal.get(&m.key) == Some(&e) {
                    st.by_internal.remove(&m.key);
                }
                m
            };
            // Pairing preferences travel with the mappings of the address.
            if let Some(p) = st.pairings.get(&(copy.key.vni, copy.key.addr)) {
                part.pairings.insert(
                    (copy.key.vni, copy.key.addr),
                    Pairing {
                        external: p.external,
                        mappings: 0,
                    },
                );
            }
            part.mappings.insert(e, Mapping { flows: 0, ..copy });
        }
        for (k, f) in moved_flows {
            part.insert_flow(k, f);
        }
        if pools {
            for (k, set) in st.ports.sets.iter_mut() {
                part.ports.sets.insert(*k, set.split_upper_half());
            }
        }
        st.recount_pairings();
        part.recount_pairings();
        part.reindex_internal();
        part.encode()
    }
}

impl NetworkFunction for Snat {
    fn kind(&self) -> &str {
        "snat"
    }

    fn tables(&self) -> Vec<TableSpec> {
        let shared_mappings = self
            .plan
            .pools
            .iter()
            .any(|p| p.mapping == MappingBehaviour::EndpointIndependent);
        vec![
            TableSpec::shared_write("port-pool", Consistency::Partitioned),
            if shared_mappings {
                TableSpec::shared_write("mappings", Consistency::Partitioned)
            } else {
                TableSpec::per_flow("mappings")
            },
            TableSpec::shared_write("address-pairing", Consistency::Partitioned),
            TableSpec::per_flow("flows"),
        ]
    }

    fn first_packet(&mut self, pkt: &FirstPacket, env: &mut NfEnv) -> Result<Decision, NfError> {
        Ok(self.decide(pkt, env))
    }

    fn on_event(&mut self, ev: &FlowEvent, env: &mut NfEnv) {
        match ev {
            FlowEvent::Expired { key } => {
                if let Some(fk) = self.state.resolve(key) {
                    self.state.remove_flow(&fk);
                    self.state.stats.flows_ended += 1;
                }
            }
            FlowEvent::TcpClosing { key } => {
                let Some(fk) = self.state.resolve(key) else {
                    return;
                };
                let Some(f) = self.state.flows.get_mut(&fk) else {
                    return;
                };
                if matches!(
                    f.state,
                    FlowState::TcpOpen | FlowState::TcpClosing | FlowState::TcpSynSent
                ) {
                    f.state = FlowState::TcpClosing;
                    let d = self.deadline(env.now_ms, FlowState::TcpClosing);
                    self.state.set_deadline(&fk, d);
                }
            }
            FlowEvent::TcpEstablished { key } => {
                let Some(fk) = self.state.resolve(key) else {
                    return;
                };
                let Some(f) = self.state.flows.get_mut(&fk) else {
                    return;
                };
                // Only a half-open flow moves: a closing one stays closing (a late or
                // reordered report must not revive it).
                if f.state == FlowState::TcpSynSent {
                    f.state = FlowState::TcpOpen;
                    let d = self.deadline(env.now_ms, FlowState::TcpOpen);
                    self.state.set_deadline(&fk, d);
                }
            }
            FlowEvent::Active { key } => {
                let Some(fk) = self.state.resolve(key) else {
                    return;
                };
                let Some(state) = self.state.flows.get(&fk).map(|f| f.state) else {
                    return;
                };
                // RFC 4787 REQ-6 / RFC 5382 REQ-5: traffic refreshes the mapping, with the
                // timeout of the state the flow is in.
                let d = self.deadline(env.now_ms, state);
                self.state.set_deadline(&fk, d);
            }
            // Traffic counts are the monitor's; a mapping's life is its own timers'.
            FlowEvent::Counters { .. } => {}
        }
    }

    fn on_timer(&mut self, env: &mut NfEnv) -> Vec<FlowKey> {
        let mut out = Vec::new();
        while let Some(&(deadline, kb)) = self.state.timers.first() {
            if deadline > env.now_ms {
                break;
            }
            self.state.timers.pop_first();
            let k = FlowKey::from_bytes(kb);
            if self.state.remove_flow(&k).is_some() {
                self.state.stats.flows_expired += 1;
                out.push(k);
            }
        }
        out
    }

    fn snapshot(&self) -> Result<Vec<u8>, NfError> {
        self.state.encode()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), NfError> {
        self.state = State::decode(&self.plan, snapshot)?;
        Ok(())
    }

    /// Flows whose key `half` moves go, with the mappings they use. A mapping also used by
    /// flows that stay is copied and its weight halved; the free ports of every (address,
    /// protocol) are halved by count. The part's counters start at zero.
    fn split(&mut self, half: &SplitHalf) -> Result<Vec<u8>, NfError> {
        self.split_part(half, true)
    }

    /// Flows and their mappings only: the free ports stay here.
    fn split_flows(&mut self, half: &SplitHalf) -> Result<Vec<u8>, NfError> {
        self.split_part(half, false)
    }

    /// Union with another partition's state. Checked first, applied only if sound: a port
    /// owned by both sides, or one external endpoint mapped for two internal ones, is an
    /// error and changes nothing. A flow both sides hold keeps this side's decision.
    fn merge(&mut self, part: &[u8]) -> Result<(), NfError> {
        let other = SnatPart::decode(&self.plan, part)?;
        self.state.check_merge(&other)?;
        self.state.apply_merge(other);
        Ok(())
    }

    /// Decoding (the bulk of a merge: every flow, mapping and free port is read and
    /// checked) needs only the configuration, so it runs off the request stream.
    fn merge_decoder(&self) -> MergeDecoder {
        let plan = Arc::new(self.plan.clone());
        Arc::new(move |b: &[u8]| Ok(PreparedPart::new(SnatPart::decode(&plan, b)?)))
    }

    fn check_prepared(&self, part: &PreparedPart) -> Result<(), NfError> {
        let other = part
            .downcast_ref::<SnatPart>()
            .ok_or_else(|| snap_err("prepared part is not a SNAT part".to_string()))?;
        self.state.check_merge(other)
    }

    fn merge_prepared(&mut self, part: PreparedPart) -> Result<(), NfError> {
        let other: SnatPart = part.downcast()?;
        self.state.check_merge(&other)?;
        self.state.apply_merge(other);
        Ok(())
    }

    fn flow_hashes(&self) -> Option<Vec<u64>> {
        Some(self.state.flows.keys().map(FlowKey::hash).collect())
    }
}
