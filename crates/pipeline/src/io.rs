//! The I/O boundary of a worker: packet descriptors over a backend-owned memory region.
//!
//! A backend owns a region of fixed-size frames (a `Vec` here, a UMEM for AF_XDP) and
//! hands the pipeline descriptors (frame base, data offset, length). The pipeline rewrites
//! frames in place, may grow a frame into its headroom (encap), and sets each descriptor's
//! verdict; the backend then transmits or recycles. This is the AF_XDP descriptor model,
//! so an AF_XDP backend, or an XDP fast path in front of it, plugs in without touching
//! the pipeline.

use std::collections::VecDeque;

use thiserror::Error;

use crate::stats::DropReason;

/// Size of one frame slot in a backend region.
pub const FRAME_SIZE: usize = 2048;
/// Bytes reserved before received data, for pushing encap headers.
pub const HEADROOM: usize = 128;
/// Largest frame a slot holds after the headroom.
pub const MAX_FRAME: usize = FRAME_SIZE - HEADROOM;

/// What happens to a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Not processed yet.
    Pending,
    /// Transmit on output port.
    Tx(u8),
    /// Dropped, counted under the reason.
    Drop(DropReason),
    /// Copied into a pending queue while its rule is outstanding; recycle the frame.
    Held,
}

/// A packet in a backend region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    /// Start of the frame slot in the region.
    pub base: u32,
    /// Start of the data within the slot (headroom before it).
    pub off: u16,
    pub len: u16,
    /// Slot size.
    pub cap: u16,
    /// Ingress port.
    pub port: u16,
    pub verdict: Verdict,
}

impl Desc {
    pub fn new(base: usize, off: usize, len: usize, cap: usize, port: u16) -> Self {
        Desc {
            base: base as u32,
            off: off as u16,
            len: len as u16,
            cap: cap as u16,
            port,
            verdict: Verdict::Pending,
        }
    }

    #[inline]
    pub fn data<'a>(&self, region: &'a [u8]) -> &'a [u8] {
        let s = self.base as usize + self.off as usize;
        &region[s..s + self.len as usize]
    }

    #[inline]
    pub fn slot_mut<'a>(&self, region: &'a mut [u8]) -> &'a mut [u8] {
        let s = self.base as usize;
        &mut region[s..s + self.cap as usize]
    }
}

#[derive(Debug, Error)]
pub enum IoError {
    #[error("I/O error: {0}")]
    Os(#[from] std::io::Error),
    #[error("backend closed")]
    Closed,
}

/// A source and sink of frames for a worker.
pub trait PacketIo {
    /// Receive up to `max` frames; `descs` is cleared and refilled. Returns the count.
    fn rx(&mut self, descs: &mut Vec<Desc>, max: usize) -> Result<usize, IoError>;

    /// The region `rx` descriptors point into.
    fn region(&mut self) -> &mut [u8];

    /// Transmit every `Tx` descriptor and recycle all frames of the last `rx`.
    /// Returns how many were sent; the rest of the `Tx` ones are counted by the backend.
    fn tx(&mut self, descs: &[Desc]) -> Result<usize, IoError>;

    /// Transmit `Tx` descriptors pointing into another region (released pending packets).
    fn tx_from(&mut self, region: &[u8], descs: &[Desc]) -> Result<usize, IoError>;
}

/// Produces frames for a [`MemRing`].
pub trait FrameSource {
    /// Write the next frame into `out`, returning (length, ingress port); `None` when
    /// the source is exhausted.
    fn next_frame(&mut self, out: &mut [u8]) -> Option<(usize, u16)>;
}

/// A queue of prepared frames.
#[derive(Debug, Default)]
pub struct VecSource {
    pub frames: VecDeque<(Vec<u8>, u16)>,
}

impl VecSource {
    pub fn push(&mut self, frame: Vec<u8>, port: u16) {
        self.frames.push_back((frame, port));
    }
}

impl FrameSource for VecSource {
    fn next_frame(&mut self, out: &mut [u8]) -> Option<(usize, u16)> {
        loop {
            let (f, port) = self.frames.pop_front()?;
            if f.len() <= out.len() {
                out[..f.len()].copy_from_slice(&f);
                return Some((f.len(), port));
            }
            // Larger than a slot: a real NIC would not deliver it either.
            tracing::warn!(len = f.len(), "frame larger than a slot; skipped");
        }
    }
}

/// What a [`MemRing`] does with transmitted frames.
#[derive(Debug, Default)]
pub struct MemSink {
    pub packets: u64,
    pub bytes: u64,
    /// Keep copies of transmitted frames (tests); off for benchmarks.
    pub capture: bool,
    pub captured: Vec<(u8, Vec<u8>)>,
}

impl MemSink {
    fn take(&mut self, region: &[u8], descs: &[Desc]) -> usize {
        let mut n = 0;
        for d in descs {
            if let Verdict::Tx(port) = d.verdict {
                n += 1;
                self.bytes += d.len as u64;
                if self.capture {
                    self.captured.push((port, d.data(region).to_vec()));
                }
            }
        }
        self.packets += n as u64;
        n
    }
}

/// An in-memory ring: frames come from a [`FrameSource`] (copied into the region, as a
/// NIC would DMA them) and go to a [`MemSink`]. For tests and benchmarks.
pub struct MemRing<S: FrameSource> {
    region: Vec<u8>,
    slots: usize,
    pub source: S,
    pub sink: MemSink,
}

impl<S: FrameSource> MemRing<S> {
    /// A ring with `slots` frame slots (the largest batch it can deliver).
    pub fn new(source: S, slots: usize) -> Self {
        MemRing {
            region: vec![0u8; slots * FRAME_SIZE],
            slots,
            source,
            sink: MemSink::default(),
        }
    }
}

impl<S: FrameSource> PacketIo for MemRing<S> {
    fn rx(&mut self, descs: &mut Vec<Desc>, max: usize) -> Result<usize, IoError> {
        descs.clear();
        for i in 0..max.min(self.slots) {
            let base = i * FRAME_SIZE;
            let out = &mut self.region[base + HEADROOM..base + FRAME_SIZE];
            match self.source.next_frame(out) {
                Some((len, port)) => descs.push(Desc::new(base, HEADROOM, len, FRAME_SIZE, port)),
                None => break,
            }
        }
        Ok(descs.len())
    }

    fn region(&mut self) -> &mut [u8] {
        &mut self.region
    }

    fn tx(&mut self, descs: &[Desc]) -> Result<usize, IoError> {
        Ok(self.sink.take(&self.region, descs))
    }

    fn tx_from(&mut self, region: &[u8], descs: &[Desc]) -> Result<usize, IoError> {
        Ok(self.sink.take(region, descs))
    }
}
