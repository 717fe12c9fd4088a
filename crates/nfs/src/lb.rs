//! STUB: being written.

use nf::NfError;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LbConfig {}

pub struct LoadBalancer;

impl LoadBalancer {
    pub fn new(_c: LbConfig) -> Result<Self, NfError> {
        Err(NfError::Config("not built yet".into()))
    }
}

impl nf::NetworkFunction for LoadBalancer {
    fn kind(&self) -> &str {
        "lb"
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
