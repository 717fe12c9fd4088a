//! JSON views of FM's replies: the one format `starfabric scale|events -o json` prints
//! and the testbed and scripts parse. Hash bounds are also given as hex strings where a
//! reader whose JSON numbers are doubles would lose their low bits.

use serde_json::{json, Value};

use crate::v1;

/// The vIP table (`testbed::elastic::VipMap` parses it).
pub fn vip_map(r: &v1::VipMapReply) -> Value {
    json!({
        "epoch": r.epoch,
        "moves": r.moves,
        "nodes": r.nodes,
        "draining": r.draining,
        "vips": r.vips.iter().map(|o| {
            let v = o.vip.clone().unwrap_or_default();
            json!({
                "index": v.index,
                "ip": v.ip,
                "mac": v.mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":"),
                "node": if o.node.is_empty() { Value::Null } else { Value::String(o.node.clone()) },
            })
        }).collect::<Vec<_>>(),
    })
}

/// A scale's outcome (`testbed::elastic::ScaleResult` parses it). Hash bounds are also given as hex strings: a reader in a
/// language whose JSON numbers are doubles would lose their low bits.
pub fn scale_reply(r: &v1::ScaleReply) -> Value {
    let kind = match v1::ScaleKind::try_from(r.kind) {
        Ok(v1::ScaleKind::Out) => "out",
        Ok(v1::ScaleKind::In) => "in",
        _ => "unspecified",
    };
    json!({
        "scale_id": r.scale_id,
        "kind": kind,
        "from_group": r.from_group,
        "to_group": r.to_group,
        "moved_lo": r.moved_lo,
        "moved_hi": r.moved_hi,
        "moved_range": format!("{:#018x}..={:#018x}", r.moved_lo, r.moved_hi),
        "aborted": if r.aborted.is_empty() { Value::Null } else { Value::String(r.aborted.clone()) },
        "st_to_fin_us": r.st_to_fin_us,
    })
}

/// The partition map (`testbed::elastic::PartitionMap` parses it).
pub fn partition_map(m: &v1::PartitionMap) -> Value {
    json!({
        "version": m.version,
        "partitions": m.partitions.iter().map(|p| json!({
            "tenant": p.tenant, "chain": p.chain, "hash_lo": p.hash_lo,
            "hash_hi": p.hash_hi, "group": p.group,
        })).collect::<Vec<_>>(),
        "groups": m.groups.iter().map(|g| json!({
            "id": g.id, "epoch": g.epoch,
            "replicas": g.replicas.iter().map(|r| json!({
                "node_id": r.node_id, "addr": r.addr,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

/// One event of FM's log: what `starfabric events -o json` prints a line of.
pub fn fm_event(e: &v1::FmEvent) -> Value {
    let detail = if e.detail_json.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&e.detail_json)
            .unwrap_or_else(|_| Value::String(e.detail_json.clone()))
    };
    json!({
        "seq": e.seq,
        "unix_ms": e.unix_ms,
        "time": utc(e.unix_ms),
        "kind": e.kind,
        "message": e.message,
        "detail": detail,
    })
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` (no date crate for one format).
pub fn utc(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        unix_ms % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_json_names_the_kind_and_keeps_full_u64_bounds() {
        let r = v1::ScaleReply {
            scale_id: 7,
            kind: v1::ScaleKind::Out as i32,
            from_group: 1,
            to_group: 2,
            moved_lo: 0,
            moved_hi: u64::MAX / 2,
            aborted: String::new(),
            st_to_fin_us: 1234,
        };
        let v = scale_reply(&r);
        assert_eq!(v["kind"], "out");
        assert_eq!(v["moved_hi"].as_u64(), Some(u64::MAX / 2));
        assert!(v["aborted"].is_null());
        let r = v1::ScaleReply {
            aborted: "group 2 lost a replica".into(),
            kind: v1::ScaleKind::In as i32,
            ..r
        };
        let v = scale_reply(&r);
        assert_eq!(v["kind"], "in");
        assert_eq!(v["aborted"], "group 2 lost a replica");
    }
    #[test]
    fn utc_times() {
        assert_eq!(utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(utc(1_795_000_000_000), "2026-11-18T11:06:40.000Z");
    }
}
