//! The PP (packet processing) node: pipeline workers wired to I/O backends.
//!
//! `pipeline` holds the NF-independent parse→match→action; this crate adds the real
//! I/O backends a PP node runs on (UDP/VXLAN sockets with recvmmsg/sendmmsg now; AF_XDP
//! and the XDP fast path later) and, in later issues, the FM client and rate manager.
