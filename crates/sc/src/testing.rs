//! Minimal deterministic NFs for the platform's own tests and benchmarks: they exercise
//! SC, FM and PP without depending on the behaviour of the built-in NFs.
//!
//! - `test-snat`: `{"kind": "test-snat", "addrs": ["198.19.255.1"], "ports": [1024, 65535]}`.
//!   Per-flow mapping to a unique (address, port), chosen by the request's seeded rng
//!   with linear probing; a repeated first packet gets the flow's existing mapping;
//!   an exhausted pool drops as `snat-exhausted`. Its snapshot lists the mappings in key
//!   order, so equal state gives equal bytes.
//! - `test-fw`: `{"kind": "test-fw", "deny_dports": [23]}`: drops those ports as
//!   `acl-deny`, passes the rest.
//! - `test-lb`: `{"kind": "test-lb", "vip": "198.19.0.100", "port": 80,
//!   "backend": "198.19.1.7", "backend_port": 8080}`: DNAT of one VIP to one backend.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use nf::{
    Consistency, Decision, FirstPacket, NetworkFunction, NfEnv, NfError, Rewrite, SplitHalf,
    TableSpec,
};
use pipeline::FlowKey;
use serde::Deserialize;

use crate::factory::{BuiltinNfs, ChainFactory};
use crate::ScError;

/// Builds the test NFs, and the built-in ones for any other kind.
#[derive(Debug, Default, Clone, Copy)]
pub struct TestNfs;

#[derive(Deserialize)]
struct Kind {
    kind: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SnatCfg {
    #[allow(dead_code)]
    kind: String,
    addrs: Vec<IpAddr>,
    ports: (u16, u16),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FwCfg {
    #[allow(dead_code)]
    kind: String,
    #[serde(default)]
    deny_dports: Vec<u16>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LbCfg {
    #[allow(dead_code)]
    kind: String,
    vip: IpAddr,
    port: u16,
    backend: IpAddr,
    backend_port: u16,
}

fn parse<T: for<'a> Deserialize<'a>>(s: &str) -> Result<T, ScError> {
    serde_json::from_str(s).map_err(|e| ScError::Chain(format!("{s}: {e}")))
}

impl ChainFactory for TestNfs {
    fn build_nf(&self, config: &str) -> Result<Box<dyn NetworkFunction>, ScError> {
        let k: Kind = parse(config)?;
        Ok(match k.kind.as_str() {
            "test-snat" => {
                let c: SnatCfg = parse(config)?;
                if c.ports.0 > c.ports.1 || c.addrs.is_empty() {
                    return Err(ScError::Chain("empty pool".into()));
                }
                let slots = c.addrs.len() * (usize::from(c.ports.1 - c.ports.0) + 1);
                Box::new(TestSnat {
                    addrs: c.addrs,
                    lo: c.ports.0,
                    hi: c.ports.1,
                    map: BTreeMap::new(),
                    used: vec![0; slots.div_ceil(64)],
                })
            }
            "test-fw" => Box::new(TestFw {
                deny: parse::<FwCfg>(config)?.deny_dports,
            }),
            "test-lb" => {
                let c: LbCfg = parse(config)?;
                Box::new(TestLb {
                    vip: c.vip,
                    port: c.port,
                    backend: c.backend,
                    backend_port: c.backend_port,
                })
            }
            _ => return BuiltinNfs.build_nf(config),
        })
    }
}

/// See the module documentation.
pub struct TestSnat {
    addrs: Vec<IpAddr>,
    lo: u16,
    hi: u16,
    /// Flow key → slot (address index × ports + port offset).
    map: BTreeMap<[u8; 40], u32>,
    /// Bitmap of used slots.
    used: Vec<u64>,
}

impl TestSnat {
    fn ports(&self) -> u32 {
        u32::from(self.hi - self.lo) + 1
    }

    fn slots(&self) -> u32 {
        self.addrs.len() as u32 * self.ports()
    }

    fn is_used(&self, s: u32) -> bool {
        self.used[s as usize / 64] >> (s % 64) & 1 == 1
    }

    fn set_used(&mut self, s: u32, on: bool) {
        let Some(w) = self.used.get_mut(s as usize / 64) else {
            return;
        };
        if on {
            *w |= 1 << (s % 64);
        } else {
            *w &= !(1 << (s % 64));
        }
    }

    /// Mappings in a snapshot: flow key → slot (address index × ports + port offset).
    pub fn decode_snapshot(s: &[u8]) -> Result<BTreeMap<[u8; 40], u32>, NfError> {
        let bad = || NfError::Snapshot("truncated test-snat snapshot".into());
        let (n, mut rest) = s.split_first_chunk::<8>().ok_or_else(bad)?;
        let n = u64::from_le_bytes(*n) as usize;
        if rest.len() != n.checked_mul(44).ok_or_else(bad)? {
            return Err(bad());
        }
        let mut map = BTreeMap::new();
        for _ in 0..n {
            let (k, r) = rest.split_first_chunk::<40>().ok_or_else(bad)?;
            let (p, r) = r.split_first_chunk::<4>().ok_or_else(bad)?;
            map.insert(*k, u32::from_le_bytes(*p));
            rest = r;
        }
        Ok(map)
    }

    fn encode(map: &BTreeMap<[u8; 40], u32>) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + map.len() * 44);
        out.extend_from_slice(&(map.len() as u64).to_le_bytes());
        for (k, p) in map {
            out.extend_from_slice(k);
            out.extend_from_slice(&p.to_le_bytes());
        }
        out
    }

    fn decision(&self, key: &FlowKey, slot: u32) -> Decision {
        let addr = self.addrs[(slot / self.ports()) as usize];
        let port = self.lo + (slot % self.ports()) as u16;
        Decision {
            forward: Rewrite::src(addr, port),
            reverse: Rewrite::dst(key.src(), key.sport()),
            idle_timeout: Some(Duration::from_secs(300)),
            ..Decision::pass()
        }
    }
}

impl NetworkFunction for TestSnat {
    fn kind(&self) -> &str {
        "test-snat"
    }

    fn tables(&self) -> Vec<TableSpec> {
        vec![
            TableSpec::per_flow("mappings"),
            TableSpec::shared_write("pool", Consistency::Partitioned),
        ]
    }

    fn first_packet(&mut self, pkt: &FirstPacket, env: &mut NfEnv) -> Result<Decision, NfError> {
        if let Some(&p) = self.map.get(pkt.key.as_bytes()) {
            return Ok(self.decision(&pkt.key, p));
        }
        let n = self.slots();
        if self.map.len() as u32 >= n {
            return Ok(Decision::drop("snat-exhausted"));
        }
        let start = env.rng.below(u64::from(n)) as u32;
        for i in 0..n {
            let s = (start + i) % n;
            if !self.is_used(s) {
                self.set_used(s, true);
                self.map.insert(*pkt.key.as_bytes(), s);
                return Ok(self.decision(&pkt.key, s));
            }
        }
        Ok(Decision::drop("snat-exhausted"))
    }

    fn snapshot(&self) -> Result<Vec<u8>, NfError> {
        Ok(Self::encode(&self.map))
    }

    fn restore(&mut self, s: &[u8]) -> Result<(), NfError> {
        let map = Self::decode_snapshot(s)?;
        self.used.iter_mut().for_each(|w| *w = 0);
        for &p in map.values() {
            self.set_used(p, true);
        }
        self.map = map;
        Ok(())
    }

    fn split(&mut self, half: &SplitHalf) -> Result<Vec<u8>, NfError> {
        let moved: BTreeMap<[u8; 40], u32> = self
            .map
            .iter()
            .filter(|(k, _)| half.moves(&FlowKey::from_bytes(**k)))
            .map(|(k, p)| (*k, *p))
            .collect();
        for (k, p) in &moved {
            self.map.remove(k);
            self.set_used(*p, false);
        }
        Ok(Self::encode(&moved))
    }

    fn merge(&mut self, part: &[u8]) -> Result<(), NfError> {
        for (k, p) in Self::decode_snapshot(part)? {
            self.set_used(p, true);
            self.map.insert(k, p);
        }
        Ok(())
    }

    fn flow_hashes(&self) -> Option<Vec<u64>> {
        Some(
            self.map
                .keys()
                .map(|k| FlowKey::from_bytes(*k).hash())
                .collect(),
        )
    }
}

struct TestFw {
    deny: Vec<u16>,
}

impl NetworkFunction for TestFw {
    fn kind(&self) -> &str {
        "test-fw"
    }
    fn tables(&self) -> Vec<TableSpec> {
        vec![TableSpec::shared_read("acl")]
    }
    fn first_packet(&mut self, pkt: &FirstPacket, _: &mut NfEnv) -> Result<Decision, NfError> {
        if self.deny.contains(&pkt.key.dport()) {
            Ok(Decision::drop("acl-deny"))
        } else {
            Ok(Decision::pass())
        }
    }
    nf::no_flow_state!(holds no flows);
}

struct TestLb {
    vip: IpAddr,
    port: u16,
    backend: IpAddr,
    backend_port: u16,
}

impl NetworkFunction for TestLb {
    fn kind(&self) -> &str {
        "test-lb"
    }
    fn tables(&self) -> Vec<TableSpec> {
        vec![TableSpec::shared_read("services")]
    }
    fn first_packet(&mut self, pkt: &FirstPacket, _: &mut NfEnv) -> Result<Decision, NfError> {
        if pkt.key.dst() != self.vip || pkt.key.dport() != self.port {
            return Ok(Decision::pass());
        }
        Ok(Decision {
            forward: Rewrite::dst(self.backend, self.backend_port),
            reverse: Rewrite::src(self.vip, self.port),
            ..Decision::pass()
        })
    }
    nf::no_flow_state!(holds no flows);
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipeline::PacketMeta;

    fn pkt(i: u16) -> FirstPacket {
        let key = format!("1 udp 198.18.10.2:{i} > 198.19.0.9:53");
        FirstPacket::new(key.parse().unwrap(), 1, PacketMeta::new(60, 0))
    }

    #[test]
    fn test_snat_is_unique_idempotent_and_exhausts() {
        let mut nf = TestNfs
            .build_nf(r#"{"kind": "test-snat", "addrs": ["198.19.255.1", "198.19.255.2"], "ports": [1000, 1004]}"#)
            .unwrap();
        let mut ports = Vec::new();
        for i in 0..10 {
            let d = nf
                .first_packet(&pkt(i), &mut NfEnv::new(0, i as u64))
                .unwrap();
            ports.push((d.forward.src.addr.unwrap(), d.forward.src.port.unwrap()));
            let again = nf.first_packet(&pkt(i), &mut NfEnv::new(0, 99)).unwrap();
            assert_eq!(again, d);
        }
        ports.sort();
        ports.dedup();
        assert_eq!(ports.len(), 10);
        assert!(ports.iter().all(|(_, p)| (1000..=1004).contains(p)));
        let d = nf.first_packet(&pkt(77), &mut NfEnv::new(0, 1)).unwrap();
        assert_eq!(d, Decision::drop("snat-exhausted"));
        let s = nf.snapshot().unwrap();
        assert_eq!(TestSnat::decode_snapshot(&s).unwrap().len(), 10);
        let mut other = TestNfs
            .build_nf(r#"{"kind": "test-snat", "addrs": ["198.19.255.1", "198.19.255.2"], "ports": [1000, 1004]}"#)
            .unwrap();
        other.restore(&s).unwrap();
        assert_eq!(other.snapshot().unwrap(), s);
        assert!(other.restore(&s[..s.len() - 1]).is_err());
    }
}
