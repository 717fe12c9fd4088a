//! The golden-packet corpus on both paths: every case of `tests/golden/corpus.txt` runs
//! through the XDP program (`BPF_PROG_TEST_RUN`, no interface needed) and through the
//! userspace pipeline, and the two must agree case by case.
//!
//! A case the XDP program runs must give the corpus's frame with `XDP_TX` (or `XDP_DROP`
//! for a drop rule), byte for byte the userspace pipeline's output. A case it does not run
//! by design is listed in [`PASSED_UP`] with the reason, and must come back `XDP_PASS` with
//! the frame untouched: the miss path, which hands the packet to the userspace pipeline
//! (whose result is then the corpus's, checked here too). No case is skipped.

use pipeline::golden::{self, Case, Outcome};
use xdp::{XdpProgram, XdpRule, XdpVerdict};

/// Cases the XDP program hands up to userspace, and why.
const PASSED_UP: &[(&str, &str)] = &[
    // Outer shapes other than packet::vxlan_fast's (VLAN tag, IPv6 underlay).
    ("v4-udp-vlan-outer-snat-reencap", "outer VLAN tag"),
    ("v4-udp-vlan-outer-decap-only", "outer VLAN tag"),
    ("v4-udp-v6-underlay-decap-only", "IPv6 underlay"),
    // ICMP errors are keyed on their quote and rewrite it: userspace only.
    ("v4-icmp-port-unreach-udp-unsnat-vxlan-decap", "ICMP error"),
    (
        "v4-icmp-time-exceeded-tcp-unsnat-vxlan-reencap",
        "ICMP error",
    ),
    (
        "v6-icmp6-dest-unreach-udp-unsnat-vxlan-reencap",
        "ICMP error",
    ),
    // A VXLAN miss: no offloaded rule (userspace asks FM; here it has no rule server).
    ("v4-udp-vxlan-no-rule", "miss"),
    // Malformed VXLAN to the node: the userspace parser decides and counts the drop.
    ("vxlan-i-flag-clear-bad-header", "VXLAN I flag clear"),
    ("vxlan-inner-eth-cut-truncated", "inner frame cut"),
    ("vxlan-hdr-cut-truncated", "VXLAN header cut"),
];

/// Frames that are not VXLAN to the node: the program gives them to the kernel (on a PP
/// node with AF_XDP, the kernel answers ARP and management; the userspace pipeline never
/// sees bare traffic there). Any case whose input is not VXLAN to the node belongs here.
const NOT_VXLAN: &str = "not VXLAN to the node";

/// Frames the kernel's BPF_PROG_TEST_RUN refuses (shorter than an Ethernet header);
/// a driver never hands such a frame to XDP either.
const RUNT: &[&str] = &["eth-runt-truncated"];

fn is_vxlan_to_node(f: &[u8], node: &pipeline::NodeAddr) -> bool {
    // Untagged IPv4 UDP to the node's address and port 4789: what the program considers.
    if f.len() < 34
        || f[12..14] != [0x08, 0x00]
        || f[14] >> 4 != 4
        || f[23] != 17
        || f[30..34] != node.ip.octets()
    {
        return false;
    }
    let udp = 14 + (f[14] & 0x0f) as usize * 4;
    f.get(udp + 2..udp + 4) == Some(&4789u16.to_be_bytes()[..])
}

#[test]
fn golden_corpus_gives_identical_results_on_xdp_and_userspace() {
    let (node, cases) = golden::load().expect("corpus");
    let mut prog = XdpProgram::load().expect("load the XDP program (needs root / CAP_BPF)");
    prog.set_node(&node).expect("set node");

    let mut identical = Vec::new();
    let mut passed_up: Vec<(String, &str)> = Vec::new();
    let mut failures = Vec::new();
    for c in &cases {
        match run(&mut prog, node, c) {
            Ok(Ran::Identical) => identical.push(c.name.clone()),
            Ok(Ran::PassedUp(why)) => passed_up.push((c.name.clone(), why)),
            Err(e) => failures.push(format!("{}: {e}", c.name)),
        }
    }
    // Every listed case exists: the list cannot hide a case that was renamed away.
    for (name, _) in PASSED_UP {
        assert!(
            cases.iter().any(|c| c.name == *name),
            "PASSED_UP names {name}, which the corpus does not have"
        );
    }
    println!(
        "golden corpus on XDP: {} of {} cases identical on XDP and userspace, {} passed up to userspace:",
        identical.len(),
        cases.len(),
        passed_up.len()
    );
    let mut reasons: Vec<&str> = passed_up.iter().map(|(_, r)| *r).collect();
    reasons.sort();
    reasons.dedup();
    for r in reasons {
        let names: Vec<&str> = passed_up
            .iter()
            .filter(|(_, x)| *x == r)
            .map(|(n, _)| n.as_str())
            .collect();
        println!("  {r}: {} ({})", names.len(), names.join(", "));
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    // The offloadable core of the corpus really runs in the driver.
    assert!(
        identical.len() >= 23,
        "only {} cases ran on XDP",
        identical.len()
    );
}

enum Ran {
    Identical,
    PassedUp(&'static str),
}

fn run(prog: &mut XdpProgram, node: pipeline::NodeAddr, c: &Case) -> Result<Ran, String> {
    let want = c.expect.as_ref().ok_or("no expectation")?;
    // The userspace pipeline gives the corpus's result on every case.
    let user = golden::run_userspace(node, c)?;
    golden::compare(&user, want).map_err(|e| format!("userspace: {e}"))?;

    let rule = c.parsed_rule()?;
    let offloaded = match &rule {
        Some(r) => match XdpRule::from_rule(r) {
            Ok(x) => {
                prog.install_rule(&r.key, &x)
                    .map_err(|e| format!("install: {e}"))?;
                true
            }
            Err(_) => false,
        },
        None => false,
    };
    let result = run_offloaded(prog, node, c, want, offloaded);
    if let Some(r) = &rule {
        prog.remove_rule(&r.key)
            .map_err(|e| format!("remove: {e}"))?;
    }
    result
}

fn run_offloaded(
    prog: &mut XdpProgram,
    node: pipeline::NodeAddr,
    c: &Case,
    want: &Outcome,
    offloaded: bool,
) -> Result<Ran, String> {
    if RUNT.contains(&c.name.as_str()) {
        return match prog.test_run(&c.input) {
            Err(_) => Ok(Ran::PassedUp("runt frame (never reaches XDP)")),
            Ok(v) => Err(format!("runt frame ran: {v:?}")),
        };
    }
    let (verdict, out) = prog.test_run(&c.input).map_err(|e| e.to_string())?;
    let listed = PASSED_UP
        .iter()
        .find(|(n, _)| *n == c.name)
        .map(|(_, r)| *r);
    let why = match listed {
        Some(r) => Some(r),
        None if !is_vxlan_to_node(&c.input, &node) => Some(NOT_VXLAN),
        None => None,
    };
    if let Some(why) = why {
        if verdict != XdpVerdict::Pass || out != c.input {
            return Err(format!(
                "listed as passed up ({why}) but XDP gave {verdict:?}{}",
                if out != c.input {
                    " with a changed frame"
                } else {
                    ""
                }
            ));
        }
        return Ok(Ran::PassedUp(why));
    }
    if !offloaded {
        return Err("rule not offloadable, and the case is not listed as passed up".into());
    }
    // Run in the driver: the same result as the corpus, and so as userspace.
    match (want, verdict) {
        (Outcome::Out(_, frame), XdpVerdict::Tx) => {
            // Every output port of a PP node is its one interface: XDP_TX.
            golden::compare(&Outcome::Out(0, out), &Outcome::Out(0, frame.clone()))
                .map_err(|e| format!("XDP: {e}"))?;
        }
        (Outcome::Drop(r), XdpVerdict::Drop) if r.starts_with("rule:") => {}
        (w, v) => return Err(format!("XDP verdict {v:?}, want {w:?}")),
    }
    // The hit was counted once, with the input frame's length.
    let key = c.parsed_rule()?.ok_or("no rule")?.key;
    let cnt = prog
        .rule_counters(&key)
        .map_err(|e| e.to_string())?
        .ok_or("rule gone")?;
    if cnt.packets != 1 || cnt.bytes != c.input.len() as u64 || cnt.last_seen.is_none() {
        return Err(format!("counters {cnt:?} after one packet"));
    }
    Ok(Ran::Identical)
}

#[test]
fn counters_add_up_and_removal_returns_them() {
    let (node, cases) = golden::load().expect("corpus");
    let c = cases
        .iter()
        .find(|c| c.name == "v4-udp-snat-reencap")
        .expect("case");
    let rule = c.parsed_rule().unwrap().unwrap();
    let mut prog = XdpProgram::load().expect("load");
    prog.set_node(&node).unwrap();
    assert_eq!(prog.offload(&rule).unwrap(), None);
    for _ in 0..5 {
        assert_eq!(prog.test_run(&c.input).unwrap().0, XdpVerdict::Tx);
    }
    let cnt = prog.rule_counters(&rule.key).unwrap().unwrap();
    assert_eq!((cnt.packets, cnt.bytes), (5, 5 * c.input.len() as u64));
    // Replacing the rule hands back the old counters; removing hands back the new ones.
    let old = prog.offload(&rule).unwrap().unwrap();
    assert_eq!(old.packets, 5);
    prog.test_run(&c.input).unwrap();
    let last = prog.remove_rule(&rule.key).unwrap().unwrap();
    assert_eq!(last.packets, 1);
    assert_eq!(prog.remove_rule(&rule.key).unwrap(), None);
    // Without the rule the flow misses and goes up, untouched.
    let (v, out) = prog.test_run(&c.input).unwrap();
    assert_eq!((v, out.as_slice()), (XdpVerdict::Pass, c.input.as_slice()));
}

/// VNI the bare cases are wrapped in for [`bare_cases_wrapped_in_vxlan_agree_on_both_paths`].
const WRAP_VNI: u32 = 4242;

/// Bare cases (VNI 0) whose inner packet the program hands up even once wrapped in VXLAN.
const WRAPPED_PASSED_UP: &[(&str, &str)] = &[
    ("v4-udp-vlan-bare-snat", "inner VLAN tag"),
    ("v4-tcp-qinq-bare-snat", "inner VLAN tag"),
    ("v4-udp-first-fragment-snat", "fragment"),
    ("v4-udp-middle-fragment", "fragment"),
    (
        "v6-icmp6-port-unreach-udp-unsnat",
        "inner IPv6 not offloaded",
    ),
    (
        "v6-icmp6-packet-too-big-udp-unsnat",
        "inner IPv6 not offloaded",
    ),
    (
        "v6-icmp6-time-exceeded-tcp-undnat",
        "inner IPv6 not offloaded",
    ),
    ("v4-icmp-port-unreach-udp-unsnat", "ICMP error"),
    ("v4-icmp-time-exceeded-udp-unsnat", "ICMP error"),
    ("v4-icmp-time-exceeded-tcp-quote8-unsnat", "ICMP error"),
    ("v4-icmp-time-exceeded-tcp-hdr-unsnat", "ICMP error"),
    ("v4-icmp-frag-needed-tcp-unsnat", "ICMP error"),
    ("v4-icmp-port-unreach-udp-undnat", "ICMP error"),
    ("v4-icmp-time-exceeded-udp-undnat-router", "ICMP error"),
];

/// The corpus's bare cases (VNI 0: the checksum edge cases, IP options, Ethernet padding)
/// wrapped in a VXLAN header to the node, with `decap` put in front of their rule. The
/// userspace pipeline must give the corpus's expected result for the bare case (decap
/// takes the wrapper off again), and the XDP program the same, byte for byte, or pass the
/// frame up untouched for a listed reason. This runs the RFC 1624 corner cases of the
/// corpus (checksums becoming 0 or 0xffff) through the driver's checksum code.
#[test]
fn bare_cases_wrapped_in_vxlan_agree_on_both_paths() {
    use pipeline::{Action, Rule};
    let (node, cases) = golden::load().expect("corpus");
    let mut prog = XdpProgram::load().expect("load");
    prog.set_node(&node).unwrap();
    let far = packet::build::EncapV4::new(
        [0x02, 0, 0, 0, 0, 0x0b],
        node.mac,
        [198, 18, 0, 7],
        node.ip.octets(),
        WRAP_VNI,
    );
    let (mut identical, mut passed, mut failures) = (Vec::new(), Vec::new(), Vec::new());
    for c in &cases {
        let Ok(Some(rule)) = c.parsed_rule() else {
            continue;
        };
        if rule.key.vni() != 0 || is_vxlan_to_node(&c.input, &node) || c.input.len() < 14 {
            continue;
        }
        let o = packet::build::VXLAN_V4_OVERHEAD;
        let mut input = vec![0u8; o + c.input.len()];
        input[o..].copy_from_slice(&c.input);
        far.write(&mut input, c.input.len(), 50000);
        let mut key = rule.key;
        key.set_vni(WRAP_VNI);
        let mut actions = vec![Action::DecapVxlan];
        actions.extend(rule.actions.iter().cloned());
        let wrapped = Case {
            name: format!("{}+vxlan", c.name),
            rule: None,
            input,
            expect: c.expect.clone(),
        };
        let rule = Rule::new(key, actions);
        let res = run_wrapped(&mut prog, node, &wrapped, &rule);
        prog.remove_rule(&rule.key).unwrap();
        match res {
            Ok(Ran::Identical) => identical.push(c.name.clone()),
            Ok(Ran::PassedUp(why)) => passed.push(format!("{} ({why})", c.name)),
            Err(e) => failures.push(format!("{}: {e}", wrapped.name)),
        }
    }
    println!(
        "bare corpus cases wrapped in VXLAN: {} identical on XDP and userspace, {} passed up: {}",
        identical.len(),
        passed.len(),
        passed.join(", ")
    );
    for (name, _) in WRAPPED_PASSED_UP {
        assert!(
            passed.iter().any(|p| p.starts_with(&format!("{name} ("))),
            "WRAPPED_PASSED_UP names {name}, which did not come up as passed"
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(identical.len() >= 11, "only {} ran on XDP", identical.len());
}

fn run_wrapped(
    prog: &mut XdpProgram,
    node: pipeline::NodeAddr,
    c: &Case,
    rule: &pipeline::Rule,
) -> Result<Ran, String> {
    let want = c.expect.as_ref().ok_or("no expectation")?;
    let user = run_userspace_rule(node, c, rule)?;
    golden::compare(&user, want).map_err(|e| format!("userspace: {e}"))?;
    // A rule the driver cannot run is not installed: the flow misses.
    if let Ok(x) = XdpRule::from_rule(rule) {
        prog.install_rule(&rule.key, &x)
            .map_err(|e| e.to_string())?;
    }
    let (verdict, out) = prog.test_run(&c.input).map_err(|e| e.to_string())?;
    let base = c.name.trim_end_matches("+vxlan");
    if let Some((_, why)) = WRAPPED_PASSED_UP.iter().find(|(n, _)| *n == base) {
        return if verdict == XdpVerdict::Pass && out == c.input {
            Ok(Ran::PassedUp(why))
        } else {
            Err(format!(
                "listed as passed up ({why}) but XDP gave {verdict:?}"
            ))
        };
    }
    match (&user, verdict) {
        (Outcome::Out(_, frame), XdpVerdict::Tx) => {
            golden::compare(&Outcome::Out(0, out), &Outcome::Out(0, frame.clone()))
                .map_err(|e| format!("XDP: {e}"))?;
            Ok(Ran::Identical)
        }
        (Outcome::Drop(r), XdpVerdict::Drop) if r.starts_with("rule:") => Ok(Ran::Identical),
        (u, v) => Err(format!("XDP verdict {v:?}, userspace {u:?}")),
    }
}

/// [`golden::run_userspace`] with a rule given as a value rather than corpus text.
fn run_userspace_rule(
    node: pipeline::NodeAddr,
    c: &Case,
    rule: &pipeline::Rule,
) -> Result<Outcome, String> {
    let text = Case {
        rule: Some((
            rule.key.to_string(),
            pipeline::format_actions(&rule.actions),
        )),
        ..c.clone()
    };
    golden::run_userspace(node, &text)
}

/// Differential check beyond the corpus: the VXLAN cases the program runs, with bytes
/// flipped, frames cut short or grown, run on both paths. Whatever the mutation, the
/// program either hands the frame up untouched or gives the userspace pipeline's result
/// exactly; it never transmits a frame userspace would not, or a different one.
#[test]
fn mutated_frames_never_disagree_with_userspace() {
    let (node, cases) = golden::load().expect("corpus");
    let mut prog = XdpProgram::load().expect("load");
    prog.set_node(&node).unwrap();
    let mut rng: u64 = 0x9e37_79b9_7f4a_7c15;
    let (mut ran, mut up, mut failures) = (0usize, 0usize, Vec::new());
    for c in &cases {
        let Ok(Some(rule)) = c.parsed_rule() else {
            continue;
        };
        if !is_vxlan_to_node(&c.input, &node) {
            continue;
        }
        let Ok(x) = XdpRule::from_rule(&rule) else {
            continue;
        };
        prog.install_rule(&rule.key, &x).unwrap();
        for _ in 0..300 {
            let mut f = c.input.clone();
            match next(&mut rng) % 4 {
                // Flip one to three bytes, anywhere.
                0 | 1 => {
                    for _ in 0..=next(&mut rng) % 3 {
                        let i = (next(&mut rng) % f.len() as u64) as usize;
                        f[i] ^= 1 << (next(&mut rng) % 8);
                    }
                }
                // Cut the frame short.
                2 => f.truncate(14 + (next(&mut rng) % (f.len() as u64 - 14)) as usize),
                // Grow it (Ethernet padding, or junk after the packet).
                _ => f.extend((0..1 + next(&mut rng) % 40).map(|i| i as u8)),
            }
            let m = Case {
                name: c.name.clone(),
                rule: c.rule.clone(),
                input: f.clone(),
                expect: None,
            };
            let user = match golden::run_userspace(node, &m) {
                Ok(u) => u,
                Err(e) => {
                    failures.push(format!("{}: userspace: {e}", c.name));
                    continue;
                }
            };
            let (verdict, out) = prog.test_run(&f).unwrap();
            let agree = match (verdict, &user) {
                (XdpVerdict::Pass, _) => out == f,
                (XdpVerdict::Tx, Outcome::Out(_, frame)) => out == *frame,
                (XdpVerdict::Drop, Outcome::Drop(r)) => r.starts_with("rule:"),
                _ => false,
            };
            if verdict == XdpVerdict::Pass {
                up += 1;
            } else {
                ran += 1;
            }
            if !agree {
                failures.push(format!(
                    "{}: XDP {verdict:?} {}, userspace {user:?}, input {}",
                    c.name,
                    golden::to_hex(&out),
                    golden::to_hex(&f)
                ));
            }
        }
        prog.remove_rule(&rule.key).unwrap();
    }
    println!("mutated frames: {ran} ran on XDP identical to userspace, {up} passed up");
    assert!(
        failures.is_empty(),
        "{} disagreements:\n{}",
        failures.len(),
        failures[..failures.len().min(5)].join("\n")
    );
    assert!(ran > 1000, "only {ran} mutated frames ran on XDP");
}

/// xorshift64*: a fixed, dependency-free sequence, so a failure replays.
fn next(s: &mut u64) -> u64 {
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    s.wrapping_mul(0x2545_f491_4f6c_dd1d)
}
