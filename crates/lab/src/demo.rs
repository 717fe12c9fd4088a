//! `starfabric demo --pipeline`: the PP pipeline step by step, then its benchmark.
//!
//! A small in-process "rule server" plays SNAT so the walk-through needs no FM or SC:
//! it answers each rule request with a paired-pool mapping, as SC does. The default
//! `starfabric demo` (`make demo`) is the whole platform on the netns testbed
//! (`demo_testbed.rs`).

use std::net::{IpAddr, Ipv4Addr};

use anyhow::{Context, Result};
use clap::Args;
use packet::build::{udp_v4, vxlan_wrap};
use packet::{parse_frame, L4};
use pipeline::{
    format_actions, ManualClock, MemRing, NodeAddr, Pipeline, PipelineConfig, Rule, RuleReply,
    RuleSource, VecSource, VpcBinding, Worker,
};

use crate::bench::{pipeline_bench, PipelineBenchArgs};

#[derive(Args)]
pub struct DemoArgs {
    /// The offline walk-through of the PP pipeline instead of the testbed demo.
    #[arg(long)]
    pipeline: bool,
    /// Testbed demo: seconds of traffic.
    #[arg(long, default_value_t = 20)]
    secs: u32,
    /// Skip the benchmark at the end (--pipeline).
    #[arg(long)]
    no_bench: bool,
    /// Seconds per benchmark point.
    #[arg(long, default_value_t = 0.5)]
    seconds: f64,
}

fn step(n: u32, title: &str) {
    println!("\n\x1b[1m[{n}] {title}\x1b[0m");
}

fn describe(frame: &[u8]) -> String {
    let Ok(f) = parse_frame(frame) else {
        return "unparseable".into();
    };
    let ip_str = |buf: &[u8], ip: &packet::Ip| -> String {
        let a = |r: std::ops::Range<usize>| -> IpAddr {
            let b = &buf[r];
            if b.len() == 4 {
                IpAddr::from([b[0], b[1], b[2], b[3]])
            } else {
                let mut x = [0u8; 16];
                x.copy_from_slice(b);
                IpAddr::from(x)
            }
        };
        let (sp, dp, p) = match ip.l4 {
            L4::Udp { sport, dport, .. } => (sport, dport, "udp"),
            L4::Tcp { sport, dport, .. } => (sport, dport, "tcp"),
            _ => (0, 0, "ip"),
        };
        format!(
            "{p} {}:{sp} → {}:{dp}",
            a(ip.src_range()),
            a(ip.dst_range())
        )
    };
    let outer = f.ip().map(|ip| ip_str(frame, ip)).unwrap_or_default();
    match (f.vxlan, f.vxlan_inner(frame)) {
        (Some(v), Some(inner)) => {
            let i = parse_frame(inner)
                .ok()
                .and_then(|fi| fi.ip().map(|ip| ip_str(inner, ip)))
                .unwrap_or_default();
            format!("outer [{outer}] vxlan vni {} inner [{i}]", v.vni)
        }
        _ => outer,
    }
}

pub fn run(a: DemoArgs) -> Result<()> {
    if !a.pipeline {
        return crate::demo_testbed::run(a.secs);
    }
    println!("starfabric demo: the PP node's match-action pipeline");
    println!("A PP node caches rules only, never NF state. A flow's first packet misses; the");
    println!("node holds it, asks the fabric master for a rule, and applies that rule to every");
    println!("later packet of the flow with one table lookup.");

    let node = NodeAddr {
        ip: Ipv4Addr::new(198, 18, 0, 1),
        mac: [2, 0, 0, 0, 0, 1],
        gw_mac: [2, 0, 0, 0, 0, 2],
    };
    let (req_tx, req_rx) = crossbeam_channel::bounded(64);
    let (rep_tx, rep_rx) = crossbeam_channel::bounded(64);
    let mut p = Pipeline::new(
        PipelineConfig::new(node),
        RuleSource::Channel {
            requests: req_tx,
            replies: rep_rx,
        },
    )?;
    p.bind_vpc(
        100,
        VpcBinding {
            tenant: 1,
            chain: 1,
        },
    );
    let mut io = MemRing::new(VecSource::default(), 64);
    io.sink.capture = true;
    let clock = ManualClock::default();
    let mut w = Worker::new(p, io, 64, Box::new(clock.clone()));

    let packet = |seq: u8| {
        let inner = udp_v4([198, 18, 10, 2], 40000, [198, 19, 0, 9], 53, &[seq; 18]);
        vxlan_wrap([198, 18, 0, 50], [198, 18, 0, 1], 51000, 100, &inner)
    };

    step(
        1,
        "Tenant 1 (VPC VNI 100) sends three packets of a new flow",
    );
    println!("    {}", describe(&packet(0)));
    for s in 0..3 {
        w.io.source.push(packet(s), 0);
    }
    w.run_once()?;
    let st = w.pipeline.stats();
    println!(
        "    misses {}, held {}, rule requests {}, transmitted {}",
        st.misses,
        w.pipeline.pending().held(),
        st.rule_requests,
        w.io.sink.captured.len()
    );

    step(2, "The rule request (what FM receives)");
    let req = req_rx.try_recv().context("a rule request")?;
    println!(
        "    key {}  tenant {}  chain {}  first packet {} bytes",
        req.key, req.tenant, req.chain, req.meta.len
    );

    step(
        3,
        "SNAT answers with a rule for the flow: one composed action list",
    );
    let rule = Rule::new(req.key, testkit::flows::snat_actions(40000));
    println!("    match {}", rule.key);
    println!("    rule  {}", format_actions(&rule.actions));
    rep_tx.send(RuleReply::ok(rule))?;
    clock.advance(1);
    w.run_once()?;
    println!("    installed; the held packets leave in order:");
    for (port, f) in &w.io.sink.captured {
        println!("    out port {port}: {}", describe(f));
    }

    step(
        4,
        "Later packets hit the flow table: no request, no holding",
    );
    w.io.sink.captured.clear();
    for s in 3..5 {
        w.io.source.push(packet(s), 0);
    }
    w.run_once()?;
    for (port, f) in &w.io.sink.captured {
        println!("    out port {port}: {}", describe(f));
    }

    step(
        5,
        "A truncated packet is dropped and counted, never a crash",
    );
    let mut bad = packet(9);
    bad.truncate(60);
    w.io.source.push(bad, 0);
    w.run_once()?;

    let st = w.pipeline.stats();
    let (_, pkts, bytes) = w
        .pipeline
        .lookup_rule(&req.key)
        .context("rule is installed")?;
    println!(
        "    rx {}  tx {}  hits {}  misses {}  released {}  truncated drops {}",
        st.rx_packets,
        st.tx_packets,
        st.hits,
        st.misses,
        st.pending_released,
        st.dropped(pipeline::DropReason::Truncated)
    );
    println!("    the flow's rule counted {pkts} packets, {bytes} bytes");

    if a.no_bench {
        return Ok(());
    }
    step(
        6,
        "Benchmark: one core, 64-byte inner frames, random flow choice",
    );
    let r = pipeline_bench(&PipelineBenchArgs {
        json: false,
        flows: vec![1000, 100_000, 1_000_000],
        seconds: a.seconds,
        batch: pipeline::MAX_BATCH,
        quick: false,
        only: None,
        count: false,
        workload: None,
        workers: 1,
    })?;
    crate::bench::print_table(&r);
    println!("\n(full run with 10M flows: starfabric bench pipeline [--json])");
    Ok(())
}
