//! The PP (packet processing) node: pipeline workers wired to I/O backends.
//!
//! `pipeline` holds the NF-independent parse→match→action; this crate adds the real
//! I/O backends a PP node runs on, the client of the fabric master ([`FmClient`]) that
//! answers misses, and, in a later issue, the rate manager. Rules can also come from a
//! static file ([`parse_rules`]).
//!
//! [`node::start`] assembles a whole PP node from these (what `starfabric pp` runs), so
//! a test or another program can run one in-process; [`metrics`] is its `/metrics`.
//!
//! Backends:
//! - [`AfXdpIo`] (the default wherever it works): an AF_XDP socket whose UMEM is the
//!   pipeline's frame region; the `xdp` crate's program on the interface redirects VXLAN
//!   to the node into it and passes everything else to the kernel. [`open_afxdp`] sets a
//!   node up (interface, MACs, program, socket); see `docs/afxdp.md`.
//! - [`UdpVxlanIo`], the fallback: a UDP socket on the VXLAN port with
//!   `recvmmsg`/`sendmmsg`, for loopback, `0.0.0.0` and anywhere XDP cannot attach.

mod afxdp;
pub mod doorbell;
pub mod fm_client;
pub mod gso_tx;
pub mod metrics;
pub mod netif;
pub mod node;
pub mod qdisc;
pub mod rates;
mod rules_file;
pub mod trace;
mod udp;
pub mod vip;
mod xdp_node;

pub use afxdp::{
    AfXdpConfig, AfXdpError, AfXdpIo, AfXdpKernelStats, AfXdpStats, AfXdpTx, BusyPoll, FrameCensus,
    NapiDeferral, XskMode, AFXDP_MAX_BATCH, RX_HEADROOM, XDP_HEADROOM,
};
pub use doorbell::Doorbell;
pub use fm_client::{
    FmClient, FmClientConfig, FmClientError, FmClientStats, NoticeSender, ReportSender, WorkerLink,
};
pub use rules_file::{parse_rules, RulesFileError, StaticRule};
pub use udp::{
    tx_target, write_outer_header, TxTarget, UdpVxlanConfig, UdpVxlanError, UdpVxlanIo,
    UdpVxlanStats, GRO_BUF, MAX_DATAGRAM, MAX_GSO_BYTES, MAX_GSO_SEGMENTS, MAX_IO_BATCH, MAX_SLOTS,
    SYNTH_DST_MAC, SYNTH_HDR_LEN, SYNTH_SRC_MAC,
};
pub use vip::{OwnedVips, VipError, VipMember, VipStats};
pub use xdp_node::{open_afxdp, open_afxdp_workers, AfXdpNodeConfig, AfXdpNodeError, XdpAttached};
