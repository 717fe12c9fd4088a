//! Rule replies encoded once, at the SC tail, and carried as bytes to PP
//! (`OpResult.encoded_replies`, `v1::EncodedRuleReply`).
//!
//! FM caches every rule it returns as its encoding (`fm::cache`) and answers PP with
//! those bytes (`RuleReplyBatch`, `reply_batch.rs`). When SC sent its replies as
//! messages, FM decoded each one (a `Rule` with its action list, twice: the flow's and
//! its companion's) only to encode it again for the cache, and the SC node's link had
//! encoded it under five levels of nesting (`ScUp`, `GroupResults`, `OpResult`,
//! `RuleReply`, `Rule`), prost walking the rule once per level for its length. Now the
//! tail's node encodes each rule reply once, into one buffer for the batch
//! ([`encode_rule_replies`]); FM reads the three things it needs from the bytes
//! ([`scan_rule_reply`]: that it is a rule, the rule's idle timeout, the companions'
//! keys) and copies the bytes into its cache.
//!
//! Errors stay decoded in `OpResult.replies`: FM acts on them (a moved key, a
//! migrating flow) and never caches them.

use std::net::IpAddr;

use pipeline::{Action, Rule};
use prost::bytes::{Buf, BufMut, BytesMut};
use prost::encoding::{self, DecodeContext, WireType};
use prost::{DecodeError, Message};

use crate::v1;

/// Move the rule replies of `results` to `encoded_replies`, each encoded without its
/// id and worker and naming `group` as the one that decided it. All bodies share one
/// buffer: two allocations for the batch, not one per reply. Error replies stay.
pub fn encode_rule_replies(results: &mut [v1::OpResult], group: u64) {
    let is_rule = |r: &v1::RuleReply| matches!(r.result, Some(v1::rule_reply::Result::Rule(_)));
    let mut total = 0;
    for r in results.iter_mut() {
        for reply in r.replies.iter_mut().filter(|r| is_rule(r)) {
            reply.worker = 0;
            reply.decided_by_group = group;
            // With its id, which is left out below: a few bytes over, never under.
            total += reply.encoded_len();
        }
    }
    if total == 0 {
        return;
    }
    let mut buf = BytesMut::with_capacity(total);
    for r in results.iter_mut() {
        if !r.replies.iter().any(is_rule) {
            continue;
        }
        let replies = std::mem::take(&mut r.replies);
        r.encoded_replies.reserve(replies.len());
        for mut reply in replies {
            if !is_rule(&reply) {
                r.replies.push(reply);
                continue;
            }
            let id = std::mem::take(&mut reply.id);
            // `encode_raw`, not `encode`: the buffer has room, so `encode`'s length
            // check would only walk the rules once more.
            reply.encode_raw(&mut buf);
            r.encoded_replies.push(v1::EncodedRuleReply {
                id,
                body: buf.split().freeze(),
            });
        }
    }
}

/// A rule reply the SC tail decided, encoded straight from the chain's rules: the
/// body [`encode_rule_replies`] makes from the message `replica.rs` would build (a
/// `RuleReply` naming `group`, with neither id nor worker), byte for byte, without
/// building it.
///
/// Why by hand: prost encodes a message it is given, and the message costs the tail
/// four allocations a flow (the rule's and its companion's action lists, the
/// companion list, the companion's key) only to be dropped once encoded; and prost
/// walks a nested message's length once per enclosing level (`RuleReply`, `Rule`,
/// `Action`, `Endpoint`). Here each length is one sum over the pipeline's actions. The
/// tests hold the bytes equal to prost's for every kind of action.
#[derive(Debug, Clone, Copy)]
pub struct DecidedReply<'a> {
    /// The request's key, as the reply carries it.
    pub key: Option<&'a v1::FlowKey>,
    /// The flow's rule.
    pub rule: &'a Rule,
    /// Its companion (the reverse direction), if the flow has one.
    pub also: Option<&'a Rule>,
    /// The group whose chain decided (`decided_by_group`).
    pub group: u64,
}

/// A length-delimited field's length with its tag (every tag here is below 16: one
/// byte).
fn delimited(len: usize) -> usize {
    1 + encoding::encoded_len_varint(len as u64) + len
}

fn put_delimited(tag: u32, len: usize, buf: &mut impl BufMut) {
    encoding::encode_key(tag, WireType::LengthDelimited, buf);
    encoding::encode_varint(len as u64, buf);
}

fn put_bytes(tag: u32, b: &[u8], buf: &mut impl BufMut) {
    put_delimited(tag, b.len(), buf);
    buf.put_slice(b);
}

fn put_uint(tag: u32, v: u64, buf: &mut impl BufMut) {
    encoding::encode_key(tag, WireType::Varint, buf);
    encoding::encode_varint(v, buf);
}

fn uint_len(v: u64) -> usize {
    1 + encoding::encoded_len_varint(v)
}

fn addr_len(a: &Option<IpAddr>) -> usize {
    match a {
        Some(IpAddr::V4(_)) => delimited(4),
        Some(IpAddr::V6(_)) => delimited(16),
        None => 0,
    }
}

/// `v1::Endpoint`'s length (proto3 leaves an empty address out; the port is optional,
/// so it is written whenever it is set, 0 too).
fn endpoint_len(addr: &Option<IpAddr>, port: Option<u16>) -> usize {
    addr_len(addr) + port.map_or(0, |p| uint_len(u64::from(p)))
}

fn put_endpoint(addr: &Option<IpAddr>, port: Option<u16>, buf: &mut impl BufMut) {
    match addr {
        Some(IpAddr::V4(a)) => put_bytes(1, &a.octets(), buf),
        Some(IpAddr::V6(a)) => put_bytes(1, &a.octets(), buf),
        None => {}
    }
    if let Some(p) = port {
        put_uint(2, u64::from(p), buf);
    }
}

fn encap_len(vni: u32, dmac: &Option<[u8; 6]>, smac: &Option<[u8; 6]>) -> usize {
    delimited(4)
        + if vni != 0 {
            uint_len(u64::from(vni))
        } else {
            0
        }
        + dmac.map_or(0, |_| delimited(6))
        + smac.map_or(0, |_| delimited(6))
}

/// `v1::Action`'s length: its one `kind` field (a oneof's field is written even when it
/// holds its type's default).
fn action_len(a: &Action) -> usize {
    match a {
        Action::DecapVxlan | Action::Count | Action::Offload => delimited(0),
        Action::SetSrc { addr, port } | Action::SetDst { addr, port } => {
            delimited(endpoint_len(addr, *port))
        }
        Action::EncapVxlan {
            vni,
            inner_dmac,
            inner_smac,
            ..
        } => delimited(encap_len(*vni, inner_dmac, inner_smac)),
        Action::Police { class } => uint_len(u64::from(*class)),
        Action::Output(p) => uint_len(u64::from(*p)),
        Action::Drop { reason } => delimited(reason.len()),
        Action::Fabric { .. } => delimited(6),
    }
}

fn put_action(a: &Action, buf: &mut impl BufMut) {
    match a {
        Action::DecapVxlan => put_delimited(1, 0, buf),
        Action::SetSrc { addr, port } => {
            put_delimited(2, endpoint_len(addr, *port), buf);
            put_endpoint(addr, *port, buf);
        }
        Action::SetDst { addr, port } => {
            put_delimited(3, endpoint_len(addr, *port), buf);
            put_endpoint(addr, *port, buf);
        }
        Action::EncapVxlan {
            dst,
            vni,
            inner_dmac,
            inner_smac,
        } => {
            put_delimited(4, encap_len(*vni, inner_dmac, inner_smac), buf);
            put_bytes(1, &dst.octets(), buf);
            if *vni != 0 {
                put_uint(2, u64::from(*vni), buf);
            }
            if let Some(m) = inner_dmac {
                put_bytes(3, m, buf);
            }
            if let Some(m) = inner_smac {
                put_bytes(4, m, buf);
            }
        }
        Action::Count => put_delimited(5, 0, buf),
        Action::Police { class } => put_uint(6, u64::from(*class), buf),
        Action::Offload => put_delimited(7, 0, buf),
        Action::Output(p) => put_uint(8, u64::from(*p), buf),
        Action::Drop { reason } => put_bytes(9, reason.as_bytes(), buf),
        Action::Fabric { peer } => put_bytes(10, peer, buf),
    }
}

/// `v1::Rule`'s length.
fn rule_len(r: &Rule) -> usize {
    delimited(delimited(r.key.as_bytes().len()))
        + r.actions
            .iter()
            .map(|a| delimited(action_len(a)))
            .sum::<usize>()
        + r.idle_timeout.map_or(0, |t| uint_len(crate::timeout_ms(t)))
}

fn put_rule(r: &Rule, buf: &mut impl BufMut) {
    let raw = r.key.as_bytes();
    put_delimited(1, delimited(raw.len()), buf);
    put_bytes(1, raw, buf);
    for a in &r.actions {
        put_delimited(2, action_len(a), buf);
        put_action(a, buf);
    }
    if let Some(t) = r.idle_timeout {
        put_uint(3, crate::timeout_ms(t), buf);
    }
}

impl DecidedReply<'_> {
    /// The body's length.
    pub fn encoded_len(&self) -> usize {
        self.key.map_or(0, |k| delimited(delimited_opt(&k.raw)))
            + delimited(rule_len(self.rule))
            + self.also.map_or(0, |r| delimited(rule_len(r)))
            + if self.group != 0 {
                uint_len(self.group)
            } else {
                0
            }
    }

    /// Write the body: the fields in tag order, as prost's derive writes them (the
    /// `result` oneof at 3, before `also` at 5).
    pub fn encode(&self, buf: &mut impl BufMut) {
        if let Some(k) = self.key {
            put_delimited(2, delimited_opt(&k.raw), buf);
            if !k.raw.is_empty() {
                put_bytes(1, &k.raw, buf);
            }
        }
        put_delimited(3, rule_len(self.rule), buf);
        put_rule(self.rule, buf);
        if let Some(r) = self.also {
            put_delimited(5, rule_len(r), buf);
            put_rule(r, buf);
        }
        if self.group != 0 {
            put_uint(9, self.group, buf);
        }
    }
}

/// A proto3 `bytes` field's length with its tag, or 0 when it is empty (left out).
fn delimited_opt(b: &[u8]) -> usize {
    if b.is_empty() {
        0
    } else {
        delimited(b.len())
    }
}

/// Undo [`encode_rule_replies`]: decode `encoded_replies` back into `replies`, for an
/// FM that does not take them (`RegisterAck.encoded_replies` false: an older FM, which
/// would skip the field it does not know). A body that does not decode is dropped and
/// counted in the answer; FM then times its request out and the PP node asks again.
pub fn decode_rule_replies(results: &mut [v1::OpResult]) -> usize {
    let mut bad = 0;
    for r in results {
        for e in std::mem::take(&mut r.encoded_replies) {
            match e.decode_reply() {
                Ok(reply) => r.replies.push(reply),
                Err(_) => bad += 1,
            }
        }
    }
    bad
}

/// What [`scan_rule_reply`] read from an encoded reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScannedReply {
    /// The reply is a rule (`result` is field 3), not an error or nothing.
    pub rule: bool,
    /// The rule's `idle_timeout_ms`, if it has one.
    pub idle_timeout_ms: Option<u64>,
    /// The bytes carry an id or a worker (fields 1, 6), which an encoded body leaves
    /// to the answer it goes out in: protobuf's last value wins, so the body's would
    /// override the asker's.
    pub asker_fields: bool,
}

/// Read an encoded `RuleReply` (an [`v1::EncodedRuleReply`]'s body) for what FM's
/// cache needs, without decoding it: whether it is a rule, the rule's idle timeout, and
/// each companion rule's flow key (`also_key`, in order; the raw bytes, any length).
///
/// Checks the structure it walks: every field's wire type where it reads one, and
/// every length. Fields it does not need are skipped, not checked inside (an action
/// list is PP's to decode).
pub fn scan_rule_reply(
    mut body: &[u8],
    mut also_key: impl FnMut(&[u8]),
) -> Result<ScannedReply, DecodeError> {
    let mut out = ScannedReply {
        rule: false,
        idle_timeout_ms: None,
        asker_fields: false,
    };
    let buf = &mut body;
    while buf.has_remaining() {
        let (tag, wt) = encoding::decode_key(buf)?;
        match tag {
            3 => {
                let mut rule = nested(buf, wt, "result.rule")?;
                out.rule = true;
                out.idle_timeout_ms = scan_rule(&mut rule, |_| ())?;
            }
            4 => {
                // An error (a string): the result is not a rule, whatever came first.
                nested(buf, wt, "result.error")?;
                out.rule = false;
                out.idle_timeout_ms = None;
            }
            5 => {
                let mut rule = nested(buf, wt, "also")?;
                scan_rule(&mut rule, &mut also_key)?;
            }
            _ => {
                out.asker_fields |= tag == 1 || tag == 6;
                encoding::skip_field(wt, tag, buf, DecodeContext::default())?
            }
        }
    }
    Ok(out)
}

/// A length-delimited field's bytes, taken off `buf`.
fn nested<'a>(
    buf: &mut &'a [u8],
    wt: WireType,
    field: &'static str,
) -> Result<&'a [u8], DecodeError> {
    let err = |m: &str| {
        let mut e = DecodeError::new(m.to_string());
        e.push("RuleReply", field);
        e
    };
    if wt != WireType::LengthDelimited {
        return Err(err("invalid wire type"));
    }
    let len = encoding::decode_varint(buf)?;
    if len > buf.len() as u64 {
        return Err(err("buffer underflow"));
    }
    let (head, rest) = buf.split_at(len as usize);
    *buf = rest;
    Ok(head)
}

/// A `Rule`'s idle timeout; its key's raw bytes go to `key`.
fn scan_rule(buf: &mut &[u8], mut key: impl FnMut(&[u8])) -> Result<Option<u64>, DecodeError> {
    let mut ttl = None;
    while buf.has_remaining() {
        let (tag, wt) = encoding::decode_key(buf)?;
        match tag {
            1 => {
                let mut k = nested(buf, wt, "Rule.key")?;
                while k.has_remaining() {
                    let (tag, wt) = encoding::decode_key(&mut k)?;
                    if tag == 1 {
                        key(nested(&mut k, wt, "Rule.key.raw")?);
                    } else {
                        encoding::skip_field(wt, tag, &mut k, DecodeContext::default())?;
                    }
                }
            }
            3 => {
                if wt != WireType::Varint {
                    let mut e = DecodeError::new("invalid wire type");
                    e.push("Rule", "idle_timeout_ms");
                    return Err(e);
                }
                ttl = Some(encoding::decode_varint(buf)?);
            }
            _ => encoding::skip_field(wt, tag, buf, DecodeContext::default())?,
        }
    }
    Ok(ttl)
}

impl v1::EncodedRuleReply {
    /// The reply as a message, its id filled in.
    pub fn decode_reply(&self) -> Result<v1::RuleReply, DecodeError> {
        let mut r = v1::RuleReply::decode(&self.body[..])?;
        r.id = self.id;
        Ok(r)
    }
}

/// Every reply of `r`, decoded: `replies`, then `encoded_replies` (for tests and tools;
/// FM reads the encoded ones without decoding them).
pub fn op_replies(r: &v1::OpResult) -> Result<Vec<v1::RuleReply>, DecodeError> {
    let mut out = r.replies.clone();
    for e in &r.encoded_replies {
        out.push(e.decode_reply()?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{action, rule_reply, Action, FlowKey, Rule};

    fn key(b: u8) -> Option<FlowKey> {
        Some(FlowKey {
            raw: vec![b; 40].into(),
        })
    }

    fn rule(k: u8, ttl: Option<u64>, actions: usize) -> Rule {
        Rule {
            key: key(k),
            actions: vec![
                Action {
                    kind: Some(action::Kind::Output(2)),
                };
                actions
            ],
            idle_timeout_ms: ttl,
        }
    }

    fn rule_reply(id: u64, ttl: Option<u64>, also: &[u8]) -> v1::RuleReply {
        v1::RuleReply {
            id,
            key: key(id as u8),
            result: Some(rule_reply::Result::Rule(rule(id as u8, ttl, 3))),
            also: also.iter().map(|&k| rule(k, Some(5), 2)).collect(),
            worker: 4,
            ..Default::default()
        }
    }

    fn error_reply(id: u64) -> v1::RuleReply {
        v1::RuleReply {
            id,
            key: key(1),
            result: Some(rule_reply::Result::Error("sc-moved".into())),
            worker: 4,
            ..Default::default()
        }
    }

    #[test]
    fn rules_move_to_encoded_bodies_and_read_back_with_their_group() {
        let first = vec![
            rule_reply(1, Some(30_000), &[7]),
            error_reply(2),
            rule_reply(3, None, &[]),
        ];
        let second = vec![rule_reply(u64::MAX, Some(u64::MAX), &[8, 9])];
        let mut results = vec![
            v1::OpResult {
                seq: 1,
                replies: first.clone(),
                ..Default::default()
            },
            v1::OpResult {
                seq: 2,
                replies: vec![error_reply(5)],
                ..Default::default()
            },
            v1::OpResult {
                seq: 3,
                replies: second.clone(),
                ..Default::default()
            },
        ];
        encode_rule_replies(&mut results, 12);
        // Errors stay as they were.
        assert_eq!(results[0].replies, vec![error_reply(2)]);
        assert_eq!(results[1].replies, vec![error_reply(5)]);
        assert!(results[1].encoded_replies.is_empty());
        assert!(results[2].replies.is_empty());
        let ids: Vec<u64> = results
            .iter()
            .flat_map(|r| r.encoded_replies.iter().map(|e| e.id))
            .collect();
        assert_eq!(ids, vec![1, 3, u64::MAX]);
        // Each body decodes to its reply, worker cleared and the group named.
        let expect = |mut r: v1::RuleReply| {
            r.worker = 0;
            r.decided_by_group = 12;
            r
        };
        assert_eq!(
            op_replies(&results[0]).unwrap(),
            vec![
                error_reply(2),
                expect(first[0].clone()),
                expect(first[2].clone())
            ]
        );
        assert_eq!(
            op_replies(&results[2]).unwrap(),
            vec![expect(second[0].clone())]
        );
        // The body leaves the id out (FM adds each asker's).
        let body = &results[2].encoded_replies[0].body;
        assert_eq!(v1::RuleReply::decode(&body[..]).unwrap().id, 0);
        // And the result encodes on the wire and back as it is.
        let wire = results[0].encode_to_vec();
        assert_eq!(v1::OpResult::decode(&wire[..]).unwrap(), results[0]);
        // For an FM that does not take them, they go back to messages.
        let mut back = results.clone();
        assert_eq!(decode_rule_replies(&mut back), 0);
        assert!(back.iter().all(|r| r.encoded_replies.is_empty()));
        for (b, r) in back.iter().zip(&results) {
            assert_eq!(b.replies, op_replies(r).unwrap());
        }
        let mut bad = vec![v1::OpResult {
            encoded_replies: vec![v1::EncodedRuleReply {
                id: 1,
                body: vec![0x1a, 0x7f].into(),
            }],
            ..Default::default()
        }];
        assert_eq!(decode_rule_replies(&mut bad), 1);
        assert!(bad[0].replies.is_empty() && bad[0].encoded_replies.is_empty());
    }

    #[test]
    fn a_scan_reads_what_a_decode_does() {
        for r in [
            rule_reply(1, Some(30_000), &[7]),
            rule_reply(2, None, &[]),
            rule_reply(3, Some(u64::MAX), &[8, 9, 10]),
            rule_reply(4, Some(0), &[11]),
        ] {
            let body = r.encode_to_vec();
            let mut keys = Vec::new();
            let s = scan_rule_reply(&body, |k| keys.push(k.to_vec())).unwrap();
            let Some(rule_reply::Result::Rule(fwd)) = &r.result else {
                unreachable!()
            };
            assert!(s.rule);
            assert_eq!(s.idle_timeout_ms, fwd.idle_timeout_ms);
            let want: Vec<Vec<u8>> = r
                .also
                .iter()
                .map(|a| a.key.as_ref().unwrap().raw.to_vec())
                .collect();
            assert_eq!(keys, want);
        }
        let s = scan_rule_reply(&error_reply(3).encode_to_vec(), |_| panic!()).unwrap();
        assert_eq!(
            s,
            ScannedReply {
                rule: false,
                idle_timeout_ms: None,
                asker_fields: true,
            }
        );
        // A body as the tail encodes it has neither id nor worker.
        let mut r = rule_reply(5, None, &[]);
        assert!(
            scan_rule_reply(&r.encode_to_vec(), |_| ())
                .unwrap()
                .asker_fields
        );
        r.id = 0;
        assert!(
            scan_rule_reply(&r.encode_to_vec(), |_| ())
                .unwrap()
                .asker_fields
        );
        r.worker = 0;
        assert!(
            !scan_rule_reply(&r.encode_to_vec(), |_| ())
                .unwrap()
                .asker_fields
        );
        assert!(!scan_rule_reply(&[], |_| ()).unwrap().rule);
    }

    #[test]
    fn a_bad_body_is_an_error_not_a_panic() {
        let good = rule_reply(1, Some(30_000), &[7]).encode_to_vec();
        // Every truncation of a good body either scans (it ended between fields) or
        // is an error.
        for n in 0..good.len() {
            let _ = scan_rule_reply(&good[..n], |_| ());
        }
        // The rule as a varint: the wrong wire type, named.
        let e = scan_rule_reply(&[0x18, 0x01], |_| ()).unwrap_err();
        assert!(e.to_string().contains("RuleReply.result.rule"), "{e}");
        // A length past the end.
        let e = scan_rule_reply(&[0x2a, 0x7f, 0x0a], |_| ()).unwrap_err();
        assert!(e.to_string().contains("RuleReply.also"), "{e}");
        // An idle timeout that is not a varint.
        let e = scan_rule_reply(&[0x1a, 0x02, 0x1a, 0x00], |_| ()).unwrap_err();
        assert!(e.to_string().contains("idle_timeout_ms"), "{e}");
        // Random bytes never panic.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2000 {
            let mut b = good.clone();
            for _ in 0..3 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let i = (x as usize) % b.len();
                b[i] = (x >> 32) as u8;
            }
            let _ = scan_rule_reply(&b, |_| ());
        }
    }
}

/// [`DecidedReply`] against prost: the same bytes as the message the tail would build.
#[cfg(test)]
mod decided_tests {
    use std::net::{Ipv4Addr, Ipv6Addr};
    use std::time::Duration;

    use pipeline::{Action, FlowKey, Rule};
    use proptest::prelude::*;
    use prost::Message;

    use super::DecidedReply;
    use crate::v1;

    fn addr() -> impl Strategy<Value = Option<IpAddr>> {
        prop_oneof![
            Just(None),
            any::<u32>().prop_map(|a| Some(IpAddr::V4(Ipv4Addr::from(a)))),
            any::<u128>().prop_map(|a| Some(IpAddr::V6(Ipv6Addr::from(a)))),
        ]
    }

    use std::net::IpAddr;

    fn action() -> impl Strategy<Value = Action> {
        prop_oneof![
            Just(Action::DecapVxlan),
            (addr(), any::<Option<u16>>()).prop_map(|(addr, port)| Action::SetSrc { addr, port }),
            (addr(), any::<Option<u16>>()).prop_map(|(addr, port)| Action::SetDst { addr, port }),
            (
                any::<u32>(),
                prop_oneof![Just(0u32), 0u32..(1 << 24)],
                any::<Option<[u8; 6]>>(),
                any::<Option<[u8; 6]>>()
            )
                .prop_map(|(dst, vni, inner_dmac, inner_smac)| Action::EncapVxlan {
                    dst: Ipv4Addr::from(dst),
                    vni,
                    inner_dmac,
                    inner_smac,
                }),
            Just(Action::Count),
            any::<u16>().prop_map(|class| Action::Police { class }),
            Just(Action::Offload),
            any::<u8>().prop_map(Action::Output),
            "[a-z-]{0,20}".prop_map(|reason| Action::Drop { reason }),
            any::<[u8; 6]>().prop_map(|peer| Action::Fabric { peer }),
        ]
    }

    fn rule() -> impl Strategy<Value = Rule> {
        (
            any::<[u8; 40]>(),
            proptest::collection::vec(action(), 0..9),
            prop_oneof![
                Just(None),
                Just(Some(Duration::ZERO)),
                Just(Some(Duration::MAX)),
                any::<u32>().prop_map(|ms| Some(Duration::from_millis(u64::from(ms)))),
            ],
        )
            .prop_map(|(k, actions, idle_timeout)| Rule {
                key: FlowKey::from_bytes(k),
                actions: actions.into(),
                idle_timeout,
            })
    }

    /// The message `replica.rs` built for a decided flow, as `encode_rule_replies` left
    /// it (no id, no worker, the group named).
    fn as_message(d: &DecidedReply) -> v1::RuleReply {
        v1::RuleReply {
            id: 0,
            key: d.key.cloned(),
            result: Some(v1::rule_reply::Result::Rule(crate::rule_keyed(
                d.rule, d.key,
            ))),
            also: d.also.iter().map(|r| v1::Rule::from(*r)).collect(),
            worker: 0,
            decided_by: String::new(),
            decided_by_group: d.group,
            frame_forwarded: false,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        #[test]
        fn a_decided_reply_encodes_as_prost_encodes_its_message(
            rule in rule(),
            also in proptest::option::of(rule()),
            same_key in any::<bool>(),
            other_key in proptest::option::of(proptest::collection::vec(any::<u8>(), 0..48)),
            group in prop_oneof![Just(0u64), Just(1u64), any::<u64>()],
        ) {
            // The request's key: the rule's own (the usual case), another, or none.
            let key = if same_key {
                Some(v1::FlowKey::from(&rule.key))
            } else {
                other_key.map(|raw| v1::FlowKey { raw: raw.into() })
            };
            let d = DecidedReply { key: key.as_ref(), rule: &rule, also: also.as_ref(), group };
            let want = as_message(&d).encode_to_vec();
            let mut got = Vec::with_capacity(d.encoded_len());
            d.encode(&mut got);
            prop_assert_eq!(d.encoded_len(), got.len());
            prop_assert_eq!(&got, &want);
            // And it reads back as the message, through PP's decoder.
            prop_assert_eq!(v1::RuleReply::decode(&got[..]).unwrap(), as_message(&d));
        }
    }
}
