//! `starfabric trace`: arm a packet trace on PP nodes, print each traced packet's
//! stages (like `vppctl show trace`), and optionally write the frames as pcapng.
//!
//! The CLI talks to each PP node's HTTP endpoint (the one serving `/metrics`, see
//! `pp::trace`): `--node ADDR` names one; without it, the orchestrator's `/v1/status`
//! lists the PP nodes and their metrics URLs, as `starfabric status` shows them.
//!
//! The match expression is parsed here first: a bad one is an error before any node
//! is asked, so nothing is armed.
//!
//! pcapng layout: one section, three interfaces, every packet's frames in order:
//! `outer` (0), the frame as the PP node received it (VXLAN-encapsulated tenant
//! traffic); `inner` (1), the frame inside the VXLAN header; `out` (2), the frame the
//! node transmitted after the rule's actions (none for a held or dropped packet). Each
//! packet block's comment carries the stage summary (`pkt 3 tenant 1 vni 100: hit entry
//! 17 -> tx 0`). Frames are cut at the snap length; the original length is kept.

use std::collections::HashSet;
use std::io::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use base64::Engine as _;
use clap::Args;
use pcap_file::pcapng::blocks::enhanced_packet::{EnhancedPacketBlock, EnhancedPacketOption};
use pcap_file::pcapng::blocks::interface_description::{
    InterfaceDescriptionBlock, InterfaceDescriptionOption,
};
use pcap_file::pcapng::PcapNgWriter;
use pcap_file::DataLink;
use serde_json::{json, Value};

/// `starfabric trace`'s flags.
#[derive(Args, Debug, Clone)]
pub struct TraceArgs {
    /// The tenant: its name (looked up in the orchestrator) or its number.
    #[arg(long, required_unless_present = "vni")]
    pub tenant: Option<String>,
    /// Only packets on this VNI (also traces VNIs bound to no tenant, such as a
    /// gateway's replies).
    #[arg(long)]
    pub vni: Option<u32>,
    /// A tcpdump-like expression on the inner 5-tuple: tcp, udp, icmp, icmp6, ip, ip6,
    /// proto N, [src|dst] host A, [src|dst] port N, and, or, not, ( ).
    #[arg(long = "match", value_name = "EXPR")]
    pub expr: Option<String>,
    /// Packets to trace (per node).
    #[arg(long, default_value_t = 10)]
    pub count: u64,
    /// Write the traced frames (outer, inner, out) as pcapng to FILE.
    #[arg(long, value_name = "FILE")]
    pub pcap: Option<PathBuf>,
    /// A PP node's HTTP endpoint (`host:port` or its `/metrics` URL); default: every
    /// PP node the orchestrator lists.
    #[arg(long, value_name = "ADDR")]
    pub node: Vec<String>,
    /// Bytes of each frame to keep.
    #[arg(long, default_value_t = 256)]
    pub snaplen: u32,
    /// Give up (and disarm) after this many seconds.
    #[arg(long, default_value_t = 60.0)]
    pub timeout: f64,
}

/// Run `starfabric trace`. `client` is asked for only when the tenant is a name or no
/// `--node` is given.
pub fn run(
    a: TraceArgs,
    client: impl FnOnce() -> Result<crate::cli::Client>,
    output: crate::cli::Output,
) -> Result<()> {
    let expr = a.expr.clone().unwrap_or_default();
    // Checked before anything is armed.
    pipeline::Expr::parse(&expr).map_err(|e| anyhow!("--match '{expr}': {e}"))?;
    if a.count == 0 {
        bail!("--count must be at least 1");
    }
    // The orchestrator is asked only for a tenant's name or the node list.
    // Called at most once: the client made for a tenant's name is kept for the nodes.
    let mut make = Some(client);
    let mut orchestrator =
        || -> Result<crate::cli::Client> { (make.take().expect("made once, then kept"))() };
    let mut kept = None;
    let tenant: Option<u32> = match &a.tenant {
        None => None,
        Some(t) => match t.parse::<u32>() {
            Ok(n) => Some(n),
            Err(_) => {
                let c = orchestrator()?;
                let v = c
                    .call("GET", &format!("/v1/tenants/{t}"), None)
                    .with_context(|| format!("tenant {t}"))?;
                let id = v["id"]
                    .as_u64()
                    .ok_or_else(|| anyhow!("tenant {t}: the orchestrator gave no id"))?;
                kept = Some(c);
                Some(id as u32)
            }
        },
    };
    let nodes: Vec<String> = if a.node.is_empty() {
        let c = match kept.take() {
            Some(c) => c,
            None => orchestrator()?,
        };
        let v = c.call("GET", "/v1/status", None)?;
        let urls: Vec<String> = v["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|n| {
                n["role"]
                    .as_str()
                    .is_some_and(|r| r.eq_ignore_ascii_case("pp"))
            })
            .filter_map(|n| n["metrics_url"].as_str().map(base_url))
            .filter(|u| !u.is_empty())
            .collect();
        if urls.is_empty() {
            bail!("no PP node with an HTTP endpoint in the orchestrator's status (run PP nodes with --metrics, or give --node)");
        }
        urls
    } else {
        a.node.iter().map(|n| base_url(n)).collect()
    };
    let body = json!({
        "tenant": tenant,
        "vni": a.vni,
        "match": expr,
        "count": a.count,
        "snaplen": a.snaplen,
    });
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(10))
        .build();
    let mut armed = Vec::new();
    for n in &nodes {
        match agent
            .post(&format!("{n}/trace"))
            .set("content-type", "application/json")
            .send_string(&body.to_string())
        {
            Ok(r) => {
                let v: Value = serde_json::from_str(&r.into_string()?)?;
                armed.push((n.clone(), v["id"].as_u64().unwrap_or(0)));
            }
            Err(ureq::Error::Status(code, r)) => {
                let msg = r.into_string().unwrap_or_default();
                disarm(&agent, &armed);
                bail!("{n}: arming the trace failed ({code}): {msg}");
            }
            Err(e) => {
                disarm(&agent, &armed);
                bail!("{n}: {e}");
            }
        }
    }
    let json_out = output == crate::cli::Output::Json;
    if !json_out {
        let scope = match (&a.tenant, tenant, a.vni) {
            (Some(name), Some(id), v) => {
                let t = if *name == id.to_string() {
                    format!("tenant {id}")
                } else {
                    format!("tenant {name} ({id})")
                };
                match v {
                    Some(v) => format!("{t}, vni {v}"),
                    None => t,
                }
            }
            (_, _, Some(v)) => format!("vni {v}"),
            _ => "every tenant".into(),
        };
        println!(
            "tracing {} packets of {scope}{} on {}; packets the XDP fast path forwards are not seen",
            a.count,
            if expr.is_empty() { String::new() } else { format!(" matching '{expr}'") },
            nodes.join(", ")
        );
        std::io::stdout().flush()?;
    }
    let mut pcap = match &a.pcap {
        Some(path) => Some(Pcap::create(path, a.snaplen)?),
        None => None,
    };
    let deadline = Instant::now() + Duration::from_secs_f64(a.timeout.max(0.1));
    let mut packets: Vec<u64> = vec![0; armed.len()];
    let mut finished: HashSet<usize> = HashSet::new();
    let mut lost = 0u64;
    while finished.len() < armed.len() {
        if Instant::now() >= deadline {
            if !json_out {
                println!("timed out after {} s", a.timeout);
            }
            break;
        }
        for (i, (n, id)) in armed.iter().enumerate() {
            if finished.contains(&i) {
                continue;
            }
            let v: Value = match agent.get(&format!("{n}/trace?wait_ms=200")).call() {
                Ok(r) => serde_json::from_str(&r.into_string()?)?,
                Err(e) => bail!("{n}: reading the trace: {e}"),
            };
            if v["id"].as_u64() != Some(*id) {
                bail!("{n}: another trace replaced this one");
            }
            for r in v["records"].as_array().into_iter().flatten() {
                if json_out {
                    let mut r = r.clone();
                    r["node"] = json!(n);
                    println!("{r}");
                } else {
                    print!("{}", render(n, r));
                }
                if r["kind"] == "packet" {
                    packets[i] += 1;
                    if let Some(p) = pcap.as_mut() {
                        p.write(r)?;
                    }
                }
            }
            std::io::stdout().flush()?;
            lost = lost.max(v["lost"].as_u64().unwrap_or(0));
            if v["done"] == true {
                finished.insert(i);
            }
        }
    }
    let unfinished: Vec<(String, u64)> = armed
        .iter()
        .enumerate()
        .filter(|(i, _)| !finished.contains(i))
        .map(|(_, a)| a.clone())
        .collect();
    disarm(&agent, &unfinished);
    if let Some(p) = pcap {
        let n = p.finish()?;
        if !json_out {
            println!(
                "wrote {n} frames of {} packets to {}",
                packets.iter().sum::<u64>(),
                a.pcap
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default()
            );
        }
    }
    if lost > 0 {
        eprintln!("warning: {lost} trace records were lost (the node's trace ring was full)");
    }
    Ok(())
}

fn disarm(agent: &ureq::Agent, nodes: &[(String, u64)]) {
    for (n, _) in nodes {
        if let Err(e) = agent.delete(&format!("{n}/trace")).call() {
            eprintln!("warning: {n}: disarming the trace: {e}");
        }
    }
}

/// `http://host:port` from `host:port`, `http://host:port` or `http://host:port/metrics`.
fn base_url(s: &str) -> String {
    let s = s.trim().trim_end_matches('/');
    let s = s.strip_suffix("/metrics").unwrap_or(s);
    if s.starts_with("http://") || s.starts_with("https://") {
        s.to_string()
    } else {
        format!("http://{s}")
    }
}

fn b64(v: &Value) -> Vec<u8> {
    v.as_str()
        .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
        .unwrap_or_default()
}

fn tcp_flags(f: u8) -> String {
    let names = [
        (0x02, "SYN"),
        (0x10, "ACK"),
        (0x01, "FIN"),
        (0x04, "RST"),
        (0x08, "PSH"),
    ];
    let v: Vec<&str> = names
        .iter()
        .filter(|(b, _)| f & b != 0)
        .map(|(_, n)| *n)
        .collect();
    v.join(",")
}

/// `198.18.1.2:51234 > 198.18.0.2:4789` of an IPv4/UDP frame's outer headers.
fn outer_summary(f: &[u8]) -> Option<String> {
    if f.len() < 42 || f[12..14] != [0x08, 0x00] || f[14] >> 4 != 4 {
        return None;
    }
    let ihl = usize::from(f[14] & 0x0f) * 4;
    let ip = |o: usize| format!("{}.{}.{}.{}", f[o], f[o + 1], f[o + 2], f[o + 3]);
    let (src, dst) = (ip(26), ip(30));
    let l4 = 14 + ihl;
    if f[23] == 17 && f.len() >= l4 + 8 {
        let port = |o: usize| u16::from_be_bytes([f[o], f[o + 1]]);
        let (sp, dp) = (port(l4), port(l4 + 2));
        let vx = if dp == 4789 && f.len() >= l4 + 16 {
            let vni = u32::from_be_bytes([0, f[l4 + 12], f[l4 + 13], f[l4 + 14]]);
            format!(" vxlan vni {vni}")
        } else {
            String::new()
        };
        Some(format!("udp {src}:{sp} > {dst}:{dp}{vx}"))
    } else {
        Some(format!("ip proto {} {src} > {dst}", f[23]))
    }
}

fn clock(ts_us: u64) -> String {
    let s = ts_us / 1_000_000;
    format!(
        "{:02}:{:02}:{:02}.{:06}",
        (s / 3600) % 24,
        (s / 60) % 60,
        s % 60,
        ts_us % 1_000_000
    )
}

/// One record as a block of text (`vppctl show trace` style).
pub fn render(node: &str, r: &Value) -> String {
    let s = |k: &str| r[k].as_str().unwrap_or("").to_string();
    let ts = clock(r["ts_us"].as_u64().unwrap_or(0));
    let mut o = String::new();
    use std::fmt::Write as _;
    if r["kind"] == "decision" {
        let _ = writeln!(
            o,
            "Packet {} FM decision  {ts}  ({} ms after the miss)",
            r["for_seq"],
            format_args!("{:.3}", r["after_us"].as_u64().unwrap_or(0) as f64 / 1000.0)
        );
        let _ = writeln!(o, "  flow:     {}", s("flow"));
        let by = s("decided_by");
        let _ = writeln!(
            o,
            "  by:       {}",
            if by.is_empty() {
                "(the reply does not say)"
            } else {
                by.as_str()
            }
        );
        if r["ok"] == true {
            let _ = writeln!(o, "  rule:     {}", s("rule"));
            let _ = writeln!(
                o,
                "  result:   {}",
                if r["installed"] == true {
                    "installed; the held packets run again"
                } else {
                    "did not compile; the held packets are dropped (rule-error)"
                }
            );
        } else {
            let _ = writeln!(o, "  result:   error from FM: {}", s("error"));
        }
        for a in r["also"].as_array().into_iter().flatten() {
            let _ = writeln!(o, "  also:     {}", a.as_str().unwrap_or(""));
        }
        o.push('\n');
        return o;
    }
    let tenant = match r["tenant"].as_u64() {
        Some(t) => format!("tenant {t}"),
        None => "no tenant".into(),
    };
    let _ = writeln!(
        o,
        "Packet {}  {ts}  node {node} worker {}  {tenant} vni {}{}",
        r["seq"],
        r["worker"],
        r["vni"],
        if r["released"] == true {
            "  (held packet, run again after its rule came)"
        } else {
            ""
        }
    );
    let outer = b64(&r["outer"]);
    let _ = writeln!(
        o,
        "  rx:       {} bytes{}",
        r["outer_len"],
        outer_summary(&outer)
            .map(|x| format!("  {x}"))
            .unwrap_or_default()
    );
    if s("parse") == "ok" {
        let flags = r["tcp_flags"]
            .as_u64()
            .map(|f| format!(" [{}]", tcp_flags(f as u8)))
            .unwrap_or_default();
        let _ = writeln!(o, "  parse:    ok  {}{flags}", s("flow"));
    } else {
        let _ = writeln!(o, "  parse:    error: {}", s("parse"));
    }
    match s("lookup").as_str() {
        "hit" => {
            let _ = writeln!(o, "  lookup:   hit  flow entry {}", r["entry"]);
            let _ = writeln!(o, "  actions:  {}", s("actions"));
            if r["offloaded"] == true {
                let _ = writeln!(o, "  offload:  flow handed to the XDP fast path; its next packets bypass userspace and this trace");
            }
        }
        "miss" => {
            let why = if r["expired"] == true {
                "miss (the entry had idled out)"
            } else {
                "miss"
            };
            let req = if r["request_sent"] == true {
                "rule request sent to FM"
            } else if s("verdict") == "held" {
                "the flow already waits for its rule"
            } else {
                "no rule request"
            };
            let _ = writeln!(o, "  lookup:   {why}  {req}");
        }
        _ => {}
    }
    let verdict = s("verdict");
    match verdict.as_str() {
        "held" => {
            let _ = writeln!(o, "  verdict:  held until FM answers");
        }
        "drop" => {
            let _ = writeln!(o, "  verdict:  drop  reason {}", s("drop_reason"));
        }
        v => {
            let _ = writeln!(
                o,
                "  verdict:  {v}  {} bytes{}",
                r["out_len"],
                outer_summary(&b64(&r["out"]))
                    .map(|x| format!("  {x}"))
                    .unwrap_or_default()
            );
        }
    }
    o.push('\n');
    o
}

/// The stage summary a packet's pcapng comment carries.
fn comment(r: &Value) -> String {
    let s = |k: &str| r[k].as_str().unwrap_or("").to_string();
    let tenant = r["tenant"]
        .as_u64()
        .map_or("-".to_string(), |t| t.to_string());
    let lookup = match s("lookup").as_str() {
        "hit" => format!("hit entry {} [{}]", r["entry"], s("actions")),
        "miss" if r["request_sent"] == true => "miss, rule request sent".into(),
        "miss" => "miss".into(),
        _ => format!("parse {}", s("parse")),
    };
    let verdict = match s("verdict").as_str() {
        "drop" => format!("drop {}", s("drop_reason")),
        v => v.to_string(),
    };
    format!(
        "pkt {} tenant {tenant} vni {}: {lookup} -> {verdict}{}",
        r["seq"],
        r["vni"],
        if r["released"] == true {
            " (released)"
        } else {
            ""
        }
    )
}

/// The pcapng file being written.
struct Pcap {
    w: PcapNgWriter<std::io::BufWriter<std::fs::File>>,
    frames: u64,
}

impl Pcap {
    fn create(path: &PathBuf, snaplen: u32) -> Result<Self> {
        let f = std::fs::File::create(path).with_context(|| format!("{}", path.display()))?;
        let mut w = PcapNgWriter::new(std::io::BufWriter::new(f))?;
        for (name, what) in [
            (
                "outer",
                "frames as the PP node received them (VXLAN outer headers)",
            ),
            ("inner", "the frames inside the VXLAN header"),
            (
                "out",
                "frames as the PP node sent them, after the rule's actions",
            ),
        ] {
            w.write_pcapng_block(InterfaceDescriptionBlock {
                linktype: DataLink::ETHERNET,
                snaplen,
                options: vec![
                    InterfaceDescriptionOption::IfName(name.into()),
                    InterfaceDescriptionOption::IfDescription(what.into()),
                    // pcap-file writes packet timestamps in nanoseconds.
                    InterfaceDescriptionOption::IfTsResol(9),
                ],
            })?;
        }
        Ok(Pcap { w, frames: 0 })
    }

    fn write(&mut self, r: &Value) -> Result<()> {
        let ts = Duration::from_micros(r["ts_us"].as_u64().unwrap_or(0));
        let c = comment(r);
        for (iface, data, len) in [
            (0u32, "outer", "outer_len"),
            (1, "inner", "inner_len"),
            (2, "out", "out_len"),
        ] {
            let bytes = b64(&r[data]);
            if bytes.is_empty() {
                continue;
            }
            self.w.write_pcapng_block(EnhancedPacketBlock {
                interface_id: iface,
                timestamp: ts,
                original_len: r[len].as_u64().unwrap_or(bytes.len() as u64) as u32,
                data: bytes.into(),
                options: vec![EnhancedPacketOption::Comment(c.clone().into())],
            })?;
            self.frames += 1;
        }
        Ok(())
    }

    fn finish(self) -> Result<u64> {
        let frames = self.frames;
        let mut f = self.w.into_inner();
        f.flush()?;
        Ok(frames)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_addresses_become_base_urls() {
        assert_eq!(base_url("127.0.0.1:9100"), "http://127.0.0.1:9100");
        assert_eq!(
            base_url("http://127.0.0.1:9100/metrics"),
            "http://127.0.0.1:9100"
        );
        assert_eq!(base_url("http://h:1/"), "http://h:1");
    }

    #[test]
    fn a_packet_record_renders_its_stages_and_its_pcapng_comment() {
        let r = json!({
            "kind": "packet", "seq": 3, "ts_us": 3_723_000_001u64, "worker": 0,
            "tenant": 1, "vni": 100, "released": false,
            "flow": "100 tcp 10.0.0.2:4000 > 198.19.0.1:80", "tcp_flags": 0x12,
            "parse": "ok", "lookup": "hit", "entry": 17, "expired": false,
            "request_sent": false, "actions": "decap; out 0", "verdict": "tx 0",
            "drop_reason": null, "offloaded": false, "outer": "", "outer_len": 110,
            "inner": "", "inner_len": 60, "out": "", "out_len": 60,
        });
        let t = render("http://n:1", &r);
        assert!(
            t.starts_with(
                "Packet 3  01:02:03.000001  node http://n:1 worker 0  tenant 1 vni 100\n"
            ),
            "{t}"
        );
        assert!(
            t.contains("  parse:    ok  100 tcp 10.0.0.2:4000 > 198.19.0.1:80 [SYN,ACK]\n"),
            "{t}"
        );
        assert!(
            t.contains("  lookup:   hit  flow entry 17\n  actions:  decap; out 0\n"),
            "{t}"
        );
        assert!(t.contains("  verdict:  tx 0  60 bytes"), "{t}");
        assert_eq!(
            comment(&r),
            "pkt 3 tenant 1 vni 100: hit entry 17 [decap; out 0] -> tx 0"
        );
    }
}
