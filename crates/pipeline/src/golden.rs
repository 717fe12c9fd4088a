//! The golden-packet corpus (`tests/golden/corpus.txt`, format in
//! `docs/golden-corpus.md`): its parser, and a runner that puts one case through the
//! userspace pipeline. Both the pipeline's own test and the XDP fast path's test
//! (`crates/xdp/tests/golden.rs`) use them, so the two paths read the corpus the same way
//! and can be compared case by case.

use std::net::Ipv4Addr;

use crate::{
    parse_actions, FlowKey, MemRing, NodeAddr, PacketIo, Pipeline, PipelineConfig, Rule,
    RuleSource, VecSource, Verdict,
};

/// The corpus file of the repository.
pub const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/golden/corpus.txt");

/// One corpus case.
#[derive(Debug, Default, Clone)]
pub struct Case {
    pub name: String,
    /// The `match` and `rule` lines' text, when the case installs a rule.
    pub rule: Option<(String, String)>,
    pub input: Vec<u8>,
    pub expect: Option<Outcome>,
}

impl Case {
    /// The case's rule, parsed.
    pub fn parsed_rule(&self) -> Result<Option<Rule>, String> {
        let Some((m, actions)) = &self.rule else {
            return Ok(None);
        };
        let key: FlowKey = m.parse().map_err(|e| format!("match {m:?}: {e}"))?;
        let actions = parse_actions(actions).map_err(|e| format!("rule {actions:?}: {e}"))?;
        Ok(Some(Rule::new(key, actions)))
    }
}

/// What happens to a case's input frame: sent on an output port, or dropped with a reason
/// (`rule:<name>` for drop rules).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Out(u8, Vec<u8>),
    Drop(String),
}

/// Lower-case hex of `b`, as the corpus writes frames.
pub fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn from_hex(s: &str) -> Result<Vec<u8>, String> {
    if s.len() % 2 != 0 {
        return Err(format!("odd-length hex ({} digits)", s.len()));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| format!("hex: {e}")))
        .collect()
}

fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let v = s
        .split(':')
        .map(|b| u8::from_str_radix(b, 16).map_err(|e| format!("mac {s:?}: {e}")))
        .collect::<Result<Vec<u8>, _>>()?;
    v.try_into().map_err(|_| format!("mac {s:?}: not 6 bytes"))
}

/// Read and parse the repository's corpus file.
pub fn load() -> Result<(NodeAddr, Vec<Case>), String> {
    let text = std::fs::read_to_string(CORPUS)
        .map_err(|e| format!("{CORPUS}: {e} (run `make golden`)"))?;
    parse(&text)
}

/// Parse corpus text: the `node` line and the cases, in file order.
pub fn parse(text: &str) -> Result<(NodeAddr, Vec<Case>), String> {
    let mut node = None;
    let mut cases: Vec<Case> = Vec::new();
    let mut pending_match: Option<String> = None;
    for (n, line) in text.lines().enumerate() {
        let at = |e: String| format!("line {}: {e}", n + 1);
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
        if !matches!(word, "node" | "case") && cases.is_empty() {
            return Err(at(format!("{word} before the first case")));
        }
        match word {
            "node" => {
                let (mut ip, mut mac, mut gw) = (None, None, None);
                for kv in rest.split_whitespace() {
                    match kv.split_once('=') {
                        Some(("ip", v)) => {
                            ip = Some(v.parse::<Ipv4Addr>().map_err(|e| at(e.to_string()))?)
                        }
                        Some(("mac", v)) => mac = Some(parse_mac(v).map_err(at)?),
                        Some(("gw-mac", v)) => gw = Some(parse_mac(v).map_err(at)?),
                        _ => return Err(at(format!("bad node field {kv}"))),
                    }
                }
                node = Some(NodeAddr {
                    ip: ip.ok_or_else(|| at("node without ip".into()))?,
                    mac: mac.ok_or_else(|| at("node without mac".into()))?,
                    gw_mac: gw.ok_or_else(|| at("node without gw-mac".into()))?,
                });
            }
            "case" => cases.push(Case {
                name: rest.to_string(),
                ..Default::default()
            }),
            "match" => pending_match = Some(rest.to_string()),
            "rule" => {
                let m = pending_match
                    .take()
                    .ok_or_else(|| at("rule without match".into()))?;
                if let Some(c) = cases.last_mut() {
                    c.rule = Some((m, rest.to_string()));
                }
            }
            "in" => {
                if let Some(c) = cases.last_mut() {
                    c.input = from_hex(rest).map_err(at)?;
                }
            }
            "out" => {
                let (port, hx) = rest
                    .split_once(' ')
                    .ok_or_else(|| at("want out <port> <hex>".into()))?;
                let port = port.parse().map_err(|e| at(format!("port: {e}")))?;
                if let Some(c) = cases.last_mut() {
                    c.expect = Some(Outcome::Out(port, from_hex(hx).map_err(at)?));
                }
            }
            "drop" => {
                if let Some(c) = cases.last_mut() {
                    c.expect = Some(Outcome::Drop(rest.to_string()));
                }
            }
            other => return Err(at(format!("unknown directive {other}"))),
        }
    }
    Ok((node.ok_or("no node line")?, cases))
}

/// Run one case through a fresh userspace pipeline (no rule server, so a miss is a
/// `no-rule` drop): install its rule, process its input frame, and report the outcome.
pub fn run_userspace(node: NodeAddr, c: &Case) -> Result<Outcome, String> {
    let mut cfg = PipelineConfig::new(node);
    cfg.flow_capacity = 16;
    let mut p = Pipeline::new(cfg, RuleSource::None).map_err(|e| format!("pipeline: {e}"))?;
    if let Some(rule) = c.parsed_rule()? {
        p.install_rule(&rule, 0)
            .map_err(|e| format!("install: {e}"))?;
    }
    let mut src = VecSource::default();
    src.push(c.input.clone(), 0);
    let mut io = MemRing::new(src, 4);
    io.sink.capture = true;
    let mut descs = Vec::new();
    io.rx(&mut descs, 4).map_err(|e| format!("rx: {e}"))?;
    p.process(io.region(), &mut descs, 1);
    io.tx(&descs).map_err(|e| format!("tx: {e}"))?;
    match descs[0].verdict {
        Verdict::Tx(port) => {
            let (_, frame) = io
                .sink
                .captured
                .first()
                .ok_or("transmitted but nothing captured")?;
            Ok(Outcome::Out(port, frame.clone()))
        }
        Verdict::Drop(r) => Ok(Outcome::Drop(p.drop_name(r))),
        v => Err(format!("verdict {v:?}")),
    }
}

/// Compare an outcome with the expected one; `Err` says how they differ.
pub fn compare(got: &Outcome, want: &Outcome) -> Result<(), String> {
    match (got, want) {
        (Outcome::Out(gp, g), Outcome::Out(wp, w)) => {
            if gp != wp {
                return Err(format!("port {gp}, want {wp}"));
            }
            if g != w {
                return Err(format!(
                    "frame differs\n   got {}\n  want {}\n  diff at byte {:?}",
                    to_hex(g),
                    to_hex(w),
                    g.iter().zip(w.iter()).position(|(a, b)| a != b)
                ));
            }
            Ok(())
        }
        (Outcome::Drop(g), Outcome::Drop(w)) if g == w => Ok(()),
        (Outcome::Drop(g), Outcome::Drop(w)) => Err(format!("dropped as {g}, want {w}")),
        (g, w) => Err(format!("got {g:?}, want {w:?}")),
    }
}
