//! [`HugeArena`]: the allocator behind the flow table's large arenas.
//!
//! A flow table of a million flows or more is looked up at random over a hundred MiB
//! and more, and with 4 KiB pages nearly every lookup misses the TLB. Advising the
//! arena for transparent huge pages (`MADV_HUGEPAGE`) helps only pages not yet faulted
//! in: memory the global allocator hands back after an earlier table was freed is
//! often already backed by 4 KiB pages, and stays so. `bench pipeline`'s 10M-flow point
//! ran with 36 MiB more of its table on 4 KiB pages after its 1M-flow table had been
//! freed (docs/pp-pipeline.md). So an arena of 4 MiB or more gets a mapping of its
//! own: fresh, aligned to 2 MiB and advised before its first touch, and unmapped when
//! the arena is freed. VPP and DPDK do the same with hugetlbfs pages; transparent huge
//! pages need no reservation by the operator.
//!
//! Why not a crate: this is a dozen lines over `mmap`; the allocator crates on offer
//! (region, memmap2) map files or keep no alignment.

use std::alloc::Layout;
use std::ptr::NonNull;

use allocator_api2::alloc::{AllocError, Allocator, Global};

const HUGE: usize = 2 << 20;
/// Smaller arenas come from the global allocator: they are few pages, and a mapping
/// of their own would round each up to 2 MiB.
const MIN_MAPPED: usize = 4 << 20;

/// Allocates arenas of [`MIN_MAPPED`] bytes or more as their own 2 MiB-aligned
/// anonymous mappings advised for huge pages; smaller ones from [`Global`].
#[derive(Clone, Copy, Debug, Default)]
pub struct HugeArena;

fn mapped_len(layout: Layout) -> usize {
    layout.size().next_multiple_of(HUGE)
}

unsafe impl Allocator for HugeArena {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        if layout.size() < MIN_MAPPED || layout.align() > HUGE {
            return Global.allocate(layout);
        }
        let len = mapped_len(layout);
        // MAP_NORESERVE: a table reserves its capacity up front and touches only what it
        // fills, as the global allocator's reservations did.
        // SAFETY: an anonymous private mapping at an address the kernel picks: it
        // aliases nothing, and a failure is reported as MAP_FAILED.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len + HUGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(AllocError);
        }
        let raw = raw as usize;
        let start = raw.next_multiple_of(HUGE);
        let (head, tail) = (start - raw, raw + len + HUGE - (start + len));
        // SAFETY: the head and tail cut off are parts of the mapping just made, outside
        // the aligned `len` bytes handed out; nothing refers to them.
        unsafe {
            if head > 0 {
                libc::munmap(raw as *mut libc::c_void, head);
            }
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
            // A hint on pages of our own mapping, before any is touched; harmless if
            // refused (THP off).
            libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        let ptr = NonNull::new(start as *mut u8).ok_or(AllocError)?;
        Ok(NonNull::slice_from_raw_parts(ptr, len))
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        if layout.size() < MIN_MAPPED || layout.align() > HUGE {
            // SAFETY: allocated by `Global` with this layout (see `allocate`).
            unsafe { Global.deallocate(ptr, layout) };
            return;
        }
        // SAFETY: `allocate` mapped exactly `mapped_len(layout)` bytes at `ptr` for this
        // layout (a container's later layout for the same block is no larger than the
        // length handed out, so it rounds to the same length), and the caller
        // gives the block back once.
        unsafe {
            libc::munmap(ptr.as_ptr().cast(), mapped_len(layout));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use allocator_api2::vec::Vec;

    #[test]
    fn a_large_arena_is_its_own_aligned_mapping_and_a_small_one_is_not() {
        let mut big: Vec<u64, HugeArena> = Vec::with_capacity_in(1 << 20, HugeArena);
        assert_eq!(
            big.as_ptr() as usize % HUGE,
            0,
            "8 MiB arena on a 2 MiB boundary"
        );
        big.resize(1 << 20, 7);
        assert!(big.iter().all(|v| *v == 7));
        let mut small: Vec<u64, HugeArena> = Vec::with_capacity_in(16, HugeArena);
        small.push(1);
        assert_eq!(small[0], 1);
        // Growing past the capacity moves the contents into a new mapping.
        big.push(8);
        assert_eq!((big.len(), big[0], big[1 << 20]), ((1 << 20) + 1, 7, 8));
        assert_eq!(big.as_ptr() as usize % HUGE, 0);
    }
}
