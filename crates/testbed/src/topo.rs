//! The topology: namespaces, veth pairs, Linux VXLAN devices, addresses and routes.
//!
//! ```text
//!                        underlay 198.18.0.0/17, one /24 per attachment, router at .1
//!   c<j> VPC client          ┌──────────────┐
//!   up0 198.18.(10+j).2 ─────┤              ├───── up0 198.18.1.2   pp  (PP node)
//!   vx0 VNI 100+j            │  rt (router) │
//!   198.19.1.2/24 (every j)  │              ├───── up0 198.18.4.2   ctl (FM, SC nodes)
//!   gw 198.19.1.1            │              │
//!                            │              ├───── up0 198.18.2.2   igw ── inet0 198.18.200.1
//!                            │              │      vx0 VNI 200 198.19.250.1   │
//!                            │              │                      inet: 198.18.200.10, .11
//!                            │              ├───── up0 198.18.3.2   svc ── br0 198.19.3.1
//!                            └──────────────┘      vx0 VNI 300 198.19.251.1   │
//!                                                               b<k>: 198.19.3.(11+k)
//! ```
//!
//! Every VXLAN device's remote is the PP node (198.18.1.2): tenant clients send their
//! VPC's traffic there, and the gateways send replies there. The PP node re-encapsulates
//! toward a gateway (forward) or a client (reverse) as its chain's egress says, and
//! writes the inner destination MAC of the receiving VXLAN device, which Linux needs to
//! take the frame as its own.
//!
//! Every tenant uses the same private subnet 198.19.1.0/24 (the client is 198.19.1.2 in
//! each VPC): only the VNI tells them apart. Public (SNAT pool) addresses are
//! 198.18.201.0/24, the internet 198.18.200.0/24, the load balancer's VIP 198.19.2.100.
//! The gateways route every 198.19.0.0/16 and 198.18.128.0/17 destination back to the PP
//! node, so replies to NATed pool addresses and to un-NATed tenant addresses both reach
//! it.

use std::fmt::Write as _;
use std::fs::File;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::info;

use crate::cleanup::Resources;
use crate::cmd::{self, CONFIG_LIMIT};
use crate::{Error, Result};

/// Addresses, all in 198.18.0.0/15.
pub mod addr {
    use std::net::Ipv4Addr;

    /// The underlay every node routes through the router.
    pub const UNDERLAY: &str = "198.18.0.0/17";
    /// The PP node's underlay address: every VXLAN device's remote.
    pub const PP: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 2);
    pub const IGW: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 2);
    pub const SVC: Ipv4Addr = Ipv4Addr::new(198, 18, 3, 2);
    /// Where FM listens.
    pub const CTL: Ipv4Addr = Ipv4Addr::new(198, 18, 4, 2);
    pub const FM_PORT: u16 = 7000;
    /// Where `starfabric up` ([`super::Testbed::spawn_up`]) has the orchestrator's REST
    /// API and its control service listen, on [`CTL`].
    pub const API_PORT: u16 = 7080;
    pub const CONTROL_PORT: u16 = 7081;

    /// PP cluster mode (docs/pp-cluster.md): PP node `i`'s own underlay address. Every
    /// node also has [`PP`] (the cluster's address, every VXLAN device's remote) on its
    /// interface, and takes frames to it when they carry a vMAC it owns.
    pub fn pp_node(i: usize) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, 1, 10 + i as u8)
    }

    /// vIP `k` of the PP cluster's vIP group: a next hop of the router's ECMP route to
    /// [`PP`], resolved to [`super::mac::vip`]`(k)` by a permanent neighbour entry.
    pub fn vip(k: usize) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, 1, 100 + k as u8)
    }

    /// Client host `j`'s underlay address.
    pub fn client_underlay(j: usize) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, 10 + j as u8, 2)
    }

    /// The internet host (nginx, iperf3, the STUN server's primary address).
    pub const INET: Ipv4Addr = Ipv4Addr::new(198, 18, 200, 10);
    /// The internet host's second address (the STUN server's alternate).
    pub const INET_ALT: Ipv4Addr = Ipv4Addr::new(198, 18, 200, 11);
    pub const INET_GW: Ipv4Addr = Ipv4Addr::new(198, 18, 200, 1);
    /// "Public" space the gateways route back to PP.
    pub const PUBLIC: &str = "198.18.128.0/17";

    /// Tenant `j`'s SNAT pool address.
    pub fn pool(j: usize) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, 201, 1 + j as u8)
    }

    /// Every tenant's private subnet (overlapping on purpose).
    pub const TENANT_NET: &str = "198.19.1.0/24";
    /// The client host of every VPC.
    pub const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 19, 1, 2);
    /// The VPC's default gateway (a static neighbour on the client: the PP node).
    pub const TENANT_GW: Ipv4Addr = Ipv4Addr::new(198, 19, 1, 1);
    /// Private space the gateways route back to PP.
    pub const PRIVATE: &str = "198.19.0.0/16";

    /// The load balancer's virtual IP.
    pub const VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 2, 100);
    pub const SVC_GW: Ipv4Addr = Ipv4Addr::new(198, 19, 3, 1);

    /// nginx backend `k`.
    pub fn backend(k: usize) -> Ipv4Addr {
        Ipv4Addr::new(198, 19, 3, 11 + k as u8)
    }

    /// The internet gateway's VXLAN address and the PP side of that segment (used by
    /// the kernel baseline; a static neighbour on the gateway otherwise).
    pub const IGW_VX: Ipv4Addr = Ipv4Addr::new(198, 19, 250, 1);
    pub const PP_IGW_VX: Ipv4Addr = Ipv4Addr::new(198, 19, 250, 2);
    pub const SVC_VX: Ipv4Addr = Ipv4Addr::new(198, 19, 251, 1);
    pub const PP_SVC_VX: Ipv4Addr = Ipv4Addr::new(198, 19, 251, 2);
}

/// VNIs.
pub mod vni {
    /// Tenant `j`'s VPC.
    pub fn tenant(j: usize) -> u32 {
        100 + j as u32
    }
    /// PP ↔ internet gateway.
    pub const INTERNET: u32 = 200;
    /// PP ↔ service gateway (the nginx backends).
    pub const SERVICES: u32 = 300;
}

/// MAC addresses (locally administered, `02:5f:...`).
pub mod mac {
    /// Client `j`'s VXLAN device.
    pub fn client(j: usize) -> String {
        format!("02:5f:01:00:{:02x}:02", j)
    }
    /// The MAC the client resolves its default gateway to.
    pub fn tenant_gw(j: usize) -> String {
        format!("02:5f:01:00:{:02x}:01", j)
    }
    /// vIP `k`'s vMAC (PP cluster mode).
    pub fn vip(k: usize) -> String {
        format!("02:5f:76:00:00:{:02x}", k)
    }
    pub const IGW: &str = "02:5f:02:00:00:01";
    pub const PP_IGW: &str = "02:5f:02:00:00:02";
    pub const SVC: &str = "02:5f:03:00:00:01";
    pub const PP_SVC: &str = "02:5f:03:00:00:02";
}

/// What to build.
#[derive(Debug, Clone)]
pub struct TopologySpec {
    /// Prefix of every namespace name (e.g. `sft-1234-0-`).
    pub prefix: String,
    /// VPCs, each with one client host (at least 1).
    pub tenants: usize,
    /// nginx backends behind the service gateway (0: no service gateway).
    pub backends: usize,
    /// Directory for configurations and logs (default: a fresh one under the temp dir).
    pub dir: Option<PathBuf>,
    /// PP cluster mode when non-zero: this many PP node namespaces on a bridge behind
    /// the router's ECMP route over `vips` vIPs (docs/pp-cluster.md). 0: one PP node at
    /// 198.18.1.2 on a veth of its own.
    pub pp_nodes: usize,
    /// vIPs of the PP cluster (cluster mode only).
    pub vips: usize,
    /// Receive and transmit queues of each PP node's underlay veth (both ends), for a
    /// PP node with this many AF_XDP workers (`starfabric pp --workers`). The router's
    /// end picks a TX queue by the outer flow hash, so flows spread over the queues.
    pub pp_queues: usize,
}

impl TopologySpec {
    pub fn new(prefix: &str) -> Self {
        TopologySpec {
            prefix: prefix.to_string(),
            tenants: 1,
            backends: 0,
            dir: None,
            pp_nodes: 0,
            vips: 8,
            pp_queues: 1,
        }
    }

    /// `n` queues on each PP node's underlay veth (see [`TopologySpec::pp_queues`]).
    pub fn pp_queues(mut self, n: usize) -> Self {
        self.pp_queues = n.max(1);
        self
    }

    /// PP cluster mode with `n` PP node namespaces (see [`TopologySpec::pp_nodes`]).
    pub fn pp_cluster(mut self, n: usize) -> Self {
        self.pp_nodes = n;
        self
    }

    pub fn tenants(mut self, n: usize) -> Self {
        self.tenants = n;
        self
    }

    pub fn backends(mut self, n: usize) -> Self {
        self.backends = n;
        self
    }
}

/// A node of the topology, i.e. a namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Node {
    Router,
    /// The PP node (cluster mode: PP node 0).
    Pp,
    /// PP node `i` ≥ 1 of a PP cluster.
    PpNode(usize),
    Ctl,
    Client(usize),
    Igw,
    Inet,
    Svc,
    Backend(usize),
    /// The IPsec remote site's gateway and the host behind it (crate::ipsec; made only
    /// by `ipsec::RemoteSite::build`).
    RemoteSite,
    RemoteHost,
}

impl Node {
    /// PP node `i` (0 is [`Node::Pp`]).
    pub fn pp(i: usize) -> Node {
        if i == 0 {
            Node::Pp
        } else {
            Node::PpNode(i)
        }
    }

    fn suffix(self) -> String {
        match self {
            Node::Router => "rt".into(),
            Node::Pp | Node::PpNode(0) => "pp".into(),
            Node::PpNode(i) => format!("pp{i}"),
            Node::Ctl => "ctl".into(),
            Node::Client(j) => format!("c{j}"),
            Node::Igw => "igw".into(),
            Node::Inet => "inet".into(),
            Node::Svc => "svc".into(),
            Node::Backend(k) => format!("b{k}"),
            Node::RemoteSite => "rs".into(),
            Node::RemoteHost => "rh".into(),
        }
    }
}

/// A process started inside the testbed, with its log (stdout and stderr).
#[derive(Debug, Clone)]
pub struct Proc {
    pub pid: i32,
    pub what: String,
    pub log: PathBuf,
}

/// A built topology. Dropping it deletes everything it created (through its
/// [`Resources`], which the caller may share).
pub struct Testbed {
    pub spec: TopologySpec,
    pub res: Arc<Resources>,
    pub dir: PathBuf,
}

impl Testbed {
    /// Build the topology of `spec`, recording everything in `res`. On error what was
    /// built so far is deleted when `res` is dropped.
    pub fn build(spec: TopologySpec, res: Arc<Resources>) -> Result<Testbed> {
        if spec.tenants == 0 || spec.tenants > 100 {
            return Err(Error::Setup("tenants must be in 1..=100".into()));
        }
        if spec.pp_nodes > 50 || (spec.pp_nodes > 0 && !(1..=64).contains(&spec.vips)) {
            return Err(Error::Setup(
                "a PP cluster has at most 50 nodes and 1..=64 vIPs".into(),
            ));
        }
        if spec.backends > 200 {
            return Err(Error::Setup("at most 200 backends".into()));
        }
        crate::check_prerequisites()?;
        let started = Instant::now();
        let dir = match &spec.dir {
            Some(d) => d.clone(),
            None => std::env::temp_dir().join(format!("{}run", spec.prefix)),
        };
        // Recorded first: removed at cleanup even if creating it fails half-way.
        res.add_path(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(dir.display().to_string(), e))?;
        let tb = Testbed { spec, res, dir };
        tb.create()?;
        info!(
            prefix = %tb.spec.prefix,
            secs = started.elapsed().as_secs_f64(),
            "testbed built"
        );
        Ok(tb)
    }

    /// The namespace name of `n`.
    pub fn ns(&self, n: Node) -> String {
        format!("{}{}", self.spec.prefix, n.suffix())
    }

    /// Every node of this topology.
    pub fn nodes(&self) -> Vec<Node> {
        let mut v = vec![Node::Router, Node::Pp, Node::Ctl, Node::Igw, Node::Inet];
        v.extend((1..self.spec.pp_nodes).map(Node::PpNode));
        v.extend((0..self.spec.tenants).map(Node::Client));
        if self.spec.backends > 0 {
            v.push(Node::Svc);
            v.extend((0..self.spec.backends).map(Node::Backend));
        }
        v
    }

    /// The `ip link add` queue options of a PP node's veth end (empty for one queue).
    fn queues(&self) -> String {
        match self.spec.pp_queues {
            0 | 1 => String::new(),
            n => format!(" numtxqueues {n} numrxqueues {n}"),
        }
    }

    /// Underlay attachments: node, third octet of its /24.
    fn attachments(&self) -> Vec<(Node, u8)> {
        let mut v = vec![(Node::Igw, 2), (Node::Ctl, 4)];
        if self.spec.pp_nodes == 0 {
            v.push((Node::Pp, 1));
        }
        if self.spec.backends > 0 {
            v.push((Node::Svc, 3));
        }
        v.extend((0..self.spec.tenants).map(|j| (Node::Client(j), 10 + j as u8)));
        v
    }

    /// Create namespace `ns` (removed with the testbed) with IPv6 off. The testbed is
    /// IPv4 only. Without IPv6, VXLAN devices send no router solicitations, MLD reports
    /// or DAD probes to the PP node, which would otherwise show up as misses and drops
    /// that no test traffic caused.
    pub(crate) fn add_v4_namespace(&self, ns: &str) -> Result<()> {
        self.res.add_namespace(ns)?;
        cmd::in_ns(
            ns,
            &[
                "sysctl",
                "-qw",
                "net.ipv6.conf.all.disable_ipv6=1",
                "net.ipv6.conf.default.disable_ipv6=1",
            ],
            CONFIG_LIMIT,
        )?;
        Ok(())
    }

    fn create(&self) -> Result<()> {
        for n in self.nodes() {
            self.add_v4_namespace(&self.ns(n))?;
        }
        let rt = self.ns(Node::Router);
        // Routers forward; nothing filters on the reverse path (replies of NATed flows
        // come back on other devices than the requests left by).
        let fwd = [
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ];
        let mut routers = vec![Node::Router, Node::Pp, Node::Igw];
        routers.extend((1..self.spec.pp_nodes).map(Node::PpNode));
        if self.spec.backends > 0 {
            routers.push(Node::Svc);
        }
        for n in routers {
            let mut argv = vec!["sysctl", "-qw"];
            argv.extend(fwd);
            cmd::in_ns(&self.ns(n), &argv, CONFIG_LIMIT)?;
        }

        // The underlay: a veth from the router to each attached node, created from inside
        // the router namespace so that nothing ever appears in the host's.
        let mut s = String::new();
        for (n, o) in self.attachments() {
            let dev = format!("d{}", n.suffix());
            let q = if n == Node::Pp {
                self.queues()
            } else {
                String::new()
            };
            let _ = writeln!(
                s,
                "link add {dev}{q} type veth peer name up0{q} netns {}",
                self.ns(n)
            );
            let _ = writeln!(s, "addr add 198.18.{o}.1/24 dev {dev}");
            let _ = writeln!(s, "link set {dev} up");
        }
        cmd::ip_batch(&rt, &s)?;
        if self.spec.pp_nodes > 0 {
            self.create_pp_cluster()?;
        }
        // The PP node's XDP fast path transmits with XDP_TX. On a veth that puts the
        // frame in the peer's XDP ring, which the kernel only drains when the peer runs
        // an XDP program itself (with GRO alone the ring fills after 256 frames and every
        // later XDP_TX fails: up0's `xdp_tx_errors`). So the router's side runs one that
        // passes everything, as a NIC would simply receive.
        let pass = self.path("xdp_pass.o");
        std::fs::write(&pass, xdp::XDP_PASS_OBJ)
            .map_err(|e| Error::io(pass.display().to_string(), e))?;
        let pass_s = pass.display().to_string();
        for i in 0..self.spec.pp_nodes.max(1) {
            let dev = self.pp_port(i);
            cmd::in_ns(
                &rt,
                &[
                    "ip", "link", "set", "dev", &dev, "xdpdrv", "obj", &pass_s, "sec", "xdp",
                ],
                CONFIG_LIMIT,
            )?;
        }
        for (n, o) in self.attachments() {
            let s = format!(
                "addr add 198.18.{o}.2/24 dev up0\nlink set up0 up\nroute add {} via 198.18.{o}.1\n",
                addr::UNDERLAY
            );
            cmd::ip_batch(&self.ns(n), &s)?;
        }

        // VPC clients: a VXLAN device toward the PP node, the tenant address, and the
        // default route through a gateway whose MAC is static (the PP node answers no ARP).
        for j in 0..self.spec.tenants {
            let ns = self.ns(Node::Client(j));
            let s = format!(
                "link add vx0 address {} type vxlan id {} local {} remote {} dstport 4789 dev up0\n\
                 addr add {}/24 dev vx0\n\
                 link set vx0 up\n\
                 neigh add {} lladdr {} dev vx0 nud permanent\n\
                 route add default via {} dev vx0\n",
                mac::client(j),
                vni::tenant(j),
                addr::client_underlay(j),
                addr::PP,
                addr::CLIENT,
                addr::TENANT_GW,
                mac::tenant_gw(j),
                addr::TENANT_GW,
            );
            cmd::ip_batch(&ns, &s)?;
            vxlan_tx_off(&ns)?;
        }

        // The internet gateway and host.
        let igw = self.ns(Node::Igw);
        let inet = self.ns(Node::Inet);
        let s = GatewaySide {
            mac: mac::IGW,
            vni: vni::INTERNET,
            local: addr::IGW,
            vx: addr::IGW_VX,
            pp_vx: addr::PP_IGW_VX,
            pp_mac: mac::PP_IGW,
            inner: format!("link add inet0 type veth peer name eth0 netns {inet}\n"),
            dev: "inet0",
            gw: addr::INET_GW,
        }
        .script();
        cmd::ip_batch(&igw, &s)?;
        vxlan_tx_off(&igw)?;
        let s = format!(
            "addr add {}/24 dev eth0\naddr add {}/24 dev eth0\nlink set eth0 up\nroute add default via {}\n",
            addr::INET,
            addr::INET_ALT,
            addr::INET_GW
        );
        cmd::ip_batch(&inet, &s)?;

        // The service gateway and its nginx backends on a bridge.
        if self.spec.backends > 0 {
            let svc = self.ns(Node::Svc);
            let mut s = GatewaySide {
                mac: mac::SVC,
                vni: vni::SERVICES,
                local: addr::SVC,
                vx: addr::SVC_VX,
                pp_vx: addr::PP_SVC_VX,
                pp_mac: mac::PP_SVC,
                inner: "link add br0 type bridge\n".to_string(),
                dev: "br0",
                gw: addr::SVC_GW,
            }
            .script();
            for k in 0..self.spec.backends {
                let _ = writeln!(
                    s,
                    "link add bk{k} type veth peer name eth0 netns {}\nlink set bk{k} master br0\nlink set bk{k} up",
                    self.ns(Node::Backend(k))
                );
            }
            cmd::ip_batch(&svc, &s)?;
            vxlan_tx_off(&svc)?;
            for k in 0..self.spec.backends {
                let s = format!(
                    "addr add {}/24 dev eth0\nlink set eth0 up\nroute add default via {}\n",
                    addr::backend(k),
                    addr::SVC_GW
                );
                cmd::ip_batch(&self.ns(Node::Backend(k)), &s)?;
            }
        }
        Ok(())
    }

    /// The router's port toward PP node `i` (`dpp`, `dpp1`, ...).
    pub fn pp_port(&self, i: usize) -> String {
        format!("d{}", Node::pp(i).suffix())
    }

    /// PP cluster mode (docs/pp-cluster.md). The router's PP side is a bridge (the
    /// cluster's switch) with a port per PP node. The cluster's address 198.18.1.2 is an
    /// ECMP route over the vIPs, hashed on L4 (so on the VXLAN outer source port, which
    /// the senders derive from the inner flow); each vIP resolves to its vMAC by a
    /// permanent neighbour entry. Which node gets a vIP's flows is only the bridge's
    /// learning: the node that last announced the vMAC. Nothing here changes when vIPs
    /// move.
    fn create_pp_cluster(&self) -> Result<()> {
        let rt = self.ns(Node::Router);
        cmd::in_ns(
            &rt,
            &["sysctl", "-qw", "net.ipv4.fib_multipath_hash_policy=1"],
            CONFIG_LIMIT,
        )?;
        let mut s = String::from(
            "link add brpp type bridge
addr add 198.18.1.1/24 dev brpp
link set brpp up
",
        );
        for i in 0..self.spec.pp_nodes {
            let dev = self.pp_port(i);
            let q = self.queues();
            let _ = writeln!(
                s,
                "link add {dev}{q} type veth peer name up0{q} netns {}
link set {dev} master brpp
link set {dev} up",
                self.ns(Node::pp(i))
            );
        }
        for k in 0..self.spec.vips {
            let _ = writeln!(
                s,
                "neigh add {} lladdr {} dev brpp nud permanent",
                addr::vip(k),
                mac::vip(k)
            );
        }
        let mut route = format!("route add {}/32", addr::PP);
        for k in 0..self.spec.vips {
            let _ = write!(route, " nexthop via {} dev brpp", addr::vip(k));
        }
        s.push_str(&route);
        s.push('\n');
        cmd::ip_batch(&rt, &s)?;
        for i in 0..self.spec.pp_nodes {
            let ns = self.ns(Node::pp(i));
            // The cluster address is on every node's interface but never answered for
            // (the router routes it, it never asks): arp_ignore/arp_announce keep the
            // nodes from claiming it or using it as an ARP source.
            cmd::in_ns(
                &ns,
                &[
                    "sysctl",
                    "-qw",
                    "net.ipv4.conf.all.arp_ignore=1",
                    "net.ipv4.conf.all.arp_announce=2",
                ],
                CONFIG_LIMIT,
            )?;
            let s = format!(
                "addr add {}/24 dev up0
addr add {}/32 dev up0
link set up0 up
route add {} via 198.18.1.1 src {}
",
                addr::pp_node(i),
                addr::PP,
                addr::UNDERLAY,
                addr::pp_node(i),
            );
            cmd::ip_batch(&ns, &s)?;
        }
        Ok(())
    }

    /// Start `argv` inside `n`'s namespace, its stdout and stderr going to a log file in
    /// the run directory. The process is recorded and killed at cleanup.
    pub fn spawn(&self, n: Node, what: &str, argv: &[&str]) -> Result<Proc> {
        let ns = self.ns(n);
        let name: String = what
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let log = self.dir.join(format!("{name}.log"));
        let f = File::create(&log).map_err(|e| Error::io(log.display().to_string(), e))?;
        let f2 = f
            .try_clone()
            .map_err(|e| Error::io(log.display().to_string(), e))?;
        // `ip netns exec` execs the program, so the child's PID is the program's own. It
        // leads a process group of its own: stopping it stops its helpers too (trafgen's
        // sender processes), and a terminal's Ctrl-C reaches only the testbed, which
        // then stops everything in order.
        let ip = cmd::which("ip").unwrap_or_else(|| PathBuf::from("ip"));
        let child = Command::new(ip)
            .process_group(0)
            .args(["netns", "exec", &ns])
            .args(argv)
            .stdin(Stdio::null())
            .stdout(f)
            .stderr(f2)
            .spawn()
            .map_err(|e| Error::io(format!("spawn {what}"), e))?;
        let pid = self.res.add_child(child, what)?;
        tracing::debug!(pid, %what, %ns, "started");
        Ok(Proc {
            pid,
            what: what.to_string(),
            log,
        })
    }

    /// Wait until `p`'s log has a line containing `needle`; fail early if `p` exits.
    pub fn wait_log(&self, p: &Proc, needle: &str, limit: Duration) -> Result<String> {
        cmd::wait_for(&format!("{}: `{needle}`", p.what), limit, || {
            let text = std::fs::read_to_string(&p.log).unwrap_or_default();
            if let Some(l) = text.lines().find(|l| l.contains(needle)) {
                return Ok(Some(l.to_string()));
            }
            if !self.res.child_running(p.pid) {
                return Err(Error::Setup(format!(
                    "{} exited before printing `{needle}`: {}",
                    p.what,
                    tail(&text, 20)
                )));
            }
            Ok(None)
        })
    }

    /// Stop a process started by [`Testbed::spawn`].
    pub fn stop(&self, p: &Proc) {
        self.res.stop_child(p.pid);
    }

    /// Kill a process started by [`Testbed::spawn`] with SIGKILL (a crash, no goodbye).
    pub fn kill(&self, p: &Proc) -> Result<()> {
        self.res.kill_child(p.pid)
    }

    /// Is a process started by [`Testbed::spawn`] still running?
    pub fn running(&self, p: &Proc) -> bool {
        self.res.child_running(p.pid)
    }

    /// Run `argv` in `n`'s namespace within `limit`; fail unless it exits 0.
    pub fn exec(&self, n: Node, argv: &[&str], limit: Duration) -> Result<String> {
        cmd::in_ns(&self.ns(n), argv, limit)
    }

    /// Run `argv` in `n`'s namespace within `limit`, whatever its exit status.
    pub fn exec_full(&self, n: Node, argv: &[&str], limit: Duration) -> Result<cmd::Output> {
        cmd::in_ns_full(&self.ns(n), argv, limit)
    }

    /// Starts `starfabric up` (the binary `exe`, with `config` as its CLI config and its
    /// state in `dir`) in the control namespace: the orchestrator's API and control service
    /// on [`addr::CTL`] ports [`addr::API_PORT`] and [`addr::CONTROL_PORT`], FM on
    /// [`addr::FM_PORT`], and the PP node in the PP namespace taking VXLAN on
    /// [`addr::PP`]:4789; `more` are further arguments.
    pub fn spawn_up(&self, exe: &Path, config: &Path, dir: &Path, more: &[&str]) -> Result<Proc> {
        let env = format!("STARFABRIC_CONFIG={}", config.display());
        let exe = exe.display().to_string();
        let dir = dir.display().to_string();
        let api = format!("{}:{}", addr::CTL, addr::API_PORT);
        let control = format!("{}:{}", addr::CTL, addr::CONTROL_PORT);
        let fm = format!("{}:{}", addr::CTL, addr::FM_PORT);
        let vxlan = format!("{}:4789", addr::PP);
        let pp_ns = self.ns(Node::Pp);
        let mut argv = vec![
            "env",
            &env,
            &exe,
            "up",
            "--dir",
            &dir,
            "--api",
            &api,
            "--control",
            &control,
            "--fm",
            &fm,
            "--vxlan",
            &vxlan,
            "--pp-netns",
            &pp_ns,
        ];
        argv.extend_from_slice(more);
        self.spawn(Node::Ctl, "starfabric up", &argv)
    }

    /// A file in the run directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// A counter of a network device in `n`'s namespace (`rx_packets`, `tx_bytes`, ...),
    /// read from sysfs through a thread that enters the namespace (no process spawn, so
    /// two reads bracket a measurement window tightly).
    pub fn dev_counter(&self, n: Node, dev: &str, counter: &str) -> Result<u64> {
        let ns_path = Path::new("/run/netns").join(self.ns(n));
        let dev = dev.to_string();
        let counter = counter.to_string();
        std::thread::spawn(move || -> Result<u64> {
            use std::os::fd::AsRawFd;
            let f =
                File::open(&ns_path).map_err(|e| Error::io(ns_path.display().to_string(), e))?;
            // SAFETY: `f` is an open namespace file; setns changes only this thread's
            // network namespace, and the thread ends after one read.
            if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(Error::io("setns", std::io::Error::last_os_error()));
            }
            // /proc/thread-self/net follows this thread's namespace (/proc/self/net
            // would show the main thread's, and sysfs the host's as mounted).
            let text = std::fs::read_to_string("/proc/thread-self/net/dev")
                .map_err(|e| Error::io("/proc/thread-self/net/dev", e))?;
            parse_net_dev(&text, &dev, &counter)
        })
        .join()
        .map_err(|_| Error::Setup("counter thread panicked".into()))?
    }
}

/// A counter of `dev` from `/proc/net/dev` text.
pub fn parse_net_dev(text: &str, dev: &str, counter: &str) -> Result<u64> {
    // Columns after "dev:": rx bytes packets errs drop fifo frame compressed multicast,
    // then tx bytes packets errs drop fifo colls carrier compressed.
    let col = match counter {
        "rx_bytes" => 0,
        "rx_packets" => 1,
        "rx_dropped" => 3,
        "tx_bytes" => 8,
        "tx_packets" => 9,
        "tx_dropped" => 11,
        other => {
            return Err(Error::Parse {
                what: "/proc/net/dev".into(),
                msg: format!("unknown counter {other}"),
            })
        }
    };
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(name, _)| name.trim() == dev)
        .and_then(|(_, rest)| rest.split_whitespace().nth(col)?.parse().ok())
        .ok_or_else(|| Error::Parse {
            what: "/proc/net/dev".into(),
            msg: format!("no {counter} for {dev}"),
        })
}

/// The last `n` lines of `text`.
pub fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A gateway namespace's side of its VXLAN link to PP: the tunnel, PP's neighbour entry,
/// the inner device (`inner` creates it) holding the gateway address, and the routes to
/// the public and private ranges through PP. The internet and service gateways differ
/// only in these values.
struct GatewaySide {
    mac: &'static str,
    vni: u32,
    local: Ipv4Addr,
    vx: Ipv4Addr,
    pp_vx: Ipv4Addr,
    pp_mac: &'static str,
    inner: String,
    dev: &'static str,
    gw: Ipv4Addr,
}

impl GatewaySide {
    /// The `ip -batch` lines.
    fn script(&self) -> String {
        let GatewaySide {
            mac,
            vni,
            local,
            vx,
            pp_vx,
            pp_mac,
            inner,
            dev,
            gw,
        } = self;
        let (pp, public, private) = (addr::PP, addr::PUBLIC, addr::PRIVATE);
        format!(
            "link add vx0 address {mac} type vxlan id {vni} local {local} remote {pp} dstport 4789 dev up0\n\
             addr add {vx}/24 dev vx0\n\
             link set vx0 up\n\
             neigh add {pp_vx} lladdr {pp_mac} dev vx0 nud permanent\n\
             {inner}\
             addr add {gw}/24 dev {dev}\n\
             link set {dev} up\n\
             route add {public} via {pp_vx} dev vx0\n\
             route add {private} via {pp_vx} dev vx0\n"
        )
    }
}

/// Linux hands CHECKSUM_PARTIAL inner packets to a VXLAN device, and a PP node reading
/// the datagrams from a UDP socket would forward them with unfinished checksums: make
/// the kernel finish them before encapsulating.
fn vxlan_tx_off(ns: &str) -> Result<()> {
    cmd::in_ns(ns, &["ethtool", "-K", "vx0", "tx", "off"], CONFIG_LIMIT).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_dev_counters() {
        let text = "Inter-|   Receive                                                |  Transmit\n \
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n    \
 lo:     100       2    0    0    0     0          0         0      100       2    0    0    0     0       0          0\n  \
 eth0: 5000      40    0    1    0     0          0         0     7000      50    0    3    0     0       0          0\n";
        assert_eq!(parse_net_dev(text, "eth0", "rx_packets").unwrap(), 40);
        assert_eq!(parse_net_dev(text, "eth0", "tx_packets").unwrap(), 50);
        assert_eq!(parse_net_dev(text, "eth0", "rx_dropped").unwrap(), 1);
        assert_eq!(parse_net_dev(text, "lo", "rx_bytes").unwrap(), 100);
        assert!(parse_net_dev(text, "eth1", "rx_packets").is_err());
    }

    #[test]
    fn names_and_addresses_stay_in_the_benchmark_range() {
        for j in 0..100 {
            let a = addr::client_underlay(j).octets();
            assert_eq!((a[0], a[1]), (198, 18));
            assert!(a[2] < 128, "underlay is 198.18.0.0/17");
            assert_eq!(addr::pool(j).octets()[..3], [198, 18, 201]);
            assert_eq!(mac::client(j).len(), 17);
            assert_ne!(mac::client(j), mac::tenant_gw(j));
        }
        assert_eq!(addr::backend(199).octets(), [198, 19, 3, 210]);
    }
}
