//! What one SC replica pays per new flow for the built-in chain of `bench setup --nfs
//! builtin` (FW → SNAT → LB), or for one of its NFs alone: resident memory per flow and
//! time per decision, deciding `FLOWS` new flows into empty tables as a replica does
//! (ops of 64 requests at one group-clock time). docs/setup-path.md, "Page faults per
//! flow", uses it to say where the setup path's fresh memory goes.
//!
//!   cargo run --release -p nfs --example state_per_flow -- [all|fw|snat|lb] [FLOWS]

use nf::{Chain, ChainSpec, Egress, FirstPacket, NfEnv};
use pipeline::{FlowKey, PacketMeta};

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

fn chain(which: &str) -> Result<Chain, String> {
    // As `bench setup --nfs builtin`: 32 SNAT addresses, one LB service.
    let addrs: Vec<String> = (1..=32).map(|i| format!("198.19.255.{i}")).collect();
    let fw = serde_json::json!({"kind": "fw", "tenants": [{"tenant": 1,
        "default_action": "allow", "rules": [{"action": "deny", "proto": "tcp", "dport": 23}]}]});
    let snat = serde_json::json!({"kind": "snat", "pools": [{"addresses": addrs,
        "ports": {"lo": 1024, "hi": 65535}}]});
    let lb = serde_json::json!({"kind": "lb", "services": [{"vip": "198.19.200.9", "port": 53,
        "protocol": "udp", "backends": [{"addr": "198.19.1.7", "port": 5353}]}]});
    let cfgs = match which {
        "all" => vec![fw, snat, lb],
        "fw" => vec![fw],
        "snat" => vec![snat],
        "lb" => vec![lb],
        other => return Err(format!("unknown chain {other:?}: all, fw, snat or lb")),
    };
    let n = cfgs.len();
    let mut nfs = Vec::new();
    for c in cfgs {
        let cfg = serde_json::from_value(c).map_err(|e| e.to_string())?;
        nfs.push(nfs::build(&cfg).map_err(|e| e.to_string())?);
    }
    let encap = |dst: [u8; 4], vni| Egress {
        decap: true,
        encap: Some((dst.into(), vni)),
        output: 1,
        ..Egress::LOCAL
    };
    Chain::new(
        nfs,
        ChainSpec::seq(n),
        encap([198, 18, 0, 9], 200),
        encap([198, 18, 0, 50], 100),
    )
    .map_err(|e| e.to_string())
}

fn key(i: u32) -> FlowKey {
    let (a, b, p) = ((i >> 14) & 255, (i >> 6) & 255, 1024 + (i & 63) * 900);
    format!("100 udp 198.18.{a}.{b}:{p} > 198.19.200.9:53")
        .parse()
        .expect("a well-formed flow key")
}

fn main() -> Result<(), String> {
    let which = std::env::args().nth(1).unwrap_or_else(|| "all".into());
    let flows: u32 = match std::env::args().nth(2) {
        Some(s) => s.parse().map_err(|e| format!("FLOWS: {e}"))?,
        None => 200_000,
    };
    if !(1..=4_000_000).contains(&flows) {
        return Err("FLOWS must be 1..=4000000".into());
    }
    let keys: Vec<FlowKey> = (0..flows).map(key).collect();
    let mut chain = chain(&which)?;
    let rss0 = rss_bytes();
    let t = std::time::Instant::now();
    let mut decided = 0u32;
    for (i, k) in keys.iter().enumerate() {
        let p = FirstPacket::new(*k, 1, PacketMeta::new(60, 0));
        let now = (i / 64) as u64;
        if chain
            .decide(&p, &mut NfEnv::new(now, now ^ i as u64))
            .is_ok()
        {
            decided += 1;
        }
    }
    let el = t.elapsed().as_secs_f64();
    println!(
        "{which}: {decided} of {flows} flows decided, {:.0} B resident per flow, {:.2} µs per decision",
        rss_bytes().saturating_sub(rss0) as f64 / f64::from(flows),
        el * 1e6 / f64::from(flows)
    );
    Ok(())
}
