//! A live-frames packet generator: `BPF_PROG_TEST_RUN` with `BPF_F_TEST_XDP_LIVE_FRAMES`
//! runs `bpf/xdp_gen.c` on copies of a template frame and transmits every frame the
//! program returns `XDP_TX` for out of the named device, all inside the kernel on the
//! calling thread's CPU. xdp-tools' xdp-trafficgen works the same way. It feeds the
//! per-core packet-rate measurement of `starfabric bench e2e`, where the sender must
//! neither share a CPU with the NF under test nor stop when the NF falls behind (which
//! trafgen's AF_PACKET sends do, with EAGAIN).

use std::time::{Duration, Instant};

use aya::maps::Array;
use aya::programs::{TestRunAttrs, Xdp};
use aya::{Ebpf, EbpfLoader, TestRun, TestRunOptions};

use crate::{ebpf_map_mut, XdpError};

static XDP_GEN_OBJ: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/xdp_gen.o"));
const GEN_PROGRAM: &str = "xdp_gen";
/// The program varies the flow in the low byte of the outer source port.
pub const GEN_MAX_FLOWS: u32 = 256;
/// Frames per kernel batch (the kernel's own default, and the most it takes is 256).
const BATCH: u32 = 64;
/// Frames in the first syscall.
const FIRST_CALL: u32 = 1 << 12;
/// At most this many frames per syscall.
const MAX_CALL: u32 = 1 << 24;
/// How long one syscall should send for.
const CALL_TARGET: Duration = Duration::from_millis(500);
/// The template's length: `FRAME_LEN` of `bpf/xdp_gen.c`, a 64-byte UDP frame in VXLAN.
pub const GEN_FRAME_LEN: usize = 110;
const TEMPLATE_MAP: &str = "gen_template";

/// The loaded generator program.
pub struct LiveGenerator {
    ebpf: Ebpf,
    template: [u8; GEN_FRAME_LEN],
}

impl LiveGenerator {
    /// Load the generator for `flows` flows (clamped to 1..=[`GEN_MAX_FLOWS`]) of
    /// `frame`, which must be [`GEN_FRAME_LEN`] bytes, sending `rate_pps` frames/s
    /// (`None` or 0: as fast as it can).
    pub fn load(flows: u32, frame: &[u8], rate_pps: Option<u64>) -> Result<Self, XdpError> {
        let template: [u8; GEN_FRAME_LEN] = frame
            .try_into()
            .map_err(|_| XdpError::FrameLength(frame.len()))?;
        let flows = flows.clamp(1, GEN_MAX_FLOWS);
        let interval_ns: u64 = match rate_pps {
            Some(r) if r > 0 => (1_000_000_000 / r).max(1),
            _ => 0,
        };
        let mut ebpf = EbpfLoader::new()
            .override_global("flows", &flows, true)
            .override_global("interval_ns", &interval_ns, true)
            .load(XDP_GEN_OBJ)?;
        let prog: &mut Xdp = ebpf
            .program_mut(GEN_PROGRAM)
            .ok_or(XdpError::MissingProgram(GEN_PROGRAM))?
            .try_into()?;
        prog.load()?;
        let mut map: Array<_, [u8; GEN_FRAME_LEN]> = ebpf_map_mut(&mut ebpf, TEMPLATE_MAP)?;
        map.set(0, template, 0)
            .map_err(XdpError::on_map(TEMPLATE_MAP))?;
        Ok(Self { ebpf, template })
    }

    /// Send the template's flows out of the device with index `ifindex` (in the
    /// caller's network namespace) until `deadline`; returns the frames the program ran
    /// on (each handed to the device, which may refuse it when its peer is full, or,
    /// paced, dropped because its time had not come).
    pub fn run_until(&self, ifindex: u32, deadline: Instant) -> Result<u64, XdpError> {
        let frame = &self.template[..];
        let prog: &Xdp = self
            .ebpf
            .program(GEN_PROGRAM)
            .ok_or(XdpError::MissingProgram(GEN_PROGRAM))?
            .try_into()?;
        // struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index,
        // egress_ifindex. The kernel wants data = 0 (no metadata) and data_end = the
        // frame's length.
        let mut ctx = [0u8; 24];
        ctx[4..8].copy_from_slice(&(GEN_FRAME_LEN as u32).to_ne_bytes());
        ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
        let mut sent = 0u64;
        // Each call sets up and tears down a page pool and an rxq registration, which
        // costs an RCU grace period or so (milliseconds): calls of a fixed small repeat
        // count leave the sender idle most of the time. So each call's repeat count aims
        // at CALL_TARGET of sending, from the rate the previous call achieved.
        let mut repeat = FIRST_CALL;
        while Instant::now() < deadline {
            let mut opts = TestRunOptions::new();
            opts.data_in = Some(frame);
            opts.ctx_in = Some(&ctx);
            opts.repeat = repeat;
            opts.attrs = TestRunAttrs::new().xdp_live_frames(BATCH);
            let t = Instant::now();
            prog.test_run(opts)?;
            let took = t.elapsed().as_secs_f64().max(1e-6);
            sent += u64::from(repeat);
            let left = deadline
                .saturating_duration_since(Instant::now())
                .as_secs_f64();
            let target = CALL_TARGET.as_secs_f64().min(left);
            repeat = ((f64::from(repeat) / took) * target)
                .clamp(f64::from(FIRST_CALL), f64::from(MAX_CALL)) as u32;
        }
        Ok(sent)
    }

    /// [`run_until`](Self::run_until) for `secs` from now.
    pub fn run_for(&self, ifindex: u32, secs: Duration) -> Result<u64, XdpError> {
        self.run_until(ifindex, Instant::now() + secs)
    }
}
