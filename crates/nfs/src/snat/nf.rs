//! The SNAT NF itself: deciding first packets, flow events, split and merge.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use ::nf::{
    Decision, DetRng, Endpoint, FirstPacket, FlowEvent, MergeDecoder, NetworkFunction, NfEnv,
    NfError, PreparedPart, Rewrite, TableSpec,
};
use packet::proto;
use packet::tcp_flags::{ACK, FIN, RST, SYN};
use pipeline::FlowKey;
use tracing::debug;

use super::config::{MappingBehaviour, Plan, SnatConfig};
use super::reason;
use super::snapshot::{is_platform, snap_err};
use super::table::{
    ExternalEndpoint, FlowEntry, FlowRow, FlowState, MappingInfo, MappingKey, SnatStats, State,
    FLOWS, MIRROR, PORTS,
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
        let state = State::new(&plan, true)?;
        Ok(Snat { cfg, plan, state })
    }

    pub fn config(&self) -> &SnatConfig {
        &self.cfg
    }

    pub fn stats(&self) -> SnatStats {
        self.state.totals()
    }

    pub fn flow_count(&self) -> usize {
        self.state.flow_count()
    }

    /// Every mapping, sorted by external endpoint.
    pub fn mappings(&self) -> Vec<MappingInfo> {
        let st = &self.state;
        let mut v: Vec<MappingInfo> = (st.mapping_rows().into_iter())
            .map(|(s, e, mk)| MappingInfo {
                key: mk,
                external: e,
                flows: st.flows_by_slot.get(s as usize).copied().unwrap_or(0),
                sole_owner: st.sole_owner(&e),
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
        (self.state.tables.pool(PORTS, &(addr, proto)).ok().flatten())
            .map(|s| s.free_units().collect())
            .unwrap_or_default()
    }

    /// When the NF forgets a flow (ms on the group clock) if nothing refreshes it; the key
    /// may be either direction's.
    pub fn flow_deadline(&self, key: &FlowKey) -> Option<u64> {
        let fk = self.state.resolve(key)?;
        self.state.flow(&fk).map(|f| f.deadline_ms)
    }

    pub fn free_port_count(&self, addr: IpAddr, proto: u8) -> usize {
        self.state.free_count(addr, proto) as usize
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
        let (fk, mut f) = self.state.lookup(&pkt.key)?;
        let reply = fk != pkt.key;
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
            self.state.set_flow_state(&fk, &f, state, d);
            f.state = state;
        }
        Some(self.flow_decision(&f, reply))
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
        if let Some(e) = self.state.mapping_of(&mk) {
            self.state.stats.mappings_reused += 1;
            return Some(e);
        }
        let p = self.plan.pools.get(pool)?;
        let st = &self.state;
        let paired = st.pairings.get(&(mk.vni, mk.addr)).map(|p| p.0);
        let addr = match paired {
            Some(a) if p.addrs.contains(&a) && st.free_count(a, mk.proto) > 0 => a,
            _ => {
                let mut best: Option<(IpAddr, u32)> = None;
                for &a in &p.addrs {
                    let n = st.free_count(a, mk.proto);
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
        let got = (st.tables)
            .pool_alloc(PORTS, &(addr, mk.proto), mk.port, rng)
            .ok()
            .flatten()?;
        st.took(addr, mk.proto);
        let s = &mut st.stats;
        if got.preserved {
            s.ports_preserved += 1;
        } else {
            s.random_probes += got.probes as u64;
            s.probe_histogram[got.failed_probes] += 1;
        }
        let ext = ExternalEndpoint {
            addr,
            port: got.unit,
            proto: mk.proto,
        };
        if let Err(e) = st.add_mapping(ext, mk, addr) {
            // Nothing holds the port yet: give it back.
            if st.tables.pool_put(PORTS, &(addr, mk.proto), got.unit) == Ok(true) {
                *st.free.entry((addr, mk.proto)).or_insert(0) += 1;
            }
            debug!(%e, "snat: mapping not recorded");
            return None;
        }
        st.stats.mappings_created += 1;
        Some(ext)
    }

    pub(super) fn new_flow(&mut self, key: FlowKey, f: FlowEntry) -> Result<Decision, NfError> {
        let d = self.flow_decision(&f, false);
        let (own, peer) = (f.own, f.peer);
        if let Err(e) = self.state.insert_flow(key, f) {
            // The mappings it made or joined must not outlive a flow that never was.
            for m in std::iter::once(own).chain(peer) {
                if self.state.flows_of(&m) == Some(0) {
                    self.state.free_mapping(&m);
                }
            }
            return Err(e);
        }
        self.state.stats.flows_created += 1;
        Ok(d)
    }

    pub(super) fn outbound(
        &mut self,
        pkt: &FirstPacket,
        pool: usize,
        env: &mut NfEnv,
    ) -> Result<Decision, NfError> {
        let key = pkt.key;
        let state = match Self::new_flow_state(&key, pkt.meta.tcp_flags) {
            Ok(s) => s,
            Err(why) => return Ok(self.refuse(why)),
        };
        let mk = self.mapping_key(pool, &key);
        let Some(own) = self.mapping_for(pool, mk, &mut env.rng) else {
            debug!(%key, "snat: pool exhausted");
            return Ok(self.refuse(reason::EXHAUSTED));
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
    pub(super) fn hairpin(
        &mut self,
        pkt: &FirstPacket,
        env: &mut NfEnv,
    ) -> Result<Decision, NfError> {
        let key = pkt.key;
        let target = ExternalEndpoint {
            addr: key.dst(),
            port: key.dport(),
            proto: key.proto(),
        };
        // This partition's own mapping, else another partition's, from the mirror: a
        // chain partitioned by inside host has the sender here and the target's
        // mapping wherever its host went.
        let own = self.state.mapping_key(&target);
        let peer = own.or_else(|| {
            (self.state.tables)
                .get::<_, MappingKey>(MIRROR, &target)
                .ok()
                .flatten()
        });
        let Some(peer) = peer else {
            return Ok(self.refuse(reason::NO_MAPPING));
        };
        let Some(pool) = self.plan.pool_for(key.src()) else {
            return Ok(self.refuse(reason::NO_MAPPING));
        };
        let state = match Self::new_flow_state(&key, pkt.meta.tcp_flags) {
            Ok(s) => s,
            Err(why) => return Ok(self.refuse(why)),
        };
        let mk = self.mapping_key(pool, &key);
        let Some(own) = self.mapping_for(pool, mk, &mut env.rng) else {
            return Ok(self.refuse(reason::EXHAUSTED));
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

    pub(super) fn decide(
        &mut self,
        pkt: &FirstPacket,
        env: &mut NfEnv,
    ) -> Result<Decision, NfError> {
        if let Some(d) = self.replay(pkt, env.now_ms) {
            return Ok(d);
        }
        if pkt.meta.icmp_error {
            return Ok(self.refuse(reason::ICMP_ERROR_UNKNOWN_FLOW));
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
            return Ok(if self.state.has_mapping(&target) {
                self.refuse(reason::FILTERED)
            } else {
                self.refuse(reason::NO_MAPPING)
            });
        }
        let pool = match self.plan.pool_for(src) {
            Some(p) if !self.plan.is_pool_addr(src) => p,
            _ => {
                self.state.stats.untranslated += 1;
                return Ok(Decision::pass());
            }
        };
        self.outbound(pkt, pool, env)
    }

    /// A part to merge, as a state of its own: decoded from the platform's form or from
    /// this NF's older one, and checked.
    /// `tables` decodes the platform's form of a part (`StateTables::merge_decoder`),
    /// so the ordered merge only checks and applies.
    fn part(plan: &Plan, tables: &MergeDecoder, bytes: &[u8]) -> Result<SnatPart, NfError> {
        let (view, prepared) = if is_platform(bytes) {
            let mut s = State::new(plan, false)?;
            s.tables.restore(bytes)?;
            s.reindex_view();
            (s, tables(bytes)?)
        } else {
            let s = State::decode_own(plan, bytes)?;
            let prepared = tables(&s.tables.snapshot()?)?;
            (s, prepared)
        };
        Ok(SnatPart { view, prepared })
    }

    fn check_part(&self, part: &SnatPart) -> Result<(), NfError> {
        self.state.check_merge(&part.view)?;
        self.state.tables.check_prepared(&part.prepared)
    }

    fn merge_part(&mut self, part: SnatPart) -> Result<(), NfError> {
        self.state.check_merge(&part.view)?;
        let conflicts = self.state.conflicts(&part.view);
        self.state.tables.merge_prepared(part.prepared)?;
        self.state.reindex();
        self.state.stats.merge_conflicts += conflicts;
        self.state.flush();
        Ok(())
    }
}

/// A part decoded for a merge: a state to look at (the check across tables, the flows
/// both sides hold), and the platform's decoded part, to merge.
struct SnatPart {
    view: State,
    prepared: PreparedPart,
}

impl NetworkFunction for Snat {
    fn kind(&self) -> &str {
        "snat"
    }

    fn tables(&self) -> Vec<TableSpec> {
        self.plan.tables()
    }

    /// Endpoint-independent mappings and the address pairing are per inside host: in a
    /// chain partitioned by source address they hold across partitions (RFC 4787
    /// REQ-1, REQ-2), not only within one.
    fn partition_by(&self) -> ::nf::PartitionBy {
        ::nf::PartitionBy::SourceAddress
    }

    fn knows_reply(&self, key: &FlowKey) -> bool {
        let mut k = *key;
        k.set_vni(0);
        (self.state.reply_to(&k)).is_some_and(|fk| fk != *key)
    }

    fn first_packet(&mut self, pkt: &FirstPacket, env: &mut NfEnv) -> Result<Decision, NfError> {
        let d = self.decide(pkt, env);
        self.state.flush();
        d
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
                let Some((fk, f)) = self.state.lookup(key) else {
                    return;
                };
                if matches!(
                    f.state,
                    FlowState::TcpOpen | FlowState::TcpClosing | FlowState::TcpSynSent
                ) {
                    let d = self.deadline(env.now_ms, FlowState::TcpClosing);
                    self.state.set_flow_state(&fk, &f, FlowState::TcpClosing, d);
                }
            }
            FlowEvent::TcpEstablished { key } => {
                let Some((fk, f)) = self.state.lookup(key) else {
                    return;
                };
                // Only a half-open flow moves: a closing one stays closing (a late or
                // reordered report must not revive it).
                if f.state == FlowState::TcpSynSent {
                    let d = self.deadline(env.now_ms, FlowState::TcpOpen);
                    self.state.set_flow_state(&fk, &f, FlowState::TcpOpen, d);
                }
            }
            FlowEvent::Active { key } => {
                let Some((fk, f)) = self.state.lookup(key) else {
                    return;
                };
                // RFC 4787 REQ-6 / RFC 5382 REQ-5: traffic refreshes the mapping, with the
                // timeout of the state the flow is in.
                let d = self.deadline(env.now_ms, f.state);
                self.state.set_deadline(&fk, d);
            }
            // Traffic counts are the monitor's; a mapping's life is its own timers'.
            FlowEvent::Counters { .. } => {}
        }
        self.state.flush();
    }

    /// The platform's timer removes the flows whose deadline passed; their mappings
    /// are released here.
    fn on_timer(&mut self, env: &mut NfEnv) -> Vec<FlowKey> {
        let gone: Vec<(FlowKey, FlowRow)> = (self.state.tables)
            .expire_flows(FLOWS, env.now_ms)
            .unwrap_or_default();
        let mut out = Vec::with_capacity(gone.len());
        for (k, r) in gone {
            let f = r.entry(&k, env.now_ms);
            self.state.forget_flow(&k, &f);
            self.state.stats.flows_expired += 1;
            out.push(k);
        }
        self.state.tables.fold(env.now_ms);
        self.state.flush();
        out
    }

    ::nf::platform_state!(self.state.tables);

    fn tables_changed(&mut self) {
        self.state.reindex();
    }

    /// The platform's form, or this NF's older one (JSON or binary), checked either way.
    fn restore(&mut self, snapshot: &[u8]) -> Result<(), NfError> {
        if is_platform(snapshot) {
            self.state.tables.restore(snapshot)?;
            self.state.reindex();
        } else {
            self.state = State::decode_own(&self.plan, snapshot)?;
        }
        Ok(())
    }

    /// Union with another partition's state, by the platform's merge of each table,
    /// checked first and applied only if sound: a port owned by both sides, a port
    /// mapped on one side and free on the other, or one external endpoint mapped for two
    /// internal ones, is an error and changes nothing. A flow both sides hold keeps this
    /// side's decision.
    fn merge(&mut self, part: &[u8]) -> Result<(), NfError> {
        let part = Self::part(&self.plan, &self.state.tables.merge_decoder(), part)?;
        self.check_part(&part)?;
        self.merge_part(part)
    }

    /// Decoding (the bulk of a merge: every flow, mapping and free port is read and
    /// checked) needs only the configuration, so it runs off the request stream.
    fn merge_decoder(&self) -> MergeDecoder {
        let plan = Arc::new(self.plan.clone());
        let tables = self.state.tables.merge_decoder();
        Arc::new(move |b: &[u8]| Ok(PreparedPart::new(Snat::part(&plan, &tables, b)?)))
    }

    fn check_prepared(&self, part: &PreparedPart) -> Result<(), NfError> {
        let other = part
            .downcast_ref::<SnatPart>()
            .ok_or_else(|| snap_err("prepared part is not a SNAT part".to_string()))?;
        self.check_part(other)
    }

    fn merge_prepared(&mut self, part: PreparedPart) -> Result<(), NfError> {
        let other: SnatPart = part.downcast()?;
        self.check_part(&other)?;
        self.merge_part(other)
    }
}

#[cfg(test)]
mod reply_tests {
    use super::*;
    use crate::snat::SnatPool;
    use pipeline::PacketMeta;

    fn key(s: &str) -> FlowKey {
        s.parse().expect("test flow key")
    }

    fn decide(n: &mut Snat, k: FlowKey) -> Decision {
        let flags = if k.proto() == proto::TCP { SYN } else { 0 };
        let p = FirstPacket::new(k, 1, PacketMeta::new(60, flags));
        (n.first_packet(&p, &mut NfEnv::new(0, 7))).expect("snat decides")
    }

    /// The reply key SC sees when PP lost a flow's reverse rule: remote → external
    /// endpoint, on whatever VNI the reply arrives.
    fn reply(k: &FlowKey, d: &Decision, vni: u32) -> FlowKey {
        let mut r = d.forward.apply(k).reversed();
        r.set_vni(vni);
        r
    }

    #[test]
    fn a_plain_flows_reply_is_found_through_its_mapping_and_only_hairpins_are_indexed() {
        let pool = "198.19.255.1".parse().expect("address");
        let mut n = Snat::new(SnatConfig::new(vec![SnatPool::new(
            vec![pool],
            1024,
            65535,
        )
        .sources(&["198.18.0.0/16"])]))
        .expect("config");
        let mut plain = Vec::new();
        for i in 0..50u16 {
            for p in ["udp", "tcp", "icmp"] {
                let k = key(&format!(
                    "100 {p} 198.18.0.{}:{} > 198.19.0.10:53",
                    i % 7 + 1,
                    2000 + i
                ));
                let d = decide(&mut n, k);
                plain.push((k, d));
            }
        }
        // A hairpin flow: to the external endpoint of the first flow's mapping.
        let (k0, d0) = plain[0].clone();
        let ext = d0.forward.apply(&k0);
        let hk = key(&format!(
            "100 udp 198.18.0.9:999 > {}:{}",
            ext.src(),
            ext.sport()
        ));
        let hd = decide(&mut n, hk);
        assert!(hd.forward.dst.addr.is_some(), "hairpinned: {hd:?}");
        // Only the hairpin flow's reply key is indexed; every reply is still found.
        assert_eq!(n.state.by_reply.len(), 1);
        let check = |n: &Snat| {
            for (k, d) in plain.iter().chain([(hk, hd.clone())].iter()) {
                let r = reply(k, d, 200);
                let mut r0 = r;
                r0.set_vni(0);
                assert_eq!(n.state.reply_to(&r0), Some(*k), "{k}");
                assert!(n.knows_reply(&r), "{k}");
                assert_eq!(n.state.lookup(&r).map(|(fk, _)| fk), Some(*k), "{k}");
            }
            // A new forward flow is not anyone's reply.
            assert!(!n.knows_reply(&key("100 udp 198.18.0.1:4000 > 198.19.0.10:53")));
            // Nor is a packet to a mapped endpoint from elsewhere than the flow's remote.
            let mut stray = reply(&plain[0].0, &plain[0].1, 0);
            stray = key(&format!(
                "0 udp 198.19.0.11:53 > {}:{}",
                stray.dst(),
                stray.dport()
            ));
            assert_eq!(n.state.reply_to(&stray), None);
        };
        check(&n);
        // Rebuilt from the tables (restore, split, merge): the same answers, the same index.
        n.state.reindex_view();
        assert_eq!(n.state.by_reply.len(), 1);
        check(&n);
        // A flow gone has no reply any more, though its mapping may stay.
        let (k, d) = plain[1].clone();
        n.on_event(&FlowEvent::Expired { key: k }, &mut NfEnv::new(1, 0));
        let mut r = reply(&k, &d, 0);
        r.set_vni(0);
        assert_eq!(n.state.reply_to(&r), None);
    }
}
