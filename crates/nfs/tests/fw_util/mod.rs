//! Helpers shared by the firewall tests.

use nfs::fw::{AclAction, AclRule, FwConfig, TenantAcl};

/// Tenant 1 may open anything outbound from its VPC, 198.18.0.0/16 and the IPv6 prefix
/// `v6`; nothing inbound.
pub fn outbound_only(v6: &str) -> FwConfig {
    let mut out = AclRule::new(AclAction::Allow);
    out.src = vec!["198.18.0.0/16".into(), v6.into()];
    FwConfig {
        tenants: vec![TenantAcl {
            tenant: 1,
            rules: vec![out],
            default_action: AclAction::Deny,
        }],
        ..FwConfig::default()
    }
}
