// A packet generator for BPF_PROG_TEST_RUN's live-frames mode (the mechanism of
// xdp-tools' xdp-trafficgen): the kernel runs this program on copies of one template
// frame in a loop, in batches, and sends each frame it returns XDP_TX for out of the
// device named as the frame's ingress (through that device's ndo_xdp_xmit; on a veth,
// straight into the peer's receive ring). It is the sender of `bench e2e`'s per-core
// packet-rate measurement: trafgen's AF_PACKET sends give up (EAGAIN) as soon as a
// receiver on another CPU falls behind, and no pktgen module is built on this kernel.
//
// The template is a VXLAN frame as `testbed::measure::udp64_frame` builds it (IPv4
// without options outside and inside, UDP checksums 0). Per frame the program picks one
// of `flows` flows at random and writes its outer UDP source port (0xc000 + i, the
// flow's hash as a VXLAN sender sets it) and inner UDP source port (10000 + i); no
// checksum covers either.
//
// The program writes the whole template into every frame, not just the ports: the
// kernel fills a live-frames page once, and a page comes back to the generator's pool
// after the receiver is done with it. A receiver that rewrote the frame in place (the
// XDP fast path's NAT and re-encapsulation, the kernel's VXLAN decap) would otherwise
// have its output sent again.
#include <linux/bpf.h>

#define SEC(n) __attribute__((section(n), used))
#define __uint(name, val) int(*name)[val]
#define __type(name, val) typeof(val) *name
#define FRAME_LEN 110

static __u32 (*bpf_get_prandom_u32)(void) = (void *)BPF_FUNC_get_prandom_u32;
static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)BPF_FUNC_map_lookup_elem;

// Set by the loader (aya's EbpfLoader::override_global).
volatile const __u32 flows = 1;
// Nanoseconds between frames sent; 0: as fast as the CPU goes. A frame whose time has
// not come is dropped here (cheaply, on the sender's CPU), so the offered rate is paced
// frame by frame instead of in bursts that a 256-entry veth ring could not take.
volatile const __u64 interval_ns = 0;
// When the next frame may go (one generator runs on one CPU: no other writer).
__u64 next_ns = 0;
static __u64 (*bpf_ktime_get_ns)(void) = (void *)BPF_FUNC_ktime_get_ns;

struct frame {
	unsigned char b[FRAME_LEN];
};

// One entry: the template frame, written by userspace before the run.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct frame);
} gen_template SEC(".maps");

#define OUTER_SPORT 34 // Ethernet 14 + IPv4 20
#define INNER_SPORT 84 // + UDP 8 + VXLAN 8 + Ethernet 14 + IPv4 20

SEC("xdp") int xdp_gen(struct xdp_md *ctx)
{
	unsigned char *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
	if (interval_ns) {
		__u64 now = bpf_ktime_get_ns();
		if (now < next_ns)
			return XDP_DROP;
		__u64 n = next_ns + interval_ns;
		// Behind (the first frame, the gap between two test runs, a preemption):
		// catch up by at most one batch of 64, which the peer's 256-entry ring can
		// take, rather than in one burst.
		__u64 floor = now - 64 * interval_ns;
		next_ns = n < floor ? floor : n;
	}
	__u32 zero = 0;
	struct frame *t = bpf_map_lookup_elem(&gen_template, &zero);
	if (!t || data + FRAME_LEN > end)
		return XDP_ABORTED;
	__builtin_memcpy(data, t->b, FRAME_LEN);
	__u32 n = flows ? flows : 1;
	__u32 i = bpf_get_prandom_u32() % n;
	__u16 outer = 0xc000 + i, inner = 10000 + i;
	data[OUTER_SPORT] = outer >> 8;
	data[OUTER_SPORT + 1] = outer & 0xff;
	data[INNER_SPORT] = inner >> 8;
	data[INNER_SPORT + 1] = inner & 0xff;
	return XDP_TX;
}

char _license[] SEC("license") = "GPL";
