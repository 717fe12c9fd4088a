//! The PP (packet processing) node: pipeline workers wired to I/O backends.
//!
//! `pipeline` holds the NF-independent parse→match→action; this crate adds the real
//! I/O backends a PP node runs on (UDP/VXLAN sockets with recvmmsg/sendmmsg now; AF_XDP
//! and the XDP fast path later), the client of the fabric master ([`FmClient`]) that
//! answers misses, and, in a later issue, the rate manager. Rules can also come from a
//! static file ([`parse_rules`]).

pub mod fm_client;
mod rules_file;
mod udp;

pub use fm_client::{FmClient, FmClientConfig, FmClientError, FmClientStats, WorkerLink};
pub use rules_file::{parse_rules, RulesFileError, StaticRule};
pub use udp::{
    tx_target, write_outer_header, TxTarget, UdpVxlanConfig, UdpVxlanError, UdpVxlanIo,
    UdpVxlanStats, MAX_DATAGRAM, MAX_IO_BATCH, SYNTH_DST_MAC, SYNTH_HDR_LEN, SYNTH_SRC_MAC,
};
