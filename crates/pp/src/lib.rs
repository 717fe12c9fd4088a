//! The PP (packet processing) node: pipeline workers wired to I/O backends.
//!
//! `pipeline` holds the NF-independent parse→match→action; this crate adds the real
//! I/O backends a PP node runs on (UDP/VXLAN sockets with recvmmsg/sendmmsg now; AF_XDP
//! and the XDP fast path later) and, in later issues, the FM client and rate manager.
//! Until the FM exists, rules come from a static file ([`parse_rules`]).

mod rules_file;
mod udp;

pub use rules_file::{parse_rules, RulesFileError, StaticRule};
pub use udp::{
    tx_target, write_outer_header, TxTarget, UdpVxlanConfig, UdpVxlanError, UdpVxlanIo,
    UdpVxlanStats, MAX_DATAGRAM, MAX_IO_BATCH, SYNTH_DST_MAC, SYNTH_HDR_LEN, SYNTH_SRC_MAC,
};
