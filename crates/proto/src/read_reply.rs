//! A `RuleReply` read off the wire straight into the pipeline's types.
//!
//! PP's FM session decoded each reply into a `v1::RuleReply` (three lists: the rule's
//! actions, the companion list, the companion's actions), converted that into a
//! `pipeline::RuleReply` (three lists again) and dropped the message: six of its seven
//! allocations per flow in `bench setup`. [`read_rule_reply`] goes from the bytes to
//! the pipeline's reply in one pass, so only the lists the worker keeps are made.
//! prost does not serve here because it decodes into its own message type only; this
//! is the reader side of [`crate::DecidedReply`].
//!
//! It must read every input exactly as decode-then-convert did: the same replies, and
//! an error wherever either step failed. That includes protobuf's merge rules, which a
//! peer may use and a fuzzer will: a field repeated is the last one's value, a message
//! field repeated is the two merged (a rule sent twice has both action lists), and a
//! oneof set twice to the same message kind merges, to another kind replaces. So a
//! rule's conversion is decided at the end, not as its parts arrive: a rule whose action
//! did not convert may yet be replaced by an error, and the reply is then good. A
//! property test holds it to `v1::RuleReply::decode` plus `TryFrom` on arbitrary
//! messages, merged ones and mutated bytes (`tests` below).
//!
//! One difference is left: prost counts nesting against a recursion limit of 100 across
//! messages, and this reader gives an unknown group the full limit wherever it is. A
//! group nested more than 96 deep inside an action reads here and fails there. No
//! sender in this project writes groups at all.

use pipeline::{Action, Actions, FlowKey, Rule, RuleReply};
use prost::bytes::Buf;
use prost::encoding::{self, DecodeContext, WireType};
use prost::DecodeError;
use thiserror::Error;

use crate::{
    addr_from, check_vni, decided_by, ipv4_from, key_from_raw, mac_from, narrow, timeout_from, v1,
    ConvertError,
};

/// A reply read off the wire: the asker's fields and the pipeline's reply.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadReply {
    /// The asker's request id.
    pub id: u64,
    /// The asker's pipeline worker.
    pub worker: u32,
    pub reply: RuleReply,
}

/// Why a reply could not be read.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ReadError {
    /// The bytes are not a `RuleReply` (the message would not decode).
    #[error("reply does not decode: {0}")]
    Decode(#[from] DecodeError),
    /// A `RuleReply`, but not one the pipeline can take (the conversion would fail).
    #[error("reply does not convert: {0}")]
    Convert(#[from] ConvertError),
}

type Read<T> = Result<T, DecodeError>;

/// Take a length-delimited field's bytes off `buf`, checking the wire type first as
/// prost does for a known field.
fn delimited<'a>(buf: &mut &'a [u8], wt: WireType) -> Read<&'a [u8]> {
    encoding::check_wire_type(WireType::LengthDelimited, wt)?;
    let len = encoding::decode_varint(buf)?;
    if len > buf.len() as u64 {
        return Err(DecodeError::new("buffer underflow"));
    }
    let (head, rest) = buf.split_at(len as usize);
    *buf = rest;
    Ok(head)
}

fn varint(buf: &mut &[u8], wt: WireType) -> Read<u64> {
    encoding::check_wire_type(WireType::Varint, wt)?;
    encoding::decode_varint(buf)
}

fn string<'a>(buf: &mut &'a [u8], wt: WireType) -> Read<&'a str> {
    std::str::from_utf8(delimited(buf, wt)?)
        .map_err(|_| DecodeError::new("invalid string value: data is not UTF-8 encoded"))
}

fn skip(buf: &mut &[u8], tag: u32, wt: WireType) -> Read<()> {
    encoding::skip_field(wt, tag, buf, DecodeContext::default())
}

/// Each field of the message in `buf`, in order, handed to `field` with the rest of
/// the bytes to take its value from.
fn fields<'a>(
    mut buf: &'a [u8],
    mut field: impl FnMut(u32, WireType, &mut &'a [u8]) -> Read<()>,
) -> Read<()> {
    while buf.has_remaining() {
        let (tag, wt) = encoding::decode_key(&mut buf)?;
        field(tag, wt, &mut buf)?;
    }
    Ok(())
}

/// Merge a `FlowKey` message into `raw`: its `raw` field, when present, replaces.
fn flow_key<'a>(msg: &'a [u8], raw: &mut &'a [u8]) -> Read<()> {
    fields(msg, |tag, wt, buf| {
        match tag {
            1 => *raw = delimited(buf, wt)?,
            _ => skip(buf, tag, wt)?,
        }
        Ok(())
    })
}

/// A required key field, as `crate::key_of` checks it.
fn key_from(raw: Option<&[u8]>) -> Result<FlowKey, ConvertError> {
    key_from_raw(raw.ok_or(ConvertError::Missing("key"))?)
}

/// `v1::Endpoint` as read so far.
#[derive(Default, Clone, Copy)]
pub(crate) struct Endpoint<'a> {
    addr: &'a [u8],
    port: Option<u32>,
}

impl<'a> Endpoint<'a> {
    fn merge(&mut self, msg: &'a [u8]) -> Read<()> {
        fields(msg, |tag, wt, buf| {
            match tag {
                1 => self.addr = delimited(buf, wt)?,
                2 => self.port = Some(varint(buf, wt)? as u32),
                _ => skip(buf, tag, wt)?,
            }
            Ok(())
        })
    }

    fn convert(&self) -> Result<(Option<std::net::IpAddr>, Option<u16>), ConvertError> {
        let port = self.port.map(|p| narrow("port", p)).transpose()?;
        Ok((addr_from(self.addr)?, port))
    }
}

/// `v1::Encap` as read so far.
#[derive(Default, Clone, Copy)]
pub(crate) struct Encap<'a> {
    dst: &'a [u8],
    vni: u32,
    dmac: &'a [u8],
    smac: &'a [u8],
}

impl<'a> Encap<'a> {
    fn merge(&mut self, msg: &'a [u8]) -> Read<()> {
        fields(msg, |tag, wt, buf| {
            match tag {
                1 => self.dst = delimited(buf, wt)?,
                2 => self.vni = varint(buf, wt)? as u32,
                3 => self.dmac = delimited(buf, wt)?,
                4 => self.smac = delimited(buf, wt)?,
                _ => skip(buf, tag, wt)?,
            }
            Ok(())
        })
    }
}

/// `v1::Action`'s oneof as read so far, or borrowed from a message.
#[derive(Default, Clone, Copy)]
pub(crate) enum Kind<'a> {
    #[default]
    Unset,
    Decap,
    SetSrc(Endpoint<'a>),
    SetDst(Endpoint<'a>),
    Encap(Encap<'a>),
    Count,
    Police(u32),
    Offload,
    Output(u32),
    Drop(&'a str),
    Fabric(&'a [u8]),
}

/// An `Empty` message: nothing to keep, but its bytes must read.
fn empty(buf: &mut &[u8], wt: WireType) -> Read<()> {
    fields(delimited(buf, wt)?, |tag, wt, buf| skip(buf, tag, wt))
}

/// One `v1::Action` message, read and then converted.
fn action(msg: &[u8]) -> Read<Result<Action, ConvertError>> {
    let mut kind = Kind::Unset;
    fields(msg, |tag, wt, buf| {
        kind = match (tag, kind) {
            (1, _) => {
                empty(buf, wt)?;
                Kind::Decap
            }
            // A message kind set again merges into the one already there.
            (2 | 3, k) => {
                let mut e = match (tag, k) {
                    (2, Kind::SetSrc(e)) | (3, Kind::SetDst(e)) => e,
                    _ => Endpoint::default(),
                };
                e.merge(delimited(buf, wt)?)?;
                if tag == 2 {
                    Kind::SetSrc(e)
                } else {
                    Kind::SetDst(e)
                }
            }
            (4, k) => {
                let mut e = match k {
                    Kind::Encap(e) => e,
                    _ => Encap::default(),
                };
                e.merge(delimited(buf, wt)?)?;
                Kind::Encap(e)
            }
            (5, _) => {
                empty(buf, wt)?;
                Kind::Count
            }
            (6, _) => Kind::Police(varint(buf, wt)? as u32),
            (7, _) => {
                empty(buf, wt)?;
                Kind::Offload
            }
            (8, _) => Kind::Output(varint(buf, wt)? as u32),
            (9, _) => Kind::Drop(string(buf, wt)?),
            (10, _) => Kind::Fabric(delimited(buf, wt)?),
            (_, k) => {
                skip(buf, tag, wt)?;
                k
            }
        };
        Ok(())
    })?;
    Ok(kind.convert())
}

impl<'a> Kind<'a> {
    /// A message's action, borrowed.
    pub(crate) fn of(a: &'a v1::Action) -> Self {
        use v1::action::Kind as K;
        let ep = |e: &'a v1::Endpoint| Endpoint {
            addr: &e.addr,
            port: e.port,
        };
        match &a.kind {
            None => Kind::Unset,
            Some(K::Decap(_)) => Kind::Decap,
            Some(K::SetSrc(e)) => Kind::SetSrc(ep(e)),
            Some(K::SetDst(e)) => Kind::SetDst(ep(e)),
            Some(K::Encap(e)) => Kind::Encap(Encap {
                dst: &e.dst,
                vni: e.vni,
                dmac: &e.inner_dmac,
                smac: &e.inner_smac,
            }),
            Some(K::Count(_)) => Kind::Count,
            Some(K::Police(c)) => Kind::Police(*c),
            Some(K::Offload(_)) => Kind::Offload,
            Some(K::Output(p)) => Kind::Output(*p),
            Some(K::Drop(r)) => Kind::Drop(r),
            Some(K::Fabric(m)) => Kind::Fabric(m),
        }
    }

    /// The pipeline's action: everything a peer could get wrong is checked (address,
    /// MAC and VNI widths, port and class ranges, an action of no known kind).
    pub(crate) fn convert(self) -> Result<Action, ConvertError> {
        Ok(match self {
            Kind::Unset => return Err(ConvertError::UnknownAction),
            Kind::Decap => Action::DecapVxlan,
            Kind::SetSrc(e) => {
                let (addr, port) = e.convert()?;
                Action::SetSrc { addr, port }
            }
            Kind::SetDst(e) => {
                let (addr, port) = e.convert()?;
                Action::SetDst { addr, port }
            }
            Kind::Encap(e) => Action::EncapVxlan {
                dst: ipv4_from(e.dst)?,
                vni: check_vni(e.vni)?,
                inner_dmac: mac_from(e.dmac)?,
                inner_smac: mac_from(e.smac)?,
            },
            Kind::Count => Action::Count,
            Kind::Police(c) => Action::Police {
                class: narrow("police class", c)?,
            },
            Kind::Offload => Action::Offload,
            Kind::Output(p) => Action::Output(narrow("output port", p)?),
            Kind::Drop(r) => Action::Drop {
                reason: r.to_owned(),
            },
            Kind::Fabric(m) => Action::Fabric {
                peer: mac_from(m)?.ok_or(ConvertError::MacLength(0))?,
            },
        })
    }
}

/// A `v1::Rule` as read so far: its actions already converted (each action is its own
/// message, never merged with another), the first that did not convert kept for the
/// end, when the rule is known to stay.
#[derive(Default)]
struct RuleParts<'a> {
    key: Option<&'a [u8]>,
    /// Inline up to six: a rule of the built-in chains reads without allocating.
    actions: Actions,
    idle_timeout_ms: Option<u64>,
    bad: Option<ConvertError>,
}

impl<'a> RuleParts<'a> {
    fn merge(&mut self, msg: &'a [u8]) -> Read<()> {
        fields(msg, |tag, wt, buf| {
            match tag {
                1 => flow_key(delimited(buf, wt)?, self.key.get_or_insert(&[]))?,
                2 => match action(delimited(buf, wt)?)? {
                    Ok(a) => self.actions.push(a),
                    Err(e) => {
                        self.bad.get_or_insert(e);
                    }
                },
                3 => self.idle_timeout_ms = Some(varint(buf, wt)?),
                _ => skip(buf, tag, wt)?,
            }
            Ok(())
        })
    }

    /// The same checks, in the same order, as `TryFrom<&v1::Rule>`.
    fn convert(self) -> Result<Rule, ConvertError> {
        if let Some(e) = self.bad {
            return Err(e);
        }
        Ok(Rule {
            key: key_from(self.key)?,
            actions: self.actions,
            idle_timeout: self.idle_timeout_ms.map(timeout_from),
        })
    }
}

/// `RuleReply.result` as read so far.
// One lives on the stack per reply read; boxing the rule would put back the allocation
// that holding its actions inline took away.
#[allow(clippy::large_enum_variant)]
enum Outcome<'a> {
    Unset,
    Rule(RuleParts<'a>),
    Error(&'a str),
}

/// Read one `RuleReply` (a message's bytes, without framing) into the pipeline's
/// reply: what `v1::RuleReply::decode` and then `RuleReply::try_from` made of it, in
/// one pass and without the message.
pub fn read_rule_reply(msg: &[u8]) -> Result<ReadReply, ReadError> {
    let mut id = 0;
    let mut worker = 0;
    let mut key: Option<&[u8]> = None;
    let mut outcome = Outcome::Unset;
    let mut also = pipeline::Companions::new();
    let mut also_bad: Option<ConvertError> = None;
    let mut name = "";
    let mut group = 0;
    let mut frame_forwarded = false;
    fields(msg, |tag, wt, buf| {
        match tag {
            1 => id = varint(buf, wt)?,
            2 => flow_key(delimited(buf, wt)?, key.get_or_insert(&[]))?,
            3 => {
                let m = delimited(buf, wt)?;
                if !matches!(outcome, Outcome::Rule(_)) {
                    outcome = Outcome::Rule(RuleParts::default());
                }
                if let Outcome::Rule(r) = &mut outcome {
                    r.merge(m)?;
                }
            }
            4 => outcome = Outcome::Error(string(buf, wt)?),
            5 => {
                let mut r = RuleParts::default();
                r.merge(delimited(buf, wt)?)?;
                match r.convert() {
                    Ok(r) => also.push(r),
                    Err(e) => {
                        also_bad.get_or_insert(e);
                    }
                }
            }
            6 => worker = varint(buf, wt)? as u32,
            7 => name = string(buf, wt)?,
            8 => frame_forwarded = varint(buf, wt)? != 0,
            9 => group = varint(buf, wt)?,
            _ => skip(buf, tag, wt)?,
        }
        Ok(())
    })?;
    // Converted in `TryFrom<v1::RuleReply>`'s order: key, result, companions.
    let key = key_from(key)?;
    let result = match outcome {
        Outcome::Unset => return Err(ConvertError::Missing("result").into()),
        Outcome::Rule(r) => Ok(r.convert()?),
        Outcome::Error(e) => Err(e.to_owned()),
    };
    if let Some(e) = also_bad {
        return Err(e.into());
    }
    // An empty name is an empty `String`, which allocates nothing.
    let decided_by = decided_by(group, name.to_owned());
    Ok(ReadReply {
        id,
        worker,
        reply: RuleReply {
            key,
            result,
            also,
            revoke: false,
            decided_by,
            frame_forwarded,
            inject: None,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use prost::Message;

    use crate::v1::{action, rule_reply};

    /// What the message path made of `b`: decode, then convert. A decode error is only
    /// compared by kind (prost's message names the field path); a conversion error is
    /// compared whole, since both take the checks in the same order.
    fn oracle(b: &[u8]) -> Result<ReadReply, Option<ConvertError>> {
        let m = v1::RuleReply::decode(b).map_err(|_| None)?;
        let (id, worker) = (m.id, m.worker);
        let reply = RuleReply::try_from(m).map_err(Some)?;
        Ok(ReadReply { id, worker, reply })
    }

    fn direct(b: &[u8]) -> Result<ReadReply, Option<ConvertError>> {
        read_rule_reply(b).map_err(|e| match e {
            ReadError::Decode(_) => None,
            ReadError::Convert(c) => Some(c),
        })
    }

    fn bytes_of(lens: &'static [usize], max: usize) -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            proptest::sample::select(lens)
                .prop_flat_map(|n| proptest::collection::vec(any::<u8>(), n)),
            proptest::collection::vec(any::<u8>(), 0..max),
        ]
    }

    fn small_or_any() -> impl Strategy<Value = u32> {
        prop_oneof![0u32..300, any::<u32>()]
    }

    fn endpoint() -> impl Strategy<Value = v1::Endpoint> {
        (
            bytes_of(&[0, 4, 16], 20),
            proptest::option::of(prop_oneof![0u32..70_000, any::<u32>()]),
        )
            .prop_map(|(addr, port)| v1::Endpoint {
                addr: addr.into(),
                port,
            })
    }

    fn kind() -> impl Strategy<Value = action::Kind> {
        prop_oneof![
            Just(action::Kind::Decap(v1::Empty {})),
            endpoint().prop_map(action::Kind::SetSrc),
            endpoint().prop_map(action::Kind::SetDst),
            (
                bytes_of(&[4], 8),
                prop_oneof![0u32..(1 << 24), any::<u32>()],
                bytes_of(&[0, 6], 8),
                bytes_of(&[0, 6], 8)
            )
                .prop_map(|(dst, vni, d, s)| action::Kind::Encap(v1::Encap {
                    dst: dst.into(),
                    vni,
                    inner_dmac: d.into(),
                    inner_smac: s.into(),
                })),
            Just(action::Kind::Count(v1::Empty {})),
            prop_oneof![0u32..70_000, any::<u32>()].prop_map(action::Kind::Police),
            Just(action::Kind::Offload(v1::Empty {})),
            small_or_any().prop_map(action::Kind::Output),
            "[a-z-]{0,12}".prop_map(action::Kind::Drop),
            bytes_of(&[6], 8).prop_map(|m| action::Kind::Fabric(m.into())),
        ]
    }

    fn key() -> impl Strategy<Value = Option<v1::FlowKey>> {
        proptest::option::weighted(
            0.9,
            bytes_of(&[40], 48).prop_map(|raw| v1::FlowKey { raw: raw.into() }),
        )
    }

    /// A `v1::Rule` whose actions are each one or more `Action` messages sent as one
    /// (so merged: a oneof set twice, an endpoint's fields twice).
    #[derive(Debug, Clone)]
    struct RawRule {
        key: Option<v1::FlowKey>,
        actions: Vec<Vec<v1::Action>>,
        idle_timeout_ms: Option<u64>,
    }

    impl RawRule {
        fn encode(&self, tag: u32, buf: &mut Vec<u8>) {
            let mut body = Vec::new();
            if let Some(k) = &self.key {
                encoding::message::encode(1, k, &mut body);
            }
            for parts in &self.actions {
                let a: Vec<u8> = parts.iter().flat_map(|p| p.encode_to_vec()).collect();
                encoding::bytes::encode(2, &a, &mut body);
            }
            if let Some(t) = &self.idle_timeout_ms {
                encoding::uint64::encode(3, t, &mut body);
            }
            encoding::bytes::encode(tag, &body, buf);
        }
    }

    fn rule() -> impl Strategy<Value = RawRule> {
        let part = || proptest::option::weighted(0.95, kind()).prop_map(|kind| v1::Action { kind });
        let action = prop_oneof![
            2 => part().prop_map(|p| vec![p]),
            1 => proptest::collection::vec(part(), 2..4),
        ];
        (
            key(),
            proptest::collection::vec(action, 0..8),
            proptest::option::of(prop_oneof![
                Just(u64::MAX),
                any::<u32>().prop_map(u64::from),
                any::<u64>()
            ]),
        )
            .prop_map(|(key, actions, idle_timeout_ms)| RawRule {
                key,
                actions,
                idle_timeout_ms,
            })
    }

    /// A reply's bytes: its scalar fields and error as prost writes them, then its rule
    /// and companions (protobuf takes fields in any order).
    fn reply() -> impl Strategy<Value = Vec<u8>> {
        (
            (any::<u64>(), key(), any::<u32>(), any::<bool>()),
            proptest::option::weighted(
                0.95,
                prop_oneof![
                    4 => rule().prop_map(Ok),
                    1 => "[a-z-]{0,16}".prop_map(Err),
                ],
            ),
            proptest::collection::vec(rule(), 0..3),
            prop_oneof![Just(String::new()), "[A-Za-z ]{0,12}"],
            prop_oneof![Just(0u64), any::<u64>()],
        )
            .prop_map(
                |(
                    (id, key, worker, frame_forwarded),
                    result,
                    also,
                    decided_by,
                    decided_by_group,
                )| {
                    let (rule, error) = match result {
                        Some(Ok(r)) => (Some(r), None),
                        Some(Err(e)) => (None, Some(rule_reply::Result::Error(e))),
                        None => (None, None),
                    };
                    let mut b = v1::RuleReply {
                        id,
                        key,
                        result: error,
                        also: Vec::new(),
                        worker,
                        decided_by,
                        decided_by_group,
                        frame_forwarded,
                    }
                    .encode_to_vec();
                    if let Some(r) = rule {
                        r.encode(3, &mut b);
                    }
                    for r in &also {
                        r.encode(5, &mut b);
                    }
                    b
                },
            )
    }

    /// How the bytes are damaged or combined before reading.
    #[derive(Debug, Clone)]
    enum Change {
        None,
        /// Another message after it: protobuf merges the two.
        Merge(Vec<u8>),
        Truncate(usize),
        Set(usize, u8),
        Insert(usize, Vec<u8>),
    }

    fn change() -> impl Strategy<Value = Change> {
        prop_oneof![
            3 => Just(Change::None),
            2 => reply().prop_map(Change::Merge),
            1 => any::<usize>().prop_map(Change::Truncate),
            2 => (any::<usize>(), any::<u8>()).prop_map(|(i, v)| Change::Set(i, v)),
            1 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..6)).prop_map(|(i, v)| Change::Insert(i, v)),
        ]
    }

    fn apply(mut b: Vec<u8>, c: &Change) -> Vec<u8> {
        let at = |i: usize, n: usize| if n == 0 { 0 } else { i % n };
        match c {
            Change::None => {}
            Change::Merge(m) => b.extend_from_slice(m),
            Change::Truncate(i) => b.truncate(at(*i, b.len())),
            Change::Set(i, v) => {
                if !b.is_empty() {
                    let i = at(*i, b.len());
                    b[i] = *v;
                }
            }
            Change::Insert(i, v) => {
                let i = at(*i, b.len() + 1);
                b.splice(i..i, v.iter().copied());
            }
        }
        b
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4_000))]

        #[test]
        fn reading_a_reply_is_decoding_then_converting_it(m in reply(), c in change()) {
            let b = apply(m, &c);
            prop_assert_eq!(direct(&b), oracle(&b));
        }
    }

    fn pipeline_rule(n: u8) -> Rule {
        let key: FlowKey = format!("100 tcp 198.18.0.{n}:1000 > 198.19.0.1:80")
            .parse()
            .unwrap();
        Rule::new(
            key,
            pipeline::parse_actions("set-dst 198.19.1.2:8080; count; out 1").unwrap(),
        )
    }

    #[test]
    fn a_decided_reply_reads_back_as_its_rules() {
        let (fwd, rev) = (pipeline_rule(1), pipeline_rule(2));
        let key = v1::FlowKey::from(&fwd.key);
        let d = crate::DecidedReply {
            key: Some(&key),
            rule: &fwd,
            also: Some(&rev),
            group: 3,
        };
        let mut body = Vec::new();
        // FM writes the asker's id and worker around the tail's body.
        encoding::uint64::encode(1, &77, &mut body);
        d.encode(&mut body);
        encoding::uint32::encode(6, &2, &mut body);
        let got = read_rule_reply(&body).unwrap();
        assert_eq!((got.id, got.worker), (77, 2));
        assert_eq!(got.reply.result, Ok(fwd.clone()));
        assert_eq!(got.reply.also.as_slice(), [rev]);
        assert_eq!(got.reply.decided_by, pipeline::DecidedBy::ScGroup(3));
        assert_eq!(got.reply.key, fwd.key);
        assert!(
            !got.reply.result.as_ref().unwrap().actions.spilled(),
            "held inline"
        );
    }

    #[test]
    fn merges_follow_protobuf() {
        let fwd = pipeline_rule(1);
        let one = crate::reply_to_proto(&RuleReply::ok(fwd.clone()), 5, 0);
        // A rule sent twice is one rule with both action lists.
        let mut twice = one.encode_to_vec();
        let mut only_rule = one.clone();
        only_rule.key = None;
        only_rule.id = 0;
        twice.extend(only_rule.encode_to_vec());
        let got = read_rule_reply(&twice).unwrap().reply.result.unwrap();
        assert_eq!(got.actions.len(), 2 * fwd.actions.len());
        // A rule whose action does not convert, replaced by an error: the reply reads.
        let mut bad = one.clone();
        if let Some(rule_reply::Result::Rule(r)) = &mut bad.result {
            r.actions.push(v1::Action {
                kind: Some(action::Kind::Output(1 << 20)),
            });
        }
        let mut b = bad.encode_to_vec();
        assert!(matches!(read_rule_reply(&b), Err(ReadError::Convert(_))));
        let err = v1::RuleReply {
            result: Some(rule_reply::Result::Error("no".into())),
            ..Default::default()
        };
        b.extend(err.encode_to_vec());
        assert_eq!(
            read_rule_reply(&b).unwrap().reply.result,
            Err("no".to_string())
        );
        // Cut short: a decode error, not a panic.
        assert!(matches!(
            read_rule_reply(&b[..b.len() - 1]),
            Err(ReadError::Decode(_))
        ));
    }
}
