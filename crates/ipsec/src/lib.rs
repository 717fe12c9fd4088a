//! The IPsec VPN gateway's data path: ESP in tunnel mode with AES-GCM (RFC 4303,
//! RFC 4106), the anti-replay window (RFC 4303 §3.4.3, ESN per Appendix A), and the
//! per-worker SA database and security policy ([`Gateway`]) that the PP pipeline hands
//! bursts of frames to. Keys are set through the orchestrator's API (IKE is out of
//! scope); see docs/ipsec.md.
//!
//! The crypto is `ring`'s AES-GCM (BoringSSL's AES-NI/PCLMUL/VAES code): nothing here
//! implements a cipher.

pub mod bench;
pub mod esp;
mod gateway;
pub mod replay;

pub use esp::{EspDrop, KeyError, SaKey};
pub use gateway::{
    ConfigError, Dir, Gateway, GatewayConfig, GatewayStats, Job, Outcome, Prefix, SaConfig,
    SaCounters, SeqSpace, TunnelConfig, TunnelStatus, GATEWAY_MAC,
};
pub use replay::{ReplayError, ReplayWindow};
