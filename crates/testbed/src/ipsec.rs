//! The IPsec remote site (docs/ipsec.md): a branch office whose gateway terminates
//! starfabric's ESP tunnel, with a host behind it.
//!
//! ```text
//!  c0 (VPC 0, 198.19.1.2) ─VXLAN─▶ pp (starfabric's IPsec gateway, 198.18.1.2)
//!                                   │ ESP (AES-GCM, tunnel mode)
//!                                  rt ──── up0 198.18.20.2  rs (remote site gateway)
//!                                                            lan0 198.18.170.1
//!                                                             │
//!                                                      rh: 198.18.170.10 (nginx, iperf3)
//! ```
//!
//! The remote gateway is the Linux kernel with `ip xfrm state/policy` (`aead
//! 'rfc4106(gcm(aes))'`) wherever the kernel has ESP and GCM ([`kernel_esp`]). On a
//! kernel built without them (`CONFIG_INET_ESP`, `CONFIG_CRYPTO_GCM` unset: no xfrm ESP
//! state can exist) it is a userspace ESP endpoint instead (`esp_peer.py`: scapy's
//! ESP over a TUN device, AES-GCM by OpenSSL), so the tunnel still meets an
//! implementation that is not starfabric's. [`RemoteSite::kind`] says which one ran.
//!
//! [`KernelGateway`] is the bench's baseline: the PP namespace's kernel doing what the
//! PP node does (VXLAN from the VPC, xfrm ESP to the remote site), same topology.

use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::sync::Mutex;
use std::time::Duration;

use crate::cmd::{self, CONFIG_LIMIT};
use crate::topo::{addr as tb_addr, mac, vni, Node, Proc, Testbed};
use crate::{Error, Result};

/// Addresses of the remote site, all in 198.18.0.0/15.
pub mod addr {
    use std::net::Ipv4Addr;

    /// The remote gateway's underlay address (the tunnel's far end).
    pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(198, 18, 20, 2);
    /// The router's side of that link.
    pub const GATEWAY_RT: Ipv4Addr = Ipv4Addr::new(198, 18, 20, 1);
    /// The remote site's LAN, behind the gateway (the tunnel's remote prefix).
    pub const LAN: &str = "198.18.170.0/24";
    pub const LAN_GW: Ipv4Addr = Ipv4Addr::new(198, 18, 170, 1);
    /// The host behind the gateway: nginx and iperf3.
    pub const HOST: Ipv4Addr = Ipv4Addr::new(198, 18, 170, 10);
}

/// Who terminates the tunnel at the remote site.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerKind {
    /// The Linux kernel: `ip xfrm`.
    Xfrm,
    /// `esp_peer.py` (scapy) over a TUN device.
    Userspace,
}

impl PeerKind {
    pub fn name(self) -> &'static str {
        match self {
            PeerKind::Xfrm => "kernel xfrm",
            PeerKind::Userspace => "userspace ESP (scapy)",
        }
    }
}

/// One SA: SPI and RFC 4106 KEYMAT in hex (key then 4-byte salt).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sa {
    pub spi: u32,
    pub key: String,
}

impl Sa {
    pub fn new(spi: u32, key: &str) -> Self {
        Sa {
            spi,
            key: key.trim_start_matches("0x").to_string(),
        }
    }
}

/// Why this kernel cannot run an xfrm ESP state with AES-GCM, or `None` when it can.
/// Tried in `ns` (a state added and deleted again).
pub fn kernel_esp(ns: &str) -> Result<Option<String>> {
    let key = format!("0x{}", "01".repeat(20));
    let state = |verb: &'static str| {
        [
            "ip",
            "xfrm",
            "state",
            verb,
            "src",
            "198.18.255.1",
            "dst",
            "198.18.255.2",
            "proto",
            "esp",
            "spi",
            "0x5f5f5f5f",
        ]
    };
    let mut add = state("add").to_vec();
    add.extend(["mode", "tunnel", "aead", "rfc4106(gcm(aes))", &key, "128"]);
    let out = cmd::in_ns_full(ns, &add, CONFIG_LIMIT)?;
    if !out.ok() {
        return Ok(Some(format!(
            "`ip xfrm state add ... aead rfc4106(gcm(aes))` failed: {} (the kernel needs CONFIG_INET_ESP and CONFIG_CRYPTO_GCM)",
            out.stderr.trim()
        )));
    }
    cmd::in_ns(ns, &state("delete"), CONFIG_LIMIT)?;
    Ok(None)
}

/// The remote site: its two namespaces, and the tunnel's far end in one of them.
pub struct RemoteSite {
    pub kind: PeerKind,
    /// Why not the kernel, when the userspace peer runs.
    pub why_userspace: Option<String>,
    peer: Option<Proc>,
    /// The userspace peer's SA file, and what it holds.
    sa_file: std::path::PathBuf,
    sas: Mutex<(Option<Sa>, Vec<Sa>)>,
    /// The tunnel's near end: starfabric's gateway (or the kernel baseline's).
    near: Ipv4Addr,
    /// The VPC prefix behind the near end.
    vpc: String,
}

const TUN: &str = "esp0";
/// The userspace peer's TUN MTU: ESP adds at most 58 bytes, and the remote host's TCP
/// learns this from the kernel's "fragmentation needed" like behind any tunnel.
const TUN_MTU: &str = "1400";

impl RemoteSite {
    /// `remote site: KIND` and, when it is not the kernel, why.
    pub fn summary(&self) -> String {
        format!(
            "remote site: {}{}",
            self.kind.name(),
            self.why_userspace
                .as_ref()
                .map(|w| format!(" (not the kernel: {w})"))
                .unwrap_or_default()
        )
    }

    /// Make the remote site's namespaces and links, and pick its tunnel endpoint:
    /// `Some(kind)` insists on one (xfrm fails where the kernel has no ESP), `None`
    /// takes the kernel where it can.
    pub fn build(tb: &Testbed, want: Option<PeerKind>) -> Result<RemoteSite> {
        let rs = tb.ns(Node::RemoteSite);
        let rh = tb.ns(Node::RemoteHost);
        for ns in [&rs, &rh] {
            tb.add_v4_namespace(ns)?;
        }
        cmd::in_ns(
            &rs,
            &[
                "sysctl",
                "-qw",
                "net.ipv4.ip_forward=1",
                "net.ipv4.conf.all.rp_filter=0",
                "net.ipv4.conf.default.rp_filter=0",
            ],
            CONFIG_LIMIT,
        )?;
        cmd::ip_batch(
            &tb.ns(Node::Router),
            &format!(
                "link add drs type veth peer name up0 netns {rs}\n\
                 addr add {}/24 dev drs\n\
                 link set drs up\n",
                addr::GATEWAY_RT
            ),
        )?;
        cmd::ip_batch(
            &rs,
            &format!(
                "addr add {}/24 dev up0\n\
                 link set up0 up\n\
                 route add {} via {}\n\
                 route add {} via {}\n\
                 link add lan0 type veth peer name eth0 netns {rh}\n\
                 addr add {}/24 dev lan0\n\
                 link set lan0 up\n",
                addr::GATEWAY,
                tb_addr::UNDERLAY,
                addr::GATEWAY_RT,
                tb_addr::TENANT_NET,
                addr::GATEWAY_RT,
                addr::LAN_GW,
            ),
        )?;
        cmd::ip_batch(
            &rh,
            &format!(
                "addr add {}/24 dev eth0\nlink set eth0 up\nroute add default via {}\n",
                addr::HOST,
                addr::LAN_GW
            ),
        )?;
        let why = kernel_esp(&rs)?;
        let kind = match (want, &why) {
            (Some(PeerKind::Xfrm), Some(w)) => return Err(Error::Setup(w.clone())),
            (Some(k), _) => k,
            (None, None) => PeerKind::Xfrm,
            (None, Some(_)) => PeerKind::Userspace,
        };
        Ok(RemoteSite {
            kind,
            why_userspace: (kind == PeerKind::Userspace).then(|| why.unwrap_or_default()),
            peer: None,
            sa_file: tb.path("esp-peer-sas.json"),
            sas: Mutex::new((None, Vec::new())),
            near: tb_addr::PP,
            vpc: tb_addr::TENANT_NET.to_string(),
        })
    }

    fn xfrm_state(&self, tb: &Testbed, outbound: bool, sa: &Sa) -> Result<()> {
        let (src, dst, reqid) = if outbound {
            (addr::GATEWAY, self.near, "1")
        } else {
            (self.near, addr::GATEWAY, "2")
        };
        let (src, dst, spi, key) = (
            src.to_string(),
            dst.to_string(),
            format!("{:#x}", sa.spi),
            format!("0x{}", sa.key),
        );
        let mut argv = vec![
            "ip", "xfrm", "state", "add", "src", &src, "dst", &dst, "proto", "esp", "spi", &spi,
            "reqid", reqid, "mode", "tunnel",
        ];
        if !outbound {
            argv.extend(["replay-window", "64"]);
        }
        argv.extend(["aead", "rfc4106(gcm(aes))", &key, "128"]);
        tb.exec(Node::RemoteSite, &argv, CONFIG_LIMIT).map(drop)
    }

    fn xfrm_delete(&self, tb: &Testbed, outbound: bool, spi: u32) -> Result<()> {
        let (src, dst) = if outbound {
            (addr::GATEWAY, self.near)
        } else {
            (self.near, addr::GATEWAY)
        };
        let (src, dst, spi) = (src.to_string(), dst.to_string(), format!("{spi:#x}"));
        tb.exec(
            Node::RemoteSite,
            &[
                "ip", "xfrm", "state", "delete", "src", &src, "dst", &dst, "proto", "esp", "spi",
                &spi,
            ],
            CONFIG_LIMIT,
        )
        .map(drop)
    }

    fn write_sas(&self, out: &Sa, ins: &[Sa]) -> Result<()> {
        let sa = |s: &Sa| serde_json::json!({"spi": s.spi, "key": s.key});
        let v = serde_json::json!({
            "local": addr::GATEWAY.to_string(),
            "peer": self.near.to_string(),
            "out": sa(out),
            "in": ins.iter().map(sa).collect::<Vec<_>>(),
        });
        // Written whole and renamed, so the peer never reads half a file.
        let tmp = self.sa_file.with_extension("tmp");
        std::fs::write(&tmp, v.to_string()).map_err(|e| Error::io(tmp.display().to_string(), e))?;
        std::fs::rename(&tmp, &self.sa_file)
            .map_err(|e| Error::io(self.sa_file.display().to_string(), e))
    }

    /// Bring the tunnel up: the remote site seals with `out` (starfabric's inbound SA)
    /// and opens with `ins` (starfabric's outbound SAs).
    pub fn install(&mut self, tb: &Testbed, out: &Sa, ins: &[Sa]) -> Result<()> {
        match self.kind {
            PeerKind::Xfrm => {
                // Again (another run of the bench): start from nothing.
                for what in ["policy", "state"] {
                    tb.exec(
                        Node::RemoteSite,
                        &["ip", "xfrm", what, "flush"],
                        CONFIG_LIMIT,
                    )?;
                }
                self.xfrm_state(tb, true, out)?;
                for s in ins {
                    self.xfrm_state(tb, false, s)?;
                }
                let (lan, vpc, gw, near) = (addr::LAN, self.vpc.as_str(), addr::GATEWAY, self.near);
                let mut p = String::new();
                let _ = writeln!(
                    p,
                    "policy add src {lan} dst {vpc} dir out tmpl src {gw} dst {near} proto esp reqid 1 mode tunnel"
                );
                for dir in ["in", "fwd"] {
                    let _ = writeln!(
                        p,
                        "policy add src {vpc} dst {lan} dir {dir} tmpl src {near} dst {gw} proto esp reqid 2 mode tunnel"
                    );
                }
                tb.exec(
                    Node::RemoteSite,
                    &["sh", "-c", &xfrm_batch(&p)],
                    CONFIG_LIMIT,
                )?;
            }
            PeerKind::Userspace if self.peer.is_some() => self.write_sas(out, ins)?,
            PeerKind::Userspace => {
                self.write_sas(out, ins)?;
                let script = tb.path("esp_peer.py");
                std::fs::write(&script, ESP_PEER)
                    .map_err(|e| Error::io(script.display().to_string(), e))?;
                let (s, f) = (
                    script.display().to_string(),
                    self.sa_file.display().to_string(),
                );
                let p = tb.spawn(
                    Node::RemoteSite,
                    "esp-peer",
                    &["/usr/bin/python3", "-u", &s, &f, TUN],
                )?;
                tb.wait_log(&p, "esp-peer: ready", Duration::from_secs(30))?;
                cmd::ip_batch(
                    &tb.ns(Node::RemoteSite),
                    &format!(
                        "link set {TUN} mtu {TUN_MTU} up\nroute replace {} dev {TUN}\n",
                        self.vpc
                    ),
                )?;
                self.peer = Some(p);
            }
        }
        *self.sas.lock().unwrap_or_else(|e| e.into_inner()) = (Some(out.clone()), ins.to_vec());
        Ok(())
    }

    /// Rekey, step 1 (before starfabric's own rekey): open with `sa` too.
    pub fn add_inbound(&self, tb: &Testbed, sa: &Sa) -> Result<()> {
        let mut g = self.sas.lock().unwrap_or_else(|e| e.into_inner());
        match self.kind {
            PeerKind::Xfrm => self.xfrm_state(tb, false, sa)?,
            PeerKind::Userspace => {
                let mut ins = g.1.clone();
                ins.push(sa.clone());
                self.write_sas(g.0.as_ref().expect("installed"), &ins)?;
            }
        }
        g.1.push(sa.clone());
        Ok(())
    }

    /// Rekey, step 2 (once starfabric opens with `sa`): seal with `sa` from now on, and
    /// delete the SA it sealed with before.
    pub fn switch_outbound(&self, tb: &Testbed, sa: &Sa) -> Result<()> {
        let mut g = self.sas.lock().unwrap_or_else(|e| e.into_inner());
        let old = g.0.clone().expect("installed");
        match self.kind {
            PeerKind::Xfrm => {
                // The newest state of a policy's template is the one the kernel uses.
                self.xfrm_state(tb, true, sa)?;
                self.xfrm_delete(tb, true, old.spi)?;
            }
            PeerKind::Userspace => self.write_sas(sa, &g.1)?,
        }
        g.0 = Some(sa.clone());
        Ok(())
    }

    /// Rekey, step 3 (after starfabric stopped sealing with it): forget inbound `spi`.
    pub fn remove_inbound(&self, tb: &Testbed, spi: u32) -> Result<()> {
        let mut g = self.sas.lock().unwrap_or_else(|e| e.into_inner());
        g.1.retain(|s| s.spi != spi);
        match self.kind {
            PeerKind::Xfrm => self.xfrm_delete(tb, false, spi)?,
            PeerKind::Userspace => self.write_sas(g.0.as_ref().expect("installed"), &g.1)?,
        }
        Ok(())
    }

    /// The userspace peer's last counters line, or the kernel's ESP states.
    pub fn describe(&self, tb: &Testbed) -> String {
        match (&self.peer, self.kind) {
            (Some(p), _) => std::fs::read_to_string(&p.log)
                .unwrap_or_default()
                .lines()
                .rev()
                .find(|l| l.contains("out="))
                .unwrap_or("")
                .to_string(),
            (None, _) => tb
                .exec(
                    Node::RemoteSite,
                    &["ip", "-s", "xfrm", "state"],
                    CONFIG_LIMIT,
                )
                .unwrap_or_default(),
        }
    }
}

/// The orchestrator's REST API as `starfabric up` in the control namespace serves it,
/// called with curl from that namespace (the API listens there only).
pub struct CtlApi {
    pub server: String,
    pub token: String,
}

impl CtlApi {
    /// From the CLI configuration `starfabric up` wrote (`STARFABRIC_CONFIG`).
    pub fn from_config(path: &std::path::Path) -> Result<CtlApi> {
        let text =
            std::fs::read_to_string(path).map_err(|e| Error::io(path.display().to_string(), e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Parse {
            what: path.display().to_string(),
            msg: e.to_string(),
        })?;
        let field = |k: &str| {
            v[k].as_str()
                .map(str::to_string)
                .ok_or_else(|| Error::Parse {
                    what: path.display().to_string(),
                    msg: format!("no {k}"),
                })
        };
        Ok(CtlApi {
            server: field("server")?,
            token: field("token")?,
        })
    }

    /// `method path [body]`: the status and the JSON answer (null if none).
    pub fn call(
        &self,
        tb: &Testbed,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<(u16, serde_json::Value)> {
        let auth = format!("Authorization: Bearer {}", self.token);
        let url = format!("{}{path}", self.server);
        let b = body.map(|b| b.to_string()).unwrap_or_default();
        let mut argv = vec![
            "curl",
            "-s",
            "-m",
            "10",
            "-X",
            method,
            "-H",
            &auth,
            "-H",
            "Content-Type: application/json",
            "-w",
            "\n%{http_code}",
            &url,
        ];
        if body.is_some() {
            argv.extend(["-d", &b]);
        }
        let out = tb.exec(Node::Ctl, &argv, Duration::from_secs(15))?;
        let (text, code) = out.trim_end().rsplit_once('\n').unwrap_or(("", out.trim()));
        Ok((
            code.parse().unwrap_or(0),
            serde_json::from_str(text).unwrap_or(serde_json::Value::Null),
        ))
    }

    /// A PUT that must succeed (200 or 201).
    pub fn put(
        &self,
        tb: &Testbed,
        path: &str,
        body: serde_json::Value,
    ) -> Result<serde_json::Value> {
        let (code, v) = self.call(tb, "PUT", path, Some(&body))?;
        if code != 200 && code != 201 {
            return Err(Error::Command {
                cmd: format!("PUT {path}"),
                msg: format!("{code} {v}"),
            });
        }
        Ok(v)
    }

    /// Poll tunnel `path` until the PP node reports sealing with `spi`; its state then.
    pub fn wait_applied(
        &self,
        tb: &Testbed,
        path: &str,
        spi: u32,
        limit: Duration,
    ) -> Result<serde_json::Value> {
        cmd::wait_for(&format!("PP sealing with SPI {spi:#x}"), limit, || {
            let (code, v) = self.call(tb, "GET", path, None)?;
            if code != 200 {
                return Err(Error::Command {
                    cmd: format!("GET {path}"),
                    msg: format!("{code} {v}"),
                });
            }
            Ok((v["status"][0]["outbound_spi"] == serde_json::json!(spi)).then_some(v))
        })
    }
}

/// The API body of VPC 0's tunnel to the remote site: starfabric seals with `out` and
/// opens with `ins`.
pub fn tunnel_body(out: &Sa, ins: &[&Sa]) -> serde_json::Value {
    serde_json::json!({
        "vni": vni::tenant(0),
        "peer": addr::GATEWAY.to_string(),
        "local_prefixes": [tb_addr::TENANT_NET],
        "remote_prefixes": [addr::LAN],
        "vtep": tb_addr::client_underlay(0).to_string(),
        "vm_mac": mac::client(0),
        "outbound": {"spi": out.spi, "key": out.key},
        "inbound": ins.iter().map(|s| serde_json::json!({"spi": s.spi, "key": s.key})).collect::<Vec<_>>(),
    })
}

/// `ip -batch` for xfrm lines (`ip xfrm` takes no batch file of its own lines here, so
/// a shell runs them one by one).
fn xfrm_batch(lines: &str) -> String {
    lines
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| format!("ip xfrm {l}"))
        .collect::<Vec<_>>()
        .join(" && ")
}

/// The userspace ESP endpoint, written into the run directory when it is used.
pub const ESP_PEER: &str = include_str!("esp_peer.py");

/// The bench's baseline: the PP namespace's kernel as the IPsec gateway. VXLAN from
/// VPC 0's client arrives on `vx100` (as [`crate::baseline`] sets it up), the kernel
/// routes the remote LAN through an xfrm policy (ESP to the remote site) and back.
pub struct KernelGateway;

impl KernelGateway {
    /// Configure it with SAs `out` (PP namespace → remote site) and `inb` (back). The
    /// remote site must be installed with the mirror SAs and near end [`tb_addr::PP`].
    pub fn start(tb: &Testbed, out: &Sa, inb: &Sa) -> Result<KernelGateway> {
        let ns = tb.ns(Node::Pp);
        if let Some(why) = kernel_esp(&ns)? {
            return Err(Error::Setup(why));
        }
        let t = vni::tenant(0);
        cmd::ip_batch(
            &ns,
            &format!(
                "link add vx{t} address {} type vxlan id {t} local {} remote {} dstport 4789 dev up0\n\
                 addr add {}/24 dev vx{t}\n\
                 link set vx{t} up\n\
                 route add {} via 198.18.1.1\n",
                mac::tenant_gw(0),
                tb_addr::PP,
                tb_addr::client_underlay(0),
                tb_addr::TENANT_GW,
                addr::LAN,
            ),
        )?;
        let (pp, gw, lan, vpc) = (tb_addr::PP, addr::GATEWAY, addr::LAN, tb_addr::TENANT_NET);
        let st = |src: Ipv4Addr, dst: Ipv4Addr, sa: &Sa, reqid: u32, rw: bool| {
            format!(
                "state add src {src} dst {dst} proto esp spi {:#x} reqid {reqid} mode tunnel{} aead rfc4106(gcm(aes)) 0x{} 128",
                sa.spi,
                if rw { " replay-window 64" } else { "" },
                sa.key
            )
        };
        let mut p = String::new();
        let _ = writeln!(p, "{}", st(pp, gw, out, 1, false));
        let _ = writeln!(p, "{}", st(gw, pp, inb, 2, true));
        let _ = writeln!(
            p,
            "policy add src {vpc} dst {lan} dir out tmpl src {pp} dst {gw} proto esp reqid 1 mode tunnel"
        );
        for dir in ["in", "fwd"] {
            let _ = writeln!(
                p,
                "policy add src {lan} dst {vpc} dir {dir} tmpl src {gw} dst {pp} proto esp reqid 2 mode tunnel"
            );
        }
        let script = xfrm_batch(&p).replace("rfc4106(gcm(aes))", "'rfc4106(gcm(aes))'");
        cmd::in_ns(&ns, &["sh", "-c", &script], CONFIG_LIMIT)?;
        cmd::in_ns(
            &ns,
            &["ethtool", "-K", &format!("vx{t}"), "tx", "off"],
            CONFIG_LIMIT,
        )?;
        Ok(KernelGateway)
    }

    /// Undo [`KernelGateway::start`] so a PP node can take the namespace again.
    pub fn stop(self, tb: &Testbed) -> Result<()> {
        let ns = tb.ns(Node::Pp);
        cmd::in_ns(&ns, &["ip", "xfrm", "policy", "flush"], CONFIG_LIMIT)?;
        cmd::in_ns(&ns, &["ip", "xfrm", "state", "flush"], CONFIG_LIMIT)?;
        cmd::in_ns(
            &ns,
            &["ip", "link", "del", &format!("vx{}", vni::tenant(0))],
            CONFIG_LIMIT,
        )
        .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_stay_in_the_benchmark_range() {
        for a in [addr::GATEWAY, addr::GATEWAY_RT, addr::LAN_GW, addr::HOST] {
            assert_eq!(a.octets()[..2], [198, 18]);
        }
        assert_eq!(Sa::new(5, "0xabcd").key, "abcd");
        assert_eq!(
            xfrm_batch("policy add a\n\nstate add b\n"),
            "ip xfrm policy add a && ip xfrm state add b"
        );
    }
}
