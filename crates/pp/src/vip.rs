//! A PP node's side of its cluster's vIP group (Zeta's Multi IPs, paper 003 §IV-E;
//! docs/pp-cluster.md).
//!
//! FM owns the mapping table and tells each node the complete set of vIPs it owns
//! ([`v1::VipAssign`]). The node applies a set in this order:
//! 1. its XDP program starts taking frames to the new vMACs (`XdpProgram::set_vip_macs`);
//! 2. it announces each new vMAC with a RARP frame out of its interface, so the switch
//!    (the testbed's Linux bridge, a ToR in a real cluster) learns the vMAC on this port
//!    and sends the vIP's flows here from then on.
//!
//! Nothing else changes anywhere: the hosts' and the router's ECMP route and neighbour
//! entries stay as they are. The node re-announces what it owns every second so the
//! switch never ages a vMAC out (it would flood, and only the owner's filter takes the
//! frames, but flooding costs every node).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proto::v1;
use thiserror::Error;
use tracing::{info, warn};
use xdp::XdpProgram;

#[derive(Debug, Error)]
pub enum VipError {
    #[error("AF_PACKET socket: {0}")]
    Socket(std::io::Error),
    #[error("interface {0}: no such device")]
    NoDevice(String),
    #[error("vIP {index}: MAC has {len} bytes, not 6")]
    BadMac { index: u32, len: usize },
    #[error("XDP program: {0}")]
    Xdp(#[from] xdp::XdpError),
}

/// How often owned vMACs are announced again (Linux bridges age entries after 300 s).
pub const REANNOUNCE: Duration = Duration::from_secs(1);

/// How long a node keeps taking frames to a vMAC it was told to give up. FM tells the
/// gainer first, but the two nodes apply their sets independently: if the loser
/// dropped its filter before the gainer's RARP reached the switch, the frames the switch
/// still sends the loser would be lost. Taking them a little longer costs nothing: the
/// switch sends each frame to one port, so no frame is served twice.
pub const LINGER: Duration = Duration::from_millis(200);

/// The vIPs this node owns, shared with the FM client, which reports them when it
/// registers (so a restarted FM, or another one, adopts the node's set instead of
/// moving its traffic).
pub type OwnedVips = Arc<Mutex<Vec<v1::Vip>>>;

/// Counters of a node's vIP membership.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VipStats {
    pub assignments: u64,
    pub gained: u64,
    pub lost: u64,
    pub announcements: u64,
    pub announce_errors: u64,
}

/// A node's membership in its cluster's vIP group.
pub struct VipMember {
    ifname: String,
    ifindex: i32,
    sock: OwnedFd,
    owned: Vec<v1::Vip>,
    /// vMACs given up, still filtered in until the instant (see [`LINGER`]).
    lingering: Vec<([u8; 6], Instant)>,
    shared: OwnedVips,
    next_announce: Instant,
    /// This node's own MAC when it takes fabric frames (docs/fabric.md): always
    /// filtered in, whatever vIPs it owns, since peers reach it there.
    fabric_mac: Option<[u8; 6]>,
    pub stats: VipStats,
}

impl VipMember {
    /// Announce vMACs out of `ifname` (the interface the XDP program is attached to).
    pub fn new(ifname: &str, shared: OwnedVips) -> Result<Self, VipError> {
        let c = std::ffi::CString::new(ifname).map_err(|_| VipError::NoDevice(ifname.into()))?;
        // SAFETY: `c` is a valid NUL-terminated string for the call's duration.
        let ifindex = unsafe { libc::if_nametoindex(c.as_ptr()) } as i32;
        if ifindex == 0 {
            return Err(VipError::NoDevice(ifname.into()));
        }
        // Protocol 0: a send-only packet socket, which receives nothing.
        // SAFETY: plain socket(2) call; the result is checked before use.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(VipError::Socket(std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(VipMember {
            ifname: ifname.to_string(),
            ifindex,
            sock,
            owned: Vec::new(),
            lingering: Vec::new(),
            shared,
            next_announce: Instant::now() + REANNOUNCE,
            fabric_mac: None,
            stats: VipStats::default(),
        })
    }

    /// Take fabric frames (to this node's own MAC) from now on, owned vIPs or not.
    pub fn set_fabric_mac(&mut self, prog: &mut XdpProgram, mac: [u8; 6]) -> Result<(), VipError> {
        self.fabric_mac = Some(mac);
        let owned: Vec<[u8; 6]> = self.owned.iter().filter_map(|v| mac_of(v).ok()).collect();
        self.program_filter(prog, &owned)
    }

    pub fn owned(&self) -> &[v1::Vip] {
        &self.owned
    }

    /// Take on FM's assignment: filter the new set in, then announce the vMACs gained.
    pub fn apply(&mut self, prog: &mut XdpProgram, a: &v1::VipAssign) -> Result<(), VipError> {
        let mut macs = Vec::with_capacity(a.vips.len());
        for v in &a.vips {
            macs.push(mac_of(v)?);
        }
        let gained: Vec<&v1::Vip> = a
            .vips
            .iter()
            .filter(|v| !self.owned.iter().any(|o| o.index == v.index))
            .collect();
        let lost: Vec<[u8; 6]> = self
            .owned
            .iter()
            .filter(|o| !a.vips.iter().any(|v| v.index == o.index))
            .filter_map(|o| mac_of(o).ok())
            .collect();
        let until = Instant::now() + LINGER;
        self.lingering.retain(|(m, _)| !macs.contains(m));
        self.lingering.extend(lost.iter().map(|m| (*m, until)));
        let lost = lost.len();
        self.program_filter(prog, &macs)?;
        for v in &gained {
            let mac = mac_of(v)?;
            self.announce(mac);
        }
        self.stats.assignments += 1;
        self.stats.gained += gained.len() as u64;
        self.stats.lost += lost as u64;
        info!(
            epoch = a.epoch,
            owned = a.vips.len(),
            gained = gained.len(),
            lost,
            ifname = %self.ifname,
            "vIP assignment applied"
        );
        self.owned = a.vips.clone();
        if let Ok(mut s) = self.shared.lock() {
            s.clone_from(&self.owned);
        }
        Ok(())
    }

    fn program_filter(&self, prog: &mut XdpProgram, owned: &[[u8; 6]]) -> Result<(), VipError> {
        let mut all = owned.to_vec();
        all.extend(self.lingering.iter().map(|(m, _)| *m));
        all.extend(self.fabric_mac);
        prog.set_vip_macs(&all)?;
        Ok(())
    }

    /// Let lingering vMACs go once their time is up, and announce every owned vMAC
    /// again once a [`REANNOUNCE`] period has passed.
    pub fn tick(&mut self, prog: &mut XdpProgram, now: Instant) {
        if self.lingering.iter().any(|(_, t)| *t <= now) {
            self.lingering.retain(|(_, t)| *t > now);
            let owned: Vec<[u8; 6]> = self.owned.iter().filter_map(|v| mac_of(v).ok()).collect();
            if let Err(e) = self.program_filter(prog, &owned) {
                warn!(error = %e, "XDP program: vIP filter not updated");
            }
        }
        if now < self.next_announce {
            return;
        }
        self.next_announce = now + REANNOUNCE;
        let macs: Vec<[u8; 6]> = self.owned.iter().filter_map(|v| mac_of(v).ok()).collect();
        for m in macs {
            self.announce(m);
        }
    }

    fn announce(&mut self, mac: [u8; 6]) {
        let frame = rarp_frame(mac);
        // SAFETY: an all-zero sockaddr_ll is a valid value that is then filled in.
        let mut sa: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sa.sll_family = libc::AF_PACKET as u16;
        sa.sll_protocol = (ETH_P_RARP).to_be();
        sa.sll_ifindex = self.ifindex;
        sa.sll_halen = 6;
        sa.sll_addr[..6].copy_from_slice(&[0xff; 6]);
        // SAFETY: `frame` and `sa` are live for the call and their lengths are passed.
        let n = unsafe {
            libc::sendto(
                self.sock.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&sa as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if n < 0 {
            self.stats.announce_errors += 1;
            warn!(error = %std::io::Error::last_os_error(), "RARP announcement failed");
        } else {
            self.stats.announcements += 1;
        }
    }
}

const ETH_P_RARP: u16 = 0x8035;

fn mac_of(v: &v1::Vip) -> Result<[u8; 6], VipError> {
    <[u8; 6]>::try_from(v.mac.as_slice()).map_err(|_| VipError::BadMac {
        index: v.index,
        len: v.mac.len(),
    })
}

/// A RARP "request reverse" (RFC 903) from `mac` to broadcast, padded to Ethernet's
/// 60-byte minimum: what Zeta's gateways send so the switch learns a migrated vMAC on
/// their port. The protocol addresses are zero; only the source MAC matters to the
/// switch.
pub fn rarp_frame(mac: [u8; 6]) -> [u8; 60] {
    let mut f = [0u8; 60];
    f[..6].copy_from_slice(&[0xff; 6]);
    f[6..12].copy_from_slice(&mac);
    f[12..14].copy_from_slice(&ETH_P_RARP.to_be_bytes());
    f[14..16].copy_from_slice(&1u16.to_be_bytes()); // hardware: Ethernet
    f[16..18].copy_from_slice(&0x0800u16.to_be_bytes()); // protocol: IPv4
    f[18] = 6;
    f[19] = 4;
    f[20..22].copy_from_slice(&3u16.to_be_bytes()); // op: request reverse
    f[22..28].copy_from_slice(&mac); // sender hardware address
    f[32..38].copy_from_slice(&mac); // target hardware address
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rarp_frames_parse_as_rarp_from_the_vmac() {
        let mac = [2, 0x5f, 0x76, 0, 0, 7];
        let f = rarp_frame(mac);
        let eth = etherparse::Ethernet2HeaderSlice::from_slice(&f).unwrap();
        assert_eq!(eth.source(), mac);
        assert_eq!(eth.destination(), [0xff; 6]);
        assert_eq!(eth.ether_type().0, ETH_P_RARP);
        assert_eq!(&f[20..22], &[0, 3]);
        assert_eq!(&f[22..28], &mac);
        assert_eq!(&f[32..38], &mac);
    }

    #[test]
    fn a_bad_mac_is_an_error() {
        let v = v1::Vip {
            index: 3,
            ip: "198.18.1.103".into(),
            mac: vec![1, 2, 3],
        };
        assert!(matches!(
            mac_of(&v),
            Err(VipError::BadMac { index: 3, len: 3 })
        ));
    }
}
