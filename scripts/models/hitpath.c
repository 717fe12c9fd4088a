// A C model of the PP hit path's memory pattern (docs/pp-pipeline.md, "The flow table"):
// per 64-packet batch, pass 1 does some work per packet and prefetches a random bucket
// line, pass 2 reads it, takes an entry index from it and prefetches that entry line,
// pass 3 reads and writes the entry. Arrays are sized as the pipeline's for the given
// flow count (buckets rounded up to a power of two, 64-byte entries) and advised for
// transparent huge pages. It tells what the memory pattern alone costs per packet as
// the table grows, apart from everything else the pipeline does.
//
//   cc -O2 -o /tmp/hitpath scripts/models/hitpath.c
//   for f in 1000 1000000 10000000; do /tmp/hitpath $f 12 2 20 100000; done
//
// Arguments: flows, work units in pass 1, 2 and 3 (about 1 ns each here), batches.
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static uint64_t rng = 0x2545f4914f6cdd1dULL;
static inline uint64_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

// A dependent multiply chain: work that occupies the core but touches no memory.
static inline uint64_t work(uint64_t acc, int n) {
    for (int k = 0; k < n; k++) {
        acc = acc * 0x9E3779B97F4A7C15ULL + (uint64_t)k;
        __asm__ volatile("" ::"r"(acc));
    }
    return acc;
}

static void *arena(size_t bytes) {
    void *p = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(1);
    }
    madvise(p, bytes, MADV_HUGEPAGE);
    return p;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s FLOWS WORK1 WORK2 WORK3 BATCHES\n", argv[0]);
        return 2;
    }
    size_t flows = strtoull(argv[1], 0, 10);
    int w1 = atoi(argv[2]), w2 = atoi(argv[3]), w3 = atoi(argv[4]);
    long batches = atol(argv[5]);
    if (flows == 0 || batches <= 0) {
        fprintf(stderr, "FLOWS and BATCHES must be > 0\n");
        return 2;
    }
    // As FlowTable::new: capacity × 5/4 slots in 8-way buckets, rounded up.
    size_t nb = 1;
    while (nb * 8 < flows + flows / 4) nb <<= 1;
    uint32_t *buckets = arena(nb * 64);
    uint64_t *entries = arena(flows * 64);
    for (size_t b = 0; b < nb; b++)
        for (int w = 0; w < 16; w++) buckets[b * 16 + w] = (uint32_t)((b * 2654435761u + w) % flows);
    for (size_t e = 0; e < flows; e++) entries[e * 8] = e;

    uint64_t bi[64], ei[64], acc = 1;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long it = 0; it < batches; it++) {
        for (int i = 0; i < 64; i++) {
            bi[i] = (uint64_t)(((unsigned __int128)next() * nb) >> 64);
            acc = work(acc, w1);
            __builtin_prefetch(&buckets[bi[i] * 16]);
        }
        for (int i = 0; i < 64; i++) {
            uint32_t *bk = &buckets[bi[i] * 16];
            ei[i] = bk[(acc & 7) + 8];
            acc = work(acc + bk[0], w2);
            __builtin_prefetch(&entries[ei[i] * 8]);
        }
        for (int i = 0; i < 64; i++) {
            uint64_t *e = &entries[ei[i] * 8];
            acc = work(acc + e[0], w3);
            e[1] = acc;
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ns = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
    printf("flows %zu (buckets %zu MiB, entries %zu MiB) work %d/%d/%d: %.2f ns/packet (%llu)\n",
           flows, (nb * 64) >> 20, (flows * 64) >> 20, w1, w2, w3, ns / (batches * 64.0),
           (unsigned long long)(acc & 1));
    return 0;
}
