//! Runs the golden-packet corpus (`tests/golden/corpus.txt`, built by scapy) through the
//! userspace pipeline. The XDP fast path runs the same file.

use std::net::Ipv4Addr;

use pipeline::{
    parse_actions, FlowKey, MemRing, NodeAddr, PacketIo, Pipeline, PipelineConfig, Rule,
    RuleSource, VecSource, Verdict,
};

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/golden/corpus.txt");
const HASH_VECTORS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/golden/hash_vectors.txt"
);

#[derive(Debug, Default)]
struct Case {
    name: String,
    rule: Option<(String, String)>,
    input: Vec<u8>,
    expect: Option<Expect>,
}

#[derive(Debug, Clone)]
enum Expect {
    Out(u8, Vec<u8>),
    Drop(String),
}

fn parse_mac(s: &str) -> [u8; 6] {
    let v: Vec<u8> = s
        .split(':')
        .map(|b| u8::from_str_radix(b, 16).expect("mac byte"))
        .collect();
    v.try_into().expect("6-byte mac")
}

fn load() -> (NodeAddr, Vec<Case>) {
    let text = std::fs::read_to_string(CORPUS).expect("corpus file (run `make golden`)");
    let mut node = None;
    let mut cases: Vec<Case> = Vec::new();
    let mut pending_match: Option<String> = None;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (word, rest) = line.split_once(' ').unwrap_or((line, ""));
        let cur = cases.last_mut();
        match word {
            "node" => {
                let mut ip = None;
                let mut mac = None;
                let mut gw = None;
                for kv in rest.split_whitespace() {
                    match kv.split_once('=') {
                        Some(("ip", v)) => ip = Some(v.parse::<Ipv4Addr>().unwrap()),
                        Some(("mac", v)) => mac = Some(parse_mac(v)),
                        Some(("gw-mac", v)) => gw = Some(parse_mac(v)),
                        _ => panic!("line {}: bad node field {kv}", n + 1),
                    }
                }
                node = Some(NodeAddr {
                    ip: ip.unwrap(),
                    mac: mac.unwrap(),
                    gw_mac: gw.unwrap(),
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
                    .unwrap_or_else(|| panic!("line {}: rule without match", n + 1));
                cur.expect("case").rule = Some((m, rest.to_string()));
            }
            "in" => cur.expect("case").input = hex::decode(rest).expect("input hex"),
            "out" => {
                let (port, hx) = rest.split_once(' ').expect("out <port> <hex>");
                cur.expect("case").expect = Some(Expect::Out(
                    port.parse().unwrap(),
                    hex::decode(hx).expect("output hex"),
                ));
            }
            "drop" => cur.expect("case").expect = Some(Expect::Drop(rest.to_string())),
            other => panic!("line {}: unknown directive {other}", n + 1),
        }
    }
    (node.expect("node line"), cases)
}

fn run_case(node: NodeAddr, c: &Case) -> Result<(), String> {
    let mut cfg = PipelineConfig::new(node);
    cfg.flow_capacity = 16;
    let mut p = Pipeline::new(cfg, RuleSource::None).unwrap();
    if let Some((m, actions)) = &c.rule {
        let key: FlowKey = m.parse().map_err(|e| format!("match {m:?}: {e}"))?;
        let actions = parse_actions(actions).map_err(|e| format!("rule: {e}"))?;
        p.install_rule(&Rule::new(key, actions), 0)
            .map_err(|e| format!("install: {e}"))?;
    }
    let mut src = VecSource::default();
    src.push(c.input.clone(), 0);
    let mut io = MemRing::new(src, 4);
    io.sink.capture = true;
    let mut descs = Vec::new();
    io.rx(&mut descs, 4).unwrap();
    p.process(io.region(), &mut descs, 1);
    io.tx(&descs).unwrap();
    let d = descs[0];
    match (c.expect.as_ref().expect("expectation"), d.verdict) {
        (Expect::Out(port, want), Verdict::Tx(got_port)) => {
            let got = &io.sink.captured[0].1;
            if *port != got_port {
                return Err(format!("port {got_port}, want {port}"));
            }
            if got != want {
                return Err(format!(
                    "frame differs\n   got {}\n  want {}\n  diff at byte {:?}",
                    hex::encode(got),
                    hex::encode(want),
                    got.iter().zip(want.iter()).position(|(a, b)| a != b)
                ));
            }
            Ok(())
        }
        (Expect::Drop(want), Verdict::Drop(r)) => {
            let got = p.drop_name(r);
            if &got == want {
                Ok(())
            } else {
                Err(format!("dropped as {got}, want {want}"))
            }
        }
        (want, got) => Err(format!("verdict {got:?}, want {want:?}")),
    }
}

#[test]
fn golden_corpus_passes_on_the_pipeline() {
    let (node, cases) = load();
    assert!(cases.len() >= 30, "corpus has only {} cases", cases.len());
    let mut failures = Vec::new();
    for c in &cases {
        if let Err(e) = run_case(node, c) {
            failures.push(format!("{}: {e}", c.name));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} golden cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn flow_hash_matches_the_reference_vectors() {
    let text = std::fs::read_to_string(HASH_VECTORS).expect("hash vectors");
    let mut n = 0;
    for line in text
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
    {
        let f: Vec<&str> = line.split_whitespace().collect();
        let key: [u8; 40] = hex::decode(f[0]).unwrap().try_into().unwrap();
        let want = u64::from_str_radix(f[1], 16).unwrap();
        let k = FlowKey::from_bytes(key);
        assert_eq!(k.hash(), want, "flow_hash of {}", f[0]);
        assert_eq!(
            pipeline::vxlan_source_port(k.hash()),
            f[2].parse::<u16>().unwrap()
        );
        n += 1;
    }
    assert!(n >= 4);
}
