//! The XDP fast path of a PP node: offloaded rules run in the NIC driver.
//!
//! `bpf/pp_xdp.c` is built by clang from this crate's build script and embedded here. On
//! the PP node's interface it takes VXLAN to the node's underlay address, builds the same
//! 40-byte [`FlowKey`] as the userspace pipeline from the inner packet, and looks it up in
//! the `offloaded_rules` map. A hit runs the rule in the driver (NAT rewrite with
//! incremental checksums, VXLAN decap and re-encap, per-rule counters) and transmits with
//! `XDP_TX`; a miss, and any packet the program does not parse exactly as the userspace
//! parser does, goes up to the userspace pipeline (the AF_XDP socket bound in `xsks`, or
//! the kernel when none is). Anything else (ARP, management) goes to the kernel.
//!
//! [`XdpProgram`] loads the program with aya and manages its maps: the userspace PP
//! installs a flow's rule with [`XdpProgram::offload`] once the flow qualifies, reads the
//! rule's counters back with [`XdpProgram::rule_counters`], and folds them into its own
//! stats when it removes the rule. [`XdpRule::from_rule`] refuses the rules the driver
//! cannot run (policing, rules that keep the arriving outer header), so the
//! userspace PP keeps those flows on its own path. See `docs/xdp.md`.

mod offload;

pub use offload::{monotonic_now, OffloadPolicy, OffloadStats, Offloader};

use std::net::IpAddr;
use std::time::Duration;

use aya::maps::{Array, HashMap, Map, MapData, MapError};
use aya::programs::{ProgramError, Xdp};
use aya::{Ebpf, EbpfError, TestRun, TestRunOptions};
use packet::proto;
use pipeline::{vxlan_source_port, Action, FlowKey, NodeAddr, Rule, RuleContext, RuleError};
use thiserror::Error;

mod attach;
pub use attach::{AttachMode, Attachment};

mod gen;
pub use gen::{LiveGenerator, GEN_FRAME_LEN, GEN_MAX_FLOWS};

/// The compiled XDP object (clang `-O2 -g -target bpf`).
static PP_XDP_OBJ: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/pp_xdp.o"));

/// An object whose one program (`xdp_pass`, section `xdp`) passes every frame. XDP_TX on
/// a veth needs an XDP program on the peer device to drain the frames it hands over (see
/// `bpf/xdp_pass.c`); a testbed or host attaches this one there, e.g. with `ip link set
/// dev PEER xdpdrv obj FILE sec xdp`.
pub static XDP_PASS_OBJ: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/xdp_pass.o"));

/// An object whose one program (`xdp_sink`, section `xdp`) drops the VXLAN frames that
/// carry UDP to port 9 (the benchmark's sink port) and passes the rest: the receiving
/// end of a per-core packet-rate measurement, counted by the device's XDP drop counter
/// (see `bpf/xdp_sink.c`).
pub static XDP_SINK_OBJ: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/xdp_sink.o"));

pub mod abi;
pub use abi::{
    rule_flag, XdpFlowKey, XdpNode, XdpRule, MAX_OFFLOADED_RULES, NODE_MAP, PROGRAM, RULES_MAP,
    VIP_MACS_MAP, VIP_MODE_MAP, XSKS_MAP,
};

// SAFETY: `XdpRule` is `repr(C)`, made only of integers and byte arrays, with no padding
// (88 bytes, asserted in `abi`) and no invalid bit patterns, so any bytes the kernel hands
// back are a valid value.
unsafe impl aya::Pod for XdpRule {}

// SAFETY: `repr(C)`, byte arrays only, 16 bytes without padding; any bytes are valid.
unsafe impl aya::Pod for XdpNode {}

/// An offloaded rule's counters, read from the map.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct XdpCounters {
    pub packets: u64,
    pub bytes: u64,
    /// CLOCK_MONOTONIC time of the last hit; `None` before the first.
    pub last_seen: Option<Duration>,
}

impl From<&XdpRule> for XdpCounters {
    fn from(r: &XdpRule) -> Self {
        XdpCounters {
            packets: r.packets,
            bytes: r.bytes,
            last_seen: (r.last_seen_ns != 0).then(|| Duration::from_nanos(r.last_seen_ns)),
        }
    }
}

/// Why a rule stays on the userspace path.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum NotOffloadable {
    #[error("the rule does not compile: {0}")]
    Invalid(#[from] RuleError),
    #[error("protocol {0} is not offloaded (TCP, UDP and ICMP/ICMPv6 echo are)")]
    Protocol(u8),
    #[error(
        "the rule keeps the arriving outer header (no decap); the XDP path only terminates VXLAN"
    )]
    NoDecap,
    #[error("policing needs the userspace rate manager")]
    Police,
    #[error("a fabric next hop is forwarded by the userspace pipeline")]
    Fabric,
}

/// Errors of the XDP fast path.
#[derive(Debug, Error)]
pub enum XdpError {
    #[error("loading the XDP object: {0}")]
    Load(#[from] EbpfError),
    #[error("XDP program: {0}")]
    Program(#[from] ProgramError),
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: MapError,
    },
    #[error("map {0} missing from the object")]
    MissingMap(&'static str),
    #[error("program {0} missing from the object")]
    MissingProgram(&'static str),
    #[error("not offloadable: {0}")]
    NotOffloadable(#[from] NotOffloadable),
    #[error("BPF_PROG_TEST_RUN wrote {got} bytes, more than the {cap}-byte buffer")]
    TestRunOverflow { got: usize, cap: usize },
    #[error("the generator takes a 110-byte frame (GEN_FRAME_LEN), not {0} bytes")]
    FrameLength(usize),
}

impl XdpError {
    /// The error of a failed operation on map `name`, for `map_err`.
    fn on_map(name: &'static str) -> impl FnOnce(MapError) -> XdpError {
        move |source| XdpError::Map { name, source }
    }
}

/// Map `name` of `ebpf` as the aya map type `T`, for writing.
fn ebpf_map_mut<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<T, XdpError>
where
    T: TryFrom<&'a mut Map, Error = MapError>,
{
    let map = ebpf.map_mut(name).ok_or(XdpError::MissingMap(name))?;
    T::try_from(map).map_err(XdpError::on_map(name))
}

/// Map `name` of `ebpf` as the aya map type `T`, for reading.
fn ebpf_map<'a, T>(ebpf: &'a Ebpf, name: &'static str) -> Result<T, XdpError>
where
    T: TryFrom<&'a Map, Error = MapError>,
{
    let map = ebpf.map(name).ok_or(XdpError::MissingMap(name))?;
    T::try_from(map).map_err(XdpError::on_map(name))
}

/// The program's verdict on a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XdpVerdict {
    Aborted,
    Drop,
    Pass,
    Tx,
    Redirect,
    Other(u32),
}

impl XdpVerdict {
    fn from_raw(v: u32) -> Self {
        match v {
            0 => XdpVerdict::Aborted,
            1 => XdpVerdict::Drop,
            2 => XdpVerdict::Pass,
            3 => XdpVerdict::Tx,
            4 => XdpVerdict::Redirect,
            n => XdpVerdict::Other(n),
        }
    }
}

/// An address as the program stores it: IPv4 in the first 4 bytes, IPv6 in all 16.
/// (The rule was validated: its family is the flow's.)
/// A MAC as the `vip_macs` key: its 6 bytes first, in memory order, the rest zero (what
/// the program's `__builtin_memcpy` of the destination MAC into a `__u64` makes).
fn mac_key(m: &[u8; 6]) -> u64 {
    let mut b = [0u8; 8];
    b[..6].copy_from_slice(m);
    u64::from_ne_bytes(b)
}

fn addr_bytes(a: &IpAddr) -> [u8; 16] {
    let mut b = [0u8; 16];
    match a {
        IpAddr::V4(a) => b[..4].copy_from_slice(&a.octets()),
        IpAddr::V6(a) => b.copy_from_slice(&a.octets()),
    }
    b
}

/// The (address, port) flags of one side of a rewrite.
const SRC_FLAGS: (u32, u32) = (rule_flag::SRC_ADDR, rule_flag::SRC_PORT);
const DST_FLAGS: (u32, u32) = (rule_flag::DST_ADDR, rule_flag::DST_PORT);

/// Store one side's new address and port; returns the flags that say which are set.
fn set_side(
    addr_out: &mut [u8; 16],
    port_out: &mut [u8; 2],
    addr: &Option<IpAddr>,
    port: &Option<u16>,
    (addr_flag, port_flag): (u32, u32),
) -> u32 {
    let mut flags = 0;
    if let Some(a) = addr {
        *addr_out = addr_bytes(a);
        flags |= addr_flag;
    }
    if let Some(p) = port {
        *port_out = p.to_be_bytes();
        flags |= port_flag;
    }
    flags
}

impl XdpRule {
    /// Compile a pipeline rule into its offloaded form, or say why it must stay on the
    /// userspace path. The rule is first validated as the userspace pipeline compiles
    /// it, so an offloaded rule always has a userspace twin with the same meaning.
    pub fn from_rule(rule: &Rule) -> Result<XdpRule, NotOffloadable> {
        // The node identity does not matter to validation; it is not read from here.
        let probe = NodeAddr {
            ip: std::net::Ipv4Addr::UNSPECIFIED,
            mac: [0; 6],
            gw_mac: [0; 6],
        };
        let mut ctx = RuleContext::new(probe, Duration::from_secs(60));
        let slot = ctx.compile(rule)?;
        ctx.release(&slot);

        let v4 = rule.key.is_v4();
        match (rule.key.proto(), v4) {
            (proto::TCP | proto::UDP, _) | (proto::ICMP, true) | (proto::ICMPV6, false) => {}
            (p, _) => return Err(NotOffloadable::Protocol(p)),
        }
        let mut r = XdpRule::default();
        let mut decap = false;
        for a in &rule.actions {
            match a {
                Action::DecapVxlan => {
                    decap = true;
                    r.flags |= rule_flag::DECAP;
                }
                Action::SetSrc { addr, port } => {
                    r.flags |= set_side(&mut r.src_addr, &mut r.sport, addr, port, SRC_FLAGS);
                }
                Action::SetDst { addr, port } => {
                    r.flags |= set_side(&mut r.dst_addr, &mut r.dport, addr, port, DST_FLAGS);
                }
                Action::EncapVxlan {
                    dst,
                    vni,
                    inner_dmac,
                    inner_smac,
                } => {
                    r.flags |= rule_flag::ENCAP;
                    r.encap_dst = dst.octets();
                    r.encap_vni = vni.to_be_bytes();
                    r.encap_sport = vxlan_source_port(rule.rewritten_key().hash()).to_be_bytes();
                    if let Some(m) = inner_dmac {
                        r.inner_dmac = *m;
                        r.flags |= rule_flag::INNER_DMAC;
                    }
                    if let Some(m) = inner_smac {
                        r.inner_smac = *m;
                        r.flags |= rule_flag::INNER_SMAC;
                    }
                }
                Action::Count | Action::Offload => {}
                Action::Police { .. } => return Err(NotOffloadable::Police),
                Action::Output(p) => r.out_port = *p,
                Action::Drop { .. } => r.flags |= rule_flag::DROP,
                Action::Fabric { .. } => return Err(NotOffloadable::Fabric),
            }
        }
        // A drop needs no decap: the frame goes nowhere.
        if !decap && r.flags & rule_flag::DROP == 0 {
            return Err(NotOffloadable::NoDecap);
        }
        Ok(r)
    }
}

/// The loaded XDP program and its maps.
pub struct XdpProgram {
    ebpf: Ebpf,
}

impl std::fmt::Debug for XdpProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XdpProgram").finish_non_exhaustive()
    }
}

impl XdpProgram {
    /// Load the embedded object and its program into the kernel (needs CAP_BPF and
    /// CAP_NET_ADMIN). Nothing is attached to an interface.
    pub fn load() -> Result<Self, XdpError> {
        let mut ebpf = Ebpf::load(PP_XDP_OBJ)?;
        let prog: &mut Xdp = ebpf
            .program_mut(PROGRAM)
            .ok_or(XdpError::MissingProgram(PROGRAM))?
            .try_into()?;
        prog.load()?;
        tracing::debug!(bytes = PP_XDP_OBJ.len(), "XDP fast path loaded");
        Ok(XdpProgram { ebpf })
    }

    /// The loaded program, for attaching it to an interface.
    pub fn program_mut(&mut self) -> Result<&mut Xdp, XdpError> {
        Ok(self
            .ebpf
            .program_mut(PROGRAM)
            .ok_or(XdpError::MissingProgram(PROGRAM))?
            .try_into()?)
    }

    fn program(&self) -> Result<&Xdp, XdpError> {
        Ok(self
            .ebpf
            .program(PROGRAM)
            .ok_or(XdpError::MissingProgram(PROGRAM))?
            .try_into()?)
    }

    fn rules_mut(&mut self) -> Result<HashMap<&mut MapData, [u8; 40], XdpRule>, XdpError> {
        ebpf_map_mut(&mut self.ebpf, RULES_MAP)
    }

    fn rules(&self) -> Result<HashMap<&MapData, [u8; 40], XdpRule>, XdpError> {
        ebpf_map(&self.ebpf, RULES_MAP)
    }

    /// PP cluster mode: from now on take VXLAN only in frames to one of `macs`, the
    /// vMACs of the vIPs this node owns (the whole set: others are removed). Called with
    /// an empty set the node takes nothing, which is right for a node that owns no vIP.
    pub fn set_vip_macs(&mut self, macs: &[[u8; 6]]) -> Result<(), XdpError> {
        let want: std::collections::HashSet<u64> = macs.iter().map(mac_key).collect();
        {
            let mut h: HashMap<&mut MapData, u64, u32> =
                ebpf_map_mut(&mut self.ebpf, VIP_MACS_MAP)?;
            // Add before removing: a vMAC that stays is never missing, even for a moment.
            for k in &want {
                h.insert(k, 1, 0).map_err(XdpError::on_map(VIP_MACS_MAP))?;
            }
            let stale: Vec<u64> = h
                .keys()
                .filter_map(Result::ok)
                .filter(|k| !want.contains(k))
                .collect();
            for k in stale {
                h.remove(&k).map_err(XdpError::on_map(VIP_MACS_MAP))?;
            }
        }
        let mut arr: Array<&mut MapData, u32> = ebpf_map_mut(&mut self.ebpf, VIP_MODE_MAP)?;
        arr.set(0, 1, 0).map_err(XdpError::on_map(VIP_MODE_MAP))?;
        Ok(())
    }

    /// The vMACs the program takes frames for (PP cluster mode), sorted.
    pub fn vip_macs(&self) -> Result<Vec<[u8; 6]>, XdpError> {
        let h: HashMap<&MapData, u64, u32> = ebpf_map(&self.ebpf, VIP_MACS_MAP)?;
        let mut v: Vec<[u8; 6]> = h
            .keys()
            .filter_map(Result::ok)
            .map(|k| {
                let b = k.to_ne_bytes();
                [b[0], b[1], b[2], b[3], b[4], b[5]]
            })
            .collect();
        v.sort();
        Ok(v)
    }

    /// Set the node's underlay identity: its address (VXLAN to it is considered), its MAC
    /// and its next hop's MAC (the re-encap's outer Ethernet header).
    pub fn set_node(&mut self, node: &NodeAddr) -> Result<(), XdpError> {
        let mut arr: Array<&mut MapData, XdpNode> = ebpf_map_mut(&mut self.ebpf, NODE_MAP)?;
        let v = XdpNode {
            ip: node.ip.octets(),
            mac: node.mac,
            gw_mac: node.gw_mac,
        };
        arr.set(0, v, 0).map_err(XdpError::on_map(NODE_MAP))?;
        tracing::info!(ip = %node.ip, "XDP fast path node set");
        Ok(())
    }

    /// Install (or replace) the offloaded rule for `key`. Returns the counters of the
    /// rule it replaced, which the caller folds into the flow's stats: the new value
    /// starts from `rule`'s counters.
    pub fn install_rule(
        &mut self,
        key: &FlowKey,
        rule: &XdpRule,
    ) -> Result<Option<XdpCounters>, XdpError> {
        let mut map = self.rules_mut()?;
        let old = lookup(&map, key)?;
        map.insert(*key.as_bytes(), *rule, 0)
            .map_err(XdpError::on_map(RULES_MAP))?;
        tracing::debug!(%key, flags = rule.flags, "rule offloaded to XDP");
        Ok(old.as_ref().map(XdpCounters::from))
    }

    /// Compile `rule` with [`XdpRule::from_rule`] and install it under its key.
    pub fn offload(&mut self, rule: &Rule) -> Result<Option<XdpCounters>, XdpError> {
        let r = XdpRule::from_rule(rule)?;
        self.install_rule(&rule.key, &r)
    }

    /// Remove the offloaded rule for `key`, returning its final counters (`None` if it
    /// was not offloaded).
    pub fn remove_rule(&mut self, key: &FlowKey) -> Result<Option<XdpCounters>, XdpError> {
        let mut map = self.rules_mut()?;
        let Some(old) = lookup(&map, key)? else {
            return Ok(None);
        };
        match map.remove(key.as_bytes()) {
            Ok(()) => {}
            Err(MapError::KeyNotFound) => return Ok(None),
            Err(source) => {
                return Err(XdpError::Map {
                    name: RULES_MAP,
                    source,
                })
            }
        }
        tracing::debug!(%key, packets = old.packets, "offloaded rule removed");
        Ok(Some(XdpCounters::from(&old)))
    }

    /// The offloaded rule's counters, `None` if `key` is not offloaded.
    pub fn rule_counters(&self, key: &FlowKey) -> Result<Option<XdpCounters>, XdpError> {
        let map = self.rules()?;
        Ok(lookup(&map, key)?.as_ref().map(XdpCounters::from))
    }

    /// Run the program once on `frame` with `BPF_PROG_TEST_RUN` (no interface needed):
    /// its verdict, and the frame as the program left it.
    pub fn test_run(&self, frame: &[u8]) -> Result<(XdpVerdict, Vec<u8>), XdpError> {
        // Output can grow by the encap overhead at most; leave generous room.
        let cap = frame.len() + 256;
        let mut out = vec![0u8; cap];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.data_out = Some(&mut out);
        opts.repeat = 1;
        let res = self.program()?.test_run(opts)?;
        let n = res.data_size_out as usize;
        if n > cap {
            return Err(XdpError::TestRunOverflow { got: n, cap });
        }
        out.truncate(n);
        Ok((XdpVerdict::from_raw(res.return_value), out))
    }
}

fn lookup<T: std::borrow::Borrow<MapData>>(
    map: &HashMap<T, [u8; 40], XdpRule>,
    key: &FlowKey,
) -> Result<Option<XdpRule>, XdpError> {
    match map.get(key.as_bytes(), 0) {
        Ok(r) => Ok(Some(r)),
        Err(MapError::KeyNotFound) => Ok(None),
        Err(source) => Err(XdpError::Map {
            name: RULES_MAP,
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(text_key: &str, actions: &str) -> Rule {
        Rule::new(
            text_key.parse().unwrap(),
            pipeline::parse_actions(actions).unwrap(),
        )
    }

    /// The header clang compiled `pp_xdp.c` against.
    const BUILT_HEADER: &str = include_str!(concat!(env!("OUT_DIR"), "/pp_xdp_abi.h"));

    #[test]
    fn built_header_is_the_abi_and_defines_every_flag() {
        assert_eq!(BUILT_HEADER, abi::c_header());
        assert_eq!(rule_flag::ALL.len(), 9);
        for (name, value) in rule_flag::ALL {
            let line = format!("\n#define F_{name} {value:#x}u\n");
            assert!(BUILT_HEADER.contains(&line), "missing {line:?}");
        }
        assert!(BUILT_HEADER.contains(&format!(
            "#define MAX_OFFLOADED_RULES {MAX_OFFLOADED_RULES}\n"
        )));
        for m in abi::MAPS {
            assert!(BUILT_HEADER.contains(&format!("}} {} SEC(\".maps\");", m.name)));
        }
        assert!(BUILT_HEADER.contains("_Static_assert(sizeof(struct xdp_rule) == 88,"));
        assert!(BUILT_HEADER
            .contains("_Static_assert(__builtin_offsetof(struct xdp_rule, packets) == 64,"));
    }

    #[test]
    fn flow_key_bytes_are_the_c_flow_key() {
        use abi::CStruct;
        let key = FlowKey::new(
            0x0a0b0c,
            proto::UDP,
            "2001:db8::1".parse().unwrap(),
            0x1234,
            "2001:db8::2".parse().unwrap(),
            0x5678,
        );
        let b = key.as_bytes();
        assert_eq!(b.len(), XdpFlowKey::SIZE);
        let field = |name: &str| {
            let f = XdpFlowKey::C_FIELDS
                .iter()
                .find(|f| f.name == name)
                .unwrap();
            &b[f.offset..f.offset + f.size]
        };
        let src: std::net::Ipv6Addr = "2001:db8::1".parse().unwrap();
        let dst: std::net::Ipv6Addr = "2001:db8::2".parse().unwrap();
        assert_eq!(field("src"), src.octets());
        assert_eq!(field("dst"), dst.octets());
        assert_eq!(field("sport"), [0x12, 0x34]);
        assert_eq!(field("dport"), [0x56, 0x78]);
        assert_eq!(field("vni"), [0x0a, 0x0b, 0x0c]);
        assert_eq!(field("proto"), [proto::UDP]);
    }

    #[test]
    fn snat_reencap_compiles_to_the_map_value() {
        let r = rule(
            "100 udp 198.18.10.2:5000 > 198.18.20.5:9000",
            "decap; set-src 198.19.0.1:40000; encap 198.18.0.9 vni 200; count; out 1",
        );
        let x = XdpRule::from_rule(&r).unwrap();
        assert_eq!(
            x.flags,
            rule_flag::DECAP | rule_flag::SRC_ADDR | rule_flag::SRC_PORT | rule_flag::ENCAP
        );
        assert_eq!(&x.src_addr[..4], &[198, 19, 0, 1]);
        assert_eq!(x.sport, 40000u16.to_be_bytes());
        assert_eq!(x.encap_dst, [198, 18, 0, 9]);
        assert_eq!(x.encap_vni, [0, 0, 0, 200]);
        assert_eq!(
            x.encap_sport,
            vxlan_source_port(r.rewritten_key().hash()).to_be_bytes()
        );
        assert_eq!(x.out_port, 1);
    }

    #[test]
    fn rules_the_driver_cannot_run_stay_in_userspace() {
        let cases = [
            (
                rule("100 icmp [2001:2::1]:1 > [2001:2::2]:0", "decap; out 1"),
                NotOffloadable::Protocol(1),
            ),
            (
                rule("0 udp 10.0.0.1:1 > 10.0.0.2:2", "set-src 10.0.0.9; out 1"),
                NotOffloadable::NoDecap,
            ),
            (
                rule("100 udp 10.0.0.1:1 > 10.0.0.2:2", "decap; police 3; out 1"),
                NotOffloadable::Police,
            ),
            (
                rule("100 47 10.0.0.1 > 10.0.0.2", "decap; out 1"),
                NotOffloadable::Protocol(47),
            ),
        ];
        for (r, want) in cases {
            assert_eq!(XdpRule::from_rule(&r), Err(want), "{r:?}");
        }
        // Invalid rules are refused as the pipeline refuses them.
        let r = rule("100 udp 10.0.0.1:1 > 10.0.0.2:2", "decap; count");
        assert_eq!(
            XdpRule::from_rule(&r),
            Err(NotOffloadable::Invalid(RuleError::NoTerminal))
        );
    }
}
