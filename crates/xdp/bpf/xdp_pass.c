// XDP_PASS for every frame. Attached to the far side of a veth whose near side runs
// pp_xdp: XDP_TX on a veth hands frames to the peer's XDP receive ring, which the kernel
// only drains when the peer has an XDP program of its own (GRO alone gives it a ring
// that is never polled: after 256 frames every XDP_TX fails).
#include <linux/bpf.h>

#define SEC(n) __attribute__((section(n), used))

SEC("xdp") int xdp_pass(struct xdp_md *ctx)
{
	return XDP_PASS;
}

char _license[] SEC("license") = "GPL";
