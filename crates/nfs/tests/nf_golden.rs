//! The golden NF-decision corpus (`tests/golden/nf_corpus.txt`, format in
//! `docs/golden-corpus.md`, "NF decisions"): every case builds its NF from the case's
//! configuration, replays the steps (first packets, events, timer runs, configuration
//! updates), checks each step's answer, and then the state after. The expected answers come
//! from `tests/golden/nf_gen.py`, which models SNAT, FW and LB on its own.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use nf::{Decision, FirstPacket, FlowEvent, NetworkFunction, NfEnv, Verdict};
use nfs::fw::Firewall;
use nfs::lb::LoadBalancer;
use nfs::snat::Snat;
use nfs::NfConfig;
use packet::proto;
use pipeline::{format_actions, FlowKey, PacketMeta};

fn corpus_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/nf_corpus.txt")
}

/// The NF of a case, concrete so that its state can be read back.
enum Nf {
    Snat(Box<Snat>),
    Fw(Box<Firewall>),
    Lb(Box<LoadBalancer>),
}

impl Nf {
    fn build(cfg: &NfConfig) -> Result<Nf, String> {
        let e = |e: nf::NfError| e.to_string();
        Ok(match cfg {
            NfConfig::Snat(c) => Nf::Snat(Box::new(Snat::new(c.clone()).map_err(e)?)),
            NfConfig::Fw(c) => Nf::Fw(Box::new(Firewall::new(c.clone()).map_err(e)?)),
            NfConfig::Lb(c) => Nf::Lb(Box::new(LoadBalancer::new(c.clone()).map_err(e)?)),
            other => return Err(format!("no golden cases for {other:?}")),
        })
    }

    fn nf(&mut self) -> &mut dyn NetworkFunction {
        match self {
            Nf::Snat(n) => n.as_mut(),
            Nf::Fw(n) => n.as_mut(),
            Nf::Lb(n) => n.as_mut(),
        }
    }

    /// A configuration change at runtime: the flows it forgot.
    fn update(&mut self, cfg: &NfConfig) -> Result<Vec<FlowKey>, String> {
        match (self, cfg) {
            (Nf::Fw(n), NfConfig::Fw(c)) => n.update(c.clone()).map(|()| Vec::new()),
            (Nf::Lb(n), NfConfig::Lb(c)) => n.update(c.clone()),
            _ => return Err("update of another kind, or of an NF without update".into()),
        }
        .map_err(|e| e.to_string())
    }

    /// The state after, in the corpus's `state` lines.
    fn state(&self, cfg: &NfConfig, keys: &[FlowKey]) -> Vec<String> {
        let mut out = Vec::new();
        match (self, cfg) {
            (Nf::Snat(n), NfConfig::Snat(c)) => {
                out.push(format!("flows {}", n.flow_count()));
                let st = n.stats();
                out.push(format!(
                    "drops exhausted={} invalid={} unsupported={} icmp-error-unknown={} \
                     refused-inbound={}",
                    st.exhausted,
                    st.invalid,
                    st.unsupported_protocol,
                    st.icmp_error_unknown,
                    st.refused_inbound
                ));
                for m in n.mappings() {
                    let k = m.key;
                    let remote = k
                        .remote
                        .map(|(a, p)| format!(" remote {}", ep(a, p)))
                        .unwrap_or_default();
                    out.push(format!(
                        "mapping {} {} {}{remote} -> {} flows {}",
                        k.vni,
                        proto_name(k.proto),
                        ep(k.addr, k.port),
                        ep(m.external.addr, m.external.port),
                        m.flows
                    ));
                }
                for p in &c.pools {
                    for &a in &p.addresses {
                        let icmp = if a.is_ipv4() {
                            proto::ICMP
                        } else {
                            proto::ICMPV6
                        };
                        for pr in [proto::TCP, proto::UDP, icmp] {
                            let n = n.free_port_count(a, pr);
                            out.push(format!("free {a} {} {n}", proto_name(pr)));
                        }
                    }
                }
                for k in keys {
                    let d = n
                        .flow_deadline(k)
                        .map_or("none".to_string(), |d| d.to_string());
                    out.push(format!("deadline {k} {d}"));
                }
            }
            (Nf::Fw(n), NfConfig::Fw(_)) => {
                out.push(format!("conns {}", n.conn_count()));
                for k in keys {
                    match (n.conn_state(k), n.conn_deadline(k)) {
                        (Some(s), Some(d)) => {
                            let s = serde_json::to_string(&s).unwrap_or_default();
                            out.push(format!("conn {k} {} deadline {d}", s.trim_matches('"')));
                        }
                        _ => out.push(format!("conn {k} none")),
                    }
                }
            }
            (Nf::Lb(n), NfConfig::Lb(c)) => {
                out.push(format!("flows {}", n.flow_count()));
                for s in &c.services {
                    let counts = n
                        .table(s.vip, s.port, s.protocol)
                        .map(|t| t.counts())
                        .unwrap_or_default();
                    let body: Vec<String> = counts
                        .iter()
                        .map(|(b, c)| format!("{}={c}", ep(b.addr, b.port)))
                        .collect();
                    let body = if body.is_empty() {
                        "empty".to_string()
                    } else {
                        body.join(" ")
                    };
                    out.push(format!("table {}/{} {body}", ep(s.vip, s.port), s.protocol));
                }
                for k in keys {
                    let b = n
                        .flow_backend(k)
                        .map_or("none".to_string(), |b| ep(b.addr, b.port));
                    out.push(format!("backend {k} {b}"));
                }
            }
            _ => out.push("state of a mismatched configuration".into()),
        }
        out
    }
}

fn ep(a: IpAddr, p: u16) -> String {
    match a {
        IpAddr::V4(a) => format!("{a}:{p}"),
        IpAddr::V6(a) => format!("[{a}]:{p}"),
    }
}

fn proto_name(p: u8) -> String {
    match p {
        proto::TCP => "tcp".into(),
        proto::UDP => "udp".into(),
        proto::ICMP => "icmp".into(),
        proto::ICMPV6 => "icmp6".into(),
        n => n.to_string(),
    }
}

fn decision_text(d: &Decision) -> String {
    let idle = match d.idle_timeout {
        None => "none".to_string(),
        Some(t) if t.as_millis() % 1000 == 0 => format!("{}s", t.as_secs()),
        Some(t) => format!("{}ms", t.as_millis()),
    };
    match &d.verdict {
        Verdict::Pass { label } => format!(
            "pass fwd [{}] rev [{}] idle {idle}{}",
            format_actions(&d.forward.actions()),
            format_actions(&d.reverse.actions()),
            label
                .as_ref()
                .map(|l| format!(" label {l}"))
                .unwrap_or_default()
        ),
        Verdict::Drop { reason } => format!("drop {reason} idle {idle}"),
    }
}

fn keys_text(keys: &[FlowKey]) -> String {
    if keys.is_empty() {
        return "-".into();
    }
    keys.iter()
        .map(|k| k.to_string())
        .collect::<Vec<_>>()
        .join(" ; ")
}

/// TCP flags as the corpus writes them: letters of F, S, R, P, A, or `-`.
fn flags(s: &str) -> Result<u8, String> {
    if s == "-" {
        return Ok(0);
    }
    s.chars().try_fold(0u8, |f, c| {
        Ok(f | match c {
            'F' => 0x01,
            'S' => 0x02,
            'R' => 0x04,
            'P' => 0x08,
            'A' => 0x10,
            _ => return Err(format!("flag {c:?}")),
        })
    })
}

/// `name=value` at the head of `s`; the value and the rest.
fn field<'a>(s: &'a str, name: &str) -> Result<(&'a str, &'a str), String> {
    let s = s
        .strip_prefix(name)
        .and_then(|s| s.strip_prefix('='))
        .ok_or_else(|| format!("expected {name}= in {s:?}"))?;
    Ok(s.split_once(' ').unwrap_or((s, "")))
}

fn num<T: std::str::FromStr>(s: &str) -> Result<T, String> {
    s.parse().map_err(|_| format!("not a number: {s:?}"))
}

fn flow_key(s: &str) -> Result<FlowKey, String> {
    s.trim().parse().map_err(|e| format!("flow key {s:?}: {e}"))
}

/// One case being replayed.
struct Run {
    name: String,
    cfg: Option<NfConfig>,
    nf: Option<Nf>,
    /// Keys of the case's first packets, in order of first appearance.
    keys: Vec<FlowKey>,
    expected_state: Vec<String>,
    errors: Vec<String>,
}

impl Run {
    fn new(name: &str) -> Self {
        Run {
            name: name.to_string(),
            cfg: None,
            nf: None,
            keys: Vec::new(),
            expected_state: Vec::new(),
            errors: Vec::new(),
        }
    }

    fn nf(&mut self) -> Result<&mut Nf, String> {
        self.nf
            .as_mut()
            .ok_or_else(|| "step before config".to_string())
    }

    fn check(&mut self, what: &str, got: String, want: &str) {
        if got != want.trim() {
            self.errors.push(format!(
                "{what}\n      want {}\n      got  {got}",
                want.trim()
            ));
        }
    }

    fn step(&mut self, line: &str) -> Result<(), String> {
        let (verb, rest) = line.split_once(' ').unwrap_or((line, ""));
        match verb {
            "doc" => {}
            "config" => {
                let cfg: NfConfig =
                    serde_json::from_str(rest).map_err(|e| format!("config: {e}"))?;
                self.nf = Some(Nf::build(&cfg)?);
                self.cfg = Some(cfg);
            }
            "pkt" => {
                let (head, want) = rest.split_once(" => ").ok_or("pkt without =>")?;
                let (t, r) = field(head, "t")?;
                let (seed, r) = field(r, "seed")?;
                let (tenant, r) = field(r, "tenant")?;
                let (fl, r) = field(r, "flags")?;
                let (icmp_error, r) = match r.strip_prefix("icmp-error ") {
                    Some(r) => (true, r),
                    None => (false, r),
                };
                let key = flow_key(r)?;
                let meta = PacketMeta {
                    len: 64,
                    tcp_flags: flags(fl)?,
                    icmp_error,
                    ingress_port: 0,
                };
                let pkt = FirstPacket::new(key, num(tenant)?, meta);
                let mut env = NfEnv::new(num(t)?, num(seed)?);
                let d = self
                    .nf()?
                    .nf()
                    .first_packet(&pkt, &mut env)
                    .map_err(|e| format!("first_packet: {e}"))?;
                if !self.keys.contains(&key) {
                    self.keys.push(key);
                }
                self.check(line, decision_text(&d), want);
            }
            "event" => {
                let (t, r) = field(rest, "t")?;
                let (kind, k) = r.split_once(' ').ok_or("event without key")?;
                let key = flow_key(k)?;
                let ev = match kind {
                    "closing" => FlowEvent::TcpClosing { key },
                    "established" => FlowEvent::TcpEstablished { key },
                    "active" => FlowEvent::Active { key },
                    "expired" => FlowEvent::Expired { key },
                    _ => return Err(format!("event {kind:?}")),
                };
                self.nf()?.nf().on_event(&ev, &mut NfEnv::new(num(t)?, 0));
            }
            "timer" => {
                let (head, want) = rest.split_once(" => ").ok_or("timer without =>")?;
                let (t, _) = field(head, "t")?;
                let gone = self.nf()?.nf().on_timer(&mut NfEnv::new(num(t)?, 0));
                self.check(line, keys_text(&gone), want);
            }
            "update" => {
                let (head, want) = rest.rsplit_once(" => ").ok_or("update without =>")?;
                let (_, json) = field(head, "t")?;
                let cfg: NfConfig =
                    serde_json::from_str(json).map_err(|e| format!("update: {e}"))?;
                let gone = self.nf()?.update(&cfg)?;
                self.cfg = Some(cfg);
                self.check(line, keys_text(&gone), want);
            }
            "state" => self.expected_state.push(rest.to_string()),
            _ => return Err(format!("unknown line {line:?}")),
        }
        Ok(())
    }

    /// Compare the state after; the case's mismatches, if any.
    fn finish(mut self) -> Option<String> {
        match (&self.nf, &self.cfg) {
            (Some(nf), Some(cfg)) => {
                let got = nf.state(cfg, &self.keys);
                if got != self.expected_state {
                    let mut diff = String::from("state after differs:");
                    let n = got.len().max(self.expected_state.len());
                    for i in 0..n {
                        let (w, g) = (self.expected_state.get(i), got.get(i));
                        if w != g {
                            diff.push_str(&format!("\n      want {w:?}\n      got  {g:?}"));
                        }
                    }
                    self.errors.push(diff);
                }
            }
            _ => self.errors.push("case without config".into()),
        }
        (!self.errors.is_empty())
            .then(|| format!("case {}:\n    {}", self.name, self.errors.join("\n    ")))
    }
}

#[test]
fn nf_decisions_match_the_golden_corpus() {
    let path = corpus_path();
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run make golden)", path.display()));
    let mut failures = Vec::new();
    let mut cases = 0usize;
    let mut per_kind = std::collections::BTreeMap::<String, usize>::new();
    let mut run: Option<Run> = None;
    for (no, line) in text.lines().enumerate() {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(name) = line.strip_prefix("case ") {
            failures.extend(run.take().and_then(Run::finish));
            cases += 1;
            let kind = name.split('/').next().unwrap_or_default().to_string();
            *per_kind.entry(kind).or_default() += 1;
            run = Some(Run::new(name));
            continue;
        }
        let Some(r) = run.as_mut() else {
            panic!("line {}: {line:?} before the first case", no + 1);
        };
        if let Err(e) = r.step(line) {
            r.errors.push(format!("line {}: {e}", no + 1));
        }
    }
    failures.extend(run.take().and_then(Run::finish));
    assert!(
        failures.is_empty(),
        "{} of {cases} cases differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
    for kind in ["snat", "fw", "lb"] {
        let n = per_kind.get(kind).copied().unwrap_or(0);
        assert!(n >= 30, "only {n} {kind} cases: {per_kind:?}");
    }
}

/// The harness must notice a wrong expectation, or the corpus proves nothing.
#[test]
fn a_wrong_expectation_is_reported() {
    let mut r = Run::new("self-check");
    let steps = [
        r#"config {"kind":"fw","default_action":"allow"}"#,
        "pkt t=0 seed=1 tenant=1 flags=S 7 tcp 198.18.1.10:1000 > 198.18.200.1:80 => drop acl-deny idle 60s",
        "state conns 0",
    ];
    for s in steps {
        r.step(s).expect("parses");
    }
    let report = r.finish().expect("mismatches reported");
    assert!(report.contains("want drop acl-deny"), "{report}");
    assert!(report.contains("state after differs"), "{report}");
    assert_eq!(
        decision_text(&Decision::pass()),
        "pass fwd [] rev [] idle none"
    );
    let _ = Duration::ZERO;
}
