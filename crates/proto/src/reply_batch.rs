//! `starfabric.v1.RuleReplyBatch`, written out rather than generated (`build.rs` maps
//! the message here with `extern_path`, and [`crate::v1`] re-exports it), so that FM can
//! send a reply it has already encoded.
//!
//! FM encodes every rule it caches (`fm::cache`). It then sent the same reply to the
//! asking PP node as a message, which tonic encoded again, and prost computes a nested
//! message's length once per enclosing level on the way: the `Rule` inside a
//! `RuleReply` inside this batch inside a `PpDown` had its length walked seven times per
//! flow, the largest single cost on FM's thread in `bench setup`. An
//! [`EncodedReply`] is the cached bytes (a reference count, not a copy; an `Arc` rather
//! than a `Bytes`, whose first clone of an owned buffer allocates) plus the two
//! fields that are the asker's, id and worker, which the cached body leaves out; it
//! goes on the wire as one `RuleReply`, and nothing on the receiving side can tell.
//!
//! Decoding fills `wire` only: each reply's bytes, a slice of the receive buffer (a
//! reference count), not yet read. PP reads them straight into the pipeline's replies
//! ([`crate::read_rule_reply`]), with no message in between;
//! [`RuleReplyBatch::into_replies`] decodes every kind into messages, for tests and
//! tools.
//!
//! Each reply is read on its own. FM passes the SC tail's encoding of a rule on
//! without decoding it (`encoded_rules.rs`), so a reply that does not read (a bug at
//! the node that made it) must cost its own flow only, not the batch and the session
//! it came in: the batch's framing holds its length, so the reader counts it and goes
//! on. When the reply's own top level still reads (its id, worker and key, which FM
//! writes around the body), it becomes an error reply ([`crate::ERR_BAD_SC_REPLY`],
//! [`refusal_of`]) for that flow, so the asker releases what it holds for it and asks
//! again.

use std::sync::Arc;

use prost::bytes::{Buf, BufMut, Bytes};
use prost::encoding::{self, DecodeContext, WireType};
use prost::{DecodeError, Message};

use crate::v1::RuleReply;

/// A `RuleReply` already encoded, but for the fields that name its asker.
#[derive(Clone, PartialEq, Debug, Default)]
pub struct EncodedReply {
    /// `RuleReply.id`: the asker's request id.
    pub id: u64,
    /// `RuleReply.worker`: the asker's pipeline worker.
    pub worker: u32,
    /// Every other field of the reply, encoded, with `id` and `worker` left at zero
    /// (so absent, as proto3 leaves defaults out). Protobuf takes a message's fields in
    /// any order, so the two are written around it.
    pub body: Arc<[u8]>,
}

impl EncodedReply {
    /// The reply's encoded length, without the batch's tag and length prefix.
    fn inner_len(&self) -> usize {
        let id = if self.id != 0 {
            encoding::uint64::encoded_len(1, &self.id)
        } else {
            0
        };
        let worker = if self.worker != 0 {
            encoding::uint32::encoded_len(6, &self.worker)
        } else {
            0
        };
        id + self.body.len() + worker
    }

    /// The reply's fields, without the batch's tag and length prefix.
    fn encode_inner(&self, buf: &mut impl BufMut) {
        if self.id != 0 {
            encoding::uint64::encode(1, &self.id, buf);
        }
        buf.put_slice(&self.body);
        if self.worker != 0 {
            encoding::uint32::encode(6, &self.worker, buf);
        }
    }

    /// The reply as a message.
    pub fn decode(&self) -> Result<RuleReply, DecodeError> {
        let mut r = RuleReply::decode(&self.body[..])?;
        r.id = self.id;
        r.worker = self.worker;
        Ok(r)
    }
}

/// Rule replies for one PP session.
#[derive(Clone, PartialEq, Default, Debug)]
pub struct RuleReplyBatch {
    pub replies: Vec<RuleReply>,
    /// Replies sent as they were encoded, after `replies`. Never filled by decoding.
    pub encoded: Vec<EncodedReply>,
    /// Replies as they came off the wire, each one `RuleReply`'s bytes, not yet read:
    /// all a decoded batch has. Sent after the others, as they are.
    pub wire: Vec<Bytes>,
}

impl RuleReplyBatch {
    /// A batch of decoded replies.
    pub fn new(replies: Vec<RuleReply>) -> Self {
        RuleReplyBatch {
            replies,
            encoded: Vec::new(),
            wire: Vec::new(),
        }
    }

    /// Replies in the batch, of any kind.
    pub fn len(&self) -> usize {
        self.replies.len() + self.encoded.len() + self.wire.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every reply as a message, in the order the wire carries them: `replies`, the
    /// `encoded` ones decoded, then the `wire` ones. A `wire` reply that does not
    /// decode becomes its [`refusal_of`], or is left out without an id.
    pub fn into_replies(self) -> Result<Vec<RuleReply>, DecodeError> {
        self.into_replies_counted().map(|(r, _)| r)
    }

    /// [`Self::into_replies`], with the number of `wire` replies that did not decode.
    pub fn into_replies_counted(self) -> Result<(Vec<RuleReply>, u32), DecodeError> {
        let mut out = self.replies;
        out.reserve_exact(self.encoded.len() + self.wire.len());
        for e in &self.encoded {
            out.push(e.decode()?);
        }
        let mut unreadable = 0;
        for b in &self.wire {
            match RuleReply::decode(&b[..]) {
                Ok(r) => out.push(r),
                Err(_) => {
                    unreadable += 1;
                    out.extend(refusal_of(b));
                }
            }
        }
        Ok((out, unreadable))
    }

    /// Every reply as its bytes, in the order the wire carries them: what a batch read
    /// off the wire has already, and the others encoded.
    pub fn into_wire(self) -> Vec<Bytes> {
        if self.replies.is_empty() && self.encoded.is_empty() {
            return self.wire;
        }
        let mut out: Vec<Bytes> = self
            .replies
            .iter()
            .map(|r| r.encode_to_vec().into())
            .collect();
        for e in &self.encoded {
            let mut b = Vec::with_capacity(e.inner_len());
            e.encode_inner(&mut b);
            out.push(b.into());
        }
        out.extend(self.wire);
        out
    }
}

impl Message for RuleReplyBatch {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        encoding::message::encode_repeated(1, &self.replies, buf);
        for e in &self.encoded {
            encoding::encode_key(1, WireType::LengthDelimited, buf);
            encoding::encode_varint(e.inner_len() as u64, buf);
            e.encode_inner(buf);
        }
        for b in &self.wire {
            encoding::encode_key(1, WireType::LengthDelimited, buf);
            encoding::encode_varint(b.len() as u64, buf);
            buf.put_slice(b);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        let field_err = |mut e: DecodeError| {
            e.push("RuleReplyBatch", "replies");
            e
        };
        match tag {
            1 => {
                // The reply's bytes, by the batch's framing (an error here is the
                // batch's: nothing after it can be found).
                encoding::check_wire_type(WireType::LengthDelimited, wire_type)
                    .map_err(field_err)?;
                let len = encoding::decode_varint(buf).map_err(field_err)?;
                if len > buf.remaining() as u64 {
                    return Err(field_err(DecodeError::new("buffer underflow")));
                }
                self.wire.push(buf.copy_to_bytes(len as usize));
                Ok(())
            }
            _ => encoding::skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        encoding::message::encoded_len_repeated(1, &self.replies)
            + self
                .encoded
                .iter()
                .map(|e| {
                    let n = e.inner_len();
                    encoding::key_len(1) + encoding::encoded_len_varint(n as u64) + n
                })
                .sum::<usize>()
            + self
                .wire
                .iter()
                .map(|b| {
                    encoding::key_len(1) + encoding::encoded_len_varint(b.len() as u64) + b.len()
                })
                .sum::<usize>()
    }

    fn clear(&mut self) {
        self.replies.clear();
        self.encoded.clear();
        self.wire.clear();
    }
}

/// An error reply ([`crate::ERR_BAD_SC_REPLY`]) for a reply that does not decode, if
/// its top level still reads: its id, worker and key. `None` without an id.
pub fn refusal_of(mut bytes: &[u8]) -> Option<RuleReply> {
    let mut r = RuleReply {
        result: Some(crate::v1::rule_reply::Result::Error(
            crate::ERR_BAD_SC_REPLY.into(),
        )),
        ..Default::default()
    };
    let mut id = None;
    let buf = &mut bytes;
    while buf.has_remaining() {
        let (tag, wt) = encoding::decode_key(buf).ok()?;
        match (tag, wt) {
            (1, WireType::Varint) => id = Some(encoding::decode_varint(buf).ok()?),
            (6, WireType::Varint) => r.worker = encoding::decode_varint(buf).ok()? as u32,
            (2, WireType::LengthDelimited) => {
                let len = encoding::decode_varint(buf).ok()?;
                if len > buf.len() as u64 {
                    return None;
                }
                let (key, rest) = buf.split_at(len as usize);
                r.key = crate::v1::FlowKey::decode(key).ok();
                *buf = rest;
            }
            _ => encoding::skip_field(wt, tag, buf, DecodeContext::default()).ok()?,
        }
    }
    r.id = id?;
    Some(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{rule_reply, Action, FlowKey, Rule};

    /// What prost's derive makes of the same message.
    #[derive(Clone, PartialEq, prost::Message)]
    struct Derived {
        #[prost(message, repeated, tag = "1")]
        replies: Vec<RuleReply>,
    }

    fn reply(id: u64, worker: u32, group: u64) -> RuleReply {
        RuleReply {
            id,
            key: Some(FlowKey {
                raw: vec![id as u8; 40].into(),
            }),
            result: Some(rule_reply::Result::Rule(Rule {
                key: Some(FlowKey {
                    raw: vec![3; 40].into(),
                }),
                actions: vec![
                    Action {
                        kind: Some(crate::v1::action::Kind::Output(1)),
                    };
                    5
                ],
                idle_timeout_ms: Some(30_000),
            })),
            worker,
            decided_by_group: group,
            ..Default::default()
        }
    }

    /// `r` as FM caches it: every field but the asker's.
    fn encoded(r: &RuleReply) -> EncodedReply {
        let mut body = r.clone();
        body.id = 0;
        body.worker = 0;
        EncodedReply {
            id: r.id,
            worker: r.worker,
            body: body.encode_to_vec().into(),
        }
    }

    #[test]
    fn an_encoded_reply_reads_back_as_the_reply() {
        // Zero id and worker are left out, as proto3 leaves defaults out; a wide id
        // takes a ten-byte varint.
        let cases = [
            reply(7, 1, 3),
            reply(0, 0, 3),
            reply(u64::MAX, u32::MAX, 0),
            reply(1 << 40, 0, 9),
        ];
        let ours = RuleReplyBatch {
            replies: vec![cases[0].clone()],
            encoded: cases[1..].iter().map(encoded).collect(),
            wire: Vec::new(),
        };
        let wire = ours.encode_to_vec();
        assert_eq!(wire.len(), ours.encoded_len());
        // The derived message encodes the same replies to the same bytes, but for the
        // order of fields within a spliced reply.
        let theirs = Derived {
            replies: cases.to_vec(),
        };
        assert_eq!(theirs.encoded_len(), ours.encoded_len());
        let back = Derived::decode(&wire[..]).unwrap();
        assert_eq!(back.replies, cases);
        let ours_back = RuleReplyBatch::decode(&wire[..]).unwrap();
        assert!(ours_back.replies.is_empty() && ours_back.encoded.is_empty());
        assert_eq!(ours_back.len(), 4, "every reply kept as its bytes");
        // Sent on again, a decoded batch is the same bytes.
        assert_eq!(ours_back.encode_to_vec(), wire);
        assert_eq!(ours_back.encoded_len(), wire.len());
        assert_eq!(ours_back.clone().into_replies().unwrap(), cases);
        assert_eq!(ours.clone().into_replies().unwrap(), cases);
        assert_eq!(ours.len(), 4);
        // As bytes, in memory or off the wire, each reply reads as the message.
        for b in [ours.into_wire(), ours_back.into_wire()] {
            let read: Vec<RuleReply> = b
                .iter()
                .map(|b| RuleReply::decode(&b[..]).unwrap())
                .collect();
            assert_eq!(read, cases);
        }
    }

    #[test]
    fn decoded_replies_encode_as_the_derived_message_does() {
        let replies = vec![reply(1, 2, 3), reply(4, 0, 0)];
        let ours = RuleReplyBatch::new(replies.clone());
        let theirs = Derived { replies };
        assert_eq!(ours.encode_to_vec(), theirs.encode_to_vec());
        assert_eq!(RuleReplyBatch::default().encode_to_vec(), Vec::<u8>::new());
    }

    #[test]
    fn bad_input_is_an_error_naming_the_field() {
        // Field 1 as a varint: the wrong wire type.
        let e = RuleReplyBatch::decode(&[0x08, 0x01][..]).unwrap_err();
        assert!(e.to_string().contains("RuleReplyBatch.replies"), "{e}");
        // A truncated reply.
        assert!(RuleReplyBatch::decode(&[0x0a, 0x05, 0x08][..]).is_err());
        // An unknown field is skipped.
        let b = RuleReplyBatch::decode(&[0x10, 0x05][..]).unwrap();
        assert!(b.is_empty());
        // A corrupt cached body is an error when decoded in memory, not a panic.
        let bad = RuleReplyBatch {
            replies: vec![],
            wire: vec![],
            encoded: vec![EncodedReply {
                id: 1,
                worker: 0,
                body: Arc::from(&[0x12u8, 0x7f][..]),
            }],
        };
        assert!(bad.into_replies().is_err());
    }

    #[test]
    fn a_reply_that_does_not_read_costs_its_own_flow_only() {
        // Three replies on the wire; the middle one's rule holds an action that is a
        // truncated varint (it frames, but does not decode). FM writes the asker's id
        // and worker around the body, so they still read.
        let mut body = reply(0, 0, 3);
        body.result = None;
        let mut bad_body = body.encode_to_vec();
        bad_body.extend_from_slice(&[0x1a, 0x04, 0x12, 0x02, 0x08, 0x80]);
        let batch = RuleReplyBatch {
            replies: vec![reply(1, 2, 3)],
            encoded: vec![
                EncodedReply {
                    id: 9,
                    worker: 4,
                    body: Arc::from(&bad_body[..]),
                },
                encoded(&reply(10, 1, 3)),
            ],
            wire: vec![],
        };
        let wire = batch.encode_to_vec();
        let back = RuleReplyBatch::decode(&wire[..]).unwrap();
        assert_eq!(
            back.wire.len(),
            3,
            "the batch reads; its replies are read one by one"
        );
        let (replies, unreadable) = back.into_replies_counted().unwrap();
        assert_eq!(unreadable, 1);
        assert_eq!(replies.len(), 3);
        assert_eq!(replies[0], reply(1, 2, 3));
        assert_eq!(replies[2], reply(10, 1, 3));
        let refused = &replies[1];
        assert_eq!((refused.id, refused.worker), (9, 4));
        assert_eq!(
            refused.key, body.key,
            "the key is kept, for the asker to release"
        );
        assert_eq!(
            refused.result,
            Some(rule_reply::Result::Error(crate::ERR_BAD_SC_REPLY.into()))
        );
        // Without a readable id there is no flow to answer: counted only.
        let mut wire = Vec::new();
        encoding::encode_key(1, WireType::LengthDelimited, &mut wire);
        encoding::encode_varint(2, &mut wire);
        wire.extend_from_slice(&[0x08, 0x80]);
        let (replies, unreadable) = RuleReplyBatch::decode(&wire[..])
            .unwrap()
            .into_replies_counted()
            .unwrap();
        assert_eq!((unreadable, replies.len()), (1, 0));
    }
}
