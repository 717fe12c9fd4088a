//! `starfabric.v1.Rule`, written out rather than generated (`build.rs` maps the message
//! here with `extern_path`, and [`crate::v1`] re-exports it).
//!
//! prost decodes a repeated field by pushing onto an empty `Vec`: room for four, then a
//! move to eight. A rule of the built-in chain carries six actions (decap, two rewrites,
//! encap, count, output), and PP and FM each decode two rules per flow, so that was two
//! allocations per rule where one does. This type makes room for eight at the first
//! action. Everything else is what prost's derive generates for the message, and the
//! tests check the bytes both ways against a derived twin.

use prost::bytes::{Buf, BufMut};
use prost::encoding::{self, DecodeContext, WireType};
use prost::DecodeError;

use crate::v1::{Action, FlowKey};

/// Room made for a rule's actions when its first one is decoded.
const ACTIONS_AT_FIRST: usize = 8;

/// A match plus a composed action list.
#[derive(Clone, PartialEq, Default, Debug)]
pub struct Rule {
    pub key: Option<FlowKey>,
    pub actions: Vec<Action>,
    /// Absent: PP's default. u64::MAX: never expires.
    pub idle_timeout_ms: Option<u64>,
}

impl prost::Message for Rule {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if let Some(k) = &self.key {
            encoding::message::encode(1, k, buf);
        }
        encoding::message::encode_repeated(2, &self.actions, buf);
        if let Some(t) = &self.idle_timeout_ms {
            encoding::uint64::encode(3, t, buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        let field = |mut e: DecodeError, name| {
            e.push("Rule", name);
            e
        };
        match tag {
            1 => encoding::message::merge(
                wire_type,
                self.key.get_or_insert_with(Default::default),
                buf,
                ctx,
            )
            .map_err(|e| field(e, "key")),
            2 => {
                if self.actions.capacity() == 0 {
                    self.actions.reserve_exact(ACTIONS_AT_FIRST);
                }
                encoding::message::merge_repeated(wire_type, &mut self.actions, buf, ctx)
                    .map_err(|e| field(e, "actions"))
            }
            3 => {
                encoding::uint64::merge(wire_type, self.idle_timeout_ms.get_or_insert(0), buf, ctx)
                    .map_err(|e| field(e, "idle_timeout_ms"))
            }
            _ => encoding::skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        self.key
            .as_ref()
            .map_or(0, |k| encoding::message::encoded_len(1, k))
            + encoding::message::encoded_len_repeated(2, &self.actions)
            + self
                .idle_timeout_ms
                .as_ref()
                .map_or(0, |t| encoding::uint64::encoded_len(3, t))
    }

    fn clear(&mut self) {
        self.key = None;
        self.actions.clear();
        self.idle_timeout_ms = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// What prost's derive makes of the same message.
    #[derive(Clone, PartialEq, prost::Message)]
    struct Derived {
        #[prost(message, optional, tag = "1")]
        key: Option<FlowKey>,
        #[prost(message, repeated, tag = "2")]
        actions: Vec<Action>,
        #[prost(uint64, optional, tag = "3")]
        idle_timeout_ms: Option<u64>,
    }

    fn actions(n: u32) -> Vec<Action> {
        (0..n)
            .map(|i| Action {
                kind: Some(crate::v1::action::Kind::Output(i)),
            })
            .collect()
    }

    #[test]
    fn same_bytes_as_the_derived_message() {
        for (key, n, t) in [
            (None, 0, None),
            (Some(vec![7u8; 40]), 6, Some(30_000)),
            (Some(vec![1u8; 40]), 9, Some(u64::MAX)),
            (None, 1, Some(0)),
        ] {
            let key = key.map(|k| FlowKey { raw: k.into() });
            let ours = Rule {
                key: key.clone(),
                actions: actions(n),
                idle_timeout_ms: t,
            };
            let theirs = Derived {
                key,
                actions: actions(n),
                idle_timeout_ms: t,
            };
            let (a, b) = (ours.encode_to_vec(), theirs.encode_to_vec());
            assert_eq!(a, b);
            assert_eq!(ours.encoded_len(), theirs.encoded_len());
            let back = Rule::decode(&b[..]).unwrap();
            assert_eq!(back, ours);
            assert_eq!(Derived::decode(&a[..]).unwrap(), theirs);
        }
    }

    #[test]
    fn six_actions_take_one_allocation() {
        let wire = Rule {
            key: None,
            actions: actions(6),
            idle_timeout_ms: None,
        }
        .encode_to_vec();
        let r = Rule::decode(&wire[..]).unwrap();
        assert_eq!(r.actions.len(), 6);
        assert_eq!(r.actions.capacity(), ACTIONS_AT_FIRST);
    }

    #[test]
    fn bad_input_is_an_error_naming_the_field() {
        // Field 2 (actions) as a varint: the wrong wire type.
        let e = Rule::decode(&[0x10, 0x01][..]).unwrap_err();
        assert!(e.to_string().contains("Rule.actions"), "{e}");
        // A truncated length-delimited key.
        assert!(Rule::decode(&[0x0a, 0x05, 0x01][..]).is_err());
        // An unknown field is skipped, as the derived message does.
        let r = Rule::decode(&[0x20, 0x05][..]).unwrap();
        assert_eq!(r, Rule::default());
    }
}
