// The receiving end of the per-core packet-rate measurement (`bench e2e`'s
// `udp64_core_pps`): attached to the router's end of the PP node's link, it drops the
// VXLAN frames that carry the benchmark's inner UDP datagrams (to the sink port, 9) and
// passes everything else, like xdp_pass.c (ARP, control traffic, other VXLAN). The
// count is the veth's own `rx_queue_0_xdp_drops`, so the sink needs no map, and a
// dropped frame costs the receiving CPU one short parse instead of a trip through the
// router, a VXLAN gateway and a host: what is measured is the NF, not the path after it.
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>

#define SEC(n) __attribute__((section(n), used))
#define VXLAN_PORT 4789
#define SINK_PORT 9

struct vxlanhdr {
	__u32 flags;
	__u32 vni;
};

static __always_inline struct udphdr *ipv4_udp(void *p, void *end)
{
	struct ethhdr *eth = p;
	if ((void *)(eth + 1) > end || eth->h_proto != __builtin_bswap16(ETH_P_IP))
		return 0;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > end || ip->ihl != 5 || ip->protocol != IPPROTO_UDP)
		return 0;
	struct udphdr *udp = (void *)(ip + 1);
	if ((void *)(udp + 1) > end)
		return 0;
	return udp;
}

SEC("xdp") int xdp_sink(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
	struct udphdr *outer = ipv4_udp(data, end);
	if (!outer || outer->dest != __builtin_bswap16(VXLAN_PORT))
		return XDP_PASS;
	struct udphdr *inner = ipv4_udp((void *)(outer + 1) + sizeof(struct vxlanhdr), end);
	if (!inner || inner->dest != __builtin_bswap16(SINK_PORT))
		return XDP_PASS;
	return XDP_DROP;
}

char _license[] SEC("license") = "GPL";
