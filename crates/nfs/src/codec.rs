//! The byte form of NF state snapshots (and so of scale parts and deltas).
//!
//! Snapshots are written with `postcard`: a compact binary form that encodes and decodes
//! many times faster than JSON. A scale-out part of ~6k flows is encoded while the old
//! owner's request stream waits behind the split op (docs/scaling.md), so this matters.
//! Reading also accepts the JSON form older builds wrote (it starts with `{`, which a
//! postcard snapshot never does: its first byte is the small version number).

use serde::de::DeserializeOwned;

/// Decode a snapshot, binary or JSON. Trailing bytes are an error.
pub(crate) fn decode<T: DeserializeOwned>(b: &[u8]) -> Result<T, String> {
    if b.first() == Some(&b'{') {
        return serde_json::from_slice(b).map_err(|e| e.to_string());
    }
    let (v, rest) = postcard::take_from_bytes(b).map_err(|e| e.to_string())?;
    if !rest.is_empty() {
        return Err(format!("{} trailing bytes after the snapshot", rest.len()));
    }
    Ok(v)
}

/// A `FlowKey` in the binary form: its 40 canonical bytes.
pub(crate) fn serialize_key_bytes<S: serde::Serializer>(
    k: &pipeline::FlowKey,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.serialize_bytes(k.as_bytes())
}

/// Reads what `serialize_key_bytes` wrote; a wrong length is an error.
pub(crate) fn deserialize_key_bytes<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<pipeline::FlowKey, D::Error> {
    struct V;
    impl serde::de::Visitor<'_> for V {
        type Value = pipeline::FlowKey;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "{} bytes of a flow key", pipeline::FlowKey::LEN)
        }
        fn visit_bytes<E: serde::de::Error>(self, b: &[u8]) -> Result<Self::Value, E> {
            let bytes: [u8; pipeline::FlowKey::LEN] = b
                .try_into()
                .map_err(|_| E::invalid_length(b.len(), &self))?;
            Ok(pipeline::FlowKey::from_bytes(bytes))
        }
    }
    d.deserialize_bytes(V)
}
