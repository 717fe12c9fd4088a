//! Measurements with real tools, each bounded in time, each returning what arrived.
//!
//! - [`tcp_gbps`]: one iperf3 TCP stream, client in a VPC, server at the internet host;
//!   the receiver's byte count (`sum_received`).
//! - [`udp64_pps`]: trafgen writes 64-byte frames (60 bytes + the 4-byte FCS a wire
//!   would add: Ethernet 14, IPv4 20, UDP 8, payload 18) of `flows` UDP flows into the
//!   client's VXLAN device, as fast as it can, for warm-up + `secs`; the rate is what
//!   the internet host's nftables sink counted during the `secs` window, not what was
//!   sent.
//! - [`cps`]: wrk with `Connection: close`, so every request is a new TCP connection;
//!   successful connections/s are completed 2xx/3xx responses per second.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use serde::Serialize;
use tracing::debug;

use crate::cmd;
use crate::services::{self, IPERF_PORT, SINK_PORT};
use crate::topo::{addr, mac, Node, Testbed};
use crate::{Error, Result};

/// One row of results; `None` where a measurement does not apply (or failed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Numbers {
    pub tcp_gbps: Option<f64>,
    pub udp64_pps: Option<f64>,
    pub cps: Option<f64>,
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
            cps: r(self.cps, base.cps),
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

/// The trafgen configuration: 64-byte UDP frames from VPC `j`'s client to `dst`:9,
/// `flows` source ports, as the client's VXLAN device would send them to its gateway.
pub fn trafgen_conf(j: usize, dst: Ipv4Addr, flows: u16) -> String {
    let hi = 10000 + flows.max(1) - 1;
    format!(
        "/* 64-byte frames on the wire: 14 + 20 + 8 + 18 bytes, plus the FCS */\n\
         {{\n\
         \x20 eth(da={}, sa={}, type=0x0800),\n\
         \x20 ipv4(saddr={}, daddr={dst}, ttl=64, df),\n\
         \x20 udp(sp=dinc(10000, {hi}), dp={SINK_PORT}),\n\
         \x20 fill(0x5f, 18)\n\
         }}\n",
        mac::tenant_gw(j),
        mac::client(j),
        addr::CLIENT,
    )
}

/// 64-byte UDP packets/s from VPC `j`'s client to the internet host's sink: trafgen runs
/// for `warmup` (flows get their rules, queues fill) plus `secs`; the sink's count over
/// the `secs` window, divided by its measured length.
pub fn udp64_pps(tb: &Testbed, j: usize, flows: u16, warmup: Duration, secs: f64) -> Result<f64> {
    let conf = tb.path(&format!("trafgen-c{j}.cfg"));
    std::fs::write(&conf, trafgen_conf(j, addr::INET, flows))
        .map_err(|e| Error::io(conf.display().to_string(), e))?;
    let c = conf.display().to_string();
    // One sender process (-P 1): the machine has few cores and the PP node needs one.
    // --no-sock-mem/--notouch-irq: leave socket memory sysctls and IRQ affinities alone.
    let gen = tb.spawn(
        Node::Client(j),
        &format!("trafgen c{j}"),
        &[
            "trafgen",
            "--dev",
            "vx0",
            "--conf",
            &c,
            "--cpus",
            "1",
            "--no-sock-mem",
            "--notouch-irq",
        ],
    )?;
    let result = (|| {
        cmd::sleep(warmup)?;
        if !tb.res.child_running(gen.pid) {
            let log = std::fs::read_to_string(&gen.log).unwrap_or_default();
            return Err(Error::Setup(format!("trafgen exited: {log}")));
        }
        let (t0, n0) = (Instant::now(), services::udp_sink_packets(tb)?);
        cmd::sleep(Duration::from_secs_f64(secs))?;
        let (t1, n1) = (Instant::now(), services::udp_sink_packets(tb)?);
        debug!(
            packets = n1 - n0,
            secs = (t1 - t0).as_secs_f64(),
            "udp sink"
        );
        Ok((n1.saturating_sub(n0)) as f64 / (t1 - t0).as_secs_f64())
    })();
    tb.stop(&gen);
    result
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
    fn trafgen_frames_are_64_bytes_with_fcs() {
        let c = trafgen_conf(0, addr::INET, 16);
        assert!(c.contains("udp(sp=dinc(10000, 10015), dp=9)"));
        assert!(c.contains("daddr=198.18.200.10"));
        assert!(c.contains("fill(0x5f, 18)"));
        assert_eq!(14 + 20 + 8 + 18 + 4, 64);
    }

    #[test]
    fn ratios() {
        let a = Numbers {
            tcp_gbps: Some(2.0),
            udp64_pps: Some(100.0),
            cps: None,
        };
        let b = Numbers {
            tcp_gbps: Some(4.0),
            udp64_pps: Some(0.0),
            cps: Some(1.0),
        };
        let r = a.ratio(&b);
        assert_eq!(r.tcp_gbps, Some(0.5));
        assert_eq!(r.udp64_pps, None);
        assert_eq!(r.cps, None);
    }
}
