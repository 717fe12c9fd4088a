//! Measurements with real tools, each bounded in time, each returning what arrived.
//!
//! - [`tcp_gbps`]: one iperf3 TCP stream, client in a VPC, server at the internet host;
//!   the receiver's byte count (`sum_received`).
//! - [`udp64_pps`]: trafgen sends 64-byte UDP frames (60 bytes + the 4-byte FCS a wire
//!   would add: Ethernet 14, IPv4 20, UDP 8, payload 18) of `flows` UDP flows from a
//!   VPC client, VXLAN-encapsulated toward the PP node as the client's VXLAN device
//!   would, as fast as it can, for warm-up + `secs`; the rate is what the internet
//!   host's nftables sink counted during the `secs` window, not what was sent.
//! - [`cps`]: wrk with `Connection: close`, so every request is a new TCP connection;
//!   successful connections/s are completed 2xx/3xx responses per second.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use serde::Serialize;
use tracing::debug;

use crate::cmd;
use crate::ladder;
use crate::services::{self, IPERF_PORT, SINK_PORT};
use crate::topo::{addr, mac, Node, Testbed};
use crate::{Error, Result};

/// One row of results; `None` where a measurement does not apply (or failed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Numbers {
    pub tcp_gbps: Option<f64>,
    /// End to end: sender, router, NF, gateway and sink all on the sender's CPU.
    pub udp64_pps: Option<f64>,
    /// The NF alone on one CPU ([`udp64_core_pps`]).
    pub udp64_core_pps: Option<f64>,
    pub cps: Option<f64>,
    /// The NF on one CPU at 2 × its peak offered load: forwarded there over its peak
    /// forwarded rate ([`Udp64Core::overload_keep`]; issue 18's goal: ≥ 0.9).
    pub overload_keep: Option<f64>,
    /// The same from back-to-back pairs of peak and 2 × peak load, median
    /// ([`Udp64Core::overload_keep_paired`]).
    pub overload_keep_paired: Option<f64>,
}

impl Numbers {
    /// `self / base` per field, where both are there and the base is positive.
    pub fn ratio(&self, base: &Numbers) -> Numbers {
        let r = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        };
        Numbers {
            tcp_gbps: r(self.tcp_gbps, base.tcp_gbps),
            udp64_pps: r(self.udp64_pps, base.udp64_pps),
            udp64_core_pps: r(self.udp64_core_pps, base.udp64_core_pps),
            cps: r(self.cps, base.cps),
            overload_keep: r(self.overload_keep, base.overload_keep),
            overload_keep_paired: r(self.overload_keep_paired, base.overload_keep_paired),
        }
    }
}

/// iperf3 TCP from `from` to the iperf3 server at `to` for `secs`: Gbit/s received.
pub fn tcp_gbps(tb: &Testbed, from: Node, to: Ipv4Addr, secs: u32) -> Result<f64> {
    let (t, port, dst) = (secs.to_string(), IPERF_PORT.to_string(), to.to_string());
    let out = tb.exec_full(
        from,
        &[
            "iperf3",
            "-c",
            &dst,
            "-p",
            &port,
            "-t",
            &t,
            "-J",
            "--connect-timeout",
            "3000",
        ],
        Duration::from_secs(u64::from(secs) + 20),
    )?;
    parse_iperf3(&out.stdout).map(|bps| bps / 1e9)
}

/// Bits/s received from `iperf3 -J` output; an error when iperf3 reported one.
pub fn parse_iperf3(json: &str) -> Result<f64> {
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| Error::Parse {
        what: "iperf3 -J".into(),
        msg: format!("{e}: {}", crate::topo::tail(json, 5)),
    })?;
    if let Some(e) = v["error"].as_str() {
        return Err(Error::Command {
            cmd: "iperf3".into(),
            msg: e.to_string(),
        });
    }
    v["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .ok_or_else(|| Error::Parse {
            what: "iperf3 -J".into(),
            msg: "no end.sum_received.bits_per_second".into(),
        })
}

/// The trafgen configuration: VPC `j`'s client sending 64-byte UDP frames to `dst`:9
/// from `flows` source ports (at most 256), already VXLAN-encapsulated toward the PP
/// node, written straight onto the client's underlay veth (`outer_smac` → the router's
/// `outer_dmac`). Encapsulating in trafgen rather than through the client's VXLAN device
/// keeps the sender's kernel out of the measurement: trafgen alone then outruns any PP.
///
/// Checksums: both IPv4 header checksums are constant and computed here; both UDP
/// checksums are 0 ("none", allowed for IPv4, and what VXLAN senders use outside), so
/// the per-flow port bytes can vary without recomputing anything.
pub fn trafgen_conf(
    j: usize,
    dst: std::net::Ipv4Addr,
    flows: u16,
    outer_dmac: [u8; 6],
    outer_smac: [u8; 6],
) -> String {
    let flows = flows.clamp(1, 256);
    let frame = udp64_frame(j, dst, outer_dmac, outer_smac);
    let b: Vec<String> = frame
        .iter()
        .enumerate()
        .map(|(i, x)| match i {
            // The low bytes of the outer (0xc0NN) and inner (10000 + NN) source ports.
            OUTER_SPORT_LOW => format!("dinc(0, {})", flows - 1),
            INNER_SPORT_LOW => format!("dinc(0x10, {})", 0x10 + flows - 1),
            _ => format!("0x{x:02x}"),
        })
        .collect();
    format!(
        "/* 64-byte UDP frames (60 bytes + FCS) from VPC {j}, VXLAN-encapsulated: {} bytes */\n{{\n  {}\n}}\n",
        frame.len(),
        b.join(", ")
    )
}

/// Index of the outer UDP source port's low byte in [`udp64_frame`].
const OUTER_SPORT_LOW: usize = 14 + 20 + 1;
/// Index of the inner UDP source port's low byte in [`udp64_frame`].
const INNER_SPORT_LOW: usize = 14 + 20 + 8 + 8 + 14 + 20 + 1;

/// Flow 0 of the 64-byte UDP traffic of VPC `j`'s client to `dst`:9, VXLAN-encapsulated
/// toward the PP node (outer `outer_smac` → `outer_dmac`). Flow i has outer source port
/// 0xc000 + i and inner source port 10000 + i (trafgen and `bpf/xdp_gen.c` vary those
/// bytes).
///
/// Checksums: both IPv4 header checksums are constant and computed here; both UDP
/// checksums are 0 ("none", allowed for IPv4, and what VXLAN senders use outside), so
/// the per-flow port bytes can vary without recomputing anything.
pub fn udp64_frame(
    j: usize,
    dst: std::net::Ipv4Addr,
    outer_dmac: [u8; 6],
    outer_smac: [u8; 6],
) -> Vec<u8> {
    let inner_len = 20 + 8 + 18;
    let udp_outer_len = 8 + 8 + 14 + inner_len;
    let outer_len = 20 + udp_outer_len;
    let mac = |m: &str| -> Vec<u8> {
        m.split(':')
            .map(|p| u8::from_str_radix(p, 16).unwrap_or(0))
            .collect()
    };
    let mut b: Vec<u8> = Vec::with_capacity(14 + outer_len);
    // Outer Ethernet, IPv4 (DF, TTL 64, UDP) and UDP (source port 0xc0NN: a flow's
    // hash, as Linux VXLAN senders vary it; destination 4789).
    b.extend(outer_dmac);
    b.extend(outer_smac);
    b.extend([0x08, 0x00]);
    b.extend(ipv4_header(
        outer_len as u16,
        addr::client_underlay(j),
        addr::PP,
    ));
    b.extend([0xc0, 0x00, 0x12, 0xb5]);
    b.extend((udp_outer_len as u16).to_be_bytes());
    b.extend([0, 0]);
    // VXLAN: flags (VNI valid), VNI, reserved.
    let v = crate::topo::vni::tenant(j).to_be_bytes();
    b.extend([0x08, 0, 0, 0, v[1], v[2], v[3], 0]);
    // The inner frame, as the client's VXLAN device would carry it: 60 bytes.
    b.extend(mac(&mac::tenant_gw(j)));
    b.extend(mac(&mac::client(j)));
    b.extend([0x08, 0x00]);
    b.extend(ipv4_header(inner_len as u16, addr::CLIENT, dst));
    // Inner UDP: source port 10000 (+ the flow), destination the sink's.
    b.extend(10000u16.to_be_bytes());
    b.extend(SINK_PORT.to_be_bytes());
    b.extend((8u16 + 18).to_be_bytes());
    b.extend([0, 0]);
    b.extend([0x5f; 18]);
    b
}

/// An IPv4 header (no options, DF, TTL 64, UDP) with its checksum.
fn ipv4_header(total_len: u16, src: std::net::Ipv4Addr, dst: std::net::Ipv4Addr) -> [u8; 20] {
    let mut h = [0u8; 20];
    h[0] = 0x45;
    h[2..4].copy_from_slice(&total_len.to_be_bytes());
    h[6] = 0x40;
    h[8] = 64;
    h[9] = 17;
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let mut sum: u32 = h
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    h[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    h
}

/// The MAC address of `dev` in `n`'s namespace.
pub fn dev_mac(tb: &Testbed, n: Node, dev: &str) -> Result<[u8; 6]> {
    let out = tb.exec(n, &["ip", "-j", "link", "show", dev], cmd::CONFIG_LIMIT)?;
    let v: serde_json::Value = serde_json::from_str(&out).map_err(|e| Error::Parse {
        what: "ip -j link".into(),
        msg: e.to_string(),
    })?;
    let s = v[0]["address"].as_str().unwrap_or_default();
    let m: Vec<u8> = s
        .split(':')
        .filter_map(|p| u8::from_str_radix(p, 16).ok())
        .collect();
    m.try_into().map_err(|_| Error::Parse {
        what: "ip -j link".into(),
        msg: format!("no MAC for {dev}: {out}"),
    })
}

/// What a 64-byte UDP run measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Udp64 {
    /// Packets/s that arrived at the sink: the result.
    pub pps: f64,
    /// Packets/s trafgen put on the client's underlay link (what was offered).
    pub offered_pps: f64,
    /// Datagrams/s the PP namespace's kernel dropped because a UDP socket's receive
    /// buffer was full (`Udp: RcvbufErrors`): a PP node that could not keep up.
    pub pp_socket_drops_pps: f64,
}

/// `Udp: RcvbufErrors` of the PP namespace (`/proc/net/snmp`).
pub fn pp_rcvbuf_errors(tb: &Testbed) -> Result<u64> {
    let snmp = tb.exec(Node::Pp, &["cat", "/proc/net/snmp"], cmd::CONFIG_LIMIT)?;
    parse_snmp(&snmp, "Udp:", "RcvbufErrors")
}

/// A counter from `/proc/net/snmp` text: a header line and a value line per protocol.
pub fn parse_snmp(text: &str, proto: &str, name: &str) -> Result<u64> {
    let rows: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| l.starts_with(proto))
        .map(|l| l.split_whitespace().collect())
        .collect();
    let bad = || Error::Parse {
        what: "/proc/net/snmp".into(),
        msg: format!("no {proto} {name}"),
    };
    let [names, values] = rows.as_slice() else {
        return Err(bad());
    };
    let i = names.iter().position(|n| *n == name).ok_or_else(bad)?;
    values.get(i).and_then(|v| v.parse().ok()).ok_or_else(bad)
}

/// 64-byte UDP packets/s from VPC `j`'s client to the internet host's sink: trafgen runs
/// for `warmup` (flows get their rules, queues fill) plus `secs`; the sink's count over
/// the `secs` window, divided by its measured length.
pub fn udp64_pps(tb: &Testbed, j: usize, flows: u16, warmup: Duration, secs: f64) -> Result<Udp64> {
    let router_mac = dev_mac(tb, Node::Router, &format!("dc{j}"))?;
    let client_mac = dev_mac(tb, Node::Client(j), "up0")?;
    let conf = tb.path(&format!("trafgen-c{j}.cfg"));
    std::fs::write(
        &conf,
        trafgen_conf(j, addr::INET, flows, router_mac, client_mac),
    )
    .map_err(|e| Error::io(conf.display().to_string(), e))?;
    let c = conf.display().to_string();
    // Stopped after warm-up + `secs`; the packet count is only a second bound, at a rate
    // (3 Mpps) no sender reaches here.
    let num = ((warmup.as_secs_f64() + secs + 5.0) * 3e6) as u64;
    let num = num.to_string();
    // One sender process (--cpus 1): the machine has few cores and the PP node needs
    // one. --no-sock-mem/--notouch-irq: leave socket memory sysctls and IRQ affinities
    // alone.
    let gen = tb.spawn(
        Node::Client(j),
        &format!("trafgen c{j}"),
        &[
            "trafgen",
            "--dev",
            "up0",
            "--conf",
            &c,
            "--cpus",
            "1",
            "--no-sock-mem",
            "--notouch-irq",
            "--num",
            &num,
        ],
    )?;
    let result = (|| {
        cmd::sleep(warmup)?;
        if !tb.res.child_running(gen.pid) {
            let log = std::fs::read_to_string(&gen.log).unwrap_or_default();
            return Err(Error::Setup(format!("trafgen exited: {log}")));
        }
        let sent = |tb: &Testbed| tb.dev_counter(Node::Client(j), "up0", "tx_packets");
        let (s0, r0) = (sent(tb)?, pp_rcvbuf_errors(tb)?);
        let (t0, n0) = (Instant::now(), services::udp_sink_packets(tb)?);
        cmd::sleep(Duration::from_secs_f64(secs))?;
        let (t1, n1) = (Instant::now(), services::udp_sink_packets(tb)?);
        let (s1, r1) = (sent(tb)?, pp_rcvbuf_errors(tb)?);
        let secs = (t1 - t0).as_secs_f64();
        Ok(Udp64 {
            pps: n1.saturating_sub(n0) as f64 / secs,
            offered_pps: s1.saturating_sub(s0) as f64 / secs,
            pp_socket_drops_pps: r1.saturating_sub(r0) as f64 / secs,
        })
    })();
    tb.stop(&gen);
    result
}

/// What a per-core 64-byte UDP run measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Udp64Core {
    /// The highest rate at which the NF forwarded to the sink over the bracket and
    /// bisection loads (RFC 2889's maximum forwarding rate): the result.
    pub pps: f64,
    /// Frames/s offered at that load (taken into the PP node's receive ring, plus
    /// refused because the ring was full).
    pub offered_pps: f64,
    /// The peak offered load: the highest load (asked, packets/s) the NF kept
    /// (forwarded ≥ [`ladder::KEEP`] of it); `None` if even the first was not kept.
    pub peak_load_pps: Option<u64>,
    /// Forwarded at 2 × the peak offered load ([`ladder::Phase::Overload`]).
    pub overload2x_pps: Option<f64>,
    /// What that step actually offered (the sender may fall short of 2 ×).
    pub overload2x_offered_pps: Option<f64>,
    /// `overload2x_pps / pps`: what the NF keeps of its peak at twice the load it
    /// peaked at (issue 18's goal: ≥ 0.9).
    pub overload_keep: Option<f64>,
    /// The median over [`ladder::PAIRS`] back-to-back pairs of forwarded at 2 × the peak
    /// load over forwarded at the peak load ([`ladder::Ladder::overload_keep_paired`]):
    /// the same question as `overload_keep`, without dividing by the run's maximum.
    pub overload_keep_paired: Option<f64>,
    /// Forwarded with the sender unpaced (as fast as its CPU goes): how the NF holds up
    /// under the heaviest overload this sender makes.
    pub overload_pps: Option<f64>,
    /// Every load tried, in order: [offered, forwarded] packets/s.
    pub steps: Vec<[f64; 2]>,
    /// The same steps with the load asked for and what each was for.
    pub ladder: Vec<ladder::Step>,
    /// The CPU the NF ran on (the PP namespace's receive path and the NF's processes).
    pub nf_cpu: usize,
    /// The CPU the generator ran on.
    pub gen_cpu: usize,
}

/// 64-byte UDP packets/s that the NF in the PP namespace forwards **on one CPU**, with
/// the sender on another and the sink a drop at the router's side of the PP link:
///
/// - the sender is `bin bench xdp-gen` in the router namespace, pinned to CPU 0: the
///   kernel's XDP live-frames test run puts VPC `j`'s VXLAN frames (`flows` flows, as
///   [`udp64_frame`] builds them) straight into the receive ring of the PP node's `up0`;
/// - `up0`'s NAPI runs threaded, its kthread pinned to CPU 1, and so are `nf_pids` (the
///   PP node's process; none for the kernel): everything the NF does per packet (XDP,
///   AF_XDP copies, the userspace pipeline, or the kernel's decap, conntrack and encap)
///   runs on CPU 1;
/// - `xdp_sink` on the router's `dpp` drops the forwarded frames (on CPU 1 too, as the
///   receive softirq of whoever transmits), counted by the veth's `xdp_drops`.
///
/// The sender offers the loads of a [`ladder::Ladder`] in turn (paced frame by frame),
/// each for 0.3 s to settle plus `secs` measured, after a `warmup` at the lowest load:
/// doubling from 50k pps until a load is not kept (forwarded < 90 % of offered), then
/// four bisection steps between the last kept load and that one, then 2 × the highest
/// kept load, then unpaced. At most 14 steps, so the run takes at most
/// `warmup + 14 × (secs + 0.8 s)` (the 0.8 s: settling and the sender's start and
/// stop). The result is the highest forwarded rate (RFC 2889's maximum forwarding
/// rate); `overload_keep` is what the NF forwards at twice its peak load over that,
/// since an NF that livelocks under overload (a userspace path whose kernel half
/// starves it) forwards far less there than at its peak.
///
/// This is the "one core" rate of paper 000 §6 and of the kernel figures in the issue
/// (nftables masquerade on one core), which the end-to-end [`udp64_pps`] cannot give
/// on a veth testbed: there the sender's CPU runs the whole path of every frame. Every
/// setting is undone afterwards, also on error.
pub fn udp64_core_pps(
    tb: &Testbed,
    bin: &std::path::Path,
    j: usize,
    flows: u16,
    nf_pids: &[i32],
    warmup: Duration,
    secs: f64,
) -> Result<Udp64Core> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 {
        return Err(Error::Setup(format!(
            "the per-core rate needs 2 CPUs (one sender, one NF); this machine has {cpus}"
        )));
    }
    let (gen_cpu, nf_cpu) = (0usize, 1usize);
    let rt = tb.ns(Node::Router);
    let pp = tb.ns(Node::Pp);
    let sink = tb.path("xdp_sink.o");
    std::fs::write(&sink, xdp::XDP_SINK_OBJ)
        .map_err(|e| Error::io(sink.display().to_string(), e))?;
    let pass = tb.path("xdp_pass.o");
    let gro_was_on = cmd::in_ns(&pp, &["ethtool", "-k", "up0"], cmd::CONFIG_LIMIT)?
        .lines()
        .any(|l| l.trim() == "generic-receive-offload: on");
    let napi_before = napi_threads("up0");

    let set = |script: &str| cmd::in_ns(&pp, &["sh", "-c", script], cmd::CONFIG_LIMIT).map(drop);
    let attach = |obj: &std::path::Path| {
        let o = obj.display().to_string();
        cmd::in_ns(
            &rt,
            &[
                "ip", "-force", "link", "set", "dev", "dpp", "xdpdrv", "obj", &o, "sec", "xdp",
            ],
            cmd::CONFIG_LIMIT,
        )
        .map(drop)
    };
    let pin = |pid: i32, cpu: &str, all: bool| {
        let p = pid.to_string();
        let mut argv = vec!["taskset"];
        if all {
            argv.push("-a");
        }
        argv.extend(["-p", "-c", cpu, &p]);
        cmd::run(&argv, cmd::CONFIG_LIMIT).map(drop)
    };
    let nf = nf_cpu.to_string();
    // The NF's threads (and the CPU's ksoftirqd, which takes over softirq work that
    // overruns) get the highest CFS weight for the run, so that a build running on the
    // same machine takes a few percent of the NF's CPU rather than half of it. Their
    // old nice values come back afterwards.
    let mut reniced: Vec<(i32, i32)> = Vec::new();
    let me = own_tid();
    let my_cpus = allowed_cpus();
    let gen_s_cpu = gen_cpu.to_string();
    let result = (|| {
        attach(&sink)?;
        // A veth receives into a NAPI ring only with XDP or GRO on; the ring is what
        // the generator fills and what a threaded NAPI drains.
        cmd::in_ns(
            &pp,
            &["ethtool", "-K", "up0", "gro", "on"],
            cmd::CONFIG_LIMIT,
        )?;
        set("echo 1 > /sys/class/net/up0/threaded")?;
        let napi: Vec<i32> = napi_threads("up0")
            .into_iter()
            .filter(|p| !napi_before.contains(p))
            .collect();
        if napi.is_empty() {
            return Err(Error::Setup(
                "up0's threaded NAPI kthread did not appear".into(),
            ));
        }
        for &p in &napi {
            pin(p, &nf, false)?;
        }
        for &p in nf_pids {
            pin(p, &nf, true)?;
        }
        // The counter reads (this thread and the ethtool it forks) run beside the
        // sender, never on the NF's CPU: there a real-time PP worker leaves ordinary
        // tasks only the kernel's RT-throttling slack, and a read waited up to 0.5 s.
        if let Some(t) = me {
            pin(t, &gen_s_cpu, false)?;
        }
        let mut boost: Vec<i32> = napi.clone();
        boost.extend(nf_pids.iter().flat_map(|&p| threads_of(p)));
        boost.extend(kthreads_named(&format!("ksoftirqd/{nf_cpu}")));
        // This thread too: it reads the counters that bracket each step (an ethtool
        // process it forks, which inherits its nice value). At nice 0 beside the sender
        // at -20 it got about 1 % of a CPU, and a read took up to half a second of a
        // 1 s window.
        boost.extend(own_tid());
        for tid in boost {
            if let Some(old) = nice_of(tid) {
                set_nice(tid, -20)?;
                reniced.push((tid, old));
            }
        }
        let dmac = dev_mac(tb, Node::Pp, "up0")?;
        let smac = dev_mac(tb, Node::Router, "dpp")?;
        let frame: String = udp64_frame(j, addr::INET, dmac, smac)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let (bin_s, flows_s, gen_s) = (
            bin.display().to_string(),
            flows.to_string(),
            gen_cpu.to_string(),
        );
        // One sender process per load: sends for `run` seconds at `rate`.
        let spawn = |rate: u64, run: f64| {
            let (rate_s, run_s) = (rate.to_string(), format!("{run:.2}"));
            tb.spawn(
                Node::Router,
                &format!("xdp-gen c{j}"),
                &[
                    "nice", "-n", "-20", "taskset", "-c", &gen_s, &bin_s, "bench", "xdp-gen",
                    "--dev", "dpp", "--frame", &frame, "--flows", &flows_s, "--secs", &run_s,
                    "--rate", &rate_s,
                ],
            )
        };
        // The counters are read by an ethtool process at some moment during its run,
        // and with the sender and the NF each holding a CPU that run can take tens of
        // milliseconds: stamped at its end, a slow first read and a fast second one
        // shorten the window against the counts and inflate the rates. The middle of
        // the run is the stamp; the error is at most half of each read's duration.
        let read = || -> Result<(u64, u64, Instant)> {
            let before = Instant::now();
            let st = ethtool_stats(tb, Node::Router, "dpp")?;
            let took = before.elapsed();
            debug!(
                read_ms = took.as_secs_f64() * 1e3,
                "per-core step: counters read"
            );
            let get = |k: &str| st.iter().find(|(n, _)| n == k).map_or(0, |(_, v)| *v);
            Ok((
                get("rx_queue_0_xdp_drops"),
                get("tx_queue_0_xdp_xmit") + get("tx_queue_0_xdp_xmit_errors"),
                before + took / 2,
            ))
        };
        // Warm-up at the lowest load: every flow gets its rule (and, with the fast path
        // on, becomes an elephant and moves to the driver).
        let gen = spawn(ladder::LADDER_START, warmup.as_secs_f64())?;
        let w = cmd::sleep(warmup + Duration::from_millis(200));
        tb.stop(&gen);
        w?;
        let settle = Duration::from_millis(300);
        let mut lad = ladder::Ladder::new();
        while let Some((phase, rate)) = lad.next() {
            let gen = spawn(rate, settle.as_secs_f64() + secs + 0.5)?;
            let measured = (|| {
                cmd::sleep(settle)?;
                if !tb.res.child_running(gen.pid) {
                    let log = std::fs::read_to_string(&gen.log).unwrap_or_default();
                    return Err(Error::Setup(format!("xdp-gen exited: {log}")));
                }
                // The NF's threads and the receive kthread it competes with.
                let mut tasks = nf_tasks(nf_pids);
                tasks.extend(napi.iter().map(|p| format!("/proc/{p}/stat")));
                let switches0: Vec<(u64, u64)> = tasks.iter().map(|t| ctxt_switches(t)).collect();
                let (d0, o0, t0) = read()?;
                // Whether the NF ran real-time during the window (PP's governor
                // switches with the kernel's drops): sampled while the step runs.
                let (mut samples, mut rt_samples) = (0u32, 0u32);
                let end = t0 + Duration::from_secs_f64(secs);
                while Instant::now() < end {
                    cmd::sleep((end - Instant::now()).min(RT_SAMPLE_EVERY))?;
                    samples += 1;
                    rt_samples += u32::from(tasks.iter().any(|t| task_is_rt(t)));
                }
                let (d1, o1, t1) = read()?;
                let secs = (t1 - t0).as_secs_f64();
                // Per NF thread: voluntary (it waited: a wakeup each) and involuntary
                // (preempted) context switches per second, and its name.
                for (t, (v0, n0)) in tasks.iter().zip(&switches0) {
                    let (v1, n1) = ctxt_switches(t);
                    if v1 + n1 > v0 + n0 + 10 {
                        debug!(
                            task = %t.trim_end_matches("/stat"),
                            comm = std::fs::read_to_string(t.replace("/stat", "/comm")).unwrap_or_default().trim(),
                            voluntary_per_s = (v1.saturating_sub(*v0)) as f64 / secs,
                            preempted_per_s = (n1.saturating_sub(*n0)) as f64 / secs,
                            "per-core step: NF thread switches"
                        );
                    }
                }
                Ok([
                    o1.saturating_sub(o0) as f64 / secs,
                    d1.saturating_sub(d0) as f64 / secs,
                    f64::from(rt_samples) / f64::from(samples.max(1)),
                ])
            })();
            tb.stop(&gen);
            let [offered, forwarded, rt_share] = measured?;
            tracing::debug!(?phase, rate, offered, forwarded, rt_share, "per-core step");
            lad.record(phase, rate, offered, forwarded);
            lad.note_rt_share(rt_share);
        }
        let best = lad.peak();
        let over = lad.overload();
        Ok(Udp64Core {
            pps: best.map_or(0.0, |s| s.forwarded),
            offered_pps: best.map_or(0.0, |s| s.offered),
            peak_load_pps: lad.peak_load(),
            overload2x_pps: over.map(|s| s.forwarded),
            overload2x_offered_pps: over.map(|s| s.offered),
            overload_keep: lad.overload_keep(),
            overload_keep_paired: lad.overload_keep_paired(),
            overload_pps: lad.unpaced().map(|s| s.forwarded),
            steps: lad.steps.iter().map(|s| [s.offered, s.forwarded]).collect(),
            ladder: lad.steps.clone(),
            nf_cpu,
            gen_cpu,
        })
    })();
    // Undo, whatever happened: the NF's processes may run anywhere again, NAPI back in
    // softirq, GRO as it was, the router's side passing everything.
    for (tid, old) in reniced {
        let _ = set_nice(tid, old);
    }
    let all = format!("0-{}", cpus - 1);
    for &p in nf_pids {
        let _ = pin(p, &all, true);
    }
    if let (Some(t), Some(c)) = (me, &my_cpus) {
        let _ = pin(t, c, false);
    }
    let _ = set("echo 0 > /sys/class/net/up0/threaded");
    if !gro_was_on {
        let _ = cmd::in_ns(
            &pp,
            &["ethtool", "-K", "up0", "gro", "off"],
            cmd::CONFIG_LIMIT,
        );
    }
    if let Err(e) = attach(&pass) {
        tracing::warn!(error = %e, "restoring xdp_pass on the router's dpp");
    }
    result
}

/// PIDs of the kernel's threaded-NAPI kthreads of devices named `dev` (`napi/DEV-ID`).
fn napi_threads(dev: &str) -> Vec<i32> {
    let prefix = format!("napi/{dev}-");
    numbered_entries("/proc")
        .into_iter()
        .filter(|pid| comm_of(*pid).is_some_and(|c| c.starts_with(&prefix)))
        .collect()
}

/// PIDs of the tasks whose command is exactly `name` (e.g. `ksoftirqd/1`).
fn kthreads_named(name: &str) -> Vec<i32> {
    numbered_entries("/proc")
        .into_iter()
        .filter(|pid| comm_of(*pid).is_some_and(|c| c == name))
        .collect()
}

/// The thread IDs of process `pid`.
fn threads_of(pid: i32) -> Vec<i32> {
    numbered_entries(&format!("/proc/{pid}/task"))
}

fn numbered_entries(dir: &str) -> Vec<i32> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()))
        .collect()
}

fn comm_of(pid: i32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|c| c.trim_end().to_string())
}

/// A task's nice value: field 19 of `/proc/TID/stat`, counted after the command's
/// closing parenthesis (the command itself may hold spaces).
fn nice_of(tid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{tid}/stat")).ok()?;
    parse_nice(&stat)
}

/// The calling thread's ID (`/proc/thread-self` links to `PID/task/TID`).
fn own_tid() -> Option<i32> {
    let link = std::fs::read_link("/proc/thread-self").ok()?;
    link.file_name()?.to_str()?.parse().ok()
}

/// The CPUs the calling thread may run on, as a list `taskset -c` takes.
fn allowed_cpus() -> Option<String> {
    let status = std::fs::read_to_string("/proc/thread-self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|v| v.trim().to_string())
}

/// How often a per-core step looks at the NF's scheduling policy.
const RT_SAMPLE_EVERY: Duration = Duration::from_millis(20);

/// The `/proc` stat files of every thread of the NF's processes.
fn nf_tasks(nf_pids: &[i32]) -> Vec<String> {
    nf_pids
        .iter()
        .flat_map(|&p| {
            threads_of(p)
                .into_iter()
                .map(move |t| format!("/proc/{p}/task/{t}/stat"))
        })
        .collect()
}

/// A task's (voluntary, involuntary) context switches, from its `status` file next to
/// `stat_path`; zeros when it is gone.
fn ctxt_switches(stat_path: &str) -> (u64, u64) {
    let status = std::fs::read_to_string(stat_path.replace("/stat", "/status")).unwrap_or_default();
    let get = |k: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    (
        get("voluntary_ctxt_switches:"),
        get("nonvoluntary_ctxt_switches:"),
    )
}

/// The task runs a real-time policy (`SCHED_FIFO` or `SCHED_RR`).
fn task_is_rt(stat_path: &str) -> bool {
    std::fs::read_to_string(stat_path)
        .ok()
        .and_then(|s| parse_policy(&s))
        .is_some_and(|p| p == libc::SCHED_FIFO as u32 || p == libc::SCHED_RR as u32)
}

/// Field 41 of `/proc/TID/stat`, the scheduling policy, counted after the command's
/// closing parenthesis.
fn parse_policy(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After ")": state is field 3, so policy (field 41) is the 39th.
    rest.split_whitespace().nth(38)?.parse().ok()
}

fn parse_nice(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After ")": state is field 3, so nice (field 19) is the 17th.
    rest.split_whitespace().nth(16)?.parse().ok()
}

/// `renice` one task (a thread ID: Linux nice values are per thread).
fn set_nice(tid: i32, nice: i32) -> Result<()> {
    let (n, t) = (nice.to_string(), tid.to_string());
    cmd::run(&["renice", "-n", &n, "-p", &t], cmd::CONFIG_LIMIT).map(drop)
}

/// `ethtool -S dev` in `n`'s namespace, as (name, value) pairs.
pub fn ethtool_stats(tb: &Testbed, n: Node, dev: &str) -> Result<Vec<(String, u64)>> {
    let out = tb.exec(n, &["ethtool", "-S", dev], cmd::CONFIG_LIMIT)?;
    Ok(parse_ethtool_stats(&out))
}

/// The `name: value` lines of `ethtool -S` output.
pub fn parse_ethtool_stats(text: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(':')?;
            Some((k.trim().to_string(), v.trim().parse().ok()?))
        })
        .collect()
}

/// What wrk reported.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WrkResult {
    pub requests: u64,
    pub secs: f64,
    pub non_2xx: u64,
    /// connect + read + write + timeout socket errors.
    pub socket_errors: u64,
}

impl WrkResult {
    /// Successful (2xx/3xx) responses per second.
    pub fn ok_per_sec(&self) -> f64 {
        self.requests.saturating_sub(self.non_2xx) as f64 / self.secs
    }
}

/// Parse wrk's text report.
pub fn parse_wrk(text: &str) -> Result<WrkResult> {
    let bad = |msg: &str| Error::Parse {
        what: "wrk output".into(),
        msg: format!("{msg}: {}", crate::topo::tail(text, 12)),
    };
    // "  1234 requests in 3.00s, 200.00KB read"
    let line = text
        .lines()
        .find(|l| l.contains(" requests in "))
        .ok_or_else(|| bad("no `requests in` line"))?;
    let mut w = line.split_whitespace();
    let requests: u64 = w
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| bad("request count"))?;
    let secs = line
        .split(" requests in ")
        .nth(1)
        .and_then(|r| r.split(',').next())
        .and_then(parse_wrk_duration)
        .ok_or_else(|| bad("duration"))?;
    let non_2xx = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Non-2xx or 3xx responses:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    // "  Socket errors: connect 0, read 3, write 0, timeout 0"
    let socket_errors = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Socket errors:"))
        .map(|r| {
            r.split(',')
                .filter_map(|p| p.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0);
    Ok(WrkResult {
        requests,
        secs,
        non_2xx,
        socket_errors,
    })
}

/// wrk durations: `3.00s`, `500.00ms`, `1.00m`.
fn parse_wrk_duration(s: &str) -> Option<f64> {
    let s = s.trim();
    if let Some(v) = s.strip_suffix("ms") {
        return v.parse::<f64>().ok().map(|v| v / 1e3);
    }
    if let Some(v) = s.strip_suffix("us") {
        return v.parse::<f64>().ok().map(|v| v / 1e6);
    }
    if let Some(v) = s.strip_suffix('s') {
        return v.parse().ok();
    }
    if let Some(v) = s.strip_suffix('m') {
        return v.parse::<f64>().ok().map(|v| v * 60.0);
    }
    None
}

/// wrk from `from` against `url` for `secs` with `conns` connections; with `close`, every
/// request on a new connection (`Connection: close`).
pub fn wrk(
    tb: &Testbed,
    from: Node,
    url: &str,
    secs: u32,
    conns: u32,
    close: bool,
) -> Result<WrkResult> {
    let (d, c) = (format!("{secs}s"), conns.to_string());
    let mut argv = vec!["wrk", "-t", "1", "-c", &c, "-d", &d, "--timeout", "2s"];
    if close {
        argv.extend(["-H", "Connection: close"]);
    }
    argv.push(url);
    let out = tb.exec_full(from, &argv, Duration::from_secs(u64::from(secs) + 20))?;
    if !out.ok() {
        return Err(Error::Command {
            cmd: argv.join(" "),
            msg: format!("{}: {}{}", out.status, out.stderr, out.stdout),
        });
    }
    parse_wrk(&out.stdout)
}

/// New TCP connections/s from `from` to `url`: wrk with `Connection: close`, counting
/// successful responses.
pub fn cps(tb: &Testbed, from: Node, url: &str, secs: u32, conns: u32) -> Result<f64> {
    let r = wrk(tb, from, url, secs, conns, true)?;
    debug!(?r, "wrk");
    Ok(r.ok_per_sec())
}

#[cfg(test)]
mod tests {
    use super::*;

    const WRK: &str = "Running 3s test @ http://198.18.200.10/\n\
  1 threads and 32 connections\n\
  Thread Stats   Avg      Stdev     Max   +/- Stdev\n\
    Latency     3.10ms    1.20ms  20.00ms   90.00%\n\
    Req/Sec     9.80k     1.00k   11.00k    70.00%\n\
  29400 requests in 3.00s, 4.50MB read\n\
  Socket errors: connect 0, read 12, write 0, timeout 3\n\
  Non-2xx or 3xx responses: 5\n\
Requests/sec:   9800.00\n\
Transfer/sec:      1.50MB\n";

    #[test]
    fn wrk_report() {
        let r = parse_wrk(WRK).unwrap();
        assert_eq!(r.requests, 29400);
        assert_eq!(r.secs, 3.0);
        assert_eq!(r.non_2xx, 5);
        assert_eq!(r.socket_errors, 15);
        assert!((r.ok_per_sec() - 29395.0 / 3.0).abs() < 1e-9);
        assert_eq!(parse_wrk_duration("500.00ms"), Some(0.5));
        assert!(parse_wrk("garbage").is_err());
    }

    #[test]
    fn iperf3_report() {
        let ok = r#"{"start":{},"end":{"sum_received":{"bits_per_second":2.5e9}}}"#;
        assert_eq!(parse_iperf3(ok).unwrap(), 2.5e9);
        let err = r#"{"start":{},"end":{},"error":"unable to connect to server"}"#;
        assert!(parse_iperf3(err).is_err());
        assert!(parse_iperf3("not json").is_err());
    }

    #[test]
    fn trafgen_frames_carry_64_byte_inner_frames() {
        let c = trafgen_conf(0, addr::INET, 16, [2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
        let body = c.split('{').nth(1).unwrap().split('}').next().unwrap();
        // The counters' own commas are not byte separators.
        let body = body
            .replace("dinc(0, 15)", "dinc(0;15)")
            .replace("dinc(0x10, 31)", "dinc(0x10;31)");
        let items: Vec<&str> = body.split(',').map(str::trim).collect();
        // One item per byte (the dinc counters are one byte each).
        assert_eq!(items.len(), 14 + 20 + 8 + 8 + 60);
        assert_eq!(items.len() - 50 + 4, 64, "inner frame + FCS");
        assert_eq!(items[50 + 34 + 1], "dinc(0x10;31)");
        assert_eq!(items[14 + 20 + 1], "dinc(0;15)");
        // VNI 100 in the VXLAN header.
        assert_eq!(
            &items[42..50],
            ["0x08", "0x00", "0x00", "0x00", "0x00", "0x00", "0x64", "0x00"]
        );
        assert!(c.contains("110 bytes"));
    }

    #[test]
    fn nice_is_read_after_the_command() {
        let stat = "42 (napi/up0 -7) S 2 0 0 0 -1 2129984 0 0 0 0 0 5 0 0 20 -20 1 0 100";
        assert_eq!(parse_nice(stat), Some(-20));
        assert_eq!(parse_nice("42 (x) S 1 2"), None);
        assert!(nice_of(std::process::id() as i32).is_some());
    }

    #[test]
    fn the_scheduling_policy_is_read_after_the_command() {
        // A SCHED_FIFO (1) task at priority 10 (rt_priority is field 40).
        let mut f: Vec<String> = (3..=52).map(|i| i.to_string()).collect();
        f[0] = "R".into();
        f[40 - 3] = "10".into();
        f[41 - 3] = "1".into();
        let stat = format!("7 (pp worker (0)) {}", f.join(" "));
        assert_eq!(parse_policy(&stat), Some(1));
        assert_eq!(parse_policy("7 (x) R 1 2"), None);
        assert!(
            !task_is_rt("/proc/thread-self/stat"),
            "the test thread is ordinary"
        );
        assert!(!task_is_rt("/proc/0/task/0/stat"), "no such task: not RT");
        // The test thread's own ID names a task of this process.
        assert!(allowed_cpus().is_some_and(|c| !c.is_empty()));
        let tid = own_tid().expect("a thread id");
        let me = std::process::id();
        assert!(std::path::Path::new(&format!("/proc/{me}/task/{tid}")).exists());
    }

    #[test]
    fn ethtool_statistics_parse() {
        let t = "NIC statistics:\n     peer_ifindex: 2\n     rx_queue_0_xdp_drops: 1234\n     odd line\n";
        let s = parse_ethtool_stats(t);
        assert_eq!(
            s,
            vec![
                ("peer_ifindex".to_string(), 2),
                ("rx_queue_0_xdp_drops".to_string(), 1234)
            ]
        );
    }

    #[test]
    fn the_raw_frame_and_the_trafgen_template_agree() {
        let f = udp64_frame(0, addr::INET, [2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
        assert_eq!(f.len(), 110);
        assert_eq!(&f[OUTER_SPORT_LOW - 1..=OUTER_SPORT_LOW], [0xc0, 0x00]);
        assert_eq!(
            u16::from_be_bytes([f[INNER_SPORT_LOW - 1], f[INNER_SPORT_LOW]]),
            10000
        );
        // bpf/xdp_gen.c writes the same two ports at these offsets.
        assert_eq!((OUTER_SPORT_LOW - 1, INNER_SPORT_LOW - 1), (34, 84));
        assert_eq!(u16::from_be_bytes([f[36], f[37]]), 4789);
    }

    #[test]
    fn ipv4_header_checksum_verifies() {
        let h = ipv4_header(96, addr::client_underlay(0), addr::PP);
        let sum: u32 = h
            .chunks(2)
            .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
            .sum();
        let folded = (sum & 0xffff) + (sum >> 16);
        assert_eq!(folded, 0xffff);
    }

    #[test]
    fn snmp_counters() {
        let t = "Ip: Forwarding DefaultTTL\nIp: 1 64\nUdp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors\nUdp: 10 0 5 7 4\n";
        assert_eq!(parse_snmp(t, "Udp:", "RcvbufErrors").unwrap(), 4);
        assert_eq!(parse_snmp(t, "Udp:", "InDatagrams").unwrap(), 10);
        assert!(parse_snmp(t, "Udp:", "Nope").is_err());
        assert!(parse_snmp(t, "Tcp:", "InSegs").is_err());
    }

    #[test]
    fn ratios() {
        let a = Numbers {
            tcp_gbps: Some(2.0),
            udp64_pps: Some(100.0),
            udp64_core_pps: Some(3.0),
            cps: None,
            overload_keep: Some(0.5),
            overload_keep_paired: Some(0.9),
        };
        let b = Numbers {
            tcp_gbps: Some(4.0),
            udp64_pps: Some(0.0),
            udp64_core_pps: Some(2.0),
            cps: Some(1.0),
            overload_keep: Some(1.0),
            overload_keep_paired: None,
        };
        let r = a.ratio(&b);
        assert_eq!(r.tcp_gbps, Some(0.5));
        assert_eq!(r.udp64_pps, None);
        assert_eq!(r.udp64_core_pps, Some(1.5));
        assert_eq!(r.cps, None);
        assert_eq!(r.overload_keep, Some(0.5));
        assert_eq!(r.overload_keep_paired, None);
    }
}
