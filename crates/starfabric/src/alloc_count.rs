//! A counting wrapper around mimalloc, built only with the `alloc-count` feature: how
//! many allocations each thread makes, so `bench setup` can report allocations per flow
//! set up by thread (issue 16: "no allocation per op"; docs/setup-path.md). uprobes on
//! the allocator were tried first and slowed the path 50-fold; a relaxed add to a
//! counter only the allocating thread writes costs a few nanoseconds.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering::Relaxed};

/// Threads beyond this share the last slot (as do allocations during a thread's exit).
const SLOTS: usize = 256;

struct Slot {
    tid: AtomicI32,
    allocs: AtomicU64,
    bytes: AtomicU64,
}

static TABLE: [Slot; SLOTS] = [const {
    Slot {
        tid: AtomicI32::new(0),
        allocs: AtomicU64::new(0),
        bytes: AtomicU64::new(0),
    }
}; SLOTS];
static NEXT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    // Const-initialised and without a destructor, so reading it never allocates.
    static MINE: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn count(size: usize) {
    let i = MINE
        .try_with(|m| {
            if m.get() == usize::MAX {
                let i = NEXT.fetch_add(1, Relaxed).min(SLOTS - 1);
                // SAFETY: gettid has no arguments and cannot fail.
                TABLE[i].tid.store(unsafe { libc::gettid() }, Relaxed);
                m.set(i);
            }
            m.get()
        })
        .unwrap_or(SLOTS - 1);
    TABLE[i].allocs.fetch_add(1, Relaxed);
    TABLE[i].bytes.fetch_add(size as u64, Relaxed);
}

pub struct Counting;

// SAFETY: every call is passed on unchanged to mimalloc, which upholds GlobalAlloc's
// contract; counting touches only atomics and a const thread-local, never the heap.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count(l.size());
        // SAFETY: the caller's layout, passed on.
        unsafe { mimalloc::MiMalloc.alloc(l) }
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        count(l.size());
        // SAFETY: as above.
        unsafe { mimalloc::MiMalloc.alloc_zeroed(l) }
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        count(new);
        // SAFETY: the caller's pointer and layout, passed on.
        unsafe { mimalloc::MiMalloc.realloc(p, l, new) }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: as above.
        unsafe { mimalloc::MiMalloc.dealloc(p, l) }
    }
}

/// Each thread's allocations so far: (thread name, allocations, bytes asked for).
/// Threads that have exited are named by their former id.
pub fn snapshot() -> Vec<lab::bench_setup::ThreadAllocs> {
    let n = NEXT.load(Relaxed).min(SLOTS);
    (0..n)
        .map(|i| {
            let s = &TABLE[i];
            let tid = s.tid.load(Relaxed);
            let name = std::fs::read_to_string(format!("/proc/self/task/{tid}/comm"))
                .map(|c| c.trim().to_string())
                .unwrap_or_else(|_| format!("exited-{tid}"));
            lab::bench_setup::ThreadAllocs {
                slot: i,
                name,
                allocs: s.allocs.load(Relaxed),
                bytes: s.bytes.load(Relaxed),
            }
        })
        .collect()
}
