// What faulting in fresh anonymous memory costs on this machine, per 4 KiB page
// (docs/setup-path.md, "Page faults per flow, and what this VM charges for them"): maps
// N GiB, advises it against huge pages, writes one byte per page, and prints the time
// per page. On a virtual machine whose guest hands freed memory back to the host (free
// page reporting), a fault may have to be served by the host too, and the figure moves
// from run to run with that.
//
//   cc -O2 -o /tmp/first-touch scripts/models/first-touch.c
//   /tmp/first-touch 1
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

int main(int argc, char **argv) {
  if (argc != 2 || atol(argv[1]) <= 0) {
    fprintf(stderr, "usage: %s GiB\n", argv[0]);
    return 2;
  }
  size_t n = (size_t)atol(argv[1]) << 30;
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  char *p = mmap(0, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  madvise(p, n, MADV_NOHUGEPAGE);
  for (size_t i = 0; i < n; i += 4096)
    p[i] = 1;
  clock_gettime(CLOCK_MONOTONIC, &b);
  double s = (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9;
  printf("%s GiB: %.2f s, %.2f us per page\n", argv[1], s, s * 1e6 / (n / 4096));
  munmap(p, n);
  return 0;
}
