//! The worked example of `docs/nf-api.md`: Serpens Fig. 9's NAT written against the NF
//! trait. It is kept here, compiled and run, so the document cannot drift from the API.
//! The real SNAT (`nfs::snat`) adds endpoint-independent mapping, pairing, hairpinning,
//! TCP states, ICMP and a bitmap pool.

// --- begin example ---
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use nf::{
    Consistency, Decision, FirstPacket, FlowEvent, NetworkFunction, NfEnv, NfError, Rewrite,
    SplitHalf, TableSpec,
};
use pipeline::FlowKey;
use serde::{Deserialize, Serialize};

/// All state, in two tables. BTreeMaps, so every replica serialises identical bytes.
#[derive(Default, Serialize, Deserialize)]
struct State {
    /// pool_table: global | write | release.
    free: Vec<u16>,
    /// mapping_table: per-flow | write. Flow key (text form) → (port, deadline).
    flows: BTreeMap<String, (u16, u64)>,
}

pub struct TinyNat {
    public: IpAddr,
    timeout: Duration,
    st: State,
}

impl TinyNat {
    /// nat_init: the first partition owns the whole pool.
    pub fn new(public: IpAddr, lo: u16, hi: u16) -> Self {
        TinyNat {
            public,
            timeout: Duration::from_secs(300),
            st: State {
                free: (lo..=hi).collect(),
                flows: BTreeMap::new(),
            },
        }
    }

    fn release(&mut self, key: &FlowKey) -> bool {
        match self.st.flows.remove(&key.to_string()) {
            Some((port, _)) => {
                self.st.free.push(port);
                true
            }
            None => false,
        }
    }
}

fn snap_err(e: serde_json::Error) -> NfError {
    NfError::Snapshot(e.to_string())
}

impl NetworkFunction for TinyNat {
    fn kind(&self) -> &str {
        "tiny-nat"
    }

    fn tables(&self) -> Vec<TableSpec> {
        vec![
            TableSpec::shared_write("pool", Consistency::Partitioned),
            TableSpec::per_flow("mapping"),
        ]
    }

    /// nat_handler, for the first packet only: PP applies the answer to the rest.
    fn first_packet(&mut self, pkt: &FirstPacket, env: &mut NfEnv) -> Result<Decision, NfError> {
        let k = pkt.key;
        let port = match self.st.flows.get(&k.to_string()) {
            // Asked again (PP lost the rule): the same answer.
            Some(&(port, _)) => port,
            None if self.st.free.is_empty() => return Ok(Decision::drop("nat-exhausted")),
            // select(IPs): random from the request's seeded rng, never from the host.
            None => {
                let i = env.rng.below(self.st.free.len() as u64) as usize;
                self.st.free.swap_remove(i)
            }
        };
        let deadline = env.now_ms + self.timeout.as_millis() as u64;
        self.st.flows.insert(k.to_string(), (port, deadline));
        Ok(Decision {
            // update_header for this direction...
            forward: Rewrite::src(self.public, port),
            // ...and the reverse-5-tuple state, as the reply rule's rewrite.
            reverse: Rewrite::dst(k.src(), k.sport()),
            idle_timeout: Some(self.timeout),
            ..Decision::pass()
        })
    }

    fn on_event(&mut self, ev: &FlowEvent, _env: &mut NfEnv) {
        if let FlowEvent::Expired { key } = ev {
            self.release(key);
        }
    }

    fn on_timer(&mut self, env: &mut NfEnv) -> Vec<FlowKey> {
        let due: Vec<FlowKey> = self
            .st
            .flows
            .iter()
            .filter(|(_, (_, deadline))| *deadline <= env.now_ms)
            .filter_map(|(k, _)| k.parse().ok())
            .collect();
        due.into_iter().filter(|k| self.release(k)).collect()
    }

    fn snapshot(&self) -> Result<Vec<u8>, NfError> {
        serde_json::to_vec(&self.st).map_err(snap_err)
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), NfError> {
        self.st = serde_json::from_slice(snapshot).map_err(snap_err)?;
        Ok(())
    }

    /// Fig. 3 scale-out: flows in `half` move; the free pool splits in two (release
    /// consistency), so both owners allocate without ever meeting.
    fn split(&mut self, half: &SplitHalf) -> Result<Vec<u8>, NfError> {
        let mut part = State::default();
        let moving: Vec<String> = self
            .st
            .flows
            .keys()
            .filter(|k| k.parse::<FlowKey>().is_ok_and(|k| half.moves(&k)))
            .cloned()
            .collect();
        for k in moving {
            if let Some(v) = self.st.flows.remove(&k) {
                part.flows.insert(k, v);
            }
        }
        self.st.free.sort_unstable();
        part.free = self.st.free.split_off(self.st.free.len() / 2);
        serde_json::to_vec(&part).map_err(snap_err)
    }

    /// Scale-in: the parts are disjoint, so the union is the merge.
    fn merge(&mut self, part: &[u8]) -> Result<(), NfError> {
        let part: State = serde_json::from_slice(part).map_err(snap_err)?;
        self.st.free.extend(part.free);
        self.st.flows.extend(part.flows);
        Ok(())
    }
}
// --- end example ---

use nf::{Chain, ChainSpec, Egress};
use pipeline::{format_actions, PacketMeta};

fn pkt(s: &str) -> FirstPacket {
    FirstPacket::new(s.parse().expect("key"), 1, PacketMeta::new(60, 0))
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

#[test]
fn tiny_nat_in_a_chain() {
    let nfs: Vec<Box<dyn NetworkFunction>> = vec![
        Box::new(nfs::monitor::Monitor::new(Default::default()).expect("monitor")),
        Box::new(TinyNat::new(ip("198.19.255.1"), 40_000, 40_009)),
    ];
    let mut chain =
        Chain::new(nfs, ChainSpec::seq(2), Egress::LOCAL, Egress::LOCAL).expect("chain");
    let r = chain
        .decide(
            &pkt("100 udp 198.18.0.2:5000 > 198.19.0.10:53"),
            &mut NfEnv::new(0, 42),
        )
        .expect("decided");
    assert_eq!(r.path_names(), ["monitor", "tiny-nat"]);
    let fwd = format_actions(&r.forward.actions);
    assert!(fwd.starts_with("set-src 198.19.255.1:400"), "{fwd}");
    let rev = r.reverse.expect("reverse rule");
    assert!(rev
        .key
        .to_string()
        .starts_with("100 udp 198.19.0.10:53 > 198.19.255.1:400"));
    assert_eq!(
        format_actions(&rev.actions),
        "set-dst 198.18.0.2:5000; count; out 0"
    );
    // Same request, same seed: same answer (replicas agree).
    let again = chain
        .decide(
            &pkt("100 udp 198.18.0.2:5000 > 198.19.0.10:53"),
            &mut NfEnv::new(0, 42),
        )
        .expect("decided");
    assert_eq!(again.forward, r.forward);
    assert_eq!(chain.on_timer(&mut NfEnv::new(300_000, 0)).len(), 1);
}

#[test]
fn tiny_nat_splits_and_merges() {
    let mut a = TinyNat::new(ip("198.19.255.1"), 1, 100);
    for i in 0..40 {
        let f = format!("100 udp 198.18.0.{i}:5000 > 198.19.0.10:53");
        a.first_packet(&pkt(&f), &mut NfEnv::new(0, i))
            .expect("decided");
    }
    let half = SplitHalf {
        moved_lo: 0,
        moved_hi: u64::MAX / 2,
    };
    let mut b = TinyNat::new(ip("198.19.255.1"), 1, 100);
    b.restore(&a.split(&half).expect("split")).expect("restore");
    assert_eq!(a.st.flows.len() + b.st.flows.len(), 40);
    assert_eq!(a.st.free.len() + b.st.free.len(), 60);
    a.merge(&b.snapshot().expect("snapshot")).expect("merge");
    let mut free = a.st.free.clone();
    free.extend(a.st.flows.values().map(|(p, _)| *p));
    free.sort_unstable();
    assert_eq!(free, (1..=100).collect::<Vec<u16>>());
}
