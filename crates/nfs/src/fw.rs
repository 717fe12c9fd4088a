//! STUB: being written.

use nf::NfError;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FwConfig {}

pub struct Firewall;

impl Firewall {
    pub fn new(_c: FwConfig) -> Result<Self, NfError> {
        Err(NfError::Config("not built yet".into()))
    }
}

impl nf::NetworkFunction for Firewall {
    fn kind(&self) -> &str {
        "fw"
    }
    fn tables(&self) -> Vec<nf::TableSpec> {
        vec![]
    }
    fn first_packet(
        &mut self,
        _p: &nf::FirstPacket,
        _e: &mut nf::NfEnv,
    ) -> Result<nf::Decision, NfError> {
        Err(NfError::Other("stub".into()))
    }
    fn snapshot(&self) -> Result<Vec<u8>, NfError> {
        Ok(vec![])
    }
    fn restore(&mut self, _s: &[u8]) -> Result<(), NfError> {
        Ok(())
    }
    fn split(&mut self, _h: &nf::SplitHalf) -> Result<Vec<u8>, NfError> {
        Ok(vec![])
    }
    fn merge(&mut self, _p: &[u8]) -> Result<(), NfError> {
        Ok(())
    }
}
