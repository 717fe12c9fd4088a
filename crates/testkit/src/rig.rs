//! A pipeline test rig: a [`Pipeline`] whose rule source is a channel the test answers,
//! run by a [`Worker`] on in-memory I/O ([`MemRing`]) with a [`ManualClock`].

use std::net::Ipv4Addr;

use crossbeam_channel::{Receiver, Sender};
use packet::build::{udp_v4, vxlan_wrap};
use pipeline::{
    ManualClock, MemRing, NodeAddr, Pipeline, PipelineConfig, RuleReply, RuleRequest, RuleSource,
    VecSource, VpcBinding, Worker,
};

/// The VPC [`Rig::tenant`] binds, to tenant 7, chain 3.
pub const TENANT_VNI: u32 = 100;

/// The node the rigs' pipelines run as: 198.18.0.1, MAC 02:00:00:00:00:01, gateway MAC
/// 02:00:00:00:00:02.
pub fn node() -> NodeAddr {
    NodeAddr {
        ip: Ipv4Addr::new(198, 18, 0, 1),
        mac: [2, 0, 0, 0, 0, 1],
        gw_mac: [2, 0, 0, 0, 0, 2],
    }
}

/// A UDP datagram of the tenant's client 198.18.10.2:`sport` to 198.19.0.9:`dport`, in
/// VXLAN on `vni` from the tenant's endpoint 198.18.0.50 to [`node`]: the frame the
/// pipeline tests send.
pub fn client_udp(vni: u32, sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
    let inner = udp_v4([198, 18, 10, 2], sport, [198, 19, 0, 9], dport, payload);
    vxlan_wrap([198, 18, 0, 50], [198, 18, 0, 1], 50000, vni, &inner)
}

/// A pipeline on `cfg` whose rule requests go to the returned receiver (bounded by
/// `channel_cap`) and whose replies come from the returned sender.
pub fn channel_pipeline(
    cfg: PipelineConfig,
    channel_cap: usize,
) -> (Pipeline, Receiver<RuleRequest>, Sender<RuleReply>) {
    let (req_tx, req_rx) = crossbeam_channel::bounded(channel_cap);
    let (rep_tx, rep_rx) = crossbeam_channel::unbounded();
    let p = Pipeline::new(
        cfg,
        RuleSource::Channel {
            requests: req_tx,
            replies: rep_rx,
        },
    )
    .expect("pipeline config");
    (p, req_rx, rep_tx)
}

/// A [`channel_pipeline`] in a worker on a 64-frame [`MemRing`] (batches of 64): the
/// test pushes frames in, answers rule requests, and moves the clock.
pub struct Rig {
    pub worker: Worker<MemRing<VecSource>>,
    pub requests: Receiver<RuleRequest>,
    pub replies: Sender<RuleReply>,
    pub clock: ManualClock,
}

impl Rig {
    /// The rig for `cfg`; `setup` binds VPCs and the like before the worker starts, and
    /// `clock` (shared with the rig) is the worker's clock.
    pub fn new(
        cfg: PipelineConfig,
        channel_cap: usize,
        clock: ManualClock,
        setup: impl FnOnce(&mut Pipeline),
    ) -> Rig {
        let (mut p, requests, replies) = channel_pipeline(cfg, channel_cap);
        setup(&mut p);
        Rig {
            worker: Worker::new(
                p,
                MemRing::new(VecSource::default(), 64),
                64,
                Box::new(clock.clone()),
            ),
            requests,
            replies,
            clock,
        }
    }

    /// A rig for `cfg` on its own clock whose pipeline binds VNI [`TENANT_VNI`] to tenant
    /// 7, chain 3: the one tenant most pipeline tests send as.
    pub fn tenant(cfg: PipelineConfig, channel_cap: usize) -> Rig {
        Rig::new(cfg, channel_cap, ManualClock::default(), |p| {
            p.bind_vpc(
                TENANT_VNI,
                VpcBinding {
                    tenant: 7,
                    chain: 3,
                },
            )
        })
    }

    /// Queue `frames` and run the worker until it has taken them all.
    pub fn send(&mut self, frames: impl IntoIterator<Item = Vec<u8>>) {
        for f in frames {
            self.worker.io.source.push(f, 0);
        }
        while !self.worker.io.source.frames.is_empty() {
            self.worker.run_once().unwrap();
        }
    }

    /// The frames transmitted since the last call (needs `worker.io.sink.capture`).
    pub fn out(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.worker.io.sink.captured)
            .into_iter()
            .map(|(_, f)| f)
            .collect()
    }
}
