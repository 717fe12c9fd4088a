//! [`FifoQdisc`]: a `pfifo` root qdisc on an interface that has none (`noqueue`, a
//! veth's default), for as long as the guard lives, over rtnetlink.
//!
//! Why: the copy-mode AF_XDP port's packet socket ([`crate::gso_tx`]) sends a TCP
//! flow's run as one GSO skb, which the device cuts into up to 64 datagrams at once. A
//! veth whose peer runs XDP delivers into a 256-entry ring; with no qdisc, a datagram
//! that finds it full is dropped (the device's `tx_dropped`) and the flow retransmits.
//! With a qdisc, the veth (Linux 6.17+) stops its queue instead and the qdisc holds the
//! rest until the ring drains: measured on the testbed, 1,355 drops and 3,016
//! retransmits in 5 s of iperf3 without it, none and 2 with it, at the same rate. The
//! TX ring path needs none of this: AF_XDP's `sendto` retries a busy device itself. A
//! NIC has its own qdisc (`mq`), which this leaves alone.
//!
//! Why not a crate: `rtnetlink`/`netlink-packet-route` would bring an async runtime and
//! a large message model for three fixed messages (dump the qdiscs, add one, delete it).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const NLMSG_HDR: usize = 16;
const TCMSG: usize = 20;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const RTM_NEWQDISC: u16 = 36;
const RTM_DELQDISC: u16 = 37;
const RTM_GETQDISC: u16 = 38;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TC_H_ROOT: u32 = 0xffff_ffff;

/// An interface's root qdisc: its kind and handle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootQdisc {
    pub kind: String,
    pub handle: u32,
}

/// The `pfifo` this process attached as an interface's root; deleted on drop if it is
/// still the root (the interface then falls back to its default, `noqueue` on a veth).
#[derive(Debug)]
pub struct FifoQdisc {
    ifname: String,
    ifindex: u32,
    handle: u32,
}

impl FifoQdisc {
    /// If `ifname`'s root qdisc is `noqueue`, attach a `pfifo` of `limit` packets as its
    /// root and return its guard; `None` if the interface has another root qdisc.
    pub fn attach_if_noqueue(ifname: &str, limit: u32) -> std::io::Result<Option<FifoQdisc>> {
        let ifindex = crate::netif::ifindex(ifname)?;
        let nl = Netlink::open()?;
        match nl.root_qdisc(ifindex)? {
            Some(q) if q.kind == "noqueue" => {}
            _ => return Ok(None),
        }
        let mut attrs = Vec::new();
        put_attr(&mut attrs, TCA_KIND, b"pfifo\0");
        put_attr(&mut attrs, TCA_OPTIONS, &limit.to_ne_bytes());
        nl.request(
            RTM_NEWQDISC,
            NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
            &tcmsg(ifindex, 0, TC_H_ROOT),
            &attrs,
        )?;
        let q = match nl.root_qdisc(ifindex)? {
            Some(q) if q.kind == "pfifo" => q,
            other => {
                return Err(std::io::Error::other(format!(
                    "{ifname}: the pfifo root qdisc did not take (root: {other:?})"
                )))
            }
        };
        tracing::info!(
            ifname,
            limit,
            handle = q.handle,
            "pfifo root qdisc attached"
        );
        Ok(Some(FifoQdisc {
            ifname: ifname.to_string(),
            ifindex,
            handle: q.handle,
        }))
    }
}

impl Drop for FifoQdisc {
    fn drop(&mut self) {
        let r = Netlink::open().and_then(|nl| {
            match nl.root_qdisc(self.ifindex)? {
                Some(q) if q.kind == "pfifo" && q.handle == self.handle => {}
                other => {
                    tracing::info!(ifname = %self.ifname, root = ?other, "root qdisc replaced since; left alone");
                    return Ok(());
                }
            }
            nl.request(
                RTM_DELQDISC,
                NLM_F_ACK,
                &tcmsg(self.ifindex, self.handle, TC_H_ROOT),
                &[],
            )
            .map(drop)
        });
        if let Err(e) = r {
            tracing::warn!(ifname = %self.ifname, error = %e, "removing the pfifo root qdisc");
        }
    }
}

/// The root qdisc of interface `ifindex` in this thread's network namespace.
pub fn root_qdisc(ifindex: u32) -> std::io::Result<Option<RootQdisc>> {
    Netlink::open()?.root_qdisc(ifindex)
}

fn tcmsg(ifindex: u32, handle: u32, parent: u32) -> [u8; TCMSG] {
    let mut t = [0u8; TCMSG];
    t[0] = libc::AF_UNSPEC as u8;
    t[4..8].copy_from_slice(&(ifindex as i32).to_ne_bytes());
    t[8..12].copy_from_slice(&handle.to_ne_bytes());
    t[12..16].copy_from_slice(&parent.to_ne_bytes());
    t
}

fn put_attr(buf: &mut Vec<u8>, kind: u16, data: &[u8]) {
    let len = 4 + data.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(data);
    buf.resize(buf.len().next_multiple_of(4), 0);
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The root qdisc among the `RTM_NEWQDISC` messages of a dump (`msgs`: one message's
/// bytes each, header included) for `ifindex`.
fn find_root(msgs: &[Vec<u8>], ifindex: u32) -> Option<RootQdisc> {
    for m in msgs {
        if u16_at(m, 4) != Some(RTM_NEWQDISC) {
            continue;
        }
        let t = NLMSG_HDR;
        if u32_at(m, t + 4) != Some(ifindex) || u32_at(m, t + 12) != Some(TC_H_ROOT) {
            continue;
        }
        let handle = u32_at(m, t + 8)?;
        let mut at = t + TCMSG;
        while let (Some(len), Some(kind)) = (u16_at(m, at), u16_at(m, at + 2)) {
            let len = len as usize;
            if len < 4 || at + len > m.len() {
                break;
            }
            if kind == TCA_KIND {
                let v = &m[at + 4..at + len];
                let name = v.split(|&c| c == 0).next().unwrap_or_default();
                return Some(RootQdisc {
                    kind: String::from_utf8_lossy(name).into_owned(),
                    handle,
                });
            }
            at += len.next_multiple_of(4);
        }
    }
    None
}

struct Netlink {
    fd: OwnedFd,
}

impl Netlink {
    fn open() -> std::io::Result<Netlink> {
        // SAFETY: plain socket(2); the fd is owned below.
        let raw = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if raw < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a new fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let tv = libc::timeval {
            tv_sec: 2,
            tv_usec: 0,
        };
        // SAFETY: a valid fd and a timeval that lives for the call.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        Ok(Netlink { fd })
    }

    /// Send one request and collect the answer's messages until `NLMSG_DONE` or the
    /// acknowledgement; a netlink error is returned as the OS error it carries.
    fn request(
        &self,
        kind: u16,
        flags: u16,
        tcm: &[u8; TCMSG],
        attrs: &[u8],
    ) -> std::io::Result<Vec<Vec<u8>>> {
        let len = NLMSG_HDR + TCMSG + attrs.len();
        let mut m = Vec::with_capacity(len);
        m.extend_from_slice(&(len as u32).to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
        m.extend_from_slice(&1u32.to_ne_bytes()); // seq
        m.extend_from_slice(&0u32.to_ne_bytes()); // pid: the kernel fills it in
        m.extend_from_slice(tcm);
        m.extend_from_slice(attrs);
        // SAFETY: a valid fd and a buffer of `m.len()` bytes that lives for the call.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), m.as_ptr().cast(), m.len(), 0) };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut out = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: a valid fd and a buffer of `buf.len()` bytes that lives for the call.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let mut at = 0;
            let n = n as usize;
            while at + NLMSG_HDR <= n {
                let mlen = u32_at(&buf, at).unwrap_or(0) as usize;
                if mlen < NLMSG_HDR || at + mlen > n {
                    return Err(std::io::Error::other("truncated netlink message"));
                }
                let msg = &buf[at..at + mlen];
                match u16_at(msg, 4) {
                    Some(NLMSG_DONE) => return Ok(out),
                    Some(NLMSG_ERROR) => {
                        let errno = u32_at(msg, NLMSG_HDR).unwrap_or(0) as i32;
                        return if errno == 0 {
                            Ok(out)
                        } else {
                            Err(std::io::Error::from_raw_os_error(-errno))
                        };
                    }
                    _ => out.push(msg.to_vec()),
                }
                at += mlen.next_multiple_of(4);
            }
        }
    }

    fn root_qdisc(&self, ifindex: u32) -> std::io::Result<Option<RootQdisc>> {
        let msgs = self.request(RTM_GETQDISC, NLM_F_DUMP, &tcmsg(0, 0, 0), &[])?;
        Ok(find_root(&msgs, ifindex))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn newqdisc(ifindex: u32, handle: u32, parent: u32, kind: &str) -> Vec<u8> {
        let mut attrs = Vec::new();
        put_attr(&mut attrs, 5, &[1, 2, 3]); // another attribute first
        put_attr(&mut attrs, TCA_KIND, format!("{kind}\0").as_bytes());
        let mut m = vec![0u8; NLMSG_HDR];
        m[4..6].copy_from_slice(&RTM_NEWQDISC.to_ne_bytes());
        m.extend_from_slice(&tcmsg(ifindex, handle, parent));
        m.extend_from_slice(&attrs);
        let len = m.len() as u32;
        m[..4].copy_from_slice(&len.to_ne_bytes());
        m
    }

    #[test]
    fn the_root_of_the_interface_is_found_among_the_dump() {
        let msgs = vec![
            newqdisc(3, 0, TC_H_ROOT, "mq"),
            newqdisc(7, 0x10000, 0x8001_0001, "fq_codel"),
            newqdisc(7, 0x8001_0000, TC_H_ROOT, "pfifo"),
        ];
        assert_eq!(
            find_root(&msgs, 7),
            Some(RootQdisc {
                kind: "pfifo".into(),
                handle: 0x8001_0000
            })
        );
        assert_eq!(find_root(&msgs, 3).map(|q| q.kind), Some("mq".into()));
        assert_eq!(find_root(&msgs, 9), None);
        // A truncated attribute ends the search for that message, without a panic.
        let mut bad = newqdisc(9, 0, TC_H_ROOT, "noqueue");
        bad.truncate(NLMSG_HDR + TCMSG + 6);
        assert_eq!(find_root(&[bad], 9), None);
    }
}
