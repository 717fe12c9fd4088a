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
//! Decoding fills `replies` only: a batch read off the wire has every reply there.
//! [`RuleReplyBatch::into_replies`] also decodes the `encoded` ones, for a batch
//! handed over in memory.

use std::sync::Arc;

use prost::bytes::{Buf, BufMut};
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
}

impl RuleReplyBatch {
    /// A batch of decoded replies.
    pub fn new(replies: Vec<RuleReply>) -> Self {
        RuleReplyBatch {
            replies,
            encoded: Vec::new(),
        }
    }

    /// Replies in the batch, of either kind.
    pub fn len(&self) -> usize {
        self.replies.len() + self.encoded.len()
    }

    pub fn is_empty(&self) -> bool {
        self.replies.is_empty() && self.encoded.is_empty()
    }

    /// Every reply as a message: `replies`, then the `encoded` ones decoded, in the
    /// order the wire carries them.
    pub fn into_replies(self) -> Result<Vec<RuleReply>, DecodeError> {
        let mut out = self.replies;
        out.reserve_exact(self.encoded.len());
        for e in &self.encoded {
            out.push(e.decode()?);
        }
        Ok(out)
    }
}

impl Message for RuleReplyBatch {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        encoding::message::encode_repeated(1, &self.replies, buf);
        for e in &self.encoded {
            encoding::encode_key(1, WireType::LengthDelimited, buf);
            encoding::encode_varint(e.inner_len() as u64, buf);
            if e.id != 0 {
                encoding::uint64::encode(1, &e.id, buf);
            }
            buf.put_slice(&e.body);
            if e.worker != 0 {
                encoding::uint32::encode(6, &e.worker, buf);
            }
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        match tag {
            1 => encoding::message::merge_repeated(wire_type, &mut self.replies, buf, ctx).map_err(
                |mut e| {
                    e.push("RuleReplyBatch", "replies");
                    e
                },
            ),
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
    }

    fn clear(&mut self) {
        self.replies.clear();
        self.encoded.clear();
    }
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
        assert_eq!(ours_back.replies, cases);
        assert!(ours_back.encoded.is_empty());
        assert_eq!(ours.clone().into_replies().unwrap(), cases);
        assert_eq!(ours.len(), 4);
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
            encoded: vec![EncodedReply {
                id: 1,
                worker: 0,
                body: Arc::from(&[0x12u8, 0x7f][..]),
            }],
        };
        assert!(bad.into_replies().is_err());
    }
}
