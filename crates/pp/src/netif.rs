//! What the AF_XDP backend needs to know about the node's interface, read from the
//! kernel: which interface owns an address, its MAC and receive queues, and the MAC of
//! the underlay next hop. With AF_XDP the kernel no longer writes outer Ethernet headers,
//! so `encap`'s node MAC → gateway MAC must be the real ones.
//!
//! Read from `getifaddrs`, interface ioctls and procfs (`/proc/net/route`,
//! `/proc/net/arp`), as the node sees them from inside its network namespace. Not from
//! sysfs: `/sys/class/net` shows the namespace of whoever mounted `/sys`, which is not
//! the thread's own after an in-process `setns` (only `ip netns exec` remounts it), so
//! a node started on such a thread would have read another namespace's interface, or
//! none. An ioctl goes through a socket, and a socket belongs to its creator's namespace.

use std::ffi::CStr;
use std::net::{Ipv4Addr, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use thiserror::Error;

#[derive(Debug, Error)]
pub enum NetifError {
    #[error("getifaddrs: {0}")]
    Getifaddrs(std::io::Error),
    #[error("no interface has address {0}")]
    NoInterface(Ipv4Addr),
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: cannot parse {what}")]
    Parse { path: String, what: String },
    #[error("no route through {0} has a gateway (give --gw-mac)")]
    NoGateway(String),
    #[error("the neighbour entry of gateway {gw} on {ifname} did not resolve within {waited:?} (give --gw-mac)")]
    Unresolved {
        gw: Ipv4Addr,
        ifname: String,
        waited: Duration,
    },
}

fn read(path: &str) -> Result<String, NetifError> {
    std::fs::read_to_string(path).map_err(|source| NetifError::Read {
        path: path.to_string(),
        source,
    })
}

/// The interface that has `ip` as one of its IPv4 addresses.
pub fn interface_of(ip: Ipv4Addr) -> Result<String, NetifError> {
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return Err(NetifError::Getifaddrs(std::io::Error::last_os_error()));
    }
    let mut found = None;
    let mut p = ifap;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*p };
        p = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: a non-null ifa_addr points at a sockaddr whose family says its type.
        let fam = unsafe { (*ifa.ifa_addr).sa_family } as libc::c_int;
        if fam != libc::AF_INET {
            continue;
        }
        // SAFETY: AF_INET: the sockaddr is a sockaddr_in.
        let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
        if Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)) == ip {
            // SAFETY: ifa_name is a NUL-terminated string of the list.
            let name = unsafe { CStr::from_ptr(ifa.ifa_name) };
            found = Some(name.to_string_lossy().into_owned());
            break;
        }
    }
    // SAFETY: the list from getifaddrs, freed once; nothing refers into it any more.
    unsafe { libc::freeifaddrs(ifap) };
    found.ok_or(NetifError::NoInterface(ip))
}

/// Parse `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut m = [0u8; 6];
    let mut parts = s.trim().split(':');
    for b in m.iter_mut() {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(m)
}

/// An `ifreq` naming `ifname`, or `None` if the name does not fit.
fn ifreq(ifname: &str) -> Option<libc::ifreq> {
    let name = ifname.as_bytes();
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(&0) {
        return None;
    }
    // SAFETY: ifreq is plain old data (a name array and a union of integers, pointers
    // and sockaddrs), for which all-zero bytes are a valid value.
    let mut r: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, b) in r.ifr_name.iter_mut().zip(name) {
        *d = *b as libc::c_char;
    }
    Some(r)
}

/// Run interface ioctl `req` on `r` through a socket of the calling thread's namespace.
fn if_ioctl(req: libc::c_ulong, r: &mut libc::ifreq) -> std::io::Result<()> {
    // A datagram socket, unbound: only the handle the ioctl goes through.
    // SAFETY: plain socket(2); the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is the socket just made, owned by nothing else; `sock` closes it.
    let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    // SAFETY: `sock` is an open socket; `r` is a valid ifreq that outlives the call and
    // is the argument type `req` (SIOCGIFHWADDR, SIOCETHTOOL) takes; for SIOCETHTOOL its
    // data pointer points at a live, correctly sized ethtool struct.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), req as _, r as *mut libc::ifreq) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn ioctl_error(ifname: &str, what: &str, source: std::io::Error) -> NetifError {
    NetifError::Read {
        path: format!("{ifname} ({what})"),
        source,
    }
}

/// The interface's MAC address (`SIOCGIFHWADDR`).
pub fn mac_of(ifname: &str) -> Result<[u8; 6], NetifError> {
    let mut r = ifreq(ifname).ok_or_else(|| NetifError::Parse {
        path: ifname.to_string(),
        what: "interface name".into(),
    })?;
    if_ioctl(libc::SIOCGIFHWADDR, &mut r).map_err(|e| ioctl_error(ifname, "SIOCGIFHWADDR", e))?;
    // SAFETY: SIOCGIFHWADDR succeeded, so the union holds `ifru_hwaddr`.
    let sa = unsafe { r.ifr_ifru.ifru_hwaddr };
    let mut mac = [0u8; 6];
    for (m, b) in mac.iter_mut().zip(sa.sa_data.iter()) {
        *m = *b as u8;
    }
    Ok(mac)
}

/// `struct ethtool_channels` (linux/ethtool.h).
#[repr(C)]
#[derive(Default)]
struct EthtoolChannels {
    cmd: u32,
    max_rx: u32,
    max_tx: u32,
    max_other: u32,
    max_combined: u32,
    rx_count: u32,
    tx_count: u32,
    other_count: u32,
    combined_count: u32,
}

const ETHTOOL_GCHANNELS: u32 = 0x3c;

/// How many receive queues the interface has: its channels (`ETHTOOL_GCHANNELS`),
/// combined plus receive-only, which is what AF_XDP queue ids range over.
pub fn rx_queues(ifname: &str) -> Result<u32, NetifError> {
    let mut r = ifreq(ifname).ok_or_else(|| NetifError::Parse {
        path: ifname.to_string(),
        what: "interface name".into(),
    })?;
    let mut ch = EthtoolChannels {
        cmd: ETHTOOL_GCHANNELS,
        ..Default::default()
    };
    r.ifr_ifru.ifru_data = (&mut ch as *mut EthtoolChannels).cast();
    if let Err(e) = if_ioctl(libc::SIOCETHTOOL, &mut r) {
        if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
            return Err(ioctl_error(ifname, "ETHTOOL_GCHANNELS", e));
        }
        // A driver without channels: its sysfs queues, if sysfs shows this namespace.
        sysfs_is_ours(ifname).map_err(|e| ioctl_error(ifname, "ETHTOOL_GCHANNELS", e))?;
        let path = format!("/sys/class/net/{ifname}/queues");
        let dir = std::fs::read_dir(&path).map_err(|source| NetifError::Read {
            path: path.clone(),
            source,
        })?;
        return Ok(dir
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with("rx-"))
            .count() as u32);
    }
    let n = ch.combined_count.saturating_add(ch.rx_count);
    if n == 0 {
        return Err(NetifError::Parse {
            path: format!("{ifname} (ETHTOOL_GCHANNELS)"),
            what: "zero receive channels".into(),
        });
    }
    Ok(n)
}

/// The gateway of the routes through `ifname` in `/proc/net/route` text: the default
/// route's, else the one of the widest gatewayed route.
pub fn gateway_in(route_text: &str, ifname: &str) -> Option<Ipv4Addr> {
    const RTF_UP: u32 = 0x1;
    const RTF_GATEWAY: u32 = 0x2;
    let mut best: Option<(u32, Ipv4Addr)> = None;
    for line in route_text.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 8 || f[0] != ifname {
            continue;
        }
        let hex = |s: &str| u32::from_str_radix(s, 16).ok();
        let (Some(gw), Some(flags), Some(mask)) = (hex(f[2]), hex(f[3]), hex(f[7])) else {
            continue;
        };
        if flags & (RTF_UP | RTF_GATEWAY) != RTF_UP | RTF_GATEWAY {
            continue;
        }
        // procfs prints each address as the host's u32 read from its network-order bytes
        // (`%08X`), so the host's own byte order gets the bytes back.
        let gw = Ipv4Addr::from(gw.to_ne_bytes());
        let prefix = mask.count_ones();
        if best.is_none_or(|(p, _)| prefix < p) {
            best = Some((prefix, gw));
        }
    }
    best.map(|(_, gw)| gw)
}

/// The MAC of `ip` on `ifname` in `/proc/net/arp` text, if the entry is complete.
pub fn neighbour_in(arp_text: &str, ip: Ipv4Addr, ifname: &str) -> Option<[u8; 6]> {
    const ATF_COM: u32 = 0x2;
    for line in arp_text.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 6 || f[5] != ifname || f[0].parse::<Ipv4Addr>().ok() != Some(ip) {
            continue;
        }
        let flags = u32::from_str_radix(f[2].trim_start_matches("0x"), 16).ok()?;
        if flags & ATF_COM == 0 {
            return None;
        }
        return parse_mac(f[3]).filter(|m| *m != [0; 6]);
    }
    None
}

/// The underlay next hop of `ifname` (its gateway) and that gateway's MAC. When the
/// kernel has no neighbour entry yet, a datagram to the gateway's discard port makes it
/// resolve one; waits up to `wait`.
pub fn gateway_mac(ifname: &str, wait: Duration) -> Result<(Ipv4Addr, [u8; 6]), NetifError> {
    let gw = gateway_in(&read("/proc/net/route")?, ifname)
        .ok_or_else(|| NetifError::NoGateway(ifname.to_string()))?;
    let start = Instant::now();
    let mut poked = false;
    loop {
        if let Some(mac) = neighbour_in(&read("/proc/net/arp")?, gw, ifname) {
            return Ok((gw, mac));
        }
        if start.elapsed() >= wait {
            return Err(NetifError::Unresolved {
                gw,
                ifname: ifname.to_string(),
                waited: wait,
            });
        }
        if !poked {
            // Any IPv4 packet to the gateway makes the kernel ARP for it; the discard
            // port (9) asks nothing of it. Failure only means no entry: reported above.
            if let Ok(s) = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)) {
                let _ = s.send_to(b"starfabric: resolving the gateway", (gw, 9));
            }
            poked = true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The index of `ifname` in this thread's network namespace.
pub fn ifindex(ifname: &str) -> std::io::Result<u32> {
    let name = std::ffi::CString::new(ifname).map_err(std::io::Error::other)?;
    // SAFETY: a NUL-terminated name that outlives the call.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(index)
}

/// Whether `/sys/class/net/IFNAME` is this thread's `ifname`: sysfs shows the namespace
/// that mounted it, which after an in-process setns is not the thread's, and a device of
/// the same name there (say the host's) must not be read or written as this one. Same
/// index and MAC as the thread's own namespace reports, or an error.
pub fn sysfs_is_ours(ifname: &str) -> std::io::Result<()> {
    let mismatch = |what: &str| {
        std::io::Error::other(format!(
            "/sys/class/net/{ifname} is another network namespace's device ({what} differs); \
             run the node in its namespace with `ip netns exec`, which mounts its own /sys"
        ))
    };
    let index = ifindex(ifname)?;
    let sys_index = std::fs::read_to_string(format!("/sys/class/net/{ifname}/ifindex"))
        .map_err(|_| mismatch("presence"))?;
    if sys_index.trim().parse::<u32>().ok() != Some(index) {
        return Err(mismatch("ifindex"));
    }
    let sys_mac = std::fs::read_to_string(format!("/sys/class/net/{ifname}/address"))?;
    let mac = mac_of(ifname).map_err(std::io::Error::other)?;
    if parse_mac(&sys_mac) != Some(mac) {
        return Err(mismatch("MAC"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROUTE: &str =
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
up0\t00000000\t010112C6\t0003\t0\t0\t0\t00000000\t0\t0\t0
up0\t000112C6\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0
up1\t000012C6\t010212C6\t0003\t0\t0\t0\t0080FFFF\t0\t0\t0
";

    #[test]
    fn default_route_gateway() {
        assert_eq!(gateway_in(ROUTE, "up0"), Some(Ipv4Addr::new(198, 18, 1, 1)));
        assert_eq!(gateway_in(ROUTE, "up1"), Some(Ipv4Addr::new(198, 18, 2, 1)));
        assert_eq!(gateway_in(ROUTE, "eth9"), None);
    }

    #[test]
    fn on_link_routes_have_no_gateway() {
        let t = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\n\
                 up0\t000112C6\t00000000\t0001\t0\t0\t0\t00FFFFFF\n";
        assert_eq!(gateway_in(t, "up0"), None);
    }

    #[test]
    fn arp_entries() {
        let t = "IP address       HW type     Flags       HW address            Mask     Device
198.18.1.1       0x1         0x2         02:5f:00:00:01:01     *        up0
198.18.1.9       0x1         0x0         00:00:00:00:00:00     *        up0
";
        let gw = Ipv4Addr::new(198, 18, 1, 1);
        assert_eq!(neighbour_in(t, gw, "up0"), Some([0x02, 0x5f, 0, 0, 1, 1]));
        assert_eq!(neighbour_in(t, gw, "up1"), None);
        assert_eq!(neighbour_in(t, Ipv4Addr::new(198, 18, 1, 9), "up0"), None);
    }

    #[test]
    fn macs() {
        assert_eq!(
            parse_mac("02:5f:0a:00:01:ff\n"),
            Some([2, 0x5f, 10, 0, 1, 0xff])
        );
        assert_eq!(parse_mac("02:5f:0a:00:01"), None);
        assert_eq!(parse_mac("02:5f:0a:00:01:ff:00"), None);
        assert_eq!(parse_mac("zz:5f:0a:00:01:ff"), None);
    }

    #[test]
    fn loopback_owns_127_0_0_1() {
        assert_eq!(interface_of(Ipv4Addr::LOCALHOST).unwrap(), "lo");
        assert!(interface_of(Ipv4Addr::new(198, 18, 255, 254)).is_err());
    }
}
