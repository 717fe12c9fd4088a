//! A fabric master driven by untrusted bytes, without sockets or a runtime: the
//! `control` cargo-fuzz target (fuzz/fuzz_targets/control.rs) feeds it. Everything a
//! peer can send FM arrives here as protobuf bytes: session registrations and the
//! messages PP and SC nodes send after them, the orchestrator's directives, operators'
//! scale and vIP requests, and queries. Each goes through the validation, routing
//! ([`super::pp_in`], [`super::sc_in`]) and dispatch ([`super::dispatch`]) the gRPC
//! service uses, on a clock the input advances.
//!
//! Built only with the `fuzzing` feature: production builds do not carry it.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use prost::Message;
use proto::v1;
use tokio::sync::oneshot;

use super::{
    check_registration, dispatch, down_channel, pp_in, sc_in, DownBound, DownFullCounters,
    DownStream, Links, MasterIn, PpTx, ScTx, ScaleDone,
};
use crate::master::{FmConfig, Master, Opened, ScaleRequest};

/// What the harness did with one input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Decoded, accepted and handed to the master.
    Applied,
    /// Decoded, and refused as the service refuses it (the reason).
    Refused(String),
    /// Not a message of the expected type.
    Undecodable,
}

/// The master and what its task holds, with the receiving ends of every session's
/// down stream (drained, so that nothing grows without bound).
pub struct ControlHarness {
    master: Master,
    links: Links,
    now_us: u64,
    next_session: u64,
    /// Open sessions: session id, node id, role.
    sessions: Vec<(u64, String, v1::Role)>,
    pp_down: Vec<DownStream<v1::PpDown>>,
    sc_down: Vec<DownStream<v1::ScDown>>,
    scales: Vec<oneshot::Receiver<Result<crate::ScaleOutcome, String>>>,
    /// Messages the master sent down sessions (what the fuzz target can report).
    pub delivered: u64,
}

impl ControlHarness {
    /// A master with FM's default configuration serving `chains`.
    pub fn new(chains: Vec<v1::ChainConfig>) -> Self {
        ControlHarness {
            master: Master::new(FmConfig::default(), chains),
            links: Links::new(
                DownBound::of(&FmConfig::default()),
                Arc::new(DownFullCounters::default()),
            ),
            now_us: 1,
            next_session: 1,
            sessions: Vec::new(),
            pp_down: Vec::new(),
            sc_down: Vec::new(),
            scales: Vec::new(),
            delivered: 0,
        }
    }

    /// A session of `role` whose first message is `registration` (a `PpUp` or `ScUp`).
    pub fn open(&mut self, role: v1::Role, registration: &[u8]) -> Step {
        let info = match role {
            v1::Role::Pp => match v1::PpUp::decode(registration) {
                Ok(m) => match m.msg {
                    Some(v1::pp_up::Msg::Register(i)) => Some(i),
                    _ => None,
                },
                Err(_) => return Step::Undecodable,
            },
            _ => match v1::ScUp::decode(registration) {
                Ok(m) => match m.msg {
                    Some(v1::sc_up::Msg::Register(i)) => Some(i),
                    _ => None,
                },
                Err(_) => return Step::Undecodable,
            },
        };
        let info = match check_registration(info, role) {
            Ok(i) => i,
            Err(e) => return Step::Refused(e.message().to_string()),
        };
        let session = self.next_session;
        self.next_session += 1;
        let open = Opened {
            session,
            info: info.clone(),
            seen: Arc::new(AtomicU64::new(self.now_us / 1000)),
            liveness_token: session,
        };
        let msg = if role == v1::Role::Pp {
            let (tx, rx): (PpTx, _) = down_channel();
            self.pp_down.push(rx);
            MasterIn::PpOpen { open, tx }
        } else {
            let (tx, rx): (ScTx, _) = down_channel();
            self.sc_down.push(rx);
            MasterIn::ScOpen { open, tx }
        };
        self.sessions.push((session, info.id, role));
        self.apply(msg)
    }

    /// The `which`th open session of `role` (modulo their count).
    fn session(&self, role: v1::Role, which: usize) -> Option<(u64, String)> {
        let of_role: Vec<&(u64, String, v1::Role)> =
            self.sessions.iter().filter(|s| s.2 == role).collect();
        let s = of_role.get(which % of_role.len().max(1))?;
        Some((s.0, s.1.clone()))
    }

    /// A message on a PP session after its registration.
    pub fn pp_message(&mut self, which: usize, bytes: &[u8]) -> Step {
        let Ok(m) = v1::PpUp::decode(bytes) else {
            return Step::Undecodable;
        };
        let Some((session, node)) = self.session(v1::Role::Pp, which) else {
            return Step::Refused("no PP session".into());
        };
        match pp_in(m, session, &node) {
            Some(msg) => self.apply(msg),
            None => Step::Refused("not a message after registration".into()),
        }
    }

    /// A message on an SC session after its registration.
    pub fn sc_message(&mut self, which: usize, bytes: &[u8]) -> Step {
        let Ok(m) = v1::ScUp::decode(bytes) else {
            return Step::Undecodable;
        };
        let Some((session, node)) = self.session(v1::Role::Sc, which) else {
            return Step::Refused("no SC session".into());
        };
        match sc_in(m, session, &node) {
            Some(msg) => self.apply(msg),
            None => Step::Refused("not a message after registration".into()),
        }
    }

    /// The `which`th open session ends (its stream closed or broke).
    pub fn close(&mut self, which: usize) -> Step {
        if self.sessions.is_empty() {
            return Step::Refused("no session".into());
        }
        let (session, node, _) = self.sessions.remove(which % self.sessions.len());
        self.apply(MasterIn::Closed { session, node })
    }

    /// An orchestrator directive: the chains, partitions and shard sets FM serves.
    pub fn directive(&mut self, bytes: &[u8]) -> Step {
        let Ok(d) = v1::Directive::decode(bytes) else {
            return Step::Undecodable;
        };
        let (done, _answer) = oneshot::channel();
        self.apply(MasterIn::SetDesired {
            chains: d.chains,
            partitions: d.partitions,
            shards: d.shards,
            done,
        })
    }

    /// An operator's scale-out (`out`) or scale-in request.
    pub fn scale(&mut self, out: bool, bytes: &[u8]) -> Step {
        let req = if out {
            match v1::ScaleOutRequest::decode(bytes) {
                Ok(r) => ScaleRequest::Out {
                    tenant: r.tenant,
                    chain: r.chain,
                    group: r.group,
                    // A bad mode is the service's to refuse; here FM's default.
                    migration: r.migration.parse().ok(),
                },
                Err(_) => return Step::Undecodable,
            }
        } else {
            match v1::ScaleInRequest::decode(bytes) {
                Ok(r) => ScaleRequest::In {
                    tenant: r.tenant,
                    chain: r.chain,
                    group: r.group,
                },
                Err(_) => return Step::Undecodable,
            }
        };
        let (done, answer): (ScaleDone, _) = oneshot::channel();
        self.scales.push(answer);
        self.apply(MasterIn::Scale(req, done))
    }

    /// An operator's vIP move, or (`drain`) a PP drain of the node the bytes name.
    pub fn vip(&mut self, drain: bool, bytes: &[u8]) -> Step {
        if drain {
            let node = String::from_utf8_lossy(bytes).into_owned();
            let (tx, _rx) = oneshot::channel();
            return self.apply(MasterIn::PpDrain(node, tx));
        }
        let Ok(req) = v1::VipMoveRequest::decode(bytes) else {
            return Step::Undecodable;
        };
        let (tx, _rx) = oneshot::channel();
        self.apply(MasterIn::VipMove(req, tx))
    }

    /// One of the read-only queries (`kind` picks it), with `bytes` as its request.
    pub fn query(&mut self, kind: u8, bytes: &[u8]) -> Step {
        let msg = match kind % 8 {
            0 => MasterIn::Members(oneshot::channel().0),
            1 => MasterIn::Map(oneshot::channel().0),
            2 => MasterIn::Stats(oneshot::channel().0),
            3 => MasterIn::Metrics(oneshot::channel().0),
            4 => MasterIn::Load(oneshot::channel().0),
            5 => MasterIn::VipMap(oneshot::channel().0),
            6 => match v1::FlowsRequest::decode(bytes) {
                Ok(r) => MasterIn::Flows(r, oneshot::channel().0),
                Err(_) => return Step::Undecodable,
            },
            _ => match v1::EventsRequest::decode(bytes) {
                Ok(r) => MasterIn::Events(r, oneshot::channel().0),
                Err(_) => return Step::Undecodable,
            },
        };
        self.apply(msg)
    }

    /// Time passes (`ms`): the master's periodic work (failure detection, scale
    /// timeouts, cache expiry) runs as its task runs it.
    pub fn advance(&mut self, ms: u16) {
        self.now_us += u64::from(ms) * 1000;
        self.master.tick_late(self.now_us, 0);
        self.settle();
    }

    fn apply(&mut self, msg: MasterIn) -> Step {
        dispatch(&mut self.master, &mut self.links, msg, self.now_us);
        self.settle();
        Step::Applied
    }

    /// What the master task does after a burst: flush, deliver, and (here) read what
    /// the sessions were sent.
    fn settle(&mut self) {
        self.master.flush(self.now_us);
        self.links.deliver(self.master.take_out());
        for rx in &mut self.pp_down {
            while rx.try_recv().is_some() {
                self.delivered += 1;
            }
        }
        for rx in &mut self.sc_down {
            while rx.try_recv().is_some() {
                self.delivered += 1;
            }
        }
        self.scales
            .retain_mut(|r| matches!(r.try_recv(), Err(oneshot::error::TryRecvError::Empty)));
    }
}

/// One input of the byte stream [`run`] reads: `[tag, arg, len_lo, len_hi, body...]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    OpenPp(Vec<u8>),
    OpenSc(Vec<u8>),
    Pp(u8, Vec<u8>),
    Sc(u8, Vec<u8>),
    Close(u8),
    Directive(Vec<u8>),
    ScaleOut(Vec<u8>),
    ScaleIn(Vec<u8>),
    VipMove(Vec<u8>),
    Drain(Vec<u8>),
    Query(u8, Vec<u8>),
    Advance(u16),
}

impl Op {
    /// The bytes [`Op::read`] takes back (a body over 65535 bytes is cut).
    pub fn encode(&self) -> Vec<u8> {
        let (tag, arg, body): (u8, u8, &[u8]) = match self {
            Op::OpenPp(b) => (0, 0, b),
            Op::OpenSc(b) => (1, 0, b),
            Op::Pp(w, b) => (2, *w, b),
            Op::Sc(w, b) => (3, *w, b),
            Op::Close(w) => (4, *w, &[]),
            Op::Directive(b) => (5, 0, b),
            Op::ScaleOut(b) => (6, 0, b),
            Op::ScaleIn(b) => (7, 0, b),
            Op::VipMove(b) => (8, 0, b),
            Op::Drain(b) => (9, 0, b),
            Op::Query(k, b) => (10, *k, b),
            Op::Advance(ms) => (11, 0, &ms.to_le_bytes()[..]),
        };
        let body = &body[..body.len().min(usize::from(u16::MAX))];
        let mut out = vec![tag, arg];
        out.extend_from_slice(&(body.len() as u16).to_le_bytes());
        out.extend_from_slice(body);
        out
    }

    /// The next op of `data` and what follows it; `None` at the end. A length past the
    /// end takes what is there.
    pub fn read(data: &[u8]) -> Option<(Op, &[u8])> {
        let (&tag, rest) = data.split_first()?;
        let (&arg, rest) = rest.split_first().unwrap_or((&0, &[]));
        let len = match rest {
            [lo, hi, ..] => usize::from(u16::from_le_bytes([*lo, *hi])),
            _ => 0,
        };
        let rest = rest.get(2..).unwrap_or(&[]);
        let (body, rest) = rest.split_at(len.min(rest.len()));
        let b = body.to_vec();
        let op = match tag % 12 {
            0 => Op::OpenPp(b),
            1 => Op::OpenSc(b),
            2 => Op::Pp(arg, b),
            3 => Op::Sc(arg, b),
            4 => Op::Close(arg),
            5 => Op::Directive(b),
            6 => Op::ScaleOut(b),
            7 => Op::ScaleIn(b),
            8 => Op::VipMove(b),
            9 => Op::Drain(b),
            10 => Op::Query(arg, b),
            _ => Op::Advance(match body {
                [lo, hi, ..] => u16::from_le_bytes([*lo, *hi]),
                [lo] => u16::from(*lo),
                [] => 0,
            }),
        };
        Some((op, rest))
    }
}

/// What [`run`] saw.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    pub applied: u64,
    pub refused: u64,
    pub undecodable: u64,
    /// Messages the master sent down sessions.
    pub delivered: u64,
}

impl ControlHarness {
    /// Apply one op.
    pub fn step(&mut self, op: &Op) -> Step {
        match op {
            Op::OpenPp(b) => self.open(v1::Role::Pp, b),
            Op::OpenSc(b) => self.open(v1::Role::Sc, b),
            Op::Pp(w, b) => self.pp_message(usize::from(*w), b),
            Op::Sc(w, b) => self.sc_message(usize::from(*w), b),
            Op::Close(w) => self.close(usize::from(*w)),
            Op::Directive(b) => self.directive(b),
            Op::ScaleOut(b) => self.scale(true, b),
            Op::ScaleIn(b) => self.scale(false, b),
            Op::VipMove(b) => self.vip(false, b),
            Op::Drain(b) => self.vip(true, b),
            Op::Query(k, b) => self.query(*k, b),
            Op::Advance(ms) => {
                self.advance(*ms);
                Step::Applied
            }
        }
    }
}

/// Feed every op of `data` to a fresh master serving no chains (the ops' directives
/// bring them).
pub fn run(data: &[u8]) -> Summary {
    let mut h = ControlHarness::new(Vec::new());
    let mut sum = Summary::default();
    let mut rest = data;
    while let Some((op, tail)) = Op::read(rest) {
        match h.step(&op) {
            Step::Applied => sum.applied += 1,
            Step::Refused(_) => sum.refused += 1,
            Step::Undecodable => sum.undecodable += 1,
        }
        rest = tail;
    }
    sum.delivered = h.delivered;
    sum
}
