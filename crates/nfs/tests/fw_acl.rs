//! Firewall ACLs: first match wins, defaults, v4 and v6 prefixes, port ranges,
//! protocols, and configuration errors.

use nf::{Decision, FirstPacket, NetworkFunction, NfEnv, NfError, Verdict};
use nfs::fw::{AclAction, AclProto, AclRule, Firewall, FwConfig, PortSpec, TenantAcl};
use packet::tcp_flags::SYN;
use pipeline::{FlowKey, PacketMeta};

fn key(s: &str) -> FlowKey {
    s.parse().unwrap()
}

fn pkt(tenant: u32, k: &str) -> FirstPacket {
    FirstPacket::new(key(k), tenant, PacketMeta::new(60, SYN))
}

fn rule(action: AclAction) -> AclRule {
    AclRule::new(action)
}

fn tenant(t: u32, rules: Vec<AclRule>, default_action: AclAction) -> TenantAcl {
    TenantAcl {
        tenant: t,
        rules,
        default_action,
    }
}

fn fw(tenants: Vec<TenantAcl>) -> Firewall {
    Firewall::new(FwConfig {
        tenants,
        ..FwConfig::default()
    })
    .unwrap()
}

fn allowed(f: &mut Firewall, t: u32, k: &str) -> bool {
    let d = f.first_packet(&pkt(t, k), &mut NfEnv::new(0, 0)).unwrap();
    match d.verdict {
        Verdict::Pass { .. } => {
            // No rewrites: the firewall only filters.
            assert!(d.forward.is_empty() && d.reverse.is_empty());
            true
        }
        Verdict::Drop { reason } => {
            assert_eq!(reason, "acl-deny");
            false
        }
    }
}

#[test]
fn first_match_wins() {
    let mut deny_net = rule(AclAction::Deny);
    deny_net.src = vec!["198.18.5.0/24".into()];
    let mut web = rule(AclAction::Allow);
    web.proto = AclProto::Tcp;
    web.dport = Some(PortSpec::Port(80));
    let mut f = fw(vec![tenant(1, vec![deny_net, web], AclAction::Deny)]);
    assert!(!allowed(&mut f, 1, "1 tcp 198.18.5.9:1000 > 198.19.0.1:80"));
    assert!(allowed(&mut f, 1, "1 tcp 198.18.6.9:1000 > 198.19.0.1:80"));
    assert!(!allowed(&mut f, 1, "1 tcp 198.18.6.9:1000 > 198.19.0.1:81"));
    // Swap the order: the allow now comes first and wins for the /24 too.
    let mut deny_net = rule(AclAction::Deny);
    deny_net.src = vec!["198.18.5.0/24".into()];
    let mut web = rule(AclAction::Allow);
    web.dport = Some(PortSpec::Text("80".into()));
    let mut f = fw(vec![tenant(1, vec![web, deny_net], AclAction::Allow)]);
    assert!(allowed(&mut f, 1, "1 tcp 198.18.5.9:1000 > 198.19.0.1:80"));
    assert!(!allowed(&mut f, 1, "1 tcp 198.18.5.9:1000 > 198.19.0.1:22"));
    assert!(allowed(&mut f, 1, "1 tcp 198.18.6.9:1000 > 198.19.0.1:22"));
}

#[test]
fn defaults_per_tenant_and_firewall_wide() {
    let mut f = fw(vec![
        tenant(1, vec![], AclAction::Allow),
        tenant(2, vec![], AclAction::Deny),
    ]);
    let k = "1 udp 198.18.0.1:1000 > 198.19.0.1:53";
    assert!(allowed(&mut f, 1, k));
    assert!(!allowed(&mut f, 2, "2 udp 198.18.0.1:1000 > 198.19.0.1:53"));
    // No ACL for tenant 3: the firewall-wide default, deny unless configured.
    assert!(!allowed(&mut f, 3, "3 udp 198.18.0.1:1000 > 198.19.0.1:53"));
    let mut f = Firewall::new(FwConfig {
        default_action: AclAction::Allow,
        ..FwConfig::default()
    })
    .unwrap();
    assert!(allowed(&mut f, 3, k));
}

#[test]
fn v4_and_v6_prefixes() {
    let mut r = rule(AclAction::Allow);
    r.src = vec!["198.18.0.0/15".into(), "2001:2::/48".into()];
    r.dst = vec!["198.19.0.0/24".into(), "2001:2:0:1::/64".into()];
    let mut f = fw(vec![tenant(1, vec![r], AclAction::Deny)]);
    assert!(allowed(&mut f, 1, "1 tcp 198.19.255.1:1 > 198.19.0.9:80"));
    assert!(!allowed(&mut f, 1, "1 tcp 198.20.0.1:1 > 198.19.0.9:80"));
    assert!(!allowed(&mut f, 1, "1 tcp 198.18.0.1:1 > 198.19.1.9:80"));
    assert!(allowed(
        &mut f,
        1,
        "1 tcp [2001:2::7]:1 > [2001:2:0:1::9]:80"
    ));
    assert!(allowed(
        &mut f,
        1,
        "1 tcp [2001:2:0:ffff::7]:1 > [2001:2:0:1:ffff::9]:80"
    ));
    assert!(!allowed(
        &mut f,
        1,
        "1 tcp [2001:2:1::7]:1 > [2001:2:0:1::9]:80"
    ));
    assert!(!allowed(
        &mut f,
        1,
        "1 tcp [2001:2::7]:1 > [2001:2:0:2::9]:80"
    ));

    // A v6-only rule does not match v4 flows, and the other way round.
    let mut v6 = rule(AclAction::Allow);
    v6.src = vec!["::/0".into()];
    let mut f = fw(vec![tenant(1, vec![v6], AclAction::Deny)]);
    assert!(!allowed(&mut f, 1, "1 udp 198.18.0.1:1 > 198.19.0.1:2"));
    assert!(allowed(&mut f, 1, "1 udp [2001:2::1]:1 > [2001:2::2]:2"));
    // Host addresses without a length are /32 and /128.
    let mut host = rule(AclAction::Allow);
    host.dst = vec!["198.19.0.1".into(), "2001:2::2".into()];
    let mut f = fw(vec![tenant(1, vec![host], AclAction::Deny)]);
    assert!(allowed(&mut f, 1, "1 udp 198.18.0.1:1 > 198.19.0.1:2"));
    assert!(!allowed(&mut f, 1, "1 udp 198.18.0.1:1 > 198.19.0.2:2"));
    assert!(allowed(&mut f, 1, "1 udp [2001:2::1]:1 > [2001:2::2]:2"));
}

#[test]
fn port_ranges_are_inclusive() {
    let mut r = rule(AclAction::Allow);
    r.sport = Some(PortSpec::Text("1024-65535".into()));
    r.dport = Some(PortSpec::Text("8000-8080".into()));
    let mut f = fw(vec![tenant(1, vec![r], AclAction::Deny)]);
    for (k, ok) in [
        ("1 tcp 198.18.0.1:1024 > 198.19.0.1:8000", true),
        ("1 udp 198.18.0.1:65535 > 198.19.0.1:8080", true),
        ("1 tcp 198.18.0.1:1023 > 198.19.0.1:8000", false),
        ("1 tcp 198.18.0.1:2000 > 198.19.0.1:7999", false),
        ("1 tcp 198.18.0.1:2000 > 198.19.0.1:8081", false),
        // Ports mean nothing to ICMP: a rule with ports does not match it.
        ("1 icmp 198.18.0.1:2000 > 198.19.0.1:8000", false),
    ] {
        assert_eq!(allowed(&mut f, 1, k), ok, "{k}");
    }
}

#[test]
fn protocols() {
    let cases = [
        (AclProto::Tcp, "1 tcp 198.18.0.1:1 > 198.19.0.1:2"),
        (AclProto::Udp, "1 udp 198.18.0.1:1 > 198.19.0.1:2"),
        (AclProto::Icmp, "1 icmp 198.18.0.1:7 > 198.19.0.1:0"),
        (AclProto::Icmp6, "1 icmp6 [2001:2::1]:7 > [2001:2::2]:0"),
    ];
    for (p, k) in cases {
        let mut r = rule(AclAction::Allow);
        r.proto = p;
        let mut f = fw(vec![tenant(1, vec![r], AclAction::Deny)]);
        for (_, other) in cases {
            assert_eq!(allowed(&mut f, 1, other), other == k, "{p:?} vs {other}");
        }
    }
    let mut f = fw(vec![tenant(
        1,
        vec![rule(AclAction::Allow)],
        AclAction::Deny,
    )]);
    for (_, k) in cases {
        assert!(allowed(&mut f, 1, k));
    }
    assert!(allowed(&mut f, 1, "1 47 198.18.0.1:0 > 198.19.0.1:0"));
}

#[test]
fn denied_flow_becomes_a_cached_drop_rule() {
    let f = fw(vec![tenant(1, vec![], AclAction::Deny)]);
    let mut c = nf::Chain::new(
        vec![Box::new(f)],
        nf::ChainSpec::seq(1),
        nf::Egress::LOCAL,
        nf::Egress::LOCAL,
    )
    .unwrap();
    let r = c
        .decide(
            &pkt(1, "1 tcp 198.18.0.1:1 > 198.19.0.1:22"),
            &mut NfEnv::new(0, 0),
        )
        .unwrap();
    assert_eq!(
        pipeline::format_actions(&r.forward.actions),
        "drop acl-deny"
    );
    assert_eq!(
        r.forward.idle_timeout,
        Some(std::time::Duration::from_secs(60))
    );
    assert!(r.reverse.is_none());
}

fn config_error(cfg: FwConfig) -> String {
    match Firewall::new(cfg) {
        Err(NfError::Config(m)) => m,
        Err(e) => panic!("wrong error kind: {e}"),
        Ok(_) => panic!("accepted"),
    }
}

fn with_rule(r: AclRule) -> FwConfig {
    FwConfig {
        tenants: vec![tenant(4, vec![rule(AclAction::Allow), r], AclAction::Deny)],
        ..FwConfig::default()
    }
}

#[test]
fn bad_configurations_are_clear_config_errors() {
    let mut r = rule(AclAction::Allow);
    r.name = Some("web".into());
    r.src = vec!["198.18.0.1/15".into()];
    let m = config_error(with_rule(r));
    assert!(m.contains("tenant 4 rule 1 (web)"), "{m}");
    assert!(m.contains("did you mean 198.18.0.0/15"), "{m}");

    let mut r = rule(AclAction::Allow);
    r.dst = vec!["198.18.0.0/33".into()];
    assert!(config_error(with_rule(r)).contains("prefix length must be 0 to 32"));

    let mut r = rule(AclAction::Allow);
    r.dst = vec!["example.com".into()];
    assert!(config_error(with_rule(r)).contains("not an address or prefix"));

    let mut r = rule(AclAction::Allow);
    r.dport = Some(PortSpec::Text("2000-1000".into()));
    assert!(config_error(with_rule(r)).contains("starts above its end"));

    let mut r = rule(AclAction::Allow);
    r.sport = Some(PortSpec::Text("http".into()));
    assert!(config_error(with_rule(r)).contains("ports are numbers"));

    let mut r = rule(AclAction::Allow);
    r.proto = AclProto::Icmp;
    r.dport = Some(PortSpec::Port(0));
    assert!(config_error(with_rule(r)).contains("tcp and udp only"));

    let mut r = rule(AclAction::Allow);
    r.src = vec!["198.18.0.0/15".into()];
    r.dst = vec!["2001:2::/48".into()];
    assert!(config_error(with_rule(r)).contains("can never match"));

    let mut r = rule(AclAction::Allow);
    r.proto = AclProto::Icmp6;
    r.src = vec!["198.18.0.0/15".into()];
    assert!(config_error(with_rule(r)).contains("can never match"));

    let mut c = with_rule(rule(AclAction::Deny));
    c.tenants.push(tenant(4, vec![], AclAction::Allow));
    assert!(config_error(c).contains("tenant 4 has two ACLs"));

    let mut c = with_rule(rule(AclAction::Deny));
    c.timeouts.tcp_established_s = 0;
    assert!(config_error(c).contains("timeouts.tcp_established_s"));

    let e = FwConfig::from_json(r#"{"tenants":[{"tenant":1,"rules":[{"action":"permit"}]}]}"#)
        .unwrap_err();
    assert!(
        matches!(&e, NfError::Config(m) if m.contains("permit")),
        "{e}"
    );
    let e = FwConfig::from_json(
        r#"{"tenants":[{"tenant":1,"rules":[{"action":"allow","dst_port":80}]}]}"#,
    )
    .unwrap_err();
    assert!(
        matches!(&e, NfError::Config(m) if m.contains("dst_port")),
        "{e}"
    );

    // A failed update leaves the running ACL alone.
    let mut f = fw(vec![tenant(1, vec![], AclAction::Allow)]);
    let mut bad = rule(AclAction::Deny);
    bad.src = vec!["300.1.1.1".into()];
    assert!(f.update(with_rule(bad)).is_err());
    assert!(allowed(&mut f, 1, "1 udp 198.18.0.1:1 > 198.19.0.1:2"));
}

#[test]
fn builds_from_json_through_nfconfig() {
    let json = r#"{
        "kind": "fw",
        "default_action": "deny",
        "tenants": [{
            "tenant": 7,
            "default_action": "deny",
            "rules": [
                {"name": "no-bad-net", "action": "deny", "src": ["198.18.66.0/24"]},
                {"action": "allow", "proto": "tcp", "dport": "80"},
                {"action": "allow", "proto": "udp", "dport": 53, "dst": ["198.19.0.53"]},
                {"action": "allow", "proto": "icmp6"}
            ]
        }],
        "timeouts": {"tcp_established_s": 3600}
    }"#;
    let cfg: nfs::NfConfig = serde_json::from_str(json).unwrap();
    let mut nf = nfs::build(&cfg).unwrap();
    assert_eq!(nf.kind(), "fw");
    let mut run = |k: &str| nf.first_packet(&pkt(7, k), &mut NfEnv::new(0, 0)).unwrap();
    assert_eq!(
        run("1 tcp 198.18.66.1:1000 > 198.19.0.1:80"),
        Decision {
            idle_timeout: Some(std::time::Duration::from_secs(60)),
            ..Decision::drop("acl-deny")
        }
    );
    assert!(matches!(
        run("1 tcp 198.18.0.1:1000 > 198.19.0.1:80").verdict,
        Verdict::Pass { .. }
    ));
    assert!(matches!(
        run("1 udp 198.18.0.1:1000 > 198.19.0.53:53").verdict,
        Verdict::Pass { .. }
    ));
    assert!(matches!(
        run("1 udp 198.18.0.1:1000 > 198.19.0.54:53").verdict,
        Verdict::Drop { .. }
    ));
    assert!(matches!(
        run("1 icmp6 [2001:2::1]:9 > [2001:2::2]:0").verdict,
        Verdict::Pass { .. }
    ));
    // The configuration round-trips through serde unchanged.
    let back: nfs::NfConfig = serde_json::from_str(&serde_json::to_string(&cfg).unwrap()).unwrap();
    assert_eq!(back, cfg);
}

#[test]
fn one_tenants_conntrack_never_admits_another_tenants_flow() {
    // VNIs are per tenant, so this cannot happen in a sound deployment; if a
    // misconfiguration made two tenants share a VNI, tenant 2's ACL still rules.
    let mut f = fw(vec![
        tenant(1, vec![], AclAction::Allow),
        tenant(2, vec![], AclAction::Deny),
    ]);
    let k = "1 udp 198.18.0.1:1000 > 198.19.0.1:53";
    assert!(allowed(&mut f, 1, k));
    assert!(!allowed(&mut f, 2, k));
}
