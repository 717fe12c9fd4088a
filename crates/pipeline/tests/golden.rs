//! Runs the golden-packet corpus (`tests/golden/corpus.txt`, built by scapy) through the
//! userspace pipeline. The XDP fast path runs the same file.

use pipeline::golden::{self, Case};
use pipeline::{FlowKey, NodeAddr};

const HASH_VECTORS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/golden/hash_vectors.txt"
);

fn run_case(node: NodeAddr, c: &Case) -> Result<(), String> {
    let want = c.expect.as_ref().ok_or("no expectation")?;
    let got = golden::run_userspace(node, c)?;
    golden::compare(&got, want)
}

#[test]
fn golden_corpus_passes_on_the_pipeline() {
    let (node, cases) = golden::load().expect("corpus");
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
