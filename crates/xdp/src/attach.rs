//! Attaching the program to the PP node's interface, and registering AF_XDP sockets in
//! its `xsks` map (the AF_XDP backend in `pp` binds them).
//!
//! Native (driver) mode first: on veth it is what lets the program run before the
//! kernel builds an skb, and what XDP_TX needs to be cheap. A driver without native XDP
//! gets generic (SKB) mode, which works everywhere but later in the receive path. The
//! attachment is a bpf_link where the kernel has them, so it goes away with the
//! program (and with the process, even on SIGKILL); aya falls back to netlink otherwise.

use std::os::fd::AsRawFd;

use aya::maps::{MapData, XskMap};
use aya::programs::xdp::XdpLinkId;
use aya::programs::XdpMode;

use crate::{ebpf_map_mut, XdpError, XdpProgram, XSKS_MAP};

/// Where the program runs on an interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachMode {
    /// In the driver, before an skb exists.
    Native,
    /// Generic XDP, in the kernel's receive path (any driver).
    Skb,
}

impl std::fmt::Display for AttachMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AttachMode::Native => "native",
            AttachMode::Skb => "skb",
        })
    }
}

/// The program attached to an interface. Hand it back to [`XdpProgram::detach`]; dropping
/// the [`XdpProgram`] detaches it as well.
#[derive(Debug)]
pub struct Attachment {
    pub ifname: String,
    pub mode: AttachMode,
    link: XdpLinkId,
}

impl XdpProgram {
    /// Attach the program to `ifname`: native mode, or SKB mode if the driver refuses
    /// native. Returns which one it got.
    pub fn attach(&mut self, ifname: &str) -> Result<Attachment, XdpError> {
        let prog = self.program_mut()?;
        let (link, mode) = match prog.attach(ifname, XdpMode::Driver) {
            Ok(l) => (l, AttachMode::Native),
            Err(native) => {
                tracing::warn!(ifname, error = %native, "native XDP refused; trying SKB mode");
                (prog.attach(ifname, XdpMode::Skb)?, AttachMode::Skb)
            }
        };
        tracing::info!(ifname, %mode, "XDP program attached");
        Ok(Attachment {
            ifname: ifname.to_string(),
            mode,
            link,
        })
    }

    /// Detach the program from the attachment's interface.
    pub fn detach(&mut self, a: Attachment) -> Result<(), XdpError> {
        self.program_mut()?.detach(a.link)?;
        tracing::info!(ifname = %a.ifname, "XDP program detached");
        Ok(())
    }

    fn xsks(&mut self) -> Result<XskMap<&mut MapData>, XdpError> {
        ebpf_map_mut(&mut self.ebpf, XSKS_MAP)
    }

    /// Send what the program passes up on receive queue `queue` to the AF_XDP socket
    /// `fd` (an entry of `xsks`, replacing any earlier socket of that queue).
    pub fn register_xsk(&mut self, queue: u32, fd: &impl AsRawFd) -> Result<(), XdpError> {
        let mut xsks = self.xsks()?;
        xsks.set(queue, fd.as_raw_fd(), 0)
            .map_err(XdpError::on_map(XSKS_MAP))?;
        tracing::debug!(queue, "AF_XDP socket registered in xsks");
        Ok(())
    }

    /// Stop sending queue `queue`'s misses to a socket: they go to the kernel again.
    pub fn unregister_xsk(&mut self, queue: u32) -> Result<(), XdpError> {
        let mut xsks = self.xsks()?;
        match xsks.unset(queue) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(source) => Err(XdpError::Map {
                name: XSKS_MAP,
                source,
            }),
        }
    }
}
