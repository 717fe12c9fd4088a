//! [`IndexAlloc`]: the allocator of [`crate::slabmap::SlabMap`]'s index tables, which
//! can hand a new table a block faulted in ahead of time.
//!
//! A per-flow map's index grows to four times its size in one allocation, and the
//! inserts that follow touch its pages at random: within the first few thousand, nearly
//! every page of it. Every per-flow map of a chain's three replicas grows on about the
//! same flow, so in `bench setup --seconds 5` (about 430k flows in) page faults took
//! 301 of the replica workers' 489 samples in the 200 ms after the growth, and the
//! chain fell to a tenth of its rate (docs/setup-path.md).
//! The map knows the next table's size long before it needs it, so it fills a block of
//! that size with zeros a few hundred bytes per insert once its index is 3/4 full
//! ([`crate::slabmap::SlabMap`]'s `prepare`), and the growth's table is made in it.
//!
//! Why an allocator: hashbrown allocates its own table and exposes no way to pass it
//! memory; its allocator parameter is the one door. Why not huge pages instead: a 2 MiB
//! page is zeroed on first touch too, and a table's few huge pages are all touched
//! within its first few inserts, so the stall came back at once (tried: 170 ms of
//! `clear_page_erms` on one replica).

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Mutex;

use allocator_api2::alloc::{AllocError, Allocator, Global};

/// Handed-out memory of a block made ahead: address and length in `u128`s.
type Block = (usize, usize);

/// The index tables' allocator: the global allocator, except that the one table made
/// with [`IndexAlloc::with_ready`] gets that block if it fits.
#[derive(Default)]
pub(crate) struct IndexAlloc {
    blocks: Mutex<Blocks>,
}

#[derive(Default)]
struct Blocks {
    /// A block made ahead (zeroed, so every page of it is faulted in), for the next
    /// table this allocator allocates.
    ready: Option<Box<[u128]>>,
    /// The block `ready` gave out, freed as the `Box` it was and not by `Global`.
    given: Option<Block>,
}

impl Clone for IndexAlloc {
    /// A table's copy gets its own memory from the global allocator.
    fn clone(&self) -> Self {
        IndexAlloc::default()
    }
}

impl IndexAlloc {
    pub(crate) fn with_ready(block: Box<[u128]>) -> Self {
        IndexAlloc {
            blocks: Mutex::new(Blocks {
                ready: Some(block),
                given: None,
            }),
        }
    }

    /// Drops a ready block no table took (it did not fit).
    pub(crate) fn drop_unused(&self) {
        lock(&self.blocks).ready.take();
    }

    /// Whether a table lives in a block made ahead.
    #[cfg(test)]
    pub(crate) fn gave_ready_block(&self) -> bool {
        lock(&self.blocks).given.is_some()
    }
}

/// The lock's data: a panic while it was held cannot have left it half-changed (every
/// critical section is an `Option` swap or two).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// SAFETY: every block handed out is either the global allocator's, given back to it
// with the layout it was allocated with, or a leaked `Box<[u128]>` from `ready`,
// recorded in `given` and rebuilt into that same `Box` to free it. A ready block is
// used only for a layout it covers (its size is at least the layout's, its alignment of
// 16 at least the layout's), and is handed out once.
unsafe impl Allocator for IndexAlloc {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        let mut blocks = lock(&self.blocks);
        let fits = blocks.ready.as_ref().is_some_and(|b| {
            let bytes = std::mem::size_of_val::<[u128]>(b);
            // A block more than twice the size asked for is not worth its memory.
            layout.align() <= std::mem::align_of::<u128>()
                && bytes >= layout.size()
                && bytes <= 2 * layout.size()
        });
        // A block that does not fit is dropped here: nothing else will take it.
        let Some(block) = blocks.ready.take().filter(|_| fits) else {
            return Global.allocate(layout);
        };
        let len = block.len();
        let ptr = NonNull::from(Box::leak(block)).cast::<u8>();
        blocks.given = Some((ptr.as_ptr() as usize, len));
        Ok(NonNull::slice_from_raw_parts(ptr, len * 16))
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        let mut blocks = lock(&self.blocks);
        if let Some((at, len)) = blocks.given {
            if at == ptr.as_ptr() as usize {
                blocks.given = None;
                let slice = std::ptr::slice_from_raw_parts_mut(ptr.as_ptr().cast::<u128>(), len);
                // SAFETY: this is the block `allocate` leaked from its `Box<[u128]>` of
                // `len` elements, handed back once by the table that was using it.
                drop(unsafe { Box::from_raw(slice) });
                return;
            }
        }
        drop(blocks);
        // SAFETY: any other block came from `Global` with this layout (see `allocate`).
        unsafe { Global.deallocate(ptr, layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ready_block_serves_a_layout_it_covers_once_and_is_freed_as_a_box() {
        let a = IndexAlloc::with_ready(vec![7u128; 1024].into_boxed_slice());
        let layout = Layout::from_size_align(16 * 1000, 16).expect("layout");
        let first = a.allocate(layout).expect("allocate");
        assert!(a.gave_ready_block());
        assert_eq!(first.len(), 16 * 1024);
        let second = a.allocate(layout).expect("allocate");
        assert_ne!(first.cast::<u8>(), second.cast::<u8>());
        // SAFETY: both blocks were allocated above with this layout and are unused.
        unsafe {
            a.deallocate(second.cast(), layout);
            a.deallocate(first.cast(), layout);
        }
        assert!(!a.gave_ready_block());
    }

    #[test]
    fn a_block_too_small_or_far_too_big_is_not_used() {
        for (block, want) in [(100usize, 16 * 101), (1000, 16 * 400)] {
            let a = IndexAlloc::with_ready(vec![0u128; block].into_boxed_slice());
            let layout = Layout::from_size_align(want, 16).expect("layout");
            let b = a.allocate(layout).expect("allocate");
            assert!(!a.gave_ready_block(), "{block} u128s for {want} bytes");
            // SAFETY: allocated above with this layout.
            unsafe { a.deallocate(b.cast(), layout) };
            a.drop_unused();
        }
    }
}
